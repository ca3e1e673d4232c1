"""attnx.scaled_dot_product_attention against the NumPy reference and against torch.

The reference (``attnx.reference``) runs in float64 on float64 copies of the inputs; attnx's
float32 results must agree to rtol 1e-5 / atol 1e-6 and its float64 results to 1e-12 (the
contract's "Numbers"). The C++ core tiles query rows by 32 and keys by 128, so lengths are
taken below, at and above those sizes.
"""

from __future__ import annotations


import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import attnx
from conftest import (
    DTYPE_IDS,
    DTYPES,
    assert_close,
    assert_identical,
    assert_no_alias,
    assert_unchanged,
    copies,
    num_threads,
    peak_traced_bytes,
    randn,
    ref_sdpa,
    sdpa_mask,
)

sdpa = attnx.scaled_dot_product_attention

LENGTHS = [1, 8, 31, 32, 33, 127, 128, 129, 300, 513]
HEAD_DIMS = [1, 15, 16, 17, 64, 80, 128]


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def qkv(rng, q_shape, k_shape, v_shape, dtype):
    return randn(rng, q_shape, dtype), randn(rng, k_shape, dtype), randn(rng, v_shape, dtype)


def well_scaled(q, scale):
    """q shrunk so that scale * q.k stays O(1) (the contract's tolerances are for that)."""
    factor = min(1.0, 1.0 / (abs(float(scale)) * np.sqrt(q.shape[-1]) + 1e-30))
    return (q * factor).astype(q.dtype)


def check(q, k, v, dtype=None, **kwargs):
    """attnx vs the float64 reference; returns attnx's result."""
    dtype = np.asarray(q).dtype if dtype is None else dtype
    out = sdpa(q, k, v, **kwargs)
    assert_close(out, ref_sdpa(q, k, v, **kwargs), dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("S", LENGTHS)
@pytest.mark.parametrize("L", LENGTHS)
def test_lengths_around_block_sizes(rng, L, S, dtype):
    E = HEAD_DIMS[(LENGTHS.index(L) + LENGTHS.index(S)) % len(HEAD_DIMS)]
    Ev = HEAD_DIMS[(LENGTHS.index(L) * 3 + LENGTHS.index(S)) % len(HEAD_DIMS)]
    q, k, v = qkv(rng, (1, 2, L, E), (1, 2, S, E), (1, 2, S, Ev), dtype)
    out = check(q, k, v)
    assert out.shape == (1, 2, L, Ev)
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("Ev", [1, 16, 17, 80])
@pytest.mark.parametrize("E", HEAD_DIMS)
def test_head_dims(rng, E, Ev, dtype):
    q, k, v = qkv(rng, (2, 2, 33, E), (2, 2, 129, E), (2, 2, 129, Ev), dtype)
    out = check(q, k, v)
    assert out.shape == (2, 2, 33, Ev)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scores_need_many_key_blocks(rng, dtype):
    # One row whose best key sits in the last key block, after many others: the online
    # softmax must rescale what it accumulated from the earlier blocks.
    q, k, v = qkv(rng, (1, 1, 40, 16), (1, 1, 700, 16), (1, 1, 700, 16), dtype)
    k[0, 0, 650] = q[0, 0, 3] * 2
    check(q, k, v)
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("masking", ["none", "causal", "bool", "float"])
@pytest.mark.parametrize("S", [1, 200, 511, 512, 513, 1025, 1300])
@pytest.mark.parametrize("L", [1, 2, 3, 5, 7])
def test_few_queries_many_keys(rng, L, S, masking, dtype):
    # Decoding shapes: few queries per head, keys split in chunks whose partial softmax
    # states are merged (the chunking must not show in the numbers).
    q, k, v = qkv(rng, (2, 3, L, 16), (2, 3, S, 16), (2, 3, S, 8), dtype)
    kwargs = {}
    if masking == "causal":
        kwargs["is_causal"] = True
    elif masking != "none":
        kwargs["attn_mask"] = sdpa_mask(rng, masking, (2, 1, L, S), dtype, keep_one=False, masked_fraction=0.5)
    check(q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L", [1, 3, 40])
def test_key_chunks_fully_masked_and_nan(rng, L, dtype):
    S = 1300
    q, k, v = qkv(rng, (1, 2, L, 16), (1, 2, S, 16), (1, 2, S, 8), dtype)
    mask = np.ones((1, 2, L, S), bool)
    mask[0, 0, :, :1100] = False  # head 0: only the last chunk is open
    mask[0, 1, 0] = False  # head 1, row 0: nothing open
    mask[0, 1, :, 600] = False  # head 1: key 600 (second chunk) closed ...
    k[0, 1, 600] = np.nan  # ... and NaN
    v[0, 1, 601] = np.nan  # key 601 open: NaN in column 0.. of every row that attends it
    with np.errstate(invalid="ignore"):
        out = check(q, k, v, attn_mask=mask)
    np.testing.assert_array_equal(out[0, 1, 0], 0.0)
    assert np.isfinite(out[0, 0]).all()
    assert np.isnan(out[0, 1, 1:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_huge_logit_in_a_late_chunk(rng, dtype):
    # The running maximum jumps in the last chunk: earlier chunks must be rescaled.
    L, S = 2, 1300
    q, k, v = qkv(rng, (1, 1, L, 16), (1, 1, S, 16), (1, 1, S, 8), dtype)
    k[0, 0, 1250] = q[0, 0, 0] * 4
    check(q, k, v)
    check(q, k, v, scale=1.0)


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------

B, H, L0, S0, E0 = 2, 3, 33, 130, 16
MASK_SHAPES = {
    "LS": (L0, S0),
    "S": (S0,),
    "1S": (1, S0),
    "L1": (L0, 1),
    "HLS": (H, L0, S0),
    "B1LS": (B, 1, L0, S0),
    "1H1S": (1, H, 1, S0),
    "BHLS": (B, H, L0, S0),
    "B111": (B, 1, 1, 1),
    "111S": (1, 1, 1, S0),
    "scalar": (),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape_id", list(MASK_SHAPES))
@pytest.mark.parametrize("kind,mask_dtype", [("bool", "same"), ("float", "same"), ("float", "other")])
def test_masks(rng, kind, shape_id, dtype, mask_dtype):
    shape = MASK_SHAPES[shape_id]
    q, k, v = qkv(rng, (B, H, L0, E0), (B, H, S0, E0), (B, H, S0, 24), dtype)
    other = np.float64 if dtype == np.float32 else np.float32
    m_dtype = dtype if mask_dtype == "same" else other
    # keep_one=False: some (L, 1)-style rows are fully masked; the reference says zeros.
    mask = sdpa_mask(rng, kind, shape, m_dtype, keep_one=False, masked_fraction=0.3)
    out = check(q, k, v, attn_mask=mask)
    assert out.shape == (B, H, L0, 24)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_with_broadcast_batch_dims(rng, kind, dtype):
    q, k, v = qkv(rng, (2, 1, 2, 9, 8), (1, 3, 2, 40, 8), (1, 3, 2, 40, 5), dtype)
    for shape in [(3, 1, 9, 40), (2, 1, 1, 1, 40), (2, 3, 2, 9, 40), (40,)]:
        mask = sdpa_mask(rng, kind, shape, dtype)
        out = check(q, k, v, attn_mask=mask)
        assert out.shape == (2, 3, 2, 9, 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zeros(rng, kind, dtype):
    L, S = 70, 300
    q, k, v = qkv(rng, (2, 2, L, 16), (2, 2, S, 16), (2, 2, S, 16), dtype)
    mask = sdpa_mask(rng, kind, (2, 2, L, S), dtype, masked_fraction=0.5)
    dead = [(0, 0, 0), (0, 1, 31), (1, 0, 32), (1, 1, 69), (0, 0, 40)]
    for b, h, i in dead:
        mask[b, h, i] = False if kind == "bool" else -np.inf
    # A row whose only visible key is in the last key block (after two fully masked blocks).
    mask[1, 0, 5] = False if kind == "bool" else -np.inf
    mask[1, 0, 5, 299] = True if kind == "bool" else 0.0
    out = check(q, k, v, attn_mask=mask)
    for b, h, i in dead:
        np.testing.assert_array_equal(out[b, h, i], 0.0)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_all_rows_fully_masked(rng, dtype):
    q, k, v = qkv(rng, (2, 40, 8), (2, 140, 8), (2, 140, 8), dtype)
    for mask in (np.zeros((40, 140), bool), np.full((140,), -np.inf, dtype)):
        out = sdpa(q, k, v, attn_mask=mask)
        np.testing.assert_array_equal(out, np.zeros((2, 40, 8), dtype))
        assert out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float_mask_values_are_added(rng, dtype):
    # A constant added to every score of a row changes nothing; a large finite negative
    # value is not a mask (the key still counts if everything else is as small).
    q, k, v = qkv(rng, (1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), dtype)
    base = sdpa(q, k, v)
    shifted = sdpa(q, k, v, attn_mask=np.full((5, 1), 3.0, dtype))
    assert_close(shifted, base.astype(np.float64), dtype)
    # Integer q, k and scale 1/4 keep score - 1e4 exact in float32.
    q = rng.integers(-2, 3, q.shape).astype(dtype)
    k = rng.integers(-2, 3, k.shape).astype(dtype)
    m = np.full((5, 7), -1e4, dtype)
    out = check(q, k, v, attn_mask=m, scale=0.25)
    assert_close(out, sdpa(q, k, v, scale=0.25).astype(np.float64), dtype)


# ---------------------------------------------------------------------------------------------
# is_causal, scale, enable_gqa
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.7])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "L,S", [(1, 1), (5, 3), (3, 5), (33, 33), (31, 129), (129, 31), (300, 300), (128, 257), (40, 1)]
)
def test_causal(rng, L, S, dtype, scale):
    q, k, v = qkv(rng, (2, 2, L, 16), (2, 2, S, 16), (2, 2, S, 8), dtype)
    out = check(q, k, v, is_causal=True, scale=scale)
    # Row 0 attends key 0 only.
    np.testing.assert_allclose(out[:, :, 0], v[:, :, 0], rtol=1e-6, atol=1e-6)
    # Same as an explicit top-left lower-triangular bool mask.
    tri = np.tril(np.ones((L, S), bool))
    assert_close(out, sdpa(q, k, v, attn_mask=tri, scale=scale).astype(np.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [0.0, 1e-3, 0.37, 1.0, 2.5, -1.3, np.float32(0.5), np.float64(0.25), 2])
def test_scale(rng, scale, dtype):
    q, k, v = qkv(rng, (2, 2, 33, 17), (2, 2, 129, 17), (2, 2, 129, 9), dtype)
    q = well_scaled(q, scale)
    out = check(q, k, v, scale=scale)
    if scale == 0.0:
        # Uniform weights: every row is the mean of the values.
        assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=2, keepdims=True), out.shape), dtype)
    check(q, k, v, scale=scale, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_default_scale_is_one_over_sqrt_e(rng, dtype):
    q, k, v = qkv(rng, (1, 2, 9, 25), (1, 2, 11, 25), (1, 2, 11, 3), dtype)
    assert_identical(sdpa(q, k, v), sdpa(q, k, v, scale=0.2))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("masking", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("Hq,Hk", [(4, 2), (6, 3), (4, 1), (3, 3), (8, 2)])
def test_gqa(rng, Hq, Hk, masking, dtype):
    L, S = 33, 129
    q, k, v = qkv(rng, (2, Hq, L, 16), (2, Hk, S, 16), (2, Hk, S, 8), dtype)
    kwargs = {"enable_gqa": True}
    if masking == "causal":
        kwargs["is_causal"] = True
    elif masking != "none":
        kwargs["attn_mask"] = sdpa_mask(rng, masking, (2, Hq, L, S), dtype)
    out = check(q, k, v, **kwargs)
    assert out.shape == (2, Hq, L, 8)
    # Query head h uses key/value head h // (Hq // Hk): the same as repeating the kv heads.
    g = Hq // Hk
    rep = sdpa(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), **{**kwargs, "enable_gqa": False})
    assert_close(out, rep.astype(np.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gqa_with_broadcast_batch_dims(rng, dtype):
    q, k, v = qkv(rng, (2, 1, 4, 9, 8), (1, 3, 2, 20, 8), (1, 3, 2, 20, 6), dtype)
    out = check(q, k, v, enable_gqa=True)
    assert out.shape == (2, 3, 4, 9, 6)
    mask = sdpa_mask(rng, "bool", (1, 4, 1, 20))
    check(q, k, v, enable_gqa=True, attn_mask=mask)


# ---------------------------------------------------------------------------------------------
# Shapes: broadcasting, plain inputs, empty dimensions, dtypes
# ---------------------------------------------------------------------------------------------

BROADCAST_CASES = [
    ((2, 1, 3, 9, 8), (1, 3, 3, 20, 8), (1, 3, 3, 20, 5)),
    ((2, 3, 9, 8), (3, 20, 8), (3, 20, 5)),
    ((2, 3, 9, 8), (2, 1, 20, 8), (2, 1, 20, 5)),  # one kv head broadcast over the query heads
    ((1, 3, 9, 8), (4, 3, 20, 8), (4, 3, 20, 5)),  # query broadcast over the batch
    ((2, 3, 9, 8), (2, 3, 20, 8), (1, 1, 20, 5)),
    ((9, 8), (2, 3, 20, 8), (2, 3, 20, 5)),
    ((2, 9, 8), (20, 8), (20, 5)),
    ((2, 2, 1, 2, 9, 8), (2, 1, 3, 1, 20, 8), (1, 2, 3, 2, 20, 5)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shapes", BROADCAST_CASES, ids=lambda s: "x".join(map(str, s)))
def test_broadcast_batch_dims(rng, shapes, dtype):
    q, k, v = qkv(rng, *shapes, dtype)
    out = check(q, k, v)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    assert out.shape == lead + (9, 5)
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shapes", [((33, 16), (129, 16), (129, 7)), ((3, 33, 16), (3, 129, 16), (3, 129, 7))])
def test_plain_inputs(rng, shapes, dtype):
    q, k, v = qkv(rng, *shapes, dtype)
    out = check(q, k, v)
    assert out.shape == shapes[0][:-1] + (7,)
    check(q, k, v, is_causal=True)
    check(q, k, v, attn_mask=sdpa_mask(rng, "bool", (33, 129)))
    check(q, k, v, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_array_likes(dtype):
    q = np.linspace(-1, 1, 24).reshape(4, 6).astype(dtype)
    k = np.linspace(1, -2, 30).reshape(5, 6)
    out = sdpa(q, k.tolist(), k.tolist(), attn_mask=[[True] * 5] * 4)
    assert_close(out, ref_sdpa(q, k.astype(dtype), k.astype(dtype)), dtype)
    out = sdpa(q.tolist(), k, k)  # a list query computes in float64
    assert out.dtype == np.float64


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,expected",
    [
        ((0, 2, 5, 8), (0, 2, 7, 8), (0, 2, 7, 4), (0, 2, 5, 4)),  # batch 0
        ((2, 0, 5, 8), (2, 0, 7, 8), (2, 0, 7, 4), (2, 0, 5, 4)),  # no heads
        ((2, 2, 0, 8), (2, 2, 7, 8), (2, 2, 7, 4), (2, 2, 0, 4)),  # L = 0
        ((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 0), (2, 2, 5, 0)),  # Ev = 0
        ((0, 8), (7, 8), (7, 4), (0, 4)),
        ((3, 0, 8), (3, 7, 8), (3, 7, 4), (3, 0, 4)),
        ((1, 1, 5, 8), (0, 1, 7, 8), (0, 1, 7, 4), (0, 1, 5, 4)),  # broadcast against 0
    ],
)
def test_empty_dims(rng, q_shape, k_shape, v_shape, expected, dtype):
    q, k, v = qkv(rng, q_shape, k_shape, v_shape, dtype)
    out = sdpa(q, k, v)
    assert out.shape == expected and out.dtype == dtype
    assert_close(out, ref_sdpa(q, k, v), dtype)
    assert sdpa(q, k, v, is_causal=True).shape == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L", [1, 33, 129])
def test_no_keys_gives_zeros(rng, L, dtype):
    q, k, v = qkv(rng, (2, 3, L, 8), (2, 3, 0, 8), (2, 3, 0, 5), dtype)
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": np.zeros((L, 0), bool)}, {"scale": 2.0}):
        out = sdpa(q, k, v, **kwargs)
        assert out.shape == (2, 3, L, 5) and out.dtype == dtype
        np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zero_head_dim(rng, dtype):
    # E = 0: every score is 0, the weights are uniform (default scale must not divide by 0).
    q, k, v = qkv(rng, (2, 5, 0), (2, 7, 0), (2, 7, 3), dtype)
    out = check(q, k, v)
    assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=1, keepdims=True), out.shape), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float16_key_value_are_converted(rng, dtype):
    q = randn(rng, (2, 2, 33, 16), dtype)
    k = randn(rng, (2, 2, 129, 16), np.float16)
    v = randn(rng, (2, 2, 129, 8), np.float16)
    mask = sdpa_mask(rng, "float", (33, 129), np.float16)
    out = sdpa(q, k, v, attn_mask=mask)
    assert out.dtype == dtype
    assert_close(out, ref_sdpa(q, k, v, attn_mask=mask), dtype)
    assert_identical(out, sdpa(q, k.astype(dtype), v.astype(dtype), attn_mask=mask.astype(dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_query_dtype_decides(rng, dtype):
    other = np.float64 if dtype == np.float32 else np.float32
    q = randn(rng, (3, 9, 8), dtype)
    k = randn(rng, (3, 12, 8), other)
    v = randn(rng, (3, 12, 4), other)
    out = sdpa(q, k, v)
    assert out.dtype == dtype
    assert_identical(out, sdpa(q, k.astype(dtype), v.astype(dtype)))


# ---------------------------------------------------------------------------------------------
# NaN, Inf and large logits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_query_row(rng, dtype, causal):
    q, k, v = qkv(rng, (2, 2, 70, 16), (2, 2, 300, 16), (2, 2, 300, 8), dtype)
    q[1, 0, 40, 3] = np.nan
    with np.errstate(invalid="ignore"):
        out = check(q, k, v, is_causal=causal)
    assert np.isnan(out[1, 0, 40]).all()
    rest = np.ones(out.shape[:3], bool)
    rest[1, 0, 40] = False
    assert np.isfinite(out[rest]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_in_attended_key_or_value(rng, dtype, where):
    q, k, v = qkv(rng, (2, 2, 70, 16), (2, 2, 300, 16), (2, 2, 300, 8), dtype)
    (k if where == "key" else v)[0, 1, 200, 5] = np.nan
    with np.errstate(invalid="ignore"):
        out = check(q, k, v)
    assert np.isnan(out[0, 1]).any(axis=-1).all()  # every row of that head attends key 200
    if where == "key":
        assert np.isnan(out[0, 1]).all()
    others = np.ones((2, 2), bool)
    others[0, 1] = False
    assert np.isfinite(out[others]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_with_causal_reaches_only_later_rows(rng, dtype, where):
    L = S = 300
    j = 140
    q, k, v = qkv(rng, (1, 2, L, 16), (1, 2, S, 16), (1, 2, S, 8), dtype)
    (k if where == "key" else v)[0, 0, j, 2] = np.nan
    with np.errstate(invalid="ignore"):
        out = check(q, k, v, is_causal=True)
    # Rows i < j never attend key j: finite. Rows i >= j attend it: NaN.
    assert np.isfinite(out[0, 0, :j]).all()
    assert np.isnan(out[0, 0, j:]).any(axis=-1).all()
    assert np.isfinite(out[0, 1]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_in_masked_key_reaches_no_row(rng, dtype, kind, where):
    # "NaN ... propagates to the output rows it touches ... and to no other rows": a row for
    # which the key is masked does not touch it (the reference ignores masked keys entirely).
    L, S, j = 40, 150, 77
    q, k, v = qkv(rng, (1, 1, L, 16), (1, 1, S, 16), (1, 1, S, 8), dtype)
    (k if where == "key" else v)[0, 0, j, :] = np.nan
    mask = sdpa_mask(rng, kind, (L, S), dtype, masked_fraction=0.2)
    blocked = np.arange(L) % 2 == 0  # even rows may not attend key j
    allowed_val = True if kind == "bool" else 0.0
    blocked_val = False if kind == "bool" else -np.inf
    mask[:, j] = np.where(blocked, blocked_val, allowed_val)
    with np.errstate(invalid="ignore"):
        out = check(q, k, v, attn_mask=mask)
    assert np.isfinite(out[0, 0, blocked]).all()
    assert np.isnan(out[0, 0, ~blocked]).any(axis=-1).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("closed", [False, True], ids=["", "with_closed_key"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("L,S", [(8, 20), (40, 300), (1, 20), (2, 1300)])
def test_nonfinite_value_of_open_key_with_underflowing_weight(rng, dtype, value, L, S, closed):
    # Key 3 is open (its bias is finite) but its weight underflows to 0: NaN or Inf in its
    # value still "touches" the rows (never silently zeroed); the reference gives
    # 0 * NaN = 0 * Inf = NaN there, as a plain softmax(...) @ v does.
    q, k, v = qkv(rng, (1, 1, L, 16), (1, 1, S, 16), (1, 1, S, 8), dtype)
    v[0, 0, 3, 1] = value
    mask = np.zeros((L, S), dtype)
    mask[:, 3] = -1e4  # open, exp(-1e4) == 0
    if closed:
        mask[:, 5] = -np.inf  # a closed key in the same block
    with np.errstate(invalid="ignore"):
        out = check(q, k, v, attn_mask=mask)
    assert np.isnan(out[0, 0, :, 1]).all()
    assert np.isfinite(np.delete(out[0, 0], 1, axis=-1)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_in_fully_masked_row_stays_zero(rng, dtype):
    q, k, v = qkv(rng, (1, 1, 8, 16), (1, 1, 20, 16), (1, 1, 20, 8), dtype)
    k[0, 0, 3] = np.nan
    v[0, 0, 4] = np.nan
    mask = np.ones((8, 20), bool)
    mask[2] = False
    with np.errstate(invalid="ignore"):
        out = sdpa(q, k, v, attn_mask=mask)
    np.testing.assert_array_equal(out[0, 0, 2], 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_inf_propagates(rng, dtype):
    q, k, v = qkv(rng, (1, 2, 10, 8), (1, 2, 40, 8), (1, 2, 40, 4), dtype)
    q[0, 0, 3, 0] = np.inf  # scores of +-inf in row 3: NaN row
    k[0, 1, 7, :] = np.inf  # mixed-sign queries against an inf key: NaN scores
    mask = np.zeros((10, 40), dtype)
    mask[6, 9] = np.inf  # a +inf bias: NaN row
    with np.errstate(invalid="ignore", over="ignore"):
        out = check(q, k, v, attn_mask=mask)
    assert np.isnan(out[0, 0, 3]).all()
    assert np.isnan(out[0, :, 6]).all()
    fine = np.ones(out.shape[:3], bool)
    fine[0, 0, 3] = fine[0, :, 6] = False
    fine[0, 1] = False
    assert np.isfinite(out[fine]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L,S", [(5, 9), (40, 300)])
def test_large_logits_do_not_overflow(rng, dtype, L, S):
    # Integer queries and keys with scale 1: the scores (up to ~1e4) are exact in float32,
    # so the softmax itself is what is compared.
    E = 16
    q = rng.integers(-25, 26, (2, 2, L, E)).astype(dtype)
    k = rng.integers(-25, 26, (2, 2, S, E)).astype(dtype)
    v = randn(rng, (2, 2, S, 8), dtype)
    q[:, :, 0] = 25  # q0 . k0 = 16 * 625 = 1e4
    k[:, :, 0] = 25
    scores = np.abs(q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64))
    assert scores.max() >= 1e4
    out = check(q, k, v, scale=1.0)
    assert np.isfinite(out).all()
    out = check(q, k, v, scale=4.0)  # scores ~1e4 and beyond
    assert np.isfinite(out).all()
    check(q, k, v, scale=1.0, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias", [-1e4, 1e4, -1e30, 1e30])
def test_huge_uniform_bias_does_not_overflow(rng, dtype, bias):
    # Small integer q, k and scale 1/4: score + bias is exact in float32 for |bias| = 1e4,
    # and loses the score alike in float32 and float64 for |bias| = 1e30.
    q = rng.integers(-2, 3, (1, 2, 40, 8)).astype(dtype)
    k = rng.integers(-2, 3, (1, 2, 200, 8)).astype(dtype)
    v = randn(rng, (1, 2, 200, 4), dtype)
    mask = np.full((40, 200), bias, dtype)
    mask[:, 150:] = 2 * bias if bias < 0 else 0.5 * bias
    out = check(q, k, v, attn_mask=mask, scale=0.25)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_hot_with_huge_scale(rng, dtype):
    q, k, v = qkv(rng, (1, 1, 20, 8), (1, 1, 150, 8), (1, 1, 150, 4), dtype)
    out = check(q, k, v, scale=1e25)
    best = np.argmax(q[0, 0].astype(np.float64) @ k[0, 0].T.astype(np.float64), axis=-1)
    assert_close(out[0, 0], v[0, 0, best].astype(np.float64), dtype)


# ---------------------------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "shapes,kwargs",
    [
        (((2, 3, 33, 16), (2, 3, 129, 16), (2, 3, 129, 8)), {}),
        (((2, 3, 33, 16), (2, 3, 129, 16), (2, 3, 129, 8)), {"is_causal": True}),
        (((2, 3, 33, 16), (2, 3, 129, 16), (2, 3, 129, 8)), {"attn_mask": "bool"}),
        (((2, 4, 33, 16), (2, 2, 129, 16), (2, 2, 129, 8)), {"enable_gqa": True, "scale": 0.3}),
        (((33, 16), (129, 16), (129, 8)), {}),
        (((2, 1, 3, 9, 8), (1, 3, 3, 20, 8), (1, 3, 3, 20, 5)), {}),
        (((2, 3, 5, 8), (2, 3, 0, 8), (2, 3, 0, 5)), {}),  # S = 0: zeros are written
        (((2, 3, 0, 8), (2, 3, 4, 8), (2, 3, 4, 5)), {}),  # empty result
    ],
)
def test_out(rng, shapes, kwargs, dtype):
    q, k, v = qkv(rng, *shapes, dtype)
    if kwargs.get("attn_mask") == "bool":
        kwargs = {**kwargs, "attn_mask": sdpa_mask(rng, "bool", (33, 129))}
    expected = sdpa(q, k, v, **kwargs)
    out = np.full(expected.shape, np.nan, dtype)
    result = sdpa(q, k, v, **kwargs, out=out)
    assert result is out
    assert_identical(out, expected)
    assert_close(out, ref_sdpa(q, k, v, **kwargs), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_allocates_nothing(rng, dtype):
    q, k, v = qkv(rng, (2, 4, 256, 32), (2, 4, 256, 32), (2, 4, 256, 64), dtype)
    mask = sdpa_mask(rng, "float", (1, 4, 1, 256), dtype)
    out = np.empty((2, 4, 256, 64), dtype)
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}):
        result, peak = peak_traced_bytes(lambda: sdpa(q, k, v, **kwargs, out=out))
        assert result is out
        assert peak < out.nbytes // 16, f"{peak} bytes allocated with out= ({out.nbytes} bytes)"
        # Without out= the result itself is allocated (the measurement sees allocations).
        _, peak_alloc = peak_traced_bytes(lambda: sdpa(q, k, v, **kwargs))
        assert peak_alloc >= out.nbytes


# ---------------------------------------------------------------------------------------------
# Threads, inputs untouched, no aliasing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"attn_mask": "float"}, {"enable_gqa": True}, {"attn_mask": "bool"}])
def test_thread_count_does_not_change_results(rng, threads, kwargs, dtype):
    q, k, v = qkv(rng, (2, 4, 200, 32), (2, 2 if kwargs.get("enable_gqa") else 4, 300, 32), (2, 2 if kwargs.get("enable_gqa") else 4, 300, 24), dtype)
    if "attn_mask" in kwargs:
        kwargs = {"attn_mask": sdpa_mask(rng, kwargs["attn_mask"], (2, 1, 200, 300), dtype)}
    with num_threads(1):
        one = sdpa(q, k, v, **kwargs)
    for n in (2, 3):
        with num_threads(n):
            many = sdpa(q, k, v, **kwargs)
        assert_identical(one, many, err_msg=f"1 thread vs {n}")
    assert attnx.get_num_threads() == threads


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", [None, "bool", "float"])
def test_inputs_unchanged_and_not_aliased(rng, kind, dtype):
    q, k, v = qkv(rng, (2, 3, 33, 16), (2, 3, 129, 16), (2, 3, 129, 16), dtype)
    inputs = {"query": q, "key": k, "value": v, "attn_mask": sdpa_mask(rng, kind, (2, 1, 33, 129), dtype)}
    before = copies(inputs)
    out = sdpa(**inputs)
    assert_unchanged(before, inputs)
    assert_no_alias(out, inputs)
    # Same object passed as query, key and value.
    x = randn(rng, (2, 3, 40, 16), dtype)
    x0 = x.copy()
    out = sdpa(x, x, x, is_causal=True)
    assert_identical(x, x0)
    assert not np.shares_memory(out, x)
    # Calling twice gives the same result (no state kept between calls).
    assert_identical(sdpa(**inputs), sdpa(**inputs))


def test_result_is_a_fresh_c_contiguous_array(rng):
    q = randn(rng, (2, 3, 5, 8), np.float32)
    out = sdpa(q, q, q)
    assert type(out) is np.ndarray
    assert out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
    out[...] = 0  # writable


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


def torch_sdpa64(torch, q, k, v, attn_mask=None, **kwargs):
    """torch's sdpa in float64 (bool masks stay bool)."""

    def t(x):
        if x is None:
            return None
        a = np.asarray(x)
        return torch.from_numpy(a.copy() if a.dtype == np.bool_ else a.astype(np.float64))

    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(attn_mask), **kwargs).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape_id", ["LS", "HLS", "B1LS", "1H1S", "BHLS", "L1"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_torch_masks(torch, rng, kind, shape_id, dtype):
    q, k, v = qkv(rng, (B, H, L0, E0), (B, H, S0, E0), (B, H, S0, 24), dtype)
    mask = sdpa_mask(rng, kind, MASK_SHAPES[shape_id], dtype)
    if shape_id == "L1":  # whole rows masked
        mask[::3] = False if kind == "bool" else -np.inf
    out = sdpa(q, k, v, attn_mask=mask)
    expected = torch_sdpa64(torch, q, k, v, attn_mask=mask)
    dead = np.zeros(L0, bool)
    if shape_id == "L1":
        dead[::3] = True
        np.testing.assert_array_equal(out[:, :, dead], 0.0)
    # torch gives zeros or NaN for fully masked rows; every other row must match it.
    assert_close(out[:, :, ~dead], expected[:, :, ~dead], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L,S", [(5, 3), (33, 33), (31, 129), (129, 31), (300, 300)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_torch_causal(torch, rng, L, S, scale, dtype):
    q, k, v = qkv(rng, (2, 2, L, 16), (2, 2, S, 16), (2, 2, S, 8), dtype)
    out = sdpa(q, k, v, is_causal=True, scale=scale)
    assert_close(out, torch_sdpa64(torch, q, k, v, is_causal=True, scale=scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("Hq,Hk", [(4, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_gqa(torch, rng, Hq, Hk, causal, dtype):
    q, k, v = qkv(rng, (2, Hq, 33, 16), (2, Hk, 129, 16), (2, Hk, 129, 8), dtype)
    out = sdpa(q, k, v, enable_gqa=True, is_causal=causal)
    assert_close(out, torch_sdpa64(torch, q, k, v, enable_gqa=True, is_causal=causal), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shapes", BROADCAST_CASES[:4] + [((33, 16), (129, 16), (129, 7)), ((3, 33, 16), (3, 129, 16), (3, 129, 7))], ids=str)
def test_torch_shapes(torch, rng, shapes, dtype):
    q, k, v = qkv(rng, *shapes, dtype)
    assert_close(sdpa(q, k, v), torch_sdpa64(torch, q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [1e-3, 0.37, 2.5, -1.3])
def test_torch_scale(torch, rng, scale, dtype):
    q, k, v = qkv(rng, (2, 2, 33, 17), (2, 2, 129, 17), (2, 2, 129, 9), dtype)
    q = well_scaled(q, scale)
    assert_close(sdpa(q, k, v, scale=scale), torch_sdpa64(torch, q, k, v, scale=scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_torch_fully_masked_rows(torch, rng, kind, dtype):
    q, k, v = qkv(rng, (2, 2, 40, 16), (2, 2, 150, 16), (2, 2, 150, 8), dtype)
    mask = sdpa_mask(rng, kind, (2, 2, 40, 150), dtype)
    dead = np.zeros((2, 2, 40), bool)
    dead[0, 0, 3] = dead[1, 1, 35] = dead[0, 1, 0] = True
    mask[dead] = False if kind == "bool" else -np.inf
    out = sdpa(q, k, v, attn_mask=mask)
    expected = torch_sdpa64(torch, q, k, v, attn_mask=mask)
    np.testing.assert_array_equal(out[dead], 0.0)
    # torch may give zeros or NaN there; every other row must match it.
    assert_close(out[~dead], expected[~dead], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_large_logits(torch, rng, dtype):
    q = rng.integers(-25, 26, (2, 2, 40, 16)).astype(dtype)
    k = rng.integers(-25, 26, (2, 2, 150, 16)).astype(dtype)
    v = randn(rng, (2, 2, 150, 8), dtype)
    assert_close(sdpa(q, k, v, scale=4.0), torch_sdpa64(torch, q, k, v, scale=4.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_float16_key_value(torch, rng, dtype):
    q = randn(rng, (2, 2, 33, 16), dtype)
    k = randn(rng, (2, 2, 129, 16), np.float16)
    v = randn(rng, (2, 2, 129, 8), np.float16)
    assert_close(sdpa(q, k, v), torch_sdpa64(torch, q, k, v), dtype)


# ---------------------------------------------------------------------------------------------
# Random combinations (hypothesis)
# ---------------------------------------------------------------------------------------------

@hypothesis.settings(max_examples=80, deadline=None, derandomize=True, database=None)
@hypothesis.given(
    seed=st.integers(0, 2**31),
    B=st.integers(0, 3),
    Hk=st.integers(1, 3),
    group=st.integers(1, 3),
    L=st.sampled_from([0, 1, 2, 31, 32, 33, 70]),
    S=st.sampled_from([0, 1, 5, 127, 128, 129, 200]),
    E=st.sampled_from([1, 3, 16, 17]),
    Ev=st.sampled_from([1, 4, 9]),
    masking=st.sampled_from(["none", "causal", "bool", "float"]),
    mask_dims=st.lists(st.booleans(), min_size=4, max_size=4),
    scale=st.sampled_from([None, 0.1, 0.5, -0.7]),
    dtype=st.sampled_from(DTYPES),
)
def test_random_combinations(seed, B, Hk, group, L, S, E, Ev, masking, mask_dims, scale, dtype):
    rng = np.random.default_rng(seed)
    gqa = group > 1
    Hq = Hk * group
    q, k, v = qkv(rng, (B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev), dtype)
    kwargs = {"scale": scale, "enable_gqa": gqa}
    if masking == "causal":
        kwargs["is_causal"] = True
    elif masking != "none":
        # Each of (B, Hq, L, S) either kept or broadcast (size 1).
        shape = tuple(n if keep else 1 for n, keep in zip((B, Hq, L, S), mask_dims))
        kwargs["attn_mask"] = sdpa_mask(rng, masking, shape, dtype, keep_one=False, masked_fraction=0.3)
    with np.errstate(all="ignore"):
        out = check(q, k, v, **kwargs)
    assert out.shape == (B, Hq, L, Ev)
    assert np.isfinite(out).all()
