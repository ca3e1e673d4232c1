"""attnx.MultiheadAttention behaves as torch.nn.MultiheadAttention in eval() mode.

Every constructor configuration is converted from a random torch module (with ``from_torch``
and with ``load_state_dict(torch_module.state_dict())``) and must give torch's outputs and
weights, with and without masks, batched and unbatched; the state_dict keys are torch's; the
initial parameters follow torch's distributions; instances pickle; load_state_dict checks keys
and shapes and never aliases the caller's arrays.
"""

import copy
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

import attnx

TOL = {np.float32: {"rtol": 1e-5, "atol": 1e-5}, np.float64: {"rtol": 1e-12, "atol": 1e-12}}
INF = float("inf")

E, H, N, L, S = 16, 4, 3, 5, 7
KDIM, VDIM = 5, 6

# Every constructor option, alone and combined. ``dropout`` is torch-only (attnx is for
# inference) and must not change the eval-mode result.
CONFIGS = {
    "default": {},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "kdim_vdim": {"kdim": KDIM, "vdim": VDIM},
    "kdim_only": {"kdim": KDIM},
    "kdim_eq_embed": {"kdim": E, "vdim": E},
    "batch_first": {"batch_first": True},
    "everything": {
        "bias": False,
        "add_bias_kv": True,
        "add_zero_attn": True,
        "kdim": KDIM,
        "vdim": VDIM,
        "batch_first": True,
        "dropout": 0.1,
    },
    "bias_kv_zero_attn_kdim": {"add_bias_kv": True, "add_zero_attn": True, "kdim": KDIM, "vdim": VDIM},
}
DTYPES = [np.float32, np.float64]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


def torch_dtype(dtype):
    torch = _torch()
    return {np.float32: torch.float32, np.float64: torch.float64}[dtype]


def make_torch_mha(config, dtype, seed=0, num_heads=H):
    """A random torch module in eval mode; its biases (zeros at init) are made random too."""
    torch = _torch()
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, num_heads, dtype=torch_dtype(dtype), **config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    return m.eval()


def attnx_kwargs(config):
    return {k: v for k, v in config.items() if k != "dropout"}


def inputs(rng, config, dtype, batched=True):
    """query, key, value in the module's layout (seq-first, batch-first or unbatched)."""
    kdim, vdim = config.get("kdim", E), config.get("vdim", E)
    if not batched:
        shapes = [(L, E), (S, kdim), (S, vdim)]
    elif config.get("batch_first"):
        shapes = [(N, L, E), (N, S, kdim), (N, S, vdim)]
    else:
        shapes = [(L, N, E), (S, N, kdim), (S, N, vdim)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def make_mask(rng, kind, shape, dtype):
    """A torch-MHA mask (bool: True = may not attend) that leaves key 0 visible to every row."""
    if kind is None:
        return None
    if kind == "bool":
        masked = rng.random(shape) < 0.4
        masked[..., 0] = False
        return masked
    values = rng.standard_normal(shape)
    values[rng.random(shape) < 0.3] = -INF
    values[..., 0] = rng.standard_normal(values[..., 0].shape)
    return values.astype(dtype)


def to_tensor(x):
    torch = _torch()
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


def torch_forward(tm, query, key, value, **options):
    """torch's module on NumPy inputs, under no_grad; tensors back as NumPy (None stays None)."""
    torch = _torch()
    options = {k: to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    q, k, v = (to_tensor(x) for x in (query, key, value))
    with torch.no_grad(), warnings.catch_warnings():
        # torch deprecates mixing bool and float masks; attnx accepts the mix as torch computes it.
        warnings.simplefilter("ignore")
        out, weights = tm(q, k, v, **options)
    return out.numpy(), None if weights is None else weights.numpy()


def assert_same(ours, theirs, dtype):
    if theirs is None:
        assert ours is None
        return
    assert isinstance(ours, np.ndarray)
    assert ours.shape == theirs.shape
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, theirs, **TOL[dtype])


def assert_forward_matches(am, tm, dtype, query, key, value, **options):
    ours = am(query, key, value, **options)
    theirs = torch_forward(tm, query, key, value, **options)
    assert isinstance(ours, tuple) and len(ours) == 2
    assert_same(ours[0], theirs[0], dtype)
    assert_same(ours[1], theirs[1], dtype)
    return ours


def torch_state_numpy(tm):
    return {k: v.detach().numpy() for k, v in tm.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Conversion from torch: weights, keys and outputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", CONFIGS)
def test_from_torch_copies_config_and_weights(name, dtype):
    config = CONFIGS[name]
    tm = make_torch_mha(config, dtype)
    am = attnx.MultiheadAttention.from_torch(tm)
    assert isinstance(am, attnx.MultiheadAttention)
    assert am.dtype == np.dtype(dtype)
    for attr in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "batch_first", "add_zero_attn", "_qkv_same_embed_dim"):
        assert getattr(am, attr) == getattr(tm, attr), attr
    assert am.bias == config.get("bias", True)
    assert am.add_bias_kv == config.get("add_bias_kv", False)

    theirs = torch_state_numpy(tm)
    ours = am.state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].dtype == dtype
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)

    # The attributes under torch's names (out_proj.* as out_proj_*).
    for attr in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k", "bias_v"):
        t = getattr(tm, attr)
        a = getattr(am, attr)
        if t is None:
            assert a is None, attr
        else:
            np.testing.assert_array_equal(a, t.detach().numpy(), err_msg=attr)
    np.testing.assert_array_equal(am.out_proj_weight, tm.out_proj.weight.detach().numpy())
    if tm.out_proj.bias is None:
        assert am.out_proj_bias is None
    else:
        np.testing.assert_array_equal(am.out_proj_bias, tm.out_proj.bias.detach().numpy())


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", CONFIGS)
def test_state_dict_keys_equal_torch(name, dtype):
    torch = _torch()
    config = CONFIGS[name]
    am = attnx.MultiheadAttention(E, H, dtype=dtype, seed=1, **attnx_kwargs(config))
    tm = torch.nn.MultiheadAttention(E, H, dtype=torch_dtype(dtype), **config)
    ours, theirs = am.state_dict(), tm.state_dict()
    assert list(ours) == list(theirs)  # same keys, same order
    for key, t in theirs.items():
        assert ours[key].shape == tuple(t.shape), key
        assert ours[key].dtype == dtype, key
    # And torch accepts attnx's state_dict as it is.
    tm.load_state_dict({k: torch.from_numpy(v) for k, v in ours.items()})


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", CONFIGS)
def test_outputs_match_torch(name, dtype):
    config = CONFIGS[name]
    tm = make_torch_mha(config, dtype)
    am = attnx.MultiheadAttention.from_torch(tm)
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, config, dtype)
    assert_forward_matches(am, tm, dtype, q, k, v)
    assert_forward_matches(am, tm, dtype, q, k, v, average_attn_weights=False)
    out, weights = assert_forward_matches(am, tm, dtype, q, k, v, need_weights=False)
    assert weights is None
    expected = (N, L, E) if config.get("batch_first") else (L, N, E)
    assert out.shape == expected


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", CONFIGS)
def test_load_state_dict_from_torch_state_dict_matches(name, dtype):
    """A torch state_dict (tensors, not arrays) loads without attnx importing torch."""
    config = CONFIGS[name]
    tm = make_torch_mha(config, dtype, seed=3)
    am = attnx.MultiheadAttention(E, H, dtype=dtype, seed=0, **attnx_kwargs(config))
    result = am.load_state_dict(tm.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    rng = np.random.default_rng(4)
    q, k, v = inputs(rng, config, dtype)
    kpm = rng.random((N, S)) < 0.3
    kpm[:, 0] = False
    assert_forward_matches(am, tm, dtype, q, k, v, key_padding_mask=kpm, average_attn_weights=False)


@pytest.mark.torch
def test_torch_tensors_requiring_grad_and_bfloat16_load():
    torch = _torch()
    tm = make_torch_mha({}, np.float32)
    sd = {k: v.detach().clone().requires_grad_(True) for k, v in tm.state_dict().items()}
    am = attnx.MultiheadAttention(E, H, seed=0)
    am.load_state_dict(sd)
    np.testing.assert_array_equal(am.in_proj_weight, tm.in_proj_weight.detach().numpy())

    # NumPy has no bfloat16: such tensors are widened (exactly) to the module's dtype.
    tm16 = torch.nn.MultiheadAttention(E, H, dtype=torch.bfloat16)
    am16 = attnx.MultiheadAttention.from_torch(tm16)
    assert am16.dtype == np.float32
    np.testing.assert_array_equal(am16.in_proj_weight, tm16.in_proj_weight.detach().float().numpy())


# ---------------------------------------------------------------------------------------------
# Masks, weights options, unbatched inputs, is_causal
# ---------------------------------------------------------------------------------------------

MASK_CASES = {
    "attn_bool_2d": ("bool", 2, None),
    "attn_float_2d": ("float", 2, None),
    "attn_bool_3d": ("bool", 3, None),
    "attn_float_3d": ("float", 3, None),
    "kpm_bool": (None, None, "bool"),
    "kpm_float": (None, None, "float"),
    "attn_bool_kpm_bool": ("bool", 2, "bool"),
    "attn_float3d_kpm_float": ("float", 3, "float"),
    "attn_float_kpm_bool": ("float", 2, "bool"),
}
WEIGHT_OPTIONS = {
    "weights_avg": {"need_weights": True, "average_attn_weights": True},
    "weights_per_head": {"need_weights": True, "average_attn_weights": False},
    "no_weights": {"need_weights": False},
}


@pytest.mark.torch
@pytest.mark.parametrize("weight_options", WEIGHT_OPTIONS)
@pytest.mark.parametrize("mask_case", MASK_CASES)
@pytest.mark.parametrize("name", ["default", "batch_first", "bias_kv_zero_attn_kdim"])
def test_masks_match_torch(name, mask_case, weight_options):
    dtype = np.float32
    config = CONFIGS[name]
    tm = make_torch_mha(config, dtype, seed=5)
    am = attnx.MultiheadAttention.from_torch(tm)
    rng = np.random.default_rng(6)
    q, k, v = inputs(rng, config, dtype)
    attn_kind, attn_ndim, kpm_kind = MASK_CASES[mask_case]
    options = dict(WEIGHT_OPTIONS[weight_options])
    if attn_kind is not None:
        shape = (L, S) if attn_ndim == 2 else (N * H, L, S)
        options["attn_mask"] = make_mask(rng, attn_kind, shape, dtype)
    if kpm_kind is not None:
        options["key_padding_mask"] = make_mask(rng, kpm_kind, (N, S), dtype)
    assert_forward_matches(am, tm, dtype, q, k, v, **options)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", ["default", "no_bias", "bias_kv_zero_attn_kdim", "everything"])
def test_masks_match_torch_float64_and_all_options(name, dtype):
    config = CONFIGS[name]
    tm = make_torch_mha(config, dtype, seed=7)
    am = attnx.MultiheadAttention.from_torch(tm)
    rng = np.random.default_rng(8)
    q, k, v = inputs(rng, config, dtype)
    attn_mask = make_mask(rng, "float", (N * H, L, S), dtype)
    kpm = make_mask(rng, "float", (N, S), dtype)
    for options in WEIGHT_OPTIONS.values():
        assert_forward_matches(am, tm, dtype, q, k, v, attn_mask=attn_mask, key_padding_mask=kpm, **options)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", ["default", "no_bias", "bias_kv", "zero_attn", "kdim_vdim", "everything"])
def test_unbatched_inputs_match_torch(name, dtype):
    config = CONFIGS[name]
    tm = make_torch_mha(config, dtype, seed=9)
    am = attnx.MultiheadAttention.from_torch(tm)
    rng = np.random.default_rng(10)
    q, k, v = inputs(rng, config, dtype, batched=False)
    out, weights = assert_forward_matches(am, tm, dtype, q, k, v)
    assert out.shape == (L, E) and weights.ndim == 2
    assert_forward_matches(
        am,
        tm,
        dtype,
        q,
        k,
        v,
        key_padding_mask=make_mask(rng, "bool", (S,), dtype),
        attn_mask=make_mask(rng, "bool", (H, L, S), dtype),
        average_attn_weights=False,
    )
    assert_forward_matches(
        am, tm, dtype, q, k, v, key_padding_mask=make_mask(rng, "float", (S,), dtype), need_weights=False
    )


@pytest.mark.torch
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("name", ["default", "batch_first"])
def test_is_causal_alone_equals_torch_with_causal_mask(name, need_weights):
    """torch needs attn_mask with is_causal (a hint); attnx applies the causal mask from the flag alone."""
    dtype = np.float64
    config = CONFIGS[name]
    tm = make_torch_mha(config, dtype, seed=11)
    am = attnx.MultiheadAttention.from_torch(tm)
    rng = np.random.default_rng(12)
    q = rng.standard_normal((N, L, E) if config.get("batch_first") else (L, N, E))
    causal = np.triu(np.ones((L, L), dtype=bool), k=1)
    theirs = torch_forward(tm, q, q, q, attn_mask=causal, is_causal=True, need_weights=need_weights)
    for ours in (
        am(q, q, q, is_causal=True, need_weights=need_weights),
        am(q, q, q, attn_mask=causal, is_causal=True, need_weights=need_weights),
        am.forward(q, q, q, attn_mask=causal, need_weights=need_weights),
    ):
        assert_same(ours[0], theirs[0], dtype)
        assert_same(ours[1], theirs[1], dtype)


@pytest.mark.torch
@pytest.mark.parametrize("need_weights", [True, False])
def test_self_attention_fast_path_matches(need_weights):
    """batch_first self-attention with query is key is value takes torch's fused fast path."""
    dtype = np.float32
    tm = make_torch_mha({"batch_first": True}, dtype, seed=13)
    am = attnx.MultiheadAttention.from_torch(tm)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((N, L, E)).astype(dtype)
    kpm = np.zeros((N, L), dtype=bool)
    kpm[0, 3:] = True
    kpm[2, 1:] = True
    torch = _torch()
    tx = torch.from_numpy(x)
    with torch.no_grad():
        out, weights = tm(tx, tx, tx, key_padding_mask=torch.from_numpy(kpm), need_weights=need_weights)
    ours_out, ours_weights = am(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    assert_same(ours_out, out.numpy(), dtype)
    assert_same(ours_weights, None if weights is None else weights.numpy(), dtype)


def test_fully_masked_row_gives_out_proj_bias_not_nan():
    """The documented deviation from torch: a query row with no visible key gives zero attention."""
    am = attnx.MultiheadAttention(E, H, batch_first=True, seed=0)
    am.out_proj_bias[:] = np.arange(E, dtype=np.float32)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((N, L, E)).astype(np.float32)
    attn_mask = np.zeros((L, L), dtype=bool)
    attn_mask[2, :] = True
    out, weights = am(x, x, x, attn_mask=attn_mask)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[:, 2, :], np.broadcast_to(am.out_proj_bias, (N, E)))
    np.testing.assert_array_equal(weights[:, 2, :], 0)


def test_inputs_are_converted_to_the_module_dtype():
    am = attnx.MultiheadAttention(E, H, seed=0)  # float32
    rng = np.random.default_rng(16)
    q64 = rng.standard_normal((L, N, E))
    out64, w64 = am(q64, q64, q64)
    out32, w32 = am(q64.astype(np.float32), q64.astype(np.float32), q64.astype(np.float32))
    assert out64.dtype == np.float32 and w64.dtype == np.float32
    np.testing.assert_array_equal(out64, out32)
    np.testing.assert_array_equal(w64, w32)
    with pytest.raises(TypeError):
        am(q64.astype(np.int64), q64, q64)


def test_forward_and_call_are_the_same():
    am = attnx.MultiheadAttention(E, H, seed=0)
    x = np.random.default_rng(17).standard_normal((L, N, E)).astype(np.float32)
    a = am(x, x, x, need_weights=True, average_attn_weights=False)
    b = am.forward(x, x, x, need_weights=True, average_attn_weights=False)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------


def _uniform_bound_check(ours, theirs, bound):
    """Samples of U(-bound, bound): inside the bound, reaching near it, with std bound/sqrt(3) as torch's."""
    std = bound / np.sqrt(3.0)
    assert np.abs(ours).max() <= bound
    assert np.abs(ours).max() > 0.99 * bound
    assert abs(ours.mean()) < 0.05 * std
    assert ours.std() == pytest.approx(std, rel=0.03)
    assert ours.std() == pytest.approx(float(theirs.std()), rel=0.05)
    assert np.abs(theirs).max() <= bound * (1 + 1e-6)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_init_packed_matches_torch_distribution(dtype):
    torch = _torch()
    e, h = 256, 8
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(e, h, add_bias_kv=True, dtype=torch_dtype(dtype))
    am = attnx.MultiheadAttention(e, h, add_bias_kv=True, dtype=dtype, seed=0)
    t = torch_state_numpy(tm)
    for value in am.state_dict().values():
        assert value.dtype == dtype
    # xavier_uniform_ treats the packed (3E, E) weight as one matrix: fan_in E, fan_out 3E.
    _uniform_bound_check(am.in_proj_weight, t["in_proj_weight"], np.sqrt(6.0 / (4 * e)))
    # out_proj is an nn.Linear: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(E), 1/sqrt(E)).
    _uniform_bound_check(am.out_proj_weight, t["out_proj.weight"], 1.0 / np.sqrt(e))
    # Biases start at zero (out_proj's Linear bias init is overwritten).
    np.testing.assert_array_equal(am.in_proj_bias, 0)
    np.testing.assert_array_equal(am.out_proj_bias, 0)
    np.testing.assert_array_equal(t["in_proj_bias"], 0)
    np.testing.assert_array_equal(t["out_proj.bias"], 0)
    # xavier_normal_ on (1, 1, E): fans are E and E, so N(0, 1/E).
    ours_kv = np.concatenate([am.bias_k.ravel(), am.bias_v.ravel()])
    theirs_kv = np.concatenate([t["bias_k"].ravel(), t["bias_v"].ravel()])
    assert am.bias_k.shape == am.bias_v.shape == (1, 1, e)
    assert ours_kv.std() == pytest.approx(np.sqrt(1.0 / e), rel=0.1)
    assert ours_kv.std() == pytest.approx(float(theirs_kv.std()), rel=0.15)
    assert abs(ours_kv.mean()) < 0.2 * np.sqrt(1.0 / e)
    assert not np.array_equal(am.bias_k, am.bias_v)


@pytest.mark.torch
def test_init_separate_projections_match_torch_distribution():
    torch = _torch()
    e, kdim, vdim = 256, 64, 512
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(e, 4, kdim=kdim, vdim=vdim, bias=False)
    am = attnx.MultiheadAttention(e, 4, kdim=kdim, vdim=vdim, bias=False, seed=0)
    assert am.in_proj_weight is None and am.in_proj_bias is None and am.out_proj_bias is None
    t = torch_state_numpy(tm)
    _uniform_bound_check(am.q_proj_weight, t["q_proj_weight"], np.sqrt(6.0 / (e + e)))
    _uniform_bound_check(am.k_proj_weight, t["k_proj_weight"], np.sqrt(6.0 / (e + kdim)))
    _uniform_bound_check(am.v_proj_weight, t["v_proj_weight"], np.sqrt(6.0 / (e + vdim)))
    _uniform_bound_check(am.out_proj_weight, t["out_proj.weight"], 1.0 / np.sqrt(e))


def test_seed_reproducibility():
    a = attnx.MultiheadAttention(E, H, add_bias_kv=True, seed=123).state_dict()
    b = attnx.MultiheadAttention(E, H, add_bias_kv=True, seed=123).state_dict()
    c = attnx.MultiheadAttention(E, H, add_bias_kv=True, seed=124).state_dict()
    g = attnx.MultiheadAttention(E, H, add_bias_kv=True, seed=np.random.default_rng(123)).state_dict()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
        np.testing.assert_array_equal(a[key], g[key])
    assert not np.array_equal(a["in_proj_weight"], c["in_proj_weight"])
    assert not np.array_equal(a["bias_k"], c["bias_k"])
    # Without a seed, fresh entropy each time.
    d = attnx.MultiheadAttention(E, H).in_proj_weight
    e = attnx.MultiheadAttention(E, H).in_proj_weight
    assert not np.array_equal(d, e)


def test_float64_init_is_not_float32_precision():
    am = attnx.MultiheadAttention(E, H, dtype=np.float64, seed=0)
    w = am.in_proj_weight
    assert w.dtype == np.float64
    assert not np.array_equal(w, w.astype(np.float32).astype(np.float64))


# ---------------------------------------------------------------------------------------------
# Pickling and copying
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "everything", "kdim_only"])
def test_pickle_and_deepcopy_round_trip(name):
    config = attnx_kwargs(CONFIGS[name])
    am = attnx.MultiheadAttention(E, H, dtype=np.float64, seed=3, **config)
    if am.in_proj_bias is not None:
        am.in_proj_bias[:] = np.linspace(-1, 1, 3 * E)
    rng = np.random.default_rng(18)
    q, k, v = inputs(rng, CONFIGS[name], np.float64)
    expected = am(q, k, v, average_attn_weights=False)
    for clone in (
        pickle.loads(pickle.dumps(am)),
        pickle.loads(pickle.dumps(am, protocol=pickle.HIGHEST_PROTOCOL)),
        copy.deepcopy(am),
    ):
        assert type(clone) is attnx.MultiheadAttention
        assert repr(clone) == repr(am)
        got = clone(q, k, v, average_attn_weights=False)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
        sd, sd_clone = am.state_dict(), clone.state_dict()
        assert list(sd) == list(sd_clone)
        for key in sd:
            np.testing.assert_array_equal(sd[key], sd_clone[key])
        if clone is not am:
            for attr in ("in_proj_weight", "q_proj_weight", "out_proj_weight", "bias_k"):
                a, b = getattr(am, attr), getattr(clone, attr)
                assert (a is None) == (b is None)
                if a is not None:
                    assert not np.shares_memory(a, b)


def _through_pickle(x):
    return pickle.loads(pickle.dumps(x))


def test_module_accepts_arrays_that_went_through_pickle():
    """What a worker process receives: unpickled inputs, masks and parameters."""
    am = attnx.MultiheadAttention(E, H, seed=0)
    rng = np.random.default_rng(20)
    x = rng.standard_normal((L, N, E)).astype(np.float32)
    attn_mask = make_mask(rng, "float", (L, L), np.float32)
    kpm = make_mask(rng, "float", (N, L), np.float32)
    expected = am(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm)
    clone = _through_pickle(am)
    clone.in_proj_weight = _through_pickle(am.in_proj_weight)
    clone.out_proj_bias = _through_pickle(am.out_proj_bias)
    got = clone(*(_through_pickle(a) for a in (x, x, x)), attn_mask=_through_pickle(attn_mask), key_padding_mask=_through_pickle(kpm))
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_functional_accepts_arrays_that_went_through_pickle(dtype):
    """multi_head_attention_forward, which the module calls, on arrays a worker process receives.

    An unpickled float32/float64 array has a dtype equal to, but not the same object as,
    ``np.dtype(np.float32)``; the result must not depend on that.
    """
    am = attnx.MultiheadAttention(E, H, dtype=dtype, seed=0)
    am.in_proj_bias[:] = 0.25
    rng = np.random.default_rng(21)
    x = rng.standard_normal((L, N, E)).astype(dtype)
    attn_mask = make_mask(rng, "float", (L, L), dtype)
    args = [x, x, x, E, H, am.in_proj_weight, am.in_proj_bias, None, None, False, 0.0, am.out_proj_weight, am.out_proj_bias]
    expected = attnx.multi_head_attention_forward(*args, training=False, attn_mask=attn_mask)
    unpickled = [_through_pickle(a) if isinstance(a, np.ndarray) else a for a in args]
    assert unpickled[0].dtype == dtype and unpickled[0].dtype is not np.dtype(dtype)
    got = attnx.multi_head_attention_forward(*unpickled, training=False, attn_mask=_through_pickle(attn_mask))
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


# ---------------------------------------------------------------------------------------------
# load_state_dict: errors, strictness, copies
# ---------------------------------------------------------------------------------------------


def test_load_state_dict_missing_key_raises_and_loads_nothing():
    am = attnx.MultiheadAttention(E, H, seed=0)
    before = am.state_dict()
    sd = attnx.MultiheadAttention(E, H, seed=1).state_dict()
    del sd["out_proj.bias"]
    with pytest.raises(ValueError, match=r"missing keys 'out_proj\.bias'"):
        am.load_state_dict(sd)
    for key, value in am.state_dict().items():
        np.testing.assert_array_equal(value, before[key])


def test_load_state_dict_unexpected_key_raises():
    am = attnx.MultiheadAttention(E, H, seed=0)
    sd = am.state_dict()
    sd["bias_k"] = np.zeros((1, 1, E), np.float32)
    with pytest.raises(ValueError, match=r"unexpected keys 'bias_k'"):
        am.load_state_dict(sd)
    # A separate-projection state_dict into a packed module: both kinds of mismatch named.
    separate = attnx.MultiheadAttention(E, H, kdim=KDIM, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"missing keys 'in_proj_weight'.*unexpected keys 'q_proj_weight'"):
        am.load_state_dict(separate)


def test_load_state_dict_non_strict_reports_keys():
    am = attnx.MultiheadAttention(E, H, seed=0)
    source = attnx.MultiheadAttention(E, H, seed=1).state_dict()
    old_out_bias = am.out_proj_bias.copy()
    sd = {"in_proj_weight": source["in_proj_weight"], "extra": np.zeros(3)}
    result = am.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["in_proj_bias", "out_proj.weight", "out_proj.bias"]
    assert result.unexpected_keys == ["extra"]
    assert result == (result.missing_keys, result.unexpected_keys)
    np.testing.assert_array_equal(am.in_proj_weight, source["in_proj_weight"])
    np.testing.assert_array_equal(am.out_proj_bias, old_out_bias)


@pytest.mark.parametrize("strict", [True, False])
def test_load_state_dict_wrong_shape_names_key_and_shapes(strict):
    am = attnx.MultiheadAttention(E, H, add_bias_kv=True, seed=0)
    before = am.state_dict()
    sd = attnx.MultiheadAttention(E, H, add_bias_kv=True, seed=1).state_dict()
    sd["bias_k"] = np.zeros(E, np.float32)  # (E,) instead of (1, 1, E)
    with pytest.raises(ValueError, match=r"'bias_k'.*\(16,\).*\(1, 1, 16\)"):
        am.load_state_dict(sd, strict=strict)
    sd = attnx.MultiheadAttention(E + 4, H, add_bias_kv=True, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"'in_proj_weight'.*\(60, 20\).*\(48, 16\)"):
        am.load_state_dict(sd, strict=strict)
    for key, value in am.state_dict().items():
        np.testing.assert_array_equal(value, before[key])


def test_load_state_dict_bad_values():
    am = attnx.MultiheadAttention(E, H, seed=0)
    sd = am.state_dict()
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        am.load_state_dict([("in_proj_weight", sd["in_proj_weight"])])
    bad = dict(sd, **{"out_proj.bias": np.zeros(E, dtype=bool)})
    with pytest.raises(TypeError, match=r"'out_proj\.bias'.*bool"):
        am.load_state_dict(bad)
    bad = dict(sd, **{"out_proj.bias": np.zeros(E, dtype=np.complex64)})
    with pytest.raises(TypeError, match=r"'out_proj\.bias'"):
        am.load_state_dict(bad)
    with pytest.raises(TypeError, match="strict"):
        am.load_state_dict(sd, strict="yes")


def test_load_state_dict_copies_and_converts():
    am = attnx.MultiheadAttention(E, H, dtype=np.float32, seed=0)
    source = {k: v.astype(np.float64) for k, v in attnx.MultiheadAttention(E, H, seed=1).state_dict().items()}
    source["in_proj_weight"] = np.asfortranarray(source["in_proj_weight"])  # any layout is accepted
    snapshot = {k: v.copy() for k, v in source.items()}
    am.load_state_dict(source)
    for key, value in am.state_dict().items():
        assert value.dtype == np.float32 and value.flags.c_contiguous
        np.testing.assert_array_equal(value, snapshot[key].astype(np.float32))
    # The caller's arrays are unchanged and not aliased: editing them leaves the module alone.
    for key, value in source.items():
        np.testing.assert_array_equal(value, snapshot[key])
        value[...] = 7.0
    for key, value in am.state_dict().items():
        np.testing.assert_array_equal(value, snapshot[key].astype(np.float32))
    # Same dtype: still a copy.
    same = attnx.MultiheadAttention(E, H, seed=2).state_dict()
    am.load_state_dict(same)
    assert not np.shares_memory(am.in_proj_weight, same["in_proj_weight"])
    # __array__ objects and lists are accepted.

    class ArrayLike:
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a

    am.load_state_dict({k: ArrayLike(v) for k, v in same.items()})
    np.testing.assert_array_equal(am.out_proj_weight, same["out_proj.weight"])
    am.load_state_dict({k: v.tolist() for k, v in same.items()})
    np.testing.assert_array_equal(am.out_proj_weight, same["out_proj.weight"])


def test_state_dict_returns_copies():
    am = attnx.MultiheadAttention(E, H, seed=0)
    sd = am.state_dict()
    assert not np.shares_memory(sd["in_proj_weight"], am.in_proj_weight)
    sd["in_proj_weight"][...] = 0
    assert np.any(am.in_proj_weight != 0)


def test_forward_does_not_modify_inputs():
    am = attnx.MultiheadAttention(E, H, kdim=KDIM, vdim=VDIM, add_bias_kv=True, seed=0)
    rng = np.random.default_rng(19)
    q, k, v = inputs(rng, CONFIGS["kdim_vdim"], np.float32)
    attn_mask = make_mask(rng, "float", (N * H, L, S), np.float32)
    kpm = make_mask(rng, "bool", (N, S), np.float32)
    arrays = [q, k, v, attn_mask, kpm]
    snapshot = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False  # read-only inputs work
    params = {k: v.copy() for k, v in am.state_dict().items()}
    out, weights = am(q, k, v, attn_mask=attn_mask, key_padding_mask=kpm)
    for a, b in zip(arrays, snapshot):
        np.testing.assert_array_equal(a, b)
    for key, value in am.state_dict().items():
        np.testing.assert_array_equal(value, params[key])
    for a in arrays:
        assert not np.shares_memory(out, a) and not np.shares_memory(weights, a)


@pytest.mark.torch
def test_from_torch_weights_are_copies():
    torch = _torch()
    tm = make_torch_mha({}, np.float32)
    am = attnx.MultiheadAttention.from_torch(tm)
    before = am.in_proj_weight.copy()
    with torch.no_grad():
        tm.in_proj_weight.add_(1.0)
    np.testing.assert_array_equal(am.in_proj_weight, before)


@pytest.mark.torch
def test_from_torch_rejects_other_objects():
    with pytest.raises(TypeError, match="from_torch expects a torch.nn.MultiheadAttention"):
        attnx.MultiheadAttention.from_torch(object())
    torch = _torch()
    with pytest.raises(TypeError, match="from_torch expects"):
        attnx.MultiheadAttention.from_torch(torch.nn.Linear(4, 4))


def test_modules_does_not_import_torch():
    code = (
        "import sys, numpy as np, attnx\n"
        "m = attnx.MultiheadAttention(8, 2, seed=0)\n"
        "m.load_state_dict(m.state_dict())\n"
        "m(np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32))\n"
        "assert 'torch' not in sys.modules, 'attnx imported torch'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# ---------------------------------------------------------------------------------------------
# Constructor validation and repr
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"embed_dim": 10, "num_heads": 3}, ValueError, r"embed_dim \(10\) must be divisible by num_heads \(3\)"),
        ({"embed_dim": 0, "num_heads": 1}, ValueError, "embed_dim must be a positive integer"),
        ({"embed_dim": 8, "num_heads": -2}, ValueError, "num_heads must be a positive integer"),
        ({"embed_dim": 8.0, "num_heads": 2}, TypeError, "embed_dim must be a positive integer"),
        ({"embed_dim": True, "num_heads": 1}, TypeError, "embed_dim must be a positive integer"),
        ({"embed_dim": 8, "num_heads": "2"}, TypeError, "num_heads must be a positive integer"),
        ({"embed_dim": 8, "num_heads": 2, "kdim": 0}, ValueError, "kdim must be a positive integer"),
        ({"embed_dim": 8, "num_heads": 2, "vdim": 2.5}, TypeError, "vdim must be a positive integer"),
        ({"embed_dim": 8, "num_heads": 2, "dtype": np.complex64}, TypeError, "dtype must be float32, float64, float16 or bfloat16"),
        ({"embed_dim": 8, "num_heads": 2, "dtype": np.int32}, TypeError, "dtype must be float32, float64, float16 or bfloat16"),
        ({"embed_dim": 8, "num_heads": 2, "dtype": "not a dtype"}, TypeError, "dtype must be float32, float64, float16 or bfloat16"),
        ({"embed_dim": 8, "num_heads": 2, "batch_first": "yes"}, TypeError, "batch_first"),
        ({"embed_dim": 8, "num_heads": 2, "bias": None}, TypeError, "bias"),
        ({"embed_dim": 8, "num_heads": 2, "add_bias_kv": 1}, TypeError, "add_bias_kv"),
        ({"embed_dim": 8, "num_heads": 2, "add_zero_attn": "no"}, TypeError, "add_zero_attn"),
    ],
)
def test_constructor_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        attnx.MultiheadAttention(**kwargs)


def test_constructor_accepts_numpy_ints_and_dtype_spellings():
    am = attnx.MultiheadAttention(np.int64(8), np.int32(2), kdim=np.int16(3), dtype="float64", seed=0)
    assert (am.embed_dim, am.num_heads, am.head_dim, am.kdim, am.vdim) == (8, 2, 4, 3, 8)
    assert type(am.embed_dim) is int
    assert am.dtype == np.float64
    assert attnx.MultiheadAttention(8, 2, dtype=np.dtype(">f4")).dtype == np.float32


def test_repr():
    assert repr(attnx.MultiheadAttention(8, 2)) == "MultiheadAttention(embed_dim=8, num_heads=2, dtype=float32)"
    r = repr(
        attnx.MultiheadAttention(
            8, 2, bias=False, add_bias_kv=True, add_zero_attn=True, kdim=3, vdim=5, batch_first=True, dtype=np.float64
        )
    )
    assert r == (
        "MultiheadAttention(embed_dim=8, num_heads=2, bias=False, add_bias_kv=True, add_zero_attn=True, "
        "kdim=3, vdim=5, batch_first=True, dtype=float64)"
    )


def test_public_methods_have_numpy_docstrings():
    for name in ("forward", "state_dict", "load_state_dict", "from_torch"):
        doc = getattr(attnx.MultiheadAttention, name).__doc__
        assert doc and "Returns\n        -------" in doc, name
    assert "Parameters\n    ----------" in attnx.MultiheadAttention.__doc__
