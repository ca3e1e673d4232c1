"""The row path's grouped kernels: few queries per key head, taken through each key together.

Decoding steps, a few new tokens at a time, and the query heads of grouped-query attention
that share a key head run on the row path, whose kernels take several query rows through each
block of keys and values at once. A row's result must be the same to the bit whatever rows it
is grouped with, and the same as the reference within the contract's tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import DTYPE_IDS, DTYPES, assert_close, assert_identical, num_threads

import attnx
import attnx.reference as reference

sdpa = attnx.scaled_dot_product_attention


def _inputs(rng, dtype, Hq, Hk, L, S, E, Ev):
    q = rng.standard_normal((2, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((2, Hk, S, E)).astype(dtype)
    v = rng.standard_normal((2, Hk, S, Ev)).astype(dtype)
    return q, k, v


def _row_alone(q, k, v, b, h, i, mask=None):
    """Row i of query head h of batch b, computed as the only row of its call."""
    group = q.shape[1] // k.shape[1]
    kv = h // group
    row_mask = None if mask is None else mask[..., i : i + 1, :]
    return sdpa(q[b : b + 1, h : h + 1, i : i + 1], k[b : b + 1, kv : kv + 1], v[b : b + 1, kv : kv + 1],
                attn_mask=row_mask)[0, 0, 0]


# Head dims around the kernels' register chunks (a vector of 4, 8 or 16 lanes; 4 to 8 vectors),
# with tails; up to 8 rows per key head (several groups of rows); keys over more than one block.
CASES = [
    # Hq, Hk, L, S, E, Ev
    (8, 2, 1, 300, 64, 64),
    (8, 1, 1, 137, 128, 128),
    (6, 2, 2, 300, 80, 24),
    (4, 4, 3, 260, 24, 40),
    (4, 2, 3, 129, 256, 16),
    (16, 2, 1, 70, 8, 96),
    # Value rows longer than the registers hold (AVX-512 float32: over 8 vectors of 16), whose
    # accumulators go through L1 for several rows at once; odd rows and keys left over.
    (10, 2, 1, 133, 64, 256),
    (4, 1, 3, 261, 16, 160),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[f"Hq{c[0]}-Hk{c[1]}-L{c[2]}-S{c[3]}-E{c[4]}-Ev{c[5]}" for c in CASES])
def test_grouped_rows_match_rows_alone_and_the_reference(rng, dtype, case):
    Hq, Hk, L, S, E, Ev = case
    q, k, v = _inputs(rng, dtype, Hq, Hk, L, S, E, Ev)
    out = sdpa(q, k, v, enable_gqa=True)
    group = Hq // Hk
    ref = reference.scaled_dot_product_attention(
        q.astype(np.float64), np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1).astype(np.float64)
    )
    assert_close(out, ref, dtype)
    for b in range(2):
        for h in range(Hq):
            for i in range(L):
                assert_identical(out[b, h, i], _row_alone(q, k, v, b, h, i), err_msg=f"b{b} h{h} i{i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_rows_with_closed_keys_and_nan_values(rng, dtype):
    # Rows closed to different keys; a closed key's value is NaN in one block only: that block
    # goes key by key for the rows that close it, the others stay grouped.
    Hq, Hk, L, S, E, Ev = 4, 1, 3, 300, 32, 32
    q, k, v = _inputs(rng, dtype, Hq, Hk, L, S, E, Ev)
    mask = rng.random((L, S)) > 0.3
    mask[:, 5] = False
    mask[1, 140:] = False  # row 1 sees none of the last blocks' keys
    v[:, :, 5] = np.nan
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert not np.isnan(out).any()
    ref = reference.scaled_dot_product_attention(
        q.astype(np.float64), np.repeat(k, Hq, axis=1).astype(np.float64),
        np.nan_to_num(np.repeat(v, Hq, axis=1).astype(np.float64)), attn_mask=mask,
    )
    assert_close(out, ref, dtype)
    for b in range(2):
        for h in range(Hq):
            for i in range(L):
                assert_identical(out[b, h, i], _row_alone(q, k, v, b, h, i, mask), err_msg=f"b{b} h{h} i{i}")


@pytest.mark.parametrize("storage", [np.float16, "bfloat16"])
@pytest.mark.parametrize("group", [4, 8, 16, 24])
def test_grouped_rows_read_16_bit_keys_and_values(rng, storage, group):
    # float16 / bfloat16 keys and values are read straight from storage by up to four groups of
    # the row kernels' rows (8 rows on AVX2, 16 on AVX-512), and widened into a buffer for more:
    # the same bits either way, and those of the float32 keys and values they widen to.
    if storage == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        storage = ml_dtypes.bfloat16
    Hk, L, S, E = 2, 1, 300, 64
    Hq = group * Hk
    q = rng.standard_normal((1, Hq, L, E)).astype(np.float32)
    k = rng.standard_normal((1, Hk, S, E)).astype(storage)
    v = rng.standard_normal((1, Hk, S, E)).astype(storage)
    out = sdpa(q, k, v, enable_gqa=True)
    assert out.dtype == np.float32
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    assert_identical(out, sdpa(q, k32, v32, enable_gqa=True))
    for h in range(Hq):
        assert_identical(out[0, h, 0], _row_alone(q, k, v, 0, h, 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gqa_canonical_and_converted_calls_give_the_same_bits(rng, dtype):
    q, k, v = _inputs(rng, dtype, 8, 2, 1, 200, 32, 32)
    canonical = sdpa(q, k, v, enable_gqa=True)  # run by the core as they are
    # Keys and values with a strided last dim go through the Python rules first (copied).
    converted = sdpa(q, np.asfortranarray(k), np.asfortranarray(v), enable_gqa=True)
    assert_identical(canonical, converted)
    assert_identical(sdpa(q, k, v, enable_gqa=True, scale=1 / math.sqrt(32)), canonical)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        sdpa(q, k, v)
    with pytest.raises(ValueError, match="multiple of key heads"):
        sdpa(q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1), enable_gqa=True)


def test_decoding_results_do_not_depend_on_the_thread_count(rng, threads):
    # Decoding steps (one query row a head, hundreds of keys) run on every thread: the bits
    # must not change with the count.
    for Hq, Hk, S in [(12, 12, 512), (32, 8, 700), (8, 2, 3000)]:
        q, k, v = _inputs(rng, np.float32, Hq, Hk, 1, S, 64, 64)
        with num_threads(1):
            one = sdpa(q, k, v, enable_gqa=True)
        with num_threads(2):
            two = sdpa(q, k, v, enable_gqa=True)
        assert_identical(one, two)
