#!/usr/bin/env python3
"""Benchmark attnx against NumPy, PyTorch, ONNX Runtime and OpenVINO on the CPU.

Usage (from a checkout, after ``pip install .``; the installed attnx is the one timed)::

    python benchmarks/compare.py --quick                # smoke run, nothing saved
    python benchmarks/compare.py                        # full run, saved under benchmarks/results/
    python benchmarks/compare.py --sweep                # time against sequence length, same file
    python benchmarks/compare.py --threads 2 --shapes l1024 --out run.json

Results go to ``benchmarks/results/DATE-MACHINE-COMMIT.json`` (see results_file.py): the
``compare`` section for the shapes, ``sweep`` for ``--sweep``. ``--out`` names another file.

Method
------
* **One process per thread count.** The driver (this script without ``--worker``) starts
  itself once per thread count as a subprocess with ``OMP_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to that count (and
  ``OPENBLAS_THREAD_TIMEOUT=4`` so OpenBLAS's idle threads go to sleep quickly). These must be
  set before NumPy is imported, which is why each count gets a fresh interpreter. Inside the
  worker every library is also told the count through its own API: ``attnx.set_num_threads``,
  ``torch.set_num_threads``, ONNX Runtime's ``intra_op_num_threads`` and OpenVINO's
  ``INFERENCE_NUM_THREADS``.
* **All libraries in the same process, on the same inputs.** float32 inputs are drawn once per
  shape; every library gets those arrays (zero-copy where the library allows it). ONNX
  Runtime's ``MultiHeadAttention`` wants ``(B, L, H*D)`` inputs, so for it the layout is
  converted once at set-up, outside the timed region.
* **Interleaved blocks.** For each round, each library runs a block of ``k`` calls (``k`` is
  calibrated per library so that a block lasts about ``--block-seconds``; at least one call),
  and every call is timed on its own with ``time.perf_counter``. The order of the libraries
  rotates from round to round. Interleaving spreads slow drifts of the machine (frequency,
  other tenants, page cache) over all libraries alike instead of penalising whichever ran last.
* **A pause between libraries.** OpenMP, OpenBLAS and TBB keep their worker threads spinning
  for a while after a parallel region. Without a pause, the previous library's spinning
  threads would compete with the next library's threads for the same cores. The script sleeps
  ``--pause-ms`` (30 ms) before each block; ONNX Runtime is additionally told not to spin.
* **Medians.** Each library's figure is the median of all its per-call times, which ignores
  the occasional interruption; GFLOP/s are computed from it. The speed-up is
  ``median(best peer) / median(attnx)``, where the best peer is the fastest library other than
  attnx whose output agreed with the reference (so > 1 means attnx is faster).
* **Per-round speed-up.** The shared VMs this runs on change speed from one minute to the next
  (neighbours), and a pooled median can then set one library's fast blocks against another's
  slow ones. The table also gives the median over rounds of the best peer's block median over
  attnx's in the same round ("per round"): each ratio compares blocks run a few tenths of a
  second apart.
* **Checked outputs.** Every library's output (including attnx's) is compared with a float64
  NumPy reference of the same computation; the max absolute difference is reported and a peer
  that disagrees is flagged and excluded from "best peer", so a broken set-up is visible
  rather than a silently fast wrong answer.
* **Machine peaks.** Each worker measures an achievable FP32 GEMM rate (a large float32 matmul
  with torch and with NumPy, best of a few) and the memory read bandwidth (reductions over a
  512 MiB float32 array: torch sum on n threads, NumPy max, BLAS sdot; the best of a few), and
  the FP32 FMA peak: by default measured with attnx's own probe (``attnx._core.fma_peak``:
  register-resident chains of vector multiply-adds in the active kernel, on n threads, the best
  of five), or taken from ``--peak-gflops`` (all cores) scaled to the thread count.
  attnx's fraction of peak uses the FMA peak for the compute-bound shapes and, for the decode
  shape (bytes = K and V read once = ``2*B*H*S*D*4``), the read bandwidth measured the same way
  over an array of the K+V size: K and V are re-read on every call, so they live in whichever
  cache level holds that size (64 MiB fits a large L3), and the 512 MiB (DRAM) figure would be
  the wrong roof. The fraction of the DRAM bandwidth is printed as well.
* **Background load.** Each worker reports the share of the machine's CPU time used by other
  processes while it ran (from /proc/stat) and warns above 5%; ``--wait-quiet`` waits for an
  idle machine before each thread count.

FLOP counts: sdpa ``4*B*H*L*S*D`` (two matmuls, 2 FLOPs per multiply-add); for causal shapes
only the computed half is counted (``2*B*H*L*S*D``); the MHA module adds ``8*B*L*E^2`` for the
four projections. Softmax work is not counted.

Peers that are not installed are reported as "not installed", never as an error.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_file  # noqa: E402  (benchmarks/results_file.py)
from progress import Progress  # noqa: E402  (benchmarks/progress.py)

WORKER_FLAG = "--worker"


def thread_env(threads: int) -> dict[str, str]:
    """Environment variables that fix the thread count of OpenMP / BLAS runtimes."""
    n = str(threads)
    return {
        "OMP_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "OPENBLAS_THREAD_TIMEOUT": "4",
    }


def _set_thread_env_before_numpy() -> None:
    """In a worker process, set the thread variables before NumPy is imported."""
    if WORKER_FLAG in sys.argv:
        i = sys.argv.index(WORKER_FLAG)
        if i + 1 < len(sys.argv) and sys.argv[i + 1].isdigit():
            os.environ.update(thread_env(int(sys.argv[i + 1])))


_set_thread_env_before_numpy()

import numpy as np  # noqa: E402  (must come after the thread variables are set)

LIBRARIES = ("attnx", "numpy", "torch", "onnxruntime", "openvino")
PEERS = LIBRARIES[1:]


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One benchmark case. For "mha", H*D is the embedding width E and S == L."""

    name: str
    kind: str  # "sdpa" or "mha"
    B: int
    H: int
    L: int
    S: int
    D: int
    causal: bool = False
    memory_bound: bool = False
    # The causal mask given as an (L, S) float array of 0 / -inf, as model code often passes
    # it, rather than as a flag: each library then finds the closed keys in the mask.
    mask_given: bool = False

    @property
    def E(self) -> int:
        return self.H * self.D

    @property
    def label(self) -> str:
        if self.kind == "mha":
            return f"MHA B{self.B} L{self.L} E{self.E} H{self.H}"
        tag = " causal mask" if self.mask_given else (
            " causal" if self.causal else (" decode" if self.memory_bound else ""))
        return f"sdpa{tag} B{self.B} H{self.H} L{self.L} S{self.S} D{self.D}"

    @property
    def flops(self) -> float:
        attention = 4.0 * self.B * self.H * self.L * self.S * self.D
        if self.causal:
            attention /= 2  # only the computed (lower) half
        if self.kind == "mha":
            attention += 8.0 * self.B * self.L * self.E**2
        return attention

    @property
    def bytes_kv(self) -> float:
        """Bytes of K and V, each read once (float32)."""
        return 2.0 * self.B * self.H * self.S * self.D * 4


SHAPES = (
    Shape("b8-l128", "sdpa", B=8, H=12, L=128, S=128, D=64),
    Shape("l1024", "sdpa", B=1, H=12, L=1024, S=1024, D=64),
    Shape("causal-l2048", "sdpa", B=1, H=12, L=2048, S=2048, D=64, causal=True),
    Shape("decode-s2048", "sdpa", B=1, H=32, L=1, S=2048, D=128, memory_bound=True),
    Shape("tiny", "sdpa", B=1, H=4, L=16, S=16, D=16),
    Shape("mha-e768", "mha", B=8, H=12, L=128, S=128, D=64),
    Shape("mha-e64", "mha", B=1, H=4, L=16, S=16, D=16),
)
# Run only when named: a BERT-sized layer on one token (projections of one
# row: reading the weights is the work) and on a short sequence; a causal
# mask given as an array; long sequences and wide heads; a few queries against
# many keys.
EXTRA_SHAPES = (
    Shape("mha-e1024-l1", "mha", B=1, H=16, L=1, S=1, D=64),
    Shape("mha-e768-l64", "mha", B=1, H=12, L=64, S=64, D=64),
    Shape("causal-mask-l2048", "sdpa", B=1, H=12, L=2048, S=2048, D=64, causal=True,
          mask_given=True),
    # Heads whose keys and values outgrow L2 (2 MiB and 4 MiB a head), and wide heads.
    Shape("l8192", "sdpa", B=1, H=2, L=8192, S=8192, D=64),
    Shape("d128-l2048", "sdpa", B=1, H=8, L=2048, S=2048, D=128),
    Shape("d256-l512", "sdpa", B=1, H=8, L=512, S=512, D=256),
    # A step that checks 16 drafted tokens against a long cache: 128 MiB of keys and values,
    # read from memory.
    Shape("decode-l16-s4096", "sdpa", B=1, H=32, L=16, S=4096, D=128, memory_bound=True),
)


SWEEP_LENGTHS = (128, 256, 512, 1024, 2048)


def sweep_shapes(lengths) -> list[Shape]:
    """The --sweep cases: sdpa B1 H12 D64 with L == S, one per length."""
    return [Shape(f"sweep-l{n}", "sdpa", B=1, H=12, L=n, S=n, D=64) for n in lengths]


def select_shapes(selectors: list[str] | None) -> list[Shape]:
    """Shapes by 1-based number or name; all when `selectors` is empty."""
    if not selectors:
        return list(SHAPES)
    chosen = []
    for sel in selectors:
        if sel.isdigit() and 1 <= int(sel) <= len(SHAPES):
            chosen.append(SHAPES[int(sel) - 1])
            continue
        matches = [s for s in SHAPES + EXTRA_SHAPES if s.name == sel]
        if not matches:
            names = ", ".join([f"{i}={s.name}" for i, s in enumerate(SHAPES, 1)] +
                              [s.name for s in EXTRA_SHAPES])
            raise SystemExit(f"unknown shape {sel!r}; choose from {names}")
        chosen.extend(matches)
    return chosen


def make_inputs(shape: Shape, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 inputs: q, k, v (B, H, L|S, D) for sdpa; x (B, L, E) and weights for mha."""
    rng = np.random.default_rng(seed)

    def randn(*dims):
        return rng.standard_normal(dims, dtype=np.float32)

    if shape.kind == "sdpa":
        return {
            "q": randn(shape.B, shape.H, shape.L, shape.D),
            "k": randn(shape.B, shape.H, shape.S, shape.D),
            "v": randn(shape.B, shape.H, shape.S, shape.D),
        }
    E = shape.E
    bound_in = math.sqrt(6.0 / (E + 3 * E))  # xavier_uniform_ on (3E, E), as torch
    bound_out = 1.0 / math.sqrt(E)
    return {
        "x": randn(shape.B, shape.L, E),
        "w_in": rng.uniform(-bound_in, bound_in, (3 * E, E)).astype(np.float32),
        "b_in": 0.1 * randn(3 * E),  # non-zero biases so the bias paths are checked too
        "w_out": rng.uniform(-bound_out, bound_out, (E, E)).astype(np.float32),
        "b_out": 0.1 * randn(E),
    }


# --------------------------------------------------------------------------------------------
# NumPy implementation (a peer, and in float64 the reference)
# --------------------------------------------------------------------------------------------


def causal_additive_mask(L: int, S: int, dtype) -> np.ndarray:
    """(L, S) float mask: 0 where key j <= query i (top-left aligned), -inf elsewhere."""
    mask = np.zeros((L, S), dtype=dtype)
    mask[np.triu_indices(L, k=1, m=S)] = -np.inf
    return mask


def numpy_sdpa(q, k, v, mask=None, softcap=None):
    """softmax(q @ k^T * scale + mask) @ v with matmul; normalises after the second matmul.
    With softcap, the scores are softcap * tanh(scores / softcap) before the mask."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = np.matmul(q * q.dtype.type(scale), np.swapaxes(k, -1, -2))
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if mask is not None:
        scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)
    out /= denom
    return out


def numpy_mha(x, w_in, b_in, w_out, b_out, num_heads, mask=None):
    """Self-attention MHA (batch_first): in-projection, sdpa per head, out-projection."""
    B, L, E = x.shape
    D = E // num_heads
    qkv = x @ w_in.T
    qkv += b_in
    qkv = qkv.reshape(B, L, 3, num_heads, D).transpose(2, 0, 3, 1, 4)  # (3, B, H, L, D)
    heads = numpy_sdpa(qkv[0], qkv[1], qkv[2], mask)
    merged = heads.transpose(0, 2, 1, 3).reshape(B, L, E)
    out = merged @ w_out.T
    out += b_out
    return out


def reference_output(shape: Shape, data: dict[str, np.ndarray], softcap: float | None = None) -> np.ndarray:
    """The float64 NumPy result every library is checked against (the soft cap: sdpa only)."""
    d64 = {name: a.astype(np.float64) for name, a in data.items()}
    mask = causal_additive_mask(shape.L, shape.S, np.float64) if shape.causal else None
    if shape.kind == "sdpa":
        return numpy_sdpa(d64["q"], d64["k"], d64["v"], mask, softcap)
    return numpy_mha(d64["x"], d64["w_in"], d64["b_in"], d64["w_out"], d64["b_out"], shape.H, mask)


# --------------------------------------------------------------------------------------------
# Library adapters: setup_<lib>(shape, data, threads) -> Bench
# --------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """A prepared library call: `run()` is timed; `to_numpy(run())` gives the canonical output
    ((B, H, L, D) for sdpa, (B, L, E) for mha) and is not timed."""

    run: Callable[[], Any]
    to_numpy: Callable[[Any], np.ndarray] = np.asarray
    note: str = ""


class NotInstalled(Exception):
    """The peer library cannot be imported."""


def import_optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise NotInstalled(str(exc)) from None


def setup_attnx(shape: Shape, data, threads: int, softcap: float | None = None) -> Bench:
    """attnx's call of a shape; with `softcap`, the sdpa shapes soft-cap their scores (ab.py's
    --after-softcap), and the multi-head ones, which have no soft cap, run as they are."""
    import attnx

    attnx.set_num_threads(threads)
    if shape.kind == "sdpa":
        q, k, v = data["q"], data["k"], data["v"]
        extra = {} if softcap is None else {"softcap": softcap}
        if shape.mask_given:
            mask = causal_additive_mask(shape.L, shape.S, np.float32)
            return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra))
        return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, **extra))
    x = data["x"]
    module_cls = getattr(attnx, "MultiheadAttention", None)
    if module_cls is not None:
        module = module_cls(shape.E, shape.H, batch_first=True, dtype=np.float32)
        module.load_state_dict(
            {
                "in_proj_weight": data["w_in"],
                "in_proj_bias": data["b_in"],
                "out_proj.weight": data["w_out"],
                "out_proj.bias": data["b_out"],
            }
        )
        return Bench(
            lambda: module(x, x, x, need_weights=False, is_causal=shape.causal)[0],
            note="attnx.MultiheadAttention",
        )
    args = (shape.E, shape.H, data["w_in"], data["b_in"], None, None, False, 0.0, data["w_out"], data["b_out"])
    return Bench(
        lambda: attnx.multi_head_attention_forward(
            x, x, x, *args, training=False, need_weights=False, is_causal=shape.causal, batch_first=True
        )[0],
        note="attnx.multi_head_attention_forward (attnx.MultiheadAttention not available)",
    )


def setup_numpy(shape: Shape, data, threads: int) -> Bench:
    mask = causal_additive_mask(shape.L, shape.S, np.float32) if shape.causal else None
    if shape.kind == "sdpa":
        q, k, v = data["q"], data["k"], data["v"]
        return Bench(lambda: numpy_sdpa(q, k, v, mask))
    d = data
    return Bench(lambda: numpy_mha(d["x"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], shape.H, mask))


def setup_torch(shape: Shape, data, threads: int) -> Bench:
    torch = import_optional("torch")
    torch.set_num_threads(threads)
    to_numpy = lambda t: t.numpy()  # noqa: E731
    if shape.kind == "sdpa":
        q, k, v = (torch.from_numpy(data[n]) for n in ("q", "k", "v"))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        mask = torch.from_numpy(causal_additive_mask(shape.L, shape.S, np.float32)) if shape.mask_given else None

        def run_sdpa():
            with torch.inference_mode():
                if mask is not None:
                    return sdpa(q, k, v, attn_mask=mask)
                return sdpa(q, k, v, is_causal=shape.causal)

        return Bench(run_sdpa, to_numpy, note="F.scaled_dot_product_attention, inference_mode")
    module = torch.nn.MultiheadAttention(shape.E, shape.H, batch_first=True)
    module.load_state_dict(
        {
            "in_proj_weight": torch.from_numpy(data["w_in"]),
            "in_proj_bias": torch.from_numpy(data["b_in"]),
            "out_proj.weight": torch.from_numpy(data["w_out"]),
            "out_proj.bias": torch.from_numpy(data["b_out"]),
        }
    )
    module.eval()
    x = torch.from_numpy(data["x"])
    mask = None
    if shape.causal:
        mask = torch.from_numpy(causal_additive_mask(shape.L, shape.S, np.float32))

    def run_mha():
        with torch.inference_mode():
            return module(x, x, x, need_weights=False, attn_mask=mask)[0]

    return Bench(run_mha, to_numpy, note="nn.MultiheadAttention eval(), inference_mode")


def _onnx_model_bytes(shape: Shape, data) -> bytes:
    """An in-memory ONNX model around com.microsoft MultiHeadAttention (BSH layout)."""
    onnx = import_optional("onnx")
    from onnx import TensorProto, helper, numpy_helper

    B, L, S, E = shape.B, shape.L, shape.S, shape.E
    attrs = {"num_heads": shape.H}
    if shape.causal and not shape.mask_given:
        attrs["unidirectional"] = 1
    f32 = TensorProto.FLOAT
    if shape.kind == "sdpa":
        inputs = [
            helper.make_tensor_value_info("query", f32, [B, L, E]),
            helper.make_tensor_value_info("key", f32, [B, S, E]),
            helper.make_tensor_value_info("value", f32, [B, S, E]),
        ]
        names = ["query", "key", "value"]
        if shape.mask_given:  # inputs 3, 4 (bias, key_padding_mask) absent; 5: attention_bias
            inputs.append(helper.make_tensor_value_info("attention_bias", f32, [1, 1, L, S]))
            names += ["", "", "attention_bias"]
        nodes = [helper.make_node("MultiHeadAttention", names, ["output"], domain="com.microsoft", **attrs)]
        initializers = []
    else:
        inputs = [helper.make_tensor_value_info("x", f32, [B, L, E])]
        initializers = [
            numpy_helper.from_array(np.ascontiguousarray(data["w_in"].T), "w_in_t"),
            numpy_helper.from_array(data["b_in"], "b_in"),
            numpy_helper.from_array(np.ascontiguousarray(data["w_out"].T), "w_out_t"),
            numpy_helper.from_array(data["b_out"], "b_out"),
            numpy_helper.from_array(np.array([E, E, E], dtype=np.int64), "split_sizes"),
        ]
        nodes = [
            helper.make_node("MatMul", ["x", "w_in_t"], ["qkv_mm"]),
            helper.make_node("Add", ["qkv_mm", "b_in"], ["qkv"]),
            helper.make_node("Split", ["qkv", "split_sizes"], ["q", "k", "v"], axis=2),
            helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["attn"], domain="com.microsoft", **attrs),
            helper.make_node("MatMul", ["attn", "w_out_t"], ["out_mm"]),
            helper.make_node("Add", ["out_mm", "b_out"], ["output"]),
        ]
    outputs = [helper.make_tensor_value_info("output", f32, [B, L, E])]
    graph = helper.make_graph(nodes, f"attnx_bench_{shape.name}", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _to_bsh(a: np.ndarray) -> np.ndarray:
    """(B, H, N, D) -> (B, N, H*D), contiguous."""
    B, H, N, D = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(B, N, H * D)


def setup_onnxruntime(shape: Shape, data, threads: int) -> Bench:
    ort = import_optional("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    session = ort.InferenceSession(_onnx_model_bytes(shape, data), options, providers=["CPUExecutionProvider"])

    if shape.kind == "sdpa":
        feeds = {"query": _to_bsh(data["q"]), "key": _to_bsh(data["k"]), "value": _to_bsh(data["v"])}
        if shape.mask_given:
            feeds["attention_bias"] = causal_additive_mask(shape.L, shape.S, np.float32)[None, None]
        B, H, L, D = shape.B, shape.H, shape.L, shape.D
        to_numpy = lambda out: out.reshape(B, L, H, D).transpose(0, 2, 1, 3)  # noqa: E731
        note = "com.microsoft.MultiHeadAttention" + (
            " attention_bias" if shape.mask_given else " unidirectional=1" if shape.causal else "")
    else:
        feeds = {"x": data["x"]}
        to_numpy = np.asarray
        note = "MatMul+Add, Split, com.microsoft.MultiHeadAttention, MatMul+Add"

    binding = session.io_binding()  # inputs bound once (zero-copy), as a server would
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("output")

    def run():
        assert feeds  # bound zero-copy: the arrays must live as long as the binding
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    return Bench(run, to_numpy, note=note)


def _openvino_ops():
    for name in ("openvino.opset13", "openvino.runtime.opset13"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NotInstalled("openvino.opset13 not found")


def _openvino_model(shape: Shape, data, ops, ov):
    """An ov.Model: opset13 ScaledDotProductAttention, with MatMul projections for mha."""
    B, H, L, S, D, E = shape.B, shape.H, shape.L, shape.S, shape.D, shape.E
    f32 = ov.Type.f32
    if shape.kind == "sdpa":
        params = [
            ops.parameter([B, H, L, D], f32, name="q"),
            ops.parameter([B, H, S, D], f32, name="k"),
            ops.parameter([B, H, S, D], f32, name="v"),
        ]
        if shape.mask_given:
            params.append(ops.parameter([L, S], f32, name="mask"))
            out = ops.scaled_dot_product_attention(*params, causal=False)
            return ov.Model([out], params, f"sdpa_{shape.name}")
        out = ops.scaled_dot_product_attention(*params, causal=shape.causal)
        return ov.Model([out], params, f"sdpa_{shape.name}")
    x = ops.parameter([B, L, E], f32, name="x")
    qkv = ops.add(ops.matmul(x, ops.constant(data["w_in"]), False, True), ops.constant(data["b_in"]))
    parts = ops.split(qkv, ops.constant(np.int64(2)), 3).outputs()

    def to_heads(t):
        t = ops.reshape(t, ops.constant(np.array([B, L, H, D], dtype=np.int64)), False)
        return ops.transpose(t, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64)))

    attn = ops.scaled_dot_product_attention(*(to_heads(p) for p in parts), causal=shape.causal)
    attn = ops.transpose(attn, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64)))
    attn = ops.reshape(attn, ops.constant(np.array([B, L, E], dtype=np.int64)), False)
    out = ops.add(ops.matmul(attn, ops.constant(data["w_out"]), False, True), ops.constant(data["b_out"]))
    return ov.Model([out], [x], f"mha_{shape.name}")


def setup_openvino(shape: Shape, data, threads: int) -> Bench:
    ov = import_optional("openvino")
    ops = _openvino_ops()
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "f32",
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "ENABLE_CPU_PINNING": False,  # pinning would also pin this process's other threads
    }
    compiled = ov.Core().compile_model(_openvino_model(shape, data, ops, ov), "CPU", config)
    request = compiled.create_infer_request()
    names = ("q", "k", "v") if shape.kind == "sdpa" else ("x",)
    inputs = [data[name] for name in names]
    if shape.mask_given:
        inputs.append(causal_additive_mask(shape.L, shape.S, np.float32))
    for i, array in enumerate(inputs):  # inputs bound once, sharing the NumPy memory
        request.set_input_tensor(i, ov.Tensor(array, shared_memory=True))

    def run():
        # The tensors share the arrays' memory and do not own it: `inputs` (the mask made
        # here among them) must live as long as the request.
        assert inputs
        request.infer()
        return request.get_output_tensor(0).data

    return Bench(run, lambda out: np.array(out, copy=True), note="opset13.ScaledDotProductAttention, f32 hint")


ADAPTERS: dict[str, Callable[[Shape, dict, int], Bench]] = {
    "attnx": setup_attnx,
    "numpy": setup_numpy,
    "torch": setup_torch,
    "onnxruntime": setup_onnxruntime,
    "openvino": setup_openvino,
}


def library_versions() -> dict[str, str | None]:
    """Versions of the libraries (None = not installed)."""
    versions: dict[str, str | None] = {}
    for name in (*LIBRARIES, "onnx"):
        try:
            versions[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except ImportError:
            versions[name] = None
    try:
        versions["numpy_blas"] = np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    except (AttributeError, KeyError, TypeError):
        versions["numpy_blas"] = "?"
    try:
        import attnx

        versions["attnx_config"] = json.dumps(attnx.show_config(), default=str)
    except ImportError:
        pass
    return versions


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


@contextmanager
def gc_paused():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_calls(run: Callable[[], Any], k: int) -> list[float]:
    """Per-call wall times (seconds) of `k` consecutive calls."""
    clock = time.perf_counter
    times = []
    for _ in range(k):
        t0 = clock()
        run()
        times.append(clock() - t0)
    return times


def calibrate(run: Callable[[], Any], block_seconds: float, max_calls: int = 2000) -> int:
    """Calls per block so that a block lasts about `block_seconds` (after a warm-up call)."""
    run()
    once = min(time_calls(run, 2))
    return max(1, min(max_calls, int(block_seconds / max(once, 1e-7))))


def run_block(run: Callable[[], Any], k: int, pause_s: float) -> list[float]:
    """One block: sleep `pause_s` (other runtimes' spinning threads go quiet), then time `k` calls."""
    time.sleep(pause_s)
    return time_calls(run, k)


def measure_interleaved(benches: dict[str, Bench], rounds: int, block_seconds: float, pause_s: float,
                        progress: Progress | None = None) -> dict:
    """Rounds of blocks, one block per library per round, rotating the order each round."""
    names = list(benches)
    calls = {}
    for name in names:
        time.sleep(pause_s)
        calls[name] = calibrate(benches[name].run, block_seconds)
    samples: dict[str, list[float]] = {name: [] for name in names}
    block_medians: dict[str, list[float]] = {name: [] for name in names}
    with gc_paused():
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                times = run_block(benches[name].run, calls[name], pause_s)
                samples[name].extend(times)
                block_medians[name].append(statistics.median(times))
            if progress is not None:
                progress.update()
    return {name: summarize(samples[name], block_medians[name], calls[name]) for name in names}


def summarize(times: list[float], block_medians: list[float], calls_per_block: int) -> dict:
    ordered = sorted(times)
    pick = lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))]  # noqa: E731
    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "min_ms": 1e3 * ordered[0],
        "p10_ms": 1e3 * pick(0.10),
        "p90_ms": 1e3 * pick(0.90),
        "calls": len(ordered),
        "calls_per_block": calls_per_block,
        "block_medians_ms": [1e3 * t for t in block_medians],
    }


# --------------------------------------------------------------------------------------------
# Machine peaks
# --------------------------------------------------------------------------------------------


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    return min(time_calls(fn, repeats))


def measure_gemm_peak(threads: int, n: int, repeats: int) -> dict:
    """Achievable FP32 GEMM GFLOP/s: an n x n x n float32 matmul, best of `repeats`."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    flops = 2.0 * n**3
    rates = {"numpy": flops / best_time(lambda: a @ b, repeats) / 1e9}
    try:
        torch = import_optional("torch")
        torch.set_num_threads(threads)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        rates["torch"] = flops / best_time(lambda: torch.mm(ta, tb), repeats) / 1e9
    except NotInstalled:
        pass
    by = max(rates, key=rates.get)
    return {"gflops": rates[by], "by": by, "n": n, "all": rates}


def measure_fma_peak(threads: int, repeats: int = 5) -> dict:
    """FP32 multiply-add GFLOP/s of attnx's active kernel on `threads` threads, in registers
    only (no memory traffic): the best of `repeats` runs of attnx._core.fma_peak."""
    import attnx
    from attnx import _core

    rate = max(_core.fma_peak(threads, 0.2) for _ in range(repeats))
    return {"gflops": rate, "by": f"measured, attnx {attnx.show_config()['isa']} kernel"}


def measure_read_bandwidth(threads: int, mib: float, repeats: int) -> dict:
    """Memory read GB/s over a `mib` MiB float32 array: the best of a few reductions
    (NumPy max, BLAS sdot of the array with itself, torch sum on `threads` threads),
    each the best of `repeats` passes."""
    a = np.ones(int(mib * 2**20) // 4, dtype=np.float32)
    kernels = {"numpy max": lambda: a.max(), "numpy dot": lambda: np.dot(a, a)}
    try:
        torch = import_optional("torch")
        torch.set_num_threads(threads)
        ta = torch.from_numpy(a)
        kernels["torch sum"] = lambda: ta.sum()
    except NotInstalled:
        pass
    rates = {name: a.nbytes / best_time(fn, repeats) / 1e9 for name, fn in kernels.items()}
    by = max(rates, key=rates.get)
    return {"gbs": rates[by], "by": by, "mib": mib, "all": rates}


# --------------------------------------------------------------------------------------------
# Worker: one thread count
# --------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_output(got: np.ndarray, ref: np.ndarray) -> dict:
    """Max abs difference from the float64 reference; ok when within float32 round-off."""
    got = np.asarray(got)
    if got.shape != ref.shape:
        return {"max_abs_diff": None, "ok": False, "problem": f"shape {got.shape} != {ref.shape}"}
    diff = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    tol = 2e-4 * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    return {"max_abs_diff": diff, "ok": bool(diff <= tol)}  # NaN compares False -> not ok


def bench_shape(shape: Shape, libs: list[str], threads: int, opts, progress: Progress | None = None) -> dict:
    """Set up every library for `shape`, check outputs, time them interleaved."""
    data = make_inputs(shape)
    reference = reference_output(shape, data)
    status: dict[str, dict] = {}
    benches: dict[str, Bench] = {}
    for name in libs:
        try:
            bench = ADAPTERS[name](shape, data, threads)
            check = check_output(bench.to_numpy(bench.run()), reference)
            status[name] = {"status": "ok", "note": bench.note, **check}
            benches[name] = bench
        except NotInstalled as exc:
            status[name] = {"status": "not installed", "note": str(exc)}
        except Exception as exc:  # a peer's set-up problem is reported, not fatal
            status[name] = {"status": "error", "note": f"{type(exc).__name__}: {exc}"}
            if name == "attnx":
                raise
        if status[name]["status"] == "ok" and not status[name]["ok"]:
            log(f"  WARNING: {name} output differs from the reference by {status[name]['max_abs_diff']}")
    timings = measure_interleaved(benches, opts.rounds, opts.block_seconds, opts.pause_ms / 1e3, progress)
    for name, t in timings.items():
        status[name].update(t)
        status[name]["gflops"] = shape.flops / (t["median_ms"] / 1e3) / 1e9
    return {
        "shape": {"name": shape.name, "label": shape.label, "kind": shape.kind, "B": shape.B, "H": shape.H,
                  "L": shape.L, "S": shape.S, "D": shape.D, "E": shape.E, "causal": shape.causal,
                  "mask_given": shape.mask_given},
        "flops": shape.flops,
        "bytes_kv": shape.bytes_kv,
        "memory_bound": shape.memory_bound,
        "libs": status,
    }


def add_comparisons(result: dict, peaks: dict) -> None:
    """Best peer, speed-up and attnx's fraction of the machine's peak."""
    libs = result["libs"]
    attnx_ms = libs["attnx"]["median_ms"]
    valid = {n: s["median_ms"] for n, s in libs.items() if n != "attnx" and s.get("ok") and "median_ms" in s}
    best = min(valid, key=valid.get) if valid else None
    result["best_peer"] = best
    result["speedup"] = valid[best] / attnx_ms if best else None
    result["speedup_per_round"] = None
    if best:
        pairs = zip(libs[best]["block_medians_ms"], libs["attnx"]["block_medians_ms"])
        result["speedup_per_round"] = statistics.median(peer / own for peer, own in pairs)
    attnx_gflops = libs["attnx"]["gflops"]
    result["attnx_gflops"] = attnx_gflops
    result["attnx_fraction_of_fma_peak"] = attnx_gflops / peaks["fma"]["gflops"]
    result["attnx_fraction_of_gemm_peak"] = attnx_gflops / peaks["gemm"]["gflops"]
    gbs = result["bytes_kv"] / (attnx_ms / 1e3) / 1e9
    result["attnx_read_gbs"] = gbs
    result["attnx_fraction_of_read_bw"] = gbs / peaks["read_bandwidth"]["gbs"]
    same_size = peaks["working_set_bandwidth"].get(result["shape"]["name"])
    if same_size is not None:
        result["attnx_fraction_of_working_set_bw"] = gbs / same_size["gbs"]
    if result["memory_bound"]:
        # K and V are re-read on every call, so they stay in whichever cache level holds them:
        # the roof is the read bandwidth measured over an array of the same size.
        result["fraction_kind"] = "read bandwidth at the K+V size"
        result["attnx_fraction_of_peak"] = result.get("attnx_fraction_of_working_set_bw",
                                                      result["attnx_fraction_of_read_bw"])
    else:
        result["fraction_kind"] = "FMA peak"
        result["attnx_fraction_of_peak"] = result["attnx_fraction_of_fma_peak"]


def cpu_busy_seconds() -> float | None:
    """Machine-wide non-idle CPU seconds since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


class BackgroundLoad:
    """The share of the machine's CPU time that other processes used between start and stop,
    so that a run disturbed by other work on the machine can be recognised."""

    def __init__(self):
        self.wall, self.busy, self.own = time.perf_counter(), cpu_busy_seconds(), sum(os.times()[:2])

    def fraction(self) -> float | None:
        busy = cpu_busy_seconds()
        if busy is None or self.busy is None:
            return None
        others = (busy - self.busy) - (sum(os.times()[:2]) - self.own)
        capacity = (time.perf_counter() - self.wall) * (os.cpu_count() or 1)
        return max(0.0, others / capacity)


def run_worker(threads: int, opts) -> dict:
    """Everything for one thread count; returns a JSON-able dict."""
    cores = os.cpu_count() or 1
    libs = [name for name in LIBRARIES if name in opts.libs]
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    shapes = sweep_shapes(opts.sweep_lengths) if opts.sweep else select_shapes(opts.shapes)
    load = BackgroundLoad()
    log(f"[threads={threads}] measuring machine peaks ...")
    gemm_n, reps = (1536, 3) if opts.quick else (2048, 5)
    peaks = {
        "fma": (measure_fma_peak(threads) if opts.peak_gflops is None else
                {"gflops": opts.peak_gflops * threads / cores, "by": "--peak-gflops"}),
        "gemm": measure_gemm_peak(threads, gemm_n, reps),
        "read_bandwidth": measure_read_bandwidth(threads, 512, reps),
        "working_set_bandwidth": {
            s.name: measure_read_bandwidth(threads, s.bytes_kv / 2**20, 3 * reps) for s in shapes if s.memory_bound
        },
    }
    results = []
    with Progress(len(shapes) * opts.rounds, f"threads={threads}", unit="round",
                  enabled=not opts.no_progress) as progress:
        for shape in shapes:
            progress.write(f"[threads={threads}] {shape.label} ...")
            result = bench_shape(shape, libs, threads, opts, progress)
            add_comparisons(result, peaks)
            results.append(result)
    if affinity is not None and sorted(os.sched_getaffinity(0)) != affinity:
        log(f"WARNING: a library changed this process's CPU affinity to {sorted(os.sched_getaffinity(0))}")
    return {"threads": threads, "peaks": peaks, "results": results, "background_cpu_fraction": load.fraction()}


# --------------------------------------------------------------------------------------------
# Driver: one subprocess per thread count, then the report
# --------------------------------------------------------------------------------------------


cpu_model = results_file.cpu_model


def worker_argv(threads: int, out_path: str, opts) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(threads), "--worker-out", out_path,
            "--rounds", str(opts.rounds), "--block-seconds", str(opts.block_seconds),
            "--pause-ms", str(opts.pause_ms), "--libs", *opts.libs]
    if opts.peak_gflops is not None:
        argv += ["--peak-gflops", str(opts.peak_gflops)]
    if opts.shapes:
        argv += ["--shapes", *opts.shapes]
    if opts.quick:
        argv.append("--quick")
    if opts.sweep:
        argv += ["--sweep", "--sweep-lengths", *map(str, opts.sweep_lengths)]
    if opts.no_progress:
        argv.append("--no-progress")
    return argv


def wait_for_quiet_machine(max_wait_s: float, threshold: float = 0.10, window_s: float = 2.0) -> float | None:
    """Wait (up to `max_wait_s`) until other processes use less than `threshold` of the CPUs
    over a `window_s` window; returns the last measured share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        load = BackgroundLoad()
        time.sleep(window_s)
        share = load.fraction()
        if share is None or share < threshold or time.monotonic() >= deadline:
            return share
        log(f"machine busy ({100 * share:.0f}% of its CPU time used by other processes), waiting ...")


def run_thread_count(threads: int, opts) -> dict:
    """Run the worker for `threads` in a fresh interpreter with clean thread settings."""
    if opts.wait_quiet > 0:
        wait_for_quiet_machine(opts.wait_quiet)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        env = {**os.environ, **thread_env(threads)}
        proc = subprocess.run(worker_argv(threads, out_path, opts), env=env)
        if proc.returncode != 0 or not os.path.exists(out_path):
            return {"threads": threads, "error": f"worker exited with status {proc.returncode}"}
        with open(out_path) as f:
            return json.load(f)


def fmt_ms(entry: dict) -> str:
    status = entry.get("status")
    if status != "ok":
        return status or "-"
    if "median_ms" not in entry:
        return "-"
    ms = entry["median_ms"]
    text = f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"
    return text if entry.get("ok") else f"{text} (wrong!)"


def markdown_table(run: dict) -> str:
    head = ["shape", "attnx ms", "numpy ms", "torch ms", "onnxruntime ms", "openvino ms",
            "best peer", "speed-up", "per round", "attnx GFLOP/s", "% of peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in run["results"]:
        libs = r["libs"]
        cells = [r["shape"]["label"]] + [fmt_ms(libs.get(n, {"status": "-"})) for n in LIBRARIES]
        cells.append(r["best_peer"] or "-")
        cells.append(f"{r['speedup']:.2f}x" if r["speedup"] else "-")
        per_round = r.get("speedup_per_round")
        cells.append(f"{per_round:.2f}x" if per_round else "-")
        cells.append(f"{r['attnx_gflops']:.1f}")
        kind = "BW" if r["memory_bound"] else "FMA"
        cells.append(f"{100 * r['attnx_fraction_of_peak']:.1f}% {kind}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_table(run: dict) -> str:
    lines = ["| shape | " + " | ".join(LIBRARIES) + " |", "|---|" + "|".join("---" for _ in LIBRARIES) + "|"]
    for r in run["results"]:
        cells = []
        for name in LIBRARIES:
            e = r["libs"].get(name, {})
            if e.get("status") != "ok":
                cells.append(e.get("status", "-"))
            else:
                cells.append(f"{e['max_abs_diff']:.1e}" + ("" if e["ok"] else " MISMATCH"))
        lines.append(f"| {r['shape']['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_report(report: dict) -> None:
    m = report["machine"]
    v = report["versions"]
    print(f"\n# attnx benchmark — {m['cpu_model']}, {m['cores']} cores, {m['platform']}")
    print("versions: " + ", ".join(f"{n} {v[n] or 'not installed'}" for n in (*LIBRARIES, "onnx")))
    print(f"numpy BLAS: {v.get('numpy_blas')}; attnx config: {v.get('attnx_config')}")
    c = report["config"]
    print(f"method: {c['rounds']} interleaved rounds, blocks of ~{c['block_seconds']} s per library, "
          f"{c['pause_ms']} ms pause between libraries, median per-call time; float32.")
    print("FLOPs: sdpa 4*B*H*L*S*D (causal: the computed half, 2*B*H*L*S*D); MHA adds 8*B*L*E^2. "
          "speed-up = best peer's median / attnx's (> 1: attnx faster); per round = the median over "
          "rounds of the same ratio of block medians.")
    for run in report["runs"]:
        print(f"\n## {run['threads']} thread(s)\n")
        if "error" in run:
            print(f"worker failed: {run['error']}")
            continue
        p = run["peaks"]
        fma_source = (f"--peak-gflops scaled to {run['threads']} thread(s)" if p["fma"]["by"] == "--peak-gflops"
                      else f"{p['fma']['by']}, register-only multiply-adds on {run['threads']} thread(s)")
        print(f"Peaks: FMA {p['fma']['gflops']:.0f} GFLOP/s ({fma_source}); achievable GEMM {p['gemm']['gflops']:.1f} GFLOP/s "
              f"({p['gemm']['by']}, {p['gemm']['n']}^3 float32 matmul); read bandwidth "
              f"{p['read_bandwidth']['gbs']:.1f} GB/s ({p['read_bandwidth']['by']} over "
              f"{p['read_bandwidth']['mib']} MiB)", end="")
        for name, bw in p["working_set_bandwidth"].items():
            print(f"; read bandwidth over {bw['mib']:.0f} MiB (the K+V of {name}) {bw['gbs']:.1f} GB/s "
                  f"({bw['by']})", end="")
        print(".\n")
        print(markdown_table(run))
        background = run.get("background_cpu_fraction")
        if background is not None:
            warn = " — WARNING: other work on the machine may have disturbed these timings" if background > 0.05 else ""
            print(f"\nOther processes used {100 * background:.1f}% of the machine's CPU time during this run{warn}.")
        print("\n% of peak: FMA = attnx GFLOP/s / the FMA peak above; BW = attnx's K+V bytes per second / "
              "the read bandwidth measured over an array of the K+V size.")
        for r in run["results"]:
            if r["memory_bound"]:
                print(f"{r['shape']['name']}: attnx reads K+V at {r['attnx_read_gbs']:.1f} GB/s = "
                      f"{100 * r['attnx_fraction_of_read_bw']:.0f}% of the {p['read_bandwidth']['mib']} MiB "
                      f"(DRAM) read bandwidth.")
        gemm = ", ".join(f"{r['shape']['name']} {100 * r['attnx_fraction_of_gemm_peak']:.1f}%"
                         for r in run["results"] if not r["memory_bound"])
        print(f"attnx vs achievable GEMM rate: {gemm}")
        print("\nmax |output - float64 reference|:\n")
        print(accuracy_table(run))
        notes = {}
        for r in run["results"]:
            for name, e in r["libs"].items():
                if e.get("note") and e.get("status") == "ok":
                    notes.setdefault(name, set()).add(e["note"])
                elif e.get("status") == "error":
                    print(f"- {name} on {r['shape']['label']}: {e['note']}")
        for name, ns in notes.items():
            print(f"- {name}: {'; '.join(sorted(ns))}")


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help="thread counts, each run in its own subprocess (default: 1 and the core count)")
    p.add_argument("--shapes", nargs="+", help="shapes by number (1-7) or name: "
                   + ", ".join(f"{i}={s.name}" for i, s in enumerate(SHAPES, 1))
                   + "; named only: " + ", ".join(s.name for s in EXTRA_SHAPES))
    p.add_argument("--libs", nargs="+", default=list(LIBRARIES), choices=LIBRARIES,
                   help="libraries to run (attnx is always run)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 7, --quick 2)")
    p.add_argument("--block-seconds", type=float, help="target length of one block (default 0.25, --quick 0.05)")
    p.add_argument("--pause-ms", type=float, default=30.0, help="sleep before each block (default 30)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="FP32 FMA peak of all cores, scaled by threads/cores (default: measured on each thread "
                        "count with attnx's register-only multiply-add probe)")
    p.add_argument("--out", "--json", dest="out", metavar="PATH",
                   help="results file (default: benchmarks/results/DATE-MACHINE-COMMIT.json; --quick runs are "
                        "saved only when this is given)")
    p.add_argument("--section", help="key of the results file to write (default: compare, or sweep with --sweep)")
    p.add_argument("--no-save", action="store_true", help="print the report only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sweep", action="store_true",
                   help="time against sequence length: sdpa B1 H12 D64, L = S over --sweep-lengths")
    p.add_argument("--sweep-lengths", type=int, nargs="+", default=list(SWEEP_LENGTHS), metavar="L",
                   help=f"lengths for --sweep (default {' '.join(map(str, SWEEP_LENGTHS))})")
    p.add_argument("--quick", action="store_true", help="a fast smoke run (fewer rounds, shorter blocks)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each thread count, wait up to SECONDS for other processes to leave the CPUs idle")
    p.add_argument(WORKER_FLAG, type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.rounds is None:
        opts.rounds = 2 if opts.quick else 7
    if opts.block_seconds is None:
        opts.block_seconds = 0.05 if opts.quick else 0.25
    if "attnx" not in opts.libs:
        opts.libs = ["attnx", *opts.libs]
    if opts.shapes:
        select_shapes(opts.shapes)  # validate early
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker is not None:
        result = run_worker(opts.worker, opts)
        with open(opts.worker_out, "w") as f:
            json.dump(result, f)
        return 0
    if opts.sweep and opts.quick and opts.sweep_lengths == list(SWEEP_LENGTHS):
        opts.sweep_lengths = [64, 128]
    report = {
        "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "versions": library_versions(),
        "config": {"rounds": opts.rounds, "block_seconds": opts.block_seconds, "pause_ms": opts.pause_ms,
                   "peak_gflops_all_cores": opts.peak_gflops, "quick": opts.quick, "threads": opts.threads,
                   "sweep_lengths": opts.sweep_lengths if opts.sweep else None},
        "runs": [run_thread_count(n, opts) for n in opts.threads],
    }
    print_report(report)
    if not opts.no_save and (opts.out or not opts.quick):
        section = opts.section or ("sweep" if opts.sweep else "compare")
        path = results_file.write_section(section, report, opts.out)
        print(f"\nwrote the {section!r} section of {path}")
    return 0 if all("error" not in run for run in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
