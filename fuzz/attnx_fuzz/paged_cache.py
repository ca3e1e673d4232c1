"""PagedKVCache with paged_attention: a small pool of blocks (float32, float64, float16, bfloat16
or int8 storage; block sizes 1 to 32; GQA; a value width of its own) served over a few steps:
sequences join (``add_sequence``), fork (then written from both sides), leave (``remove``,
their handles then passed again) and are cut back (``truncate``), and ``paged_attention`` calls
mix prefill chunks, decode rows and rows already cached, with every option (window, softcap,
scale, ``precision="bfloat16"``, ``rope=`` with or without ``positions=``, ``out=``). The
pool is small enough to run out: an append that needs more blocks than are free must raise
``CacheFullError``.

The cache is mirrored: what each sequence holds (what was appended, converted to the storage
dtype, int8 quantized as ``attnx.cache._quantize`` does, keys rotated at their positions by
``rope`` applied by hand). After every operation each sequence's rows, read back from the pool
through its block table and dequantized, must equal the mirror's, and the pool's accounting
must hold (every block free or held; a fork takes none; an append takes exactly the blocks its
tokens fill plus a copy of each shared block it writes into; a removal or a cut frees exactly
the blocks no other sequence holds). A result must equal ``attnx.reference.varlen_attention``
(bottom-right causal) over the queries (rotated by hand) and the rows read back from the pool.

Mutations: a malformed query, key, value or ``out=`` (``malformed``); malformed handles
(duplicates, removed or unknown ones, non-ints, a scalar, a string), ``query_lens`` (lists,
other integer dtypes, negative, huge, the wrong count, more rows than a sequence holds; past
uint64's half, wrapping to the row count) and ``positions``
(judged by their values: valid ones must compute, invalid ones raise); and bad options. A call
that raises -- an invalid one, a full pool -- must change nothing: not a byte of the pool or of
its scales, not a length, a block table, the free count or the live handles.
"""

from __future__ import annotations

import math
import operator
from collections import Counter

import numpy as np

import attnx
from attnx import reference
from attnx.cache import _quantize

from .common import (
    BAD_PRECISIONS, BF16, F32, F64, HALVES, I8, LAST_ERROR, LAST_MESSAGE, OUTCOMES, TOL, Disallowed, Provider,
    bf16_tolerance, call, check_untouched, compare, draw_precision, is_float, logits_moderate, malformed, plain,
    raised, reference_of, relayout, snapshot, values,
)

WHAT = "paged_attention"

# ---------------------------------------------------------------------------------------------
# The cache as it is, and as it should be
# ---------------------------------------------------------------------------------------------


def state_of(cache):
    """Everything an operation may change: the pool's bytes (and scales), each live sequence's
    length and block table, the free count and the live handles, in order."""
    pool = [np.array(cache.key, copy=True), np.array(cache.value, copy=True)]
    if cache.key_scales is not None:
        pool += [np.array(cache.key_scales, copy=True), np.array(cache.value_scales, copy=True)]
    seqs = tuple(cache.sequences)
    tables = {h: (cache.length(h), tuple(cache.block_table(h).tolist())) for h in seqs}
    return pool, seqs, tables, cache.free_blocks


def same_state(a, b) -> bool:
    pool_a, *rest_a = a
    pool_b, *rest_b = b
    return rest_a == rest_b and all(
        x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(pool_a, pool_b))


def gathered(cache, seq):
    """(keys, values) of `seq` read back from the pool through its block table, float64."""
    table, n, bs = cache.block_table(seq), cache.length(seq), cache.block_size
    rows = np.arange(n)
    blocks, offsets = table[rows // bs], rows % bs
    k = cache.key[blocks, :, offsets].astype(np.float64)
    v = cache.value[blocks, :, offsets].astype(np.float64)
    if cache.dtype == I8:
        k *= cache.key_scales[blocks, :, offsets][..., None]
        v *= cache.value_scales[blocks, :, offsets][..., None]
    return k, v


def as_stored(x, dtype):
    """Rows as a cache of `dtype` stores them, read back as float64."""
    x = np.asarray(x)
    if dtype == I8:
        q, s = _quantize(x)
        return q.astype(np.float64) * s[..., None].astype(np.float64)
    with np.errstate(all="ignore"):
        return x.astype(dtype).astype(np.float64)


def holders(cache) -> Counter:
    """How many live sequences hold each block."""
    return Counter(b for h in cache.sequences for b in set(cache.block_table(h).tolist()))


def check_pool(cache, mirror, what):
    """The live handles are the mirror's (oldest first); each sequence's rows read back from the
    pool equal the mirror's; every block is free or held, and a table lists each of its
    blocks once, as many as its tokens fill."""
    if tuple(cache.sequences) != tuple(mirror):
        raise Disallowed(f"{what}: live sequences {cache.sequences}, expected {tuple(mirror)}")
    bs = cache.block_size
    for h, (k, v) in mirror.items():
        table = cache.block_table(h).tolist()
        if cache.length(h) != k.shape[0] or len(table) != -(-k.shape[0] // bs) or len(set(table)) != len(table):
            raise Disallowed(f"{what}: sequence {h} holds {cache.length(h)} tokens in blocks {table}, "
                             f"expected {k.shape[0]} tokens")
        if not all(0 <= b < cache.num_blocks for b in table):
            raise Disallowed(f"{what}: sequence {h}'s block table {table} lists a block past the pool")
        gk, gv = gathered(cache, h)
        if not (np.array_equal(gk, k, equal_nan=True) and np.array_equal(gv, v, equal_nan=True)):
            raise Disallowed(f"{what}: the keys or values of sequence {h} read back from the pool differ from "
                             f"what was appended")
    if cache.free_blocks + len(holders(cache)) != cache.num_blocks:
        raise Disallowed(f"{what}: {cache.free_blocks} free and {len(holders(cache))} held blocks in a pool of "
                         f"{cache.num_blocks}")


def blocks_needed(cache, handles, counts) -> int:
    """The blocks appending `counts` tokens to `handles` takes: those the new tokens fill, and
    a copy of each partly filled block shared with another sequence that it writes into (the
    last of a block's holders to write writes in place)."""
    bs, refs, writers, needed = cache.block_size, holders(cache), Counter(), 0
    for h, n in zip(handles, counts):
        if n == 0:
            continue
        length, table = cache.length(h), cache.block_table(h).tolist()
        needed += -(-(length + n) // bs) - len(table)
        if length % bs:
            b = table[length // bs]
            if refs[b] - writers[b] > 1:
                writers[b] += 1
                needed += 1
    return needed


def freed_by_dropping(cache, handle, keep_blocks) -> int:
    """The blocks freed when `handle` lets go of its blocks past its first `keep_blocks`."""
    refs = holders(cache)
    return sum(refs[b] == 1 for b in cache.block_table(handle).tolist()[keep_blocks:])


def empty_rows(cache):
    return (np.zeros((0, cache.num_kv_heads, cache.head_dim)), np.zeros((0, cache.num_kv_heads, cache.value_dim)))


# ---------------------------------------------------------------------------------------------
# Reading arguments as attnx reads them (judged by their values)
# ---------------------------------------------------------------------------------------------


def handles_of(seqs, live):
    """The handles `seqs` names, if they are valid (a sequence of distinct live int handles), else None."""
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__len__"):
        return None
    try:
        handles = [operator.index(s) for s in seqs]
    except TypeError:
        return None
    if len(set(handles)) != len(handles) or any(h not in live for h in handles):
        return None
    return handles


def counts_of(query_lens, count):
    """The rows per sequence `query_lens` gives (Python ints), if it is valid, else None."""
    if query_lens is None:
        return [1] * count
    try:
        a = np.asarray(plain(query_lens))
    except Exception:  # noqa: BLE001 - not convertible: not valid
        return None
    if a.dtype.kind not in "iu" or a.shape != (count,):
        return None
    n = [int(x) for x in a]  # Python ints: no wrap-around
    return n if all(x >= 0 for x in n) else None


def positions_of(positions, total):
    """The positions `positions` gives (int64), if they are valid, else None."""
    try:
        a = np.asarray(plain(positions))
    except Exception:  # noqa: BLE001
        return None
    if a.dtype.kind not in "iu" or a.shape != (total,) or any(int(x) < 0 or int(x) >= 2**62 for x in a):
        return None
    return a.astype(np.int64)


def as_rows(x):
    """A query, key or value argument as the float array attnx reads (native byte order), or None."""
    try:
        a = np.asarray(plain(x))
    except Exception:  # noqa: BLE001
        return None
    if not (is_float(a) or a.dtype.kind == "f"):
        return None
    return a.astype(a.dtype.newbyteorder("=")) if not a.dtype.isnative else a


# ---------------------------------------------------------------------------------------------
# Malformed handles, counts and positions
# ---------------------------------------------------------------------------------------------


def malformed_seqs(p: Provider, seqs, removed, live):
    """A replacement for `seqs`: mostly invalid (duplicates, removed or unknown handles, non-int
    handles, a scalar, a string), sometimes valid after all (a tuple, an int array)."""
    unknown = max(list(live) + removed + [0]) + 1 + p.int(0, 50)
    options = [
        lambda: seqs + [seqs[0]] if seqs else [unknown, unknown],         # a duplicate
        lambda: seqs[:-1] + [p.choice(removed) if removed else unknown],  # a removed handle mid-batch
        lambda: [unknown] + seqs[1:],
        lambda: [-1] + seqs[1:],
        lambda: [float(s) for s in seqs] or [1.5],
        lambda: [str(s) for s in seqs] or ["0"],
        lambda: [None] + seqs[1:],
        lambda: seqs[0] if seqs else 0,                                   # a bare int
        lambda: "".join(str(s) for s in seqs) or "0",
        lambda: np.array(seqs, np.float64),
        lambda: [np.array(seqs)] if seqs else [[]],
        lambda: [2**70] + seqs[1:],
        lambda: tuple(seqs),                                              # valid
        lambda: np.array(seqs, np.int64),                                 # valid (empty: float64, refused)
        lambda: [np.int32(s) for s in seqs],                              # valid
    ]
    return p.choice(options)()


def malformed_lens(p: Provider, lens):
    """A replacement for `query_lens`: negative, huge, wrapping past uint64 (to the same sum),
    floats, 2-D, another count, strings, None; or valid after all (a list, another int dtype)."""
    a = np.array(lens, np.int64)
    kind = p.int(0, 12)
    if kind == 0 and a.size:  # negative, the sum kept
        a[0] -= 1
        a[-1] += 1 if a.size > 1 else 0
        return a
    if kind == 1 and a.size > 1:  # wrapping past uint64: the same sum modulo 2**64
        u = a.astype(np.uint64)
        u[0] += np.uint64(p.choice([1, 2**32, 2**63]))
        with np.errstate(all="ignore"):
            u[-1] -= u[0] - np.uint64(a[0])
        return u
    if kind == 2 and a.size:  # huge
        a[p.int(0, a.size - 1)] = p.choice([2**31, 2**40, 2**62, 2**63 - 1])
        return a
    if kind == 3:
        return a.astype(p.choice([F32, F64]))
    if kind == 4:
        return a[None] if p.bool() else a[:, None]
    if kind == 5:  # another count of sequences
        return np.concatenate([a, [0]]) if p.bool() or not a.size else a[:-1]
    if kind == 6:
        return p.choice([[str(x) for x in lens], "1", None, 1, [], [1.5] * len(lens)])
    if kind == 7:  # more rows than a sequence holds, the sum kept (without key: invalid)
        if a.size > 1 and a[-1] > 0:
            a[0] += a[-1]
            a[-1] = 0
        return a
    if kind == 8:  # valid: a list, another integer dtype
        return p.choice([lambda: list(lens), lambda: a.astype(np.int32), lambda: a.astype(np.uint16),
                         lambda: tuple(int(x) for x in lens)])()
    if kind == 9:
        return relayout(p, a)
    return malformed(p, a)


def malformed_positions(p: Provider, positions, total):
    """A replacement for `positions`: the wrong count, negative, floats, 2-D, past uint64's
    half; or valid after all (a list, int32, None)."""
    try:
        a = np.array(plain(positions), np.int64)
    except Exception:  # noqa: BLE001 - replaced already by something that is no positions
        a = None
    if a is None or a.shape != (total,):
        a = np.arange(total, dtype=np.int64) + 3
    kind = p.int(0, 8)
    if kind == 0:
        return np.concatenate([a, [1]]) if p.bool() or not a.size else a[1:]
    if kind == 1 and a.size:
        a[p.int(0, a.size - 1)] = -p.choice([1, 2**40])
        return a
    if kind == 2 and a.size:
        u = a.astype(np.uint64)
        u[0] = np.uint64(p.choice([2**63, 2**64 - 1]))
        return u
    if kind == 3:
        return a.astype(F64)
    if kind == 4:
        return a[None]
    if kind == 5:  # valid
        return p.choice([lambda: a.tolist(), lambda: a.astype(np.int32), lambda: None])()
    if kind == 6:
        return p.choice(["0", 3, [None] * max(total, 1), object()])
    return malformed(p, a)


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------


def fuzz_paged_cache(p: Provider):
    """A PagedKVCache served over a few steps (joins, forks, removals, cuts, paged_attention
    calls mixing prefill and decode rows, a pool that runs out), checked after each against
    a mirror of what it holds and the reference over the rows read back from the pool."""
    dtype = p.choice([F32, F32, F64, I8] + HALVES)
    num_blocks = p.choice([1, 2, 3, 4, 6, 8, 12, 24])
    bs = p.choice([1, 2, 3, 4, 5, 8, 16, 32])
    Hk, group = p.int(1, 2), p.choice([1, 1, 2, 3])
    E = p.choice([1, 2, 4, 6, 8, 16])
    Ev = E if p.bool(0.6) else p.choice([1, 3, 8])
    cache = attnx.PagedKVCache(num_blocks, bs, Hk, E, dtype, value_dim=Ev)
    OUTCOMES[f"PagedKVCache: {cache.dtype.name}"] += 1
    rope = None
    if E >= 2 and E % 2 == 0 and p.bool(0.35):
        rope = attnx.RotaryEmbedding(E, p.choice([10000.0, 500000.0, 10.0]),
                                     rotary_dim=p.choice([None, None, 2]), interleaved=p.bool())
    mirror = {}  # live handle -> (keys, values) it holds, as stored, float64
    removed = []
    for _ in range(p.int(1, 3)):
        mirror[cache.add_sequence()] = empty_rows(cache)
    check_pool(cache, mirror, "add_sequence")
    pair = []  # a fork and its parent: the next call writes both
    for _ in range(p.int(1, 5)):
        op = p.int(0, 11)
        if op == 0 or not mirror:
            h = cache.add_sequence()
            if not isinstance(h, int) or h in mirror or h in removed:
                raise Disallowed(f"add_sequence: handle {h!r} is not new")
            mirror[h] = empty_rows(cache)
            check_pool(cache, mirror, "add_sequence")
        elif op in (1, 2):
            fork(p, cache, mirror, removed, pair)
        elif op == 3:
            remove(p, cache, mirror, removed)
        elif op == 4:
            truncate(p, cache, mirror, removed)
        else:
            step(p, cache, mirror, removed, rope, pair)
            pair = []


def refused(p: Provider, cache, mirror, what, fn):
    """`fn` (an operation given a malformed argument) must raise ValueError or TypeError and
    change nothing."""
    before = state_of(cache)
    ok, _ = call(what, fn)
    if ok:
        raise Disallowed(f"{what}: accepted a malformed argument")
    if not same_state(before, state_of(cache)):
        raise Disallowed(f"{what}: raised {raised()} after changing the cache")
    check_pool(cache, mirror, what)


def junk_handle(p: Provider, mirror, removed):
    unknown = max(list(mirror) + removed + [0]) + 1
    return p.choice([unknown, -1, 1.5, "0", None, 2**70, [0], np.float64(0)] + (removed[-1:] * 3))


def fork(p: Provider, cache, mirror, removed, pair):
    if p.bool(0.1):
        refused(p, cache, mirror, "fork", lambda: cache.fork(junk_handle(p, mirror, removed)))
        return
    parent = p.choice(list(mirror))
    free = cache.free_blocks
    child = cache.fork(parent)
    if child in mirror or child in removed:
        raise Disallowed(f"fork: handle {child!r} is not new")
    if cache.free_blocks != free or cache.block_table(child).tolist() != cache.block_table(parent).tolist():
        raise Disallowed("fork: took a block, or the fork's blocks are not its parent's")
    mirror[child] = mirror[parent]
    pair[:] = [parent, child]
    OUTCOMES["PagedKVCache.fork"] += 1
    check_pool(cache, mirror, "fork")


def remove(p: Provider, cache, mirror, removed):
    if p.bool(0.15):
        refused(p, cache, mirror, "remove", lambda: cache.remove(junk_handle(p, mirror, removed)))
        return
    h = p.choice(list(mirror))
    expected = cache.free_blocks + freed_by_dropping(cache, h, 0)
    cache.remove(h)
    del mirror[h]
    removed.append(h)
    if cache.free_blocks != expected:
        raise Disallowed(f"remove: {cache.free_blocks} blocks free, expected {expected}")
    OUTCOMES["PagedKVCache.remove"] += 1
    check_pool(cache, mirror, "remove")


def truncate(p: Provider, cache, mirror, removed):
    h = p.choice(list(mirror))
    length = cache.length(h)
    if p.bool(0.2):
        if p.bool():
            refused(p, cache, mirror, "truncate", lambda: cache.truncate(junk_handle(p, mirror, removed), 0))
        else:
            bad = p.choice([-1, length + 1, 2**70, 1.5, "0", None, np.float64(0)])
            refused(p, cache, mirror, "truncate", lambda: cache.truncate(h, bad))
        return
    keep = p.choice([0, length, length // 2, max(length - 1, 0), p.int(0, length)])
    expected = cache.free_blocks + freed_by_dropping(cache, h, -(-keep // cache.block_size))
    cache.truncate(h, keep if p.bool(0.8) else np.int64(keep))
    mirror[h] = (mirror[h][0][:keep], mirror[h][1][:keep])
    if cache.free_blocks != expected:
        raise Disallowed(f"truncate: {cache.free_blocks} blocks free, expected {expected}")
    OUTCOMES["PagedKVCache.truncate"] += 1
    check_pool(cache, mirror, "truncate")


def draw_lens(p: Provider, cache, seqs, append):
    """Rows per sequence: decode rows, prefill chunks, none; without keys, at most what it holds."""
    lens = []
    for h in seqs:
        if h not in cache.sequences:  # a removed handle
            lens.append(1)
        elif append:
            lens.append(p.choice([1, 1, 1, 0, 2, 3, 5, 8, 17, 40]))
        else:
            length = cache.length(h)
            lens.append(p.choice([min(1, length), length, p.int(0, length), 0]))
    return lens


def step(p: Provider, cache, mirror, removed, rope, pair):
    """One paged_attention call, judged."""
    live = list(mirror)
    seqs = [h for h in live if p.bool(0.6)] or [p.choice(live)]
    seqs += [h for h in pair if h in mirror and h not in seqs]
    if removed and p.bool(0.1):  # a removed handle among live ones: ValueError, nothing changed
        seqs.append(p.choice(removed))
    seqs = [seqs[i] for i in np.random.default_rng(p.seed()).permutation(len(seqs))]
    append = p.bool(0.8)
    lens = draw_lens(p, cache, seqs, append)
    total = sum(lens)
    Hq, E, Ev = cache.num_kv_heads * p.choice([1, 1, 2, 3]), cache.head_dim, cache.value_dim
    compute = F64 if cache.dtype == F64 else F32
    # Special values (NaN, Inf, extreme magnitudes) in one call of three: a row stored with them
    # makes every later result of its sequence incomparable (only the NaN pattern is checked).
    values_of = values if p.bool(0.35) else (
        lambda p, shape, dtype: np.random.default_rng(p.seed()).standard_normal(shape).astype(dtype))
    q_dtype = p.choice([compute, compute, compute, F32, F64] + HALVES)
    kv_dtype = p.choice([cache.dtype if cache.dtype != I8 else F32, compute, F32, F64] + HALVES)
    args = {"query": values_of(p, (total, Hq, E), q_dtype), "seqs": list(seqs), "query_lens": list(lens),
            "key": None, "value": None}
    if append:
        args["key"] = values_of(p, (total, cache.num_kv_heads, E), kv_dtype)
        args["value"] = values_of(p, (total, cache.num_kv_heads, Ev), kv_dtype)
    if p.bool(0.2):
        args["query_lens"] = np.array(lens, np.int64) if p.bool() else None if all(n == 1 for n in lens) else lens
    kwargs = {}
    if rope is not None and p.bool(0.75):
        kwargs["rope"] = rope
        if p.bool(0.3):
            kwargs["positions"] = np.random.default_rng(p.seed()).integers(0, p.choice([4, 100, 5000]), total)
    if p.bool(0.3):
        kwargs["window"] = (p.choice([None, 0, 1, 3, 20]), p.choice([None, 0, 2]))
    if p.bool(0.2):
        kwargs["softcap"] = p.choice([0.5, 5.0, 30.0])
    if p.bool(0.25):
        kwargs["scale"] = p.choice([0.0, 0.3, -1.0, 2.0, np.float32(0.25)])
    kwargs["precision"], invalid = draw_precision(p, compute)
    if p.bool(0.25):
        kwargs["out"] = np.full((total, Hq, Ev), np.nan, np.asarray(args["query"]).dtype)
    for name in ("query", "key", "value"):
        if args[name] is not None and p.bool(0.15):
            args[name] = relayout(p, args[name])
    # Mutations: most calls are valid, so that the oracle compares results on a fair share.
    n_mut = p.choice([0, 0, 0, 0, 1, 1, 2])
    others = 0  # mutations whose validity only attnx's outcome tells (judged by the values after)
    for _ in range(n_mut):
        name = p.choice(["query", "key", "value", "seqs", "seqs", "query_lens", "query_lens", "positions", "rope",
                         "scale", "window", "softcap", "precision", "out"])
        if name == "seqs":
            args["seqs"] = malformed_seqs(p, list(seqs), removed, mirror)
        elif name == "query_lens":
            args["query_lens"] = malformed_lens(p, lens)
        elif name == "positions":
            kwargs["positions"] = malformed_positions(p, kwargs.get("positions"), total)
        elif name == "rope":
            invalid = True
            kwargs["rope"] = p.choice([lambda: "rope", lambda: object(), lambda: (lambda x, pos: x),
                                       lambda: attnx.RotaryEmbedding(E + 2 - E % 2)])()
        elif name == "scale":
            invalid = True
            kwargs["scale"] = p.choice([float("nan"), float("inf"), "x", 1j, [1.0], -float("inf")])
        elif name == "window":
            invalid = True
            kwargs["window"] = p.choice([(-1, 0), (1,), "ab", (1.5, 2), 5, (None, None, None), ("1", 0)])
        elif name == "softcap":
            invalid = True
            kwargs["softcap"] = p.choice([0.0, -1.0, float("nan"), float("inf"), "2", True, [1.0]])
        elif name == "precision":
            invalid = True
            kwargs["precision"] = p.choice(BAD_PRECISIONS)
        elif name in ("key", "value") and args[name] is None:  # a key without a value, or the reverse
            args[name] = values(p, (total, cache.num_kv_heads, E if name == "key" else Ev), F32)
        else:
            others += 1
            args[name] = malformed(p, args[name]) if name != "out" else p.choice([
                lambda: np.empty((total, Hq, Ev), F64 if q_dtype != F64 else F32),
                lambda: np.empty((total + 1, Hq, Ev), q_dtype), lambda: np.empty((total, Hq, Ev), q_dtype)[::-1],
                lambda: "out", lambda: args["query"] if Ev == E else np.empty((Hq, total, Ev), q_dtype),
                lambda: np.empty((Hq, total, Ev), q_dtype).transpose(1, 0, 2), lambda: malformed(p, args["query"])])()
    judge(p, cache, mirror, removed, args, kwargs, invalid, others, n_mut)


def judge(p: Provider, cache, mirror, removed, args, kwargs, invalid, others, n_mut):
    """Runs the call and judges its outcome against what its arguments' values ask for."""
    handles = handles_of(args["seqs"], mirror)
    counts = counts_of(args["query_lens"], len(handles)) if handles is not None else None
    q, k, v = as_rows(args["query"]), as_rows(args["key"]), as_rows(args["value"])
    append = args["key"] is not None
    rows = q.shape[0] if q is not None and q.ndim == 3 else None
    if counts is not None and (sum(counts) != rows or (not append and any(
            n > cache.length(h) for h, n in zip(handles, counts)))):
        counts = None
    Hk, E, Ev = cache.num_kv_heads, cache.head_dim, cache.value_dim
    if rows is not None and not (q.shape[2] == E and q.shape[1] and q.shape[1] % Hk == 0):
        counts = None  # the query's heads or width do not fit the cache
    if append and not (k is not None and v is not None and k.shape == (rows, Hk, E) and v.shape == (rows, Hk, Ev)):
        counts = None  # keys or values that do not fit the cache or the query rows
    rope = kwargs.get("rope")
    positions = None
    if counts is not None and isinstance(rope, attnx.RotaryEmbedding):
        if kwargs.get("positions") is not None:
            positions = positions_of(kwargs["positions"], sum(counts))
            if positions is None:
                counts = None  # invalid positions: the call is invalid
    elif counts is not None and kwargs.get("positions") is not None:
        counts = None  # positions without rope
    invalid = invalid or (args["key"] is None) != (args["value"] is None)
    valid = handles is not None and counts is not None and not invalid
    needed = blocks_needed(cache, handles, counts) if valid and append else 0
    full = needed > cache.free_blocks
    if valid and append:
        OUTCOMES["paged_attention: the pool runs out" if full else "paged_attention: appends"] += 1
    inputs = [args["query"], args["key"], args["value"], args["query_lens"], args["seqs"], kwargs.get("positions")]
    snap = snapshot([plain(x) for x in inputs])
    before = state_of(cache)
    free = cache.free_blocks
    ok, got = call(WHAT, lambda: attnx.paged_attention(
        args["query"], cache, args["seqs"], args["query_lens"], args["key"], args["value"], **kwargs))
    check_untouched(snap, WHAT, allowed=[kwargs.get("out")])
    if not ok:
        if not same_state(before, state_of(cache)):
            raise Disallowed(f"{WHAT}: raised {raised()} after changing the cache")
        check_pool(cache, mirror, WHAT)
        if full and others == 0:
            if LAST_ERROR[0] is not attnx.CacheFullError:
                raise Disallowed(f"{WHAT}: a full pool raised {LAST_ERROR[0]}, not CacheFullError")
            OUTCOMES["paged_attention: CacheFullError, nothing changed"] += 1
        elif valid and others == 0:
            raise Disallowed(f"{WHAT}: a valid call raised {LAST_ERROR[0]}: {LAST_MESSAGE[0]}")
        elif valid and LAST_ERROR[0] is attnx.CacheFullError and not full:
            raise Disallowed(f"{WHAT}: CacheFullError with {cache.free_blocks} blocks free for {needed} needed")
        seqs = args["seqs"]
        if (isinstance(seqs, list) and any(isinstance(s, int) and s in removed for s in seqs)
                and all(isinstance(s, int) for s in seqs) and len(set(seqs)) == len(seqs)):
            if LAST_ERROR[0] is not ValueError:
                raise Disallowed(f"{WHAT}: a removed handle raised {LAST_ERROR[0]}, not ValueError")
            OUTCOMES["paged_attention: removed handle refused"] += 1
        return
    # It computed: the call must have been valid.
    if handles is None:
        raise Disallowed(f"{WHAT}: computed with seqs={args['seqs']!r} (live: {list(mirror)})")
    if counts is None:
        raise Disallowed(f"{WHAT}: computed with query_lens={args['query_lens']!r}, "
                         f"positions={kwargs.get('positions')!r} for {rows} query rows")
    if invalid:
        raise Disallowed(f"{WHAT}: computed with an invalid option: "
                         f"{ {k: v for k, v in kwargs.items() if k != 'out'} !r}")
    if full:
        raise Disallowed(f"{WHAT}: appended {needed} blocks with {free} free")
    out = kwargs.get("out")
    if out is not None and got is not out:
        raise Disallowed(f"{WHAT}: out= given but another array returned")
    if append:
        if cache.free_blocks != free - needed:
            raise Disallowed(f"{WHAT}: {cache.free_blocks} blocks free after taking {needed} of {free}")
    elif not same_state(before, state_of(cache)):
        raise Disallowed(f"{WHAT}: changed the cache without keys to append")
    # The positions of the rows: given, or each row's place in its sequence.
    lengths_before = [mirror[h][0].shape[0] for h in handles]
    starts = np.cumsum([0] + counts)
    if positions is None:
        positions = np.concatenate([np.arange(n, dtype=np.int64) + (L if append else L - n)
                                    for L, n in zip(lengths_before, counts)] + [np.zeros(0, np.int64)])
    rotate = (lambda x: rope(x, positions)) if isinstance(rope, attnx.RotaryEmbedding) else (lambda x: x)
    result_dtype = q.dtype
    q_used = rotate(q)
    if append:  # the mirror: the appended rows as stored (keys rotated)
        k_used = rotate(k)
        for i, h in enumerate(handles):
            r = slice(starts[i], starts[i + 1])
            mirror[h] = (np.concatenate([mirror[h][0], as_stored(k_used[r], cache.dtype)]),
                         np.concatenate([mirror[h][1], as_stored(v[r], cache.dtype)]))
    check_pool(cache, mirror, WHAT)
    OUTCOMES["paged_attention: computed"] += 1
    if sum(counts) == 0:
        if not (isinstance(got, np.ndarray) and got.shape == (0, q.shape[1], cache.value_dim)
                and got.dtype == result_dtype):
            raise Disallowed(f"{WHAT}: no query rows gave {type(got).__name__} {getattr(got, 'shape', '')}")
        return
    # The reference: each sequence's query rows over the rows read back from the pool.
    read = [gathered(cache, h) for h in handles]
    kp = np.concatenate([x[0] for x in read])
    vp = np.concatenate([x[1] for x in read])
    cu_k = np.cumsum([0] + [x[0].shape[0] for x in read])
    precision = kwargs.get("precision")
    bf16 = precision == "bfloat16"
    compute = np.dtype(F64 if cache.dtype == F64 else F32)
    convert = (lambda x: np.asarray(x, F32)) if bf16 else (lambda x: np.asarray(x, np.float64))
    ref_kwargs = {name: kwargs[name] for name in ("scale", "window", "softcap") if name in kwargs}
    expected = reference_of(lambda: reference.varlen_attention(
        convert(q_used), convert(kp), convert(vp), starts, cu_k, is_causal="bottom_right", precision=precision,
        **ref_kwargs))
    if expected is None:
        raise Disallowed(f"{WHAT}: attnx computed a result for a call the reference rejects")
    scale = kwargs.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    moderate = logits_moderate(q_used, kp, scale)
    tolerance = result_dtype if result_dtype.itemsize <= compute.itemsize else compute
    if bf16:
        tolerance = bf16_tolerance([vp])
        if result_dtype.itemsize == 2:  # and the result's own rounding
            tolerance["rtol"] += TOL[result_dtype]["rtol"]
    compare(got, expected, result_dtype, WHAT, [q_used, kp, vp, np.asarray(scale)], moderate, tolerance)
