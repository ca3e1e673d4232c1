"""The parts of attnx's transformer classes.

:class:`Linear` and :class:`LayerNorm` hold the parameters of ``torch.nn.Linear`` and
``torch.nn.LayerNorm`` under torch's names; ``_Module`` gives every transformer class torch's
``nn.Module`` methods for parameters and modes (``named_parameters``, ``parameters``,
``state_dict``, ``load_state_dict``, ``train``, ``eval``), from the parameters each class lists
in torch's order; the other functions check the arguments of the classes' forward passes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator, Mapping, TypeVar

import numpy as np

from ._arrays import as_array, as_bool_flag, as_int, as_positive_int, is_floating, shape_str
from .modules import (
    LoadStateDictResult,
    MultiheadAttention,
    _check_device,
    _dropout_probability,
    _module_dtype,
    _to_numpy,
)

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import ActivationFunction, FloatArray, TorchDevice, TorchDType

__all__ = ["LayerNorm", "Linear"]

_M = TypeVar("_M", bound="_Module")


def _compute_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """float64 for float64 parameters, float32 for float32 and the half-precision storage dtypes."""
    return np.dtype(np.float64 if dtype == np.float64 else np.float32)


def _torch_parameter_dtype(tensor: Any) -> type[np.floating[Any]]:
    """The attnx dtype of a copy of torch parameters: float64 and float16 kept, others float32."""
    dtype = str(getattr(tensor, "dtype", ""))
    return {"torch.float64": np.float64, "torch.float16": np.float16}.get(dtype, np.float32)


class _Module:
    """torch's ``nn.Module`` methods for parameters and modes, shared by attnx's transformer classes.

    A class lists its own parameters in ``_own_shapes`` (the attribute's name is the key) and
    its submodules in ``_children``, both in torch's order; submodules are attnx
    MultiheadAttention modules or other ``_Module`` instances.
    """

    training: bool

    def _own_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def _children(self) -> list[tuple[str, Any]]:
        return []

    def _slots(self, recurse: bool = True) -> Iterator[tuple[str, Any, str, tuple[int, ...]]]:
        """``(key, owner, attribute, shape)`` of every parameter, in torch's order: the key is
        torch's state_dict key and ``getattr(owner, attribute)`` the parameter (None if absent)."""
        for key, shape in self._own_shapes().items():
            yield key, self, key, shape
        if not recurse:
            return
        for name, child in self._children():
            if isinstance(child, MultiheadAttention):
                for key, shape in child._expected_shapes().items():
                    yield f"{name}.{key}", child, MultiheadAttention._KEY_TO_ATTR[key], shape
            else:
                for key, owner, attr, shape in child._slots():
                    yield f"{name}.{key}", owner, attr, shape

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "training":
            value = as_bool_flag(value, "training")
        elif name == "dropout":
            value = _dropout_probability(value)
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_core_weights", None)  # the core's views of the parameters: not the copy's memory
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, FloatArray]]:
        """The parameters with their names, in torch's order, as ``torch.nn.Module.named_parameters``.

        Parameters
        ----------
        prefix : str, default ""
            Put in front of every name, with a dot.
        recurse : bool, default True
            Also yield the submodules' parameters (all of a transformer layer's parameters
            are its submodules', as in torch: without ``recurse`` a layer yields none).

        Yields
        ------
        (str, ndarray)
            torch's names (the keys of :meth:`state_dict`) and the module's own arrays, not
            copies: writing into them changes the module.

        Examples
        --------
        >>> import attnx
        >>> layer = attnx.TransformerEncoderLayer(8, 2, 16, bias=False)
        >>> [name for name, _ in layer.named_parameters()]
        ['self_attn.in_proj_weight', 'self_attn.out_proj.weight', 'linear1.weight', 'linear2.weight', 'norm1.weight', 'norm2.weight']
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        recurse = as_bool_flag(recurse, "recurse")
        for key, owner, attr, _ in self._slots(recurse):
            value = getattr(owner, attr)
            if value is not None:  # torch leaves absent parameters out, too
                yield (f"{prefix}.{key}" if prefix else key), value

    def parameters(self, recurse: bool = True) -> Iterator[FloatArray]:
        """The parameter arrays in torch's order, as ``torch.nn.Module.parameters``.

        Parameters
        ----------
        recurse : bool, default True
            Also yield the submodules' parameters.

        Yields
        ------
        ndarray
            The arrays of :meth:`named_parameters` (the module's own, not copies).

        Examples
        --------
        >>> import attnx
        >>> sum(p.size for p in attnx.TransformerEncoderLayer(8, 2, 16).parameters())
        600
        """
        for _, value in self.named_parameters(recurse=recurse):
            yield value

    def state_dict(self) -> dict[str, FloatArray]:
        """The parameters under torch's state_dict keys, in torch's order.

        Returns
        -------
        dict of str to ndarray
            Exactly the keys of the torch module of the same configuration; absent parameters
            (biases with ``bias=False``) are left out. The arrays are copies.

        Examples
        --------
        >>> import attnx
        >>> list(attnx.TransformerEncoderLayer(8, 2, 16).state_dict())[:5]
        ['self_attn.in_proj_weight', 'self_attn.in_proj_bias', 'self_attn.out_proj.weight', 'self_attn.out_proj.bias', 'linear1.weight']
        """
        return {key: np.array(value, copy=True) for key, value in self.named_parameters()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> LoadStateDictResult:
        """Copy parameters from a state_dict with torch's keys (a torch module's included).

        Parameters
        ----------
        state_dict : mapping of str to array_like
            NumPy arrays, torch tensors (read with ``.detach().cpu().numpy()``; torch is not
            imported) or anything with ``__array__``. They are converted to the dtype of the
            module that holds them and copied; the caller's arrays are not aliased.
        strict : bool, default True
            Require exactly the keys :meth:`state_dict` has. With False, missing keys keep
            their values and unexpected keys are ignored (both are reported).

        Returns
        -------
        LoadStateDictResult
            Named tuple ``(missing_keys, unexpected_keys)``, as torch's.

        Raises
        ------
        ValueError
            With ``strict=True``, a missing or unexpected key; in any mode, a value whose shape
            differs from the parameter's. Nothing is loaded when an error is raised.
        TypeError
            A value that is not a real floating-point (or integer) array.

        Examples
        --------
        >>> import attnx
        >>> a = attnx.TransformerDecoderLayer(8, 2, 16, seed=0)
        >>> b = attnx.TransformerDecoderLayer(8, 2, 16, seed=1)
        >>> b.load_state_dict(a.state_dict())
        LoadStateDictResult(missing_keys=[], unexpected_keys=[])
        """
        strict = as_bool_flag(strict, "strict")
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"state_dict must be a mapping of str to arrays, got {type(state_dict).__name__}")
        slots = {key: (owner, attr, shape) for key, owner, attr, shape in self._slots()}
        missing = [key for key in slots if key not in state_dict]
        unexpected = [key for key in state_dict.keys() if key not in slots]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append("missing keys " + ", ".join(repr(k) for k in missing))
            if unexpected:
                parts.append("unexpected keys " + ", ".join(repr(k) for k in unexpected))
            raise ValueError(f"state_dict does not match {self!r}: {'; '.join(parts)} ({len(slots)} keys expected)")

        # Convert and check everything first, so that a bad entry leaves the module unchanged.
        loaded = []
        for key, (owner, attr, shape) in slots.items():
            if key not in state_dict:
                continue
            raw = _to_numpy(state_dict[key], key)
            if not (is_floating(raw.dtype) or raw.dtype.kind in "iu"):
                raise TypeError(f"state_dict[{key!r}] must be a real floating-point array, got dtype {raw.dtype}")
            if raw.shape != shape:
                raise ValueError(
                    f"state_dict[{key!r}] has shape {shape_str(raw.shape)}, but the parameter has shape "
                    f"{shape_str(shape)}"
                )
            loaded.append((owner, attr, np.array(raw, dtype=owner.dtype, order="C", copy=True)))
        for owner, attr, value in loaded:
            setattr(owner, attr, value)
        return LoadStateDictResult(missing, unexpected)

    def train(self: _M, mode: bool = True) -> _M:
        """Set training mode (``mode=True``) or inference mode, here and in every submodule.

        As ``torch.nn.Module.train``. In training mode a layer with ``dropout > 0`` raises
        NotImplementedError when called (attnx does not apply dropout).

        Parameters
        ----------
        mode : bool, default True

        Returns
        -------
        The module itself.

        Examples
        --------
        >>> import attnx
        >>> layer = attnx.TransformerEncoderLayer(8, 2, 16)
        >>> layer.train(False) is layer, layer.training, layer.self_attn.training
        (True, False, False)
        """
        self.training = as_bool_flag(mode, "mode")
        for _, child in self._children():
            child.train(mode)
        return self

    def eval(self: _M) -> _M:
        """Set inference mode: ``self.train(False)``, as ``torch.nn.Module.eval``.

        Returns
        -------
        The module itself, so that ``TransformerEncoderLayer(...).eval()`` is the layer.

        Examples
        --------
        >>> import attnx
        >>> attnx.TransformerEncoderLayer(8, 2, 16).eval().training
        False
        """
        return self.train(False)


class Linear(_Module):
    """The parameters of ``torch.nn.Linear``: ``y = x @ weight.T + bias``.

    Parameters
    ----------
    in_features, out_features : int
        Widths of the input and of the output.
    bias : bool, default True
        Hold a ``bias``.
    device : {None, "cpu"}, default None
        As torch's argument (attnx computes on the CPU).
    dtype : {None, numpy.float32, numpy.float64, numpy.float16, "bfloat16"}, default None
        Dtype of the parameters (None: float32), as :class:`attnx.MultiheadAttention`'s.
    seed : int, numpy.random.Generator or None, default None
        Keyword-only. Seed of ``np.random.default_rng`` for the initial parameters.

    Attributes
    ----------
    weight : ndarray, shape (out_features, in_features)
        Initially ``U(-1/sqrt(in_features), 1/sqrt(in_features))``, as torch's.
    bias : ndarray, shape (out_features,), or None
        Initially from the same distribution.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx.transformer import Linear
    >>> linear = Linear(4, 3, seed=0)
    >>> linear
    Linear(in_features=4, out_features=3, bias=True)
    >>> linear(np.ones((2, 4), np.float32)).shape
    (2, 3)
    """

    in_features: int
    out_features: int
    weight: FloatArray
    bias: FloatArray | None
    dtype: np.dtype[Any]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: str | TorchDevice | None = None,
        dtype: npt.DTypeLike | TorchDType | None = None,
        *,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        _check_device(device)
        self.training = True
        self.in_features = as_positive_int(in_features, "in_features")
        self.out_features = as_positive_int(out_features, "out_features")
        bias = as_bool_flag(bias, "bias")
        self.dtype = _module_dtype(dtype)
        rng = np.random.default_rng(seed)
        # kaiming_uniform_(a=sqrt(5)) of the weight and the bias's default are both U(-b, b), b = 1/sqrt(fan_in).
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = rng.uniform(-bound, bound, size=(self.out_features, self.in_features)).astype(self.dtype)
        self.bias = rng.uniform(-bound, bound, size=self.out_features).astype(self.dtype) if bias else None

    def _own_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"weight": (self.out_features, self.in_features)}
        if self.bias is not None:
            shapes["bias"] = (self.out_features,)
        return shapes

    def forward(self, x: npt.ArrayLike) -> FloatArray:
        """``x @ weight.T + bias`` over the last dimension of ``x``.

        Parameters
        ----------
        x : array_like, shape (..., in_features)
            Floating; converted to the module's dtype, which is the result's.

        Returns
        -------
        ndarray, shape (..., out_features)
        """
        a = _floating(x, "x", self.dtype)
        if a.ndim == 0 or a.shape[-1] != self.in_features:
            raise ValueError(f"x must have in_features = {self.in_features} in its last dimension, got shape {shape_str(a.shape)}")
        dtype = _compute_dtype(self.dtype)
        y = np.matmul(a.astype(dtype, copy=False), self.weight.astype(dtype, copy=False).T)
        if self.bias is not None:
            y += self.bias.astype(dtype, copy=False)
        return y.astype(self.dtype, copy=False)

    __call__ = forward

    def __repr__(self) -> str:
        return f"Linear(in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None})"


class LayerNorm(_Module):
    """The parameters of ``torch.nn.LayerNorm`` over the last dimension.

    ``(x - mean) / sqrt(var + eps) * weight + bias``, with each row's mean and biased variance.

    Parameters
    ----------
    normalized_shape : int or tuple of one int
        Width ``E`` of the last dimension (attnx normalizes the last dimension only).
    eps : float, default 1e-5
        Added to the variance.
    elementwise_affine : bool, default True
        Hold ``weight`` (and ``bias``, unless ``bias=False``); without, both are None.
    bias : bool, default True
        Hold a ``bias``.
    device : {None, "cpu"}, default None
        As torch's argument (attnx computes on the CPU).
    dtype : {None, numpy.float32, numpy.float64, numpy.float16, "bfloat16"}, default None
        Dtype of the parameters (None: float32).

    Attributes
    ----------
    weight : ndarray, shape (E,), or None
        Initially ones.
    bias : ndarray, shape (E,), or None
        Initially zeros.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx.transformer import LayerNorm
    >>> norm = LayerNorm(4)
    >>> norm
    LayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True)
    >>> norm(np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)).round(3)
    array([[-1.342, -0.447,  0.447,  1.342]], dtype=float32)
    """

    normalized_shape: tuple[int]
    eps: float
    elementwise_affine: bool
    weight: FloatArray | None
    bias: FloatArray | None
    dtype: np.dtype[Any]

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: str | TorchDevice | None = None,
        dtype: npt.DTypeLike | TorchDType | None = None,
    ) -> None:
        _check_device(device)
        self.training = True
        shape = normalized_shape if isinstance(normalized_shape, (tuple, list)) else (normalized_shape,)
        if len(shape) != 1:
            raise ValueError(
                f"normalized_shape must be an int or a tuple of one int (attnx normalizes the last dimension), "
                f"got {normalized_shape!r}"
            )
        self.normalized_shape = (as_positive_int(shape[0], "normalized_shape"),)
        self.eps = _layer_norm_eps(eps, "eps")
        self.elementwise_affine = as_bool_flag(elementwise_affine, "elementwise_affine")
        bias = as_bool_flag(bias, "bias")
        self.dtype = _module_dtype(dtype)
        E = self.normalized_shape[0]
        self.weight = np.ones(E, self.dtype) if self.elementwise_affine else None
        self.bias = np.zeros(E, self.dtype) if self.elementwise_affine and bias else None

    def _own_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        if self.weight is not None:
            shapes["weight"] = self.normalized_shape
        if self.bias is not None:
            shapes["bias"] = self.normalized_shape
        return shapes

    def forward(self, x: npt.ArrayLike) -> FloatArray:
        """Normalize each row of the last dimension of ``x``.

        Parameters
        ----------
        x : array_like, shape (..., E)
            Floating; converted to the module's dtype, which is the result's.

        Returns
        -------
        ndarray, shape (..., E)
        """
        from . import _layers

        a = _floating(x, "x", self.dtype)
        if a.ndim == 0 or a.shape[-1] != self.normalized_shape[0]:
            raise ValueError(
                f"x must have normalized_shape = {self.normalized_shape} as its last dimension, got shape "
                f"{shape_str(a.shape)}"
            )
        y = _layers.layer_norm(a.astype(_compute_dtype(self.dtype), copy=False), self)
        return y.astype(self.dtype, copy=False)

    __call__ = forward

    @classmethod
    def from_torch(cls, module: Any) -> LayerNorm:
        """A LayerNorm with the configuration and parameters of a ``torch.nn.LayerNorm``.

        Parameters
        ----------
        module : torch.nn.LayerNorm
            Of a 1-D ``normalized_shape``; read through its attributes and ``state_dict()``.

        Returns
        -------
        LayerNorm
            float64 or float16 as the torch module's parameters, else float32.
        """
        lacking = [n for n in ("normalized_shape", "eps", "elementwise_affine") if not hasattr(module, n)]
        if lacking or not callable(getattr(module, "state_dict", None)):
            raise TypeError(f"from_torch expects a torch.nn.LayerNorm, got {type(module).__name__}")
        weight = getattr(module, "weight", None)
        new = cls(
            tuple(int(n) for n in module.normalized_shape),  # type: ignore[arg-type]  # checked: one int
            float(module.eps),
            bool(module.elementwise_affine),
            getattr(module, "bias", None) is not None,
            dtype=_torch_parameter_dtype(weight),
        )
        new.load_state_dict(module.state_dict())
        new.train(bool(getattr(module, "training", False)))
        return new

    def __repr__(self) -> str:
        return (
            f"LayerNorm({self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None})"
        )


# ---------------------------------------------------------------------------------------------
# Arguments of the transformer classes
# ---------------------------------------------------------------------------------------------


def _layer_norm_eps(eps: Any, name: str = "layer_norm_eps") -> float:
    """`eps` as a float >= 0 (TypeError for non-numbers, bools included)."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float >= 0, got {eps!r}")
    value = float(eps)
    if not value >= 0.0:  # also NaN
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


# torch's relu and gelu, known by the module and name of the function (torch is not imported):
# F.relu is torch.nn.functional's, F.gelu torch._C._nn's, torch.relu torch's own.
_TORCH_FUNCTIONS = {("torch.nn.functional", "relu"), ("torch", "relu"), ("torch._C._nn", "gelu"),
                    ("torch.nn.functional", "gelu")}
_TORCH_MODULES = {"ReLU": "relu", "GELU": "gelu"}


def _from_torch_activation(value: Any) -> str | None:
    """"relu" or "gelu" for torch's functions and modules of those (exact GELU), else None."""
    module = getattr(value, "__module__", None) or ""
    name = getattr(value, "__name__", None)
    if (module, name) in _TORCH_FUNCTIONS:
        return str(name)
    cls = type(value)
    if cls.__module__.startswith("torch.") and cls.__name__ in _TORCH_MODULES:
        if cls.__name__ == "GELU" and getattr(value, "approximate", "none") != "none":
            return None
        return _TORCH_MODULES[cls.__name__]
    return None


def _is_torch_object(value: Any) -> bool:
    return any(str(m).partition(".")[0] == "torch"
               for m in (getattr(value, "__module__", None), type(value).__module__))


def _activation(value: Any) -> str | ActivationFunction:
    """The layers' ``activation``: "relu", "gelu" (torch's relu and exact gelu map to them), or
    a callable on NumPy arrays, kept as it is."""
    if isinstance(value, str):
        if value in ("relu", "gelu"):
            return value
        raise ValueError(f"activation must be 'relu', 'gelu' or a callable on NumPy arrays, got {value!r}")
    named = _from_torch_activation(value)
    if named is not None:
        return named
    if _is_torch_object(value):
        raise ValueError(
            f"activation {value!r} is torch's and computes on tensors: attnx knows torch's relu and exact gelu "
            f"(as 'relu' and 'gelu'); for another activation pass a callable on NumPy arrays"
        )
    if not callable(value):
        raise TypeError(f"activation must be 'relu', 'gelu' or a callable on NumPy arrays, got {value!r}")
    return value  # type: ignore[no-any-return]  # a callable on arrays, as documented


def _floating(x: Any, name: str, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """`x` as an array of `dtype` (floating inputs only: TypeError naming `name` otherwise)."""
    a = as_array(x, name)
    if not is_floating(a.dtype):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    return a if a.dtype == dtype else a.astype(dtype)


def _sequence(x: Any, name: str, dtype: np.dtype[Any], d_model: int, batch_first: bool) -> tuple[np.ndarray[Any, Any], bool]:
    """``(array, batched)``: `x` as a 3-D array of the compute dtype of `dtype`, in the layout of
    `batch_first` (an unbatched 2-D `x` is a batch of one), after rounding it to `dtype`."""
    a = as_array(x, name)
    if not is_floating(a.dtype):
        raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    if a.ndim not in (2, 3):
        layout = "(N, L, E)" if batch_first else "(L, N, E)"
        raise ValueError(f"{name} must be 2-D (L, E) unbatched or 3-D {layout} batched, got shape {shape_str(a.shape)}")
    if a.shape[-1] != d_model:
        raise ValueError(f"{name} has {a.shape[-1]} features, expected d_model = {d_model}: {name} {shape_str(a.shape)}")
    if a.dtype != dtype:  # half-precision modules: inputs rounded to the storage dtype first
        a = a.astype(dtype)
    compute = _compute_dtype(dtype)
    if a.dtype != compute:
        a = a.astype(compute)
    batched = a.ndim == 3
    if not batched:
        a = a[None] if batch_first else a[:, None]
    return a, batched


def _result(out: np.ndarray[Any, Any], batched: bool, batch_first: bool, dtype: np.dtype[Any]) -> FloatArray:
    """A layer's or stack's 3-D result as returned: unbatched again, in the module's dtype."""
    if not batched:
        out = out[0] if batch_first else out[:, 0]
    return np.ascontiguousarray(out, dtype=dtype)


def _lengths(x: np.ndarray[Any, Any], batch_first: bool) -> tuple[int, int]:
    """``(N, L)`` of a 3-D sequence in the layout of `batch_first`."""
    return (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])


def _mask_array(mask: Any, name: str) -> np.ndarray[Any, Any]:
    a = as_array(mask, name)
    if a.dtype != np.bool_ and not is_floating(a.dtype):
        raise TypeError(f"{name} must be a bool or floating-point array, got dtype {a.dtype}")
    return a


def _attn_mask(mask: Any, name: str, N: int, nhead: int, L: int, S: int, batched: bool) -> np.ndarray[Any, Any] | None:
    """An attention mask, checked: ``(L, S)``, or ``(N * nhead, L, S)`` (``(nhead, L, S)`` unbatched)."""
    if mask is None:
        return None
    a = _mask_array(mask, name)
    heads = (N * nhead, "N*nhead") if batched else (nhead, "nhead")
    if a.shape != (L, S) and a.shape != (heads[0], L, S):
        raise ValueError(
            f"{name} must have shape (L, S) = {shape_str((L, S))} or ({heads[1]}, L, S) = "
            f"{shape_str((heads[0], L, S))}, got {shape_str(a.shape)}"
        )
    return a


def _padding_mask(mask: Any, name: str, N: int, S: int, batched: bool) -> np.ndarray[Any, Any] | None:
    """A key padding mask, checked, as ``(N, S)``: ``(S,)`` for unbatched inputs."""
    if mask is None:
        return None
    a = _mask_array(mask, name)
    expected = (N, S) if batched else (S,)
    if a.shape != expected:
        form = "(N, S)" if batched else "(S,) for unbatched inputs"
        raise ValueError(f"{name} must have shape {form} = {shape_str(expected)}, got {shape_str(a.shape)}")
    return a if batched else a[None]


def _detect_is_causal(mask: np.ndarray[Any, Any] | None, is_causal: Any, size: int, name: str) -> bool:
    """torch's ``_detect_is_causal_mask``: a given `is_causal` as it is; None is True exactly
    when `mask` is the ``(size, size)`` causal mask (bool: True above the diagonal; float:
    -inf above it, 0 on and below it)."""
    if is_causal is not None:
        return as_bool_flag(is_causal, name)
    from . import _layers

    return _layers.is_causal_mask(mask, size)


def _xavier_uniform(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype[Any]) -> FloatArray:
    """torch's ``xavier_uniform_``: U(-b, b), b = sqrt(6 / (fan_in + fan_out))."""
    receptive = math.prod(shape[2:])
    fan_in, fan_out = shape[1] * receptive, shape[0] * receptive
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def _square_size(sz: Any) -> int:
    """`sz` as an int >= 0 (bools and non-integral numbers: TypeError)."""
    return as_int(sz, "sz", 0, "an int >= 0", ">= 0")
