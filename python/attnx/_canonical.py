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
from .cache import KVCache
from ._arrays import (
    additive_mask,
    as_array,
    as_bool_flag,
    as_finite_scale,
    as_float,
    as_lengths,
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


def make_sdpa_options(causal, bottom_right, scale, window_left, window_right, enable_gqa, softcap, scores,
                      precision) -> "_core.SdpaOptions":
    """The core's options of checked values (`precision`: the core's code of it)."""
    return _core.SdpaOptions(causal, bottom_right, scale, window_left, window_right, enable_gqa, softcap, scores,
                             precision)


# The options of the common calls, made once: [is_causal][enable_gqa].
DEFAULT_SDPA_OPTIONS = tuple(
    tuple(make_sdpa_options(causal, False, _NAN, -1, -1, gqa, 0.0, -1, 0) for gqa in (False, True))
    for causal in (False, True)
)


# return_scores= and the stage of the core's scores (ScoreStage).
SCORE_STAGES = {"qk": 0, "softcapped": 1, "masked": 2, "softmax": 3}


def as_softcap(softcap) -> float:
    """The soft cap as the core takes it: 0.0 for None, else a finite number > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_, str, bytes)):
        raise TypeError(f"softcap must be a positive number or None, got {softcap!r}")
    try:
        c = float(softcap)
    except (TypeError, ValueError):
        raise TypeError(f"softcap must be a positive number or None, got {softcap!r}") from None
    if not (math.isfinite(c) and c > 0):
        raise ValueError(
            f"softcap must be finite and > 0 (scores become softcap * tanh(scores / softcap)), got {softcap!r}"
        )
    return c


def score_stage(return_scores) -> int:
    """The core's stage of a ``return_scores`` argument; -1 for None."""
    if return_scores is None:
        return -1
    stage = SCORE_STAGES.get(return_scores) if isinstance(return_scores, str) else None
    if stage is None:
        choices = ", ".join(repr(name) for name in SCORE_STAGES)
        raise ValueError(f"return_scores must be None or one of {choices}, got {return_scores!r}")
    return stage


def check_dropout(dropout_p, name: str = "dropout_p") -> None:
    """dropout_p must be 0: attnx computes inference, where dropout is off."""
    if isinstance(dropout_p, (bool, np.bool_, str)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"{name} must be a number (0.0), got {dropout_p!r}; as in torch, is_causal comes after "
            f"{name}: sdpa(query, key, value, attn_mask, dropout_p, is_causal)"
        )
    if not 0 <= dropout_p <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {dropout_p!r}")
    if dropout_p != 0:
        raise NotImplementedError(
            f"{name}={dropout_p!r}: attnx is inference only and applies no dropout; pass {name}=0.0"
        )


# The options of calls without a window, by their arguments and the arguments' classes (so that
# True and 1, or 0.5 and np.float32(0.5), are told apart): checking them and making the core's
# object costs a small call a large share of its time (docs/tuning.md).
_OPTIONS_CACHE: dict = {}
_OPTIONS_CACHE_SIZE = 256


def sdpa_options(is_causal, scale, enable_gqa, window, softcap=None, return_scores=None,
                 precision: int = 0) -> "_core.SdpaOptions":
    """The checked scalar arguments of scaled_dot_product_attention; `precision` is the
    core's code of it (precision_code)."""
    if window is not None:
        return _make_sdpa_options(is_causal, scale, enable_gqa, window, softcap, return_scores, precision)
    key = (is_causal, is_causal.__class__, scale, scale.__class__, enable_gqa, enable_gqa.__class__,
           softcap, softcap.__class__, return_scores, return_scores.__class__, precision)
    try:
        options = _OPTIONS_CACHE.get(key)
    except TypeError:  # an unhashable argument: checked (and refused) below
        options = key = None
    if options is None:
        options = _make_sdpa_options(is_causal, scale, enable_gqa, window, softcap, return_scores, precision)
        if key is not None and len(_OPTIONS_CACHE) < _OPTIONS_CACHE_SIZE:
            _OPTIONS_CACHE[key] = options
    return options


def _make_sdpa_options(is_causal, scale, enable_gqa, window, softcap, return_scores,
                       precision) -> "_core.SdpaOptions":
    causal, bottom_right = causal_mode(is_causal)
    enable_gqa = as_bool_flag(enable_gqa, "enable_gqa")
    window_left, window_right = window_bounds(window)
    scale = _NAN if scale is None else as_finite_scale(scale)
    return make_sdpa_options(
        causal, bottom_right, scale, window_left, window_right, enable_gqa, as_softcap(softcap),
        score_stage(return_scores), precision,
    )



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

    Returns ``(q, k, v, mask, target, computed, result, scores)``: 4-D operands, the
    additive mask or None, the (B, Hq, L, Ev) view of ``computed`` the core writes (None
    when there is nothing to compute) and the array returned, which is ``computed`` unless
    the result has a half-precision dtype and is rounded from it. ``scores`` is None, or
    for ``options.scores >= 0`` the same three arrays of the (..., Hq, L, S) scores.
    """
    result_dtype, dtype, q, k, v = _sdpa_operands(query, key, value)
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
    scores = None
    if options.scores >= 0:
        # The only (L, S) array of the call: the scores are computed in place.
        scores_result = np.empty(result_shape[:-1] + (S,), result_dtype)
        scores_computed = scores_result if result_dtype == dtype else np.empty(scores_result.shape, dtype)
        scores = (scores_computed.reshape(q4.shape[:3] + (S,)), scores_computed, scores_result)
    if out.size == 0 and (scores is None or scores_result.size == 0):
        return q4, k4, v4, mask4, None, out, out, scores
    # Half-precision results are computed into a float32 buffer, then rounded.
    computed = out if result_dtype == dtype else np.empty(result_shape, dtype)
    target = computed.reshape(q4.shape[:3] + (Ev,))
    return kernel_layout(q4), kernel_layout(k4), kernel_layout(v4), mask4, target, computed, out, scores


# ---------------------------------------------------------------------------------------------
# Multi-head attention
# ---------------------------------------------------------------------------------------------


def mha_options(is_causal, need_weights, average_attn_weights, batch_first, attn_mask,
                precision: int = 0) -> "_core.MhaOptions":
    """The checked flags of a multi-head attention call; `precision` is the core's code of it.

    With an attn_mask, is_causal is a hint (as in torch's module): the mask is used as given.
    """
    causal, bottom_right = causal_mode(is_causal)
    causal = causal and attn_mask is None
    return make_mha_options(
        causal,
        causal and bottom_right,
        as_bool_flag(need_weights, "need_weights"),
        as_bool_flag(average_attn_weights, "average_attn_weights"),
        as_bool_flag(batch_first, "batch_first"),
        precision,
    )


def make_mha_options(causal, bottom_right, need_weights, average_weights, batch_first,
                     precision) -> "_core.MhaOptions":
    """The core's options of checked flags (`precision`: the core's code of it)."""
    return _core.MhaOptions(causal, bottom_right, need_weights, average_weights, batch_first, precision)


def _parameter(x, dtype, name, shape) -> np.ndarray:
    """A weight or bias in the compute dtype with exactly `shape` (None in `shape`: any extent)."""
    a = as_float(x, dtype, name)
    if a.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, a.shape)):
        expected = "(" + ", ".join("any" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"{name} must have shape {expected}, got {shape_str(a.shape)}")
    return kernel_layout(a)


def _projections(p: dict, E: int, dtype) -> tuple:
    """(w_q, w_k, w_v): views into the packed in_proj_weight, or the separate weights."""
    if p.get("use_separate_proj_weight"):
        names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        for name in names:
            if p.get(name) is None:
                raise ValueError(f"use_separate_proj_weight=True requires {name}")
        return tuple(_parameter(p[name], dtype, name, (E, E if name[0] == "q" else None)) for name in names)
    if p.get("in_proj_weight") is None:
        raise ValueError("in_proj_weight is required unless use_separate_proj_weight=True")
    w_in = _parameter(p["in_proj_weight"], dtype, "in_proj_weight", (3 * E, E))
    return w_in[:E], w_in[E : 2 * E], w_in[2 * E :]


def mha_weights(p: dict, num_heads: int, E: int, dtype, result_dtype) -> "_core.MhaWeights":
    """The parameters of multi-head attention (torch's names in `p`), checked once.

    `dtype` is the compute dtype (the parameters are converted to it) and `result_dtype` the
    dtype results are returned in.
    """
    # (That num_heads divides E is the core's own rule, checked by _core.MhaWeights.)
    projections = _projections(p, E, dtype)
    in_biases = None
    if p.get("in_proj_bias") is not None:
        b_in = _parameter(p["in_proj_bias"], dtype, "in_proj_bias", (3 * E,))
        in_biases = (b_in[:E], b_in[E : 2 * E], b_in[2 * E :])
    if p.get("out_proj_weight") is None:
        raise ValueError("out_proj_weight is required")
    # As torch, the output projection may change the width: (E_out, E).
    w_out = _parameter(p["out_proj_weight"], dtype, "out_proj_weight", (None, E))
    b_out = p.get("out_proj_bias")
    b_out = None if b_out is None else _parameter(b_out, dtype, "out_proj_bias", (w_out.shape[0],))
    # (Given together, and not with static keys: rules of the core's own, checked there.)
    bias_k, bias_v = p.get("bias_k"), p.get("bias_v")
    bias_kv = None
    if bias_k is not None or bias_v is not None:
        pair = []
        for name, b in (("bias_k", bias_k), ("bias_v", bias_v)):
            if b is None:
                pair.append(None)
                continue
            b = as_float(b, dtype, name)
            if b.size != E:
                raise ValueError(f"{name} must have {E} elements (shape (1, 1, {E})), got shape {shape_str(b.shape)}")
            pair.append(kernel_layout(b.reshape(E)))
        bias_kv = tuple(pair)
    add_zero_attn = as_bool_flag(p.get("add_zero_attn", False), "add_zero_attn")
    return _core.MhaWeights(
        num_heads, projections, in_biases, (w_out, b_out), bias_kv, add_zero_attn, np.dtype(result_dtype)
    )


def _mha_ranks(query, key, value, key_padding_mask, attn_mask) -> bool:
    """torch's rules for batched (3-D) and unbatched (2-D) inputs; returns batched."""
    if query.ndim not in (2, 3):
        raise ValueError(f"query must be 2-D (unbatched) or 3-D (batched), got shape {shape_str(query.shape)}")
    batched = query.ndim == 3
    kind, rank = ("a batched (3-D)", 3) if batched else ("an unbatched (2-D)", 2)
    if key.ndim != rank or value.ndim != rank:
        raise ValueError(
            f"for {kind} query, key and value must be {rank}-D: query {shape_str(query.shape)}, "
            f"key {shape_str(key.shape)}, value {shape_str(value.shape)}"
        )
    if key_padding_mask is not None and np.ndim(key_padding_mask) != rank - 1:
        form = "2-D (N, S)" if batched else "1-D (S,)"
        raise ValueError(
            f"for {kind} query, key_padding_mask must be {form}, got shape {shape_str(np.shape(key_padding_mask))}"
        )
    if attn_mask is not None and np.ndim(attn_mask) not in (2, 3):
        heads = "N*num_heads" if batched else "num_heads"
        raise ValueError(
            f"attn_mask must be 2-D (L, S) or 3-D ({heads}, L, S), got shape {shape_str(np.shape(attn_mask))}"
        )
    return batched


def _mha_statics(static_k, static_v, dtype, N, H, head_dim, S) -> tuple:
    """static_k / static_v as (N, H, S_static, head_dim) views, and the source length S_src
    (static_k's: the core checks that the values have as many)."""
    statics = []
    for name, st in (("static_k", static_k), ("static_v", static_v)):
        if st is not None:
            st = as_float(st, dtype, name)
            if st.ndim != 3 or st.shape[0] != N * H or st.shape[2] != head_dim:
                raise ValueError(
                    f"{name} must have shape (N*num_heads, S, head_dim) = ({N * H}, S, {head_dim}), "
                    f"got {shape_str(st.shape)}"
                )
            st = kernel_layout(st.reshape(N, H, st.shape[1], head_dim))
        statics.append(st)
    return statics[0], statics[1], S if statics[0] is None else statics[0].shape[2]


def _mha_masks(attn_mask, key_padding_mask, dtype, batched, N, H, L, S_src) -> tuple:
    """The masks as additive (N, H, L, S_src) views of their own storage."""
    kpm = am = None
    if key_padding_mask is not None:
        kpm = additive_mask(key_padding_mask, dtype, "key_padding_mask", true_means_masked=True)
        if not batched:
            kpm = kpm[None]
        if kpm.shape != (N, S_src):
            raise ValueError(
                f"key_padding_mask must have shape (N, S) = {shape_str((N, S_src))}, got {shape_str(np.shape(key_padding_mask))}"
            )
        kpm = np.broadcast_to(kpm[:, None, None, :], (N, H, L, S_src))
    if attn_mask is not None:
        am = additive_mask(attn_mask, dtype, "attn_mask", true_means_masked=True)
        if am.ndim == 2:
            if am.shape != (L, S_src):
                raise ValueError(f"2-D attn_mask must have shape (L, S) = {shape_str((L, S_src))}, got {shape_str(am.shape)}")
            am = np.broadcast_to(am, (N, H, L, S_src))
        else:
            if am.shape != (N * H, L, S_src):
                raise ValueError(
                    f"3-D attn_mask must have shape (N*num_heads, L, S) = {shape_str((N * H, L, S_src))}, "
                    f"got {shape_str(am.shape)}"
                )
            am = am.reshape(N, H, L, S_src)
    return am, kpm


def mha_call(weights, query, key, value, extras, options) -> tuple:
    """The canonical call of multi-head attention's forward pass.

    ``extras`` is None or ``(attn_mask, key_padding_mask, static_k, static_v)`` as given.
    Returns ``(query, key, value, attn_mask, key_padding_mask, static_k, static_v, finish,
    key_lengths)``: (N, L, dim) operands in the weights' dtype, (N, H, L, S) additive masks and
    (N, H, S, head_dim) static keys and values or None, ``finish(out, weights)``, which gives
    the result from the core's (out, weights) (unbatched, in the result's dtype), and int64 (N)
    key lengths or None: a key padding mask that pads only the end of each batch entry's keys
    is given as their lengths (the padded keys are then never read), where the results are the
    same (no attn_mask, nothing appended to the keys, and every entry with a key; the weights
    of the padded keys are then 0, as the mask gives them).
    """
    attn_mask, key_padding_mask, static_k, static_v = (None,) * 4 if extras is None else extras
    # The masks as arrays before their ranks are read: a tensor subclass or another object whose
    # conversion is not its values raises TypeError naming the mask, not a shape error.
    if attn_mask is not None:
        attn_mask = as_array(attn_mask, "attn_mask")
    if key_padding_mask is not None:
        key_padding_mask = as_array(key_padding_mask, "key_padding_mask")
    result_and_compute_dtype(query)  # non-float queries: torch's message
    dtype = np.dtype(np.float64 if weights.dtype == np.float64 else np.float32)
    q, k, v = (as_float(x, dtype, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    batched = _mha_ranks(q, k, v, key_padding_mask, attn_mask)
    if not batched:
        q, k, v = q[None], k[None], v[None]
    elif not options.batch_first:
        q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))
    (N, L, E), S = q.shape, k.shape[1]
    if E != weights.embed_dim:
        raise ValueError(f"query has {E} features, the parameters take embed_dim = {weights.embed_dim} (query {shape_str(np.shape(query))})")
    if k.shape[0] != N or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"key and value must have the query's batch size and the same length: query {shape_str(np.shape(query))}, "
            f"key {shape_str(np.shape(key))}, value {shape_str(np.shape(value))}"
        )
    for name, x, width, weight in (("key", k, weights.kdim, "k_proj_weight"), ("value", v, weights.vdim, "v_proj_weight")):
        if x.shape[2] != width:
            raise ValueError(
                f"{name} has {x.shape[2]} features, but {weight} (or the packed in_proj_weight) takes {width}: "
                f"{name} {shape_str(x.shape)}; with a key or value width other than embed_dim, use "
                f"use_separate_proj_weight=True"
            )
    H = weights.num_heads
    static_k, static_v, S_src = _mha_statics(static_k, static_v, dtype, N, H, E // H, S)
    am, kpm = _mha_masks(attn_mask, key_padding_mask, dtype, batched, N, H, L, S_src)
    key_lengths = None
    if kpm is not None and am is None and not weights.bias_kv and not weights.add_zero_attn:
        key_lengths = _trailing_padding(key_padding_mask if batched else key_padding_mask[None])
        if key_lengths is not None:
            kpm = None
    result_dtype = weights.dtype

    def finish(out, attn_weights):
        if not batched:
            out = out[0] if options.batch_first else out[:, 0]
            attn_weights = None if attn_weights is None else attn_weights[0]
        if result_dtype != dtype:  # half-precision results: computed in float32, returned as given
            out = out.astype(result_dtype)
            attn_weights = None if attn_weights is None else attn_weights.astype(result_dtype)
        return out, attn_weights

    q, k, v = (kernel_layout(x) for x in (q, k, v))
    return q, k, v, am, kpm, static_k, static_v, finish, key_lengths


def _trailing_padding(mask) -> "np.ndarray | None":
    """Each row's count of keys before its padding, int64 (N), where a checked (N, S) key padding
    mask (bool True or float -inf: padding; float 0: a key) pads only the end of each row and
    leaves each row a key; else None."""
    if mask.dtype == np.bool_:
        padded = mask
    elif np.all((mask == 0) | (mask == -np.inf)):
        padded = mask == -np.inf
    else:
        return None
    lengths = np.count_nonzero(~padded, axis=1).astype(np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        return None
    if not np.array_equal(padded, np.arange(padded.shape[1])[None, :] >= lengths[:, None]):
        return None
    return lengths


# ---------------------------------------------------------------------------------------------
# Decoding step
# ---------------------------------------------------------------------------------------------


def check_cache(cache) -> KVCache:
    """`cache` itself, an attnx.KVCache; TypeError for anything else."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be an attnx.KVCache, got {type(cache).__name__}")
    return cache


def _step_rows(x, cache, batch_first: bool) -> tuple:
    """(rows, result shape without E_out, tokens): the new tokens as (B * T, E) rows in the
    query's own order, (t, b) or (b, t), by torch's layout rules."""
    B = cache.batch
    if x.ndim == 2:
        if B != 1:
            raise ValueError(f"an unbatched (2-D) query {shape_str(x.shape)} needs a cache of batch 1, got {cache!r}")
        T = x.shape[0]
        return kernel_layout(x), (T,), T
    if x.ndim != 3:
        raise ValueError(f"query must be 2-D (T, E) or 3-D (T, batch, E) / (batch, T, E), got shape {shape_str(x.shape)}")
    if x.shape[0 if batch_first else 1] != B:
        raise ValueError(
            f"query {shape_str(x.shape)} must have the cache's batch {B} in dim "
            f"{0 if batch_first else 1} ({'(batch, T, E)' if batch_first else '(T, batch, E)'})"
        )
    T = x.shape[1] if batch_first else x.shape[0]
    # A layout the core reads (a misaligned query is copied: ascontiguousarray would keep it).
    return kernel_layout(x.reshape(-1, x.shape[2])), x.shape[:2], T


def mha_step(weights, query, cache, lengths, batch_first: bool, precision: int = 0):
    """One decoding step of causal self-attention over `cache` (see multi_head_attention_step).

    The keys and values of the new tokens are appended and the cache's lengths grow only when
    the whole step succeeds: a failed step leaves the cache as it was.
    """
    check_cache(cache)
    dtype = np.dtype(np.float64 if weights.dtype == np.float64 else np.float32)
    rows, lead, T = _step_rows(as_float(query, dtype, "query"), cache, batch_first)
    E, H = rows.shape[1], weights.num_heads
    head_dim = E // H
    if weights.bias_kv or weights.add_zero_attn or weights.kdim != E or weights.vdim != E:
        raise ValueError("a decoding step is self-attention: no bias_k/bias_v, zero attention or kdim/vdim")
    if (cache.num_kv_heads, cache.head_dim, cache.value_dim) != (H, head_dim, head_dim):
        raise ValueError(
            f"cache must have num_kv_heads = num_heads = {H} and head_dim = value_dim = "
            f"E // num_heads = {head_dim} for a query of width {E}, got {cache!r}"
        )
    n = None if lengths is None else as_lengths(lengths, cache.batch, T, "lengths", f"T = {T}, the query's tokens per sequence")
    if rows.shape[0] == 0:
        return np.zeros(lead + (weights.out_dim,), weights.dtype)
    cache.check_room(np.full(cache.batch, T, np.int64) if n is None else n)
    options = (_STEP_OPTIONS[batch_first] if not precision
               else make_mha_options(True, True, False, False, batch_first, precision))
    out = _core.mha_step(weights, rows, cache, n, options).reshape(lead + (weights.out_dim,))
    return out if out.dtype == weights.dtype else out.astype(weights.dtype)


_STEP_OPTIONS = tuple(make_mha_options(True, True, False, False, batch_first, 0) for batch_first in (False, True))
