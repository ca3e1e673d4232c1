"""precision="bfloat16": every entry point and module against the bfloat16 reference and float64.

With ``precision="bfloat16"`` the operands of every product are rounded to bfloat16 and the sums
are float32. Each result is checked twice: against ``attnx.reference`` with the same rounding
(``precision="bfloat16"``, a tight bound: the kernels sum in float32, in their own order, with an
online softmax) and against the float64 reference without rounding (the documented bound of
docs/api.md, "Precision"). ``precision="float32"`` must give the default's bits, and the
arguments that cannot work (unknown names, float64 computations) raise ValueError.
"""

from __future__ import annotations

import pathlib
import pickle
import sys
import textwrap

import numpy as np
import pytest

import attnx
from attnx import _core
from conftest import ISAS, assert_identical, mha_args, num_threads, randn, reference, run_under_isa

# Bounds of the max abs error on inputs of unit scale (N(0, 1) queries, keys and values and
# inputs; weights of scale 1/sqrt(fan_in)), measured on this file's cases (docs/api.md,
# "Precision", gives the figures): about 1.3x the largest error seen.
# Against the reference with the same rounding: float32 sums in another order, the online
# softmax's probabilities rounded against a running maximum, and where a float32 intermediate
# lies near a tie, its rounding to the other neighbour. "weights": multi-head attention that
# returns its weights, whose path rounds the normalized probabilities (an error of up to a
# bfloat16 ulp of each probability, times the values).
REF_BOUND = {"sdpa": 3e-3, "mha": 2e-3, "weights": 1.6e-2, "layer": 1e-3}
# Against float64 without rounding: the rounding of the operands itself.
F64_BOUND = {"sdpa": 2e-2, "mha": 1.6e-2, "weights": 1.6e-2, "layer": 8e-3}

BF16 = "bfloat16"


def _bf16_storage():
    return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


def max_error(got, want) -> float:
    """max |got - want| over the entries, NaN where either has NaN at different places."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN at different places"
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite])
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0))


def assert_bounds(got, bf16_ref, f64_ref, kind, what=""):
    """`got` within the tight bound of the bfloat16 reference and the documented bound of float64."""
    near, far = max_error(got, bf16_ref), max_error(got, f64_ref)
    assert near <= REF_BOUND[kind], f"{what}: {near:.3g} from the bfloat16 reference > {REF_BOUND[kind]}"
    assert far <= F64_BOUND[kind], f"{what}: {far:.3g} from the float64 reference > {F64_BOUND[kind]}"
    return near, far


def f32(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The bfloat16 rounding of the reference
# ---------------------------------------------------------------------------------------------


def test_reference_rounding_is_round_to_nearest_even():
    bf16 = _bf16_storage()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-35, 35, 200_000)).astype(np.float32)
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9], np.float32)
    x = np.concatenate([x, special])
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    got = reference._round_bfloat16(x)
    want = x.astype(bf16).astype(np.float32)
    assert_identical(got[normal], want[normal])
    # Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (odd): to 1; 1 + 3 * 2^-8 to 1 + 2^-6.
    assert got[-3] == 1.0 and got[-2] == 1 + 2**-6 and got[-1] == 1.0
    # Subnormals become zeros of their sign, NaN a quiet NaN of its sign.
    tiny = reference._round_bfloat16(np.array([1e-40, -1e-40, np.nan, -np.nan], np.float32))
    assert tiny[0] == 0 and not np.signbit(tiny[0]) and tiny[1] == 0 and np.signbit(tiny[1])
    assert np.isnan(tiny[2:]).all() and np.signbit(tiny[3]) and not np.signbit(tiny[2])


def test_reference_leaves_the_input_unchanged():
    x = np.linspace(-3, 3, 101, dtype=np.float32)
    before = x.copy()
    reference._round_bfloat16(x)
    assert_identical(x, before)


# ---------------------------------------------------------------------------------------------
# The argument: names, float64, the default's bits
# ---------------------------------------------------------------------------------------------


def _every_call(precision, dtype=np.float32):
    """Each entry point and module called with `precision` on small inputs of `dtype`."""
    rng = np.random.default_rng(1)
    q = f32(rng, (1, 2, 3, 8)).astype(dtype)
    x = f32(rng, (3, 1, 8)).astype(dtype)
    args = mha_args(rng, L=3, S=3, N=1, E=8, H=2, dtype=dtype)
    mha = attnx.MultiheadAttention(8, 2, dtype=dtype, seed=0)
    enc = attnx.TransformerEncoderLayer(8, 2, 16, 0.0, dtype=dtype, seed=0)
    dec = attnx.TransformerDecoderLayer(8, 2, 16, 0.0, dtype=dtype, seed=0)
    return {
        "sdpa": lambda: attnx.scaled_dot_product_attention(q, q, q, precision=precision),
        "mha_forward": lambda: attnx.multi_head_attention_forward(**args, precision=precision),
        "cached_attention": lambda: attnx.cached_attention(
            q, attnx.KVCache(1, 2, 8, 8, dtype), q, q, precision=precision),
        "mha_step": lambda: attnx.multi_head_attention_step(
            x, mha.new_cache(1, 8), 2, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj_weight,
            mha.out_proj_bias, precision=precision),
        "MultiheadAttention": lambda: mha(x, x, x, precision=precision),
        "MultiheadAttention.step": lambda: mha.step(x, mha.new_cache(1, 8), precision=precision),
        "TransformerEncoderLayer": lambda: enc(x, precision=precision),
        "TransformerDecoderLayer": lambda: dec(x, x, precision=precision),
        "TransformerEncoder": lambda: attnx.TransformerEncoder(enc, 2)(x, precision=precision),
        "TransformerDecoder": lambda: attnx.TransformerDecoder(dec, 2)(x, x, precision=precision),
        "TransformerDecoder.step": lambda: attnx.TransformerDecoder(dec, 1).step(
            x, x, attnx.TransformerDecoder(dec, 1).new_cache(1, 8), precision=precision),
        "Transformer": lambda: attnx.Transformer(8, 2, 1, 1, 16, 0.0, dtype=dtype, seed=0)(x, x, precision=precision),
    }


CALLS = list(_every_call(None))


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("bad", ["bf16", "float16", "BFLOAT16", 1, True, np.float32, ""])
def test_unknown_precision_raises_naming_the_choices(name, bad):
    # Attention over a cache also takes "int8".
    choices = "None, 'float32', 'bfloat16' or 'int8'" if name in ("cached_attention", "paged_attention") \
        else "None, 'float32' or 'bfloat16'"
    with pytest.raises(ValueError, match=rf"precision must be {choices}, got"):
        _every_call(bad)[name]()


@pytest.mark.parametrize("name", CALLS)
def test_bfloat16_with_float64_raises(name):
    with pytest.raises(ValueError, match=r"precision='bfloat16' computes in float32.*float64"):
        _every_call(BF16, np.float64)[name]()


def _results(result) -> list:
    """A call's arrays: the result, or those of its tuple (None left out)."""
    return [a for a in (result if isinstance(result, tuple) else (result,)) if a is not None]


@pytest.mark.parametrize("name", CALLS)
def test_float32_precision_gives_the_defaults_bits(name):
    default, explicit = _results(_every_call(None)[name]()), _results(_every_call("float32")[name]())
    assert len(default) == len(explicit)
    for a, b in zip(default, explicit):
        assert_identical(a, b, name)


@pytest.mark.parametrize("name", CALLS)
def test_bfloat16_differs_from_float32(name):
    # The rounding is applied (a test that could not tell would pass a kernel that ignores it).
    default, rounded = _results(_every_call(None)[name]())[0], _results(_every_call(BF16)[name]())[0]
    assert rounded.dtype == default.dtype and rounded.shape == default.shape
    assert not np.array_equal(rounded, default), name


@pytest.mark.parametrize(
    "make",
    [
        lambda: attnx.MultiheadAttention(8, 2, dtype=np.float64, precision=BF16),
        lambda: attnx.TransformerEncoderLayer(8, 2, 16, dtype=np.float64, precision=BF16),
        lambda: attnx.TransformerDecoderLayer(8, 2, 16, dtype=np.float64, precision=BF16),
        lambda: attnx.Transformer(8, 2, 1, 1, 16, dtype=np.float64, precision=BF16),
        lambda: attnx.TransformerEncoder(attnx.TransformerEncoderLayer(8, 2, 16, dtype=np.float64), 2,
                                         precision=BF16),
    ],
)
def test_float64_modules_refuse_bfloat16_at_construction(make):
    with pytest.raises(ValueError, match=r"module's dtype is float64.*dtype=np.float32"):
        make()


def test_constructor_refuses_unknown_precision():
    with pytest.raises(ValueError, match="precision must be"):
        attnx.MultiheadAttention(8, 2, precision="half")
    with pytest.raises(ValueError, match="precision must be"):
        attnx.TransformerEncoderLayer(8, 2, 16, precision="fp32")
    m = attnx.MultiheadAttention(8, 2)
    with pytest.raises(ValueError, match="precision must be"):
        m.precision = "bf16"
    assert m.precision == "float32"


def test_a_half_precision_query_computes_in_float32_with_bfloat16():
    q = np.ones((1, 2, 3, 8), np.float16)
    assert attnx.scaled_dot_product_attention(q, q, q, precision=BF16).dtype == np.float16


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------


def _sdpa_both(q, k, v, **kw):
    """attnx's bfloat16 result, the bfloat16 reference's and the float64 reference's."""
    got = attnx.scaled_dot_product_attention(q, k, v, precision=BF16, **kw)
    want = reference.scaled_dot_product_attention(q, k, v, precision=BF16, **kw)
    exact = reference.scaled_dot_product_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), **{
        name: (np.asarray(x, np.float64) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x)
        for name, x in kw.items()})
    return got, want, exact


@pytest.mark.parametrize("E", [16, 64, 80])
@pytest.mark.parametrize("L,S", [(1, 1), (1, 300), (7, 7), (7, 64), (64, 64), (64, 300), (300, 300), (300, 7)])
def test_sdpa_within_the_bounds(L, S, E):
    rng = np.random.default_rng(L * 1000 + S * 10 + E)
    q, k, v = f32(rng, (2, 4, L, E)), f32(rng, (2, 4, S, E)), f32(rng, (2, 4, S, E))
    got, want, exact = _sdpa_both(q, k, v)
    assert got.dtype == np.float32
    assert_bounds(got, want, exact, "sdpa", f"L{L} S{S} E{E}")


@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True),
        dict(is_causal="bottom_right"),
        dict(window=(16, 0), is_causal="bottom_right"),
        dict(window=(5, 9)),
        dict(softcap=3.0),
        dict(softcap=2.0, is_causal=True),
        dict(scale=0.3),
        dict(mask="bool"),
        dict(mask="float"),
        dict(mask="rows"),  # some rows have no open key: zeros
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_sdpa_masks_windows_softcap(kw):
    rng = np.random.default_rng(7)
    L, S, E = 70, 150, 64
    q, k, v = f32(rng, (2, 3, L, E)), f32(rng, (2, 3, S, E)), f32(rng, (2, 3, S, E))
    kw = dict(kw)
    kind = kw.pop("mask", None)
    if kind == "bool":
        kw["attn_mask"] = rng.random((L, S)) < 0.7
    elif kind == "float":
        kw["attn_mask"] = np.where(rng.random((1, 3, L, S)) < 0.2, -np.inf, rng.standard_normal((1, 3, L, S))).astype(np.float32)
    elif kind == "rows":
        mask = rng.random((L, S)) < 0.5
        mask[::5] = False
        kw["attn_mask"] = mask
    got, want, exact = _sdpa_both(q, k, v, **kw)
    assert_bounds(got, want, exact, "sdpa", str(kw.keys()))
    if kind == "rows":
        assert not got[:, :, ::5].any()


def test_sdpa_grouped_query_attention():
    rng = np.random.default_rng(3)
    q, k, v = f32(rng, (2, 8, 33, 64)), f32(rng, (2, 2, 129, 64)), f32(rng, (2, 2, 129, 48))
    got, want, exact = _sdpa_both(q, k, v, enable_gqa=True, is_causal="bottom_right")
    assert_bounds(got, want, exact, "sdpa")


@pytest.mark.parametrize("stage", ["qk", "softcapped", "masked", "softmax"])
def test_sdpa_return_scores(stage):
    rng = np.random.default_rng(4)
    q, k, v = f32(rng, (1, 2, 20, 32)), f32(rng, (1, 2, 40, 32)), f32(rng, (1, 2, 40, 32))
    kw = dict(is_causal="bottom_right", softcap=4.0, return_scores=stage)
    (out, scores), (want_out, want_scores), (exact_out, exact_scores) = _sdpa_both(q, k, v, **kw)
    assert_bounds(out, want_out, exact_out, "sdpa")
    # The scores are those of the rounded operands: near the reference's of the same rounding.
    scale = 1.0 if stage == "softmax" else float(np.abs(exact_scores[np.isfinite(exact_scores)]).max())
    assert max_error(scores, want_scores) <= 1e-5 * scale + REF_BOUND["sdpa"] * (stage == "softmax")
    # And the output is the same as without them.
    assert_identical(out, attnx.scaled_dot_product_attention(q, k, v, precision=BF16, is_causal="bottom_right",
                                                             softcap=4.0))


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_sdpa_half_precision_inputs(storage):
    dtype = np.dtype(np.float16) if storage == "float16" else _bf16_storage()
    rng = np.random.default_rng(5)
    q, k, v = (f32(rng, (2, 4, n, 64)).astype(dtype) for n in (17, 200, 200))
    got, want, exact = _sdpa_both(q, k, v, is_causal="bottom_right")
    assert got.dtype == dtype
    # The result is rounded to its dtype: half an ulp of it more.
    ulp = 2.0**-11 if storage == "float16" else 2.0**-8
    assert max_error(got, want) <= REF_BOUND["sdpa"] + ulp
    assert max_error(got, exact) <= F64_BOUND["sdpa"] + ulp
    # float32 queries with half-precision keys and values, read in place
    got, want, exact = _sdpa_both(q.astype(np.float32), k, v)
    assert_bounds(got, want, exact, "sdpa")


def test_sdpa_bfloat16_storage_inputs_are_not_rounded_again():
    # Values that are bfloat16 already: the rounding changes nothing, so a float32 call on them
    # and a bfloat16-precision call differ only by the rounding of the scaled queries and of
    # the probabilities; with scale 1 and one key, the probability is 1 (exact).
    rng = np.random.default_rng(6)
    q = reference._round_bfloat16(f32(rng, (1, 1, 4, 16)))
    k = reference._round_bfloat16(f32(rng, (1, 1, 1, 16)))
    v = reference._round_bfloat16(f32(rng, (1, 1, 1, 16)))
    got = attnx.scaled_dot_product_attention(q, k, v, scale=1.0, precision=BF16)
    assert_identical(got, np.broadcast_to(v, got.shape).astype(np.float32))


def test_sdpa_nan_reaches_only_its_rows():
    rng = np.random.default_rng(8)
    q, k, v = f32(rng, (1, 1, 8, 16)), f32(rng, (1, 1, 8, 16)), f32(rng, (1, 1, 8, 16))
    v[0, 0, 5, 3] = np.nan
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, precision=BF16)
    assert not np.isnan(got[0, 0, :5]).any() and np.isnan(got[0, 0, 5:]).any()


def test_sdpa_large_logits_do_not_overflow():
    rng = np.random.default_rng(9)
    q, k, v = f32(rng, (1, 2, 16, 32), 300.0), f32(rng, (1, 2, 16, 32), 300.0), f32(rng, (1, 2, 16, 32))
    got = attnx.scaled_dot_product_attention(q, k, v, precision=BF16)
    assert np.isfinite(got).all()


# ---------------------------------------------------------------------------------------------
# Multi-head attention: the function, the module, decoding
# ---------------------------------------------------------------------------------------------


def _mha_both(args):
    got = attnx.multi_head_attention_forward(**args, precision=BF16)
    want = reference.multi_head_attention_forward(**args, precision=BF16)
    exact = reference.multi_head_attention_forward(
        **{k: (x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x) for k, x in args.items()})
    return got, want, exact


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(is_causal=True, batch_first=True),
        dict(padding=True),
        dict(mask="bool"),
        dict(mask="float3d"),
        dict(bias_kv=True, add_zero_attn=True),
        dict(kdim=24, vdim=40),
        dict(average_attn_weights=False),
        dict(unbatched=True),
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "plain",
)
def test_mha_forward_within_the_bounds(kw):
    rng = np.random.default_rng(11)
    kw = dict(kw)
    padding, mask = kw.pop("padding", False), kw.pop("mask", None)
    N, L, S, E, H = 2, 37, 70, 64, 4
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=np.float32, **kw)
    if padding:
        kpm = rng.random((N, S)) < 0.3
        kpm[:, 0] = False
        args["key_padding_mask"] = kpm
    if mask == "bool":
        args["attn_mask"] = rng.random((L, S)) < 0.3
    elif mask == "float3d":
        args["attn_mask"] = rng.standard_normal((N * H, L, S)).astype(np.float32)
    (out, weights), (want, want_w), (exact, exact_w) = _mha_both(args)
    assert out.dtype == np.float32
    assert_bounds(out, want, exact, "weights", str(kw))
    # Without the weights: the path of the attention's tiles, near the reference.
    args["need_weights"] = False
    (out, none), (want, _), (exact, _) = _mha_both(args)
    assert none is None
    assert_bounds(out, want, exact, "mha", str(kw))
    # The weights are the float32 probabilities of the rounded scores.
    assert max_error(weights, want_w) <= REF_BOUND["sdpa"]
    assert max_error(weights, exact_w) <= F64_BOUND["sdpa"]


def test_mha_forward_half_precision_query():
    rng = np.random.default_rng(12)
    args = mha_args(rng, L=9, S=9, N=2, E=32, H=4, dtype=np.float16)
    out, weights = attnx.multi_head_attention_forward(**args, precision=BF16)
    want, _ = reference.multi_head_attention_forward(**args, precision=BF16)
    assert out.dtype == np.float16 and weights.dtype == np.float16
    assert max_error(out, want) <= REF_BOUND["weights"] + 2.0**-10 * np.abs(want).max()


def test_module_constructor_precision_is_used_and_overridden_per_call():
    rng = np.random.default_rng(13)
    x = f32(rng, (2, 11, 32))
    plain = attnx.MultiheadAttention(32, 4, batch_first=True, seed=0).eval()
    rounded = attnx.MultiheadAttention(32, 4, batch_first=True, seed=0, precision=BF16).eval()
    assert rounded.precision == BF16 and plain.precision == "float32"
    a32, _ = plain(x, x, x)
    abf, wbf = rounded(x, x, x)
    assert not np.array_equal(a32, abf)
    assert_identical(plain(x, x, x, precision=BF16)[0], abf)
    assert_identical(rounded(x, x, x, precision="float32")[0], a32)
    assert max_error(rounded.forward(x, x, x, need_weights=False)[0], abf) <= REF_BOUND["weights"]
    params = {k: v for k, v in rounded.state_dict().items()}
    want, _ = reference.multi_head_attention_forward(
        x, x, x, 32, 4, params["in_proj_weight"], params["in_proj_bias"], None, None, False, 0.0,
        params["out_proj.weight"], params["out_proj.bias"], batch_first=True, precision=BF16)
    assert max_error(abf, want) <= REF_BOUND["weights"]
    # The attribute can be set, and is what calls use.
    plain.precision = BF16
    assert_identical(plain(x, x, x)[0], abf)
    plain.precision = None
    assert plain.precision == "float32"
    assert_identical(plain(x, x, x)[0], a32)


@pytest.mark.parametrize("E, H", [(64, 4), (48, 4), (256, 8)])
def test_stacked_weights_project_in_one_product_with_the_bits_of_three(E, H):
    # Weights stacked as torch's in_proj_weight: self-attention projects q, k and v in one
    # product, the module from one packing of the stacked matrix, of which its w_q, w_k and
    # w_v are views where each begins a panel (not E 48 on the pairs route, whose panels are
    # 64 wide): the bits of three products over separate weights, for self- and
    # cross-attention alike.
    rng = np.random.default_rng(E)
    x, memory = f32(rng, (9, 2, E)), f32(rng, (13, 2, E))
    m = attnx.MultiheadAttention(E, H, seed=0, precision=BF16).eval()
    params = m.state_dict()
    w, b = params["in_proj_weight"], params["in_proj_bias"]
    separate = dict(use_separate_proj_weight=True, q_proj_weight=w[:E].copy(),
                    k_proj_weight=w[E:2 * E].copy(), v_proj_weight=w[2 * E:].copy())
    for query, key in ((x, x), (x, memory)):
        common = (query, key, key, E, H)
        tail = (None, None, False, 0.0, params["out_proj.weight"], params["out_proj.bias"])
        three, _ = attnx.multi_head_attention_forward(*common, None, b, *tail, **separate,
                                                      precision=BF16)
        one, _ = attnx.multi_head_attention_forward(*common, w, b, *tail, precision=BF16)
        assert_identical(one, three)
        assert_identical(m(query, key, key)[0], three)


def test_module_precision_survives_pickle_and_is_not_state():
    m = attnx.MultiheadAttention(16, 4, seed=0, precision=BF16).eval()
    x = f32(np.random.default_rng(14), (5, 2, 16))
    copy = pickle.loads(pickle.dumps(m))
    assert copy.precision == BF16
    assert_identical(copy(x, x, x)[0], m(x, x, x)[0])
    assert all("precision" not in key for key in m.state_dict())
    assert "precision='bfloat16'" in repr(m) and "precision" not in repr(attnx.MultiheadAttention(16, 4))
    other = attnx.MultiheadAttention(16, 4, seed=1)
    other.load_state_dict(m.state_dict())
    assert other.precision == "float32"


def test_module_repacks_assigned_and_loaded_parameters():
    rng = np.random.default_rng(15)
    m = attnx.MultiheadAttention(16, 4, seed=0, precision=BF16).eval()
    x = f32(rng, (5, 2, 16))
    first = m(x, x, x)[0]
    # In place: the bfloat16 copy of the weights is the one packed at the first call.
    w = m.in_proj_weight.copy()
    m.in_proj_weight[...] *= 2
    assert_identical(m(x, x, x)[0], first)
    assert not np.array_equal(m(x, x, x, precision="float32")[0], attnx.MultiheadAttention(16, 4, seed=0)(x, x, x)[0])
    # Assigned: packed again.
    m.in_proj_weight = m.in_proj_weight.copy()
    doubled = m(x, x, x)[0]
    assert not np.array_equal(doubled, first)
    # Loaded: packed again, back to the first values.
    m.load_state_dict({**m.state_dict(), "in_proj_weight": w})
    assert_identical(m(x, x, x)[0], first)
    m.out_proj.weight = m.out_proj_weight * 0
    assert_identical(m(x, x, x)[0], np.broadcast_to(m.out_proj_bias, first.shape).astype(np.float32))


def test_from_torch_takes_a_precision():
    torch = pytest.importorskip("torch")
    module = torch.nn.MultiheadAttention(16, 4).eval()
    copy = attnx.MultiheadAttention.from_torch(module, precision=BF16)
    assert copy.precision == BF16
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32).eval()
    assert attnx.TransformerEncoderLayer.from_torch(layer, precision=BF16).precision == BF16
    with pytest.raises(ValueError, match="float64"):
        attnx.MultiheadAttention.from_torch(module.double(), precision=BF16)


def _cache_dtype(name):
    """A cache dtype by name: ml_dtypes' bfloat16, or NumPy's (int8 where KVCache has it)."""
    if name == "bfloat16":
        return _bf16_storage()
    if name == "int8":
        try:
            attnx.KVCache(1, 1, 1, 1, np.int8)
        except (TypeError, ValueError):
            pytest.skip("this attnx's KVCache has no int8 storage")
    return np.dtype(name)


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_decoding_steps_equal_the_full_forward(cache_dtype):
    dtype = _cache_dtype(cache_dtype)
    rng = np.random.default_rng(16)
    m = attnx.MultiheadAttention(32, 4, batch_first=True, seed=0, precision=BF16).eval()
    x = f32(rng, (2, 9, 32))
    cache = m.new_cache(2, 16, dtype=dtype)
    steps = np.concatenate([m.step(x[:, :5], cache), m.step(x[:, 5:8], cache), m.step(x[:, 8:], cache)], axis=1)
    full, _ = m(x, x, x, is_causal=True, need_weights=False)
    params = m.state_dict()
    want, _ = reference.multi_head_attention_forward(
        x, x, x, 32, 4, params["in_proj_weight"], params["in_proj_bias"], None, None, False, 0.0,
        params["out_proj.weight"], params["out_proj.bias"], batch_first=True, is_causal=True, precision=BF16)
    # The cache stores the projected keys and values in its dtype: one more rounding for halves,
    # and int8's quantization to 1/127 of each row's largest value.
    extra = {"float32": 0.0, "float16": 2e-3, "bfloat16": 2e-3, "int8": 1e-2}[cache_dtype]
    assert max_error(steps, want) <= REF_BOUND["mha"] + extra
    assert max_error(full, want) <= REF_BOUND["mha"]
    # The functional step, with the module's parameters
    cache2 = m.new_cache(2, 16, dtype=dtype)
    functional = attnx.multi_head_attention_step(
        x, cache2, 4, m.in_proj_weight, m.in_proj_bias, m.out_proj_weight, m.out_proj_bias, batch_first=True,
        precision=BF16)
    assert max_error(functional, want) <= REF_BOUND["mha"] + extra
    # A module of float32 precision, asked per step
    plain = attnx.MultiheadAttention(32, 4, batch_first=True, seed=0).eval()
    cache3 = plain.new_cache(2, 16, dtype=dtype)
    assert_identical(plain.step(x, cache3, precision=BF16), functional)


def _stored(cache, array, scales):
    """A cache's keys or values as its attention reads them: an int8 cache's scaled by its rows'."""
    if np.dtype(cache.dtype) != np.int8:
        return array
    return getattr(cache, scales)[..., None] * array.astype(np.float32)


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_cached_attention_within_the_bounds(cache_dtype):
    dtype = _cache_dtype(cache_dtype)
    rng = np.random.default_rng(17)
    B, Hk, Hq, E, T = 2, 2, 8, 64, 3
    cache = attnx.KVCache(B, Hk, 600, E, dtype)
    k, v = f32(rng, (B, Hk, 520, E)), f32(rng, (B, Hk, 520, E))
    cache.append(k, v, lengths=[520, 300])
    q = f32(rng, (B, Hq, T, E))
    got = attnx.cached_attention(q, cache, lengths=[3, 2], window=(400, None), softcap=5.0, precision=BF16)
    key, value, lengths = cache.storage()
    key, value = _stored(cache, key, "key_scales"), _stored(cache, value, "value_scales")
    args = dict(key_lengths=lengths, query_lengths=[3, 2], window=(400, None), softcap=5.0)
    want = reference.cached_attention(q, key, value, **args, precision=BF16)
    exact = reference.cached_attention(q.astype(np.float64), np.asarray(key, np.float64),
                                       np.asarray(value, np.float64), **args)
    assert_bounds(got, want, exact, "sdpa")
    assert not got[1, :, 2].any()


# Decoding over a cache of unit-normal keys and values: the largest error against float64 of the
# unquantized float32 data (docs/api.md, "Precision": about 1.5x the largest measured on this
# case), per cache dtype and precision. The cache's own rounding dominates the 16-bit and int8
# rows; bfloat16 products add the rounding of the queries and the probabilities (and of a
# float32 cache's elements).
DECODE_F64_BOUND = {
    ("float32", None): 1e-6, ("float16", None): 2e-4, ("bfloat16", None): 1.2e-3, ("int8", None): 6e-3,
    ("float32", BF16): 2e-3, ("float16", BF16): 2e-3, ("bfloat16", BF16): 2e-3, ("int8", BF16): 6e-3,
}
# bfloat16 products against the default precision on the same cache.
DECODE_BF16_FROM_DEFAULT = 2e-3


@pytest.mark.parametrize("precision", [None, BF16])
@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("paged", [False, True])
def test_decoding_error_against_float64_per_cache_and_precision(cache_dtype, precision, paged):
    dtype = _cache_dtype(cache_dtype)
    rng = np.random.default_rng(19)
    B, Hk, Hq, E, S = 2, 2, 8, 64, 300
    k, v = f32(rng, (B, Hk, S, E)), f32(rng, (B, Hk, S, E))
    q = f32(rng, (B, Hq, 1, E))
    lengths = [S, 211]
    if paged:
        cache = attnx.PagedKVCache(2 * S // 16 + 2, 16, Hk, E, dtype)
        seqs = [cache.add_sequence() for _ in range(B)]
        for b, n in enumerate(lengths):  # the prompt, then one decoding step's query
            attnx.paged_attention(np.zeros((n - 1, Hq, E), np.float32), cache, [seqs[b]], [n - 1],
                                  k[b, :, :n - 1].transpose(1, 0, 2), v[b, :, :n - 1].transpose(1, 0, 2))
        step_k = np.stack([k[b, :, n - 1] for b, n in enumerate(lengths)])
        step_v = np.stack([v[b, :, n - 1] for b, n in enumerate(lengths)])
        got = attnx.paged_attention(q[:, :, 0], cache, seqs, [1, 1], step_k, step_v, precision=precision)
        got = got[:, :, None]
    else:
        cache = attnx.KVCache(B, Hk, S, E, dtype)
        cache.append(k, v, lengths=lengths)
        got = attnx.cached_attention(q, cache, precision=precision)
    exact = reference.cached_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), lengths)
    error = max_error(got, exact)
    assert error <= DECODE_F64_BOUND[cache_dtype, precision], error
    if precision is not None and not paged:  # the rounding of the operands, from the default's
        assert max_error(got, attnx.cached_attention(q, cache)) <= DECODE_BF16_FROM_DEFAULT


@pytest.mark.parametrize("E", [20, 40, 64, 80, 120, 128])
@pytest.mark.parametrize("keys", [1, 77, 300])
def test_decoding_a_bfloat16_cache_within_the_bounds(E, keys):
    # Head dims that are not whole vectors and odd key counts: on the pairs route (where the
    # probe or ATTNX_BF16_PRODUCTS=pairs chooses vdpbf16ps) the row kernels read the cache as
    # pairs of elements and of keys; on the float route the AVX-512 scores widen each 32
    # elements of a key as their even and odd ones, against queries split the same way, and
    # take the last E % 32 in order (20: none whole, 120: a tail of 16 + 8).
    dtype = _bf16_storage()
    rng = np.random.default_rng(E + keys)
    B, Hk, Hq, T = 2, 2, 8, min(3, keys)
    cache = attnx.KVCache(B, Hk, keys, E, dtype)
    cache.append(f32(rng, (B, Hk, keys, E)), f32(rng, (B, Hk, keys, E)))
    q = f32(rng, (B, Hq, T, E))
    got = attnx.cached_attention(q, cache, precision=BF16)
    key, value, lengths = cache.storage()
    key, value = np.asarray(key, np.float32), np.asarray(value, np.float32)
    want = reference.cached_attention(q, key, value, lengths, precision=BF16)
    exact = reference.cached_attention(q.astype(np.float64), key.astype(np.float64), value.astype(np.float64),
                                       lengths)
    assert_bounds(got, want, exact, "sdpa", f"E {E}, {keys} keys")


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_a_decoding_rows_bits_do_not_depend_on_the_rows_beside_it(cache_dtype):
    # Grouped heads go through the row kernels several rows at a time (four, or one by one on
    # the pairs route's bfloat16 cache): a head's bits are the same with any number of others.
    dtype = _cache_dtype(cache_dtype)
    rng = np.random.default_rng(21)
    cache = attnx.KVCache(1, 1, 700, 128, dtype)
    cache.append(f32(rng, (1, 1, 700, 128)), f32(rng, (1, 1, 700, 128)))
    q = f32(rng, (1, 4, 1, 128))
    four = attnx.cached_attention(q, cache, precision=BF16)
    for heads in (1, 2, 3):
        assert_identical(attnx.cached_attention(q[:, :heads], cache, precision=BF16), four[:, :heads])


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_decoding_rounds_a_float32_cache_as_it_reads_it(cache_dtype):
    # One key and scale 1: the probability is 1, exact, so the output is the value row as the
    # products take it. Decoding reads the cache in place and rounds a float32 element to
    # bfloat16 as it loads it; a float16 one is multiplied as stored (its products with bfloat16
    # values are exact in float32), a bfloat16 one is rounded already, and an int8 row is its
    # integers (bfloat16 values) times its float32 scale.
    dtype = _cache_dtype(cache_dtype)
    rng = np.random.default_rng(20)
    cache = attnx.KVCache(1, 1, 4, 16, dtype)
    cache.append(f32(rng, (1, 1, 1, 16)), f32(rng, (1, 1, 1, 16)))
    q = f32(rng, (1, 2, 1, 16))
    got = attnx.cached_attention(q, cache, scale=1.0, precision=BF16)
    _, stored, _ = cache.storage()
    stored = _stored(cache, stored, "value_scales")[:, :, :1].astype(np.float32)
    if cache_dtype in ("float32", "float16"):  # values that rounding changes
        assert not np.array_equal(reference._round_bfloat16(stored), stored)
    if cache_dtype == "float32":
        stored = reference._round_bfloat16(stored)
    assert_identical(got, np.broadcast_to(stored, got.shape).astype(np.float32))


def test_cached_attention_refuses_bfloat16_with_a_float64_cache():
    cache = attnx.KVCache(1, 1, 4, 8, np.float64)
    q = np.ones((1, 1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="the cache is float64"):
        attnx.cached_attention(q, cache, q.astype(np.float64), q.astype(np.float64), precision=BF16)
    assert cache.lengths.tolist() == [0]


# ---------------------------------------------------------------------------------------------
# Transformer layers
# ---------------------------------------------------------------------------------------------


def _layer_bounds(got, layer, *args, keep=None, **kw):
    """`got` within the bounds of the references; `keep`: the positions compared (the others,
    padding, are zeros in attnx and computed by the references)."""
    decoder = hasattr(layer, "multihead_attn")
    run = reference.transformer_decoder_layer if decoder else reference.transformer_encoder_layer
    common = dict(activation=layer.activation, norm_first=layer.norm_first, batch_first=layer.batch_first, **kw)
    params = layer.state_dict()
    want = run(*args, params, layer.self_attn.num_heads, precision=BF16, **common)
    exact = run(*(a.astype(np.float64) for a in args), {k: p.astype(np.float64) for k, p in params.items()},
                layer.self_attn.num_heads, **common)
    if keep is not None:
        assert not got[~keep].any()
        got, want, exact = got[keep], want[keep], exact[keep]
    return assert_bounds(got, want, exact, "layer")


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_within_the_bounds(norm_first, activation):
    rng = np.random.default_rng(18)
    layer = attnx.TransformerEncoderLayer(64, 4, 128, 0.0, activation, batch_first=True, norm_first=norm_first,
                                          seed=0, precision=BF16)
    src = f32(rng, (2, 40, 64))
    padding = np.zeros((2, 40), bool)
    padding[1, 30:] = True
    got = layer(src, src_key_padding_mask=padding, is_causal=True)
    _layer_bounds(got, layer, src, src_key_padding_mask=padding, is_causal=True, keep=~padding)


def test_decoder_layer_within_the_bounds():
    rng = np.random.default_rng(19)
    layer = attnx.TransformerDecoderLayer(64, 4, 128, 0.0, seed=0, precision=BF16)
    tgt, memory = f32(rng, (12, 2, 64)), f32(rng, (30, 2, 64))
    mask = rng.random((12, 30)) < 0.2
    got = layer(tgt, memory, memory_mask=mask, tgt_is_causal=True)
    _layer_bounds(got, layer, tgt, memory, memory_mask=mask, tgt_is_causal=True)


def test_layer_precision_constructor_call_attribute_pickle_repr():
    rng = np.random.default_rng(20)
    x = f32(rng, (7, 2, 32))
    plain = attnx.TransformerEncoderLayer(32, 4, 64, 0.0, seed=0)
    rounded = attnx.TransformerEncoderLayer(32, 4, 64, 0.0, seed=0, precision=BF16)
    assert rounded.self_attn.precision == BF16
    a, b = plain(x), rounded(x)
    assert not np.array_equal(a, b)
    assert_identical(plain(x, precision=BF16), b)
    assert_identical(rounded(x, precision="float32"), a)
    assert "precision='bfloat16'" in repr(rounded) and "precision" not in repr(plain)
    copy = pickle.loads(pickle.dumps(rounded))
    assert copy.precision == BF16 and copy.self_attn.precision == BF16
    assert_identical(copy(x), b)
    assert all("precision" not in key for key in rounded.state_dict())
    plain.precision = BF16
    assert plain.self_attn.precision == BF16
    assert_identical(plain(x), b)


def test_layer_repacks_assigned_and_loaded_parameters():
    rng = np.random.default_rng(25)
    layer = attnx.TransformerEncoderLayer(32, 4, 64, 0.0, seed=0, precision=BF16)
    x = f32(rng, (7, 2, 32))
    first = layer(x)
    state = layer.state_dict()
    layer.linear1.weight[...] *= 2          # in place: not seen by the packed copy
    assert_identical(layer(x), first)
    layer.linear1.weight = layer.linear1.weight.copy()     # assigned: packed again
    assert not np.array_equal(layer(x), first)
    layer.load_state_dict(state)            # loaded: packed again
    assert_identical(layer(x), first)
    layer.self_attn.in_proj_weight = layer.self_attn.in_proj_weight * 0.5
    assert not np.array_equal(layer(x), first)


def test_stacks_take_their_layers_precision_or_their_own():
    rng = np.random.default_rng(21)
    x, memory = f32(rng, (6, 2, 32)), f32(rng, (9, 2, 32))
    enc_layer = attnx.TransformerEncoderLayer(32, 4, 64, 0.0, seed=0, precision=BF16)
    dec_layer = attnx.TransformerDecoderLayer(32, 4, 64, 0.0, seed=0)
    encoder = attnx.TransformerEncoder(enc_layer, 2)
    assert encoder.precision == BF16
    decoder = attnx.TransformerDecoder(dec_layer, 2, precision=BF16)
    assert decoder.precision == BF16 and dec_layer.precision == "float32"
    plain_decoder = attnx.TransformerDecoder(dec_layer, 2)
    assert_identical(plain_decoder(x, memory, precision=BF16), decoder(x, memory))
    assert not np.array_equal(plain_decoder(x, memory), decoder(x, memory))
    # Layers of different precisions: each its own, and the stack's precision is None.
    encoder.layers[1].precision = "float32"
    assert encoder.precision is None
    mixed = encoder(x)
    assert not np.array_equal(mixed, encoder(x, precision=BF16))
    assert not np.array_equal(mixed, encoder(x, precision="float32"))
    encoder.precision = BF16
    assert all(layer.precision == BF16 for layer in encoder.layers)
    copy = pickle.loads(pickle.dumps(encoder))
    assert copy.precision == BF16 and "precision='bfloat16'" in repr(copy)


def test_transformer_precision():
    rng = np.random.default_rng(22)
    src, tgt = f32(rng, (2, 9, 32)), f32(rng, (2, 5, 32))
    model = attnx.Transformer(32, 4, 2, 2, 64, 0.0, batch_first=True, seed=0, precision=BF16)
    plain = attnx.Transformer(32, 4, 2, 2, 64, 0.0, batch_first=True, seed=0)
    assert model.precision == BF16 and plain.precision == "float32"
    assert "precision='bfloat16'" in repr(model) and "precision" not in repr(plain)
    out = model(src, tgt, tgt_is_causal=True)
    assert_identical(plain(src, tgt, tgt_is_causal=True, precision=BF16), out)
    assert_identical(model(src, tgt, tgt_is_causal=True, precision="float32"), plain(src, tgt, tgt_is_causal=True))
    # Against the layers' reference, one layer at a time
    memory = src
    for layer in model.encoder.layers:
        memory = reference.transformer_encoder_layer(memory, layer.state_dict(), 4, batch_first=True, precision=BF16)
    memory = reference.layer_norm(memory, model.encoder.norm.weight, model.encoder.norm.bias, 1e-5)
    y = tgt
    for layer in model.decoder.layers:
        y = reference.transformer_decoder_layer(y, memory, layer.state_dict(), 4, batch_first=True,
                                                tgt_is_causal=True, precision=BF16)
    y = reference.layer_norm(y, model.decoder.norm.weight, model.decoder.norm.bias, 1e-5)
    assert max_error(out, y) <= 2 * REF_BOUND["layer"]


def test_decoder_steps_equal_the_forward():
    rng = np.random.default_rng(23)
    layer = attnx.TransformerDecoderLayer(32, 4, 64, 0.0, batch_first=True, seed=0, precision=BF16)
    decoder = attnx.TransformerDecoder(layer, 2)
    tgt, memory = f32(rng, (2, 6, 32)), f32(rng, (2, 8, 32))
    cache = decoder.new_cache(2, 8)
    steps = np.concatenate([decoder.step(tgt[:, :4], memory, cache), decoder.step(tgt[:, 4:], memory, cache)], axis=1)
    full = decoder(tgt, memory, tgt_is_causal=True)
    assert max_error(steps, full) <= 2 * REF_BOUND["layer"]
    # A step of another precision projects the memory again (its keys were rounded otherwise).
    cache = decoder.new_cache(2, 8)
    first = decoder.step(tgt[:, :4], memory, cache)
    plain_cache = decoder.new_cache(2, 8)
    plain_first = decoder.step(tgt[:, :4], memory, plain_cache, precision="float32")
    assert not np.array_equal(first, plain_first)
    plain_decoder = attnx.TransformerDecoder(attnx.TransformerDecoderLayer(32, 4, 64, 0.0, batch_first=True, seed=0), 2)
    assert_identical(plain_first, plain_decoder.step(tgt[:, :4], memory, plain_decoder.new_cache(2, 8)))
    assert_identical(decoder.step(tgt[:, 4:], memory, cache), steps[:, 4:])


# ---------------------------------------------------------------------------------------------
# Threads and kernels
# ---------------------------------------------------------------------------------------------


def _thread_battery():
    rng = np.random.default_rng(24)
    q, k, v = f32(rng, (2, 4, 130, 64)), f32(rng, (2, 4, 530, 64)), f32(rng, (2, 4, 530, 64))
    args = mha_args(rng, L=65, S=65, N=2, E=64, H=4)
    layer = attnx.TransformerEncoderLayer(64, 4, 128, 0.0, seed=0, precision=BF16)
    cache = attnx.KVCache(2, 4, 1100, 64)
    cache.append(f32(rng, (2, 4, 1050, 64)), f32(rng, (2, 4, 1050, 64)))
    return [
        attnx.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", precision=BF16),
        attnx.scaled_dot_product_attention(q[:, :, :1], k, v, precision=BF16),
        *attnx.multi_head_attention_forward(**args, precision=BF16),
        attnx.cached_attention(q[:, :, :2], cache, precision=BF16),
        layer(f32(rng, (40, 2, 64))),
    ]


def test_results_do_not_depend_on_the_thread_count(threads):
    results = {}
    for n in (1, 2, 3):
        with num_threads(n):
            results[n] = _thread_battery()
    for n in (2, 3):
        for a, b in zip(results[1], results[n]):
            assert_identical(a, b, f"{n} threads")


KERNEL_BATTERY = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import attnx
    from attnx import reference

    rng = np.random.default_rng(0)
    worst = {"sdpa": [0.0, 0.0], "mha": [0.0, 0.0], "weights": [0.0, 0.0]}

    def record(kind, got, want, exact):
        worst[kind][0] = max(worst[kind][0], float(np.abs(got - want).max(initial=0)))
        worst[kind][1] = max(worst[kind][1], float(np.abs(got - exact).max(initial=0)))

    # Sizes around the vector widths, the query tiles, the key blocks and the decode chunks
    for L, S, E in [(1, 1, 16), (1, 513, 64), (3, 17, 80), (16, 64, 64), (33, 129, 64), (97, 300, 128), (8, 1100, 64)]:
        q, k, v = (rng.standard_normal((2, 2, n, E)).astype(np.float32) for n in (L, S, S))
        for kw in ({}, {"is_causal": "bottom_right"}, {"attn_mask": rng.random((L, S)) < 0.6}):
            got = attnx.scaled_dot_product_attention(q, k, v, precision="bfloat16", **kw)
            want = reference.scaled_dot_product_attention(q, k, v, precision="bfloat16", **kw)
            exact = reference.scaled_dot_product_attention(q.astype(float), k, v, **kw)
            record("sdpa", got, want, exact)
    for E, H, L in [(16, 2, 5), (64, 4, 33), (96, 4, 70)]:
        x = rng.standard_normal((L, 2, E)).astype(np.float32)
        w = (rng.standard_normal((3 * E, E)) / np.sqrt(E)).astype(np.float32)
        wo = (rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32)
        b = (0.5 * rng.standard_normal(3 * E)).astype(np.float32)   # biases of mha_args' scale
        args = (x, x, x, E, H, w, b, None, None, False, 0.0, wo, b[:E])
        for kind, need in (("mha", False), ("weights", True)):
            kw = dict(training=False, need_weights=need)
            got, _ = attnx.multi_head_attention_forward(*args, precision="bfloat16", **kw)
            want, _ = reference.multi_head_attention_forward(*args, precision="bfloat16", **kw)
            exact, _ = reference.multi_head_attention_forward(*(a.astype(float) if isinstance(a, np.ndarray) else a
                                                                for a in args), **kw)
            record(kind, got, want, exact)
    config = attnx.show_config()
    bf16 = config["precisions"]["bfloat16"]
    # The avx512_bf16 level runs the avx512 float kernels (and its own bfloat16 table).
    requested = os.environ["ATTNX_ISA"]
    level = requested if requested == "avx512_bf16" and config["isa"] == "avx512" else config["isa"]
    print(json.dumps({"isa": level, "bf16": bf16, "worst": worst}))
    """
)

PRECISION_ISAS = ISAS + ["avx512_bf16"]


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


@pytest.mark.slow
@pytest.mark.parametrize("products", ["pairs", "float"])
@pytest.mark.parametrize("isa", PRECISION_ISAS)
def test_every_kernel_within_the_bounds(isa, products):
    # avx512_bf16 is the AVX-512 float kernels with AVX512_BF16's vdpbf16ps; the others emulate
    # vdpbf16ps's arithmetic with float32 multiply-adds (ATTNX_BF16_PRODUCTS=pairs), or every
    # level multiplies the rounded operands with its float32 kernels (=float).
    config = attnx.show_config()
    float_isa = "avx512" if isa == "avx512_bf16" else isa
    if ISAS.index(float_isa) > ISAS.index(config["cpu_isa"]):
        pytest.skip(f"this CPU does not run the {float_isa} kernel (it runs {config['cpu_isa']})")
    if isa == "avx512_bf16" and "avx512_bf16" not in _cpu_flags():
        pytest.skip("this CPU has no AVX512_BF16")
    assert float_isa in config["kernels"], config
    result = run_under_isa(isa, KERNEL_BATTERY, env={"ATTNX_BF16_PRODUCTS": products})
    if products == "float":
        assert result["bf16"] == f"{float_isa} (float32 products)", result
    else:
        assert result["bf16"] == ("avx512_bf16" if isa == "avx512_bf16" else f"{isa} (emulated)"), result
    worst = result["worst"]
    for kind, (near, far) in worst.items():
        assert near <= REF_BOUND[kind], (isa, kind, near)
        assert far <= F64_BOUND[kind], (isa, kind, far)


# ---------------------------------------------------------------------------------------------
# Against OpenVINO's bfloat16 inference
# ---------------------------------------------------------------------------------------------

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["b8-l128", "l1024", "mha-e768"])
def test_error_no_worse_than_openvinos_bfloat16(shape):
    # benchmarks/accuracy.py's cases: the same inputs to both, each against float64. attnx's
    # max and mean errors must stay within 1.5 times OpenVINO's.
    if not (BENCHMARKS / "accuracy.py").exists():
        pytest.skip("benchmarks/ is not in this tree")
    pytest.importorskip("openvino")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import accuracy
        import peers
        import shapes
    finally:
        sys.path.remove(str(BENCHMARKS))
    case = {s.name: s for s in shapes.SHAPES}[shape]
    data = shapes.make_inputs(case, 0)
    want = shapes.reference_output(case, data)
    threads = attnx.get_num_threads()
    try:
        theirs, note = accuracy.output(peers.setup_openvino, case, data, threads, BF16)
        if "bf16" not in note:
            pytest.skip(f"OpenVINO computes in float32 on this CPU ({note}); bfloat16 needs AVX512_BF16 or AMX")
        ours, _ = accuracy.output(peers.setup_attnx, case, data, threads, BF16)
    finally:
        attnx.set_num_threads(threads)  # (the set-ups set it)
    (our_max, our_mean), (their_max, their_mean) = accuracy.errors(ours, want), accuracy.errors(theirs, want)
    assert our_max <= 1.5 * their_max, (our_max, their_max)
    assert our_mean <= 1.5 * their_mean, (our_mean, their_mean)
