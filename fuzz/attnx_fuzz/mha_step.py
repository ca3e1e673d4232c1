"""multi_head_attention_step: the decoding step of MultiheadAttention.step over a KVCache, a
few steps in a row. It must append exactly the new tokens' keys and values, and its output
match the reference's projections and cached attention (see ``fuzz_step``).
"""

from __future__ import annotations

import math

import numpy as np

import attnx
from attnx import reference

from .common import (
    F32, F64, HALVES, I8, OUTCOMES, SCALAR_JUNK, TOL, Disallowed, Provider, bf16_tolerance, cache_contents,
    call, check_untouched, compare, draw_precision, held, input_arrays, is_float, logits_moderate, malformed,
    reference_of, relayout, snapshot, still_held, values, well_scaled,
)


STEP_ARRAYS = ["query", "in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
               "q_proj_weight", "k_proj_weight", "v_proj_weight", "lengths"]


def step_expected(a, cache, before, n, bf16=False):
    """float64 expectation of one multi_head_attention_step that appended n[b] tokens to
    sequence b of `cache` (which held before[b]): the new tokens' queries, keys and values
    (B, H, T, D) and the step's output; raises where the arguments describe no valid step.
    With `bf16`, the float32 expectation of precision "bfloat16" (the reference's rounding)."""
    x = np.asarray(a["query"])
    if not is_float(x):
        raise TypeError("query")
    run = F32 if bf16 else np.float64
    x = x.astype(run)
    layout = "unbatched" if x.ndim == 2 else ("batch_first" if a["batch_first"] else "seq_first")
    xb = {"unbatched": lambda: x[None], "batch_first": lambda: x, "seq_first": lambda: x.transpose(1, 0, 2)}[layout]()
    B, T, E = xb.shape
    H = a["num_heads"]
    D = E // H

    def param(name, shape):
        value = np.asarray(a[name])
        if not is_float(value) or value.shape != shape:
            raise ValueError(name)
        return value.astype(run)

    if a["use_separate_proj_weight"]:
        w_in = np.concatenate([param(name, (E, E)) for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight")])
    else:
        w_in = param("in_proj_weight", (3 * E, E))
    b_in = np.zeros(3 * E, run) if a["in_proj_bias"] is None else param("in_proj_bias", (3 * E,))
    w_out = np.asarray(a["out_proj_weight"])
    if not is_float(w_out) or w_out.ndim != 2 or w_out.shape[1] != E:
        raise ValueError("out_proj_weight")
    w_out = w_out.astype(run)
    b_out = np.zeros(w_out.shape[0], run) if a["out_proj_bias"] is None else param("out_proj_bias", (w_out.shape[0],))
    qkv = reference._linear(xb, w_in, b_in, bf16)
    q, k, v = (qkv[..., i * E:(i + 1) * E].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    attn = reference.cached_attention(q, *(np.asarray(x, run) for x in cache_contents(cache)), before + n,
                                      query_lengths=n, precision="bfloat16" if bf16 else None)
    out = reference._linear(attn.transpose(0, 2, 1, 3).reshape(B, T, E), w_out, b_out, bf16)
    out = {"unbatched": lambda: out[0], "batch_first": lambda: out, "seq_first": lambda: out.transpose(1, 0, 2)}[layout]()
    return q, k, v, out


def fuzz_step(p: Provider):
    """multi_head_attention_step (the decoding step of MultiheadAttention.step) over a KVCache
    for a few steps: ragged lengths, batch-first, sequence-first and unbatched queries,
    separate projection weights, another output width, float16 queries and storage. Each
    output must match the reference: the projections, reference.cached_attention over the
    cache's contents, the output projection. The step must append exactly the new tokens'
    keys and values, leave the cached ones as they were, and, where it raises, append nothing."""
    dtype = p.choice([F32, F32, F64])
    H = p.int(1, 3)
    E, B = H * p.choice([1, 2, 4, 8]), p.int(1, 3)
    unbatched = B == 1 and p.bool(0.3)
    cache = attnx.KVCache(B, H, p.choice([1, 4, 16, 40]), E // H, p.choice([dtype, dtype, I8] + HALVES))
    separate = p.bool(0.3)
    E_out = p.choice([E, E, 3])

    def weight(rows, cols):
        return values(p, (rows, cols), dtype) / math.sqrt(cols)

    for _ in range(p.int(1, 3)):
        T = p.choice([0, 1, 1, 2, 5])
        batch_first = p.bool()
        shape = (T, E) if unbatched else ((B, T, E) if batch_first else (T, B, E))
        a = dict(query=values(p, shape, p.choice([dtype, dtype] + HALVES)), num_heads=H,
                 in_proj_weight=None if separate else weight(3 * E, E),
                 in_proj_bias=values(p, (3 * E,), dtype) if p.bool(0.7) else None,
                 out_proj_weight=weight(E_out, E),
                 out_proj_bias=values(p, (E_out,), dtype) if p.bool(0.7) else None,
                 lengths=np.random.default_rng(p.seed()).integers(0, T + 1, B) if p.bool(0.4) else None,
                 batch_first=batch_first, use_separate_proj_weight=separate,
                 q_proj_weight=weight(E, E) if separate else None,
                 k_proj_weight=weight(E, E) if separate else None,
                 v_proj_weight=weight(E, E) if separate else None)
        for name in STEP_ARRAYS:
            if isinstance(a[name], np.ndarray) and p.bool(0.15):
                a[name] = relayout(p, a[name])
        valid_n = np.full(B, T) if a["lengths"] is None else np.asarray(a["lengths"])
        # (float64 queries compute their projections in float64: no bfloat16 products.)
        precision, invalid = draw_precision(p, a["query"].dtype)
        n_mut = p.choice([0, 0, 0, 1, 2]) + invalid
        for _ in range(n_mut):
            if p.bool(0.8):
                name = p.choice(STEP_ARRAYS)
                a[name] = malformed(p, a[name])
            else:
                a[p.choice(["num_heads", "batch_first", "use_separate_proj_weight"])] = p.choice(SCALAR_JUNK)
        before, held_before = cache.lengths.copy(), held(cache)
        inputs = [a[name] for name in STEP_ARRAYS]
        snap = snapshot(inputs)
        ok, got = call("step", lambda: attnx.multi_head_attention_step(
            a["query"], cache, a["num_heads"], a["in_proj_weight"], a["in_proj_bias"], a["out_proj_weight"],
            a["out_proj_bias"], lengths=a["lengths"], batch_first=a["batch_first"],
            use_separate_proj_weight=a["use_separate_proj_weight"], q_proj_weight=a["q_proj_weight"],
            k_proj_weight=a["k_proj_weight"], v_proj_weight=a["v_proj_weight"], precision=precision))
        check_untouched(snap, "step")
        if not still_held(cache, held_before):
            raise Disallowed("step: a cached token's key or value changed")
        if not ok:
            if not np.array_equal(cache.lengths, before):
                raise Disallowed("step: raised after appending to the cache")
            if n_mut == 0 and np.all(before + valid_n <= cache.max_len):
                raise Disallowed("step: a valid call raised")
            continue
        for x in inputs:
            if isinstance(x, np.ndarray) and np.shares_memory(got, x):
                raise Disallowed("step: the result shares memory with an input")
        x_shape = np.shape(np.asarray(a["query"]))
        tokens = x_shape[1] if len(x_shape) == 3 and a["batch_first"] else x_shape[0]
        n = np.full(B, tokens) if a["lengths"] is None else np.asarray(a["lengths"], dtype=np.int64)
        if not np.array_equal(cache.lengths, before + n):
            raise Disallowed(f"step: cache lengths {cache.lengths.tolist()}, expected {(before + n).tolist()}")
        bf16 = precision == "bfloat16"
        expected = reference_of(lambda: step_expected(a, cache, before, n, bf16))
        if expected is None:
            raise Disallowed("step: attnx computed a result for a call the reference rejects")
        q, k, v, out = expected
        query = np.asarray(a["query"])
        # The query decides the projections' dtype and the result's, the cache the attention's.
        compute = F64 if cache.dtype == F64 and query.dtype == F64 else F32
        result_dtype = query.dtype.newbyteorder("=")
        arrays = [x for x in inputs if x is not a["lengths"]]
        key, value = cache_contents(cache)
        keys = [key[b, :, :m] for b, m in enumerate(cache.lengths)]
        values_held = [value[b, :, :m] for b, m in enumerate(cache.lengths)]
        if well_scaled(input_arrays(arrays)):
            OUTCOMES["step: appended keys and values checked"] += 1
            stored = TOL[cache.dtype] if cache.dtype in HALVES else TOL[compute]
            for b, (m, t) in enumerate(zip(before, n)):
                for name, got_rows, want in (("keys", key, k), ("values", value, v)):
                    want = want[b, :, :t]
                    if cache.dtype == I8:  # within half a step of each row's scale, max|x| / 127
                        step = np.abs(want).max(-1, keepdims=True) / 127 if want.size else 0
                        assert np.all(np.abs(got_rows[b, :, m:m + t] - want) <= 0.5 * step * (1 + 1e-5) + 1e-30), \
                            f"step: appended {name}"
                        continue
                    np.testing.assert_allclose(got_rows[b, :, m:m + t], want, err_msg=f"step: appended {name}", **stored)
        moderate = all(logits_moderate(q[b], keys[b], 1 / math.sqrt(E // H)) for b in range(B))
        tolerance = result_dtype if result_dtype.itemsize < compute.itemsize else compute
        if bf16:
            tolerance = bf16_tolerance(input_arrays(arrays) + values_held)
            if result_dtype.itemsize == 2:  # and the result's own rounding
                tolerance["rtol"] += TOL[result_dtype]["rtol"]
        compare(got, out, result_dtype, "step", arrays + keys + values_held, moderate, tolerance)
