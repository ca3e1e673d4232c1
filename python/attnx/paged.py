"""Serving many sequences: a paged key/value cache and continuous batching.

:class:`PagedKVCache` keeps the keys and values of many sequences in one pool of fixed-size
blocks, allocated once: a sequence holds only the blocks its tokens fill, sequences join and
leave at any step, and :meth:`PagedKVCache.fork` shares a prefix (a system prompt, the beams
of a search) without copying it. :func:`paged_attention` runs one step of continuous batching
over it: prefill chunks and single decode tokens of different sequences in one call, each
sequence's blocks read in place by the same kernels as :func:`attnx.cached_attention`.
"""

from __future__ import annotations

import array
import math
import operator
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

import numpy as np

from . import _core
from ._arrays import (
    as_array,
    as_float,
    as_positive_int,
    check_out,
    is_floating,
    kernel_layout,
    precision_code,
    result_and_compute_dtype,
    shape_str,
    window_bounds,
)
from ._canonical import as_finite_scale, as_softcap, make_sdpa_options
from .cache import CacheScales, _quantize, _read_only, _storage_dtype, _zeros_on_cache_line

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._typing import CachePrecision, FloatArray, IntArray
    from .rotary import RotaryEmbedding

__all__ = ["CacheFullError", "PagedKVCache", "paged_attention"]


class CacheFullError(ValueError):
    """Appending needs more blocks than a :class:`PagedKVCache` has free; nothing was written.

    Parameters
    ----------
    message : str
        What was appended, to which sequences, and how to make room.
    needed : int
        Blocks the append needed.
    free : int
        Blocks that were free.

    Attributes
    ----------
    needed : int
        Blocks the append needed.
    free : int
        Blocks that were free.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> cache = attnx.PagedKVCache(num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8)
    >>> seq = cache.add_sequence()
    >>> try:
    ...     cache.append([seq], np.ones((9, 1, 8)), np.ones((9, 1, 8)), [9])
    ... except attnx.CacheFullError as error:
    ...     print(error.needed, error.free, cache.length(seq))
    3 2 0
    """

    def __init__(self, message: str, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.needed, self.free))


class _Sequence:
    """A sequence's blocks, in order, and its length in tokens.

    The blocks are an ``array('i')`` (int32, as the block tables), not a list: a step reads every
    sequence's table, and NumPy copies a typed array's buffer where it converts a list's
    integers one by one (about 10 us for a sequence of 512 blocks).
    """

    __slots__ = ("blocks", "length")

    def __init__(self, blocks: Iterable[int], length: int) -> None:
        self.blocks = array.array("i", blocks)
        self.length = length


class _Undo(NamedTuple):
    """What an append changed, to put back: each sequence's blocks and length before it, the
    blocks it took from the free list, and the shared blocks it stopped referencing."""

    sequences: list[tuple[_Sequence, array.array[int], int]]
    taken: list[int]
    released: list[int]


class PagedKVCache:
    """Keys and values of many sequences in a pool of fixed-size blocks, allocated once.

    A sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks of the pool, listed in
    its block table; its token ``j`` is row ``j % block_size`` of its block
    ``j // block_size``. Blocks are reference counted: :meth:`fork` gives a new sequence the
    same blocks (taking none), and a shared block is copied only when a sequence writes into
    it, so a shared prompt is stored once. :func:`paged_attention` appends and reads.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool.
    block_size : int
        Tokens per block.
    num_kv_heads : int
        Key/value heads; queries may have any multiple of it (grouped-query attention).
    head_dim : int
        Width of a key (and of a query) per head.
    dtype : {numpy.float32, numpy.float64, numpy.float16, "bfloat16", numpy.int8}, default numpy.float32
        Storage dtype, as :class:`attnx.KVCache`'s: float16 and bfloat16 halve the memory and
        the bytes a step reads, int8 quarters them (each key or value row of each head with
        its own float32 scale, ``scale = max|x| / 127``).
    value_dim : int, optional, keyword-only
        Width of a value per head (default ``head_dim``).

    Attributes
    ----------
    key, value : ndarray, shape (num_blocks, num_kv_heads, block_size, head_dim or value_dim)
        The pool (read-only views).
    key_scales, value_scales : ndarray of float32, shape (num_blocks, num_kv_heads, block_size), or None
        The per-row scales of an int8 pool (read-only views); None for the other dtypes.
    sequences : tuple of int
        The live sequence handles, oldest first.
    free_blocks : int
        Blocks no sequence holds.
    num_blocks, block_size, num_kv_heads, head_dim, value_dim : int
    dtype : numpy.dtype
    nbytes : int
        Bytes of the pool (int8: its scales included).

    Notes
    -----
    Reading from several threads at once is safe; changing the cache (appending, forking,
    removing) while another thread uses it is not. Pickling keeps only the blocks in use.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> cache = attnx.PagedKVCache(num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8)
    >>> prompt = cache.add_sequence()
    >>> k = v = np.ones((20, 2, 8), np.float32)           # a 20-token prompt
    >>> q = np.ones((20, 4, 8), np.float32)
    >>> attnx.paged_attention(q, cache, [prompt], [20], k, v).shape
    (20, 4, 8)
    >>> cache.length(prompt), cache.block_table(prompt), cache.free_blocks
    (20, array([0, 1], dtype=int32), 62)
    >>> reply = cache.fork(prompt)                         # shares both blocks
    >>> cache.free_blocks
    62
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: npt.DTypeLike = np.float32,
        *,
        value_dim: int | None = None,
    ) -> None:
        self._num_blocks = as_positive_int(num_blocks, "num_blocks")
        self._block_size = as_positive_int(block_size, "block_size")
        self._num_kv_heads = as_positive_int(num_kv_heads, "num_kv_heads")
        self._head_dim = as_positive_int(head_dim, "head_dim")
        self._value_dim = self._head_dim if value_dim is None else as_positive_int(value_dim, "value_dim")
        if self._num_blocks >= 2**31:
            raise ValueError(f"num_blocks must be below 2**31 (block tables are int32), got {self._num_blocks}")
        self._dtype = _storage_dtype(dtype)
        self._allocate()

    def _allocate(self) -> None:
        lead = (self._num_blocks, self._num_kv_heads, self._block_size)
        self._key = _zeros_on_cache_line(lead + (self._head_dim,), self._dtype)
        self._value = _zeros_on_cache_line(lead + (self._value_dim,), self._dtype)
        self._scales = None
        if self._dtype == np.int8:
            self._scales = CacheScales(np.zeros(lead, np.float32), np.zeros(lead, np.float32))
        self._refs = np.zeros(self._num_blocks, np.int32)
        # A stack: the lowest blocks are taken first, and a freed block is the next taken
        # (still in cache).
        self._free = list(range(self._num_blocks - 1, -1, -1))
        self._seqs: dict[int, _Sequence] = {}
        self._next_handle = 0

    # ------------------------------------------------------------------------------------------
    # Sizes and views
    # ------------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

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
    def key(self) -> FloatArray:
        return _read_only(self._key)

    @property
    def value(self) -> FloatArray:
        return _read_only(self._value)

    @property
    def key_scales(self) -> FloatArray | None:
        return None if self._scales is None else _read_only(self._scales.key)

    @property
    def value_scales(self) -> FloatArray | None:
        return None if self._scales is None else _read_only(self._scales.value)

    @property
    def nbytes(self) -> int:
        scales = 0 if self._scales is None else self._scales.key.nbytes + self._scales.value.nbytes
        return int(self._key.nbytes + self._value.nbytes + scales)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> tuple[int, ...]:
        return tuple(self._seqs)

    def _sequence(self, seq: Any) -> _Sequence:
        try:
            handle = operator.index(seq)
        except TypeError:
            raise TypeError(f"a sequence handle is an int, got {type(seq).__name__}") from None
        state = self._seqs.get(handle)
        if state is None:
            raise ValueError(
                f"sequence {handle} is not in this cache (live: {list(self._seqs)}); "
                f"handles come from add_sequence() or fork() and end with remove()"
            )
        return state

    def length(self, seq: int) -> int:
        """Tokens held by sequence ``seq``.

        Parameters
        ----------
        seq : int
            A live sequence handle.

        Returns
        -------
        int
        """
        return self._sequence(seq).length

    def block_table(self, seq: int) -> IntArray:
        """The blocks of sequence ``seq``, in order.

        Parameters
        ----------
        seq : int
            A live sequence handle.

        Returns
        -------
        ndarray of int32, shape (ceil(length / block_size),)
            A read-only copy: token ``j`` is row ``j % block_size`` of block ``table[j // block_size]``.
        """
        table = np.array(self._sequence(seq).blocks, np.int32)
        table.flags.writeable = False
        return table

    # ------------------------------------------------------------------------------------------
    # Sequences
    # ------------------------------------------------------------------------------------------

    def _new_handle(self, state: _Sequence) -> int:
        handle = self._next_handle
        self._next_handle += 1
        self._seqs[handle] = state
        return handle

    def add_sequence(self) -> int:
        """A new, empty sequence. It takes no block until tokens are appended.

        Returns
        -------
        int
            Its handle.
        """
        return self._new_handle(_Sequence([], 0))

    def fork(self, seq: int) -> int:
        """A new sequence holding the tokens of ``seq``, sharing its blocks.

        No block is taken or copied. When either sequence later writes into a block both
        hold (the last one, partly filled), that sequence gets its own copy of the block:
        a fork costs at most one block per sequence that goes on.

        Parameters
        ----------
        seq : int
            A live sequence handle.

        Returns
        -------
        int
            The new sequence's handle.
        """
        state = self._sequence(seq)
        for block in state.blocks:
            self._refs[block] += 1
        return self._new_handle(_Sequence(state.blocks, state.length))

    def remove(self, seq: int) -> None:
        """End sequence ``seq``: its blocks that no other sequence holds are freed.

        Parameters
        ----------
        seq : int
            A live sequence handle; it is not valid afterwards.
        """
        state = self._sequence(seq)
        self._release(reversed(state.blocks))
        del self._seqs[operator.index(seq)]

    def truncate(self, seq: int, length: int) -> None:
        """Drop the newest tokens of ``seq``, keeping its first ``length`` (speculative decoding).

        Blocks past the ones the kept tokens fill are released.

        Parameters
        ----------
        seq : int
            A live sequence handle.
        length : int
            Tokens to keep, in ``[0, length(seq)]``.
        """
        state = self._sequence(seq)
        try:
            keep = operator.index(length)
        except TypeError:
            raise TypeError(f"length must be an int, got {type(length).__name__}") from None
        if not 0 <= keep <= state.length:
            raise ValueError(f"length must be in [0, {state.length}] (the tokens sequence {seq} holds), got {keep}")
        blocks = -(-keep // self._block_size)
        self._release(reversed(state.blocks[blocks:]))
        del state.blocks[blocks:]
        state.length = keep

    def _release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    # ------------------------------------------------------------------------------------------
    # Appending
    # ------------------------------------------------------------------------------------------

    def _check_rows(self, x: Any, name: str, width: int, total: int | None) -> np.ndarray[Any, Any]:
        a = as_array(x, name)
        if not is_floating(a.dtype):
            raise TypeError(f"{name} must be a floating-point array, got dtype {a.dtype}")
        what = "head_dim" if name == "key" else "value_dim"
        if a.ndim != 3 or a.shape[1] != self._num_kv_heads or a.shape[2] != width or (
            total is not None and a.shape[0] != total
        ):
            rows = "total" if total is None else str(total)
            raise ValueError(
                f"{name} must have shape (total, num_kv_heads, {what}) = ({rows}, {self._num_kv_heads}, {width}) "
                f"for this cache, got {shape_str(a.shape)}"
            )
        return a

    def append(self, seqs: Any, key: npt.ArrayLike, value: npt.ArrayLike, counts: npt.ArrayLike | None = None) -> None:
        """Append new tokens to sequences, all or nothing.

        Parameters
        ----------
        seqs : sequence of int
            Distinct sequence handles.
        key : array_like, shape (total, num_kv_heads, head_dim)
            The new keys, packed: sequence ``seqs[i]`` takes ``counts[i]`` consecutive rows.
            Converted to the cache's dtype (int8: quantized row by row).
        value : array_like, shape (total, num_kv_heads, value_dim)
        counts : array_like of int, shape (len(seqs),), optional
            New tokens per sequence (default 1 each); they sum to ``total``.

        Raises
        ------
        CacheFullError
            The pool has too few free blocks; nothing was written.
        """
        handles, states = self._sequences_of(seqs)
        n = _counts(counts, len(states))
        total = sum(n.tolist())  # exact: an int64 sum of huge counts could wrap
        k = self._check_rows(key, "key", self._head_dim, total)
        v = self._check_rows(value, "value", self._value_dim, total)
        self._append(handles, states, n, k, v)

    def _sequences_of(self, seqs: Any) -> tuple[list[int], list[_Sequence]]:
        if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__len__"):
            raise TypeError(f"seqs must be a sequence of int handles, got {type(seqs).__name__}")
        try:
            handles = [operator.index(s) for s in seqs]
        except TypeError:
            raise TypeError(f"seqs must hold int handles, got {list(seqs)!r}") from None
        if len(set(handles)) != len(handles):
            raise ValueError(f"seqs must be distinct (each sequence's rows are consecutive), got {handles}")
        return handles, [self._sequence(h) for h in handles]

    def _append(
        self, handles: list[int], states: list[_Sequence], n: IntArray, k: np.ndarray[Any, Any], v: np.ndarray[Any, Any]
    ) -> _Undo:
        """Writes k and v (checked) after each sequence's tokens; returns how to undo it."""
        bs = self._block_size
        needed = 0
        shared_last = []
        copied: dict[int, int] = {}  # shared blocks copied by an earlier sequence of the call
        for state, count in zip(states, n.tolist()):
            if count == 0:
                shared_last.append(False)
                continue
            # The first block written is partly filled and shared: the sequence gets a copy
            # (and the last of its sharers writes in place).
            cow = False
            if state.length % bs != 0:
                block = state.blocks[state.length // bs]
                cow = int(self._refs[block]) - copied.get(block, 0) > 1
                if cow:
                    copied[block] = copied.get(block, 0) + 1
            shared_last.append(cow)
            needed += -(-(state.length + count) // bs) - len(state.blocks) + int(cow)
        if needed > len(self._free):
            lengths = [s.length for s in states]
            raise CacheFullError(
                f"appending {n.tolist()} tokens to sequences {handles} (lengths {lengths}) needs {needed} "
                f"blocks of {bs} tokens, but {len(self._free)} of {self._num_blocks} are free; nothing was "
                f"written (remove finished sequences, or make the pool larger)",
                needed,
                len(self._free),
            )
        # Every source is made before anything is written.
        pairs = [(self._key, k), (self._value, v)]
        if self._scales is not None:
            (qk, sk), (qv, sv) = _quantize(k), _quantize(v)
            pairs = [(self._key, qk), (self._value, qv), (self._scales.key, sk), (self._scales.value, sv)]
        undo = _Undo([(s, array.array("i", s.blocks), s.length) for s in states], [], [])
        block_ids, offsets = [], []
        for state, count, cow in zip(states, n.tolist(), shared_last):
            if count == 0:
                continue
            if cow:
                index = state.length // bs
                old, new = state.blocks[index], self._take()
                for dst, _ in pairs:
                    dst[new] = dst[old]
                self._refs[old] -= 1
                undo.released.append(old)
                undo.taken.append(new)
                state.blocks[index] = new
            while len(state.blocks) * bs < state.length + count:
                block = self._take()
                undo.taken.append(block)
                state.blocks.append(block)
            positions = np.arange(state.length, state.length + count)
            block_ids.append(np.asarray(state.blocks, np.int64)[positions // bs])
            offsets.append(positions % bs)
            state.length += count
        if block_ids:
            rows = np.concatenate(block_ids), np.concatenate(offsets)
            for dst, src in pairs:
                dst[rows[0], :, rows[1]] = src
        return undo

    def _undo(self, undo: _Undo) -> None:
        for state, blocks, length in undo.sequences:
            state.blocks[:] = blocks
            state.length = length
        for block in undo.released:
            self._refs[block] += 1
        for block in reversed(undo.taken):
            self._refs[block] = 0
            self._free.append(block)

    # ------------------------------------------------------------------------------------------
    # What the core reads
    # ------------------------------------------------------------------------------------------

    def _tables(self, states: list[_Sequence]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(block tables (B, max blocks) int32, lengths (B,) int64) of the sequences."""
        width = max((len(s.blocks) for s in states), default=0)
        tables = np.zeros((len(states), max(width, 1)), np.int32)
        for i, s in enumerate(states):
            tables[i, : len(s.blocks)] = s.blocks
        return tables, np.array([s.length for s in states], np.int64)

    # ------------------------------------------------------------------------------------------
    # Pickling
    # ------------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        used = np.nonzero(self._refs)[0]
        state: dict[str, Any] = {
            "shape": (self._num_blocks, self._block_size, self._num_kv_heads, self._head_dim, self._value_dim),
            "dtype": self._dtype,
            "used": used,
            "key": self._key[used].copy(),
            "value": self._value[used].copy(),
            "sequences": {h: (list(s.blocks), s.length) for h, s in self._seqs.items()},
            "next_handle": self._next_handle,
        }
        if self._scales is not None:
            state["key_scales"] = self._scales.key[used].copy()
            state["value_scales"] = self._scales.value[used].copy()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._num_blocks, self._block_size, self._num_kv_heads, self._head_dim, self._value_dim = state["shape"]
        self._dtype = np.dtype(state["dtype"])
        self._allocate()
        used = state["used"]
        self._key[used] = state["key"]
        self._value[used] = state["value"]
        if self._scales is not None:
            self._scales.key[used] = state["key_scales"]
            self._scales.value[used] = state["value_scales"]
        for handle, (blocks, length) in state["sequences"].items():
            self._seqs[handle] = _Sequence(blocks, length)
            for block in blocks:
                self._refs[block] += 1
        taken = set(int(b) for b in used)
        self._free = [b for b in range(self._num_blocks - 1, -1, -1) if b not in taken]
        self._next_handle = state["next_handle"]

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"num_kv_heads={self._num_kv_heads}, head_dim={self._head_dim}"
            + ("" if self._value_dim == self._head_dim else f", value_dim={self._value_dim}")
            + f", dtype={self._dtype.name}, sequences={len(self._seqs)}, free_blocks={len(self._free)})"
        )


def _counts(counts: Any, count: int, name: str = "counts") -> IntArray:
    """Rows per sequence: int64 (count,), each >= 0; default 1 each."""
    if counts is None:
        return np.ones(count, np.int64)
    a = as_array(counts, name)
    if a.dtype.kind not in "iu" or a.ndim != 1 or a.shape[0] != count:
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
        raise ValueError(f"{name} must have shape ({count},), one count per sequence, got {shape_str(a.shape)}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 2**63):
        raise ValueError(f"{name} must be >= 0 and below 2**63, got {a.tolist()}")
    return a.astype(np.int64)


def paged_attention(
    query: npt.ArrayLike,
    cache: PagedKVCache,
    seqs: Any,
    query_lens: npt.ArrayLike | None = None,
    key: npt.ArrayLike | None = None,
    value: npt.ArrayLike | None = None,
    *,
    positions: npt.ArrayLike | None = None,
    rope: RotaryEmbedding | None = None,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    precision: CachePrecision | None = None,
    out: FloatArray | None = None,
) -> FloatArray:
    """One step of continuous batching over a :class:`PagedKVCache`.

    The query rows of several sequences are packed along the first axis: sequence
    ``seqs[i]`` contributes ``query_lens[i]`` consecutive rows, so prefill chunks (many rows)
    and decode tokens (one row) of different sequences mix in one call. With ``key`` and
    ``value``, those rows' keys and values are appended to their sequences first, all or
    nothing. Query ``t`` of sequence ``i`` sits at position ``p = L_i - n_i + t`` (``L_i`` the
    sequence's length after appending, ``n_i = query_lens[i]``) and attends that sequence's
    keys ``0 .. p`` (causal, bottom-right aligned). Each sequence's blocks are read in place.

    Parameters
    ----------
    query : array_like, shape (total_q, Hq, head_dim)
        ``Hq`` a multiple of the cache's ``num_kv_heads`` (grouped-query attention).
        float32, float64, float16 or bfloat16: the result has its dtype.
    cache : PagedKVCache
        Decides the compute dtype: float64 for a float64 cache, else float32.
    seqs : sequence of int
        Distinct sequence handles of ``cache``.
    query_lens : array_like of int, shape (len(seqs),), optional
        Rows per sequence (default 1 each: a decode step); they sum to ``total_q``. Without
        ``key``, each must not exceed the sequence's length.
    key : array_like, shape (total_q, num_kv_heads, head_dim), optional
        Keys of the query rows, appended to their sequences before attending.
    value : array_like, shape (total_q, num_kv_heads, value_dim), optional
        Values of the same rows (with ``key``).
    positions : array_like of int, shape (total_q,), optional, keyword-only
        The positions ``rope`` rotates each row at (default: each row's ``p`` above).
    rope : RotaryEmbedding, optional, keyword-only
        Rotary embeddings: the queries and the new keys are rotated at their positions
        before the keys are stored (the cache holds rotated keys).
    scale : float, optional, keyword-only
        Defaults to ``1 / sqrt(head_dim)``.
    window : tuple (left, right), optional, keyword-only
        Sliding window, bottom-right aligned: query ``p`` attends keys ``p - left .. p``.
    softcap : float, optional, keyword-only
        Soft-capped scores, as in :func:`attnx.scaled_dot_product_attention`.
    precision : {None, "float32", "bfloat16", "int8"}, optional, keyword-only
        The products' precision, as in :func:`attnx.cached_attention` (``"int8"``:
        an int8 cache only).
    out : ndarray, optional, keyword-only
        C-contiguous array of the result's shape and dtype to write into.

    Returns
    -------
    ndarray, shape (total_q, Hq, value_dim)

    Raises
    ------
    CacheFullError
        Appending needs more free blocks than the pool has; nothing was written.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> cache = attnx.PagedKVCache(32, 16, num_kv_heads=2, head_dim=8)
    >>> a, b = cache.add_sequence(), cache.add_sequence()
    >>> rng = np.random.default_rng(0)
    >>> def rows(n, h): return rng.standard_normal((n, h, 8), dtype=np.float32)
    >>> _ = attnx.paged_attention(rows(5, 4), cache, [a], [5], rows(5, 2), rows(5, 2))  # a's prompt
    >>> out = attnx.paged_attention(rows(8, 4), cache, [a, b], [1, 7], rows(8, 2), rows(8, 2))
    >>> out.shape, cache.length(a), cache.length(b)       # a decodes while b is prefilled
    ((8, 4, 8), 6, 7)
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be an attnx.PagedKVCache, got {type(cache).__name__}")
    handles, states = cache._sequences_of(seqs)
    n = _counts(query_lens, len(states), "query_lens")
    total = sum(n.tolist())  # exact: an int64 sum of huge counts could wrap
    result_dtype, _ = result_and_compute_dtype(query)
    compute = np.dtype(np.float64) if cache.dtype == np.float64 else np.dtype(np.float32)
    code = 0 if precision is None else precision_code(
        precision, compute, "the cache", "use a PagedKVCache of float32, float16, bfloat16 or int8",
        int8_cache=cache.dtype == np.int8)
    q = as_float(query, result_dtype, "query")
    Hk, E = cache.num_kv_heads, cache.head_dim
    if q.ndim != 3 or q.shape[0] != total or q.shape[2] != E or q.shape[1] == 0 or q.shape[1] % Hk != 0:
        raise ValueError(
            f"query must have shape (total_q, Hq, head_dim) = ({total}, Hq, {E}) with total_q = sum(query_lens) "
            f"= {total} and Hq a multiple of num_kv_heads = {Hk}, for {cache!r}; got {shape_str(q.shape)}"
        )
    if (key is None) != (value is None):
        raise ValueError("key and value must both be given or both be None")
    k = v = None
    if key is not None:
        k = cache._check_rows(key, "key", E, total)
        v = cache._check_rows(value, "value", cache.value_dim, total)
    lengths_before = np.array([s.length for s in states], np.int64)
    if key is None and (n > lengths_before).any():
        raise ValueError(
            f"query_lens {n.tolist()} exceed the sequences' lengths {lengths_before.tolist()}: without key and "
            f"value, the query rows are the newest tokens in the cache (pass key and value to append them)"
        )
    if rope is not None:
        from .rotary import RotaryEmbedding

        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope must be an attnx.RotaryEmbedding, got {type(rope).__name__}")
        if rope.head_dim != E:
            raise ValueError(f"rope.head_dim ({rope.head_dim}) must equal the cache's head_dim ({E})")
        pos = _positions(positions, n, lengths_before + (0 if key is None else n) - n, total)
        q = rope(q, pos)
        if k is not None:
            k = rope(k, pos)
    elif positions is not None:
        raise ValueError("positions are the rotation positions: pass them with rope=")
    window_left, window_right = window_bounds(window)
    scale = (1.0 / math.sqrt(E)) if scale is None else as_finite_scale(scale)
    options = make_sdpa_options(True, True, scale, window_left, window_right, True, as_softcap(softcap), -1, code)
    result_shape = (total, q.shape[1], cache.value_dim)
    if out is None:
        out = np.empty(result_shape, result_dtype)
    else:
        scales = () if cache._scales is None else tuple(cache._scales)
        check_out(out, result_shape, result_dtype, (query, key, value, cache._key, cache._value) + scales)
    undo = cache._append(handles, states, n, k, v) if k is not None else None
    try:
        if total:
            tables, lengths = cache._tables(states)
            cu = np.zeros(len(states) + 1, np.int64)
            np.cumsum(n, out=cu[1:])
            computed = out if out.dtype == compute else np.empty(out.shape, compute)
            query_rows = kernel_layout(as_float(q, compute, "query"))
            scales = (None, None) if cache._scales is None else cache._scales
            _core.paged_attention(
                query_rows, cache._key, cache._value, scales[0], scales[1], tables, lengths, cu, options, computed
            )
            if computed is not out:
                out[...] = computed
    except BaseException:
        if undo is not None:
            cache._undo(undo)
        raise
    return out


def _positions(positions: Any, n: IntArray, first: IntArray, total: int) -> IntArray:
    """Each query row's rotation position: `positions` checked, or first[i] + t for row t of i."""
    if positions is not None:
        p = as_array(positions, "positions")
        if p.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers, got dtype {p.dtype}")
        if p.shape != (total,):
            raise ValueError(f"positions must have shape (total_q,) = ({total},), got {shape_str(p.shape)}")
        if (p < 0).any():
            raise ValueError("positions must be >= 0")
        return p.astype(np.int64)
    starts = np.repeat(first - np.concatenate(([0], np.cumsum(n)[:-1])), n)
    return starts + np.arange(total, dtype=np.int64)
