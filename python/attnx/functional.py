"""The functional API: torch.nn.functional's attention, for NumPy arrays.

This module owns PyTorch's semantics: argument checking, shape rules,
broadcasting and mask conventions. It hands the C++ core canonical strided
views -- (B, H, L, E) for sdpa, (N, L, E) for multi-head attention -- and the
core does all the arithmetic with the GIL released.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

# Calls into _core pass every argument by position. Given any keyword, pybind11 looks each
# parameter's name up among the keywords, making and interning a string a parameter, and the
# interpreter's table of interned strings then grows at unpredictable calls.
from . import _core
from ._canonical import (
    DEFAULT_SDPA_OPTIONS,
    as_softcap,
    check_cache,
    check_dropout,
    make_sdpa_options,
    mha_options,
    mha_step,
    mha_weights,
    sdpa_options,
)
from ._arrays import (
    as_array,
    as_bool_flag,
    as_lengths,
    as_finite_scale,
    as_float,
    as_positive_int,
    causal_bias,
    check_out,
    kernel_layout,
    precision_code,
    result_and_compute_dtype,
    shape_str,
    window_bounds,
)
from .cache import KVCache

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import CachePrecision, FloatArray, IntArray, Precision
    from .rotary import RotaryEmbedding

__all__ = [
    "scaled_dot_product_attention",
    "multi_head_attention_forward",
    "cached_attention",
    "multi_head_attention_step",
]


@overload
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
    return_scores: None = None,
    precision: Precision | None = None,
    out: FloatArray | None = None,
) -> FloatArray: ...


@overload
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
    return_scores: Literal["qk", "softcapped", "masked", "softmax"],
    precision: Precision | None = None,
    out: FloatArray | None = None,
) -> tuple[FloatArray, FloatArray]: ...


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
    out: FloatArray | None = None,
) -> FloatArray | tuple[FloatArray, FloatArray]:
    """Scaled dot-product attention, as ``torch.nn.functional.scaled_dot_product_attention``.

    Computes ``softmax(query @ key^T * scale + mask) @ value`` without storing
    the ``L x S`` score matrix. The positional order is torch's, so
    ``sdpa(q, k, v, mask, 0.0, True)`` means what it means in torch.

    Parameters
    ----------
    query : array_like, shape (..., Hq, L, E)
        float32 or float64: its dtype is the compute dtype; float16 or
        bfloat16 (from ml_dtypes) are computed in float32 and the result has
        the query's dtype. Also ``(L, E)`` or ``(N, L, E)``.
    key : array_like, shape (..., Hk, S, E)
    value : array_like, shape (..., Hk, S, Ev)
        Leading batch dims of query, key and value broadcast against each
        other. Other float dtypes are converted to the compute dtype, except
        that float16/bfloat16 keys and values of a float32 computation are read
        in place (never copied) and widened to float32 in the kernels.
    attn_mask : array_like, optional
        Broadcastable to ``(..., Hq, L, S)``. bool: True means the query may
        attend the key. float: added to the scores. A torch ``CausalBias``
        (``causal_upper_left`` / ``causal_lower_right``) means
        ``is_causal=True`` / ``"bottom_right"``.
    dropout_p : float, default 0.0
        Must be 0: attnx computes inference (NotImplementedError otherwise).
    is_causal : {False, True, "top_left", "bottom_right"}, default False
        True or ``"top_left"``: query ``i`` attends key ``j`` iff ``j <= i``
        (as torch). ``"bottom_right"``: iff ``j <= i + S - L``, so that the
        last query row sees every key (queries are the newest ``L`` of ``S``
        positions). With ``attn_mask``, both apply: a key must be allowed by
        each (as torch's CPU sdpa and ONNX's Attention).
    scale : float, optional
        Defaults to ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` must be a multiple of ``Hk``, and
        query head ``h`` uses key/value head ``h // (Hq // Hk)``.
    window : tuple (left, right), optional, keyword-only
        Sliding window: query ``i`` attends only keys ``j`` with
        ``i + d - left <= j <= i + d + right``, where ``d = S - L`` with
        ``is_causal="bottom_right"`` and 0 otherwise. Each side is an int
        ``>= 0`` or None (unbounded). Combines with ``is_causal`` (which caps
        ``right`` at 0) and with ``attn_mask`` (a key must be allowed by both).
        Computed without a mask array; blocks of keys outside the window are
        skipped.
    softcap : float, optional, keyword-only
        Soft-capped scores: ``softcap * tanh(scores / softcap)``, after the
        scale and before the masks (so a masked key stays masked), as Gemma 2
        and ONNX's Attention apply it. Must be finite and > 0.
    return_scores : {"qk", "softcapped", "masked", "softmax"}, optional, keyword-only
        Also return the ``(..., Hq, L, S)`` scores, in the query's dtype, taken
        at one stage: ``"qk"`` is ``scale * query @ key^T``; ``"softcapped"``
        after the soft cap; ``"masked"`` the softmax's input (the masks added,
        keys closed by a mask, the causal band or the window ``-inf``);
        ``"softmax"`` the probabilities (a row with no open key is zeros).
        The output is the same, to the bit, as without them; the scores are
        the only ``L x S`` array the call allocates.
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        The products' precision. None or ``"float32"``: products and sums in
        the compute dtype. ``"bfloat16"``: the scaled queries, the keys, the
        probabilities and the values are rounded to bfloat16 (to nearest
        even) before their products, and the sums are float32; the softmax
        and the masks stay float32. float32 computations only (ValueError
        for float64 queries). See docs/api.md, "Precision".
    out : ndarray, optional
        C-contiguous array of the result's shape and dtype to write into.

    Returns
    -------
    ndarray, shape (..., Hq, L, Ev), or (ndarray, ndarray) with return_scores
        In the query's dtype. A query row with no key to attend (all masked,
        or outside its window or causal range, as the first ``L - S`` rows
        with ``is_causal="bottom_right"`` and ``L > S``) gives zeros, never NaN.
        With ``return_scores``, ``(output, scores)``.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> q = k = v = np.ones((2, 4, 8, 16), np.float32)
    >>> attnx.scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 4, 8, 16)
    >>> q = np.ones((2, 4, 1, 16), np.float32)     # the newest of 8 positions
    >>> attnx.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", window=(3, 0)).shape
    (2, 4, 1, 16)

    Equal scores average the values a query attends (causal: the keys up to its own):

    >>> q = k = np.zeros((1, 3, 2), np.float32)
    >>> v = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
    >>> attnx.scaled_dot_product_attention(q, k, v, is_causal=True).round(6)
    array([[[0., 1.],
            [1., 2.],
            [2., 3.]]], dtype=float32)
    """
    # The common call in one test: its options are made once, at import.
    if (
        scale is None
        and window is None
        and softcap is None
        and return_scores is None
        and dropout_p.__class__ is float
        and not dropout_p
        and is_causal.__class__ is bool
        and enable_gqa.__class__ is bool
        and (attn_mask is None or attn_mask.__class__ is np.ndarray)
        and precision is None
    ):
        return _core.sdpa(query, key, value, attn_mask, DEFAULT_SDPA_OPTIONS[is_causal][enable_gqa], out)
    if dropout_p.__class__ is not float or dropout_p:
        check_dropout(dropout_p)
    if attn_mask is not None and not isinstance(attn_mask, np.ndarray):
        attn_mask, is_causal = _causal_bias_as_causal(attn_mask, is_causal, query, key)
    code = 0 if precision is None else precision_code(precision, result_and_compute_dtype(query)[1])
    options = sdpa_options(is_causal, scale, enable_gqa, window, softcap, return_scores, code)
    return _core.sdpa(query, key, value, attn_mask, options, out)


def _causal_bias_as_causal(attn_mask: Any, is_causal: Any, query: Any, key: Any) -> tuple[Any, Any]:
    """(attn_mask, is_causal), with a torch ``CausalBias`` mask read as ``is_causal``.

    A CausalBias converts to an array of the wrong shape and uninitialised values, so it is
    recognised (without importing torch) and turned into the causal alignment it stands for.
    """
    bias = causal_bias(attn_mask)
    if bias is None:
        return attn_mask, is_causal
    mode, L, S = bias
    if is_causal is not False:
        raise ValueError("attn_mask is a CausalBias, which is causal already: leave is_causal=False")
    q_len, k_len = np.shape(query)[-2:], np.shape(key)[-2:]
    if len(q_len) < 2 or len(k_len) < 2 or (q_len[0], k_len[0]) != (L, S):
        raise ValueError(
            f"attn_mask is a CausalBias for L = {L} queries and S = {S} keys, but query has shape "
            f"{shape_str(np.shape(query))} and key {shape_str(np.shape(key))}"
        )
    return None, mode


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
    """Multi-head attention forward, as ``torch.nn.functional.multi_head_attention_forward``.

    Same positional order and keyword names as torch's function.

    Parameters
    ----------
    query : array_like, shape (L, N, E), or (N, L, E) with ``batch_first``, or (L, E)
        float32 or float64: its dtype is the compute dtype. float16 or
        bfloat16 (ml_dtypes) are computed in float32 and the results have the
        query's dtype. Other float inputs are converted to the compute dtype.
    key : array_like, shape (S, N, kdim), or (N, S, kdim) with ``batch_first``, or (S, kdim)
    value : array_like, shape (S, N, vdim), or (N, S, vdim) with ``batch_first``, or (S, vdim)
    embed_dim_to_check : int
        Must equal E, the query's last dimension.
    num_heads : int
        Must divide E.
    in_proj_weight : array_like, shape (3E, E), or None with ``use_separate_proj_weight``
    in_proj_bias : array_like, shape (3E,), or None
    bias_k, bias_v : array_like of E elements, or None
        Appended to the keys and values as one more position.
    add_zero_attn : bool
        Append one all-zero key and value position.
    dropout_p : float
        Must be 0.0 unless ``training=False`` (attnx is an inference library).
    out_proj_weight : array_like, shape (E_out, E)
        E_out is the output's width (E in ``nn.MultiheadAttention``).
    out_proj_bias : array_like, shape (E_out,), or None
    training : bool
    key_padding_mask : array_like, shape (N, S), optional
        bool: True means the key is ignored; float: added to the scores.
    need_weights : bool
        Also return the attention weights.
    attn_mask : array_like, shape (L, S) or (N * num_heads, L, S), optional
        bool: True means *not* allowed to attend; float: added to the scores.
    use_separate_proj_weight : bool
        Use ``q_proj_weight``, ``k_proj_weight`` and ``v_proj_weight`` instead
        of ``in_proj_weight`` (needed when kdim or vdim differs from E).
    q_proj_weight : array_like, shape (E, E), optional
        The query projection, with ``use_separate_proj_weight``.
    k_proj_weight : array_like, shape (E, kdim), optional
        The key projection, with ``use_separate_proj_weight``.
    v_proj_weight : array_like, shape (E, vdim), optional
        The value projection, with ``use_separate_proj_weight``.
    static_k, static_v : array_like, shape (N * num_heads, S, E / num_heads), optional
        Use these keys/values instead of projecting ``key``/``value``.
    average_attn_weights : bool
        Average the returned weights over heads.
    is_causal : {False, True, "top_left", "bottom_right"}
        Apply a causal mask: True or ``"top_left"``: query ``i`` attends
        source keys ``j <= i``; ``"bottom_right"``: ``j <= i + S - L``. The
        bias_k and zero-attention positions stay open. Unlike torch, it needs
        no ``attn_mask``; when one is given, it is used as given.
    batch_first : bool, keyword-only
        Inputs and output are (N, L, E) (an attnx addition).
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        The products' precision (an attnx addition). ``"bfloat16"`` rounds the
        operands of the projections (inputs and weights), of the scores and
        of the probabilities' product with the values to bfloat16, with
        float32 sums; biases, masks and the softmax stay float32. float32
        computations only. See :func:`scaled_dot_product_attention`.

    Returns
    -------
    attn_output : ndarray, shape (L, N, E_out) (or (N, L, E_out) / (L, E_out))
        In the query's dtype.
    attn_weights : ndarray or None
        (N, L, S') averaged, or (N, num_heads, L, S'); None unless ``need_weights``.
        ``S'`` counts the bias_k and zero-attention positions.

    Notes
    -----
    A query row whose keys are all masked gives a zero attention row (the
    output row equals ``out_proj_bias``) and zero weights, where torch gives NaN.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> mha = attnx.MultiheadAttention(16, 4, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((5, 2, 16)).astype(np.float32)  # (L, N, E)
    >>> out, weights = attnx.multi_head_attention_forward(
    ...     x, x, x, 16, 4, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0,
    ...     mha.out_proj_weight, mha.out_proj_bias, training=False, is_causal=True)
    >>> out.shape, weights.shape
    ((5, 2, 16), (2, 5, 5))
    >>> weights[0, 0].round(6)       # causal: the first query attends the first key only
    array([1., 0., 0., 0., 0.], dtype=float32)
    >>> bool(np.allclose(out, mha(x, x, x, is_causal=True)[0]))     # what the module computes
    True
    """
    result_dtype, dtype = result_and_compute_dtype(query)
    training = as_bool_flag(training, "training")
    _check_dropout(dropout_p, training)
    num_heads = as_positive_int(num_heads, "num_heads")
    E = np.shape(query)[-1] if np.ndim(query) else 0
    if embed_dim_to_check != E:
        raise ValueError(f"embed_dim_to_check ({embed_dim_to_check}) does not match the query's last dimension ({E})")
    params = dict(
        in_proj_weight=in_proj_weight, in_proj_bias=in_proj_bias, bias_k=bias_k, bias_v=bias_v,
        add_zero_attn=add_zero_attn, out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias,
        use_separate_proj_weight=as_bool_flag(use_separate_proj_weight, "use_separate_proj_weight"),
        q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight,
    )
    code = 0 if precision is None else precision_code(precision, dtype)
    weights = mha_weights(params, num_heads, E, dtype, result_dtype)
    options = mha_options(is_causal, need_weights, average_attn_weights, batch_first, attn_mask, code)
    extras = (attn_mask, key_padding_mask, static_k, static_v)
    return _core.mha(weights, query, key, value, None if all(x is None for x in extras) else extras, options)


def _check_dropout(dropout_p: Any, training: bool) -> None:
    """attnx computes inference: dropout only as 0.0, or when not training."""
    try:
        dropout_p = float(dropout_p)
    except (TypeError, ValueError):
        raise TypeError(f"dropout_p must be a float, got {dropout_p!r}") from None
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if dropout_p > 0.0 and training:
        raise NotImplementedError(
            "attention dropout is not supported (attnx is for inference): pass dropout_p=0.0 or training=False"
        )


# ---------------------------------------------------------------------------------------------
# Decoding with a KV cache
# ---------------------------------------------------------------------------------------------


def _cache_compute_dtype(cache: KVCache) -> np.dtype[Any]:
    """The cache decides the compute dtype (it is read in place, never converted)."""
    return np.dtype(np.float64) if cache.dtype == np.float64 else np.dtype(np.float32)


def _query_lengths(lengths: npt.ArrayLike | None, batch: int, T: int) -> IntArray:
    if lengths is None:
        return np.full(batch, T, np.int64)
    return as_lengths(lengths, batch, T, "lengths", f"T = {T}, the query's tokens per sequence")


def _attend_cache(q, cache: KVCache, n, options, out) -> None:
    """The attention of the newest n[b] tokens of each sequence over the cache, into `out`.

    `q` (B, Hq, T, E), checked; `out` (B, Hq, T, Ev) C-contiguous, of any float dtype.
    The core reads the cache storage itself: keys j < lengths[b] of sequence b, with
    query t attending j <= lengths[b] - n[b] + t (bottom-right causal alignment).
    """
    if out.size == 0:
        return
    dtype = _cache_compute_dtype(cache)
    computed = out if out.dtype == dtype else np.empty(out.shape, dtype)
    key, value, lengths = cache.storage()
    scales = cache.scales()
    query = kernel_layout(as_float(q, dtype, "query"))
    if scales is None:
        _core.cached_attention(query, key, value, lengths, n, options, computed)
    else:
        _core.cached_attention(query, key, value, lengths, n, options, computed, scales.key, scales.value)
    if computed is not out:
        out[...] = computed


def cached_attention(
    query: npt.ArrayLike,
    cache: KVCache,
    key: npt.ArrayLike | None = None,
    value: npt.ArrayLike | None = None,
    *,
    lengths: npt.ArrayLike | None = None,
    rope: RotaryEmbedding | None = None,
    positions: npt.ArrayLike | None = None,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    precision: CachePrecision | None = None,
    out: FloatArray | None = None,
) -> FloatArray:
    """Attention of the newest tokens of each sequence over a :class:`KVCache`.

    The ``T`` query tokens are the newest tokens of each sequence: with
    ``key`` and ``value`` given, they are appended to the cache first. Query
    ``t`` of sequence ``b`` attends the cached keys ``j <= lengths_b - n_b + t``
    (causal, bottom-right aligned per sequence), where ``lengths_b`` is the
    cache's length of sequence ``b`` and ``n_b`` its number of valid query
    tokens. The cache storage is read in place (never copied), up to each
    sequence's length.

    Parameters
    ----------
    query : array_like, shape (batch, Hq, T, head_dim)
        ``Hq`` a multiple of the cache's ``num_kv_heads`` (grouped-query or
        multi-query attention: query head ``h`` uses key/value head
        ``h // (Hq // num_kv_heads)``). float32, float64, float16 or bfloat16:
        the result has the query's dtype.
    cache : KVCache
        The keys and values so far. It decides the compute dtype: float64 for
        a float64 cache, else float32 (float16/bfloat16 and int8 caches are
        widened in the kernels).
    key : array_like, shape (batch, num_kv_heads, T, head_dim), optional
        Keys of the query tokens, appended to the cache before attending.
    value : array_like, shape (batch, num_kv_heads, T, value_dim), optional
        Values of the query tokens (with ``key``).
    lengths : array_like of int, shape (batch,), optional, keyword-only
        Valid query tokens per sequence, ``n_b`` in ``[0, T]`` (ragged
        batches: valid tokens first). Default: all ``T``. With ``key`` and
        ``value``, also how many of them are appended. Output rows
        ``t >= n_b`` are zeros. Each ``n_b`` must not exceed the sequence's
        length in the cache (after appending).
    rope : RotaryEmbedding, optional, keyword-only
        Rotary position embeddings: the queries, and the new keys before they
        are stored, are rotated at their positions (the cache holds rotated
        keys, as transformers' caches do; it is never rotated again). Query
        ``t`` of sequence ``b`` is at position ``lengths_b - n_b + t``, its
        place in the cache. ``rope.head_dim`` must equal ``head_dim``.
    positions : array_like of int, shape (batch, T), optional, keyword-only
        With ``rope``: the positions to rotate at instead (e.g. positions that
        do not start at 0, or that skip), ``>= 0`` for the valid tokens; those
        of padding tokens (``t >= n_b``) are ignored.
    scale : float, optional, keyword-only
        Defaults to ``1 / sqrt(head_dim)``.
    window : tuple (left, right), optional, keyword-only
        Sliding window, as in :func:`scaled_dot_product_attention` (bottom-right
        aligned): query ``t`` attends only keys ``j >= lengths_b - n_b + t - left``.
    softcap : float, optional, keyword-only
        Soft-capped scores, as in :func:`scaled_dot_product_attention`.
    precision : {None, "float32", "bfloat16", "int8"}, optional, keyword-only
        The products' precision, as in :func:`scaled_dot_product_attention`:
        ``"bfloat16"`` rounds the scaled queries, the cached keys and values
        (widened from the cache's dtype) and the probabilities to bfloat16.
        Not with a float64 cache (ValueError). ``"int8"`` (an int8 cache
        only) quantizes the query rows as the cache quantizes its rows and
        the probabilities per block of 128 keys, and multiplies integers
        (docs/api.md, "Precision").
    out : ndarray, optional, keyword-only
        C-contiguous array of the result's shape and dtype to write into.

    Returns
    -------
    ndarray, shape (batch, Hq, T, value_dim)
        In the query's dtype.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> cache = attnx.KVCache(1, 2, 64, 8)
    >>> k = v = np.ones((1, 2, 5, 8), np.float32)
    >>> q = np.ones((1, 4, 5, 8), np.float32)
    >>> attnx.cached_attention(q, cache, k, v).shape     # a 5-token prompt
    (1, 4, 5, 8)
    >>> k = v = np.ones((1, 2, 1, 8), np.float32)
    >>> attnx.cached_attention(q[:, :, :1], cache, k, v).shape   # then one token at a time
    (1, 4, 1, 8)

    With rotary position embeddings, the new keys are stored rotated:

    >>> rope = attnx.RotaryEmbedding(8)
    >>> cache = attnx.KVCache(1, 2, 64, 8)
    >>> k = v = np.ones((1, 2, 5, 8), np.float32)
    >>> attnx.cached_attention(q, cache, k, v, rope=rope).shape
    (1, 4, 5, 8)
    >>> bool(np.array_equal(cache.key[0, :, 3], rope(k[0, :, 3][None], [3])[0]))   # key 3 at position 3
    True
    """
    cache = check_cache(cache)
    result_dtype, _ = result_and_compute_dtype(query)
    code = 0 if precision is None else precision_code(
        precision, _cache_compute_dtype(cache), "the cache", "use a KVCache of float32, float16, bfloat16 or int8",
        int8_cache=cache.dtype == np.int8)
    q = as_float(query, result_dtype, "query")
    B, Hkv, E = cache.batch, cache.num_kv_heads, cache.head_dim
    if q.ndim != 4 or q.shape[0] != B or q.shape[3] != E or q.shape[1] == 0 or q.shape[1] % Hkv != 0:
        raise ValueError(
            f"query must have shape (batch, Hq, T, head_dim) = ({B}, Hq, T, {E}) with Hq a multiple of "
            f"num_kv_heads = {Hkv}, for {cache!r}; got {shape_str(q.shape)}"
        )
    Hq, T = q.shape[1], q.shape[2]
    if (key is None) != (value is None):
        raise ValueError("key and value must both be given or both be None")
    if key is not None:
        for name, x in (("key", key), ("value", value)):
            shape = np.shape(x)
            if len(shape) != 4 or shape[2] != T:
                raise ValueError(
                    f"{name} must hold the query's T = {T} tokens (dim 2): query {shape_str(q.shape)}, "
                    f"{name} {shape_str(shape)}"
                )
    n = _query_lengths(lengths, B, T)
    if rope is None and positions is not None:
        raise ValueError("positions are the rotary positions: pass them with rope=")
    window_left, window_right = window_bounds(window)
    scale = (1.0 / math.sqrt(E)) if scale is None else as_finite_scale(scale)
    # Made before anything is appended: a call the core's options refuse changes nothing.
    options = make_sdpa_options(True, True, scale, window_left, window_right, True, as_softcap(softcap), -1, code)
    result_shape = (B, Hq, T, cache.value_dim)
    if out is None:
        out = np.empty(result_shape, result_dtype)
    else:
        check_out(out, result_shape, result_dtype, (query, key, value) + cache.storage()[:2] + tuple(cache.scales() or ()))

    if key is None and (n > cache.lengths).any():
        raise ValueError(
            f"lengths {n.tolist()} (query tokens per sequence) exceed the cache's lengths "
            f"{cache.lengths.tolist()}: the query tokens must be the newest tokens in the cache "
            f"(pass key and value to append them)"
        )
    if rope is not None:
        # Rotated before anything is appended: a call that raises leaves the cache as it was.
        q, key = _rotate_new(rope, q, key, n, cache, positions)
    if key is not None:
        cache.append(key, value, None if lengths is None else n)
    _attend_cache(q, cache, n, options, out)
    return out


def _rotate_new(rope: Any, q: np.ndarray, key: Any, n: IntArray, cache: KVCache, positions: Any) -> tuple[Any, Any]:
    """The queries (B, Hq, T, E) and new keys (B, Hk, T, E) rotated at their positions.

    Token t of sequence b is at ``lengths_b - n_b + t`` once its key is in the cache
    (``lengths_b`` after the append), or at ``positions[b, t]`` where given. Padding
    tokens (t >= n_b) are rotated at position 0: they are neither stored nor attended
    from. Only the new rows are rotated, never the cache.
    """
    from .rotary import RotaryEmbedding  # imported on first use, as attnx.RotaryEmbedding is

    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be an attnx.RotaryEmbedding or None, got {type(rope).__name__}")
    B, _, T, E = q.shape
    if rope.head_dim != E:
        raise ValueError(
            f"rope.head_dim ({rope.head_dim}) must equal the head_dim of the query and cache ({E}): "
            f"make the RotaryEmbedding with head_dim={E}"
        )
    valid = np.arange(T) < n[:, None]
    if positions is None:
        after = cache.lengths + (n if key is not None else 0)
        p = (after - n)[:, None] + np.arange(T)
    else:
        p = as_array(positions, "positions")
        if p.dtype.kind not in "iu":
            raise TypeError(f"positions must be an array of integers, got dtype {p.dtype}")
        if p.shape != (B, T):
            raise ValueError(
                f"positions must have shape (batch, T) = ({B}, {T}), one per query token, got {shape_str(p.shape)}"
            )
        if (p[valid] < 0).any():
            raise ValueError(f"positions of the valid query tokens must be >= 0, got {p.tolist()}")
    p = np.where(valid, p, 0).astype(np.int64)
    cos, sin = rope._cos_sin(p)              # (B, T, rotary_dim)
    cos, sin = cos[:, None], sin[:, None]    # broadcast over the heads
    q = rope._rotate(q, cos, sin)
    if key is not None:
        k = as_array(key, "key")
        result_dtype, _ = result_and_compute_dtype(k, "key")
        k = as_float(k, result_dtype, "key")
        if k.ndim != 4 or k.shape[0] != B or k.shape[3] != E:
            raise ValueError(
                f"key must have shape (batch, num_kv_heads, T, head_dim) = ({B}, {cache.num_kv_heads}, {T}, {E}), "
                f"got {shape_str(k.shape)}"
            )
        key = rope._rotate(k, cos, sin)
    return q, key


def multi_head_attention_step(
    query: npt.ArrayLike,
    cache: KVCache,
    num_heads: int,
    in_proj_weight: npt.ArrayLike | None,
    in_proj_bias: npt.ArrayLike | None,
    out_proj_weight: npt.ArrayLike,
    out_proj_bias: npt.ArrayLike | None,
    *,
    lengths: npt.ArrayLike | None = None,
    batch_first: bool = False,
    use_separate_proj_weight: bool = False,
    q_proj_weight: npt.ArrayLike | None = None,
    k_proj_weight: npt.ArrayLike | None = None,
    v_proj_weight: npt.ArrayLike | None = None,
    precision: Precision | None = None,
) -> FloatArray:
    """One decoding step of causal self-attention over a :class:`KVCache`.

    Projects the new tokens to queries, keys and values, appends the keys and
    values to ``cache``, attends from the new tokens over the cache (each
    sequence's newest tokens, causal, bottom-right aligned) and applies the
    output projection. Decoding a sequence token by token gives the outputs of
    one :func:`multi_head_attention_forward` over the whole sequence with
    ``is_causal=True`` (self-attention, no bias_k/bias_v or zero attention).

    Parameters
    ----------
    query : array_like, shape (T, batch, E), or (batch, T, E) with ``batch_first``, or (T, E)
        The new tokens (the unbatched form needs a cache of batch 1).
        float32, float64, float16 or bfloat16: the result has its dtype;
        projections run in float64 for float64, else float32.
    cache : KVCache
        ``num_kv_heads == num_heads`` and ``head_dim == value_dim == E // num_heads``
        (see :meth:`MultiheadAttention.new_cache`).
    num_heads : int
        Must divide E.
    in_proj_weight : array_like, shape (3E, E), or None with ``use_separate_proj_weight``
    in_proj_bias : array_like, shape (3E,), or None
    out_proj_weight : array_like, shape (E_out, E)
    out_proj_bias : array_like, shape (E_out,), or None
    lengths : array_like of int, shape (batch,), optional, keyword-only
        Valid new tokens per sequence, each in ``[0, T]`` (ragged batches:
        valid tokens first). Only those are appended; the output rows of the
        others equal ``out_proj_bias`` (zeros without a bias). Default: all ``T``.
    batch_first : bool, keyword-only
        ``query`` and the result are (batch, T, E).
    use_separate_proj_weight : bool, keyword-only
        Use ``q_proj_weight``, ``k_proj_weight`` and ``v_proj_weight``
        (each (E, E)) instead of ``in_proj_weight``.
    q_proj_weight, k_proj_weight, v_proj_weight : array_like, shape (E, E), optional, keyword-only
        The separate projections, with ``use_separate_proj_weight``.
    precision : {None, "float32", "bfloat16"}, optional, keyword-only
        The products' precision, as in :func:`multi_head_attention_forward`
        (float32 computations only).

    Returns
    -------
    ndarray, shape (T, batch, E_out), or (batch, T, E_out) with ``batch_first``, or (T, E_out)
        The attention output (no weights), in the query's dtype.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> mha = attnx.MultiheadAttention(16, 4, batch_first=True, seed=0)
    >>> cache = mha.new_cache(batch=2, max_len=32)
    >>> prompt = np.ones((2, 5, 16), np.float32)
    >>> mha.step(prompt, cache).shape
    (2, 5, 16)
    >>> mha.step(np.ones((2, 1, 16), np.float32), cache).shape
    (2, 1, 16)
    """
    result_dtype, dtype = result_and_compute_dtype(query)
    num_heads = as_positive_int(num_heads, "num_heads")
    E = np.shape(query)[-1] if np.ndim(query) else 0
    params = dict(
        in_proj_weight=in_proj_weight, in_proj_bias=in_proj_bias, out_proj_weight=out_proj_weight,
        out_proj_bias=out_proj_bias,
        use_separate_proj_weight=as_bool_flag(use_separate_proj_weight, "use_separate_proj_weight"),
        q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight, v_proj_weight=v_proj_weight,
    )
    code = 0 if precision is None else precision_code(precision, dtype)
    weights = mha_weights(params, num_heads, E, dtype, result_dtype)
    return mha_step(weights, query, cache, lengths, as_bool_flag(batch_first, "batch_first"), code)
