"""A preallocated key/value cache for decoding one token (or a few) at a time.

:class:`KVCache` holds the keys and values of the tokens a batch of sequences has
seen so far, in storage allocated once at its full length. Each sequence has its
own length, so a batch may be ragged, and a slot can be reset and reused for a
new sequence (continuous batching). :func:`attnx.cached_attention` and
:meth:`attnx.MultiheadAttention.step` read the storage in place: the cache is
never copied, and keys past a sequence's length are never read.

:class:`TransformerDecoderCache` holds a :class:`KVCache` per layer of a
:class:`attnx.TransformerDecoder`, and the keys and values of its memory.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, NamedTuple, SupportsIndex

import numpy as np

from . import _core
from ._arrays import as_array, as_lengths, as_positive_int, is_floating, is_half, shape_str

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import FloatArray, IntArray

__all__ = ["KVCache", "TransformerDecoderCache"]


_DTYPES = "float32, float64, float16, bfloat16 or int8"


def _storage_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    """float32, float64, float16, bfloat16 (ml_dtypes, imported only when asked for by name) or int8."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("dtype 'bfloat16' needs the ml_dtypes package (pip install ml_dtypes)") from None
        dtype = ml_dtypes.bfloat16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be {_DTYPES}, got {dtype!r}") from None
    if dt.type in (np.float32, np.float64, np.int8):
        return np.dtype(dt.type)
    if is_half(dt):
        return dt.newbyteorder("=")
    raise TypeError(f"dtype must be {_DTYPES}, got {dt}")


def _zeros_on_cache_line(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray[Any, Any]:
    """Zeros whose first byte starts a 64-byte cache line (NumPy's own start 16 bytes past one
    for large arrays): with a head dim of whole lines, every key and value row does too, and the
    kernels' vector loads of a row stay within its lines."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    buffer = np.zeros(count * dtype.itemsize + 64, np.uint8)
    start = -buffer.ctypes.data % 64
    return buffer[start : start + count * dtype.itemsize].view(dtype).reshape(shape)


def _read_only(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    view = a.view()
    view.flags.writeable = False
    return view


class CacheStorage(NamedTuple):
    """The arrays of a :class:`KVCache` (see :meth:`KVCache.storage`)."""

    key: FloatArray
    value: FloatArray
    lengths: IntArray


class CacheScales(NamedTuple):
    """The per-row scales of an int8 :class:`KVCache` (see :meth:`KVCache.scales`)."""

    key: FloatArray
    value: FloatArray


def _quantize(x: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Each last-axis row of `x` (any float dtype) as an int8 cache stores it: (int8 rows, float32
    scales of shape x.shape[:-1]); see :class:`KVCache`."""
    if x.dtype not in (np.float32, np.float64):
        x = x.astype(np.float32)
    # C-contiguous and aligned (the core reads rows of float32 or float64 elements).
    rows = np.require(x, requirements=["C", "A"]).reshape(-1, x.shape[-1])
    q = np.empty(rows.shape, np.int8)
    scales = np.empty(rows.shape[0], np.float32)
    if rows.size:  # (NumPy calls an empty array aligned wherever its pointer lies)
        _core.quantize_int8(rows, q, scales)
    return q.reshape(x.shape), scales.reshape(x.shape[:-1])


class KVCache:
    """Keys and values of a batch of sequences, preallocated for ``max_len`` tokens each.

    The storage is allocated (zeroed) once; :meth:`append` writes the keys and
    values of new tokens after each sequence's current length. The attention
    functions read the storage in place, up to each sequence's length.

    Parameters
    ----------
    batch : int
        Number of sequences (slots).
    num_kv_heads : int
        Key/value heads. The query of :func:`attnx.cached_attention` may have
        any multiple of it (grouped-query / multi-query attention).
    max_len : int
        Tokens each sequence can hold.
    head_dim : int
        Width of a key (and of a query) per head.
    dtype : {numpy.float32, numpy.float64, numpy.float16, "bfloat16", numpy.int8}, default numpy.float32
        Storage dtype. float16 and bfloat16 (``ml_dtypes.bfloat16``, or the
        string ``"bfloat16"`` with ml_dtypes installed) halve the memory and
        the bytes an attention step reads; they are computed in float32.
        int8 quarters them: each appended key row and value row of each head
        (its ``head_dim`` or ``value_dim`` values, taken as float32) is stored
        as ``q = clip(rint(x / scale), -127, 127)`` (round half to even) with
        its own float32 ``scale = max|x| / 127`` (see :meth:`scales`); it reads
        as ``scale * q``, computed in float32. A row of zeros has scale 0. A
        row holding NaN or an infinity gets scale NaN (and q = 0), so that
        every score or output it reaches is NaN, as a non-finite input is
        never silently dropped.
    value_dim : int, optional, keyword-only
        Width of a value per head (default ``head_dim``).

    Attributes
    ----------
    key : ndarray, shape (batch, num_kv_heads, max_len, head_dim)
        The key storage (a read-only view). Only the first ``lengths[b]``
        positions of sequence ``b`` are in use.
    value : ndarray, shape (batch, num_kv_heads, max_len, value_dim)
        The value storage (a read-only view).
    lengths : ndarray of int64, shape (batch,)
        Tokens held per sequence (a read-only view).
    batch, num_kv_heads, max_len, head_dim, value_dim : int
    dtype : numpy.dtype
    key_scales, value_scales : ndarray of float32, shape (batch, num_kv_heads, max_len), or None
        The per-row scales of an int8 cache (read-only views); None for the
        other dtypes.
    nbytes : int
        Bytes of the key and value storage (int8: their scales included).

    Notes
    -----
    Reading a cache from several threads at once is safe; appending to it
    (:meth:`append`, or :func:`attnx.cached_attention` / ``step`` with new
    tokens) while another thread uses it is not. Pickling keeps only the
    positions in use.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> cache = attnx.KVCache(2, 4, 128, 16, dtype=np.float16)
    >>> k = v = np.ones((2, 4, 3, 16), np.float32)
    >>> cache.append(k, v, lengths=[3, 1])          # ragged: 3 new tokens, and 1
    >>> cache.lengths
    array([3, 1])
    >>> q = np.ones((2, 8, 1, 16), np.float32)      # 8 query heads share 4 kv heads
    >>> attnx.cached_attention(q, cache).shape
    (2, 8, 1, 16)
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: npt.DTypeLike = np.float32,
        *,
        value_dim: int | None = None,
    ) -> None:
        self._batch = as_positive_int(batch, "batch")
        self._num_kv_heads = as_positive_int(num_kv_heads, "num_kv_heads")
        self._max_len = as_positive_int(max_len, "max_len")
        self._head_dim = as_positive_int(head_dim, "head_dim")
        self._value_dim = self._head_dim if value_dim is None else as_positive_int(value_dim, "value_dim")
        self._dtype = _storage_dtype(dtype)
        self._allocate()

    def _allocate(self) -> None:
        lead = (self._batch, self._num_kv_heads, self._max_len)
        self._key = _zeros_on_cache_line(lead + (self._head_dim,), self._dtype)
        self._value = _zeros_on_cache_line(lead + (self._value_dim,), self._dtype)
        self._lengths = np.zeros(self._batch, np.int64)
        self._scales = None
        if self._dtype == np.int8:
            self._scales = CacheScales(np.zeros(lead, np.float32), np.zeros(lead, np.float32))

    # ------------------------------------------------------------------------------------------
    # Read-only views and sizes
    # ------------------------------------------------------------------------------------------

    @property
    def key(self) -> FloatArray:
        return _read_only(self._key)

    @property
    def value(self) -> FloatArray:
        return _read_only(self._value)

    @property
    def lengths(self) -> IntArray:
        return _read_only(self._lengths)

    @property
    def key_scales(self) -> FloatArray | None:
        return None if self._scales is None else _read_only(self._scales.key)

    @property
    def value_scales(self) -> FloatArray | None:
        return None if self._scales is None else _read_only(self._scales.value)

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def value_dim(self) -> int:
        return self._value_dim

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def nbytes(self) -> int:
        scales = 0 if self._scales is None else self._scales.key.nbytes + self._scales.value.nbytes
        return self._key.nbytes + self._value.nbytes + scales

    # ------------------------------------------------------------------------------------------
    # Updates
    # ------------------------------------------------------------------------------------------

    def _check_new(self, x: npt.ArrayLike, name: str, width: int) -> np.ndarray[Any, Any]:
        a = as_array(x, name)
        if not is_floating(a.dtype):
            raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
        expected = f"(batch, num_kv_heads, T, {'head_dim' if name == 'key' else 'value_dim'})"
        if a.ndim != 4 or a.shape[:2] != (self._batch, self._num_kv_heads) or a.shape[3] != width:
            raise ValueError(
                f"{name} must have shape {expected} = ({self._batch}, {self._num_kv_heads}, T, {width}) "
                f"for this cache, got {shape_str(a.shape)}"
            )
        return a

    def append(self, key: npt.ArrayLike, value: npt.ArrayLike, lengths: npt.ArrayLike | None = None) -> None:
        """Write the keys and values of new tokens after each sequence's current length.

        Parameters
        ----------
        key : array_like, shape (batch, num_kv_heads, T, head_dim)
            Keys of ``T`` new tokens per sequence; converted to the cache's dtype
        (int8: quantized row by row, see the class).
        value : array_like, shape (batch, num_kv_heads, T, value_dim)
            Values of the same tokens.
        lengths : array_like of int, shape (batch,), optional
            How many of the ``T`` new tokens are valid per sequence, each in
            ``[0, T]`` (ragged batches: the valid tokens come first; the rest
            are ignored). Default: all ``T``.

        Raises
        ------
        ValueError
            Shapes that do not fit the cache, lengths out of range, or a
            sequence that would grow past ``max_len``. Nothing is written
            when an error is raised.
        TypeError
            Non-floating keys or values, or non-integer lengths.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> cache = attnx.KVCache(2, 1, 8, 4)
        >>> cache.append(np.ones((2, 1, 3, 4)), np.ones((2, 1, 3, 4)), lengths=[3, 2])
        >>> cache.append(np.full((2, 1, 1, 4), 2.0), np.full((2, 1, 1, 4), 2.0))
        >>> cache.lengths
        array([4, 3])
        >>> cache.key[1, 0, :4, 0]      # sequence 1: its 2 valid tokens, then the new one
        array([1., 1., 2., 0.], dtype=float32)
        """
        k = self._check_new(key, "key", self._head_dim)
        v = self._check_new(value, "value", self._value_dim)
        T = k.shape[2]
        if v.shape[2] != T:
            raise ValueError(
                f"key and value must hold the same number of new tokens (dim 2): key {shape_str(k.shape)}, "
                f"value {shape_str(v.shape)}"
            )
        if lengths is None:
            new = np.full(self._batch, T, np.int64)
        else:
            new = as_lengths(lengths, self._batch, T, "lengths", f"T = {T}, the new tokens per sequence")
        self.check_room(new)
        # (destination, source) pairs: nothing is written before every source is ready.
        pairs = [(self._key, k), (self._value, v)]
        if self._scales is not None:
            (qk, sk), (qv, sv) = _quantize(k), _quantize(v)
            pairs = [(self._key, qk), (self._value, qv), (self._scales.key, sk), (self._scales.value, sv)]
        start = self._lengths
        if lengths is None and (start == start[0]).all():
            # Every sequence at the same position: one block copy.
            s = int(start[0])
            for dst, src in pairs:
                dst[:, :, s : s + T] = src
        else:
            for b in range(self._batch):
                s, n = int(start[b]), int(new[b])
                if n:
                    for dst, src in pairs:
                        dst[b, :, s : s + n] = src[b, :, :n]
        self._lengths += new

    def check_room(self, new: IntArray) -> None:
        """Raise ValueError unless each sequence ``b`` has room for ``new[b]`` more tokens.

        Parameters
        ----------
        new : ndarray of int64, shape (batch,)
            Tokens about to be appended to each sequence.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> cache = attnx.KVCache(2, 1, 4, 8)
        >>> cache.check_room(np.array([4, 1]))
        >>> cache.check_room(np.array([5, 0]))
        Traceback (most recent call last):
            ...
        ValueError: appending lengths [5, 0] to a cache of max_len 4 with lengths [0, 0] overflows sequence(s) [0]; ...
        """
        total = self._lengths + new
        if total.max(initial=0) > self._max_len:
            full = [int(b) for b in np.nonzero(total > self._max_len)[0]]
            raise ValueError(
                f"appending lengths {new.tolist()} to a cache of max_len {self._max_len} with lengths "
                f"{self._lengths.tolist()} overflows sequence(s) {full}; nothing was written "
                f"(reset finished sequences, or allocate a longer cache)"
            )

    def storage(self) -> CacheStorage:
        """The live arrays the kernels read and write, for code that decodes over the cache.

        Returns
        -------
        CacheStorage
            ``(key, value, lengths)``: the writable key ``(batch, num_kv_heads, max_len,
            head_dim)`` and value storage, and the int64 lengths. Positions at or past a
            sequence's length are never read, so writing there and then raising the
            length appends; setting the lengths back to earlier values undoes appends.
            The :attr:`key`, :attr:`value` and :attr:`lengths` properties are read-only
            views of the same arrays.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> cache = attnx.KVCache(1, 2, 16, 8)
        >>> key, value, lengths = cache.storage()
        >>> key[0, :, :3] = 1.0; value[0, :, :3] = 1.0   # write 3 tokens in place ...
        >>> lengths[0] = 3                                 # ... and take them in
        >>> cache
        KVCache(batch=1, num_kv_heads=2, max_len=16, head_dim=8, dtype=float32, lengths=[3])
        >>> key.flags.writeable, cache.key.flags.writeable
        (True, False)
        """
        return CacheStorage(self._key, self._value, self._lengths)

    def scales(self) -> CacheScales | None:
        """The live per-row scales of an int8 cache, as :meth:`storage` gives its arrays.

        Returns
        -------
        CacheScales or None
            ``(key, value)``: the writable float32 scales ``(batch, num_kv_heads, max_len)`` of
            the key and value rows (row ``j`` of head ``h`` of sequence ``b`` reads as
            ``scales[b, h, j] * storage[b, h, j]``); None for a cache of another dtype.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> cache = attnx.KVCache(1, 1, 4, 4, dtype=np.int8)
        >>> cache.append(np.array([[[[0.5, -1.0, 0.25, 0.0]]]]), np.zeros((1, 1, 1, 4)))
        >>> cache.key[0, 0, 0]
        array([  64, -127,   32,    0], dtype=int8)
        >>> float(cache.scales().key[0, 0, 0] * 127)
        1.0
        """
        return self._scales

    def reset(self, index: SupportsIndex | None = None) -> None:
        """Empty every sequence, or the slot ``index`` only (for continuous batching).

        Parameters
        ----------
        index : int, optional
            The slot to empty (negative counts from the end); default all.
            The storage is not cleared: positions at or past a sequence's
            length are never read.

        Raises
        ------
        IndexError
            ``index`` outside ``[-batch, batch)``.
        TypeError
            ``index`` that is not an integer.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> cache = attnx.KVCache(3, 1, 8, 4)
        >>> cache.append(np.ones((3, 1, 2, 4)), np.ones((3, 1, 2, 4)))
        >>> cache.reset(-1)             # the last sequence is done: its slot is free again
        >>> cache.lengths
        array([2, 2, 0])
        >>> cache.reset()
        >>> cache.lengths
        array([0, 0, 0])
        """
        if index is None:
            self._lengths[:] = 0
            return
        if isinstance(index, (bool, np.bool_)):
            raise TypeError(f"index must be an int or None, got {index!r}")
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"index must be an int or None, got {index!r}") from None
        if not -self._batch <= i < self._batch:
            raise IndexError(f"index {i} is out of range for a cache of batch {self._batch}")
        self._lengths[i] = 0

    # ------------------------------------------------------------------------------------------
    # Pickling (only the positions in use travel) and repr
    # ------------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        used = int(self._lengths.max(initial=0))
        state = {
            "shape": (self._batch, self._num_kv_heads, self._max_len, self._head_dim, self._value_dim),
            "dtype": self._dtype,
            "lengths": self._lengths.copy(),
            "key": self._key[:, :, :used].copy(),
            "value": self._value[:, :, :used].copy(),
        }
        if self._scales is not None:
            state["key_scales"] = self._scales.key[:, :, :used].copy()
            state["value_scales"] = self._scales.value[:, :, :used].copy()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._batch, self._num_kv_heads, self._max_len, self._head_dim, self._value_dim = state["shape"]
        self._dtype = np.dtype(state["dtype"])
        self._allocate()
        used = state["key"].shape[2]
        self._key[:, :, :used] = state["key"]
        self._value[:, :, :used] = state["value"]
        if self._scales is not None:
            self._scales.key[:, :, :used] = state["key_scales"]
            self._scales.value[:, :, :used] = state["value_scales"]
        self._lengths[:] = state["lengths"]

    def __repr__(self) -> str:
        args = [
            f"batch={self._batch}", f"num_kv_heads={self._num_kv_heads}", f"max_len={self._max_len}",
            f"head_dim={self._head_dim}",
        ]
        if self._value_dim != self._head_dim:
            args.append(f"value_dim={self._value_dim}")
        args.append(f"dtype={self._dtype.name}")
        lengths = np.array2string(self._lengths, separator=", ", threshold=8, edgeitems=3)
        args.append(f"lengths={lengths}")
        return f"{type(self).__name__}({', '.join(args)})"


class TransformerDecoderCache:
    """The decoding state of an :class:`attnx.TransformerDecoder`: made by its ``new_cache``.

    Each layer's self-attention keeps the keys and values of the tokens decoded so far in a
    :class:`KVCache` of its own (``layers``); the keys and values its cross-attention reads from
    the memory are projected at the first step and kept while the steps' memory has the same
    values and no cross-attention parameter has been assigned (otherwise they are projected
    anew; values written into a parameter in place between the steps of one cache are not
    seen by the kept projections).

    Parameters
    ----------
    num_layers : int
        Layers of the decoder.
    batch, num_heads, max_len, head_dim : int
        As :class:`KVCache`'s ``batch``, ``num_kv_heads``, ``max_len`` and ``head_dim``.
    dtype : {numpy.float32, numpy.float64, numpy.float16, "bfloat16", numpy.int8}, default numpy.float32
        Storage dtype of the keys and values.

    Attributes
    ----------
    layers : list of KVCache
        One per layer, in order.
    lengths : ndarray of int64, shape (batch,)
        Tokens held per sequence (a read-only view; every layer holds as many).
    batch, max_len : int
    dtype : numpy.dtype

    Examples
    --------
    >>> import numpy as np, attnx
    >>> cache = attnx.TransformerDecoderCache(2, batch=3, num_heads=4, max_len=16, head_dim=8)
    >>> cache
    TransformerDecoderCache(num_layers=2, batch=3, max_len=16, dtype=float32, lengths=[0, 0, 0])
    """

    def __init__(
        self, num_layers: int, batch: int, num_heads: int, max_len: int, head_dim: int,
        dtype: npt.DTypeLike = np.float32,
    ) -> None:
        num_layers = as_positive_int(num_layers, "num_layers")
        self.layers: list[KVCache] = [KVCache(batch, num_heads, max_len, head_dim, dtype) for _ in range(num_layers)]
        self._memory: tuple[np.ndarray[Any, Any], tuple[Any, ...], list[Any]] | None = None

    @property
    def lengths(self) -> IntArray:
        return self.layers[0].lengths

    @property
    def batch(self) -> int:
        return self.layers[0].batch

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.layers[0].dtype

    def reset(self, index: SupportsIndex | None = None) -> None:
        """Empty every sequence, or the slot ``index`` only, in every layer.

        Parameters
        ----------
        index : int, optional
            The slot to empty, as :meth:`KVCache.reset` takes it; default all. Emptying every
            sequence also forgets the memory's keys and values.
        """
        for layer in self.layers:
            layer.reset(index)
        if index is None:
            self._memory = None

    def memory_keys_values(self, memory: np.ndarray[Any, Any], owners: tuple[Any, ...], project: Any) -> list[Any]:
        """Each decoder layer's cross-attention (keys, values) over `memory`, as
        :meth:`TransformerDecoder.step` reads them.

        Those kept are returned if `memory` has the values of the last call's and `owners` (the
        layers' cross-attention parameters and precisions) are the same objects; otherwise
        ``project()`` makes them, and they are kept from now on (until :meth:`reset` empties
        every sequence).

        Parameters
        ----------
        memory : ndarray
            The memory the decoder attends, in the layers' layout and dtype.
        owners : tuple
            What the kept keys and values were made from: each layer's cross-attention
            parameters and precision, compared by identity.
        project : callable
            ``project()`` returns the list of (keys, values), one pair per layer.

        Returns
        -------
        list
            One (keys, values) pair per layer.
        """
        kept = self._memory
        if kept is not None and kept[0].shape == memory.shape and kept[0].dtype == memory.dtype:
            if len(kept[1]) == len(owners) and all(a is b for a, b in zip(kept[1], owners)):
                if np.array_equal(kept[0], memory):
                    return kept[2]
        projections = project()
        self._memory = (memory.copy(), owners, projections)
        return projections

    def __repr__(self) -> str:
        lengths = np.array2string(self.lengths, separator=", ", threshold=8, edgeitems=3)
        return (
            f"{type(self).__name__}(num_layers={len(self.layers)}, batch={self.batch}, "
            f"max_len={self.max_len}, dtype={self.dtype.name}, lengths={lengths})"
        )
