"""Memory layouts: every array argument of both functions, in every layout, gives the result
of its C-contiguous twin.

Layouts: strided (every axis, or all but the last), Fortran-ordered, transposed storage,
negative strides, misaligned (data at byte offset 1), strides that are not a multiple of the
item size, big-endian, read-only, and broadcast (stride 0 on the first or the last axis).
attnx reads what it can in place and copies the rest; either way the numbers must be the ones
of the contiguous call (bit for bit) and of the reference. Broadcast masks are never expanded.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from conftest import (
    DTYPE_IDS,
    DTYPES,
    VARIANT_NAMES,
    assert_close,
    assert_identical,
    layout_variant,
    mha_args,
    num_threads,
    output_atol,
    peak_traced_bytes,
    randn,
    ref_mha,
    ref_sdpa,
    sdpa_mask,
    mha_mask,
)

sdpa = attnx.scaled_dot_product_attention
mha = attnx.multi_head_attention_forward

# Every layout in float32; the byte-level ones (order, alignment, odd strides) in float64 too.
BYTE_LEVEL = ("misaligned", "odd_byte_strides", "big_endian", "broadcast_lead")
LAYOUT_CASES = [pytest.param(v, np.float32, id=f"{v}-f32") for v in VARIANT_NAMES] + [
    pytest.param(v, np.float64, id=f"{v}-f64") for v in VARIANT_NAMES if v in BYTE_LEVEL
]


# ---------------------------------------------------------------------------------------------
# sdpa
# ---------------------------------------------------------------------------------------------

SDPA_ARGS = ["query", "key", "value", "attn_mask_bool", "attn_mask_float", "attn_mask_float_1H1S"]


def sdpa_inputs(rng, dtype, which):
    B, H, L, S, E, Ev = 2, 3, 33, 130, 16, 8
    inputs = {
        "query": randn(rng, (B, H, L, E), dtype),
        "key": randn(rng, (B, H, S, E), dtype),
        "value": randn(rng, (B, H, S, Ev), dtype),
    }
    if which == "attn_mask_bool":
        inputs["attn_mask"] = sdpa_mask(rng, "bool", (B, H, L, S))
    elif which == "attn_mask_float":
        inputs["attn_mask"] = sdpa_mask(rng, "float", (B, H, L, S), dtype)
    elif which == "attn_mask_float_1H1S":
        inputs["attn_mask"] = sdpa_mask(rng, "float", (1, H, 1, S), dtype)
    return inputs


@pytest.mark.parametrize("variant,dtype", LAYOUT_CASES)
@pytest.mark.parametrize("which", SDPA_ARGS)
def test_sdpa_layouts(rng, which, variant, dtype):
    inputs = sdpa_inputs(rng, dtype, which)
    name = "attn_mask" if which.startswith("attn_mask") else which
    pair = layout_variant(inputs[name], variant)
    assert pair is not None or inputs[name].dtype == np.bool_
    if pair is None:
        pair = layout_variant(inputs[name], "strided_all")  # (bool: big-endian etc. do not exist)
    base, var = pair
    expected = sdpa(**{**inputs, name: base})
    actual = sdpa(**{**inputs, name: var})
    assert_identical(actual, expected, err_msg=f"{name} as {variant}")
    assert_close(actual, ref_sdpa(**{**inputs, name: base}), dtype)
    # The same with the causal rule / GQA where they apply (no mask allowed with is_causal).
    if name != "attn_mask":
        assert_identical(sdpa(**{**inputs, name: var}, is_causal=True), sdpa(**{**inputs, name: base}, is_causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_sdpa_all_arguments_in_one_layout(rng, variant, dtype):
    inputs = sdpa_inputs(rng, dtype, "attn_mask_float")
    pairs = {name: layout_variant(x, variant) for name, x in inputs.items()}
    base = {name: p[0] for name, p in pairs.items()}
    var = {name: p[1] for name, p in pairs.items()}
    assert_identical(sdpa(**var), sdpa(**base))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", ["strided_all", "fortran", "negative", "misaligned", "big_endian"])
def test_sdpa_plain_and_gqa_layouts(rng, variant, dtype):
    q = randn(rng, (40, 17), dtype)
    k = randn(rng, (150, 17), dtype)
    v = randn(rng, (150, 5), dtype)
    for name in ("q", "k", "v"):
        args = {"q": q, "k": k, "v": v}
        base, var = layout_variant(args[name], variant)
        assert_identical(sdpa(*{**args, name: var}.values()), sdpa(*{**args, name: base}.values()))
    q4 = randn(rng, (2, 4, 40, 16), dtype)
    k4 = randn(rng, (2, 2, 150, 16), dtype)
    v4 = randn(rng, (2, 2, 150, 8), dtype)
    base, var = layout_variant(k4, variant)
    assert_identical(sdpa(q4, var, v4, enable_gqa=True), sdpa(q4, base, v4, enable_gqa=True))


def at_byte_offset(x, offset, row_pad=0):
    """A copy of x starting `offset` bytes past a cache line (a multiple of the item size), its
    last axis padded by row_pad elements (rows that do not start on lines even when the first
    does)."""
    x = np.asarray(x)
    padded_shape = x.shape[:-1] + (x.shape[-1] + row_pad,)
    size = int(np.prod(padded_shape)) * x.itemsize
    buf = np.zeros(size + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    y = np.frombuffer(buf.data, x.dtype, count=int(np.prod(padded_shape)), offset=start)
    y = y.reshape(padded_shape)[..., : x.shape[-1]]
    y[...] = x
    assert y.ctypes.data % 64 == offset
    return y


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("Ev", [64, 40])
def test_values_anywhere_in_memory_give_the_same_bits(rng, Ev, dtype):
    """The query tiles read value rows that do not start on cache lines from a copy whose rows do
    (where a head has five tiles or more; four with 32-byte vectors): every offset of the values,
    rows padded or not, on one thread or two, gives the bits of values that start on a line."""
    B, Hq, Hk, L, S, E = 2, 4, 2, 130, 300, 64
    q, k = randn(rng, (B, Hq, L, E), dtype), randn(rng, (B, Hk, S, E), dtype)
    v = randn(rng, (B, Hk, S, Ev), dtype)
    mask = sdpa_mask(rng, "bool", (B, 1, L, S))
    calls = [dict(enable_gqa=True), dict(enable_gqa=True, is_causal=True),
             dict(enable_gqa=True, attn_mask=mask)]
    on_line = at_byte_offset(v, 0)
    expected = [sdpa(q, k, on_line, **kw) for kw in calls]
    for kw, want in zip(calls, expected):
        assert_close(want, ref_sdpa(q, k, v, **kw), dtype)
    item = np.dtype(dtype).itemsize
    for offset in range(0, 64, item):
        for row_pad in (0, 3):
            moved = at_byte_offset(v, offset, row_pad)
            for threads in (1, 2):
                with num_threads(threads):
                    for kw, want in zip(calls, expected):
                        assert_identical(sdpa(q, k, moved, **kw), want,
                                         err_msg=f"offset {offset}, row_pad {row_pad}, {threads} threads, {kw.keys()}")
    # A batch of values broadcast (stride 0) and a head of them at an offset.
    shared = at_byte_offset(v[:1], 16)
    assert_identical(sdpa(q, k, np.broadcast_to(shared, v.shape), enable_gqa=True),
                     sdpa(q, k, np.broadcast_to(v[:1], v.shape), enable_gqa=True))


def test_sdpa_transposed_key_view(rng):
    # A key that is the transpose of a (E, S) array: the last dimension has stride S.
    q = randn(rng, (2, 9, 16), np.float32)
    kt = randn(rng, (2, 16, 40), np.float32)
    v = randn(rng, (2, 40, 8), np.float32)
    k = kt.swapaxes(-1, -2)
    assert_identical(sdpa(q, k, v), sdpa(q, np.ascontiguousarray(k), v))


# ---------------------------------------------------------------------------------------------
# multi_head_attention_forward
# ---------------------------------------------------------------------------------------------

MHA_ARGS = [
    "query", "key", "value", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
    "out_proj_weight", "out_proj_bias", "key_padding_mask_bool", "key_padding_mask_float",
    "attn_mask_bool", "attn_mask_float", "attn_mask_float3", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "static_k", "static_v",
]


def mha_inputs(rng, dtype, which, batch_first=False):
    N, H, L, S, E = 2, 2, 9, 11, 8
    if which in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, kdim=5, vdim=6, dtype=dtype, batch_first=batch_first)
    elif which in ("static_k", "static_v"):
        args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, add_zero_attn=True, batch_first=batch_first)
        args["static_k"] = randn(rng, (N * H, 13, E // H), dtype)
        args["static_v"] = randn(rng, (N * H, 13, E // H), dtype)
        S = 13
    else:
        args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, bias_kv=True, batch_first=batch_first)
    if which.startswith("attn_mask"):
        kind = "bool" if which.endswith("bool") else "float"
        shape = (N * H, L, S) if which.endswith("3") else (L, S)
        args["attn_mask"] = mha_mask(rng, kind, shape, dtype)
    else:
        args["attn_mask"] = mha_mask(rng, "float", (L, S), dtype)
    kind = "bool" if which != "key_padding_mask_float" else "float"
    args["key_padding_mask"] = mha_mask(rng, kind, (N, S), dtype)
    args["average_attn_weights"] = False
    return args


@pytest.mark.parametrize("variant,dtype", LAYOUT_CASES)
@pytest.mark.parametrize("which", MHA_ARGS)
def test_mha_layouts(rng, which, variant, dtype):
    args = mha_inputs(rng, dtype, which)
    name = which.rsplit("_", 1)[0] if which.endswith(("_bool", "_float", "_float3")) else which
    name = "attn_mask" if name.startswith("attn_mask") else name
    pair = layout_variant(args[name], variant)
    if pair is None:  # bool masks have no byte order or alignment
        pair = layout_variant(args[name], "strided_all")
    base, var = pair
    expected = mha(**{**args, name: base})
    actual = mha(**{**args, name: var})
    for a, b, what in zip(actual, expected, ("output", "weights")):
        assert_identical(a, b, err_msg=f"{what}: {name} as {variant}")
    ref_out, ref_w = ref_mha(**{**args, name: base})
    assert_close(actual[0], ref_out, dtype, atol=output_atol(args, ref_out, dtype))
    assert_close(actual[1], ref_w, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_mha_all_arguments_in_one_layout(rng, variant, batch_first, dtype):
    args = mha_inputs(rng, dtype, "attn_mask_float3", batch_first=batch_first)
    base, var = dict(args), dict(args)
    for name, x in args.items():
        if isinstance(x, np.ndarray):
            pair = layout_variant(x, variant) or layout_variant(x, "negative")
            base[name], var[name] = pair
    for a, b in zip(mha(**var), mha(**base)):
        assert_identical(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mha_query_views_of_one_buffer(rng, dtype):
    # Self-attention on slices of one packed (L, N, 3E) buffer: strided, overlapping reads.
    L, N, E = 9, 2, 8
    buf = randn(rng, (L, N, 3 * E), dtype)
    args = mha_args(rng, L=L, S=L, N=N, E=E, dtype=dtype)
    views = {"query": buf[..., :E], "key": buf[..., E:2 * E], "value": buf[..., 2 * E:]}
    copies = {k: np.ascontiguousarray(v) for k, v in views.items()}
    for a, b in zip(mha(**{**args, **views}), mha(**{**args, **copies})):
        assert_identical(a, b)
    # The whole buffer doubles as query, key and value when E matches: one array, three roles.
    same = buf[..., :E]
    for a, b in zip(mha(**{**args, "query": same, "key": same, "value": same}),
                    mha(**{**args, "query": same.copy(), "key": same.copy(), "value": same.copy()})):
        assert_identical(a, b)


# ---------------------------------------------------------------------------------------------
# Broadcast masks are not expanded
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize(
    "q_lead,mask_shape",
    [
        ((8, 4), (1, 4, 1, 256)),
        ((8, 4), (4, 1, 256)),
        ((8, 4), (256,)),
        ((8, 4), (8, 1, 1, 256)),
        ((8, 4), (8, 4, 1, 256)),
        ((2, 4, 4), (1, 1, 4, 1, 256)),
        ((2, 4, 4), (4, 1, 1, 256)),
        ((2, 4, 4), (2, 1, 1, 1, 256)),
    ],
)
def test_sdpa_broadcast_mask_is_not_expanded(rng, q_lead, mask_shape, kind, dtype):
    L, S, E, Ev = 128, 256, 8, 4
    q = randn(rng, q_lead + (L, E), dtype)
    k = randn(rng, q_lead + (S, E), dtype)
    v = randn(rng, q_lead + (S, Ev), dtype)
    mask = sdpa_mask(rng, kind, mask_shape, dtype)
    out = np.empty(q_lead + (L, Ev), dtype)
    expanded = int(np.prod(q_lead)) * L * S * np.dtype(dtype).itemsize
    result, peak = peak_traced_bytes(lambda: sdpa(q, k, v, attn_mask=mask, out=out))
    assert result is out
    assert peak < expanded // 8, f"{peak} bytes allocated; the expanded mask is {expanded}"
    # and the numbers are those of the expanded mask
    full = np.ascontiguousarray(np.broadcast_to(mask, q_lead + (L, S)))
    assert_identical(out, sdpa(q, k, v, attn_mask=full))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mha_masks_are_not_expanded(rng, kind, dtype):
    N, L, S, E, H = 16, 128, 512, 8, 4
    args = mha_args(rng, L=L, S=S, N=N, E=E, H=H, dtype=dtype, need_weights=False, batch_first=True)
    args["key_padding_mask"] = mha_mask(rng, kind, (N, S), dtype)
    args["attn_mask"] = mha_mask(rng, kind, (L, S), dtype)
    expanded = N * H * L * S * np.dtype(dtype).itemsize
    (out, _), peak = peak_traced_bytes(lambda: mha(**args))
    # The output and the projections are allocated; an (N, H, L, S) mask must not be.
    assert peak < expanded // 8, f"{peak} bytes allocated; an expanded mask is {expanded}"
    ref_out, _ = ref_mha(**args)
    assert_close(out, ref_out, dtype)
