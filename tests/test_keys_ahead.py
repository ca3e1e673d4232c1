"""Calls that read their keys and values from memory ask for them ahead.

A tile-path call that reads more than 64 MiB of keys and values (in memory: a broadcast batch
or head axis counts once) has the first tile of each task ask for each block's values while it
scores the block, and for the next block's keys while it accumulates, between pieces of the
gemms. The pieces sum every output as one gemm does, so the heads of such a call must have the
bits of the same heads in a call too small to ask ahead, on every thread count, and agree with
the reference: one tile per head, grouped tiles, grouped-query heads, a bottom-right causal
band, padding masks, float16 keys and values, and values of a width that is no multiple of the
pieces.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, assert_identical, num_threads, ref_sdpa

import attnx

sdpa = attnx.scaled_dot_product_attention

MIB = 2**20
THREADS = (1, 2, 3)


def _key_heads_past_64_mib(S, E, Ev, itemsize):
    """Key heads whose keys and values together hold just over 64 MiB."""
    return 64 * MIB // (S * (E + Ev) * itemsize) + 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["one-tile", "grouped-tiles", "gqa", "bottom-right", "padding", "float16", "values-of-80"],
)
def test_heads_asked_ahead_have_the_bits_of_a_small_call(rng, case):
    S, E = 4096, 128
    Ev = 80 if case == "values-of-80" else E  # a last piece of the values narrower than 32
    kv_dtype = np.float16 if case == "float16" else np.float32
    Hk = _key_heads_past_64_mib(S, E, Ev, np.dtype(kv_dtype).itemsize)
    Hq = 2 * Hk if case == "gqa" else Hk
    L = 96 if case == "grouped-tiles" else 40 if case == "bottom-right" else 16
    q = rng.standard_normal((1, Hq, L, E)).astype(np.float32)
    k = rng.standard_normal((1, Hk, S, E)).astype(kv_dtype)
    v = rng.standard_normal((1, Hk, S, Ev)).astype(kv_dtype)
    assert k.nbytes + v.nbytes > 64 * MIB
    kwargs = {"enable_gqa": case == "gqa"}
    if case == "bottom-right":
        kwargs["is_causal"] = "bottom_right"

    def mask(heads):
        if case != "padding":
            return None
        # Each head's last 100 + 37 h keys closed (a per-head padding mask).
        h = np.arange(heads)[:, None, None]
        return np.where(np.arange(S)[None, None, :] < S - 100 - 37 * h, 0.0, -np.inf).astype(
            np.float32
        )[None]

    results = []
    for n in THREADS:
        with num_threads(n):
            results.append(sdpa(q, k, v, attn_mask=mask(Hq), **kwargs))
    for n, result in zip(THREADS[1:], results[1:]):
        assert_identical(results[0], result, err_msg=f"1 thread against {n}")
    whole = results[0]

    # Two key heads at a time (8 MiB at most): too small to ask ahead.
    group = Hq // Hk
    with num_threads(2):
        for kh in (0, Hk // 2, Hk - 2):
            heads = slice(kh * group, (kh + 2) * group)
            m = mask(Hq)
            small = sdpa(
                q[:, heads], k[:, kh : kh + 2], v[:, kh : kh + 2],
                attn_mask=None if m is None else m[:, heads], **kwargs,
            )
            assert_identical(small, whole[:, heads], err_msg=f"key heads {kh} and {kh + 1}")

    heads = slice(0, group)
    m = mask(Hq)
    expected = ref_sdpa(
        q[:, heads], k[:, :1].astype(np.float64), v[:, :1].astype(np.float64),
        attn_mask=None if m is None else m[:, heads],
        is_causal=kwargs.get("is_causal", False), enable_gqa=kwargs["enable_gqa"],
    )
    assert_close(whole[:, heads], expected, np.float32, atol=2e-6)

