"""Shared fixtures and helpers of the attnx test suite.

The tests compare attnx with the NumPy reference ``attnx.reference`` (always computed in
float64, on float64 copies of the inputs) to the tolerances of the API contract, and, where
torch is installed, with torch. The helpers here are imported by the test modules as
``from conftest import ...`` (pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import math
import os
import tracemalloc
import warnings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers side by side: a thread of attnx's OpenMP pool that waits at a barrier sleeps
    # instead of spinning on a core that another worker computes on. (Read by the OpenMP
    # runtime when it loads: before attnx is imported below; a worker's environment is its
    # own, and the variable given outside wins.)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import _hardening
import attnx
import attnx.reference as reference  # a submodule import: works whether or not attnx exports it

# The contract's "Numbers" section: float32 vs a float64 reference to rtol 1e-5 / atol 1e-6,
# float64 to 1e-12.
TOLERANCES = {
    np.dtype(np.float32): {"rtol": 1e-5, "atol": 1e-6},
    np.dtype(np.float64): {"rtol": 1e-12, "atol": 1e-12},
}
DTYPES = [np.float32, np.float64]

ISAS = ["scalar", "avx2", "avx512"]  # the kernels, lowest first


def usable_isas():
    """The kernels ATTNX_ISA can pick here: those this build has that the CPU runs."""
    cfg = attnx.show_config()
    return [isa for isa in ISAS[: ISAS.index(cfg["cpu_isa"]) + 1] if isa in cfg["kernels"]]


def run_under_isa(isa: str, script: str, *args: str, timeout: float = 600, env: dict | None = None) -> dict:
    """Runs `script` in a subprocess with ATTNX_ISA=isa (the kernel is chosen once, at import)
    and the variables `env`, and returns the JSON object its last line of output prints; its
    `isa` must be `isa`."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, ATTNX_ISA=isa, **(env or {}))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    # A negative rc is a signal: SIGSEGV (-11) most likely means a read outside an array.
    assert proc.returncode == 0, f"ATTNX_ISA={isa}: rc {proc.returncode}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa, result
    return result
DTYPE_IDS = ["f32", "f64"]


def core_sdpa(query, key, value, attn_mask, causal, scale, out, weights):
    """The core itself on canonical (B, H, L, E) arrays (``attnx._testing.run_sdpa``), with the
    probabilities written to ``weights`` where given: the views' own checks and the weights paths."""
    from attnx import _core, _testing

    options = _core.SdpaOptions(causal, False, scale, -1, -1, False)
    return _testing.run_sdpa(query, key, value, attn_mask, options, out, weights)


def core_mha(num_heads, query, key, value, w_q, w_k, w_v, b_q, b_k, b_v, bias_k, bias_v, add_zero_attn,
             static_k, static_v, attn_mask, key_padding_mask, causal, w_out, b_out, out, weights,
             average_weights, bottom_right=False):
    """The core's forward pass on canonical (N, L, E) arrays (``attnx._testing.run_mha``), with
    the parameters checked by ``_core.MhaWeights`` (of the query's dtype); the results are
    copied into ``out`` and ``weights`` (when given)."""
    from attnx import _core, _testing

    dtype = np.dtype(np.float64 if getattr(query, "dtype", None) == np.float64 else np.float32)
    in_biases = None if b_q is None and b_k is None and b_v is None else (b_q, b_k, b_v)
    bias_kv = None if bias_k is None and bias_v is None else (bias_k, bias_v)
    params = _core.MhaWeights(num_heads, (w_q, w_k, w_v), in_biases, (w_out, b_out), bias_kv, add_zero_attn, dtype)
    options = _core.MhaOptions(causal, bottom_right, weights is not None, average_weights, True)
    call = (query, key, value, attn_mask, key_padding_mask, static_k, static_v)
    result, probabilities = _testing.run_mha(params, call, options)
    out[...] = result
    if weights is not None:
        weights[...] = probabilities


# ---------------------------------------------------------------------------------------------
# Running the suite: xdist's workers, Hypothesis profiles, markers
# ---------------------------------------------------------------------------------------------

# How hard the property tests push, chosen with Hypothesis' own option
# ``--hypothesis-profile=NAME``. Every profile is derandomized (a run is reproducible) and has no
# deadline (the cases' sizes vary a thousandfold) and no example database. Hypothesis loads its
# profile ``ci`` by itself wherever the CI variable is set: here it is the default's, so that CI
# runs the suite as a developer does. ``thorough`` is the hardening run's (.ci/harden): thousands
# of cases per property, and the long versions of the other hardening checks (_hardening.py).
# max_examples is the weight-1 test's; test_properties.py scales it per test.
_COMMON_SETTINGS = dict(
    deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile("default", max_examples=50, **_COMMON_SETTINGS)
settings.register_profile("ci", max_examples=50, **_COMMON_SETTINGS)
settings.register_profile("dev", max_examples=10, **_COMMON_SETTINGS)
settings.register_profile("thorough", max_examples=2500, **_COMMON_SETTINGS)

def pytest_configure(config):
    """The profile named by --hypothesis-profile, for the hardening tests' other knobs."""
    _hardening.PROFILE = config.getoption("hypothesis_profile", None) or "default"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """With pytest-xdist, a run that names no ``-n`` runs on every core: ``-n auto --dist
    worksteal`` (most tests take milliseconds and a few take seconds; idle workers take
    the others' queued tests). ``-n0`` or ``-p no:xdist`` runs the tests in this process, and
    so do ``--pdb`` and ``--collect-only``. (Before xdist's own hook of the same order: a
    conftest's hook runs before the installed plugins'.)"""
    option = config.option
    if (config.pluginmanager.hasplugin("xdist") and getattr(option, "numprocesses", 0) is None
            and not hasattr(config, "workerinput") and not option.usepdb and not option.collectonly):
        option.numprocesses = "auto"
        if option.dist == "no":
            option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
    """Marks ``torch`` the tests that compare with torch: those of a module that imports it
    at its top, and those that take a fixture named ``torch`` (the modules' fixtures that
    import it or skip). A test that imports torch in its body carries the mark itself."""
    for item in items:
        module = getattr(item, "module", None)
        if "torch" in getattr(item, "fixturenames", ()) or (
                getattr(getattr(module, "torch", None), "__name__", None) == "torch"):
            item.add_marker(pytest.mark.torch)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id, so every test is reproducible on its own."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)


@pytest.fixture
def threads():
    """Restores attnx's thread count after the test, whatever the test sets."""
    before = attnx.get_num_threads()
    yield before
    attnx.set_num_threads(before)


@contextlib.contextmanager
def num_threads(n):
    before = attnx.get_num_threads()
    attnx.set_num_threads(n)
    try:
        yield
    finally:
        attnx.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Comparison helpers
# ---------------------------------------------------------------------------------------------


def tolerance(dtype):
    return TOLERANCES[np.dtype(dtype)]


def assert_close(actual, expected64, dtype, err_msg="", atol=None):
    """``actual`` (attnx's result) has ``dtype`` and agrees with a float64 expectation.

    NaN must sit exactly where the expectation has NaN (and +-inf must match exactly).
    ``atol`` replaces the dtype's absolute tolerance where given.
    """
    dtype = np.dtype(dtype)
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {dtype}"
    expected64 = np.asarray(expected64)
    assert actual.shape == expected64.shape, f"shape {actual.shape}, expected {expected64.shape}"
    np.testing.assert_allclose(
        actual.astype(np.float64), expected64.astype(np.float64), equal_nan=True,
        err_msg=err_msg, **{**tolerance(dtype), **({} if atol is None else {"atol": atol})}
    )


def output_atol(args, ref_out, dtype):
    """The absolute tolerance of a float32 MHA output: its rounding error is a sum over the
    embedding (the projections) and grows as sqrt(E) times the output's size, 3-5 units of
    2^-24 * sqrt(E) * rms in attnx and torch alike. 1e-6 alone fails on some seeds, at E = 160
    and on outputs near zero (cancellation) at E = 8, depending on the kernel's tile sizes."""
    if np.dtype(dtype) != np.float32:
        return None
    E = args["embed_dim_to_check"]
    rms = np.sqrt(np.mean(np.square(ref_out[np.isfinite(ref_out)]))) if ref_out.size else 0.0
    return max(1e-6, 8 * 2.0**-24 * np.sqrt(E) * rms)


def assert_identical(a, b, err_msg=""):
    """Bit-for-bit equal (NaN patterns included), same dtype and shape."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8), err_msg=err_msg
    )


def to64(x):
    """A float64 copy of a float array for the reference; bool arrays and None pass through."""
    if x is None:
        return None
    a = np.asarray(x)
    if a.dtype == np.bool_:
        return a.copy()
    return a.astype(np.float64)  # always a copy


def ref_sdpa(query, key, value, attn_mask=None, **kwargs):
    """The reference sdpa in float64 on float64 copies of every float input."""
    return reference.scaled_dot_product_attention(
        to64(query), to64(key), to64(value), attn_mask=to64(attn_mask), **kwargs
    )


MHA_ARRAY_ARGS = (
    "query", "key", "value", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
    "out_proj_weight", "out_proj_bias", "key_padding_mask", "attn_mask", "q_proj_weight",
    "k_proj_weight", "v_proj_weight", "static_k", "static_v",
)


def ref_mha(**kwargs):
    """The reference MHA in float64 on float64 copies; kwargs as attnx's (all by keyword)."""
    kw = {name: (to64(x) if name in MHA_ARRAY_ARGS else x) for name, x in kwargs.items()}
    return reference.multi_head_attention_forward(**kw)




def copies(arrays):
    """Deep copies of the ndarrays in a dict (others kept as they are)."""
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in arrays.items()}


def assert_unchanged(before, after):
    for name, a in before.items():
        if isinstance(a, np.ndarray):
            b = after[name]
            assert_identical(np.asarray(b), a, err_msg=f"input {name} was modified")


def assert_no_alias(result, inputs):
    for name, x in inputs.items():
        if isinstance(x, np.ndarray) and result is not None:
            assert not np.shares_memory(result, x), f"the result shares memory with {name}"


# ---------------------------------------------------------------------------------------------
# Input builders
# ---------------------------------------------------------------------------------------------


def randn(rng, shape, dtype=np.float64, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def sdpa_mask(rng, kind, shape, dtype=np.float64, *, keep_one=True, masked_fraction=0.4):
    """A random sdpa mask (bool: True = may attend; float: additive, with some -inf).

    With ``keep_one`` the last key stays visible in every row, so no row is fully masked.
    """
    if kind is None:
        return None
    shape = tuple(shape)
    hidden = np.asarray(rng.random(shape) < masked_fraction)
    if keep_one and shape[-1] > 0:
        hidden[..., -1] = False
    if kind == "bool":
        return ~hidden
    values = np.asarray(rng.standard_normal(shape))
    values[hidden] = -np.inf
    return values.astype(dtype)


def mha_mask(rng, kind, shape, dtype=np.float64, *, keep_one=True, masked_fraction=0.4):
    """A random MHA mask (bool: True = may NOT attend; float: additive, with some -inf)."""
    m = sdpa_mask(rng, kind, shape, dtype, keep_one=keep_one, masked_fraction=masked_fraction)
    if kind == "bool":
        return ~m
    return m


def mha_args(
    rng, *, L=5, S=6, N=2, E=8, H=2, dtype=np.float32, kdim=None, vdim=None, separate=None,
    in_bias=True, out_bias=True, bias_kv=False, add_zero_attn=False, batch_first=False,
    unbatched=False, need_weights=True, average_attn_weights=True, is_causal=False,
):
    """Keyword arguments for ``multi_head_attention_forward`` with well-scaled random weights."""
    kdim = E if kdim is None else kdim
    vdim = E if vdim is None else vdim
    if separate is None:
        separate = kdim != E or vdim != E
    w = 1.0 / math.sqrt(E)

    def seq(length, dim):
        if unbatched:
            return randn(rng, (length, dim), dtype)
        return randn(rng, (N, length, dim) if batch_first else (length, N, dim), dtype)

    args = dict(
        query=seq(L, E), key=seq(S, kdim), value=seq(S, vdim), embed_dim_to_check=E,
        num_heads=H, in_proj_weight=None, in_proj_bias=None, bias_k=None, bias_v=None,
        add_zero_attn=add_zero_attn, dropout_p=0.0,
        out_proj_weight=randn(rng, (E, E), dtype, w),
        out_proj_bias=randn(rng, (E,), dtype) if out_bias else None,
        training=False, key_padding_mask=None, need_weights=need_weights, attn_mask=None,
        use_separate_proj_weight=separate, q_proj_weight=None, k_proj_weight=None,
        v_proj_weight=None, static_k=None, static_v=None,
        average_attn_weights=average_attn_weights, is_causal=is_causal, batch_first=batch_first,
    )
    if separate:
        args["q_proj_weight"] = randn(rng, (E, E), dtype, w)
        args["k_proj_weight"] = randn(rng, (E, kdim), dtype, 1.0 / math.sqrt(max(kdim, 1)))
        args["v_proj_weight"] = randn(rng, (E, vdim), dtype, 1.0 / math.sqrt(max(vdim, 1)))
    else:
        args["in_proj_weight"] = randn(rng, (3 * E, E), dtype, w)
    if in_bias:
        args["in_proj_bias"] = randn(rng, (3 * E,), dtype, 0.5)
    if bias_kv:
        args["bias_k"] = randn(rng, (1, 1, E), dtype)
        args["bias_v"] = randn(rng, (1, 1, E), dtype)
    return args


# ---------------------------------------------------------------------------------------------
# Layout variants
# ---------------------------------------------------------------------------------------------


def _misaligned(a):
    """The same values in an array whose data starts at an odd byte offset."""
    buf = bytearray(a.nbytes + a.itemsize + 1)
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned or a.itemsize == 1
    return out


def _odd_byte_strides(a):
    """The same values with strides that are not a multiple of the item size."""
    if a.ndim == 0:
        return _misaligned(a)
    item = a.itemsize
    strides = [item] if a.ndim > 1 else [item + 3]
    for d in range(a.ndim - 1, 0, -1):
        inner = strides[0] * max(a.shape[d], 1)
        strides.insert(0, inner + 3 if d == a.ndim - 1 else inner)
    nbytes = sum((n - 1) * s for n, s in zip(a.shape, strides) if n > 0) + item + 8
    buf = bytearray(max(nbytes, 16))
    out = np.ndarray(a.shape, dtype=a.dtype, buffer=buf, offset=0, strides=tuple(strides))
    out[...] = a
    return out


def _strided_all(a):
    """Every axis strided by 2 (the last dimension not contiguous)."""
    big = np.zeros(tuple(2 * n for n in a.shape), a.dtype)
    view = big[(slice(None, None, 2),) * a.ndim]
    view[...] = a
    return view


def _strided_outer(a):
    """Every axis but the last strided by 2 (rows apart, each row contiguous)."""
    if a.ndim < 2:
        return _strided_all(a)
    big = np.zeros(tuple(2 * n for n in a.shape[:-1]) + a.shape[-1:], a.dtype)
    view = big[(slice(None, None, 2),) * (a.ndim - 1)]
    view[...] = a
    return view


def _negative(a):
    """Every axis with a negative stride."""
    rev = (slice(None, None, -1),) * a.ndim
    return np.ascontiguousarray(a[rev])[rev]


def _negative_outer(a):
    rev = (slice(None, None, -1),) * max(a.ndim - 1, 0)
    return np.ascontiguousarray(a[rev])[rev]


def _transposed(a):
    """A view of the last two axes' transposed storage (column-major in the last two dims)."""
    if a.ndim < 2:
        return _negative(a)
    return np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)


def _big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


def _readonly(a):
    b = a.copy()
    b.flags.writeable = False
    return b


def _broadcast_lead(a):
    """(base, variant): the first axis broadcast (stride 0) and its contiguous twin."""
    base = np.ascontiguousarray(np.repeat(a[:1], a.shape[0], axis=0))
    return base, np.broadcast_to(a[:1], a.shape)


def _broadcast_last(a):
    base = np.ascontiguousarray(np.repeat(a[..., :1], a.shape[-1], axis=-1))
    return base, np.broadcast_to(a[..., :1], a.shape)


SAME_VALUE_VARIANTS = {
    "strided_all": _strided_all,
    "strided_outer": _strided_outer,
    "fortran": np.asfortranarray,
    "transposed": _transposed,
    "negative": _negative,
    "negative_outer": _negative_outer,
    "misaligned": _misaligned,
    "odd_byte_strides": _odd_byte_strides,
    "big_endian": _big_endian,
    "readonly": _readonly,
}
BROADCAST_VARIANTS = {"broadcast_lead": _broadcast_lead, "broadcast_last": _broadcast_last}
VARIANT_NAMES = list(SAME_VALUE_VARIANTS) + list(BROADCAST_VARIANTS)


def layout_variant(a, name):
    """``(base, variant)``: ``variant`` holds the values of ``base`` in another memory layout.

    ``base`` is C-contiguous, aligned and native; ``variant`` is non-contiguous, Fortran,
    broadcast (stride 0), negatively strided, misaligned, big-endian, read-only, ... For the
    broadcast variants ``base`` is ``a`` with the broadcast axis repeated; otherwise it is ``a``.
    Returns None where the variant makes no sense for the array (e.g. big-endian bool).
    """
    a = np.ascontiguousarray(a)
    if name in BROADCAST_VARIANTS:
        if a.ndim == 0 or a.shape[0 if name == "broadcast_lead" else -1] == 0:
            return None
        base, var = BROADCAST_VARIANTS[name](a)
    else:
        if a.dtype == np.bool_ and name in ("big_endian", "misaligned", "odd_byte_strides"):
            return None
        base, var = a, SAME_VALUE_VARIANTS[name](a)
    np.testing.assert_array_equal(np.asarray(var, dtype=base.dtype), base)
    return base, var


# ---------------------------------------------------------------------------------------------
# Memory and warnings
# ---------------------------------------------------------------------------------------------


def peak_traced_bytes(fn, runs=3):
    """Runs ``fn()`` (a call without side effects) `runs` times and returns (the first result, the
    least peak of bytes NumPy/Python allocated during a call). tracemalloc counts every thread
    of the process: pytest-xdist's channel thread allocates at moments of its own (600 KiB was
    seen inside a call), where a call's own allocations are in every run."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    results, peaks = [], []
    try:
        for _ in range(runs):
            tracemalloc.reset_peak()
            start, _ = tracemalloc.get_traced_memory()
            results.append(fn())
            _, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - start)
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return results[0], min(peaks)


@contextlib.contextmanager
def quiet_torch():
    """torch warns about e.g. mismatched mask types; the warnings are not under test."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
