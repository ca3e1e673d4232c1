"""KVCache with cached_attention: a cache (float32, float64, float16, bfloat16 or int8
storage; perhaps a malformed constructor argument) filled over a few calls (ragged lengths,
GQA, windows), reset or pickled between them. Each result must match
``attnx.reference.cached_attention`` over the cache's contents; a call that raises must append
nothing, and none may change a cached key or value.
"""

from __future__ import annotations

import math
import operator
import pickle

import numpy as np

import attnx
from attnx import reference

from .common import (
    F32, F64, HALVES, I8, OUTCOMES, TOL, Disallowed, Provider, bf16_tolerance, cache_contents, call,
    check_untouched, compare, draw_precision, held, int8_tolerance, logits_moderate, mutate, reference_of,
    same_held, snapshot, still_held, values,
)


def reset_or_pickle(p: Provider, cache):
    """`cache` after reset(index) (index perhaps malformed), or a pickled copy of it: a reset
    empties exactly the slot it names (all with None) and raises for any other index without
    a change; a copy holds the same keys, values and lengths."""
    before, lengths = held(cache), cache.lengths.copy()
    if p.bool(0.3):
        copy = pickle.loads(pickle.dumps(cache))
        if not (np.array_equal(copy.lengths, lengths) and same_held(held(copy), before)
                and (copy.dtype, copy.max_len, copy.value_dim) == (cache.dtype, cache.max_len, cache.value_dim)):
            raise Disallowed("KVCache: a pickled copy differs")
        OUTCOMES["KVCache: pickled"] += 1
        return copy
    B = cache.batch
    index = p.choice([None, 0, B - 1, -1, -B, B, -B - 1, 1.0, True, "0", np.int64(B - 1), np.array([0]), 2**70])
    try:
        cache.reset(index)
    except (TypeError, IndexError) as exc:
        OUTCOMES[f"KVCache.reset: {type(exc).__name__}"] += 1
        if not (np.array_equal(cache.lengths, lengths) and str(exc)):
            raise Disallowed("KVCache.reset: raised after a change, or without a message") from exc
        return cache
    expected = np.zeros_like(lengths) if index is None else lengths.copy()
    if index is not None:
        expected[operator.index(index)] = 0
    if not np.array_equal(cache.lengths, expected):
        raise Disallowed(f"KVCache.reset({index!r}): lengths {cache.lengths.tolist()}, expected {expected.tolist()}")
    kept = [pair for pair, m in zip(before, expected) if m]
    if not same_held([pair for pair, m in zip(held(cache), expected) if m], kept):
        raise Disallowed(f"KVCache.reset({index!r}): another slot's keys or values changed")
    OUTCOMES["KVCache.reset"] += 1
    return cache

def fuzz_cache(p: Provider):
    """A KVCache filled over a few steps of cached_attention (ragged lengths, GQA, windows,
    float16 storage), each result against the reference over the cache's contents; a
    malformed argument must raise before anything is appended."""
    dtype = p.choice([F32, F32, F64, I8] + HALVES)
    given = F32 if dtype == I8 else dtype  # the keys and values appended (int8: quantized)
    B, Hk, group = p.int(1, 3), p.int(1, 2), p.int(1, 3)
    D, Dv = p.choice([1, 4, 8, 17]), p.choice([None, 3, 8])
    ctor = [B, Hk, p.choice([1, 5, 40, 600]), D, dtype]
    if p.bool(0.15):
        ctor[p.int(0, 4)] = p.choice([-1, 0, 2.5, "3", None, np.int64(2), 2**40, np.dtype(np.int32)])
    ok, cache = call("KVCache()", lambda: attnx.KVCache(*ctor, value_dim=Dv), huge=True)
    if not ok:
        return
    Dv = cache.value_dim
    for _ in range(p.int(1, 3)):
        if p.bool(0.15):
            cache = reset_or_pickle(p, cache)
        T = p.choice([0, 1, 2, 7])
        q_dtype = p.choice([given, F32] + HALVES) if dtype != F64 else F64
        args = {
            "query": values(p, (B, Hk * group, T, D), q_dtype),
            "key": values(p, (B, Hk, T, D), given) if p.bool(0.8) else None,
            "lengths": None, "window": None,
        }
        args["value"] = values(p, (B, Hk, T, Dv), given) if args["key"] is not None else None
        if p.bool(0.4):
            args["lengths"] = np.random.default_rng(p.seed()).integers(0, T + 1, B)
        if p.bool(0.3):
            args["window"] = (p.choice([None, 0, 1, 30]), p.choice([None, 0, 3]))
        args["scale"] = p.choice([0.0, 0.3, -1.0, 2.0]) if p.bool(0.25) else None
        args["out"] = np.full((B, Hk * group, T, Dv), np.nan, q_dtype) if p.bool(0.25) else None
        precision, invalid = draw_precision(p, dtype, int8_cache=cache.dtype == I8)
        n_mut = p.choice([0, 0, 0, 1, 2])
        mutate(p, args, ["query", "key", "value", "lengths", "window", "scale", "out"], n_mut)
        before, held_before = cache.lengths.copy(), held(cache)
        inputs = [args["query"], args["key"], args["value"], args["lengths"], args["out"]]
        snap = snapshot(inputs)
        ok, got = call("cached_attention", lambda: attnx.cached_attention(
            args["query"], cache, args["key"], args["value"], lengths=args["lengths"], scale=args["scale"],
            window=args["window"], precision=precision, out=args["out"]))
        check_untouched(snap, "cached_attention", allowed=[args["out"]])
        if not still_held(cache, held_before):
            raise Disallowed("cached_attention: a cached token's key or value changed")
        if not ok:
            if not np.array_equal(cache.lengths, before):
                raise Disallowed("cached_attention: raised after appending to the cache")
            continue
        if invalid:
            raise Disallowed(f"cached_attention: computed with precision={precision!r} and a {cache.dtype} cache")
        if args["out"] is not None and got is not args["out"]:
            raise Disallowed("cached_attention: out= given but another array returned")
        q = np.asarray(args["query"])
        n = (np.full(B, q.shape[2]) if args["lengths"] is None else np.asarray(args["lengths"])).astype(np.int64)
        key, value = cache_contents(cache)
        bf16, int8 = precision == "bfloat16", precision == "int8"
        as_computed = (lambda x: np.asarray(x, F32)) if bf16 or int8 else (lambda x: np.asarray(x, np.float64))
        expected = reference_of(lambda: reference.cached_attention(
            as_computed(q), as_computed(key), as_computed(value), cache.lengths, query_lengths=n,
            scale=args["scale"], window=args["window"], precision=precision))
        if expected is None:
            raise Disallowed("cached_attention: attnx computed a result for a call the reference rejects")
        scale = 1 / math.sqrt(D) if args["scale"] is None else args["scale"]
        try:
            moderate = logits_moderate(q, key, float(scale))
        except (TypeError, ValueError):
            moderate = True  # a scale attnx accepted that is no number: the result is compared
        # The cache decides the compute dtype (float64 only for a float64 cache); the result
        # has the query's, so the looser of the two sets the tolerance.
        compute = np.dtype(F64 if cache.dtype == F64 else F32)
        tolerance = got.dtype if got.dtype.itemsize <= compute.itemsize else compute
        if int8:
            OUTCOMES["cached_attention: int8 precision computed"] += 1
        if bf16 or int8:
            tolerance = int8_tolerance([value]) if int8 else bf16_tolerance([value])
            if got.dtype.itemsize == 2:  # and the result's own rounding
                tolerance["rtol"] += TOL[got.dtype]["rtol"]
        compare(got, expected, np.dtype(got.dtype), "cached_attention", [q, key, value], moderate, tolerance)
