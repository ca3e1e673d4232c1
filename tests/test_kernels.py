"""Every SIMD kernel the CPU supports, against the float64 reference.

The kernel is chosen once, at import, from ATTNX_ISA, so each kernel runs in a
subprocess. Sizes straddle what the drivers switch on: the vector width and
query tile (8, 16, 32 lanes), the key block (64 to 256 keys), the row path
(fewer than a quarter tile of queries), the decode chunks (512 keys) and the
register tile of gemm (4, 6, 12, 16 rows).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import attnx
from conftest import run_under_isa, usable_isas


SWEEP = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import attnx
    from attnx import reference

    rng = np.random.default_rng(int(sys.argv[1]))
    failures = []

    def check(name, got, want, dtype):
        tol = 1e-5 if dtype == np.float32 else 1e-12
        same_nan = np.array_equal(np.isnan(got), np.isnan(want))
        close = np.allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=tol, atol=tol / 10)
        if not (same_nan and close):
            failures.append(name)

    sizes_l = [1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 97]
    sizes_s = [0, 1, 15, 16, 31, 32, 33, 96, 127, 128, 129, 511, 512, 513, 1100]
    for trial in range(int(sys.argv[2])):
        dtype = (np.float32, np.float64)[trial % 2]
        hk = int(rng.integers(1, 3)); group = int(rng.integers(1, 4)); hq = hk * group
        b = int(rng.integers(1, 3))
        L = int(rng.choice(sizes_l)); S = int(rng.choice(sizes_s))
        E = int(rng.choice([1, 7, 8, 16, 17, 64, 80, 128])); Ev = int(rng.choice([1, 8, 15, 64, 128]))
        q = rng.standard_normal((b, hq, L, E)); k = rng.standard_normal((b, hk, S, E))
        v = rng.standard_normal((b, hk, S, Ev))
        kw = {"enable_gqa": True} if group > 1 else {}
        mode = trial % 5
        if mode == 1:
            kw["is_causal"] = True
        elif mode == 2:
            kw["attn_mask"] = rng.random((L, S)) > 0.4
        elif mode == 3:
            kw["attn_mask"] = np.where(rng.random((b, 1, 1, S)) > 0.3, 0.0, -np.inf)
        elif mode == 4:
            kw["attn_mask"] = rng.standard_normal((1, hq, L, S))
        if trial % 6 == 0 and S:
            v[0, 0, int(rng.integers(S))] = np.nan  # must reach only the rows that attend it
        with np.errstate(all="ignore"):
            got = attnx.scaled_dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), **kw)
            want = reference.scaled_dot_product_attention(q, k, v, **kw)
        check(f"sdpa b{b} hq{hq} hk{hk} L{L} S{S} E{E} Ev{Ev} {sorted(kw)} {dtype.__name__}", got, want, dtype)

    # Multi-head attention with and without weights (the row path with weights).
    for trial in range(int(sys.argv[2]) // 4):
        dtype = (np.float32, np.float64)[trial % 2]
        H = int(rng.choice([1, 2, 4])); E = H * int(rng.choice([1, 8, 16, 24]))
        N = int(rng.integers(1, 3)); L = int(rng.choice([1, 5, 8, 16, 40])); S = int(rng.choice([1, 9, 33, 140]))
        x = rng.standard_normal((L, N, E)); kv = rng.standard_normal((S, N, E))
        w = rng.standard_normal((3 * E, E)) / np.sqrt(E); bias = rng.standard_normal(3 * E)
        wo = rng.standard_normal((E, E)) / np.sqrt(E); bo = rng.standard_normal(E)
        kpm = rng.random((N, S)) > 0.8
        for need in (False, True):
            args = (E, H, w, bias, None, None, False, 0.0, wo, bo)
            got = attnx.multi_head_attention_forward(
                x.astype(dtype), kv.astype(dtype), kv.astype(dtype), *args, key_padding_mask=kpm,
                need_weights=need, average_attn_weights=bool(trial % 2))
            want = reference.multi_head_attention_forward(
                x, kv, kv, *args, key_padding_mask=kpm, need_weights=need,
                average_attn_weights=bool(trial % 2))
            check(f"mha N{N} L{L} S{S} E{E} H{H} weights={need} {dtype.__name__}", got[0], want[0], dtype)
            if need:
                check(f"mha weights N{N} L{L} S{S} E{E} H{H} {dtype.__name__}", got[1], want[1], dtype)
        # Self-attention: one array as query, key and value (few rows are
        # computed transposed from end to end).
        xs = x.astype(dtype)
        got = attnx.multi_head_attention_forward(xs, xs, xs, *args, need_weights=False)
        want = reference.multi_head_attention_forward(x, x, x, *args, need_weights=False)
        check(f"self-attention N{N} L{L} E{E} H{H} {dtype.__name__}", got[0], want[0], dtype)

    # Results do not depend on the thread count, on every path.
    shapes = [((1, 2, 100, 64), (1, 2, 300, 64)), ((1, 1, 1, 128), (1, 1, 3000, 128)), ((2, 3, 5, 16), (2, 3, 700, 16))]
    for qs, ks in shapes:
        q = rng.standard_normal(qs, dtype=np.float32); k = rng.standard_normal(ks, dtype=np.float32)
        results = []
        for threads in (1, 2, 3):
            attnx.set_num_threads(threads)
            results.append(attnx.scaled_dot_product_attention(q, k, k, is_causal=qs[2] > 1))
        if not all(np.array_equal(results[0], r) for r in results[1:]):
            failures.append(f"thread-dependent result for q {qs}, k {ks}")
    print(json.dumps({"isa": attnx.show_config()["isa"], "failures": failures}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("isa", usable_isas())
def test_kernel_agrees_with_reference(isa):
    assert run_under_isa(isa, SWEEP, "7", "120")["failures"] == []


# float32 projections over long input dims, against float64, in units of
# 2^-24 * sum_k |x_k w_k| (the size of the terms summed): gemm sums runs of
# k and folds each run's sum into C, which keeps this near 1 where one long
# chain of sums reached 4 to 5 (OpenBLAS: 0.7 to 1.8).
PROJECTION_ACCURACY = textwrap.dedent(
    """
    import json
    import numpy as np
    import attnx
    from attnx import _core
    worst = 0.0
    for rows, K in ((64, 768), (64, 4096), (7, 4096), (2, 4096), (1, 16384)):
        rng = np.random.default_rng(K + rows)
        x = rng.standard_normal((rows, K)).astype(np.float32)
        w = rng.standard_normal((96, K)).astype(np.float32)
        y = np.empty((rows, 96), np.float32)
        _core.linear(x, w, None, y)
        exact = x.astype(np.float64) @ w.T.astype(np.float64)
        size = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
        worst = max(worst, float((np.abs(y - exact) / size).max() / 2.0**-24))
    print(json.dumps({"isa": attnx.show_config()["isa"], "worst": worst}))
    """
)


@pytest.mark.parametrize("isa", usable_isas())
def test_long_projection_sums_stay_accurate(isa):
    result = run_under_isa(isa, PROJECTION_ACCURACY, timeout=300)
    assert result["worst"] <= 2.0, result


def test_unknown_isa_is_a_clear_error():
    env = dict(os.environ, ATTNX_ISA="sse9")
    proc = subprocess.run([sys.executable, "-c", "import attnx"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "sse9" in proc.stderr
