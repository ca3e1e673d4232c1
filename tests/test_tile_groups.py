"""Long key sequences: query tiles visited together, a chunk of keys at a time.

Where a head's keys and values outgrow L2 (more than 1 MiB, and more than one chunk of 1024
keys), several query tiles of a head share a task and visit their keys one chunk at a time in
turn. How many share a task depends on the thread count; each tile sums the same blocks in the
same order whatever it is, so the results must be the same to the bit for every thread count,
and agree with the reference: with padding, masks, causal bands, grouped-query heads, float16
keys and values, and NaN in closed values.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPE_IDS, DTYPES, assert_close, assert_identical, num_threads, ref_sdpa

import attnx

sdpa = attnx.scaled_dot_product_attention

THREADS = (1, 2, 3, 8)


def _inputs(rng, dtype, B, Hq, Hk, L, S, E):
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hk, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hk, S, E)).astype(dtype)
    return q, k, v


def _same_for_every_thread_count(call):
    results = []
    for n in THREADS:
        with num_threads(n):
            results.append(call())
    for n, result in zip(THREADS[1:], results[1:]):
        assert_identical(results[0], result, err_msg=f"1 thread against {n}")
    return results[0]


def _atol(v, E, dtype):
    if np.dtype(dtype) != np.float32:
        return None
    return max(1e-6, 8 * 2.0**-24 * np.sqrt(E) * np.sqrt(np.mean(np.square(v))))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "case", ["plain", "causal", "bottom-right", "padding", "mask", "gqa", "nan-closed"]
)
def test_grouped_tiles_match_reference_for_every_thread_count(rng, dtype, case):
    B, Hq, Hk, L, S, E = 1, 2, 2, 300, 2600, 64  # 1.3 MiB of keys and values per head
    if case == "gqa":
        Hq = 4
    q, k, v = _inputs(rng, dtype, B, Hq, Hk, L, S, E)
    kwargs = {"enable_gqa": True} if case == "gqa" else {}
    if case == "causal":
        # A square causal call: its tiles reach the chunks one after another.
        kwargs["is_causal"] = True
        q = rng.standard_normal((B, Hq, S, E)).astype(dtype)
    elif case == "bottom-right":
        kwargs["is_causal"] = "bottom_right"
    elif case == "padding":
        kwargs["attn_mask"] = np.arange(S)[None, None, None, :] < 1500
    elif case == "mask":
        kwargs["attn_mask"] = rng.random((L, S)) > 0.3
    elif case == "nan-closed":
        closed = rng.random(S) < 0.2
        closed[:5] = False
        kwargs["attn_mask"] = np.where(closed, -np.inf, 0.0).astype(dtype)
        v[:, :, closed] = np.nan
    out = _same_for_every_thread_count(lambda: sdpa(q, k, v, **kwargs))
    expected = ref_sdpa(q, k, v, **kwargs)
    assert np.all(np.isfinite(out))
    assert_close(out, expected, dtype, atol=_atol(np.nan_to_num(v), E, dtype))


def test_grouped_tiles_read_float16_keys_and_values(rng):
    q, k, v = _inputs(rng, np.float32, 1, 2, 2, 200, 3000, 80)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    out = _same_for_every_thread_count(lambda: sdpa(q, k16, v16))
    assert_close(out, ref_sdpa(q, k16.astype(np.float64), v16.astype(np.float64)), np.float32,
                 atol=_atol(v, 80, np.float32))


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
def test_grouped_tiles_have_the_bits_of_a_tile_alone(rng, masked):
    """A call of one tile of queries (32 rows) has one tile per task; the same rows within a
    long call are visited in a group: the bits are the same."""
    L, S = 320, 2600
    q, k, v = _inputs(rng, np.float32, 1, 1, 1, L, S, 64)
    mask = rng.random((L, S)) > 0.3 if masked else None
    with num_threads(2):
        whole = sdpa(q, k, v, attn_mask=mask)
        for i0 in (0, 96, 288):
            rows = slice(i0, i0 + 32)
            alone = sdpa(q[:, :, rows], k, v, attn_mask=None if mask is None else mask[rows])
            assert_identical(alone, whole[:, :, rows], err_msg=f"rows from {i0}")
