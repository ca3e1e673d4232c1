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
    dtype = np.asarray(query).dtype
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
    a = np.asarray(x)
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
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        closed = m if true_means_masked else ~m
        uint, neg_inf_bits = _NEG_INF_BITS[dtype.itemsize]
        out = np.empty(m.shape, uint)
        np.multiply(closed, uint(neg_inf_bits), out=out)
        return out.view(dtype)
    if is_floating(m.dtype):
        return kernel_layout(m.astype(dtype, copy=False), contiguous_last=False)
    raise TypeError(f"{name} must be a bool or floating-point array, got dtype {m.dtype}")


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
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} {side} must be an int >= 0 or None, got {value!r}")
        try:
            n = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} {side} must be an int >= 0 or None, got {value!r}") from None
        if n < 0:
            raise ValueError(f"{name} {side} must be >= 0 or None, got {n}")
        bounds.append(min(n, _WINDOW_MAX))
    return tuple(bounds)


def as_lengths(lengths, count: int, upper: int, name: str, what: str) -> np.ndarray:
    """Per-sequence lengths as a C-contiguous int64 array of shape (count,), values in [0, upper].

    `what` says what the upper bound is, for the error message (e.g. "T = 4, the query's length").
    """
    a = np.asarray(lengths)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an array of integers, got dtype {a.dtype}")
    if a.shape != (count,):
        raise ValueError(f"{name} must have shape {shape_str((count,))} (one per sequence), got {shape_str(a.shape)}")
    if a.size and (a.min() < 0 or a.max() > upper):
        raise ValueError(f"{name} must be in [0, {upper}] ({what}), got {a.tolist()}")
    return np.array(a, dtype=np.int64, order="C", copy=True)


def as_positive_int(value, name: str) -> int:
    """`value` as an int >= 1; bools and non-integral numbers raise TypeError."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {n}")
    return n


def check_heads(embed_dim: int, num_heads: int) -> int:
    """The head dim, embed_dim // num_heads; ValueError unless num_heads divides embed_dim >= 1."""
    if embed_dim < 1:
        raise ValueError(f"embed_dim must be at least 1 (a multiple of num_heads = {num_heads}), got {embed_dim}")
    if embed_dim % num_heads != 0:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    return embed_dim // num_heads


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
        if x is not None and np.may_share_memory(out, x):
            raise ValueError("out must not share memory with an input")
    return out


# torch.nn.attention.bias.CausalVariant's names, by the alignment they stand for.
_CAUSAL_VARIANTS = {"UPPER_LEFT": "top_left", "LOWER_RIGHT": "bottom_right"}


def causal_bias(obj) -> tuple | None:
    """(is_causal mode, L, S) of a torch ``CausalBias``; None for anything else.

    ``torch.nn.attention.bias.causal_upper_left(L, S)`` / ``causal_lower_right(L, S)``
    are recognised by their class, without importing torch: ``np.asarray`` of one gives
    uninitialised memory of another shape, never its mask.
    """
    cls = type(obj)
    if cls.__name__ != "CausalBias" or not cls.__module__.startswith("torch.nn.attention"):
        return None
    variant = getattr(getattr(obj, "variant", None), "name", None)
    mode = _CAUSAL_VARIANTS.get(variant)
    if mode is None:
        raise TypeError(f"attn_mask is a CausalBias of an unknown variant {variant!r}")
    return mode, int(obj.seq_len_q), int(obj.seq_len_kv)
