"""Every error of the API contract, with its type and a message naming the argument.

The contract's Errors section: masks must be bool or floating point (TypeError otherwise);
wrong shapes, mismatched dims, bad mask shapes, embed_dim not divisible by num_heads,
non-finite scale, out= of the wrong shape/dtype/layout raise ValueError or TypeError with a
message that names the argument (and the shapes involved). No input, however malformed,
crashes the process -- the private core included, which is called directly here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnx
from conftest import core_mha, core_sdpa, mha_args, randn

sdpa = attnx.scaled_dot_product_attention
mha = attnx.multi_head_attention_forward

f32 = np.float32


def qkv(shape_q=(2, 3, 5, 8), shape_k=(2, 3, 7, 8), shape_v=(2, 3, 7, 4), dtype=f32):
    rng = np.random.default_rng(0)
    return randn(rng, shape_q, dtype), randn(rng, shape_k, dtype), randn(rng, shape_v, dtype)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((8,), (7, 8), (7, 4)), r"query.*\(8,\)"),
        (((5, 8), (8,), (7, 4)), r"key.*\(8,\)"),
        (((5, 8), (7, 8), (4,)), r"value.*\(4,\)"),
        (((), (7, 8), (7, 4)), r"query"),
        (((2, 3, 5, 8), (2, 3, 7, 9), (2, 3, 7, 4)), r"query.*key.*\(2, 3, 5, 8\).*\(2, 3, 7, 9\)"),
        (((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 6, 4)), r"key.*value.*\(2, 3, 7, 8\).*\(2, 3, 6, 4\)"),
        (((2, 3, 5, 8), (4, 3, 7, 8), (4, 3, 7, 4)), r"query \(2, 3, 5, 8\).*key \(4, 3, 7, 8\).*broadcast"),
        (((2, 3, 5, 8), (2, 2, 7, 8), (2, 2, 7, 4)), r"broadcast"),
        (((2, 3, 5, 8), (2, 3, 7, 8), (2, 1, 7, 4)), None),  # value heads broadcast: fine
        (((3, 2, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)), r"broadcast"),
    ],
)
def test_sdpa_shapes(shapes, match):
    q, k, v = (np.zeros(s, f32) for s in shapes)
    if match is None:
        assert sdpa(q, k, v).shape == (2, 3, 5, 4)
        return
    with pytest.raises(ValueError, match=match):
        sdpa(q, k, v)


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,match",
    [
        ((2, 6, 5, 8), (2, 4, 7, 8), (2, 4, 7, 4), r"enable_gqa.*multiple.*\(2, 6, 5, 8\).*\(2, 4, 7, 8\)"),
        ((2, 3, 5, 8), (2, 2, 7, 8), (2, 2, 7, 4), r"enable_gqa.*multiple"),
        ((2, 4, 5, 8), (2, 2, 7, 8), (2, 1, 7, 4), r"enable_gqa.*key.*value"),
        ((2, 4, 5, 8), (2, 0, 7, 8), (2, 0, 7, 4), r"enable_gqa"),
        ((2, 4, 5, 8), (3, 2, 7, 8), (3, 2, 7, 4), r"broadcast"),
    ],
)
def test_sdpa_gqa_heads(q_shape, k_shape, v_shape, match):
    q, k, v = qkv(q_shape, k_shape, v_shape)
    with pytest.raises(ValueError, match=match):
        sdpa(q, k, v, enable_gqa=True)


@pytest.mark.parametrize(
    "mask_shape", [(5, 6), (6,), (4, 7), (3, 2, 3, 5, 7), (2, 2, 5, 7), (3, 1, 5, 7), (5, 7, 1)]
)
@pytest.mark.parametrize("kind", [bool, f32])
def test_sdpa_mask_shape(mask_shape, kind):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"attn_mask.*" + str(mask_shape).replace("(", r"\(").replace(")", r"\)")):
        sdpa(q, k, v, attn_mask=np.zeros(mask_shape, kind))


@pytest.mark.parametrize("mask_dtype", [np.int8, np.int32, np.uint8, np.int64, np.complex64, object, "U1"])
def test_sdpa_mask_dtype(mask_dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa(q, k, v, attn_mask=np.zeros((5, 7), mask_dtype))


@pytest.mark.parametrize("arg", ["query", "key", "value"])
@pytest.mark.parametrize("bad_dtype", [np.int32, np.int64, np.uint8, np.complex64, np.complex128, bool, object])
def test_sdpa_input_dtypes(arg, bad_dtype):
    q, k, v = qkv()
    inputs = {"query": q, "key": k, "value": v}
    inputs[arg] = inputs[arg].astype(bad_dtype)
    with pytest.raises(TypeError, match=arg):
        sdpa(**inputs)


@pytest.mark.parametrize("arg", ["query", "key", "value"])
def test_sdpa_string_input(arg):
    q, k, v = qkv()
    inputs = {"query": q, "key": k, "value": v, arg: np.full((5, 8), "x")}
    with pytest.raises(TypeError, match=arg):
        sdpa(**inputs)


OTHER_FLOATS = [np.longdouble] if np.dtype(np.longdouble) != np.float64 else []


@pytest.mark.parametrize("dtype", OTHER_FLOATS)
def test_sdpa_query_must_be_float32_float64_or_half(dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="query"):
        sdpa(q.astype(dtype), k, v)


def test_sdpa_float16_query_and_keys():
    # float16 is a storage dtype: computed in float32, returned as float16.
    q, k, v = qkv()
    assert sdpa(q.astype(np.float16), k, v).dtype == np.float16
    assert sdpa(q, k.astype(np.float16), v.astype(np.float16)).dtype == f32


@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf, float("nan"), np.float32(np.inf)])
def test_sdpa_non_finite_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale"):
        sdpa(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", ["0.5x", [0.5, 1.0], object()])
def test_sdpa_scale_not_a_number(scale):
    q, k, v = qkv()
    with pytest.raises((TypeError, ValueError), match="scale"):
        sdpa(q, k, v, scale=scale)


@pytest.mark.parametrize("softcap", [0, 0.0, -1.0, np.nan, np.inf, -np.inf])
def test_sdpa_softcap_out_of_range(softcap):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softcap must be finite and > 0"):
        sdpa(q, k, v, softcap=softcap)


@pytest.mark.parametrize("softcap", ["30", True, [30.0], object()])
def test_sdpa_softcap_not_a_number(softcap):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"softcap must be a positive number or None"):
        sdpa(q, k, v, softcap=softcap)


@pytest.mark.parametrize("stage", ["probs", "QK", "", 3, True])
def test_sdpa_unknown_return_scores(stage):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"return_scores must be None or one of 'qk', 'softcapped', 'masked', 'softmax'"):
        sdpa(q, k, v, return_scores=stage)


@pytest.mark.parametrize("dropout_p", [0.1, 1.0, 1])
def test_sdpa_dropout_is_inference_only(dropout_p):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=r"inference only"):
        sdpa(q, k, v, None, dropout_p)


@pytest.mark.parametrize("dropout_p", [-0.5, 1.5, np.nan])
def test_sdpa_dropout_out_of_range(dropout_p):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        sdpa(q, k, v, dropout_p=dropout_p)


@pytest.mark.parametrize("dropout_p", [True, "0.0", None])
def test_sdpa_is_causal_in_dropouts_place(dropout_p):
    # attnx's former order (q, k, v, mask, is_causal) put is_causal fifth; torch's has
    # dropout_p there, and the message says so.
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"dropout_p must be a number.*is_causal comes after dropout_p"):
        sdpa(q, k, v, None, dropout_p)


# out=


def _out_cases():
    base = (2, 3, 5, 4)
    big = np.zeros((2, 3, 5, 8), f32)
    ro = np.zeros(base, f32)
    ro.flags.writeable = False
    buf = bytearray(np.zeros(base, f32).nbytes + 1)
    misaligned = np.frombuffer(buf, f32, offset=1).reshape(base)
    return [
        ("shape", np.zeros((2, 3, 5, 5), f32), ValueError, r"out.*\(2, 3, 5, 5\).*\(2, 3, 5, 4\)"),
        ("rank", np.zeros((6, 5, 4), f32), ValueError, r"out.*\(6, 5, 4\)"),
        ("dtype", np.zeros(base, np.float64), TypeError, r"out.*float64"),
        ("int", np.zeros(base, np.int32), TypeError, r"out"),
        ("big_endian", np.zeros(base, ">f4"), TypeError, r"out"),
        ("non_contiguous", big[..., ::2], ValueError, r"out.*contiguous"),
        ("fortran", np.asfortranarray(np.zeros(base, f32)), ValueError, r"out.*contiguous"),
        ("transposed", np.zeros((2, 3, 4, 5), f32).swapaxes(-1, -2), ValueError, r"out.*contiguous"),
        ("negative", np.zeros(base, f32)[::-1], ValueError, r"out"),
        ("broadcast", np.broadcast_to(np.zeros((1, 3, 5, 4), f32), base), ValueError, r"out"),
        ("read_only", ro, ValueError, r"out.*read-only"),
        ("misaligned", misaligned, ValueError, r"out.*aligned"),
        ("list", np.zeros(base, f32).tolist(), TypeError, r"out"),
    ]


@pytest.mark.parametrize("case", _out_cases(), ids=lambda c: c[0])
def test_sdpa_out_errors(case):
    _, out, exc, match = case
    q, k, v = qkv()
    before = np.array(out, copy=True)
    with pytest.raises(exc, match=match):
        sdpa(q, k, v, out=out)
    np.testing.assert_array_equal(np.asarray(out), before)  # untouched


@pytest.mark.parametrize("overlaps", ["query", "key", "value", "attn_mask", "query_partial", "mask_partial"])
def test_sdpa_out_overlapping_an_input(overlaps):
    q, k, v = qkv((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 4))
    inputs = {"query": q, "key": k, "value": v, "attn_mask": np.zeros((2, 3, 5, 7), f32)}
    if overlaps == "query_partial":
        flat = np.zeros(2 * 3 * 5 * 4 + 8, f32)  # out and query share all but 8 elements
        inputs["query"] = flat[8:].reshape(2, 3, 5, 4)
        out = flat[:-8].reshape(2, 3, 5, 4)
    elif overlaps == "mask_partial":
        storage = np.zeros((2, 3, 5, 7), f32)
        inputs["attn_mask"] = storage
        out = storage.reshape(-1)[:120].reshape(2, 3, 5, 4)
    else:
        out = inputs[overlaps]
    with pytest.raises(ValueError, match="out"):
        sdpa(**inputs, out=out)


# ---------------------------------------------------------------------------------------------
# multi_head_attention_forward
# ---------------------------------------------------------------------------------------------


def good(**overrides):
    args = mha_args(np.random.default_rng(1), L=5, S=7, N=2, E=8, H=2, dtype=f32)
    args.update(overrides)
    return args


def test_mha_good_arguments_work():
    out, w = mha(**good())
    assert out.shape == (5, 2, 8) and w.shape == (2, 5, 7)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"query": np.zeros((5, 2, 2, 8), f32)}, r"query.*\(5, 2, 2, 8\)"),
        ({"query": np.zeros((8,), f32)}, r"query.*\(8,\)"),
        ({"key": np.zeros((7, 8), f32)}, r"key.*\(7, 8\)"),
        ({"value": np.zeros((7, 2, 2, 8), f32)}, r"value"),
        ({"key": np.zeros((7, 3, 8), f32), "value": np.zeros((7, 3, 8), f32)}, r"key.*\(7, 3, 8\)"),
        ({"value": np.zeros((6, 2, 8), f32)}, r"value.*\(6, 2, 8\)"),
        ({"key": np.zeros((6, 2, 8), f32)}, r"key.*\(6, 2, 8\)"),
    ],
)
def test_mha_input_shapes(overrides, match):
    with pytest.raises(ValueError, match=match):
        mha(**good(**overrides))


def test_mha_unbatched_rank_mismatch():
    with pytest.raises(ValueError, match="key"):
        mha(**good(query=np.zeros((5, 8), f32)))


@pytest.mark.parametrize("embed_dim_to_check", [7, 16, 0])
def test_mha_embed_dim_to_check(embed_dim_to_check):
    with pytest.raises(ValueError, match=rf"embed_dim_to_check.*{embed_dim_to_check}"):
        mha(**good(embed_dim_to_check=embed_dim_to_check))


@pytest.mark.parametrize("num_heads", [3, 5, 16])
def test_mha_embed_dim_not_divisible(num_heads):
    with pytest.raises(ValueError, match=rf"num_heads.*{num_heads}"):
        mha(**good(num_heads=num_heads))


@pytest.mark.parametrize("num_heads,exc", [(0, ValueError), (-2, ValueError), (2.0, TypeError), ("2", TypeError)])
def test_mha_num_heads_invalid(num_heads, exc):
    with pytest.raises(exc, match="num_heads"):
        mha(**good(num_heads=num_heads))


def test_mha_zero_embed_dim():
    args = good()
    for name in ("query", "key", "value"):
        args[name] = np.zeros(args[name].shape[:-1] + (0,), f32)
    args.update(embed_dim_to_check=0, in_proj_weight=np.zeros((0, 0), f32), in_proj_bias=None,
                out_proj_weight=np.zeros((0, 0), f32), out_proj_bias=None)
    with pytest.raises(ValueError, match="embed_dim"):
        mha(**args)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 1.0])
def test_mha_dropout_in_training(dropout_p):
    with pytest.raises(NotImplementedError, match="dropout"):
        mha(**good(dropout_p=dropout_p, training=True))
    mha(**good(dropout_p=dropout_p, training=False))  # fine


@pytest.mark.parametrize("dropout_p", [-0.1, 1.5, np.nan])
def test_mha_dropout_out_of_range(dropout_p):
    with pytest.raises(ValueError, match="dropout_p"):
        mha(**good(dropout_p=dropout_p, training=False))


def test_mha_missing_weights():
    with pytest.raises(ValueError, match="in_proj_weight"):
        mha(**good(in_proj_weight=None))
    with pytest.raises(ValueError, match="out_proj_weight"):
        mha(**good(out_proj_weight=None))
    sep = good(use_separate_proj_weight=True, in_proj_weight=None,
               q_proj_weight=np.eye(8, dtype=f32), k_proj_weight=np.eye(8, dtype=f32), v_proj_weight=np.eye(8, dtype=f32))
    mha(**sep)
    for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        with pytest.raises(ValueError, match=name):
            mha(**{**sep, name: None})


def test_mha_packed_weight_with_other_kdim():
    args = good(key=np.zeros((7, 2, 5), f32))
    with pytest.raises(ValueError, match=r"in_proj_weight|use_separate_proj_weight"):
        mha(**args)
    args = good(value=np.zeros((7, 2, 6), f32))
    with pytest.raises(ValueError, match=r"in_proj_weight|use_separate_proj_weight"):
        mha(**args)


@pytest.mark.parametrize(
    "name,shape",
    [
        ("in_proj_weight", (24, 9)),
        ("in_proj_weight", (16, 8)),
        ("in_proj_weight", (24,)),
        ("in_proj_bias", (16,)),
        ("in_proj_bias", (24, 1)),
        ("out_proj_weight", (8, 9)),
        ("out_proj_weight", (8,)),
        ("out_proj_bias", (9,)),
        ("out_proj_bias", (1, 8)),
        ("bias_k", (1, 1, 9)),
        ("bias_v", (7,)),
    ],
)
def test_mha_weight_shapes(name, shape):
    args = good(bias_k=np.zeros((1, 1, 8), f32), bias_v=np.zeros((1, 1, 8), f32))
    args[name] = np.zeros(shape, f32)
    with pytest.raises(ValueError, match=name):
        mha(**args)


@pytest.mark.parametrize(
    "name,shape",
    [("q_proj_weight", (8, 5)), ("k_proj_weight", (8, 8)), ("k_proj_weight", (5, 8)),
     ("v_proj_weight", (8, 5)), ("v_proj_weight", (6,))],
)
def test_mha_separate_weight_shapes(name, shape):
    args = mha_args(np.random.default_rng(2), E=8, H=2, kdim=5, vdim=6, dtype=f32)
    args[name] = np.zeros(shape, f32)
    with pytest.raises(ValueError, match=name):
        mha(**args)


def test_mha_bias_k_and_bias_v_together():
    for name, other in (("bias_k", "bias_v"), ("bias_v", "bias_k")):
        with pytest.raises(ValueError, match=rf"bias_k.*bias_v"):
            mha(**good(**{name: np.zeros((1, 1, 8), f32), other: None}))


def test_mha_bias_kv_with_static():
    for static in ("static_k", "static_v"):
        args = good(bias_k=np.zeros((1, 1, 8), f32), bias_v=np.zeros((1, 1, 8), f32))
        args[static] = np.zeros((4, 7, 4), f32)
        with pytest.raises(ValueError, match=r"bias_k.*static"):
            mha(**args)


@pytest.mark.parametrize("name", ["static_k", "static_v"])
@pytest.mark.parametrize("shape", [(2, 7, 4), (4, 7, 8), (4, 7), (1, 4, 7, 4), (8, 7, 2)])
def test_mha_static_shape(name, shape):
    with pytest.raises(ValueError, match=rf"{name}.*" + str(shape).replace("(", r"\(").replace(")", r"\)")):
        mha(**good(**{name: np.zeros(shape, f32)}))


def test_mha_static_lengths_differ():
    with pytest.raises(ValueError, match="static"):
        mha(**good(static_k=np.zeros((4, 7, 4), f32), static_v=np.zeros((4, 9, 4), f32)))
    with pytest.raises(ValueError, match="static"):
        mha(**good(static_k=np.zeros((4, 9, 4), f32)))  # the projected values have 7


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"key_padding_mask": np.zeros((2, 6), bool)}, r"key_padding_mask.*\(2, 6\)"),
        ({"key_padding_mask": np.zeros((3, 7), bool)}, r"key_padding_mask.*\(3, 7\)"),
        ({"key_padding_mask": np.zeros((7,), bool)}, r"key_padding_mask.*\(7,\)"),
        ({"key_padding_mask": np.zeros((2, 1, 7), f32)}, r"key_padding_mask"),
        ({"attn_mask": np.zeros((5, 6), bool)}, r"attn_mask.*\(5, 6\)"),
        ({"attn_mask": np.zeros((7, 5), f32)}, r"attn_mask.*\(7, 5\)"),
        ({"attn_mask": np.zeros((2, 5, 7), bool)}, r"attn_mask.*\(2, 5, 7\)"),
        ({"attn_mask": np.zeros((4, 5, 6), f32)}, r"attn_mask.*\(4, 5, 6\)"),
        ({"attn_mask": np.zeros((7,), bool)}, r"attn_mask.*\(7,\)"),
        ({"attn_mask": np.zeros((2, 2, 5, 7), bool)}, r"attn_mask.*\(2, 2, 5, 7\)"),
        ({"attn_mask": np.zeros((1, 5, 7), bool)}, r"attn_mask"),
    ],
)
def test_mha_mask_shapes(overrides, match):
    with pytest.raises(ValueError, match=match):
        mha(**good(**overrides))


def test_mha_mask_shapes_with_static_and_unbatched():
    # With static_k the masks describe its length.
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(**good(static_k=np.zeros((4, 9, 4), f32), static_v=np.zeros((4, 9, 4), f32),
                   key_padding_mask=np.zeros((2, 7), bool)))
    args = mha_args(np.random.default_rng(3), unbatched=True, dtype=f32)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(**{**args, "key_padding_mask": np.zeros((1, 6), bool)})
    with pytest.raises(ValueError, match="attn_mask"):
        mha(**{**args, "attn_mask": np.zeros((4, 5, 6), bool)})


@pytest.mark.parametrize("name", ["key_padding_mask", "attn_mask"])
@pytest.mark.parametrize("mask_dtype", [np.int8, np.int32, np.uint8, np.int64, np.complex64, object])
def test_mha_mask_dtype(name, mask_dtype):
    shape = (2, 7) if name == "key_padding_mask" else (5, 7)
    with pytest.raises(TypeError, match=name):
        mha(**good(**{name: np.zeros(shape, mask_dtype)}))


@pytest.mark.parametrize(
    "name", ["query", "key", "value", "in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "bias_k"]
)
@pytest.mark.parametrize("bad_dtype", [np.int32, np.int64, np.complex128, bool, object])
def test_mha_input_dtypes(name, bad_dtype):
    args = good(bias_k=np.zeros((1, 1, 8), f32), bias_v=np.zeros((1, 1, 8), f32))
    args[name] = np.asarray(args[name]).astype(bad_dtype)
    with pytest.raises(TypeError, match=name):
        mha(**args)


def test_mha_float16_query():
    # The query's dtype is the result's: float16 is computed in float32 and returned as float16.
    args = good()
    out, weights = mha(**{**args, "query": args["query"].astype(np.float16)})
    assert out.dtype == weights.dtype == np.float16
    f16 = {k: (args[k].astype(np.float16)) for k in ("key", "value", "in_proj_weight", "out_proj_weight")}
    out, _ = mha(**{**args, **f16})
    assert out.dtype == f32
    if np.dtype(np.longdouble) != np.float64:
        with pytest.raises(TypeError, match="query"):
            mha(**{**args, "query": args["query"].astype(np.longdouble)})


# ---------------------------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,exc", [(0, ValueError), (-1, ValueError), (-(2**40), ValueError), (1.5, TypeError), ("2", TypeError), (None, TypeError)])
def test_set_num_threads_invalid(threads, n, exc):
    with pytest.raises(exc):
        attnx.set_num_threads(n)
    assert attnx.get_num_threads() == threads  # unchanged


def test_set_num_threads_zero_message(threads):
    with pytest.raises(ValueError, match=r"0"):
        attnx.set_num_threads(0)


# ---------------------------------------------------------------------------------------------
# The private core: wrong shapes, dtypes and strides raise, never crash
# ---------------------------------------------------------------------------------------------


def core_sdpa_args(dtype=f32, B=2, H=3, L=5, S=7, E=8, Ev=4, Hk=None, mask=True, weights=False):
    rng = np.random.default_rng(4)
    Hk = H if Hk is None else Hk
    return dict(
        query=randn(rng, (B, H, L, E), dtype),
        key=randn(rng, (B, Hk, S, E), dtype),
        value=randn(rng, (B, Hk, S, Ev), dtype),
        attn_mask=np.zeros((B, H, L, S), dtype) if mask else None,
        causal=False,
        scale=0.5,
        out=np.zeros((B, H, L, Ev), dtype),
        weights=np.zeros((B, H, L, S), dtype) if weights else None,
    )


def test_core_sdpa_good_arguments_work():
    for weights in (False, True):
        a = core_sdpa_args(weights=weights)
        core_sdpa(**a)
        assert np.isfinite(a["out"]).all() and np.abs(a["out"]).sum() > 0


def _misaligned(a):
    buf = bytearray(a.nbytes + 1)
    m = np.frombuffer(buf, a.dtype, offset=1, count=a.size).reshape(a.shape)
    m[...] = a
    return m


def _odd_strides(a):
    """The values of `a` with a row stride that is not a multiple of the item size."""
    strides = list(a.strides)
    strides[-2] = a.strides[-2] + 2
    for d in range(a.ndim - 3, -1, -1):
        strides[d] = strides[d + 1] * a.shape[d + 1]
    buf = bytearray(strides[0] * a.shape[0] + 64)
    out = np.ndarray(a.shape, a.dtype, buffer=buf, strides=tuple(strides))
    out[...] = a
    return out


CORE_SDPA_BAD = {
    "query_rank3": (lambda a: a.update(query=a["query"][0]), ValueError, "query"),
    "query_rank5": (lambda a: a.update(query=a["query"][None]), ValueError, "query"),
    "key_rank3": (lambda a: a.update(key=a["key"][0]), ValueError, "key"),
    "value_rank2": (lambda a: a.update(value=a["value"][0, 0]), ValueError, "value"),
    "query_int": (lambda a: a.update(query=a["query"].astype(np.int32)), TypeError, "query"),
    "query_f16": (lambda a: a.update(query=a["query"].astype(np.float16)), TypeError, "query"),
    "key_f64": (lambda a: a.update(key=a["key"].astype(np.float64)), TypeError, "key"),
    "value_f64": (lambda a: a.update(value=a["value"].astype(np.float64)), TypeError, "value"),
    "mask_f64": (lambda a: a.update(attn_mask=a["attn_mask"].astype(np.float64)), TypeError, "attn_mask"),
    "mask_bool": (lambda a: a.update(attn_mask=a["attn_mask"].astype(bool)), TypeError, "attn_mask"),
    "key_batch": (lambda a: a.update(key=np.zeros((3, 3, 7, 8), f32)), ValueError, "key"),
    "key_dim": (lambda a: a.update(key=np.zeros((2, 3, 7, 9), f32)), ValueError, "key"),
    "value_len": (lambda a: a.update(value=np.zeros((2, 3, 6, 4), f32)), ValueError, "value"),
    "value_heads": (lambda a: a.update(value=np.zeros((2, 2, 7, 4), f32)), ValueError, "value"),
    "gqa_heads": (lambda a: a.update(key=np.zeros((2, 2, 7, 8), f32), value=np.zeros((2, 2, 7, 4), f32)), ValueError, "heads"),
    "zero_key_heads": (lambda a: a.update(key=np.zeros((2, 0, 7, 8), f32), value=np.zeros((2, 0, 7, 4), f32)), ValueError, "heads"),
    "mask_shape": (lambda a: a.update(attn_mask=np.zeros((2, 3, 5, 6), f32)), ValueError, "attn_mask"),
    "mask_rank": (lambda a: a.update(attn_mask=np.zeros((5, 7), f32)), ValueError, "attn_mask"),
    "out_rows": (lambda a: a.update(out=np.zeros((2, 3, 4, 4), f32)), ValueError, "out"),
    "out_misaligned": (lambda a: a.update(out=_misaligned(a["out"])), ValueError, "out"),
    "query_misaligned": (lambda a: a.update(query=_misaligned(a["query"])), ValueError, "query"),
    "key_misaligned": (lambda a: a.update(key=_misaligned(a["key"])), ValueError, "key"),
    "mask_misaligned": (lambda a: a.update(attn_mask=_misaligned(a["attn_mask"])), ValueError, "attn_mask"),
    "query_last_strided": (lambda a: a.update(query=np.zeros((2, 3, 5, 16), f32)[..., ::2]), ValueError, "query"),
    "key_fortran": (lambda a: a.update(key=np.asfortranarray(a["key"])), ValueError, "key"),
    "value_last_strided": (lambda a: a.update(value=np.zeros((2, 3, 7, 8), f32)[..., ::2]), ValueError, "value"),
    "query_odd_strides": (lambda a: a.update(query=_odd_strides(a["query"])), ValueError, "query"),
    "scale_inf": (lambda a: a.update(scale=np.inf), ValueError, "scale"),
    "scale_neg_inf": (lambda a: a.update(scale=-np.inf), ValueError, "scale"),
    "weights_rank": (lambda a: a.update(weights=np.zeros((6, 5, 7), f32)), ValueError, "weights"),
    "weights_f64": (lambda a: a.update(weights=np.zeros((2, 3, 5, 7))), TypeError, "weights"),
    "weights_fortran": (lambda a: a.update(weights=np.asfortranarray(np.zeros((2, 3, 5, 7), f32))), ValueError, "weights"),
    "weights_readonly": (lambda a: a.update(weights=np.broadcast_to(np.zeros((1, 3, 5, 7), f32), (2, 3, 5, 7))), ValueError, "weights"),
    "query_none": (lambda a: a.update(query=None), TypeError, None),
    "out_none": (lambda a: a.update(out=None), TypeError, None),
    "query_object": (lambda a: a.update(query=np.zeros((2, 3, 5, 8), object)), TypeError, "query"),
}


@pytest.mark.parametrize("case", list(CORE_SDPA_BAD))
def test_core_sdpa_rejects(case):
    mutate, exc, match = CORE_SDPA_BAD[case]
    a = core_sdpa_args(weights=case.startswith("weights"))
    mutate(a)
    with pytest.raises(exc, match=match):
        core_sdpa(**a)


@pytest.mark.parametrize("shape", [(2, 3, 5), (7,), (), (1, 2, 3, 4, 5)])
def test_core_messages_write_a_shape_as_python_does(shape):
    # The core builds its messages without iostreams (see shape_string); they must still
    # read like the tuple NumPy reports.
    a = core_sdpa_args()
    a["query"] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=re.escape(f"query: expected 4 dimensions, got shape {shape}")):
        core_sdpa(**a)


@pytest.mark.parametrize(
    "name,bad",
    [("key", np.float32), ("value", np.float32), ("attn_mask", np.float32), ("out", np.float32),
     ("weights", np.float32), ("query", np.int64)],
)
def test_core_sdpa_float64_mixed_dtypes(name, bad):
    a = core_sdpa_args(dtype=np.float64, weights=True)
    a[name] = a[name].astype(bad)
    with pytest.raises(TypeError, match=name):
        core_sdpa(**a)


def core_mha_args(dtype=f32, N=2, L=5, S=7, E=8, H=2, kdim=8, vdim=8, weights="avg"):
    rng = np.random.default_rng(5)
    return dict(
        num_heads=H,
        query=randn(rng, (N, L, E), dtype),
        key=randn(rng, (N, S, kdim), dtype),
        value=randn(rng, (N, S, vdim), dtype),
        w_q=randn(rng, (E, E), dtype, 0.3),
        w_k=randn(rng, (E, kdim), dtype, 0.3),
        w_v=randn(rng, (E, vdim), dtype, 0.3),
        b_q=randn(rng, (E,), dtype),
        b_k=randn(rng, (E,), dtype),
        b_v=randn(rng, (E,), dtype),
        bias_k=None,
        bias_v=None,
        add_zero_attn=False,
        static_k=None,
        static_v=None,
        attn_mask=np.zeros((N, H, L, S), dtype),
        key_padding_mask=np.zeros((N, H, L, S), dtype),
        causal=False,
        w_out=randn(rng, (E, E), dtype, 0.3),
        b_out=randn(rng, (E,), dtype),
        out=np.zeros((N, L, E), dtype),
        weights=None if weights is None else np.zeros((N, L, S) if weights == "avg" else (N, H, L, S), dtype),
        average_weights=weights == "avg",
    )


def test_core_mha_good_arguments_work():
    for w in ("avg", "heads", None):
        a = core_mha_args(weights=w)
        core_mha(**a)
        assert np.isfinite(a["out"]).all() and np.abs(a["out"]).sum() > 0


CORE_MHA_BAD = {
    "num_heads_0": (lambda a: a.update(num_heads=0), ValueError, "num_heads"),
    "num_heads_neg": (lambda a: a.update(num_heads=-2), ValueError, "num_heads"),
    "num_heads_3": (lambda a: a.update(num_heads=3), ValueError, "num_heads"),
    "query_rank2": (lambda a: a.update(query=a["query"][0]), ValueError, "query"),
    "query_rank4": (lambda a: a.update(query=a["query"][None]), ValueError, "query"),
    "query_int": (lambda a: a.update(query=a["query"].astype(np.int64)), TypeError, "query"),
    "query_f16": (lambda a: a.update(query=a["query"].astype(np.float16)), TypeError, "query"),
    "key_f64": (lambda a: a.update(key=a["key"].astype(np.float64)), TypeError, "key"),
    "key_batch": (lambda a: a.update(key=np.zeros((3, 7, 8), f32)), ValueError, "key"),
    "value_len": (lambda a: a.update(value=np.zeros((2, 6, 8), f32)), ValueError, "value"),
    "w_q_shape": (lambda a: a.update(w_q=np.zeros((8, 9), f32)), ValueError, "q_proj_weight"),
    "w_q_rows": (lambda a: a.update(w_q=np.zeros((9, 8), f32)), ValueError, "q_proj_weight"),
    "w_k_shape": (lambda a: a.update(w_k=np.zeros((8, 5), f32)), ValueError, "k_proj_weight"),
    "w_v_shape": (lambda a: a.update(w_v=np.zeros((4, 8), f32)), ValueError, "v_proj_weight"),
    "w_out_shape": (lambda a: a.update(w_out=np.zeros((8, 4), f32)), ValueError, "out_proj_weight"),
    "w_q_rank": (lambda a: a.update(w_q=np.zeros((64,), f32)), ValueError, "q_proj_weight"),
    "w_q_f64": (lambda a: a.update(w_q=np.zeros((8, 8))), TypeError, "q_proj_weight"),
    "w_k_fortran": (lambda a: a.update(w_k=np.asfortranarray(a["w_k"])), ValueError, "k_proj_weight"),
    "w_out_misaligned": (lambda a: a.update(w_out=_misaligned(a["w_out"])), ValueError, "out_proj_weight"),
    "b_q_len": (lambda a: a.update(b_q=np.zeros(7, f32)), ValueError, "bias"),
    "b_out_len": (lambda a: a.update(b_out=np.zeros(9, f32)), ValueError, "out_proj_bias"),
    "b_k_rank": (lambda a: a.update(b_k=np.zeros((1, 8), f32)), ValueError, "bias"),
    "b_v_strided": (lambda a: a.update(b_v=np.zeros(16, f32)[::2]), ValueError, "bias"),
    "b_out_int": (lambda a: a.update(b_out=np.zeros(8, np.int32)), TypeError, "out_proj_bias"),
    "bias_k_alone": (lambda a: a.update(bias_k=np.zeros(8, f32)), ValueError, "bias_k"),
    "bias_v_alone": (lambda a: a.update(bias_v=np.zeros(8, f32)), ValueError, "bias_"),
    "bias_k_len": (lambda a: a.update(bias_k=np.zeros(7, f32), bias_v=np.zeros(8, f32)), ValueError, "bias_k"),
    "static_k_shape": (lambda a: a.update(static_k=np.zeros((2, 2, 7, 3), f32)), ValueError, "static_k"),
    "static_k_rank": (lambda a: a.update(static_k=np.zeros((4, 7, 4), f32)), ValueError, "static_k"),
    "static_v_heads": (lambda a: a.update(static_v=np.zeros((2, 3, 7, 4), f32)), ValueError, "static_v"),
    "static_with_bias": (lambda a: a.update(static_k=np.zeros((2, 2, 7, 4), f32), bias_k=np.zeros(8, f32), bias_v=np.zeros(8, f32)), ValueError, "bias_k"),
    "static_lengths": (lambda a: a.update(static_k=np.zeros((2, 2, 9, 4), f32), attn_mask=None, key_padding_mask=None), ValueError, "length"),
    "mask_shape": (lambda a: a.update(attn_mask=np.zeros((2, 2, 5, 6), f32)), ValueError, "mask"),
    "kpm_shape": (lambda a: a.update(key_padding_mask=np.zeros((2, 1, 5, 7), f32)), ValueError, "mask"),
    "mask_rank": (lambda a: a.update(attn_mask=np.zeros((5, 7), f32)), ValueError, "attn_mask"),
    "mask_bool": (lambda a: a.update(attn_mask=np.zeros((2, 2, 5, 7), bool)), TypeError, "attn_mask"),
    "query_misaligned": (lambda a: a.update(query=_misaligned(a["query"])), ValueError, "query"),
    "key_last_strided": (lambda a: a.update(key=np.zeros((2, 7, 16), f32)[..., ::2]), ValueError, "key"),
    "w_q_none": (lambda a: a.update(w_q=None), TypeError, None),
}


@pytest.mark.parametrize("case", list(CORE_MHA_BAD))
def test_core_mha_rejects(case):
    mutate, exc, match = CORE_MHA_BAD[case]
    a = core_mha_args()
    mutate(a)
    with pytest.raises(exc, match=match):
        core_mha(**a)


def test_core_never_crashes_on_malformed_calls():
    """Hundreds of malformed direct calls in a child process: each raises, none crashes."""
    script = textwrap.dedent(
        r"""
        import itertools, sys
        import numpy as np
        from attnx import _core, _testing

        rng = np.random.default_rng(7)
        options = _core.SdpaOptions(False, False, 0.5, -1, -1, False)
        shapes = [(), (0,), (3,), (2, 3), (1, 2, 3), (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 5, 4),
                  (2, 3, 7, 4), (1, 3, 5, 8), (2, 1, 7, 8), (2, 3, 0, 8), (0, 3, 5, 8), (2, 3, 5, 0)]
        dtypes = [np.float32, np.float64, np.int32]
        def arr(shape, dtype):
            return np.asarray(rng.standard_normal(shape)).astype(dtype)
        calls = ok = 0
        for qs, ks, vs in itertools.product(shapes[3:], repeat=3):
            for dt in (np.float32, np.float64):
                q, k, v = arr(qs, dt), arr(ks, dt), arr(vs, dt)
                for out_shape in [(2, 3, 5, 4), (2, 3, 5, 8), qs]:
                    out = np.zeros(out_shape, dt)
                    for mask in (None, np.zeros((2, 3, 5, 7), dt), np.zeros(qs, dt)):
                        calls += 1
                        try:
                            _testing.run_sdpa(q, k, v, mask, options, out, None)
                            ok += 1
                        except (TypeError, ValueError):
                            pass
        for n_heads in (-1, 0, 1, 2, 3, 8):
            for qs in [(2, 5, 8), (2, 5, 6), (5, 8), (2, 0, 8), (0, 5, 8)]:
                for ks in [(2, 7, 8), (2, 7, 5), (3, 7, 8), (2, 0, 8)]:
                    for ws in [(8, 8), (6, 6), (8, 5), (8,)]:
                        for st in [None, (2, 2, 7, 4), (2, 2, 9, 4), (2, 2, 7, 3)]:
                            for need_weights in (False, True):
                                f = np.float32
                                q, k = arr(qs, f), arr(ks, f)
                                statics = (None, None) if st is None else (arr(st, f), arr(st, f))
                                options = _core.MhaOptions(False, False, need_weights, True, True)
                                for route in ("core", "canonical"):
                                    calls += 1
                                    try:
                                        w = _core.MhaWeights(n_heads, (arr(ws, f), arr(ws, f), arr(ws, f)), None,
                                                             (arr(ws, f), None), None, False, np.dtype(f))
                                        if route == "core":
                                            _testing.run_mha(w, (q, k, k, None, None) + statics, options)
                                        else:
                                            _core.mha(w, q, k, k, (None, None) + statics, options)
                                        ok += 1
                                    except (TypeError, ValueError):
                                        pass
        print(calls, ok)
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(attnx.__file__)), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"crashed or raised (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    calls, ok = map(int, proc.stdout.split())
    assert calls > 1000 and 0 < ok < calls


def test_sdpa_mask_of_higher_rank_than_the_scores():
    # Found by the fuzzer: a (1, 1, S) mask for an unbatched (L, E) query was accepted.
    q, k, v = np.ones((1, 3), f32), np.ones((129, 3), f32), np.ones((129, 17), f32)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(1, 1, 129\).*\(1, 129\)"):
        sdpa(q, k, v, np.zeros((1, 1, 129), f32))
