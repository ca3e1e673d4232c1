"""One transformer layer's forward pass, and a LayerNorm's: what the transformer classes compute with.

The classes of :mod:`attnx.transformer` check their arguments, convert ``src`` / ``tgt`` /
``memory`` to the layer's compute dtype (float32 or float64) and make unbatched inputs a batch
of one, then call these functions once per layer. So these functions receive:

* ``layer``: an ``attnx.TransformerEncoderLayer`` or ``TransformerDecoderLayer``, read through
  its attributes (``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``, ``norm1`` ..
  ``norm3``, each norm with its own ``eps``; ``activation``, ``norm_first``, ``batch_first``),
  whose parameters are in ``layer.dtype`` (float16 and bfloat16 included);
* 3-D ``src`` / ``tgt`` / ``memory`` in the layer's layout, ``(N, L, E)`` with
  ``layer.batch_first`` and ``(L, N, E)`` without, in the compute dtype, of any strides (the
  caller's own array where it has that dtype already: read, never written);
* the masks, None or the arrays the caller gave as :func:`attnx._arrays.as_array` reads them
  (torch tensors included), bool or floating of any float dtype and layout, not converted
  further; the classes have checked their shapes: ``attn_mask`` ``(L, S)`` or
  ``(N * nhead, L, S)``, key padding ``(N, S)`` (an unbatched caller's ``(S,)`` is given as
  ``(1, S)``). As torch's multi-head attention reads them: bool True means *not* allowed, float
  is added to the scores. ``is_causal=True`` without a mask is the top-left causal mask; with a
  mask, the mask is used as given (the flag is a hint, and the stacks set it as torch detects a
  causal mask).

and return the layer's 3-D output, a new array, in the same layout and dtype. The functions compute with the
plain-NumPy reference (:mod:`attnx.reference`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._arrays import as_array

if TYPE_CHECKING:
    from ._layer_parts import LayerNorm
    from ._typing import FloatArray
    from .transformer import TransformerDecoderLayer, TransformerEncoderLayer


def _mask(mask: Any, name: str) -> np.ndarray[Any, Any] | None:
    return None if mask is None else as_array(mask, name)


def encoder_layer(
    layer: TransformerEncoderLayer,
    src: FloatArray,
    src_mask: Any,
    src_key_padding_mask: Any,
    is_causal: bool,
) -> FloatArray:
    """``layer``'s forward pass on the checked, batched ``src`` (see the module's docstring)."""
    from . import reference  # on first use: `import attnx` does not import the reference

    return reference.transformer_encoder_layer(
        src,
        dict(layer.named_parameters()),
        layer.self_attn.num_heads,
        src_mask=_mask(src_mask, "src_mask"),
        src_key_padding_mask=_mask(src_key_padding_mask, "src_key_padding_mask"),
        is_causal=is_causal,
        activation=layer.activation,
        layer_norm_eps=(layer.norm1.eps, layer.norm2.eps),
        norm_first=layer.norm_first,
        batch_first=layer.batch_first,
    )


def decoder_layer(
    layer: TransformerDecoderLayer,
    tgt: FloatArray,
    memory: FloatArray,
    tgt_mask: Any,
    memory_mask: Any,
    tgt_key_padding_mask: Any,
    memory_key_padding_mask: Any,
    tgt_is_causal: bool,
    memory_is_causal: bool,
) -> FloatArray:
    """``layer``'s forward pass on the checked, batched ``tgt`` and ``memory`` (see the module's docstring)."""
    from . import reference

    return reference.transformer_decoder_layer(
        tgt,
        memory,
        dict(layer.named_parameters()),
        layer.self_attn.num_heads,
        tgt_mask=_mask(tgt_mask, "tgt_mask"),
        memory_mask=_mask(memory_mask, "memory_mask"),
        tgt_key_padding_mask=_mask(tgt_key_padding_mask, "tgt_key_padding_mask"),
        memory_key_padding_mask=_mask(memory_key_padding_mask, "memory_key_padding_mask"),
        tgt_is_causal=tgt_is_causal,
        memory_is_causal=memory_is_causal,
        activation=layer.activation,
        layer_norm_eps=(layer.norm1.eps, layer.norm2.eps, layer.norm3.eps),
        norm_first=layer.norm_first,
        batch_first=layer.batch_first,
    )


def layer_norm(x: FloatArray, norm: LayerNorm) -> FloatArray:
    """``norm`` (a LayerNorm's parameters) applied to ``x`` over its last dimension, in ``x``'s dtype."""
    from . import reference

    return reference.layer_norm(x, norm.weight, norm.bias, norm.eps)
