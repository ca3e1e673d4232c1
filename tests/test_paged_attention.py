"""paged_attention and PagedKVCache: continuous batching over a pool of cache blocks.

A random serving run (sequences joining and leaving, prefill chunks mixed with decode rows in
one call, forks written from both sides, truncation) is checked step by step: each sequence's
rows in the pool, read back through its block table, equal what was appended (rounded to the
cache's dtype); every output row equals the float64 reference over those stored keys and
values, bottom-right causal per sequence with the drawn options; and the pool's accounting
holds (a block is free or held, a fork takes no block). The same step equals a contiguous
KVCache's cached_attention, and nothing changes when a call fails.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import attnx
import attnx.reference as reference
from attnx.cache import _quantize
from conftest import assert_close, assert_identical, num_threads, randn

f16, f32, f64 = np.float16, np.float32, np.float64
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8"]


def storage_dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def as_stored(x, dtype):
    """Rows as a cache of `dtype` stores them, read back as float64."""
    if dtype == np.int8:
        q, s = _quantize(x)
        return q.astype(f64) * s[..., None].astype(f64)
    return x.astype(dtype).astype(f64)


def gathered(cache, seq):
    """(keys, values) of `seq` read back from the pool through its block table, float64."""
    table, n = cache.block_table(seq), cache.length(seq)
    bs = cache.block_size
    rows = np.arange(n)
    blocks, offsets = table[rows // bs], rows % bs
    k = cache.key[blocks, :, offsets].astype(f64)
    v = cache.value[blocks, :, offsets].astype(f64)
    if cache.dtype == np.int8:
        k *= cache.key_scales[blocks, :, offsets][..., None]
        v *= cache.value_scales[blocks, :, offsets][..., None]
    return k, v


def expected_rows(q, k, v, options):
    """The float64 reference of one sequence's query rows over its keys (bottom-right causal)."""
    group = q.shape[1] // k.shape[1]
    return reference.scaled_dot_product_attention(
        q.transpose(1, 0, 2).astype(f64)[None],
        np.repeat(k.transpose(1, 0, 2), group, 0)[None],
        np.repeat(v.transpose(1, 0, 2), group, 0)[None],
        is_causal="bottom_right", **options,
    )[0].transpose(1, 0, 2)


def check_accounting(cache):
    held = {}
    for s in cache.sequences:
        table = cache.block_table(s)
        assert len(table) == -(-cache.length(s) // cache.block_size)
        for b in table.tolist():
            held[b] = held.get(b, 0) + 1
    assert cache.free_blocks + len(held) == cache.num_blocks


def draw_options(rng, head_dim):
    options = {}
    if rng.random() < 0.3:
        options["window"] = (int(rng.integers(0, 30)), 0)
    if rng.random() < 0.25:
        options["softcap"] = float(rng.uniform(2, 30))
    if rng.random() < 0.25:
        options["scale"] = float(rng.uniform(0.05, 0.5))
    return options


def serve(seed, dtype_name, steps=6, threads=None):
    """A random serving run, checked at every step (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    dtype = storage_dtype(dtype_name)
    hk = int(rng.choice([1, 2]))
    hq = hk * int(rng.choice([1, 2, 4]))
    e = int(rng.choice([8, 16, 40, 64]))
    ev = e if rng.random() < 0.7 else int(rng.choice([8, 24]))
    bs = int(rng.choice([1, 3, 16, 32]))
    cache = attnx.PagedKVCache(int(rng.integers(60, 200)) * (4 if bs == 1 else 1), bs, hk, e, dtype, value_dim=ev)
    compute = f64 if dtype == f64 else f32
    options = draw_options(rng, e)
    stored = {}  # handle -> (keys, values) as stored, float64
    for step in range(steps):
        # Sequences join, fork, leave, or are cut back between steps.
        if not stored or rng.random() < 0.5:
            stored[cache.add_sequence()] = (np.zeros((0, hk, e)), np.zeros((0, hk, ev)))
        if stored and rng.random() < 0.3:
            parent = int(rng.choice(list(stored)))
            stored[cache.fork(parent)] = stored[parent]
        if len(stored) > 2 and rng.random() < 0.2:
            gone = int(rng.choice(list(stored)))
            cache.remove(gone)
            del stored[gone]
        if stored and rng.random() < 0.15:
            cut = int(rng.choice(list(stored)))
            keep = int(rng.integers(0, cache.length(cut) + 1))
            cache.truncate(cut, keep)
            stored[cut] = (stored[cut][0][:keep], stored[cut][1][:keep])
        check_accounting(cache)
        seqs = [s for s in stored if rng.random() < 0.8] or [next(iter(stored))]
        rng.shuffle(seqs)
        lens = [int(rng.integers(1, 40)) if rng.random() < 0.3 else int(rng.integers(0, 2)) for _ in seqs]
        total = sum(lens)
        q = randn(rng, (total, hq, e), compute)
        k = randn(rng, (total, hk, e), compute)
        v = randn(rng, (total, hk, ev), compute)
        needed = sum(-(-(cache.length(s) + n) // bs) - len(cache.block_table(s)) + 1 for s, n in zip(seqs, lens))
        if needed > cache.free_blocks:
            break  # the pool may run out; CacheFullError has its own tests
        if threads is None:
            out = attnx.paged_attention(q, cache, seqs, lens, k, v, **options)
        else:
            with num_threads(threads):
                out = attnx.paged_attention(q, cache, seqs, lens, k, v, **options)
        assert out.shape == (total, hq, ev) and out.dtype == compute
        start = 0
        for s, n in zip(seqs, lens):
            rows = slice(start, start + n)
            sk, sv = stored[s]
            stored[s] = (np.concatenate([sk, as_stored(k[rows], dtype)]), np.concatenate([sv, as_stored(v[rows], dtype)]))
            gk, gv = gathered(cache, s)
            np.testing.assert_array_equal(gk, stored[s][0], err_msg=f"keys of sequence {s} at step {step}")
            np.testing.assert_array_equal(gv, stored[s][1], err_msg=f"values of sequence {s} at step {step}")
            if n:
                expected = expected_rows(q[rows], *stored[s], options)
                assert_close(out[rows], expected, compute, atol=5e-6 if compute == f32 else None,
                             err_msg=f"sequence {s} ({n} rows over {cache.length(s)}), step {step}, {options}")
            start += n
        check_accounting(cache)
    return cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(24))
def test_random_serving_runs_equal_the_reference(seed, dtype):
    serve(seed, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_results_do_not_depend_on_threads(seed):
    """Long sequences split into key chunks among short ones: the same bits on 1 and 2 threads."""
    rng = np.random.default_rng(seed)
    cache = attnx.PagedKVCache(400, 16, 2, 32)
    seqs = [cache.add_sequence() for _ in range(4)]
    lens = [int(rng.integers(1, 3000)), 5, 1, 40]
    total = sum(lens)
    attnx.paged_attention(randn(rng, (total, 4, 32), f32), cache, seqs, lens,
                          randn(rng, (total, 2, 32), f32), randn(rng, (total, 2, 32), f32))
    q = randn(rng, (4, 8, 32), f32)
    outs = []
    for threads in (1, 2):
        with num_threads(threads):
            outs.append(attnx.paged_attention(q, cache, seqs))
    assert_identical(outs[0], outs[1])


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_decode_step_equals_the_contiguous_cache(dtype):
    """The blocks are key ranges of the same kernels: a decode step over a paged cache gives the
    bits of cached_attention over a KVCache holding the same tokens."""
    rng = np.random.default_rng(3)
    B, hk, hq, e, bs = 5, 2, 8, 64, 16
    lengths = [700, 33, 1, 300, 1030]
    contiguous = attnx.KVCache(B, hk, 1100, e, storage_dtype(dtype))
    paged = attnx.PagedKVCache(sum(-(-n // bs) for n in lengths) + 3, bs, hk, e, storage_dtype(dtype))
    seqs = [paged.add_sequence() for _ in range(B)]
    k, v = randn(rng, (B, hk, 1100, e), f32), randn(rng, (B, hk, 1100, e), f32)
    contiguous.append(k, v, lengths=lengths)
    # Appended in turns of a few tokens each, so that the sequences' blocks interleave in the pool.
    done = np.zeros(B, int)
    while (done < lengths).any():
        step = np.minimum(rng.integers(1, 40, B), np.array(lengths) - done)
        rows = lambda x: np.concatenate([x[b, :, done[b]:done[b] + step[b]].transpose(1, 0, 2) for b in range(B)])
        paged.append(seqs, rows(k), rows(v), step)
        done += step
    q = randn(rng, (B, hq, 1, e), f32)
    q_rows = np.ascontiguousarray(q[:, :, 0])
    assert_identical(attnx.paged_attention(q_rows, paged, seqs), attnx.cached_attention(q, contiguous)[:, :, 0])
    # A window starts the keys mid-block: the score kernels group keys by four from the first
    # key of each call, and a block's first key is then another's, so a score may differ by an
    # ulp of its reduction's order.
    options = {"window": (100, 0), "softcap": 20.0}
    np.testing.assert_allclose(attnx.paged_attention(q_rows, paged, seqs, **options),
                               attnx.cached_attention(q, contiguous, **options)[:, :, 0], rtol=1e-6, atol=1e-7)


def test_fork_shares_blocks_until_written():
    cache = attnx.PagedKVCache(16, 4, 1, 8)
    rng = np.random.default_rng(0)
    a = cache.add_sequence()
    cache.append([a], randn(rng, (10, 1, 8), f32), randn(rng, (10, 1, 8), f32), [10])
    assert cache.free_blocks == 13
    b = cache.fork(a)
    assert cache.free_blocks == 13 and list(cache.block_table(b)) == list(cache.block_table(a))
    before = gathered(cache, a)
    # b writes into the shared, partly filled third block: it gets its own copy of it (one block).
    cache.append([b], randn(rng, (1, 1, 8), f32), randn(rng, (1, 1, 8), f32))
    assert cache.free_blocks == 12
    assert list(cache.block_table(b))[:2] == list(cache.block_table(a))[:2]
    assert cache.block_table(b)[2] != cache.block_table(a)[2]
    # a's tokens are untouched; b holds them and its own.
    for x, y in zip(gathered(cache, a), before):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(gathered(cache, b)[0][:10], before[0])
    # a, now the only holder of its third block, writes in place.
    cache.append([a], randn(rng, (2, 1, 8), f32), randn(rng, (2, 1, 8), f32), [2])
    assert cache.free_blocks == 12
    cache.append([a], randn(rng, (1, 1, 8), f32), randn(rng, (1, 1, 8), f32))  # 13 tokens: a 4th block
    assert cache.free_blocks == 11
    # Both sides written in one call: the first gets a copy, the last writes in place.
    c = cache.fork(a)
    cache.append([a, c], randn(rng, (2, 1, 8), f32), randn(rng, (2, 1, 8), f32), [1, 1])
    assert cache.free_blocks == 10
    cache.remove(a)
    cache.remove(c)
    cache.remove(b)
    assert cache.free_blocks == 16


def test_a_full_pool_raises_and_writes_nothing():
    rng = np.random.default_rng(1)
    cache = attnx.PagedKVCache(5, 4, 2, 8, np.int8)
    a, b = cache.add_sequence(), cache.add_sequence()
    attnx.paged_attention(randn(rng, (9, 2, 8), f32), cache, [a, b], [6, 3],
                          randn(rng, (9, 2, 8), f32), randn(rng, (9, 2, 8), f32))
    assert cache.free_blocks == 2
    snapshot = [x.copy() for x in (cache.key, cache.value, cache.key_scales, cache.value_scales)]
    tables = [cache.block_table(s).copy() for s in (a, b)]
    with pytest.raises(attnx.CacheFullError, match="needs 3 blocks.*2 of 5 are free") as info:
        attnx.paged_attention(randn(rng, (11, 2, 8), f32), cache, [a, b], [3, 8],
                              randn(rng, (11, 2, 8), f32), randn(rng, (11, 2, 8), f32))
    assert isinstance(info.value, ValueError) and (info.value.needed, info.value.free) == (3, 2)
    for x, y in zip((cache.key, cache.value, cache.key_scales, cache.value_scales), snapshot):
        np.testing.assert_array_equal(x, y)
    assert [cache.length(a), cache.length(b), cache.free_blocks] == [6, 3, 2]
    for s, t in zip((a, b), tables):
        np.testing.assert_array_equal(cache.block_table(s), t)
    assert pickle.loads(pickle.dumps(info.value)).needed == 3


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, [s[0], s[0]], [1, 1], r(2, 2, 8), r(2, 2, 8)),
         ValueError, "distinct"),
        (lambda c, s, r: attnx.paged_attention(r(3, 4, 8), c, s, [1, 1], r(3, 2, 8), r(3, 2, 8)),
         ValueError, "total_q"),
        (lambda c, s, r: attnx.paged_attention(r(2, 3, 8), c, s, [1, 1], r(2, 2, 8), r(2, 2, 8)),
         ValueError, "multiple of num_kv_heads"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, s, [1, 1], r(2, 2, 8), r(2, 1, 8)),
         ValueError, "value must have shape"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, s, [1, 1], r(2, 2, 8), None),
         ValueError, "both"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, s, [1, 1], r(2, 2, 8), r(2, 2, 8),
                                               out=np.empty((2, 4, 7), f32)), ValueError, "out"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, [s[0], 99], [1, 1], r(2, 2, 8), r(2, 2, 8)),
         ValueError, "sequence 99 is not in this cache"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, s, [1.0, 1.0], r(2, 2, 8), r(2, 2, 8)),
         TypeError, "query_lens"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, s, [-1, 3], r(2, 2, 8), r(2, 2, 8)),
         ValueError, ">= 0"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, s, [1, 1], r(2, 2, 8), r(2, 2, 8), scale=np.inf),
         ValueError, "scale"),
        (lambda c, s, r: attnx.paged_attention(r(9, 4, 8), c, s, [4, 5]),
         ValueError, "exceed the sequences' lengths"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), attnx.KVCache(1, 2, 4, 8), s),
         TypeError, "PagedKVCache"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, "ab"), TypeError, "seqs"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8).astype(int), c, s), TypeError, "query"),
        (lambda c, s, r: attnx.paged_attention(r(2, 4, 8), c, s, positions=[0, 1]), ValueError, "rope"),
    ],
)
def test_bad_calls_raise_and_change_nothing(call, error, match):
    rng = np.random.default_rng(2)
    cache = attnx.PagedKVCache(8, 4, 2, 8)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    cache.append(seqs, randn(rng, (6, 2, 8), f32), randn(rng, (6, 2, 8), f32), [3, 3])
    before = (cache.key.copy(), cache.value.copy(), [cache.length(s) for s in seqs], cache.free_blocks)
    with pytest.raises(error, match=match):
        call(cache, seqs, lambda *shape: randn(rng, shape, f32))
    np.testing.assert_array_equal(cache.key, before[0])
    np.testing.assert_array_equal(cache.value, before[1])
    assert [cache.length(s) for s in seqs] == before[2] and cache.free_blocks == before[3]


def test_truncate_releases_blocks_and_a_shared_block_is_copied_on_the_next_write():
    rng = np.random.default_rng(4)
    cache = attnx.PagedKVCache(8, 4, 1, 8)
    a = cache.add_sequence()
    cache.append([a], randn(rng, (11, 1, 8), f32), randn(rng, (11, 1, 8), f32), [11])
    b = cache.fork(a)
    cache.truncate(a, 5)  # a keeps 2 blocks; its second is still shared with b
    assert len(cache.block_table(a)) == 2 and cache.free_blocks == 5
    keys_b = gathered(cache, b)[0].copy()
    cache.append([a], randn(rng, (1, 1, 8), f32), randn(rng, (1, 1, 8), f32))
    np.testing.assert_array_equal(gathered(cache, b)[0], keys_b)
    assert cache.free_blocks == 4
    with pytest.raises(ValueError, match=r"length must be in \[0, 6\]"):
        cache.truncate(a, 7)


def test_pickle_keeps_the_sequences():
    cache = serve(5, "int8", steps=4)
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.sequences == cache.sequences and copy.free_blocks == cache.free_blocks
    rng = np.random.default_rng(0)
    seqs = list(cache.sequences)
    q = randn(rng, (len(seqs), cache.num_kv_heads * 2, cache.head_dim), f32)
    nonempty = [s for s in seqs if cache.length(s)]
    q = q[: len(nonempty)]
    assert_identical(attnx.paged_attention(q, copy, nonempty), attnx.paged_attention(q, cache, nonempty))
    for s in seqs:
        np.testing.assert_array_equal(copy.block_table(s), cache.block_table(s))
    assert repr(copy) == repr(cache)


def test_empty_calls():
    cache = attnx.PagedKVCache(4, 4, 1, 8)
    a = cache.add_sequence()
    assert attnx.paged_attention(np.zeros((0, 2, 8), f32), cache, []).shape == (0, 2, 8)
    out = attnx.paged_attention(np.zeros((0, 2, 8), f32), cache, [a], [0], np.zeros((0, 1, 8)), np.zeros((0, 1, 8)))
    assert out.shape == (0, 2, 8) and cache.length(a) == 0 and cache.free_blocks == 4


def test_the_documented_pool_holds_64_sequences_of_16_to_4096_tokens():
    """64 sequences of 16..4096 tokens fit in (their tokens / block_size + 64) blocks, where a
    contiguous cache reserves 64 x 4096 rows."""
    rng = np.random.default_rng(6)
    lengths = rng.integers(16, 4097, 64)
    bs = 16
    cache = attnx.PagedKVCache(int(lengths.sum()) // bs + 64, bs, 1, 8, np.float16)
    seqs = [cache.add_sequence() for _ in lengths]
    for start in range(0, int(lengths.max()), 512):
        n = np.clip(lengths - start, 0, 512)
        live = [s for s, c in zip(seqs, n) if c]
        rows = int(n.sum())
        cache.append(live, np.ones((rows, 1, 8), f32), np.ones((rows, 1, 8), f32), n[n > 0])
    assert [cache.length(s) for s in seqs] == lengths.tolist()
    used = cache.num_blocks - cache.free_blocks
    assert used == sum(-(-int(n) // bs) for n in lengths) <= int(lengths.sum()) // bs + 64
    assert used * bs < 0.55 * 64 * 4096


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_bfloat16_products_equal_varlen_attention_over_the_same_keys(dtype):
    """precision="bfloat16" over the pool equals varlen attention over the stored keys and values
    laid end to end: the same rounded operands, the same route. The step's one-row sequence is a
    decoding row (the row path, as at the default precision), which multiplies a float16 or int8
    cache's elements as stored, where varlen's rows round their float32 copies: there, one
    bfloat16 rounding of the values apart."""
    rng = np.random.default_rng(7)
    cache = attnx.PagedKVCache(64, 16, 2, 32, storage_dtype(dtype))
    seqs = [cache.add_sequence() for _ in range(3)]
    lens = [70, 1, 130]
    total = sum(lens)
    k, v = randn(rng, (total, 2, 32), f32), randn(rng, (total, 2, 32), f32)
    q = randn(rng, (total, 4, 32), f32)
    out = attnx.paged_attention(q, cache, seqs, lens, k, v, precision="bfloat16", window=(50, 0))
    keys, values = zip(*(gathered(cache, s) for s in seqs))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    expected = attnx.varlen_attention(q, np.concatenate(keys).astype(f32), np.concatenate(values).astype(f32), cu,
                                      is_causal="bottom_right", precision="bfloat16", window=(50, 0))
    decoding = np.zeros(total, bool)
    decoding[lens[0]] = True
    np.testing.assert_allclose(out[~decoding], expected[~decoding], rtol=1e-5, atol=1e-5)
    stored_as_is = dtype != "float32"
    np.testing.assert_allclose(out[decoding], expected[decoding], rtol=0, atol=2**-8 * 3 if stored_as_is else 1e-5)
    exact = attnx.varlen_attention(q, np.concatenate(keys).astype(f32), np.concatenate(values).astype(f32), cu,
                                   is_causal="bottom_right", window=(50, 0))
    assert np.abs(out - exact).max() > 0  # the products were rounded


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_bfloat16_step_runs_its_decoding_rows_as_a_decoding_step(dtype):
    """Where the products are float32 multiply-adds of rounded operands, a step of prefill chunks
    and decoding rows reads the pool in place on both paths and runs each kind on its own path,
    as at the default precision: its decoding rows have the bits of a step of those rows alone."""
    if "float32 products" not in attnx.show_config()["precisions"]["bfloat16"]:
        pytest.skip("the bfloat16 products run as vdpbf16ps pairs here: their tile path reads copies")
    rng = np.random.default_rng(17)
    cache = attnx.PagedKVCache(96, 16, 2, 32, storage_dtype(dtype))
    seqs = [cache.add_sequence() for _ in range(3)]
    for s, n in zip(seqs, (300, 45, 170)):
        attnx.paged_attention(np.zeros((n, 4, 32), f32), cache, [s], [n], randn(rng, (n, 2, 32), f32),
                              randn(rng, (n, 2, 32), f32))
    q = randn(rng, (2 + 40, 4, 32), f32)
    mixed = attnx.paged_attention(q, cache, seqs, [1, 1, 40], precision="bfloat16")
    alone = attnx.paged_attention(q[:2], cache, seqs[:2], [1, 1], precision="bfloat16")
    assert_identical(mixed[:2], alone)
    chunk = attnx.paged_attention(q[2:], cache, seqs[2:], [40], precision="bfloat16")
    assert_identical(mixed[2:], chunk)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_rope_rotates_the_queries_and_the_new_keys_before_they_are_stored(dtype):
    """rope= equals rotating the queries and new keys by hand at each row's position (the
    sequence's length before the call, plus the row's index) and calling without rope; the
    cache then holds the rotated keys."""
    rng = np.random.default_rng(8)
    rope = attnx.RotaryEmbedding(32, rotary_dim=16, scaling={"rope_type": "linear", "factor": 2.0})
    caches = [attnx.PagedKVCache(40, 8, 2, 32, storage_dtype(dtype)) for _ in range(2)]
    seqs = [[c.add_sequence() for _ in range(3)] for c in caches]
    lengths = np.zeros(3, np.int64)
    for lens in ([9, 1, 20], [1, 1, 1], [3, 0, 1]):
        total = sum(lens)
        q, k, v = randn(rng, (total, 4, 32), f32), randn(rng, (total, 2, 32), f32), randn(rng, (total, 2, 32), f32)
        positions = np.concatenate([np.arange(n) + lengths[i] for i, n in enumerate(lens)])
        out = attnx.paged_attention(q, caches[0], seqs[0], lens, k, v, rope=rope)
        expected = attnx.paged_attention(rope(q, positions), caches[1], seqs[1], lens, rope(k, positions), v)
        assert_identical(out, expected)
        for s0, s1 in zip(*seqs):
            for x, y in zip(gathered(caches[0], s0), gathered(caches[1], s1)):
                np.testing.assert_array_equal(x, y)
        lengths += lens
    # positions= overrides the positions; without new keys, only the queries are rotated.
    q = randn(rng, (3, 4, 32), f32)
    at = np.array([100, 7, 0])
    assert_identical(attnx.paged_attention(q, caches[0], seqs[0], rope=rope, positions=at),
                     attnx.paged_attention(rope(q, at), caches[1], seqs[1]))
    with pytest.raises(ValueError, match="positions must have shape"):
        attnx.paged_attention(q, caches[0], seqs[0], rope=rope, positions=at[:2])
    with pytest.raises(ValueError, match="head_dim"):
        attnx.paged_attention(q, caches[0], seqs[0], rope=attnx.RotaryEmbedding(16))


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_mixed_step_equals_its_prefill_and_decode_rows_called_apart(dtype):
    """Prefill chunks take query tiles and decode rows take grouped rows in one call: each
    sequence's rows are the bits of a call of its kind alone, and of the reference."""
    rng = np.random.default_rng(9)
    cache = attnx.PagedKVCache(300, 16, 2, 64, storage_dtype(dtype))
    seqs = [cache.add_sequence() for _ in range(5)]
    lengths = [700, 40, 1300, 3, 90]
    total = sum(lengths)
    cache.append(seqs, randn(rng, (total, 2, 64), f32), randn(rng, (total, 2, 64), f32), lengths)
    lens = [64, 1, 1, 3, 37]  # two chunks, three decoding sequences
    q = randn(rng, (sum(lens), 8, 64), f32)
    for options in ({}, {"window": (200, 0), "softcap": 30.0}):
        out = attnx.paged_attention(q, cache, seqs, lens, **options)
        cu = np.concatenate([[0], np.cumsum(lens)])
        for i in range(len(seqs)):
            alone = attnx.paged_attention(q[cu[i]:cu[i + 1]], cache, [seqs[i]], [lens[i]], **options)
            assert_identical(out[cu[i]:cu[i + 1]], alone)
            k, v = gathered(cache, seqs[i])
            assert_close(out[cu[i]:cu[i + 1]], expected_rows(q[cu[i]:cu[i + 1]], k, v, options), f32, atol=5e-6)


def test_a_step_that_fails_after_appending_takes_its_rows_back(monkeypatch):
    """Anything raised once the rows are appended (here: by the core) undoes the append: the
    lengths, block tables, reference counts and free blocks are as before the call."""
    rng = np.random.default_rng(10)
    cache = attnx.PagedKVCache(12, 4, 1, 8)
    a = cache.add_sequence()
    cache.append([a], randn(rng, (6, 1, 8), f32), randn(rng, (6, 1, 8), f32), [6])
    b = cache.fork(a)  # a's second block is shared and partly filled: a write copies it
    before = [(cache.length(s), cache.block_table(s).tolist()) for s in (a, b)], cache.free_blocks

    def broken(*args):
        raise MemoryError("no memory for the states")

    monkeypatch.setattr(attnx.paged._core, "paged_attention", broken)
    with pytest.raises(MemoryError):
        attnx.paged_attention(randn(rng, (7, 1, 8), f32), cache, [a, b], [6, 1],
                              randn(rng, (7, 1, 8), f32), randn(rng, (7, 1, 8), f32))
    assert ([(cache.length(s), cache.block_table(s).tolist()) for s in (a, b)], cache.free_blocks) == before
    monkeypatch.undo()
    # The pool works on as if the call never happened: both sides still share the block.
    cache.append([a, b], randn(rng, (2, 1, 8), f32), randn(rng, (2, 1, 8), f32), [1, 1])
    assert cache.free_blocks == before[1] - 1
    check_accounting(cache)


def test_bfloat16_products_over_a_bfloat16_pool_equal_those_over_a_float32_one():
    """A bfloat16 pool's rows are rounded copies for bfloat16 products, as any other pool's:
    (they are not read in place as pairs, which would ignore the block tables)."""
    bf16 = storage_dtype("bfloat16")
    rng = np.random.default_rng(11)
    lens = [3, 30]  # the second sequence spans blocks and is not the first of the call
    q = randn(rng, (33, 4, 8), f32)
    k, v = (randn(rng, (33, 2, 8), f32).astype(bf16).astype(f32) for _ in range(2))
    outs = []
    for dtype in (f32, bf16):
        cache = attnx.PagedKVCache(16, 8, 2, 8, dtype)
        seqs = [cache.add_sequence(), cache.add_sequence()]
        outs.append(attnx.paged_attention(q, cache, seqs, lens, k, v, precision="bfloat16"))
    assert_identical(outs[1], outs[0])


def test_misaligned_rows_are_quantized_into_an_int8_cache():
    x = np.arange(12, dtype=f32).reshape(4, 1, 3) / 7
    buffer = np.frombuffer(bytearray(x.nbytes + 5), np.uint8)
    misaligned = buffer[1:1 + x.nbytes].view(f32).reshape(x.shape)
    misaligned[...] = x
    caches = [attnx.PagedKVCache(8, 5, 1, 3, np.int8) for _ in range(2)]
    for cache, value in zip(caches, (x, misaligned)):
        seq = cache.add_sequence()
        cache.append([seq], x, value, [4])
    np.testing.assert_array_equal(caches[0].value, caches[1].value)
    contiguous = attnx.KVCache(1, 1, 4, 3, np.int8)
    contiguous.append(x.transpose(1, 0, 2)[None], misaligned.transpose(1, 0, 2)[None])
    np.testing.assert_array_equal(contiguous.value[0, 0], caches[0].value[0, 0, :4])


@pytest.mark.parametrize("lens", [[3, 2**64 - 1], [2**63, 2**63], [3, 2**64 - 2]])
def test_counts_past_int64_raise_and_change_nothing(lens):
    cache = attnx.PagedKVCache(4, 2, 1, 4)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    q = np.ones((2, 1, 4), f32)
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        attnx.paged_attention(q, cache, seqs, np.array(lens, np.uint64), q, q)
    with pytest.raises(ValueError, match="below 2\\*\\*63"):
        cache.append(seqs, q, q, np.array(lens, np.uint64))
    assert [cache.length(s) for s in seqs] == [0, 0] and cache.free_blocks == 4
