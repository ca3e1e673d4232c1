#!/usr/bin/env python3
"""Decode-step benchmark: one new query token against a KV cache, attnx against torch and ONNX Runtime.

Usage (from a checkout, after ``pip install .``; the installed attnx is the one timed)::

    python benchmarks/decode.py --quick                 # smoke run, nothing saved
    python benchmarks/decode.py                         # full run, saved under benchmarks/results/
    python benchmarks/decode.py --kv-heads 32 --lengths 2048 32768 --dtypes float16 --out run.json

A full run goes into the ``decode`` section of ``benchmarks/results/MACHINE.json``
(the machine's file, which compare.py writes too; see results_file.py); ``--out`` names another
file.

Case
----
Batch 1, 32 query heads, ``--kv-heads`` key/value heads (8: grouped-query attention, the default;
32: plain multi-head), head size 128, one query token, a cache holding ``length`` tokens (default
lengths 128 512 2048 8192 32768) stored as float32 or float16 (the query has the cache's dtype), or
with ``--dtypes`` also bfloat16 (ml_dtypes) or int8. An int8 cache is attnx's alone (each key and
value row quantized with its own float32 scale; the query is float32): the peers have no such cache
and are reported n/a, and its error is taken against the float64 result of the unquantized float32
keys and values, so that it shows what the quantization costs. Every library gets the same keys,
values and query:

* **attnx**: ``attnx.cached_attention(query, cache)``, where ``cache = attnx.KVCache(1, Hkv,
  max_len, 128, dtype)`` is filled to ``length`` once, before timing. ``max_len`` is the largest
  length of the run for every row, so a call must cost what its ``length`` costs, not ``max_len``.
* **torch**: ``F.scaled_dot_product_attention(q, k_cache[:, :, :length], v_cache[:, :, :length],
  enable_gqa=True)`` under ``inference_mode``, over a cache tensor of ``max_len`` tokens (the
  slices are views made once; nothing is copied per call).
* **ONNX Runtime** (CPU provider): an in-memory model around ``com.microsoft.GroupQueryAttention``
  with ``past_key``/``past_value`` in BNSH layout over a buffer of ``max_len`` tokens, bound with
  IOBinding to ``present_key``/``present_value`` as well, so past and present share one buffer
  (ORT then appends in place instead of copying the cache on every call). A decode step of this
  op appends the new token's key and value itself: the cache holds ``length - 1`` tokens, the new
  token is the ``length``-th (its key and value are the ones the other libraries find at position
  ``length - 1``, so all three compute the same attention over ``length`` keys), ``seqlens_k`` is
  ``length - 1`` and ``total_sequence_length`` is ``length``. Where GroupQueryAttention cannot run
  this configuration (or with ``--ort-op mha``) the script falls back to
  ``com.microsoft.MultiHeadAttention`` with ``past_key``/``past_value`` of ``length - 1`` tokens,
  the key/value heads repeated to 32 (MHA has no grouped heads) and says so; that op concatenates
  past and new into a fresh ``present`` on every call, which is part of what it costs.

Method
------
The helpers of ``timing.py`` (imported from beside this file) do the timing and set the threads:

* One worker process (this script with ``--worker N``) runs every library and every row, started
  with ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/``MKL_NUM_THREADS`` = ``--threads`` and
  ``OPENBLAS_THREAD_TIMEOUT=4`` set before NumPy is imported; each library is also given the
  count through its own API (``attnx.set_num_threads``, ``torch.set_num_threads``, ORT's
  ``intra_op_num_threads`` with ``session.intra_op.allow_spinning=0``).
* For each (dtype, length), the libraries run in interleaved rounds of blocks (each block ~
  ``--block-seconds`` of calls, each call timed on its own, the order rotating every round, a
  ``--pause-ms`` sleep before each block so the previous library's spinning threads are quiet);
  the figure is the median per-call time. ``--quick``: 2 rounds of short blocks, lengths 128 and
  2048 only.
* Before timing, every library's output is compared with a float64 NumPy computation on the same
  (dtype-rounded) keys, values and query; a library whose error exceeds the tolerance (float32:
  2e-4, float16: 2e-3, times max(1, max |reference|)) is flagged and never counted as best peer.
  attnx is also checked against a cache of exactly ``length`` tokens (its result must not depend
  on ``max_len``).
* FLOPs per step = ``4 * 32 * length * 128`` (q.k^T and p.v for every query head); grouped heads
  share the bytes but not the arithmetic, so attnx's GFLOP/s is reported next to its GB/s.
* Bytes per step = the K and V read once: ``length * Hkv * 128 * 2 * itemsize`` (int8: plus the
  float32 scale of each row, ``length * Hkv * 2 * 4``). attnx's GB/s is
  that over its median time, and its fraction of the read bandwidth that ``timing.py``'s
  ``measure_read_bandwidth`` achieves over a buffer of the same size, measured just before that
  row (K and V are re-read every step, so they sit in whichever cache level holds them). "fits L3"
  compares the K+V size with the L3 size (sysfs, else ``lscpu``) only: near the L3 size, other
  data and other tenants evict part of it, which the same-size bandwidth shows. For K+V of a few
  MiB or less, per-call overhead is a large part of both times, so that fraction is indicative
  only. The read bandwidth over 512 MiB (DRAM) is reported too, and attnx's fraction of the FP32
  multiply-add peak that ``timing.py``'s ``measure_fma_peak`` measures on the same threads: with
  grouped heads every key and value element takes (32 / Hkv) multiply-adds, so a cache of 2-byte
  or 1-byte elements can be bound by the arithmetic rather than by the bytes.
* The share of the machine's CPU time used by other processes during the run is reported
  (``--wait-quiet`` waits for a quiet machine first).
* ``--precision bfloat16`` (or ``int8``, int8 caches only) times attnx with that ``precision=``
  and, in the same rounds, attnx at the default precision on the same cache ("attnx float32");
  each row gives the median over rounds of the ratio of their block medians (default / chosen:
  above 1, the chosen precision is faster). Its tolerance is bfloat16's for float32 and float16
  caches. The run is written to the ``decode-bfloat16`` (``decode-int8``) section.
* ``--beside-float32-cache`` (with ``--precision``) times, in the same rounds, attnx at the
  default precision over a float32 cache of the same keys and values ("attnx float32 cache"), and
  each row gives the median over rounds of its time over attnx's (above 1: the row's cache and
  precision take less time than a float32 cache).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# timing comes first: it sets the thread variables of a worker before NumPy is imported.
import timing  # noqa: E402  (benchmarks/timing.py: timing, thread and bandwidth helpers)
from timing import log  # noqa: E402
import peers  # noqa: E402  (benchmarks/peers.py)
from peers import Bench, NotInstalled, import_optional  # noqa: E402
import results_file  # noqa: E402
from progress import Progress  # noqa: E402
from report import decode_table, fmt_bytes  # noqa: E402  (benchmarks/report.py: the tables)

import numpy as np  # noqa: E402

WORKER_FLAG = timing.WORKER_FLAG
LIBRARIES = ("attnx", "torch", "onnxruntime")
PEERS = LIBRARIES[1:]
Q_HEADS = 32
HEAD_DIM = 128
LENGTHS = (128, 512, 2048, 8192, 32768)
QUICK_LENGTHS = (128, 2048)
DTYPES = ("float32", "float16", "bfloat16", "int8")
DEFAULT_DTYPES = ("float32", "float16")
# int8: the quantization's own error (unit-normal rows), against the unquantized reference.
TOLERANCE = {"float32": 2e-4, "float16": 2e-3, "bfloat16": 1.6e-2, "int8": 3e-2}


def data_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of the keys, values and query of a `dtype` row: the cache's (bfloat16 from
    ml_dtypes), float32 for an int8 cache (which quantizes float32 rows)."""
    if dtype == "int8":
        return np.dtype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def peer_supports(data: dict) -> None:
    """Raises for a cache dtype only attnx has (the row reports the peer as n/a)."""
    if data["cache_dtype"] == "int8":
        raise NotImplementedError("no int8 KV cache")


# --------------------------------------------------------------------------------------------
# Data and the float64 reference
# --------------------------------------------------------------------------------------------


def make_cache_data(kv_heads: int, max_len: int, dtype: str, seed: int) -> dict[str, np.ndarray]:
    """Keys and values (1, Hkv, max_len, 128) and a query (1, 32, 1, 128), standard normal, in `dtype`."""
    rng = np.random.default_rng(seed)
    dt = data_dtype(dtype)
    k = np.empty((1, kv_heads, max_len, HEAD_DIM), dt)
    v = np.empty_like(k)
    for h in range(kv_heads):  # per head, so float16 runs never hold a float32 copy of everything
        k[0, h] = rng.standard_normal((max_len, HEAD_DIM), dtype=np.float32)
        v[0, h] = rng.standard_normal((max_len, HEAD_DIM), dtype=np.float32)
    q = rng.standard_normal((1, Q_HEADS, 1, HEAD_DIM), dtype=np.float32).astype(dt)
    return {"q": q, "k": k, "v": v, "cache_dtype": dtype}


def reference_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, length: int) -> np.ndarray:
    """softmax(q k^T / sqrt(128)) v in float64 over the first `length` keys; query head h uses
    key/value head h // (32 / Hkv). Returns (1, 32, 1, 128)."""
    kv_heads = k.shape[1]
    group = Q_HEADS // kv_heads
    q64 = q.astype(np.float64).reshape(kv_heads, group, HEAD_DIM)
    out = np.empty((kv_heads, group, HEAD_DIM))
    for h in range(kv_heads):
        kh = k[0, h, :length].astype(np.float64)
        scores = q64[h] @ kh.T / math.sqrt(HEAD_DIM)  # (group, length)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[h] = p @ v[0, h, :length].astype(np.float64)
    return out.reshape(1, Q_HEADS, 1, HEAD_DIM)


def check_output(got, ref: np.ndarray, dtype: str, precision: str = "float32") -> dict:
    """Max abs difference from the float64 reference, and whether it is within the tolerance of the
    dtype (with bfloat16 products, at least bfloat16's)."""
    got = np.asarray(got)
    result = {"out_dtype": str(got.dtype), "out_shape": list(got.shape)}
    if got.shape != ref.shape:
        return {**result, "max_abs_diff": None, "ok": False, "problem": f"shape {got.shape} != {ref.shape}"}
    diff = float(np.max(np.abs(got.astype(np.float64) - ref)))
    tolerance = TOLERANCE[dtype] if precision == "float32" else max(TOLERANCE[dtype], TOLERANCE["bfloat16"])
    tol = tolerance * max(1.0, float(np.max(np.abs(ref))))
    # the error of the exact result rounded once to the output's dtype: the least any library can have
    rounding = float(np.max(np.abs(ref.astype(got.dtype).astype(np.float64) - ref))) if got.dtype.kind == "f" else None
    return {**result, "max_abs_diff": diff, "rounding_of_reference": rounding, "tolerance": tol,
            "ok": bool(diff <= tol)}  # NaN -> not ok


# --------------------------------------------------------------------------------------------
# Library adapters: setup_<lib>(data, length, threads, opts) -> Bench (to_numpy gives (1, 32, 1, 128))
# --------------------------------------------------------------------------------------------


def attnx_cache(data: dict, length: int, max_len: int):
    """An attnx.KVCache of `max_len` tokens holding the first `length` keys and values of `data`."""
    import attnx

    k, v = data["k"], data["v"]
    dtype = np.int8 if data["cache_dtype"] == "int8" else k.dtype
    cache = attnx.KVCache(1, k.shape[1], max_len, HEAD_DIM, dtype)
    cache.append(k[:, :, :length], v[:, :, :length])
    return cache


def setup_attnx(data: dict, length: int, threads: int, opts, precision: str | None = None) -> Bench:
    import attnx

    precision = opts.precision if precision is None else precision
    attnx.set_num_threads(threads)
    cache = attnx_cache(data, length, opts.max_len)
    q = data["q"]
    chosen = None if precision == "float32" else precision
    kernels = attnx.show_config()["precisions"][chosen] if chosen else None
    return Bench(lambda: attnx.cached_attention(q, cache, precision=chosen),
                 note=f"attnx.cached_attention over KVCache(max_len={opts.max_len})"
                      + (f", precision={chosen!r} ({kernels})" if chosen else ""))


def setup_attnx_float32(data: dict, length: int, threads: int, opts) -> Bench:
    """attnx at the default precision, beside a --precision run."""
    return setup_attnx(data, length, threads, opts, "float32")


def setup_attnx_float32_cache(data: dict, length: int, threads: int, opts) -> Bench:
    """attnx at the default precision over a float32 cache of the same rows (--beside-float32-cache)."""
    return setup_attnx({**data, "cache_dtype": "float32", "k": data["k"].astype(np.float32),
                        "v": data["v"].astype(np.float32)}, length, threads, opts, "float32")


def setup_torch(data: dict, length: int, threads: int, opts) -> Bench:
    torch = import_optional("torch")
    peer_supports(data)
    torch.set_num_threads(threads)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.from_numpy(data["q"])
    k_cache, v_cache = torch.from_numpy(data["k"]), torch.from_numpy(data["v"])  # (1, Hkv, max_len, 128)
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]  # views, made once

    def run():
        with torch.inference_mode():
            return sdpa(q, k, v, enable_gqa=True)

    return Bench(run, lambda t: t.numpy(),
                 note=f"F.scaled_dot_product_attention(enable_gqa=True) on {data['k'].dtype} views of a "
                      f"max_len cache, inference_mode")


def _ort_session(model: bytes, threads: int):
    ort = import_optional("onnxruntime")
    return ort, ort.InferenceSession(model, peers.ort_session_options(ort, threads),
                                     providers=["CPUExecutionProvider"])


def _onnx_model(op: str, dtype: np.dtype, kv_heads: int, past_len: int, present_len: int) -> bytes:
    """A one-node model: com.microsoft GroupQueryAttention or MultiHeadAttention, one query token,
    the new token's key/value in (1, 1, heads*128), past and present key/value in BNSH."""
    onnx = import_optional("onnx")
    from onnx import TensorProto, helper

    elem = helper.np_dtype_to_tensor_dtype(dtype)
    heads = kv_heads if op == "GroupQueryAttention" else Q_HEADS

    def value(name, shape, elem_type=elem):
        return helper.make_tensor_value_info(name, elem_type, shape)

    inputs = [value("query", [1, 1, Q_HEADS * HEAD_DIM]), value("key", [1, 1, heads * HEAD_DIM]),
              value("value", [1, 1, heads * HEAD_DIM])]
    if op == "GroupQueryAttention":
        inputs += [value("past_key", [1, heads, past_len, HEAD_DIM]), value("past_value", [1, heads, past_len, HEAD_DIM]),
                   value("seqlens_k", [1], TensorProto.INT32), value("total_sequence_length", [], TensorProto.INT32)]
        attrs = {"num_heads": Q_HEADS, "kv_num_heads": kv_heads}
        node_inputs = [i.name for i in inputs]
    else:  # MultiHeadAttention: query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value
        inputs += [value("past_key", [1, heads, past_len, HEAD_DIM]), value("past_value", [1, heads, past_len, HEAD_DIM])]
        attrs = {"num_heads": Q_HEADS}
        node_inputs = ["query", "key", "value", "", "", "", "past_key", "past_value"]
    outputs = [value("output", [1, 1, Q_HEADS * HEAD_DIM]), value("present_key", [1, heads, present_len, HEAD_DIM]),
               value("present_value", [1, heads, present_len, HEAD_DIM])]
    node = helper.make_node(op, node_inputs, [o.name for o in outputs], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], f"decode_{op}", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _new_token(a: np.ndarray, length: int) -> np.ndarray:
    """The key or value of token `length - 1` as (1, 1, heads*128)."""
    return np.ascontiguousarray(a[:, :, length - 1]).reshape(1, 1, -1)


def setup_ort_gqa(data: dict, length: int, threads: int, opts) -> Bench:
    k, v, q = data["k"], data["v"], data["q"]
    kv_heads, max_len = k.shape[1], k.shape[2]
    ort, session = _ort_session(_onnx_model("GroupQueryAttention", k.dtype, kv_heads, max_len, max_len), threads)
    # past and present share the max_len buffer (the same OrtValue on both sides, wrapping the
    # NumPy arrays without a copy): ORT writes the new token in place at position length - 1,
    # where it already is, so the cache is unchanged from call to call.
    past_k, past_v = ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)
    binding = session.io_binding()
    feeds = {"query": q.reshape(1, 1, Q_HEADS * HEAD_DIM), "key": _new_token(k, length), "value": _new_token(v, length),
             "seqlens_k": np.array([length - 1], np.int32), "total_sequence_length": np.array(length, np.int32)}
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_ortvalue_input("past_key", past_k)
    binding.bind_ortvalue_input("past_value", past_v)
    binding.bind_output("output")
    binding.bind_ortvalue_output("present_key", past_k)
    binding.bind_ortvalue_output("present_value", past_v)
    keep = (feeds, past_k, past_v, k, v)  # the bound memory must outlive the binding

    def run():
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def to_numpy(out):
        assert keep
        return out.numpy().reshape(1, 1, Q_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)

    note = (f"com.microsoft.GroupQueryAttention (num_heads=32, kv_num_heads={kv_heads}), {k.dtype}, "
            f"past/present sharing one max_len BNSH buffer, cache length-1 + the new token, IOBinding")
    return Bench(run, to_numpy, note=note)


def setup_ort_mha(data: dict, length: int, threads: int, opts) -> Bench:
    k, v, q = data["k"], data["v"], data["q"]
    kv_heads = k.shape[1]
    group = Q_HEADS // kv_heads
    ort, session = _ort_session(_onnx_model("MultiHeadAttention", k.dtype, kv_heads, length - 1, length), threads)
    # MultiHeadAttention has no grouped heads: repeat each key/value head `group` times (once, untimed).
    k_rep = np.repeat(k[:, :, :length], group, axis=1)
    v_rep = np.repeat(v[:, :, :length], group, axis=1)
    feeds = {"query": q.reshape(1, 1, Q_HEADS * HEAD_DIM), "key": _new_token(k_rep, length),
             "value": _new_token(v_rep, length), "past_key": np.ascontiguousarray(k_rep[:, :, :length - 1]),
             "past_value": np.ascontiguousarray(v_rep[:, :, :length - 1])}
    del k_rep, v_rep
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    for name in ("output", "present_key", "present_value"):
        binding.bind_output(name)

    def run():
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def to_numpy(out):
        assert feeds
        return out.numpy().reshape(1, 1, Q_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)

    heads = f"key/value heads repeated {kv_heads} -> 32" if group > 1 else "32 key/value heads, no repetition needed"
    note = (f"com.microsoft.MultiHeadAttention (num_heads=32; {heads}), "
            f"{k.dtype}, past_key/past_value of length-1 tokens + the new token, present copied each call, IOBinding")
    return Bench(run, to_numpy, note=note)


def setup_onnxruntime(data: dict, length: int, threads: int, opts) -> Bench:
    """GroupQueryAttention where it runs and agrees with the reference, else MultiHeadAttention."""
    import_optional("onnxruntime")
    peer_supports(data)
    if opts.ort_op in ("auto", "gqa"):
        try:
            bench = setup_ort_gqa(data, length, threads, opts)
            if opts.ort_op == "gqa":
                return bench
            ref = reference_decode(data["q"], data["k"], data["v"], length)
            if check_output(bench.to_numpy(bench.run()), ref, str(data["k"].dtype))["ok"]:
                return bench
            problem = "its output disagrees with the reference"
        except NotInstalled:
            raise
        except Exception as exc:  # not supported here: fall back to MultiHeadAttention
            if opts.ort_op == "gqa":
                raise
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        bench = setup_ort_mha(data, length, threads, opts)
        bench.note += f" [fallback: GroupQueryAttention failed: {problem}]"
        return bench
    return setup_ort_mha(data, length, threads, opts)


ADAPTERS = {"attnx": setup_attnx, "torch": setup_torch, "onnxruntime": setup_onnxruntime,
            "attnx_float32": setup_attnx_float32, "attnx_float32_cache": setup_attnx_float32_cache}


# --------------------------------------------------------------------------------------------
# Machine facts
# --------------------------------------------------------------------------------------------


def _parse_size(text: str) -> int | None:
    text = text.strip().upper().replace("IB", "").replace(" ", "")
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        return None


def cpu_caches() -> dict:
    """Data/unified cache sizes of cpu0 from sysfs (bytes per instance, and the CPUs sharing it)."""
    caches = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(e for e in os.listdir(base) if e.startswith("index"))
    except OSError:
        entries = []
    for entry in entries:
        try:
            read = lambda name: open(os.path.join(base, entry, name)).read().strip()  # noqa: E731
            if read("type") == "Instruction":
                continue
            caches[f"L{read('level')}"] = {"bytes": _parse_size(read("size")), "shared_cpu_list": read("shared_cpu_list")}
        except OSError:
            continue
    if "L3" not in caches:  # e.g. no sysfs: ask lscpu
        try:
            out = subprocess.run(["lscpu", "-B"], capture_output=True, text=True, timeout=10).stdout
            for line in out.splitlines():
                if line.startswith("L3 cache:"):
                    caches["L3"] = {"bytes": _parse_size(line.split(":", 1)[1].split("(")[0]), "shared_cpu_list": "?"}
        except (OSError, subprocess.SubprocessError):
            pass
    return caches


# --------------------------------------------------------------------------------------------
# Worker: every (dtype, length) row in one process
# --------------------------------------------------------------------------------------------


def kv_bytes(length: int, kv_heads: int, dtype: str) -> int:
    if dtype == "int8":  # a byte per element and a float32 scale per row
        return length * kv_heads * 2 * (HEAD_DIM + 4)
    return length * kv_heads * HEAD_DIM * 2 * data_dtype(dtype).itemsize


def step_flops(length: int) -> int:
    """q.k^T and p.v for every query head: 2 x 32 x length x 128 multiply-adds (softmax not counted)."""
    return 4 * Q_HEADS * length * HEAD_DIM


def bench_row(data: dict, dtype: str, length: int, libs: list[str], threads: int, opts,
              progress: Progress | None = None) -> dict:
    reference = reference_decode(data["q"], data["k"], data["v"], length)
    status: dict[str, dict] = {}
    benches: dict[str, Bench] = {}
    if opts.precision != "float32":
        libs = [*libs, "attnx_float32"] + (["attnx_float32_cache"] if opts.beside_float32_cache else [])
    for name in libs:
        try:
            bench = ADAPTERS[name](data, length, threads, opts)
            precision = opts.precision if name == "attnx" else "float32"
            status[name] = {"status": "ok", "note": bench.note,
                            **check_output(bench.to_numpy(bench.run()), reference, dtype, precision)}
            benches[name] = bench
        except NotInstalled as exc:
            status[name] = {"status": "not installed", "note": str(exc)}
        except Exception as exc:  # a library that cannot run this row is reported as n/a
            status[name] = {"status": "n/a", "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        entry = status[name]
        if entry["status"] == "ok" and not entry["ok"]:
            log(f"  WARNING: {name} {dtype} length {length}: max |error| {entry['max_abs_diff']} "
                f"> tolerance {entry.get('tolerance')} {entry.get('problem', '')}")
    if "attnx" in benches:  # the result must not depend on the cache's capacity
        try:
            import attnx

            exact = attnx.cached_attention(data["q"], attnx_cache(data, length, length),
                                           precision=None if opts.precision == "float32" else opts.precision)
            same = np.array_equal(np.asarray(exact), np.asarray(benches["attnx"].run()), equal_nan=True)
            status["attnx"]["same_as_exact_capacity_cache"] = bool(same)
            if not same:
                log(f"  WARNING: attnx {dtype} length {length}: a max_len={opts.max_len} cache and a "
                    f"max_len={length} cache give different results")
        except Exception as exc:
            status["attnx"]["same_as_exact_capacity_cache"] = f"{type(exc).__name__}: {exc}"
    timings = (timing.measure_interleaved(benches, opts.rounds, opts.block_seconds, opts.pause_ms / 1e3, progress)
               if benches else {})
    if not benches and progress is not None:
        progress.update(opts.rounds)
    nbytes = kv_bytes(length, data["k"].shape[1], dtype)
    def per_round(base: str) -> float | None:
        """The median over rounds of base's block median over attnx's."""
        if "attnx" not in timings or base not in timings:
            return None
        return statistics.median(d / b for d, b in zip(timings[base]["block_medians_ms"],
                                                       timings["attnx"]["block_medians_ms"]))
    default_vs_chosen = per_round("attnx_float32")
    for name, t in timings.items():
        status[name].update(t)
        status[name]["median_us"] = 1e3 * t["median_ms"]
        status[name]["gbs"] = nbytes / (t["median_ms"] / 1e3) / 1e9
        status[name]["gflops"] = step_flops(length) / (t["median_ms"] / 1e3) / 1e9
    del benches
    gc.collect()
    return {"dtype": dtype, "length": length, "kv_heads": data["k"].shape[1], "q_heads": Q_HEADS,
            "head_dim": HEAD_DIM, "max_len": opts.max_len, "kv_bytes": nbytes, "flops": step_flops(length),
            "default_vs_precision_per_round": default_vs_chosen,
            "float32_cache_vs_precision_per_round": per_round("attnx_float32_cache"), "libs": status}


def add_comparisons(row: dict, peaks: dict, caches: dict) -> None:
    libs = row["libs"]
    a = libs.get("attnx", {})
    valid = {n: libs[n]["median_us"] for n in PEERS if n in libs and libs[n].get("ok") and "median_us" in libs[n]}
    best = min(valid, key=valid.get) if valid else None
    row["best_peer"] = best
    row["speedup"] = valid[best] / a["median_us"] if best and "median_us" in a else None
    l3 = (caches.get("L3") or {}).get("bytes")
    row["l3_bytes"] = l3
    row["fits_l3"] = None if not l3 else row["kv_bytes"] <= l3
    same = peaks["working_set_bandwidth"].get(str(row["kv_bytes"]))
    row["read_bw_same_size"] = same
    if "median_us" in a:
        gbs = a["gbs"]
        row["attnx_gbs"] = gbs
        row["attnx_gflops"] = a["gflops"]
        row["attnx_fraction_of_dram_bw"] = gbs / peaks["read_bandwidth"]["gbs"]
        row["attnx_fraction_of_same_size_bw"] = gbs / same["gbs"] if same else None
        row["attnx_fraction_of_fma_peak"] = a["gflops"] / peaks["fma"]["gflops"] if peaks.get("fma") else None


def same_size_bandwidth(nbytes: int, threads: int, opts) -> dict | None:
    """timing.py's read bandwidth over a buffer of `nbytes` (the K+V size), or None without the memory."""
    try:
        return timing.measure_read_bandwidth(threads, nbytes / 2**20, 3 if opts.quick else 15)
    except MemoryError:
        return None
    finally:
        gc.collect()


def run_worker(threads: int, opts) -> dict:
    libs = [name for name in LIBRARIES if name in opts.libs]
    kv_heads = opts.kv_heads
    load = timing.BackgroundLoad()
    caches = cpu_caches()
    log(f"[threads={threads}] measuring the DRAM read bandwidth ...")
    peaks = {"read_bandwidth": timing.measure_read_bandwidth(threads, 512, 2 if opts.quick else 5),
             "fma": timing.measure_fma_peak(threads), "working_set_bandwidth": {}}
    rows = []
    progress = Progress(len(opts.dtypes) * len(opts.lengths) * opts.rounds, f"threads={threads}", unit="round",
                        enabled=not opts.no_progress)
    for dtype in opts.dtypes:
        data = make_cache_data(kv_heads, opts.max_len, dtype, opts.seed)
        for length in opts.lengths:
            progress.write(f"[threads={threads}] {dtype} cache length {length} ...")
            nbytes = kv_bytes(length, kv_heads, dtype)
            if str(nbytes) not in peaks["working_set_bandwidth"]:  # measured next to the row it serves
                peaks["working_set_bandwidth"][str(nbytes)] = same_size_bandwidth(nbytes, threads, opts)
            row = bench_row(data, dtype, length, libs, threads, opts, progress)
            add_comparisons(row, peaks, caches)
            rows.append(row)
        del data
        gc.collect()
    progress.close()
    return {"threads": threads, "precision": opts.precision, "peaks": peaks, "caches": caches, "rows": rows,
            "background_cpu_fraction": load.fraction()}


# --------------------------------------------------------------------------------------------
# Driver and report
# --------------------------------------------------------------------------------------------


def worker_argv(out_path: str, opts) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(opts.threads), "--worker-out", out_path,
            "--lengths", *map(str, opts.lengths), "--dtypes", *opts.dtypes, "--kv-heads", str(opts.kv_heads),
            "--libs", *opts.libs, "--rounds", str(opts.rounds), "--block-seconds", str(opts.block_seconds),
            "--pause-ms", str(opts.pause_ms), "--ort-op", opts.ort_op, "--seed", str(opts.seed),
            "--precision", opts.precision]
    return (argv + (["--quick"] if opts.quick else []) + (["--no-progress"] if opts.no_progress else [])
            + (["--beside-float32-cache"] if opts.beside_float32_cache else []))


def spread_table(run: dict) -> str:
    """Fastest call, 10th percentile and 90th percentile per library: a wide spread means interruptions."""
    lines = ["| dtype | cache length | " + " | ".join(f"{n} min / p10 / p90 us" for n in LIBRARIES) + " |",
             "|---|---|" + "|".join("---" for _ in LIBRARIES) + "|"]
    for r in run["rows"]:
        cells = []
        for name in LIBRARIES:
            e = r["libs"].get(name, {})
            cells.append(" / ".join(f"{1e3 * e[k]:.0f}" for k in ("min_ms", "p10_ms", "p90_ms")) if "min_ms" in e else "-")
        lines.append(f"| {r['dtype']} | {r['length']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_table(run: dict) -> str:
    lines = ["| dtype | cache length | " + " | ".join(LIBRARIES) + " | exact result rounded to the dtype |",
             "|---|---|" + "|".join("---" for _ in LIBRARIES) + "|---|"]
    for r in run["rows"]:
        cells = []
        for name in LIBRARIES:
            e = r["libs"].get(name, {})
            if e.get("status") != "ok":
                cells.append(e.get("status", "-"))
                continue
            text = "n/a" if e.get("max_abs_diff") is None else f"{e['max_abs_diff']:.1e}"
            text += "" if e["ok"] else " MISMATCH"
            if e.get("same_as_exact_capacity_cache") not in (None, True):
                text += " (depends on max_len!)"
            cells.append(text)
        roundings = [e["rounding_of_reference"] for e in r["libs"].values()
                     if e.get("status") == "ok" and e.get("out_dtype") == r["dtype"] and e.get("rounding_of_reference") is not None]
        cells.append(f"{max(roundings):.1e}" if roundings else "-")
        lines.append(f"| {r['dtype']} | {r['length']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_report(report: dict) -> None:
    m, v, c = report["machine"], report["versions"], report["config"]
    run = report["run"]
    print(f"\n# attnx decode-step benchmark — {m['cpu_model']}, {m['cores']} cores, {m['platform']}")
    print("versions: " + ", ".join(f"{n} {v.get(n) or 'not installed'}" for n in ("attnx", "numpy", "torch", "onnxruntime", "onnx")))
    print(f"attnx config: {v.get('attnx_config')}")
    print(f"case: batch 1, {Q_HEADS} query heads, {c['kv_heads']} KV heads, head_dim {HEAD_DIM}, one query token; "
          f"cache capacity max_len = {c['max_len']} for every row; {c['threads']} thread(s).")
    print(f"method: {c['rounds']} interleaved rounds, blocks of ~{c['block_seconds']} s per library, "
          f"{c['pause_ms']} ms pause before each block, median per-call time (microseconds).")
    if "error" in run:
        print(f"\nworker failed: {run['error']}")
        return
    caches = run["caches"]
    l3 = caches.get("L3", {})
    print("caches: " + ", ".join(f"{name} {fmt_bytes(x['bytes'])} (CPUs {x['shared_cpu_list']})"
                                 for name, x in caches.items() if x.get("bytes")))
    dram = run["peaks"]["read_bandwidth"]
    print(f"read bandwidth over {dram['mib']} MiB (DRAM): {dram['gbs']:.1f} GB/s ({dram['by']}).")
    fma = run["peaks"].get("fma")
    if fma:
        print(f"FP32 multiply-add peak: {fma['gflops']:.1f} GFLOP/s ({fma.get('by', 'attnx probe')}).")
    print()
    print(decode_table(run))
    background = run.get("background_cpu_fraction")
    if background is not None:
        warn = " — WARNING: other work on the machine may have disturbed these timings" if background > 0.05 else ""
        print(f"\nOther processes used {100 * background:.1f}% of the machine's CPU time during this run{warn}.")
    print("\nK+V read = length x KV heads x 128 x 2 x itemsize, read once per step. speed-up = the best "
          "correct peer's median / attnx's (> 1: attnx faster). % of read BW = attnx's GB/s over the read "
          "bandwidth timing.py's measure_read_bandwidth reaches over a buffer of the K+V size "
          f"(fits L3: K+V <= the {fmt_bytes(l3['bytes']) if l3.get('bytes') else '?'} L3, by size alone; below a few MiB "
          "per-call overhead dominates both times, so that fraction is indicative only). GFLOP/s counts "
          f"4 x {Q_HEADS} x length x {HEAD_DIM} FLOPs per step (both products, every query head; softmax not "
          "counted): with grouped heads a step does the same arithmetic on fewer bytes, so it need not be "
          "bandwidth-bound.")
    print("\nSpread of the per-call times (the table above gives the medians):\n")
    print(spread_table(run))
    print("\nmax |output - float64 reference|:\n")
    print(accuracy_table(run))
    notes: dict[str, set] = {}
    for r in run["rows"]:
        for name, e in r["libs"].items():
            if e.get("status") == "ok" and e.get("note"):
                notes.setdefault(name, set()).add(e["note"])
            elif e.get("status") not in ("ok", None):
                print(f"- {name} {r['dtype']} length {r['length']}: {e['status']}: {e.get('note')}")
    print()
    for name, ns in notes.items():
        print(f"- {name}: {'; '.join(sorted(ns))}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads for every library (default 2)")
    p.add_argument("--lengths", type=int, nargs="+", help=f"cache lengths (default {' '.join(map(str, LENGTHS))}; "
                   f"--quick: {' '.join(map(str, QUICK_LENGTHS))})")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DEFAULT_DTYPES),
                   help="cache dtypes (default float32 float16; bfloat16 needs ml_dtypes; int8 is attnx's alone)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads, a divisor of 32 (default 8; 32: no grouping)")
    p.add_argument("--libs", nargs="+", default=list(LIBRARIES), choices=LIBRARIES, help="libraries (attnx always runs)")
    p.add_argument("--ort-op", choices=("auto", "gqa", "mha"), default="auto",
                   help="ONNX Runtime op: GroupQueryAttention, falling back to MultiHeadAttention (auto), or one of them")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 7, --quick 2)")
    p.add_argument("--block-seconds", type=float, help="target length of one block (default 0.2, --quick 0.02)")
    p.add_argument("--pause-ms", type=float, default=30.0, help="sleep before each block (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random keys, values and query")
    p.add_argument("--out", "--json", dest="out", metavar="PATH",
                   help="results file (default: benchmarks/results/MACHINE.json; --quick runs are "
                        "saved only when this is given)")
    p.add_argument("--precision", choices=("float32", "bfloat16", "int8"), default="float32",
                   help="attnx's precision= (attnx at the default precision runs beside it; int8: int8 caches "
                        "only; see above)")
    p.add_argument("--beside-float32-cache", action="store_true",
                   help="with --precision: also attnx at the default precision over a float32 cache (see above)")
    p.add_argument("--section", help="key of the results file to write (default decode, or decode-bfloat16)")
    p.add_argument("--no-save", action="store_true", help="print the report only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 short rounds, lengths 128 and 2048")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for other processes to leave the CPUs idle")
    p.add_argument(WORKER_FLAG, type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.threads < 1:
        p.error("--threads must be at least 1")
    if opts.kv_heads < 1 or Q_HEADS % opts.kv_heads:
        p.error(f"--kv-heads must divide {Q_HEADS}")
    if opts.lengths is None:
        opts.lengths = list(QUICK_LENGTHS if opts.quick else LENGTHS)
    if min(opts.lengths) < 1:
        p.error("--lengths must be positive")
    opts.lengths = sorted(set(opts.lengths))
    opts.max_len = max(opts.lengths)
    if opts.rounds is None:
        opts.rounds = 2 if opts.quick else 7
    if opts.block_seconds is None:
        opts.block_seconds = 0.02 if opts.quick else 0.2
    if opts.quick:
        opts.pause_ms = min(opts.pause_ms, 10.0)
    if "attnx" not in opts.libs:
        opts.libs = ["attnx", *opts.libs]
    if opts.section is None:
        opts.section = "decode" if opts.precision == "float32" else f"decode-{opts.precision}"
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker is not None:
        with open(opts.worker_out, "w") as f:
            json.dump(run_worker(opts.worker, opts), f)
        return 0
    waited = timing.wait_for_quiet_machine(opts.wait_quiet) if opts.wait_quiet > 0 else None
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        env = {**os.environ, **timing.thread_env(opts.threads)}
        proc = subprocess.run(worker_argv(out_path, opts), env=env)
        if proc.returncode != 0 or not os.path.exists(out_path):
            why = f"status {proc.returncode}"
            if proc.returncode < 0:
                why += f" ({signal.Signals(-proc.returncode).name}; stderr shows the row it was on)"
            run = {"threads": opts.threads, "error": f"worker exited with {why}"}
        else:
            with open(out_path) as f:
                run = json.load(f)
    report = {
        "benchmark": "decode step: attnx.cached_attention vs torch sdpa and ONNX Runtime over a KV cache",
        "machine": {"cpu_model": results_file.cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")},
        "versions": {n: x for n, x in peers.library_versions().items() if n not in ("openvino",)},
        "config": {"threads": opts.threads, "kv_heads": opts.kv_heads, "q_heads": Q_HEADS, "head_dim": HEAD_DIM,
                   "lengths": opts.lengths, "dtypes": opts.dtypes, "max_len": opts.max_len, "libs": opts.libs,
                   "ort_op": opts.ort_op, "precision": opts.precision, "rounds": opts.rounds, "block_seconds": opts.block_seconds,
                   "pause_ms": opts.pause_ms, "seed": opts.seed, "quick": opts.quick,
                   "load_before_start": waited, "argv": sys.argv[1:] if argv is None else list(argv)},
        "run": run,
    }
    print_report(report)
    if not opts.no_save and (opts.out or not opts.quick):
        path = results_file.write_section(opts.section, report, opts.out)
        print(f"\nwrote the {opts.section!r} section of {path}")
    return 0 if "error" not in run else 1


if __name__ == "__main__":
    sys.exit(main())
