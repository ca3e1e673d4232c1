"""Causal alignment (is_causal="top_left" / "bottom_right") and sliding windows.

The reference's new options are checked against torch where torch can express them
(``torch.nn.attention.bias.causal_lower_right`` and explicit boolean masks); attnx's
sdpa, multi-head attention and module are checked against the reference. Lengths straddle
the core's tiles (32 query rows, 128 keys) so that windows cover, cut and skip whole blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
import attnx.reference as reference
from conftest import (
    assert_close,
    assert_unchanged,
    copies,
    mha_args,
    quiet_torch,
    randn,
    ref_mha,
    ref_sdpa,
    sdpa_mask,
    to64,
)

sdpa = attnx.scaled_dot_product_attention


def open_positions(L, S, causal=False, bottom_right=False, window=None):
    """Bool (L, S), True = may attend, written independently of the reference's helper."""
    d = S - L if bottom_right else 0
    left, right = (None, None) if window is None else window
    allowed = np.zeros((L, S), bool)
    for i in range(L):
        for j in range(S):
            ok = not causal or j <= i + d
            ok = ok and (left is None or j >= i + d - left)
            ok = ok and (right is None or j <= i + d + right)
            allowed[i, j] = ok
    return allowed


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def torch_sdpa(torch, q, k, v, attn_mask=None, **kwargs):
    t = lambda x: None if x is None else torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
    with quiet_torch():
        return torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(attn_mask), **kwargs).numpy()


# ---------------------------------------------------------------------------------------------
# The reference against torch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L, S", [(3, 7), (6, 6), (7, 3), (1, 9)])
def test_reference_bottom_right_is_torchs_causal_lower_right(torch, rng, L, S):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = randn(rng, (2, 3, L, 8)), randn(rng, (2, 3, S, 8)), randn(rng, (2, 3, S, 5))
    ours = reference.scaled_dot_product_attention(q, k, v, is_causal="bottom_right")
    with quiet_torch():  # torch warns of NaN rows for L > S
        mask = causal_lower_right(L, S)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=mask).numpy()
    # Rows with no key (the first L - S rows when L > S) are zeros here; torch gives NaN there.
    rows = open_positions(L, S, True, True).any(axis=1)
    np.testing.assert_allclose(ours[..., rows, :], theirs[..., rows, :], rtol=1e-12, atol=1e-12)
    assert np.all(ours[..., ~rows, :] == 0)
    # True and "top_left" are torch's is_causal.
    for flag in (True, "top_left"):
        np.testing.assert_allclose(
            reference.scaled_dot_product_attention(q, k, v, is_causal=flag),
            torch_sdpa(torch, q, k, v, is_causal=True) if L <= S else
            torch_sdpa(torch, q, k, v, attn_mask=open_positions(L, S, True)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [(2, 0), (0, 3), (1, 1), (None, 2), (3, None), (0, 0)])
@pytest.mark.parametrize("is_causal", [False, True, "bottom_right"])
def test_reference_window_is_an_explicit_mask_in_torch(torch, rng, window, is_causal):
    L, S = 5, 9
    q, k, v = randn(rng, (1, 2, L, 4)), randn(rng, (1, 2, S, 4)), randn(rng, (1, 2, S, 3))
    causal, bottom_right = is_causal is not False, is_causal == "bottom_right"
    allowed = open_positions(L, S, causal, bottom_right, window)
    ours = reference.scaled_dot_product_attention(q, k, v, is_causal=is_causal, window=window)
    theirs = torch_sdpa(torch, q, k, v, attn_mask=allowed)
    rows = allowed.any(axis=1)
    np.testing.assert_allclose(ours[..., rows, :], theirs[..., rows, :], rtol=1e-12, atol=1e-12)
    assert np.all(ours[..., ~rows, :] == 0)


def test_reference_window_with_a_mask_and_gqa_in_torch(torch, rng):
    L, S = 6, 11
    q, k, v = randn(rng, (2, 4, L, 8)), randn(rng, (2, 2, S, 8)), randn(rng, (2, 2, S, 8))
    mask = sdpa_mask(rng, "bool", (2, 1, L, S), keep_one=False, masked_fraction=0.3)
    allowed = mask & open_positions(L, S, window=(3, 1))
    ours = reference.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, window=(3, 1))
    theirs = torch_sdpa(torch, q, k, v, attn_mask=allowed, enable_gqa=True)
    rows = np.broadcast_to(allowed.any(axis=-1), ours.shape[:-1])
    np.testing.assert_allclose(ours[rows], theirs[rows], rtol=1e-12, atol=1e-12)
    assert np.all(ours[~rows] == 0)


def test_reference_mha_bottom_right_is_an_explicit_mask_in_torch(torch, rng):
    args = mha_args(rng, L=3, S=7, dtype=np.float64, bias_kv=True)
    ours = reference.multi_head_attention_forward(**{**args, "is_causal": "bottom_right"})
    t = {k: (torch.from_numpy(x) if isinstance(x, np.ndarray) else x) for k, x in args.items()
         if k != "batch_first"}
    t["attn_mask"] = torch.from_numpy(~open_positions(3, 7, True, True))  # True = not allowed
    t["is_causal"] = False
    with quiet_torch():
        theirs = torch.nn.functional.multi_head_attention_forward(**t)
    np.testing.assert_allclose(ours[0], theirs[0].numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours[1], theirs[1].numpy(), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# attnx's sdpa against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("L, S", [(1, 300), (33, 300), (129, 129), (40, 7), (300, 33)])
def test_bottom_right(rng, dtype, L, S):
    q, k, v = randn(rng, (2, 2, L, 16), dtype), randn(rng, (2, 2, S, 16), dtype), randn(rng, (2, 2, S, 8), dtype)
    out = sdpa(q, k, v, is_causal="bottom_right")
    assert_close(out, ref_sdpa(q, k, v, is_causal="bottom_right"), dtype)
    if L > S:  # the first L - S rows see no key: zeros
        assert np.all(out[..., : L - S, :] == 0)
    if L == S:  # the two alignments agree
        np.testing.assert_array_equal(out, sdpa(q, k, v, is_causal=True))


@pytest.mark.parametrize("flag", [True, "top_left"])
def test_top_left_is_true(rng, flag):
    q, k, v = randn(rng, (1, 2, 40, 16), np.float32), randn(rng, (1, 2, 70, 16), np.float32), randn(rng, (1, 2, 70, 16), np.float32)
    out = sdpa(q, k, v, is_causal=flag, scale=0.3)
    assert_close(out, ref_sdpa(q, k, v, is_causal=True, scale=0.3), np.float32)
    np.testing.assert_array_equal(out, sdpa(q, k, v, is_causal=True, scale=0.3))


WINDOWS = [(0, 0), (5, 0), (0, 7), (40, 3), (None, 20), (130, None), (None, None)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True, "bottom_right"], ids=["none", "top_left", "bottom_right"])
def test_window(rng, window, is_causal):
    L, S = 70, 300
    q, k, v = randn(rng, (1, 2, L, 16), np.float32), randn(rng, (1, 2, S, 16), np.float32), randn(rng, (1, 2, S, 8), np.float32)
    inputs = copies({"q": q, "k": k, "v": v})
    out = sdpa(q, k, v, is_causal=is_causal, window=window)
    assert_close(out, ref_sdpa(q, k, v, is_causal=is_causal, window=window), np.float32)
    assert_unchanged(inputs, {"q": q, "k": k, "v": v})
    # The same as the explicit boolean mask.
    causal, bottom_right = is_causal is not False, is_causal == "bottom_right"
    explicit = open_positions(L, S, causal, bottom_right, window)
    assert_close(out, ref_sdpa(q, k, v, attn_mask=explicit), np.float32)


@pytest.mark.parametrize("L", [1, 5])
def test_window_on_the_decode_path(rng, L):
    S = 1000
    q, k, v = randn(rng, (1, 4, L, 32), np.float32), randn(rng, (1, 4, S, 32), np.float32), randn(rng, (1, 4, S, 32), np.float32)
    for window in [(0, 0), (100, 0), (300, None)]:
        out = sdpa(q, k, v, is_causal="bottom_right", window=window)
        assert_close(out, ref_sdpa(q, k, v, is_causal="bottom_right", window=window), np.float32)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_window_with_a_mask_and_gqa(rng, kind):
    L, S = 35, 140
    q, k, v = randn(rng, (2, 4, L, 16)), randn(rng, (2, 2, S, 16)), randn(rng, (2, 2, S, 16))
    mask = sdpa_mask(rng, kind, (2, 1, L, S), keep_one=False, masked_fraction=0.3)
    for dtype in (np.float32, np.float64):
        args = [x.astype(dtype) for x in (q, k, v)]
        out = sdpa(*args, attn_mask=mask, enable_gqa=True, window=(10, 2))
        assert_close(out, ref_sdpa(q, k, v, mask, enable_gqa=True, window=(10, 2)), dtype)


def test_window_with_batch_broadcast_and_out(rng):
    q, k, v = randn(rng, (3, 1, 2, 20, 8), np.float32), randn(rng, (2, 45, 8), np.float32), randn(rng, (2, 45, 8), np.float32)
    out = np.empty((3, 1, 2, 20, 8), np.float32)
    got = sdpa(q, k, v, is_causal="bottom_right", window=(4, 0), out=out)
    assert got is out
    assert_close(out, ref_sdpa(q, k, v, is_causal="bottom_right", window=(4, 0)), np.float32)


def test_window_equals_a_sliced_sdpa(rng):
    """A causal window of w keys over the last query is sdpa over the last w + 1 keys."""
    q, k, v = randn(rng, (1, 2, 1, 16), np.float32), randn(rng, (1, 2, 500, 16), np.float32), randn(rng, (1, 2, 500, 16), np.float32)
    windowed = sdpa(q, k, v, is_causal="bottom_right", window=(63, 0))
    sliced = sdpa(q, k[:, :, -64:], v[:, :, -64:])
    np.testing.assert_allclose(windowed, sliced, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Multi-head attention and the module
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L, S, extra", [(3, 7, {}), (7, 3, {}), (4, 9, {"bias_kv": True, "add_zero_attn": True})])
def test_mha_bottom_right(rng, L, S, extra):
    args = mha_args(rng, L=L, S=S, dtype=np.float32, **extra)
    args["is_causal"] = "bottom_right"
    out, weights = attnx.multi_head_attention_forward(**args)
    expected = ref_mha(**args)
    assert_close(out, expected[0], np.float32)
    assert_close(weights, expected[1], np.float32)
    explicit = {**args, "is_causal": False, "attn_mask": ~open_positions(L, S, True, True)}
    assert_close(out, ref_mha(**explicit)[0], np.float32)


def test_module_bottom_right_and_torch(rng, torch):
    mha = attnx.MultiheadAttention(16, 4, batch_first=True, seed=3)
    q, kv = randn(rng, (2, 3, 16), np.float32), randn(rng, (2, 8, 16), np.float32)
    out, w = mha(q, kv, kv, is_causal="bottom_right")
    tm = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    tm.load_state_dict({k: torch.from_numpy(x) for k, x in mha.state_dict().items()})
    with torch.no_grad(), quiet_torch():
        t_out, t_w = tm(*(torch.from_numpy(x) for x in (q, kv, kv)),
                        attn_mask=torch.from_numpy(~open_positions(3, 8, True, True)))
    np.testing.assert_allclose(out, t_out.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w, t_w.numpy(), rtol=1e-5, atol=1e-6)
    # The general path (with a key_padding_mask that masks nothing) agrees with the plain path.
    out2, _ = mha(q, kv, kv, key_padding_mask=np.zeros((2, 8), bool), is_causal="bottom_right")
    np.testing.assert_allclose(out2, out, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["bottom-right", "lower_right", "", 1, None, 2.0, np.array([True])])
def test_bad_is_causal(flag):
    q = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="is_causal.*'bottom_right'"):
        sdpa(q, q, q, is_causal=flag)
    args = mha_args(np.random.default_rng(0))
    with pytest.raises(ValueError, match="is_causal"):
        attnx.multi_head_attention_forward(**{**args, "is_causal": flag})
    with pytest.raises(ValueError, match="is_causal"):
        attnx.MultiheadAttention(8, 2)(args["query"], args["key"], args["value"], is_causal=flag)


def test_bottom_right_with_attn_mask_applies_both():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    mask = rng.random((3, 5)) < 0.7
    got = sdpa(q, k, k, attn_mask=mask, is_causal="bottom_right")
    want = reference.scaled_dot_product_attention(q.astype(np.float64), k, k, mask, is_causal="bottom_right")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window, error", [
    (3, TypeError), ("ab", TypeError), ((1, 2, 3), ValueError), ((1,), ValueError),
    ((-1, 0), ValueError), ((0, -2), ValueError), ((1.5, 0), TypeError), ((True, 0), TypeError),
    ((0, "1"), TypeError), ({1: 2}, TypeError),
])
def test_bad_window(window, error):
    q = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(error, match="window"):
        sdpa(q, q, q, window=window)


def test_window_accepts_numpy_integers_and_lists(rng):
    q, k, v = randn(rng, (1, 1, 4, 4), np.float32), randn(rng, (1, 1, 9, 4), np.float32), randn(rng, (1, 1, 9, 4), np.float32)
    a = sdpa(q, k, v, window=[np.int64(2), np.uint8(1)])
    np.testing.assert_array_equal(a, sdpa(q, k, v, window=(2, 1)))
    # A side longer than any sequence is unbounded.
    np.testing.assert_array_equal(sdpa(q, k, v, window=(2**70, None)), sdpa(q, k, v, window=(None, None)))
    assert_close(sdpa(q, k, v, window=(None, None)), to64(ref_sdpa(q, k, v)), np.float32)


def test_mask_values_outside_the_window_never_reach_a_row():
    # Found by the fuzzer: NaN/+inf mask values at keys the window closes must not matter.
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 9, 4)).astype(np.float32) for _ in range(3))
    mask = rng.standard_normal((9, 9)).astype(np.float32)
    mask[0, 5], mask[1, 8], mask[6, 0] = np.nan, np.inf, np.nan
    got = attnx.scaled_dot_product_attention(q, k, v, mask, window=(1, 2))
    expected = reference.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                                      v.astype(np.float64), mask, window=(1, 2))
    assert np.isfinite(got).all() and np.isfinite(expected).all()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
