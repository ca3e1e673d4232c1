"""int8 KV caches: each key and value row of each head quantized with its own float32 scale.

The storage is checked against a NumPy rewrite of the quantization (scale = max|x| / 127,
q = round half to even of x / scale, clipped to 127), whether the rows come from
``KVCache.append`` or from a step that appends in the core; attention over the cache equals
attention over the dequantized rows (scale * q) to float32 accuracy, on every kernel; and
against a float32 cache of the same rows it stays within 3e-2 on unit-normal data (about 5e-3
measured: docs/serving.md).
"""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest

import attnx
import attnx.reference as reference
from attnx import KVCache
from conftest import randn, run_under_isa, usable_isas

f32, i8 = np.float32, np.int8
INT8_BOUND = 3e-2  # vs a float32 cache, unit-normal keys and values


def quantize(x):
    """NumPy's rewrite of the int8 cache's rows: (int8 q, float32 scales)."""
    x = np.asarray(x).astype(f32)
    finite = np.isfinite(x).all(-1)
    amax = np.abs(np.where(np.isfinite(x), x, 0)).max(-1)
    scale = (amax / f32(127)).astype(f32)
    safe = np.where(scale > 0, scale, f32(1))[..., None]
    levels = np.rint(x / safe)
    q = np.clip(np.where(np.isfinite(levels), levels, 0), -127, 127).astype(i8)
    q[~(scale > 0) | ~finite] = 0
    return q, np.where(finite, scale, f32(np.nan)).astype(f32)


def dequantized(cache):
    """The float32 keys and values an int8 cache reads as."""
    k = cache.key.astype(f32) * cache.key_scales[..., None]
    v = cache.value.astype(f32) * cache.value_scales[..., None]
    return k, v


def filled(rng, B, H, S, D, dtype, lengths=None, max_len=None):
    k, v = randn(rng, (B, H, S, D), f32), randn(rng, (B, H, S, D), f32)
    cache = KVCache(B, H, max_len or S, D, dtype=dtype)
    cache.append(k, v, lengths)
    return cache, k, v


def test_rows_are_quantized_as_numpy_does(rng):
    x = randn(rng, (2, 3, 9, 40), f32)
    x[0, 0, 1] = 0  # a row of zeros: scale 0
    x[0, 1, 2] = 1e-44  # subnormal: its scale rounds to 0, the row reads as zeros
    x[1, 2, 3] = np.r_[127, np.arange(39) - 19.5]  # scale 1: halves, rounded to even
    x[1, 0, 4] *= 1e30  # large, finite
    given = x.copy()
    cache = KVCache(2, 3, 16, 40, dtype=i8)
    cache.append(x, x[..., ::-1])
    np.testing.assert_array_equal(x, given)  # the caller's array is left as it was
    assert cache.key_scales[1, 2, 3] == 1
    np.testing.assert_array_equal(cache.key[1, 2, 3, 1:7], [-20, -18, -18, -16, -16, -14])
    q, s = quantize(x)
    np.testing.assert_array_equal(cache.key[:, :, :9], q)
    np.testing.assert_array_equal(cache.key_scales[:, :, :9], s)
    qv, sv = quantize(x[..., ::-1])
    np.testing.assert_array_equal(cache.value[:, :, :9], qv)
    np.testing.assert_array_equal(cache.value_scales[:, :, :9], sv)
    assert cache.key_scales[0, 0, 1] == 0 and not cache.key[0, 0, 1].any()
    assert np.abs(cache.key[:, :, :9]).max() == 127


@pytest.mark.parametrize("dtype", [np.float64, np.float16, "bfloat16"])
def test_other_float_rows_are_taken_as_float32_first(rng, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    x = randn(rng, (1, 2, 5, 24), f32).astype(dtype)
    cache = KVCache(1, 2, 5, 24, dtype=i8)
    cache.append(x, x)
    q, s = quantize(x.astype(f32))
    np.testing.assert_array_equal(cache.key, q)
    np.testing.assert_array_equal(cache.key_scales, s)


def test_a_step_stores_what_numpy_quantizes(rng):
    """The core's quantization (a step appends in C++) equals the NumPy rewrite of the rows a
    float32 cache stores for the same step."""
    m = attnx.MultiheadAttention(32, 4, batch_first=True, seed=3)
    x = randn(rng, (2, 5, 32), f32)
    c32, c8 = m.new_cache(2, 8), m.new_cache(2, 8, dtype=i8)
    m.step(x, c32, lengths=[5, 3])
    m.step(x, c8, lengths=[5, 3])
    np.testing.assert_array_equal(c8.lengths, [5, 3])
    for b, n in enumerate([5, 3]):
        for arr, scales, ref in ((c8.key, c8.key_scales, c32.key), (c8.value, c8.value_scales, c32.value)):
            q, s = quantize(ref[b, :, :n])
            np.testing.assert_array_equal(arr[b, :, :n], q)
            np.testing.assert_array_equal(scales[b, :, :n], s)


@pytest.mark.parametrize("T", [1, 3, 40])  # one token, a few (row kernels), a prompt (tiles)
@pytest.mark.parametrize("D", [128, 40])
def test_attention_reads_scale_times_q(rng, T, D):
    """Equal to attention over the dequantized rows to float32 accuracy, and within the bound
    of attention over a float32 cache of the original rows."""
    B, Hk, Hq, S = 2, 2, 8, 700
    cache, k, v = filled(rng, B, Hk, S, D, i8, max_len=S + 5)
    q = randn(rng, (B, Hq, T, D), f32)
    got = attnx.cached_attention(q, cache)
    kd, vd = dequantized(cache)
    lengths = np.full(B, S)
    ref = reference.cached_attention(q, kd, vd, lengths, np.full(B, T))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)
    c32 = KVCache(B, Hk, S + 5, D)
    c32.append(k, v)
    assert np.abs(got - attnx.cached_attention(q, c32)).max() <= INT8_BOUND


def test_ragged_append_reset_and_lengths(rng):
    B, H, D = 3, 2, 16
    cache, k, v = filled(rng, B, H, 6, D, i8, lengths=[6, 2, 0], max_len=12)
    np.testing.assert_array_equal(cache.lengths, [6, 2, 0])
    k2, v2 = randn(rng, (B, H, 2, D), f32), randn(rng, (B, H, 2, D), f32)
    cache.append(k2, v2, lengths=[1, 2, 2])
    np.testing.assert_array_equal(cache.lengths, [7, 4, 2])
    np.testing.assert_array_equal(cache.key[1, :, 2:4], quantize(k2[1])[0])
    np.testing.assert_array_equal(cache.value_scales[0, :, 6], quantize(v2[0, :, :1])[1][:, 0])
    q = randn(rng, (B, 4, 2, D), f32)
    got = attnx.cached_attention(q, cache, lengths=[1, 2, 2])
    kd, vd = dequantized(cache)
    ref = reference.cached_attention(q, kd, vd, cache.lengths, [1, 2, 2])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)
    cache.reset(1)
    np.testing.assert_array_equal(cache.lengths, [7, 0, 2])
    cache.reset()
    np.testing.assert_array_equal(cache.lengths, [0, 0, 0])


def test_pickle_storage_repr_and_nbytes(rng):
    cache, _, _ = filled(rng, 2, 2, 5, 8, i8, lengths=[5, 3], max_len=9)
    assert cache.dtype == np.int8 and cache.key.dtype == np.int8
    assert repr(cache) == "KVCache(batch=2, num_kv_heads=2, max_len=9, head_dim=8, dtype=int8, lengths=[5, 3])"
    assert cache.nbytes == 2 * (2 * 2 * 9 * 8) + 2 * (2 * 2 * 9 * 4)
    key, value, lengths = cache.storage()
    scales = cache.scales()
    assert scales is not None and scales.key.shape == (2, 2, 9) and scales.key.dtype == f32
    assert key.flags.writeable and scales.value.flags.writeable
    assert not cache.key_scales.flags.writeable
    clone = pickle.loads(pickle.dumps(cache))
    for a, b in ((clone.key, cache.key), (clone.key_scales, cache.key_scales), (clone.value_scales, cache.value_scales)):
        np.testing.assert_array_equal(a[:, :, :5], b[:, :, :5])
    np.testing.assert_array_equal(clone.lengths, cache.lengths)
    q = randn(rng, (2, 4, 1, 8), f32)
    np.testing.assert_array_equal(attnx.cached_attention(q, clone), attnx.cached_attention(q, cache))
    assert KVCache(1, 1, 2, 4).scales() is None and KVCache(1, 1, 2, 4).key_scales is None
    assert KVCache(1, 1, 2, 4, dtype="int8").dtype == np.int8


def test_failed_appends_leave_the_cache_as_it_was(rng):
    cache, _, _ = filled(rng, 2, 2, 3, 8, i8, max_len=4)
    held = [a.copy() for a in (cache.key, cache.value, cache.key_scales, cache.value_scales, cache.lengths)]
    bad = [
        (randn(rng, (2, 2, 2, 8), f32), randn(rng, (2, 2, 2, 8), f32), ValueError),  # overflows max_len
        (randn(rng, (2, 2, 1, 7), f32), randn(rng, (2, 2, 1, 8), f32), ValueError),  # head_dim
        (randn(rng, (2, 2, 1, 8), f32), randn(rng, (2, 2, 2, 8), f32), ValueError),  # token counts
        (np.ones((2, 2, 1, 8), np.int8), randn(rng, (2, 2, 1, 8), f32), TypeError),  # int keys
    ]
    for k, v, error in bad:
        with pytest.raises(error):
            cache.append(k, v)
        for a, b in zip(held, (cache.key, cache.value, cache.key_scales, cache.value_scales, cache.lengths)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stage", ["attention", "output projection"])
def test_a_failed_step_leaves_an_int8_cache_as_it_was(rng, stage):
    from attnx import _testing

    m = attnx.MultiheadAttention(16, 2, seed=1)
    prompt, token = randn(rng, (3, 2, 16), f32), randn(rng, (1, 2, 16), f32)
    cache, fresh = m.new_cache(2, 6, dtype=i8), m.new_cache(2, 6, dtype=i8)
    m.step(prompt, cache, lengths=[3, 2])
    m.step(prompt, fresh, lengths=[3, 2])
    _testing.fail_next_step(stage)
    with pytest.raises(MemoryError):
        m.step(token, cache)
    np.testing.assert_array_equal(cache.lengths, [3, 2])
    np.testing.assert_array_equal(m.step(token, cache), m.step(token, fresh))


def test_non_finite_rows_reach_only_the_rows_that_attend_them(rng):
    """A row holding NaN or an infinity is stored with scale NaN: the outputs of its sequence's
    query heads that read it are NaN, every other output is finite."""
    B, Hk, Hq, S, D = 2, 2, 4, 6, 8
    k, v = randn(rng, (B, Hk, S, D), f32), randn(rng, (B, Hk, S, D), f32)
    k[0, 1, 2, 3] = np.inf
    v[1, 0, 4, 0] = np.nan
    cache = KVCache(B, Hk, S, D, dtype=i8)
    cache.append(k, v)
    assert np.isnan(cache.key_scales[0, 1, 2]) and not cache.key[0, 1, 2].any()
    assert np.isnan(cache.value_scales[1, 0, 4])
    out = attnx.cached_attention(randn(rng, (B, Hq, 1, D), f32), cache)
    nan = np.isnan(out).any(-1)[..., 0]
    np.testing.assert_array_equal(nan, [[False, False, True, True], [True, True, False, False]])
    assert np.isfinite(out[~nan]).all()


def test_results_do_not_depend_on_the_thread_count(rng):
    cache, _, _ = filled(rng, 1, 2, 2100, 64, i8)  # several key chunks per head
    q = randn(rng, (1, 8, 1, 64), f32)
    before = attnx.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            attnx.set_num_threads(n)
            outs.append(attnx.cached_attention(q, cache))
    finally:
        attnx.set_num_threads(before)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_bad_inputs():
    cache = KVCache(1, 2, 4, 8, dtype=i8)
    with pytest.raises(TypeError, match="query"):
        attnx.cached_attention(np.ones((1, 2, 1, 8), np.int8), cache)
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16, bfloat16 or int8"):
        KVCache(1, 2, 4, 8, dtype=np.uint8)
    with pytest.raises(ValueError, match="query must have shape"):
        attnx.cached_attention(np.ones((1, 3, 1, 8), f32), cache)
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16"):
        attnx.MultiheadAttention(8, 2, dtype=np.int8)  # a cache dtype, not a parameter dtype


def test_out_must_not_alias_the_scales():
    cache = KVCache(1, 1, 4, 8, dtype=i8, value_dim=1)
    cache.append(np.ones((1, 1, 4, 8), f32), np.ones((1, 1, 4, 1), f32))
    scales = cache.scales()
    assert scales is not None
    for held in (scales.key, scales.value):
        with pytest.raises(ValueError, match="out must not share memory"):
            attnx.cached_attention(np.ones((1, 1, 4, 8), f32), cache, out=held.reshape(1, 1, 4, 1))


def test_core_quantize_checks_its_arrays():
    from attnx import _core

    src = np.ones((3, 8), f32)
    with pytest.raises(ValueError, match="do not agree"):
        _core.quantize_int8(src, np.empty((3, 7), np.int8), np.empty(3, f32))
    with pytest.raises(TypeError, match="dst"):
        _core.quantize_int8(src, np.empty((3, 8), np.int16), np.empty(3, f32))
    with pytest.raises(TypeError, match="src"):
        _core.quantize_int8(src.astype(np.int32), np.empty((3, 8), np.int8), np.empty(3, f32))
    q, s = np.empty((3, 8), np.int8), np.empty(3, f32)
    _core.quantize_int8(src[:, :], q, s)
    assert (q == 127).all() and np.allclose(s, 1 / 127)


QUANTIZE_SCRIPT = """
import json
import numpy as np
import attnx
from attnx import _core
rng = np.random.default_rng(8)
rows = []
for n in (1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 129):
    x = (rng.standard_normal((6, n)) * 10.0 ** rng.integers(-40, 39, (6, 1))).astype(np.float32)
    x[0] = np.arange(n) - n / 2 + 0.5  # halves, to even
    x[0, -1] = 127.0  # scale 1
    x[1, -1] = np.nan
    x[2, 0] = -np.inf
    x[3] = 0.0
    x[3, n // 2] = -0.0
    x[4, :] = 1e-44  # subnormal: scale 0
    # Levels just below a half, which x * (1 / scale) would round up: a division it must be.
    x[5] = np.resize(np.float32([0.9473482966423035, 0.5519333481788635, 0.7166895866394043]), n)
    x[5, 0] = 2.0924041271209717
    q, s = np.empty(x.shape, np.int8), np.empty(6, np.float32)
    _core.quantize_int8(x, q, s)
    rows.append([x.tolist(), q.tolist(), s.tolist()])
print(json.dumps({"isa": attnx.show_config()["isa"], "rows": rows}))
"""


@pytest.mark.parametrize("isa", usable_isas())
def test_every_kernel_quantizes_rows_as_numpy_does(isa):
    """The int8 tables quantize on their own vectors (the query rows of every "int8" step,
    every appended row): whole vectors and tails, NaN, infinity, zeros, subnormals, halves and
    magnitudes from 1e-40 to 1e38 give NumPy's levels and scales bit for bit."""
    result = run_under_isa(isa, QUANTIZE_SCRIPT)
    for x, q, s in result["rows"]:
        want_q, want_s = quantize(np.array(x, f32))
        np.testing.assert_array_equal(np.array(q, i8), want_q)
        np.testing.assert_array_equal(np.array(s, f32), want_s)


def test_transformer_decoder_steps_over_int8_caches(rng):
    torch = pytest.importorskip("torch")
    layer = torch.nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    dec = attnx.TransformerDecoder.from_torch(torch.nn.TransformerDecoder(layer, 2).eval())
    memory, tgt = randn(rng, (2, 7, 32), f32), randn(rng, (2, 6, 32), f32)
    cache = dec.new_cache(2, 16, dtype=i8)
    assert cache.dtype == np.int8
    outs = [dec.step(tgt[:, :3], memory, cache)] + [dec.step(tgt[:, t : t + 1], memory, cache) for t in range(3, 6)]
    full = dec(tgt, memory, tgt_mask=attnx.Transformer.generate_square_subsequent_mask(6), tgt_is_causal=True)
    assert np.abs(np.concatenate(outs, 1) - full).max() <= INT8_BOUND


def test_multi_head_attention_step_function(rng):
    m = attnx.MultiheadAttention(16, 4, seed=2)
    x = randn(rng, (2, 3, 16), f32)
    c8, c32 = m.new_cache(3, 4, dtype=i8), m.new_cache(3, 4)
    args = (m.num_heads, m.in_proj_weight, m.in_proj_bias, m.out_proj_weight, m.out_proj_bias)
    got = attnx.multi_head_attention_step(x, c8, *args)
    assert np.abs(got - attnx.multi_head_attention_step(x, c32, *args)).max() <= INT8_BOUND


ISA_SCRIPT = """
import json, sys
import numpy as np
import attnx, attnx.reference as reference
rng = np.random.default_rng(5)
worst_ref = worst_f32 = 0.0
for D in (128, 40, 16, 7):
    for T in (1, 2, 5, 40):
        B, Hk, Hq, S = 2, 2, 8, 300
        k = rng.standard_normal((B, Hk, S, D)).astype(np.float32)
        v = rng.standard_normal((B, Hk, S, D)).astype(np.float32)
        q = rng.standard_normal((B, Hq, T, D)).astype(np.float32)
        c8 = attnx.KVCache(B, Hk, S, D, dtype=np.int8); c8.append(k, v, lengths=[S, S - 17])
        c32 = attnx.KVCache(B, Hk, S, D); c32.append(k, v, lengths=[S, S - 17])
        got = attnx.cached_attention(q, c8, lengths=[T, T])
        kd = c8.key.astype(np.float32) * c8.key_scales[..., None]
        vd = c8.value.astype(np.float32) * c8.value_scales[..., None]
        ref = reference.cached_attention(q, kd, vd, c8.lengths, [T, T])
        worst_ref = max(worst_ref, float(np.abs(got - ref).max()))
        worst_f32 = max(worst_f32, float(np.abs(got - attnx.cached_attention(q, c32, lengths=[T, T])).max()))
print(json.dumps({"isa": attnx.show_config()["isa"], "ref": worst_ref, "f32": worst_f32}))
"""


@pytest.mark.parametrize("isa", usable_isas())
def test_every_kernel_reads_int8(isa):
    """Each kernel's int8 row kernels (and the widened blocks of the tile path): head dims
    below, at and above the vector widths, one to forty query tokens, ragged lengths."""
    result = run_under_isa(isa, ISA_SCRIPT)
    assert result["ref"] <= 2e-6, result
    assert result["f32"] <= INT8_BOUND, result
    assert math.isfinite(result["f32"]) and json.dumps(result)
