"""Numerical stress, against the float64 reference: logits near the float limits, rows whose
keys are all masked, NaN/Inf inputs, denormals, and very long rows (S = 1M keys).

Every case runs for float32 and float64, on the kernel in use (``.ci/run`` runs the suite
once per kernel the CPU has: scalar, AVX2, AVX-512).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import attnx
from _hardening import record
from conftest import DTYPE_IDS, DTYPES, assert_close, randn, ref_mha, ref_sdpa, to64, usable_isas

pytestmark = pytest.mark.hardening

sdpa = attnx.scaled_dot_product_attention
mha = attnx.multi_head_attention_forward


def test_the_kernel_in_use_is_the_one_asked_for():
    """.ci/run runs the suite once per kernel with ATTNX_ISA set: each run checks its kernel."""
    requested = os.environ.get("ATTNX_ISA", "").strip().lower()
    cfg = attnx.show_config()
    assert cfg["isa"] == (requested or usable_isas()[-1])
    record("kernel in use", requested=requested or None)


def assert_matches(got, expected, dtype, err_msg=""):
    """As assert_close, for results with NaN/Inf: NaN exactly where the reference has NaN,
    a non-finite value where it has +-Inf (an Inf value whose float32 weight underflows to
    0 gives 0 * Inf = NaN, where float64's tiny weight keeps the Inf), finite values close."""
    expected = np.asarray(expected, dtype=np.float64)
    assert got.dtype == np.dtype(dtype) and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    g = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g) | np.isinf(g), ~np.isfinite(expected), err_msg=f"{err_msg}: non-finite pattern")
    np.testing.assert_array_equal(np.isnan(g)[np.isnan(expected)], True, err_msg=f"{err_msg}: NaN pattern")
    finite = np.isfinite(expected)
    assert_close(got[finite], expected[finite], dtype, err_msg=err_msg)


# ---------------------------------------------------------------------------------------------
# Logits near the limits of the float type
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.99])
def test_logits_near_the_float_maximum(rng, dtype, fraction):
    """Scores of about +-fraction * max(float): finite, yet their differences overflow.
    Max-subtracted softmax gives the largest score's value (one-hot), as float64 does."""
    big = np.sqrt(np.finfo(dtype).max * fraction)
    L, S = 37, 300  # both paths: the tile path (L >= tile / 4) and the row path below
    for L in (1, 3, 37):
        q = (np.where(rng.random((1, 2, L, 1)) < 0.5, -1.0, 1.0) * big).astype(dtype)
        k = (rng.uniform(-1, 1, (1, 2, S, 1)) * big).astype(dtype)
        v = randn(rng, (1, 2, S, 5), dtype)
        got = sdpa(q, k, v, scale=1.0)
        assert np.isfinite(got).all()
        assert_close(got, ref_sdpa(q, k, v, scale=1.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("magnitude", [1e4, 1e10, 1e30])
def test_large_logits_never_overflow(rng, dtype, magnitude):
    """Logits of 1e4 and beyond (the contract): through a large scale, with masks, in MHA too."""
    for L, S in ((1, 700), (40, 300), (5, 9)):
        q, k = randn(rng, (2, 2, L, 8), dtype), randn(rng, (2, 2, S, 8), dtype)
        v = randn(rng, (2, 2, S, 8), dtype)
        mask = rng.random((L, S)) < 0.8
        mask[:, -1] = True
        for kw in ({}, {"attn_mask": mask}, {"is_causal": True}):
            got = sdpa(q, k, v, scale=magnitude, **kw)
            assert np.isfinite(got).all()
            expected = ref_sdpa(q, k, v, scale=magnitude, **kw)
            # One-hot rows: the result is a value row, exactly or as its float32 rounding.
            assert_close(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_additive_masks(rng, dtype):
    """Float masks near the maximum added to ordinary scores (and the mask's -max)."""
    top = np.finfo(dtype).max
    q, k, v = randn(rng, (1, 3, 20, 16), dtype), randn(rng, (1, 3, 50, 16), dtype), randn(rng, (1, 3, 50, 4), dtype)
    mask = np.where(rng.random((20, 50)) < 0.5, -top, top / 2).astype(dtype)
    got = sdpa(q, k, v, mask)
    assert np.isfinite(got).all()
    assert_close(got, ref_sdpa(q, k, v, mask), dtype)


# ---------------------------------------------------------------------------------------------
# Rows whose keys are all masked
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L,S", [(1, 5), (3, 700), (40, 130), (70, 33)])
def test_fully_masked_rows_are_zero(rng, dtype, L, S):
    q, k, v = randn(rng, (2, 2, L, 8), dtype), randn(rng, (2, 2, S, 8), dtype), randn(rng, (2, 2, S, 8), dtype)
    closed = rng.random((2, 1, L, 1)) < 0.5  # whole rows closed
    bool_mask = (rng.random((2, 2, L, S)) < 0.7) & ~closed
    float_mask = np.where(bool_mask, randn(rng, (2, 2, L, S), dtype), -np.inf).astype(dtype)
    k_nan, v_nan = k.copy(), v.copy()  # NaN/Inf in every key and value
    k_nan[..., ::3, 0], v_nan[..., 1::3, 0] = np.nan, np.inf
    for mask in (bool_mask, float_mask):
        for kk, vv in ((k, v), (k_nan, v_nan)):
            with np.errstate(all="ignore"):
                got = sdpa(q, kk, vv, mask)
                expected = ref_sdpa(q, kk, vv, mask)
            rows = np.broadcast_to(closed[..., 0], (2, 2, L))
            np.testing.assert_array_equal(got[rows], 0.0)  # zeros, never NaN
            assert_matches(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_no_keys_at_all_gives_zeros(dtype):
    q = np.ones((2, 3, 4, 8), dtype)
    empty = np.ones((2, 3, 0, 8), dtype)
    np.testing.assert_array_equal(sdpa(q, empty, empty), 0.0)
    np.testing.assert_array_equal(sdpa(q, empty, empty, scale=0.5), 0.0)
    np.testing.assert_array_equal(sdpa(q, empty, empty, np.ones((4, 0), bool)), 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_fully_masked_batch_gives_out_proj_bias(rng, dtype, need_weights):
    from conftest import mha_args

    args = mha_args(rng, L=9, S=700, N=3, E=16, H=4, dtype=dtype, need_weights=need_weights)
    kpm = rng.random((3, 700)) < 0.5
    kpm[1] = True  # batch 1: every key ignored
    args["key_padding_mask"] = kpm
    out, w = mha(**args)
    expected = ref_mha(**args)
    np.testing.assert_allclose(out[:, 1], np.broadcast_to(args["out_proj_bias"], (9, 16)), rtol=0, atol=0)
    assert_close(out, expected[0], dtype)
    if need_weights:
        np.testing.assert_array_equal(w[1], 0.0)
        assert_close(w, expected[1], dtype)


# ---------------------------------------------------------------------------------------------
# NaN and Inf inputs
# ---------------------------------------------------------------------------------------------

SPECIAL = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("where", ["query", "key", "value", "mask"])
@pytest.mark.parametrize("value", SPECIAL, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("L,S", [(1, 1030), (40, 300), (3, 17)])
def test_nan_and_inf_reach_exactly_the_rows_they_touch(rng, dtype, where, value, L, S):
    q, k, v = randn(rng, (2, 2, L, 16), dtype), randn(rng, (2, 2, S, 16), dtype), randn(rng, (2, 2, S, 8), dtype)
    mask = np.where(rng.random((2, 1, L, S)) < 0.6, randn(rng, (2, 1, L, S), dtype), -np.inf).astype(dtype)
    target = {"query": q, "key": k, "value": v, "mask": mask}[where]
    idx = tuple(rng.integers(0, n, size=3) for n in target.shape)
    target[idx] = value
    for kw in ({"attn_mask": mask}, {"is_causal": True}, {}):
        if where == "mask" and "attn_mask" not in kw:
            continue
        with np.errstate(all="ignore"):
            got = sdpa(q, k, v, **kw)
            expected = ref_sdpa(q, k, v, **kw)
        assert_matches(got, expected, dtype, err_msg=f"{where}={value} {sorted(kw)}")
        # ...and to no other row: rows the reference has finite are finite.
        assert np.isfinite(got[np.isfinite(expected).all(-1)]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["query", "key", "value", "in_proj_weight", "out_proj_weight", "in_proj_bias", "bias_k"])
def test_mha_nan_propagation(rng, dtype, name):
    from conftest import mha_args

    args = mha_args(rng, L=6, S=40, N=2, E=8, H=2, dtype=dtype, bias_kv=True)
    kpm = rng.random((2, 40)) < 0.3
    args["key_padding_mask"] = kpm
    target = args[name]
    idx = tuple(int(rng.integers(0, n)) for n in target.shape)
    target[idx] = np.nan
    with np.errstate(all="ignore"):
        out, w = mha(**args)
        expected = ref_mha(**args)
    assert_matches(out, expected[0], dtype, err_msg=f"output, NaN in {name}")
    assert_matches(w, expected[1], dtype, err_msg=f"weights, NaN in {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_value_reaches_its_row_even_when_its_weight_underflows(dtype):
    """A key far below the row's maximum has weight 0 in float32 (e^-200), yet NaN or Inf in
    its value must still reach the row (the reference's float64 weight is not 0)."""
    q = np.ones((1, 1, 1, 1), dtype)
    k = np.array([0.0, -200.0, -800.0], dtype).reshape(1, 1, 3, 1)
    for bad in (np.nan, np.inf):
        v = np.array([1.0, bad, 2.0], dtype).reshape(1, 1, 3, 1)
        with np.errstate(all="ignore"):
            got = sdpa(q, k, v, scale=1.0)
            expected = ref_sdpa(q, k, v, scale=1.0)
        assert_matches(got, expected, dtype)
        assert not np.isfinite(got).any()


# ---------------------------------------------------------------------------------------------
# Denormals
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_denormal_inputs(rng, dtype):
    tiny = np.finfo(dtype).smallest_subnormal

    def denormal(shape):
        a = (rng.integers(-1000, 1000, shape) * tiny).astype(dtype)
        assert (np.abs(a[a != 0]) < np.finfo(dtype).tiny).all()
        return a

    for L, S in ((1, 700), (40, 100)):
        q, k, v = randn(rng, (1, 2, L, 8), dtype), randn(rng, (1, 2, S, 8), dtype), randn(rng, (1, 2, S, 4), dtype)
        dq, dk = denormal(q.shape), denormal(k.shape)
        # Denormal queries or keys: scores of ~0, so weights of ~1/S.
        assert_close(sdpa(dq, k, v), ref_sdpa(dq, k, v), dtype)
        assert_close(sdpa(q, dk, v), ref_sdpa(q, dk, v), dtype)
        # Values mixing normal and denormal numbers, and a denormal mask.
        mixed = np.where(rng.random(v.shape) < 0.5, v, denormal(v.shape)).astype(dtype)
        assert_close(sdpa(q, k, mixed), ref_sdpa(q, k, mixed), dtype)
        dmask = denormal((L, S))
        assert_close(sdpa(q, k, v, dmask), ref_sdpa(q, k, v, dmask), dtype)
        # All-denormal values: results are denormal (or 0), never NaN, as small as the values.
        dv = denormal(v.shape)
        got = sdpa(q, k, dv)
        assert np.isfinite(got).all() and (np.abs(got) <= np.abs(dv).max()).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_calls_leave_denormals_working(rng, dtype):
    """The kernels may flush denormals (FTZ/DAZ) while they run, but must not leave the
    calling thread's floating-point mode changed: NumPy arithmetic after a call still
    produces and reads denormals."""
    tiny = np.finfo(dtype).smallest_subnormal
    q = randn(rng, (2, 4, 64, 32), dtype)
    sdpa(q, q, q)
    mha(**__import__("conftest").mha_args(rng, dtype=dtype))
    half_normal = np.array(np.finfo(dtype).tiny, dtype) / dtype(2)
    assert 0 < half_normal < np.finfo(dtype).tiny  # produced, not flushed
    assert np.array(tiny, dtype) * dtype(3) == dtype(3) * tiny != 0  # read, not treated as 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_denormal_weights(rng, dtype):
    """Scores spread so that most weights are denormal or underflow (MHA's weights output).
    The SIMD kernels give 0 for a term e^x below the smallest normal number, where the
    reference's is denormal: within any tolerance, and no microcode assists."""
    from conftest import mha_args

    args = mha_args(rng, L=7, S=50, N=2, E=8, H=2, dtype=dtype, need_weights=True, average_attn_weights=False)
    spread = 90.0 if dtype == np.float32 else 720.0  # e^-spread: below the smallest normal
    args["attn_mask"] = (-spread * rng.random((7, 50)) - spread * 0.5).astype(dtype)
    out, w = mha(**args)
    expected = ref_mha(**args)
    tiny = np.finfo(dtype).tiny
    ref_w = np.asarray(expected[1], np.float64)
    assert ((ref_w > 0) & (ref_w < tiny)).any(), "no denormal weight: the case tests nothing"
    assert_close(out, expected[0], dtype)
    assert_close(w, expected[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L", [1, 40])  # the row path (decoding) and the tile path
def test_weights_at_the_edge_of_the_normal_range(dtype, L):
    """Scores whose e^(s - max) straddle the smallest normal number, a large float mask, a
    closed key and a NaN score: with the values the identity, the output row is the row's
    weights. Each weight matches the reference (those below the normal range within atol),
    the closed key's is exactly 0, and the NaN score's row is NaN (a NaN passes through the
    kernels' underflow masks)."""
    ln_tiny = float(np.log(np.finfo(dtype).tiny))  # -87.34 (float32), -708.40 (float64)
    offsets = [0.0, -1.0, -20.0, ln_tiny + 1.0, ln_tiny + 1e-3, ln_tiny - 1e-3, ln_tiny - 0.5,
               ln_tiny - 10.0, ln_tiny - 16.5, ln_tiny - 17.0, ln_tiny - 40.0, -1e4, 0.0, -3.0]
    S = len(offsets)
    k = np.array(offsets, np.float64).reshape(1, 1, S, 1).astype(dtype)
    q = np.ones((1, 1, L, 1), dtype)
    v = np.eye(S, dtype=dtype).reshape(1, 1, S, S)
    mask = np.zeros((L, S), dtype)
    mask[:, 1] = -np.inf  # closed key
    mask[:, 2] = -1e4     # a large float mask on an open key
    got = sdpa(q, k, v, mask, scale=1.0)
    expected = ref_sdpa(q, k, v, mask, scale=1.0)
    assert_close(got, expected, dtype)
    assert (got[..., 1] == 0).all()
    np.testing.assert_allclose(got.astype(np.float64).sum(-1), 1.0, rtol=1e-5)
    k_nan = k.copy()
    k_nan[0, 0, 4, 0] = np.nan
    got_nan = sdpa(q, k_nan, v, mask, scale=1.0)
    assert np.isnan(got_nan).all(), "a NaN score makes its rows NaN"


# ---------------------------------------------------------------------------------------------
# Very long rows
# ---------------------------------------------------------------------------------------------

MILLION = 1 << 20


@pytest.mark.large
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L", [1, 3, 40])
def test_one_million_keys(rng, dtype, L):
    """S = 1M keys: decoding (L = 1, the chunked row path), a few queries, and the tile path.
    Values centred on 1, so that results are of order 1 and rtol is what binds.

    Bug found (L = 40, float32, the tile path): the error grows with S, to a relative 2e-4 at
    1M keys (1e-5 at 64k), where the row path stays near 3e-6: the tile path accumulates its
    running sum and output over all S/key_block blocks in float32, one block after another,
    while the row path merges 512-key chunks."""
    E = 16
    q = randn(rng, (1, 1, L, E), dtype)
    k = randn(rng, (1, 1, MILLION, E), dtype)
    v = (1.0 + randn(rng, (1, 1, MILLION, 4), np.float64)).astype(dtype)
    got = sdpa(q, k, v)
    assert_close(got, ref_sdpa(q, k, v), dtype)
    if L == 1:  # masked: decoding (the reference's masked path is slow on 40 x 1M)
        mask = rng.random((L, MILLION)) < 0.5
        got = sdpa(q, k, v, mask)
        assert_close(got, ref_sdpa(q, k, v, mask), dtype)


@pytest.mark.large
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_million_keys_large_logits_and_nan(rng, dtype):
    """1M keys with a wide logit range (one-hot-ish rows), and one NaN value far down the row."""
    q = randn(rng, (1, 2, 1, 8), dtype)
    k = randn(rng, (1, 2, MILLION, 8), dtype)
    v = randn(rng, (1, 2, MILLION, 2), dtype)
    got = sdpa(q, k, v, scale=30.0)
    assert_close(got, ref_sdpa(q, k, v, scale=30.0), dtype)
    v[0, 1, MILLION - 7, 1] = np.nan
    with np.errstate(invalid="ignore"):
        got = sdpa(q, k, v)
    expected = ref_sdpa(q, k, v)
    assert_matches(got, expected, dtype)
    assert np.isnan(got[0, 1, 0, 1]) and np.isfinite(got[0, 0]).all() and np.isfinite(got[0, 1, 0, 0])


@pytest.mark.large
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mha_one_million_keys(rng, dtype):
    from conftest import mha_args

    args = mha_args(rng, L=2, S=MILLION, N=1, E=8, H=2, dtype=dtype, need_weights=True)
    args["key_padding_mask"] = rng.random((1, MILLION)) < 0.3
    # A well-conditioned output projection (a permutation), so that the result shows the
    # error of the 1M-key attention itself rather than that error amplified by cancellation
    # in a random projection.
    args["out_proj_weight"] = np.eye(8, dtype=dtype)[::-1].copy()
    out, w = mha(**args)
    expected = ref_mha(**args)
    assert_close(out, expected[0], dtype)
    # Each weight is ~1e-6: compare them relative to their own size.
    np.testing.assert_allclose(w, expected[1], rtol=1e-4 if dtype == np.float32 else 1e-11, atol=0)
