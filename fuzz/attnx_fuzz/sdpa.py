"""scaled_dot_product_attention: query, key and value of 2 to 5 dimensions (GQA too), float16
or bfloat16 keys and values, masks of every kind (bool, additive, block patterns, per head),
the causal modes, windows, scales, ``precision=``, relaid-out arguments; then mutated (any
argument malformed, ``out=`` of every kind), given torch's habits (tensors that require grad,
tensor subclasses, a ``CausalBias`` of the call's lengths). A result must match
``attnx.reference.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math

import numpy as np

import attnx
from attnx import reference

from .common import (
    F32, F64, HALVES, OUTCOMES, CausalBias, Disallowed, Provider, as_f64, bf16_tolerance, block_pattern, call,
    check_garbage_refused, check_untouched, compare, draw_precision, logits_moderate, mutate, plain,
    reference_of, relayout, safe_shape, snapshot, torch_habits, values,
)


def fuzz_sdpa(p: Provider):
    dtype = p.choice([F32, F64])
    lead = tuple(p.int(1, 3) for _ in range(p.int(0, 2)))
    Hk = p.int(1, 3)
    group = p.int(1, 3) if p.bool() else 1
    # (130 queries: four query tiles or more, whose values may be read from an aligned copy)
    L, S = p.choice([0, 1, 2, 5, 17, 33, 70, 130]), p.choice([0, 1, 3, 16, 129, 530])
    E, Ev = p.choice([1, 3, 8, 16, 33]), p.choice([1, 4, 8, 17])
    rank = p.int(2, 2 + len(lead) + 1) if group == 1 else 3 + len(lead)
    batch = (lead + (Hk * group,))[len(lead) + 1 - (rank - 2):] if rank > 2 else ()
    kbatch = batch[:-1] + (Hk,) if group > 1 else batch
    args = {
        "query": values(p, batch + (L, E), dtype),
        "key": values(p, kbatch + (S, E), p.choice([dtype, dtype, F32, F64] + HALVES)),
        "value": values(p, kbatch + (S, Ev), p.choice([dtype, dtype, dtype] + HALVES)),
        "attn_mask": None, "is_causal": False, "scale": None, "enable_gqa": group > 1,
    }
    mask_kind = p.int(0, 4)
    if mask_kind == 4:
        pattern = block_pattern(p, (batch[-1:] if p.bool() else ()) + (L, S))
        added = p.choice([0.0, 0.0, 0.5, np.nan, np.inf])
        args["attn_mask"] = pattern if p.bool() else np.where(pattern, added, -np.inf).astype(dtype)
    elif mask_kind == 1:
        args["attn_mask"] = np.random.default_rng(p.seed()).random(batch[-1:] + (L, S)) < 0.7
    elif mask_kind == 2:
        m = values(p, (L, S), dtype)
        m[np.random.default_rng(p.seed()).random((L, S)) < 0.3] = -np.inf
        args["attn_mask"] = m
    elif mask_kind == 3:
        args["is_causal"] = p.choice([True, "top_left", "bottom_right"])
    if p.bool(0.3):
        args["window"] = (p.choice([None, 0, 1, 5, 200]), p.choice([None, 0, 2, 40]))
    if p.bool(0.3):
        args["scale"] = p.choice([0.0, 0.1, -0.5, 2.0, np.float32(0.25)])
    args["precision"], invalid = draw_precision(p, dtype)
    for name in ("query", "key", "value", "attn_mask"):
        if args[name] is not None and p.bool(0.2):
            args[name] = relayout(p, args[name])
    n_mut = p.choice([0, 0, 1, 1, 1, 2, 3])
    touched = mutate(p, args, ["query", "key", "value", "attn_mask", "is_causal", "scale", "enable_gqa", "out"],
                     n_mut)
    for name in touched:
        if name in ("is_causal", "enable_gqa"):
            args[name] = p.choice([True, False, 1, 0, None, "yes", np.bool_(True), np.array([True, False])])
        elif name == "scale":
            args[name] = p.choice([None, float("nan"), float("inf"), -0.0, "1", 1e300, 1j, np.float64(0.5), [1.0]])
        elif name == "out":
            shape = safe_shape(args["query"])[:-1] + safe_shape(args["value"])[-1:] if p.bool() else (2, 3)
            options = [lambda: np.empty(shape, dtype), lambda: np.empty(shape, F64 if dtype == F32 else F32),
                       lambda: np.empty(shape, dtype).T, lambda: args["query"],
                       lambda: np.zeros(shape, dtype)[::-1], lambda: "out", lambda: None,
                       lambda: np.broadcast_to(np.zeros((), dtype), shape)]
            try:
                args["out"] = p.choice(options)()
            except (ValueError, TypeError, IndexError):
                args["out"] = np.empty((1,), dtype)
    garbage = torch_habits(p, args, ["query", "key", "value", "attn_mask"])
    bias = None
    if args["attn_mask"] is None and p.bool(0.1):  # torch's CausalBias, of the call's lengths
        bias = args["attn_mask"] = CausalBias(p.choice(["UPPER_LEFT", "LOWER_RIGHT"]), L, S)
        n_mut += 1  # (read as is_causal, or refused: either is allowed)
    kwargs = {k: v for k, v in args.items() if k not in ("query", "key", "value")}
    inputs = [plain(args["query"]), plain(args["key"]), plain(args["value"]),
              None if bias is not None else plain(args["attn_mask"])]
    snap = snapshot(inputs)
    ok, got = call("sdpa", lambda: attnx.scaled_dot_product_attention(args["query"], args["key"], args["value"], **kwargs))
    check_untouched(snap, "sdpa", allowed=[args.get("out")])
    check_garbage_refused(ok, garbage, n_mut, "sdpa")
    n_mut += len(garbage)
    if bias is not None:
        OUTCOMES[f"sdpa: CausalBias {'read' if ok else 'refused'}"] += 1
    n_mut += invalid
    if not ok:
        if n_mut == 0:
            raise Disallowed("sdpa: a valid call raised")
        return
    if args.get("out") is not None and got is not args["out"]:
        raise Disallowed("sdpa: out= given but another array returned")
    for x in inputs:
        if isinstance(x, np.ndarray) and x is not args.get("out") and np.shares_memory(got, x):
            raise Disallowed("sdpa: the result shares memory with an input")
    ref_kwargs = {k: plain(v) for k, v in kwargs.items() if k != "out"}
    if bias is not None:  # the causal mode it stands for (read only where is_causal is False)
        ref_kwargs["attn_mask"], ref_kwargs["is_causal"] = None, bias.causal_mode()
    # bfloat16 precision: the reference of the same rounding, on the values attnx computes with.
    bf16 = ref_kwargs.get("precision") == "bfloat16"
    convert = (lambda x: x) if bf16 else as_f64
    expected = reference_of(lambda: reference.scaled_dot_product_attention(
        *(convert(plain(x)) for x in (args["query"], args["key"], args["value"])), **ref_kwargs))
    if expected is None:
        raise Disallowed("sdpa: attnx computed a result for a call the reference rejects")
    scale = args["scale"]
    scale_arr = [np.asarray(float(scale))] if isinstance(scale, (int, float, np.floating)) else []
    q = np.asarray(plain(args["query"]))
    eff_scale = 1 / math.sqrt(q.shape[-1]) if args["scale"] is None and q.shape[-1] else (scale_arr or [1.0])[0]
    moderate = logits_moderate(q, np.asarray(plain(args["key"])), eff_scale) if q.ndim >= 2 else True
    tolerance = bf16_tolerance([np.asarray(plain(args["value"]))]) if bf16 else None
    compare(got, expected, q.dtype.newbyteorder("="), "sdpa", inputs + scale_arr, moderate, tolerance)
