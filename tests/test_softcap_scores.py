"""Soft-capped scores, the scores returned with return_scores, and is_causal with attn_mask.

Against the float64 reference on every path of the core (flash tiles, rows, rows in key
chunks, the weights paths, 16-bit keys and values) and, in a subprocess per kernel, on
every SIMD kernel the CPU runs.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import attnx
from attnx import _core, _testing, reference
from conftest import TOLERANCES, run_under_isa, usable_isas

sdpa = attnx.scaled_dot_product_attention
STAGES = ["qk", "softcapped", "masked", "softmax"]


def operands(rng, b, hq, hk, L, S, E, Ev, dtype=np.float32, spread=1.5):
    """q, k, v with scores of a few units: large enough for a soft cap of 1.5 to bend them."""
    q = (rng.standard_normal((b, hq, L, E)) * spread).astype(dtype)
    k = (rng.standard_normal((b, hk, S, E)) * spread).astype(dtype)
    v = rng.standard_normal((b, hk, S, Ev)).astype(dtype)
    return q, k, v


def assert_matches(got, want, dtype, what=""):
    """The contract's tolerances, the absolute one in units of the largest |value| (scores
    are sums of E products: their rounding grows with their size, not with 1)."""
    tol = dict(TOLERANCES[np.dtype(dtype)])
    assert got.dtype == np.dtype(dtype), what
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    finite = np.isfinite(want)
    if finite.any():
        tol["atol"] *= max(1.0, float(np.abs(want[finite]).max()))
    np.testing.assert_allclose(got[finite], want[finite], err_msg=what, **tol)


# The shapes that take each path: (b, hq, hk, L, S, E, Ev).
PATHS = {
    "tiles": (2, 4, 2, 70, 90, 32, 24),
    "rows": (2, 4, 2, 3, 200, 64, 64),
    "row chunks": (1, 2, 1, 1, 1500, 48, 16),
    "one key block": (1, 3, 3, 40, 40, 16, 16),
}
MASKINGS = ["none", "causal", "bool mask", "float mask", "causal and mask", "bottom_right and window"]


def masking_kwargs(kind, rng, L, S):
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool mask":
        return {"attn_mask": rng.random((L, S)) < 0.7}
    if kind == "float mask":
        return {"attn_mask": np.where(rng.random((1, 1, L, S)) < 0.8, rng.standard_normal((1, 1, L, S)), -np.inf)}
    if kind == "causal and mask":
        return {"attn_mask": rng.random((L, S)) < 0.7, "is_causal": True}
    if kind == "bottom_right and window":
        return {"is_causal": "bottom_right", "window": (20, None)}
    return {}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("softcap", [1.5, 30.0])
def test_softcap_matches_reference(path, masking, dtype, softcap):
    rng = np.random.default_rng(len(path) * 7 + len(masking))
    b, hq, hk, L, S, E, Ev = PATHS[path]
    q, k, v = operands(rng, b, hq, hk, L, S, E, Ev, dtype)
    kw = masking_kwargs(masking, rng, L, S)
    got = sdpa(q, k, v, enable_gqa=hq != hk, softcap=softcap, **kw)
    want = reference.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), enable_gqa=hq != hk, softcap=softcap, **kw
    )
    assert_matches(got, want, dtype, f"{path} {masking} softcap={softcap}")


def test_softcap_changes_the_result():
    # The test above could pass with the cap ignored only if it bent nothing: it does.
    rng = np.random.default_rng(0)
    q, k, v = operands(rng, *PATHS["tiles"])
    plain = sdpa(q, k, v, enable_gqa=True)
    capped = sdpa(q, k, v, enable_gqa=True, softcap=1.5)
    assert np.abs(plain - capped).max() > 0.05


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_softcap_with_16bit_keys_and_values(storage):
    ml_dtypes = pytest.importorskip("ml_dtypes") if storage == "bfloat16" else None
    half = np.float16 if storage == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    for shape in (PATHS["tiles"], PATHS["rows"]):
        q, k, v = operands(rng, *shape)
        k16, v16 = k.astype(half), v.astype(half)
        got = sdpa(q, k16, v16, enable_gqa=True, softcap=4.0)
        want = reference.scaled_dot_product_attention(
            q.astype(np.float64), k16.astype(np.float64), v16.astype(np.float64), enable_gqa=True, softcap=4.0
        )
        assert_matches(got, want, np.float32, f"{storage} keys, shape {shape}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", [(2, 3, 40, 150, 16), (1, 2, 2, 700, 32)], ids=["tile", "rows"])
def test_softcap_on_the_weights_paths(shape, dtype):
    # The probabilities written beside the output (the weights tile and rows_with_weights):
    # multi-head attention's need_weights, with the soft cap through the core's own options.
    rng = np.random.default_rng(5)
    b, h, L, S, E = shape
    q, k, v = operands(rng, b, h, h, L, S, E, E, dtype)
    out = np.empty((b, h, L, E), dtype)
    weights = np.empty((b, h, L, S), dtype)
    options = _core.SdpaOptions(True, False, float("nan"), -1, -1, False, 2.5)
    _testing.run_sdpa(q, k, v, None, options, out, weights)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    want_out, want_weights = reference.scaled_dot_product_attention(
        q64, k64, v64, is_causal=True, softcap=2.5, return_scores="softmax"
    )
    assert_matches(out, want_out, dtype, "output")
    assert_matches(weights, want_weights, dtype, "weights")


def test_softcap_of_cached_attention():
    rng = np.random.default_rng(6)
    cache = attnx.KVCache(2, 2, 900, 32)
    k = (rng.standard_normal((2, 2, 800, 32)) * 3).astype(np.float32)
    v = rng.standard_normal((2, 2, 800, 32)).astype(np.float32)
    cache.append(k, v, lengths=[800, 500])
    q = (rng.standard_normal((2, 4, 2, 32)) * 3).astype(np.float32)
    got = attnx.cached_attention(q, cache, softcap=2.0, lengths=[2, 1])
    key, value, lengths = cache.storage()
    want = reference.cached_attention(q.astype(np.float64), key, value, lengths, [2, 1], softcap=2.0)
    assert_matches(got, want, np.float32)
    with pytest.raises(ValueError, match="softcap"):
        attnx.cached_attention(q, cache, softcap=-1.0)


def test_softcap_keeps_closed_keys_closed_and_caps_infinities():
    # A closed key stays closed (the cap comes before the masks: a capped -inf would be
    # -softcap, open); an infinite score is capped to +-softcap; NaN stays NaN.
    q = np.array([[[1.0], [1.0], [np.nan]]], np.float32)  # (1, 3, 1)
    k = np.array([[[1e30], [0.0], [-1e30]]], np.float32)   # scores 1e30, 0, -1e30 (or inf)
    v = np.array([[[1.0], [2.0], [4.0]]], np.float32)
    mask = np.array([[True, True, True], [False, True, True], [True, True, True]])
    out, scores = sdpa(q, k, v, mask, softcap=2.0, scale=1.0, return_scores="masked")
    np.testing.assert_allclose(scores[0, 0], [2.0, 0.0, -2.0], rtol=1e-6)
    assert scores[0, 1, 0] == -np.inf
    assert np.isnan(scores[0, 2]).all() and np.isnan(out[0, 2]).all()
    e = np.exp([2.0, 0.0, -2.0])
    np.testing.assert_allclose(out[0, 0, 0], (e @ [1.0, 2.0, 4.0]) / e.sum(), rtol=1e-6)
    np.testing.assert_allclose(out[0, 1, 0], (e[1:] @ [2.0, 4.0]) / e[1:].sum(), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# return_scores
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("stage", STAGES)
def test_scores_match_reference_and_leave_the_output_alone(stage, masking, dtype):
    rng = np.random.default_rng(11 + len(masking))
    b, hq, hk, L, S, E, Ev = PATHS["tiles"]
    q, k, v = operands(rng, b, hq, hk, L, S, E, Ev, dtype)
    kw = masking_kwargs(masking, rng, L, S)
    for softcap in (None, 2.0):
        alone = sdpa(q, k, v, enable_gqa=True, softcap=softcap, **kw)
        out, scores = sdpa(q, k, v, enable_gqa=True, softcap=softcap, return_scores=stage, **kw)
        np.testing.assert_array_equal(out, alone)  # the same bits
        assert scores.shape == (b, hq, L, S) and scores.flags.c_contiguous
        want_out, want = reference.scaled_dot_product_attention(
            *(x.astype(np.float64) for x in (q, k, v)), enable_gqa=True, softcap=softcap, return_scores=stage, **kw
        )
        assert_matches(scores, want, dtype, f"{stage} {masking} softcap={softcap}")


def test_scores_stages_differ_where_they_should():
    rng = np.random.default_rng(2)
    q, k, v = operands(rng, 1, 2, 2, 6, 9, 8, 8)
    mask = rng.random((6, 9)) < 0.6
    mask[:, 0] = True
    got = {s: sdpa(q, k, v, mask, softcap=1.0, return_scores=s)[1] for s in STAGES}
    assert np.abs(got["qk"]).max() > 1.5 and np.abs(got["softcapped"]).max() < 1.0
    assert np.isneginf(got["masked"]).sum() == 2 * (~mask).sum()
    np.testing.assert_allclose(got["softmax"].sum(-1), 1.0, rtol=1e-6)
    assert (got["softmax"][:, :, ~mask] == 0).all()


def test_scores_of_a_row_with_no_open_key():
    q, k, v = operands(np.random.default_rng(0), 1, 1, 1, 3, 4, 8, 8)
    mask = np.ones((3, 4), bool)
    mask[1] = False
    out, probs = sdpa(q, k, v, mask, return_scores="softmax")
    assert (probs[0, 0, 1] == 0).all() and (out[0, 0, 1] == 0).all()
    _, masked = sdpa(q, k, v, mask, return_scores="masked")
    assert np.isneginf(masked[0, 0, 1]).all()


@pytest.mark.parametrize("shape", [((5, 8), (7, 8), (7, 3)), ((2, 4, 5, 8), (1, 4, 7, 8), (1, 4, 7, 3))])
def test_scores_follow_torch_shape_rules(shape):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shape)
    out, scores = sdpa(q, k, v, return_scores="qk")
    assert scores.shape == out.shape[:-1] + (7,)
    want = reference.scaled_dot_product_attention(q, k, v, return_scores="qk")[1]
    assert_matches(scores, want, np.float32)


def test_scores_in_the_query_dtype():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    for half in (np.float16, ml_dtypes.bfloat16):
        q, k, v = (rng.standard_normal((2, 6, 8)).astype(half) for _ in range(3))
        out, scores = sdpa(q, k, v, return_scores="softmax")
        assert out.dtype == scores.dtype == np.dtype(half)
        want = reference.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q, k, v)), return_scores="softmax")[1]
        np.testing.assert_allclose(scores.astype(np.float64), want, rtol=1e-2, atol=1e-3)


def test_scores_with_out_and_empty_shapes():
    rng = np.random.default_rng(0)
    q, k, v = operands(rng, 1, 2, 2, 4, 5, 8, 3)
    out = np.empty((1, 2, 4, 3), np.float32)
    result, scores = sdpa(q, k, v, return_scores="softmax", out=out)
    assert result is out
    np.testing.assert_allclose(scores.sum(-1), 1.0, rtol=1e-6)
    # No keys: zero outputs and (L, 0) scores; no value features: the scores all the same.
    result, scores = sdpa(q, k[:, :, :0], v[:, :, :0], return_scores="softmax")
    assert scores.shape == (1, 2, 4, 0) and (result == 0).all()
    result, scores = sdpa(q, k, v[..., :0], return_scores="qk")
    assert result.shape == (1, 2, 4, 0)
    assert_matches(scores, reference.scaled_dot_product_attention(q, k, v, return_scores="qk")[1], np.float32)


def test_scores_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(9)
    q, k, v = operands(rng, 2, 4, 4, 33, 300, 32, 32)
    results = []
    before = attnx.get_num_threads()
    try:
        for threads in (1, 2, 3):
            attnx.set_num_threads(threads)
            results.append(sdpa(q, k, v, is_causal=True, softcap=3.0, return_scores="softmax"))
    finally:
        attnx.set_num_threads(before)
    for out, scores in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(scores, results[0][1])


# ---------------------------------------------------------------------------------------------
# is_causal with attn_mask, and torch's positional order
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [True, "top_left", "bottom_right"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_causal_and_mask_both_apply(is_causal, mask_kind):
    rng = np.random.default_rng(4)
    q, k, v = operands(rng, 2, 2, 2, 6, 9, 8, 8, spread=1.0)
    mask = rng.random((2, 1, 6, 9)) < 0.7
    if mask_kind == "float":
        mask = np.where(mask, rng.standard_normal(mask.shape), -np.inf)
    got = sdpa(q, k, v, mask, 0.0, is_causal)
    want = reference.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q, k, v)), mask, is_causal=is_causal)
    assert_matches(got, want, np.float32)
    # Both: not the mask alone, not the band alone.
    assert not np.allclose(got, sdpa(q, k, v, mask))
    assert not np.allclose(got, sdpa(q, k, v, is_causal=is_causal))


@pytest.mark.torch
def test_torch_positional_order_and_causal_with_mask():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(8)
    q, k, v = operands(rng, 2, 3, 3, 7, 7, 16, 16, spread=1.0)
    mask = rng.random((7, 7)) < 0.6
    np.fill_diagonal(mask, True)  # every row keeps a key: torch gives NaN for rows without
    # (torch takes scale and enable_gqa by keyword only; attnx by position too)
    for args, kw in [((mask, 0.0, True), {}), ((None, 0.0, True), {}), ((mask, 0.0, False), {"scale": 0.3}),
                     ((mask, 0.0, True), {"enable_gqa": False})]:
        t_args = tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args)
        want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), *t_args, **kw).numpy()
        np.testing.assert_allclose(sdpa(q, k, v, *args, **kw), want, rtol=1e-5, atol=2e-6, err_msg=str(args[1:]))


@pytest.mark.torch
@pytest.mark.parametrize("variant", ["causal_upper_left", "causal_lower_right"])
def test_torch_causal_bias_is_read_as_is_causal(variant):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import bias

    rng = np.random.default_rng(1)
    q, k, v = operands(rng, 1, 2, 2, 4, 6, 8, 8, spread=1.0)
    causal = getattr(bias, variant)(4, 6)
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), attn_mask=causal)
    got = sdpa(q, k, v, attn_mask=causal)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="CausalBias for L = 4 queries and S = 6 keys"):
        sdpa(q[:, :, :3], k, v, attn_mask=causal)
    with pytest.raises(ValueError, match="leave is_causal=False"):
        sdpa(q, k, v, attn_mask=causal, is_causal=True)


# ---------------------------------------------------------------------------------------------
# Every kernel the CPU runs (the kernel is chosen at import: a subprocess each)
# ---------------------------------------------------------------------------------------------

KERNEL_SWEEP = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import attnx
    from attnx import reference

    rng = np.random.default_rng(int(sys.argv[1]))
    failures = []
    sdpa = attnx.scaled_dot_product_attention

    def check(name, got, want, dtype):
        tol = 1e-5 if dtype == np.float32 else 1e-12
        ok = np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isneginf(got), np.isneginf(want))
        finite = np.isfinite(want)
        size = max(1.0, float(np.abs(want[finite]).max())) if finite.any() else 1.0
        if not (ok and np.allclose(got[finite], want[finite], rtol=tol, atol=tol / 10 * size)):
            failures.append(name)

    for trial in range(int(sys.argv[2])):
        dtype = (np.float32, np.float64)[trial % 2]
        hk = int(rng.integers(1, 3)); hq = hk * int(rng.integers(1, 3)); b = int(rng.integers(1, 3))
        L = int(rng.choice([1, 3, 8, 17, 33, 70])); S = int(rng.choice([1, 16, 33, 129, 600]))
        E = int(rng.choice([1, 8, 17, 64])); Ev = int(rng.choice([1, 8, 64]))
        q = rng.standard_normal((b, hq, L, E)) * 1.5; k = rng.standard_normal((b, hk, S, E)) * 1.5
        v = rng.standard_normal((b, hk, S, Ev))
        kw = {"enable_gqa": hq != hk, "softcap": float(rng.choice([0.5, 2.0, 20.0]))}
        if trial % 3 == 1:
            kw["is_causal"] = "bottom_right"
        if trial % 3 == 2:
            kw["attn_mask"] = rng.random((L, S)) < 0.8
        stage = ["qk", "softcapped", "masked", "softmax"][trial % 4]
        args = [x.astype(dtype) for x in (q, k, v)]
        with np.errstate(all="ignore"):
            out, scores = sdpa(*args, return_scores=stage, **kw)
            want_out, want = reference.scaled_dot_product_attention(q, k, v, return_scores=stage, **kw)
        name = f"b{b} hq{hq} hk{hk} L{L} S{S} E{E} Ev{Ev} {sorted(kw)} {stage} {dtype.__name__}"
        check(name, out, want_out, dtype)
        check(name + " scores", scores, want, dtype)
        if not np.array_equal(out, sdpa(*args, **kw)):
            failures.append(name + ": the output changed with return_scores")

    # The soft cap of single scores (E = 1, scale 1, k = 1: the score is q), in units in the
    # last place of float32, over a wide range of scores and caps.
    x = np.concatenate([np.geomspace(1e-30, 1e3, 20000), [0.0, 1e30, np.inf]]).astype(np.float32)
    x = np.concatenate([x, -x])
    worst = 0.0
    for cap in (0.01, 1.0, 30.0, 1e4):
        _, s = sdpa(x[:, None], np.ones((1, 1), np.float32), np.ones((1, 1), np.float32), scale=1.0,
                    softcap=cap, return_scores="softcapped")
        exact = cap * np.tanh(x.astype(np.float64) / cap)
        ulps = np.abs(s[:, 0] - exact) / np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
        worst = max(worst, float(ulps.max()))
    print(json.dumps({"isa": attnx.show_config()["isa"], "failures": failures, "softcap_ulps": worst}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("isa", usable_isas())
def test_every_kernel_softcaps_and_scores(isa):
    result = run_under_isa(isa, KERNEL_SWEEP, "3", "40")
    assert result["failures"] == []
    # The rational tanh of the SIMD kernels (docs/tuning.md): within a few units in the
    # last place, with the multiplication by 1 / cap before it.
    assert result["softcap_ulps"] <= 8.0, result
