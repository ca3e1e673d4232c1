"""Fuzz target of attnx's Python entry points.

``TestOneInput(data)`` turns a byte string into one call of an attnx entry point --
``scaled_dot_product_attention``, ``multi_head_attention_forward``, ``MultiheadAttention``
(construction, forward, ``load_state_dict``), ``set_num_threads``, ``KVCache`` with
``cached_attention``, ``multi_head_attention_step`` (a few decoding steps over a cache),
``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (alone or in their stacks, with their
parameters changed, masks of every kind), ``TransformerDecoder.step`` (a few decoding steps
over a ``TransformerDecoderCache``, a layer broken for one of them), ``varlen_attention``
(ragged batches packed along the first axis: empty sequences, cross lengths, a long sequence
among short ones, GQA, float16/bfloat16 storage, every option, ``out=``), and the private
``_core.sdpa`` / ``_testing.run_sdpa`` / ``_core.mha`` / ``_core.MhaWeights`` --
built as a valid call that is then mutated 0 to 3 times: an argument replaced by a
malformed value (wrong rank, shape, dtype, strides, byte order, alignment, a list, a
string, None, an object whose ``__array__`` raises, ...), or resized, or re-typed, or
re-laid-out. ``varlen_attention``'s ``cu_seqlens`` offsets get their own malformations (not
from 0, decreasing, not ending at the row count, floats, 2-D, another count of sequences for
the queries than for the keys, huge, negative, lists, other integer dtypes, empty), and its
key heads may not divide the query heads; offsets and heads are judged by their values (valid
ones must compute, invalid ones must raise). The public entry points also get what torch code
passes: tensors that require grad (valid: read as their values), tensor subclasses whose
conversion gives garbage of another shape (they must raise), and ``CausalBias`` masks for
sdpa. The only allowed outcomes:

* a result equal to the float64 reference's (``attnx.reference``, to the contract's
  tolerances, NaN/Inf where it has them) -- and an unmutated call must give one; a call
  with ``precision="bfloat16"`` (drawn for sdpa, multi-head attention, the module, the caches,
  the decoding steps, the transformer layers and varlen_attention) against the reference of
  the same rounding, within BF16_TOL of the values' magnitude;
* ``ValueError``, ``TypeError`` or ``NotImplementedError``;
* ``MemoryError`` only for requests that are truly huge (flagged where they are built).

Anything else -- another exception, a wrong result, a modified input, a crash -- fails.

Run it::

    python fuzz/fuzz_attnx.py --seconds 90 --seed 1        # built-in engine (default)
    python fuzz/fuzz_attnx.py --engine atheris --seconds 90 --seed 1   # libFuzzer, if installed

The built-in engine feeds random byte strings from a fixed seed (so a run is reproducible:
the same inputs in the same order), and prints a JSON summary: inputs run, seconds, and
the count of each outcome. ``--save-last PATH`` writes each input there before running it
(to keep the input of a crash); ``--replay PATH`` runs one saved input.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import operator
import os
import pickle
import random
import sys
import time
import warnings
from collections import Counter

import numpy as np

if os.environ.get("ATTNX_FUZZ_ATHERIS_INSTRUMENT"):  # set by --engine atheris
    import atheris

    with atheris.instrument_imports(include=["attnx"]):
        import attnx
else:
    import attnx

from attnx import _core, _testing, reference
from attnx._canonical import sdpa_options

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
F16 = np.dtype(np.float16)
I8 = np.dtype(np.int8)  # KVCache storage only: rows quantized with a float32 scale each
try:  # bfloat16 storage, where ml_dtypes is installed (the test tools include it)
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BF16 = None
HALVES = [F16] + ([BF16] if BF16 is not None else [])
# A float16 result is the float32 result rounded once: half an ulp (2^-11) plus float32's error.
TOL = {F32: dict(rtol=1e-5, atol=1e-6), F64: dict(rtol=1e-12, atol=1e-12), F16: dict(rtol=1e-3, atol=1e-5)}
if BF16 is not None:  # bfloat16 keeps 8 bits: half an ulp is 2^-9
    TOL[BF16] = dict(rtol=4e-3, atol=1e-5)


# precision= of a call: mostly the default, often bfloat16; sometimes a name attnx does not know.
PRECISIONS = [None, None, None, "float32", "bfloat16", "bfloat16"]
BAD_PRECISIONS = ["bf16", "float16", "BFLOAT16", 16, True, np.float32]
# The bound of a bfloat16-precision result against the reference of the same rounding, per unit
# of the values' magnitude (tests/test_precision.py measures the tight bounds).
BF16_TOL = 1.5e-2


def draw_precision(p: Provider, compute):
    """``(precision, invalid)`` for a call computing in `compute`: bfloat16 with float64, or
    an unknown name, is invalid (ValueError)."""
    if p.bool(0.02):
        return p.choice(BAD_PRECISIONS), True
    precision = p.choice(PRECISIONS)
    if precision == "bfloat16" and np.dtype(compute).type is np.float64:  # (either byte order)
        return (precision, True) if p.bool(0.25) else (None, False)
    return precision, False


def module_or_call_precision(p: Provider, module, compute):
    """``(the calls' precision=, bfloat16, invalid)``: a drawn precision set on `module` (the
    calls then pass None) or passed by every call."""
    precision, invalid = draw_precision(p, compute)
    if not invalid and precision is not None and p.bool():
        module.precision = precision
        return None, precision == "bfloat16", invalid
    return precision, precision == "bfloat16", invalid


def bf16_tolerance(arrays) -> dict:
    """assert_allclose's tolerance of a bfloat16-precision result: BF16_TOL relative, and
    absolute per unit of the largest finite value of `arrays` (the values, the weights)."""
    scale = 1.0
    for a in arrays:
        if is_float(a) and a.size:
            with np.errstate(all="ignore"):
                finite = np.abs(a.astype(np.float64)[np.isfinite(a.astype(np.float64))])
            scale = max(scale, float(finite.max(initial=0.0)))
    return dict(rtol=BF16_TOL, atol=BF16_TOL * scale)


def is_float(a) -> bool:
    """Whether `a` is an array of real floats: NumPy's, or ml_dtypes' bfloat16."""
    return isinstance(a, np.ndarray) and (a.dtype.kind == "f" or (BF16 is not None and a.dtype == BF16))


def as_f64(x):
    """A float array as float64 (for the reference); anything else as it is."""
    return np.array(x, dtype=np.float64) if is_float(x) else x
ALLOWED = (ValueError, TypeError, NotImplementedError)
HUGE_BYTES = 2**40  # a request needing this much memory may raise MemoryError
BASE_THREADS = 2

OUTCOMES: Counter = Counter()


class Disallowed(AssertionError):
    """An outcome the contract does not allow."""


# ---------------------------------------------------------------------------------------------
# Reading decisions from the input bytes
# ---------------------------------------------------------------------------------------------


class Provider:
    """Decisions drawn from a byte string (zeros once it is used up)."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b

    def int(self, lo: int, hi: int) -> int:
        """An int in [lo, hi]."""
        span = hi - lo + 1
        value = 0
        for _ in range(max(1, (span.bit_length() + 7) // 8)):
            value = (value << 8) | self.byte()
        return lo + value % span

    def bool(self, p_true: float = 0.5) -> bool:
        return self.byte() < int(256 * p_true)

    def choice(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def seed(self) -> int:
        return self.int(0, 2**32 - 1)


# ---------------------------------------------------------------------------------------------
# Malformed values
# ---------------------------------------------------------------------------------------------


class Planted(Exception):
    """Raised by an input's own __array__: the caller's error, which attnx may pass on."""


class RaisingArray:
    """An object whose conversion to an array raises (the exception is the caller's own)."""

    def __init__(self, exc):
        self.exc = exc

    def __array__(self, dtype=None, copy=None):
        raise self.exc


class FakeTensor:
    """Duck-typed like a torch tensor: detach().cpu().numpy()."""

    def __init__(self, array, fail=False):
        self.array, self.fail = array, fail

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        if self.fail:
            raise RuntimeError("cannot convert")
        return self.array

    def float(self):
        return self


class GradTensor:
    """Duck-typed like a torch tensor that requires grad: its own conversion raises (as torch's
    does, "Can't call numpy() on Tensor that requires grad"); ``detach()`` gives its values.
    A valid input: attnx must read it as its detached values."""

    requires_grad = True

    def __init__(self, array):
        self.array = array
        self.shape, self.ndim = array.shape, array.ndim

    def detach(self):
        return FakeTensor(self.array)

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")


class GarbageTensor:
    """A tensor subclass as torch's CausalBias is one: its ``__array__`` gives uninitialised
    memory of another shape than its own. Any call given one must raise."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype

    def __array__(self, dtype=None, copy=None):
        return np.empty((self.shape[0] + 1,) + self.shape[1:] if self.shape else (3,), self.dtype)


class TorchGarbageTensor(GarbageTensor):
    """The same, from a torch module (by name): refused as a torch object that is no plain tensor."""

    __module__ = "torch.fuzz"


class CausalVariant:
    def __init__(self, name):
        self.name = name


class CausalBias:
    """Looks like torch.nn.attention.bias.CausalBias (by name and module, as attnx tells it) and
    converts as it does: to garbage. sdpa may read it as its causal mode, or refuse it."""

    __module__ = "torch.nn.attention.bias"

    def __init__(self, variant, seq_len_q, seq_len_kv):
        self.variant, self.seq_len_q, self.seq_len_kv = CausalVariant(variant), seq_len_q, seq_len_kv

    def __array__(self, dtype=None, copy=None):
        return np.empty((2, self.seq_len_q, self.seq_len_kv), np.float32)

    def causal_mode(self):
        """The is_causal it stands for (which also aligns a window: docs/api.md)."""
        return "bottom_right" if self.variant.name == "LOWER_RIGHT" else "top_left"


def plain(x):
    """What attnx reads from `x`: a GradTensor's values, anything else as it is."""
    return x.array if isinstance(x, GradTensor) else x


def garbage_in(values) -> bool:
    return any(isinstance(x, GarbageTensor) for x in values)


def torch_habits(p: Provider, args: dict, names) -> list:
    """Sometimes replaces an ndarray argument with a tensor that requires grad (valid) or a
    tensor subclass that converts to garbage; returns the names given garbage."""
    garbage = []
    for _ in range(p.choice([0, 0, 0, 1, 2])):
        name = p.choice(names)
        x = args.get(name)
        if not isinstance(x, np.ndarray):
            continue
        if p.bool(0.75):
            args[name] = GradTensor(x)
        else:
            cls = TorchGarbageTensor if p.bool() else GarbageTensor
            args[name] = cls(x.shape, x.dtype if x.dtype.kind in "fb" else F32)
            garbage.append(name)
    return garbage


WEIRD_DTYPES = [np.float16, np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.complex128,
                np.longdouble, object, "U3", "S2", "M8[s]", [("a", "f4"), ("b", "f4")], ">f4", ">f8"]


def values(p: Provider, shape, dtype):
    """Values for an array: mostly N(0, 1); sometimes special ones sprinkled in."""
    rng = np.random.default_rng(p.seed())
    a = rng.standard_normal(shape)
    kind = p.int(0, 9)
    if kind == 7 and a.size:  # NaN / Inf at a few places
        flat = a.reshape(-1)
        flat[rng.integers(0, a.size, size=1 + a.size // 50)] = p.choice([np.nan, np.inf, -np.inf])
    elif kind == 8:  # large or tiny magnitudes
        a = a * p.choice([1e30, 1e-30, 1e-42, 3e38, 1e4])
    elif kind == 9:
        a = np.zeros(shape)
    with np.errstate(all="ignore"):
        return a.astype(dtype)


def relayout(p: Provider, a):
    """The values of `a` in another memory layout (or `a` itself)."""
    a = np.asarray(a)
    if a.ndim == 0 or a.size == 0 or not (a.dtype.kind in "fbiuc" or is_float(a)):
        return a
    kind = p.int(0, 9)
    if kind == 0:  # every axis strided
        big = np.zeros(tuple(2 * n for n in a.shape), a.dtype)
        v = big[(slice(None, None, 2),) * a.ndim]
        v[...] = a
        return v
    if kind == 1:
        return np.asfortranarray(a)
    if kind == 2:  # negative strides
        rev = (slice(None, None, -1),) * a.ndim
        return np.ascontiguousarray(a[rev])[rev]
    if kind == 3:  # misaligned
        buf = bytearray(a.nbytes + a.itemsize + 1)
        m = np.frombuffer(buf, a.dtype, count=a.size, offset=1).reshape(a.shape)
        m[...] = a
        return m
    if kind == 4:  # odd byte strides
        item = a.itemsize
        strides, step = [], item + 3
        for n in reversed(a.shape):
            strides.insert(0, step)
            step = step * max(n, 1) + 5
        buf = bytearray(step + 64)
        m = np.ndarray(a.shape, a.dtype, buffer=buf, strides=tuple(strides))
        m[...] = a
        return m
    if kind == 5 and a.dtype.kind == "f":
        return a.astype(a.dtype.newbyteorder(">"))
    if kind == 6:
        b = a.copy()
        b.flags.writeable = False
        return b
    if kind == 7:  # the first axis broadcast (stride 0)
        return np.broadcast_to(a[:1], a.shape)
    if kind == 8:  # transposed storage of the last two axes
        return np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2) if a.ndim >= 2 else a
    if kind == 9:  # contiguous, a whole number of items past a 64-byte cache line
        buf = np.zeros(a.nbytes + 128, np.uint8)
        start = -buf.ctypes.data % 64 + a.itemsize * p.int(0, 64 // a.itemsize - 1)
        m = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        m[...] = a
        return m
    return a


def safe_shape(x):
    try:
        return tuple(np.shape(x))
    except Exception:  # noqa: BLE001 - a malformed value's shape is whatever it is
        return (2, 3)


def malformed(p: Provider, like):
    """A malformed replacement for an array argument shaped like `like`."""
    try:
        return _malformed(p, like)
    except (ValueError, TypeError, IndexError, OverflowError):
        return np.zeros((3,) * p.int(0, 5), F32)  # could not derive one from `like`: another rank


def _malformed(p: Provider, like):
    like = np.asarray(like) if isinstance(like, np.ndarray) else np.zeros((2, 3))
    kind = p.int(0, 15)
    if kind == 0:
        return None
    if kind == 1:
        return p.choice([0, 1.5, -1, True, "abc", b"xy", 1 + 2j, float("nan"), object(), [], {}])
    if kind == 2:  # a (possibly ragged) list
        if p.bool():
            return like.tolist() if like.size < 200 else [[1.0, 2.0], [3.0]]
        return [[1.0, 2.0], [3.0]]
    if kind == 3:  # another dtype
        dt = p.choice(WEIRD_DTYPES)
        try:
            return np.zeros(like.shape, dt) if p.bool() else like.astype(dt)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: NumPy's datetime parsing
            return np.zeros(like.shape, dt)
    if kind == 4:  # another rank
        shape = tuple(p.int(0, 4) for _ in range(p.int(0, 6)))
        return values(p, shape, like.dtype if like.dtype.kind == "f" else F32)
    if kind == 5:  # one dimension resized
        if like.ndim == 0:
            return values(p, (3,), F32)
        shape = list(like.shape)
        d = p.int(0, like.ndim - 1)
        shape[d] = p.choice([0, 1, 2, 3, shape[d] + 1, max(shape[d] - 1, 0), 7])
        return values(p, tuple(shape), like.dtype if like.dtype.kind in "fb" else F32)
    if kind == 6:  # extra leading dims
        return values(p, (p.int(0, 3),) * p.int(1, 2) + like.shape, like.dtype if like.dtype.kind == "f" else F32)
    if kind == 7:
        return RaisingArray(Planted("raised by the input's __array__"))
    if kind == 8:
        return np.asarray(like, dtype=object)
    if kind == 9:  # a 0-d array or scalar
        return np.float32(1.0) if p.bool() else np.array(2.0)
    if kind == 10 and like.ndim and like.size:  # broadcast (stride 0) to a larger shape
        shape = list(like.shape)
        shape[0] = shape[0] * p.int(2, 4) if shape[0] == 1 else shape[0]
        try:
            return np.broadcast_to(like[:1] if like.shape[0] else like, tuple(shape))
        except ValueError:
            return like
    if kind == 11:  # the last axis not contiguous
        return np.repeat(like, 2, axis=-1)[..., ::2] if like.ndim else like
    if kind == 12:  # a float mask where bool was, or the reverse
        return like.astype(bool) if like.dtype.kind == "f" else like.astype(F32)
    return relayout(p, like)


# ---------------------------------------------------------------------------------------------
# Checking an outcome
# ---------------------------------------------------------------------------------------------


def well_scaled(arrays) -> bool:
    """Whether every float array is finite and of moderate magnitude (tolerances apply)."""
    for a in arrays:
        if is_float(a) and a.size:
            a = a.astype(np.float64)
            with np.errstate(all="ignore"):
                if not np.isfinite(a).all() or np.abs(a).max() > 20:
                    return False
                nz = np.abs(a[a != 0]).astype(np.float64)
                if nz.size and nz.min() < 1e-20:
                    return False
    return True


def nan_inf_only(arrays) -> bool:
    """Whether the only non-moderate values are NaN/Inf (their pattern must match)."""
    for a in arrays:
        if is_float(a) and a.size:
            a = a.astype(np.float64)
            with np.errstate(all="ignore"):
                fin = a[np.isfinite(a)]
            if fin.size and (np.abs(fin).max() > 20 or np.abs(fin[fin != 0]).min(initial=1) < 1e-20):
                return False
    return True


def logits_moderate(q, k, scale) -> bool:
    """Whether |scale| * sum_e |q_e k_e| stays small for every query/key pair: float32
    rounding of larger logits alone moves results past the contract's tolerance (which holds
    "for well-scaled inputs")."""
    try:
        q = np.abs(np.asarray(q, dtype=np.float64))
        k = np.abs(np.asarray(k, dtype=np.float64))
        if q.size == 0 or k.size == 0:
            return True
        with np.errstate(all="ignore"):  # Cauchy-Schwarz: sum_e |q_e k_e| <= |q| |k|
            bound = abs(float(scale)) * float(np.sqrt((q * q).sum(axis=-1)).max()) * float(
                np.sqrt((k * k).sum(axis=-1)).max())
        return bound <= 16 or not np.isfinite(bound)  # non-finite: NaN/Inf inputs, judged by pattern
    except (ValueError, TypeError):
        return True


def input_arrays(inputs):
    """The inputs as arrays: lists and other array-likes reach attnx as arrays too, so their
    values decide whether a result can be compared as much as an ndarray's do."""
    arrays = []
    for x in inputs:
        if isinstance(x, np.ndarray):
            arrays.append(x)
        elif isinstance(x, (list, tuple)):
            try:
                arrays.append(np.asarray(x))
            except (ValueError, TypeError, OverflowError):
                pass  # ragged or not numeric: attnx rejected it, nothing to compare
    return arrays


def compare(got, expected, dtype, what, inputs, moderate=True, tolerance=None):
    """`got` must have `dtype` and the reference's shape, and its values the reference's within
    the tolerance of `tolerance` (default `dtype`), where the inputs allow a comparison."""
    if expected is None:
        if got is not None:
            raise Disallowed(f"{what}: got an array where the reference gives None")
        return
    if not isinstance(got, np.ndarray):
        raise Disallowed(f"{what}: not an ndarray: {type(got).__name__}")
    if got.dtype != dtype or got.shape != np.shape(expected):
        raise Disallowed(f"{what}: dtype/shape {got.dtype} {got.shape}, expected {dtype} {np.shape(expected)}")
    arrays = input_arrays(inputs)
    expected = np.asarray(expected, dtype=np.float64)
    if well_scaled(arrays) and moderate:
        OUTCOMES["result checked"] += 1
        if isinstance(tolerance, dict):
            OUTCOMES[f"{what}: bfloat16 precision checked"] += 1
        tol = tolerance if isinstance(tolerance, dict) else TOL[dtype if tolerance is None else tolerance]
        np.testing.assert_allclose(got.astype(np.float64), expected, equal_nan=True, err_msg=what, **tol)
    elif nan_inf_only(arrays):
        # NaN/Inf in the inputs: they must reach exactly the outputs the reference has them in.
        # Non-finite exactly where the reference is; NaN wherever it has NaN. Where it has
        # +-Inf, NaN is allowed too: an Inf value whose float32 weight underflows to 0 gives
        # 0 * Inf = NaN, where float64's tiny weight keeps the Inf.
        OUTCOMES["nan pattern checked"] += 1
        g = np.asarray(got, dtype=np.float64)
        bad = (~np.isfinite(g) != ~np.isfinite(expected)) | (np.isnan(expected) & ~np.isnan(g))
        if bad.any():
            raise Disallowed(f"{what}: NaN/Inf at {np.argwhere(bad)[:5].tolist()} differ from the reference")
    else:
        OUTCOMES["result not comparable (extreme values)"] += 1


def snapshot(arrays):
    out = []
    for a in arrays:
        if isinstance(a, np.ndarray) and a.dtype != object:
            out.append((a, np.array(a, copy=True)))
    return out


def check_garbage_refused(ok, garbage, n_mut, what):
    """A call given a tensor that converts to garbage must raise; TypeError where nothing else
    was wrong with it."""
    if not garbage:
        return
    OUTCOMES[f"{what}: tensor subclass given"] += 1
    if ok:
        raise Disallowed(f"{what}: computed with {', '.join(garbage)} a tensor subclass whose conversion is garbage")
    if n_mut == 0 and garbage[0] in ("query",) and LAST_ERROR[0] is not TypeError:
        raise Disallowed(f"{what}: a tensor subclass as query raised {LAST_ERROR[0]}, not TypeError")


def check_untouched(snap, what, allowed=()):
    for a, copy in snap:
        if any(a is x for x in allowed):
            continue
        if not np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(copy).view(np.uint8)):
            raise Disallowed(f"{what}: an input was modified")


LAST_ERROR: list = [None]  # the type of the allowed exception call() caught last
LAST_MESSAGE: list = [""]  # and its message


def call(what, fn, huge=False):
    """Runs fn(); returns (True, result) or (False, None) for an allowed exception."""
    LAST_ERROR[0], LAST_MESSAGE[0] = None, ""
    try:
        with np.errstate(all="ignore"):
            return True, fn()
    except ALLOWED as exc:
        LAST_ERROR[0], LAST_MESSAGE[0] = type(exc), str(exc)
        OUTCOMES[f"{what}: {type(exc).__name__}"] += 1
        if not str(exc):
            raise Disallowed(f"{what}: {type(exc).__name__} without a message") from exc
        return False, None
    except Planted:
        OUTCOMES[f"{what}: the input's own exception passed on"] += 1
        return False, None
    except MemoryError as exc:
        if huge:
            OUTCOMES[f"{what}: MemoryError (huge request)"] += 1
            return False, None
        raise Disallowed(f"{what}: MemoryError on a request that is not huge") from exc


def reference_of(fn):
    """The reference's result, or None where it rejects the input."""
    try:
        with np.errstate(all="ignore"):
            return fn()
    except (ValueError, TypeError, NotImplementedError, IndexError):
        return None


# ---------------------------------------------------------------------------------------------
# The entry points
# ---------------------------------------------------------------------------------------------


def mutate(p: Provider, args: dict, names, n_mut):
    """Apply n_mut mutations to the named entries of args; returns the names touched."""
    touched = []
    for _ in range(n_mut):
        name = p.choice(names)
        args[name] = malformed(p, args.get(name))
        touched.append(name)
    return touched


def block_pattern(p: Provider, shape) -> np.ndarray:
    """A bool pattern (True = open) constant over blocks of rows x keys, as a causal, document
    or block-sparse mask is: whole blocks of the kernels' tiles then close every key or none."""
    rows, keys = p.choice([1, 7, 16, 32, 64]), p.choice([1, 16, 32, 64, 100, 256])
    rng = np.random.default_rng(p.seed())
    coarse = rng.random(shape[:-2] + (-(-shape[-2] // rows), -(-shape[-1] // keys))) < 0.5
    fine = np.repeat(np.repeat(coarse, rows, axis=-2), keys, axis=-1)
    pattern = fine[..., : shape[-2], : shape[-1]]
    if p.bool():  # and causal on top
        pattern = pattern & np.tri(shape[-2], shape[-1], dtype=bool)
    return np.ascontiguousarray(pattern)


def fuzz_sdpa(p: Provider):
    dtype = p.choice([F32, F64])
    lead = tuple(p.int(1, 3) for _ in range(p.int(0, 2)))
    Hk = p.int(1, 3)
    group = p.int(1, 3) if p.bool() else 1
    # (130 queries: four query tiles or more, whose values may be read from an aligned copy)
    L, S = p.choice([0, 1, 2, 5, 17, 33, 70, 130]), p.choice([0, 1, 3, 16, 129, 530])
    E, Ev = p.choice([1, 3, 8, 16, 33]), p.choice([1, 4, 8, 17])
    rank = p.int(2, 2 + len(lead) + 1) if group == 1 else 3 + len(lead)
    batch = (lead + (Hk * group,))[len(lead) + 1 - (rank - 2):] if rank > 2 else ()
    kbatch = batch[:-1] + (Hk,) if group > 1 else batch
    args = {
        "query": values(p, batch + (L, E), dtype),
        "key": values(p, kbatch + (S, E), p.choice([dtype, dtype, F32, F64] + HALVES)),
        "value": values(p, kbatch + (S, Ev), p.choice([dtype, dtype, dtype] + HALVES)),
        "attn_mask": None, "is_causal": False, "scale": None, "enable_gqa": group > 1,
    }
    mask_kind = p.int(0, 4)
    if mask_kind == 4:
        pattern = block_pattern(p, (batch[-1:] if p.bool() else ()) + (L, S))
        added = p.choice([0.0, 0.0, 0.5, np.nan, np.inf])
        args["attn_mask"] = pattern if p.bool() else np.where(pattern, added, -np.inf).astype(dtype)
    elif mask_kind == 1:
        args["attn_mask"] = np.random.default_rng(p.seed()).random(batch[-1:] + (L, S)) < 0.7
    elif mask_kind == 2:
        m = values(p, (L, S), dtype)
        m[np.random.default_rng(p.seed()).random((L, S)) < 0.3] = -np.inf
        args["attn_mask"] = m
    elif mask_kind == 3:
        args["is_causal"] = p.choice([True, "top_left", "bottom_right"])
    if p.bool(0.3):
        args["window"] = (p.choice([None, 0, 1, 5, 200]), p.choice([None, 0, 2, 40]))
    if p.bool(0.3):
        args["scale"] = p.choice([0.0, 0.1, -0.5, 2.0, np.float32(0.25)])
    args["precision"], invalid = draw_precision(p, dtype)
    for name in ("query", "key", "value", "attn_mask"):
        if args[name] is not None and p.bool(0.2):
            args[name] = relayout(p, args[name])
    n_mut = p.choice([0, 0, 1, 1, 1, 2, 3])
    touched = mutate(p, args, ["query", "key", "value", "attn_mask", "is_causal", "scale", "enable_gqa", "out"],
                     n_mut)
    for name in touched:
        if name in ("is_causal", "enable_gqa"):
            args[name] = p.choice([True, False, 1, 0, None, "yes", np.bool_(True), np.array([True, False])])
        elif name == "scale":
            args[name] = p.choice([None, float("nan"), float("inf"), -0.0, "1", 1e300, 1j, np.float64(0.5), [1.0]])
        elif name == "out":
            shape = safe_shape(args["query"])[:-1] + safe_shape(args["value"])[-1:] if p.bool() else (2, 3)
            options = [lambda: np.empty(shape, dtype), lambda: np.empty(shape, F64 if dtype == F32 else F32),
                       lambda: np.empty(shape, dtype).T, lambda: args["query"],
                       lambda: np.zeros(shape, dtype)[::-1], lambda: "out", lambda: None,
                       lambda: np.broadcast_to(np.zeros((), dtype), shape)]
            try:
                args["out"] = p.choice(options)()
            except (ValueError, TypeError, IndexError):
                args["out"] = np.empty((1,), dtype)
    garbage = torch_habits(p, args, ["query", "key", "value", "attn_mask"])
    bias = None
    if args["attn_mask"] is None and p.bool(0.1):  # torch's CausalBias, of the call's lengths
        bias = args["attn_mask"] = CausalBias(p.choice(["UPPER_LEFT", "LOWER_RIGHT"]), L, S)
        n_mut += 1  # (read as is_causal, or refused: either is allowed)
    kwargs = {k: v for k, v in args.items() if k not in ("query", "key", "value")}
    inputs = [plain(args["query"]), plain(args["key"]), plain(args["value"]),
              None if bias is not None else plain(args["attn_mask"])]
    snap = snapshot(inputs)
    ok, got = call("sdpa", lambda: attnx.scaled_dot_product_attention(args["query"], args["key"], args["value"], **kwargs))
    check_untouched(snap, "sdpa", allowed=[args.get("out")])
    check_garbage_refused(ok, garbage, n_mut, "sdpa")
    n_mut += len(garbage)
    if bias is not None:
        OUTCOMES[f"sdpa: CausalBias {'read' if ok else 'refused'}"] += 1
    n_mut += invalid
    if not ok:
        if n_mut == 0:
            raise Disallowed("sdpa: a valid call raised")
        return
    if args.get("out") is not None and got is not args["out"]:
        raise Disallowed("sdpa: out= given but another array returned")
    for x in inputs:
        if isinstance(x, np.ndarray) and x is not args.get("out") and np.shares_memory(got, x):
            raise Disallowed("sdpa: the result shares memory with an input")
    ref_kwargs = {k: plain(v) for k, v in kwargs.items() if k != "out"}
    if bias is not None:  # the causal mode it stands for (read only where is_causal is False)
        ref_kwargs["attn_mask"], ref_kwargs["is_causal"] = None, bias.causal_mode()
    # bfloat16 precision: the reference of the same rounding, on the values attnx computes with.
    bf16 = ref_kwargs.get("precision") == "bfloat16"
    convert = (lambda x: x) if bf16 else as_f64
    expected = reference_of(lambda: reference.scaled_dot_product_attention(
        *(convert(plain(x)) for x in (args["query"], args["key"], args["value"])), **ref_kwargs))
    if expected is None:
        raise Disallowed("sdpa: attnx computed a result for a call the reference rejects")
    scale = args["scale"]
    scale_arr = [np.asarray(float(scale))] if isinstance(scale, (int, float, np.floating)) else []
    q = np.asarray(plain(args["query"]))
    eff_scale = 1 / math.sqrt(q.shape[-1]) if args["scale"] is None and q.shape[-1] else (scale_arr or [1.0])[0]
    moderate = logits_moderate(q, np.asarray(plain(args["key"])), eff_scale) if q.ndim >= 2 else True
    tolerance = bf16_tolerance([np.asarray(plain(args["value"]))]) if bf16 else None
    compare(got, expected, q.dtype.newbyteorder("="), "sdpa", inputs + scale_arr, moderate, tolerance)


# ---------------------------------------------------------------------------------------------
# varlen_attention: sequences packed along the first axis, cu_seqlens offsets
# ---------------------------------------------------------------------------------------------


def packed_offsets(lengths) -> np.ndarray:
    """The (batch + 1,) int64 offsets of sequences of `lengths` packed end to end."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


def ragged_lengths(p: Provider, batch: int):
    """Query and key lengths of a ragged batch: empty sequences, a long one among short ones,
    cross lengths, or decoding-like (a few queries over many keys)."""
    lengths_q = [p.choice([0, 0, 1, 2, 3, 5, 17, 40, 70]) for _ in range(batch)]
    if batch and p.bool(0.15):
        lengths_q[p.int(0, batch - 1)] = p.choice([130, 300, 530])
    kind = p.int(0, 9)
    if kind < 5:  # self-attention: the same lengths
        return lengths_q, list(lengths_q)
    if kind < 8:  # cross lengths
        return lengths_q, [p.choice([0, 1, 3, 16, 33, 90]) for _ in range(batch)]
    return [p.int(0, 3) for _ in range(batch)], [p.choice([0, 1, 7, 129, 600]) for _ in range(batch)]


def malformed_offsets(p: Provider, cu):
    """A malformed replacement for the offsets `cu` (an int64 vector): not from 0, decreasing,
    not ending at the row count, floats, 2-D, another count of sequences, huge or negative
    values, lists, other integer dtypes, empty -- or any malformed value. Some replacements
    are valid after all (a list of the same offsets, int32): the oracle judges the values."""
    cu = np.array(cu, dtype=np.int64)
    rows = int(cu[-1])
    kind = p.int(0, 13)
    if kind == 0:  # not from 0
        if p.bool():
            return cu + p.choice([1, -1, 3])
        cu[0] = p.choice([1, -1, 2**40])
        return cu
    if kind == 1:  # decreasing somewhere
        if cu.size < 3:
            return np.array([0, rows + 1, rows], np.int64)
        i = p.int(1, cu.size - 2)
        cu[i] = cu[i + 1] + p.int(1, 3)
        return cu
    if kind == 2:  # not ending at the row count
        cu[-1] += p.choice([-1, 1, 5, -rows - 1])
        return cu
    if kind == 3:  # floats (of the same values)
        return cu.astype(p.choice([F64, F32, F16]))
    if kind == 4:  # 2-D
        return p.choice([lambda: cu[None], lambda: cu[:, None], lambda: np.stack([cu, cu])])()
    if kind == 5:  # another count of sequences (each valid alone): an empty one appended or prepended,
        if p.bool() or cu.size < 3:  # or two merged
            return np.concatenate([cu, cu[-1:]]) if p.bool() else np.concatenate([cu[:1], cu])
        return np.delete(cu, p.int(1, cu.size - 2))
    if kind == 6:  # huge values
        huge = p.choice([2**31, 2**32 + rows, 2**40, 2**62, 2**63 - 1, -(2**63), -(2**62)])
        if p.bool(0.3):  # as unsigned: past int64
            u = cu.astype(np.uint64)
            u[p.int(0, u.size - 1)] = p.choice([2**63, 2**64 - 1, 2**63 + rows])
            return u
        i = p.int(0, cu.size - 1)
        cu[i] = huge
        if p.bool():  # and every later offset: non-decreasing up to the last
            cu[i:-1] = huge
        return cu
    if kind == 7:  # negative values
        i = p.int(0, cu.size - 1)
        cu[i] = -p.choice([1, 2, 7, 2**31])
        if p.bool():
            cu = cu - cu[-1]  # all of them at or below 0, ending at 0
        return cu
    if kind == 8:  # lists: of the offsets (valid), of floats, nested, of ints past int64
        return p.choice([lambda: cu.tolist(), lambda: [float(x) for x in cu], lambda: [cu.tolist()],
                         lambda: cu.tolist()[:-1] + [2**70], lambda: [int(x) for x in cu[:-1]] + [str(rows)],
                         lambda: tuple(cu.tolist())])()
    if kind == 9:  # other integer (or bool) dtypes: values wrapped where they do not fit
        dt = p.choice([np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.uint64, ">i8", ">i4",
                       np.bool_])
        return cu.astype(dt)
    if kind == 10:  # no offsets at all
        return p.choice([np.zeros(0, np.int64), [], np.zeros((0, 1), np.int64)])
    if kind == 11:  # a scalar
        return p.choice([np.int64(0), 0, np.array(cu[-1])])
    if kind == 12:  # another layout (the broadcast one changes the values)
        return relayout(p, cu)
    return malformed(p, cu)


def offsets_valid(cu, rows) -> bool:
    """Whether `cu` is what varlen_attention accepts as the offsets of `rows` rows: integers
    (an array or a list), 1-D, at least one, from 0, never decreasing, ending at `rows`."""
    if isinstance(cu, (GarbageTensor, RaisingArray)) or rows is None:
        return False
    try:
        a = np.asarray(plain(cu))
    except Exception:  # noqa: BLE001 - not convertible: not valid
        return False
    if a.dtype.kind not in "iu" or a.ndim != 1 or a.size == 0:
        return False
    v = [int(x) for x in a]  # Python ints: no wrap-around in the comparisons
    return v[0] == 0 and v[-1] == rows and all(x <= y for x, y in zip(v, v[1:]))


def offsets_count(cu):
    try:
        return np.asarray(plain(cu)).size
    except Exception:  # noqa: BLE001
        return None


def packed_shape(x):
    """The shape of a packed array argument as attnx reads it, None where it is no 3-D array."""
    if isinstance(x, (GarbageTensor, RaisingArray)) or x is None:
        return None
    try:
        a = np.asarray(plain(x))
    except Exception:  # noqa: BLE001
        return None
    return a.shape if a.ndim == 3 and (is_float(a) or a.dtype.kind == "f") else None


def reference_window(window):
    """`window` for the reference: a bound past int64 (which the reference's position
    arithmetic cannot hold: OverflowError) as None, the same window for any real length."""
    if not isinstance(window, tuple):
        return window
    return tuple(None if isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 2**62 else b
                 for b in window)


def fuzz_varlen(p: Provider):
    """varlen_attention on a ragged batch (empty sequences, cross lengths, a long sequence among
    short ones, GQA, float16/bfloat16 storage, every option, out=), then mutated: malformed
    offsets above all, and key heads that do not divide the query heads. The offsets and
    head counts are judged by their values: valid ones must compute, invalid ones raise."""
    dtype = p.choice([F32, F32, F64] + HALVES)
    compute = F64 if dtype == F64 else F32
    batch = p.choice([0, 1, 1, 2, 3, 4, 6])
    lengths_q, lengths_k = ragged_lengths(p, batch)
    Hk, group = p.int(1, 3), p.choice([1, 1, 2, 3, 4])
    Hq = Hk * group
    E, Ev = p.choice([1, 3, 8, 16, 33, 64]), p.choice([1, 4, 8, 17, 64])
    Tq, Tk = sum(lengths_q), sum(lengths_k)
    kv_dtype = p.choice([dtype, dtype, F32, F64] + HALVES)
    args = {
        "query": values(p, (Tq, Hq, E), dtype),
        "key": values(p, (Tk, Hk, E), kv_dtype),
        "value": values(p, (Tk, Hk, Ev), p.choice([kv_dtype, kv_dtype, dtype] + HALVES)),
        "cu_seqlens_q": packed_offsets(lengths_q),
        "cu_seqlens_k": packed_offsets(lengths_k),
        "is_causal": p.choice([False, False, False, True, "top_left", "bottom_right"]),
    }
    if lengths_q == lengths_k and p.bool():
        args["cu_seqlens_k"] = None  # self-attention: the query's offsets
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if args[name] is not None and p.bool(0.15):  # other valid forms: int32, a list
            args[name] = args[name].astype(np.int32) if p.bool() else args[name].tolist()
    if p.bool(0.3):
        args["window"] = (p.choice([None, 0, 1, 5, 40]), p.choice([None, 0, 2, 40]))
    if p.bool(0.2):
        args["softcap"] = p.choice([0.5, 1.0, 5.0, 30.0])
    if p.bool(0.3):
        args["scale"] = p.choice([0.0, 0.1, -0.5, 2.0, np.float32(0.25)])
    args["precision"], invalid = draw_precision(p, compute)
    sentinel_rows = 0
    if p.bool(0.3):  # out=: the first rows of a larger buffer, whose other rows must stay as they are
        sentinel_rows = p.int(0, 3)
        buffer = np.full((Tq + sentinel_rows, Hq, Ev), 7.0, dtype)
        args["out"] = buffer[:Tq]
    for name in ("query", "key", "value"):
        if p.bool(0.2):
            args[name] = relayout(p, args[name])
    # Most calls unmutated: most mutations here make errors (the offsets'), and the oracle
    # must still compare results on a fair share of the inputs.
    n_mut = p.choice([0, 0, 0, 0, 1, 1, 2])
    names = ["query", "key", "value", "cu_seqlens_q", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k", "heads",
             "is_causal", "scale", "window", "softcap", "precision", "out"]
    others = 0  # mutations other than of the offsets and the head counts (judged by their values)
    for _ in range(n_mut):
        name = p.choice(names)
        if name in ("cu_seqlens_q", "cu_seqlens_k"):
            cu = packed_offsets(lengths_q if name == "cu_seqlens_q" else lengths_k)
            args[name] = malformed_offsets(p, cu) if p.bool(0.85) else malformed(p, cu)
            continue
        others += name != "heads"
        if name == "heads":  # key and value heads that do not divide the query heads
            hk = p.choice([h for h in (2, 3, 4, 5, Hq + 1) if Hq % h])
            args["key"] = values(p, (Tk, hk, E), kv_dtype)
            args["value"] = values(p, (Tk, hk, Ev), kv_dtype)
        elif name == "is_causal":
            args[name] = p.choice(["diagonal", "TOP_LEFT", 1, 0, None, "yes", np.bool_(True), np.array([True, False])])
        elif name == "scale":
            args[name] = p.choice([None, float("nan"), float("inf"), -0.0, "1", 1e300, 1j, np.float64(0.5), [1.0]])
        elif name == "window":
            args[name] = p.choice([(-1, 0), (1,), "ab", (1.5, 2), (None, None), 5, (2**70, 0), (np.int64(3), None)])
        elif name == "softcap":
            args[name] = p.choice([0.0, -1.0, float("nan"), float("inf"), "2", True, 1e-30, 1e38, 1e300, [1.0]])
        elif name == "precision":
            args[name] = p.choice(BAD_PRECISIONS)
        elif name == "out":
            shape = (Tq, Hq, Ev)
            options = [lambda: np.empty(shape, F64 if dtype != F64 else F32), lambda: np.empty((Tq + 1, Hq, Ev), dtype),
                       lambda: np.empty((Hq, Tq, Ev), dtype).transpose(1, 0, 2), lambda: np.empty(shape, dtype)[::-1],
                       lambda: args["query"], lambda: "out", lambda: np.empty(shape, dtype).tolist(),
                       lambda: np.broadcast_to(np.zeros((), dtype), shape)]
            args["out"] = p.choice(options)()
            sentinel_rows = 0
        else:
            args[name] = malformed(p, args[name])
    garbage = torch_habits(p, args, ["query", "key", "value", "cu_seqlens_q", "cu_seqlens_k"])
    kwargs = {k: v for k, v in args.items() if k not in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")}
    inputs = [plain(args[name]) for name in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")]
    snap = snapshot(inputs)
    out_given = args.get("out")
    out_base = out_given.base if isinstance(out_given, np.ndarray) and sentinel_rows else None
    ok, got = call("varlen_attention", lambda: attnx.varlen_attention(
        args["query"], args["key"], args["value"], args["cu_seqlens_q"], args["cu_seqlens_k"], **kwargs))
    check_untouched(snap, "varlen_attention", allowed=[out_given])
    check_garbage_refused(ok, garbage, n_mut, "varlen_attention")
    if out_base is not None and not (out_base[Tq:] == 7.0).all():
        raise Disallowed("varlen_attention: a row of out='s buffer past the packed queries was written")
    # What the offsets and shapes ask for, judged by their values.
    q_shape, k_shape, v_shape = (packed_shape(args[name]) for name in ("query", "key", "value"))
    cu_k = args["cu_seqlens_k"] if args["cu_seqlens_k"] is not None else args["cu_seqlens_q"]
    offsets_ok = (offsets_valid(args["cu_seqlens_q"], q_shape and q_shape[0])
                  and offsets_valid(cu_k, k_shape and k_shape[0])
                  and offsets_count(args["cu_seqlens_q"]) == offsets_count(cu_k))
    heads_ok = bool(q_shape and k_shape and k_shape[1] and q_shape[1] % k_shape[1] == 0)
    if not offsets_ok:
        OUTCOMES["varlen_attention: malformed offsets"] += 1
    if not heads_ok:
        OUTCOMES["varlen_attention: heads not a multiple"] += 1
    if not ok:
        if others == 0 and not invalid and not garbage and offsets_ok and heads_ok:
            raise Disallowed(f"varlen_attention: a valid call raised {LAST_ERROR[0]}: {LAST_MESSAGE[0]}")
        return
    if garbage:
        return  # (check_garbage_refused raised already)
    if not offsets_ok:
        raise Disallowed(f"varlen_attention: computed with invalid offsets {args['cu_seqlens_q']!r}, {cu_k!r} "
                         f"for {q_shape and q_shape[0]} query and {k_shape and k_shape[0]} key rows")
    if not heads_ok:
        raise Disallowed(f"varlen_attention: computed with query heads {q_shape and q_shape[1]} and key heads "
                         f"{k_shape and k_shape[1]}")
    if invalid:
        raise Disallowed(f"varlen_attention: computed with precision={args['precision']!r} and a {dtype} query")
    OUTCOMES["varlen_attention: computed"] += 1
    if out_given is not None and got is not out_given:
        raise Disallowed("varlen_attention: out= given but another array returned")
    for x in inputs:
        if isinstance(x, np.ndarray) and x is not out_given and np.shares_memory(got, x):
            raise Disallowed("varlen_attention: the result shares memory with an input")
    ref_kwargs = {k: plain(v) for k, v in kwargs.items() if k != "out"}
    if "window" in ref_kwargs:
        ref_kwargs["window"] = reference_window(ref_kwargs["window"])
    bf16 = ref_kwargs.get("precision") == "bfloat16"
    # bfloat16 precision: the reference of the same rounding, on the float32 values attnx computes with.
    convert = (lambda x: np.asarray(x, F32)) if bf16 else as_f64
    expected = reference_of(lambda: reference.varlen_attention(
        *(convert(plain(args[name])) for name in ("query", "key", "value")),
        plain(args["cu_seqlens_q"]), plain(args["cu_seqlens_k"]), **ref_kwargs))
    if expected is None:
        raise Disallowed("varlen_attention: attnx computed a result for a call the reference rejects")
    q, k, v = (np.asarray(plain(args[name])) for name in ("query", "key", "value"))
    scale = args.get("scale")
    scale_arr = [np.asarray(float(scale))] if isinstance(scale, (int, float, np.floating)) else []
    eff_scale = 1 / math.sqrt(q.shape[-1]) if scale is None and q.shape[-1] else (scale_arr or [1.0])[0]
    moderate = logits_moderate(q, k, eff_scale)
    result_dtype = q.dtype.newbyteorder("=")
    tolerance = result_dtype if result_dtype.itemsize <= np.dtype(compute).itemsize else compute
    if bf16:
        tolerance = bf16_tolerance([v])
        if result_dtype.itemsize == 2:  # and the result's own rounding
            tolerance["rtol"] += TOL[result_dtype]["rtol"]
    compare(got, expected, result_dtype, "varlen_attention", [q, k, v] + scale_arr, moderate, tolerance)


def mha_valid(p: Provider):
    dtype = p.choice([F32, F64])
    H = p.int(1, 3)
    E = H * p.choice([1, 2, 4])
    kdim, vdim = p.choice([E, E, 3]), p.choice([E, E, 5])
    separate = kdim != E or vdim != E or p.bool()
    N, L, S = p.int(0, 3), p.choice([0, 1, 4, 9]), p.choice([0, 1, 5, 12])
    unbatched, batch_first = p.bool(0.2), p.bool()
    static = None if not p.bool(0.2) else "kv"

    def seq(length, dim):
        shape = (length, dim) if unbatched else ((N, length, dim) if batch_first else (length, N, dim))
        return values(p, shape, dtype)

    n = 1 if unbatched else N
    a = dict(query=seq(L, E), key=seq(S, kdim), value=seq(S, vdim), embed_dim_to_check=E, num_heads=H,
             in_proj_weight=None if separate else values(p, (3 * E, E), dtype) / math.sqrt(E),
             in_proj_bias=values(p, (3 * E,), dtype) if p.bool() else None,
             bias_k=None, bias_v=None, add_zero_attn=p.bool(0.3), dropout_p=0.0,
             out_proj_weight=values(p, (E, E), dtype) / math.sqrt(E),
             out_proj_bias=values(p, (E,), dtype) if p.bool() else None,
             training=p.bool(), key_padding_mask=None, need_weights=p.bool(), attn_mask=None,
             use_separate_proj_weight=separate,
             q_proj_weight=values(p, (E, E), dtype) / math.sqrt(E) if separate else None,
             k_proj_weight=values(p, (E, kdim), dtype) / math.sqrt(kdim) if separate else None,
             v_proj_weight=values(p, (E, vdim), dtype) / math.sqrt(vdim) if separate else None,
             static_k=None, static_v=None, average_attn_weights=p.bool(), is_causal=p.bool(0.3),
             batch_first=batch_first)
    S_src = S
    if static:
        S_src = p.choice([0, 2, 6])
        a["static_k"] = values(p, (n * H, S_src, E // H), dtype)
        a["static_v"] = values(p, (n * H, S_src, E // H), dtype)
    elif p.bool(0.3):
        a["bias_k"], a["bias_v"] = values(p, (1, 1, E), dtype), values(p, (1, 1, E), dtype)
    if p.bool(0.4):
        kpm = np.random.default_rng(p.seed()).random((S_src,) if unbatched else (n, S_src)) < 0.3
        a["key_padding_mask"] = kpm if p.bool() else np.where(kpm, -np.inf, 0.0).astype(dtype)
    if p.bool(0.4):
        shape = (L, S_src) if p.bool() else (n * H, L, S_src)
        am = np.random.default_rng(p.seed()).random(shape) < 0.3
        if p.bool():
            am = ~block_pattern(p, shape)
        a["attn_mask"] = am if p.bool() else np.where(am, -np.inf, p.choice([0.0, 0.5])).astype(dtype)
    return a


MHA_ARRAYS = ["query", "key", "value", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
              "out_proj_weight", "out_proj_bias", "key_padding_mask", "attn_mask", "q_proj_weight",
              "k_proj_weight", "v_proj_weight", "static_k", "static_v"]
MHA_SCALARS = ["embed_dim_to_check", "num_heads", "add_zero_attn", "dropout_p", "training",
               "need_weights", "use_separate_proj_weight", "average_attn_weights", "is_causal", "batch_first"]
SCALAR_JUNK = [None, 0, 1, -1, 2, 3, 4, 2**40, 1.5, float("nan"), "2", True, False, np.int64(2),
               np.bool_(False), np.array([1, 2]), 0.5, 1.0, [], object()]


def fuzz_mha(p: Provider):
    a = mha_valid(p)
    a["precision"], invalid = draw_precision(p, a["query"].dtype)
    for name in MHA_ARRAYS:
        if isinstance(a[name], np.ndarray) and p.bool(0.15):
            a[name] = relayout(p, a[name])
    n_mut = p.choice([0, 0, 1, 1, 1, 2, 3])
    for _ in range(n_mut):
        if p.bool(0.7):
            name = p.choice(MHA_ARRAYS)
            a[name] = malformed(p, a[name])
        else:
            a[p.choice(MHA_SCALARS)] = p.choice(SCALAR_JUNK)
    garbage = torch_habits(p, a, MHA_ARRAYS)
    inputs = [plain(a[n]) for n in MHA_ARRAYS]
    snap = snapshot(inputs)
    ok, got = call("mha", lambda: attnx.multi_head_attention_forward(**a))
    check_untouched(snap, "mha")
    # The projections the call does not use are never read (as in torch): garbage there is no
    # computation on garbage.
    try:
        separate = bool(a["use_separate_proj_weight"])
    except (TypeError, ValueError):
        separate = None
    unused = {True: ("in_proj_weight",), False: ("q_proj_weight", "k_proj_weight", "v_proj_weight")}.get(separate, ())
    garbage = [name for name in garbage if name not in unused]
    check_garbage_refused(ok, garbage, n_mut + invalid, "mha")
    n_mut += len(garbage) + invalid
    if not ok:
        if n_mut == 0:
            raise Disallowed("mha: a valid call raised")
        return
    out, weights = got
    for r in (out, weights):
        for x in inputs:
            if r is not None and isinstance(x, np.ndarray) and np.shares_memory(r, x):
                raise Disallowed("mha: a result shares memory with an input")
    bf16 = a["precision"] == "bfloat16"
    conv = {k: plain(v) if bf16 else as_f64(plain(v)) for k, v in a.items()}
    expected = reference_of(lambda: reference.multi_head_attention_forward(**conv))
    if expected is None:
        raise Disallowed("mha: attnx computed a result for a call the reference rejects")
    dtype = np.asarray(plain(a["query"])).dtype.newbyteorder("=")
    tolerance = bf16_tolerance(input_arrays(inputs)) if bf16 else None
    compare(out, expected[0], dtype, "mha output", inputs, tolerance=tolerance)
    compare(weights, expected[1], dtype, "mha weights", inputs, tolerance=bf16_tolerance([]) if bf16 else None)


def fuzz_module(p: Provider):
    E = p.choice([1, 2, 4, 6, 8])
    kw = dict(embed_dim=E, num_heads=p.choice([1, 2]), bias=p.bool(), add_bias_kv=p.bool(0.3),
              add_zero_attn=p.bool(0.3), kdim=p.choice([None, None, 3]), vdim=p.choice([None, None, 5]),
              batch_first=p.bool(), dtype=p.choice([np.float32, np.float64, "float32", "f8", None]),
              dropout=p.choice([0.0, 0.0, 0.0, 0.1]), device=p.choice([None, None, "cpu"]), seed=p.int(0, 1000))
    huge = False
    if p.bool(0.25):  # malformed constructor arguments
        name = p.choice(list(kw))
        # 2**40 as a size is refused at allocation everywhere. (2**20 as embed_dim asked for
        # 24 TiB, which a system that overcommits memory without limit may grant, and the
        # weights' initialisation then fills until the process is killed.)
        junk = [None, 0, -3, 1.5, "8", True, np.int32(4), 2**40, 2**62, np.float16, np.int32, object,
                "float16", np.random.default_rng(0), -1, [1], "cuda", 1.5, float("nan")]
        kw[name] = p.choice(junk)
        huge = name in ("embed_dim", "kdim", "vdim")
    ok, m = call("MultiheadAttention()", lambda: attnx.MultiheadAttention(**kw), huge=huge)
    if not ok:
        return
    if p.bool():
        m.eval()
    # torch's rule: dropout applies in training mode, where attnx must refuse the call.
    dropout_applies = m.training and m.dropout > 0
    dtype = m.dtype
    # load_state_dict: a state_dict of another module, perhaps mangled.
    sd = attnx.MultiheadAttention(
        m.embed_dim, m.num_heads, bias=m.bias, add_bias_kv=m.add_bias_kv, kdim=m.kdim, vdim=m.vdim,
        dtype=np.float64, seed=p.int(0, 99)).state_dict()
    mangle = p.int(0, 9)
    if mangle == 1:
        sd.pop(p.choice(sorted(sd)))
    elif mangle == 2:
        sd["extra"] = np.zeros(3)
    elif mangle == 3:
        k = p.choice(sorted(sd))
        sd[k] = malformed(p, sd[k])
    elif mangle == 4:
        sd = {k: FakeTensor(v, fail=p.bool(0.3)) for k, v in sd.items()}
    elif mangle == 5:
        sd = {k: v.tolist() for k, v in sd.items()}
    elif mangle == 6:
        sd = p.choice([None, [], "state", 3, {1: 2}])
    strict = p.choice([True, True, False, "yes", None])
    before = {k: v.copy() for k, v in m.state_dict().items()}
    ok, res = call("load_state_dict", lambda: m.load_state_dict(sd, strict=strict))
    after = m.state_dict()
    if not ok:  # nothing loaded
        for k in before:
            if not np.array_equal(before[k], after[k], equal_nan=True):
                raise Disallowed("load_state_dict: raised but changed the module")
    elif mangle == 0:
        for k, v in sd.items():
            np.testing.assert_array_equal(after[k], np.asarray(v).astype(dtype), err_msg=k)
    # forward
    N, L, S = p.int(0, 2), p.choice([0, 1, 3, 7]), p.choice([0, 1, 4, 9])
    def seq(length, dim):
        return values(p, (N, length, dim) if m.batch_first else (length, N, dim), p.choice([dtype, F32, F64]))
    q, k, v = seq(L, m.embed_dim), seq(S, m.kdim), seq(S, m.vdim)
    opts = {}
    if p.bool(0.3):
        opts["key_padding_mask"] = np.random.default_rng(p.seed()).random((N, S)) < 0.3
    if p.bool(0.3):
        opts["attn_mask"] = np.random.default_rng(p.seed()).random((L, S)) < 0.3
    for name in ("need_weights", "average_attn_weights", "is_causal"):
        if p.bool(0.3):
            opts[name] = p.choice([True, False])
    # The module's precision (constructor or attribute) or the call's.
    precision, invalid = draw_precision(p, dtype)
    if p.bool() or invalid:
        opts["precision"] = precision
    elif precision is not None:
        m.precision = precision
    precision = opts.get("precision") or m.precision
    args = {"query": q, "key": k, "value": v}
    n_mut = p.choice([0, 0, 1, 2]) + invalid
    for _ in range(n_mut):
        name = p.choice(["query", "key", "value", "key_padding_mask", "attn_mask", "need_weights"])
        if name == "need_weights":
            opts[name] = p.choice(SCALAR_JUNK)
        elif name in args:
            args[name] = malformed(p, args[name])
        else:
            opts[name] = malformed(p, opts.get(name))
    garbage = torch_habits(p, args, ["query", "key", "value"])
    garbage += torch_habits(p, opts, ["key_padding_mask", "attn_mask"])
    inputs = [plain(x) for x in (args["query"], args["key"], args["value"], opts.get("key_padding_mask"),
                                 opts.get("attn_mask"))]
    snap = snapshot(inputs)
    params = m.state_dict()
    ok, got = call("MultiheadAttention.forward", lambda: m(args["query"], args["key"], args["value"], **opts))
    check_untouched(snap, "MultiheadAttention.forward")
    for key, value in m.state_dict().items():
        if not np.array_equal(value, params[key], equal_nan=True):
            raise Disallowed("MultiheadAttention.forward changed a parameter")
    check_garbage_refused(ok, garbage, n_mut + dropout_applies, "MultiheadAttention.forward")
    n_mut += len(garbage)
    if dropout_applies:
        if ok:
            raise Disallowed("MultiheadAttention.forward: computed in training mode with dropout > 0")
        OUTCOMES[f"MultiheadAttention.forward: dropout in training mode, {LAST_ERROR[0].__name__}"] += 1
        return
    if not ok:
        if n_mut == 0:
            raise Disallowed("MultiheadAttention.forward: a valid call raised")
        return
    out, weights = got
    cast = lambda x: np.asarray(x).astype(np.float64) if np.asarray(x).dtype.kind == "f" else x  # noqa: E731
    args = {k: plain(v) for k, v in args.items()}
    opts = {k: plain(v) for k, v in opts.items()}
    bf16 = precision == "bfloat16"
    if bf16:  # the reference of the same rounding, on the values attnx computes with (float32)
        cast = lambda x: np.asarray(x).astype(F32) if is_float(np.asarray(x)) else x  # noqa: E731
    opts["precision"] = precision
    expected = reference_of(lambda: reference.multi_head_attention_forward(
        cast(np.asarray(args["query"]).astype(dtype)), cast(np.asarray(args["key"]).astype(dtype)),
        cast(np.asarray(args["value"]).astype(dtype)), m.embed_dim, m.num_heads,
        *(None if x is None else cast(x) for x in (m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v)),
        m.add_zero_attn, 0.0, cast(m.out_proj_weight), None if m.out_proj_bias is None else cast(m.out_proj_bias),
        training=False, use_separate_proj_weight=m.in_proj_weight is None,
        q_proj_weight=None if m.q_proj_weight is None else cast(m.q_proj_weight),
        k_proj_weight=None if m.k_proj_weight is None else cast(m.k_proj_weight),
        v_proj_weight=None if m.v_proj_weight is None else cast(m.v_proj_weight),
        batch_first=m.batch_first, **opts))
    if expected is None:
        raise Disallowed("MultiheadAttention: attnx computed a result for a call the reference rejects")
    # Projections over thousands of input features sum that many float32 products: their
    # rounding alone exceeds the tolerance, so such results are not compared.
    moderate = max(m.embed_dim, m.kdim, m.vdim) <= 4096
    tolerance = bf16_tolerance(input_arrays(inputs) + list(params.values())) if bf16 else None
    compare(out, expected[0], dtype, "module output", inputs + list(params.values()), moderate, tolerance)
    compare(weights, expected[1], dtype, "module weights", inputs + list(params.values()), moderate,
            bf16_tolerance([]) if bf16 else None)


def fuzz_set_num_threads(p: Provider):
    n = p.choice([0, -1, 1, 2, 3, 64, 1000, 10**6, 2**31 - 1, 2**31, 2**63, -(2**63), 1.0, 2.5, "2",
                  None, True, False, np.int8(3), np.uint64(2**64 - 1), np.int64(4), np.float64(2.0),
                  np.array(2), np.array([2]), [2], object()])
    before = attnx.get_num_threads()
    ok, _ = call("set_num_threads", lambda: attnx.set_num_threads(n))
    now = attnx.get_num_threads()
    if not ok and now != before:
        raise Disallowed("set_num_threads raised but changed the count")
    if not (isinstance(now, int) and 1 <= now <= max(64, 4 * (os.cpu_count() or 1))):
        raise Disallowed(f"get_num_threads() = {now!r} after set_num_threads({n!r})")
    # A computation with the new count gives the numbers of the usual one.
    rng = np.random.default_rng(p.seed())
    q = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 700, 16)).astype(np.float32)
    got = attnx.scaled_dot_product_attention(q, k, k)
    attnx.set_num_threads(BASE_THREADS)
    if not np.array_equal(got, attnx.scaled_dot_product_attention(q, k, k)):
        raise Disallowed(f"a result depends on the thread count ({now})")


def core_sdpa_expected(q, k, v, mask, causal, scale):
    """float64 expectation of _core.sdpa's out and weights (causal and a mask may combine)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    Hq, Hk = q.shape[1], k.shape[1]
    if Hk:
        k, v = np.repeat(k, Hq // Hk, axis=1), np.repeat(v, Hq // Hk, axis=1)
    L, S = q.shape[2], k.shape[2]
    bias = np.zeros((1, 1, L, S)) if mask is None else np.asarray(mask, np.float64)
    if causal:  # keys above the diagonal are closed by selection, whatever the mask holds
        bias = np.where(np.arange(S)[None, :] > np.arange(L)[:, None], -np.inf, bias)
    return reference._attention(q, k, v, bias, scale)


def fuzz_core(p: Provider):
    which = p.choice(["sdpa", "sdpa", "sdpa_canonical", "mha", "mha_weights"])
    dtype = p.choice([F32, F64])
    if which == "mha_weights":
        fuzz_core_mha_weights(p, dtype)
        return
    if which in ("sdpa", "sdpa_canonical"):
        B, Hk, g = p.int(0, 2), p.int(0, 2), p.int(1, 2)
        L, S, E, Ev = p.choice([0, 1, 3, 40]), p.choice([0, 1, 7, 600]), p.choice([1, 4, 16]), p.choice([1, 3, 8])
        a = dict(query=values(p, (B, Hk * g, L, E), dtype), key=values(p, (B, Hk, S, E), dtype),
                 value=values(p, (B, Hk, S, Ev), dtype),
                 attn_mask=values(p, (B, Hk * g, L, S), dtype) if p.bool() else None,
                 causal=p.bool(), scale=p.choice([0.5, 1.0, -0.25]),
                 out=np.empty((B, Hk * g, L, Ev), dtype),
                 weights=np.empty((B, Hk * g, L, S), dtype) if p.bool(0.3) else None)
        if a["attn_mask"] is not None and p.bool():
            a["attn_mask"] = np.broadcast_to(a["attn_mask"][:, :1, :1], a["attn_mask"].shape)
        names = list(a)
        n_mut = p.choice([0, 1, 1, 2, 3])
        for _ in range(n_mut):
            name = p.choice(names)
            if name in ("causal",):
                a[name] = p.choice(SCALAR_JUNK)
            elif name == "scale":
                a[name] = p.choice([float("nan"), float("inf"), "x", None, 1e300, np.float32(2)])
            elif name in ("out", "weights") and p.bool(0.3):
                a[name] = p.choice([a["query"], a["key"], np.empty((1,), dtype)])  # aliasing / wrong
            else:
                a[name] = malformed(p, a[name])
        inputs = [a["query"], a["key"], a["value"], a["attn_mask"]]
        outputs = [a["out"], a["weights"]]
        aliased = any(isinstance(o, np.ndarray) and isinstance(x, np.ndarray) and np.shares_memory(o, x)
                      for o in outputs for x in inputs) or (
            isinstance(a["out"], np.ndarray) and isinstance(a["weights"], np.ndarray)
            and np.shares_memory(a["out"], a["weights"]))
        snap = snapshot(inputs)
        if which == "sdpa_canonical":
            ok, got = call("_core.sdpa", lambda: _core.sdpa(
                a["query"], a["key"], a["value"], None, sdpa_options(a["causal"], None, False, None), None))
            check_untouched(snap, "_core.sdpa")
            qkv = (a["query"], a["key"], a["value"])
            # The oracle below takes canonical operands; others were checked by the Python rules.
            canonical = all(isinstance(x, np.ndarray) and x.ndim == 4 for x in qkv) and (
                qkv[0].shape[:2] == qkv[1].shape[:2] == qkv[2].shape[:2])
            if ok and canonical:
                exp, _ = core_sdpa_expected(a["query"], a["key"], a["value"], None, bool(a["causal"]),
                                            1 / math.sqrt(safe_shape(a["query"])[3]))
                compare(got, exp, np.asarray(a["query"]).dtype.newbyteorder("="), "_core.sdpa", inputs)
            return
        ok, _ = call("_testing.run_sdpa", lambda: _testing.run_sdpa(
            a["query"], a["key"], a["value"], a["attn_mask"],
            _core.SdpaOptions(a["causal"], False, a["scale"], -1, -1, False), a["out"], a["weights"]))
        if not aliased:
            check_untouched(snap, "_testing.run_sdpa")
        if ok and not aliased and n_mut == 0:
            exp_out, exp_w = core_sdpa_expected(a["query"], a["key"], a["value"], a["attn_mask"], a["causal"], a["scale"])
            moderate = logits_moderate(a["query"], a["key"], a["scale"])
            compare(a["out"], exp_out, dtype, "_core.sdpa out", inputs, moderate)
            if a["weights"] is not None:
                compare(a["weights"], exp_w, dtype, "_core.sdpa weights", inputs, moderate)
        elif not ok and n_mut == 0:
            raise Disallowed("_core.sdpa: a valid call raised")
        return
    # _core.mha with canonical (N, L, E) arguments
    H = p.int(1, 2)
    E = H * p.choice([1, 2, 4])
    # (L = 8, 16 with S = L: the transposed form of few-row self-attention.)
    N, L, S = p.int(0, 2), p.choice([0, 1, 5, 8, 16]), p.choice([0, 1, 6, 8, 16])
    kdim, vdim = p.choice([E, 3]), p.choice([E, 2])
    Eo = p.choice([E, E, 3])
    avg = p.bool()
    bias_kv = p.bool(0.3)
    zero = p.bool(0.3)
    Sp = S + bias_kv + zero
    a = dict(num_heads=H, query=values(p, (N, L, E), dtype), key=values(p, (N, S, kdim), dtype),
             value=values(p, (N, S, vdim), dtype), w_q=values(p, (E, E), dtype), w_k=values(p, (E, kdim), dtype),
             w_v=values(p, (E, vdim), dtype), b_q=values(p, (E,), dtype) if p.bool() else None,
             b_k=None, b_v=None, bias_k=values(p, (E,), dtype) if bias_kv else None,
             bias_v=values(p, (E,), dtype) if bias_kv else None, add_zero_attn=zero, static_k=None,
             static_v=None, attn_mask=np.zeros((N, H, L, S), dtype) if p.bool() else None,
             key_padding_mask=None, causal=p.bool(), w_out=values(p, (Eo, E), dtype),
             b_out=values(p, (Eo,), dtype) if p.bool() else None, out=np.empty((N, L, Eo), dtype),
             weights=(np.empty((N, L, Sp) if avg else (N, H, L, Sp), dtype) if p.bool() else None),
             average_weights=avg)
    names = [k for k in a]
    for _ in range(p.choice([1, 1, 2, 3])):
        name = p.choice(names)
        if name in ("num_heads", "add_zero_attn", "causal", "average_weights"):
            a[name] = p.choice(SCALAR_JUNK + [-5, 7, 2**62])
        else:
            a[name] = malformed(p, a[name])
    ok, _ = call("_testing.run_mha", lambda: run_core_mha(**a))


def run_core_mha(num_heads, query, key, value, w_q, w_k, w_v, b_q, b_k, b_v, bias_k, bias_v, add_zero_attn,
                 static_k, static_v, attn_mask, key_padding_mask, causal, w_out, b_out, out, weights,
                 average_weights):
    """The core's forward pass on canonical (N, L, E) arrays: the parameters checked by
    _core.MhaWeights, then _testing.run_mha; the results copied into out and weights."""
    dtype = np.dtype(np.float64 if getattr(query, "dtype", None) == np.float64 else np.float32)
    in_biases = None if b_q is None and b_k is None and b_v is None else (b_q, b_k, b_v)
    bias_kv = None if bias_k is None and bias_v is None else (bias_k, bias_v)
    params = _core.MhaWeights(num_heads, (w_q, w_k, w_v), in_biases, (w_out, b_out), bias_kv, add_zero_attn, dtype)
    options = _core.MhaOptions(causal, False, weights is not None, average_weights, True)
    result, probabilities = _testing.run_mha(params, (query, key, value, attn_mask, key_padding_mask, static_k, static_v), options)
    out[...] = result
    if weights is not None:
        weights[...] = probabilities


def fuzz_core_mha_weights(p: Provider, dtype):
    """_core.MhaWeights built from parameters (perhaps malformed), then _core.mha with inputs
    and flags (perhaps malformed). A call it accepts must give the bits of the core's forward
    pass on the canonical arrays (_testing.run_mha); nothing else but a clear exception."""
    H = p.int(1, 2)
    E = H * p.choice([1, 2, 4])
    kdim, vdim = p.choice([E, 3]), p.choice([E, 2])
    bias_kv = p.bool(0.3)
    params = dict(num_heads=H, w_q=values(p, (E, E), dtype), w_k=values(p, (E, kdim), dtype),
                  w_v=values(p, (E, vdim), dtype), b_q=values(p, (E,), dtype) if p.bool() else None,
                  b_k=values(p, (E,), dtype) if p.bool() else None,
                  b_v=values(p, (E,), dtype) if p.bool() else None,
                  bias_k=values(p, (E,), dtype) if bias_kv else None,
                  bias_v=values(p, (E,), dtype) if bias_kv else None, add_zero_attn=p.bool(0.3),
                  w_out=values(p, (E, E), dtype), b_out=values(p, (E,), dtype) if p.bool() else None,
                  batch_first=p.bool())
    # torch's layout: the three weights (and biases) stacked in one array, which
    # self-attention may project in one call.
    stacked = kdim == E and vdim == E and p.bool()
    if stacked:
        w = values(p, (3 * E, E), dtype)
        params.update(w_q=w[:E], w_k=w[E : 2 * E], w_v=w[2 * E :])
        if params["b_q"] is not None:
            b = values(p, (3 * E,), dtype)
            params.update(b_q=b[:E], b_k=b[E : 2 * E], b_v=b[2 * E :])
    if p.bool(0.3):
        name = p.choice(list(params))
        if name in ("num_heads", "add_zero_attn", "batch_first"):
            params[name] = p.choice(SCALAR_JUNK + [-5, 7, 2**62])
        else:
            params[name] = malformed(p, params[name])
    def weights_of(q):
        in_biases = (params["b_q"], params["b_k"], params["b_v"])
        return _core.MhaWeights(
            params["num_heads"], (params["w_q"], params["w_k"], params["w_v"]),
            None if in_biases == (None, None, None) else in_biases, (params["w_out"], params["b_out"]),
            None if params["bias_k"] is None and params["bias_v"] is None else (params["bias_k"], params["bias_v"]),
            params["add_zero_attn"], np.dtype(dtype))

    ok, plan = call("_core.MhaWeights", lambda: weights_of(None))
    if not ok:
        return
    batch_first = params["batch_first"]
    try:
        layout_first = bool(batch_first)
    except (TypeError, ValueError):  # junk without a truth value (an array): MhaOptions refuses it
        layout_first = True
    # (L = 8, 16 with S = L: the transposed form of few-row self-attention.)
    N, L, S = p.int(0, 2), p.choice([0, 1, 5, 8, 16]), p.choice([0, 1, 6, 8, 16])

    def seq(length, dim):
        return values(p, (N, length, dim) if layout_first else (length, N, dim), dtype)

    args = [seq(L, E), seq(S, kdim), seq(S, vdim)]
    self_attention = stacked and p.bool()
    if self_attention:
        args[1] = args[2] = args[0]
    flags = [p.choice([True, False]), p.choice([True, False]), p.bool(), p.bool()]
    n_mut = p.choice([0, 0, 1, 2])
    for _ in range(n_mut):
        i = p.int(0, 5)
        if i < 3:
            args[i] = malformed(p, args[i])
        else:
            flags[i - 3] = p.choice(SCALAR_JUNK)
    snap = snapshot(args + list(params.values()))
    ok, got = call("_core.mha", lambda: _core.mha(
        plan, *args, None, _core.MhaOptions(flags[2], flags[2] and flags[3], flags[0], flags[1], batch_first)))
    check_untouched(snap, "_core.mha")
    if not ok:
        return
    need_weights, average, causal, bottom_right = flags
    out, weights = got
    # (Self-attention's key and value as copies: the core then projects them apart, which
    # must give the same bits.)
    # (Converted as the Python rules convert inputs that are not canonical.)
    canonical = [np.array(x, dtype=dtype, order="C", copy=True) for x in args]
    q, k, v = (x if batch_first else x.transpose(1, 0, 2) for x in canonical)
    options = _core.MhaOptions(bool(causal), bool(causal) and bool(bottom_right), bool(need_weights), bool(average), True)
    expected_out, expected_weights = _testing.run_mha(plan, (q, k, v, None, None, None, None), options)
    got_out = out if batch_first else out.transpose(1, 0, 2)
    if not np.array_equal(got_out, expected_out, equal_nan=True):
        raise Disallowed("_core.mha: output differs from the core's on the canonical arrays")
    if (weights is None) != (expected_weights is None) or (
            weights is not None and not np.array_equal(weights, expected_weights, equal_nan=True)):
        raise Disallowed("_core.mha: weights differ from the core's on the canonical arrays")
    OUTCOMES["_core.mha: result checked"] += 1
    if self_attention:
        OUTCOMES["_core.mha: self-attention checked"] += 1


def cache_contents(cache):
    """The keys and values of `cache` as float64: an int8 cache's rows times their scales."""
    if cache.dtype == I8:
        return (cache.key.astype(np.float64) * cache.key_scales[..., None],
                cache.value.astype(np.float64) * cache.value_scales[..., None])
    return np.asarray(cache.key, np.float64), np.asarray(cache.value, np.float64)


def held(cache):
    """Copies of the keys and values each sequence of `cache` holds (as float64)."""
    key, value = cache_contents(cache)
    return [(key[b, :, :m].copy(), value[b, :, :m].copy()) for b, m in enumerate(cache.lengths)]


def same_held(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x, y, equal_nan=True) for pair_a, pair_b in zip(a, b) for x, y in zip(pair_a, pair_b))


def still_held(cache, before) -> bool:
    """Whether each sequence of `cache` still starts with the keys and values of `before`."""
    now = [(k[:, :kb.shape[1]], v[:, :kb.shape[1]]) for (k, v), (kb, _) in zip(held(cache), before)]
    return same_held(now, before)


def reset_or_pickle(p: Provider, cache):
    """`cache` after reset(index) (index perhaps malformed), or a pickled copy of it: a reset
    empties exactly the slot it names (all with None) and raises for any other index without
    a change; a copy holds the same keys, values and lengths."""
    before, lengths = held(cache), cache.lengths.copy()
    if p.bool(0.3):
        copy = pickle.loads(pickle.dumps(cache))
        if not (np.array_equal(copy.lengths, lengths) and same_held(held(copy), before)
                and (copy.dtype, copy.max_len, copy.value_dim) == (cache.dtype, cache.max_len, cache.value_dim)):
            raise Disallowed("KVCache: a pickled copy differs")
        OUTCOMES["KVCache: pickled"] += 1
        return copy
    B = cache.batch
    index = p.choice([None, 0, B - 1, -1, -B, B, -B - 1, 1.0, True, "0", np.int64(B - 1), np.array([0]), 2**70])
    try:
        cache.reset(index)
    except (TypeError, IndexError) as exc:
        OUTCOMES[f"KVCache.reset: {type(exc).__name__}"] += 1
        if not (np.array_equal(cache.lengths, lengths) and str(exc)):
            raise Disallowed("KVCache.reset: raised after a change, or without a message") from exc
        return cache
    expected = np.zeros_like(lengths) if index is None else lengths.copy()
    if index is not None:
        expected[operator.index(index)] = 0
    if not np.array_equal(cache.lengths, expected):
        raise Disallowed(f"KVCache.reset({index!r}): lengths {cache.lengths.tolist()}, expected {expected.tolist()}")
    kept = [pair for pair, m in zip(before, expected) if m]
    if not same_held([pair for pair, m in zip(held(cache), expected) if m], kept):
        raise Disallowed(f"KVCache.reset({index!r}): another slot's keys or values changed")
    OUTCOMES["KVCache.reset"] += 1
    return cache

def fuzz_cache(p: Provider):
    """A KVCache filled over a few steps of cached_attention (ragged lengths, GQA, windows,
    float16 storage), each result against the reference over the cache's contents; a
    malformed argument must raise before anything is appended."""
    dtype = p.choice([F32, F32, F64, I8] + HALVES)
    given = F32 if dtype == I8 else dtype  # the keys and values appended (int8: quantized)
    B, Hk, group = p.int(1, 3), p.int(1, 2), p.int(1, 3)
    D, Dv = p.choice([1, 4, 8, 17]), p.choice([None, 3, 8])
    ctor = [B, Hk, p.choice([1, 5, 40, 600]), D, dtype]
    if p.bool(0.15):
        ctor[p.int(0, 4)] = p.choice([-1, 0, 2.5, "3", None, np.int64(2), 2**40, np.dtype(np.int32)])
    ok, cache = call("KVCache()", lambda: attnx.KVCache(*ctor, value_dim=Dv), huge=True)
    if not ok:
        return
    Dv = cache.value_dim
    for _ in range(p.int(1, 3)):
        if p.bool(0.15):
            cache = reset_or_pickle(p, cache)
        T = p.choice([0, 1, 2, 7])
        q_dtype = p.choice([given, F32] + HALVES) if dtype != F64 else F64
        args = {
            "query": values(p, (B, Hk * group, T, D), q_dtype),
            "key": values(p, (B, Hk, T, D), given) if p.bool(0.8) else None,
            "lengths": None, "window": None,
        }
        args["value"] = values(p, (B, Hk, T, Dv), given) if args["key"] is not None else None
        if p.bool(0.4):
            args["lengths"] = np.random.default_rng(p.seed()).integers(0, T + 1, B)
        if p.bool(0.3):
            args["window"] = (p.choice([None, 0, 1, 30]), p.choice([None, 0, 3]))
        args["scale"] = p.choice([0.0, 0.3, -1.0, 2.0]) if p.bool(0.25) else None
        args["out"] = np.full((B, Hk * group, T, Dv), np.nan, q_dtype) if p.bool(0.25) else None
        precision, invalid = draw_precision(p, dtype)
        n_mut = p.choice([0, 0, 0, 1, 2])
        mutate(p, args, ["query", "key", "value", "lengths", "window", "scale", "out"], n_mut)
        before, held_before = cache.lengths.copy(), held(cache)
        inputs = [args["query"], args["key"], args["value"], args["lengths"], args["out"]]
        snap = snapshot(inputs)
        ok, got = call("cached_attention", lambda: attnx.cached_attention(
            args["query"], cache, args["key"], args["value"], lengths=args["lengths"], scale=args["scale"],
            window=args["window"], precision=precision, out=args["out"]))
        check_untouched(snap, "cached_attention", allowed=[args["out"]])
        if not still_held(cache, held_before):
            raise Disallowed("cached_attention: a cached token's key or value changed")
        if not ok:
            if not np.array_equal(cache.lengths, before):
                raise Disallowed("cached_attention: raised after appending to the cache")
            continue
        if invalid:
            raise Disallowed(f"cached_attention: computed with precision={precision!r} and a {cache.dtype} cache")
        if args["out"] is not None and got is not args["out"]:
            raise Disallowed("cached_attention: out= given but another array returned")
        q = np.asarray(args["query"])
        n = (np.full(B, q.shape[2]) if args["lengths"] is None else np.asarray(args["lengths"])).astype(np.int64)
        key, value = cache_contents(cache)
        bf16 = precision == "bfloat16"
        as_computed = (lambda x: np.asarray(x, F32)) if bf16 else (lambda x: np.asarray(x, np.float64))
        expected = reference_of(lambda: reference.cached_attention(
            as_computed(q), as_computed(key), as_computed(value), cache.lengths, query_lengths=n,
            scale=args["scale"], window=args["window"], precision=precision))
        if expected is None:
            raise Disallowed("cached_attention: attnx computed a result for a call the reference rejects")
        scale = 1 / math.sqrt(D) if args["scale"] is None else args["scale"]
        try:
            moderate = logits_moderate(q, key, float(scale))
        except (TypeError, ValueError):
            moderate = True  # a scale attnx accepted that is no number: the result is compared
        # The cache decides the compute dtype (float64 only for a float64 cache); the result
        # has the query's, so the looser of the two sets the tolerance.
        compute = np.dtype(F64 if cache.dtype == F64 else F32)
        tolerance = got.dtype if got.dtype.itemsize <= compute.itemsize else compute
        if bf16:
            tolerance = bf16_tolerance([value])
            if got.dtype.itemsize == 2:  # and the result's own rounding
                tolerance["rtol"] += TOL[got.dtype]["rtol"]
        compare(got, expected, np.dtype(got.dtype), "cached_attention", [q, key, value], moderate, tolerance)


STEP_ARRAYS = ["query", "in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
               "q_proj_weight", "k_proj_weight", "v_proj_weight", "lengths"]


def step_expected(a, cache, before, n, bf16=False):
    """float64 expectation of one multi_head_attention_step that appended n[b] tokens to
    sequence b of `cache` (which held before[b]): the new tokens' queries, keys and values
    (B, H, T, D) and the step's output; raises where the arguments describe no valid step.
    With `bf16`, the float32 expectation of precision "bfloat16" (the reference's rounding)."""
    x = np.asarray(a["query"])
    if not is_float(x):
        raise TypeError("query")
    run = F32 if bf16 else np.float64
    x = x.astype(run)
    layout = "unbatched" if x.ndim == 2 else ("batch_first" if a["batch_first"] else "seq_first")
    xb = {"unbatched": lambda: x[None], "batch_first": lambda: x, "seq_first": lambda: x.transpose(1, 0, 2)}[layout]()
    B, T, E = xb.shape
    H = a["num_heads"]
    D = E // H

    def param(name, shape):
        value = np.asarray(a[name])
        if not is_float(value) or value.shape != shape:
            raise ValueError(name)
        return value.astype(run)

    if a["use_separate_proj_weight"]:
        w_in = np.concatenate([param(name, (E, E)) for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight")])
    else:
        w_in = param("in_proj_weight", (3 * E, E))
    b_in = np.zeros(3 * E, run) if a["in_proj_bias"] is None else param("in_proj_bias", (3 * E,))
    w_out = np.asarray(a["out_proj_weight"])
    if not is_float(w_out) or w_out.ndim != 2 or w_out.shape[1] != E:
        raise ValueError("out_proj_weight")
    w_out = w_out.astype(run)
    b_out = np.zeros(w_out.shape[0], run) if a["out_proj_bias"] is None else param("out_proj_bias", (w_out.shape[0],))
    qkv = reference._linear(xb, w_in, b_in, bf16)
    q, k, v = (qkv[..., i * E:(i + 1) * E].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3))
    attn = reference.cached_attention(q, *(np.asarray(x, run) for x in cache_contents(cache)), before + n,
                                      query_lengths=n, precision="bfloat16" if bf16 else None)
    out = reference._linear(attn.transpose(0, 2, 1, 3).reshape(B, T, E), w_out, b_out, bf16)
    out = {"unbatched": lambda: out[0], "batch_first": lambda: out, "seq_first": lambda: out.transpose(1, 0, 2)}[layout]()
    return q, k, v, out


def fuzz_step(p: Provider):
    """multi_head_attention_step (the decoding step of MultiheadAttention.step) over a KVCache
    for a few steps: ragged lengths, batch-first, sequence-first and unbatched queries,
    separate projection weights, another output width, float16 queries and storage. Each
    output must match the reference: the projections, reference.cached_attention over the
    cache's contents, the output projection. The step must append exactly the new tokens'
    keys and values, leave the cached ones as they were, and, where it raises, append nothing."""
    dtype = p.choice([F32, F32, F64])
    H = p.int(1, 3)
    E, B = H * p.choice([1, 2, 4, 8]), p.int(1, 3)
    unbatched = B == 1 and p.bool(0.3)
    cache = attnx.KVCache(B, H, p.choice([1, 4, 16, 40]), E // H, p.choice([dtype, dtype, I8] + HALVES))
    separate = p.bool(0.3)
    E_out = p.choice([E, E, 3])

    def weight(rows, cols):
        return values(p, (rows, cols), dtype) / math.sqrt(cols)

    for _ in range(p.int(1, 3)):
        T = p.choice([0, 1, 1, 2, 5])
        batch_first = p.bool()
        shape = (T, E) if unbatched else ((B, T, E) if batch_first else (T, B, E))
        a = dict(query=values(p, shape, p.choice([dtype, dtype] + HALVES)), num_heads=H,
                 in_proj_weight=None if separate else weight(3 * E, E),
                 in_proj_bias=values(p, (3 * E,), dtype) if p.bool(0.7) else None,
                 out_proj_weight=weight(E_out, E),
                 out_proj_bias=values(p, (E_out,), dtype) if p.bool(0.7) else None,
                 lengths=np.random.default_rng(p.seed()).integers(0, T + 1, B) if p.bool(0.4) else None,
                 batch_first=batch_first, use_separate_proj_weight=separate,
                 q_proj_weight=weight(E, E) if separate else None,
                 k_proj_weight=weight(E, E) if separate else None,
                 v_proj_weight=weight(E, E) if separate else None)
        for name in STEP_ARRAYS:
            if isinstance(a[name], np.ndarray) and p.bool(0.15):
                a[name] = relayout(p, a[name])
        valid_n = np.full(B, T) if a["lengths"] is None else np.asarray(a["lengths"])
        # (float64 queries compute their projections in float64: no bfloat16 products.)
        precision, invalid = draw_precision(p, a["query"].dtype)
        n_mut = p.choice([0, 0, 0, 1, 2]) + invalid
        for _ in range(n_mut):
            if p.bool(0.8):
                name = p.choice(STEP_ARRAYS)
                a[name] = malformed(p, a[name])
            else:
                a[p.choice(["num_heads", "batch_first", "use_separate_proj_weight"])] = p.choice(SCALAR_JUNK)
        before, held_before = cache.lengths.copy(), held(cache)
        inputs = [a[name] for name in STEP_ARRAYS]
        snap = snapshot(inputs)
        ok, got = call("step", lambda: attnx.multi_head_attention_step(
            a["query"], cache, a["num_heads"], a["in_proj_weight"], a["in_proj_bias"], a["out_proj_weight"],
            a["out_proj_bias"], lengths=a["lengths"], batch_first=a["batch_first"],
            use_separate_proj_weight=a["use_separate_proj_weight"], q_proj_weight=a["q_proj_weight"],
            k_proj_weight=a["k_proj_weight"], v_proj_weight=a["v_proj_weight"], precision=precision))
        check_untouched(snap, "step")
        if not still_held(cache, held_before):
            raise Disallowed("step: a cached token's key or value changed")
        if not ok:
            if not np.array_equal(cache.lengths, before):
                raise Disallowed("step: raised after appending to the cache")
            if n_mut == 0 and np.all(before + valid_n <= cache.max_len):
                raise Disallowed("step: a valid call raised")
            continue
        for x in inputs:
            if isinstance(x, np.ndarray) and np.shares_memory(got, x):
                raise Disallowed("step: the result shares memory with an input")
        x_shape = np.shape(np.asarray(a["query"]))
        tokens = x_shape[1] if len(x_shape) == 3 and a["batch_first"] else x_shape[0]
        n = np.full(B, tokens) if a["lengths"] is None else np.asarray(a["lengths"], dtype=np.int64)
        if not np.array_equal(cache.lengths, before + n):
            raise Disallowed(f"step: cache lengths {cache.lengths.tolist()}, expected {(before + n).tolist()}")
        bf16 = precision == "bfloat16"
        expected = reference_of(lambda: step_expected(a, cache, before, n, bf16))
        if expected is None:
            raise Disallowed("step: attnx computed a result for a call the reference rejects")
        q, k, v, out = expected
        query = np.asarray(a["query"])
        # The query decides the projections' dtype and the result's, the cache the attention's.
        compute = F64 if cache.dtype == F64 and query.dtype == F64 else F32
        result_dtype = query.dtype.newbyteorder("=")
        arrays = [x for x in inputs if x is not a["lengths"]]
        key, value = cache_contents(cache)
        keys = [key[b, :, :m] for b, m in enumerate(cache.lengths)]
        values_held = [value[b, :, :m] for b, m in enumerate(cache.lengths)]
        if well_scaled(input_arrays(arrays)):
            OUTCOMES["step: appended keys and values checked"] += 1
            stored = TOL[cache.dtype] if cache.dtype in HALVES else TOL[compute]
            for b, (m, t) in enumerate(zip(before, n)):
                for name, got_rows, want in (("keys", key, k), ("values", value, v)):
                    want = want[b, :, :t]
                    if cache.dtype == I8:  # within half a step of each row's scale, max|x| / 127
                        step = np.abs(want).max(-1, keepdims=True) / 127 if want.size else 0
                        assert np.all(np.abs(got_rows[b, :, m:m + t] - want) <= 0.5 * step * (1 + 1e-5) + 1e-30), \
                            f"step: appended {name}"
                        continue
                    np.testing.assert_allclose(got_rows[b, :, m:m + t], want, err_msg=f"step: appended {name}", **stored)
        moderate = all(logits_moderate(q[b], keys[b], 1 / math.sqrt(E // H)) for b in range(B))
        tolerance = result_dtype if result_dtype.itemsize < compute.itemsize else compute
        if bf16:
            tolerance = bf16_tolerance(input_arrays(arrays) + values_held)
            if result_dtype.itemsize == 2:  # and the result's own rounding
                tolerance["rtol"] += TOL[result_dtype]["rtol"]
        compare(got, out, result_dtype, "step", arrays + keys + values_held, moderate, tolerance)


# ---------------------------------------------------------------------------------------------
# Transformer layers and the decoder's decoding step
# ---------------------------------------------------------------------------------------------


def act_tanh(h):
    return np.tanh(h)


def act_relu_in_place(h):
    """Writes into the array it is given (attnx's own copy of the hidden rows) and returns it."""
    np.maximum(h, 0, out=h)
    return h


def act_softsign_f64(h):
    """Another dtype than the one it is given (float64)."""
    return (h / (1 + np.abs(h))).astype(np.float64)


def act_list(h):
    """A nested list, not an array."""
    return (0.5 * np.asarray(h)).tolist()


def act_fortran(h):
    """An array of another layout (Fortran order)."""
    return np.asfortranarray(np.sin(h))


def act_first_column(h):
    """The wrong shape, unless dim_feedforward is 1."""
    return h[..., :1]


def act_raises(h):
    raise Planted("raised by the activation")


LAYER_ACTIVATIONS = ["relu", "relu", "gelu", "gelu", act_tanh, act_relu_in_place, act_softsign_f64, act_list,
                     act_fortran, act_first_column, act_raises]
ACTIVATION_JUNK = ["tanh", "RELU", "", None, 3, np.float32(1.0), b"relu", ["relu"]]
LAYER_EPS = [1e-5, 1e-5, 1e-5, 1e-3, 1e-9, 0.25, 0.0]
# The unit roundoff of each dtype: how much a computation in it may lose per operation.
UNIT = {F32: 2.0**-24, F64: 2.0**-53, F16: 2.0**-11}
if BF16 is not None:
    UNIT[BF16] = 2.0**-8
# An int8 cache's row holds each value to half a step of its scale, max|x| / 127: 2^-8 of the
# row's largest, more of its smaller values; taken as 2^-7.
UNIT[I8] = 2.0**-7
# Base tolerances of a transformer layer's result (a chain of projections, softmaxes and norms);
# an ill-conditioned input (a norm's row of tiny variance, logits that cancel) widens them by
# the spread of the reference itself between float32 and float64 (see compare_layer).
LAYER_TOL = {F32: dict(rtol=2e-5, atol=2e-5), F64: dict(rtol=1e-11, atol=1e-11),
             F16: dict(rtol=2e-3, atol=2e-3)}  # (float16 parameters and results, computed in float32)


def raised() -> str:
    """The exception call() caught last, for a message: its type and the start of its own."""
    if LAST_ERROR[0] is None:
        return "the input's own exception"
    return f"{LAST_ERROR[0].__name__}: {LAST_MESSAGE[0].splitlines()[0][:100] if LAST_MESSAGE[0] else ''}"


def rarely(p: Provider, prob: float) -> bool:
    """True with probability `prob`; False once the input is used up (which p.bool() makes
    True), so that a short input still describes a plain valid call."""
    return p.byte() >= 256 - int(256 * prob)


def real_parameter(value) -> bool:
    """Whether a parameter's value holds real numbers: floats, or integers as load_state_dict
    takes them (what attnx must refuse with a TypeError otherwise: complex, bool, strings,
    objects)."""
    try:
        a = np.asarray(plain(value))
    except Exception:  # noqa: BLE001 - a value whose conversion raises holds no numbers
        return False
    return is_float(a) or a.dtype.kind in "iu"


def layer_slots(module):
    """(key, owner, attribute) of every parameter slot of a transformer layer or stack."""
    return [(key, owner, attr) for key, owner, attr, _ in module._slots()]


def layer_params(module, dtype):
    """The module's parameters as the reference takes them: its state_dict keys, float64
    arrays of the values the module computes with (rounded to `dtype`, the module's)."""
    params = {}
    for key, owner, attr in layer_slots(module):
        value = getattr(owner, attr)
        if value is not None:
            params[key] = np.asarray(plain(value)).astype(dtype).astype(np.float64)
    return params


def randomize_parameters(p: Provider, module):
    """New values for every parameter, loaded with load_state_dict: weights N(0, 1/fan_in),
    norm weights 1 + N(0, 0.09), biases N(0, 0.09)."""
    rng = np.random.default_rng(p.seed())
    state = {}
    for key, value in module.state_dict().items():
        owner = key.rsplit(".", 2)[-2] if key.count(".") else ""
        if value.ndim == 2:
            state[key] = rng.standard_normal(value.shape) / math.sqrt(value.shape[1])
        elif owner.startswith("norm") and key.endswith("weight"):
            state[key] = 1 + 0.3 * rng.standard_normal(value.shape)
        else:
            state[key] = 0.3 * rng.standard_normal(value.shape)
    module.load_state_dict(state)


def mutate_parameter(p: Provider, layer) -> bool:
    """Changes one parameter of `layer` as a user might: a malformed value, NaN/Inf values, a
    copy in another float dtype or layout, None, a tensor that requires grad, a write in place.
    Returns whether the layer may now be invalid (a call may then raise)."""
    key, owner, attr = p.choice(layer_slots(layer))
    current = getattr(owner, attr)
    kind = p.int(0, 5)
    if kind == 0 or not is_float(current):
        setattr(owner, attr, malformed(p, current))
        OUTCOMES["transformer: parameter malformed"] += 1
        return True
    if kind == 1:  # NaN or Inf at a place (valid: they must reach the result as the reference's)
        bad = np.array(current, dtype=np.float64)
        if bad.size:  # (a parameter of no elements has no place)
            bad.reshape(-1)[p.int(0, bad.size - 1)] = p.choice([np.nan, np.inf, -np.inf])
        setattr(owner, attr, bad.astype(current.dtype))
        return False
    if kind == 2:  # another float dtype and layout (valid: read as its values)
        setattr(owner, attr, relayout(p, np.asarray(current).astype(p.choice([F32, F64, F16]))))
        return False
    if kind == 3:  # None: no bias, or no norm weight (valid); no weight (invalid)
        setattr(owner, attr, None)
        return not (attr.endswith("bias") or owner.__class__.__name__ == "LayerNorm")
    if kind == 4:  # what copying from a torch module by attribute gives (valid: its values)
        setattr(owner, attr, GradTensor(np.asarray(current)))
        OUTCOMES["transformer: parameter a tensor that requires grad"] += 1
        return False
    if isinstance(current, np.ndarray) and current.flags.writeable:  # in place (seen by the next call)
        current *= current.dtype.type(p.choice([0.5, 1.5, -1.0]))
    return False


def layer_mask(p: Provider, shape, dtype):
    """A mask of `shape` as torch's attention takes it: bool (True = masked) or float (-inf
    where masked, elsewhere 0 or other finite values); rows may be masked wholly."""
    rng = np.random.default_rng(p.seed())
    closed = rng.random(shape) < p.choice([0.0, 0.2, 0.5, 0.9, 1.0])
    kind = p.int(0, 3)
    if kind <= 1:
        return closed
    m = np.where(closed, -np.inf, p.choice([0.0, 0.0, 0.5, -1.0]))
    if kind == 3:
        m = m + 0.3 * rng.standard_normal(shape)
    return m.astype(p.choice([dtype, dtype, F32, F64, F16]))


def closed_rows(mask, shape):
    """Where a key padding mask marks positions as padding (True, or -inf), as a bool array of
    `shape` (the mask's own, batched); None where there is no such mask."""
    if mask is None:
        return None
    m = np.asarray(plain(mask))
    marked = m if m.dtype == np.bool_ else np.isneginf(m.astype(np.float64))
    return marked.reshape(shape)


def scale_view(x):
    """A mask as the judge of scaling sees it: -inf closes a key and is no value."""
    x = plain(x)
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return np.where(np.isneginf(x), 0, x)
    return x


def compare_layer(got, expected, spread, dtype, what, inputs, unit=None, skip_rows=None, bf16=False):
    """compare() for a transformer layer's or decoder's result (in canonical (N, L, E) order):
    within LAYER_TOL[dtype] plus 16 times the reference's own spread between float32 and
    float64 (`spread`: the float32 reference's result; the largest difference in each row,
    scaled from float32's unit roundoff to `unit`, the least precise one the computation went
    through: a half-precision cache's), so that a row a norm amplifies rounding in (tiny
    variance) is judged by that amplification; where `unit` is coarser than `dtype`'s, also
    16 units of it more. Rows marked in `skip_rows` (padded query positions, whose outputs are
    not specified) are not compared. With `bf16` (precision "bfloat16": `expected` is the
    reference of the same rounding), also BF16_TOL of (1 + |expected|): a float32
    intermediate near a tie rounds to the other bfloat16 neighbour, an error the spread does
    not show."""
    if not isinstance(got, np.ndarray):
        raise Disallowed(f"{what}: not an ndarray: {type(got).__name__}")
    if got.dtype != dtype or got.shape != expected.shape:
        raise Disallowed(f"{what}: dtype/shape {got.dtype} {got.shape}, expected {dtype} {expected.shape}")
    g, e = got.astype(np.float64), np.asarray(expected, np.float64)
    if skip_rows is not None and skip_rows.any():
        OUTCOMES["transformer: padded rows skipped"] += 1
        g, e = g.copy(), e.copy()
        g[skip_rows] = e[skip_rows] = 0
    arrays = input_arrays(inputs)
    if not well_scaled(arrays):
        if not nan_inf_only(arrays):
            OUTCOMES["result not comparable (extreme values)"] += 1
            return
        # As compare(): non-finite exactly where the reference is, NaN wherever it has NaN.
        OUTCOMES["nan pattern checked"] += 1
        bad = (np.isfinite(g) != np.isfinite(e)) | (np.isnan(e) & ~np.isnan(g))
        if bad.any():
            at = tuple(np.argwhere(bad)[0])
            raise Disallowed(f"{what}: NaN/Inf in other places than the reference's\n{int(bad.sum())} of {bad.size} "
                             f"elements, first at {at}: got {g[at]!r}, expected {e[at]!r}")
        return
    OUTCOMES["result checked"] += 1
    tol = LAYER_TOL[dtype]
    factor = (UNIT[dtype] if unit is None else unit) / UNIT[F32]
    with np.errstate(all="ignore"):
        widen = np.nan_to_num(np.abs(np.asarray(spread, np.float64) - e), nan=np.inf)
        if widen.size:  # each row's largest spread: its norm's conditioning
            widen = np.broadcast_to(widen.max(axis=-1, keepdims=True), widen.shape)
        allowed = tol["atol"] + tol["rtol"] * np.abs(e) + 16 * factor * widen
        if unit is not None and unit > UNIT[dtype]:  # keys and values stored in a narrower dtype
            allowed = allowed + 16 * unit * (1 + np.abs(e))
        if bf16:
            allowed = allowed + BF16_TOL * (1 + np.abs(e))
        bad = ~(np.abs(g - e) <= allowed) & ~(np.isnan(g) & np.isnan(e))
    if bad.any():
        at = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: not equal to the reference within the tolerance\n{int(bad.sum())} of "
                             f"{bad.size} elements differ, first at {at}: got {g[at]!r}, expected {e[at]!r} "
                             f"(allowed {allowed[at]:.3g})")


def canonical(x, batched, batch_first):
    """A layer's input or output in (N, L, E) order."""
    x = np.asarray(x)
    if not batched:
        return x[None]
    return x if batch_first else x.transpose(1, 0, 2)


LAYER_CTOR_JUNK = [None, 0, -3, 1.5, "8", True, np.int32(4), 2**62, np.float16, "float16", "cuda", -1, [1],
                   float("nan"), 7, np.float64(1e-5)]


def fuzz_transformer_layer(p: Provider):
    """TransformerEncoderLayer and TransformerDecoderLayer of small random configurations
    (relu, gelu or a callable activation; pre- or post-norm; with or without biases; batch
    first, sequence first or unbatched; float32 or float64), alone or in a TransformerEncoder
    or TransformerDecoder of one or two copies with or without a final norm: construction
    (perhaps with a malformed argument), new parameter values, a parameter changed (malformed,
    NaN/Inf, another dtype or layout, None, a tensor, written in place after a first call),
    masks of every kind (bool, float, per head, fully masked rows; malformed), relaid-out
    inputs. A call that returns must match attnx.reference's layers over the values the
    module holds; nothing else but a clear exception; inputs and parameters unchanged; the
    result its own memory."""
    decoder = p.bool()
    cls = attnx.TransformerDecoderLayer if decoder else attnx.TransformerEncoderLayer
    H = p.int(1, 3)
    E = H * p.choice([1, 2, 4, 8])
    kw = dict(d_model=E, nhead=H, dim_feedforward=p.choice([1, 2, 5, 16]), dropout=p.choice([0.0, 0.0, 0.1]),
              activation=p.choice(LAYER_ACTIVATIONS), layer_norm_eps=p.choice(LAYER_EPS), batch_first=p.bool(),
              norm_first=p.bool(), bias=p.bool(0.8), device=p.choice([None, None, "cpu"]),
              dtype=p.choice([np.float32, np.float32, np.float64, "float64", None]), seed=p.int(0, 1000))
    huge = False
    if rarely(p, 0.15):
        name = p.choice(list(kw))
        kw[name] = p.choice(ACTIVATION_JUNK if name == "activation" else LAYER_CTOR_JUNK)
        huge = name in ("d_model", "dim_feedforward")
    ok, layer = call(f"{cls.__name__}()", lambda: cls(**kw), huge=huge)
    if not ok:
        return
    stack = p.bool(0.25)
    module = layer
    if stack:
        norm = attnx.transformer.LayerNorm(layer.d_model, p.choice(LAYER_EPS[:-1]), bias=p.bool(0.8),
                                           dtype=layer.dtype) if p.bool() else None
        module = (attnx.TransformerDecoder if decoder else attnx.TransformerEncoder)(layer, p.int(1, 2), norm)
    layers = module.layers if stack else [module]
    prefixes = [f"layers.{i}." for i in range(len(layers))] if stack else [""]
    if p.bool(0.8):
        module.eval()
    if p.bool(0.6):
        randomize_parameters(p, module)
    dtype = layer.dtype
    call_precision, bf16, invalid = module_or_call_precision(p, module, dtype)
    E, H = layer.d_model, layer.self_attn.num_heads
    batch_first = layer.batch_first
    N, L, S = p.int(0, 3), p.choice([0, 1, 2, 5, 9]), p.choice([0, 1, 3, 7])
    batched = not (N == 1 and p.bool(0.25))

    def seq(length):
        shape = ((N, length, E) if batch_first else (length, N, E)) if batched else (length, E)
        return values(p, shape, p.choice([dtype, dtype, dtype, F32, F64, F16]))

    def attn_mask(rows, cols):
        shape = (rows, cols) if p.bool() else ((N * H if batched else H), rows, cols)
        return layer_mask(p, shape, dtype)

    def padding(cols):
        return layer_mask(p, (N, cols) if batched else (cols,), dtype)

    # The flags of a stack default to None (detected from the mask, as torch does).
    flag = (lambda p_true: p.choice([None, True, False])) if stack else (lambda p_true: p.bool(p_true))
    if decoder:
        args = {"tgt": seq(L), "memory": seq(S), "tgt_mask": None, "memory_mask": None,
                "tgt_key_padding_mask": None, "memory_key_padding_mask": None,
                "tgt_is_causal": flag(0.3), "memory_is_causal": p.bool(0.15)}
        if p.bool(0.4):
            args["tgt_mask"] = attn_mask(L, L)
        if p.bool(0.3):
            args["memory_mask"] = attn_mask(L, S)
        if p.bool(0.3):
            args["tgt_key_padding_mask"] = padding(L)
        if p.bool(0.4):
            args["memory_key_padding_mask"] = padding(S)
        arrays = ["tgt", "memory", "tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask"]
        flags, padding_name = ["tgt_is_causal", "memory_is_causal"], "tgt_key_padding_mask"
    else:
        mask_name = "mask" if stack else "src_mask"
        args = {"src": seq(L), mask_name: None, "src_key_padding_mask": None, "is_causal": flag(0.3)}
        if p.bool(0.4):
            args[mask_name] = attn_mask(L, L)
        if p.bool(0.4):
            args["src_key_padding_mask"] = padding(L)
        arrays, flags, padding_name = ["src", mask_name, "src_key_padding_mask"], ["is_causal"], "src_key_padding_mask"
    for name in arrays:
        if args[name] is not None and rarely(p, 0.15):
            args[name] = relayout(p, args[name])
    sequences = arrays[: 1 + decoder]

    def run():
        return module(*(args[n] for n in sequences), **{n: args[n] for n in arrays[1 + decoder:] + flags},
                      precision=call_precision)

    what = type(module).__name__
    changes = p.choice([0, 0, 0, 1, 1, 2])
    # (With bfloat16 products the weights are rounded once, at the first call: values written
    # in place after it are not seen, as documented.)
    if rarely(p, 0.2) and not (module.training and layer.dropout) and not bf16:
        # A first call (which keeps the core's view of the parameters), then a parameter
        # changed in place or assigned: the next call must see the new values.
        call(f"{what} (first call)", run)
        OUTCOMES["transformer: parameter changed after a call"] += 1
        changes = max(changes, 1)
    n_mut = int(invalid)
    for _ in range(changes):
        n_mut += mutate_parameter(p, module)
    if rarely(p, 0.05):
        owner = p.choice([getattr(x, n) for x in layers for n in ("norm1", "norm2", "norm3")[: 2 + decoder]]
                         + ([module.norm] if stack and module.norm is not None else []))
        owner.eps = p.choice([0.0, -1.0, float("nan"), float("inf"), 1e-3, None, True])
        n_mut += 1
    if rarely(p, 0.05):
        p.choice(layers).activation = p.choice(ACTIVATION_JUNK)
        n_mut += 1
    n_mut += sum(x.activation is act_raises or (x.activation is act_first_column and x.linear1.out_features != 1)
                 for x in layers)
    n_arg_mut = p.choice([0, 0, 0, 1, 1, 2])
    for _ in range(n_arg_mut):
        name = p.choice(arrays + flags)
        args[name] = p.choice(SCALAR_JUNK) if name in flags else malformed(p, args[name])
    n_mut += n_arg_mut
    garbage = torch_habits(p, args, arrays)

    slots = layer_slots(module)
    shapes = [shape for *_, shape in module._slots()]
    held_params = [getattr(owner, attr) for _, owner, attr in slots]
    inputs = [plain(args[n]) for n in arrays]
    snap = snapshot(inputs + [plain(x) for x in held_params])
    ok, got = call(what, run)
    check_untouched(snap, what)
    if any(getattr(owner, attr) is not x for (_, owner, attr), x in zip(slots, held_params)):
        raise Disallowed(f"{what}: the call replaced a parameter")
    check_garbage_refused(ok, garbage, n_mut, what)
    n_mut += len(garbage)
    if module.training and layer.dropout > 0:
        if ok:
            raise Disallowed(f"{what}: computed in training mode with dropout > 0")
        OUTCOMES[f"{what}: dropout in training mode, {LAST_ERROR[0] and LAST_ERROR[0].__name__}"] += 1
        return
    if not ok:
        if n_mut == 0:
            raise Disallowed(f"{what}: a valid call raised {raised()}")
        return
    for x in inputs + [plain(x) for x in held_params]:
        if isinstance(x, np.ndarray) and np.shares_memory(got, x):
            raise Disallowed(f"{what}: the result shares memory with an input or a parameter")
    odd = sorted({str(np.asarray(plain(x)).dtype) for x in held_params if x is not None and not real_parameter(x)})
    if odd:
        raise Disallowed(f"{what}: computed with a parameter that holds no real numbers ({', '.join(odd)})")
    for (key, _, _), shape, x in zip(slots, shapes, held_params):
        # (Another extent may be valid, as in torch: linear1 and linear2 of another consistent
        # dim_feedforward. Another rank is not.)
        if x is not None and np.ndim(plain(x)) != len(shape):
            raise Disallowed(f"{what}: computed with a parameter of another rank than its own\n"
                             f"{key} of shape {np.shape(plain(x))}, expected {shape}")
    params = layer_params(module, dtype)

    def reference_in(run_dtype, rounded=False):
        def arr(name):
            return np.asarray(plain(args[name])).astype(dtype).astype(run_dtype)

        masks = {n: plain(args[n]) for n in arrays[1 + decoder:]}
        if stack and not decoder:
            masks["src_mask"] = masks.pop("mask")
        x = arr(sequences[0])
        for one, prefix in zip(layers, prefixes):
            own = {k[len(prefix):]: v.astype(run_dtype) for k, v in params.items() if k.startswith(prefix)}
            eps = tuple(float(getattr(one, n).eps) for n in ("norm1", "norm2", "norm3")[: 2 + decoder])
            common = dict(activation=one.activation, norm_first=bool(one.norm_first), batch_first=batch_first,
                          layer_norm_eps=eps, precision="bfloat16" if rounded else None)
            if decoder:
                x = reference.transformer_decoder_layer(
                    x, arr("memory"), own, H, tgt_is_causal=bool(args["tgt_is_causal"]),
                    memory_is_causal=bool(args["memory_is_causal"]), **masks, **common)
            else:
                x = reference.transformer_encoder_layer(x, own, H, is_causal=bool(args["is_causal"]), **masks, **common)
        if stack and module.norm is not None:
            weight, bias = params.get("norm.weight"), params.get("norm.bias")
            x = reference.layer_norm(x, None if weight is None else weight.astype(run_dtype),
                                     None if bias is None else bias.astype(run_dtype), float(module.norm.eps))
        return x

    # attnx runs the layers on the real tokens only: where every position is padding, it has no
    # rows to give the activation (and returns zeros).
    padded = None
    if args[padding_name] is not None and got.size:
        padded = closed_rows(args[padding_name], canonical(got, batched, batch_first).shape[:2])
    no_rows = got.size == 0 or (padded is not None and bool(padded.all()))
    try:
        if bf16:
            # The reference of the same rounding; the spread is its distance from float64
            # without rounding: the rounding as the row's norms amplify it.
            expected = reference_of(lambda: reference_in(np.float32, rounded=True))
            spread = reference_of(lambda: reference_in(np.float64))
        else:
            expected = reference_of(lambda: reference_in(np.float64))
            spread = reference_of(lambda: reference_in(np.float32))
    except Planted:  # the activation raised in the reference: attnx had no rows to give it
        if not no_rows:
            raise Disallowed(f"{what}: a result where the activation raised") from None
        return
    if (expected is None or spread is None) and no_rows and any(callable(x.activation) for x in layers):
        return  # (the reference called an activation that refuses even no rows; attnx had none to give it)
    if expected is None or spread is None:
        raise Disallowed(f"{what}: attnx computed a result for a call the reference rejects")
    got_rows, exp_rows, spread_rows = (canonical(x, batched, batch_first) for x in (got, expected, spread))
    skip = None
    if args[padding_name] is not None:
        skip = closed_rows(args[padding_name], got_rows.shape[:2])
        if np.asarray(got_rows)[skip].any():
            raise Disallowed(f"{what}: an output at a padded position is not 0")
    scaled = inputs[:1 + decoder] + [scale_view(args[n]) for n in arrays[1 + decoder:]] + list(params.values())
    if bf16:
        OUTCOMES[f"{what}: bfloat16 precision checked"] += 1
    compare_layer(got_rows, exp_rows, spread_rows, dtype, what, scaled, skip_rows=skip, bf16=bf16)
    if stack:
        OUTCOMES[f"{what}: result checked"] += 1


def additive(mask, shape):
    """A bool (True = masked) or float mask as float64 values added to the scores, broadcast
    to `shape`; zeros where there is no mask."""
    if mask is None:
        return np.zeros(shape)
    m = np.asarray(plain(mask))
    m = np.where(m, -np.inf, 0.0) if m.dtype == np.bool_ else m.astype(np.float64)
    return np.broadcast_to(m, shape)


def decoder_reference(decoder, params, tokens, memory, cross_bias, run_dtype, precision=None):
    """The reference decoder (each layer's attnx.reference.transformer_decoder_layer, then the
    final norm) over whole sequences with the causal tgt_mask: `tokens` (n, L, E) and `memory`
    (n, S, E) batch first, `cross_bias` (n * nhead, L, S) the memory attention's mask; with
    the products of `precision`."""
    x, mem = tokens.astype(run_dtype), memory.astype(run_dtype)
    L = x.shape[1]
    causal = np.triu(np.ones((L, L), bool), 1)
    for i, layer in enumerate(decoder.layers):
        prefix = f"layers.{i}."
        own = {k[len(prefix):]: v.astype(run_dtype) for k, v in params.items() if k.startswith(prefix)}
        eps = tuple(float(getattr(layer, n).eps) for n in ("norm1", "norm2", "norm3"))
        x = reference.transformer_decoder_layer(
            x, mem, own, layer.self_attn.num_heads, tgt_mask=causal, memory_mask=cross_bias.astype(run_dtype),
            activation=layer.activation, layer_norm_eps=eps, norm_first=bool(layer.norm_first), batch_first=True,
            precision=precision)
    if decoder.norm is not None:
        weight, bias = params.get("norm.weight"), params.get("norm.bias")
        x = reference.layer_norm(x, None if weight is None else weight.astype(run_dtype),
                                 None if bias is None else bias.astype(run_dtype), decoder.norm.eps)
    return x


def norm_conditioning(fn):
    """``(fn(), k)``: k the largest max|x| / sqrt(var + eps) of a row that reference.layer_norm
    normalized while fn ran (how much the norm amplifies a rounding of the row's values)."""
    real, worst = reference.layer_norm, [0.0]

    def recording(x, weight, bias, eps):
        a = np.asarray(x, np.float64)
        if a.size:
            with np.errstate(all="ignore"):
                k = np.abs(a).max(axis=-1) / np.sqrt(a.var(axis=-1) + eps)
            k = k[np.isfinite(k)]
            worst[0] = max(worst[0], float(k.max(initial=0.0)))
        return real(x, weight, bias, eps)

    reference.layer_norm = recording
    try:
        return fn(), worst[0]
    finally:
        reference.layer_norm = real


def cache_state(cache):
    """Every layer's lengths and the keys and values it holds."""
    return [(c.lengths.copy(), held(c)) for c in cache.layers]


def fuzz_transformer_step(p: Provider):
    """TransformerDecoder.step over a TransformerDecoderCache: a decoder of 1 to 3 layers (a
    final norm or none) decodes a few steps of 0 to 3 new positions per sequence, over a
    memory with ragged padding and per-step memory masks, with a slot of the cache reset now
    and then; some steps get a malformed argument (tgt, memory, masks, cache) or are too long
    for the cache. A step that raises must leave every layer's lengths, keys and values as
    they were; one that returns must append its positions to every layer, keep what they held,
    and give, at the new positions, the reference decoder's output over each whole sequence
    with the causal tgt_mask."""
    dtype = p.choice([F32, F32, F64])
    H = p.int(1, 3)
    E = H * p.choice([1, 2, 4, 8])
    eps = p.choice([1e-5, 1e-5, 1e-3, 0.25])
    dropout = p.choice([0.0, 0.0, 0.0, 0.1])
    layer = attnx.TransformerDecoderLayer(
        E, H, p.choice([1, 3, 8]), dropout, p.choice(["relu", "gelu", act_tanh, act_relu_in_place]), eps,
        p.bool(), p.bool(), p.bool(0.8), dtype=dtype, seed=p.int(0, 1000))
    norm = attnx.transformer.LayerNorm(E, eps, bias=p.bool(0.8), dtype=dtype) if p.bool() else None
    decoder = attnx.TransformerDecoder(layer, p.int(1, 3), norm)
    if p.bool(0.85):
        decoder.eval()
    if p.bool(0.7):
        randomize_parameters(p, decoder)
    dropout_applies = decoder.training and dropout > 0
    step_precision, bf16, invalid = module_or_call_precision(p, decoder, dtype)  # every step's
    batch_first = layer.batch_first
    B = p.int(1, 3)
    batched = not (B == 1 and p.bool(0.3))
    cache = decoder.new_cache(B, p.choice([1, 3, 6, 10]), p.choice([dtype, dtype, dtype, F32, F64, I8] + HALVES))
    unit = max(UNIT[dtype], UNIT[cache.dtype])
    params = layer_params(decoder, dtype)

    def layout(x):  # (B, L, E) -> the decoder's layout
        return x.transpose(1, 0, 2) if batched and not batch_first else (x if batched else x[0])

    S = p.choice([0, 1, 3, 6])
    memory = values(p, (B, S, E), dtype).astype(np.float64)  # canonical, the decoder's values
    kpm = None
    if p.bool(0.6):
        ends = np.random.default_rng(p.seed()).integers(0, S + 1, B)
        closed = np.arange(S)[None, :] >= ends[:, None]
        kpm = closed if p.bool() else np.where(closed, -np.inf, 0.0).astype(p.choice([dtype, F32, F64]))
        kpm = kpm if batched else kpm[0]
    masked_steps = p.bool(0.4)
    tokens = [[] for _ in range(B)]  # per sequence: the positions' inputs (E,)
    cross = [[] for _ in range(B)]  # their memory attention's mask rows (H, S)
    outputs = [[] for _ in range(B)]  # the step's results at them (E,)

    def check(seqs):
        """The outputs of sequences `seqs` against the reference over their whole sequences."""
        groups: dict = {}
        for b in seqs:
            if tokens[b]:
                groups.setdefault(len(tokens[b]), []).append(b)
        for bs in groups.values():
            x = np.array([tokens[b] for b in bs])
            bias = np.array([cross[b] for b in bs]).transpose(0, 2, 1, 3).reshape(len(bs) * H, x.shape[1], S)
            mem = memory[bs]
            if bf16:
                # The reference of the same rounding; the spread is its distance from float64
                # without rounding (as in fuzz_transformer_layer).
                expected, conditioning = norm_conditioning(lambda: reference_of(
                    lambda: decoder_reference(decoder, params, x, mem, bias, np.float32, "bfloat16")))
                spread = reference_of(lambda: decoder_reference(decoder, params, x, mem, bias, np.float64))
                OUTCOMES["TransformerDecoder.step: bfloat16 precision checked"] += 1
            else:
                expected, conditioning = norm_conditioning(
                    lambda: reference_of(lambda: decoder_reference(decoder, params, x, mem, bias, np.float64)))
                spread = reference_of(lambda: decoder_reference(decoder, params, x, mem, bias, np.float32))
            if expected is None or spread is None:
                raise Disallowed("TransformerDecoder.step: results where the reference rejects the decoder")
            got = np.array([outputs[b] for b in bs], dtype)
            if (cache.dtype in HALVES or cache.dtype == I8) and UNIT[cache.dtype] * conditioning > 0.02:
                # A norm of a row whose values nearly cancel (as two near-equal values of a
                # d_model of 2 do) amplifies the rounding of half-precision or int8 keys and values past
                # any tolerance: such decodes are not compared.
                OUTCOMES["TransformerDecoder.step: not comparable (half-precision cache, a norm ill-conditioned)"] += 1
                continue
            compare_layer(got, expected, spread, dtype, "TransformerDecoder.step", [x, mem, scale_view(bias)]
                          + list(params.values()), unit=unit, bf16=bf16)

    for _ in range(p.int(1, 4)):
        if rarely(p, 0.12):
            index = p.choice([None, p.int(0, B - 1)])
            seqs = range(B) if index is None else [index]
            check(seqs)
            cache.reset(index)
            for b in seqs:
                tokens[b], cross[b], outputs[b] = [], [], []
            if any(int(c.lengths[b]) for c in cache.layers for b in seqs):
                raise Disallowed("TransformerDecoderCache.reset: a layer kept positions")
            OUTCOMES["TransformerDecoder.step: cache reset"] += 1
        T = p.choice([0, 1, 1, 2, 3])
        x = values(p, (B, T, E), p.choice([dtype, dtype, F32, F64, F16]))
        mem_arg = layout(memory.astype(dtype))
        mem_arg = p.choice([lambda: mem_arg, lambda: relayout(p, mem_arg), lambda: mem_arg.astype(F64)])()
        args = {"tgt": layout(x), "memory": mem_arg, "cache": cache, "memory_key_padding_mask": kpm,
                "memory_mask": None}
        if masked_steps and p.bool(0.8):
            shape = (T, S) if p.bool() else ((B * H if batched else H), T, S)
            args["memory_mask"] = layer_mask(p, shape, dtype)
        for name in ("tgt", "memory", "memory_key_padding_mask", "memory_mask"):
            if isinstance(args[name], np.ndarray) and rarely(p, 0.15):
                args[name] = relayout(p, args[name])
        n_mut = p.choice([0, 0, 0, 0, 1, 2])
        for _ in range(n_mut):
            name = p.choice(["tgt", "memory", "memory_key_padding_mask", "memory_mask", "cache"])
            if name == "cache":
                args[name] = p.choice([
                    lambda: None, lambda: "cache", lambda: cache.layers[0],
                    lambda: attnx.TransformerDecoderCache(len(decoder.layers) + 1, B, H, cache.max_len, E // H),
                    lambda: attnx.TransformerDecoderCache(len(decoder.layers), B, E, cache.max_len, 1),
                    lambda: decoder.new_cache(B + 1, cache.max_len)])()
            else:
                args[name] = malformed(p, args[name])
        garbage = torch_habits(p, args, ["tgt", "memory", "memory_key_padding_mask", "memory_mask"])
        broken = None
        if rarely(p, 0.1):
            # One layer (a later one, too) broken for this step only: a malformed parameter, or
            # an activation that raises. Layers before it may have appended: the step must
            # undo that, and leave no trace of the broken parameter for the next steps.
            layer_i = p.choice(decoder.layers)
            if p.bool(0.3):
                broken = (layer_i, "activation", layer_i.activation)
                layer_i.activation = act_raises
            else:
                _, owner, attr = p.choice(layer_slots(layer_i))
                broken = (owner, attr, getattr(owner, attr))
                integral = is_float(broken[2]) and p.bool(0.3)  # (a copy of integers: refused by the attention)
                setattr(owner, attr, np.rint(broken[2] * 4).astype(int) if integral else malformed(p, broken[2]))
            n_mut += 1
            OUTCOMES["TransformerDecoder.step: a layer broken for a step"] += 1
        n_mut += invalid  # (a precision the decoder cannot take: every step raises)
        inputs = [plain(args[n]) for n in ("tgt", "memory", "memory_key_padding_mask", "memory_mask")]
        snap = snapshot(inputs)
        before = cache_state(cache)
        ok, got = call("TransformerDecoder.step", lambda: decoder.step(
            args["tgt"], args["memory"], args["cache"], memory_key_padding_mask=args["memory_key_padding_mask"],
            memory_mask=args["memory_mask"], precision=step_precision))
        check_untouched(snap, "TransformerDecoder.step")
        if broken is not None:  # the parameter back, for the steps to come
            setattr(*broken)
        after = cache_state(cache)
        for (lengths, kept), (_, now) in zip(before, after):
            trimmed = [(k[:, :kb.shape[1]], v[:, :kb.shape[1]]) for (k, v), (kb, _) in zip(now, kept)]
            if not same_held(trimmed, kept):
                raise Disallowed("TransformerDecoder.step: a cached position's key or value changed")
        check_garbage_refused(ok, garbage, n_mut, "TransformerDecoder.step")
        n_mut += len(garbage)
        if dropout_applies and ok:
            raise Disallowed("TransformerDecoder.step: computed in training mode with dropout > 0")
        if not ok:
            if any(not np.array_equal(b[0], a[0]) for b, a in zip(before, after)):
                raise Disallowed("TransformerDecoder.step: raised after appending to the cache")
            if n_mut == 0 and not dropout_applies and np.all(before[0][0] + T <= cache.max_len):
                raise Disallowed(f"TransformerDecoder.step: a valid step raised {raised()}")
            continue
        for a in inputs:
            if isinstance(a, np.ndarray) and np.shares_memory(got, a):
                raise Disallowed("TransformerDecoder.step: the result shares memory with an input")
        if broken is not None:
            # The changed parameter was valid after all (another layout, None for a bias, ...):
            # the positions of this step were made with it, which the reference's forward pass
            # over the whole sequences cannot follow. Compare what came before, then stop.
            OUTCOMES["TransformerDecoder.step: a broken layer accepted (decode ends)"] += 1
            check(range(B))
            return
        if args["cache"] is not cache:  # another cache of this decoder's layout: valid, and ours untouched
            if any(not np.array_equal(b[0], a[0]) for b, a in zip(before, after)):
                raise Disallowed("TransformerDecoder.step: a step given another cache changed this one")
            OUTCOMES["TransformerDecoder.step: another cache of the same layout"] += 1
            continue
        tgt = canonical(np.asarray(plain(args["tgt"])).astype(dtype).astype(np.float64), batched, batch_first)
        n = tgt.shape[1]
        for i, ((lengths, _), (now, _)) in enumerate(zip(before, after)):
            if not np.array_equal(now, lengths + n):
                raise Disallowed(f"TransformerDecoder.step: layer {i} holds {now.tolist()} positions, expected "
                                 f"{(lengths + n).tolist()}")
        mem_used = canonical(np.asarray(plain(args["memory"])).astype(dtype).astype(np.float64), batched, batch_first)
        if mem_used.shape != memory.shape or not np.array_equal(mem_used, memory, equal_nan=True):
            # A malformed memory that is valid after all (another length, other values): the
            # positions cached so far were made with the other memory, which the reference's
            # whole-sequence forward pass cannot follow. Compare what came before, then stop.
            OUTCOMES["TransformerDecoder.step: another memory (decode ends)"] += 1
            check(range(B))
            return
        got_rows = canonical(got, batched, batch_first)
        if got_rows.dtype != dtype or got_rows.shape != tgt.shape:
            raise Disallowed(f"TransformerDecoder.step: dtype/shape {got.dtype} {got.shape}, expected {dtype}, "
                             f"{n} positions")
        m = None if args["memory_mask"] is None else np.asarray(plain(args["memory_mask"]))
        if m is not None and m.shape not in ((n, S), ((B if batched else 1) * H, n, S)):
            raise Disallowed(f"TransformerDecoder.step: accepted a memory_mask of shape {m.shape}")
        kp = None if args["memory_key_padding_mask"] is None else np.asarray(plain(args["memory_key_padding_mask"]))
        if kp is not None and kp.shape != ((B, S) if batched else (S,)):
            raise Disallowed(f"TransformerDecoder.step: accepted a memory_key_padding_mask of shape {kp.shape}")
        bias = additive(None if m is None else (m.reshape(B, H, n, S) if m.ndim == 3 else m), (B, H, n, S))
        bias = bias + additive(None if kp is None else kp.reshape(B, 1, 1, S), (B, H, n, S))
        for b in range(B):
            tokens[b].extend(tgt[b])
            cross[b].extend(bias[b].transpose(1, 0, 2))
            outputs[b].extend(got_rows[b])
        OUTCOMES["TransformerDecoder.step: positions appended"] += 1
    check(range(B))


ENTRY_POINTS = [fuzz_sdpa, fuzz_sdpa, fuzz_mha, fuzz_mha, fuzz_module, fuzz_core, fuzz_core,
                fuzz_set_num_threads, fuzz_cache, fuzz_step, fuzz_transformer_layer, fuzz_transformer_step,
                fuzz_varlen]


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    p = Provider(data)
    entry = ENTRY_POINTS[p.int(0, len(ENTRY_POINTS) - 1)]
    OUTCOMES["inputs"] += 1
    OUTCOMES[f"entry {entry.__name__}"] += 1
    try:
        with warnings.catch_warnings():
            # Building malformed inputs warns (complex -> float casts, ...); attnx's own
            # warnings are not under test here.
            warnings.simplefilter("ignore")
            entry(p)
    finally:
        if attnx.get_num_threads() != BASE_THREADS:
            attnx.set_num_threads(BASE_THREADS)


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


def summary(seconds, engine, seed):
    inputs = OUTCOMES["inputs"]
    return {
        "engine": engine, "seed": seed, "inputs": inputs, "seconds": round(seconds, 1),
        "inputs_per_second": round(inputs / max(seconds, 1e-9), 1),
        "isa": attnx.show_config()["isa"],
        "outcomes": dict(sorted((k, v) for k, v in OUTCOMES.items() if k != "inputs")),
    }


FAILURES: dict = {}  # first line of the failure -> {"count", "input", "traceback"}


def run_builtin(seconds, seed, save_last, max_inputs, stop_on_failure):
    """Random byte strings from a fixed seed, for `seconds`. A disallowed outcome is recorded
    (deduplicated by its message's first line, with the first input that gave it) and the run
    goes on; a crash ends the process (--save-last keeps its input)."""
    import traceback

    rng = random.Random(seed)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and OUTCOMES["inputs"] < max_inputs:
        data = rng.randbytes(rng.choice([8, 32, 64, 128, 256, 512]))
        if save_last:
            with open(save_last, "wb") as f:
                f.write(data)
        try:
            TestOneInput(data)
        except Exception as exc:  # noqa: BLE001 - every failure is reported at the end
            key = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if "Not equal to tolerance" in str(exc) or "nan location mismatch" in str(exc):
                key = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            entry = FAILURES.setdefault(key, {"count": 0, "input": "hex:" + data.hex(),
                                              "traceback": traceback.format_exc()[-3000:]})
            entry["count"] += 1
            if stop_on_failure:
                break
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["builtin", "atheris"], default="builtin")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-inputs", type=int, default=10**12)
    ap.add_argument("--save-last", default=None)
    ap.add_argument("--stop-on-failure", action="store_true")
    ap.add_argument("--replay", default=None, help="run one saved input (a file, or hex with hex:)")
    ap.add_argument("--summary", default=None, help="also write the JSON summary to this file")
    args, rest = ap.parse_known_args(argv)
    attnx.set_num_threads(BASE_THREADS)
    if args.replay:
        data = bytes.fromhex(args.replay[4:]) if args.replay.startswith("hex:") else open(args.replay, "rb").read()
        TestOneInput(data)
        print(json.dumps(summary(0.0, "replay", None)))
        return 0
    if args.engine == "atheris":
        start = time.perf_counter()

        def report():
            s = json.dumps(summary(time.perf_counter() - start, "atheris", args.seed))
            print(s, flush=True)
            if args.summary:
                with open(args.summary, "w") as f:
                    f.write(s + "\n")

        atexit.register(report)
        atheris.Setup([sys.argv[0], f"-seed={args.seed}", f"-max_total_time={int(args.seconds)}",
                       "-rss_limit_mb=8192", "-timeout=60", *rest], TestOneInput)
        atheris.Fuzz()
        return 0
    seconds = run_builtin(args.seconds, args.seed, args.save_last, args.max_inputs, args.stop_on_failure)
    result = summary(seconds, "builtin", args.seed)
    result["failures"] = {k: {"count": v["count"], "input": v["input"]} for k, v in FAILURES.items()}
    for key, v in FAILURES.items():
        print(f"\n=== FAILURE ({v['count']}x): {key}\n    replay: python fuzz/fuzz_attnx.py --replay {v['input']}\n"
              f"{v['traceback']}", file=sys.stderr)
    s = json.dumps(result)
    print(s)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(s + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    if "--engine" in sys.argv and "atheris" in sys.argv and not os.environ.get("ATTNX_FUZZ_ATHERIS_INSTRUMENT"):
        # Re-run with the attnx package instrumented for atheris' coverage feedback.
        os.environ["ATTNX_FUZZ_ATHERIS_INSTRUMENT"] = "1"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    sys.exit(main())
