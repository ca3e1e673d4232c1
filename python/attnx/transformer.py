"""torch's ``nn.Transformer`` family for NumPy arrays: layers, stacks and the whole model.

:class:`TransformerEncoderLayer`, :class:`TransformerDecoderLayer`,
:class:`TransformerEncoder`, :class:`TransformerDecoder` and :class:`Transformer` take torch's
constructor arguments in torch's order, hold torch's parameters under torch's names (their
``state_dict`` keys are torch's), and compute the forward pass of the torch module in
``eval()`` mode. Their attention blocks are :class:`attnx.MultiheadAttention` modules (the
layers' ``self_attn`` and ``multihead_attn``), with its rules for masks; their feed-forward
and normalization parameters are held by :class:`Linear` and :class:`LayerNorm`.

They are inference modules, as :class:`attnx.MultiheadAttention`: they start in training
mode, as torch's, with torch's default ``dropout=0.1``, and a call in training mode with
``dropout > 0`` raises NotImplementedError: call ``.eval()`` first, as inference in torch
needs too (or construct with ``dropout=0.0``).

With a key padding mask (``src_key_padding_mask``, ``tgt_key_padding_mask``), the layers run on
the real tokens only: a stack packs them once at its entry, every layer works on them, and it
unpacks them once at its exit. The outputs at padded positions are exactly 0, as torch's
nested-tensor path gives them (before a stack's final norm, which torch then applies to them).
Padding may be anywhere in a sequence; a fully padded sequence gives zeros. Where the packed
tokens cannot express a call (an attention mask other than the causal one, a float padding mask
of other values than 0 and -inf, ``memory_mask`` or ``memory_is_causal`` with padding), the
padded batch runs with its masks and the padded outputs are then set to 0. A
``Transformer`` whose ``src`` is padded gives its decoder a memory with zero rows at the
padding, which the cross-attention attends unless ``memory_key_padding_mask`` is given (then
it reads the real memory rows only), as torch's nested-tensor encoder gives it.

Masks are read as :class:`attnx.MultiheadAttention` reads them: a float mask is added to the
scores. (torch's encoder fast path, taken in eval mode with ``batch_first``, an even ``nhead``
and no grad, reads a float mask as a bool one: nonzero means masked.)
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _layers
from ._arrays import as_bool_flag, as_positive_int, shape_str
from ._layer_parts import (
    LayerNorm,
    Linear,
    _attn_mask,
    _detect_is_causal,
    _lengths,
    _Module,
    _padding_mask,
    _result,
    _sequence,
    _square_size,
    _xavier_uniform,
)
from ._transformer_layers import (
    TransformerDecoderLayer,
    TransformerEncoderLayer,
    _check_batches,
    _decoder_masks,
    _memory,
)
from .cache import TransformerDecoderCache
from .modules import _check_device, _module_dtype

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import ActivationFunction, FloatArray, Precision, TorchDevice, TorchDType

__all__ = [
    "LayerNorm",
    "Linear",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]


def _precisions(layers: list[Any], precision: Any) -> list[int]:
    """The core's code of the precision of each layer's call: the call's ``precision`` for
    every layer, or each layer's own for None."""
    if precision is None:
        return [layer._precision for layer in layers]
    return [layer._call_precision(precision) for layer in layers]


def _common_precision(layers: list[Any]) -> Precision | None:
    """The layers' precision where they share one, else None."""
    names = {layer.precision for layer in layers}
    return names.pop() if len(names) == 1 else None


class _Stack(_Module):
    """What the encoder and decoder stacks share: their layers, final norm and torch's copies."""

    layers: list[Any]
    num_layers: int
    norm: LayerNorm | None

    @property
    def precision(self) -> Precision | None:
        """The layers' precision, None where they differ; setting it sets every layer's.

        A call with ``precision=None`` computes each layer with its own.
        """
        return _common_precision(self.layers)

    @precision.setter
    def precision(self, value: Precision) -> None:
        for layer in self.layers:
            layer._call_precision(value)  # every layer checked before any is changed
        for layer in self.layers:
            layer.precision = value

    def _stack(self, layer: Any, kind: type, num_layers: Any, norm: Any, precision: Any = None) -> None:
        if not isinstance(layer, kind):
            raise TypeError(f"{type(self).__name__} needs an attnx.{kind.__name__}, got {type(layer).__name__}")
        if norm is not None and not isinstance(norm, LayerNorm):
            raise TypeError(f"norm must be None or an attnx.transformer.LayerNorm, got {type(norm).__name__}")
        self.training = True
        self.num_layers = as_positive_int(num_layers, "num_layers")
        # torch's _get_clones: deep copies, so that every layer starts with the same parameters.
        self.layers = [copy.deepcopy(layer) for _ in range(self.num_layers)]
        self.norm = norm
        if precision is not None:
            self.precision = precision

    def _children(self) -> list[tuple[str, Any]]:
        children: list[tuple[str, Any]] = [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]
        if self.norm is not None:
            children.append(("norm", self.norm))
        return children

    @classmethod
    def _copy_of_torch(cls, module: Any, kind: Any, activation: Any, precision: Any) -> Any:
        layers = getattr(module, "layers", None)
        if layers is None or not callable(getattr(module, "state_dict", None)) or not hasattr(module, "norm"):
            raise TypeError(f"from_torch expects a torch.nn.{cls.__name__}, got {type(module).__name__}")
        copies = [kind.from_torch(layer, activation=activation, precision=precision) for layer in layers]
        if not copies:
            raise ValueError(f"from_torch: the torch {type(module).__name__} has no layers")
        norm = None if module.norm is None else LayerNorm.from_torch(module.norm)
        new = cls.__new__(cls)
        new._stack(copies[0], kind, 1, norm)
        new.layers = copies  # each its own parameters, as the torch module's
        new.num_layers = len(copies)
        new.training = bool(getattr(module, "training", False))
        return new

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_layers={len(self.layers)}, layer={self.layers[0]!r}, norm={self.norm!r})"


class TransformerEncoder(_Stack):
    """A stack of encoder layers and an optional final norm, as ``torch.nn.TransformerEncoder``.

    Parameters
    ----------
    encoder_layer : TransformerEncoderLayer
        Copied ``num_layers`` times (deep copies, as torch's: the layers start equal).
    num_layers : int
        Number of layers, at least 1.
    norm : LayerNorm, optional
        Applied to the last layer's output (an ``attnx.transformer.LayerNorm``).
    enable_nested_tensor : bool, default True
        torch's argument, kept as an attribute; it changes nothing (attnx always runs a padded
        batch on its real tokens, as torch's nested tensors do).
    mask_check : bool, default True
        torch's argument, kept as an attribute; it changes nothing.
    precision : {None, "float32", "bfloat16"}, default None
        Keyword-only. Sets every layer's precision; None keeps ``encoder_layer``'s.

    Attributes
    ----------
    layers : list of TransformerEncoderLayer
    num_layers : int
    norm : LayerNorm or None
    training : bool
    precision : {"float32", "bfloat16"} or None
        The layers' precision (None where they differ); setting it sets every layer's.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> layer = attnx.TransformerEncoderLayer(16, 4, 32, batch_first=True, seed=0)
    >>> encoder = attnx.TransformerEncoder(layer, 3, norm=attnx.transformer.LayerNorm(16)).eval()
    >>> src = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    >>> mask = attnx.Transformer.generate_square_subsequent_mask(5)
    >>> encoder(src, mask=mask).shape
    (2, 5, 16)
    >>> list(encoder.state_dict())[-3:]
    ['layers.2.norm2.bias', 'norm.weight', 'norm.bias']
    """

    layers: list[TransformerEncoderLayer]
    enable_nested_tensor: bool
    mask_check: bool

    def __init__(
        self,
        encoder_layer: TransformerEncoderLayer,
        num_layers: int,
        norm: LayerNorm | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
        *,
        precision: Precision | None = None,
    ) -> None:
        self._stack(encoder_layer, TransformerEncoderLayer, num_layers, norm, precision)
        self.enable_nested_tensor = as_bool_flag(enable_nested_tensor, "enable_nested_tensor")
        self.mask_check = as_bool_flag(mask_check, "mask_check")

    def forward(
        self,
        src: npt.ArrayLike,
        mask: npt.ArrayLike | None = None,
        src_key_padding_mask: npt.ArrayLike | None = None,
        is_causal: bool | None = None,
        *,
        precision: Precision | None = None,
    ) -> FloatArray:
        """Each layer in turn, then the norm, as ``torch.nn.TransformerEncoder.forward`` in ``eval()`` mode.

        Parameters
        ----------
        src : array_like, shape (L, N, E), or (N, L, E) with ``batch_first``, or (L, E)
            Floating; converted to the layers' dtype, which is the result's.
        mask : array_like, shape (L, L) or (N * nhead, L, L), optional
            Every layer's ``src_mask``.
        src_key_padding_mask : array_like, shape (N, L), or (L,) unbatched, optional
            Every layer's padding mask.
        is_causal : bool, optional
            Every layer's ``is_causal``. None (the default) is True exactly when ``mask`` is
            the ``(L, L)`` causal mask (as torch detects it); the mask is used either way.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. Every layer's precision in this call; None is each layer's own.

        Returns
        -------
        ndarray, the shape of ``src``
            The output rows of padded positions are 0.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> encoder = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(8, 2, 16, 0.0, seed=0), 2)
        >>> src = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)   # unbatched
        >>> encoder(src, is_causal=True).shape
        (4, 8)
        """
        first = self.layers[0]
        x, batched = _sequence(src, "src", first.dtype, first.d_model, first.batch_first)
        return _result(self._encode(x, batched, mask, src_key_padding_mask, is_causal, precision), batched,
                       first.batch_first, first.dtype)

    __call__ = forward

    def _encode(self, x: np.ndarray[Any, Any], batched: bool, mask: Any, src_key_padding_mask: Any,
                is_causal: Any, precision: Any = None) -> np.ndarray[Any, Any]:
        """The stack on a checked, batched ``src`` in the compute dtype; the result likewise."""
        first = self.layers[0]
        N, L = _lengths(x, first.batch_first)
        attn_mask = _attn_mask(mask, "mask", N, first.self_attn.num_heads, L, L, batched)
        padding = _padding_mask(src_key_padding_mask, "src_key_padding_mask", N, L, batched)
        causal = _detect_is_causal(attn_mask, is_causal, L, "is_causal")
        for layer in self.layers:
            layer._check_inference()
        # The final norm goes into the last layer's call (one pass over its rows).
        return _layers.encode(self.layers, self.norm, x, attn_mask, padding, causal,
                              _precisions(self.layers, precision))

    @classmethod
    def from_torch(cls, module: Any, *, activation: str | ActivationFunction | None = None,
                   precision: Precision | None = None) -> TransformerEncoder:
        """An attnx encoder with the layers, norm and parameters of a ``torch.nn.TransformerEncoder``.

        Parameters
        ----------
        module : torch.nn.TransformerEncoder
            Its layers must be ``torch.nn.TransformerEncoderLayer`` and its norm (if any) a
            ``torch.nn.LayerNorm``.
        activation : {"relu", "gelu"} or callable, optional
            Keyword-only. Every layer's activation, as in
            :meth:`TransformerEncoderLayer.from_torch`.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. Every layer's ``precision``.

        Returns
        -------
        TransformerEncoder
            Each layer a copy of torch's (:meth:`TransformerEncoderLayer.from_torch`).

        Examples
        --------
        >>> import torch, attnx
        >>> layer = torch.nn.TransformerEncoderLayer(16, 4, 32)
        >>> module = torch.nn.TransformerEncoder(layer, 2, torch.nn.LayerNorm(16), enable_nested_tensor=False)
        >>> attnx.TransformerEncoder.from_torch(module.eval())
        TransformerEncoder(num_layers=2, layer=TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.1, dtype=float32), norm=LayerNorm((16,), eps=1e-05, elementwise_affine=True, bias=True))
        """
        new = cls._copy_of_torch(module, TransformerEncoderLayer, activation, precision)
        new.enable_nested_tensor = bool(getattr(module, "enable_nested_tensor", True))
        new.mask_check = bool(getattr(module, "mask_check", True))
        return new  # type: ignore[no-any-return]


class TransformerDecoder(_Stack):
    """A stack of decoder layers and an optional final norm, as ``torch.nn.TransformerDecoder``.

    Parameters
    ----------
    decoder_layer : TransformerDecoderLayer
        Copied ``num_layers`` times (deep copies, as torch's: the layers start equal).
    num_layers : int
        Number of layers, at least 1.
    norm : LayerNorm, optional
        Applied to the last layer's output (an ``attnx.transformer.LayerNorm``).
    precision : {None, "float32", "bfloat16"}, default None
        Keyword-only. Sets every layer's precision; None keeps ``decoder_layer``'s.

    Attributes
    ----------
    layers : list of TransformerDecoderLayer
    num_layers : int
    norm : LayerNorm or None
    training : bool
    precision : {"float32", "bfloat16"} or None
        The layers' precision (None where they differ); setting it sets every layer's.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> layer = attnx.TransformerDecoderLayer(16, 4, 32, dropout=0.0, seed=0)
    >>> decoder = attnx.TransformerDecoder(layer, 2)
    >>> rng = np.random.default_rng(0)
    >>> tgt, memory = rng.standard_normal((3, 2, 16)), rng.standard_normal((7, 2, 16))
    >>> decoder(tgt, memory, tgt_mask=attnx.Transformer.generate_square_subsequent_mask(3)).shape
    (3, 2, 16)
    """

    layers: list[TransformerDecoderLayer]

    def __init__(
        self,
        decoder_layer: TransformerDecoderLayer,
        num_layers: int,
        norm: LayerNorm | None = None,
        *,
        precision: Precision | None = None,
    ) -> None:
        self._stack(decoder_layer, TransformerDecoderLayer, num_layers, norm, precision)

    def forward(
        self,
        tgt: npt.ArrayLike,
        memory: npt.ArrayLike,
        tgt_mask: npt.ArrayLike | None = None,
        memory_mask: npt.ArrayLike | None = None,
        tgt_key_padding_mask: npt.ArrayLike | None = None,
        memory_key_padding_mask: npt.ArrayLike | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
        *,
        precision: Precision | None = None,
    ) -> FloatArray:
        """Each layer in turn, then the norm, as ``torch.nn.TransformerDecoder.forward`` in ``eval()`` mode.

        Parameters
        ----------
        tgt : array_like, shape (T, N, E), or (N, T, E) with ``batch_first``, or (T, E)
            Floating; converted to the layers' dtype, which is the result's.
        memory : array_like, shape (S, N, E), or (N, S, E) with ``batch_first``, or (S, E)
            The encoder's output, attended by every layer.
        tgt_mask : array_like, shape (T, T) or (N * nhead, T, T), optional
        memory_mask : array_like, shape (T, S) or (N * nhead, T, S), optional
        tgt_key_padding_mask : array_like, shape (N, T), or (T,) unbatched, optional
        memory_key_padding_mask : array_like, shape (N, S), or (S,) unbatched, optional
            Every layer's masks, as :meth:`TransformerDecoderLayer.forward` reads them.
        tgt_is_causal : bool, optional
            Every layer's ``tgt_is_causal``. None (the default) is True exactly when
            ``tgt_mask`` is the ``(T, T)`` causal mask (as torch detects it).
        memory_is_causal : bool, default False
            Every layer's ``memory_is_causal``.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. Every layer's precision in this call; None is each layer's own.

        Returns
        -------
        ndarray, the shape of ``tgt``

        Examples
        --------
        >>> import numpy as np, attnx
        >>> decoder = attnx.TransformerDecoder(attnx.TransformerDecoderLayer(8, 2, 16, 0.0, seed=0), 2)
        >>> rng = np.random.default_rng(0)
        >>> decoder(rng.standard_normal((3, 8)), rng.standard_normal((5, 8)), tgt_is_causal=True).shape
        (3, 8)
        """
        first = self.layers[0]
        x, batched = _sequence(tgt, "tgt", first.dtype, first.d_model, first.batch_first)
        mem = _memory(memory, x, batched, np.shape(tgt), first)
        out = self._decode(x, mem, batched, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                           tgt_is_causal, memory_is_causal, precision)
        return _result(out, batched, first.batch_first, first.dtype)

    __call__ = forward

    def _decode(self, x: np.ndarray[Any, Any], mem: np.ndarray[Any, Any], batched: bool, tgt_mask: Any,
                memory_mask: Any, tgt_key_padding_mask: Any, memory_key_padding_mask: Any, tgt_is_causal: Any,
                memory_is_causal: Any, precision: Any = None) -> np.ndarray[Any, Any]:
        """The stack on checked, batched ``tgt`` and ``memory`` in the compute dtype."""
        first = self.layers[0]
        masks = _decoder_masks(first, x, mem, batched, tgt_mask, memory_mask, tgt_key_padding_mask,
                               memory_key_padding_mask)
        causal = _detect_is_causal(masks[0], tgt_is_causal, _lengths(x, first.batch_first)[1], "tgt_is_causal")
        memory_causal = as_bool_flag(memory_is_causal, "memory_is_causal")
        for layer in self.layers:
            layer._check_inference()
        return _layers.decode(self.layers, self.norm, x, mem, *masks, causal, memory_causal,
                              _precisions(self.layers, precision))

    def new_cache(self, batch: int, max_len: int, dtype: npt.DTypeLike = np.float32) -> TransformerDecoderCache:
        """A decoding state for :meth:`step`: room for ``max_len`` tokens of ``batch`` sequences.

        Parameters
        ----------
        batch : int
            Sequences decoded together (an unbatched ``tgt`` needs 1).
        max_len : int
            Tokens each sequence can hold.
        dtype : {numpy.float32, numpy.float64, numpy.float16, "bfloat16", numpy.int8}, default numpy.float32
            Storage dtype of the cached keys and values (see :class:`attnx.KVCache`).

        Returns
        -------
        TransformerDecoderCache
            One :class:`attnx.KVCache` per layer, empty.
        """
        first = self.layers[0]
        H = first.self_attn.num_heads
        return TransformerDecoderCache(len(self.layers), batch, H, max_len, first.d_model // H, dtype)

    def step(
        self,
        tgt: npt.ArrayLike,
        memory: npt.ArrayLike,
        cache: TransformerDecoderCache,
        memory_key_padding_mask: npt.ArrayLike | None = None,
        memory_mask: npt.ArrayLike | None = None,
        *,
        precision: Precision | None = None,
    ) -> FloatArray:
        """Decode the new positions ``tgt`` over the positions ``cache`` holds.

        Equal to :meth:`forward` with the causal ``tgt_mask`` over all the positions so far, at
        the new ones: each layer's self-attention attends the cached keys and values and those
        of the new positions up to its own, which are appended to the cache.

        Parameters
        ----------
        tgt : array_like, shape (T, N, E), or (N, T, E) with ``batch_first``, or (T, E)
            The new positions' inputs (T of them per sequence, one or more).
        memory : array_like, shape (S, N, E), or (N, S, E) with ``batch_first``, or (S, E)
            The encoder's output. Its keys and values are projected at the first step and kept
            in the cache while the steps' memory has the same values.
        cache : TransformerDecoderCache
            From :meth:`new_cache`, with room for T more positions in every sequence.
        memory_key_padding_mask : array_like, shape (N, S), or (S,) unbatched, optional
            True (or -inf) for the memory's padding, as in :meth:`forward`.
        memory_mask : array_like, shape (T, S) or (N * nhead, T, S), optional
            The new positions' rows of :meth:`forward`'s ``memory_mask``.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. Every layer's precision in this step; None is each layer's own.
            The memory's keys and values are projected again when it changes.

        Returns
        -------
        ndarray, the shape of ``tgt``
            The decoder's output (after its norm) at the new positions.

        Raises
        ------
        ValueError
            A cache too short, or not this decoder's; shapes that do not match. Nothing is
            appended to the cache by a step that fails.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> layer = attnx.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True, seed=0)
        >>> decoder = attnx.TransformerDecoder(layer, 2).eval()
        >>> rng = np.random.default_rng(0)
        >>> tgt, memory = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 16))
        >>> cache = decoder.new_cache(2, max_len=8)
        >>> first = decoder.step(tgt[:, :4], memory, cache)       # a prompt of 4 positions
        >>> fifth = decoder.step(tgt[:, 4:], memory, cache)       # then one at a time
        >>> full = decoder(tgt, memory, tgt_mask=attnx.Transformer.generate_square_subsequent_mask(5))
        >>> bool(np.allclose(fifth, full[:, 4:], atol=1e-5)), cache.lengths
        (True, array([5, 5]))
        """
        if not isinstance(cache, TransformerDecoderCache):
            raise TypeError(f"cache must be an attnx.TransformerDecoderCache (from new_cache), got {type(cache).__name__}")
        first = self.layers[0]
        H = first.self_attn.num_heads
        layout = (len(self.layers), H, first.d_model // H)
        if (len(cache.layers), cache.layers[0].num_kv_heads, cache.layers[0].head_dim) != layout:
            raise ValueError(
                f"cache holds {len(cache.layers)} layers of {cache.layers[0].num_kv_heads} heads of "
                f"{cache.layers[0].head_dim}; this decoder needs {layout[0]} of {layout[1]} of {layout[2]} "
                f"(make it with this decoder's new_cache)"
            )
        for layer in self.layers:
            layer._check_inference()
        codes = _precisions(self.layers, precision)
        x, batched = _sequence(tgt, "tgt", first.dtype, first.d_model, first.batch_first)
        mem = _memory(memory, x, batched, np.shape(tgt), first)
        (N, T), S = _lengths(x, first.batch_first), _lengths(mem, first.batch_first)[1]
        if N != cache.batch:
            raise ValueError(f"tgt {shape_str(np.shape(tgt))} has {N} sequences, the cache {cache.batch}")
        memory_mask = _attn_mask(memory_mask, "memory_mask", N, H, T, S, batched)
        padding = _padding_mask(memory_key_padding_mask, "memory_key_padding_mask", N, S, batched)
        cache.layers[0].check_room(np.full(N, T, np.int64))
        if T == 0:  # no positions: nothing to compute or append
            return _result(x, batched, first.batch_first, first.dtype)
        out = _layers.decoder_step(self, x, mem, cache, padding, memory_mask, codes)
        return _result(out, batched, first.batch_first, first.dtype)

    @classmethod
    def from_torch(cls, module: Any, *, activation: str | ActivationFunction | None = None,
                   precision: Precision | None = None) -> TransformerDecoder:
        """An attnx decoder with the layers, norm and parameters of a ``torch.nn.TransformerDecoder``.

        Parameters
        ----------
        module : torch.nn.TransformerDecoder
            Its layers must be ``torch.nn.TransformerDecoderLayer`` and its norm (if any) a
            ``torch.nn.LayerNorm``.
        activation : {"relu", "gelu"} or callable, optional
            Keyword-only. Every layer's activation, as in
            :meth:`TransformerEncoderLayer.from_torch`.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. Every layer's ``precision``.

        Returns
        -------
        TransformerDecoder

        Examples
        --------
        >>> import torch, attnx
        >>> module = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(16, 4, 32), 3)
        >>> len(attnx.TransformerDecoder.from_torch(module).layers)
        3
        """
        return cls._copy_of_torch(module, TransformerDecoderLayer, activation, precision)  # type: ignore[no-any-return]


class Transformer(_Module):
    """An encoder and a decoder, as ``torch.nn.Transformer``.

    ``forward(src, tgt)`` is ``decoder(tgt, encoder(src))``. The constructor takes torch's
    arguments in torch's order and builds what torch builds: a :class:`TransformerEncoder` of
    ``num_encoder_layers`` layers and a :class:`TransformerDecoder` of ``num_decoder_layers``,
    each with a final LayerNorm.

    Parameters
    ----------
    d_model : int, default 512
        Width of the inputs and of the output.
    nhead : int, default 8
        Number of attention heads.
    num_encoder_layers, num_decoder_layers : int, default 6
    dim_feedforward : int, default 2048
    dropout : float, default 0.1
        As :class:`TransformerEncoderLayer`'s: kept, never applied (call :meth:`eval`).
    activation : {"relu", "gelu"} or callable, default "relu"
        As :class:`TransformerEncoderLayer`'s.
    custom_encoder : TransformerEncoder, optional
        Used instead of a new encoder (its parameters are initialised again, as torch does).
    custom_decoder : TransformerDecoder, optional
        Used instead of a new decoder (likewise).
    layer_norm_eps : float, default 1e-5
    batch_first : bool, default False
    norm_first : bool, default False
    bias : bool, default True
    device : {None, "cpu"}, default None
    dtype : {None, numpy.float32, numpy.float64, numpy.float16, "bfloat16"}, default None
        As :class:`TransformerEncoderLayer`'s.
    seed : int, numpy.random.Generator or None, default None
        Keyword-only. Seed of ``np.random.default_rng`` for the initial parameters.
    precision : {None, "float32", "bfloat16"}, default None
        Keyword-only. Every layer's precision (None: ``"float32"`` for the layers built
        here, the custom encoder's and decoder's own for those), as
        :class:`TransformerEncoderLayer`'s.

    Attributes
    ----------
    encoder : TransformerEncoder
    decoder : TransformerDecoder
    d_model, nhead : int
    batch_first : bool
    training : bool
    precision : {"float32", "bfloat16"} or None
        The layers' precision (None where they differ); setting it sets every layer's.

    Notes
    -----
    As torch's ``_reset_parameters``, every parameter of more than one dimension (the
    attention and linear weights) is drawn again from ``xavier_uniform_``'s distribution,
    ``U(-b, b)`` with ``b = sqrt(6 / (fan_in + fan_out))``; biases and the LayerNorms keep
    their layers' initial values.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> model = attnx.Transformer(16, 4, 2, 2, 32, batch_first=True, seed=0).eval()
    >>> rng = np.random.default_rng(0)
    >>> src, tgt = rng.standard_normal((2, 7, 16)), rng.standard_normal((2, 3, 16))
    >>> tgt_mask = model.generate_square_subsequent_mask(3)
    >>> out = model(src, tgt, tgt_mask=tgt_mask)
    >>> out.shape, out.dtype
    ((2, 3, 16), dtype('float32'))
    >>> len(model.state_dict())
    64
    """

    encoder: TransformerEncoder
    decoder: TransformerDecoder
    d_model: int
    nhead: int
    batch_first: bool

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | ActivationFunction = "relu",
        custom_encoder: TransformerEncoder | None = None,
        custom_decoder: TransformerDecoder | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: str | TorchDevice | None = None,
        dtype: npt.DTypeLike | TorchDType | None = None,
        *,
        seed: int | np.random.Generator | None = None,
        precision: Precision | None = None,
    ) -> None:
        _check_device(device)
        self.training = True
        rng = np.random.default_rng(seed)
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first,
                      bias, device, dtype)
        if custom_encoder is None:
            encoder_layer = TransformerEncoderLayer(*layer_args, seed=rng, precision=precision)
            norm = LayerNorm(d_model, layer_norm_eps, bias=bias, dtype=encoder_layer.dtype)
            self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, norm)
        elif isinstance(custom_encoder, TransformerEncoder):
            self.encoder = custom_encoder
        else:
            raise TypeError(f"custom_encoder must be an attnx.TransformerEncoder, got {type(custom_encoder).__name__}")
        if custom_decoder is None:
            decoder_layer = TransformerDecoderLayer(*layer_args, seed=rng, precision=precision)
            norm = LayerNorm(d_model, layer_norm_eps, bias=bias, dtype=decoder_layer.dtype)
            self.decoder = TransformerDecoder(decoder_layer, num_decoder_layers, norm)
        elif isinstance(custom_decoder, TransformerDecoder):
            self.decoder = custom_decoder
        else:
            raise TypeError(f"custom_decoder must be an attnx.TransformerDecoder, got {type(custom_decoder).__name__}")
        if precision is not None:
            self.precision = precision  # the custom encoder's and decoder's layers too
        self._reset_parameters(rng)
        self.d_model = as_positive_int(d_model, "d_model")
        self.nhead = as_positive_int(nhead, "nhead")
        self.batch_first = as_bool_flag(batch_first, "batch_first")

    def _reset_parameters(self, rng: np.random.Generator) -> None:
        """torch's: xavier_uniform_ on every parameter of more than one dimension."""
        for _, owner, attr, shape in self._slots():
            if len(shape) > 1 and getattr(owner, attr) is not None:
                setattr(owner, attr, _xavier_uniform(rng, shape, owner.dtype))

    def _children(self) -> list[tuple[str, Any]]:
        return [("encoder", self.encoder), ("decoder", self.decoder)]

    @property
    def precision(self) -> Precision | None:
        """The layers' precision, None where they differ; setting it sets every layer's.

        A call with ``precision=None`` computes each layer with its own.
        """
        return _common_precision(self.encoder.layers + self.decoder.layers)

    @precision.setter
    def precision(self, value: Precision) -> None:
        for layer in self.encoder.layers + self.decoder.layers:
            layer._call_precision(value)  # every layer checked before any is changed
        self.encoder.precision = value
        self.decoder.precision = value

    def forward(
        self,
        src: npt.ArrayLike,
        tgt: npt.ArrayLike,
        src_mask: npt.ArrayLike | None = None,
        tgt_mask: npt.ArrayLike | None = None,
        memory_mask: npt.ArrayLike | None = None,
        src_key_padding_mask: npt.ArrayLike | None = None,
        tgt_key_padding_mask: npt.ArrayLike | None = None,
        memory_key_padding_mask: npt.ArrayLike | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
        *,
        precision: Precision | None = None,
    ) -> FloatArray:
        """``decoder(tgt, encoder(src))``, as ``torch.nn.Transformer.forward`` in ``eval()`` mode.

        Parameters
        ----------
        src : array_like, shape (S, N, E), or (N, S, E) with ``batch_first``, or (S, E)
            The encoder's input.
        tgt : array_like, shape (T, N, E), or (N, T, E) with ``batch_first``, or (T, E)
            The decoder's input: batched as ``src`` is, with its batch size.
        src_mask : array_like, shape (S, S) or (N * nhead, S, S), optional
            The encoder's ``mask``.
        tgt_mask : array_like, shape (T, T) or (N * nhead, T, T), optional
            The decoder's self-attention mask.
        memory_mask : array_like, shape (T, S) or (N * nhead, T, S), optional
            The decoder's mask of the attention to the encoder's output.
        src_key_padding_mask : array_like, shape (N, S), or (S,) unbatched, optional
        tgt_key_padding_mask : array_like, shape (N, T), or (T,) unbatched, optional
        memory_key_padding_mask : array_like, shape (N, S), or (S,) unbatched, optional
            Padding of ``src``, ``tgt`` and of the encoder's output; bool True means padding.
        src_is_causal : bool, optional
            The encoder's ``is_causal`` (None: detected from ``src_mask``).
        tgt_is_causal : bool, optional
            The decoder's ``tgt_is_causal`` (None: detected from ``tgt_mask``).
        memory_is_causal : bool, default False
            The decoder's ``memory_is_causal``.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. Every layer's precision in this call; None is each layer's own.

        Returns
        -------
        ndarray, the shape of ``tgt``
            In the model's dtype. The output rows of ``tgt``'s padded positions are 0.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> model = attnx.Transformer(8, 2, 1, 1, 16, dropout=0.0, seed=0)
        >>> rng = np.random.default_rng(0)
        >>> model(rng.standard_normal((5, 8)), rng.standard_normal((3, 8)), tgt_is_causal=True).shape
        (3, 8)
        """
        encoder_first, decoder_first = self.encoder.layers[0], self.decoder.layers[0]
        x, batched = _sequence(src, "src", encoder_first.dtype, self.d_model, encoder_first.batch_first)
        y, tgt_batched = _sequence(tgt, "tgt", decoder_first.dtype, self.d_model, decoder_first.batch_first)
        if batched != tgt_batched:
            raise ValueError(
                f"src and tgt must both be batched (3-D) or both unbatched (2-D): src {shape_str(np.shape(src))}, "
                f"tgt {shape_str(np.shape(tgt))}"
            )
        _check_batches(("src", np.shape(src), x), ("tgt", np.shape(tgt), y), self.batch_first)
        memory = self.encoder._encode(x, batched, src_mask, src_key_padding_mask, src_is_causal, precision)
        _check_batches(("tgt", np.shape(tgt), y), ("memory", memory.shape, memory), decoder_first.batch_first)
        memory = memory.astype(y.dtype, copy=False)
        out = self.decoder._decode(y, memory, batched, tgt_mask, memory_mask, tgt_key_padding_mask,
                                   memory_key_padding_mask, tgt_is_causal, memory_is_causal, precision)
        return _result(out, batched, decoder_first.batch_first, decoder_first.dtype)

    __call__ = forward

    @staticmethod
    def generate_square_subsequent_mask(
        sz: int,
        device: str | TorchDevice | None = None,
        dtype: npt.DTypeLike | TorchDType | None = None,
    ) -> FloatArray:
        """The ``(sz, sz)`` causal mask: 0 on and below the diagonal, -inf above it, as torch's.

        Parameters
        ----------
        sz : int
            The sequence length, >= 0.
        device : {None, "cpu"}, default None
            As torch's argument.
        dtype : {None, numpy.float32, numpy.float64, numpy.float16, "bfloat16"}, default None
            None is float32, as torch's default.

        Returns
        -------
        ndarray, shape (sz, sz)

        Examples
        --------
        >>> import attnx
        >>> attnx.Transformer.generate_square_subsequent_mask(3)
        array([[  0., -inf, -inf],
               [  0.,   0., -inf],
               [  0.,   0.,   0.]], dtype=float32)
        """
        _check_device(device)
        n = _square_size(sz)
        above = np.triu(np.ones((n, n), dtype=bool), 1)
        return np.where(above, -np.inf, 0.0).astype(_module_dtype(dtype))

    @classmethod
    def from_torch(cls, module: Any, *, activation: str | ActivationFunction | None = None,
                   precision: Precision | None = None) -> Transformer:
        """An attnx model with the encoder, decoder and parameters of a ``torch.nn.Transformer``.

        Parameters
        ----------
        module : torch.nn.Transformer
            Its encoder and decoder must be torch's TransformerEncoder and TransformerDecoder.
        activation : {"relu", "gelu"} or callable, optional
            Keyword-only. Every layer's activation, as in
            :meth:`TransformerEncoderLayer.from_torch`.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. Every layer's ``precision``.

        Returns
        -------
        Transformer
            With copies of the torch model's encoder and decoder
            (:meth:`TransformerEncoder.from_torch`, :meth:`TransformerDecoder.from_torch`),
            its ``d_model``, ``nhead``, ``batch_first`` and training flag.

        Examples
        --------
        >>> import warnings, numpy as np, torch, attnx
        >>> with warnings.catch_warnings():          # torch warns that it uses no nested tensors
        ...     warnings.simplefilter("ignore")
        ...     module = torch.nn.Transformer(16, 4, 2, 2, 32, batch_first=True).eval()
        >>> model = attnx.Transformer.from_torch(module)
        >>> rng = np.random.default_rng(0)
        >>> src, tgt = rng.standard_normal((2, 7, 16), np.float32), rng.standard_normal((2, 3, 16), np.float32)
        >>> with torch.inference_mode():
        ...     expected = module(torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
        >>> bool(np.allclose(model(src, tgt), expected, atol=1e-5))
        True
        """
        lacking = [n for n in ("encoder", "decoder", "d_model", "nhead", "batch_first") if not hasattr(module, n)]
        if lacking:
            raise TypeError(f"from_torch expects a torch.nn.Transformer, got {type(module).__name__} "
                            f"(lacking {', '.join(lacking)})")
        new = cls.__new__(cls)
        new.encoder = TransformerEncoder.from_torch(module.encoder, activation=activation, precision=precision)
        new.decoder = TransformerDecoder.from_torch(module.decoder, activation=activation, precision=precision)
        new.d_model = int(module.d_model)
        new.nhead = int(module.nhead)
        new.batch_first = bool(module.batch_first)
        new.training = bool(getattr(module, "training", False))
        return new

    def __repr__(self) -> str:
        layer = self.encoder.layers[0]
        args = [f"d_model={self.d_model}", f"nhead={self.nhead}", f"num_encoder_layers={len(self.encoder.layers)}",
                f"num_decoder_layers={len(self.decoder.layers)}"]
        if self.batch_first:
            args.append("batch_first=True")
        args.append(f"dtype={layer.dtype.name}")
        precision = self.precision  # (None where the layers differ: their reprs tell)
        if precision not in (None, "float32"):
            args.append(f"precision={precision!r}")
        return f"Transformer({', '.join(args)})"
