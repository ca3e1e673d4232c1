"""The private bindings, which the public entry points call with canonical arguments:
``_core.sdpa`` (the canonical fast path), ``_testing.run_sdpa`` (caller's ``out`` and
``weights`` buffers, perhaps aliasing an input), ``_core.MhaWeights`` with ``_core.mha`` (the
parameters checked once, then calls in either layout, which must give the bits of
``_testing.run_mha`` on the canonical arrays), and ``_testing.run_mha``; each perhaps with
malformed arguments, which must raise a clear exception.
"""

from __future__ import annotations

import math

import numpy as np

from attnx import _core, _testing, reference
from attnx._canonical import sdpa_options

from .common import (
    F32, F64, OUTCOMES, SCALAR_JUNK, Disallowed, Provider, call, check_untouched, compare, logits_moderate,
    malformed, safe_shape, snapshot, values,
)


def core_sdpa_expected(q, k, v, mask, causal, scale):
    """float64 expectation of _core.sdpa's out and weights (causal and a mask may combine)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    Hq, Hk = q.shape[1], k.shape[1]
    if Hk:
        k, v = np.repeat(k, Hq // Hk, axis=1), np.repeat(v, Hq // Hk, axis=1)
    L, S = q.shape[2], k.shape[2]
    bias = np.zeros((1, 1, L, S)) if mask is None else np.asarray(mask, np.float64)
    if causal:  # keys above the diagonal are closed by selection, whatever the mask holds
        bias = np.where(np.arange(S)[None, :] > np.arange(L)[:, None], -np.inf, bias)
    return reference._attention(q, k, v, bias, scale)


def fuzz_core(p: Provider):
    which = p.choice(["sdpa", "sdpa", "sdpa_canonical", "mha", "mha_weights"])
    dtype = p.choice([F32, F64])
    if which == "mha_weights":
        fuzz_core_mha_weights(p, dtype)
        return
    if which in ("sdpa", "sdpa_canonical"):
        B, Hk, g = p.int(0, 2), p.int(0, 2), p.int(1, 2)
        L, S, E, Ev = p.choice([0, 1, 3, 40]), p.choice([0, 1, 7, 600]), p.choice([1, 4, 16]), p.choice([1, 3, 8])
        a = dict(query=values(p, (B, Hk * g, L, E), dtype), key=values(p, (B, Hk, S, E), dtype),
                 value=values(p, (B, Hk, S, Ev), dtype),
                 attn_mask=values(p, (B, Hk * g, L, S), dtype) if p.bool() else None,
                 causal=p.bool(), scale=p.choice([0.5, 1.0, -0.25]),
                 out=np.empty((B, Hk * g, L, Ev), dtype),
                 weights=np.empty((B, Hk * g, L, S), dtype) if p.bool(0.3) else None)
        if a["attn_mask"] is not None and p.bool():
            a["attn_mask"] = np.broadcast_to(a["attn_mask"][:, :1, :1], a["attn_mask"].shape)
        names = list(a)
        n_mut = p.choice([0, 1, 1, 2, 3])
        for _ in range(n_mut):
            name = p.choice(names)
            if name in ("causal",):
                a[name] = p.choice(SCALAR_JUNK)
            elif name == "scale":
                a[name] = p.choice([float("nan"), float("inf"), "x", None, 1e300, np.float32(2)])
            elif name in ("out", "weights") and p.bool(0.3):
                a[name] = p.choice([a["query"], a["key"], np.empty((1,), dtype)])  # aliasing / wrong
            else:
                a[name] = malformed(p, a[name])
        inputs = [a["query"], a["key"], a["value"], a["attn_mask"]]
        outputs = [a["out"], a["weights"]]
        aliased = any(isinstance(o, np.ndarray) and isinstance(x, np.ndarray) and np.shares_memory(o, x)
                      for o in outputs for x in inputs) or (
            isinstance(a["out"], np.ndarray) and isinstance(a["weights"], np.ndarray)
            and np.shares_memory(a["out"], a["weights"]))
        snap = snapshot(inputs)
        if which == "sdpa_canonical":
            ok, got = call("_core.sdpa", lambda: _core.sdpa(
                a["query"], a["key"], a["value"], None, sdpa_options(a["causal"], None, False, None), None))
            check_untouched(snap, "_core.sdpa")
            qkv = (a["query"], a["key"], a["value"])
            # The oracle below takes canonical operands; others were checked by the Python rules.
            canonical = all(isinstance(x, np.ndarray) and x.ndim == 4 for x in qkv) and (
                qkv[0].shape[:2] == qkv[1].shape[:2] == qkv[2].shape[:2])
            if ok and canonical:
                exp, _ = core_sdpa_expected(a["query"], a["key"], a["value"], None, bool(a["causal"]),
                                            1 / math.sqrt(safe_shape(a["query"])[3]))
                compare(got, exp, np.asarray(a["query"]).dtype.newbyteorder("="), "_core.sdpa", inputs)
            return
        ok, _ = call("_testing.run_sdpa", lambda: _testing.run_sdpa(
            a["query"], a["key"], a["value"], a["attn_mask"],
            _core.SdpaOptions(a["causal"], False, a["scale"], -1, -1, False), a["out"], a["weights"]))
        if not aliased:
            check_untouched(snap, "_testing.run_sdpa")
        if ok and not aliased and n_mut == 0:
            exp_out, exp_w = core_sdpa_expected(a["query"], a["key"], a["value"], a["attn_mask"], a["causal"], a["scale"])
            moderate = logits_moderate(a["query"], a["key"], a["scale"])
            compare(a["out"], exp_out, dtype, "_core.sdpa out", inputs, moderate)
            if a["weights"] is not None:
                compare(a["weights"], exp_w, dtype, "_core.sdpa weights", inputs, moderate)
        elif not ok and n_mut == 0:
            raise Disallowed("_core.sdpa: a valid call raised")
        return
    # _core.mha with canonical (N, L, E) arguments
    H = p.int(1, 2)
    E = H * p.choice([1, 2, 4])
    # (L = 8, 16 with S = L: the transposed form of few-row self-attention.)
    N, L, S = p.int(0, 2), p.choice([0, 1, 5, 8, 16]), p.choice([0, 1, 6, 8, 16])
    kdim, vdim = p.choice([E, 3]), p.choice([E, 2])
    Eo = p.choice([E, E, 3])
    avg = p.bool()
    bias_kv = p.bool(0.3)
    zero = p.bool(0.3)
    Sp = S + bias_kv + zero
    a = dict(num_heads=H, query=values(p, (N, L, E), dtype), key=values(p, (N, S, kdim), dtype),
             value=values(p, (N, S, vdim), dtype), w_q=values(p, (E, E), dtype), w_k=values(p, (E, kdim), dtype),
             w_v=values(p, (E, vdim), dtype), b_q=values(p, (E,), dtype) if p.bool() else None,
             b_k=None, b_v=None, bias_k=values(p, (E,), dtype) if bias_kv else None,
             bias_v=values(p, (E,), dtype) if bias_kv else None, add_zero_attn=zero, static_k=None,
             static_v=None, attn_mask=np.zeros((N, H, L, S), dtype) if p.bool() else None,
             key_padding_mask=None, causal=p.bool(), w_out=values(p, (Eo, E), dtype),
             b_out=values(p, (Eo,), dtype) if p.bool() else None, out=np.empty((N, L, Eo), dtype),
             weights=(np.empty((N, L, Sp) if avg else (N, H, L, Sp), dtype) if p.bool() else None),
             average_weights=avg)
    names = [k for k in a]
    for _ in range(p.choice([1, 1, 2, 3])):
        name = p.choice(names)
        if name in ("num_heads", "add_zero_attn", "causal", "average_weights"):
            a[name] = p.choice(SCALAR_JUNK + [-5, 7, 2**62])
        else:
            a[name] = malformed(p, a[name])
    ok, _ = call("_testing.run_mha", lambda: run_core_mha(**a))


def run_core_mha(num_heads, query, key, value, w_q, w_k, w_v, b_q, b_k, b_v, bias_k, bias_v, add_zero_attn,
                 static_k, static_v, attn_mask, key_padding_mask, causal, w_out, b_out, out, weights,
                 average_weights):
    """The core's forward pass on canonical (N, L, E) arrays: the parameters checked by
    _core.MhaWeights, then _testing.run_mha; the results copied into out and weights."""
    dtype = np.dtype(np.float64 if getattr(query, "dtype", None) == np.float64 else np.float32)
    in_biases = None if b_q is None and b_k is None and b_v is None else (b_q, b_k, b_v)
    bias_kv = None if bias_k is None and bias_v is None else (bias_k, bias_v)
    params = _core.MhaWeights(num_heads, (w_q, w_k, w_v), in_biases, (w_out, b_out), bias_kv, add_zero_attn, dtype)
    options = _core.MhaOptions(causal, False, weights is not None, average_weights, True)
    result, probabilities = _testing.run_mha(params, (query, key, value, attn_mask, key_padding_mask, static_k, static_v), options)
    out[...] = result
    if weights is not None:
        weights[...] = probabilities


def fuzz_core_mha_weights(p: Provider, dtype):
    """_core.MhaWeights built from parameters (perhaps malformed), then _core.mha with inputs
    and flags (perhaps malformed). A call it accepts must give the bits of the core's forward
    pass on the canonical arrays (_testing.run_mha); nothing else but a clear exception."""
    H = p.int(1, 2)
    E = H * p.choice([1, 2, 4])
    kdim, vdim = p.choice([E, 3]), p.choice([E, 2])
    bias_kv = p.bool(0.3)
    params = dict(num_heads=H, w_q=values(p, (E, E), dtype), w_k=values(p, (E, kdim), dtype),
                  w_v=values(p, (E, vdim), dtype), b_q=values(p, (E,), dtype) if p.bool() else None,
                  b_k=values(p, (E,), dtype) if p.bool() else None,
                  b_v=values(p, (E,), dtype) if p.bool() else None,
                  bias_k=values(p, (E,), dtype) if bias_kv else None,
                  bias_v=values(p, (E,), dtype) if bias_kv else None, add_zero_attn=p.bool(0.3),
                  w_out=values(p, (E, E), dtype), b_out=values(p, (E,), dtype) if p.bool() else None,
                  batch_first=p.bool())
    # torch's layout: the three weights (and biases) stacked in one array, which
    # self-attention may project in one call.
    stacked = kdim == E and vdim == E and p.bool()
    if stacked:
        w = values(p, (3 * E, E), dtype)
        params.update(w_q=w[:E], w_k=w[E : 2 * E], w_v=w[2 * E :])
        if params["b_q"] is not None:
            b = values(p, (3 * E,), dtype)
            params.update(b_q=b[:E], b_k=b[E : 2 * E], b_v=b[2 * E :])
    if p.bool(0.3):
        name = p.choice(list(params))
        if name in ("num_heads", "add_zero_attn", "batch_first"):
            params[name] = p.choice(SCALAR_JUNK + [-5, 7, 2**62])
        else:
            params[name] = malformed(p, params[name])
    def weights_of(q):
        in_biases = (params["b_q"], params["b_k"], params["b_v"])
        return _core.MhaWeights(
            params["num_heads"], (params["w_q"], params["w_k"], params["w_v"]),
            None if in_biases == (None, None, None) else in_biases, (params["w_out"], params["b_out"]),
            None if params["bias_k"] is None and params["bias_v"] is None else (params["bias_k"], params["bias_v"]),
            params["add_zero_attn"], np.dtype(dtype))

    ok, plan = call("_core.MhaWeights", lambda: weights_of(None))
    if not ok:
        return
    batch_first = params["batch_first"]
    try:
        layout_first = bool(batch_first)
    except (TypeError, ValueError):  # junk without a truth value (an array): MhaOptions refuses it
        layout_first = True
    # (L = 8, 16 with S = L: the transposed form of few-row self-attention.)
    N, L, S = p.int(0, 2), p.choice([0, 1, 5, 8, 16]), p.choice([0, 1, 6, 8, 16])

    def seq(length, dim):
        return values(p, (N, length, dim) if layout_first else (length, N, dim), dtype)

    args = [seq(L, E), seq(S, kdim), seq(S, vdim)]
    self_attention = stacked and p.bool()
    if self_attention:
        args[1] = args[2] = args[0]
    flags = [p.choice([True, False]), p.choice([True, False]), p.bool(), p.bool()]
    n_mut = p.choice([0, 0, 1, 2])
    for _ in range(n_mut):
        i = p.int(0, 5)
        if i < 3:
            args[i] = malformed(p, args[i])
        else:
            flags[i - 3] = p.choice(SCALAR_JUNK)
    snap = snapshot(args + list(params.values()))
    ok, got = call("_core.mha", lambda: _core.mha(
        plan, *args, None, _core.MhaOptions(flags[2], flags[2] and flags[3], flags[0], flags[1], batch_first)))
    check_untouched(snap, "_core.mha")
    if not ok:
        return
    need_weights, average, causal, bottom_right = flags
    out, weights = got
    # (Self-attention's key and value as copies: the core then projects them apart, which
    # must give the same bits.)
    # (Converted as the Python rules convert inputs that are not canonical.)
    canonical = [np.array(x, dtype=dtype, order="C", copy=True) for x in args]
    q, k, v = (x if batch_first else x.transpose(1, 0, 2) for x in canonical)
    options = _core.MhaOptions(bool(causal), bool(causal) and bool(bottom_right), bool(need_weights), bool(average), True)
    expected_out, expected_weights = _testing.run_mha(plan, (q, k, v, None, None, None, None), options)
    got_out = out if batch_first else out.transpose(1, 0, 2)
    if not np.array_equal(got_out, expected_out, equal_nan=True):
        raise Disallowed("_core.mha: output differs from the core's on the canonical arrays")
    if (weights is None) != (expected_weights is None) or (
            weights is not None and not np.array_equal(weights, expected_weights, equal_nan=True)):
        raise Disallowed("_core.mha: weights differ from the core's on the canonical arrays")
    OUTCOMES["_core.mha: result checked"] += 1
    if self_attention:
        OUTCOMES["_core.mha: self-attention checked"] += 1
