"""Ragged batches: attention of sequences packed end to end, with no padding.

:func:`varlen_attention` takes flash-attn's ``flash_attn_varlen_func`` layout: the rows of every
sequence one after another along the first axis, and cumulative offsets (``cu_seqlens``) saying
where each sequence starts. The core runs it through the same planner and kernels as
:func:`attnx.scaled_dot_product_attention`, each sequence a batch of its own lengths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from ._arrays import (
    as_array,
    as_float,
    check_out,
    kernel_layout,
    precision_code,
    result_and_compute_dtype,
    shape_str,
)
from ._canonical import sdpa_options

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import FloatArray, Precision

__all__ = ["varlen_attention"]


def _offsets(cu_seqlens: Any, name: str) -> np.ndarray:
    """`cu_seqlens` as a C-contiguous int64 vector; its values are the core's to check."""
    a = as_array(cu_seqlens, name)
    if a.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be an array of integers (cumulative sequence lengths, as int32 or int64), "
            f"got dtype {a.dtype}"
        )
    if a.ndim != 1:
        raise ValueError(
            f"{name} must be 1-D, (batch + 1,) offsets starting at 0, got shape {shape_str(a.shape)}"
        )
    if a.dtype.kind == "u" and a.size and int(a.max()) >= 2**63:
        raise ValueError(f"{name} holds {int(a.max())}, past any row count")
    return np.array(a, dtype=np.int64, order="C", copy=True)


def varlen_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike | None = None,
    *,
    is_causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    precision: Precision | None = None,
    out: FloatArray | None = None,
) -> FloatArray:
    """Attention of a batch of sequences packed along the first axis, without padding.

    Sequence ``b``'s queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``query``, and
    its keys and values rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``key`` and ``value``
    (flash-attn's ``flash_attn_varlen_func`` layout). A query attends only the keys of its own
    sequence; each sequence's rows equal :func:`scaled_dot_product_attention` on that sequence
    alone, with the same options. No padded position is read or computed.

    Parameters
    ----------
    query : array_like, shape (total_q, Hq, E)
        float32 or float64: the compute dtype; float16 or bfloat16 are computed in float32 and
        the result has the query's dtype.
    key : array_like, shape (total_k, Hk, E)
        ``Hq`` must be a multiple of ``Hk``: query head ``h`` uses key/value head
        ``h // (Hq // Hk)`` (grouped-query attention, no flag needed). float16 or bfloat16 keys
        and values of a float32 computation are read in place.
    value : array_like, shape (total_k, Hk, Ev)
    cu_seqlens_q : array_like of int, shape (batch + 1,)
        Cumulative query lengths: starts at 0, never decreases, ends at ``total_q``.
    cu_seqlens_k : array_like of int, shape (batch + 1,), optional
        Cumulative key lengths, the same rules with ``total_k``. Default: ``cu_seqlens_q``
        (self-attention).
    is_causal : bool or {"top_left", "bottom_right"}, keyword-only
        Per sequence, as in :func:`scaled_dot_product_attention`: True or ``"top_left"``, query
        ``i`` attends key ``j`` iff ``j <= i``; ``"bottom_right"``, iff ``j <= i + S_b - L_b``
        (the queries are the newest ``L_b`` of the sequence's ``S_b`` positions).
    scale : float, optional, keyword-only
        Defaults to ``1 / sqrt(E)``.
    window : tuple (left, right), optional, keyword-only
        Sliding window per sequence, as in :func:`scaled_dot_product_attention`.
    softcap : float, optional, keyword-only
        Soft-capped scores, as in :func:`scaled_dot_product_attention`.
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        The products' precision, as in :func:`scaled_dot_product_attention`.
    out : ndarray, optional, keyword-only
        C-contiguous array of the result's shape and dtype to write into.

    Returns
    -------
    ndarray, shape (total_q, Hq, Ev)
        In the query's dtype. A query with no key to attend (its sequence has no keys, or its
        window or causal range holds none) gives zeros.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> lengths = [5, 2, 7]                          # three sequences, 14 tokens
    >>> cu = np.concatenate([[0], np.cumsum(lengths)])
    >>> q, k, v = rng.standard_normal((3, 14, 4, 16), dtype=np.float32)  # (tokens, heads, E)
    >>> out = attnx.varlen_attention(q, k, v, cu, is_causal=True)
    >>> out.shape
    (14, 4, 16)
    >>> alone = attnx.scaled_dot_product_attention(    # the second sequence by itself
    ...     q[5:7].transpose(1, 0, 2), k[5:7].transpose(1, 0, 2), v[5:7].transpose(1, 0, 2),
    ...     is_causal=True)
    >>> bool(np.allclose(out[5:7], alone.transpose(1, 0, 2), atol=1e-6))
    True
    """
    result_dtype, dtype = result_and_compute_dtype(query)
    code = 0 if precision is None else precision_code(precision, dtype)
    options = sdpa_options(is_causal, scale, True, window, softcap, None, code)
    q = as_float(query, dtype, "query")
    k = as_float(key, dtype, "key", keep_half=True)
    v = as_float(value, dtype, "value", keep_half=True)
    for name, x, dims in (("query", q, "(total_q, Hq, E)"), ("key", k, "(total_k, Hk, E)"),
                          ("value", v, "(total_k, Hk, Ev)")):
        if x.ndim != 3:
            raise ValueError(
                f"{name} must be {dims}, sequences packed along the first axis; got shape {shape_str(x.shape)}"
            )
    cu_q = _offsets(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else _offsets(cu_seqlens_k, "cu_seqlens_k")
    result_shape = (q.shape[0], q.shape[1], v.shape[2])
    if out is None:
        out = np.empty(result_shape, result_dtype)
    else:
        check_out(out, result_shape, result_dtype, (query, key, value))
    computed = out if out.dtype == dtype else np.empty(result_shape, dtype)
    _core.varlen_attention(kernel_layout(q), kernel_layout(k), kernel_layout(v), cu_q, cu_k, options,
                           computed)
    if computed is not out:
        out[...] = computed
    return out
