"""One call into the core per transformer layer: the canonical arguments of
``_core.transformer_layer``.

The classes of :mod:`attnx.transformer` check their arguments and lay out their inputs (3-D, in
the layer's dtype and layout); these functions turn the layer's parameters into a
``_core.TransformerLayerWeights`` (kept while the parameters are the same arrays), the masks
into additive ``(N, H, L, S)`` views, and run a stack of layers (one layer called alone is a
stack of one), its final norm included.

With a key padding mask, a stack runs on the real tokens only: their rows are packed once at the
stack's entry (each sequence's real tokens in order, the sequences end to end), every layer
works on the packed rows, and they are unpacked once at the exit, with zeros at the padded
positions (as torch's nested tensors give). Where the packed rows cannot express a call (an
attention mask other than the causal one, a float padding mask of other values than 0 and -inf),
the stack runs on the padded batch with its masks and the padded positions' outputs are then set
to zero: ``last_route()`` names the route a thread's last stack took, and why.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from . import _core
from ._arrays import additive_mask, as_array, is_floating, kernel_layout

def compute_dtype(layer: Any) -> np.dtype[Any]:
    """float64 for float64 layers, else float32 (half-precision parameters are storage)."""
    return np.dtype(np.float64) if layer.self_attn.dtype == np.float64 else np.dtype(np.float32)


def _parameter(a: Any, dtype: np.dtype[Any], name: str) -> np.ndarray[Any, Any] | None:
    """`a` itself where the core reads it in place (so values written into it are seen), else a
    C-contiguous, aligned copy in `dtype`; TypeError naming `name` for anything but a floating
    array (torch tensors are read as their values)."""
    if a is None:
        return None
    if type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous and a.flags.aligned:
        return a
    a = as_array(a, name)
    if not is_floating(a.dtype):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    # np.array(copy=True), not ascontiguousarray: the latter keeps a misaligned array as it is.
    return np.array(a, dtype=dtype, order="C", copy=True)


_NORM_NAMES = ("norm1", "norm2", "norm3")
_PARAMETER_NAMES = ("linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias") + tuple(
    f"{norm}.{part}" for norm in _NORM_NAMES for part in ("weight", "bias")
)


def layer_weights(layer: Any) -> _core.TransformerLayerWeights:
    """The layer's parameters as the core takes them, kept on the layer while its attention
    weights and its parameter arrays are the same objects."""
    decoder = hasattr(layer, "multihead_attn")
    self_attn = layer.self_attn._weights()
    cross_attn = layer.multihead_attn._weights() if decoder else None
    norms = (layer.norm1, layer.norm2, layer.norm3) if decoder else (layer.norm1, layer.norm2)
    arrays = (layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)
    arrays += tuple(a for norm in norms for a in (norm.weight, norm.bias))
    eps = tuple(float(norm.eps) for norm in norms)
    key = (self_attn, cross_attn, layer.activation, layer.norm_first) + arrays
    kept = layer.__dict__.get("_core_weights")
    if kept is not None and kept[1] == eps and len(kept[0]) == len(key) and all(a is b for a, b in zip(kept[0], key)):
        return kept[2]
    dtype = compute_dtype(layer)
    p = [_parameter(a, dtype, name) for a, name in zip(arrays, _PARAMETER_NAMES)]
    weights = _core.TransformerLayerWeights(
        self_attn,
        cross_attn,
        (p[0], p[1]),
        (p[2], p[3]),
        tuple((p[4 + 2 * i], p[5 + 2 * i], eps[i]) for i in range(len(norms))),
        bool(layer.norm_first),
        layer.activation,
    )
    if all(a is b for a, b in zip(p, arrays)):  # shared with the parameters: keep
        layer.__dict__["_core_weights"] = (key, eps, weights)
    return weights


def final_norm(norm: Any, dtype: np.dtype[Any]) -> tuple[Any, Any, float] | None:
    """A stack's final norm as the core takes it: (weight, bias, eps), or None."""
    if norm is None:
        return None
    return _parameter(norm.weight, dtype, "norm.weight"), _parameter(norm.bias, dtype, "norm.bias"), float(norm.eps)


def _batch(x: np.ndarray[Any, Any], batch_first: bool) -> tuple[int, int]:
    """(N, L) of a 3-D input in the layer's layout."""
    return (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])


def _block_masks(attn_mask: Any, key_padding_mask: Any, dtype: np.dtype[Any], N: int, H: int, L: int, S: int,
                 names: tuple[str, str]) -> tuple[Any, Any] | None:
    """A block's masks, their shapes checked by the classes ((L, S) or (N * H, L, S); (N, S)),
    as additive (N, H, L, S) views (torch's multi-head attention rules: True means masked), or
    None where it has none."""
    if attn_mask is None and key_padding_mask is None:
        return None
    am = kpm = None
    if key_padding_mask is not None:
        kpm = additive_mask(key_padding_mask, dtype, names[1], true_means_masked=True)
        kpm = np.broadcast_to(kpm.reshape(N, 1, 1, S), (N, H, L, S))
    if attn_mask is not None:
        am = additive_mask(attn_mask, dtype, names[0], true_means_masked=True)
        am = np.broadcast_to(am, (N, H, L, S)) if am.ndim == 2 else am.reshape(N, H, L, S)
    return am, kpm


# ---------------------------------------------------------------------------------------------
# Routes: padding-free rows, or the padded batch
# ---------------------------------------------------------------------------------------------

PACKED = "padding-free rows"
_route = threading.local()


def last_route() -> str:
    """The route the calling thread's last stack took: "" (no padding), ``PACKED``, or why the
    padded batch ran instead (its padded outputs then zeroed), as torch's
    ``why_not_sparsity_fast_path``."""
    return getattr(_route, "value", "")


@functools.lru_cache(maxsize=64)
def _plain_options(batch_first: bool, self_causal: bool, cross_causal: bool, precision: int) -> Any:
    return _core.TransformerLayerOptions(batch_first, self_causal, cross_causal, precision)


def _options(batch_first: bool, self_causal: bool, cross_causal: bool, precision: int, norm: Any,
             dtype: np.dtype[Any]) -> Any:
    """The call's ``_core.TransformerLayerOptions``: made once per set of flags, or with the
    stack's final norm for its last layer."""
    if norm is None:
        return _plain_options(bool(batch_first), bool(self_causal), bool(cross_causal), int(precision))
    return _core.TransformerLayerOptions(batch_first, self_causal, cross_causal, precision, final_norm(norm, dtype))


def _padded(mask: Any) -> np.ndarray[Any, Any] | None:
    """The padded positions of a checked (N, S) key padding mask (bool: True; float: -inf)."""
    if mask is None:
        return None
    return np.asarray(mask) if mask.dtype == np.bool_ else np.asarray(mask == -np.inf)


def _packable_padding(mask: Any) -> bool:
    """Whether a padding mask says no more than which positions are padding: bool, or float of
    0 and -inf only."""
    return mask.dtype == np.bool_ or bool(np.all((mask == 0) | (mask == -np.inf)))


def is_causal_mask(mask: Any, L: int) -> bool:
    """Whether `mask` is the (L, L) causal mask (bool: True above the diagonal; float: -inf above
    it, 0 elsewhere)."""
    if mask is None or mask.shape != (L, L):
        return False
    above = np.triu(np.ones((L, L), dtype=bool), 1)
    if mask.dtype == np.bool_:
        return bool((mask == above).all())
    return bool((mask == np.where(above, -np.inf, 0.0)).all())


class _Packing:
    """The real tokens of a batch in the layers' layout: their rows, each sequence's in order and
    the sequences end to end, and each sequence's length."""

    def __init__(self, padded: np.ndarray[Any, Any], batch_first: bool) -> None:
        N, L = padded.shape
        b, pos = np.nonzero(~padded)
        self.rows = b * L + pos if batch_first else pos * N + b
        self.lengths = np.count_nonzero(~padded, axis=1).astype(np.int64)

    def pack(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.ascontiguousarray(x.reshape(-1, x.shape[-1])[self.rows])

    def unpack(self, rows: np.ndarray[Any, Any], shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        out = np.zeros(shape, dtype)
        out.reshape(-1, shape[-1])[self.rows] = rows
        return out


def _zero_padded(out: np.ndarray[Any, Any], padded: np.ndarray[Any, Any] | None, batch_first: bool) -> np.ndarray[Any, Any]:
    """`out` with the rows of padded positions set to 0."""
    if padded is not None and padded.any():
        out[padded if batch_first else padded.T] = 0
    return out


def _padding(mask: Any) -> tuple[Any, np.ndarray[Any, Any] | None]:
    """(mask, its padded positions): both None where there is no mask, or where a packable mask
    pads nothing (it then changes nothing, and the call is a full batch's)."""
    padded = _padded(mask)
    if mask is not None and not padded.any() and _packable_padding(mask):
        return None, None
    return mask, padded


# ---------------------------------------------------------------------------------------------
# Stacks
# ---------------------------------------------------------------------------------------------


def encode(layers: list[Any], norm: Any, src: np.ndarray[Any, Any], attn_mask: Any, src_key_padding_mask: Any,
           is_causal: bool, precisions: list[int]) -> np.ndarray[Any, Any]:
    """Encoder layers in turn (then `norm`, a stack's final norm, if given) on a 3-D `src` in the
    layers' layout and compute dtype; `precisions` are the core's codes of each layer's."""
    first = layers[0]
    batch_first = first.batch_first
    dtype = compute_dtype(first)
    N, L = _batch(src, batch_first)
    weights = [layer_weights(layer) for layer in layers]
    last = len(layers) - 1
    src_key_padding_mask, padded = _padding(src_key_padding_mask)
    causal_mask = attn_mask is not None and is_causal_mask(attn_mask, L)
    reason = ""
    if padded is not None:
        if not _packable_padding(src_key_padding_mask):
            reason = "src_key_padding_mask is a float mask of values other than 0 and -inf"
        elif attn_mask is not None and not causal_mask:
            reason = "src_mask is not the causal mask"
        else:
            _route.value = PACKED
            packing = _Packing(padded, batch_first)
            rows = packing.pack(src)
            if rows.shape[0] > 0:
                lengths = (packing.lengths, None)
                for i, layer in enumerate(layers):
                    options = _options(batch_first, bool(is_causal) or causal_mask, False, precisions[i],
                                       norm if i == last else None, dtype)
                    rows = _core.transformer_layer(weights[i], rows, None, None, None, options, lengths)
            return packing.unpack(rows, src.shape, dtype)
    _route.value = reason
    masks = _block_masks(attn_mask, src_key_padding_mask, dtype, N, weights[0].num_heads, L, L,
                         ("src_mask", "src_key_padding_mask"))
    x = src
    for i, layer in enumerate(layers):
        options = _options(batch_first, bool(is_causal) and attn_mask is None, False, precisions[i],
                           norm if i == last else None, dtype)
        x = _core.transformer_layer(weights[i], kernel_layout(x), None, masks, None, options)
    return _zero_padded(x, padded, batch_first)


def decode(layers: list[Any], norm: Any, tgt: np.ndarray[Any, Any], memory: np.ndarray[Any, Any], tgt_mask: Any,
           memory_mask: Any, tgt_key_padding_mask: Any, memory_key_padding_mask: Any, tgt_is_causal: bool,
           memory_is_causal: bool, precisions: list[int]) -> np.ndarray[Any, Any]:
    """Decoder layers in turn (then `norm`, if given) on 3-D `tgt` and `memory` in the layers'
    layout and compute dtype; `precisions` are the core's codes of each layer's."""
    first = layers[0]
    batch_first = first.batch_first
    dtype = compute_dtype(first)
    N, L = _batch(tgt, batch_first)
    S = _batch(memory, batch_first)[1]
    weights = [layer_weights(layer) for layer in layers]
    H = weights[0].num_heads
    last = len(layers) - 1
    tgt_key_padding_mask, tgt_padded = _padding(tgt_key_padding_mask)
    memory_key_padding_mask, memory_padded = _padding(memory_key_padding_mask)
    causal_mask = tgt_mask is not None and is_causal_mask(tgt_mask, L)
    reason = ""
    if tgt_padded is not None or memory_padded is not None:
        if tgt_key_padding_mask is not None and not _packable_padding(tgt_key_padding_mask):
            reason = "tgt_key_padding_mask is a float mask of values other than 0 and -inf"
        elif memory_key_padding_mask is not None and not _packable_padding(memory_key_padding_mask):
            reason = "memory_key_padding_mask is a float mask of values other than 0 and -inf"
        elif tgt_mask is not None and not causal_mask:
            reason = "tgt_mask is not the causal mask"
        elif memory_mask is not None:
            reason = "memory_mask is given"
        elif memory_is_causal:
            reason = "memory_is_causal is set"
        else:
            _route.value = PACKED
            packing = _Packing(tgt_padded if tgt_padded is not None else np.zeros((N, L), bool), batch_first)
            rows = packing.pack(tgt)
            if rows.shape[0] > 0:
                if memory_padded is not None:
                    memory_packing = _Packing(memory_padded, batch_first)
                    mem, lengths = memory_packing.pack(memory), (packing.lengths, memory_packing.lengths)
                else:
                    mem, lengths = kernel_layout(memory), (packing.lengths, None)
                for i, layer in enumerate(layers):
                    options = _options(batch_first, bool(tgt_is_causal) or causal_mask, False, precisions[i],
                                       norm if i == last else None, dtype)
                    rows = _core.transformer_layer(weights[i], rows, mem, None, None, options, lengths)
            return packing.unpack(rows, tgt.shape, dtype)
    _route.value = reason
    self_masks = _block_masks(tgt_mask, tgt_key_padding_mask, dtype, N, H, L, L, ("tgt_mask", "tgt_key_padding_mask"))
    cross_masks = _block_masks(memory_mask, memory_key_padding_mask, dtype, N, H, L, S,
                               ("memory_mask", "memory_key_padding_mask"))
    x, memory = tgt, kernel_layout(memory)
    for i, layer in enumerate(layers):
        options = _options(batch_first, bool(tgt_is_causal) and tgt_mask is None,
                           bool(memory_is_causal) and memory_mask is None, precisions[i], norm if i == last else None,
                           dtype)
        x = _core.transformer_layer(weights[i], kernel_layout(x), memory, self_masks, cross_masks, options)
    return _zero_padded(x, tgt_padded, batch_first)


def encoder_layer(layer: Any, src: np.ndarray[Any, Any], src_mask: Any, src_key_padding_mask: Any, is_causal: bool,
                  norm: Any = None, precision: int = 0) -> np.ndarray[Any, Any]:
    """One encoder layer (then `norm`, if given): a stack of one."""
    return encode([layer], norm, src, src_mask, src_key_padding_mask, is_causal, [precision])


def decoder_layer(layer: Any, tgt: np.ndarray[Any, Any], memory: np.ndarray[Any, Any], tgt_mask: Any, memory_mask: Any,
                  tgt_key_padding_mask: Any, memory_key_padding_mask: Any, tgt_is_causal: bool,
                  memory_is_causal: bool, norm: Any = None, precision: int = 0) -> np.ndarray[Any, Any]:
    """One decoder layer (then `norm`, if given): a stack of one."""
    return decode([layer], norm, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                  tgt_is_causal, memory_is_causal, [precision])


def layer_norm(x: np.ndarray[Any, Any], norm: Any) -> np.ndarray[Any, Any]:
    """`norm` over the last dim of `x` (a stack without layers: its norm alone), in NumPy."""
    mean = x.mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + norm.eps)
    if norm.weight is not None:
        y = y * norm.weight
    if norm.bias is not None:
        y = y + norm.bias
    return y.astype(x.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def _memory_projections(layer: Any, memory: np.ndarray[Any, Any], batch_first: bool, dtype: np.dtype[Any],
                        precision: int) -> tuple:
    """The keys and values of a decoder layer's cross-attention over `memory`, (N, H, S, E / H),
    with the products of `precision` (the core's code)."""
    mha = layer.multihead_attn
    E, H = mha.embed_dim, mha.num_heads
    rows = memory if batch_first else memory.transpose(1, 0, 2)
    N, S = rows.shape[:2]
    rows = np.ascontiguousarray(rows).reshape(N * S, E)
    if mha.in_proj_weight is not None:
        w = _parameter(mha.in_proj_weight, dtype, "multihead_attn.in_proj_weight")
        weights = (w[E : 2 * E], w[2 * E :])
    else:
        weights = (_parameter(mha.k_proj_weight, dtype, "multihead_attn.k_proj_weight"),
                   _parameter(mha.v_proj_weight, dtype, "multihead_attn.v_proj_weight"))
    b = _parameter(mha.in_proj_bias, dtype, "multihead_attn.in_proj_bias")
    biases = (None, None) if b is None else (b[E : 2 * E], b[2 * E :])
    projected = []
    for weight, bias in zip(weights, biases):
        out = np.empty((N * S, E), dtype)
        _core.linear(rows, weight, bias, out, precision)
        projected.append(out.reshape(N, S, H, E // H).transpose(0, 2, 1, 3))
    return tuple(projected)


def decoder_step(decoder: Any, tgt: np.ndarray[Any, Any], memory: np.ndarray[Any, Any], cache: Any,
                 memory_key_padding_mask: Any, memory_mask: Any, precisions: list[int]) -> np.ndarray[Any, Any]:
    """The stack's output at the new positions of `tgt` (3-D, the layers' layout and compute
    dtype) over `cache`, each layer with the precision of `precisions` (the core's codes); the
    cache grows only where every layer succeeds."""
    layers = decoder.layers
    first = layers[0]
    batch_first = first.batch_first
    dtype = compute_dtype(first)
    N, T = _batch(tgt, batch_first)
    S = _batch(memory, batch_first)[1]
    H = first.self_attn.num_heads
    # Every layer's parameters checked before anything is projected or appended.
    weights = [layer_weights(layer) for layer in layers]
    cross_masks = _block_masks(memory_mask, memory_key_padding_mask, dtype, N, H, T, S,
                               ("memory_mask", "memory_key_padding_mask"))
    tgt, memory = kernel_layout(tgt), kernel_layout(memory)
    # The memory's projections are kept with the cross-attention parameters and the precisions
    # they were made with.
    owners = tuple(layer.multihead_attn._weights() for layer in layers) + tuple(precisions)
    memory_kv = cache.memory_keys_values(
        memory, owners,
        lambda: [_memory_projections(layer, memory, batch_first, dtype, code)
                 for layer, code in zip(layers, precisions)],
    )
    lengths = [c.storage().lengths for c in cache.layers]
    before = [n.copy() for n in lengths]
    x = tgt
    try:
        for i, layer in enumerate(layers):
            options = _options(batch_first, False, False, precisions[i],
                               decoder.norm if i == len(layers) - 1 else None, dtype)
            x = _core.transformer_layer(weights[i], x, memory, None, cross_masks, options, None,
                                        (cache.layers[i], memory_kv[i]))
    except BaseException:
        for n, b in zip(lengths, before):
            n[:] = b
        raise
    return x
