"""What the entry points' fuzzers share.

* Decisions read from the input bytes (``Provider``; ``rarely``).
* Values for the calls: ``values`` (N(0, 1), NaN/Inf, extreme magnitudes, zeros), ``relayout``
  (the same values in another memory layout), ``malformed`` (another rank, shape, dtype, a list,
  a string, None, an object whose ``__array__`` raises, ...), ``mutate``, ``block_pattern``,
  ``SCALAR_JUNK``; what torch code passes (``torch_habits``: tensors that require grad, tensor
  subclasses that convert to garbage; ``CausalBias``).
* The ``precision=`` of a call (``draw_precision``) and the tolerances (``TOL``, ``BF16_TOL``).
* Running a call and judging its outcome: ``call`` (an allowed exception, or a result),
  ``compare`` against the reference, ``check_untouched``, ``check_garbage_refused``,
  ``reference_of``; every outcome counted in ``OUTCOMES``.
* What a KV cache holds (``held``, ``still_held``), for the entry points that fill one.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

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


def draw_precision(p: Provider, compute, int8_cache=None):
    """``(precision, invalid)`` for a call computing in `compute`: bfloat16 with float64, or
    an unknown name, is invalid (ValueError). Attention over a cache (`int8_cache`: whether it
    is int8) also draws "int8", invalid with a cache of another dtype."""
    if p.bool(0.02):
        return p.choice(BAD_PRECISIONS), True
    if int8_cache is not None and p.bool(0.2 if int8_cache else 0.03):
        return "int8", not int8_cache
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


def int8_tolerance(arrays) -> dict:
    """assert_allclose's tolerance of an int8-precision result against the int8 reference:
    bf16_tolerance's, whose absolute part (1.5% of the largest value) covers a probability's
    level landing one step (1/127 of its block's largest) apart, and a row with non-finite
    values among its closed keys, whose products with the values are float32 ones."""
    return bf16_tolerance(arrays)


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


def rarely(p: Provider, prob: float) -> bool:
    """True with probability `prob`; False once the input is used up (which p.bool() makes
    True), so that a short input still describes a plain valid call."""
    return p.byte() >= 256 - int(256 * prob)


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


def raised() -> str:
    """The exception call() caught last, for a message: its type and the start of its own."""
    if LAST_ERROR[0] is None:
        return "the input's own exception"
    return f"{LAST_ERROR[0].__name__}: {LAST_MESSAGE[0].splitlines()[0][:100] if LAST_MESSAGE[0] else ''}"


# ---------------------------------------------------------------------------------------------
# Building calls
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


# What a malformed scalar argument (a count, a flag, a dimension) is replaced with.
SCALAR_JUNK = [None, 0, 1, -1, 2, 3, 4, 2**40, 1.5, float("nan"), "2", True, False, np.int64(2),
               np.bool_(False), np.array([1, 2]), 0.5, 1.0, [], object()]


# ---------------------------------------------------------------------------------------------
# What a KV cache holds
# ---------------------------------------------------------------------------------------------


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
