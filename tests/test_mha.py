"""attnx.multi_head_attention_forward against the NumPy reference and against torch.

The reference runs in float64 on float64 copies of every float input; attnx's float32 results
must agree to rtol 1e-5 / atol 1e-6 (the output's atol grows with the square root of the
embedding size, see output_atol), its float64 results to 1e-12.
Every argument is exercised alone and in combination: masks (none, bool, float; 2-D and 3-D),
key_padding_mask (none, bool, float), bias_k/bias_v, add_zero_attn, static_k/static_v,
kdim/vdim, batch_first, unbatched inputs, need_weights, average_attn_weights and is_causal.
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
    mha_args,
    mha_mask,
    num_threads,
    output_atol,
    quiet_torch,
    randn,
    ref_mha,
)

mha = attnx.multi_head_attention_forward


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def check(args, dtype=None):
    """attnx vs the float64 reference, output and weights; returns attnx's (out, weights)."""
    dtype = np.asarray(args["query"]).dtype if dtype is None else dtype
    out, w = mha(**args)
    ref_out, ref_w = ref_mha(**args)
    assert_close(out, ref_out, dtype, err_msg="attn_output", atol=output_atol(args, ref_out, dtype))
    if args.get("need_weights", True):
        assert w is not None
        assert_close(w, ref_w, dtype, err_msg="attn_weights")
    else:
        assert w is None
    return out, w


def src_len(args):
    """The number of source keys the masks describe."""
    if args.get("static_k") is not None:
        return args["static_k"].shape[1]
    key = args["key"]
    if key.ndim == 2:
        return key.shape[0]
    return key.shape[1] if args.get("batch_first") else key.shape[0]


def batch_size(args):
    q = args["query"]
    if q.ndim == 2:
        return None
    return q.shape[0] if args.get("batch_first") else q.shape[1]


def add_masks(rng, args, attn_kind=None, attn_rank=2, kpm_kind=None, dtype=np.float64, keep_one=True):
    """Random masks of the right shapes (the last key stays visible with keep_one)."""
    q = args["query"]
    L = q.shape[1] if (q.ndim == 3 and args.get("batch_first")) else q.shape[0]
    S = src_len(args)
    N = batch_size(args)
    H = args["num_heads"]
    if attn_kind is not None:
        shape = (L, S) if attn_rank == 2 else ((1 if N is None else N) * H, L, S)
        args["attn_mask"] = mha_mask(rng, attn_kind, shape, dtype, keep_one=keep_one)
    if kpm_kind is not None:
        shape = (S,) if N is None else (N, S)
        args["key_padding_mask"] = mha_mask(rng, kpm_kind, shape, dtype, keep_one=keep_one)
    return args


def seq_rows(out, args):
    """attnx's output as (N, L, E) (whatever the layout)."""
    if out.ndim == 2:
        return out[None]
    return out if args.get("batch_first") else out.transpose(1, 0, 2)


# ---------------------------------------------------------------------------------------------
# Combinations
# ---------------------------------------------------------------------------------------------

MASK_CASES = [(None, 2), ("bool", 2), ("bool", 3), ("float", 2), ("float", 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("add_zero_attn", [False, True], ids=["", "zero_attn"])
@pytest.mark.parametrize("bias_kv", [False, True], ids=["", "bias_kv"])
@pytest.mark.parametrize("kpm", [None, "bool", "float"], ids=["kpm_none", "kpm_bool", "kpm_float"])
@pytest.mark.parametrize("mask,rank", MASK_CASES, ids=[f"{m}{r}" for m, r in MASK_CASES])
def test_masks_bias_kv_zero_attn(rng, mask, rank, kpm, bias_kv, add_zero_attn, batch_first, dtype):
    args = mha_args(rng, L=5, S=7, N=2, E=8, H=2, dtype=dtype, bias_kv=bias_kv,
                    add_zero_attn=add_zero_attn, batch_first=batch_first)
    add_masks(rng, args, mask, rank, kpm, dtype)
    out, w = check(args)
    S_total = 7 + bias_kv + add_zero_attn
    assert out.shape == ((2, 5, 8) if batch_first else (5, 2, 8))
    assert w.shape == (2, 5, S_total)
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("average", [True, False], ids=["avg", "per_head"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
def test_weights_options(rng, need_weights, average, batch_first, unbatched, dtype):
    H, L, S, N, E = 3, 6, 9, 2, 12
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, need_weights=need_weights,
                    average_attn_weights=average, batch_first=batch_first, unbatched=unbatched,
                    bias_kv=True, add_zero_attn=True)
    add_masks(rng, args, "bool", 3, "float", dtype)
    out, w = check(args)
    lead = () if unbatched else (N,)
    assert out.shape == ((L, E) if unbatched else ((N, L, E) if batch_first else (L, N, E)))
    if need_weights:
        assert w.shape == lead + ((L, S + 2) if average else (H, L, S + 2))
        if not average:
            # The averaged weights are the mean of the per-head ones.
            args2 = {**args, "average_attn_weights": True}
            _, w_avg = mha(**args2)
            assert_close(w_avg, w.astype(np.float64).mean(axis=-3), dtype)
    else:
        assert w is None
        # need_weights does not change the output.
        out_w, _ = mha(**{**args, "need_weights": True})
        assert_close(out, out_w.astype(np.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kpm", [None, "bool", "float"])
@pytest.mark.parametrize("add_zero_attn", [False, True], ids=["", "zero_attn"])
@pytest.mark.parametrize("which", ["k", "v", "kv"])
def test_static_kv(rng, which, add_zero_attn, kpm, dtype):
    H, hd, N, L, S, S2 = 2, 4, 3, 5, 6, 9
    args = mha_args(rng, L=L, S=S, N=N, E=H * hd, H=H, dtype=dtype, add_zero_attn=add_zero_attn)
    if which == "k":
        args["static_k"] = randn(rng, (N * H, S, hd), dtype)
    elif which == "v":
        args["static_v"] = randn(rng, (N * H, S, hd), dtype)
    else:
        args["static_k"] = randn(rng, (N * H, S2, hd), dtype)
        args["static_v"] = randn(rng, (N * H, S2, hd), dtype)
    add_masks(rng, args, "float", 3, kpm, dtype)
    out, w = check(args)
    assert w.shape == (N, L, src_len(args) + add_zero_attn)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bias_kv", [False, True], ids=["", "bias_kv"])
@pytest.mark.parametrize("in_bias", [False, True], ids=["no_in_bias", "in_bias"])
@pytest.mark.parametrize("kdim,vdim", [(5, 7), (8, 3), (12, 8), (8, 8), (1, 1)])
def test_kdim_vdim(rng, kdim, vdim, in_bias, bias_kv, dtype):
    args = mha_args(rng, L=5, S=7, N=2, E=8, H=4, kdim=kdim, vdim=vdim, separate=True,
                    in_bias=in_bias, bias_kv=bias_kv, dtype=dtype)
    add_masks(rng, args, "bool", 2, "bool", dtype)
    check(args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("in_bias", [False, True], ids=["no_in_bias", "in_bias"])
def test_long_input_dims(rng, in_bias, dtype):
    # Input dims longer than the projection's blocks of `in` (1024 to 4096
    # rows of a packed panel, by kernel), with a remainder, over enough rows to
    # take the packed-panel path; the same bits on any thread count.
    args = mha_args(rng, L=40, S=33, N=2, E=264, H=3, kdim=1100, vdim=4100, separate=True,
                    in_bias=in_bias, dtype=dtype, need_weights=False)
    check(args)
    with num_threads(1):
        one = mha(**args)[0]
    with num_threads(3):
        assert_identical(one, mha(**args)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_separate_weights_equal_packed(rng, dtype):
    args = mha_args(rng, dtype=dtype)
    w = args["in_proj_weight"]
    sep = {**args, "use_separate_proj_weight": True, "in_proj_weight": None,
           "q_proj_weight": w[:8], "k_proj_weight": w[8:16], "v_proj_weight": w[16:]}
    for a, b in zip(mha(**args), mha(**sep)):
        assert_identical(a, b)
    # With use_separate_proj_weight the packed weight is ignored.
    sep["in_proj_weight"] = np.full_like(w, np.nan)
    for a, b in zip(mha(**args), mha(**sep)):
        assert_identical(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("in_bias", [False, True], ids=["no_in_bias", "in_bias"])
@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "unbatched"])
@pytest.mark.parametrize("L,N", [(5, 2), (16, 1), (32, 1), (33, 1), (40, 3)])
def test_self_attention_equals_copied_inputs(rng, L, N, layout, in_bias, need_weights, dtype):
    # Self-attention (one array as query, key and value, with torch's stacked
    # in_proj_weight) may project the three at once; it must give the same
    # numbers, to the bit, as the same values passed as three arrays.
    args = mha_args(rng, L=L, S=L, N=N, E=16, H=4, dtype=dtype, in_bias=in_bias,
                    batch_first=layout == "batch_first", unbatched=layout == "unbatched",
                    need_weights=need_weights)
    x = args["query"]
    self_args = {**args, "key": x, "value": x}
    copied = {**args, "key": x.copy(), "value": x.copy()}
    out, w = check(self_args)
    out_copied, w_copied = mha(**copied)
    assert_identical(out, out_copied)
    if need_weights:
        assert_identical(w, w_copied)
    # The module's own path too, causal and not.
    module = attnx.MultiheadAttention(16, 4, bias=in_bias, batch_first=layout == "batch_first",
                                      dtype=dtype)
    module.in_proj_weight[...] = args["in_proj_weight"]
    for is_causal in (False, True):
        a = module(x, x, x, need_weights=need_weights, is_causal=is_causal)
        b = module(x, x.copy(), x.copy(), need_weights=need_weights, is_causal=is_causal)
        for got, want in zip(a, b):
            if want is not None:
                assert_identical(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("L,N", [(40, 1), (100, 2), (200, 1)])
def test_self_attention_with_large_weights_equals_copied_inputs(rng, L, N, need_weights, dtype):
    # With weights of a MiB or more and not many rows, the three projections of
    # self-attention run as one, computed transposed (y^T = w . x^T), where the
    # same values in three arrays take three projections with packed weights (E = 384:
    # [w_q; w_k; w_v] is 1.7 MiB in float32, each alone 0.6 MiB): the same bits, with
    # and without a key padding mask, on any thread count.
    args = mha_args(rng, L=L, S=L, N=N, E=384, H=6, dtype=dtype, need_weights=need_weights,
                    batch_first=True)
    x = args["query"]
    kpm = rng.random((N, L)) < 0.2
    kpm[:, 0] = False
    for mask in (None, kpm):
        self_args = {**args, "key": x, "value": x, "key_padding_mask": mask}
        out, w = check(self_args)
        out_copied, w_copied = mha(**{**self_args, "key": x.copy(), "value": x.copy()})
        assert_identical(out, out_copied)
        if need_weights:
            assert_identical(w, w_copied)
        with num_threads(3):
            assert_identical(out, mha(**self_args)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
def test_self_attention_on_strided_views(rng, batch_first, dtype):
    # The same on views whose rows are not evenly spaced, or not in order.
    module = attnx.MultiheadAttention(16, 4, batch_first=batch_first, dtype=dtype)
    module.in_proj_bias[...] = randn(rng, (48,), dtype)
    big = randn(rng, (3, 10, 32), dtype)
    for x in (big[:, ::2, :16], big[::2, 1::3, 16:], big.transpose(1, 0, 2)[::3, :, :16]):
        out, w = module(x, x, x)
        contiguous = np.ascontiguousarray(x)
        out_copied, w_copied = module(contiguous, contiguous.copy(), contiguous.copy())
        assert_identical(out, out_copied)
        assert_identical(w, w_copied)


FEW_ROWS = [(1, 4), (1, 8), (1, 13), (1, 16), (1, 24), (1, 32), (2, 8), (2, 16), (4, 8), (3, 5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("E,H,E_out", [(16, 4, 16), (24, 1, 24), (64, 4, 64), (40, 5, 24),
                                       (96, 3, 100)])
@pytest.mark.parametrize("N,L", FEW_ROWS, ids=[f"N{n}L{l}" for n, l in FEW_ROWS])
def test_self_attention_few_rows(rng, N, L, E, H, E_out, dtype):
    # Self-attention over few rows (up to a gemm panel of N * L, some 8 to 32
    # queries a sequence, by kernel) is computed with the rows transposed from
    # the input projection to the output projection. Around the limits of that
    # form: the reference's values, and the same bits as three separate arrays
    # (the general path), on any thread count.
    args = mha_args(rng, L=L, S=L, N=N, E=E, H=H, dtype=dtype, need_weights=False,
                    batch_first=N % 2 == 0)
    args["out_proj_weight"] = randn(rng, (E_out, E), dtype, 1.0 / np.sqrt(E))
    args["out_proj_bias"] = randn(rng, (E_out,), dtype)
    x = args["query"]
    self_args = {**args, "key": x, "value": x}
    out, _ = check(self_args)
    assert out.shape[-1] == E_out
    assert_identical(out, mha(**{**args, "key": x.copy(), "value": x.copy()})[0])
    with num_threads(3):
        assert_identical(out, mha(**self_args)[0])
    # A non-finite input row reaches the rows it reaches in the general path.
    x[(0, 1) if N % 2 == 0 else (1, 0)][2] = np.inf
    out, _ = mha(**self_args)
    want, _ = mha(**{**args, "key": x.copy(), "value": x.copy()})
    assert np.isnan(want).any()
    assert_identical(out, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("in_bias", [False, True], ids=["no_in_bias", "in_bias"])
@pytest.mark.parametrize("N,L,S", [(1, 1, 1), (1, 2, 3), (2, 1, 2), (1, 3, 5), (4, 1, 1), (2, 2, 9),
                                   (1, 5, 4)])
def test_few_rows_on_many_threads(rng, N, L, S, in_bias, dtype):
    # A few rows (up to four) are projected as dot products with the rows of
    # the weights, in blocks shared among threads. Weights of 1000 x 1000 (odd:
    # each row ends in a partial vector) make the calls large enough to be
    # threaded: the reference's values, and the same bits on 1 and 3 threads,
    # for cross-attention (S keys) and self-attention.
    E, H = 1000, 8
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, in_bias=in_bias,
                    need_weights=False, batch_first=N % 2 == 0)
    x = args["query"]
    for call in (args, {**args, "key": x, "value": x}):
        with num_threads(1):
            out, _ = check(call)
        with num_threads(3):
            assert_identical(out, mha(**call)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [5, 33, 100, 256])
@pytest.mark.parametrize("n_in,n_out", [(1000, 700), (1300, 1100), (64, 96)])
def test_projection_forms_give_the_same_bits(rng, rows, n_in, n_out, dtype):
    # A projection of up to 256 rows with a large weight is computed as
    # y^T = w . x^T; more rows, or a small weight, pack w instead. Both sum
    # each value in the same order: a row gives the same bits in a call of
    # a few rows as in one of many, on any thread count.
    from attnx import _core

    x = randn(rng, (rows + 300, n_in), dtype)
    w = randn(rng, (n_out, n_in), dtype, 1.0 / np.sqrt(n_in))
    bias = randn(rng, (n_out,), dtype)
    many = np.empty((rows + 300, n_out), dtype)
    few = np.empty((rows, n_out), dtype)
    with num_threads(1):
        _core.linear(x, w, bias, many)
    for threads in (2, 3, 5):  # the blocks of rows of w or of x are cut per thread count
        with num_threads(threads):
            _core.linear(x[:rows], w, bias, few)
        assert_identical(few, many[:rows])
        again = np.empty_like(many)
        with num_threads(threads):
            _core.linear(x, w, bias, again)
        assert_identical(again, many)
    want = x[:rows].astype(np.float64) @ w.T.astype(np.float64) + bias
    assert_close(few, want, dtype, atol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "padded"])
@pytest.mark.parametrize("N,L", [(5, 100), (3, 70), (2, 193)])
def test_batch_rows_give_the_bits_of_each_sequence_alone(rng, N, L, layout, dtype):
    # The projections of many rows take blocks of rows that may span several
    # sequences of the batch (where the rows are evenly spaced), sized by the
    # thread count: each sequence still gives the bits it gives alone, on any
    # thread count, and the values of the float64 reference.
    E, H = 48, 4
    module = attnx.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    module.in_proj_bias[...] = randn(rng, (3 * E,), dtype)
    module.out_proj_bias[...] = randn(rng, (E,), dtype)
    if layout == "contiguous":
        x = randn(rng, (N, L, E), dtype)
    else:  # rows evenly spaced within each sequence, not across them
        x = randn(rng, (N, L + 3, E), dtype)[:, 2:-1]
    for threads in (1, 2, 3):
        with num_threads(threads):
            batch, _ = module(x, x, x, need_weights=False)
            for n in range(N):
                alone, _ = module(x[n : n + 1], x[n : n + 1], x[n : n + 1], need_weights=False)
                assert_identical(batch[n : n + 1], alone)
    p = module.state_dict()
    seq_first = x.transpose(1, 0, 2)
    args = dict(
        query=seq_first, key=seq_first, value=seq_first, embed_dim_to_check=E, num_heads=H,
        in_proj_weight=p["in_proj_weight"], in_proj_bias=p["in_proj_bias"], bias_k=None,
        bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=p["out_proj.weight"],
        out_proj_bias=p["out_proj.bias"], need_weights=False,
    )
    want = ref_mha(**args)[0].transpose(1, 0, 2)
    assert_close(batch, want, dtype, atol=output_atol(args, want, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("out_bias", [False, True], ids=["no_out_bias", "out_bias"])
@pytest.mark.parametrize("in_bias", [False, True], ids=["no_in_bias", "in_bias"])
def test_optional_biases(rng, in_bias, out_bias, dtype):
    args = mha_args(rng, in_bias=in_bias, out_bias=out_bias, dtype=dtype)
    check(args)


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

HEAD_CONFIGS = [(1, 1), (15, 1), (32, 2), (34, 2), (128, 2), (160, 2), (128, 1)]  # head_dim 1..128
LENGTH_PAIRS = [(1, 1), (31, 129), (32, 33), (33, 32), (129, 31), (127, 300), (300, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L,S", LENGTH_PAIRS)
@pytest.mark.parametrize("E,H", HEAD_CONFIGS)
def test_sizes(rng, E, H, L, S, dtype):
    N = 1 if E * max(L, S) > 20000 else 2
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, need_weights=(L * S < 20000))
    check(args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L,S", [(31, 129), (129, 31), (300, 300), (5, 5), (5, 9), (9, 5)])
def test_sizes_with_masks_and_causal(rng, L, S, dtype):
    args = mha_args(rng, L=L, S=S, N=2, E=16, H=2, dtype=dtype, is_causal=True)
    add_masks(rng, args, None, 2, "bool", dtype)
    check(args)
    args["need_weights"] = False
    check(args)


# ---------------------------------------------------------------------------------------------
# is_causal
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("extras", ["", "bias_kv", "zero_attn", "static"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("L,S", [(5, 5), (4, 9), (9, 4), (40, 140)])
def test_is_causal_alone(rng, L, S, need_weights, extras, dtype):
    N, H, E = 2, 2, 8
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, is_causal=True,
                    need_weights=need_weights, bias_kv=extras == "bias_kv",
                    add_zero_attn=extras == "zero_attn")
    if extras == "static":
        args["static_k"] = randn(rng, (N * H, S, E // H), dtype)
    out, w = check(args)
    # The same as torch's convention: an explicit causal bool mask (True = not allowed).
    explicit = {**args, "is_causal": False, "attn_mask": np.triu(np.ones((L, S), bool), 1)}
    out2, w2 = mha(**explicit)
    assert_close(out, out2.astype(np.float64), dtype)
    if need_weights:
        assert_close(w, w2.astype(np.float64), dtype)
        # Row i has zero weight on source keys j > i; appended keys stay visible.
        future = np.triu(np.ones((L, S), bool), 1)
        assert (w[:, :, :S][:, future] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_is_causal_with_attn_mask_uses_the_mask(rng, kind, dtype):
    args = mha_args(rng, L=6, S=6, dtype=dtype)
    add_masks(rng, args, kind, 2, None, dtype)
    plain = mha(**args)
    causal = mha(**{**args, "is_causal": True})
    check({**args, "is_causal": True})
    for a, b in zip(plain, causal):
        assert_identical(a, b)


# ---------------------------------------------------------------------------------------------
# Unbatched, empty, fully masked
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mask,rank", MASK_CASES)
@pytest.mark.parametrize("kpm", [None, "bool", "float"])
def test_unbatched_equals_batch_of_one(rng, mask, rank, kpm, dtype):
    H, L, S, E = 2, 5, 7, 8
    args = mha_args(rng, L=L, S=S, E=E, H=H, dtype=dtype, unbatched=True, bias_kv=True)
    add_masks(rng, args, mask, rank, kpm, dtype)
    out, w = check(args)
    assert out.shape == (L, E) and w.shape == (L, S + 1)
    batched = {**args, "query": args["query"][:, None], "key": args["key"][:, None],
               "value": args["value"][:, None]}
    if kpm is not None:
        batched["key_padding_mask"] = args["key_padding_mask"][None]
    out1, w1 = mha(**batched)
    assert_close(out, out1[:, 0].astype(np.float64), dtype)
    assert_close(w, w1[0].astype(np.float64), dtype)
    _, w_heads = mha(**{**args, "average_attn_weights": False})
    assert w_heads.shape == (H, L, S + 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("L,S,N", [(5, 7, 0), (0, 7, 2), (0, 0, 0), (0, 7, 0)])
def test_empty_batch_or_queries(rng, L, S, N, batch_first, dtype):
    args = mha_args(rng, L=L, S=S, N=N, dtype=dtype, batch_first=batch_first)
    add_masks(rng, args, "bool", 3, "bool", dtype)
    out, w = check(args)
    assert out.shape == ((N, L, 8) if batch_first else (L, N, 8))
    assert w.shape == (N, L, S)
    _, w = mha(**{**args, "average_attn_weights": False})
    assert w.shape == (N, 2, L, S)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("out_bias", [True, False])
@pytest.mark.parametrize("unbatched", [False, True])
def test_no_keys(rng, unbatched, out_bias, dtype):
    # S = 0: no key at all, the attention rows are zero, the output is out_proj_bias.
    L, N, E = 6, 2, 8
    args = mha_args(rng, L=L, S=0, N=N, E=E, dtype=dtype, unbatched=unbatched, out_bias=out_bias)
    out, w = check(args)
    bias = args["out_proj_bias"] if out_bias else np.zeros(E, dtype)
    np.testing.assert_array_equal(out, np.broadcast_to(bias, out.shape))
    assert w.shape == ((L, 0) if unbatched else (N, L, 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_no_keys_with_zero_attn(rng, dtype):
    args = mha_args(rng, L=6, S=0, N=2, dtype=dtype, add_zero_attn=True)
    out, w = check(args)
    np.testing.assert_array_equal(w, 1.0)
    args = mha_args(rng, L=6, S=0, N=2, dtype=dtype, bias_kv=True)
    out, w = check(args)
    np.testing.assert_array_equal(w, 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("how", ["kpm_bool", "kpm_float", "attn_bool", "attn_float3", "both"])
def test_fully_masked_rows(rng, how, need_weights, dtype):
    L, S, N, H, E = 40, 140, 2, 2, 8
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, need_weights=need_weights,
                    average_attn_weights=False)
    add_masks(rng, args, None, 2, None, dtype)
    dead = np.zeros((N, H, L), bool)  # (n, h, l) rows with no open key
    if how.startswith("kpm"):
        kpm = mha_mask(rng, how[4:], (N, S), dtype)
        kpm[1] = True if how == "kpm_bool" else -np.inf
        args["key_padding_mask"] = kpm
        dead[1] = True
    elif how == "attn_bool":
        am = mha_mask(rng, "bool", (L, S), dtype)
        am[[0, 31, 32, 39]] = True
        args["attn_mask"] = am
        dead[:, :, [0, 31, 32, 39]] = True
    elif how == "attn_float3":
        am = mha_mask(rng, "float", (N * H, L, S), dtype).reshape(N, H, L, S)
        am[0, 1, 5] = -np.inf
        am[1, 0, 33] = -np.inf
        args["attn_mask"] = am.reshape(N * H, L, S)
        dead[0, 1, 5] = dead[1, 0, 33] = True
    else:
        am = np.zeros((L, S), bool)
        am[:, :70] = True
        kpm = np.zeros((N, S), bool)
        kpm[0, 70:] = True
        args["attn_mask"], args["key_padding_mask"] = am, kpm
        dead[0] = True
    out, w = check(args)
    rows = seq_rows(out, args)  # (N, L, E)
    all_dead = dead.all(axis=1)  # (N, L): rows dead in every head
    # Deviation from torch: a row with no key gives out_proj_bias (never NaN) ...
    np.testing.assert_array_equal(rows[all_dead], np.broadcast_to(args["out_proj_bias"], rows[all_dead].shape))
    assert np.isfinite(out).all()
    # ... and zero weights.
    if need_weights:
        np.testing.assert_array_equal(w[dead], 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fully_masked_keys_but_bias_kv_and_zero_attn_are_open(rng, dtype):
    args = mha_args(rng, L=5, S=7, dtype=dtype, bias_kv=True, add_zero_attn=True)
    args["key_padding_mask"] = np.ones((2, 7), bool)
    out, w = check(args)
    # Only the two appended keys are open.
    np.testing.assert_array_equal(w[..., :7], 0.0)
    np.testing.assert_allclose(w[..., 7:].sum(axis=-1), 1.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# dtypes, dropout, NaN and Inf
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_float16_inputs_are_converted(rng, dtype):
    args = mha_args(rng, dtype=dtype, bias_kv=True)
    for name in ("key", "value", "in_proj_weight", "in_proj_bias", "out_proj_weight", "bias_k"):
        args[name] = args[name].astype(np.float16)
    add_masks(rng, args, "float", 2, "float", np.float16)
    out, w = check(args, dtype)
    assert out.dtype == dtype and w.dtype == dtype
    converted = {k: (v.astype(dtype) if isinstance(v, np.ndarray) and v.dtype == np.float16 else v)
                 for k, v in args.items()}
    for a, b in zip((out, w), mha(**converted)):
        assert_identical(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_query_dtype_decides(rng, dtype):
    other = np.float64 if dtype == np.float32 else np.float32
    args = mha_args(rng, dtype=other)
    args["query"] = args["query"].astype(dtype)
    out, w = check(args, dtype)
    assert out.dtype == dtype and w.dtype == dtype


@pytest.mark.parametrize("dropout_p", [0.0, 0.3, 1.0])
def test_dropout_ignored_when_not_training(rng, dropout_p):
    args = mha_args(rng)
    base = mha(**args)
    for a, b in zip(base, mha(**{**args, "dropout_p": dropout_p, "training": False})):
        assert_identical(a, b)
    for a, b in zip(base, mha(**{**args, "dropout_p": 0.0, "training": True})):
        assert_identical(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch_first", [False, True])
def test_nan_in_query_row(rng, batch_first, dtype):
    N, L, S, E = 2, 40, 140, 8
    args = mha_args(rng, L=L, S=S, N=N, E=E, dtype=dtype, batch_first=batch_first)
    q = args["query"]
    (q[1, 33] if batch_first else q[33, 1])[2] = np.nan
    with np.errstate(invalid="ignore"):
        out, w = check(args)
    rows = seq_rows(out, args)
    assert np.isnan(rows[1, 33]).all()
    assert np.isnan(w[1, 33]).all()
    ok = np.ones((N, L), bool)
    ok[1, 33] = False
    assert np.isfinite(rows[ok]).all() and np.isfinite(w[ok]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_in_key_or_value(rng, where, dtype):
    N, L, S, E = 2, 40, 140, 8
    args = mha_args(rng, L=L, S=S, N=N, E=E, dtype=dtype)
    args[where][100, 0, 3] = np.nan  # sequence-first: position 100 of batch 0
    with np.errstate(invalid="ignore"):
        out, w = check(args)
    rows = seq_rows(out, args)
    assert np.isnan(rows[0]).all()  # the out projection mixes every column
    assert np.isfinite(rows[1]).all() and np.isfinite(w[1]).all()
    if where == "value":
        assert np.isfinite(w).all()  # a NaN value does not touch the weights


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("how", ["kpm_bool", "kpm_float", "attn_bool", "causal"])
def test_nan_in_masked_key_reaches_no_row(rng, how, where, dtype):
    N, L, S, E = 2, 40, 140, 8
    j = 100
    args = mha_args(rng, L=L, S=S, N=N, E=E, dtype=dtype)
    args[where][j, 0, :] = np.nan
    touched = np.zeros((N, L), bool)  # rows that attend key j of batch 0
    if how.startswith("kpm"):
        kpm = mha_mask(rng, how[4:], (N, S), dtype)
        kpm[0, j] = True if how == "kpm_bool" else -np.inf
        args["key_padding_mask"] = kpm
    elif how == "attn_bool":
        am = mha_mask(rng, "bool", (L, S), dtype)
        am[:, j] = True
        am[7, j] = False
        args["attn_mask"] = am
        touched[0, 7] = True
    else:
        args["is_causal"] = True  # L = 40 <= j: no row attends key j
    with np.errstate(invalid="ignore"):
        out, w = check(args)
    rows = seq_rows(out, args)
    assert np.isfinite(rows[~touched]).all()
    assert np.isfinite(w[~touched]).all()
    assert np.isnan(rows[touched]).all()


def non_finite_mask_on_padded_key(rng, value, L, dtype, **kwargs):
    """Arguments whose float attn_mask holds `value` at (row 3, key 100) where batch 0's
    key_padding_mask pads key 100, and the (N, L) rows that value reaches."""
    N, S, i, j = 2, 140, 3, 100
    args = mha_args(rng, L=L, S=S, N=N, E=8, dtype=dtype, **kwargs)
    am = np.zeros((L, S), dtype)
    am[i, j] = value
    kpm = np.zeros((N, S), bool)
    kpm[0, j] = True
    args["attn_mask"], args["key_padding_mask"] = am, kpm
    touched = np.zeros((N, L), bool)
    touched[:, i] = True  # batch 1 attends key j; in batch 0, -inf + (+inf or NaN) is NaN
    return args, touched


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L,S", [(40, 100), (70, 70)])
def test_nan_key_in_causal_band_fills_the_whole_weights_row(rng, L, S, dtype):
    # A NaN key makes every later row's weights NaN, the keys past the causal
    # band included (0 / NaN), as in torch and the reference; the weights are
    # computed a tile of rows at a time over the keys up to the tile's band,
    # and the rest of each row must follow its sum.
    args = mha_args(rng, L=L, S=S, N=2, E=8, H=2, dtype=dtype, is_causal=True,
                    average_attn_weights=False)
    args["key"][5, 0] = np.nan
    out, w = check(args)
    assert np.isnan(w[0, :, 5:]).all() and np.isfinite(w[0, :, :5]).all()
    assert np.isfinite(w[1]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("L", [2, 7, 40], ids=["rows", "tile", "tiles"])
def test_nan_key_fills_the_weights_of_trailing_padding(rng, L, dtype):
    # A key padding mask of trailing padding is run as the keys' lengths (the padded keys are
    # never read), but their weights are those of masked keys: NaN in a NaN row, as in torch.
    args = mha_args(rng, L=L, S=12, N=2, E=8, H=2, dtype=dtype, average_attn_weights=False)
    args["key_padding_mask"] = np.arange(12)[None, :] >= np.array([[9], [5]])
    args["key"][2, 0] = np.inf  # a real key of batch 0 (seq-first: key[s, n])
    with np.errstate(invalid="ignore"):
        out, w = check(args)
    assert np.isnan(w[0]).all() and np.isfinite(w[1]).all()
    assert (w[1][..., 5:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("L", [5, 40], ids=["rows", "tiles"])
@pytest.mark.parametrize("value", [np.inf, np.nan], ids=["inf", "nan"])
def test_non_finite_float_mask_on_padded_key_reaches_its_row(rng, value, L, need_weights, dtype):
    # The masks are summed as torch merges them, so padding a key does not hide the
    # attn_mask's +inf or NaN for it: the row gets NaN, as in torch and the reference.
    args, touched = non_finite_mask_on_padded_key(rng, value, L, dtype, need_weights=need_weights)
    with np.errstate(invalid="ignore"):
        out, w = check(args)
    rows = seq_rows(out, args)
    assert np.isnan(rows[touched]).all()
    assert np.isfinite(rows[~touched]).all()
    if need_weights:
        assert np.isnan(w[touched]).all() and np.isfinite(w[~touched]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("value", [np.inf, np.nan], ids=["inf", "nan"])
def test_torch_non_finite_float_mask_on_padded_key(torch, rng, value, dtype):
    args, touched = non_finite_mask_on_padded_key(rng, value, 5, dtype)
    with np.errstate(invalid="ignore"):
        out, _ = check_torch(torch, args, dead_rows=touched)
        t_out, _ = torch_mha64(torch, args)
    assert np.isnan(seq_rows(t_out, args)[touched]).all()
    assert np.isnan(seq_rows(out, args)[touched]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kpm_kind", ["bool", "float"])
def test_mask_layouts_give_the_same_bits(rng, kpm_kind, dtype):
    # The tile path reads masks whose keys are contiguous a block at a time (transposed into
    # the tile's layout by the kernel) and other masks a key at a time: the same values in
    # any layout must give the same bits, NaN and +-inf included.
    N, L, S = 2, 70, 90
    args = mha_args(rng, L=L, S=S, N=N, E=16, H=2, dtype=dtype, need_weights=False)
    am = randn(rng, (L, S), dtype)
    am[rng.random((L, S)) < 0.2] = -np.inf
    am[3, 5], am[10, 7], am[12, 8] = np.nan, np.inf, -0.0
    kpm = mha_mask(rng, kpm_kind, (N, S), dtype)
    if kpm_kind == "bool":
        kpm[0, 7] = kpm[1, 5] = True
    else:
        kpm[0, 7], kpm[1, 5], kpm[1, 9] = -np.inf, -np.inf, np.nan
    layouts = {
        "C": am,
        "F": np.asfortranarray(am),
        "rows_reversed": am[::-1].copy()[::-1],
        "keys_strided": np.repeat(am, 2, axis=1)[:, ::2],
        "per_head": np.broadcast_to(am, (N * 2, L, S)),
    }
    outs = {}
    with np.errstate(invalid="ignore"):
        for name, mask in layouts.items():
            outs[name], _ = mha(**{**args, "attn_mask": mask, "key_padding_mask": kpm})
        check({**args, "attn_mask": am, "key_padding_mask": kpm})
    for name, out in outs.items():
        np.testing.assert_array_equal(out, outs["C"], err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_in_weights_propagates_to_every_row(rng, dtype):
    args = mha_args(rng, dtype=dtype)
    args["out_proj_weight"][3, 1] = np.nan
    with np.errstate(invalid="ignore"):
        out, w = check(args)
    assert np.isnan(out[..., 3]).all()
    assert np.isfinite(np.delete(out, 3, axis=-1)).all() and np.isfinite(w).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_nonfinite_value_of_open_key_with_underflowing_weight(rng, need_weights, dtype):
    # Key 3 is open (finite bias) but its weight underflows to 0: the value's NaN/Inf still
    # reaches the rows (never silently zeroed), as softmax(...) @ v in the reference.
    args = mha_args(rng, L=5, S=7, N=2, E=8, H=1, dtype=dtype, need_weights=need_weights)
    args["value"][3, 0, :] = np.inf
    am = np.zeros((5, 7), dtype)
    am[:, 3] = -1e4
    args["attn_mask"] = am
    with np.errstate(invalid="ignore", over="ignore"):
        out, _ = check(args)
    assert np.isnan(out[:, 0]).all()
    assert np.isfinite(out[:, 1]).all()


@pytest.mark.parametrize("scale", [30.0, 300.0])
def test_large_logits_do_not_overflow(rng, scale):
    # Large projections: scores of ~1e4 and more. float64 must match the reference closely;
    # float32 must stay finite and the weights must still sum to one.
    args = mha_args(rng, L=33, S=140, N=2, E=16, H=2, dtype=np.float64, average_attn_weights=False)
    args["in_proj_weight"] = args["in_proj_weight"] * scale
    out, w = mha(**args)
    ref_out, ref_w = ref_mha(**args)
    # Rounding a score s moves e^s by |s| * 2^-53 relatively (2e-12 at 1e4), whatever order its
    # products are summed in: the 1e-12 of well-scaled inputs cannot hold here.
    E, H = 16, 2
    w_in, b_in = args["in_proj_weight"], args["in_proj_bias"]
    q = (args["query"] @ w_in[:E].T + b_in[:E]).reshape(33, 2, H, E // H)
    k = (args["key"] @ w_in[E:2 * E].T + b_in[E:2 * E]).reshape(140, 2, H, E // H)
    largest = np.abs(np.einsum("lnhd,snhd->nhls", q, k)).max() / np.sqrt(E // H)
    assert largest > 1e3
    tol = 4 * largest * 2.0**-53
    np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(w, ref_w, rtol=tol, atol=tol)
    assert np.isfinite(out).all()
    assert np.abs(w).max() > 0.99  # nearly one-hot rows: the logits are large
    a32 = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    out32, w32 = mha(**a32)
    assert np.isfinite(out32).all() and np.isfinite(w32).all()
    np.testing.assert_allclose(w32.sum(axis=-1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Threads, inputs untouched, no aliasing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("options", [
    {}, {"need_weights": False}, {"average_attn_weights": False}, {"is_causal": True},
    {"bias_kv": True, "add_zero_attn": True}, {"batch_first": True},
])
def test_thread_count_does_not_change_results(rng, threads, options, dtype):
    options = dict(options)
    extra = {k: options.pop(k) for k in list(options) if k in ("bias_kv", "add_zero_attn", "batch_first")}
    args = mha_args(rng, L=130, S=200, N=3, E=64, H=4, dtype=dtype, **extra)
    args.update(options)
    add_masks(rng, args, "float", 2, "bool", dtype)
    with num_threads(1):
        one = mha(**args)
    for n in (2, 3):
        with num_threads(n):
            many = mha(**args)
        for a, b in zip(one, many):
            if a is None:
                assert b is None
            else:
                assert_identical(a, b, err_msg=f"1 thread vs {n}")
    assert attnx.get_num_threads() == threads


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("static", [False, True])
def test_inputs_unchanged_and_not_aliased(rng, static, dtype):
    N, H, hd = 2, 2, 4
    args = mha_args(rng, L=5, S=7, N=N, E=H * hd, H=H, dtype=dtype, bias_kv=not static,
                    add_zero_attn=True, average_attn_weights=False)
    if static:
        args["static_k"] = randn(rng, (N * H, 7, hd), dtype)
        args["static_v"] = randn(rng, (N * H, 7, hd), dtype)
    add_masks(rng, args, "float", 3, "float", dtype)
    before = copies(args)
    out, w = mha(**args)
    assert_unchanged(before, args)
    arrays = {k: v for k, v in args.items() if isinstance(v, np.ndarray)}
    assert_no_alias(out, arrays)
    assert_no_alias(w, arrays)
    assert not np.shares_memory(out, w)
    assert out.flags.writeable and w.flags.writeable


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention_same_array(rng, batch_first, dtype):
    args = mha_args(rng, L=9, S=9, dtype=dtype, batch_first=batch_first)
    x = args["query"]
    x0 = x.copy()
    args["key"] = args["value"] = x
    out, w = check(args)
    assert_identical(x, x0)
    assert not np.shares_memory(out, x)


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


def torch_mha64(torch, args):
    """torch's F.multi_head_attention_forward in float64 on the same arguments.

    batch_first is emulated by transposing; attnx's is_causal without attn_mask becomes an
    explicit causal bool mask (torch needs one).
    """
    a = dict(args)
    batch_first = a.pop("batch_first", False)
    q = a["query"]
    if batch_first and q.ndim == 3:
        for name in ("query", "key", "value"):
            a[name] = np.swapaxes(a[name], 0, 1)
    if a.get("is_causal"):
        if a.get("attn_mask") is None:
            L = q.shape[1] if (batch_first and q.ndim == 3) else q.shape[0]
            a["attn_mask"] = np.triu(np.ones((L, src_len(args)), bool), 1)
        a["is_causal"] = False  # torch uses attn_mask as given with need_weights

    def t(x):
        if not isinstance(x, np.ndarray):
            return x
        return torch.from_numpy(x.copy() if x.dtype == np.bool_ else x.astype(np.float64))

    a = {k: t(v) for k, v in a.items()}
    with torch.no_grad(), quiet_torch():
        out, w = torch.nn.functional.multi_head_attention_forward(**a)
    out = out.numpy()
    if batch_first and q.ndim == 3:
        out = np.swapaxes(out, 0, 1)
    return out, None if w is None else w.numpy()


def check_torch(torch, args, dead_rows=None):
    """attnx vs torch (float64); dead_rows (N, L) bool: rows torch gives NaN for."""
    dtype = args["query"].dtype
    out, w = mha(**args)
    t_out, t_w = torch_mha64(torch, args)
    if dead_rows is None:
        assert_close(out, t_out, dtype, atol=output_atol(args, t_out, dtype))
        if w is not None:
            assert_close(w, t_w, dtype)
        return out, w
    ours, theirs = seq_rows(out, args), seq_rows(t_out, args)
    live = theirs[~dead_rows]
    assert_close(ours[~dead_rows], live, dtype, atol=output_atol(args, live, dtype))
    if w is not None:
        w3 = w if w.ndim == 3 else w[None]
        tw3 = t_w if t_w.ndim == 3 else t_w[None]
        assert_close(w3[~dead_rows], tw3[~dead_rows], dtype)
    return out, w


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("add_zero_attn", [False, True], ids=["", "zero_attn"])
@pytest.mark.parametrize("bias_kv", [False, True], ids=["", "bias_kv"])
@pytest.mark.parametrize("kpm", [None, "bool", "float"], ids=["kpm_none", "kpm_bool", "kpm_float"])
@pytest.mark.parametrize("mask,rank", MASK_CASES, ids=[f"{m}{r}" for m, r in MASK_CASES])
def test_torch_masks_bias_kv_zero_attn(torch, rng, mask, rank, kpm, bias_kv, add_zero_attn, dtype):
    args = mha_args(rng, L=5, S=7, N=2, E=8, H=2, dtype=dtype, bias_kv=bias_kv,
                    add_zero_attn=add_zero_attn)
    add_masks(rng, args, mask, rank, kpm, dtype)
    check_torch(torch, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("average", [True, False], ids=["avg", "per_head"])
@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
def test_torch_weights_layouts(torch, rng, batch_first, need_weights, average, unbatched, dtype):
    args = mha_args(rng, L=6, S=9, N=2, E=12, H=3, dtype=dtype, batch_first=batch_first,
                    need_weights=need_weights, average_attn_weights=average, unbatched=unbatched)
    add_masks(rng, args, "bool", 3, "bool", dtype)
    check_torch(torch, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("which", ["k", "v", "kv"])
@pytest.mark.parametrize("add_zero_attn", [False, True])
def test_torch_static_kv(torch, rng, which, add_zero_attn, dtype):
    H, hd, N = 2, 4, 3
    args = mha_args(rng, L=5, S=6, N=N, E=H * hd, H=H, dtype=dtype, add_zero_attn=add_zero_attn)
    S2 = 6 if which != "kv" else 9
    if "k" in which:
        args["static_k"] = randn(rng, (N * H, S2, hd), dtype)
    if "v" in which:
        args["static_v"] = randn(rng, (N * H, S2, hd), dtype)
    # (torch checks a 2-D attn_mask against the length of `key`, not of static_k)
    add_masks(rng, args, "float" if S2 == 6 else None, 2, "bool", dtype)
    check_torch(torch, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kdim,vdim", [(5, 7), (8, 3), (12, 8)])
@pytest.mark.parametrize("bias_kv", [False, True])
def test_torch_kdim_vdim(torch, rng, kdim, vdim, bias_kv, dtype):
    args = mha_args(rng, L=5, S=7, N=2, E=8, H=4, kdim=kdim, vdim=vdim, dtype=dtype,
                    bias_kv=bias_kv, add_zero_attn=True)
    add_masks(rng, args, "bool", 2, "float", dtype)
    check_torch(torch, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("E,H", [(1, 1), (34, 2), (160, 2), (128, 1)])
@pytest.mark.parametrize("L,S", [(31, 129), (129, 31), (33, 300)])
def test_torch_sizes(torch, rng, E, H, L, S, dtype):
    args = mha_args(rng, L=L, S=S, N=2, E=E, H=H, dtype=dtype)
    check_torch(torch, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("L,S", [(5, 5), (4, 9), (9, 4), (40, 140)])
def test_torch_is_causal(torch, rng, L, S, need_weights, dtype):
    args = mha_args(rng, L=L, S=S, N=2, E=8, H=2, dtype=dtype, is_causal=True,
                    need_weights=need_weights, bias_kv=True)
    check_torch(torch, args)
    add_masks(rng, args, "bool", 2, "bool", dtype)  # is_causal with attn_mask: mask as given
    check_torch(torch, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("how", ["kpm", "attn"])
def test_torch_fully_masked_rows(torch, rng, how, dtype):
    L, S, N = 6, 9, 2
    args = mha_args(rng, L=L, S=S, N=N, dtype=dtype)
    dead = np.zeros((N, L), bool)
    if how == "kpm":
        kpm = np.zeros((N, S), bool)
        kpm[1] = True
        args["key_padding_mask"] = kpm
        dead[1] = True
    else:
        am = mha_mask(rng, "bool", (L, S))
        am[[0, 4]] = True
        args["attn_mask"] = am
        dead[:, [0, 4]] = True
    out, w = check_torch(torch, args, dead_rows=dead)
    rows = seq_rows(out, args)
    np.testing.assert_array_equal(rows[dead], np.broadcast_to(args["out_proj_bias"], rows[dead].shape))
    np.testing.assert_array_equal(w[dead], 0.0)


# ---------------------------------------------------------------------------------------------
# Random combinations (hypothesis)
# ---------------------------------------------------------------------------------------------

@hypothesis.settings(max_examples=80, deadline=None, derandomize=True, database=None)
@hypothesis.given(
    seed=st.integers(0, 2**31),
    N=st.integers(1, 3),
    H=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([1, 3, 8]),
    L=st.sampled_from([1, 2, 31, 33, 40]),
    S=st.sampled_from([1, 5, 33, 130]),
    kdim=st.sampled_from([None, 5]),
    attn=st.sampled_from([None, "bool", "float"]),
    attn_rank=st.sampled_from([2, 3]),
    kpm=st.sampled_from([None, "bool", "float"]),
    bias_kv=st.booleans(),
    add_zero_attn=st.booleans(),
    static=st.booleans(),
    batch_first=st.booleans(),
    unbatched=st.booleans(),
    need_weights=st.booleans(),
    average=st.booleans(),
    is_causal=st.booleans(),
    in_bias=st.booleans(),
    out_bias=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_random_combinations(seed, N, H, head_dim, L, S, kdim, attn, attn_rank, kpm, bias_kv,
                             add_zero_attn, static, batch_first, unbatched, need_weights, average,
                             is_causal, in_bias, out_bias, dtype):
    rng = np.random.default_rng(seed)
    E = H * head_dim
    if static:
        bias_kv = False
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, kdim=kdim, vdim=kdim,
                    in_bias=in_bias, out_bias=out_bias, bias_kv=bias_kv,
                    add_zero_attn=add_zero_attn, batch_first=batch_first, unbatched=unbatched,
                    need_weights=need_weights, average_attn_weights=average, is_causal=is_causal)
    if static:
        n = 1 if unbatched else N
        args["static_k"] = randn(rng, (n * H, S + 2, head_dim), dtype)
        args["static_v"] = randn(rng, (n * H, S + 2, head_dim), dtype)
    add_masks(rng, args, attn, attn_rank, kpm, dtype, keep_one=False)
    with np.errstate(all="ignore"):
        out, w = check(args)
    assert np.isfinite(out).all()
    if need_weights:
        assert np.isfinite(w).all()


@pytest.mark.torch
@pytest.mark.parametrize("batch_first", [False, True])
def test_output_projection_may_change_the_width(rng, batch_first):
    # torch's functional accepts out_proj_weight of shape (E_out, E).
    torch = pytest.importorskip("torch")
    E, H, E_out, L, S, N = 8, 2, 5, 4, 6, 3
    x = rng.standard_normal((L, N, E))
    kv = rng.standard_normal((S, N, E))
    w, b = rng.standard_normal((3 * E, E)), rng.standard_normal(3 * E)
    wo, bo = rng.standard_normal((E_out, E)), rng.standard_normal(E_out)
    args = (E, H, w, b, None, None, False, 0.0, wo, bo)
    got, weights = attnx.multi_head_attention_forward(
        *((x, kv, kv) if not batch_first else (x.transpose(1, 0, 2), kv.transpose(1, 0, 2), kv.transpose(1, 0, 2))),
        *args, batch_first=batch_first)
    T = torch.from_numpy
    want, want_w = torch.nn.functional.multi_head_attention_forward(
        T(x), T(kv), T(kv), E, H, T(w), T(b), None, None, False, 0.0, T(wo), T(bo), training=False)
    want = want.numpy().transpose(1, 0, 2) if batch_first else want.numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights, want_w.numpy(), rtol=1e-12, atol=1e-12)
