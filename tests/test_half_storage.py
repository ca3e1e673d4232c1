"""float16 and bfloat16 (ml_dtypes) storage: computed in float32, returned in the input dtype.

A half-precision result must be the float32 result rounded to its dtype: within half an ulp
(plus float32's own error) of the float64 reference computed from the same stored values.
float16/bfloat16 keys and values of a float32 computation are read in place, never converted.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import attnx
from conftest import (
    assert_close,
    assert_unchanged,
    copies,
    mha_args,
    peak_traced_bytes,
    randn,
    ref_mha,
    ref_sdpa,
    sdpa_mask,
    to64,
)

f32, f64 = np.float32, np.float64
sdpa = attnx.scaled_dot_product_attention


def half(name):
    """np.float16, or ml_dtypes.bfloat16 (the test skips without ml_dtypes)."""
    if name == "f16":
        return np.dtype(np.float16)
    return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


HALVES = ["f16", "bf16"]


def assert_half_close(actual, expected64, dtype):
    """``actual`` has ``dtype`` and is ``expected64`` rounded to it (float32 error allowed)."""
    dtype = np.dtype(dtype)
    assert actual.dtype == dtype, (actual.dtype, dtype)
    assert actual.shape == expected64.shape
    eps = 2.0**-10 if dtype == np.float16 else 2.0**-7  # the spacing of values in [1, 2)
    a, e = actual.astype(f64), np.asarray(expected64, f64)
    bound = (eps / 2 + 1e-5) * np.abs(e) + 1e-6
    excess = np.abs(a - e) - bound
    assert np.all(excess <= 0), f"off by up to {np.max(np.abs(a - e))} (bound {bound.flat[np.argmax(excess)]})"


# ---------------------------------------------------------------------------------------------
# sdpa
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("L, S, options", [
    (1, 300, {}),
    (33, 129, {"is_causal": True}),
    (20, 50, {"is_causal": "bottom_right", "window": (8, 0)}),
    (7, 40, {"mask": "float"}),
    (7, 40, {"mask": "bool"}),
])
def test_sdpa_half_query_returns_its_dtype(rng, name, L, S, options):
    dtype = half(name)
    options = dict(options)
    q, k, v = randn(rng, (2, 2, L, 16), dtype), randn(rng, (2, 2, S, 16), dtype), randn(rng, (2, 2, S, 8), dtype)
    mask = options.pop("mask", None)
    if mask is not None:
        mask = sdpa_mask(rng, mask, (L, S), np.float16)
    inputs = copies({"q": q, "k": k, "v": v, "mask": mask})
    out = sdpa(q, k, v, attn_mask=mask, **options)
    assert_unchanged(inputs, {"q": q, "k": k, "v": v, "mask": mask})
    assert_half_close(out, ref_sdpa(q, k, v, mask, **options), dtype)


@pytest.mark.parametrize("name", HALVES)
def test_sdpa_float32_query_over_half_keys_and_values(rng, name):
    dtype = half(name)
    q = randn(rng, (2, 8, 5, 32), f32)
    k, v = randn(rng, (2, 2, 200, 32), dtype), randn(rng, (2, 2, 200, 16), dtype)
    for options in ({}, {"is_causal": "bottom_right"}, {"is_causal": True, "window": (30, 0)}):
        out = sdpa(q, k, v, enable_gqa=True, **options)
        assert_close(out, ref_sdpa(q, k, v, enable_gqa=True, **options), f32)
    # Mixed: float16 key with a float32 value.
    out = sdpa(q, k, v.astype(f32), enable_gqa=True)
    assert_close(out, ref_sdpa(q, k, v, enable_gqa=True), f32)


@pytest.mark.parametrize("name", HALVES)
def test_half_keys_and_values_are_not_converted(rng, name):
    dtype = half(name)
    k = randn(rng, (1, 4, 16384, 64), dtype)  # 8 MiB: a float32 copy would be 16 MiB
    q = randn(rng, (1, 4, 1, 64), f32)
    out, peak = peak_traced_bytes(lambda: sdpa(q, k, k, is_causal="bottom_right"))
    assert peak < k.nbytes // 64, f"{peak} bytes allocated for {k.nbytes} bytes of keys"
    assert out.dtype == f32


def test_half_out(rng):
    q, k = randn(rng, (1, 2, 4, 8), np.float16), randn(rng, (1, 2, 6, 8), np.float16)
    out = np.empty((1, 2, 4, 8), np.float16)
    assert sdpa(q, k, k, scale=0.5, out=out) is out
    assert_half_close(out, ref_sdpa(q, k, k, scale=0.5), np.float16)
    with pytest.raises(TypeError, match="out has dtype float32, the result has dtype float16"):
        sdpa(q, k, k, out=np.empty((1, 2, 4, 8), f32))


def test_float64_query_converts_half_keys(rng):
    q, k, v = randn(rng, (2, 3, 8)), randn(rng, (2, 5, 8), np.float16), randn(rng, (2, 5, 4), np.float16)
    out = sdpa(q, k, v, is_causal="bottom_right")
    assert_close(out, ref_sdpa(q, k, v, is_causal="bottom_right"), f64)
    # A half query with float64 keys: computed in float32, returned as float16.
    out = sdpa(q.astype(np.float16), k.astype(f64), v, window=(1, 1))
    assert_half_close(out, ref_sdpa(q.astype(np.float16), k.astype(f32), v, window=(1, 1)), np.float16)


def test_half_byte_order_and_layouts(rng):
    q, k = randn(rng, (1, 2, 3, 8), np.float16), randn(rng, (1, 2, 9, 8), np.float16)
    expected = ref_sdpa(q, k, k)
    for key in (k.astype(">f2"), np.asfortranarray(k), k[:, ::-1][:, ::-1], np.repeat(k, 2, axis=-1)[..., ::2]):
        assert_half_close(sdpa(q, key, key), expected, np.float16)
    assert_half_close(sdpa(q.astype(">f2"), k, k), expected, np.float16)


def test_other_float_queries_still_raise():
    q = np.ones((1, 2, 3, 4), np.float32)
    if np.dtype(np.longdouble) != f64:
        with pytest.raises(TypeError, match="query"):
            sdpa(q.astype(np.longdouble), q, q)
    with pytest.raises(TypeError, match="key must be a floating-point array"):
        sdpa(q, q.astype(np.int16), q)


# ---------------------------------------------------------------------------------------------
# Multi-head attention and the module
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HALVES)
def test_mha_half_inputs(rng, name):
    dtype = half(name)
    args = mha_args(rng, L=5, S=7, dtype=dtype, bias_kv=True)
    args["key_padding_mask"] = np.arange(7) >= np.array([[7], [4]])
    inputs = copies(args)
    out, weights = attnx.multi_head_attention_forward(**args)
    assert_unchanged(inputs, args)
    expected = ref_mha(**args)
    assert_half_close(out, expected[0], dtype)
    assert_half_close(weights, expected[1], dtype)
    out, _ = attnx.multi_head_attention_forward(**{**args, "is_causal": "bottom_right", "key_padding_mask": None})
    assert_half_close(out, ref_mha(**{**args, "is_causal": "bottom_right", "key_padding_mask": None})[0], dtype)


@pytest.mark.parametrize("name", HALVES)
def test_half_module(rng, name):
    dtype = half(name)
    m = attnx.MultiheadAttention(16, 4, batch_first=True, dtype=dtype if name == "f16" else "bfloat16", seed=0)
    assert m.dtype == dtype and m.in_proj_weight.dtype == dtype
    sd = m.state_dict()
    assert all(x.dtype == dtype for x in sd.values())
    twin = attnx.MultiheadAttention(16, 4, batch_first=True, dtype=dtype, seed=1)
    twin.load_state_dict(sd)
    for key, value in twin.state_dict().items():
        np.testing.assert_array_equal(value, sd[key])
    x = randn(rng, (2, 6, 16), f32)  # converted to the module's dtype, as any input
    out, weights = m(x, x, x, is_causal=True)
    params = {a: getattr(m, a) for a in ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias")}
    expected = ref_mha(query=x.astype(dtype), key=x.astype(dtype), value=x.astype(dtype), embed_dim_to_check=16,
                       num_heads=4, bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
                       is_causal=True, batch_first=True, **params)
    assert_half_close(out, expected[0], dtype)
    assert_half_close(weights, expected[1], dtype)
    clone = pickle.loads(pickle.dumps(m))
    np.testing.assert_array_equal(clone(x, x, x)[0], m(x, x, x)[0])
    # Decoding with the module's own (half) cache.
    cache = m.new_cache(2, 6)
    assert cache.dtype == dtype
    steps = np.concatenate([m.step(x[:, :3], cache)] + [m.step(x[:, t : t + 1], cache) for t in range(3, 6)], axis=1)
    assert steps.dtype == dtype
    np.testing.assert_allclose(steps.astype(f64), out.astype(f64), rtol=0.05, atol=0.05)


@pytest.mark.torch
def test_from_torch_float16_module():
    torch = pytest.importorskip("torch")
    tm = torch.nn.MultiheadAttention(8, 2, dtype=torch.float16)
    am = attnx.MultiheadAttention.from_torch(tm)
    assert am.dtype == np.float16
    np.testing.assert_array_equal(am.in_proj_weight, tm.in_proj_weight.detach().numpy())
    x = np.random.default_rng(0).standard_normal((3, 1, 8)).astype(np.float16)
    out, _ = am(x, x, x)
    expected = ref_mha(query=x, key=x, value=x, embed_dim_to_check=8, num_heads=2,
                       in_proj_weight=am.in_proj_weight, in_proj_bias=am.in_proj_bias, bias_k=None, bias_v=None,
                       add_zero_attn=False, dropout_p=0.0, out_proj_weight=am.out_proj_weight,
                       out_proj_bias=am.out_proj_bias)
    assert_half_close(out, expected[0], np.float16)


# ---------------------------------------------------------------------------------------------
# Caches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HALVES)
def test_half_cache_and_half_query(rng, name):
    dtype = half(name)
    cache = attnx.KVCache(2, 2, 50, 16, dtype)
    k, v = randn(rng, (2, 2, 9, 16)), randn(rng, (2, 2, 9, 16))
    q = randn(rng, (2, 4, 9, 16), dtype)
    out = attnx.cached_attention(q, cache, k, v, lengths=[9, 6])
    expected = attnx.reference.cached_attention(to64(q), to64(cache.key), to64(cache.value), cache.lengths.copy(), [9, 6])
    assert_half_close(out, expected, dtype)
    # A float32 query over the same cache: a float32 result.
    q32 = randn(rng, (2, 4, 1, 16), f32)
    out = attnx.cached_attention(q32, cache, window=(4, 0))
    expected = attnx.reference.cached_attention(q32, to64(cache.key), to64(cache.value), cache.lengths.copy(), window=(4, 0))
    assert_close(out, expected, f32)
