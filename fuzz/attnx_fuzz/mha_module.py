"""MultiheadAttention: construction (perhaps with a malformed argument), ``load_state_dict`` of
another module's state (perhaps mangled: a key missing or extra, a malformed value, tensors,
lists, no dict at all; a call that raises must leave the module as it was), then a forward call
(masks, flags, the module's or the call's ``precision``), perhaps mutated. Dropout in training
mode must be refused; a result must match the reference over the module's parameters, which
the call leaves unchanged.
"""

from __future__ import annotations

import numpy as np

import attnx
from attnx import reference

from .common import (
    F32, F64, LAST_ERROR, OUTCOMES, SCALAR_JUNK, Disallowed, FakeTensor, Provider, bf16_tolerance, call,
    check_garbage_refused, check_untouched, compare, draw_precision, input_arrays, is_float, malformed, plain,
    reference_of, snapshot, torch_habits, values,
)


def fuzz_module(p: Provider):
    E = p.choice([1, 2, 4, 6, 8])
    kw = dict(embed_dim=E, num_heads=p.choice([1, 2]), bias=p.bool(), add_bias_kv=p.bool(0.3),
              add_zero_attn=p.bool(0.3), kdim=p.choice([None, None, 3]), vdim=p.choice([None, None, 5]),
              batch_first=p.bool(), dtype=p.choice([np.float32, np.float64, "float32", "f8", None]),
              dropout=p.choice([0.0, 0.0, 0.0, 0.1]), device=p.choice([None, None, "cpu"]), seed=p.int(0, 1000))
    huge = False
    if p.bool(0.25):  # malformed constructor arguments
        name = p.choice(list(kw))
        # 2**40 as a size is refused at allocation everywhere. (2**20 as embed_dim asked for
        # 24 TiB, which a system that overcommits memory without limit may grant, and the
        # weights' initialisation then fills until the process is killed.)
        junk = [None, 0, -3, 1.5, "8", True, np.int32(4), 2**40, 2**62, np.float16, np.int32, object,
                "float16", np.random.default_rng(0), -1, [1], "cuda", 1.5, float("nan")]
        kw[name] = p.choice(junk)
        huge = name in ("embed_dim", "kdim", "vdim")
    ok, m = call("MultiheadAttention()", lambda: attnx.MultiheadAttention(**kw), huge=huge)
    if not ok:
        return
    if p.bool():
        m.eval()
    # torch's rule: dropout applies in training mode, where attnx must refuse the call.
    dropout_applies = m.training and m.dropout > 0
    dtype = m.dtype
    # load_state_dict: a state_dict of another module, perhaps mangled.
    sd = attnx.MultiheadAttention(
        m.embed_dim, m.num_heads, bias=m.bias, add_bias_kv=m.add_bias_kv, kdim=m.kdim, vdim=m.vdim,
        dtype=np.float64, seed=p.int(0, 99)).state_dict()
    mangle = p.int(0, 9)
    if mangle == 1:
        sd.pop(p.choice(sorted(sd)))
    elif mangle == 2:
        sd["extra"] = np.zeros(3)
    elif mangle == 3:
        k = p.choice(sorted(sd))
        sd[k] = malformed(p, sd[k])
    elif mangle == 4:
        sd = {k: FakeTensor(v, fail=p.bool(0.3)) for k, v in sd.items()}
    elif mangle == 5:
        sd = {k: v.tolist() for k, v in sd.items()}
    elif mangle == 6:
        sd = p.choice([None, [], "state", 3, {1: 2}])
    strict = p.choice([True, True, False, "yes", None])
    before = {k: v.copy() for k, v in m.state_dict().items()}
    ok, res = call("load_state_dict", lambda: m.load_state_dict(sd, strict=strict))
    after = m.state_dict()
    if not ok:  # nothing loaded
        for k in before:
            if not np.array_equal(before[k], after[k], equal_nan=True):
                raise Disallowed("load_state_dict: raised but changed the module")
    elif mangle == 0:
        for k, v in sd.items():
            np.testing.assert_array_equal(after[k], np.asarray(v).astype(dtype), err_msg=k)
    # forward
    N, L, S = p.int(0, 2), p.choice([0, 1, 3, 7]), p.choice([0, 1, 4, 9])
    def seq(length, dim):
        return values(p, (N, length, dim) if m.batch_first else (length, N, dim), p.choice([dtype, F32, F64]))
    q, k, v = seq(L, m.embed_dim), seq(S, m.kdim), seq(S, m.vdim)
    opts = {}
    if p.bool(0.3):
        opts["key_padding_mask"] = np.random.default_rng(p.seed()).random((N, S)) < 0.3
    if p.bool(0.3):
        opts["attn_mask"] = np.random.default_rng(p.seed()).random((L, S)) < 0.3
    for name in ("need_weights", "average_attn_weights", "is_causal"):
        if p.bool(0.3):
            opts[name] = p.choice([True, False])
    # The module's precision (constructor or attribute) or the call's.
    precision, invalid = draw_precision(p, dtype)
    if p.bool() or invalid:
        opts["precision"] = precision
    elif precision is not None:
        m.precision = precision
    precision = opts.get("precision") or m.precision
    args = {"query": q, "key": k, "value": v}
    n_mut = p.choice([0, 0, 1, 2]) + invalid
    for _ in range(n_mut):
        name = p.choice(["query", "key", "value", "key_padding_mask", "attn_mask", "need_weights"])
        if name == "need_weights":
            opts[name] = p.choice(SCALAR_JUNK)
        elif name in args:
            args[name] = malformed(p, args[name])
        else:
            opts[name] = malformed(p, opts.get(name))
    garbage = torch_habits(p, args, ["query", "key", "value"])
    garbage += torch_habits(p, opts, ["key_padding_mask", "attn_mask"])
    inputs = [plain(x) for x in (args["query"], args["key"], args["value"], opts.get("key_padding_mask"),
                                 opts.get("attn_mask"))]
    snap = snapshot(inputs)
    params = m.state_dict()
    ok, got = call("MultiheadAttention.forward", lambda: m(args["query"], args["key"], args["value"], **opts))
    check_untouched(snap, "MultiheadAttention.forward")
    for key, value in m.state_dict().items():
        if not np.array_equal(value, params[key], equal_nan=True):
            raise Disallowed("MultiheadAttention.forward changed a parameter")
    check_garbage_refused(ok, garbage, n_mut + dropout_applies, "MultiheadAttention.forward")
    n_mut += len(garbage)
    if dropout_applies:
        if ok:
            raise Disallowed("MultiheadAttention.forward: computed in training mode with dropout > 0")
        OUTCOMES[f"MultiheadAttention.forward: dropout in training mode, {LAST_ERROR[0].__name__}"] += 1
        return
    if not ok:
        if n_mut == 0:
            raise Disallowed("MultiheadAttention.forward: a valid call raised")
        return
    out, weights = got
    cast = lambda x: np.asarray(x).astype(np.float64) if np.asarray(x).dtype.kind == "f" else x  # noqa: E731
    args = {k: plain(v) for k, v in args.items()}
    opts = {k: plain(v) for k, v in opts.items()}
    bf16 = precision == "bfloat16"
    if bf16:  # the reference of the same rounding, on the values attnx computes with (float32)
        cast = lambda x: np.asarray(x).astype(F32) if is_float(np.asarray(x)) else x  # noqa: E731
    opts["precision"] = precision
    expected = reference_of(lambda: reference.multi_head_attention_forward(
        cast(np.asarray(args["query"]).astype(dtype)), cast(np.asarray(args["key"]).astype(dtype)),
        cast(np.asarray(args["value"]).astype(dtype)), m.embed_dim, m.num_heads,
        *(None if x is None else cast(x) for x in (m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v)),
        m.add_zero_attn, 0.0, cast(m.out_proj_weight), None if m.out_proj_bias is None else cast(m.out_proj_bias),
        training=False, use_separate_proj_weight=m.in_proj_weight is None,
        q_proj_weight=None if m.q_proj_weight is None else cast(m.q_proj_weight),
        k_proj_weight=None if m.k_proj_weight is None else cast(m.k_proj_weight),
        v_proj_weight=None if m.v_proj_weight is None else cast(m.v_proj_weight),
        batch_first=m.batch_first, **opts))
    if expected is None:
        raise Disallowed("MultiheadAttention: attnx computed a result for a call the reference rejects")
    # Projections over thousands of input features sum that many float32 products: their
    # rounding alone exceeds the tolerance, so such results are not compared.
    moderate = max(m.embed_dim, m.kdim, m.vdim) <= 4096
    tolerance = bf16_tolerance(input_arrays(inputs) + list(params.values())) if bf16 else None
    compare(out, expected[0], dtype, "module output", inputs + list(params.values()), moderate, tolerance)
    compare(weights, expected[1], dtype, "module weights", inputs + list(params.values()), moderate,
            bf16_tolerance([]) if bf16 else None)
