"""Rotary position embeddings (RoPE), with Hugging Face transformers' conventions.

:class:`RotaryEmbedding` rotates the queries and keys of attention by angles that grow
with each token's position, so that the score of query ``m`` and key ``n`` depends on
``m - n`` only. It computes what transformers' rotary modules compute (Llama, Qwen,
Gemma, Phi, GPT-NeoX, GPT-J), with the same float32 frequencies and tables:

* ``inv_freq[i] = 1 / base ** (2i / rotary_dim)`` in float32, optionally rescaled
  (``"linear"`` or ``"llama3"`` scaling);
* the angle of position ``p`` is ``float32(p) * inv_freq``, and its cosine and sine
  are float32;
* dimension ``i`` is paired with ``i + rotary_dim / 2`` (``rotate_half``), or with
  its neighbour (``interleaved=True``, GPT-J's ``rotate_every_two``), and each pair
  ``(a, b)`` becomes ``(a cos - b sin, b cos + a sin)``; dimensions past
  ``rotary_dim`` pass unchanged.

:func:`attnx.cached_attention` applies one with ``rope=``.
"""

from __future__ import annotations

import math
import operator
import threading
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ._arrays import as_array, is_half, shape_str

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import FloatArray

__all__ = ["RotaryEmbedding"]

# The keys each rope_type's `scaling` dict takes, besides "rope_type" itself.
_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# The cos/sin tables grow by doubling up to this many entries each (float32: 16 MiB a table);
# positions past what fits are computed for the call alone, with the same arithmetic.
_TABLE_ENTRIES = 1 << 22

# Model types whose rotary embedding pairs neighbouring dimensions (rotate_every_two).
_INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen"})


def _f32(value: float) -> np.float32:
    return np.float32(value)


def _default_inv_freq(base: float, rotary_dim: int) -> np.ndarray[Any, Any]:
    """``1 / base ** (arange(0, rotary_dim, 2) / rotary_dim)`` in float32, as transformers.

    The exponents are float32 quotients. The power is taken in float64 and rounded once:
    that is float32's correctly rounded power, which torch's float32 power (a vectorized
    approximation) equals but for an ulp at some exponents; NumPy's own float32 power may
    be two ulps away.
    """
    exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / _f32(rotary_dim)
    power = np.power(np.float64(_f32(base)), exponent.astype(np.float64)).astype(np.float32)
    return _f32(1.0) / power


def _llama3_inv_freq(inv_freq: np.ndarray[Any, Any], scaling: Mapping[str, float]) -> np.ndarray[Any, Any]:
    """Llama 3.1's rescaling of the frequencies, in transformers' float32 operations.

    Wavelengths shorter than ``original / high_freq_factor`` keep their frequency, those
    longer than ``original / low_freq_factor`` are divided by ``factor``, and those between
    are interpolated. A scalar divided by a float32 array is, in torch, the array's
    reciprocal times the scalar, and so here: the same roundings give the same values.
    """
    factor = _f32(scaling["factor"])
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_freq_wavelen = _f32(original / low)
    high_freq_wavelen = _f32(original / high)
    wavelen = (_f32(1.0) / inv_freq) * _f32(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = ((_f32(1.0) / wavelen) * _f32(original) - _f32(low)) / _f32(high - low)
    smoothed = (_f32(1.0) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _positive_finite(value: Any, name: str, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}): {fix}")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}: {fix}")
    return number


def _check_scaling(scaling: Any) -> dict[str, Any] | None:
    """A normalised copy of ``scaling``: None for the default frequencies."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"scaling must be None or a dict such as {{'rope_type': 'linear', 'factor': 2.0}}, "
            f"got {type(scaling).__name__}"
        )
    given = dict(scaling)
    # Older transformers configs spell the key "type".
    rope_type = given.pop("rope_type", given.pop("type", None))
    if rope_type not in _SCALING_KEYS:
        raise ValueError(
            f"scaling['rope_type'] must be one of {sorted(_SCALING_KEYS)}, got {rope_type!r} "
            f"(dynamic, yarn and longrope scaling are not supported)"
        )
    keys = _SCALING_KEYS[rope_type]
    missing = [key for key in keys if key not in given]
    unknown = sorted(str(key) for key in given if key not in keys)
    if missing or unknown:
        raise ValueError(
            f"scaling with rope_type {rope_type!r} takes the keys {list(keys)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {unknown} (base and rotary_dim are arguments of their own)" if unknown else "")
        )
    if rope_type == "default":
        return None
    normal: dict[str, Any] = {"rope_type": rope_type}
    for key in keys:
        normal[key] = _positive_finite(given[key], f"scaling[{key!r}]", f"give a positive {key}")
    if rope_type == "llama3":
        if not normal["low_freq_factor"] < normal["high_freq_factor"]:
            raise ValueError(
                f"scaling['low_freq_factor'] ({normal['low_freq_factor']}) must be less than "
                f"scaling['high_freq_factor'] ({normal['high_freq_factor']})"
            )
        original = given["original_max_position_embeddings"]
        if isinstance(original, float) and original.is_integer():
            original = int(original)
        if not isinstance(original, (int, np.integer)):
            raise TypeError(
                f"scaling['original_max_position_embeddings'] must be an int, got {original!r}"
            )
        normal["original_max_position_embeddings"] = int(original)
    return normal


def _as_positions(positions: Any, total: int) -> np.ndarray[Any, Any]:
    """``positions`` as a 1-D int64 array of ``total`` non-negative entries."""
    p = positions if type(positions) is np.ndarray else as_array(positions, "positions")
    if p.dtype.kind not in "iu":
        raise TypeError(f"positions must be an array of integers, got dtype {p.dtype}")
    if p.shape != (total,):
        raise ValueError(
            f"positions must have shape ({total},), one per row of x, got {shape_str(p.shape)}"
        )
    if total and p.min() < 0:
        raise ValueError(f"positions must be >= 0, got a minimum of {int(p.min())}")
    return p


class RotaryEmbedding:
    """Rotary position embeddings, as Hugging Face transformers computes them.

    ``rope(x, positions)`` rotates each pair of dimensions of ``x`` by the angle
    ``positions * inv_freq[i]``: the score of a rotated query at position ``m``
    and a rotated key at position ``n`` then depends on ``m - n`` only. The
    frequencies, angles, cosines and sines are float32, computed as
    transformers' rotary modules compute them (within an ulp of torch's float32
    power and trigonometric functions), and applied as its
    ``apply_rotary_pos_emb``: ``x * cos + rotate(x) * sin``.

    Parameters
    ----------
    head_dim : int
        The last dimension of the queries and keys.
    base : float, default 10000.0
        The base of the wavelengths (transformers' ``rope_theta``), finite and > 0.
    rotary_dim : int, optional, keyword-only
        The first ``rotary_dim`` dimensions are rotated, the others pass
        unchanged (partial rotary embeddings, as Phi and GPT-J). Even, in
        ``[2, head_dim]``. Default: ``head_dim``.
    interleaved : bool, default False, keyword-only
        False pairs dimension ``i`` with ``i + rotary_dim / 2`` (transformers'
        ``rotate_half``: Llama, Qwen, Gemma, Phi, GPT-NeoX). True pairs ``2i``
        with ``2i + 1`` (``rotate_every_two``: GPT-J, CodeGen).
    scaling : dict, optional, keyword-only
        Frequency scaling, with transformers' keys and meaning: None (or
        ``{"rope_type": "default"}``); ``{"rope_type": "linear", "factor": f}``
        (the frequencies divided by ``f``); or ``{"rope_type": "llama3",
        "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}`` (Llama 3.1).

    Attributes
    ----------
    head_dim, rotary_dim, base, interleaved
        As given (``rotary_dim`` resolved).
    scaling : dict or None
        A copy of the scaling, None for the default frequencies.
    inv_freq : ndarray, shape (rotary_dim // 2,), float32, read-only
        The frequencies of the pairs.
    attention_scaling : float
        The factor applied to the cosines and sines: 1.0 for these scalings.

    Notes
    -----
    float32 inputs are rotated in float32; float64 inputs in float64 (with the
    float32 cosines and sines); float16 and bfloat16 inputs as a transformers
    model of that dtype does: the cosines and sines rounded to it, and each
    product and the sum rounded to it. The cosines and sines of the positions
    seen are kept in tables (grown by doubling), so that a decoding step looks
    them up rather than computing them again; a table entry is what computing
    it for one position gives.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rope = attnx.RotaryEmbedding(64, base=500000.0)
    >>> rope
    RotaryEmbedding(head_dim=64, base=500000.0)
    >>> rope.inv_freq.shape, rope.inv_freq.dtype
    ((32,), dtype('float32'))
    >>> q = np.random.default_rng(0).standard_normal((5, 8, 64), dtype=np.float32)  # (tokens, heads, dim)
    >>> positions = np.arange(5)
    >>> rotated = rope(q, positions)
    >>> rotated.shape, rotated.dtype
    ((5, 8, 64), dtype('float32'))
    >>> bool(np.array_equal(rotated[0], q[0]))      # position 0 is not rotated
    True

    Scores depend on the distance between positions only:

    >>> k = q[:1]
    >>> def score(m, n):
    ...     return float(rope(q[:1], np.array([m]))[0, 0] @ rope(k, np.array([n]))[0, 0])
    >>> abs(score(7, 3) - score(104, 100)) < 1e-4
    True
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        head_dim = self._as_dim(head_dim, "head_dim")
        if head_dim < 2:
            raise ValueError(f"head_dim must be at least 2 (one rotated pair), got {head_dim}")
        rotary = head_dim if rotary_dim is None else self._as_dim(rotary_dim, "rotary_dim")
        if rotary < 2 or rotary % 2 or rotary > head_dim:
            raise ValueError(
                f"rotary_dim must be even and in [2, head_dim = {head_dim}], got {rotary}: "
                f"it counts the rotated dimensions, in pairs (leave it None to rotate all)"
            )
        base = _positive_finite(base, "base", "pass the model's rope_theta (e.g. 10000.0)")
        if not isinstance(interleaved, (bool, np.bool_)):
            raise TypeError(f"interleaved must be True or False, got {interleaved!r}")
        normal = _check_scaling(scaling)

        inv_freq = _default_inv_freq(base, rotary)
        if normal is not None and normal["rope_type"] == "linear":
            inv_freq = inv_freq / _f32(normal["factor"])
        elif normal is not None and normal["rope_type"] == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, normal)
        inv_freq = np.ascontiguousarray(inv_freq, np.float32)
        inv_freq.flags.writeable = False

        self._head_dim = head_dim
        self._rotary_dim = rotary
        self._base = base
        self._interleaved = bool(interleaved)
        self._scaling = normal
        self._inv_freq = inv_freq
        self._attention_scaling = 1.0
        # (cos, sin), each (entries, rotary_dim) float32 (see _spread), replaced whole when it grows, so
        # that a reader in another thread sees an old table or a new one, never half of one.
        self._tables: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] = self._spread(*self._compute(np.arange(0)))
        self._grow = threading.Lock()

    @staticmethod
    def _as_dim(value: Any, name: str) -> int:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be an int, got {value!r}")
        try:
            return operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None

    # -- attributes -------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        """The last dimension of the queries and keys."""
        return self._head_dim

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions are rotated (even, at most ``head_dim``)."""
        return self._rotary_dim

    @property
    def base(self) -> float:
        """The base of the wavelengths (``rope_theta``)."""
        return self._base

    @property
    def interleaved(self) -> bool:
        """Whether pairs are neighbours (GPT-J) rather than halves (Llama)."""
        return self._interleaved

    @property
    def scaling(self) -> dict[str, Any] | None:
        """A copy of the frequency scaling; None for the default frequencies."""
        return None if self._scaling is None else dict(self._scaling)

    @property
    def inv_freq(self) -> FloatArray:
        """The float32 frequencies of the ``rotary_dim // 2`` pairs (read-only)."""
        return self._inv_freq

    @property
    def attention_scaling(self) -> float:
        """The factor of the cosines and sines (1.0 for the supported scalings)."""
        return self._attention_scaling

    # -- tables -----------------------------------------------------------------------------

    def _compute(self, positions: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """cos and sin, float32 ``positions.shape + (rotary_dim // 2,)``, computed afresh.

        The angle is the float32 product of the position (as float32) and the frequency,
        as transformers computes it; its cosine and sine are taken in float64 and rounded
        once, float32's correctly rounded values.
        """
        angles = positions.astype(np.float32)[..., None] * self._inv_freq
        wide = angles.astype(np.float64)
        cos, sin = np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)
        if self._attention_scaling != 1.0:
            cos *= _f32(self._attention_scaling)
            sin *= _f32(self._attention_scaling)
        return cos, sin

    def _spread(self, cos: np.ndarray[Any, Any], sin: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Half-width cos and sin (..., rotary_dim // 2) as full-width factors (..., rotary_dim).

        Each dimension's cosine, and its sine signed as it multiplies the pair's other
        dimension: ``x * cos + swap(x) * sin`` then rotates, with ``swap`` exchanging the
        dimensions of each pair. The sign is exact, so the products and sum are
        transformers' ``x * cos + rotate_half(x) * sin``, rounding for rounding.
        """
        if self._interleaved:
            wide_cos = np.repeat(cos, 2, axis=-1)
            wide_sin = np.stack((-sin, sin), axis=-1).reshape(sin.shape[:-1] + (self._rotary_dim,))
        else:
            wide_cos = np.concatenate((cos, cos), axis=-1)
            wide_sin = np.concatenate((-sin, sin), axis=-1)
        return wide_cos, wide_sin

    def _cos_sin(self, positions: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The full-width factors (see `_spread`) of non-negative integer ``positions`` (any shape),
        float32 ``positions.shape + (rotary_dim,)``, looked up in the tables."""
        if positions.size == 0:
            return self._spread(*self._compute(positions.astype(np.int64)))
        cos, sin = self._tables
        top = int(positions.max())
        if top >= len(cos):
            width = self._rotary_dim
            if (top + 1) * width > _TABLE_ENTRIES:
                return self._spread(*self._compute(positions))
            with self._grow:
                cos, sin = self._tables
                if top >= len(cos):
                    size = max(64, len(cos))
                    while size <= top:
                        size *= 2
                    size = max(top + 1, min(size, _TABLE_ENTRIES // width))
                    # Only the new rows are computed: an entry never depends on the table's size.
                    more = self._spread(*self._compute(np.arange(len(cos), size)))
                    cos, sin = np.concatenate((cos, more[0])), np.concatenate((sin, more[1]))
                    cos.flags.writeable = sin.flags.writeable = False
                    self._tables = (cos, sin)
        return cos[positions], sin[positions]

    # -- rotation ---------------------------------------------------------------------------

    def _rotate(self, x: np.ndarray[Any, Any], cos: np.ndarray[Any, Any], sin: np.ndarray[Any, Any]) -> FloatArray:
        """``x`` (..., head_dim) rotated by the float32 factors of `_cos_sin`, broadcastable to
        (..., rotary_dim). A new array of x's dtype; x is only read.

        Whole rows at a time, contiguous where x is: ``x * cos + swap(x) * sin``.
        """
        r, half = self._rotary_dim, self._rotary_dim // 2
        rot = x[..., :r] if r < self._head_dim else x
        swapped = np.empty(rot.shape, x.dtype)
        if self._interleaved:
            swapped[..., 0::2], swapped[..., 1::2] = rot[..., 1::2], rot[..., 0::2]
        else:
            swapped[..., :half], swapped[..., half:] = rot[..., half:], rot[..., :half]
        out = np.empty(x.shape, x.dtype)
        if r < self._head_dim:
            out[..., r:] = x[..., r:]
        if is_half(x.dtype):
            # As torch computes a float16/bfloat16 model: the factors rounded to its dtype, and
            # each product and the sum rounded to it. The product of two halves is exact in
            # float32, so one float32 operation and one rounding give torch's value.
            dtype = x.dtype
            c = cos.astype(dtype).astype(np.float32)
            s = sin.astype(dtype).astype(np.float32)
            first = (rot.astype(np.float32) * c).astype(dtype).astype(np.float32)
            second = (swapped.astype(np.float32) * s).astype(dtype).astype(np.float32)
            first += second
            out[..., :r] = first           # rounded to the dtype as it is stored
            return out
        if x.dtype != np.float32:
            cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        # The two products are rounded, then their sum: transformers' order of operations.
        head = out[..., :r]
        np.multiply(rot, cos, out=head)
        np.multiply(swapped, sin, out=swapped)
        np.add(head, swapped, out=head)
        return out

    def __call__(self, x: npt.ArrayLike, positions: npt.ArrayLike) -> FloatArray:
        """Rotate ``x`` at ``positions``.

        Parameters
        ----------
        x : array_like, shape (total, H, head_dim)
            Rows of queries or keys (``total`` tokens, ``H`` heads), float32,
            float64, float16 or bfloat16. Not modified.
        positions : array_like of int, shape (total,)
            The position of each row, ``>= 0``.

        Returns
        -------
        ndarray, shape (total, H, head_dim)
            The rotated rows, a new array of x's dtype.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> rope = attnx.RotaryEmbedding(4)
        >>> x = np.array([[[1.0, 0.0, 0.0, 0.0]]], np.float32)
        >>> rope(x, [0]).tolist()
        [[[1.0, 0.0, 0.0, 0.0]]]
        >>> rope(x, [1]).round(4)      # dims 0 and 2 turn by 1 radian
        array([[[0.5403, 0.    , 0.8415, 0.    ]]], dtype=float32)
        """
        a = x if type(x) is np.ndarray else as_array(x, "x")
        if not (a.dtype.type in (np.float32, np.float64) or is_half(a.dtype)):
            raise TypeError(f"x must be float32, float64, float16 or bfloat16, got dtype {a.dtype}")
        if a.ndim != 3 or a.shape[2] != self._head_dim:
            raise ValueError(
                f"x must have shape (total, H, head_dim) with head_dim = {self._head_dim}, got {shape_str(a.shape)}"
            )
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        p = _as_positions(positions, a.shape[0])
        cos, sin = self._cos_sin(p)
        return self._rotate(a, cos[:, None, :], sin[:, None, :])

    # -- construction from a transformers config -------------------------------------------

    @classmethod
    def from_config(cls, config: Any, *, interleaved: bool | None = None) -> RotaryEmbedding:
        """The rotary embedding a transformers model config describes.

        Reads, from a config object or its ``to_dict()`` (transformers is not
        imported): the head dimension (``head_dim``, else ``hidden_size //
        num_attention_heads``, or GPT-J's ``n_embd // n_head``); the base and
        scaling from ``rope_parameters`` (transformers 5: ``rope_type``,
        ``rope_theta``, ``factor``, ...) or the older ``rope_theta`` and
        ``rope_scaling``; the rotated dimensions from ``partial_rotary_factor``
        (Phi), ``rotary_dim`` (GPT-J) or ``rotary_pct`` (GPT-NeoX).

        Parameters
        ----------
        config : transformers config or dict
        interleaved : bool, optional, keyword-only
            Default: True for ``model_type`` ``"gptj"`` and ``"codegen"``,
            whose attention pairs neighbouring dimensions, else False.

        Returns
        -------
        RotaryEmbedding

        Examples
        --------
        >>> import attnx
        >>> attnx.RotaryEmbedding.from_config({
        ...     "hidden_size": 4096, "num_attention_heads": 32,
        ...     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        ...                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        ...                         "original_max_position_embeddings": 8192}})
        RotaryEmbedding(head_dim=128, base=500000.0, scaling={'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192})
        >>> attnx.RotaryEmbedding.from_config({"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64})
        RotaryEmbedding(head_dim=256, base=10000.0, rotary_dim=64, interleaved=True)
        """
        if isinstance(config, Mapping):
            def get(name: str) -> Any:
                return config.get(name)
        else:
            def get(name: str) -> Any:
                return getattr(config, name, None)

        head_dim = get("head_dim")
        if head_dim is None:
            width = get("hidden_size") or get("n_embd")
            heads = get("num_attention_heads") or get("n_head")
            if width is None or not heads:
                raise ValueError(
                    "config gives no head dimension: it needs head_dim, or hidden_size and num_attention_heads"
                )
            head_dim = int(width) // int(heads)

        params = get("rope_parameters")
        if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(
                f"config's rope_parameters differ by layer type ({sorted(params)}): pass one layer type's, "
                f"e.g. RotaryEmbedding.from_config({{'head_dim': ..., 'rope_parameters': "
                f"config.rope_parameters[{next(iter(params))!r}]}})"
            )
        params = dict(params or get("rope_scaling") or {})
        base = params.pop("rope_theta", None)
        if base is None:
            base = get("rope_theta")
        if base is None:
            base = 10000.0
        factor = params.pop("partial_rotary_factor", None)
        if factor is None:
            factor = get("partial_rotary_factor")
        rotary_dim = None
        if factor is not None:
            rotary_dim = int(head_dim * factor)
        elif get("rotary_dim"):
            rotary_dim = int(get("rotary_dim"))
        elif get("rotary_pct") is not None:
            rotary_dim = int(head_dim * get("rotary_pct"))

        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None
        if rope_type != "default":
            keys = _SCALING_KEYS.get(rope_type)
            if keys is None:
                raise ValueError(
                    f"config's rope_type {rope_type!r} is not supported: attnx computes "
                    f"{sorted(_SCALING_KEYS)} rotary embeddings"
                )
            if "original_max_position_embeddings" in keys and "original_max_position_embeddings" not in params:
                # transformers' fallback: the config's own original_max_position_embeddings, else
                # its max_position_embeddings.
                original = get("original_max_position_embeddings") or get("max_position_embeddings")
                if original is not None:
                    params["original_max_position_embeddings"] = original
            scaling = {"rope_type": rope_type, **{key: params[key] for key in keys if key in params}}
        if interleaved is None:
            interleaved = get("model_type") in _INTERLEAVED_MODEL_TYPES
        return cls(head_dim, base, rotary_dim=rotary_dim, interleaved=interleaved, scaling=scaling)

    # -- copies and printing ----------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # The arguments alone: the frequencies are computed again, the tables filled on use.
        return {
            "head_dim": self._head_dim,
            "base": self._base,
            "rotary_dim": self._rotary_dim,
            "interleaved": self._interleaved,
            "scaling": self.scaling,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        parts = [f"head_dim={self._head_dim}", f"base={self._base!r}"]
        if self._rotary_dim != self._head_dim:
            parts.append(f"rotary_dim={self._rotary_dim}")
        if self._interleaved:
            parts.append("interleaved=True")
        if self._scaling is not None:
            parts.append(f"scaling={self._scaling!r}")
        return f"RotaryEmbedding({', '.join(parts)})"
