"""Code written for torch runs on attnx as it is.

``MultiheadAttention`` takes torch's constructor arguments in torch's order and has torch's
modes (``eval()``, ``train()``, ``training``), parameter listing (``parameters()``,
``named_parameters()``) and ``out_proj``. Inputs are what torch code has at hand: tensors that
require grad (read as their detached values), ``nn.Parameter``, ``CausalBias`` masks; an object
whose array conversion would not give its values (tensor subclasses, object arrays, conversions
of another shape) raises TypeError naming the argument instead of computing on garbage.

The tests that need torch take the ``torch`` fixture (marked ``torch`` by conftest and skipped
where it is not installed); the others use objects that behave as torch's do.
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

import attnx
from attnx._arrays import as_array, causal_bias

E, H, N, L, S = 16, 4, 3, 5, 7
KDIM, VDIM = 5, 6
TOL = {np.float32: {"rtol": 1e-5, "atol": 1e-5}, np.float64: {"rtol": 1e-12, "atol": 1e-12}}

# Constructor keywords of both modules, torch's names; each config changes the parameter list.
CONFIGS = {
    "default": {},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "kdim_vdim": {"kdim": KDIM, "vdim": VDIM},
    "kdim_only": {"kdim": KDIM},
    "kdim_eq_embed": {"kdim": E, "vdim": E},
    "batch_first": {"batch_first": True},
    "everything": {"bias": False, "add_bias_kv": True, "add_zero_attn": True, "kdim": KDIM, "vdim": VDIM,
                   "batch_first": True},
}


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def torch_module(torch, config, dtype=np.float32, seed=0, dropout=0.0):
    """A torch module in eval mode with random biases (torch starts them at zero)."""
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, dropout, dtype={np.float32: torch.float32, np.float64: torch.float64}[dtype],
                                    **config)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.5)
    return m.eval()


def inputs(rng, config, dtype=np.float32):
    kdim, vdim = config.get("kdim", E), config.get("vdim", E)
    first = config.get("batch_first", False)
    shapes = [(N, n, d) if first else (n, N, d) for n, d in ((L, E), (S, kdim), (S, vdim))]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def torch_forward(torch, module, *arrays, **options):
    """torch's module on NumPy arrays (inputs and masks), under no_grad; the results as NumPy."""
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    options = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    with torch.no_grad():
        out, weights = module(*tensors, **options)
    return out.numpy(), None if weights is None else weights.numpy()


# ---------------------------------------------------------------------------------------------
# Constructor: torch's order, defaults, dtype and device
# ---------------------------------------------------------------------------------------------


def test_signature_is_torchs_with_seed_keyword_only(torch):
    ours = inspect.signature(attnx.MultiheadAttention.__init__).parameters
    theirs = inspect.signature(torch.nn.MultiheadAttention.__init__).parameters
    positional = [(p.name, p.default) for p in ours.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [(p.name, p.default) for p in theirs.values()]
    assert ours["seed"].kind is inspect.Parameter.KEYWORD_ONLY


def test_positional_arguments_mean_what_they_mean_in_torch():
    m = attnx.MultiheadAttention(8, 2, 0.0, False, True, True, 3, 5, True, "cpu", "float64", seed=0)
    assert (m.dropout, m.bias, m.add_bias_kv, m.add_zero_attn, m.kdim, m.vdim, m.batch_first) == (
        0.0, False, True, True, 3, 5, True)
    assert m.dtype == np.float64 and m.in_proj_bias is None and m.bias_k is not None
    # The third positional argument is dropout, not bias (the old order's).
    assert attnx.MultiheadAttention(8, 2, 0.0).bias is True
    with pytest.raises(TypeError):
        attnx.MultiheadAttention(8, 2, 0.0, True, False, False, None, None, False, None, None, 0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_positional_construction_computes_torchs_result(torch, rng, name):
    config = CONFIGS[name]
    order = ("bias", "add_bias_kv", "add_zero_attn", "kdim", "vdim", "batch_first")
    defaults = {"bias": True, "add_bias_kv": False, "add_zero_attn": False, "kdim": None, "vdim": None,
                "batch_first": False}
    args = [config.get(k, defaults[k]) for k in order]
    tm = torch_module(torch, config)
    am = attnx.MultiheadAttention(E, H, 0.0, *args, None, None)
    assert am.training and am.dtype == np.float32
    am.load_state_dict(tm.state_dict())
    q, k, v = inputs(rng, config)
    out, weights = am(q, k, v)  # training mode with dropout 0.0: computes
    expected_out, expected_weights = torch_forward(torch, tm, q, k, v)
    np.testing.assert_allclose(out, expected_out, **TOL[np.float32])
    np.testing.assert_allclose(weights, expected_weights, **TOL[np.float32])


class TorchLikeDType:
    """Prints as a torch dtype does: attnx reads torch's dtypes by name, without torch."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name


@pytest.mark.parametrize("dtype, expected", [
    (None, np.float32), (np.float32, np.float32), ("float64", np.float64), (np.dtype("f8"), np.float64),
    ("f4", np.float32), (np.float16, np.float16), ("torch.float64", np.float64),
    (TorchLikeDType("torch.float64"), np.float64), (TorchLikeDType("torch.float32"), np.float32),
    (TorchLikeDType("torch.float16"), np.float16),
])
def test_dtype_spellings(dtype, expected):
    m = attnx.MultiheadAttention(8, 2, dtype=dtype, seed=0)
    assert m.dtype == expected
    assert all(p.dtype == expected for p in m.parameters())


def test_torch_dtypes(torch):
    assert attnx.MultiheadAttention(8, 2, dtype=torch.float64).dtype == np.float64
    assert attnx.MultiheadAttention(8, 2, dtype=torch.double).dtype == np.float64
    assert attnx.MultiheadAttention(8, 2, dtype=torch.half).dtype == np.float16
    assert attnx.MultiheadAttention(8, 2, dtype=torch.float).dtype == np.float32
    for bad in (torch.int32, torch.complex64, torch.bool):
        with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16"):
            attnx.MultiheadAttention(8, 2, dtype=bad)


def test_torch_bfloat16_dtype(torch):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    m = attnx.MultiheadAttention(8, 2, dtype=torch.bfloat16, seed=0)
    assert m.dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("bad", [TorchLikeDType("torch.int64"), "torch.complex64", "int32", np.complex64])
def test_dtype_errors(bad):
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16"):
        attnx.MultiheadAttention(8, 2, dtype=bad)


@pytest.mark.parametrize("device", [None, "cpu", "cpu:0"])
def test_cpu_devices(device):
    assert attnx.MultiheadAttention(8, 2, device=device).embed_dim == 8


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps", "meta", "", 0, "CPU"])
def test_other_devices_raise(device):
    with pytest.raises(ValueError, match="device must be None or 'cpu'"):
        attnx.MultiheadAttention(8, 2, device=device)


def test_torch_devices(torch):
    assert attnx.MultiheadAttention(8, 2, device=torch.device("cpu")).embed_dim == 8
    with pytest.raises(ValueError, match=r"device must be None or 'cpu'.*cuda"):
        attnx.MultiheadAttention(8, 2, device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="meta"):
        attnx.MultiheadAttention(8, 2, device=torch.device("meta"))


@pytest.mark.parametrize("dropout, error", [
    (1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError), ("0.1", TypeError),
    (True, TypeError), (None, TypeError), ([0.1], TypeError),
])
def test_dropout_is_a_probability(dropout, error):
    with pytest.raises(error, match="dropout must be a probability"):
        attnx.MultiheadAttention(8, 2, dropout)
    m = attnx.MultiheadAttention(8, 2)
    with pytest.raises(error, match="dropout must be a probability"):
        m.dropout = dropout
    assert m.dropout == 0.0


def test_dropout_values_kept():
    for p in (0, 0.0, 0.25, 1, np.float32(0.5), np.float64(1.0)):
        m = attnx.MultiheadAttention(8, 2, p)
        assert m.dropout == float(p) and type(m.dropout) is float


# ---------------------------------------------------------------------------------------------
# Modes: training, eval(), train(), dropout
# ---------------------------------------------------------------------------------------------


def test_training_mode_with_dropout_raises_until_eval(rng):
    m = attnx.MultiheadAttention(E, H, 0.1, seed=0)
    twin = attnx.MultiheadAttention(E, H, seed=0)  # dropout 0.0: the same parameters
    x = rng.standard_normal((L, N, E)).astype(np.float32)
    assert m.training is True
    message = r"dropout=0\.1 in training mode.*call \.eval\(\) or use dropout=0\.0"
    with pytest.raises(NotImplementedError, match=message):
        m(x, x, x)
    with pytest.raises(NotImplementedError, match=r"call \.eval\(\)"):
        m.forward(x, x, x, need_weights=False)
    cache = m.new_cache(N, 16)
    with pytest.raises(NotImplementedError, match=r"call \.eval\(\)"):
        m.step(x, cache)
    assert cache.lengths.tolist() == [0] * N
    assert m.eval() is m and m.training is False
    out, weights = m(x, x, x)
    expected_out, expected_weights = twin(x, x, x)
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(weights, expected_weights)
    assert m.step(x, cache).shape == (L, N, E)
    assert m.train() is m and m.training is True
    with pytest.raises(NotImplementedError):
        m(x, x, x)
    m.dropout = 0.0  # no dropout: training mode computes the same
    np.testing.assert_array_equal(m(x, x, x)[0], expected_out)


def test_train_and_eval(rng):
    m = attnx.MultiheadAttention(8, 2, seed=0)
    assert m.training is True
    assert m.train(False) is m and m.training is False
    assert m.train(True) is m and m.training is True
    assert m.train(np.bool_(False)) is m and m.training is False
    assert m.eval().train().training is True
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="mode"):
            m.train(bad)
        with pytest.raises(TypeError, match="training"):
            m.training = bad
    assert m.training is True


def test_modes_do_not_change_the_results(rng):
    m = attnx.MultiheadAttention(8, 2, seed=0)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    before = m(x, x, x)[0]
    m.eval()
    np.testing.assert_array_equal(m(x, x, x)[0], before)
    m.train()
    np.testing.assert_array_equal(m(x, x, x)[0], before)


def test_pickle_keeps_dropout_and_mode(rng):
    m = attnx.MultiheadAttention(8, 2, 0.2, seed=0).eval()
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    copy = pickle.loads(pickle.dumps(m))
    assert (copy.dropout, copy.training) == (0.2, False)
    np.testing.assert_array_equal(copy(x, x, x)[0], m(x, x, x)[0])
    copy.train()
    with pytest.raises(NotImplementedError):
        copy(x, x, x)


def test_unpickling_a_state_without_the_modes(rng):
    # An instance pickled before the module had dropout and training: torch's defaults.
    m = attnx.MultiheadAttention(8, 2, seed=0)
    state = m.__getstate__()
    del state["dropout"], state["training"]
    old = attnx.MultiheadAttention.__new__(attnx.MultiheadAttention)
    old.__setstate__(state)
    assert (old.dropout, old.training) == (0.0, True)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    np.testing.assert_array_equal(old(x, x, x)[0], m(x, x, x)[0])


def test_repr_shows_dropout():
    expected = "MultiheadAttention(embed_dim=8, num_heads=2, dropout=0.1, dtype=float32)"
    assert repr(attnx.MultiheadAttention(8, 2, 0.1)) == expected
    assert "dropout" not in repr(attnx.MultiheadAttention(8, 2))


def test_from_torch_copies_dropout_and_mode(torch, rng):
    x = rng.standard_normal((L, N, E)).astype(np.float32)
    tm = torch_module(torch, {}, dropout=0.1).train()
    am = attnx.MultiheadAttention.from_torch(tm)
    assert (am.dropout, am.training) == (0.1, True)
    with pytest.raises(NotImplementedError, match=r"call \.eval\(\)"):
        am(x, x, x)
    tm.eval()
    am = attnx.MultiheadAttention.from_torch(tm)
    assert (am.dropout, am.training) == (0.1, False)
    np.testing.assert_allclose(am(x, x, x)[0], torch_forward(torch, tm, x, x, x)[0], **TOL[np.float32])
    # Without dropout, a torch module in training mode computes what it computes in eval().
    tm = torch_module(torch, {}).train()
    am = attnx.MultiheadAttention.from_torch(tm)
    assert (am.dropout, am.training) == (0.0, True)
    np.testing.assert_allclose(am(x, x, x)[0], torch_forward(torch, tm, x, x, x)[0], **TOL[np.float32])


# ---------------------------------------------------------------------------------------------
# parameters(), named_parameters(), out_proj
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_named_parameters_are_torchs(torch, name):
    config = CONFIGS[name]
    tm = torch_module(torch, config)
    am = attnx.MultiheadAttention.from_torch(tm)
    for kwargs in ({}, {"prefix": "attn"}, {"recurse": False}, {"prefix": "a.b", "recurse": False}):
        theirs = list(tm.named_parameters(**kwargs))
        ours = list(am.named_parameters(**kwargs))
        assert [n for n, _ in ours] == [n for n, _ in theirs], kwargs
        for (n, a), (_, t) in zip(ours, theirs):
            np.testing.assert_array_equal(a, t.detach().numpy(), err_msg=n)
    recurse = {"recurse": False}
    assert [p.shape for p in am.parameters()] == [tuple(p.shape) for p in tm.parameters()]
    assert [p.shape for p in am.parameters(**recurse)] == [tuple(p.shape) for p in tm.parameters(**recurse)]
    # A fresh module of the same configuration lists the same names.
    fresh = attnx.MultiheadAttention(E, H, **config)
    assert [n for n, _ in fresh.named_parameters()] == [n for n, _ in tm.named_parameters()]
    assert list(fresh.state_dict()) == [n for n, _ in fresh.named_parameters()]


def test_parameters_are_the_modules_arrays(rng):
    m = attnx.MultiheadAttention(8, 2, add_bias_kv=True, seed=0)
    named = dict(m.named_parameters())
    assert named["in_proj_weight"] is m.in_proj_weight and named["bias_k"] is m.bias_k
    assert named["out_proj.weight"] is m.out_proj_weight and named["out_proj.bias"] is m.out_proj_bias
    assert [id(p) for p in m.parameters()] == [id(p) for p in named.values()]
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    before = m(x, x, x)[0]
    for p in m.parameters():  # written in place, as torch code does under no_grad
        p *= 0.5
    after = m(x, x, x)[0]
    fresh = attnx.MultiheadAttention(8, 2, add_bias_kv=True)
    fresh.load_state_dict(m.state_dict())
    np.testing.assert_array_equal(after, fresh(x, x, x)[0])
    assert not np.array_equal(after, before)


def test_named_parameters_argument_errors():
    m = attnx.MultiheadAttention(8, 2)
    with pytest.raises(TypeError, match="prefix"):
        list(m.named_parameters(prefix=3))
    with pytest.raises(TypeError, match="recurse"):
        list(m.named_parameters(recurse="no"))
    with pytest.raises(TypeError, match="recurse"):
        list(m.parameters(recurse=None))


def test_out_proj_is_a_view_of_the_module(rng):
    m = attnx.MultiheadAttention(8, 2, seed=0)
    assert m.out_proj.weight is m.out_proj_weight and m.out_proj.bias is m.out_proj_bias
    assert (m.out_proj.in_features, m.out_proj.out_features) == (8, 8)
    assert repr(m.out_proj) == "OutProj(in_features=8, out_features=8, bias=True)"
    assert attnx.MultiheadAttention(8, 2, bias=False).out_proj.bias is None
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    m(x, x, x)  # the module's checked weights are kept now
    w = rng.standard_normal((8, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    m.out_proj.weight = w
    m.out_proj.bias = b
    assert m.out_proj_weight is w and m.out_proj_bias is b
    assert m.out_proj.weight is w and m.out_proj.bias is b
    expected = attnx.MultiheadAttention(8, 2)
    expected.load_state_dict({**m.state_dict(), "out_proj.weight": w, "out_proj.bias": b})
    np.testing.assert_array_equal(m(x, x, x)[0], expected(x, x, x)[0])
    # And the other way: assigning out_proj_weight is seen through out_proj.
    m.out_proj_weight = w * 2
    np.testing.assert_array_equal(m.out_proj.weight, w * 2)
    expected.out_proj.weight = w * 2
    np.testing.assert_array_equal(m(x, x, x)[0], expected(x, x, x)[0])
    with pytest.raises(AttributeError):
        m.out_proj = None


def test_out_proj_assignment_of_the_weights_is_checked_at_the_call(rng):
    m = attnx.MultiheadAttention(8, 2, seed=0)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    m.out_proj.weight = np.ones((8, 3), np.float32)
    with pytest.raises(ValueError, match="out_proj_weight"):
        m(x, x, x)


def test_out_proj_writes_in_place_are_seen(rng):
    # torch code: `with torch.no_grad(): m.out_proj.weight.mul_(2)`; NumPy: `m.out_proj.weight *= 2`.
    m = attnx.MultiheadAttention(8, 2, seed=0)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    before = m(x, x, x)[0]
    m.out_proj.weight *= 2
    m.out_proj.bias += 1
    np.testing.assert_allclose(m(x, x, x)[0], 2 * before + 1, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Tensors that require grad, Parameters, half precision
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sdpa_reads_tensors_that_require_grad(torch, rng, dtype):
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)))
    mask = rng.standard_normal((5, 7)).astype(dtype)
    tq, tk, tv, tmask = (torch.tensor(a, requires_grad=True) for a in (q, k, v, mask))
    expected = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = attnx.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
    # A result of autograd (not a leaf) and a transposed view read the same way.
    got = attnx.scaled_dot_product_attention(tq * 1, tk.transpose(-1, -2).transpose(-1, -2), tv, attn_mask=tmask)
    np.testing.assert_array_equal(got, expected)
    bool_mask = rng.random((5, 7)) < 0.7
    np.testing.assert_array_equal(
        attnx.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(bool_mask), scale=0.5),
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, scale=0.5))
    assert tq.grad is None and tq.requires_grad


def test_out_and_tensor_masks(torch, rng):
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    mask = rng.standard_normal((4, 4)).astype(np.float32)
    out = np.empty((1, 2, 4, 8), np.float32)
    got = attnx.scaled_dot_product_attention(q, q, q, attn_mask=torch.tensor(mask, requires_grad=True), out=out)
    assert got is out
    np.testing.assert_array_equal(out, attnx.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    # A tensor over the memory of out= is an input that shares it.
    shared = np.zeros((1, 2, 4, 4), np.float32)
    with pytest.raises(ValueError, match="out must not share memory with an input"):
        attnx.scaled_dot_product_attention(q[..., :4], q[..., :4], q[..., :4], attn_mask=torch.from_numpy(shared),
                                           out=shared)


def test_kv_cache_reads_tensors_that_require_grad(torch, rng):
    k = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 4)).astype(np.float32)
    cache, expected = attnx.KVCache(1, 2, 8, 4), attnx.KVCache(1, 2, 8, 4)
    cache.append(torch.tensor(k, requires_grad=True), torch.tensor(k, requires_grad=True))
    expected.append(k, k)
    np.testing.assert_array_equal(cache.key, expected.key)
    np.testing.assert_array_equal(attnx.cached_attention(torch.tensor(q, requires_grad=True), cache),
                                  attnx.cached_attention(q, expected))
    with pytest.raises(TypeError, match="value is a GarbageOfAnotherShape"):
        cache.append(k, GarbageOfAnotherShape(k.shape))
    assert cache.lengths.tolist() == [3]


def test_mha_functional_reads_torch_parameters(torch, rng):
    tm = torch_module(torch, {"add_bias_kv": True})
    x = rng.standard_normal((L, N, E)).astype(np.float32)
    padding = rng.random((N, L)) < 0.3
    padding[:, 0] = False
    detached = {n: p.detach().numpy() for n, p in tm.named_parameters()}
    args = ("in_proj_weight", "in_proj_bias", "bias_k", "bias_v")
    tx = torch.tensor(x, requires_grad=True)
    got = attnx.multi_head_attention_forward(
        tx, tx, tx, E, H, *(getattr(tm, n) for n in args), False, 0.0, tm.out_proj.weight, tm.out_proj.bias,
        training=False, key_padding_mask=torch.from_numpy(padding))
    expected = attnx.multi_head_attention_forward(
        x, x, x, E, H, *(detached[n] for n in args), False, 0.0, detached["out_proj.weight"],
        detached["out_proj.bias"], training=False, key_padding_mask=padding)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got[0], torch_forward(torch, tm, x, x, x, key_padding_mask=padding)[0],
                               **TOL[np.float32])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_module_reads_tensors_that_require_grad(torch, rng, dtype):
    tm = torch_module(torch, {"batch_first": True}, dtype)
    am = attnx.MultiheadAttention.from_torch(tm)
    q, k, v = inputs(rng, {"batch_first": True}, dtype)
    mask = np.triu(np.ones((L, S), bool), 1)
    expected = am(q, k, v, attn_mask=mask)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    got = am(tq, tk, tv, attn_mask=torch.from_numpy(mask))
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got[0], torch_forward(torch, tm, q, k, v, attn_mask=mask)[0], **TOL[dtype])
    cache = am.new_cache(N, 16)
    step = am.step(torch.tensor(q, requires_grad=True), cache)
    np.testing.assert_array_equal(step, am.step(q, am.new_cache(N, 16)))


def test_half_precision_tensors(torch, rng):
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float16)
    got = attnx.scaled_dot_product_attention(*(torch.tensor(q, requires_grad=True),) * 3)
    np.testing.assert_array_equal(got, attnx.scaled_dot_product_attention(q, q, q))
    m = attnx.MultiheadAttention(8, 2, dtype=torch.float16, seed=0)
    x = rng.standard_normal((4, 2, 8)).astype(np.float16)
    np.testing.assert_array_equal(m(torch.from_numpy(x).requires_grad_(), x, x)[0], m(x, x, x)[0])


def test_bfloat16_tensors(torch, rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    t = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).requires_grad_()
    a = as_array(t, "query")
    assert a.dtype == bf16
    np.testing.assert_array_equal(a.astype(np.float32), t.detach().float().numpy())
    got = attnx.scaled_dot_product_attention(t, t, t)
    assert got.dtype == bf16
    np.testing.assert_array_equal(got, attnx.scaled_dot_product_attention(a, a, a))


class GradTensor:
    """Behaves as a tensor of another library that requires grad: its own conversion raises
    (as torch's does), its detach() gives the values."""

    requires_grad = True

    def __init__(self, array):
        self.array = array
        self.shape = array.shape

    def detach(self):
        return Detached(self.array)

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")


class Detached:
    def __init__(self, array):
        self.array = array

    def numpy(self):
        return self.array


def test_objects_that_require_grad_are_detached(rng):
    q = rng.standard_normal((2, 5, 8)).astype(np.float32)
    got = attnx.scaled_dot_product_attention(GradTensor(q), GradTensor(q), GradTensor(q))
    np.testing.assert_array_equal(got, attnx.scaled_dot_product_attention(q, q, q))
    m = attnx.MultiheadAttention(8, 2, batch_first=True, seed=0)
    np.testing.assert_array_equal(m(GradTensor(q), q, GradTensor(q))[0], m(q, q, q)[0])


def test_reading_tensors_does_not_import_torch():
    code = (
        "import sys, numpy as np, attnx\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_torch_habits import GradTensor, GarbageOfAnotherShape\n"
        "q = np.ones((2, 5, 8), np.float32)\n"
        "attnx.scaled_dot_product_attention(GradTensor(q), q, q)\n"
        "try:\n"
        "    attnx.scaled_dot_product_attention(GarbageOfAnotherShape((2, 5, 8)), q, q)\n"
        "except TypeError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'attnx imported torch'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__))], check=True,
                   env=env, timeout=60)


# ---------------------------------------------------------------------------------------------
# Conversions that would not give the values: TypeError naming the argument
# ---------------------------------------------------------------------------------------------


class GarbageOfAnotherShape:
    """A tensor-like whose __array__ returns uninitialised memory of another shape (as torch's
    CausalBias does): its own shape says what it should have given."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def __array__(self, dtype=None, copy=None):
        return np.empty((self.shape[0] + 1,) + self.shape[1:], np.float32)


class GivesObjects:
    def __array__(self, dtype=None, copy=None):
        return np.array([object(), object()])


def unfaithful_objects():
    return {
        "another shape": GarbageOfAnotherShape((2, 5, 8)),
        "object array": GivesObjects(),
        "0-d object array": np.array(object()),
        "list of objects": [[object()] * 8] * 5,
        "string": "abc",
    }


@pytest.mark.parametrize("kind", sorted(unfaithful_objects()))
@pytest.mark.parametrize("position", ["query", "key", "value", "attn_mask"])
def test_sdpa_refuses_unfaithful_conversions(rng, kind, position):
    q = rng.standard_normal((3, 5, 8)).astype(np.float32)
    args = {"query": q, "key": q, "value": q, "attn_mask": None}
    args[position] = unfaithful_objects()[kind]
    with pytest.raises(TypeError, match=position):
        attnx.scaled_dot_product_attention(**args)


@pytest.mark.parametrize("kind", sorted(unfaithful_objects()))
@pytest.mark.parametrize("position", ["query", "key", "in_proj_weight", "attn_mask", "key_padding_mask"])
def test_mha_refuses_unfaithful_conversions(rng, kind, position):
    m = attnx.MultiheadAttention(8, 2, seed=0)
    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    args = dict(query=x, key=x, value=x, embed_dim_to_check=8, num_heads=2, in_proj_weight=m.in_proj_weight,
                in_proj_bias=m.in_proj_bias, bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
                out_proj_weight=m.out_proj_weight, out_proj_bias=m.out_proj_bias, training=False)
    args[position] = unfaithful_objects()[kind]
    with pytest.raises((TypeError, ValueError), match=position) as info:
        attnx.multi_head_attention_forward(**args)
    if position in ("query", "key", "in_proj_weight"):
        assert info.type is TypeError
    if position in ("query", "key"):
        with pytest.raises(TypeError, match=position):
            m(args["query"], args["key"], x)


def test_the_message_says_what_was_wrong():
    with pytest.raises(TypeError, match=r"key is a GarbageOfAnotherShape of shape \(3, 9, 8\) whose array "
                                        r"conversion gives shape \(4, 9, 8\): not its values"):
        attnx.scaled_dot_product_attention(np.ones((1, 4, 8), np.float32), GarbageOfAnotherShape((3, 9, 8)),
                                           np.ones((1, 9, 8), np.float32))
    with pytest.raises(TypeError, match=r"shape \(3, 9, 8\) whose array conversion gives shape \(4, 9, 8\)"):
        as_array(GarbageOfAnotherShape((3, 9, 8)), "key")
    with pytest.raises(TypeError, match="value is not an array of numbers"):
        as_array(GivesObjects(), "value")


def test_faithful_objects_still_convert(rng):
    # A plain array-like whose shape agrees, a scalar, lists, an ndarray subclass.
    class Wrapped:
        def __init__(self, a):
            self.a, self.shape = a, a.shape

        def __array__(self, dtype=None, copy=None):
            return self.a

    class Sub(np.ndarray):
        pass

    q = rng.standard_normal((3, 5, 8)).astype(np.float32)
    expected = attnx.scaled_dot_product_attention(q, q, q)
    np.testing.assert_array_equal(attnx.scaled_dot_product_attention(Wrapped(q), q, q.tolist()), expected)
    np.testing.assert_array_equal(attnx.scaled_dot_product_attention(q, q.view(Sub), q), expected)
    assert as_array(np.float32(2.0), "scale").shape == ()


def tensor_subclass(torch):
    class MyTensor(torch.Tensor):
        pass

    return MyTensor


@pytest.mark.parametrize("position", ["query", "key", "value", "attn_mask"])
def test_sdpa_refuses_tensor_subclasses(torch, rng, position):
    q = rng.standard_normal((3, 5, 8)).astype(np.float32)
    args = {"query": q, "key": q, "value": q, "attn_mask": None}
    args[position] = torch.from_numpy(q if position != "attn_mask" else q[0, :, :5].copy()).as_subclass(
        tensor_subclass(torch))
    with pytest.raises(TypeError, match=rf"{position} is a .*MyTensor, a subclass of torch.Tensor"):
        attnx.scaled_dot_product_attention(**args)


def test_torch_objects_that_are_not_plain_tensors(torch, rng):
    q = np.ones((1, 4, 8), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype warnings (nested tensors)
        nested = torch.nested.nested_tensor([torch.ones(4, 8), torch.ones(3, 8)])
    cases = {
        "sparse": (torch.ones(1, 4, 8).to_sparse(), "sparse_coo tensor"),
        "meta": (torch.ones(1, 4, 8, device="meta"), "device meta"),
        "nested": (nested, "nested tensor"),
        "uninitialised parameter": (torch.nn.UninitializedParameter(), "UninitializedParameter"),
        "dtype": (torch.float32, "torch.dtype"),
    }
    for name, (obj, message) in cases.items():
        with pytest.raises(TypeError, match=rf"key .*{message}") as info:
            attnx.scaled_dot_product_attention(q, obj, q)
        assert "key" in str(info.value), name
    # A conjugated complex tensor: refused (complex data, or torch's own conversion rule).
    with pytest.raises(TypeError, match="key"):
        attnx.scaled_dot_product_attention(q, torch.ones(1, 4, 8, dtype=torch.complex64).conj(), q)
    # An nn.Parameter is a plain tensor.
    p = torch.nn.Parameter(torch.from_numpy(q.copy()))
    np.testing.assert_array_equal(attnx.scaled_dot_product_attention(q, p, q),
                                  attnx.scaled_dot_product_attention(q, q, q))


def test_causal_bias_is_refused_where_it_is_not_read(torch, rng):
    from torch.nn.attention.bias import causal_upper_left

    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    m = attnx.MultiheadAttention(8, 2, seed=0)
    with pytest.raises(TypeError, match=r"attn_mask is a torch.nn.attention.bias.CausalBias.*is_causal='top_left'"):
        m(x, x, x, attn_mask=causal_upper_left(5, 5))
    # (The padding mask's rank is checked first: a ValueError that names it is as good.)
    with pytest.raises((TypeError, ValueError), match="key_padding_mask"):
        m(x, x, x, key_padding_mask=causal_upper_left(2, 5))
    with pytest.raises(TypeError, match="query is a torch.nn.attention.bias.CausalBias"):
        attnx.scaled_dot_product_attention(causal_upper_left(5, 8), x, x)


# ---------------------------------------------------------------------------------------------
# CausalBias
# ---------------------------------------------------------------------------------------------


class CausalVariant:
    def __init__(self, name):
        self.name = name


def fake_causal_bias(variant, seq_len_q, seq_len_kv):
    """An object recognised as torch's CausalBias without torch (by its class's name and module)."""
    cls = type("CausalBias", (), {"__module__": "torch.nn.attention.bias"})
    obj = cls()
    obj.variant, obj.seq_len_q, obj.seq_len_kv = CausalVariant(variant), seq_len_q, seq_len_kv
    return obj


def test_causal_bias_reads_torchs_objects(torch):
    from torch.nn.attention.bias import CausalBias, CausalVariant as TorchVariant, causal_lower_right, causal_upper_left

    assert causal_bias(causal_upper_left(3, 7)) == ("top_left", 3, 7)
    assert causal_bias(causal_lower_right(3, 7)) == ("bottom_right", 3, 7)
    assert causal_bias(causal_lower_right(4, 4)) == ("bottom_right", 4, 4)

    class Derived(CausalBias):
        pass

    assert causal_bias(Derived(TorchVariant.LOWER_RIGHT, 2, 5)) == ("bottom_right", 2, 5)
    for other in (torch.ones(3, 7), torch.nn.Parameter(torch.ones(2)), np.ones((3, 7), bool), None,
                  [[True]], torch.ones(3, 7).as_subclass(tensor_subclass(torch))):
        assert causal_bias(other) is None


def test_causal_bias_without_torch():
    assert causal_bias(fake_causal_bias("UPPER_LEFT", 2, 3)) == ("top_left", 2, 3)
    assert causal_bias(fake_causal_bias("LOWER_RIGHT", np.int64(5), 9)) == ("bottom_right", 5, 9)
    # Only a class of that name from torch is one.
    assert causal_bias(type("CausalBias", (), {})()) is None
    assert causal_bias(object()) is None
    with pytest.raises(TypeError, match="attn_mask is a CausalBias of variant"):
        causal_bias(fake_causal_bias("DIAGONAL", 2, 3))
    with pytest.raises(TypeError, match="seq_len_kv"):
        causal_bias(fake_causal_bias("UPPER_LEFT", 2, 3.5))
    with pytest.raises(ValueError, match="seq_len_q"):
        causal_bias(fake_causal_bias("UPPER_LEFT", -1, 3))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant, mode", [("upper_left", "top_left"), ("lower_right", "bottom_right")])
@pytest.mark.parametrize("lengths", [(6, 6), (3, 8), (1, 5)], ids=["square", "fewer_queries", "one_query"])
def test_sdpa_reads_a_causal_bias_as_is_causal(torch, rng, dtype, variant, mode, lengths):
    from torch.nn.attention import bias

    n_q, n_kv = lengths
    q = rng.standard_normal((2, 3, n_q, 8)).astype(dtype)
    k = rng.standard_normal((2, 3, n_kv, 8)).astype(dtype)
    v = rng.standard_normal((2, 3, n_kv, 4)).astype(dtype)
    mask = getattr(bias, f"causal_{variant}")(n_q, n_kv)
    got = attnx.scaled_dot_product_attention(q, k, v, mask)
    expected = attnx.scaled_dot_product_attention(q, k, v, is_causal=mode)
    np.testing.assert_array_equal(got, expected)
    with torch.no_grad():
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=mask).numpy()
    np.testing.assert_allclose(got, theirs, **TOL[dtype])
    # Positionally and with tensors that require grad, as torch code passes them.
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    np.testing.assert_array_equal(attnx.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask), expected)
