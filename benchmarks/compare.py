#!/usr/bin/env python3
"""Benchmark attnx against NumPy, PyTorch, ONNX Runtime and OpenVINO on the CPU.

Usage (from a checkout, after ``pip install .``; the installed attnx is the one timed)::

    python benchmarks/compare.py --quick                # smoke run, nothing saved
    python benchmarks/compare.py                        # full run, saved under benchmarks/results/
    python benchmarks/compare.py --sweep                # time against sequence length, same file
    python benchmarks/compare.py --threads 2 --shapes l1024 --out run.json
    python benchmarks/compare.py --shapes encoder-layer encoder-stack decoder-step
    python benchmarks/compare.py --shapes varlen-b8-l128 varlen-causal-b8-l128 encoder-layer-ragged
    python benchmarks/compare.py --precision bfloat16 --shapes b8-l128 l1024 causal-l2048 d128-l2048 mha-e768

Results go to ``benchmarks/results/MACHINE.json`` (see results_file.py): the
``compare`` section for the shapes, ``sweep`` for ``--sweep``, ``transformer`` for a run of the
transformer layers only and ``ragged`` for a run of the ragged cases only (so that neither
replaces the shapes' section), and the same names suffixed ``-bfloat16`` for ``--precision
bfloat16``. ``--out`` names another file.

``--precision bfloat16`` compares bfloat16 inference: attnx with ``precision="bfloat16"``, torch
on bfloat16 tensors and modules (``.to(torch.bfloat16)``), OpenVINO with its default inference
precision (bfloat16 on CPUs with AVX512_BF16 or AMX; the precision it chose is recorded). NumPy
and ONNX Runtime (whose CPU provider runs these models in float32) sit that comparison out. The
outputs are checked against the float64 reference with a bfloat16 tolerance, and the fraction of
the peak is still that of the float32 FMA peak (bfloat16 products can exceed 1).

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

Transformer layers (``encoder-layer``, ``encoder-stack``, ``decoder-step``, named only)
--------------------------------------------------------------------------------------
* attnx's ``TransformerEncoderLayer`` / ``TransformerEncoder`` / ``TransformerDecoder`` and
  torch's modules load one float32 state dict (torch's keys; random biases and norms) and run in
  ``eval()``; torch under ``inference_mode`` (its fused fast path for the encoders). ONNX Runtime
  and OpenVINO run the torch module exported with ``torch.onnx.export(dynamo=False)``; a failed
  export or an exported model whose output disagrees with the reference is reported as
  "unavailable" with the reason. NumPy has no transformer peer ("n/a").
* A padded encoder's outputs are compared at the non-padded positions only (torch's fast path
  leaves the padded ones undefined).
* The decoder step: attnx's ``step`` over a cache filled with the S cached tokens, against
  "torch-recompute" (the decoder over all S + T tokens with a causal mask, the last T positions)
  and "torch-cached" (TorchCachedDecoder: a loop on the module's weights that caches keys and
  values in torch tensors). The caches are put back to S tokens before every call, untimed
  (``Bench.reset``). attnx's speed-up over every peer is in ``speedups``.
* FLOPs: an encoder layer ``2*B*L*(4*E^2 + 2*E*ff) + 4*B*L^2*E`` (padding not discounted), times
  the layers; a decoder step of T tokens, per layer ``2*B*T*(6*E^2 + 2*E*ff) +
  4*B*T*(S + T + M)*E``, times the layers (the memory's K/V projections are made once per cache).
  The step is memory-bound: its fraction is of the read bandwidth, over the bytes of those weights
  and both attentions' K/V.

Ragged batches (``varlen-b8-l128``, ``varlen-causal-b8-l128``, ``encoder-layer-ragged``, named only)
----------------------------------------------------------------------------------------------------
Eight sequences of 128, 112, ..., 16 tokens (``L - i*L/B``), self-attention, H12 D64 (d768):

* ``varlen-*``: attnx runs ``attnx.varlen_attention`` on the sequences packed along the first
  axis (``(tokens, H, D)``, flash-attn's ``cu_seqlens``), causal per sequence where the shape
  is. The peers run the equivalent padded ``(8, 12, 128, 64)`` batch with a key padding mask:
  NumPy (``numpy_sdpa`` with an additive 0 / -inf mask), torch (``F.scaled_dot_product_attention``
  with a bool mask, True = may attend, ``(B, 1, 1, S)``; for the causal shape the mask is the
  combined ``(B, 1, L, S)`` one, since torch cannot combine ``is_causal`` with ``attn_mask``) and
  "attnx-padded" (``attnx.scaled_dot_product_attention`` on the padded batch with the same bool
  mask). ONNX Runtime and OpenVINO have no model here ("n/a"). The padded outputs are packed to
  the real rows, and every output is compared with the float64 reference of each sequence alone.
* ``encoder-layer-ragged``: the ``encoder-layer`` case (B8 L128 d768 h12 ff3072 gelu, post-norm,
  batch_first) over these lengths. attnx runs its ``TransformerEncoderLayer`` with
  ``src_key_padding_mask``; "torch" is ``nn.TransformerEncoder(layer, num_layers=1,
  enable_nested_tensor=True)`` in ``eval()`` under ``inference_mode`` (torch's padding-free
  nested-tensor path; when torch does not take it, which gives exactly 0 at the padded
  positions, the peer is "unavailable" with the reason); ONNX Runtime and OpenVINO run the
  exported layer as for ``encoder-layer``; "attnx-full" is attnx's same layer on the full batch
  without a mask (the dense batch's time), checked against that batch's own reference. The
  others are compared at the real positions only.
* "attnx-padded" and "attnx-full" are attnx's own baselines: their columns show attnx's time
  with the padding computed, and attnx's speed-up over them (``speedups``, the speed-up line) is
  what skipping the padding gains; they never count as the best peer.
* FLOPs count the real work only, the same figure for every library: varlen the sum over the
  sequences of ``4*H*n^2*D`` (halved where causal); the ragged layer ``2*T*(4*E^2 + 2*E*ff) +
  4*sum(n^2)*E`` over its T real tokens.

Peers that are not installed are reported as "not installed", never as an error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# timing comes first: it sets the thread variables of a worker before NumPy is imported.
from timing import (  # noqa: E402  (benchmarks/timing.py)
    WORKER_FLAG,
    BackgroundLoad,
    log,
    measure_fma_peak,
    measure_gemm_peak,
    measure_interleaved,
    measure_read_bandwidth,
    thread_env,
    wait_for_quiet_machine,
)
import results_file  # noqa: E402  (benchmarks/results_file.py)
from peers import (  # noqa: E402  (benchmarks/peers.py)
    LIBRARIES,
    PEER_VARIANTS,
    library_versions,
    prepare_benches,
)
from progress import Progress  # noqa: E402  (benchmarks/progress.py)
from report import print_report  # noqa: E402  (benchmarks/report.py)
from shapes import (  # noqa: E402  (benchmarks/shapes.py)
    EXTRA_SHAPES,
    LAYER_KINDS,
    LAYER_SHAPES,
    RAGGED_SHAPES,
    SHAPES,
    SWEEP_LENGTHS,
    Shape,
    describe,
    select_shapes,
    sweep_shapes,
)


def bench_shape(shape: Shape, libs: list[str], threads: int, opts, progress: Progress | None = None) -> dict:
    """Set up every library for `shape`, check outputs, time them interleaved."""
    status, benches = prepare_benches(shape, libs, threads, opts.precision)
    timings = measure_interleaved(benches, opts.rounds, opts.block_seconds, opts.pause_ms / 1e3, progress)
    for name, t in timings.items():
        status[name].update(t)
        status[name]["gflops"] = shape.flops / (t["median_ms"] / 1e3) / 1e9
    return {
        "shape": describe(shape),
        "flops": shape.flops,
        "bytes_kv": shape.bytes_kv,
        "bytes_of": shape.bytes_of,
        "memory_bound": shape.memory_bound,
        "libs": status,
    }


def add_comparisons(result: dict, peaks: dict) -> None:
    """Best peer, speed-up and attnx's fraction of the machine's peak. attnx's own baselines of
    the ragged cases ("attnx-padded", "attnx-full") have their speed-up in `speedups` but are
    never the best peer."""
    libs = result["libs"]
    attnx_ms = libs["attnx"]["median_ms"]
    valid = {n: s["median_ms"] for n, s in libs.items() if n != "attnx" and s.get("ok") and "median_ms" in s}
    peers = [n for n in valid if n not in PEER_VARIANTS["attnx"]]
    best = min(peers, key=valid.get) if peers else None
    result["best_peer"] = best
    result["speedup"] = valid[best] / attnx_ms if best else None
    # attnx's speed-up over every correct peer: pooled medians, and per round.
    result["speedups"] = {}
    for peer, ms in valid.items():
        pairs = zip(libs[peer]["block_medians_ms"], libs["attnx"]["block_medians_ms"])
        result["speedups"][peer] = {"speedup": ms / attnx_ms,
                                    "per_round": statistics.median(p / own for p, own in pairs)}
    result["speedup_per_round"] = result["speedups"][best]["per_round"] if best else None
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
            s.name: {**measure_read_bandwidth(threads, s.bytes_kv / 2**20, 3 * reps), "of": s.bytes_of}
            for s in shapes if s.memory_bound
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
            "--pause-ms", str(opts.pause_ms), "--libs", *opts.libs, "--precision", opts.precision]
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


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help="thread counts, each run in its own subprocess (default: 1 and the core count)")
    p.add_argument("--shapes", nargs="+", help="shapes by number (1-7) or name: "
                   + ", ".join(f"{i}={s.name}" for i, s in enumerate(SHAPES, 1))
                   + "; named only: " + ", ".join(s.name for s in EXTRA_SHAPES)
                   + "; transformer layers (named only): " + ", ".join(s.name for s in LAYER_SHAPES)
                   + "; ragged batches (named only): " + ", ".join(s.name for s in RAGGED_SHAPES))
    p.add_argument("--libs", nargs="+", default=list(LIBRARIES), choices=LIBRARIES,
                   help="libraries to run (attnx is always run)")
    p.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                   help="the precision compared (default float32; bfloat16: see the module's docstring)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 7, --quick 2)")
    p.add_argument("--block-seconds", type=float, help="target length of one block (default 0.25, --quick 0.05)")
    p.add_argument("--pause-ms", type=float, default=30.0, help="sleep before each block (default 30)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="FP32 FMA peak of all cores, scaled by threads/cores (default: measured on each thread "
                        "count with attnx's register-only multiply-add probe)")
    p.add_argument("--out", "--json", dest="out", metavar="PATH",
                   help="results file (default: benchmarks/results/MACHINE.json; --quick runs are "
                        "saved only when this is given)")
    p.add_argument("--section", help="key of the results file to write (default: compare; sweep with --sweep; "
                                     "ragged when every shape is a ragged case; transformer when every shape "
                                     "is a transformer layer)")
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


def default_section(opts) -> str:
    """The results file's section a run writes: "sweep" for --sweep, "ragged" when every shape
    is a ragged case, "transformer" when every shape is a transformer layer (their own sections:
    a run of them alone must not replace the shapes'), else "compare"; suffixed "-bfloat16" for
    --precision bfloat16."""
    suffix = "" if opts.precision == "float32" else f"-{opts.precision}"
    if opts.sweep:
        return "sweep" + suffix
    if opts.shapes and all(s.ragged for s in select_shapes(opts.shapes)):
        return "ragged" + suffix
    if opts.shapes and all(s.kind in LAYER_KINDS for s in select_shapes(opts.shapes)):
        return "transformer" + suffix
    return "compare" + suffix


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
                   "sweep_lengths": opts.sweep_lengths if opts.sweep else None,
                   "precision": opts.precision},
        "runs": [run_thread_count(n, opts) for n in opts.threads],
    }
    print_report(report)
    if not opts.no_save and (opts.out or not opts.quick):
        section = opts.section or default_section(opts)
        path = results_file.write_section(section, report, opts.out)
        print(f"\nwrote the {section!r} section of {path}")
    return 0 if all("error" not in run for run in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
