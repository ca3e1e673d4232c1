"""torch's argument rules, mapping each public call to the core's canonical call.

Each operation has one binding in ``attnx._core`` and one route to it. The
binding runs inputs that are already canonical as they are; everything else
(conversions, ranks, broadcasting, masks, ``out=``) comes here, is checked
once against torch's rules, and goes back as canonical arrays:

- scaled dot-product attention: (B, H, L, E) query, (B, Hk, S, E) key,
  (B, Hk, S, Ev) value, an additive mask broadcast to (lead..., H, L, S);
- multi-head attention: (N, L, E) inputs and (N, H, L, S) additive masks.
"""

from __future__ import annotations

import math

import numpy as np

from . import _core
from ._arrays import (
    additive_mask,
    as_bool_flag,
    as_finite_scale,
    as_float,
    causal_mode,
    check_out,
    kernel_layout,
    merge_leading,
    result_and_compute_dtype,
    shape_str,
    window_bounds,
)

# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

_NAN = float("nan")

# The options of the common calls, made once: [is_causal][enable_gqa].
_DEFAULT_SDPA_OPTIONS = tuple(
    tuple(_core.SdpaOptions(causal, False, _NAN, -1, -1, gqa) for gqa in (False, True))
    for causal in (False, True)
)


def sdpa_options(is_causal, scale, enable_gqa, window) -> "_core.SdpaOptions":
    """The checked scalar arguments of scaled_dot_product_attention."""
    if scale is None and window is None and type(is_causal) is bool and type(enable_gqa) is bool:
        return _DEFAULT_SDPA_OPTIONS[is_causal][enable_gqa]
    causal, bottom_right = causal_mode(is_causal)
    enable_gqa = as_bool_flag(enable_gqa, "enable_gqa")
    window_left, window_right = window_bounds(window)
    scale = _NAN if scale is None else as_finite_scale(scale)
    return _core.SdpaOptions(causal, bottom_right, scale, window_left, window_right, enable_gqa)


# ---------------------------------------------------------------------------------------------
# Scaled dot-product attention
# ---------------------------------------------------------------------------------------------


def _sdpa_operands(query, key, value):
    """(result dtype, compute dtype, q, k, v): the operands in the compute dtype, at least 2-D."""
    result_dtype, dtype = result_and_compute_dtype(query)
    q = as_float(query, dtype, "query")
    k = as_float(key, dtype, "key", keep_half=True)
    v = as_float(value, dtype, "value", keep_half=True)
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., L, E), got shape {shape_str(x.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dimension: query {shape_str(q.shape)}, key {shape_str(k.shape)}"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"key and value must have the same sequence length (dim -2): key {shape_str(k.shape)}, value {shape_str(v.shape)}"
        )
    return result_dtype, dtype, q, k, v


def _sdpa_batch(q, k, v, enable_gqa) -> tuple:
    """(lead dims, Hq, Hk, each operand's batch dims padded to the same rank) by torch's rules."""
    nd = max(q.ndim, k.ndim, v.ndim, 3)
    batch_q, batch_k, batch_v = (((1,) * (nd - x.ndim)) + x.shape[:-2] for x in (q, k, v))
    shapes = f"query {shape_str(q.shape)}, key {shape_str(k.shape)}"
    if enable_gqa:
        Hq, Hk = batch_q[-1], batch_k[-1]
        if batch_v[-1] != Hk:
            raise ValueError(
                f"with enable_gqa, key and value must have the same number of heads (dim -3): "
                f"key {shape_str(k.shape)}, value {shape_str(v.shape)}"
            )
        if Hk == 0 or Hq % Hk != 0:
            raise ValueError(f"with enable_gqa, query heads must be a multiple of key heads (dim -3): {shapes}")
    try:
        if enable_gqa:
            lead = tuple(np.broadcast_shapes(batch_q[:-1], batch_k[:-1], batch_v[:-1]))
        else:
            *lead, Hq = np.broadcast_shapes(batch_q, batch_k, batch_v)
            lead, Hk = tuple(lead), Hq
    except ValueError:
        grouped = ""
        if not enable_gqa and q.ndim >= 3 and k.ndim >= 3 and k.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
            grouped = " (for grouped-query attention, with fewer key than query heads, pass enable_gqa=True)"
        raise ValueError(
            f"the batch dims of {shapes} and value {shape_str(v.shape)} do not broadcast{grouped}"
        ) from None
    return lead, Hq, Hk, (batch_q, batch_k, batch_v)


def _sdpa_mask(attn_mask, dtype, full_batch, result_shape, nlead):
    """attn_mask as an additive mask broadcast to (lead..., Hq, L, S), read in place."""
    mask = additive_mask(attn_mask, dtype, "attn_mask", true_means_masked=False)
    # The scores have the result's rank: a mask of higher rank does not broadcast to them,
    # even where its extra leading dims are 1.
    L, S = full_batch[-2:]
    scores_shape = result_shape[:-1] + (S,)
    try:
        if mask.ndim > len(scores_shape):
            raise ValueError
        mask = np.broadcast_to(mask, full_batch)
    except ValueError:
        raise ValueError(
            f"attn_mask of shape {shape_str(np.shape(attn_mask))} does not broadcast to the "
            f"scores' shape {shape_str(scores_shape)}"
        ) from None
    # The lead dims stay as they are: the core reads them through their strides even where
    # they cannot merge into one (e.g. strides (0, s)).
    return kernel_layout(mask if nlead else mask[None], contiguous_last=False)


def sdpa_call(query, key, value, attn_mask, options, out) -> tuple:
    """The canonical call of ``scaled_dot_product_attention``.

    Returns ``(q, k, v, mask, target, computed, result)``: 4-D operands, the additive mask
    or None, the (B, Hq, L, Ev) view of ``computed`` the core writes (None for an empty
    result) and the array returned, which is ``computed`` unless the result has a
    half-precision dtype and is rounded from it.
    """
    result_dtype, dtype, q, k, v = _sdpa_operands(query, key, value)
    if options.causal and attn_mask is not None:
        raise ValueError("attn_mask and is_causal cannot both be given")
    lead, Hq, Hk, (batch_q, batch_k, batch_v) = _sdpa_batch(q, k, v, options.enable_gqa)
    (L, E), (S, Ev) = q.shape[-2:], v.shape[-2:]
    full_batch = lead + (Hq,)
    out_ndim = max(q.ndim, k.ndim, v.ndim)
    result_shape = full_batch[len(full_batch) - (out_ndim - 2):] + (L, Ev)
    nlead = len(lead)
    q4 = merge_leading(np.broadcast_to(q.reshape(batch_q + (L, E)), full_batch + (L, E)), nlead)
    k4 = merge_leading(np.broadcast_to(k.reshape(batch_k + (S, E)), lead + (Hk, S, E)), nlead)
    v4 = merge_leading(np.broadcast_to(v.reshape(batch_v + (S, Ev)), lead + (Hk, S, Ev)), nlead)
    mask4 = None
    if attn_mask is not None:
        mask4 = _sdpa_mask(attn_mask, dtype, full_batch + (L, S), result_shape, nlead)
    if out is None:
        out = np.empty(result_shape, result_dtype)
    else:
        check_out(out, result_shape, result_dtype, (q, k, v, attn_mask))
    if out.size == 0:
        return q4, k4, v4, mask4, None, out, out
    # Half-precision results are computed into a float32 buffer, then rounded.
    computed = out if result_dtype == dtype else np.empty(result_shape, dtype)
    target = computed.reshape(q4.shape[:3] + (Ev,))
    return kernel_layout(q4), kernel_layout(k4), kernel_layout(v4), mask4, target, computed, out
