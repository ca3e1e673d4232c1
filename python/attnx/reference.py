"""Plain-NumPy reference implementation ("oracle") of attnx's attention functions.

This module is the executable specification of attnx's numbers. It computes exactly what
:func:`attnx.scaled_dot_product_attention` and :func:`attnx.multi_head_attention_forward`
compute, but with plain NumPy, one step at a time, written to be read rather than to be fast.
Use it to check results of the fast C++ kernels (the test suite does), or to see precisely
what a corner case is supposed to give.

The semantics are PyTorch's (``torch.nn.functional.scaled_dot_product_attention`` and
``torch.nn.functional.multi_head_attention_forward``) with attnx's documented deviations:

* A query row that may attend to no key at all (every key masked, or no keys) gets a zero
  attention row, so its output is zero (sdpa) or ``out_proj_bias`` (MHA), never NaN.
* A masked key is ignored completely: NaN or Inf in it reaches no row that may not attend to
  it. NaN or Inf in anything a row does attend to propagates to that row.
* ``is_causal=True`` in :func:`multi_head_attention_forward` works without ``attn_mask``; when
  ``attn_mask`` is given as well, the mask is used as given.
* ``is_causal`` also takes ``"top_left"`` (the same as True) and ``"bottom_right"`` (query i of
  L attends key j of S iff ``j <= i + S - L``), and sdpa takes a sliding ``window=(left,
  right)``; both are attnx additions (torch expresses them with explicit masks).
* :func:`cached_attention` is attention over per-sequence prefixes of a key/value store, as
  :func:`attnx.cached_attention` computes it over an :class:`attnx.KVCache`.
* :func:`rotary_embedding` rotates queries or keys by their positions, as
  :class:`attnx.RotaryEmbedding` does (transformers' ``apply_rotary_pos_emb``), in float64 from
  given frequencies.
* :func:`transformer_encoder_layer` and :func:`transformer_decoder_layer` are one layer of
  ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (their attention blocks
  are :func:`multi_head_attention_forward`, with its rules above), and :func:`layer_norm` is
  ``torch.nn.functional.layer_norm`` over the last dimension.
* Dropout is not supported (this is an inference library).
* ``precision="bfloat16"`` (every function but :func:`layer_norm`) rounds the operands of each
  product to bfloat16, to nearest even, as the kernels do: the scaled queries and the keys of
  the scores, the probabilities and the values, the inputs and weights of the projections and
  of the feed-forward block. The products of the rounded operands are summed in float64, the
  softmax is computed in float64, the probabilities are rounded before their product with the
  values and that product is divided by the sum of the unrounded probabilities; biases, masks,
  norms and activations are as without it. The kernels sum in float32, in their own order, and
  their online softmax rounds each block's probabilities against the running maximum, so their
  results differ from this reference by a small bound (docs/api.md, "Precision"), not bit for
  bit; without it they agree to the contract's tolerances.
* ``precision="int8"`` (:func:`cached_attention` alone: the call over an int8 cache, whose
  rows ``key`` and ``value`` hold as ``scale * q``) quantizes each query row as the cache
  quantizes its rows (``scale = max|x| / 127`` in float32, ``q = rint(x / scale)``) and each
  key and value row again (which gives back the cache's integers), multiplies the integers
  exactly, and quantizes the probabilities per block of 128 keys from key 0: with
  ``w_j = p_j * value_scale_j`` and the block's largest ``w``, ``top``, ``p8_j =
  rint(127 * w_j / top)``, and the block adds ``top / 127 * sum_j p8_j * v8_j``; the sum is
  divided by the sum of the unquantized probabilities. The kernels run the softmax online in
  float32, so a level may land one step apart where ``127 * w_j / top`` is within rounding of
  a half; they agree to the bound of docs/api.md.

Only NumPy is imported.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import numpy as np

from ._arrays import precision_code

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import ActivationFunction, CachePrecision, FloatArray, Precision

__all__ = [
    "scaled_dot_product_attention",
    "multi_head_attention_forward",
    "cached_attention",
    "varlen_attention",
    "rotary_embedding",
    "layer_norm",
    "transformer_encoder_layer",
    "transformer_decoder_layer",
]


# ---------------------------------------------------------------------------------------------
# Input conversion
# ---------------------------------------------------------------------------------------------


def _compute_dtype(query):
    """The dtype every computation runs in: the query's (float32 or float64)."""
    dtype = np.asarray(query).dtype
    if dtype.type is np.float64:  # (either byte order)
        return np.dtype(np.float64)
    if dtype.type is np.float32:
        return np.dtype(np.float32)
    # Half-precision storage (float16, ml_dtypes' bfloat16) is computed in float32.
    if dtype == np.float16 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    if np.issubdtype(dtype, np.floating):
        return np.dtype(np.float64)
    raise TypeError(f"query must be a float32 or float64 array, got dtype {dtype}")


def _as_float(array, dtype, name):
    """``array`` as an ndarray of the compute dtype; integer, bool or complex raise TypeError."""
    array = np.asarray(array)
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
        raise TypeError(f"{name} must be a floating point array, got dtype {array.dtype}")
    return array.astype(dtype, copy=False)


def _operands(query, key, value, precision, ndim, what, int8_cache=None):
    """(q, k, v, compute dtype): the operands of a call in its compute dtype, each of `ndim`
    dimensions (ValueError saying `what` otherwise); the precision checked against the dtype
    (`int8_cache`: as precision_code takes it)."""
    dtype = _compute_dtype(query)
    precision_code(precision, dtype, int8_cache=int8_cache)
    q, k, v = (_as_float(x, dtype, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    if q.ndim != ndim or k.ndim != ndim or v.ndim != ndim:
        raise ValueError(f"query, key and value must be {what}, got {q.shape}, {k.shape}, {v.shape}")
    return q, k, v, dtype


def _round_bfloat16(x):
    """``x`` rounded to the nearest bfloat16, ties to even, as a float32 array.

    The rounding of the kernels' operands (AVX512_BF16's ``vcvtneps2bf16``), in integer
    arithmetic on the float32 bits so that no bfloat16 type is needed: ``x`` is first a float32,
    then the low 16 bits of its bits are rounded away. A float32 subnormal becomes a zero of its
    sign and a NaN a quiet NaN of its sign; values beyond bfloat16's largest round to infinity.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        bits = np.array(x, dtype=np.float32, copy=True).view(np.uint32)
    exponent = bits & np.uint32(0x7F800000)
    nan = (exponent == np.uint32(0x7F800000)) & ((bits & np.uint32(0x007FFFFF)) != 0)
    # Round to nearest even: add 0x7FFF, plus 1 where the lowest kept bit is odd, then truncate.
    # (The carry of a finite value's mantissa moves into its exponent, up to infinity.)
    with np.errstate(over="ignore"):
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    rounded = np.where(nan, (bits | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), rounded)
    rounded = np.where(exponent == 0, bits & np.uint32(0x80000000), rounded)
    return rounded.astype(np.uint32).view(np.float32)


def _bfloat16_operand(x):
    """An operand of a product with precision "bfloat16": rounded, as float64 (exact)."""
    return _round_bfloat16(x).astype(np.float64)


def _quantize_rows_int8(x):
    """(integers, scales): each last-axis row of ``x`` quantized as an int8 cache row is, in
    float32: ``scale = max|x| / 127``, ``q = clip(rint(x / scale), -127, 127)``; a row of zeros
    has scale 0 and q 0, a row holding NaN or an infinity scale NaN and q 0. Both as float64
    (exact), the scales with a trailing axis of 1."""
    x32 = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        finite = np.isfinite(x32).all(axis=-1, keepdims=True)
        top = np.max(np.abs(np.where(np.isfinite(x32), x32, 0)), axis=-1, keepdims=True, initial=0)
        scale = np.where(finite, top / np.float32(127), np.float32(np.nan)).astype(np.float32)
        levels = np.where(scale > 0, np.clip(np.rint(x32 / scale), -127, 127), 0)
    return levels.astype(np.float64), scale.astype(np.float64)


# Keys per block whose probabilities precision "int8" quantizes together (the kernels' blocks).
_INT8_BLOCK = 128


def _int8_probabilities_times_values(exps, v, allowed):
    """sum_j p8_j v8_j per block of _INT8_BLOCK keys, times the block's top / 127, summed over
    the blocks (see the module's notes): exps ``(..., L, S)`` unnormalized probabilities, v
    ``(..., S, Ev)`` the values as stored, ``allowed`` the keys each row attends (a masked key's
    value, NaN or not, does not reach the row)."""
    v8, vs = _quantize_rows_int8(v)
    w = np.where(allowed, exps * np.swapaxes(vs, -1, -2), 0.0)  # (..., L, S)
    S = w.shape[-1]
    blocks = -(-S // _INT8_BLOCK)
    pad = blocks * _INT8_BLOCK - S
    w = np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)])
    v8 = np.pad(v8, [(0, 0)] * (v8.ndim - 2) + [(0, pad), (0, 0)])
    w = w.reshape(w.shape[:-1] + (blocks, _INT8_BLOCK))  # (..., L, B, 128)
    v8 = v8.reshape(v8.shape[:-2] + (blocks, _INT8_BLOCK, v8.shape[-1]))  # (..., B, 128, Ev)
    with np.errstate(invalid="ignore", divide="ignore"):
        nan = np.isnan(w).any(axis=-1, keepdims=True)
        top = np.max(np.where(np.isnan(w), 0, w), axis=-1, keepdims=True, initial=0)
        levels = np.where(top > 0, np.rint(np.clip(np.nan_to_num(w / top * 127), 0, 127)), 0)
        sums = np.einsum("...lbk,...bkd->...lbd", levels, v8)  # exact integers
        factor = np.where(nan, np.nan, top / 127)
    return (sums * factor).sum(axis=-2)


def _mask_to_bias(mask, name, dtype, true_means_masked):
    """Turn a bool or float mask into an additive bias: 0 where allowed, -inf where masked.

    Bool masks mean "may attend" in sdpa and "may NOT attend" in MHA, as in torch; float
    masks are already additive and are only converted to the compute dtype.
    """
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        masked = mask if true_means_masked else ~mask
        return np.where(masked, -np.inf, 0.0).astype(dtype)
    if np.issubdtype(mask.dtype, np.floating):
        return mask.astype(dtype, copy=False)
    raise TypeError(f"{name} must be a bool or floating point array, got dtype {mask.dtype}")


def _causal_alignment(is_causal):
    """``(causal, bottom_right)`` of an ``is_causal`` argument."""
    if isinstance(is_causal, (bool, np.bool_)):
        return bool(is_causal), False
    if isinstance(is_causal, str) and is_causal in ("top_left", "bottom_right"):
        return True, is_causal == "bottom_right"
    raise ValueError(
        f"is_causal must be False, True, 'top_left' or 'bottom_right', got {is_causal!r}"
    )


def _window_sides(window):
    """``(left, right)`` of a ``window`` argument; None means unbounded on that side."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right), got {window!r}")
    for side in window:
        if side is not None and (isinstance(side, bool) or int(side) != side or side < 0):
            raise ValueError(f"window sides must be ints >= 0 or None, got {window!r}")
    return window[0], window[1]


def _open_positions(tgt_len, src_len, causal=False, bottom_right=False, window=None):
    """Bool ``(L, S)``: True where query i may attend key j by their positions alone.

    Query i is aligned with key ``i + d``: ``d = 0`` (top-left) or ``d = S - L``
    (bottom-right). Causal: ``j <= i + d``. Window (left, right):
    ``i + d - left <= j <= i + d + right``.
    """
    left, right = _window_sides(window)
    i = np.arange(tgt_len)[:, None]
    j = np.arange(src_len)[None, :]
    d = src_len - tgt_len if bottom_right else 0
    open_ = np.ones((tgt_len, src_len), dtype=bool)
    if causal:
        open_ &= j <= i + d
    if left is not None:
        open_ &= j >= i + d - left
    if right is not None:
        open_ &= j <= i + d + right
    return open_


def _causal_bias(tgt_len, src_len, dtype, bottom_right=False, window=None, causal=True):
    """Causal (and window) mask as a bias: 0 where open, -inf where closed."""
    open_ = _open_positions(tgt_len, src_len, causal, bottom_right, window)
    return np.where(open_, 0.0, -np.inf).astype(dtype)


# ---------------------------------------------------------------------------------------------
# The attention core shared by both functions
# ---------------------------------------------------------------------------------------------


def _attention(q, k, v, bias, scale, softcap=None, stages=None, products=0):
    """softmax(scale * q @ k^T + bias) @ v, with attnx's rules for masked keys.

    q ``(..., L, E)``, k ``(..., S, E)``, v ``(..., S, Ev)``, bias broadcastable to
    ``(..., L, S)`` or None. A key is masked for a query row where its bias is -inf. With
    ``softcap``, the scores become ``softcap * tanh(scores / softcap)`` before the bias.
    Returns ``(output (..., L, Ev), weights (..., L, S))``; a dict ``stages`` receives the
    scores at each stage ("qk", "softcapped", "masked", "softmax"). ``products`` is the
    precision's code (precision_code): with 1 (bfloat16; float32 q, k, v), the products'
    operands are rounded to bfloat16, with 2 (int8) they are quantized, and the rest is float64:
    the results are float64 (see the module's notes).
    """
    # NaN/Inf in the inputs are meant to propagate; numpy's warnings about them are noise.
    with np.errstate(invalid="ignore", over="ignore"):
        return _attention_core(q, k, v, bias, scale, softcap, {} if stages is None else stages, products)


def _attention_core(q, k, v, bias, scale, softcap, stages, products):
    bfloat16, int8 = products == 1, products == 2
    if int8:
        (q8, qs), (k8, ks) = _quantize_rows_int8(q), _quantize_rows_int8(k)
        scores = (scale * qs * np.swapaxes(ks, -1, -2)) * np.matmul(q8, np.swapaxes(k8, -1, -2))
    else:
        # Scaling q first (rather than the scores) is what torch does and keeps E = 0 finite.
        q = q * q.dtype.type(scale)
        if bfloat16:
            q, k, v = _bfloat16_operand(q), _bfloat16_operand(k), _bfloat16_operand(v)
        scores = np.matmul(q, np.swapaxes(k, -1, -2))
    stages["qk"] = scores
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    stages["softcapped"] = scores
    if bias is None:
        bias = np.zeros((), dtype=scores.dtype)
    allowed = np.broadcast_to(bias != -np.inf, np.broadcast_shapes(scores.shape, bias.shape))

    # Masked keys are replaced by -inf outright, so that a NaN or +inf score of a masked key
    # (from NaN/Inf in its data) cannot leak into the row.
    logits = np.where(allowed, scores + bias, -np.inf)
    stages["masked"] = logits

    # Max-subtracted softmax over the allowed keys. A row with no allowed key (fully masked,
    # or S = 0) would give -inf - -inf = NaN; it is defined to be a zero row instead.
    any_allowed = allowed.any(axis=-1, keepdims=True)
    row_max = np.max(logits, axis=-1, keepdims=True, initial=-np.inf)
    row_max = np.where(any_allowed, row_max, 0.0)
    exps = np.where(allowed, np.exp(logits - row_max), 0.0)
    denom = np.where(any_allowed, exps.sum(axis=-1, keepdims=True), 1.0)
    weights = exps / denom
    weights = weights.astype(scores.dtype, copy=False)
    stages["softmax"] = weights

    if int8:
        return _int8_probabilities_times_values(exps, v, allowed) / denom, weights
    # With bfloat16 products, the unnormalized probabilities are rounded and their product
    # with the values is divided by the sum of the unrounded ones.
    factors, divisor = (_bfloat16_operand(exps), denom) if bfloat16 else (weights, None)
    if np.isfinite(v).all():
        output = np.matmul(factors, v)
    else:
        # 0 * inf = NaN: a plain matmul would let NaN/Inf of a masked key's value into rows
        # that ignore that key. Sum only the terms of allowed keys (memory L*S*Ev, rare path).
        terms = factors[..., :, :, None] * v[..., None, :, :]
        output = np.where(allowed[..., None], terms, 0.0).sum(axis=-2).astype(weights.dtype)
    if divisor is not None:
        output = output / divisor
    return output, weights


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------


def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    is_causal: bool | Literal["top_left", "bottom_right"] = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    return_scores: Literal["qk", "softcapped", "masked", "softmax"] | None = None,
    precision: Precision | None = None,
) -> Any:
    """Reference scaled dot-product attention, as torch's ``scaled_dot_product_attention``.

    Parameters
    ----------
    query : array_like, shape ``(..., Hq, L, E)``, ``(N, L, E)`` or ``(L, E)``
        Queries. Its dtype (float32 or float64) is the compute and result dtype.
    key : array_like, shape ``(..., Hk, S, E)``
        Keys. Leading batch dimensions broadcast against the query's.
    value : array_like, shape ``(..., Hk, S, Ev)``
        Values.
    attn_mask : array_like, optional
        Broadcastable to ``(..., Hq, L, S)``. Bool: True means the query may attend to the
        key. Float: added to the scores (-inf masks the key).
    dropout_p : float, default 0.0
        Must be 0.
    is_causal : {False, True, "top_left", "bottom_right"}, default False
        True or "top_left": query i attends key j only if ``j <= i``. "bottom_right": only
        if ``j <= i + S - L``. Combined with ``attn_mask``: both apply.
    scale : float, optional
        Multiplies ``query @ key^T``; default ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` must be a multiple of ``Hk``, and query head ``h``
        uses key/value head ``h // (Hq // Hk)``.
    window : tuple (left, right), optional, keyword-only
        Query i attends key j only if ``i + d - left <= j <= i + d + right``, with
        ``d = S - L`` for ``is_causal="bottom_right"`` and 0 otherwise; a side that is None
        is unbounded. Combined with ``is_causal`` and ``attn_mask`` (all must allow a key).
    softcap : float, optional, keyword-only
        Scores become ``softcap * tanh(scores / softcap)`` after the scale, before any mask.
    return_scores : {"qk", "softcapped", "masked", "softmax"}, optional, keyword-only
        Also return the ``(..., Hq, L, S)`` scores at that stage: ``scale * q @ k^T``, after
        the soft cap, the softmax's input (closed keys -inf) or the probabilities.
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        ``"bfloat16"``: the operands of every product rounded to bfloat16 (see the module's
        notes); float32 (or half-precision) inputs only.

    Returns
    -------
    ndarray, shape ``(..., Hq, L, Ev)``, or ``(output, scores)`` with ``return_scores``
        The attention output. A query row with no key to attend to is all zeros.

    Raises
    ------
    TypeError
        Integer, bool or complex inputs; masks that are neither bool nor float.
    ValueError
        Mismatched shapes, a non-finite ``scale`` or ``softcap`` <= 0, an unknown
        ``return_scores``, or a bad grouped-query head count.
    NotImplementedError
        ``dropout_p`` other than 0.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import reference
    >>> q = k = np.zeros((3, 2))                   # equal scores: the mean of the values
    >>> v = np.arange(6.0).reshape(3, 2)
    >>> reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    array([[0., 1.],
           [1., 2.],
           [2., 3.]])
    >>> mask = np.array([[True, False, True]] * 3)
    >>> reference.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    array([[2., 3.],
           [2., 3.],
           [2., 3.]])

    It is the oracle of :func:`attnx.scaled_dot_product_attention`:

    >>> import attnx
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 4, 8, 16))
    >>> expected = reference.scaled_dot_product_attention(q, k, v, is_causal="bottom_right")
    >>> expected.shape, expected.dtype
    ((2, 4, 8, 16), dtype('float64'))
    >>> bool(np.allclose(attnx.scaled_dot_product_attention(q, k, v, is_causal="bottom_right"), expected))
    True
    """
    products = precision_code(precision, _compute_dtype(query))
    return _scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                         enable_gqa, window, softcap, return_scores, products)


def _scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                  enable_gqa, window, softcap, return_scores, products):
    """scaled_dot_product_attention with the precision's code (precision_code) checked."""
    dtype = _compute_dtype(query)
    q = _as_float(query, dtype, "query")
    k = _as_float(key, dtype, "key")
    v = _as_float(value, dtype, "value")

    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(
            f"query, key and value must have at least 2 dimensions, got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query {q.shape} and key {k.shape} differ in the last dimension")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key {k.shape} and value {v.shape} differ in sequence length")
    causal, bottom_right = _causal_alignment(is_causal)
    if dropout_p != 0:
        raise NotImplementedError(f"dropout_p={dropout_p!r}: inference only, pass 0.0")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be finite and > 0, got {softcap!r}")
    if return_scores not in (None, "qk", "softcapped", "masked", "softmax"):
        raise ValueError(f"unknown return_scores {return_scores!r}")

    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and v.ndim >= 3:
        q_heads, kv_heads = q.shape[-3], k.shape[-3]
        if v.shape[-3] != kv_heads or kv_heads == 0 or q_heads % kv_heads != 0:
            raise ValueError(
                f"enable_gqa: query heads ({q_heads}) must be a multiple of key/value heads "
                f"(key {k.shape}, value {v.shape})"
            )
        # Head h of the query reads kv head h // group: repeat each kv head `group` times.
        group = q_heads // kv_heads
        k = np.repeat(k, group, axis=-3)
        v = np.repeat(v, group, axis=-3)

    try:
        batch_shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"batch dimensions of query {q.shape}, key {k.shape} and value {v.shape} "
            "do not broadcast"
        ) from None
    tgt_len, src_len = q.shape[-2], k.shape[-2]
    scores_shape = batch_shape + (tgt_len, src_len)

    bias = None
    if attn_mask is not None:
        bias = _mask_to_bias(attn_mask, "attn_mask", dtype, true_means_masked=False)
        try:
            np.broadcast_to(bias, scores_shape)
        except ValueError:
            raise ValueError(
                f"attn_mask of shape {bias.shape} does not broadcast to the scores' shape "
                f"{scores_shape}"
            ) from None
    if causal or window is not None:
        positions = _causal_bias(tgt_len, src_len, dtype, bottom_right, window, causal)
        # A key outside the causal/window band is closed whatever the mask holds there
        # (a NaN or +inf mask value of a closed key must not reach the row).
        bias = positions if bias is None else np.where(positions == -np.inf, positions, bias)

    if scale is None:
        head_size = q.shape[-1]
        scale = 1.0 / math.sqrt(head_size) if head_size > 0 else 1.0
    else:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")

    stages = {}
    output, _ = _attention(q, k, v, bias, scale, softcap, stages, products)
    output = output.astype(dtype, copy=False)
    if return_scores is None:
        return output
    scores = np.broadcast_to(stages[return_scores], scores_shape)
    return output, np.ascontiguousarray(scores, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# multi_head_attention_forward
# ---------------------------------------------------------------------------------------------


def _linear(x, weight, bias, bfloat16=False):
    """x @ weight^T + bias, as torch.nn.functional.linear; with ``bfloat16``, of x and weight
    rounded to bfloat16, summed in float64 and returned in x's dtype."""
    if bfloat16:
        y = np.matmul(_bfloat16_operand(x), _bfloat16_operand(weight).T)
        return (y if bias is None else y + bias).astype(x.dtype)
    y = np.matmul(x, weight.T)
    return y if bias is None else y + bias


def multi_head_attention_forward(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: npt.ArrayLike | None,
    in_proj_bias: npt.ArrayLike | None,
    bias_k: npt.ArrayLike | None,
    bias_v: npt.ArrayLike | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: npt.ArrayLike,
    out_proj_bias: npt.ArrayLike | None,
    training: bool = True,
    key_padding_mask: npt.ArrayLike | None = None,
    need_weights: bool = True,
    attn_mask: npt.ArrayLike | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: npt.ArrayLike | None = None,
    k_proj_weight: npt.ArrayLike | None = None,
    v_proj_weight: npt.ArrayLike | None = None,
    static_k: npt.ArrayLike | None = None,
    static_v: npt.ArrayLike | None = None,
    average_attn_weights: bool = True,
    is_causal: bool | Literal["top_left", "bottom_right"] = False,
    *,
    batch_first: bool = False,
    precision: Precision | None = None,
) -> tuple[FloatArray, FloatArray | None]:
    """Reference multi-head attention, as torch's ``multi_head_attention_forward``.

    Parameters
    ----------
    query : array_like, shape ``(L, N, E)``, ``(N, L, E)`` with ``batch_first``, or ``(L, E)``
        Queries; its dtype (float32 or float64) is the compute and result dtype.
    key : array_like, shape ``(S, N, Ek)`` (``(N, S, Ek)`` with ``batch_first``) or ``(S, Ek)``
        Keys. ``Ek`` may differ from ``E`` only with ``use_separate_proj_weight``.
    value : array_like, shape ``(S, N, Ev)`` (``(N, S, Ev)`` with ``batch_first``) or ``(S, Ev)``
        Values.
    embed_dim_to_check : int
        Must equal ``E``.
    num_heads : int
        Number of heads; must divide ``E``. The head size is ``E // num_heads``.
    in_proj_weight : array_like, shape ``(3E, E)``, or None
        Packed q, k, v projection weights (used unless ``use_separate_proj_weight``).
    in_proj_bias : array_like, shape ``(3E,)``, or None
        Packed q, k, v projection biases.
    bias_k, bias_v : array_like, shape ``(1, 1, E)``, or None
        Appended to the projected keys/values as one extra key position (both or neither).
    add_zero_attn : bool
        Append one all-zero key/value position after the projection (and after ``bias_k``).
    dropout_p : float
        Must be 0 unless ``training`` is False (dropout is not supported).
    out_proj_weight : array_like, shape ``(E_out, E)``
        Output projection weight.
    out_proj_bias : array_like, shape ``(E_out,)``, or None
        Output projection bias.
    training : bool, default True
        Only matters for ``dropout_p``.
    key_padding_mask : array_like, shape ``(N, S)`` (``(S,)`` unbatched), optional
        Bool: True means the key is padding and is ignored. Float: added to the scores.
    need_weights : bool, default True
        Return the attention weights as well.
    attn_mask : array_like, shape ``(L, S)`` or ``(N * num_heads, L, S)``, optional
        Bool: True means the query may NOT attend to the key. Float: added to the scores.
    use_separate_proj_weight : bool, default False
        Use ``q_proj_weight`` ``(E, E)``, ``k_proj_weight`` ``(E, Ek)`` and ``v_proj_weight``
        ``(E, Ev)`` instead of ``in_proj_weight``.
    q_proj_weight, k_proj_weight, v_proj_weight : array_like, optional
        The separate projection weights.
    static_k, static_v : array_like, shape ``(N * num_heads, S, E // num_heads)``, optional
        Already projected, head-split keys/values used instead of projecting ``key``/``value``.
    average_attn_weights : bool, default True
        Average the returned weights over the heads.
    is_causal : {False, True, "top_left", "bottom_right"}, default False
        Without ``attn_mask``: query i may attend key j only if ``j <= i`` (True or
        "top_left"), or ``j <= i + S - L`` ("bottom_right"), over the keys before the
        ``bias_k``/``add_zero_attn`` positions, which stay visible. With ``attn_mask``:
        ignored, the mask is used as given.
    batch_first : bool, keyword-only, default False
        Batched inputs and output are ``(N, L, E)`` instead of ``(L, N, E)``.
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        ``"bfloat16"``: the operands of every product rounded to bfloat16 (see the module's
        notes); float32 (or half-precision) inputs only.

    Returns
    -------
    attn_output : ndarray, shape ``(L, N, E_out)``, ``(N, L, E_out)`` or ``(L, E_out)``
        A query row with no key to attend to gets ``out_proj_bias`` (or zeros).
    attn_weights : ndarray or None
        ``(N, L, S')`` averaged over heads, or ``(N, num_heads, L, S')`` when
        ``average_attn_weights`` is False (without ``N`` when unbatched), where ``S'`` counts
        the ``bias_k`` and ``add_zero_attn`` positions. None when ``need_weights`` is False.

    Raises
    ------
    NotImplementedError
        ``dropout_p > 0`` with ``training=True``.
    TypeError
        Integer, bool or complex inputs; masks that are neither bool nor float.
    ValueError
        Shapes that do not fit together.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> from attnx import reference
    >>> mha = attnx.MultiheadAttention(16, 4, dtype=np.float64, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((5, 2, 16))       # (L, N, E)
    >>> padding = np.array([[False] * 5, [False, False, False, True, True]])
    >>> out, weights = reference.multi_head_attention_forward(
    ...     x, x, x, 16, 4, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
    ...     mha.out_proj_weight, mha.out_proj_bias, key_padding_mask=padding)
    >>> out.shape, weights.shape
    ((5, 2, 16), (2, 5, 5))
    >>> weights.sum(axis=-1).round(12)   # each query's weights sum to 1 ...
    array([[1., 1., 1., 1., 1.],
           [1., 1., 1., 1., 1.]])
    >>> weights[1, :, 3:]                # ... and the padded keys of sequence 1 get none
    array([[0., 0.],
           [0., 0.],
           [0., 0.],
           [0., 0.],
           [0., 0.]])
    >>> fast, _ = mha(x, x, x, key_padding_mask=padding)
    >>> bool(np.allclose(fast, out))
    True
    """
    if dropout_p > 0.0 and training:
        raise NotImplementedError("dropout is not supported: use dropout_p=0.0 or training=False")

    dtype = _compute_dtype(query)
    bfloat16 = precision_code(precision, dtype) == 1
    query = _as_float(query, dtype, "query")
    key = _as_float(key, dtype, "key")
    value = _as_float(value, dtype, "value")

    # --- Shapes: work on sequence-first, batched (L, N, E) arrays ------------------------
    if query.ndim not in (2, 3):
        raise ValueError(f"query must be 2-D (unbatched) or 3-D (batched), got {query.shape}")
    if key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            f"query, key and value must have the same rank, got {query.shape}, {key.shape}, "
            f"{value.shape}"
        )
    is_batched = query.ndim == 3
    if is_batched and batch_first:
        query, key, value = (np.swapaxes(x, 0, 1) for x in (query, key, value))
    if not is_batched:
        # An unbatched call is a batch of one.
        query, key, value = query[:, None, :], key[:, None, :], value[:, None, :]
        if key_padding_mask is not None:
            key_padding_mask = np.asarray(key_padding_mask)[None]

    tgt_len, batch, embed_dim = query.shape
    src_len = key.shape[0]
    if embed_dim != embed_dim_to_check:
        raise ValueError(
            f"query has embedding dimension {embed_dim}, expected embed_dim_to_check="
            f"{embed_dim_to_check}"
        )
    if num_heads <= 0 or embed_dim % num_heads != 0:
        raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
    head_dim = embed_dim // num_heads
    if key.shape[:2] != (src_len, batch) or value.shape[:2] != (src_len, batch):
        raise ValueError(
            f"key {key.shape} and value {value.shape} must share sequence length and batch "
            f"with each other and batch with query {query.shape}"
        )

    # --- In-projection -----------------------------------------------------------------
    if use_separate_proj_weight:
        if q_proj_weight is None or k_proj_weight is None or v_proj_weight is None:
            raise ValueError("use_separate_proj_weight needs q_, k_ and v_proj_weight")
        w_q = _as_float(q_proj_weight, dtype, "q_proj_weight")
        w_k = _as_float(k_proj_weight, dtype, "k_proj_weight")
        w_v = _as_float(v_proj_weight, dtype, "v_proj_weight")
    else:
        if in_proj_weight is None:
            raise ValueError("in_proj_weight is required unless use_separate_proj_weight")
        w_in = _as_float(in_proj_weight, dtype, "in_proj_weight")
        if w_in.shape != (3 * embed_dim, embed_dim):
            raise ValueError(
                f"in_proj_weight has shape {w_in.shape}, expected {(3 * embed_dim, embed_dim)}"
            )
        # Packed rows are [W_q; W_k; W_v].
        w_q, w_k, w_v = np.split(w_in, 3, axis=0)
    for name, w, x in (("q", w_q, query), ("k", w_k, key), ("v", w_v, value)):
        if w.shape != (embed_dim, x.shape[-1]):
            raise ValueError(
                f"{name} projection weight has shape {w.shape}, expected "
                f"{(embed_dim, x.shape[-1])}"
            )
    if in_proj_bias is None:
        b_q = b_k = b_v = None
    else:
        b_in = _as_float(in_proj_bias, dtype, "in_proj_bias")
        if b_in.shape != (3 * embed_dim,):
            raise ValueError(f"in_proj_bias has shape {b_in.shape}, expected {(3 * embed_dim,)}")
        b_q, b_k, b_v = np.split(b_in, 3)

    q = _linear(query, w_q, b_q, bfloat16)  # (L, N, E)
    k = _linear(key, w_k, b_k, bfloat16)  # (S, N, E)
    v = _linear(value, w_v, b_v, bfloat16)  # (S, N, E)

    # --- Extra key positions from bias_k/bias_v -----------------------------------------
    num_appended = 0  # key positions added after the real keys; masks never mask them
    if (bias_k is None) != (bias_v is None):
        raise ValueError("bias_k and bias_v must be given together")
    if bias_k is not None:
        if static_k is not None or static_v is not None:
            raise ValueError("bias_k/bias_v cannot be combined with static_k/static_v")
        row_k = _as_float(bias_k, dtype, "bias_k").reshape(1, 1, embed_dim)
        row_v = _as_float(bias_v, dtype, "bias_v").reshape(1, 1, embed_dim)
        k = np.concatenate([k, np.broadcast_to(row_k, (1, batch, embed_dim))], axis=0)
        v = np.concatenate([v, np.broadcast_to(row_v, (1, batch, embed_dim))], axis=0)
        num_appended += 1

    # --- Split heads: (L, N, E) -> (N * H, L, head_dim), index n * H + h ------------------
    def split_heads(x):
        return x.reshape(x.shape[0], batch * num_heads, head_dim).transpose(1, 0, 2)

    q = split_heads(q)
    k = split_heads(k)
    v = split_heads(v)
    for name, static in (("static_k", static_k), ("static_v", static_v)):
        if static is None:
            continue
        static = _as_float(static, dtype, name)
        if static.ndim != 3 or static.shape[0] != batch * num_heads or static.shape[2] != head_dim:
            raise ValueError(
                f"{name} has shape {static.shape}, expected (N*num_heads={batch * num_heads}, "
                f"S, head_dim={head_dim})"
            )
        if name == "static_k":
            k = static
        else:
            v = static
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"keys ({k.shape[1]}) and values ({v.shape[1]}) differ in length")
    base_src_len = k.shape[1] - num_appended  # the keys the masks describe

    if add_zero_attn:
        zeros = np.zeros((batch * num_heads, 1, head_dim), dtype=dtype)
        k = np.concatenate([k, zeros], axis=1)
        v = np.concatenate([v, zeros], axis=1)
        num_appended += 1
    total_src_len = k.shape[1]

    # --- Masks -> one additive bias, broadcastable to (N * H, L, S') ----------------------
    bias = np.zeros((1, tgt_len, base_src_len), dtype=dtype)
    if attn_mask is not None:
        mask_bias = _mask_to_bias(attn_mask, "attn_mask", dtype, true_means_masked=True)
        allowed_shapes = ((tgt_len, base_src_len), (batch * num_heads, tgt_len, base_src_len))
        if mask_bias.shape not in allowed_shapes:
            raise ValueError(
                f"attn_mask has shape {mask_bias.shape}, expected one of {allowed_shapes}"
            )
        bias = bias + mask_bias
    elif _causal_alignment(is_causal)[0]:
        bottom_right = _causal_alignment(is_causal)[1]
        bias = bias + _causal_bias(tgt_len, base_src_len, dtype, bottom_right)
    if key_padding_mask is not None:
        pad_bias = _mask_to_bias(
            key_padding_mask, "key_padding_mask", dtype, true_means_masked=True
        )
        if pad_bias.shape != (batch, base_src_len):
            raise ValueError(
                f"key_padding_mask has shape {pad_bias.shape}, expected {(batch, base_src_len)}"
            )
        # Batch n's padding applies to its heads n * H ... n * H + H - 1.
        bias = bias + np.repeat(pad_bias, num_heads, axis=0)[:, None, :]
    # The appended bias_k / zero positions are never masked (torch pads masks with zeros).
    bias = np.concatenate(
        [bias, np.zeros(bias.shape[:2] + (num_appended,), dtype=dtype)], axis=-1
    )

    # --- Attention and out-projection ---------------------------------------------------
    scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    heads_out, weights = _attention(q, k, v, bias, scale, products=int(bfloat16))  # (N*H, L, hd), (N*H, L, S')
    heads_out = heads_out.astype(dtype, copy=False)

    # Merge heads back: (N * H, L, hd) -> (L, N, H * hd).
    merged = heads_out.reshape(batch, num_heads, tgt_len, head_dim).transpose(2, 0, 1, 3)
    merged = merged.reshape(tgt_len, batch, embed_dim)
    w_out = _as_float(out_proj_weight, dtype, "out_proj_weight")
    if w_out.ndim != 2 or w_out.shape[1] != embed_dim:
        raise ValueError(f"out_proj_weight has shape {w_out.shape}, expected (E_out, {embed_dim})")
    b_out = None if out_proj_bias is None else _as_float(out_proj_bias, dtype, "out_proj_bias")
    attn_output = _linear(merged, w_out, b_out, bfloat16)  # (L, N, E_out)

    weights = weights.reshape(batch, num_heads, tgt_len, total_src_len)
    if average_attn_weights:
        weights = weights.mean(axis=1)

    if not is_batched:
        attn_output = attn_output[:, 0]
        weights = weights[0]
    elif batch_first:
        attn_output = np.swapaxes(attn_output, 0, 1)
    attn_output = np.ascontiguousarray(attn_output, dtype=dtype)
    if not need_weights:
        return attn_output, None
    return attn_output, np.ascontiguousarray(weights, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# cached_attention
# ---------------------------------------------------------------------------------------------


def cached_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    key_lengths: npt.ArrayLike,
    query_lengths: npt.ArrayLike | None = None,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    *,
    precision: CachePrecision | None = None,
) -> FloatArray:
    """Reference attention of each sequence's newest tokens over its cached keys.

    Sequence ``b`` holds ``key_lengths[b]`` keys and values (the first positions of ``key``
    and ``value``; the rest is never read) and has ``query_lengths[b]`` valid query tokens
    (the first ones of ``query``), which are its newest tokens: this is
    :func:`scaled_dot_product_attention` of those queries over those keys with
    ``is_causal="bottom_right"``, one sequence at a time. Query rows past
    ``query_lengths[b]`` are zeros.

    Parameters
    ----------
    query : array_like, shape ``(B, Hq, T, E)``
        Queries; ``Hq`` a multiple of ``Hk`` (grouped-query attention).
    key : array_like, shape ``(B, Hk, S, E)``
        Key storage (``S`` at least every ``key_lengths[b]``).
    value : array_like, shape ``(B, Hk, S, Ev)``
        Value storage.
    key_lengths : array_like of int, shape ``(B,)``
        Keys held per sequence, in ``[0, S]``.
    query_lengths : array_like of int, shape ``(B,)``, optional
        Valid query tokens per sequence, in ``[0, T]``; default ``T``.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    window : tuple (left, right), optional
        As in :func:`scaled_dot_product_attention` (bottom-right aligned).
    softcap : float, optional
        As in :func:`scaled_dot_product_attention`.
    precision : {None, "float32", "bfloat16", "int8"}, optional, keyword-only
        ``"bfloat16"``: the operands of every product rounded to bfloat16; ``"int8"``: the
        integer products of an int8 cache, whose rows ``key`` and ``value`` hold (see the
        module's notes); float32 (or half-precision) inputs only.

    Returns
    -------
    ndarray, shape ``(B, Hq, T, Ev)``
        In the compute dtype of ``query``.

    Raises
    ------
    ValueError
        Shapes that do not fit, or lengths out of range.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import reference
    >>> rng = np.random.default_rng(0)
    >>> key, value = rng.standard_normal((2, 2, 1, 6, 4))      # 2 sequences, room for 6 tokens
    >>> query = rng.standard_normal((2, 1, 2, 4))              # their 2 newest tokens
    >>> out = reference.cached_attention(query, key, value, key_lengths=[5, 3], query_lengths=[2, 1])
    >>> out.shape
    (2, 1, 2, 4)
    >>> out[1, 0, 1]                     # sequence 1 has 1 new token: the second row is zeros
    array([0., 0., 0., 0.])
    >>> full = reference.scaled_dot_product_attention(query[:1], key[:1, :, :5], value[:1, :, :5],
    ...                                                is_causal="bottom_right")
    >>> bool(np.allclose(out[:1], full))     # sequence 0: its 2 newest of 5 tokens
    True
    """
    q, k, v, dtype = _operands(query, key, value, precision, 4, "4-D", int8_cache=True)
    products = precision_code(precision, dtype, int8_cache=True)
    batch, _, tgt_len, _ = q.shape
    src_len = k.shape[2]
    key_lengths = np.asarray(key_lengths)
    query_lengths = (
        np.full(batch, tgt_len) if query_lengths is None else np.asarray(query_lengths)
    )
    if key_lengths.shape != (batch,) or query_lengths.shape != (batch,):
        raise ValueError(f"key_lengths and query_lengths must have shape ({batch},)")
    if np.any(key_lengths < 0) or np.any(key_lengths > src_len):
        raise ValueError(f"key_lengths must be in [0, {src_len}], got {key_lengths}")
    if np.any(query_lengths < 0) or np.any(query_lengths > tgt_len):
        raise ValueError(f"query_lengths must be in [0, {tgt_len}], got {query_lengths}")

    output = np.zeros(q.shape[:3] + v.shape[3:], dtype=dtype)
    for b in range(batch):
        n, m = int(query_lengths[b]), int(key_lengths[b])
        output[b, :, :n] = _scaled_dot_product_attention(
            q[b, :, :n], k[b, :, :m], v[b, :, :m], None, 0.0, "bottom_right", scale, True, window,
            softcap, None, products,
        )
    return output


# ---------------------------------------------------------------------------------------------
# Transformer layers
# ---------------------------------------------------------------------------------------------



def varlen_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike | None = None,
    *,
    is_causal: bool | Literal["top_left", "bottom_right"] = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    precision: Precision | None = None,
) -> Any:
    """Reference attention of packed sequences: :func:`scaled_dot_product_attention` on each.

    Parameters
    ----------
    query : array_like, shape ``(total_q, Hq, E)``
        Sequence ``b``'s queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
    key : array_like, shape ``(total_k, Hk, E)``
        ``Hq`` a multiple of ``Hk`` (grouped-query attention).
    value : array_like, shape ``(total_k, Hk, Ev)``
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape ``(batch + 1,)``
        Cumulative lengths from 0 to the row count; ``cu_seqlens_k`` defaults to ``cu_seqlens_q``.
    is_causal, scale, window, softcap, precision
        As in :func:`scaled_dot_product_attention`, applied to each sequence.

    Returns
    -------
    ndarray, shape ``(total_q, Hq, Ev)``
        In the compute dtype of ``query``; a sequence without keys gives zeros.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import reference
    >>> q = k = v = np.arange(24.0).reshape(6, 1, 4) / 24   # sequences of 2 and 4 tokens
    >>> out = reference.varlen_attention(q, k, v, [0, 2, 6], is_causal=True)
    >>> bool(np.allclose(out[:2, 0], reference.scaled_dot_product_attention(q[:2, 0], k[:2, 0], v[:2, 0],
    ...                                                                      is_causal=True)))
    True
    """
    q, k, v, dtype = _operands(query, key, value, precision, 3, "3-D (total, H, E)")
    cu_q = np.asarray(cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else np.asarray(cu_seqlens_k)
    if cu_q.shape != cu_k.shape or cu_q.ndim != 1 or cu_q[0] != 0 or cu_k[0] != 0:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be (batch + 1,) offsets from 0")
    if cu_q[-1] != q.shape[0] or cu_k[-1] != k.shape[0] or np.any(np.diff(cu_q) < 0) or np.any(np.diff(cu_k) < 0):
        raise ValueError("cu_seqlens must not decrease and must end at the row counts")
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype)
    for b in range(cu_q.size - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            continue
        heads = scaled_dot_product_attention(
            q[rows].transpose(1, 0, 2), k[keys].transpose(1, 0, 2), v[keys].transpose(1, 0, 2),
            is_causal=is_causal, scale=scale, enable_gqa=True, window=window, softcap=softcap,
            precision=precision)
        out[rows] = heads.transpose(1, 0, 2)
    return out


def rotary_embedding(
    x: npt.ArrayLike,
    positions: npt.ArrayLike,
    inv_freq: npt.ArrayLike,
    rotary_dim: int,
    interleaved: bool = False,
    attention_scaling: float = 1.0,
) -> Any:
    """Reference rotary position embedding: each pair of dimensions turned by its angle, in float64.

    Pair ``i`` of a row at position ``p`` turns by ``p * inv_freq[i]``: ``(a, b)`` becomes
    ``(a cos - b sin, b cos + a sin)``, with cos and sin times ``attention_scaling``. Pair ``i``
    is dimensions ``(i, i + rotary_dim / 2)``, or ``(2i, 2i + 1)`` when ``interleaved``;
    dimensions from ``rotary_dim`` on are copied unchanged.

    Parameters
    ----------
    x : array_like, shape ``(total, H, D)``
    positions : array_like of int, shape ``(total,)``
    inv_freq : array_like, shape ``(rotary_dim // 2,)``
        The frequencies, e.g. :attr:`attnx.RotaryEmbedding.inv_freq`.
    rotary_dim : int
        Even, at most ``D``.
    interleaved : bool, default False
    attention_scaling : float, default 1.0

    Returns
    -------
    ndarray, shape ``(total, H, D)``, float64

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import reference
    >>> x = np.array([[[1.0, 0.0, 2.0, 0.0]]])
    >>> out = reference.rotary_embedding(x, [2], inv_freq=[np.pi / 4], rotary_dim=2)
    >>> np.round(out, 6).tolist()      # dims 0 and 1 turn by pi / 2; dims 2 and 3 pass
    [[[0.0, 1.0, 2.0, 0.0]]]
    """
    x = np.array(x, dtype=np.float64)
    positions = np.asarray(positions)
    freq = np.asarray(inv_freq, dtype=np.float64)
    if x.ndim != 3 or positions.shape != (x.shape[0],):
        raise ValueError("x must be (total, H, D) and positions (total,)")
    if rotary_dim % 2 or not 0 < rotary_dim <= x.shape[2] or freq.shape != (rotary_dim // 2,):
        raise ValueError("rotary_dim must be even, in (0, D], with rotary_dim // 2 frequencies")
    half = rotary_dim // 2
    if interleaved:
        first, second = np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    else:
        first, second = np.arange(half), np.arange(half, rotary_dim)
    out = x.copy()
    for row in range(x.shape[0]):
        angles = float(positions[row]) * freq
        cos, sin = np.cos(angles) * attention_scaling, np.sin(angles) * attention_scaling
        a, b = x[row][:, first], x[row][:, second]
        out[row][:, first] = a * cos - b * sin
        out[row][:, second] = b * cos + a * sin
    return out


def layer_norm(
    x: npt.ArrayLike,
    weight: npt.ArrayLike | None,
    bias: npt.ArrayLike | None,
    eps: float,
) -> FloatArray:
    """Reference layer normalization over the last dimension, as ``torch.nn.functional.layer_norm``.

    ``(x - mean) / sqrt(var + eps) * weight + bias``, with the mean and the biased variance
    (divided by the width, not the width - 1) of each row of the last dimension.

    Parameters
    ----------
    x : array_like, shape ``(..., E)``
        Its dtype (float32 or float64) is the compute and result dtype.
    weight : array_like, shape ``(E,)``, or None
        Scales the normalized rows (None: no scaling).
    bias : array_like, shape ``(E,)``, or None
        Added after the scaling (None: nothing added).
    eps : float
        Added to the variance.

    Returns
    -------
    ndarray, shape ``(..., E)``

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import reference
    >>> reference.layer_norm(np.array([[1.0, 3.0], [2.0, 2.0]]), None, None, 1e-5).round(4)
    array([[-1.,  1.],
           [ 0.,  0.]])
    >>> reference.layer_norm(np.array([1.0, 3.0]), np.array([2.0, 1.0]), np.array([0.0, 10.0]), 0.0)
    array([-2., 11.])
    """
    dtype = _compute_dtype(x)
    x = _as_float(x, dtype, "x")
    width = x.shape[-1] if x.ndim else 0
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and np.shape(p) != (width,):
            raise ValueError(f"{name} has shape {np.shape(p)}, expected ({width},) for x of shape {x.shape}")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mean = x.mean(axis=-1, keepdims=True)
        centered = x - mean
        variance = (centered * centered).mean(axis=-1, keepdims=True)
        y = centered / np.sqrt(variance + dtype.type(eps))
    if weight is not None:
        y = y * _as_float(weight, dtype, "weight")
    if bias is not None:
        y = y + _as_float(bias, dtype, "bias")
    return y.astype(dtype, copy=False)


# math.erf element by element: NumPy has no erf, and the reference needs the exact GELU.
_erf = np.frompyfunc(math.erf, 1, 1)


def _activate(x, activation):
    """The feed-forward activation: "relu", the exact (erf) "gelu", or a callable on arrays."""
    if isinstance(activation, str):
        if activation == "relu":
            return np.maximum(x, x.dtype.type(0))
        if activation == "gelu":
            # torch's approximate="none": x * Phi(x), Phi the standard normal CDF.
            erf = _erf(x.astype(np.float64) / math.sqrt(2.0)).astype(np.float64)
            return (0.5 * x.astype(np.float64) * (1.0 + erf)).astype(x.dtype)
        raise ValueError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
    if not callable(activation):
        raise TypeError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
    y = np.asarray(activation(x))
    if y.shape != x.shape:
        raise ValueError(f"activation returned shape {y.shape} for an input of shape {x.shape}")
    return _as_float(y, x.dtype, "activation's result")


def _norm_eps(layer_norm_eps, count):
    """One eps per LayerNorm of the layer (norm1, norm2[, norm3]): a float is every norm's."""
    if isinstance(layer_norm_eps, (int, float, np.integer, np.floating)):
        return (float(layer_norm_eps),) * count
    eps = tuple(float(e) for e in layer_norm_eps)
    if len(eps) != count:
        raise ValueError(f"layer_norm_eps must be a float or {count} floats (one per norm), got {layer_norm_eps!r}")
    return eps


def _get(params, key, dtype, required=True):
    """``params[key]`` in the compute dtype; None for an absent optional entry (a bias)."""
    value = params.get(key)
    if value is None:
        if required:
            raise ValueError(f"params has no {key!r} (torch's state_dict keys of the layer are expected)")
        return None
    return _as_float(value, dtype, key)


def _norm(x, params, name, eps):
    dtype = x.dtype
    return layer_norm(x, _get(params, f"{name}.weight", dtype, False), _get(params, f"{name}.bias", dtype, False), eps)


def _attention_block(query, memory, params, prefix, nhead, attn_mask, key_padding_mask, is_causal, batch_first,
                     precision):
    """``params``' multi-head attention ``prefix`` from ``query`` to ``memory``: its output only."""
    dtype = query.dtype
    out, _ = multi_head_attention_forward(
        query, memory, memory, query.shape[-1], nhead,
        _get(params, prefix + "in_proj_weight", dtype), _get(params, prefix + "in_proj_bias", dtype, False),
        None, None, False, 0.0,
        _get(params, prefix + "out_proj.weight", dtype), _get(params, prefix + "out_proj.bias", dtype, False),
        training=False, key_padding_mask=key_padding_mask, need_weights=False, attn_mask=attn_mask,
        is_causal=bool(is_causal), batch_first=batch_first, precision=precision,
    )
    return out


def _feed_forward(x, params, activation, bfloat16):
    """linear2(activation(linear1(x)))."""
    dtype = x.dtype
    hidden = _linear(x, _get(params, "linear1.weight", dtype), _get(params, "linear1.bias", dtype, False), bfloat16)
    return _linear(_activate(hidden, activation), _get(params, "linear2.weight", dtype),
                   _get(params, "linear2.bias", dtype, False), bfloat16)


def transformer_encoder_layer(
    src: npt.ArrayLike,
    params: Mapping[str, npt.ArrayLike],
    nhead: int,
    *,
    src_mask: npt.ArrayLike | None = None,
    src_key_padding_mask: npt.ArrayLike | None = None,
    is_causal: bool = False,
    activation: str | ActivationFunction = "relu",
    layer_norm_eps: float | Sequence[float] = 1e-5,
    norm_first: bool = False,
    batch_first: bool = False,
    precision: Precision | None = None,
) -> FloatArray:
    """Reference ``torch.nn.TransformerEncoderLayer`` forward pass (inference: no dropout).

    Post-norm (the default)::

        x = norm1(x + self_attn(x))
        x = norm2(x + linear2(activation(linear1(x))))

    and with ``norm_first``::

        x = x + self_attn(norm1(x))
        x = x + linear2(activation(linear1(norm2(x))))

    where ``self_attn(y)`` is :func:`multi_head_attention_forward` of ``y`` to itself with
    the masks.

    Parameters
    ----------
    src : array_like, shape ``(L, N, E)``, ``(N, L, E)`` with ``batch_first``, or ``(L, E)``
        Its dtype (float32 or float64) is the compute and result dtype.
    params : mapping of str to array_like
        The layer's parameters under torch's state_dict keys: ``self_attn.in_proj_weight``,
        ``self_attn.in_proj_bias``, ``self_attn.out_proj.weight``,
        ``self_attn.out_proj.bias``, ``linear1.weight``, ``linear1.bias``,
        ``linear2.weight``, ``linear2.bias``, ``norm1.weight``, ``norm1.bias``,
        ``norm2.weight``, ``norm2.bias``. Absent biases (torch's ``bias=False``) are
        left out.
    nhead : int
        Number of attention heads.
    src_mask : array_like, shape ``(L, L)`` or ``(N * nhead, L, L)``, optional, keyword-only
        Bool: True means *not* allowed to attend; float: added to the scores.
    src_key_padding_mask : array_like, shape ``(N, L)`` (``(L,)`` unbatched), optional, keyword-only
        Bool: True means the key is padding; float: added to the scores.
    is_causal : bool, default False, keyword-only
        Without ``src_mask``: the top-left causal mask. With it: ignored (a hint).
    activation : {"relu", "gelu"} or callable, default "relu", keyword-only
        The feed-forward activation: ReLU, the exact (erf) GELU, or a callable on arrays.
    layer_norm_eps : float or sequence of 2 floats, default 1e-5, keyword-only
        The eps of ``norm1`` and ``norm2`` (one float: both).
    norm_first : bool, default False, keyword-only
        Pre-norm instead of post-norm.
    batch_first : bool, default False, keyword-only
        Batched input and output are ``(N, L, E)`` instead of ``(L, N, E)``.
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        ``"bfloat16"``: the operands of every product rounded to bfloat16 (see the module's
        notes); float32 (or half-precision) inputs only.

    Returns
    -------
    ndarray, same shape as ``src``

    Examples
    --------
    >>> import numpy as np, attnx
    >>> from attnx import reference
    >>> layer = attnx.TransformerEncoderLayer(16, 4, 32, 0.0, dtype=np.float64, seed=0)
    >>> src = np.random.default_rng(0).standard_normal((5, 2, 16))      # (L, N, E)
    >>> out = reference.transformer_encoder_layer(src, layer.state_dict(), 4, is_causal=True)
    >>> out.shape
    (5, 2, 16)
    >>> bool(np.allclose(layer(src, is_causal=True), out))
    True
    """
    dtype = _compute_dtype(src)
    bfloat16 = precision_code(precision, dtype) == 1
    x = _as_float(src, dtype, "src")
    eps1, eps2 = _norm_eps(layer_norm_eps, 2)

    def self_attention(y):
        return _attention_block(y, y, params, "self_attn.", nhead, src_mask, src_key_padding_mask, is_causal,
                                batch_first, precision)

    if norm_first:
        x = x + self_attention(_norm(x, params, "norm1", eps1))
        x = x + _feed_forward(_norm(x, params, "norm2", eps2), params, activation, bfloat16)
    else:
        x = _norm(x + self_attention(x), params, "norm1", eps1)
        x = _norm(x + _feed_forward(x, params, activation, bfloat16), params, "norm2", eps2)
    return x


def transformer_decoder_layer(
    tgt: npt.ArrayLike,
    memory: npt.ArrayLike,
    params: Mapping[str, npt.ArrayLike],
    nhead: int,
    *,
    tgt_mask: npt.ArrayLike | None = None,
    memory_mask: npt.ArrayLike | None = None,
    tgt_key_padding_mask: npt.ArrayLike | None = None,
    memory_key_padding_mask: npt.ArrayLike | None = None,
    tgt_is_causal: bool = False,
    memory_is_causal: bool = False,
    activation: str | ActivationFunction = "relu",
    layer_norm_eps: float | Sequence[float] = 1e-5,
    norm_first: bool = False,
    batch_first: bool = False,
    precision: Precision | None = None,
) -> FloatArray:
    """Reference ``torch.nn.TransformerDecoderLayer`` forward pass (inference: no dropout).

    Post-norm (the default)::

        x = norm1(x + self_attn(x))
        x = norm2(x + multihead_attn(x, memory))
        x = norm3(x + linear2(activation(linear1(x))))

    and with ``norm_first``::

        x = x + self_attn(norm1(x))
        x = x + multihead_attn(norm2(x), memory)
        x = x + linear2(activation(linear1(norm3(x))))

    Parameters
    ----------
    tgt : array_like, shape ``(T, N, E)``, ``(N, T, E)`` with ``batch_first``, or ``(T, E)``
        Its dtype (float32 or float64) is the compute and result dtype.
    memory : array_like, shape ``(S, N, E)``, ``(N, S, E)`` with ``batch_first``, or ``(S, E)``
        The encoder's output, attended by ``multihead_attn``.
    params : mapping of str to array_like
        The layer's parameters under torch's state_dict keys: those of
        :func:`transformer_encoder_layer`, ``multihead_attn.in_proj_weight``,
        ``multihead_attn.in_proj_bias``, ``multihead_attn.out_proj.weight``,
        ``multihead_attn.out_proj.bias``, ``norm3.weight`` and ``norm3.bias``.
    nhead : int
        Number of attention heads (of both attentions).
    tgt_mask : array_like, shape ``(T, T)`` or ``(N * nhead, T, T)``, optional, keyword-only
        The self-attention's mask. Bool: True means *not* allowed; float: added.
    memory_mask : array_like, shape ``(T, S)`` or ``(N * nhead, T, S)``, optional, keyword-only
        The cross-attention's mask.
    tgt_key_padding_mask : array_like, shape ``(N, T)`` (``(T,)`` unbatched), optional, keyword-only
        Padding of ``tgt``'s positions as keys of the self-attention.
    memory_key_padding_mask : array_like, shape ``(N, S)`` (``(S,)`` unbatched), optional, keyword-only
        Padding of ``memory``'s positions.
    tgt_is_causal : bool, default False, keyword-only
        Without ``tgt_mask``: the top-left causal self-attention mask; with it: a hint.
    memory_is_causal : bool, default False, keyword-only
        Without ``memory_mask``: the top-left causal mask on the cross-attention's ``(T, S)``
        scores; with it: a hint.
    activation : {"relu", "gelu"} or callable, default "relu", keyword-only
        As in :func:`transformer_encoder_layer`.
    layer_norm_eps : float or sequence of 3 floats, default 1e-5, keyword-only
        The eps of ``norm1``, ``norm2`` and ``norm3`` (one float: all three).
    norm_first : bool, default False, keyword-only
        Pre-norm instead of post-norm.
    batch_first : bool, default False, keyword-only
        Batched inputs and output are ``(N, T, E)`` instead of ``(T, N, E)``.
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        ``"bfloat16"``: the operands of every product rounded to bfloat16 (see the module's
        notes); float32 (or half-precision) inputs only.

    Returns
    -------
    ndarray, same shape as ``tgt``

    Examples
    --------
    >>> import numpy as np, attnx
    >>> from attnx import reference
    >>> layer = attnx.TransformerDecoderLayer(16, 4, 32, 0.0, batch_first=True, dtype=np.float64, seed=0)
    >>> rng = np.random.default_rng(0)
    >>> tgt, memory = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 7, 16))
    >>> out = reference.transformer_decoder_layer(tgt, memory, layer.state_dict(), 4, tgt_is_causal=True,
    ...                                           batch_first=True)
    >>> out.shape
    (2, 3, 16)
    >>> bool(np.allclose(layer(tgt, memory, tgt_is_causal=True), out))
    True
    """
    dtype = _compute_dtype(tgt)
    bfloat16 = precision_code(precision, dtype) == 1
    x = _as_float(tgt, dtype, "tgt")
    mem = _as_float(memory, dtype, "memory")
    eps1, eps2, eps3 = _norm_eps(layer_norm_eps, 3)

    def self_attention(y):
        return _attention_block(y, y, params, "self_attn.", nhead, tgt_mask, tgt_key_padding_mask, tgt_is_causal,
                                batch_first, precision)

    def cross_attention(y):
        return _attention_block(y, mem, params, "multihead_attn.", nhead, memory_mask, memory_key_padding_mask,
                                memory_is_causal, batch_first, precision)

    if norm_first:
        x = x + self_attention(_norm(x, params, "norm1", eps1))
        x = x + cross_attention(_norm(x, params, "norm2", eps2))
        x = x + _feed_forward(_norm(x, params, "norm3", eps3), params, activation, bfloat16)
    else:
        x = _norm(x + self_attention(x), params, "norm1", eps1)
        x = _norm(x + cross_attention(x), params, "norm2", eps2)
        x = _norm(x + _feed_forward(x, params, activation, bfloat16), params, "norm3", eps3)
    return x
