"""multi_head_attention_forward (torch's functional form): batched, batch-first or unbatched
sequences; packed or separate projection weights, other key and value widths; ``bias_k`` /
``bias_v``, ``static_k`` / ``static_v``, ``add_zero_attn``; key padding and attention masks
(bool or additive, block patterns); the weights averaged or per head; ``precision=``; then
mutated (an array malformed, a scalar argument replaced by junk). The output and the weights
must match ``attnx.reference.multi_head_attention_forward``.
"""

from __future__ import annotations

import math

import numpy as np

import attnx
from attnx import reference

from .common import (
    F32, F64, SCALAR_JUNK, Disallowed, Provider, as_f64, bf16_tolerance, block_pattern, call,
    check_garbage_refused, check_untouched, compare, draw_precision, input_arrays, malformed, plain,
    reference_of, relayout, snapshot, torch_habits, values,
)


def mha_valid(p: Provider):
    dtype = p.choice([F32, F64])
    H = p.int(1, 3)
    E = H * p.choice([1, 2, 4])
    kdim, vdim = p.choice([E, E, 3]), p.choice([E, E, 5])
    separate = kdim != E or vdim != E or p.bool()
    N, L, S = p.int(0, 3), p.choice([0, 1, 4, 9]), p.choice([0, 1, 5, 12])
    unbatched, batch_first = p.bool(0.2), p.bool()
    static = None if not p.bool(0.2) else "kv"

    def seq(length, dim):
        shape = (length, dim) if unbatched else ((N, length, dim) if batch_first else (length, N, dim))
        return values(p, shape, dtype)

    n = 1 if unbatched else N
    a = dict(query=seq(L, E), key=seq(S, kdim), value=seq(S, vdim), embed_dim_to_check=E, num_heads=H,
             in_proj_weight=None if separate else values(p, (3 * E, E), dtype) / math.sqrt(E),
             in_proj_bias=values(p, (3 * E,), dtype) if p.bool() else None,
             bias_k=None, bias_v=None, add_zero_attn=p.bool(0.3), dropout_p=0.0,
             out_proj_weight=values(p, (E, E), dtype) / math.sqrt(E),
             out_proj_bias=values(p, (E,), dtype) if p.bool() else None,
             training=p.bool(), key_padding_mask=None, need_weights=p.bool(), attn_mask=None,
             use_separate_proj_weight=separate,
             q_proj_weight=values(p, (E, E), dtype) / math.sqrt(E) if separate else None,
             k_proj_weight=values(p, (E, kdim), dtype) / math.sqrt(kdim) if separate else None,
             v_proj_weight=values(p, (E, vdim), dtype) / math.sqrt(vdim) if separate else None,
             static_k=None, static_v=None, average_attn_weights=p.bool(), is_causal=p.bool(0.3),
             batch_first=batch_first)
    S_src = S
    if static:
        S_src = p.choice([0, 2, 6])
        a["static_k"] = values(p, (n * H, S_src, E // H), dtype)
        a["static_v"] = values(p, (n * H, S_src, E // H), dtype)
    elif p.bool(0.3):
        a["bias_k"], a["bias_v"] = values(p, (1, 1, E), dtype), values(p, (1, 1, E), dtype)
    if p.bool(0.4):
        kpm = np.random.default_rng(p.seed()).random((S_src,) if unbatched else (n, S_src)) < 0.3
        a["key_padding_mask"] = kpm if p.bool() else np.where(kpm, -np.inf, 0.0).astype(dtype)
    if p.bool(0.4):
        shape = (L, S_src) if p.bool() else (n * H, L, S_src)
        am = np.random.default_rng(p.seed()).random(shape) < 0.3
        if p.bool():
            am = ~block_pattern(p, shape)
        a["attn_mask"] = am if p.bool() else np.where(am, -np.inf, p.choice([0.0, 0.5])).astype(dtype)
    return a


MHA_ARRAYS = ["query", "key", "value", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
              "out_proj_weight", "out_proj_bias", "key_padding_mask", "attn_mask", "q_proj_weight",
              "k_proj_weight", "v_proj_weight", "static_k", "static_v"]
MHA_SCALARS = ["embed_dim_to_check", "num_heads", "add_zero_attn", "dropout_p", "training",
               "need_weights", "use_separate_proj_weight", "average_attn_weights", "is_causal", "batch_first"]


def fuzz_mha(p: Provider):
    a = mha_valid(p)
    a["precision"], invalid = draw_precision(p, a["query"].dtype)
    for name in MHA_ARRAYS:
        if isinstance(a[name], np.ndarray) and p.bool(0.15):
            a[name] = relayout(p, a[name])
    n_mut = p.choice([0, 0, 1, 1, 1, 2, 3])
    for _ in range(n_mut):
        if p.bool(0.7):
            name = p.choice(MHA_ARRAYS)
            a[name] = malformed(p, a[name])
        else:
            a[p.choice(MHA_SCALARS)] = p.choice(SCALAR_JUNK)
    garbage = torch_habits(p, a, MHA_ARRAYS)
    inputs = [plain(a[n]) for n in MHA_ARRAYS]
    snap = snapshot(inputs)
    ok, got = call("mha", lambda: attnx.multi_head_attention_forward(**a))
    check_untouched(snap, "mha")
    # The projections the call does not use are never read (as in torch): garbage there is no
    # computation on garbage.
    try:
        separate = bool(a["use_separate_proj_weight"])
    except (TypeError, ValueError):
        separate = None
    unused = {True: ("in_proj_weight",), False: ("q_proj_weight", "k_proj_weight", "v_proj_weight")}.get(separate, ())
    garbage = [name for name in garbage if name not in unused]
    check_garbage_refused(ok, garbage, n_mut + invalid, "mha")
    n_mut += len(garbage) + invalid
    if not ok:
        if n_mut == 0:
            raise Disallowed("mha: a valid call raised")
        return
    out, weights = got
    for r in (out, weights):
        for x in inputs:
            if r is not None and isinstance(x, np.ndarray) and np.shares_memory(r, x):
                raise Disallowed("mha: a result shares memory with an input")
    bf16 = a["precision"] == "bfloat16"
    conv = {k: plain(v) if bf16 else as_f64(plain(v)) for k, v in a.items()}
    expected = reference_of(lambda: reference.multi_head_attention_forward(**conv))
    if expected is None:
        raise Disallowed("mha: attnx computed a result for a call the reference rejects")
    dtype = np.asarray(plain(a["query"])).dtype.newbyteorder("=")
    tolerance = bf16_tolerance(input_arrays(inputs)) if bf16 else None
    compare(out, expected[0], dtype, "mha output", inputs, tolerance=tolerance)
    compare(weights, expected[1], dtype, "mha weights", inputs, tolerance=bf16_tolerance([]) if bf16 else None)
