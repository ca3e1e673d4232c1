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


def shape_str(shape) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def compute_dtype(query) -> np.dtype:
    """The dtype a call computes in: the query's, which must be float32/float64."""
    dtype = np.asarray(query).dtype
    if dtype.type in COMPUTE_DTYPES:
        return np.dtype(dtype.type)  # native byte order
    if dtype.kind == "f":
        raise TypeError(
            f"query has dtype {dtype}; attnx computes in float32 or float64: "
            f"convert it first (e.g. query.astype(np.float32))"
        )
    raise TypeError(f"query must be a floating-point array (float32 or float64), got dtype {dtype}")


def as_float(x, dtype: np.dtype, name: str) -> np.ndarray:
    """`x` as an array of `dtype`; integer, bool, complex and other kinds raise TypeError."""
    a = np.asarray(x)
    if a.dtype.kind != "f":
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
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


def additive_mask(mask, dtype: np.dtype, name: str, true_means_masked: bool) -> np.ndarray:
    """A bool or float mask as an additive float mask of its own shape.

    torch's sdpa reads True as "may attend"; its multi-head attention reads
    True as "masked". A float mask is added to the scores as it is.
    """
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        zero, neg_inf = dtype.type(0), dtype.type(-np.inf)
        return np.where(m, neg_inf, zero) if true_means_masked else np.where(m, zero, neg_inf)
    if m.dtype.kind == "f":
        return kernel_layout(m.astype(dtype, copy=False), contiguous_last=False)
    raise TypeError(f"{name} must be a bool or floating-point array, got dtype {m.dtype}")


def as_bool_flag(value, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


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
