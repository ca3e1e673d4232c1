"""Masks that vary over the queries, read a block at a time.

An (L, S) or (B, H, L, S) mask -- a causal mask written out, as model code passes it, sliding
windows, packed documents, causal plus padding -- is classified once a call, a block of query
tile x 16 keys at a time (finer than the key blocks computed): keys it closes to every query
of a tile are skipped where they fill a key block or end the tile's keys, a key block where it
adds 0 is not masked, and only the rest is added entry by entry. The results must agree with
the reference and with a call that classifies nothing (the same mask read with keys that are
not contiguous), to the bit; a written-out causal mask must give the bits of is_causal; nothing
of a skipped block (a NaN in its keys or values) may reach an output.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPE_IDS, DTYPES, assert_close, assert_identical, num_threads, ref_mha, ref_sdpa

import attnx

sdpa = attnx.scaled_dot_product_attention

# (B, H, L, S, E): square, more keys than queries (bottom-right diagonals), more queries than
# keys, a long key sequence (several accumulation chunks), a short tile.
SHAPES = {
    "square": (2, 3, 200, 200, 64),
    "wide": (1, 2, 97, 300, 32),
    "tall": (2, 2, 130, 90, 16),
    "long": (1, 1, 70, 2500, 16),
    "short": (3, 2, 20, 33, 24),
}


def _inputs(rng, dtype, shape):
    B, H, L, S, E = shape
    q = rng.standard_normal((B, H, L, E)).astype(dtype) * 2
    k = rng.standard_normal((B, H, S, E)).astype(dtype)
    v = rng.standard_normal((B, H, S, E)).astype(dtype)
    return q, k, v


def _sdpa_atol(v, E, dtype):
    """float32: an output is a weighted sum of value rows, and its rounding error grows as
    sqrt(E) times the values' size (as output_atol has it for the module's outputs); 1e-6
    alone fails a few entries near 0 at E = 64."""
    if np.dtype(dtype) != np.float32:
        return None
    return max(1e-6, 8 * 2.0**-24 * np.sqrt(E) * np.sqrt(np.mean(np.square(v))))


def _causal(L, S, bottom_right=False):
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    return j <= i + (S - L if bottom_right else 0)


def _documents(L, S, rng):
    """Packed sequences: each query attends the keys of its own document, causally."""
    cuts = np.sort(rng.choice(np.arange(1, min(L, S)), size=3, replace=False))
    doc_q = np.searchsorted(cuts, np.arange(L), side="right")
    doc_k = np.searchsorted(cuts, np.arange(S), side="right")
    return (doc_q[:, None] == doc_k[None, :]) & _causal(L, S)


def _pattern(name, B, H, L, S, rng):
    """An open / closed pattern broadcastable to (B, H, L, S)."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    if name == "causal":
        return _causal(L, S)
    if name == "causal-bottom-right":
        return _causal(L, S, bottom_right=True)
    if name == "window":
        return _causal(L, S, True) & (j > i + (S - L) - 40)
    if name == "documents":
        return _documents(L, S, rng)
    if name == "block-sparse":
        return ((i // 48) % 2 == 0) | ((j // 64) % 3 == 1)
    if name == "causal-and-padding":
        stop = rng.integers(1, S + 1, size=B)
        stop[0] = S
        return _causal(L, S)[None, None] & (j < stop[:, None, None, None])
    if name == "fine-runs":
        # Closed in runs of 16 keys, finer than a key block: a block of keys is computed where
        # any of its runs is open, and a tile's keys end with its last open run.
        return _causal(L, S) & ((j // 16) % 3 != 1)
    if name == "short-documents":
        doc_q, doc_k = np.arange(L) // 21, np.arange(S) // 21
        return (doc_q[:, None] == doc_k[None, :]) & _causal(L, S)
    if name == "per-head":
        heads = [_causal(L, S), (i >= 0) & ((j // 64) % 2 == 0),
                 _causal(L, S, True) & (j > i + S - L - 64)]
        return np.stack([heads[h % 3] for h in range(H)])[None]
    raise ValueError(name)


PATTERNS = ["causal", "causal-bottom-right", "window", "documents", "block-sparse",
            "causal-and-padding", "per-head", "fine-runs", "short-documents"]


def _float_mask(is_open, dtype, rng=None):
    """0 where open (or, with rng, a bias), -inf where closed."""
    added = 0.0 if rng is None else rng.standard_normal(is_open.shape)
    return np.where(is_open, added, -np.inf).astype(dtype)


def _keys_not_contiguous(mask):
    """The same values, read with a key stride of 2: such a mask is not classified."""
    wide = np.repeat(mask, 2, axis=-1)
    out = wide[..., ::2]
    assert out.strides[-1] == 2 * mask.itemsize and np.array_equal(out, mask, equal_nan=True)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("kind", ["float", "bool", "bias"])
def test_patterns_match_reference_and_keep_bits(rng, dtype, shape, pattern, kind):
    q, k, v = _inputs(rng, dtype, shape)
    is_open = _pattern(pattern, *shape[:4], rng)
    mask = {"bool": is_open, "float": _float_mask(is_open, dtype),
            "bias": _float_mask(is_open, dtype, rng)}[kind]
    out = sdpa(q, k, v, attn_mask=mask)
    expected = ref_sdpa(q, k, v, attn_mask=mask)
    assert_close(out, expected, dtype, atol=_sdpa_atol(v, shape[4], dtype))
    float_mask = _float_mask(is_open, dtype) if kind == "bool" else mask
    assert_identical(out, sdpa(q, k, v, attn_mask=_keys_not_contiguous(float_mask)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("bottom_right", [False, True], ids=["top-left", "bottom-right"])
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_written_out_causal_mask_has_the_bits_of_is_causal(rng, dtype, shape, bottom_right, kind):
    q, k, v = _inputs(rng, dtype, shape)
    is_open = _causal(shape[2], shape[3], bottom_right)
    mask = is_open if kind == "bool" else _float_mask(is_open, dtype)
    by_mask = sdpa(q, k, v, attn_mask=mask)
    by_flag = sdpa(q, k, v, is_causal="bottom_right" if bottom_right else True)
    if shape[2] > shape[3] and bottom_right:
        # Rows with no key: zero in both (torch's flag gives NaN there; see API.md).
        assert not np.any(by_mask[:, :, : shape[2] - shape[3]])
    assert_identical(by_mask, by_flag)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nothing_of_a_skipped_block_reaches_an_output(rng, dtype):
    """Keys closed to every query (a region no document reaches) hold NaN and inf in their
    keys and values: the output is that of the call without those keys; rows with no open key
    are zero."""
    B, H, L, S, E = 2, 2, 150, 400, 32
    q, k, v = _inputs(rng, dtype, (B, H, L, S, E))
    is_open = _causal(L, S, bottom_right=True)
    dead = slice(64, 256)  # whole key blocks, closed to every row
    is_open[:, dead] = False
    is_open[7] = False  # a row with no open key
    k[:, :, dead] = np.nan
    v[:, :, dead] = np.inf
    v[:, :, 100, 3] = np.nan
    for mask in (is_open, _float_mask(is_open, dtype)):
        out = sdpa(q, k, v, attn_mask=mask)
        keep = np.r_[0 : dead.start, dead.stop : S]
        expected = ref_sdpa(q, k[:, :, keep], v[:, :, keep], attn_mask=mask[:, keep])
        assert np.all(np.isfinite(out))
        assert not np.any(out[:, :, 7])
        assert_close(out, expected, dtype, atol=_sdpa_atol(np.nan_to_num(v[:, :, keep]), E, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_thread_count_changes_no_bit(rng, dtype):
    shape = (2, 3, 300, 300, 32)
    q, k, v = _inputs(rng, dtype, shape)
    mask = _float_mask(_pattern("documents", *shape[:4], rng), dtype)
    with num_threads(1):
        one = sdpa(q, k, v, attn_mask=mask)
    with num_threads(3):
        three = sdpa(q, k, v, attn_mask=mask)
    assert_identical(one, three)


def _module(rng, E, H, dtype):
    m = attnx.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    m.load_state_dict({n: (rng.standard_normal(p.shape) * 0.2).astype(dtype)
                       for n, p in m.state_dict().items()})
    return m


def _ref_module(m, x, **kwargs):
    sd = m.state_dict()
    return ref_mha(
        query=x, key=x, value=x, batch_first=True, embed_dim_to_check=m.embed_dim,
        num_heads=m.num_heads, in_proj_weight=sd["in_proj_weight"],
        in_proj_bias=sd["in_proj_bias"], bias_k=None, bias_v=None, add_zero_attn=False,
        dropout_p=0.0, out_proj_weight=sd["out_proj.weight"], out_proj_bias=sd["out_proj.bias"],
        training=False, **kwargs,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("pattern", ["causal", "documents", "block-sparse"])
def test_module_with_attn_mask_and_key_padding(rng, dtype, need_weights, average, pattern):
    """MultiheadAttention's attn_mask (True = masked) with a key_padding_mask: two masks, merged
    per block; the weights of closed keys are exactly 0, and the bits are those of the same
    attn_mask read without classification."""
    N, L, E, H = 3, 260, 128, 2  # head dim 64: key blocks of at most 64 keys
    m = _module(rng, E, H, dtype)
    x = rng.standard_normal((N, L, E)).astype(dtype) * 0.3
    attn_mask = ~_pattern(pattern, 1, 1, L, L, rng)
    padding = np.arange(L)[None, :] >= rng.integers(L // 3, L + 1, size=N)[:, None]
    padding[0] = False
    kwargs = dict(attn_mask=attn_mask, key_padding_mask=padding, need_weights=need_weights,
                  average_attn_weights=average)
    out, weights = m(x, x, x, **kwargs)
    ref_out, ref_weights = _ref_module(m, x, **kwargs)
    assert_close(out, ref_out, dtype)
    float_mask = _float_mask(~attn_mask, dtype)
    same_out, same_weights = m(x, x, x, **dict(kwargs, attn_mask=_keys_not_contiguous(float_mask)))
    assert_identical(out, same_out)
    if need_weights:
        assert_close(weights, ref_weights, dtype)
        closed = attn_mask[None] | padding[:, None, :]
        if not average:
            closed = closed[:, None]
        assert np.all(weights[np.broadcast_to(closed, weights.shape)] == 0)
        assert_identical(weights, same_weights)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_masks_merge_as_torch_per_block(rng, dtype, need_weights):
    """A block that one mask closes and the other adds +inf or NaN to is not closed: the sum
    is NaN and reaches the row, as in torch. A block that one closes and the other adds 0 to
    is closed."""
    N, L, E, H = 2, 200, 128, 2  # head dim 64: key blocks of at most 64 keys
    m = _module(rng, E, H, dtype)
    x = rng.standard_normal((N, L, E)).astype(dtype) * 0.3
    attn_mask = _float_mask(_causal(L, L), dtype)
    padding = np.zeros((N, L), dtype)
    padding[0, 100] = np.inf  # in blocks that the causal mask closes to rows < 64: NaN there
    padding[1, 190] = np.nan
    out, weights = m(x, x, x, attn_mask=attn_mask, key_padding_mask=padding,
                     need_weights=need_weights)
    ref_out, ref_weights = _ref_module(m, x, attn_mask=attn_mask, key_padding_mask=padding,
                                       need_weights=need_weights)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    assert np.all(np.isnan(out[0])) and np.all(np.isnan(out[1]))
    if need_weights:
        np.testing.assert_array_equal(np.isnan(weights), np.isnan(ref_weights))


@pytest.mark.parametrize("pattern", ["causal-and-padding", "per-head", "documents"])
@pytest.mark.parametrize("kv", ["gqa", "float16", "plain"])
def test_grouped_heads_and_16_bit_keys(rng, pattern, kv):
    """Grouped-query attention (the masks' heads are the query heads) and keys and values
    stored as float16 (widened a block at a time; a skipped block is never read)."""
    B, Hq, L, S, E = 2, 4, 150, 300, 64
    Hk = 2 if kv == "gqa" else Hq
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    k = rng.standard_normal((B, Hk, S, E)).astype(np.float32)
    v = rng.standard_normal((B, Hk, S, E)).astype(np.float32)
    if kv == "float16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    mask = _float_mask(_pattern(pattern, B, Hq, L, S, rng), np.float32)
    kwargs = {"enable_gqa": True} if kv == "gqa" else {}
    out = sdpa(q, k, v, attn_mask=mask, **kwargs)
    expected = ref_sdpa(q, k, v, attn_mask=mask, **kwargs)
    assert_close(out, expected, np.float32, atol=_sdpa_atol(v.astype(np.float64), E, np.float32))
    assert_identical(out, sdpa(q, k, v, attn_mask=_keys_not_contiguous(mask), **kwargs))
