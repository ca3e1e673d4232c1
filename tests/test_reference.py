"""The NumPy reference (``attnx.reference``) agrees with PyTorch.

The reference is the oracle the rest of the attnx tests trust, so here it is checked against
torch itself, in float64 to 1e-12, option by option and in combination. Where attnx deviates
from torch on purpose (a fully masked query row gives a zero attention row instead of NaN,
NaN/Inf of a masked key does not leak into other rows, ``is_causal`` in MHA works without
``attn_mask``), the test states the attnx result directly and compares the rest with torch.
"""

import itertools
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from attnx import reference  # noqa: E402  (after the importorskip on purpose)

TOL = {"rtol": 1e-12, "atol": 1e-12}
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def tensor(array):
    """A torch view of a NumPy array (None stays None)."""
    return None if array is None else torch.from_numpy(np.ascontiguousarray(array))


def as_numpy(t):
    return None if t is None else t.detach().numpy()


def assert_same(ours, theirs, **tol):
    theirs = as_numpy(theirs) if isinstance(theirs, torch.Tensor) else theirs
    assert isinstance(ours, np.ndarray)
    assert ours.shape == theirs.shape
    assert ours.dtype == theirs.dtype
    np.testing.assert_allclose(ours, theirs, **(tol or TOL))


def make_mask(rng, kind, shape, true_means_masked):
    """A random bool or float mask that leaves key 0 visible to every query row.

    With at least one visible key per row torch gives no NaN, so the results must agree
    everywhere. sdpa's bool masks say "may attend"; MHA's say "may not attend".
    """
    if kind is None:
        return None
    if kind == "bool":
        masked = rng.random(shape) < 0.4
        masked[..., 0] = False
        return masked if true_means_masked else ~masked
    values = rng.standard_normal(shape)
    values[rng.random(shape) < 0.3] = -INF
    values[..., 0] = rng.standard_normal(values[..., 0].shape)
    return values


def causal_mask_mha(tgt_len, src_len):
    """torch MHA bool mask (True = may not attend) for top-left causal attention."""
    return np.triu(np.ones((tgt_len, src_len), dtype=bool), k=1)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------


def sdpa_both(q, k, v, **options):
    ours = reference.scaled_dot_product_attention(q, k, v, **options)
    torch_options = {
        name: tensor(x) if isinstance(x, np.ndarray) else x for name, x in options.items()
    }
    theirs = F.scaled_dot_product_attention(tensor(q), tensor(k), tensor(v), **torch_options)
    return ours, theirs


def qkv(rng, q_shape, k_shape, v_shape, dtype=np.float64):
    return tuple(rng.standard_normal(s).astype(dtype) for s in (q_shape, k_shape, v_shape))


N, H, L, S, E, EV = 2, 3, 5, 7, 8, 4

SDPA_MASK_SHAPES = [
    (L, S),
    (1, S),
    (L, 1),
    (H, L, S),
    (N, H, L, S),
    (N, 1, 1, S),
    (1, H, L, 1),
    (N, 1, L, S),
]


@pytest.mark.parametrize("mask_shape", SDPA_MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_mask_kinds_and_broadcast_shapes(kind, mask_shape):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    mask = make_mask(rng, kind, mask_shape, true_means_masked=False)
    assert_same(*sdpa_both(q, k, v, attn_mask=mask))


SDPA_SHAPES = [
    ((L, E), (S, E), (S, EV)),
    ((N, L, E), (N, S, E), (N, S, EV)),
    ((N, H, L, E), (N, H, S, E), (N, H, S, EV)),
    ((2, N, H, L, E), (2, N, H, S, E), (2, N, H, S, EV)),
    # broadcasting of leading batch dims, as torch.matmul
    ((1, H, L, E), (N, H, S, E), (N, H, S, EV)),
    ((N, H, L, E), (N, 1, S, E), (N, 1, S, EV)),
    ((N, H, L, E), (S, E), (S, EV)),
    ((H, L, E), (N, 1, S, E), (N, 1, S, EV)),
    ((L, E), (N, H, S, E), (N, H, S, EV)),
    # odd and tiny sizes
    ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)),
    ((1, 2, 13, 3), (1, 2, 1, 3), (1, 2, 1, 9)),
    ((3, 1, 17, 5), (3, 1, 17, 5), (3, 1, 17, 5)),
    ((2, 1, 33), (2, 19, 33), (2, 19, 1)),
]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shapes", SDPA_SHAPES, ids=str)
def test_sdpa_input_ranks_broadcasting_and_odd_sizes(shapes, is_causal):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, *shapes)
    assert_same(*sdpa_both(q, k, v, is_causal=is_causal))


@pytest.mark.parametrize("tgt_len,src_len", [(1, 1), (4, 4), (3, 7), (7, 3), (1, 5), (5, 1)])
def test_sdpa_is_causal_is_top_left_aligned(tgt_len, src_len):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (N, H, tgt_len, E), (N, H, src_len, E), (N, H, src_len, EV))
    ours, theirs = sdpa_both(q, k, v, is_causal=True)
    assert_same(ours, theirs)
    # Same as an explicit lower-triangular "may attend" mask.
    keep = np.tril(np.ones((tgt_len, src_len), dtype=bool))
    np.testing.assert_allclose(
        ours, reference.scaled_dot_product_attention(q, k, v, attn_mask=keep), **TOL
    )


@pytest.mark.parametrize("scale", [0.0, 0.05, 1.0, 3.7, -0.5])
@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"attn_mask": "float"}], ids=str)
def test_sdpa_scale(scale, options):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    options = dict(options)
    if options.get("attn_mask") == "float":
        options["attn_mask"] = make_mask(rng, "float", (L, S), true_means_masked=False)
    assert_same(*sdpa_both(q, k, v, scale=scale, **options))


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (6, 3), (4, 1), (3, 3), (8, 2)])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("mask", [None, "bool-full", "float-2d", "causal"])
def test_sdpa_grouped_query_attention(q_heads, kv_heads, rank, mask):
    rng = np.random.default_rng(5)
    batch = (N,) if rank == 4 else ()
    q, k, v = qkv(
        rng, batch + (q_heads, L, E), batch + (kv_heads, S, E), batch + (kv_heads, S, EV)
    )
    options = {"enable_gqa": True}
    if mask == "bool-full":
        options["attn_mask"] = make_mask(rng, "bool", batch + (q_heads, L, S), False)
    elif mask == "float-2d":
        options["attn_mask"] = make_mask(rng, "float", (L, S), False)
    elif mask == "causal":
        options["is_causal"] = True
    ours, theirs = sdpa_both(q, k, v, **options)
    assert_same(ours, theirs)
    # Query head h reads kv head h // (Hq // Hk): the same as repeating each kv head.
    group = q_heads // kv_heads
    options.pop("enable_gqa")
    repeated = reference.scaled_dot_product_attention(
        q, np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3), **options
    )
    np.testing.assert_allclose(ours, repeated, **TOL)


def test_sdpa_grouped_query_attention_with_broadcast_batch():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, (N, 6, L, E), (1, 2, S, E), (1, 2, S, EV))
    assert_same(*sdpa_both(q, k, v, enable_gqa=True))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_fully_masked_rows_are_zero(kind):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    keep = rng.random((N, H, L, S)) < 0.6
    keep[..., 0] = True
    keep[0, 1, 2, :] = False  # one head's row
    keep[1, :, 4, :] = False  # a row in every head
    mask = keep if kind == "bool" else np.where(keep, rng.standard_normal(keep.shape), -INF)
    ours, theirs = sdpa_both(q, k, v, attn_mask=mask)
    assert_same(ours, theirs)  # torch's CPU sdpa gives zeros there too
    assert np.all(ours[0, 1, 2] == 0) and np.all(ours[1, :, 4] == 0)
    assert np.isfinite(ours).all()


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape",
    [
        ((0, H, L, E), (0, H, S, E), (0, H, S, EV)),  # batch 0
        ((N, H, 0, E), (N, H, S, E), (N, H, S, EV)),  # L = 0
        ((N, 0, L, E), (N, 0, S, E), (N, 0, S, EV)),  # no heads
        ((N, H, L, E), (N, H, 0, E), (N, H, 0, EV)),  # S = 0: no keys -> zeros
        ((N, H, L, E), (N, H, S, E), (N, H, S, 0)),  # Ev = 0
        ((N, H, L, 0), (N, H, S, 0), (N, H, S, EV)),  # E = 0: all scores 0 -> mean of v
    ],
    ids=str,
)
def test_sdpa_empty_dimensions(q_shape, k_shape, v_shape):
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, q_shape, k_shape, v_shape)
    ours, theirs = sdpa_both(q, k, v)
    assert_same(ours, theirs)
    if k_shape[-2] == 0:
        assert np.all(ours == 0)


def test_sdpa_huge_logits_do_not_overflow():
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    q *= 1e3  # scores of order 1e4, where exp() without max subtraction overflows
    ours, theirs = sdpa_both(q, k, v)
    assert np.isfinite(ours).all()
    assert_same(ours, theirs)


def test_sdpa_nan_in_query_row_stays_in_that_row():
    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    q[1, 2, 3, 0] = np.nan
    ours, theirs = sdpa_both(q, k, v)
    assert np.isnan(ours[1, 2, 3]).all()
    ours[1, 2, 3] = 0
    theirs[1, 2, 3] = 0
    assert_same(ours, theirs)


@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("bad", [np.nan, INF])
def test_sdpa_nonfinite_masked_key_reaches_only_rows_that_attend_it(where, bad):
    # attnx deviation: torch adds -inf to the NaN score (or multiplies NaN/Inf by the zero
    # weight) and so spreads it to every row; attnx ignores masked keys completely.
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    keep = np.ones((L, S), dtype=bool)
    keep[:3, 4] = False  # rows 0..2 never see key 4; rows 3, 4 do
    clean_k, clean_v = k.copy(), v.copy()
    (k if where == "key" else v)[0, 1, 4, 0] = bad
    ours = reference.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    expected = as_numpy(
        F.scaled_dot_product_attention(tensor(q), tensor(clean_k), tensor(clean_v), tensor(keep))
    )
    untouched = np.ones(ours.shape[:-1], dtype=bool)
    untouched[0, 1, 3:] = False
    np.testing.assert_allclose(ours[untouched], expected[untouched], **TOL)
    # Rows that do attend the key get torch's answer (NaN, or for a -inf score weight 0).
    with_bad = as_numpy(
        F.scaled_dot_product_attention(tensor(q), tensor(k), tensor(v), tensor(keep))
    )
    np.testing.assert_allclose(ours[~untouched], with_bad[~untouched], equal_nan=True, **TOL)
    if where == "value":  # only the output component that reads the bad value entry
        assert not np.isfinite(ours[0, 1, 3:, 0]).any()
    elif np.isnan(bad):
        assert np.isnan(ours[0, 1, 3:]).all()


def test_sdpa_nan_in_future_key_does_not_reach_earlier_rows_under_is_causal():
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, (1, 1, 5, E), (1, 1, 5, E), (1, 1, 5, EV))
    clean = k.copy()
    k[0, 0, 4, 2] = np.nan
    ours = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = as_numpy(
        F.scaled_dot_product_attention(tensor(q), tensor(clean), tensor(v), is_causal=True)
    )
    np.testing.assert_allclose(ours[0, 0, :4], expected[0, 0, :4], **TOL)
    assert np.isnan(ours[0, 0, 4]).all()


def test_sdpa_infinite_query_gives_nan_row():
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, (L, E), (S, E), (S, EV))
    q[2, 0] = INF
    ours = reference.scaled_dot_product_attention(q, k, v)
    assert np.isnan(ours[2]).all()
    assert np.isfinite(np.delete(ours, 2, axis=0)).all()


def test_sdpa_float32_and_mixed_dtypes():
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV), dtype=np.float32)
    mask = make_mask(rng, "float", (L, S), False).astype(np.float32)
    ours, theirs = sdpa_both(q, k, v, attn_mask=mask)
    assert_same(ours, theirs, rtol=1e-5, atol=1e-6)
    # The query's dtype decides; the others are converted to it.
    mixed = reference.scaled_dot_product_attention(q, k.astype(np.float64), v, attn_mask=mask)
    assert mixed.dtype == np.float32
    np.testing.assert_allclose(mixed, ours, rtol=1e-5, atol=1e-6)
    q64 = q.astype(np.float64)
    wide = reference.scaled_dot_product_attention(q64, k, v, attn_mask=mask)
    assert wide.dtype == np.float64
    exact = sdpa_both(q64, k.astype(np.float64), v.astype(np.float64), attn_mask=mask.astype(float))
    assert_same(wide, exact[1])


def test_sdpa_accepts_nested_lists():
    ours = reference.scaled_dot_product_attention(
        [[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[2.0], [4.0]]
    )
    weight = 1.0 / (1.0 + math.exp(-1.0 / math.sqrt(2.0)))
    np.testing.assert_allclose(ours, [[2.0 * weight + 4.0 * (1.0 - weight)]], **TOL)


SDPA_ERRORS = [
    ("softcap 0", dict(softcap=0.0), ValueError),
    ("unknown scores", dict(return_scores="logits"), ValueError),
    ("dropout", dict(dropout_p=0.5), NotImplementedError),
    ("int mask", dict(attn_mask=np.ones((L, S), np.int64)), TypeError),
    ("bad mask shape", dict(attn_mask=np.ones((L, S + 1), bool)), ValueError),
    ("mask with too many dims", dict(attn_mask=np.ones((2, N, H, L, S), bool)), ValueError),
    ("nan scale", dict(scale=float("nan")), ValueError),
    ("inf scale", dict(scale=INF), ValueError),
]


@pytest.mark.parametrize("name,options,error", SDPA_ERRORS, ids=[e[0] for e in SDPA_ERRORS])
def test_sdpa_errors_in_options(name, options, error):
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    with pytest.raises(error):
        reference.scaled_dot_product_attention(q, k, v, **options)


def test_sdpa_errors_in_inputs():
    rng = np.random.default_rng(16)
    q, k, v = qkv(rng, (N, H, L, E), (N, H, S, E), (N, H, S, EV))
    with pytest.raises(TypeError):
        reference.scaled_dot_product_attention(q.astype(np.int32), k, v)
    with pytest.raises(TypeError):
        reference.scaled_dot_product_attention(q, k.astype(np.complex128), v)
    with pytest.raises(ValueError):  # E differs
        reference.scaled_dot_product_attention(q, k[..., :-1], v)
    with pytest.raises(ValueError):  # S differs
        reference.scaled_dot_product_attention(q, k, v[..., :-1, :])
    with pytest.raises(ValueError):  # 1-D
        reference.scaled_dot_product_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
    with pytest.raises(ValueError):  # batch dims do not broadcast
        reference.scaled_dot_product_attention(q, k[:, :2], v[:, :2])
    q4 = rng.standard_normal((N, 4, L, E))
    with pytest.raises(ValueError):  # 4 query heads over 3 kv heads
        reference.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


@pytest.mark.parametrize("seed", range(30))
def test_sdpa_random_configurations(seed):
    rng = np.random.default_rng(100 + seed)
    batch = tuple(int(d) for d in rng.integers(1, 4, size=rng.integers(0, 3)))
    q_heads, kv_heads = [(1, 1), (2, 2), (4, 2), (3, 1), (5, 5)][rng.integers(5)]
    tgt_len, src_len = (int(x) for x in rng.integers(1, 12, size=2))
    head_size, value_size = (int(x) for x in rng.integers(1, 20, size=2))
    gqa = q_heads != kv_heads
    q, k, v = qkv(
        rng,
        batch + (q_heads, tgt_len, head_size),
        batch + (kv_heads, src_len, head_size),
        batch + (kv_heads, src_len, value_size),
    )
    options = {"enable_gqa": gqa}
    choice = rng.integers(4)
    if choice == 1:
        options["is_causal"] = True
    elif choice >= 2:
        full = batch + (q_heads, tgt_len, src_len)
        # Drop random leading dims and set random dims to 1 to exercise broadcasting.
        shape = list(full[rng.integers(0, len(full) - 1):])
        for i in range(len(shape) - 1):
            if rng.random() < 0.3:
                shape[i] = 1
        kind = "bool" if choice == 2 else "float"
        options["attn_mask"] = make_mask(rng, kind, tuple(shape), False)
    if rng.random() < 0.3:
        options["scale"] = float(rng.uniform(0.01, 2.0))
    assert_same(*sdpa_both(q, k, v, **options))


# ---------------------------------------------------------------------------------------------
# multi_head_attention_forward
# ---------------------------------------------------------------------------------------------


def mha_params(rng, embed_dim, kdim=None, vdim=None, separate=False, bias=True, bias_kv=False,
               out_dim=None, dtype=np.float64):
    """Random weights as keyword arguments for both multi_head_attention_forward's."""
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    out_dim = embed_dim if out_dim is None else out_dim
    separate = separate or kdim != embed_dim or vdim != embed_dim

    def randn(*shape):
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(dtype)

    params = {
        "in_proj_weight": None if separate else randn(3 * embed_dim, embed_dim),
        "in_proj_bias": randn(3 * embed_dim) if bias else None,
        "bias_k": randn(1, 1, embed_dim) if bias_kv else None,
        "bias_v": randn(1, 1, embed_dim) if bias_kv else None,
        "out_proj_weight": randn(out_dim, embed_dim),
        "out_proj_bias": randn(out_dim) if bias else None,
    }
    if separate:
        params.update(
            use_separate_proj_weight=True,
            q_proj_weight=randn(embed_dim, embed_dim),
            k_proj_weight=randn(embed_dim, kdim),
            v_proj_weight=randn(embed_dim, vdim),
        )
    return params


def mha_both(query, key, value, num_heads, params, add_zero_attn=False, batch_first=False,
             dropout_p=0.0, **options):
    """Run the reference and torch's functional MHA on the same arrays."""
    embed_dim = query.shape[-1]
    ours = reference.multi_head_attention_forward(
        query, key, value, embed_dim, num_heads, add_zero_attn=add_zero_attn,
        dropout_p=dropout_p, batch_first=batch_first, **params, **options
    )
    tq, tk, tv = tensor(query), tensor(key), tensor(value)
    if batch_first and query.ndim == 3:  # torch's function is sequence-first only
        tq, tk, tv = (t.transpose(0, 1) for t in (tq, tk, tv))
    torch_kwargs = {
        name: tensor(x) if isinstance(x, np.ndarray) else x
        for name, x in {**params, **options}.items()
    }
    with warnings.catch_warnings():
        # torch deprecates mixing a bool and a float mask but still supports it.
        warnings.filterwarnings("ignore", message="Support for mismatched")
        out, weights = F.multi_head_attention_forward(
            tq, tk, tv, embed_dim, num_heads, add_zero_attn=add_zero_attn,
            dropout_p=dropout_p, **torch_kwargs
        )
    if batch_first and query.ndim == 3:
        out = out.transpose(0, 1)
    return ours, (as_numpy(out), as_numpy(weights))


def assert_mha_same(ours, theirs, **tol):
    assert_same(ours[0], theirs[0], **tol)
    if theirs[1] is None:
        assert ours[1] is None
    else:
        assert_same(ours[1], theirs[1], **tol)


def seq_first(rng, tgt_len, src_len, batch, embed_dim, kdim=None, vdim=None, dtype=np.float64):
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    return (
        rng.standard_normal((tgt_len, batch, embed_dim)).astype(dtype),
        rng.standard_normal((src_len, batch, kdim)).astype(dtype),
        rng.standard_normal((src_len, batch, vdim)).astype(dtype),
    )


ME, MH, ML, MS, MN = 12, 3, 5, 6, 3  # embed_dim, heads, target len, source len, batch

EXTRAS = {
    "plain": {},
    "bias_kv": {"bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "bias_kv+zero_attn": {"bias_kv": True, "add_zero_attn": True},
}
WEIGHT_MODES = {
    "avg": {},
    "per_head": {"average_attn_weights": False},
    "no_weights": {"need_weights": False},
}
MASK_CASES = [(None, None)] + list(itertools.product(["bool", "float"], [2, 3]))


@pytest.mark.parametrize("weights", list(WEIGHT_MODES))
@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("kpm_kind", [None, "bool", "float"])
@pytest.mark.parametrize("mask_kind,mask_rank", MASK_CASES, ids=str)
def test_mha_masks_and_extra_keys(mask_kind, mask_rank, kpm_kind, extra, weights):
    rng = np.random.default_rng(20)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    add_zero_attn = EXTRAS[extra].get("add_zero_attn", False)
    params = mha_params(rng, ME, bias_kv=EXTRAS[extra].get("bias_kv", False))
    mask_shape = (ML, MS) if mask_rank == 2 else (MN * MH, ML, MS)
    options = dict(
        attn_mask=make_mask(rng, mask_kind, mask_shape, true_means_masked=True),
        key_padding_mask=make_mask(rng, kpm_kind, (MN, MS), true_means_masked=True),
        **WEIGHT_MODES[weights],
    )
    ours, theirs = mha_both(query, key, value, MH, params, add_zero_attn=add_zero_attn, **options)
    assert_mha_same(ours, theirs)
    if weights != "no_weights":
        extra_keys = int(EXTRAS[extra].get("bias_kv", False)) + int(add_zero_attn)
        assert ours[1].shape[-1] == MS + extra_keys


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("kdim,vdim", [(ME, ME), (5, 7), (3, 3), (ME, 9), (7, ME)])
def test_mha_separate_projection_weights(kdim, vdim, extra):
    rng = np.random.default_rng(21)
    query, key, value = seq_first(rng, ML, MS, MN, ME, kdim, vdim)
    params = mha_params(rng, ME, kdim, vdim, separate=True,
                        bias_kv=EXTRAS[extra].get("bias_kv", False))
    options = dict(
        attn_mask=make_mask(rng, "bool", (ML, MS), True),
        key_padding_mask=make_mask(rng, "float", (MN, MS), True),
        add_zero_attn=EXTRAS[extra].get("add_zero_attn", False),
    )
    assert_mha_same(*mha_both(query, key, value, MH, params, **options))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dim", [ME, 5])
@pytest.mark.parametrize("separate", [False, True])
def test_mha_projection_biases_and_output_size(bias, out_dim, separate):
    rng = np.random.default_rng(22)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME, separate=separate, bias=bias, out_dim=out_dim)
    ours, theirs = mha_both(query, key, value, MH, params)
    assert_mha_same(ours, theirs)
    assert ours[0].shape == (ML, MN, out_dim)


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 12])
def test_mha_head_counts(heads):
    rng = np.random.default_rng(23)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    assert_mha_same(*mha_both(query, key, value, heads, params, average_attn_weights=False))


def test_mha_self_attention_same_array():
    # torch takes a different projection path when query is key is value.
    rng = np.random.default_rng(24)
    x = rng.standard_normal((ML, MN, ME))
    params = mha_params(rng, ME)
    assert_mha_same(*mha_both(x, x, x, MH, params))


STATIC_CASES = {
    "static_k": dict(static_k=True),
    "static_v": dict(static_v=True),
    "both": dict(static_k=True, static_v=True),
    "both, other length": dict(static_k=True, static_v=True, static_len=4),
    "both + zero_attn": dict(static_k=True, static_v=True, add_zero_attn=True),
    "both + kpm + zero_attn": dict(static_k=True, static_v=True, static_len=9,
                                   kpm=True, add_zero_attn=True),
    "both + attn_mask + kpm": dict(static_k=True, static_v=True, attn_mask=True, kpm=True),
    "static_k + attn_mask + zero_attn": dict(static_k=True, attn_mask=True, add_zero_attn=True),
}


@pytest.mark.parametrize("weights", ["avg", "no_weights"])
@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_mha_static_k_and_v(case, weights):
    spec = STATIC_CASES[case]
    rng = np.random.default_rng(25)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    static_len = spec.get("static_len", MS)
    head_dim = ME // MH
    options = dict(WEIGHT_MODES[weights], add_zero_attn=spec.get("add_zero_attn", False))
    if spec.get("static_k"):
        options["static_k"] = rng.standard_normal((MN * MH, static_len, head_dim))
    if spec.get("static_v"):
        options["static_v"] = rng.standard_normal((MN * MH, static_len, head_dim))
    if spec.get("attn_mask"):
        # torch checks attn_mask against key's length, so these cases keep static_len == S.
        options["attn_mask"] = make_mask(rng, "float", (MN * MH, ML, static_len), True)
    if spec.get("kpm"):
        options["key_padding_mask"] = make_mask(rng, "bool", (MN, static_len), True)
    assert_mha_same(*mha_both(query, key, value, MH, params, **options))


def test_mha_static_k_with_bias_k_raises():
    rng = np.random.default_rng(26)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME, bias_kv=True)
    static_k = rng.standard_normal((MN * MH, MS, ME // MH))
    with pytest.raises(ValueError):
        reference.multi_head_attention_forward(
            query, key, value, ME, MH, add_zero_attn=False, dropout_p=0.0, static_k=static_k,
            **params
        )


@pytest.mark.parametrize("weights", list(WEIGHT_MODES))
@pytest.mark.parametrize("extra", ["plain", "bias_kv+zero_attn"])
@pytest.mark.parametrize("masks", ["none", "attn_mask", "kpm", "both"])
def test_mha_batch_first(masks, extra, weights):
    rng = np.random.default_rng(27)
    query, key, value = (np.swapaxes(x, 0, 1).copy() for x in seq_first(rng, ML, MS, MN, ME, 5, 7))
    params = mha_params(rng, ME, 5, 7, bias_kv=EXTRAS[extra].get("bias_kv", False))
    options = dict(WEIGHT_MODES[weights], add_zero_attn=EXTRAS[extra].get("add_zero_attn", False))
    if masks in ("attn_mask", "both"):
        options["attn_mask"] = make_mask(rng, "bool", (MN * MH, ML, MS), True)
    if masks in ("kpm", "both"):
        options["key_padding_mask"] = make_mask(rng, "float", (MN, MS), True)
    ours, theirs = mha_both(query, key, value, MH, params, batch_first=True, **options)
    assert_mha_same(ours, theirs)
    assert ours[0].shape == (MN, ML, ME)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("weights", list(WEIGHT_MODES))
@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("masks", ["none", "attn_mask_2d", "attn_mask_3d", "kpm_bool", "kpm_float"])
def test_mha_unbatched(masks, extra, weights, batch_first):
    rng = np.random.default_rng(28)
    query, key, value = (x[:, 0] for x in seq_first(rng, ML, MS, 1, ME))
    params = mha_params(rng, ME, bias_kv=EXTRAS[extra].get("bias_kv", False))
    options = dict(WEIGHT_MODES[weights], add_zero_attn=EXTRAS[extra].get("add_zero_attn", False))
    if masks == "attn_mask_2d":
        options["attn_mask"] = make_mask(rng, "float", (ML, MS), True)
    elif masks == "attn_mask_3d":
        options["attn_mask"] = make_mask(rng, "bool", (MH, ML, MS), True)
    elif masks.startswith("kpm"):
        options["key_padding_mask"] = make_mask(rng, masks[4:], (MS,), True)
    # batch_first has no effect on unbatched input (as torch's module).
    ours, theirs = mha_both(query, key, value, MH, params, batch_first=batch_first, **options)
    assert_mha_same(ours, theirs)
    assert ours[0].shape == (ML, ME)
    if ours[1] is not None:
        assert ours[1].shape[:-1] == ((ML,) if weights == "avg" else (MH, ML))


@pytest.mark.parametrize("weights", ["avg", "no_weights"])
@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("tgt_len,src_len", [(5, 5), (3, 6), (6, 3), (1, 4)])
@pytest.mark.parametrize("kpm", [False, True])
def test_mha_is_causal_without_attn_mask(tgt_len, src_len, extra, weights, kpm):
    # torch needs attn_mask with is_causal; attnx builds the top-left causal mask itself, over
    # the real keys only: the bias_k and zero-attention keys stay visible, as when torch pads
    # an explicit causal mask.
    rng = np.random.default_rng(29)
    query, key, value = seq_first(rng, tgt_len, src_len, MN, ME)
    params = mha_params(rng, ME, bias_kv=EXTRAS[extra].get("bias_kv", False))
    add_zero_attn = EXTRAS[extra].get("add_zero_attn", False)
    kpm_mask = make_mask(rng, "bool", (MN, src_len), True) if kpm else None
    ours = reference.multi_head_attention_forward(
        query, key, value, ME, MH, add_zero_attn=add_zero_attn, dropout_p=0.0,
        key_padding_mask=kpm_mask, is_causal=True, **WEIGHT_MODES[weights], **params
    )
    _, theirs = mha_both(
        query, key, value, MH, params, add_zero_attn=add_zero_attn, key_padding_mask=kpm_mask,
        attn_mask=causal_mask_mha(tgt_len, src_len), **WEIGHT_MODES[weights]
    )
    assert_mha_same(ours, theirs)


@pytest.mark.parametrize("weights", ["avg", "no_weights"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_mha_is_causal_with_attn_mask_uses_the_mask(mask_kind, weights):
    # torch's sdpa path (need_weights=False) would replace the mask by a causal one; attnx
    # uses the mask as given, like torch's need_weights=True path does.
    rng = np.random.default_rng(30)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    mask = make_mask(rng, mask_kind, (ML, MS), True)
    ours = reference.multi_head_attention_forward(
        query, key, value, ME, MH, add_zero_attn=False, dropout_p=0.0, attn_mask=mask,
        is_causal=True, **WEIGHT_MODES[weights], **params
    )
    _, theirs = mha_both(query, key, value, MH, params, attn_mask=mask, **WEIGHT_MODES[weights])
    assert_mha_same(ours, theirs)


def test_mha_is_causal_hint_matches_torch_when_mask_is_causal():
    rng = np.random.default_rng(31)
    query, key, value = seq_first(rng, ML, ML, MN, ME)
    params = mha_params(rng, ME)
    mask = causal_mask_mha(ML, ML)
    for need_weights in (True, False):
        ours, theirs = mha_both(query, key, value, MH, params, attn_mask=mask, is_causal=True,
                                need_weights=need_weights)
        assert_mha_same(ours, theirs)


STATIC_NAMES = ("static_k", "static_v")


def test_mha_is_causal_with_static_kv_and_zero_attn():
    rng = np.random.default_rng(32)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    # torch checks attn_mask against key's length, so the static length equals it here.
    static = {name: rng.standard_normal((MN * MH, MS, ME // MH)) for name in STATIC_NAMES}
    ours = reference.multi_head_attention_forward(
        query, key, value, ME, MH, add_zero_attn=True, dropout_p=0.0, is_causal=True,
        **static, **params
    )
    mask = causal_mask_mha(ML, MS)
    _, theirs = mha_both(
        query, key, value, MH, params, add_zero_attn=True, attn_mask=mask, **static
    )
    assert_mha_same(ours, theirs)


def dead_row_scenarios(rng, kind):
    """(attn_mask, key_padding_mask, dead) with dead[n, l] True where row l of batch n sees
    no key. MHA bool masks: True = may not attend."""
    attn = np.zeros((ML, MS), dtype=bool)
    attn[1, :] = True  # row 1 of every batch element
    attn[3, :3] = True  # row 3 sees only keys 3..5 ...
    pad = np.zeros((MN, MS), dtype=bool)
    pad[0, 3:] = True  # ... which batch 0 pads
    pad[2, :] = True  # batch 2 is all padding
    dead = np.zeros((MN, ML), dtype=bool)
    dead[:, 1] = True
    dead[0, 3] = True
    dead[2, :] = True
    if kind == "float":
        attn = np.where(attn, -INF, rng.standard_normal(attn.shape))
        pad = np.where(pad, -INF, rng.standard_normal(pad.shape))
    return attn, pad, dead


@pytest.mark.parametrize("weights", list(WEIGHT_MODES))
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mha_fully_masked_rows_give_out_proj_bias_and_zero_weights(kind, weights):
    # attnx deviation: torch's need_weights=True path gives NaN for these rows.
    rng = np.random.default_rng(33)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    attn, pad, dead = dead_row_scenarios(rng, kind)
    (out, weights_ours), (out_torch, weights_torch) = mha_both(
        query, key, value, MH, params, attn_mask=attn, key_padding_mask=pad, **WEIGHT_MODES[weights]
    )
    dead_out = dead.T  # output is (L, N, E)
    bias_rows = np.broadcast_to(params["out_proj_bias"], out[dead_out].shape)
    np.testing.assert_array_equal(out[dead_out], bias_rows)
    np.testing.assert_allclose(out[~dead_out], out_torch[~dead_out], **TOL)
    if weights_torch is not None:
        per_row = weights_ours if weights == "avg" else np.moveaxis(weights_ours, 1, 2)
        per_row_torch = weights_torch if weights == "avg" else np.moveaxis(weights_torch, 1, 2)
        assert np.all(per_row[dead] == 0)
        np.testing.assert_allclose(per_row[~dead], per_row_torch[~dead], **TOL)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("extra", ["bias_kv", "zero_attn"])
def test_mha_extra_keys_rescue_fully_masked_rows(extra):
    # The appended bias_k / zero keys are never masked, so no row is dead and torch agrees.
    rng = np.random.default_rng(34)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME, bias_kv=extra == "bias_kv")
    attn, pad, _ = dead_row_scenarios(rng, "bool")
    ours, theirs = mha_both(query, key, value, MH, params, attn_mask=attn, key_padding_mask=pad,
                            add_zero_attn=extra == "zero_attn", average_attn_weights=False)
    assert np.isfinite(theirs[0]).all()
    assert_mha_same(ours, theirs)


@pytest.mark.parametrize("weights", ["avg", "no_weights"])
@pytest.mark.parametrize(
    "tgt_len,src_len,batch", [(ML, MS, 0), (0, MS, MN), (ML, 0, MN), (0, 0, 0), (1, 1, 1)]
)
def test_mha_empty_dimensions(tgt_len, src_len, batch, weights):
    rng = np.random.default_rng(35)
    query, key, value = seq_first(rng, tgt_len, src_len, batch, ME)
    params = mha_params(rng, ME)
    ours, theirs = mha_both(query, key, value, MH, params, **WEIGHT_MODES[weights])
    assert_mha_same(ours, theirs)
    if src_len == 0:  # no keys: every output row is out_proj_bias
        bias_rows = np.broadcast_to(params["out_proj_bias"], ours[0].shape)
        np.testing.assert_array_equal(ours[0], bias_rows)


def test_mha_dropout():
    rng = np.random.default_rng(36)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    with pytest.raises(NotImplementedError):
        reference.multi_head_attention_forward(
            query, key, value, ME, MH, add_zero_attn=False, dropout_p=0.1, **params
        )
    # Dropout is off when not training, so that works and equals torch.
    assert_mha_same(*mha_both(query, key, value, MH, params, dropout_p=0.1, training=False))


def test_mha_huge_logits_do_not_overflow():
    rng = np.random.default_rng(37)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    query *= 300.0  # projected scores of order 1e4
    ours, theirs = mha_both(query, key, value, MH, params)
    assert np.isfinite(ours[0]).all()
    assert_mha_same(ours, theirs)


def test_mha_float32():
    rng = np.random.default_rng(38)
    query, key, value = seq_first(rng, ML, MS, MN, ME, dtype=np.float32)
    params = mha_params(rng, ME, bias_kv=True, dtype=np.float32)
    mask = make_mask(rng, "float", (ML, MS), True).astype(np.float32)
    ours, theirs = mha_both(query, key, value, MH, params, attn_mask=mask, add_zero_attn=True)
    assert ours[0].dtype == np.float32 and ours[1].dtype == np.float32
    assert_mha_same(ours, theirs, rtol=1e-5, atol=1e-6)


def test_mha_nan_in_query_stays_in_its_row():
    rng = np.random.default_rng(39)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    clean = query.copy()
    query[2, 1, 0] = np.nan
    (out, weights), _ = mha_both(query, key, value, MH, params)
    _, (expected, expected_weights) = mha_both(clean, key, value, MH, params)
    assert np.isnan(out[2, 1]).all() and np.isnan(weights[1, 2]).all()
    touched = np.zeros(out.shape[:2], dtype=bool)
    touched[2, 1] = True
    np.testing.assert_allclose(out[~touched], expected[~touched], **TOL)


def test_mha_nan_in_padded_key_is_ignored():
    # attnx deviation: torch spreads the NaN of a padded key to the whole batch element.
    rng = np.random.default_rng(40)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    pad = np.zeros((MN, MS), dtype=bool)
    pad[1, 4] = True
    clean_key, clean_value = key.copy(), value.copy()
    key[4, 1, 0] = np.nan
    value[4, 1, 2] = INF
    ours = reference.multi_head_attention_forward(
        query, key, value, ME, MH, add_zero_attn=False, dropout_p=0.0, key_padding_mask=pad,
        **params
    )
    _, theirs = mha_both(query, clean_key, clean_value, MH, params, key_padding_mask=pad)
    assert_mha_same(ours, theirs)


def test_mha_nan_in_visible_key_reaches_its_batch_element_only():
    rng = np.random.default_rng(41)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    clean = key.copy()
    key[4, 1, 0] = np.nan
    out, _ = reference.multi_head_attention_forward(
        query, key, value, ME, MH, add_zero_attn=False, dropout_p=0.0, **params
    )
    _, (expected, _) = mha_both(query, clean, value, MH, params)
    assert np.isnan(out[:, 1]).all()
    np.testing.assert_allclose(out[:, [0, 2]], expected[:, [0, 2]], **TOL)


def mha_error_cases():
    rng = np.random.default_rng(42)
    query, key, value = seq_first(rng, ML, MS, MN, ME)
    params = mha_params(rng, ME)
    base = dict(query=query, key=key, value=value, embed_dim_to_check=ME, num_heads=MH,
                add_zero_attn=False, dropout_p=0.0, **params)
    bias_k_only = dict(params, bias_k=rng.standard_normal((1, 1, ME)))
    w_in = params["in_proj_weight"]
    return [
        ("embed_dim_to_check", dict(base, embed_dim_to_check=ME + 1), ValueError),
        ("heads do not divide", dict(base, num_heads=5), ValueError),
        ("attn_mask shape", dict(base, attn_mask=np.zeros((ML, MS + 1), bool)), ValueError),
        ("attn_mask 3d shape", dict(base, attn_mask=np.zeros((MH, ML, MS), bool)), ValueError),
        ("attn_mask 4d", dict(base, attn_mask=np.zeros((MN, MH, ML, MS), bool)), ValueError),
        ("kpm shape", dict(base, key_padding_mask=np.zeros((MS,), bool)), ValueError),
        ("int attn_mask", dict(base, attn_mask=np.zeros((ML, MS), np.int8)), TypeError),
        ("int kpm", dict(base, key_padding_mask=np.zeros((MN, MS), np.int64)), TypeError),
        ("int query", dict(base, query=query.astype(np.int64)), TypeError),
        ("complex value", dict(base, value=value.astype(np.complex64)), TypeError),
        ("bias_k without bias_v", dict(base, **bias_k_only), ValueError),
        ("key/value lengths", dict(base, value=value[:-1]), ValueError),
        ("batch mismatch", dict(base, key=key[:, :-1], value=value[:, :-1]), ValueError),
        ("4-D query", dict(base, query=query[None]), ValueError),
        ("unbatched query, batched key", dict(base, query=query[:, 0]), ValueError),
        ("static_k shape", dict(base, static_k=np.zeros((MN, MS, ME // MH))), ValueError),
        ("in_proj_weight shape", dict(base, in_proj_weight=w_in[:-1]), ValueError),
        ("missing separate weights", dict(base, use_separate_proj_weight=True), ValueError),
    ]


MHA_ERRORS = mha_error_cases()


@pytest.mark.parametrize("name,kwargs,error", MHA_ERRORS, ids=[c[0] for c in MHA_ERRORS])
def test_mha_errors(name, kwargs, error):
    with pytest.raises(error):
        reference.multi_head_attention_forward(**kwargs)


@pytest.mark.parametrize("seed", range(40))
def test_mha_random_configurations(seed):
    rng = np.random.default_rng(200 + seed)
    num_heads = int(rng.choice([1, 2, 3, 4]))
    embed_dim = num_heads * int(rng.integers(1, 6))
    tgt_len, src_len = (int(x) for x in rng.integers(1, 9, size=2))
    batch = int(rng.integers(1, 4))
    kdim, vdim = (int(x) if rng.random() < 0.3 else embed_dim for x in rng.integers(1, 9, size=2))
    bias_kv = bool(rng.random() < 0.3)
    add_zero_attn = bool(rng.random() < 0.3)
    batched = bool(rng.random() < 0.8)
    batch_first = bool(rng.random() < 0.5)
    params = mha_params(rng, embed_dim, kdim, vdim, bias=bool(rng.random() < 0.8),
                        bias_kv=bias_kv, separate=bool(rng.random() < 0.2))
    query, key, value = seq_first(rng, tgt_len, src_len, batch, embed_dim, kdim, vdim)
    if not batched:
        query, key, value = query[:, 0], key[:, 0], value[:, 0]
        batch = 1
    elif batch_first:
        query, key, value = (np.swapaxes(x, 0, 1).copy() for x in (query, key, value))
    options = {
        "need_weights": bool(rng.random() < 0.7),
        "average_attn_weights": bool(rng.random() < 0.5),
    }
    mask_kind = rng.choice(["none", "bool", "float"])
    if mask_kind != "none":
        shape = (tgt_len, src_len) if rng.random() < 0.5 else (batch * num_heads, tgt_len, src_len)
        options["attn_mask"] = make_mask(rng, str(mask_kind), shape, True)
    kpm_kind = rng.choice(["none", "bool", "float"])
    if kpm_kind != "none":
        shape = (batch, src_len) if batched else (src_len,)
        options["key_padding_mask"] = make_mask(rng, str(kpm_kind), shape, True)
    ours, theirs = mha_both(query, key, value, num_heads, params, add_zero_attn=add_zero_attn,
                            batch_first=batch_first, **options)
    assert_mha_same(ours, theirs)


# ---------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention
# ---------------------------------------------------------------------------------------------


def module_params(module):
    """The reference's keyword arguments for a torch.nn.MultiheadAttention's weights."""
    get = as_numpy
    params = {
        "in_proj_weight": get(module.in_proj_weight),
        "in_proj_bias": get(module.in_proj_bias),
        "bias_k": get(module.bias_k),
        "bias_v": get(module.bias_v),
        "add_zero_attn": module.add_zero_attn,
        "dropout_p": module.dropout,
        "out_proj_weight": get(module.out_proj.weight),
        "out_proj_bias": get(module.out_proj.bias),
        "batch_first": module.batch_first,
    }
    if not module._qkv_same_embed_dim:
        params.update(
            use_separate_proj_weight=True,
            q_proj_weight=get(module.q_proj_weight),
            k_proj_weight=get(module.k_proj_weight),
            v_proj_weight=get(module.v_proj_weight),
        )
    return params


MODULE_CONFIGS = {
    "default": {},
    "no bias": {"bias": False},
    "add_bias_kv": {"add_bias_kv": True},
    "add_zero_attn": {"add_zero_attn": True},
    "kdim/vdim": {"kdim": 5, "vdim": 7},
    "batch_first": {"batch_first": True},
    "batch_first, all": {"batch_first": True, "add_bias_kv": True, "add_zero_attn": True,
                         "kdim": 3, "vdim": 9},
}


@pytest.mark.parametrize("masks", ["none", "masks"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("config", list(MODULE_CONFIGS))
def test_module(config, mode, masks):
    # eval + no_grad + batch_first self-attention takes torch's fused fast path.
    kwargs = MODULE_CONFIGS[config]
    embed_dim, num_heads = 8, 2
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(embed_dim, num_heads, dtype=torch.float64, **kwargs)
    module.train(mode == "train")
    rng = np.random.default_rng(43)
    kdim, vdim = kwargs.get("kdim", embed_dim), kwargs.get("vdim", embed_dim)
    query, key, value = seq_first(rng, ML, ML, MN, embed_dim, kdim, vdim)
    if module.batch_first:
        query, key, value = (np.swapaxes(x, 0, 1).copy() for x in (query, key, value))
    if kdim == vdim == embed_dim:
        key = value = query  # self-attention (one tensor), so the fast path can apply
    call = {}
    if masks == "masks":
        call = {"attn_mask": make_mask(rng, "bool", (ML, ML), True),
                "key_padding_mask": make_mask(rng, "bool", (MN, ML), True)}
    with torch.no_grad():
        tq = tensor(query)
        tk = tq if key is query else tensor(key)
        tv = tk if value is key else tensor(value)
        out, weights = module(tq, tk, tv, **{n: tensor(m) for n, m in call.items()})
    ours = reference.multi_head_attention_forward(
        query, key, value, embed_dim, num_heads, training=module.training,
        **module_params(module), **call
    )
    assert_mha_same(ours, (as_numpy(out), as_numpy(weights)))


def test_module_unbatched_and_need_weights_false():
    torch.manual_seed(1)
    module = torch.nn.MultiheadAttention(8, 4, dtype=torch.float64, add_bias_kv=True)
    rng = np.random.default_rng(44)
    query, key, value = (x[:, 0] for x in seq_first(rng, ML, MS, 1, 8))
    for need_weights, average in [(True, False), (False, True)]:
        out, weights = module(tensor(query), tensor(key), tensor(value), need_weights=need_weights,
                              average_attn_weights=average)
        ours = reference.multi_head_attention_forward(
            query, key, value, 8, 4, need_weights=need_weights, average_attn_weights=average,
            **module_params(module)
        )
        assert_mha_same(ours, (as_numpy(out), as_numpy(weights)))
