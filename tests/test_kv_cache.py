"""KVCache, cached_attention and decoding with MultiheadAttention.step.

cached_attention is checked against ``attnx.reference.cached_attention`` (float64, on the
values the cache holds) and, where torch is installed, against torch's sdpa with an explicit
per-sequence mask. Decoding token by token with ``step`` must give the outputs of one full
causal forward pass, for ragged batches too. The cache must never be copied.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import attnx
import attnx.reference as reference
from conftest import (
    assert_close,
    assert_unchanged,
    copies,
    peak_traced_bytes,
    quiet_torch,
    randn,
)

f32, f64 = np.float32, np.float64
KVCache = attnx.KVCache


def ref_cached(q, cache, n=None, **kwargs):
    """The reference over the values the cache holds, in float64."""
    return reference.cached_attention(
        np.asarray(q).astype(f64), cache.key.astype(f64), cache.value.astype(f64), cache.lengths.copy(),
        n, **kwargs,
    )


def random_module(rng, E, H, dtype=f32, **kwargs):
    """A module with random biases too (torch's are zeros at init)."""
    m = attnx.MultiheadAttention(E, H, dtype=dtype, seed=int(rng.integers(1000)), **kwargs)
    m.load_state_dict({k: rng.standard_normal(v.shape) / math.sqrt(E) for k, v in m.state_dict().items()})
    return m


# ---------------------------------------------------------------------------------------------
# KVCache
# ---------------------------------------------------------------------------------------------


def test_cache_attributes_and_read_only_views():
    c = KVCache(2, 3, 10, 4, value_dim=5)
    assert (c.batch, c.num_kv_heads, c.max_len, c.head_dim, c.value_dim) == (2, 3, 10, 4, 5)
    assert c.dtype == f32
    assert c.key.shape == (2, 3, 10, 4) and c.value.shape == (2, 3, 10, 5)
    assert c.lengths.dtype == np.int64 and c.lengths.tolist() == [0, 0]
    assert c.nbytes == (2 * 3 * 10 * (4 + 5)) * 4
    assert not c.key.any() and not c.value.any()
    for view in (c.key, c.value, c.lengths):
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0] = 1
    assert repr(c) == "KVCache(batch=2, num_kv_heads=3, max_len=10, head_dim=4, value_dim=5, dtype=float32, lengths=[0, 0])"
    assert "dtype=float16" in repr(KVCache(1, 1, 2, 2, np.float16))
    assert KVCache(1, 1, 2, 2, "float64").dtype == f64


@pytest.mark.parametrize("dtype", [np.float16, f32, f64])
def test_cache_rows_start_on_cache_lines(dtype):
    """The storage starts on a 64-byte line (NumPy's large arrays start 16 bytes past one), so
    that with a head dim of whole lines every row does, for the kernels' vector loads; a pickled
    copy too."""
    c = KVCache(2, 4, 3000, 64, dtype)
    copy = pickle.loads(pickle.dumps(c))
    for cache in (c, copy):
        for storage in (cache.key, cache.value):
            assert storage.ctypes.data % 64 == 0 and storage.flags.c_contiguous
            assert storage.dtype == dtype and storage.shape == (2, 4, 3000, 64)


def test_cache_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in (ml_dtypes.bfloat16, "bfloat16"):
        c = KVCache(1, 2, 8, 4, dtype)
        assert c.dtype == np.dtype(ml_dtypes.bfloat16) and c.nbytes == 2 * 2 * 8 * 4 * 2
    x = np.linspace(-2, 2, 1 * 2 * 3 * 4).reshape(1, 2, 3, 4)
    c.append(x, x)
    np.testing.assert_array_equal(c.key[:, :, :3], x.astype(ml_dtypes.bfloat16))
    assert pickle.loads(pickle.dumps(c)).key.dtype == c.dtype


@pytest.mark.parametrize("dtype", [f32, f64, np.float16])
def test_append_uniform_and_ragged(rng, dtype):
    c = KVCache(3, 2, 8, 4, dtype, value_dim=3)
    k1, v1 = randn(rng, (3, 2, 2, 4)), randn(rng, (3, 2, 2, 3))
    c.append(k1, v1)
    assert c.lengths.tolist() == [2, 2, 2]
    np.testing.assert_array_equal(c.key[:, :, :2], k1.astype(dtype))
    np.testing.assert_array_equal(c.value[:, :, :2], v1.astype(dtype))
    k2, v2 = randn(rng, (3, 2, 4, 4), f32), randn(rng, (3, 2, 4, 3), f32)
    c.append(k2, v2, lengths=np.array([4, 0, 1], np.int32))
    assert c.lengths.tolist() == [6, 2, 3]
    np.testing.assert_array_equal(c.key[0, :, 2:6], k2[0].astype(dtype))
    np.testing.assert_array_equal(c.value[2, :, 2:3], v2[2, :, :1].astype(dtype))
    assert not c.key[1, :, 2:].any() and not c.key[2, :, 3:].any()  # nothing past each length
    c.append(k2[:, :, :1], v2[:, :, :1])  # again uneven starts, all 1 token
    assert c.lengths.tolist() == [7, 3, 4]
    np.testing.assert_array_equal(c.key[1, :, 2], k2[1, :, 0].astype(dtype))
    c.append(k2[:, :, :0], v2[:, :, :0])  # T = 0: nothing
    assert c.lengths.tolist() == [7, 3, 4]


def test_append_overflow_writes_nothing(rng):
    c = KVCache(2, 1, 5, 2)
    c.append(randn(rng, (2, 1, 3, 2)), randn(rng, (2, 1, 3, 2)), lengths=[3, 1])
    before = (c.key.copy(), c.value.copy(), c.lengths.copy())
    k, v = randn(rng, (2, 1, 3, 2)), randn(rng, (2, 1, 3, 2))
    with pytest.raises(ValueError, match=r"max_len 5.*overflows sequence\(s\) \[0\]"):
        c.append(k, v)
    with pytest.raises(ValueError, match="max_len"):
        attnx.cached_attention(randn(rng, (2, 1, 3, 2), f32), c, k, v)
    for a, b in zip(before, (c.key, c.value, c.lengths)):
        np.testing.assert_array_equal(a, b)
    c.append(k, v, lengths=[2, 3])  # exactly full
    assert c.lengths.tolist() == [5, 4]


def test_append_errors(rng):
    c = KVCache(2, 3, 6, 4, value_dim=2)
    k, v = randn(rng, (2, 3, 2, 4)), randn(rng, (2, 3, 2, 2))
    cases = [
        (dict(key=k[:1], value=v), ValueError, r"key must have shape .*\(2, 3, T, 4\).*got \(1, 3, 2, 4\)"),
        (dict(key=k[..., :3], value=v), ValueError, "key must have shape"),
        (dict(key=k, value=v[..., :1]), ValueError, r"value must have shape .*\(2, 3, T, 2\)"),
        (dict(key=k, value=v[:, :, :1]), ValueError, "key and value must hold the same number"),
        (dict(key=k[0], value=v), ValueError, "key must have shape"),
        (dict(key=k.astype(int), value=v), TypeError, "key must be a floating-point array"),
        (dict(key=k, value=v.astype(complex)), TypeError, "value must be a floating-point array"),
        (dict(key=k, value=v, lengths=[1, 3]), ValueError, r"lengths must be in \[0, 2\]"),
        (dict(key=k, value=v, lengths=[1, -1]), ValueError, "lengths must be in"),
        (dict(key=k, value=v, lengths=[1]), ValueError, r"lengths must have shape \(2,\)"),
        (dict(key=k, value=v, lengths=[1.0, 1.0]), TypeError, "lengths must be an array of integers"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            c.append(**kwargs)
    assert c.lengths.tolist() == [0, 0] and not c.key.any()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(batch=0), ValueError, "batch must be a positive integer"),
        (dict(num_kv_heads=1.5), TypeError, "num_kv_heads must be a positive integer"),
        (dict(max_len=-1), ValueError, "max_len must be a positive integer"),
        (dict(head_dim=True), TypeError, "head_dim must be a positive integer"),
        (dict(value_dim=0), ValueError, "value_dim must be a positive integer"),
        (dict(dtype=np.int32), TypeError, "dtype must be float32, float64, float16, bfloat16 or int8"),
        (dict(dtype=np.complex64), TypeError, "dtype must be"),
        (dict(dtype="nonsense"), TypeError, "dtype must be"),
        (dict(dtype=np.longdouble), TypeError, "dtype must be"),
    ],
)
def test_cache_constructor_errors(kwargs, error, match):
    args = dict(batch=1, num_kv_heads=1, max_len=4, head_dim=2)
    if kwargs.get("dtype") is np.longdouble and np.dtype(np.longdouble) == f64:
        pytest.skip("longdouble is float64 here")
    with pytest.raises(error, match=match):
        KVCache(**{**args, **kwargs})


def test_reset(rng):
    c = KVCache(3, 1, 4, 2)
    c.append(randn(rng, (3, 1, 2, 2)), randn(rng, (3, 1, 2, 2)))
    c.reset(1)
    assert c.lengths.tolist() == [2, 0, 2]
    c.reset(-1)
    assert c.lengths.tolist() == [2, 0, 0]
    c.append(randn(rng, (3, 1, 2, 2)), randn(rng, (3, 1, 2, 2)))  # the slots are reused
    assert c.lengths.tolist() == [4, 2, 2]
    c.reset()
    assert c.lengths.tolist() == [0, 0, 0]
    with pytest.raises(IndexError, match="index 3"):
        c.reset(3)
    with pytest.raises(TypeError, match="index"):
        c.reset("0")
    with pytest.raises(TypeError, match="index"):
        c.reset(True)


@pytest.mark.parametrize("dtype", [f32, np.float16])
def test_pickle_round_trip_and_continue(rng, dtype):
    c = KVCache(2, 2, 12, 4, dtype)
    c.append(randn(rng, (2, 2, 5, 4)), randn(rng, (2, 2, 5, 4)), lengths=[5, 2])
    twin = pickle.loads(pickle.dumps(c))
    assert repr(twin) == repr(c) and twin.dtype == c.dtype
    for name in ("key", "value", "lengths"):
        np.testing.assert_array_equal(getattr(twin, name), getattr(c, name))
    k, v = randn(rng, (2, 2, 1, 4)), randn(rng, (2, 2, 1, 4))
    q = randn(rng, (2, 4, 1, 4), f32)
    a = attnx.cached_attention(q, c, k, v)
    b = attnx.cached_attention(q, twin, k, v)
    np.testing.assert_array_equal(a, b)
    assert len(pickle.dumps(c)) < c.nbytes  # only the positions in use travel


# ---------------------------------------------------------------------------------------------
# cached_attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [f32, f64], ids=["f32", "f64"])
def test_cached_attention_ragged_gqa(rng, Hq, Hkv, dtype):
    B, E, Ev = 3, 16, 8
    cache = KVCache(B, Hkv, 40, E, dtype, value_dim=Ev)
    # A ragged prefill: 5, 0 and 3 prompt tokens.
    n = np.array([5, 0, 3])
    q, k, v = randn(rng, (B, Hq, 5, E), dtype), randn(rng, (B, Hkv, 5, E)), randn(rng, (B, Hkv, 5, Ev))
    inputs = copies({"q": q, "k": k, "v": v})
    out = attnx.cached_attention(q, cache, k, v, lengths=n)
    assert_unchanged(inputs, {"q": q, "k": k, "v": v})
    assert cache.lengths.tolist() == [5, 0, 3]
    assert_close(out, ref_cached(q, cache, n), dtype)
    assert np.all(out[1] == 0) and np.all(out[2, :, 3:] == 0)
    # Each sequence alone is sdpa with bottom-right alignment over its cached keys.
    for b in (0, 2):
        alone = attnx.scaled_dot_product_attention(
            q[b, :, : n[b]], cache.key[b, :, : n[b]], cache.value[b, :, : n[b]], is_causal="bottom_right",
            enable_gqa=True)
        np.testing.assert_allclose(out[b, :, : n[b]], alone, rtol=1e-6, atol=1e-7)
    # Decode steps: one token for some sequences, none for others.
    for step_n in ([1, 1, 0], [1, 1, 1], [0, 1, 1]):
        q1, k1, v1 = randn(rng, (B, Hq, 1, E), dtype), randn(rng, (B, Hkv, 1, E)), randn(rng, (B, Hkv, 1, Ev))
        out = attnx.cached_attention(q1, cache, k1, v1, lengths=step_n)
        assert_close(out, ref_cached(q1, cache, step_n), dtype)
    assert cache.lengths.tolist() == [7, 3, 5]
    # Without key/value: the query tokens are the newest ones already in the cache.
    q2 = randn(rng, (B, Hq, 2, E), dtype)
    out = attnx.cached_attention(q2, cache, lengths=[2, 1, 2], scale=0.2)
    assert_close(out, ref_cached(q2, cache, [2, 1, 2], scale=0.2), dtype)
    assert cache.lengths.tolist() == [7, 3, 5]


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (100, None)])
def test_cached_attention_window(rng, window):
    B, H, E, S = 2, 2, 32, 600
    cache = KVCache(B, H, S, E)
    cache.append(randn(rng, (B, H, S, E)), randn(rng, (B, H, S, E)), lengths=[S, 350])
    for T, n in ((1, None), (4, [4, 2])):
        q = randn(rng, (B, 2 * H, T, E), f32)
        out = attnx.cached_attention(q, cache, lengths=n, window=window)
        assert_close(out, ref_cached(q, cache, n, window=window), f32)


def test_cached_attention_out_and_empty(rng):
    cache = KVCache(2, 1, 8, 4)
    q, k, v = randn(rng, (2, 2, 3, 4), f32), randn(rng, (2, 1, 3, 4)), randn(rng, (2, 1, 3, 4))
    out = np.empty((2, 2, 3, 4), f32)
    assert attnx.cached_attention(q, cache, k, v, out=out) is out
    assert_close(out, ref_cached(q, cache), f32)
    empty = attnx.cached_attention(q[:, :, :0], cache, k[:, :, :0], v[:, :, :0])
    assert empty.shape == (2, 2, 0, 4) and cache.lengths.tolist() == [3, 3]
    # A float64 query over a float32 cache computes in float32 (the cache decides) and
    # returns float64.
    out64 = attnx.cached_attention(q.astype(f64), cache)
    assert out64.dtype == f64
    np.testing.assert_allclose(out64, ref_cached(q, cache), rtol=1e-5, atol=1e-6)


@pytest.mark.torch
def test_cached_attention_agrees_with_torch(rng):
    torch = pytest.importorskip("torch")
    B, H, E, S, T = 3, 2, 8, 12, 3
    cache = KVCache(B, H, S, E, f64)
    cache.append(randn(rng, (B, H, 9, E)), randn(rng, (B, H, 9, E)), lengths=[9, 4, 6])
    n = np.array([3, 1, 2])
    q = randn(rng, (B, H, T, E))
    ours = attnx.cached_attention(q, cache, lengths=n)
    klen = cache.lengths
    t, j = np.arange(T)[:, None], np.arange(S)[None, :]
    allowed = np.stack([(j < klen[b]) & (j <= klen[b] - n[b] + t) & (t < n[b]) for b in range(B)])[:, None]
    with quiet_torch():
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(np.ascontiguousarray(x)) for x in (q, cache.key, cache.value)),
            attn_mask=torch.from_numpy(allowed)).numpy()
    rows = np.broadcast_to(allowed.any(-1), ours.shape[:-1])
    np.testing.assert_allclose(ours[rows], theirs[rows], rtol=1e-12, atol=1e-12)
    assert np.all(ours[~rows] == 0)


@pytest.mark.parametrize("dtype", [f32, np.float16])
def test_cached_attention_does_not_copy_the_cache(rng, dtype):
    B, H, S, E = 2, 4, 8192, 64
    cache = KVCache(B, H, S, E, dtype)  # 8 MiB of keys and 8 of values in float16
    block = randn(rng, (B, H, 1024, E), dtype)
    for _ in range(S // 1024):
        cache.append(block, block)
    q = randn(rng, (B, 2 * H, 1, E), f32)
    out, peak = peak_traced_bytes(lambda: attnx.cached_attention(q, cache))
    assert peak < cache.nbytes // 64, f"{peak} bytes allocated for a cache of {cache.nbytes}"
    # The same numbers as sdpa over the cache storage (which would convert a float16 cache).
    np.testing.assert_allclose(out, attnx.scaled_dot_product_attention(q, cache.key, cache.value, enable_gqa=True),
                               rtol=1e-5, atol=1e-6)


def test_cached_attention_errors(rng):
    cache = KVCache(2, 2, 6, 4, value_dim=3)
    cache.append(randn(rng, (2, 2, 2, 4)), randn(rng, (2, 2, 2, 3)))
    q = randn(rng, (2, 4, 1, 4), f32)
    k, v = randn(rng, (2, 2, 1, 4)), randn(rng, (2, 2, 1, 3))
    cases = [
        (dict(query=q, cache="cache"), TypeError, "cache must be an attnx.KVCache"),
        (dict(query=q[0], cache=cache), ValueError, r"query must have shape \(batch, Hq, T, head_dim\) = \(2, Hq, T, 4\).*got \(4, 1, 4\)"),
        (dict(query=q[:1], cache=cache), ValueError, "query must have shape"),
        (dict(query=q[..., :3], cache=cache), ValueError, "query must have shape"),
        (dict(query=q[:, :3], cache=cache), ValueError, "multiple of num_kv_heads = 2"),
        (dict(query=q.astype(int), cache=cache), TypeError, "query"),
        (dict(query=q, cache=cache, key=k), ValueError, "key and value must both be given"),
        (dict(query=q, cache=cache, key=np.concatenate([k, k], 2), value=v), ValueError, r"key must hold the query's T = 1"),
        (dict(query=q, cache=cache, key=k, value=v[..., :2]), ValueError, "value must have shape"),
        (dict(query=q, cache=cache, lengths=[1, 2]), ValueError, r"lengths must be in \[0, 1\]"),
        (dict(query=np.concatenate([q] * 3, 2), cache=cache), ValueError, r"exceed the cache's lengths \[2, 2\]"),
        (dict(query=q, cache=cache, window=(-1, 0)), ValueError, "window"),
        (dict(query=q, cache=cache, scale=float("nan")), ValueError, "scale"),
        (dict(query=q, cache=cache, key=k, value=v, out=np.empty((2, 4, 1, 3), f64)), TypeError, "out has dtype float64"),
        (dict(query=q, cache=cache, key=k, value=v, out=np.empty((2, 4, 1, 4), f32)), ValueError, r"out has shape"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            attnx.cached_attention(**kwargs)
    assert cache.lengths.tolist() == [2, 2]  # nothing was appended by a failing call


# ---------------------------------------------------------------------------------------------
# Decoding with MultiheadAttention.step
# ---------------------------------------------------------------------------------------------


def decode(module, cache, sequences, prompts, batch_first):
    """Feed each sequence's prompt in one ragged step, then the rest one token at a time.

    Returns the per-sequence outputs (length_b, E) and checks the padded rows on the way.
    """
    B, E = len(sequences), module.embed_dim
    dtype = module.dtype

    def batch(chunks, T):
        x = np.zeros((B, T, E), dtype)
        for b, chunk in enumerate(chunks):
            x[b, : len(chunk)] = chunk
        return x if batch_first else np.ascontiguousarray(x.transpose(1, 0, 2))

    outputs = [[] for _ in range(B)]
    pos = list(prompts)
    T = max(prompts)
    y = module.step(batch([s[:p] for s, p in zip(sequences, prompts)], T), cache, lengths=prompts)
    y = y if batch_first else y.transpose(1, 0, 2)
    bias = module.out_proj_bias.astype(f64)
    for b in range(B):
        outputs[b].append(y[b, : prompts[b]])
        np.testing.assert_allclose(y[b, prompts[b] :].astype(f64), np.broadcast_to(bias, (T - prompts[b], E)),
                                   rtol=1e-3)
    while any(p < len(s) for p, s in zip(pos, sequences)):
        n = [int(p < len(s)) for p, s in zip(pos, sequences)]
        y = module.step(batch([s[p : p + k] for s, p, k in zip(sequences, pos, n)], 1), cache, lengths=n)
        y = y if batch_first else y.transpose(1, 0, 2)
        for b in range(B):
            if n[b]:
                outputs[b].append(y[b, :1])
                pos[b] += 1
    assert cache.lengths.tolist() == [len(s) for s in sequences]
    return [np.concatenate(o) for o in outputs]


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("dtype", [f32, f64], ids=["f32", "f64"])
def test_step_decoding_equals_one_causal_forward(rng, batch_first, dtype):
    E, H = 32, 4
    m = random_module(rng, E, H, dtype, batch_first=batch_first)
    lengths, prompts = [9, 4, 7], [3, 1, 5]
    sequences = [randn(rng, (n, E), dtype) for n in lengths]
    cache = m.new_cache(batch=3, max_len=12)
    assert (cache.num_kv_heads, cache.head_dim, cache.dtype) == (H, E // H, dtype)
    snap = copies({str(i): s for i, s in enumerate(sequences)})
    got = decode(m, cache, sequences, prompts, batch_first)
    assert_unchanged(snap, {str(i): s for i, s in enumerate(sequences)})
    for s, g in zip(sequences, got):
        full, _ = m(s, s, s, is_causal=True, need_weights=False)  # unbatched (L, E)
        assert g.dtype == dtype
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == f32 else {"rtol": 1e-12, "atol": 1e-12}
        np.testing.assert_allclose(g, full, **tol)


def test_step_functional_separate_weights_and_unbatched(rng):
    E, H = 16, 2
    w = {name: randn(rng, (E, E), f32, 0.25) for name in ("q", "k", "v", "out")}
    b_in, b_out = randn(rng, (3 * E,), f32, 0.5), randn(rng, (E,), f32, 0.5)
    x = randn(rng, (6, E), f32)
    expected, _ = attnx.multi_head_attention_forward(
        x, x, x, E, H, None, b_in, None, None, False, 0.0, w["out"], b_out, training=False,
        use_separate_proj_weight=True, q_proj_weight=w["q"], k_proj_weight=w["k"], v_proj_weight=w["v"],
        is_causal=True, need_weights=False)
    cache = KVCache(1, H, 6, E // H)
    kwargs = dict(use_separate_proj_weight=True, q_proj_weight=w["q"], k_proj_weight=w["k"], v_proj_weight=w["v"])
    first = attnx.multi_head_attention_step(x[:2], cache, H, None, b_in, w["out"], b_out, **kwargs)
    rest = [attnx.multi_head_attention_step(x[t : t + 1], cache, H, None, b_in, w["out"], b_out, **kwargs)
            for t in range(2, 6)]
    np.testing.assert_allclose(np.concatenate([first] + rest), expected, rtol=1e-5, atol=1e-5)


def test_step_with_a_float16_cache(rng):
    E, H = 32, 4
    m = random_module(rng, E, H)
    x = randn(rng, (10, 1, E), f32)
    cache = m.new_cache(1, 10, dtype=np.float16)
    got = np.concatenate([m.step(x[:4], cache)] + [m.step(x[t : t + 1], cache) for t in range(4, 10)])
    full, _ = m(x, x, x, is_causal=True)
    assert got.dtype == f32
    np.testing.assert_allclose(got, full, rtol=1e-2, atol=1e-2)  # keys and values rounded to float16


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("batch", [1, 2])
def test_step_with_heads_of_one_dimension(rng, batch_first, batch):
    """Found by the fuzzer: with head_dim 1 (embed_dim == num_heads) and several new tokens,
    merging the heads back into rows gave a view whose last axis is strided (numpy merges
    the size-1 head axis without a copy), and the output projection raised ValueError after
    the keys and values had been appended to the cache."""
    E = H = 3
    m = random_module(rng, E, H, f32, batch_first=batch_first)
    sequences = [randn(rng, (5, E), f32) for _ in range(batch)]
    cache = m.new_cache(batch=batch, max_len=5)
    got = decode(m, cache, sequences, [3] * batch, batch_first)
    for s, g in zip(sequences, got):
        full, _ = m(s, s, s, is_causal=True, need_weights=False)
        np.testing.assert_allclose(g, full, rtol=1e-5, atol=1e-5)


def test_step_reads_a_misaligned_query(rng):
    m = random_module(rng, 8, 2, f32)
    x = randn(rng, (4, 1, 8), f32)
    buf = np.zeros(x.nbytes + 1, np.uint8)
    misaligned = np.frombuffer(buf.data, f32, count=x.size, offset=1).reshape(x.shape)
    misaligned[...] = x
    assert not misaligned.flags.aligned
    expected = m.step(x, m.new_cache(1, 4))
    np.testing.assert_array_equal(m.step(misaligned, m.new_cache(1, 4)), expected)

@pytest.mark.parametrize("stage", ["attention", "output projection"])
def test_a_step_that_fails_after_its_append_leaves_the_cache_as_it_was(rng, stage):
    """Out of memory after the new keys and values are written: the call raises, the cache
    holds what it held before it, and the next step goes on as if the failed one never ran.
    (The step runs in the core from the projections to the output, with the GIL released, so
    no Python code, and no interrupt, comes between its stages.)"""
    from attnx import _testing

    m = random_module(rng, 8, 2, f32)
    prompt, token = randn(rng, (3, 2, 8), f32), randn(rng, (1, 2, 8), f32)
    cache = m.new_cache(batch=2, max_len=6)
    m.step(prompt, cache, lengths=[3, 2])
    held = (cache.lengths.copy(), cache.key.copy(), cache.value.copy())
    _testing.fail_next_step(stage)
    with pytest.raises(MemoryError):
        m.step(token, cache)
    np.testing.assert_array_equal(cache.lengths, held[0])
    for b, n in enumerate(held[0]):  # what each sequence holds (the rest is never read)
        np.testing.assert_array_equal(cache.key[b, :, :n], held[1][b, :, :n])
        np.testing.assert_array_equal(cache.value[b, :, :n], held[2][b, :, :n])

    fresh = m.new_cache(batch=2, max_len=6)
    m.step(prompt, fresh, lengths=[3, 2])
    np.testing.assert_array_equal(m.step(token, cache), m.step(token, fresh))
    np.testing.assert_array_equal(cache.lengths, [4, 3])


def test_step_errors(rng):
    m = attnx.MultiheadAttention(8, 2)
    x = randn(rng, (1, 2, 8), f32)
    for bad in (attnx.MultiheadAttention(8, 2, add_bias_kv=True), attnx.MultiheadAttention(8, 2, add_zero_attn=True),
                attnx.MultiheadAttention(8, 2, kdim=3, vdim=3)):
        with pytest.raises(NotImplementedError, match="step"):
            bad.step(x, bad.new_cache(2, 4))
    with pytest.raises(ValueError, match="num_kv_heads = num_heads = 2"):
        m.step(x, KVCache(2, 1, 4, 4))
    with pytest.raises(ValueError, match="head_dim = value_dim"):
        m.step(x, KVCache(2, 2, 4, 4, value_dim=2))
    with pytest.raises(ValueError, match=r"query \(1, 2, 8\) must have the cache's batch 3"):
        m.step(x, m.new_cache(3, 4))
    with pytest.raises(ValueError, match="unbatched.*batch 1"):
        m.step(x[0], m.new_cache(2, 4))
    with pytest.raises(ValueError, match="query must be 2-D"):
        m.step(x[None], m.new_cache(2, 4))
    with pytest.raises(TypeError, match="cache must be an attnx.KVCache"):
        m.step(x, None)
    cache = m.new_cache(2, 1)
    m.step(x, cache)
    with pytest.raises(ValueError, match="max_len 1"):
        m.step(x, cache)
    with pytest.raises(ValueError, match="lengths"):
        m.step(x, m.new_cache(2, 4), lengths=[2, 0])
    with pytest.raises(ValueError, match="in_proj_weight must have shape"):
        attnx.multi_head_attention_step(x, m.new_cache(2, 4), 2, np.zeros((8, 8), f32), None, m.out_proj_weight, None)
