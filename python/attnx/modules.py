"""The module API: ``torch.nn.MultiheadAttention`` for NumPy arrays.

:class:`MultiheadAttention` holds the parameters of PyTorch's module under
PyTorch's names, initialises them with PyTorch's distributions, reads and
writes PyTorch's state_dict keys, and computes its forward pass with
:func:`attnx.functional.multi_head_attention_forward`. It never imports torch:
a torch module or state_dict is read through the tensors' own methods.

It is an inference module: its outputs are those of the torch module in
``eval()`` mode. It takes torch's constructor arguments in torch's order and keeps
``dropout`` and the ``training`` flag (``eval()``, ``train()``) as torch does, so
that code written for torch runs unchanged; a call that torch would compute with
dropout (training mode and ``dropout > 0``) raises NotImplementedError instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping, NamedTuple

import numpy as np

from . import _core

from ._arrays import (
    PRECISION_NAMES,
    as_array,
    as_bool_flag,
    as_positive_int,
    check_heads,
    is_floating,
    precision_code,
    shape_str,
)
from .cache import KVCache, _storage_dtype
from ._canonical import mha_options, mha_step, mha_weights

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import FloatArray, Precision, TorchDevice, TorchDType

__all__ = ["MultiheadAttention"]

_COMPUTE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

# The options of the common calls, made once: [batch_first][need_weights][average_attn_weights].
_OPTIONS = tuple(
    tuple(tuple(_core.MhaOptions(False, False, need, average, first) for average in (False, True)) for need in (False, True))
    for first in (False, True)
)


class LoadStateDictResult(NamedTuple):
    """What :meth:`MultiheadAttention.load_state_dict` did not load (as torch's ``_IncompatibleKeys``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# torch's floating dtypes by name (str(torch.float64) == "torch.float64"; torch.double and
# torch.half are the same objects as torch.float64 and torch.float16): torch is never imported.
_TORCH_DTYPES = {
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
}


def _module_dtype(dtype: npt.DTypeLike | TorchDType | None) -> np.dtype[Any]:
    """The module's parameter dtype: float32, float64, float16 or bfloat16 (ml_dtypes).

    None is float32 (torch's default); NumPy dtypes, their names and torch's dtypes
    (``torch.float64``, or the name ``"torch.float64"``) are read.
    """
    if dtype is None:
        return np.dtype(np.float32)
    given = dtype
    if isinstance(dtype, str) or not isinstance(dtype, (np.dtype, type)):
        name = str(dtype)
        if name.startswith("torch."):
            if name not in _TORCH_DTYPES:
                raise TypeError(f"dtype must be float32, float64, float16 or bfloat16, got {name}")
            dtype = _TORCH_DTYPES[name]
    if isinstance(dtype, str) and dtype == "bfloat16":
        return _storage_dtype(dtype)  # its own message where ml_dtypes is missing
    message = f"dtype must be float32, float64, float16 or bfloat16, got {given!r}"
    try:
        dt = _storage_dtype(dtype)  # type: ignore[arg-type]  # a torch dtype was mapped to its name above
    except TypeError:
        raise TypeError(message) from None
    if dt == np.int8:  # a cache dtype (new_cache), not a parameter dtype
        raise TypeError(message)
    return dt


def _check_device(device: str | TorchDevice | None) -> None:
    """ValueError unless `device` is None or the CPU ("cpu", "cpu:0", torch.device("cpu"))."""
    if device is None:
        return
    name = device if isinstance(device, str) else str(device)
    if name == "cpu" or (name.startswith("cpu:") and name[4:].isdigit()):
        return
    raise ValueError(f"device must be None or 'cpu' (attnx computes on the CPU), got {device!r}")


def _dropout_probability(p: float) -> float:
    """`p` as a float in [0, 1]: TypeError for non-numbers (bools included), ValueError outside."""
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout must be a probability, a float in [0, 1], got {p!r}")
    value = float(p)
    if not 0.0 <= value <= 1.0:  # also NaN
        raise ValueError(f"dropout must be a probability in [0, 1], got {value}")
    return value


# Attributes that are not parameters: setting them keeps the module's checked weights.
_MODE_ATTRIBUTES = frozenset({"training", "dropout", "precision"})


def module_precision(module: Any, precision: Any) -> int:
    """The core's code of a module's ``precision``, checked against its dtype (set as its
    attribute: float64 modules compute in float64, not with bfloat16 products)."""
    return precision_code(precision, np.float64 if module.dtype == np.float64 else np.float32,
                          "the module's dtype", "construct the module with dtype=np.float32")

_DROPOUT_MESSAGE = (
    "MultiheadAttention with dropout={dropout} in training mode: attnx is an inference library: "
    "call .eval() or use dropout=0.0"
)


def _to_numpy(value: Any, key: str) -> np.ndarray[Any, Any]:
    """A state_dict entry as a NumPy array, without importing torch.

    Accepts NumPy arrays, torch tensors (anything with ``detach().cpu().numpy()``,
    bfloat16 included) and anything ``np.asarray`` reads (``__array__``, lists).
    """
    if isinstance(value, np.ndarray):
        return value
    detach = getattr(value, "detach", None)
    if callable(detach):
        try:
            t = detach().cpu()
            try:
                return t.numpy()
            except TypeError:
                # NumPy has no bfloat16: widen to float32 (exact) on the tensor side.
                return t.float().numpy()
        except Exception as exc:  # noqa: BLE001 - re-raised with the key named
            raise TypeError(f"state_dict[{key!r}]: could not convert {type(value).__name__} to a NumPy array: {exc}") from exc
    try:
        return np.asarray(value)
    except Exception as exc:  # noqa: BLE001 - re-raised with the key named
        raise TypeError(f"state_dict[{key!r}]: could not convert {type(value).__name__} to a NumPy array: {exc}") from exc


class OutProj:
    """``MultiheadAttention.out_proj``: torch's output projection as a view of the module.

    ``weight`` and ``bias`` are the module's ``out_proj_weight`` and
    ``out_proj_bias`` themselves (the same arrays); assigning them assigns the
    module's, so ``m.out_proj.weight = w`` is ``m.out_proj_weight = w``.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> m = attnx.MultiheadAttention(8, 2, seed=0)
    >>> m.out_proj
    OutProj(in_features=8, out_features=8, bias=True)
    >>> m.out_proj.weight is m.out_proj_weight
    True
    >>> m.out_proj.bias = np.ones(8, np.float32)
    >>> m.out_proj_bias
    array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
    """

    __slots__ = ("_module",)

    def __init__(self, module: MultiheadAttention) -> None:
        self._module = module

    @property
    def weight(self) -> FloatArray:
        """The module's ``out_proj_weight``, shape ``(E, E)``."""
        return self._module.out_proj_weight

    @weight.setter
    def weight(self, value: FloatArray) -> None:
        self._module.out_proj_weight = value

    @property
    def bias(self) -> FloatArray | None:
        """The module's ``out_proj_bias``, shape ``(E,)``, or None without bias."""
        return self._module.out_proj_bias

    @bias.setter
    def bias(self, value: FloatArray | None) -> None:
        self._module.out_proj_bias = value

    @property
    def in_features(self) -> int:
        return int(np.shape(self._module.out_proj_weight)[1])

    @property
    def out_features(self) -> int:
        return int(np.shape(self._module.out_proj_weight)[0])

    def __repr__(self) -> str:
        return (
            f"OutProj(in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None})"
        )


class MultiheadAttention:
    """Multi-head attention with the parameters and semantics of ``torch.nn.MultiheadAttention``.

    Computes ``out_proj(concat_h(softmax(q_h k_h^T / sqrt(head_dim) + mask) v_h))``
    with ``q, k, v`` the input projections of ``query``, ``key`` and ``value``.
    It behaves as the torch module in ``eval()`` mode (inference: no dropout).
    The constructor takes torch's arguments in torch's order, so
    ``MultiheadAttention(E, H, 0.0, False)`` means what it means in torch.

    Parameters
    ----------
    embed_dim : int
        Width ``E`` of the query and of the output.
    num_heads : int
        Number of heads; must divide ``embed_dim``.
    dropout : float, default 0.0
        torch's attention dropout probability, in ``[0, 1]``. It is kept (and
        copied by :meth:`from_torch`) but never applied: a call in training
        mode (see :meth:`train`) with ``dropout > 0`` raises
        NotImplementedError; in ``eval()`` mode it is ignored, as in torch.
    bias : bool, default True
        Add ``in_proj_bias`` and ``out_proj_bias`` to the projections.
    add_bias_kv : bool, default False
        Append the learned ``bias_k`` / ``bias_v`` as one more key/value position.
    add_zero_attn : bool, default False
        Append one all-zero key/value position.
    kdim, vdim : int, optional
        Widths of ``key`` and ``value`` (default ``embed_dim``). When either
        differs from ``embed_dim``, the projections are held separately in
        ``q_proj_weight``, ``k_proj_weight`` and ``v_proj_weight`` and
        ``in_proj_weight`` is None (as torch).
    batch_first : bool, default False
        Inputs and output are ``(N, L, E)`` instead of ``(L, N, E)``.
    device : {None, "cpu"}, default None
        As torch's argument: None, ``"cpu"`` or ``torch.device("cpu")``;
        any other device raises ValueError (attnx computes on the CPU).
    dtype : {None, numpy.float32, numpy.float64, numpy.float16, "bfloat16"}, default None
        Dtype of the parameters, of the inputs (floating inputs are converted
        to it) and of the results; None is float32, as torch's default.
        NumPy dtypes, their names and torch's dtypes (``torch.float64``, read
        by name: torch is not imported) are accepted. float32 and float64 are
        also the compute dtype; float16 and bfloat16 (``ml_dtypes.bfloat16``,
        or the string ``"bfloat16"`` with ml_dtypes installed) are storage
        dtypes, computed in float32.
    seed : int, numpy.random.Generator or None, default None
        Keyword-only. Seed of ``np.random.default_rng`` for the initial
        parameters.
    precision : {None, "float32", "bfloat16"}, default None
        Keyword-only. The precision of the module's products (None is
        ``"float32"``); a call's ``precision=`` overrides it. ``"bfloat16"``
        rounds the operands of the projections, of the scores and of the
        probabilities' product with the values to bfloat16, with float32
        sums (see :func:`attnx.scaled_dot_product_attention`); not for
        float64 modules. The weights are rounded to bfloat16 once, at the
        first such call after a parameter is assigned: values written into
        the parameter arrays in place after that are not seen by calls with
        ``"bfloat16"`` until a parameter is assigned again (or
        :meth:`load_state_dict` loads new values).

    Attributes
    ----------
    in_proj_weight : ndarray, shape (3E, E), or None
        Packed query/key/value projection (None when kdim/vdim differ from E).
    q_proj_weight, k_proj_weight, v_proj_weight : ndarray or None
        Shapes ``(E, E)``, ``(E, kdim)``, ``(E, vdim)`` when kdim/vdim differ
        from E, else None.
    in_proj_bias : ndarray, shape (3E,), or None
    bias_k, bias_v : ndarray, shape (1, 1, E), or None
    out_proj_weight : ndarray, shape (E, E)
    out_proj_bias : ndarray, shape (E,), or None
    out_proj : OutProj
        torch's ``out_proj``: ``out_proj.weight`` and ``out_proj.bias`` are
        ``out_proj_weight`` and ``out_proj_bias`` (the same arrays).
    dropout : float
        As given; applied never (see ``dropout`` above).
    training : bool
        True after construction (as torch's modules); :meth:`eval` and
        :meth:`train` set it.
    precision : {"float32", "bfloat16"}
        The precision of calls that do not give one; assignable. Kept by
        pickle, not part of :meth:`state_dict`.

    Notes
    -----
    Initialisation follows torch's distributions (not its random stream):
    ``xavier_uniform_`` for the input projections (the packed ``(3E, E)``
    weight as one matrix, so ``U(-sqrt(6 / 4E), +sqrt(6 / 4E))``), zeros for
    ``in_proj_bias`` and ``out_proj_bias``, ``nn.Linear``'s default
    ``U(-1/sqrt(E), 1/sqrt(E))`` for ``out_proj_weight``, and
    ``xavier_normal_`` for ``bias_k`` / ``bias_v`` (fans of a ``(1, 1, E)``
    tensor are both E, so ``N(0, 1/E)``).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> mha = attnx.MultiheadAttention(16, 4, batch_first=True, seed=0)
    >>> x = np.ones((2, 5, 16), np.float32)
    >>> out, weights = mha(x, x, x)
    >>> out.shape, weights.shape
    ((2, 5, 16), (2, 5, 5))

    torch's positional order and its parameters, by torch's names:

    >>> mha = attnx.MultiheadAttention(16, 4, 0.1, False, seed=0)   # dropout 0.1, no bias
    >>> [(name, p.shape) for name, p in mha.named_parameters()]
    [('in_proj_weight', (48, 16)), ('out_proj.weight', (16, 16))]
    >>> mha.training
    True
    >>> mha(x, x, x)
    Traceback (most recent call last):
        ...
    NotImplementedError: MultiheadAttention with dropout=0.1 in training mode: attnx is an inference library: call .eval() or use dropout=0.0
    >>> out, _ = mha.eval()(x, x, x)
    """

    embed_dim: int
    num_heads: int
    head_dim: int
    kdim: int
    vdim: int
    bias: bool
    add_bias_kv: bool
    add_zero_attn: bool
    batch_first: bool
    dtype: np.dtype[Any]
    dropout: float
    training: bool
    precision: Precision
    _precision: int
    in_proj_weight: FloatArray | None
    q_proj_weight: FloatArray | None
    k_proj_weight: FloatArray | None
    v_proj_weight: FloatArray | None
    in_proj_bias: FloatArray | None
    out_proj_weight: FloatArray
    out_proj_bias: FloatArray | None
    bias_k: FloatArray | None
    bias_v: FloatArray | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: str | TorchDevice | None = None,
        dtype: npt.DTypeLike | TorchDType | None = None,
        *,
        seed: int | np.random.Generator | None = None,
        precision: Precision | None = None,
    ) -> None:
        _check_device(device)
        self.dropout = dropout  # checked by __setattr__
        self.training = True  # torch's modules start in training mode
        embed_dim = as_positive_int(embed_dim, "embed_dim")
        num_heads = as_positive_int(num_heads, "num_heads")
        self.head_dim = check_heads(embed_dim, num_heads)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.kdim = embed_dim if kdim is None else as_positive_int(kdim, "kdim")
        self.vdim = embed_dim if vdim is None else as_positive_int(vdim, "vdim")
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.bias = as_bool_flag(bias, "bias")
        self.add_bias_kv = as_bool_flag(add_bias_kv, "add_bias_kv")
        self.add_zero_attn = as_bool_flag(add_zero_attn, "add_zero_attn")
        self.batch_first = as_bool_flag(batch_first, "batch_first")
        self.dtype = _module_dtype(dtype)
        self.precision = "float32" if precision is None else precision  # checked by __setattr__
        self._reset_parameters(np.random.default_rng(seed))

    # ------------------------------------------------------------------------------------------
    # Parameters
    # ------------------------------------------------------------------------------------------

    def _reset_parameters(self, rng: np.random.Generator) -> None:
        """Draw every parameter from torch's initial distribution (see the class Notes)."""
        E = self.embed_dim

        def xavier_uniform(shape: tuple[int, int]) -> FloatArray:
            fan_out, fan_in = shape
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-bound, bound, size=shape).astype(self.dtype)

        if self._qkv_same_embed_dim:
            self.in_proj_weight = xavier_uniform((3 * E, E))
            self.q_proj_weight = self.k_proj_weight = self.v_proj_weight = None
        else:
            self.in_proj_weight = None
            self.q_proj_weight = xavier_uniform((E, E))
            self.k_proj_weight = xavier_uniform((E, self.kdim))
            self.v_proj_weight = xavier_uniform((E, self.vdim))
        self.in_proj_bias = np.zeros(3 * E, self.dtype) if self.bias else None
        # nn.Linear's kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(E)
        self.out_proj_weight = rng.uniform(-bound, bound, size=(E, E)).astype(self.dtype)
        self.out_proj_bias = np.zeros(E, self.dtype) if self.bias else None
        if self.add_bias_kv:
            # xavier_normal_ on (1, 1, E): fan_in = fan_out = E, std = sqrt(2 / (2E)).
            std = math.sqrt(1.0 / E)
            self.bias_k = rng.normal(0.0, std, size=(1, 1, E)).astype(self.dtype)
            self.bias_v = rng.normal(0.0, std, size=(1, 1, E)).astype(self.dtype)
        else:
            self.bias_k = self.bias_v = None

    # state_dict key -> attribute name; the order is torch's (own parameters, then out_proj).
    _KEY_TO_ATTR = {
        "in_proj_weight": "in_proj_weight",
        "q_proj_weight": "q_proj_weight",
        "k_proj_weight": "k_proj_weight",
        "v_proj_weight": "v_proj_weight",
        "in_proj_bias": "in_proj_bias",
        "bias_k": "bias_k",
        "bias_v": "bias_v",
        "out_proj.weight": "out_proj_weight",
        "out_proj.bias": "out_proj_bias",
    }

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """torch's state_dict keys for this configuration, in torch's order, with their shapes."""
        E = self.embed_dim
        shapes = {}
        if self._qkv_same_embed_dim:
            shapes["in_proj_weight"] = (3 * E, E)
        else:
            shapes["q_proj_weight"] = (E, E)
            shapes["k_proj_weight"] = (E, self.kdim)
            shapes["v_proj_weight"] = (E, self.vdim)
        if self.bias:
            shapes["in_proj_bias"] = (3 * E,)
        if self.add_bias_kv:
            shapes["bias_k"] = (1, 1, E)
            shapes["bias_v"] = (1, 1, E)
        shapes["out_proj.weight"] = (E, E)
        if self.bias:
            shapes["out_proj.bias"] = (E,)
        return shapes

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, FloatArray]]:
        """The parameters with their names, in torch's order, as ``torch.nn.Module.named_parameters``.

        Parameters
        ----------
        prefix : str, default ""
            Put in front of every name, with a dot (``"attn"`` gives ``"attn.in_proj_weight"``).
        recurse : bool, default True
            Also yield ``out_proj``'s parameters (``out_proj.weight``, ``out_proj.bias``),
            as torch yields its submodules'.

        Yields
        ------
        (str, ndarray)
            The names of :meth:`state_dict`, and the module's own arrays (not
            copies: writing into them changes the module, as writing into
            torch's parameters does).

        Examples
        --------
        >>> import attnx
        >>> m = attnx.MultiheadAttention(8, 2, kdim=3, vdim=5, add_bias_kv=True)
        >>> [name for name, _ in m.named_parameters()]
        ['q_proj_weight', 'k_proj_weight', 'v_proj_weight', 'in_proj_bias', 'bias_k', 'bias_v', 'out_proj.weight', 'out_proj.bias']
        >>> [name for name, _ in m.named_parameters(prefix="attn", recurse=False)][:2]
        ['attn.q_proj_weight', 'attn.k_proj_weight']
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        recurse = as_bool_flag(recurse, "recurse")
        for key in self._expected_shapes():
            if not recurse and "." in key:
                continue
            value = getattr(self, self._KEY_TO_ATTR[key])
            if value is not None:  # torch leaves absent parameters out, too
                yield (f"{prefix}.{key}" if prefix else key), value

    def parameters(self, recurse: bool = True) -> Iterator[FloatArray]:
        """The parameter arrays in torch's order, as ``torch.nn.Module.parameters``.

        Parameters
        ----------
        recurse : bool, default True
            Also yield ``out_proj``'s weight and bias.

        Yields
        ------
        ndarray
            The arrays of :meth:`named_parameters` (the module's own, not copies).

        Examples
        --------
        >>> import attnx
        >>> sum(p.size for p in attnx.MultiheadAttention(8, 2).parameters())
        288
        """
        for _, value in self.named_parameters(recurse=recurse):
            yield value

    @property
    def out_proj(self) -> OutProj:
        """torch's ``out_proj``: its ``weight`` and ``bias`` are ``out_proj_weight`` and ``out_proj_bias``."""
        return OutProj(self)

    def train(self, mode: bool = True) -> MultiheadAttention:
        """Set training mode (``mode=True``) or inference mode, as ``torch.nn.Module.train``.

        In training mode, a call with ``dropout > 0`` raises NotImplementedError
        (attnx does not apply dropout); with ``dropout=0.0`` both modes compute the same.

        Parameters
        ----------
        mode : bool, default True

        Returns
        -------
        MultiheadAttention
            The module itself.

        Examples
        --------
        >>> import attnx
        >>> m = attnx.MultiheadAttention(8, 2, dropout=0.1)
        >>> m.train(False) is m, m.training
        (True, False)
        """
        self.training = as_bool_flag(mode, "mode")
        return self

    def eval(self) -> MultiheadAttention:
        """Set inference mode: ``self.train(False)``, as ``torch.nn.Module.eval``.

        Returns
        -------
        MultiheadAttention
            The module itself, so that ``MultiheadAttention(E, H, 0.1).eval()`` is a module.

        Examples
        --------
        >>> import attnx
        >>> attnx.MultiheadAttention(8, 2, 0.1).eval().training
        False
        """
        return self.train(False)

    def state_dict(self) -> dict[str, FloatArray]:
        """The parameters under ``torch.nn.MultiheadAttention``'s state_dict keys.

        Returns
        -------
        dict of str to ndarray
            Exactly the keys torch's module has for the same configuration, in
            torch's order: ``in_proj_weight`` (or ``q_proj_weight``,
            ``k_proj_weight``, ``v_proj_weight``), ``in_proj_bias``,
            ``bias_k``, ``bias_v``, ``out_proj.weight``, ``out_proj.bias``;
            absent parameters are left out. The arrays are copies: changing
            them does not change the module.

        Examples
        --------
        >>> import attnx
        >>> list(attnx.MultiheadAttention(8, 2, bias=False).state_dict())
        ['in_proj_weight', 'out_proj.weight']
        """
        state: dict[str, FloatArray] = {}
        for key in self._expected_shapes():
            value = getattr(self, self._KEY_TO_ATTR[key])
            if value is not None:  # torch leaves absent parameters out, too
                state[key] = np.array(value, copy=True)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> LoadStateDictResult:
        """Copy parameters from a state_dict with torch's keys (a torch module's included).

        Parameters
        ----------
        state_dict : mapping of str to array_like
            Values may be NumPy arrays, torch tensors (read with
            ``.detach().cpu().numpy()``; torch is not imported) or anything
            with ``__array__``. They are converted to the module's dtype and
            copied; the caller's arrays are never aliased or modified.
        strict : bool, default True
            Require exactly the keys :meth:`state_dict` has. With False,
            missing keys keep their current values and unexpected keys are
            ignored (and both are reported in the result).

        Returns
        -------
        LoadStateDictResult
            Named tuple ``(missing_keys, unexpected_keys)``, as torch's.

        Raises
        ------
        ValueError
            With ``strict=True``, a missing or unexpected key; in any mode, a
            value whose shape differs from the parameter's (the message names
            the key and both shapes). Nothing is loaded when an error is raised.
        TypeError
            A value that is not a real floating-point (or integer) array.

        Examples
        --------
        >>> import attnx
        >>> a = attnx.MultiheadAttention(8, 2, seed=0)
        >>> b = attnx.MultiheadAttention(8, 2, seed=1)
        >>> b.load_state_dict(a.state_dict())
        LoadStateDictResult(missing_keys=[], unexpected_keys=[])
        """
        strict = as_bool_flag(strict, "strict")
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"state_dict must be a mapping of str to arrays, got {type(state_dict).__name__}")
        expected = self._expected_shapes()
        given = list(state_dict.keys())
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in given if k not in expected]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append("missing keys " + ", ".join(repr(k) for k in missing))
            if unexpected:
                parts.append("unexpected keys " + ", ".join(repr(k) for k in unexpected))
            raise ValueError(
                f"state_dict does not match {self!r}: {'; '.join(parts)} "
                f"(expected exactly {', '.join(repr(k) for k in expected)})"
            )

        # Convert and check everything first, so that a bad entry leaves the module unchanged.
        loaded = {}
        for key, shape in expected.items():
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
            loaded[key] = np.array(raw, dtype=self.dtype, order="C", copy=True)
        for key, value in loaded.items():
            setattr(self, self._KEY_TO_ATTR[key], value)
        return LoadStateDictResult(missing, unexpected)

    @classmethod
    def from_torch(cls, module: Any, *, precision: Precision | None = None) -> MultiheadAttention:
        """An attnx module with the configuration and weights of a ``torch.nn.MultiheadAttention``.

        Parameters
        ----------
        module : torch.nn.MultiheadAttention
            Read through its attributes and ``state_dict()``; attnx does not
            import torch.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. The copy's ``precision`` (torch's module has none).

        Returns
        -------
        MultiheadAttention
            Same ``embed_dim``, ``num_heads``, ``dropout``, ``bias``,
            ``add_bias_kv``, ``add_zero_attn``, ``kdim``, ``vdim``,
            ``batch_first`` and ``training`` flag; dtype float64 or float16 if
            the torch module's parameters are, else float32 (bfloat16
            parameters are widened exactly). The weights are copies.

        Notes
        -----
        The mode is copied with the dropout so that the copy computes what the
        torch module computes or refuses: a torch module in training mode with
        ``dropout > 0`` applies dropout, so its copy raises NotImplementedError
        when called until ``eval()`` is called on it (or on the torch module
        before copying). A module with ``dropout=0.0`` computes the same in
        either mode and works in both.

        Examples
        --------
        >>> import numpy as np, torch, attnx
        >>> module = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
        >>> mha = attnx.MultiheadAttention.from_torch(module)
        >>> mha
        MultiheadAttention(embed_dim=16, num_heads=4, batch_first=True, dtype=float32)
        >>> x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
        >>> with torch.no_grad():
        ...     expected, _ = module(*[torch.from_numpy(x)] * 3)
        >>> out, _ = mha(x, x, x)
        >>> bool(np.allclose(out, expected.numpy(), atol=1e-5))
        True
        """
        names = ("embed_dim", "num_heads", "kdim", "vdim", "batch_first", "add_zero_attn", "in_proj_bias", "bias_k", "out_proj")
        lacking = [n for n in names if not hasattr(module, n)]
        if lacking or not callable(getattr(module, "state_dict", None)):
            raise TypeError(
                f"from_torch expects a torch.nn.MultiheadAttention, got {type(module).__name__} "
                f"(lacking {', '.join(lacking) or 'state_dict()'})"
            )
        weight = module.out_proj.weight
        dtype = {"torch.float64": np.float64, "torch.float16": np.float16}.get(
            str(getattr(weight, "dtype", "")), np.float32
        )
        # The bias flag: torch registers in_proj_bias and out_proj.bias together.
        bias = module.in_proj_bias is not None or getattr(module.out_proj, "bias", None) is not None
        new = cls(
            int(module.embed_dim),
            int(module.num_heads),
            dropout=float(getattr(module, "dropout", 0.0)),
            bias=bias,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=bool(module.add_zero_attn),
            kdim=int(module.kdim),
            vdim=int(module.vdim),
            batch_first=bool(module.batch_first),
            dtype=dtype,
            seed=0,  # every parameter is overwritten just below
            precision=precision,
        )
        new.load_state_dict(module.state_dict())
        new.train(bool(getattr(module, "training", False)))
        return new

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def _as_input(self, x: npt.ArrayLike, name: str) -> np.ndarray[Any, Any]:
        """A floating input in the module's dtype; anything else goes on to the functional checks."""
        a = as_array(x, name)
        if is_floating(a.dtype) and a.dtype != self.dtype:
            a = a.astype(self.dtype)
        return a

    def forward(
        self,
        query: npt.ArrayLike,
        key: npt.ArrayLike,
        value: npt.ArrayLike,
        key_padding_mask: npt.ArrayLike | None = None,
        need_weights: bool = True,
        attn_mask: npt.ArrayLike | None = None,
        average_attn_weights: bool = True,
        is_causal: bool | Literal["top_left", "bottom_right"] = False,
        *,
        precision: Precision | None = None,
    ) -> tuple[FloatArray, FloatArray | None]:
        """Attend from ``query`` to ``key``/``value``, as ``torch.nn.MultiheadAttention.forward``.

        Parameters
        ----------
        query : array_like, shape (L, N, E), or (N, L, E) with ``batch_first``, or (L, E)
        key : array_like, shape (S, N, kdim), or (N, S, kdim) with ``batch_first``, or (S, kdim)
        value : array_like, shape (S, N, vdim), or (N, S, vdim) with ``batch_first``, or (S, vdim)
            Floating inputs are converted to the module's dtype, which is the
            dtype of the results.
        key_padding_mask : array_like, shape (N, S) or (S,) unbatched, optional
            bool: True means the key is ignored; float: added to the scores.
        need_weights : bool, default True
            Also return the attention weights.
        attn_mask : array_like, shape (L, S) or (N * num_heads, L, S), optional
            bool: True means *not* allowed to attend; float: added to the scores.
        average_attn_weights : bool, default True
            Average the returned weights over the heads.
        is_causal : {False, True, "top_left", "bottom_right"}, default False
            Apply the causal mask: True or ``"top_left"``: query ``i`` attends
            keys ``j <= i``; ``"bottom_right"``: keys ``j <= i + S - L``. Unlike
            torch, no ``attn_mask`` is needed; when one is given, it is used as given.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. This call's precision; None is the module's
            (:attr:`precision`).

        Returns
        -------
        attn_output : ndarray, shape (L, N, E), or (N, L, E) with ``batch_first``, or (L, E)
        attn_weights : ndarray or None
            ``(N, L, S')`` averaged over heads, ``(N, num_heads, L, S')`` otherwise
            (without N for unbatched input); ``S'`` counts the ``bias_k`` and
            zero-attention positions. None unless ``need_weights``.

        Notes
        -----
        A query row whose keys are all masked gives a zero attention row (so
        the output row equals ``out_proj_bias``), where torch gives NaN.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> mha = attnx.MultiheadAttention(8, 2, batch_first=True, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
        >>> padding = np.array([[False, False, False, False], [False, False, True, True]])
        >>> out, weights = mha(x, x, x, key_padding_mask=padding, average_attn_weights=False)
        >>> out.shape, weights.shape
        ((2, 4, 8), (2, 2, 4, 4))
        >>> bool((weights[1, :, :, 2:] == 0).all())      # padded keys get no weight
        True
        >>> out, none = mha(x, x, x, need_weights=False, is_causal=True)
        >>> out.shape, none
        ((2, 4, 8), None)
        """
        if self.dropout and self.training:
            raise NotImplementedError(_DROPOUT_MESSAGE.format(dropout=self.dropout))
        weights = self.__dict__.get("_weights_cache")
        if weights is None:  # not kept: half precision, or parameters the core cannot share
            weights = self._weights()
            if self.dtype.itemsize == 2:  # half precision: inputs rounded to it first
                query = self._as_input(query, "query")
                key, value = self._as_input(key, "key"), self._as_input(value, "value")
        code = self._precision if precision is None else module_precision(self, precision)
        if type(need_weights) is bool and type(average_attn_weights) is bool and is_causal is False and not code:
            options = _OPTIONS[self.batch_first][need_weights][average_attn_weights]
        else:
            options = mha_options(is_causal, need_weights, average_attn_weights, self.batch_first, attn_mask, code)
        if key_padding_mask is None and attn_mask is None:
            return _core.mha(weights, query, key, value, None, options)
        return _core.mha(weights, query, key, value, (attn_mask, key_padding_mask, None, None), options)

    def _weights(self) -> _core.MhaWeights:
        """The parameters, checked, as the core takes them.

        Kept until an attribute of the module is assigned (``__setattr__`` drops them) where
        they share the parameters' memory, so that values written in place are seen: float32
        or float64 parameters, C-contiguous and aligned. Others (half precision, other
        layouts) are converted on every call.
        """
        weights = self.__dict__.get("_weights_cache")
        if weights is not None:
            return weights
        dtype = self.dtype if self.dtype in _COMPUTE_DTYPES else np.dtype(np.float32)
        params = {key.replace(".", "_"): getattr(self, attr) for key, attr in self._KEY_TO_ATTR.items()}
        params.update(add_zero_attn=self.add_zero_attn, use_separate_proj_weight=not self._qkv_same_embed_dim)
        weights = mha_weights(params, self.num_heads, self.embed_dim, dtype, self.dtype)
        shared = self.dtype in _COMPUTE_DTYPES and all(
            type(x) is np.ndarray and x.dtype == self.dtype and x.flags.c_contiguous and x.flags.aligned
            for key, x in params.items() if x is not None and key not in ("add_zero_attn", "use_separate_proj_weight")
        )
        if shared:
            self.__dict__["_weights_cache"] = weights
        return weights

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODE_ATTRIBUTES:
            # Checked here, so that forward's test of them stays one lookup each.
            if name == "dropout":
                value = _dropout_probability(value)
            elif name == "precision":
                code = module_precision(self, value)
                object.__setattr__(self, "_precision", code)
                value = PRECISION_NAMES[code]
            else:
                value = as_bool_flag(value, "training")
        else:
            self.__dict__.pop("_weights_cache", None)
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_weights_cache", None)  # views of the parameters: not the copy's memory
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickles of versions without dropout, training or precision: the defaults.
        self.__dict__.update({"dropout": 0.0, "training": True, "precision": "float32", "_precision": 0, **state})

    __call__ = forward

    # ------------------------------------------------------------------------------------------
    # Decoding
    # ------------------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int, dtype: npt.DTypeLike | None = None) -> KVCache:
        """An empty :class:`KVCache` for :meth:`step` with this module.

        Parameters
        ----------
        batch : int
            Number of sequences.
        max_len : int
            Tokens each sequence can hold.
        dtype : {numpy.float32, numpy.float64, numpy.float16, "bfloat16", numpy.int8}, optional
            Storage dtype of the keys and values; default the module's dtype.

        Returns
        -------
        KVCache
            ``num_kv_heads = num_heads``, ``head_dim = embed_dim // num_heads``.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> attnx.MultiheadAttention(16, 4).new_cache(2, 100, dtype=np.float16)
        KVCache(batch=2, num_kv_heads=4, max_len=100, head_dim=4, dtype=float16, lengths=[0, 0])
        """
        return KVCache(batch, self.num_heads, max_len, self.head_dim, self.dtype if dtype is None else dtype)

    def step(
        self,
        query: npt.ArrayLike,
        cache: KVCache,
        lengths: npt.ArrayLike | None = None,
        *,
        precision: Precision | None = None,
    ) -> FloatArray:
        """One decoding step of causal self-attention: project, append to ``cache``, attend.

        Appends the keys and values of the new tokens to ``cache`` and attends
        from each new token over its sequence's cached tokens up to itself
        (bottom-right causal alignment, per-sequence lengths), reading the
        cache in place. Feeding a sequence token by token (or a prompt, then
        one token at a time) gives the outputs of ``self(x, x, x,
        is_causal=True)`` over the whole sequence. See
        :func:`attnx.multi_head_attention_step`.

        Parameters
        ----------
        query : array_like, shape (T, N, E), or (N, T, E) with ``batch_first``, or (T, E)
            The new tokens; floating inputs are converted to the module's
            dtype, which is the result's dtype. The unbatched form needs a
            cache of batch 1.
        cache : KVCache
            From :meth:`new_cache` (or with ``num_kv_heads = num_heads`` and
            ``head_dim = value_dim = embed_dim // num_heads``).
        lengths : array_like of int, shape (N,), optional
            Valid new tokens per sequence, each in ``[0, T]`` (valid tokens
            first); the others are not appended and their output rows equal
            ``out_proj_bias``. Default: all ``T``.
        precision : {None, "float32", "bfloat16"}, optional
            Keyword-only. This step's precision; None is the module's.

        Returns
        -------
        ndarray, shape (T, N, E), or (N, T, E) with ``batch_first``, or (T, E)
            The attention output (no weights).

        Raises
        ------
        NotImplementedError
            For a module with ``add_bias_kv``, ``add_zero_attn``, or ``kdim`` /
            ``vdim`` other than ``embed_dim`` (no self-attention decoding), and
            in training mode with ``dropout > 0`` (as :meth:`forward`).

        Examples
        --------
        >>> import numpy as np, attnx
        >>> mha = attnx.MultiheadAttention(16, 4, seed=0)
        >>> cache = mha.new_cache(batch=1, max_len=16)
        >>> tokens = np.random.default_rng(0).standard_normal((6, 1, 16)).astype(np.float32)
        >>> steps = [mha.step(tokens[t : t + 1], cache) for t in range(6)]
        >>> full, _ = mha(tokens, tokens, tokens, is_causal=True)
        >>> bool(np.allclose(np.concatenate(steps), full, atol=1e-5))
        True
        """
        if self.add_bias_kv or self.add_zero_attn or not self._qkv_same_embed_dim:
            raise NotImplementedError(
                f"step decodes self-attention only: not available for {self!r} "
                f"(add_bias_kv, add_zero_attn, or kdim/vdim other than embed_dim)"
            )
        if self.dropout and self.training:
            raise NotImplementedError(_DROPOUT_MESSAGE.format(dropout=self.dropout))
        code = self._precision if precision is None else module_precision(self, precision)
        if self.dtype.itemsize == 2:  # half precision: the new tokens rounded to it first
            query = self._as_input(query, "query")
        return mha_step(self._weights(), query, cache, lengths, self.batch_first, code)

    def __repr__(self) -> str:
        args = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.dropout:
            args.append(f"dropout={self.dropout}")
        if not self.bias:
            args.append("bias=False")
        if self.add_bias_kv:
            args.append("add_bias_kv=True")
        if self.add_zero_attn:
            args.append("add_zero_attn=True")
        if not self._qkv_same_embed_dim:
            args += [f"kdim={self.kdim}", f"vdim={self.vdim}"]
        if self.batch_first:
            args.append("batch_first=True")
        args.append(f"dtype={self.dtype.name}")
        if self._precision:
            args.append(f"precision={self.precision!r}")
        return f"{type(self).__name__}({', '.join(args)})"
