"""Outputs never alias inputs (unless passed as ``out=``), and inputs are never modified.

For every entry point and several input layouts: every array argument (module parameters
included) is byte-for-byte the same after the call; no result shares memory with any input,
with another result of the same call, or with a result of an earlier call (no output buffer
is reused behind the caller's back). ``out=`` is the one exception, and only for itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import core_mha, core_sdpa, DTYPE_IDS, DTYPES, mha_args, mha_mask, randn, sdpa_mask


def snapshot(arrays):
    return [(a, a.copy(), a.strides, a.flags.writeable) for a in arrays if isinstance(a, np.ndarray)]


def assert_untouched(snap):
    for a, copy, strides, writeable in snap:
        assert a.strides == strides and a.flags.writeable == writeable
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(copy).view(np.uint8))


def assert_disjoint(results, arrays):
    results = [r for r in results if r is not None]
    for i, r in enumerate(results):
        for x in arrays:
            if isinstance(x, np.ndarray):
                assert not np.shares_memory(r, x)
        for other in results[i + 1:]:
            assert not np.shares_memory(r, other)


def sdpa_calls(rng, dtype):
    q, k, v = randn(rng, (2, 3, 40, 16), dtype), randn(rng, (2, 3, 70, 16), dtype), randn(rng, (2, 3, 70, 8), dtype)
    fmask = sdpa_mask(rng, "float", (1, 3, 40, 70), dtype)
    bmask = sdpa_mask(rng, "bool", (40, 70))
    qb = np.broadcast_to(q[:1], q.shape)  # a stride-0 input
    qd = randn(rng, (1, 3, 1, 16), dtype)  # decoding
    return {
        "plain": ((q, k, v), {}),
        "plain 3-D": ((q[0], k[0], v[0]), {}),
        "causal": ((q, k, v), {"is_causal": True}),
        "float mask": ((q, k, v), {"attn_mask": fmask, "scale": 0.2}),
        "bool mask": ((q, k, v), {"attn_mask": bmask}),
        "broadcast query": ((qb, k, v), {}),
        "decode": ((qd, k[:1], v[:1]), {}),
        "fortran key": ((q, np.asfortranarray(k), v), {}),
        "empty keys": ((q, k[:, :, :0], v[:, :, :0]), {}),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sdpa(rng, dtype):
    earlier = []
    for name, (pos, kw) in sdpa_calls(rng, dtype).items():
        arrays = list(pos) + [v for v in kw.values() if isinstance(v, np.ndarray)]
        snap = snapshot(arrays)
        r = attnx.scaled_dot_product_attention(*pos, **kw)
        assert_untouched(snap)
        assert_disjoint([r], arrays + earlier)
        assert r.flags.writeable and r.flags.c_contiguous, name
        earlier.append(r)
        # out=: the result is `out` itself, and only `out` is written.
        out = np.full(r.shape, np.nan, dtype)
        got = attnx.scaled_dot_product_attention(*pos, **kw, out=out)
        assert got is out
        assert_untouched(snap)
        np.testing.assert_array_equal(out, r)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("options", [
    dict(), dict(need_weights=False), dict(average_attn_weights=False), dict(batch_first=True),
    dict(bias_kv=True, add_zero_attn=True), dict(unbatched=True), dict(kdim=5, vdim=3),
])
def test_mha(rng, dtype, options):
    masks = options.pop("masks", True)
    args = mha_args(rng, L=9, S=11, N=2, E=8, H=2, dtype=dtype, **options)
    if masks and not options.get("unbatched"):
        args["key_padding_mask"] = mha_mask(rng, "bool", (2, 11))
        args["attn_mask"] = mha_mask(rng, "float", (9, 11), dtype)
    arrays = [v for v in args.values() if isinstance(v, np.ndarray)]
    snap = snapshot(arrays)
    out, w = attnx.multi_head_attention_forward(**args)
    out2, w2 = attnx.multi_head_attention_forward(**args)
    assert_untouched(snap)
    assert_disjoint([out, w, out2, w2], arrays)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_static_keys_are_not_aliased(rng, dtype):
    args = mha_args(rng, L=4, S=6, N=2, E=8, H=2, dtype=dtype, average_attn_weights=False)
    args["static_k"] = randn(rng, (4, 6, 4), dtype)
    args["static_v"] = randn(rng, (4, 6, 4), dtype)
    for zero in (False, True):
        a = dict(args, add_zero_attn=zero)
        arrays = [v for v in a.values() if isinstance(v, np.ndarray)]
        snap = snapshot(arrays)
        out, w = attnx.multi_head_attention_forward(**a)
        assert_untouched(snap)
        assert_disjoint([out, w], arrays)


@pytest.mark.parametrize("batch_first", [False, True])
def test_module(rng, batch_first):
    m = attnx.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=batch_first, seed=0)
    params = [getattr(m, n) for n in ("in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj_weight", "out_proj_bias")]
    x = randn(rng, (5, 3, 8), np.float32)
    N, L = (5, 3) if batch_first else (3, 5)
    for kw in ({}, {"need_weights": False}, {"key_padding_mask": mha_mask(rng, "bool", (N, L))},
               {"attn_mask": mha_mask(rng, "float", (L, L)), "average_attn_weights": False}):
        arrays = params + [x] + [v for v in kw.values() if isinstance(v, np.ndarray)]
        snap = snapshot(arrays)
        out, w = m(x, x, x, **kw)
        assert_untouched(snap)
        assert_disjoint([out, w], arrays)
    # state_dict hands out copies; load_state_dict keeps copies.
    sd = m.state_dict()
    assert_disjoint(list(sd.values()), params)
    given = {k: v.copy() for k, v in sd.items()}
    snap = snapshot(list(given.values()))
    m.load_state_dict(given)
    assert_untouched(snap)
    assert_disjoint([getattr(m, n) for n in ("in_proj_weight", "out_proj_weight", "bias_k")], list(given.values()))


def test_core_functions_write_only_their_outputs(rng):
    f = np.float32
    q, k, v = randn(rng, (2, 2, 5, 8), f), randn(rng, (2, 1, 7, 8), f), randn(rng, (2, 1, 7, 4), f)
    mask = randn(rng, (2, 2, 5, 7), f)
    snap = snapshot([q, k, v, mask])
    out, weights = np.empty((2, 2, 5, 4), f), np.empty((2, 2, 5, 7), f)
    core_sdpa(q, k, v, mask, False, 0.5, out, weights)
    assert_untouched(snap)
    q4 = randn(rng, (2, 2, 5, 8), f)
    r1 = attnx.scaled_dot_product_attention(q4, q4, q4)
    r2 = attnx.scaled_dot_product_attention(q4, q4, q4, is_causal=True)
    assert_disjoint([r1, r2], [q4])
    x = randn(rng, (2, 5, 8), f)
    w = randn(rng, (8, 8), f)
    snap = snapshot([x, w])
    out = np.empty((2, 5, 8), f)
    core_mha(2, x, x, x, w, w, w, None, None, None, None, None, False, None, None, None, None, False,
              w, None, out, None, True)
    assert_untouched(snap)
