"""The layers of :mod:`attnx.transformer`: torch's ``TransformerEncoderLayer`` and ``TransformerDecoderLayer``.

The classes are exported by :mod:`attnx.transformer` and :mod:`attnx`; see there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _layers
from ._arrays import as_bool_flag, as_positive_int, check_heads, shape_str
from ._layer_parts import (
    LayerNorm,
    Linear,
    _activation,
    _attn_mask,
    _from_torch_activation,
    _layer_norm_eps,
    _lengths,
    _Module,
    _padding_mask,
    _result,
    _sequence,
    _torch_parameter_dtype,
)
from ._arrays import PRECISION_NAMES
from .modules import MultiheadAttention, _check_device, _module_dtype, module_precision

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import ActivationFunction, FloatArray, Precision, TorchDevice, TorchDType

__all__ = ["TransformerDecoderLayer", "TransformerEncoderLayer"]

_DROPOUT_MESSAGE = (
    "{name} with dropout={dropout} in training mode: attnx is an inference library: "
    "call .eval() or use dropout=0.0"
)


def _torch_activation(module: Any, activation: str | ActivationFunction | None) -> str | ActivationFunction:
    """The activation of a copy of a torch layer: `activation` where given, else torch's as a name."""
    if activation is not None:
        return _activation(activation)
    named = _from_torch_activation(getattr(module, "activation", None))
    if named is None:
        raise ValueError(
            f"from_torch: the torch layer's activation {getattr(module, 'activation', None)!r} has no attnx "
            f"counterpart (attnx knows torch's relu and exact gelu): pass activation= a callable on NumPy "
            f"arrays to from_torch, or construct the attnx layer with activation= and call its load_state_dict"
        )
    return named


class _TransformerLayer(_Module):
    """What the encoder and decoder layers share: construction, modes, layout, torch's copies."""

    self_attn: MultiheadAttention
    linear1: Linear
    linear2: Linear
    norm1: LayerNorm
    norm2: LayerNorm
    norm_first: bool
    activation: str | ActivationFunction
    dropout: float
    dtype: np.dtype[Any]
    precision: Precision
    _precision: int

    # Names of the attention modules and of the norms, in torch's order.
    _ATTENTIONS: tuple[str, ...] = ("self_attn",)
    _NORMS: tuple[str, ...] = ("norm1", "norm2")

    def _build(
        self,
        d_model: Any,
        nhead: Any,
        dim_feedforward: Any,
        dropout: Any,
        activation: Any,
        layer_norm_eps: Any,
        batch_first: Any,
        norm_first: Any,
        bias: Any,
        device: Any,
        dtype: Any,
        seed: Any,
        precision: Any,
    ) -> None:
        """torch's modules of the layer, drawn in torch's order from ``default_rng(seed)``."""
        _check_device(device)
        self.training = True  # torch's modules start in training mode
        self.dropout = dropout  # checked by __setattr__
        d_model = as_positive_int(d_model, "d_model")
        nhead = as_positive_int(nhead, "nhead")
        check_heads(d_model, nhead)
        dim_feedforward = as_positive_int(dim_feedforward, "dim_feedforward")
        self.activation = _activation(activation)
        eps = _layer_norm_eps(layer_norm_eps)
        batch_first = as_bool_flag(batch_first, "batch_first")
        self.norm_first = as_bool_flag(norm_first, "norm_first")
        bias = as_bool_flag(bias, "bias")
        self.dtype = _module_dtype(dtype)
        rng = np.random.default_rng(seed)
        for name in self._ATTENTIONS:
            mha = MultiheadAttention(d_model, nhead, self.dropout, bias, batch_first=batch_first, dtype=self.dtype,
                                     seed=rng)
            setattr(self, name, mha)
        self.linear1 = Linear(d_model, dim_feedforward, bias, dtype=self.dtype, seed=rng)
        self.linear2 = Linear(dim_feedforward, d_model, bias, dtype=self.dtype, seed=rng)
        for name in self._NORMS:
            setattr(self, name, LayerNorm(d_model, eps, bias=bias, dtype=self.dtype))
        self.precision = "float32" if precision is None else precision  # checked by __setattr__

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "precision":
            # Checked here; the layer's attention modules compute with it too when called alone.
            code = module_precision(self, value)
            value = PRECISION_NAMES[code]
            for attention in self._ATTENTIONS:
                getattr(self, attention).precision = value
            object.__setattr__(self, "_precision", code)
        super().__setattr__(name, value)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickles of versions without precision: the default.
        self.__dict__.update({"precision": "float32", "_precision": 0, **state})

    def _call_precision(self, precision: Any) -> int:
        """The core's code of a call's ``precision``: None is the layer's."""
        return self._precision if precision is None else module_precision(self, precision)

    def _children(self) -> list[tuple[str, Any]]:
        names = self._ATTENTIONS + ("linear1", "linear2") + self._NORMS
        return [(name, getattr(self, name)) for name in names]

    @property
    def batch_first(self) -> bool:
        """Inputs and output are ``(N, L, E)`` instead of ``(L, N, E)``: ``self_attn.batch_first``.

        Setting it sets the ``batch_first`` of the layer's attention modules.
        """
        return self.self_attn.batch_first

    @batch_first.setter
    def batch_first(self, value: bool) -> None:
        value = as_bool_flag(value, "batch_first")
        for name in self._ATTENTIONS:
            getattr(self, name).batch_first = value

    @property
    def d_model(self) -> int:
        """Width of the inputs and of the output: ``self_attn.embed_dim``."""
        return self.self_attn.embed_dim

    def _check_inference(self) -> None:
        """NotImplementedError where torch would apply dropout: training mode with dropout > 0."""
        if self.training and self.dropout:
            raise NotImplementedError(_DROPOUT_MESSAGE.format(name=type(self).__name__, dropout=self.dropout))
        for name in self._ATTENTIONS:
            mha = getattr(self, name)
            if mha.training and mha.dropout:
                raise NotImplementedError(
                    _DROPOUT_MESSAGE.format(name=f"{type(self).__name__}.{name}", dropout=mha.dropout)
                )

    @classmethod
    def _copy_of_torch(cls, module: Any, activation: str | ActivationFunction | None, precision: Any) -> Any:
        names = cls._ATTENTIONS + ("linear1", "linear2") + cls._NORMS
        lacking = [n for n in names + ("norm_first",) if not hasattr(module, n)]
        if lacking or not callable(getattr(module, "state_dict", None)):
            raise TypeError(
                f"from_torch expects a torch.nn.{cls.__name__}, got {type(module).__name__} "
                f"(lacking {', '.join(lacking) or 'state_dict()'})"
            )
        attention = module.self_attn
        # torch's layer has Dropout modules of the one `dropout` argument: the largest p of
        # theirs is the layer's (any p > 0 means dropout in training mode).
        dropouts = [float(getattr(getattr(module, n, None), "p", 0.0)) for n in ("dropout", "dropout1", "dropout2",
                                                                                 "dropout3")]
        new = cls(
            int(attention.embed_dim),
            int(attention.num_heads),
            int(module.linear1.out_features),
            max(dropouts),
            _torch_activation(module, activation),
            float(module.norm1.eps),
            bool(attention.batch_first),
            bool(module.norm_first),
            module.linear1.bias is not None,
            dtype=_torch_parameter_dtype(module.linear1.weight),
            seed=0,  # every parameter is overwritten just below
            precision=precision,
        )
        for name in cls._NORMS:
            getattr(new, name).eps = _layer_norm_eps(float(getattr(module, name).eps))
        new.load_state_dict(module.state_dict())
        new.train(bool(getattr(module, "training", False)))
        for name in cls._ATTENTIONS:
            torch_mha, mha = getattr(module, name), getattr(new, name)
            mha.dropout = float(getattr(torch_mha, "dropout", 0.0))
            mha.training = bool(getattr(torch_mha, "training", False))
        return new

    def __repr__(self) -> str:
        args = [f"d_model={self.d_model}", f"nhead={self.self_attn.num_heads}",
                f"dim_feedforward={self.linear1.out_features}", f"dropout={self.dropout}"]
        if self.activation != "relu":
            args.append(f"activation={self.activation!r}")
        if self.norm1.eps != 1e-5:
            args.append(f"layer_norm_eps={self.norm1.eps}")
        if self.batch_first:
            args.append("batch_first=True")
        if self.norm_first:
            args.append("norm_first=True")
        if self.linear1.bias is None:
            args.append("bias=False")
        args.append(f"dtype={self.dtype.name}")
        if self._precision:
            args.append(f"precision={self.precision!r}")
        return f"{type(self).__name__}({', '.join(args)})"


_LAYER_PARAMETERS = """
    Parameters
    ----------
    d_model : int
        Width ``E`` of the inputs and of the output.
    nhead : int
        Number of attention heads; must divide ``d_model``.
    dim_feedforward : int, default 2048
        Width of the feed-forward block's hidden layer.
    dropout : float, default 0.1
        torch's dropout probability, kept (and copied by ``from_torch``) but never applied:
        a call in training mode with ``dropout > 0`` raises NotImplementedError (call
        :meth:`eval` first, as for inference with torch); in ``eval()`` mode it is ignored.
    activation : {"relu", "gelu"} or callable, default "relu"
        The feed-forward activation: ReLU, the exact (erf) GELU, or a function of a NumPy
        array (float32 or float64) that returns an array of the same shape. torch's
        ``F.relu``, ``F.gelu``, ``nn.ReLU()`` and ``nn.GELU()`` are read as "relu" and "gelu".
    layer_norm_eps : float, default 1e-5
        The eps of the layer's LayerNorms.
    batch_first : bool, default False
        Inputs and output are ``(N, L, E)`` instead of ``(L, N, E)``.
    norm_first : bool, default False
        Pre-norm: each block normalizes its input (``x + block(norm(x))``) instead of the
        sum (``norm(x + block(x))``).
    bias : bool, default True
        The linear layers, the attention projections and the LayerNorms have biases.
    device : {None, "cpu"}, default None
        As torch's argument (attnx computes on the CPU; other devices raise ValueError).
    dtype : {None, numpy.float32, numpy.float64, numpy.float16, "bfloat16"}, default None
        Dtype of the parameters, of the inputs (converted to it) and of the result; None is
        float32. As :class:`attnx.MultiheadAttention`'s: float16 and bfloat16 are storage
        dtypes, computed in float32.
    seed : int, numpy.random.Generator or None, default None
        Keyword-only. Seed of ``np.random.default_rng`` for the initial parameters.
    precision : {None, "float32", "bfloat16"}, default None
        Keyword-only. The precision of the layer's products (None is ``"float32"``), also
        set on its attention modules; a call's ``precision=`` overrides it. ``"bfloat16"``
        rounds the operands of every product (the attention's projections, scores and
        probabilities, the feed-forward's inputs and weights) to bfloat16, with float32
        sums; norms, activations, biases and the softmax stay float32. Not for float64
        layers. The weights are rounded once per parameter set, as
        :class:`attnx.MultiheadAttention`'s.
"""


class TransformerEncoderLayer(_TransformerLayer):
    """Self-attention and a feed-forward block, as ``torch.nn.TransformerEncoderLayer``.

    Post-norm (the default): ``x = norm1(x + self_attn(x))``, then
    ``x = norm2(x + linear2(activation(linear1(x))))``; with ``norm_first``:
    ``x = x + self_attn(norm1(x))``, then ``x = x + linear2(activation(linear1(norm2(x))))``.
    The constructor takes torch's arguments in torch's order.
    {parameters}
    Attributes
    ----------
    self_attn : MultiheadAttention
        The self-attention (``d_model``, ``nhead``, ``bias``, ``batch_first``).
    linear1, linear2 : Linear
        The feed-forward block: ``(dim_feedforward, d_model)`` and ``(d_model, dim_feedforward)``
        weights.
    norm1, norm2 : LayerNorm
    activation : str or callable
        "relu", "gelu" or the callable given.
    norm_first, batch_first : bool
    dropout : float
    training : bool
        True after construction, as torch's; :meth:`eval` and :meth:`train` set it (and the
        submodules').

    Notes
    -----
    Initialisation follows torch's distributions: the attention as
    :class:`attnx.MultiheadAttention`'s, the linear layers' weights and biases
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, the LayerNorms' weights ones and biases zeros.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> layer = attnx.TransformerEncoderLayer(16, 4, 32, batch_first=True, seed=0).eval()
    >>> src = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    >>> layer(src).shape
    (2, 5, 16)
    >>> padding = np.array([[False] * 5, [False, False, False, True, True]])
    >>> layer(src, src_key_padding_mask=padding, is_causal=True).shape
    (2, 5, 16)

    A module of torch's defaults (``dropout=0.1``) computes in ``eval()`` mode only:

    >>> attnx.TransformerEncoderLayer(16, 4, 32)(src)
    Traceback (most recent call last):
        ...
    NotImplementedError: TransformerEncoderLayer with dropout=0.1 in training mode: attnx is an inference library: call .eval() or use dropout=0.0
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | ActivationFunction = "relu",
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
        self._build(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first,
                    bias, device, dtype, seed, precision)

    def forward(
        self,
        src: npt.ArrayLike,
        src_mask: npt.ArrayLike | None = None,
        src_key_padding_mask: npt.ArrayLike | None = None,
        is_causal: bool = False,
        *,
        precision: Precision | None = None,
    ) -> FloatArray:
        """The layer's output, as ``torch.nn.TransformerEncoderLayer.forward`` in ``eval()`` mode.

        Parameters
        ----------
        src : array_like, shape (L, N, E), or (N, L, E) with ``batch_first``, or (L, E)
            Floating; converted to the module's dtype, which is the result's.
        src_mask : array_like, shape (L, L) or (N * nhead, L, L), optional
            bool: True means *not* allowed to attend; float: added to the scores.
        src_key_padding_mask : array_like, shape (N, L), or (L,) unbatched, optional
            bool: True means the key is padding (ignored); float: added to the scores.
        is_causal : bool, default False
            Without ``src_mask``: query ``i`` attends keys ``j <= i`` (torch needs the mask
            as well). With ``src_mask``: a hint that the mask is causal; the mask is used.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. This call's precision; None is the layer's.

        Returns
        -------
        ndarray, the shape of ``src``
            The output rows of padded positions are 0.

        Raises
        ------
        NotImplementedError
            In training mode with ``dropout > 0`` (call :meth:`eval`).

        Examples
        --------
        >>> import numpy as np, attnx
        >>> layer = attnx.TransformerEncoderLayer(8, 2, 16, dropout=0.0, seed=0)
        >>> src = np.random.default_rng(0).standard_normal((4, 8))      # unbatched (L, E)
        >>> mask = attnx.Transformer.generate_square_subsequent_mask(4)
        >>> out = layer(src, src_mask=mask)
        >>> out.shape, out.dtype
        ((4, 8), dtype('float32'))
        >>> bool(np.allclose(layer(src, is_causal=True), out))
        True
        """
        self._check_inference()
        code = self._call_precision(precision)
        x, batched = _sequence(src, "src", self.dtype, self.d_model, self.batch_first)
        N, L = _lengths(x, self.batch_first)
        mask = _attn_mask(src_mask, "src_mask", N, self.self_attn.num_heads, L, L, batched)
        padding = _padding_mask(src_key_padding_mask, "src_key_padding_mask", N, L, batched)
        out = _layers.encoder_layer(self, x, mask, padding, as_bool_flag(is_causal, "is_causal"), precision=code)
        return _result(out, batched, self.batch_first, self.dtype)

    __call__ = forward

    @classmethod
    def from_torch(cls, module: Any, *, activation: str | ActivationFunction | None = None,
                   precision: Precision | None = None) -> TransformerEncoderLayer:
        """An attnx layer with the configuration and parameters of a ``torch.nn.TransformerEncoderLayer``.

        Parameters
        ----------
        module : torch.nn.TransformerEncoderLayer
            Read through its attributes and ``state_dict()``; attnx does not import torch.
        activation : {"relu", "gelu"} or callable, optional
            Keyword-only. The copy's activation. By default the torch layer's: its
            ``F.relu``, ``F.gelu``, ``nn.ReLU()`` or ``nn.GELU()`` (exact) is read as "relu"
            or "gelu"; any other activation raises ValueError unless this argument gives its
            NumPy counterpart.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. The copy's ``precision``.

        Returns
        -------
        TransformerEncoderLayer
            The same configuration, LayerNorm eps, dropout probabilities and training flags;
            dtype float64 or float16 if the torch layer's parameters are, else float32. The
            parameters are copies.

        Examples
        --------
        >>> import numpy as np, torch, attnx
        >>> module = torch.nn.TransformerEncoderLayer(16, 4, 32, activation="gelu", batch_first=True).eval()
        >>> layer = attnx.TransformerEncoderLayer.from_torch(module)
        >>> layer
        TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.1, activation='gelu', batch_first=True, dtype=float32)
        >>> src = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
        >>> with torch.inference_mode():
        ...     expected = module(torch.from_numpy(src)).numpy()
        >>> bool(np.allclose(layer(src), expected, atol=1e-5))
        True
        """
        return cls._copy_of_torch(module, activation, precision)  # type: ignore[no-any-return]


class TransformerDecoderLayer(_TransformerLayer):
    """Self-attention, attention to the encoder's output and a feed-forward block, as ``torch.nn.TransformerDecoderLayer``.

    Post-norm (the default): ``x = norm1(x + self_attn(x))``,
    ``x = norm2(x + multihead_attn(x, memory))``, ``x = norm3(x + ff(x))`` with
    ``ff(x) = linear2(activation(linear1(x)))``; with ``norm_first``:
    ``x = x + self_attn(norm1(x))``, ``x = x + multihead_attn(norm2(x), memory)``,
    ``x = x + ff(norm3(x))``. The constructor takes torch's arguments in torch's order.
    {parameters}
    Attributes
    ----------
    self_attn, multihead_attn : MultiheadAttention
        The self-attention and the attention to ``memory``.
    linear1, linear2 : Linear
    norm1, norm2, norm3 : LayerNorm
    activation : str or callable
    norm_first, batch_first : bool
    dropout : float
    training : bool

    Notes
    -----
    Initialisation as :class:`TransformerEncoderLayer`'s.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> layer = attnx.TransformerDecoderLayer(16, 4, 32, seed=0).eval()
    >>> rng = np.random.default_rng(0)
    >>> tgt, memory = rng.standard_normal((3, 2, 16)), rng.standard_normal((7, 2, 16))   # (T, N, E), (S, N, E)
    >>> out = layer(tgt, memory, tgt_is_causal=True)
    >>> out.shape, out.dtype
    ((3, 2, 16), dtype('float32'))
    >>> [name for name, _ in layer.named_parameters()][4:6]
    ['multihead_attn.in_proj_weight', 'multihead_attn.in_proj_bias']
    """

    multihead_attn: MultiheadAttention
    norm3: LayerNorm

    _ATTENTIONS = ("self_attn", "multihead_attn")
    _NORMS = ("norm1", "norm2", "norm3")

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | ActivationFunction = "relu",
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
        self._build(d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first,
                    bias, device, dtype, seed, precision)

    def forward(
        self,
        tgt: npt.ArrayLike,
        memory: npt.ArrayLike,
        tgt_mask: npt.ArrayLike | None = None,
        memory_mask: npt.ArrayLike | None = None,
        tgt_key_padding_mask: npt.ArrayLike | None = None,
        memory_key_padding_mask: npt.ArrayLike | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
        *,
        precision: Precision | None = None,
    ) -> FloatArray:
        """The layer's output, as ``torch.nn.TransformerDecoderLayer.forward`` in ``eval()`` mode.

        Parameters
        ----------
        tgt : array_like, shape (T, N, E), or (N, T, E) with ``batch_first``, or (T, E)
            Floating; converted to the module's dtype, which is the result's.
        memory : array_like, shape (S, N, E), or (N, S, E) with ``batch_first``, or (S, E)
            The encoder's output: batched as ``tgt`` is, with its batch size.
        tgt_mask : array_like, shape (T, T) or (N * nhead, T, T), optional
            The self-attention's mask: bool True means *not* allowed; float is added.
        memory_mask : array_like, shape (T, S) or (N * nhead, T, S), optional
            The attention to ``memory``'s mask.
        tgt_key_padding_mask : array_like, shape (N, T), or (T,) unbatched, optional
            Padding of ``tgt``: bool True means padding; float is added.
        memory_key_padding_mask : array_like, shape (N, S), or (S,) unbatched, optional
            Padding of ``memory``.
        tgt_is_causal : bool, default False
            Without ``tgt_mask``: query ``i`` attends ``tgt`` positions ``j <= i``. With it: a
            hint; the mask is used.
        memory_is_causal : bool, default False
            Without ``memory_mask``: query ``i`` attends ``memory`` positions ``j <= i``
            (top-left). With it: a hint; the mask is used.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. This call's precision; None is the layer's.

        Returns
        -------
        ndarray, the shape of ``tgt``
            The output rows of padded positions are 0.

        Raises
        ------
        NotImplementedError
            In training mode with ``dropout > 0`` (call :meth:`eval`).

        Examples
        --------
        >>> import numpy as np, attnx
        >>> layer = attnx.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True, seed=0)
        >>> rng = np.random.default_rng(0)
        >>> tgt, memory = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 6, 8))
        >>> padding = np.array([[False] * 6, [False] * 4 + [True] * 2])     # memory's padding
        >>> layer(tgt, memory, memory_key_padding_mask=padding).shape
        (2, 3, 8)
        """
        self._check_inference()
        code = self._call_precision(precision)
        x, batched = _sequence(tgt, "tgt", self.dtype, self.d_model, self.batch_first)
        mem = _memory(memory, x, batched, np.shape(tgt), self)
        masks = _decoder_masks(self, x, mem, batched, tgt_mask, memory_mask, tgt_key_padding_mask,
                               memory_key_padding_mask)
        out = _layers.decoder_layer(self, x, mem, *masks, as_bool_flag(tgt_is_causal, "tgt_is_causal"),
                                    as_bool_flag(memory_is_causal, "memory_is_causal"), precision=code)
        return _result(out, batched, self.batch_first, self.dtype)

    __call__ = forward

    @classmethod
    def from_torch(cls, module: Any, *, activation: str | ActivationFunction | None = None,
                   precision: Precision | None = None) -> TransformerDecoderLayer:
        """An attnx layer with the configuration and parameters of a ``torch.nn.TransformerDecoderLayer``.

        Parameters
        ----------
        module : torch.nn.TransformerDecoderLayer
            Read through its attributes and ``state_dict()``; attnx does not import torch.
        activation : {"relu", "gelu"} or callable, optional
            Keyword-only. The copy's activation; by default the torch layer's, as in
            :meth:`TransformerEncoderLayer.from_torch`.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. The copy's ``precision``.

        Returns
        -------
        TransformerDecoderLayer
            The same configuration, LayerNorm eps, dropout probabilities and training flags;
            dtype float64 or float16 if the torch layer's parameters are, else float32.

        Examples
        --------
        >>> import torch, attnx
        >>> module = torch.nn.TransformerDecoderLayer(16, 4, 32, activation=torch.nn.functional.gelu)
        >>> attnx.TransformerDecoderLayer.from_torch(module).activation
        'gelu'
        >>> attnx.TransformerDecoderLayer.from_torch(module, activation=lambda x: x * (x > 0)).activation
        <function <lambda> at 0x...>
        """
        return cls._copy_of_torch(module, activation, precision)  # type: ignore[no-any-return]


TransformerEncoderLayer.__doc__ = (TransformerEncoderLayer.__doc__ or "").replace("{parameters}", _LAYER_PARAMETERS)
TransformerDecoderLayer.__doc__ = (TransformerDecoderLayer.__doc__ or "").replace("{parameters}", _LAYER_PARAMETERS)


def _memory(memory: Any, tgt: np.ndarray[Any, Any], batched: bool, tgt_shape: tuple[int, ...],
            layer: _TransformerLayer) -> np.ndarray[Any, Any]:
    """``memory`` checked against ``tgt`` (converted as it is): the rank and the batch size."""
    mem, mem_batched = _sequence(memory, "memory", layer.dtype, layer.d_model, layer.batch_first)
    if mem_batched != batched:
        raise ValueError(
            f"memory must be {'3-D (batched)' if batched else '2-D (unbatched)'} as tgt is: tgt {shape_str(tgt_shape)}, "
            f"memory {shape_str(np.shape(memory))}"
        )
    _check_batches(("tgt", tgt_shape, tgt), ("memory", np.shape(memory), mem), layer.batch_first)
    return mem


def _check_batches(first: tuple[str, Any, np.ndarray[Any, Any]], second: tuple[str, Any, np.ndarray[Any, Any]],
                   batch_first: bool) -> None:
    """ValueError naming both arguments when two batched sequences differ in batch size."""
    if _lengths(first[2], batch_first)[0] != _lengths(second[2], batch_first)[0]:
        raise ValueError(
            f"{first[0]} and {second[0]} must have the same batch size: {first[0]} {shape_str(first[1])}, "
            f"{second[0]} {shape_str(second[1])} ({'batch_first' if batch_first else 'batch in dim 1'})"
        )


def _decoder_masks(layer: _TransformerLayer, x: np.ndarray[Any, Any], mem: np.ndarray[Any, Any], batched: bool,
                   tgt_mask: Any, memory_mask: Any, tgt_key_padding_mask: Any,
                   memory_key_padding_mask: Any) -> tuple[Any, Any, Any, Any]:
    """The decoder's four masks, checked against the shapes of ``tgt`` and ``memory``."""
    (N, T), S = _lengths(x, layer.batch_first), _lengths(mem, layer.batch_first)[1]
    H = layer.self_attn.num_heads
    return (
        _attn_mask(tgt_mask, "tgt_mask", N, H, T, T, batched),
        _attn_mask(memory_mask, "memory_mask", N, H, T, S, batched),
        _padding_mask(tgt_key_padding_mask, "tgt_key_padding_mask", N, T, batched),
        _padding_mask(memory_key_padding_mask, "memory_key_padding_mask", N, S, batched),
    )
