"""Argument conversion shared by the public functions.

Everything here turns user input into arrays the C++ core can read in place:
the compute dtype, aligned, strides in whole elements and a contiguous last
dimension. Copies are made only where an input breaks one of those rules.
"""

from __future__ import annotations

import math
import operator

import numpy as np

COMPUTE_DTYPES = (np.float32, np.float64)

# Half-precision storage dtypes: float16, and bfloat16 from ml_dtypes (an optional
# dependency, never imported by attnx: its dtype is recognised by name). They are
# read by the kernels as they are and computed in float32.
HALF_NAMES = ("float16", "bfloat16")


def shape_str(shape) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


# ---------------------------------------------------------------------------------------------
# Faithful conversion of array-likes
# ---------------------------------------------------------------------------------------------

# The torch classes whose values ``.detach().numpy()`` reads as they are, named by
# (module, class name): torch is never imported here. Subclasses of torch.Tensor are not among
# them: their array conversion need not give their values (torch's CausalBias converts to
# uninitialised memory of another shape), so they raise TypeError instead.
_PLAIN_TENSOR_CLASSES = frozenset({("torch", "Tensor"), ("torch.nn.parameter", "Parameter")})
_TENSOR_BASES = frozenset({("torch", "Tensor"), ("torch._C", "TensorBase"), ("torch._C", "_TensorBase")})


def _is_torch_tensor(cls: type) -> bool:
    """Whether `cls` is torch.Tensor or a subclass of it, told by name (torch is not imported)."""
    return any((c.__module__, c.__name__) in _TENSOR_BASES for c in cls.__mro__)


def _from_torch(x, name: str) -> np.ndarray:
    """A CPU torch tensor's values as a NumPy array (a view where torch allows one).

    As ``x.detach().cpu().numpy()`` for a dense tensor on the CPU; bfloat16 becomes
    ml_dtypes' bfloat16. Anything else (tensor subclasses, other devices and layouts,
    quantized or nested tensors) raises TypeError naming the argument.
    """
    cls = type(x)
    if (cls.__module__, cls.__name__) not in _PLAIN_TENSOR_CLASSES:
        hint = "pass a plain tensor or a NumPy array"
        if cls.__name__ == "CausalBias":
            hint = (
                "pass is_causal='top_left' (causal_upper_left) or is_causal='bottom_right' "
                "(causal_lower_right) instead"
            )
        raise TypeError(
            f"{name} is a {cls.__module__}.{cls.__qualname__}, a subclass of torch.Tensor whose array "
            f"conversion does not give its values: {hint}"
        )
    device = str(x.device)
    if not device.startswith("cpu"):
        raise TypeError(f"{name} is a tensor on device {device}; attnx computes on the CPU: pass {name}.cpu()")
    if x.is_nested:  # (strided by its layout, but without one shape)
        raise TypeError(f"{name} is a nested tensor: pass a dense one (e.g. {name}.to_padded_tensor(0.0))")
    layout = str(x.layout)
    if layout != "torch.strided":
        kind = layout.replace("torch.", "")
        raise TypeError(
            f"{name} is a {kind} tensor of shape {shape_str(x.shape)}: pass a dense one (e.g. {name}.to_dense())"
        )
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{name} is a bfloat16 tensor, which NumPy reads only with the ml_dtypes package: "
                f"pip install ml_dtypes, or pass {name}.float()"
            ) from None
        # Widening to float32 and rounding back is exact: the values are bfloat16's.
        t = t.float()
        try:
            return t.numpy().astype(ml_dtypes.bfloat16)
        except Exception as exc:  # noqa: BLE001 - re-raised with the argument named
            raise TypeError(f"{name}: could not read the tensor as a NumPy array: {exc}") from None
    try:
        return t.numpy()
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument named
        raise TypeError(f"{name}: could not read the {t.dtype} tensor as a NumPy array: {exc}") from None


def as_array(x, name: str) -> np.ndarray:
    """`x` as a NumPy array that holds its values, or TypeError naming `name`.

    NumPy arrays are returned as they are (subclasses as base-class views). torch
    tensors are read without importing torch, as ``x.detach().cpu().numpy()``: a
    tensor that requires grad is read as its detached values, a tensor subclass raises
    TypeError. Other objects that require grad and have ``detach()`` (tensors of other
    libraries) are detached first. Everything else goes through ``np.asarray``, whose
    result must be an array of numbers of the object's own ``shape``: an object array
    (a ragged list, an object NumPy does not know) or a conversion of another shape
    raises TypeError, never a computation on what it returned.
    """
    if isinstance(x, np.ndarray):
        return x if type(x) is np.ndarray else np.asarray(x)
    cls = type(x)
    if _is_torch_tensor(cls):
        return _from_torch(x, name)
    if str(getattr(cls, "__module__", "")).partition(".")[0] == "torch" and not isinstance(x, (tuple, list)):
        raise TypeError(f"{name} is a {cls.__module__}.{cls.__qualname__}, not an array or a tensor")
    source = x
    if getattr(x, "requires_grad", False) is True and callable(getattr(x, "detach", None)):
        x = x.detach()
        if not hasattr(x, "__array__") and callable(getattr(x, "numpy", None)):
            x = x.numpy()
    a = np.asarray(x)
    if a.dtype == object:
        raise TypeError(
            f"{name} is not an array of numbers: np.asarray of the {cls.__name__} gives an array of Python "
            f"objects (shape {shape_str(a.shape)}); pass a NumPy array of floats"
        )
    shape = getattr(source, "shape", None)
    if shape is not None and not isinstance(shape, (int, float)):
        try:
            claimed = tuple(operator.index(d) for d in shape)
        except (TypeError, ValueError):  # not a sequence of ints (unknown sizes): nothing to compare
            claimed = a.shape
        if claimed != a.shape:
            raise TypeError(
                f"{name} is a {cls.__name__} of shape {shape_str(claimed)} whose array conversion gives shape "
                f"{shape_str(a.shape)}: not its values; pass a NumPy array"
            )
    return a


# torch's CausalVariant names -> the is_causal mode that means the same.
_CAUSAL_VARIANTS = {"UPPER_LEFT": "top_left", "LOWER_RIGHT": "bottom_right"}


def causal_bias(obj, name: str = "attn_mask"):
    """``(mode, L, S)`` of a torch ``CausalBias`` mask, None for anything else.

    ``torch.nn.attention.bias.causal_upper_left(L, S)`` gives ``("top_left", L, S)``
    and ``causal_lower_right(L, S)`` gives ``("bottom_right", L, S)``: the
    ``is_causal`` modes that mean the same. The object is recognised by its class's
    name and module (torch is not imported) and read from its attributes
    ``variant`` (a ``CausalVariant`` whose name is ``UPPER_LEFT`` or
    ``LOWER_RIGHT``), ``seq_len_q`` and ``seq_len_kv``: its array conversion is not
    its mask.
    """
    if isinstance(obj, np.ndarray) or obj is None:
        return None
    if not any(c.__name__ == "CausalBias" and c.__module__.partition(".")[0] == "torch" for c in type(obj).__mro__):
        return None
    variant = getattr(getattr(obj, "variant", None), "name", None)
    mode = _CAUSAL_VARIANTS.get(variant) if isinstance(variant, str) else None
    if mode is None:
        raise TypeError(
            f"{name} is a CausalBias of variant {getattr(obj, 'variant', None)!r}; attnx reads UPPER_LEFT "
            f"(is_causal='top_left') and LOWER_RIGHT (is_causal='bottom_right')"
        )
    lengths = []
    for attr in ("seq_len_q", "seq_len_kv"):
        value = getattr(obj, attr, None)
        try:
            n = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} is a CausalBias whose {attr} is {value!r}, not an int") from None
        if n < 0:
            raise ValueError(f"{name} is a CausalBias whose {attr} is {n} < 0")
        lengths.append(n)
    return mode, lengths[0], lengths[1]


def is_half(dtype) -> bool:
    """Whether `dtype` is float16 or ml_dtypes' bfloat16 (any byte order)."""
    dtype = np.dtype(dtype)
    return dtype.name in HALF_NAMES and dtype.itemsize == 2


def is_floating(dtype) -> bool:
    """A real floating-point dtype: NumPy's own, or ml_dtypes' bfloat16."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or is_half(dtype)


def result_and_compute_dtype(query, name: str = "query") -> tuple:
    """(result dtype, compute dtype) of a call: the query's dtype decides.

    float32 and float64 compute in their own dtype; float16 and bfloat16 are
    storage dtypes, computed in float32 and returned in their own dtype.
    Other floating dtypes (longdouble) and non-floating ones raise TypeError.
    """
    dtype = (query if type(query) is np.ndarray else as_array(query, name)).dtype
    if dtype.type in COMPUTE_DTYPES:
        native = np.dtype(dtype.type)
        return native, native
    if is_half(dtype):
        return dtype.newbyteorder("="), np.dtype(np.float32)
    if dtype.kind == "f":
        raise TypeError(
            f"{name} has dtype {dtype}; attnx computes in float32 or float64 (float16 and "
            f"bfloat16 are computed in float32): convert it first (e.g. {name}.astype(np.float32))"
        )
    raise TypeError(
        f"{name} must be a floating-point array (float32, float64, float16 or bfloat16), got dtype {dtype}"
    )


def compute_dtype(query) -> np.dtype:
    """The dtype a call computes in: float32 or float64 (float32 for half-precision queries)."""
    return result_and_compute_dtype(query)[1]


def as_float(x, dtype: np.dtype, name: str, keep_half: bool = False) -> np.ndarray:
    """`x` as an array of `dtype`; integer, bool, complex and other kinds raise TypeError.

    With `keep_half` (for key and value of a float32 computation), a float16 or
    bfloat16 array in native byte order is returned as it is: the kernels read
    half-precision keys and values in place and widen them to float32.
    """
    a = x if type(x) is np.ndarray else as_array(x, name)
    if not is_floating(a.dtype):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    if keep_half and dtype == np.float32 and is_half(a.dtype):
        return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))
    if a.dtype != dtype:  # also converts a non-native byte order
        a = a.astype(dtype)
    return a


def kernel_layout(a: np.ndarray, contiguous_last: bool = True) -> np.ndarray:
    """`a` itself if the core can read it in place, else a C-contiguous copy.

    The core needs aligned data, strides in whole elements and (for q, k, v
    and weights) a unit-stride last dimension; broadcast (stride 0) and
    negative strides elsewhere are fine.
    """
    flags = a.flags
    if flags.c_contiguous and flags.aligned:
        return a
    item = a.itemsize
    ok = flags.aligned and all(s % item == 0 for s in a.strides)
    if ok and contiguous_last and a.ndim and a.shape[-1] > 1:
        ok = a.strides[-1] == item
    # np.array(copy=True), not ascontiguousarray: the latter returns a
    # contiguous but misaligned array unchanged.
    return a if ok else np.array(a, order="C", copy=True)


# The bits of -inf by float size: a bool mask becomes 0 / -inf in one integer multiply
# (closed = 1 times the bits), faster than np.where (docs/tuning.md).
_NEG_INF_BITS = {4: (np.uint32, 0xFF800000), 8: (np.uint64, 0xFFF0000000000000)}


def additive_mask(mask, dtype: np.dtype, name: str, true_means_masked: bool) -> np.ndarray:
    """A bool or float mask as an additive float mask of its own shape.

    torch's sdpa reads True as "may attend"; its multi-head attention reads
    True as "masked". A float mask is added to the scores as it is.
    """
    m = mask if type(mask) is np.ndarray else as_array(mask, name)
    if m.dtype == np.bool_:
        closed = m if true_means_masked else ~m
        uint, neg_inf_bits = _NEG_INF_BITS[dtype.itemsize]
        out = np.empty(m.shape, uint)
        np.multiply(closed, uint(neg_inf_bits), out=out)
        return out.view(dtype)
    if is_floating(m.dtype):
        return kernel_layout(m.astype(dtype, copy=False), contiguous_last=False)
    raise TypeError(f"{name} must be a bool or floating-point array, got dtype {m.dtype}")


# precision= and the core's code of it: the products' operands in the compute dtype (0),
# rounded to bfloat16 with float32 sums (1), or int8 with int32 sums (2: attention over an int8
# cache only).
PRECISION_NAMES = ("float32", "bfloat16", "int8")
_PRECISION_CODES = {None: 0, "float32": 0, "bfloat16": 1, "int8": 2}


def precision_code(precision, dtype=None, what: str = "query", fix: str = "", int8_cache=None) -> int:
    """The core's code of a ``precision`` argument: 0 for None or "float32", 1 for "bfloat16",
    2 for "int8".

    Anything else raises ValueError naming the choices. "bfloat16" computes in float32, so a
    float64 compute dtype (`dtype`, decided by `what`) raises ValueError that says how to fix
    the call (`fix`, by default converting `what` to float32). "int8" multiplies int8 keys and
    values: only attention over a cache takes it (`int8_cache`: whether the cache is int8;
    None where the call has no cache), and ValueError says so otherwise.
    """
    code = _PRECISION_CODES.get(precision) if precision is None or isinstance(precision, str) else None
    if code is None or (code == 2 and int8_cache is None):
        choices = "None, 'float32', 'bfloat16' or 'int8'" if int8_cache is not None else "None, 'float32' or 'bfloat16'"
        hint = (" ('int8' is for attention over an int8 KVCache or PagedKVCache: cached_attention, "
                "paged_attention)" if code == 2 else "")
        raise ValueError(f"precision must be {choices}, got {precision!r}{hint}")
    if code == 2 and not int8_cache:
        raise ValueError(
            f"precision='int8' multiplies int8 keys and values, but {what} is not int8: make the cache "
            f"with dtype=np.int8, or use precision=None or 'bfloat16'"
        )
    if code == 1 and dtype is not None and np.dtype(dtype) == np.float64:
        fix = fix or f"convert {what} to float32 ({what}.astype(np.float32))"
        raise ValueError(
            f"precision='bfloat16' computes in float32 (bfloat16 operands, float32 sums), but {what} is "
            f"float64: {fix}, or leave precision=None for float64 arithmetic"
        )
    return code


def as_bool_flag(value, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


CAUSAL_CHOICES = "False, True, 'top_left' or 'bottom_right'"


def causal_mode(value, name: str = "is_causal") -> tuple:
    """(causal, bottom_right) of an ``is_causal`` argument.

    False: no causal mask. True or "top_left": query i attends keys j <= i.
    "bottom_right": query i of L attends keys j <= i + S - L.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value), False
    if isinstance(value, str):
        if value == "top_left":
            return True, False
        if value == "bottom_right":
            return True, True
    raise ValueError(f"{name} must be {CAUSAL_CHOICES}, got {value!r}")


# Window bounds beyond any sequence length are clipped to this (the core takes int64).
_WINDOW_MAX = 2**62


def window_bounds(window, name: str = "window") -> tuple:
    """(left, right) of a ``window=(left, right)`` argument, -1 for an unbounded side.

    Each side is an int >= 0 or None (unbounded); ``window=None`` bounds neither.
    """
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)):
        raise TypeError(f"{name} must be None or a pair (left, right) of ints >= 0 or None, got {window!r}")
    if len(window) != 2:
        raise ValueError(f"{name} must be a pair (left, right), got {len(window)} values: {window!r}")
    bounds = []
    for side, value in zip(("left", "right"), window):
        if value is None:
            bounds.append(-1)
            continue
        n = as_int(value, f"{name} {side}", 0, "an int >= 0 or None", ">= 0 or None")
        bounds.append(min(n, _WINDOW_MAX))
    return tuple(bounds)


def as_lengths(lengths, count: int, upper: int, name: str, what: str) -> np.ndarray:
    """Per-sequence lengths as a C-contiguous int64 array of shape (count,), values in [0, upper].

    `what` says what the upper bound is, for the error message (e.g. "T = 4, the query's length").
    """
    a = as_array(lengths, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an array of integers, got dtype {a.dtype}")
    if a.shape != (count,):
        raise ValueError(f"{name} must have shape {shape_str((count,))} (one per sequence), got {shape_str(a.shape)}")
    if a.size and (a.min() < 0 or a.max() > upper):
        raise ValueError(f"{name} must be in [0, {upper}] ({what}), got {a.tolist()}")
    return np.array(a, dtype=np.int64, order="C", copy=True)


def as_int(value, name: str, least: int, kind: str, bound: str) -> int:
    """`value` as an int >= `least`. Bools and non-integral numbers raise TypeError
    ("{name} must be {kind}, got ..."), smaller ints ValueError ("{name} must be {bound}, got ...")."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {kind}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {kind}, got {value!r}") from None
    if n < least:
        raise ValueError(f"{name} must be {bound}, got {n}")
    return n


def as_positive_int(value, name: str) -> int:
    """`value` as an int >= 1; bools and non-integral numbers raise TypeError."""
    return as_int(value, name, 1, "a positive integer", "a positive integer")


def check_heads(embed_dim: int, num_heads: int) -> int:
    """The head dim, embed_dim // num_heads; ValueError unless num_heads divides embed_dim >= 1
    (the rule of the core's weights, checked by them: ``_core.head_dim``)."""
    from . import _core

    return int(_core.head_dim(embed_dim, num_heads))


def as_finite_scale(scale) -> float:
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number or None, got {scale!r}") from None
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {s}")
    return s


def merge_leading(a: np.ndarray, lead_ndim: int) -> np.ndarray:
    """Collapse the first `lead_ndim` dims into one (a view where strides allow)."""
    count = math.prod(a.shape[:lead_ndim])
    return a.reshape((count,) + a.shape[lead_ndim:])


def check_out(out, shape: tuple, dtype: np.dtype, inputs) -> np.ndarray:
    """Validate an `out=` array: exact shape and dtype, C-contiguous, writable, no overlap."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, the result has dtype {dtype}")
    if out.shape != tuple(shape):
        raise ValueError(f"out has shape {shape_str(out.shape)}, the result has shape {shape_str(shape)}")
    if not (out.flags.c_contiguous and out.flags.aligned):
        raise ValueError(f"out must be an aligned, C-contiguous array (shape {shape_str(out.shape)})")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    for x in inputs:
        if x is None:
            continue
        if type(x) is not np.ndarray:
            # The values as attnx read them (a tensor's are a view of its memory); np.asarray
            # itself would fail on a tensor that requires grad.
            try:
                x = as_array(x, "input")
            except TypeError:  # not an array (a CausalBias mask): no memory to share
                continue
        if np.may_share_memory(out, x):
            raise ValueError("out must not share memory with an input")
    return out

