"""Property-based tests: attnx against the float64 reference over the whole input space.

Hypothesis draws a *case*: a plain dict of sizes, flags, layouts and a seed, from which
``build_*`` makes the arrays. Every case is checked the same way:

* the result agrees with ``attnx.reference`` (float64, on float64 copies) to the contract's
  tolerances, NaN and +-inf exactly where the reference has them;
* no input is modified, and no result shares memory with an input (unless passed as ``out=``);

over shapes (batch dims that broadcast, L and S around every size the drivers switch on,
empty dims), strides (every layout of ``conftest.layout_variant``: strided, Fortran,
negative, misaligned, odd byte strides, big-endian, read-only, broadcast), dtypes
(float32/float64 queries, other float inputs converted), masks (bool/float, any
broadcastable shape, fully masked rows), NaN/Inf values, and every option of sdpa,
multi_head_attention_forward and MultiheadAttention (its state_dict round trip included).

Cases are drawn as dicts so that a minimal failing case hypothesis shrinks to can be kept,
as it printed, in an ``@example`` (the regression cases below each carry the bug they
caught). The default run draws a few dozen cases per property; Hypothesis' profile ``thorough``
(``--hypothesis-profile=thorough``, as ``.ci/harden`` runs them) draws thousands. The number of cases run is recorded (see _hardening.py).
"""

from __future__ import annotations

import math
import pickle

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import example, given

import attnx
from _hardening import hypothesis_settings, record
from conftest import (
    core_sdpa,
    BROADCAST_VARIANTS,
    SAME_VALUE_VARIANTS,
    assert_close,
    ref_mha,
    ref_sdpa,
)

pytestmark = pytest.mark.hardening

LAYOUTS = ["c"] + list(SAME_VALUE_VARIANTS) + list(BROADCAST_VARIANTS)
DTYPE_NAMES = ["float32", "float64"]
# Sizes on both sides of what the drivers switch on: vector widths and query tiles (8, 16,
# 32), key blocks (32 .. 256), the row path's decode chunks (512 keys).
L_SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65]
S_SIZES = [0, 1, 2, 5, 16, 31, 32, 33, 127, 128, 129, 255, 256, 257, 511, 512, 513, 700, 1030]
E_SIZES = [1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 64, 65]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def relayout(a, name):
    """The values of ``a`` (a fresh array) in layout ``name``; C order where it does not apply."""
    a = np.ascontiguousarray(a)
    if name == "c" or a.size == 0:
        return a
    if name in BROADCAST_VARIANTS:
        axis = 0 if name == "broadcast_lead" else -1
        if a.shape[axis] == 0:
            return a
        return BROADCAST_VARIANTS[name](a)[1]
    if a.dtype == np.bool_ and name in ("big_endian", "misaligned", "odd_byte_strides"):
        return a
    return SAME_VALUE_VARIANTS[name](a)


def snapshot(arrays):
    """Bytes and layout of every ndarray argument, to prove later that none was modified."""
    return {k: (np.array(v, copy=True), v.strides) for k, v in arrays.items() if isinstance(v, np.ndarray)}


def assert_untouched(arrays, snap):
    for name, (copy, strides) in snap.items():
        now = arrays[name]
        assert now.strides == strides, f"{name}: strides changed"
        assert now.dtype == copy.dtype and now.shape == copy.shape
        same = np.ascontiguousarray(now).view(np.uint8) == np.ascontiguousarray(copy).view(np.uint8)
        assert same.all(), f"input {name} was modified"


def assert_no_shared_memory(results, arrays, allowed=()):
    for r in results:
        if r is None:
            continue
        for name, x in arrays.items():
            if isinstance(x, np.ndarray) and name not in allowed:
                assert not np.shares_memory(r, x), f"a result shares memory with {name}"


def values(rng, shape, dtype, special=None):
    """Standard normal values; ``special`` = (value, count) puts that value at random places."""
    a = rng.standard_normal(shape)
    if special is not None and a.size:
        value, count = special
        flat = a.reshape(-1)
        flat[rng.integers(0, a.size, size=count)] = value
    return a.astype(dtype)


def run_property(prop, name):
    """Runs a hypothesis property and records how many cases it ran."""
    prop.calls = 0
    prop()
    record(name, hypothesis_examples=prop.calls)
    assert prop.calls > 0


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------


@st.composite
def sdpa_cases(draw):
    """A case of sdpa: sizes, the rank of each operand, broadcasting, mask, options, layouts."""
    size_class = draw(st.sampled_from(["small", "tile", "long"]))
    if size_class == "small":
        lead = draw(st.lists(st.integers(0, 3), max_size=2))
        L, S = draw(st.sampled_from(L_SIZES[:10])), draw(st.sampled_from(S_SIZES[:8]))
    elif size_class == "tile":
        lead = draw(st.lists(st.integers(1, 2), max_size=1))
        L, S = draw(st.sampled_from(L_SIZES)), draw(st.sampled_from(S_SIZES[:15]))
    else:  # decoding: few queries, long key rows (the chunked row path)
        lead = draw(st.lists(st.integers(1, 2), max_size=1))
        L, S = draw(st.sampled_from([1, 2, 3, 5])), draw(st.sampled_from(S_SIZES[10:]))
    Hk = draw(st.integers(1, 3))
    gqa = draw(st.booleans())
    group = draw(st.integers(1, 3)) if gqa else 1
    E = draw(st.sampled_from(E_SIZES))
    Ev = draw(st.sampled_from(E_SIZES))
    full = tuple(lead) + (Hk * group,)
    # How many batch dims each operand has (a suffix of `full`), and which are broadcast (1).
    ranks, ones = {}, {}
    for name in ("query", "key", "value"):
        ranks[name] = len(full) if gqa else draw(st.integers(0, len(full)))
        ones[name] = [False if (gqa and d == len(full) - 1) else draw(st.booleans())
                      for d in range(ranks[name])]
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    # A mask broadcasts to the scores (out batch dims, L, S); it may have fewer dims.
    mask_rank = draw(st.integers(0, max(ranks.values()) + 2))
    mask_ones = [draw(st.booleans()) for _ in range(mask_rank)]
    causal = mask_kind is None and draw(st.booleans())
    return dict(
        dtype=draw(st.sampled_from(DTYPE_NAMES)),
        kv_dtype=draw(st.sampled_from([None, None, "float16", "float32", "float64"])),
        lead=tuple(lead), Hk=Hk, group=group, gqa=gqa, L=L, S=S, E=E, Ev=Ev,
        ranks=ranks, ones=ones,
        mask_kind=mask_kind, mask_ones=mask_ones, masked_fraction=draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])),
        causal=causal,
        # A multiple of 1/sqrt(E) (None: the default): logits stay well-scaled, as the
        # contract's tolerances assume (large logits are test_stress.py's business).
        scale=draw(st.one_of(st.none(), st.floats(-1.25, 1.25, width=32))),
        out=draw(st.booleans()),
        layouts={n: draw(st.sampled_from(LAYOUTS)) for n in ("query", "key", "value", "attn_mask")},
        special=draw(st.sampled_from([None] * 6 + ["query", "key", "value", "attn_mask"])),
        special_value=draw(st.sampled_from([np.nan, np.inf, -np.inf])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def build_sdpa(case):
    rng = np.random.default_rng(case["seed"])
    dtype = np.dtype(case["dtype"])
    kv_dtype = np.dtype(case["kv_dtype"] or case["dtype"])
    full = case["lead"] + (case["Hk"] * case["group"],)
    L, S, E, Ev = case["L"], case["S"], case["E"], case["Ev"]

    def batch(name, heads):
        dims = list(full[len(full) - case["ranks"][name]:])
        if case["gqa"]:
            dims[-1] = heads
        return tuple(1 if one else n for n, one in zip(dims, case["ones"][name]))

    special = lambda name: (case["special_value"], 2) if case["special"] == name else None  # noqa: E731
    arrays = {
        "query": values(rng, batch("query", full[-1]) + (L, E), dtype, special("query")),
        "key": values(rng, batch("key", case["Hk"]) + (S, E), kv_dtype, special("key")),
        "value": values(rng, batch("value", case["Hk"]) + (S, Ev), kv_dtype, special("value")),
    }
    scale = None if case["scale"] is None else case["scale"] / math.sqrt(E)
    kwargs = {"is_causal": case["causal"], "scale": scale, "enable_gqa": case["gqa"]}
    if case["mask_kind"]:
        batches = [arrays[n].shape[:-2] for n in ("query", "key", "value")]
        if case["gqa"]:
            out_batch = np.broadcast_shapes(*(b[:-1] for b in batches)) + (full[-1],)
        else:
            out_batch = np.broadcast_shapes(*batches)
        scores = out_batch + (L, S)
        dims = scores[max(len(scores) - len(case["mask_ones"]), 0):]
        shape = tuple(1 if one else n for n, one in zip(dims, case["mask_ones"]))
        hidden = rng.random(shape) < case["masked_fraction"]
        if case["mask_kind"] == "bool":
            mask = ~hidden
        else:
            mask = values(rng, shape, dtype, special("attn_mask"))
            mask[hidden] = -np.inf
        arrays["attn_mask"] = mask
    for name in ("query", "key"):
        if case["layouts"][name] == "broadcast_last":
            # E equal values: q.k would be sqrt(E) times larger than for independent ones.
            arrays[name] = (arrays[name] / np.sqrt(E)).astype(arrays[name].dtype)
    arrays = {n: relayout(a, case["layouts"][n]) for n, a in arrays.items()}
    return arrays, kwargs


def check_sdpa(case):
    arrays, kwargs = build_sdpa(case)
    dtype = np.dtype(case["dtype"])
    snap = snapshot(arrays)
    with np.errstate(all="ignore"):
        expected = ref_sdpa(**arrays, **kwargs)
    out = np.empty(expected.shape, dtype) if case["out"] else None
    with np.errstate(all="ignore"):
        got = attnx.scaled_dot_product_attention(**arrays, **kwargs, out=out)
    if out is not None:
        assert got is out
    assert_close(got, expected, dtype)
    assert_untouched(arrays, snap)
    assert_no_shared_memory([got], arrays)


@hypothesis_settings()
@given(sdpa_cases())
def sdpa_property(case):
    sdpa_property.calls += 1
    check_sdpa(case)


def test_sdpa_matches_reference():
    run_property(sdpa_property, "properties: sdpa")


# ---------------------------------------------------------------------------------------------
# multi_head_attention_forward
# ---------------------------------------------------------------------------------------------


@st.composite
def mha_cases(draw):
    H = draw(st.integers(1, 4))
    hd = draw(st.sampled_from([1, 2, 3, 4, 8]))
    E = H * hd
    kdim = draw(st.sampled_from([E, E, 1, 5, 9]))
    vdim = draw(st.sampled_from([E, E, 2, 7]))
    static = draw(st.sampled_from([None, None, "k", "v", "kv"]))
    bias_kv = static is None and draw(st.booleans())
    return dict(
        dtype=draw(st.sampled_from(DTYPE_NAMES)),
        other_dtype=draw(st.sampled_from([None, None, "float16", "float32", "float64"])),
        H=H, E=E, kdim=kdim, vdim=vdim,
        separate=kdim != E or vdim != E or draw(st.booleans()),
        N=draw(st.integers(0, 3)), L=draw(st.sampled_from([0, 1, 2, 5, 9, 17, 33])),
        S=draw(st.sampled_from([0, 1, 3, 8, 20, 40])),
        unbatched=draw(st.booleans()), batch_first=draw(st.booleans()),
        in_bias=draw(st.booleans()), out_bias=draw(st.booleans()),
        bias_kv=bias_kv, add_zero_attn=draw(st.booleans()),
        static=static, static_S=draw(st.sampled_from([0, 1, 6])),
        kpm=draw(st.sampled_from([None, "bool", "float"])),
        attn_mask=draw(st.sampled_from([None, "bool2", "float2", "bool3", "float3"])),
        masked_fraction=draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])),
        need_weights=draw(st.booleans()), average=draw(st.booleans()),
        is_causal=draw(st.booleans()),
        dropout_p=draw(st.sampled_from([0.0, 0.0, 0.5])),
        layouts={n: draw(st.sampled_from(LAYOUTS)) for n in
                 ("query", "key", "value", "in_proj_weight", "out_proj_weight", "key_padding_mask",
                  "attn_mask", "static_k", "q_proj_weight", "in_proj_bias")},
        special=draw(st.sampled_from([None] * 8 + ["query", "key", "value", "out_proj_weight"])),
        special_value=draw(st.sampled_from([np.nan, np.inf])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def build_mha(case):
    rng = np.random.default_rng(case["seed"])
    dtype = np.dtype(case["dtype"])
    other = np.dtype(case["other_dtype"] or case["dtype"])
    H, E, N, L, S = case["H"], case["E"], case["N"], case["L"], case["S"]
    if case["unbatched"]:
        N = 1
    hd = E // H
    special = lambda name: (case["special_value"], 1) if case["special"] == name else None  # noqa: E731

    def seq(name, length, dim, dt):
        if case["unbatched"]:
            shape = (length, dim)
        else:
            shape = (N, length, dim) if case["batch_first"] else (length, N, dim)
        return values(rng, shape, dt, special(name))

    def weight(name, rows, cols):
        return values(rng, (rows, cols), other, special(name)) / math.sqrt(max(cols, 1))

    a = dict(
        query=seq("query", L, E, dtype), key=seq("key", S, case["kdim"], other),
        value=seq("value", S, case["vdim"], other),
        embed_dim_to_check=E, num_heads=H, in_proj_weight=None,
        in_proj_bias=values(rng, (3 * E,), other) if case["in_bias"] else None,
        bias_k=values(rng, (1, 1, E), other) if case["bias_kv"] else None,
        bias_v=values(rng, (1, 1, E), other) if case["bias_kv"] else None,
        add_zero_attn=case["add_zero_attn"], dropout_p=case["dropout_p"],
        out_proj_weight=weight("out_proj_weight", E, E),
        out_proj_bias=values(rng, (E,), other) if case["out_bias"] else None,
        training=False, need_weights=case["need_weights"],
        use_separate_proj_weight=case["separate"],
        average_attn_weights=case["average"], is_causal=case["is_causal"],
        batch_first=case["batch_first"],
    )
    if case["separate"]:
        a["q_proj_weight"] = weight("q_proj_weight", E, E)
        a["k_proj_weight"] = weight("k_proj_weight", E, case["kdim"])
        a["v_proj_weight"] = weight("v_proj_weight", E, case["vdim"])
    else:
        a["in_proj_weight"] = weight("in_proj_weight", 3 * E, E)
    # static_k/static_v replace the projected keys/values: both of one length, or one alone
    # of the other's (projected) length S.
    S_src = case["static_S"] if case["static"] == "kv" else S
    for which in case["static"] or "":
        a[f"static_{which}"] = values(rng, (N * H, S_src, hd), other)

    def mask(kind, shape, true_means_masked):
        hidden = rng.random(shape) < case["masked_fraction"]
        if kind.startswith("bool"):
            return hidden if true_means_masked else ~hidden
        m = rng.standard_normal(shape).astype(other)
        m[hidden] = -np.inf
        return m

    if case["kpm"]:
        a["key_padding_mask"] = mask(case["kpm"], (S_src,) if case["unbatched"] else (N, S_src), True)
    if case["attn_mask"]:
        shape = (L, S_src) if case["attn_mask"].endswith("2") else (N * H, L, S_src)
        a["attn_mask"] = mask(case["attn_mask"], shape, True)
    for name, layout in case["layouts"].items():
        if isinstance(a.get(name), np.ndarray):
            a[name] = relayout(a[name], layout)
    return a


def check_mha(case):
    args = build_mha(case)
    dtype = np.dtype(case["dtype"])
    snap = snapshot(args)
    with np.errstate(all="ignore"):
        expected = ref_mha(**args)
        out, weights = attnx.multi_head_attention_forward(**args)
    assert_close(out, expected[0], dtype, err_msg="attn_output")
    if case["need_weights"]:
        assert_close(weights, expected[1], dtype, err_msg="attn_weights")
        assert not np.shares_memory(out, weights)
    else:
        assert weights is None
    assert_untouched(args, snap)
    assert_no_shared_memory([out, weights], args)


@hypothesis_settings()
@given(mha_cases())
def mha_property(case):
    mha_property.calls += 1
    check_mha(case)


def test_mha_matches_reference():
    run_property(mha_property, "properties: multi_head_attention_forward")


# ---------------------------------------------------------------------------------------------
# MultiheadAttention: every constructor option, forward options, state_dict, pickling
# ---------------------------------------------------------------------------------------------


@st.composite
def module_cases(draw):
    H = draw(st.integers(1, 4))
    E = H * draw(st.sampled_from([1, 2, 4, 8]))
    return dict(
        E=E, H=H, bias=draw(st.booleans()), add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        kdim=draw(st.sampled_from([None, E, 3, 10])), vdim=draw(st.sampled_from([None, E, 2, 6])),
        batch_first=draw(st.booleans()), dtype=draw(st.sampled_from(DTYPE_NAMES)),
        input_dtype=draw(st.sampled_from([None, "float16", "float32", "float64"])),
        N=draw(st.integers(0, 3)), L=draw(st.sampled_from([0, 1, 4, 13, 40])),
        S=draw(st.sampled_from([0, 1, 5, 21])), unbatched=draw(st.booleans()),
        self_attention=draw(st.booleans()),
        kpm=draw(st.sampled_from([None, "bool", "float"])),
        attn_mask=draw(st.sampled_from([None, "bool2", "float2", "bool3"])),
        need_weights=draw(st.booleans()), average=draw(st.booleans()),
        is_causal=draw(st.booleans()),
        layouts={n: draw(st.sampled_from(LAYOUTS)) for n in ("query", "key", "value")},
        state_as=draw(st.sampled_from(["numpy", "list", "float16", "float64", "fortran"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def check_module(case):
    rng = np.random.default_rng(case["seed"])
    E, H, N, L, S = case["E"], case["H"], case["N"], case["L"], case["S"]
    m = attnx.MultiheadAttention(
        E, H, bias=case["bias"], add_bias_kv=case["add_bias_kv"], add_zero_attn=case["add_zero_attn"],
        kdim=case["kdim"], vdim=case["vdim"], batch_first=case["batch_first"],
        dtype=np.dtype(case["dtype"]), seed=case["seed"],
    )
    kdim = E if case["kdim"] is None else case["kdim"]
    vdim = E if case["vdim"] is None else case["vdim"]
    in_dtype = np.dtype(case["input_dtype"] or case["dtype"])
    if case["self_attention"] and kdim == E and vdim == E:
        S = L

    def seq(length, dim):
        if case["unbatched"]:
            return rng.standard_normal((length, dim)).astype(in_dtype)
        shape = (N, length, dim) if case["batch_first"] else (length, N, dim)
        return rng.standard_normal(shape).astype(in_dtype)

    query = seq(L, E)
    if case["self_attention"] and kdim == E and vdim == E:
        key = value = query
    else:
        key, value = seq(S, kdim), seq(S, vdim)
    inputs = {"query": relayout(query, case["layouts"]["query"])}
    inputs["key"] = inputs["query"] if key is query else relayout(key, case["layouts"]["key"])
    inputs["value"] = inputs["key"] if value is key else relayout(value, case["layouts"]["value"])
    opts = dict(need_weights=case["need_weights"], average_attn_weights=case["average"],
                is_causal=case["is_causal"])
    nb = 1 if case["unbatched"] else N
    if case["kpm"]:
        hidden = rng.random((S,) if case["unbatched"] else (nb, S)) < 0.3
        opts["key_padding_mask"] = hidden if case["kpm"] == "bool" else np.where(hidden, -np.inf, 0.5)
    if case["attn_mask"]:
        shape = (L, S) if case["attn_mask"].endswith("2") else (nb * H, L, S)
        hidden = rng.random(shape) < 0.3
        opts["attn_mask"] = hidden if case["attn_mask"].startswith("bool") else np.where(hidden, -np.inf, -0.25)

    # Parameters: non-zero biases, so that every parameter matters.
    sd = m.state_dict()
    for k in sd:
        sd[k] = rng.standard_normal(sd[k].shape) / math.sqrt(E)
    converted = {
        "numpy": lambda x: x,
        "list": lambda x: x.tolist(),
        "float16": lambda x: x.astype(np.float16),
        "float64": lambda x: x.astype(np.float64),
        "fortran": np.asfortranarray,
    }[case["state_as"]]
    given_sd = {k: converted(v) for k, v in sd.items()}
    sd_snap = snapshot(given_sd)
    assert m.load_state_dict(given_sd) == ([], [])
    assert_untouched(given_sd, sd_snap)
    loaded = m.state_dict()
    for k, v in loaded.items():  # what was loaded is what was given, in the module's dtype
        assert v.dtype == np.dtype(case["dtype"])
        np.testing.assert_array_equal(v, np.asarray(given_sd[k], dtype=np.float64).astype(v.dtype))
        for x in given_sd.values():
            if isinstance(x, np.ndarray):
                assert not np.shares_memory(v, x)

    arrays = {**inputs, **{k: v for k, v in opts.items() if isinstance(v, np.ndarray)}}
    snap = snapshot(arrays)
    with np.errstate(all="ignore"):
        out, weights = m(inputs["query"], inputs["key"], inputs["value"], **opts)
    params = {attr: getattr(m, attr) for attr in
              ("in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj_weight", "out_proj_bias",
               "q_proj_weight", "k_proj_weight", "v_proj_weight")}
    cast = lambda x: x.astype(m.dtype)  # noqa: E731 - the module converts its inputs first
    expected = ref_mha(
        query=cast(inputs["query"]), key=cast(inputs["key"]), value=cast(inputs["value"]),
        embed_dim_to_check=E, num_heads=H, add_zero_attn=case["add_zero_attn"], dropout_p=0.0,
        training=False, use_separate_proj_weight=params["in_proj_weight"] is None,
        batch_first=case["batch_first"], **params, **opts,
    )
    assert_close(out, expected[0], m.dtype, err_msg="attn_output")
    if case["need_weights"]:
        assert_close(weights, expected[1], m.dtype, err_msg="attn_weights")
    else:
        assert weights is None
    assert_untouched(arrays, snap)
    assert_no_shared_memory([out, weights], {**arrays, **params})

    # A module rebuilt from its state_dict, or unpickled, computes the same numbers.
    twin = attnx.MultiheadAttention(
        E, H, bias=case["bias"], add_bias_kv=case["add_bias_kv"], add_zero_attn=case["add_zero_attn"],
        kdim=case["kdim"], vdim=case["vdim"], batch_first=case["batch_first"],
        dtype=np.dtype(case["dtype"]), seed=case["seed"] + 1,
    )
    twin.load_state_dict(m.state_dict())
    clone = pickle.loads(pickle.dumps(m))
    for other in (twin, clone):
        o2, w2 = other(inputs["query"], inputs["key"], inputs["value"], **opts)
        np.testing.assert_array_equal(o2, out)
        if weights is not None:
            np.testing.assert_array_equal(w2, weights)


# Shrunk by hypothesis: an unbatched (1, 1) query with odd byte strides (see
# test_extent_one_dims_may_have_any_byte_stride).
@example(case={
    "E": 1, "H": 1, "bias": False, "add_bias_kv": False, "add_zero_attn": False, "kdim": None,
    "vdim": None, "batch_first": False, "dtype": "float32", "input_dtype": None, "N": 0, "L": 1,
    "S": 0, "unbatched": True, "self_attention": False, "kpm": None, "attn_mask": None,
    "need_weights": False, "average": False, "is_causal": False,
    "layouts": {"query": "odd_byte_strides", "key": "c", "value": "c"}, "state_as": "numpy", "seed": 0,
})
@hypothesis_settings(0.6)
@given(module_cases())
def module_property(case):
    module_property.calls += 1
    check_module(case)


def test_module_matches_reference():
    run_property(module_property, "properties: MultiheadAttention")


# ---------------------------------------------------------------------------------------------
# MultiheadAttention.step over a KVCache
# ---------------------------------------------------------------------------------------------


@st.composite
def step_cases(draw):
    """A ragged batch decoded by MultiheadAttention.step: a prompt step, then one token at a
    time. Head dims from 1 (embed_dim == num_heads) up, every query layout, float16 storage."""
    H = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 2, 3, 8]))
    B = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 6), min_size=B, max_size=B))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return {
        "H": H, "E": H * head_dim, "lengths": lengths, "dtype": dtype,
        "prompts": [draw(st.integers(1, n)) for n in lengths],
        "layout": draw(st.sampled_from(["seq_first", "batch_first"] + (["unbatched"] if B == 1 else []))),
        "storage": draw(st.sampled_from([dtype, np.float16])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def check_step(case):
    """Each sequence's outputs, decoded step by step, equal one causal forward over it; the
    rows of tokens past a sequence's length in a step are out_proj_bias exactly."""
    rng = np.random.default_rng(case["seed"])
    E, dtype, layout, lengths = case["E"], case["dtype"], case["layout"], case["lengths"]
    B = len(lengths)
    m = attnx.MultiheadAttention(E, case["H"], dtype=dtype, batch_first=layout == "batch_first")
    m.load_state_dict({k: rng.standard_normal(v.shape) / math.sqrt(E) for k, v in m.state_dict().items()})
    sequences = [rng.standard_normal((n, E)).astype(dtype) for n in lengths]
    cache = m.new_cache(B, max(lengths), dtype=case["storage"])
    outputs, pos = [[] for _ in range(B)], [0] * B
    counts = case["prompts"]
    while any(counts):
        T = max(counts)
        x = np.zeros((B, T, E), dtype)
        for b, n in enumerate(counts):
            x[b, :n] = sequences[b][pos[b]:pos[b] + n]
        query = {"batch_first": x, "seq_first": x.transpose(1, 0, 2).copy(), "unbatched": x[0]}[layout]
        y = m.step(query, cache, lengths=np.array(counts))
        y = {"batch_first": y, "seq_first": y.transpose(1, 0, 2) if y.ndim == 3 else y, "unbatched": y[None]}[layout]
        for b, n in enumerate(counts):
            outputs[b].append(y[b, :n])
            np.testing.assert_array_equal(y[b, n:], np.broadcast_to(m.out_proj_bias, y[b, n:].shape))
            pos[b] += n
        counts = [1 if p < n else 0 for p, n in zip(pos, lengths)]
    assert cache.lengths.tolist() == lengths
    tol = dict(rtol=1e-2, atol=1e-2) if case["storage"] == np.float16 else (
        dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12))
    for s, out in zip(sequences, outputs):
        full, _ = m(s, s, s, is_causal=True, need_weights=False)
        np.testing.assert_allclose(np.concatenate(out), full, **tol)


# Found by the fuzzer: heads of one dimension, a batch of one and a prompt of several tokens.
@example({"H": 3, "E": 3, "lengths": [5], "prompts": [3], "layout": "seq_first", "dtype": np.float32,
          "storage": np.float32, "seed": 0})
@hypothesis_settings(0.4)
@given(step_cases())
def step_property(case):
    step_property.calls += 1
    check_step(case)


def test_step_decodes_as_one_causal_forward():
    run_property(step_property, "properties: MultiheadAttention.step")

# ---------------------------------------------------------------------------------------------
# Run on every case of the default suite: one explicit case of each kind, so that the
# builders themselves are known to work (and as templates for regression @examples).
# ---------------------------------------------------------------------------------------------


def test_builders_make_what_the_case_says():
    case = dict(
        dtype="float32", kv_dtype=None, lead=(2,), Hk=1, group=2, gqa=True, L=5, S=7, E=3, Ev=2,
        ranks={"query": 2, "key": 2, "value": 2},
        ones={"query": [False, False], "key": [True, False], "value": [False, False]},
        mask_kind="float", mask_ones=[True, False, False], masked_fraction=0.3, causal=False,
        scale=None, out=True, layouts={"query": "c", "key": "fortran", "value": "negative", "attn_mask": "c"},
        special=None, special_value=np.nan, seed=1,
    )
    arrays, kwargs = build_sdpa(case)
    assert arrays["query"].shape == (2, 2, 5, 3)
    assert arrays["key"].shape == (1, 1, 7, 3) and arrays["key"].flags.f_contiguous
    assert arrays["attn_mask"].shape == (1, 5, 7)
    assert kwargs["enable_gqa"]
    check_sdpa(case)


# ---------------------------------------------------------------------------------------------
# Regressions: minimal failing cases found by the properties and the fuzzer, kept as tests
# ---------------------------------------------------------------------------------------------


def _odd_strided(shape, dtype, value):
    """An array of `shape` filled with `value` whose byte strides are all odd."""
    buf = bytearray(64 + 16 * int(np.prod(shape)) * np.dtype(dtype).itemsize)
    strides = []
    step = 7
    for n in reversed(shape):
        strides.insert(0, step)
        step = step * max(n, 1) + 2
    a = np.ndarray(shape, dtype, buffer=buf, offset=0, strides=tuple(strides))
    a[...] = value
    return a


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_extent_one_dims_may_have_any_byte_stride(dtype):
    """Found by module_property: an unbatched (1, 1) query with odd byte strides.

    NumPy calls an array whose dims all have extent 1 C-contiguous and aligned whatever its
    strides, so the Python layer passed it on as it was, and the core rejected it:
    ``ValueError: query: strides are not a multiple of the item size`` from a valid call.
    The stride of an extent-1 dim is never stepped along: the core now ignores it.
    """
    q = _odd_strided((1, 1), dtype, 0.5)
    assert q.flags.c_contiguous and q.flags.aligned and q.strides[0] % q.itemsize
    k = np.linspace(-1, 1, 3, dtype=dtype).reshape(3, 1)
    w1 = _odd_strided((1, 1), dtype, 0.75)  # (E, E) weights with E = 1
    args = dict(embed_dim_to_check=1, num_heads=1, in_proj_weight=None, in_proj_bias=None,
                bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=w1,
                out_proj_bias=None, use_separate_proj_weight=True, q_proj_weight=w1,
                k_proj_weight=w1, v_proj_weight=w1)
    out, w = attnx.multi_head_attention_forward(q, k, k, **args)
    eo, ew = ref_mha(query=q, key=k, value=k, **args)
    assert_close(out, eo, dtype)
    assert_close(w, ew, dtype)

    m = attnx.MultiheadAttention(1, 1, dtype=dtype, seed=0)
    out, w = m(q, k, k)
    eo, ew = ref_mha(query=q.astype(m.dtype), key=k, value=k, embed_dim_to_check=1, num_heads=1,
                     in_proj_weight=m.in_proj_weight, in_proj_bias=m.in_proj_bias, bias_k=None,
                     bias_v=None, add_zero_attn=False, dropout_p=0.0,
                     out_proj_weight=m.out_proj_weight, out_proj_bias=m.out_proj_bias)
    assert_close(out, eo, dtype)

    # The private core, with extent-1 batch/head/row dims strided oddly.
    from attnx import _core

    q4 = _odd_strided((1, 1, 1, 1), dtype, 0.5)
    k4 = np.linspace(-1, 1, 5, dtype=dtype).reshape(1, 1, 5, 1)
    out4 = np.empty((1, 1, 1, 1), dtype)
    core_sdpa(q4, k4, k4, None, False, 1.0, out4, None)
    assert_close(out4, ref_sdpa(q4, k4, k4, scale=1.0), dtype)
