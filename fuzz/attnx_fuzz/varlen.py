"""varlen_attention: ragged batches packed along the first axis (empty sequences, cross
lengths, a long sequence among short ones, GQA, float16/bfloat16 storage, every option,
``out=`` into a larger buffer). Its ``cu_seqlens`` offsets get their own malformations (not
from 0, decreasing, not ending at the row count, floats, 2-D, another count of sequences for
the queries than for the keys, huge, negative, lists, other integer dtypes, empty), and its key
heads may not divide the query heads; offsets and heads are judged by their values (valid ones
must compute, invalid ones must raise). A result must match
``attnx.reference.varlen_attention``.
"""

from __future__ import annotations

import math

import numpy as np

import attnx
from attnx import reference

from .common import (
    BAD_PRECISIONS, F16, F32, F64, HALVES, LAST_ERROR, LAST_MESSAGE, OUTCOMES, TOL, Disallowed, GarbageTensor,
    Provider, RaisingArray, as_f64, bf16_tolerance, call, check_garbage_refused, check_untouched, compare,
    draw_precision, is_float, logits_moderate, malformed, plain, reference_of, relayout, snapshot,
    torch_habits, values,
)


def packed_offsets(lengths) -> np.ndarray:
    """The (batch + 1,) int64 offsets of sequences of `lengths` packed end to end."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


def ragged_lengths(p: Provider, batch: int):
    """Query and key lengths of a ragged batch: empty sequences, a long one among short ones,
    cross lengths, or decoding-like (a few queries over many keys)."""
    lengths_q = [p.choice([0, 0, 1, 2, 3, 5, 17, 40, 70]) for _ in range(batch)]
    if batch and p.bool(0.15):
        lengths_q[p.int(0, batch - 1)] = p.choice([130, 300, 530])
    kind = p.int(0, 9)
    if kind < 5:  # self-attention: the same lengths
        return lengths_q, list(lengths_q)
    if kind < 8:  # cross lengths
        return lengths_q, [p.choice([0, 1, 3, 16, 33, 90]) for _ in range(batch)]
    return [p.int(0, 3) for _ in range(batch)], [p.choice([0, 1, 7, 129, 600]) for _ in range(batch)]


def malformed_offsets(p: Provider, cu):
    """A malformed replacement for the offsets `cu` (an int64 vector): not from 0, decreasing,
    not ending at the row count, floats, 2-D, another count of sequences, huge or negative
    values, lists, other integer dtypes, empty -- or any malformed value. Some replacements
    are valid after all (a list of the same offsets, int32): the oracle judges the values."""
    cu = np.array(cu, dtype=np.int64)
    rows = int(cu[-1])
    kind = p.int(0, 13)
    if kind == 0:  # not from 0
        if p.bool():
            return cu + p.choice([1, -1, 3])
        cu[0] = p.choice([1, -1, 2**40])
        return cu
    if kind == 1:  # decreasing somewhere
        if cu.size < 3:
            return np.array([0, rows + 1, rows], np.int64)
        i = p.int(1, cu.size - 2)
        cu[i] = cu[i + 1] + p.int(1, 3)
        return cu
    if kind == 2:  # not ending at the row count
        cu[-1] += p.choice([-1, 1, 5, -rows - 1])
        return cu
    if kind == 3:  # floats (of the same values)
        return cu.astype(p.choice([F64, F32, F16]))
    if kind == 4:  # 2-D
        return p.choice([lambda: cu[None], lambda: cu[:, None], lambda: np.stack([cu, cu])])()
    if kind == 5:  # another count of sequences (each valid alone): an empty one appended or prepended,
        if p.bool() or cu.size < 3:  # or two merged
            return np.concatenate([cu, cu[-1:]]) if p.bool() else np.concatenate([cu[:1], cu])
        return np.delete(cu, p.int(1, cu.size - 2))
    if kind == 6:  # huge values
        huge = p.choice([2**31, 2**32 + rows, 2**40, 2**62, 2**63 - 1, -(2**63), -(2**62)])
        if p.bool(0.3):  # as unsigned: past int64
            u = cu.astype(np.uint64)
            u[p.int(0, u.size - 1)] = p.choice([2**63, 2**64 - 1, 2**63 + rows])
            return u
        i = p.int(0, cu.size - 1)
        cu[i] = huge
        if p.bool():  # and every later offset: non-decreasing up to the last
            cu[i:-1] = huge
        return cu
    if kind == 7:  # negative values
        i = p.int(0, cu.size - 1)
        cu[i] = -p.choice([1, 2, 7, 2**31])
        if p.bool():
            cu = cu - cu[-1]  # all of them at or below 0, ending at 0
        return cu
    if kind == 8:  # lists: of the offsets (valid), of floats, nested, of ints past int64
        return p.choice([lambda: cu.tolist(), lambda: [float(x) for x in cu], lambda: [cu.tolist()],
                         lambda: cu.tolist()[:-1] + [2**70], lambda: [int(x) for x in cu[:-1]] + [str(rows)],
                         lambda: tuple(cu.tolist())])()
    if kind == 9:  # other integer (or bool) dtypes: values wrapped where they do not fit
        dt = p.choice([np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.uint64, ">i8", ">i4",
                       np.bool_])
        return cu.astype(dt)
    if kind == 10:  # no offsets at all
        return p.choice([np.zeros(0, np.int64), [], np.zeros((0, 1), np.int64)])
    if kind == 11:  # a scalar
        return p.choice([np.int64(0), 0, np.array(cu[-1])])
    if kind == 12:  # another layout (the broadcast one changes the values)
        return relayout(p, cu)
    return malformed(p, cu)


def offsets_valid(cu, rows) -> bool:
    """Whether `cu` is what varlen_attention accepts as the offsets of `rows` rows: integers
    (an array or a list), 1-D, at least one, from 0, never decreasing, ending at `rows`."""
    if isinstance(cu, (GarbageTensor, RaisingArray)) or rows is None:
        return False
    try:
        a = np.asarray(plain(cu))
    except Exception:  # noqa: BLE001 - not convertible: not valid
        return False
    if a.dtype.kind not in "iu" or a.ndim != 1 or a.size == 0:
        return False
    v = [int(x) for x in a]  # Python ints: no wrap-around in the comparisons
    return v[0] == 0 and v[-1] == rows and all(x <= y for x, y in zip(v, v[1:]))


def offsets_count(cu):
    try:
        return np.asarray(plain(cu)).size
    except Exception:  # noqa: BLE001
        return None


def packed_shape(x):
    """The shape of a packed array argument as attnx reads it, None where it is no 3-D array."""
    if isinstance(x, (GarbageTensor, RaisingArray)) or x is None:
        return None
    try:
        a = np.asarray(plain(x))
    except Exception:  # noqa: BLE001
        return None
    return a.shape if a.ndim == 3 and (is_float(a) or a.dtype.kind == "f") else None


def reference_window(window):
    """`window` for the reference: a bound past int64 (which the reference's position
    arithmetic cannot hold: OverflowError) as None, the same window for any real length."""
    if not isinstance(window, tuple):
        return window
    return tuple(None if isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 2**62 else b
                 for b in window)


def fuzz_varlen(p: Provider):
    """varlen_attention on a ragged batch (empty sequences, cross lengths, a long sequence among
    short ones, GQA, float16/bfloat16 storage, every option, out=), then mutated: malformed
    offsets above all, and key heads that do not divide the query heads. The offsets and
    head counts are judged by their values: valid ones must compute, invalid ones raise."""
    dtype = p.choice([F32, F32, F64] + HALVES)
    compute = F64 if dtype == F64 else F32
    batch = p.choice([0, 1, 1, 2, 3, 4, 6])
    lengths_q, lengths_k = ragged_lengths(p, batch)
    Hk, group = p.int(1, 3), p.choice([1, 1, 2, 3, 4])
    Hq = Hk * group
    E, Ev = p.choice([1, 3, 8, 16, 33, 64]), p.choice([1, 4, 8, 17, 64])
    Tq, Tk = sum(lengths_q), sum(lengths_k)
    kv_dtype = p.choice([dtype, dtype, F32, F64] + HALVES)
    args = {
        "query": values(p, (Tq, Hq, E), dtype),
        "key": values(p, (Tk, Hk, E), kv_dtype),
        "value": values(p, (Tk, Hk, Ev), p.choice([kv_dtype, kv_dtype, dtype] + HALVES)),
        "cu_seqlens_q": packed_offsets(lengths_q),
        "cu_seqlens_k": packed_offsets(lengths_k),
        "is_causal": p.choice([False, False, False, True, "top_left", "bottom_right"]),
    }
    if lengths_q == lengths_k and p.bool():
        args["cu_seqlens_k"] = None  # self-attention: the query's offsets
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if args[name] is not None and p.bool(0.15):  # other valid forms: int32, a list
            args[name] = args[name].astype(np.int32) if p.bool() else args[name].tolist()
    if p.bool(0.3):
        args["window"] = (p.choice([None, 0, 1, 5, 40]), p.choice([None, 0, 2, 40]))
    if p.bool(0.2):
        args["softcap"] = p.choice([0.5, 1.0, 5.0, 30.0])
    if p.bool(0.3):
        args["scale"] = p.choice([0.0, 0.1, -0.5, 2.0, np.float32(0.25)])
    args["precision"], invalid = draw_precision(p, compute)
    sentinel_rows = 0
    if p.bool(0.3):  # out=: the first rows of a larger buffer, whose other rows must stay as they are
        sentinel_rows = p.int(0, 3)
        buffer = np.full((Tq + sentinel_rows, Hq, Ev), 7.0, dtype)
        args["out"] = buffer[:Tq]
    for name in ("query", "key", "value"):
        if p.bool(0.2):
            args[name] = relayout(p, args[name])
    # Most calls unmutated: most mutations here make errors (the offsets'), and the oracle
    # must still compare results on a fair share of the inputs.
    n_mut = p.choice([0, 0, 0, 0, 1, 1, 2])
    names = ["query", "key", "value", "cu_seqlens_q", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k", "heads",
             "is_causal", "scale", "window", "softcap", "precision", "out"]
    others = 0  # mutations other than of the offsets and the head counts (judged by their values)
    for _ in range(n_mut):
        name = p.choice(names)
        if name in ("cu_seqlens_q", "cu_seqlens_k"):
            cu = packed_offsets(lengths_q if name == "cu_seqlens_q" else lengths_k)
            args[name] = malformed_offsets(p, cu) if p.bool(0.85) else malformed(p, cu)
            continue
        others += name != "heads"
        if name == "heads":  # key and value heads that do not divide the query heads
            hk = p.choice([h for h in (2, 3, 4, 5, Hq + 1) if Hq % h])
            args["key"] = values(p, (Tk, hk, E), kv_dtype)
            args["value"] = values(p, (Tk, hk, Ev), kv_dtype)
        elif name == "is_causal":
            args[name] = p.choice(["diagonal", "TOP_LEFT", 1, 0, None, "yes", np.bool_(True), np.array([True, False])])
        elif name == "scale":
            args[name] = p.choice([None, float("nan"), float("inf"), -0.0, "1", 1e300, 1j, np.float64(0.5), [1.0]])
        elif name == "window":
            args[name] = p.choice([(-1, 0), (1,), "ab", (1.5, 2), (None, None), 5, (2**70, 0), (np.int64(3), None)])
        elif name == "softcap":
            args[name] = p.choice([0.0, -1.0, float("nan"), float("inf"), "2", True, 1e-30, 1e38, 1e300, [1.0]])
        elif name == "precision":
            args[name] = p.choice(BAD_PRECISIONS)
        elif name == "out":
            shape = (Tq, Hq, Ev)
            options = [lambda: np.empty(shape, F64 if dtype != F64 else F32), lambda: np.empty((Tq + 1, Hq, Ev), dtype),
                       lambda: np.empty((Hq, Tq, Ev), dtype).transpose(1, 0, 2), lambda: np.empty(shape, dtype)[::-1],
                       lambda: args["query"], lambda: "out", lambda: np.empty(shape, dtype).tolist(),
                       lambda: np.broadcast_to(np.zeros((), dtype), shape)]
            args["out"] = p.choice(options)()
            sentinel_rows = 0
        else:
            args[name] = malformed(p, args[name])
    garbage = torch_habits(p, args, ["query", "key", "value", "cu_seqlens_q", "cu_seqlens_k"])
    kwargs = {k: v for k, v in args.items() if k not in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")}
    inputs = [plain(args[name]) for name in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")]
    snap = snapshot(inputs)
    out_given = args.get("out")
    out_base = out_given.base if isinstance(out_given, np.ndarray) and sentinel_rows else None
    ok, got = call("varlen_attention", lambda: attnx.varlen_attention(
        args["query"], args["key"], args["value"], args["cu_seqlens_q"], args["cu_seqlens_k"], **kwargs))
    check_untouched(snap, "varlen_attention", allowed=[out_given])
    check_garbage_refused(ok, garbage, n_mut, "varlen_attention")
    if out_base is not None and not (out_base[Tq:] == 7.0).all():
        raise Disallowed("varlen_attention: a row of out='s buffer past the packed queries was written")
    # What the offsets and shapes ask for, judged by their values.
    q_shape, k_shape, v_shape = (packed_shape(args[name]) for name in ("query", "key", "value"))
    cu_k = args["cu_seqlens_k"] if args["cu_seqlens_k"] is not None else args["cu_seqlens_q"]
    offsets_ok = (offsets_valid(args["cu_seqlens_q"], q_shape and q_shape[0])
                  and offsets_valid(cu_k, k_shape and k_shape[0])
                  and offsets_count(args["cu_seqlens_q"]) == offsets_count(cu_k))
    heads_ok = bool(q_shape and k_shape and k_shape[1] and q_shape[1] % k_shape[1] == 0)
    if not offsets_ok:
        OUTCOMES["varlen_attention: malformed offsets"] += 1
    if not heads_ok:
        OUTCOMES["varlen_attention: heads not a multiple"] += 1
    if not ok:
        if others == 0 and not invalid and not garbage and offsets_ok and heads_ok:
            raise Disallowed(f"varlen_attention: a valid call raised {LAST_ERROR[0]}: {LAST_MESSAGE[0]}")
        return
    if garbage:
        return  # (check_garbage_refused raised already)
    if not offsets_ok:
        raise Disallowed(f"varlen_attention: computed with invalid offsets {args['cu_seqlens_q']!r}, {cu_k!r} "
                         f"for {q_shape and q_shape[0]} query and {k_shape and k_shape[0]} key rows")
    if not heads_ok:
        raise Disallowed(f"varlen_attention: computed with query heads {q_shape and q_shape[1]} and key heads "
                         f"{k_shape and k_shape[1]}")
    if invalid:
        raise Disallowed(f"varlen_attention: computed with precision={args['precision']!r} and a {dtype} query")
    OUTCOMES["varlen_attention: computed"] += 1
    if out_given is not None and got is not out_given:
        raise Disallowed("varlen_attention: out= given but another array returned")
    for x in inputs:
        if isinstance(x, np.ndarray) and x is not out_given and np.shares_memory(got, x):
            raise Disallowed("varlen_attention: the result shares memory with an input")
    ref_kwargs = {k: plain(v) for k, v in kwargs.items() if k != "out"}
    if "window" in ref_kwargs:
        ref_kwargs["window"] = reference_window(ref_kwargs["window"])
    bf16 = ref_kwargs.get("precision") == "bfloat16"
    # bfloat16 precision: the reference of the same rounding, on the float32 values attnx computes with.
    convert = (lambda x: np.asarray(x, F32)) if bf16 else as_f64
    expected = reference_of(lambda: reference.varlen_attention(
        *(convert(plain(args[name])) for name in ("query", "key", "value")),
        plain(args["cu_seqlens_q"]), plain(args["cu_seqlens_k"]), **ref_kwargs))
    if expected is None:
        raise Disallowed("varlen_attention: attnx computed a result for a call the reference rejects")
    q, k, v = (np.asarray(plain(args[name])) for name in ("query", "key", "value"))
    scale = args.get("scale")
    scale_arr = [np.asarray(float(scale))] if isinstance(scale, (int, float, np.floating)) else []
    eff_scale = 1 / math.sqrt(q.shape[-1]) if scale is None and q.shape[-1] else (scale_arr or [1.0])[0]
    moderate = logits_moderate(q, k, eff_scale)
    result_dtype = q.dtype.newbyteorder("=")
    tolerance = result_dtype if result_dtype.itemsize <= np.dtype(compute).itemsize else compute
    if bf16:
        tolerance = bf16_tolerance([v])
        if result_dtype.itemsize == 2:  # and the result's own rounding
            tolerance["rtol"] += TOL[result_dtype]["rtol"]
    compare(got, expected, result_dtype, "varlen_attention", [q, k, v] + scale_arr, moderate, tolerance)
