"""Key and query lengths: what a sequence of a ragged batch reads, and what it writes.

Sequence ``b`` of a KVCache attends only its first ``lengths[b]`` keys: the storage past them
is never read, whatever it holds (here NaN, left over from a released slot). Its query rows
past its own count of query tokens are zeros. Checked on the row path (one token per
sequence, keys in several chunks) and the tile path (many tokens), with and without a window,
against ``attnx.reference.cached_attention`` (see docs/semantics.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

import attnx
import attnx.reference as reference

f32, f64 = np.float32, np.float64


@pytest.mark.parametrize("T", [1, 3, 40], ids=["decode", "few", "tiles"])
@pytest.mark.parametrize("window", [None, (100, 0)], ids=["causal", "window"])
def test_keys_past_a_sequence_length_are_never_read(rng, T, window):
    B, Hkv, Hq, E, S = 3, 2, 4, 32, 700
    cache = attnx.KVCache(B, Hkv, S, E)
    nan = np.full((B, Hkv, S, E), np.nan, f32)
    cache.append(nan, nan)  # every position holds NaN ...
    cache.reset()  # ... and is released: the storage keeps it
    lengths = np.array([650, T, 300])
    P = int(lengths.max())
    k = rng.standard_normal((B, Hkv, P, E)).astype(f32)
    v = rng.standard_normal((B, Hkv, P, E)).astype(f32)
    cache.append(k, v, lengths=lengths)
    assert cache.lengths.tolist() == lengths.tolist()
    assert np.isnan(cache.key[0, :, 650:]).all() and np.isnan(cache.value[2, :, 300:]).all()

    q = rng.standard_normal((B, Hq, T, E)).astype(f32)
    n = np.array([T, 0, min(T, 2)])  # valid query tokens per sequence
    out = attnx.cached_attention(q, cache, lengths=n, window=window)
    assert np.isfinite(out).all()
    # Rows past a sequence's query tokens are zeros.
    assert np.all(out[1] == 0) and np.all(out[2, :, n[2]:] == 0)
    expected = reference.cached_attention(
        q.astype(f64), cache.key.astype(f64), cache.value.astype(f64), cache.lengths.copy(), n, window=window
    )
    assert_close(out, expected, f32)
