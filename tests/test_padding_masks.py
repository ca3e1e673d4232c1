"""Masks that close the same keys for every query: a batch's padding.

A mask broadcast over the queries (an sdpa mask of shape (N, 1, 1, S), MultiheadAttention's
key_padding_mask) closes the same keys for every query row, and the kernels skip the keys it
closes as they skip those outside a causal band. The results must agree with the reference,
nothing of a closed key (a NaN in its key or value included) may reach an output, and skipping
must change no bit: the same mask written out for every query row, or with one more key left
open at a score that no exp can tell from -inf, gives the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPE_IDS, DTYPES, assert_close, assert_identical, num_threads, ref_mha, ref_sdpa

import attnx

sdpa = attnx.scaled_dot_product_attention

# (B, Hq, Hk, L, S, E): the tile path (many queries), a few rows, decoding steps (one query,
# keys split across threads when long), grouped-query decoding.
SHAPES = {
    "tile": (3, 2, 2, 40, 300, 32),
    "tile-long": (2, 1, 1, 70, 1300, 16),
    "rows": (3, 2, 2, 3, 700, 24),
    "decode": (3, 4, 4, 1, 2600, 64),
    "gqa-decode": (2, 8, 2, 1, 1100, 32),
}


def _lengths(rng, B, S, side):
    """Per batch entry, the open keys [start, stop): padding after, before or on both sides."""
    stop = rng.integers(1, S + 1, size=B)
    stop[0] = S  # one entry without padding
    start = np.zeros(B, dtype=np.int64)
    if side in ("before", "both"):
        start = rng.integers(0, stop)
    if side == "before":
        stop[:] = S
        start[0] = 0
    return start, stop


def _padding_mask(start, stop, S, dtype, kind):
    j = np.arange(S)
    is_open = (j >= start[:, None]) & (j < stop[:, None])  # (B, S)
    if kind == "bool":
        return is_open[:, None, None, :]
    return np.where(is_open, 0.0, -np.inf).astype(dtype)[:, None, None, :]


def _inputs(rng, dtype, shape):
    B, Hq, Hk, L, S, E = shape
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype) * 2
    k = rng.standard_normal((B, Hk, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hk, S, E)).astype(dtype)
    return q, k, v, {"enable_gqa": True} if Hq != Hk else {}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("side", ["after", "before", "both"])
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_padding_matches_reference(rng, dtype, shape, side, kind):
    q, k, v, gqa = _inputs(rng, dtype, shape)
    start, stop = _lengths(rng, shape[0], shape[4], side)
    mask = _padding_mask(start, stop, shape[4], dtype, kind)
    out = sdpa(q, k, v, attn_mask=mask, **gqa)
    assert_close(out, ref_sdpa(q, k, v, attn_mask=mask, **gqa), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_key_bias_with_padding(rng, dtype, shape):
    """A mask broadcast over queries that adds a bias to its open keys (not 0) and closes the
    padding: the bias must be added, the padding closed, the bits those of the mask written out
    for every query row."""
    q, k, v, gqa = _inputs(rng, dtype, shape)
    B, Hq, _, L, S, _ = shape
    start, stop = _lengths(rng, B, S, "both")
    bias = rng.standard_normal((B, 1, 1, S)).astype(dtype)
    bias[..., : S // 3] = 0  # zero on some open keys, not on others
    mask = _padding_mask(start, stop, S, dtype, "float") + bias
    out = sdpa(q, k, v, attn_mask=mask, **gqa)
    assert_close(out, ref_sdpa(q, k, v, attn_mask=mask, **gqa), dtype)
    written_out = np.ascontiguousarray(np.broadcast_to(mask, (B, Hq, L, S)))
    if L > 1:
        assert_identical(out, sdpa(q, k, v, attn_mask=written_out, **gqa))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_closed_keys_are_never_read(rng, dtype, shape):
    """NaN and inf in the padded keys and values: each entry equals the call on its open keys."""
    q, k, v, gqa = _inputs(rng, dtype, shape)
    S = shape[4]
    start, stop = _lengths(rng, shape[0], S, "both")
    stop[-1] = start[-1]  # an entry with every key closed: zero rows
    for b in range(shape[0]):
        k[b, :, :start[b]] = np.nan
        v[b, :, stop[b]:] = np.inf
        v[b, :, :start[b]] = np.nan
    out = sdpa(q, k, v, attn_mask=_padding_mask(start, stop, S, dtype, "float"), **gqa)
    for b in range(shape[0]):
        if stop[b] == start[b]:
            np.testing.assert_array_equal(out[b], 0)
            continue
        kb, vb = k[b : b + 1, :, start[b] : stop[b]], v[b : b + 1, :, start[b] : stop[b]]
        assert_close(out[b : b + 1], ref_sdpa(q[b : b + 1], kb, vb, **gqa), dtype,
                     err_msg=f"batch entry {b}, open keys [{start[b]}, {stop[b]})")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [SHAPES["tile"], SHAPES["tile-long"]], ids=["tile", "tile-long"])
def test_skipping_keeps_bits_in_tiles(rng, dtype, shape):
    """The mask written out for every query row is read a row at a time, and skips nothing."""
    q, k, v, gqa = _inputs(rng, dtype, shape)
    B, Hq, _, L, S, _ = shape
    start, stop = _lengths(rng, B, S, "both")
    mask = _padding_mask(start, stop, S, dtype, "float")
    written_out = np.ascontiguousarray(np.broadcast_to(mask, (B, Hq, L, S)))
    assert_identical(sdpa(q, k, v, attn_mask=mask, **gqa), sdpa(q, k, v, attn_mask=written_out, **gqa))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_skipping_keeps_bits_with_a_last_key_open(rng, dtype, shape):
    """The first and last keys left open at a score whose exp is 0 keep every key in reach,
    so that nothing is skipped: no bit moves."""
    q, k, v, gqa = _inputs(rng, dtype, shape)
    B, S = shape[0], shape[4]
    start, stop = _lengths(rng, B, S, "both")  # every entry keeps an open key
    mask = _padding_mask(start, stop, S, dtype, "float")
    reaching = mask.copy()
    ends = reaching[..., [0, S - 1]]
    reaching[..., [0, S - 1]] = np.where(ends == -np.inf, np.finfo(dtype).min / 2, ends)
    assert_identical(sdpa(q, k, v, attn_mask=mask, **gqa), sdpa(q, k, v, attn_mask=reaching, **gqa))


def test_padding_is_thread_count_independent(rng):
    q, k, v, _ = _inputs(rng, np.float32, (3, 4, 4, 1, 9000, 64))
    start, stop = _lengths(rng, 3, 9000, "both")
    mask = _padding_mask(start, stop, 9000, np.float32, "bool")
    with num_threads(1):
        one = sdpa(q, k, v, attn_mask=mask)
    with num_threads(2):
        two = sdpa(q, k, v, attn_mask=mask)
    assert_identical(one, two)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("side", ["after", "both"])
def test_mha_key_padding_mask(rng, need_weights, side):
    """MultiheadAttention's key_padding_mask (broadcast over heads and queries), long padding."""
    N, L, S, E, H = 3, 20, 400, 32, 4
    m = attnx.MultiheadAttention(E, H, batch_first=True, dtype=np.float64)
    m.load_state_dict({name: rng.standard_normal(p.shape) * 0.2 for name, p in m.state_dict().items()})
    x = rng.standard_normal((N, L, E))
    mem = rng.standard_normal((N, S, E))
    start, stop = _lengths(rng, N, S, side)  # "after": the first entry without padding
    stop[-1] = start[-1]  # an entry with every key padded: zero attention, zero weights
    padding = ~_padding_mask(start, stop, S, np.float64, "bool")[:, 0, 0, :]
    out, weights = m(x, mem, mem, key_padding_mask=padding, need_weights=need_weights)
    sd = m.state_dict()
    ref_out, ref_weights = ref_mha(
        query=x, key=mem, value=mem, batch_first=True,
        embed_dim_to_check=E, num_heads=H, in_proj_weight=sd["in_proj_weight"],
        in_proj_bias=sd["in_proj_bias"], bias_k=None, bias_v=None, add_zero_attn=False,
        dropout_p=0.0, out_proj_weight=sd["out_proj.weight"], out_proj_bias=sd["out_proj.bias"],
        training=False, key_padding_mask=padding, need_weights=need_weights,
    )
    assert_close(out, ref_out, np.float64)
    if need_weights:
        assert_close(weights, ref_weights, np.float64)
        closed = np.broadcast_to(padding[:, None, :], weights.shape)
        assert np.all(weights[closed] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("average", [True, False])
def test_weights_keep_bits_when_padding_is_skipped(rng, dtype, average):
    """need_weights=True: the last key left open at a score whose exp is 0 (so that no key
    is skipped) gives the same weights and output, to the bit."""
    N, L, S, E, H = 3, 20, 300, 32, 4
    m = attnx.MultiheadAttention(E, H, batch_first=True, dtype=dtype, seed=1)
    x = rng.standard_normal((N, L, E)).astype(dtype)
    mem = rng.standard_normal((N, S, E)).astype(dtype)
    start, stop = _lengths(rng, N, S, "both")
    stop = np.minimum(stop, S - 1)
    start = np.minimum(start, stop - 1)
    padding = _padding_mask(start, stop, S, dtype, "float")[:, 0, 0, :]
    reaching = padding.copy()
    reaching[:, -1] = np.finfo(dtype).min / 2
    out, weights = m(x, mem, mem, key_padding_mask=padding, average_attn_weights=average)
    out_r, weights_r = m(x, mem, mem, key_padding_mask=reaching, average_attn_weights=average)
    assert_identical(out, out_r)
    assert_identical(weights, weights_r)
    closed = padding == -np.inf  # (N, S)
    closed = closed[:, None, :] if average else closed[:, None, None, :]
    assert np.all(weights[np.broadcast_to(closed, weights.shape)] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [SHAPES["tile"], SHAPES["tile-long"], SHAPES["rows"]],
                         ids=["tile", "tile-long", "rows"])
@pytest.mark.parametrize("window", [(None, 0), (50, 0), (20, 20)], ids=["causal", "left50", "band20"])
def test_padding_with_a_window(rng, dtype, shape, window):
    """Padding and a band of keys per query (a sliding window, causal): blocks the band crosses
    take both."""
    q, k, v, gqa = _inputs(rng, dtype, shape)
    start, stop = _lengths(rng, shape[0], shape[4], "both")
    mask = _padding_mask(start, stop, shape[4], dtype, "float")
    kw = dict(attn_mask=mask, window=window, **gqa)
    assert_close(sdpa(q, k, v, **kw), ref_sdpa(q, k, v, **kw), dtype)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("extra", ["bias_kv", "zero_attn"])
def test_mha_padding_with_appended_keys_and_causal(rng, need_weights, extra):
    """key_padding_mask with keys appended after the source ones (bias_k/bias_v, a zero key),
    which the mask does not cover and which stay open, and is_causal."""
    N, L, E, H = 3, 150, 32, 4
    m = attnx.MultiheadAttention(E, H, batch_first=True, dtype=np.float64, seed=2,
                                 add_bias_kv=extra == "bias_kv", add_zero_attn=extra == "zero_attn")
    x = rng.standard_normal((N, L, E))
    start, stop = _lengths(rng, N, L, "after")
    padding = ~_padding_mask(start, stop, L, np.float64, "bool")[:, 0, 0, :]
    out, weights = m(x, x, x, key_padding_mask=padding, need_weights=need_weights, is_causal=True)
    sd = m.state_dict()
    ref_out, ref_weights = ref_mha(
        query=x, key=x, value=x, batch_first=True, embed_dim_to_check=E, num_heads=H,
        in_proj_weight=sd["in_proj_weight"], in_proj_bias=sd["in_proj_bias"],
        bias_k=sd.get("bias_k"), bias_v=sd.get("bias_v"), add_zero_attn=extra == "zero_attn",
        dropout_p=0.0, out_proj_weight=sd["out_proj.weight"], out_proj_bias=sd["out_proj.bias"],
        training=False, key_padding_mask=padding, need_weights=need_weights, is_causal=True,
    )
    assert_close(out, ref_out, np.float64)
    if need_weights:
        assert_close(weights, ref_weights, np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mha_float_key_padding_with_bias_and_weights(rng, dtype):
    """A float key_padding_mask that adds a bias to some open keys and closes the padding; with
    weights."""
    N, L, S, E, H = 3, 40, 200, 32, 4
    m = attnx.MultiheadAttention(E, H, batch_first=True, dtype=dtype, seed=4)
    x = rng.standard_normal((N, L, E)).astype(dtype)
    mem = rng.standard_normal((N, S, E)).astype(dtype)
    start, stop = _lengths(rng, N, S, "both")
    padding = _padding_mask(start, stop, S, dtype, "float")[:, 0, 0, :]
    padding[:, S // 2 :] += rng.standard_normal((N, S - S // 2)).astype(dtype)
    out, weights = m(x, mem, mem, key_padding_mask=padding, average_attn_weights=False)
    sd = m.state_dict()
    ref_out, ref_weights = ref_mha(
        query=x, key=mem, value=mem, batch_first=True, embed_dim_to_check=E, num_heads=H,
        in_proj_weight=sd["in_proj_weight"], in_proj_bias=sd["in_proj_bias"], bias_k=None,
        bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=sd["out_proj.weight"],
        out_proj_bias=sd["out_proj.bias"], training=False, key_padding_mask=padding,
        need_weights=True, average_attn_weights=False,
    )
    assert_close(out, ref_out, dtype, atol=None if dtype == np.float64 else 2e-6)
    assert_close(weights, ref_weights, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [SHAPES["gqa-decode"], SHAPES["rows"]], ids=["gqa-decode", "rows"])
def test_per_head_masks_with_padding(rng, dtype, shape):
    """Padding with a mask that differs between the query heads read together (a bias on some
    heads, 0 on the others): each head's own mask applies."""
    q, k, v, gqa = _inputs(rng, dtype, shape)
    B, Hq, _, L, S, _ = shape
    start, stop = _lengths(rng, B, S, "after")
    bias = rng.standard_normal((B, Hq, 1, S)).astype(dtype)
    bias[:, ::2] = 0  # even heads: the padding alone
    mask = _padding_mask(start, stop, S, dtype, "float") + bias
    out = sdpa(q, k, v, attn_mask=mask, **gqa)
    assert_close(out, ref_sdpa(q, k, v, attn_mask=mask, **gqa), dtype)
