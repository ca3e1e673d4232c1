#!/usr/bin/env python3
"""Latency beside busy processes: p50 and p99 of single calls, on a quiet machine and with k busy processes.

Usage (from a checkout, after ``pip install .``; the installed attnx is the one timed)::

    python benchmarks/contention.py --quick              # smoke run, nothing saved
    python benchmarks/contention.py                      # 1 thread and all cores, 0 .. cores-1 busy processes
    python benchmarks/contention.py --threads 1 2 --busy 0 1 --shapes decode-s2048 tiny --libs attnx
    python benchmarks/contention.py --seconds 5 --out run.json

Results go to the ``contention`` section of ``benchmarks/results/MACHINE.json`` (see
results_file.py); ``--out`` names another file, ``--no-save`` prints only, and ``--quick`` runs
are saved only when ``--out`` is given. ``report.py`` prints the tables again and ``plot.py``
draws them.

Method
------
* **Cases.** compare.py's shapes and transformer layers (shapes.py), by default
  ``decode-s2048`` (sdpa decode B1 H32 S2048 D128), ``b8-l128`` (sdpa B8 H12 L128 D64),
  ``mha-e768`` (MHA B8 L128 E768) and ``encoder-layer`` (encoder layer B8 L128 d768); attnx and
  torch set up as compare.py sets them up (peers.py), each output checked against the float64
  reference before it is timed. torch is optional ("not installed").
* **One process per thread count.** As in compare.py: the script starts itself once per
  ``--threads`` count with the OpenMP / BLAS thread variables set (timing.py's ``thread_env``),
  and each library is told the count through its own API.
* **Busy processes.** A busy process is a separate Python process spinning a pure-Python loop
  at 100% of one core (timing.py's ``BusyProcesses``). For each case and each ``--busy`` count k,
  k of them are started, the libraries warm up and are timed, and the k processes are killed
  before the next case is set up: they run during the timing only. k = 0 is the quiet machine.
  The share of the CPU time that other processes (the busy ones included) used while timing is
  recorded with each cell.
* **Single calls.** Every call is timed on its own with ``time.perf_counter``; p50, p99, mean,
  min and max are over those individual calls. A cell (case, library, threads, k) gets
  ``--calls`` calls, or as many as fill ``--seconds`` at the rate of its warm-up (at least 200;
  ``--quick``: 0.3 s, at least 20). The libraries run interleaved in ``--rounds`` blocks each,
  the order rotating every round, with a ``--pause-ms`` sleep before each block (the previous
  library's spinning OpenMP threads go quiet), so that a drift of the machine hits both.
* **Ratios.** Under the same load, per case and library: the all-core p50 over the 1-thread
  p50, and the same of p99 (the highest ``--threads`` count over the lowest). Below 1 the extra
  threads help; above 1 they cost latency beside the busy processes.
"""

from __future__ import annotations

import argparse
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
from timing import (  # noqa: E402  (benchmarks/timing.py)
    WORKER_FLAG,
    BackgroundLoad,
    BusyProcesses,
    gc_paused,
    log,
    run_block,
    thread_env,
    time_calls,
)
import results_file  # noqa: E402  (benchmarks/results_file.py)
from peers import Bench, prepare_benches  # noqa: E402  (benchmarks/peers.py)
from progress import Progress  # noqa: E402  (benchmarks/progress.py)
from report import contention_report  # noqa: E402  (benchmarks/report.py)
from shapes import EXTRA_SHAPES, LAYER_SHAPES, SHAPES, describe, select_shapes  # noqa: E402

LIBRARIES = ("attnx", "torch")
DEFAULT_SHAPES = ("decode-s2048", "b8-l128", "mha-e768", "encoder-layer")


# --------------------------------------------------------------------------------------------
# Worker: one thread count
# --------------------------------------------------------------------------------------------


def percentile(ordered: list[float], p: float) -> float:
    """The nearest-rank `p` percentile (0 < p <= 100) of sorted values."""
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def latency_stats(times: list[float], calls_per_block: int) -> dict:
    ordered = sorted(times)
    return {
        "p50_ms": 1e3 * percentile(ordered, 50),
        "p99_ms": 1e3 * percentile(ordered, 99),
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "min_ms": 1e3 * ordered[0],
        "max_ms": 1e3 * ordered[-1],
        "calls": len(ordered),
        "calls_per_block": calls_per_block,
    }


def measure_latencies(benches: dict[str, Bench], busy: int, opts) -> dict:
    """Each bench's single-call latencies beside `busy` busy processes, which run from before
    the warm-up to the end of the timing. The calls of a bench are spread over `opts.rounds`
    blocks, one block per bench per round, the order rotating."""
    names = list(benches)
    pause_s = opts.pause_ms / 1e3
    samples: dict[str, list[float]] = {name: [] for name in names}
    per_block = {}
    with BusyProcesses(busy):
        for name in names:
            bench = benches[name]
            time.sleep(pause_s)
            time_calls(bench.run, 3, bench.reset)  # warm-up: caches, thread pools, the load's effect
            once = max(statistics.median(time_calls(bench.run, 3, bench.reset)), 1e-7)
            calls = opts.calls or max(opts.min_calls, math.ceil(opts.seconds / once))
            per_block[name] = max(1, math.ceil(calls / opts.rounds))
        load = BackgroundLoad()
        with gc_paused():
            for r in range(opts.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    bench = benches[name]
                    samples[name].extend(run_block(bench.run, per_block[name], pause_s, bench.reset))
        background = load.fraction()
    return {"busy": busy, "background_cpu_fraction": background,
            "libs": {name: latency_stats(samples[name], per_block[name]) for name in names}}


def run_worker(threads: int, opts) -> dict:
    """Every case, library and busy count for one thread count; returns a JSON-able dict."""
    shapes = select_shapes(opts.shapes)
    results = []
    with Progress(len(shapes) * len(opts.busy), f"threads={threads}", unit="cell",
                  enabled=not opts.no_progress) as progress:
        for shape in shapes:
            status, benches = prepare_benches(shape, opts.libs, threads)
            loads = []
            for busy in opts.busy:
                progress.write(f"[threads={threads}] {shape.label}, {busy} busy process(es) ...")
                loads.append(measure_latencies(benches, busy, opts) if benches else {"busy": busy, "libs": {}})
                progress.update()
            results.append({"shape": describe(shape), "libs": status, "loads": loads})
    return {"threads": threads, "results": results}


# --------------------------------------------------------------------------------------------
# Driver: one subprocess per thread count, then the report
# --------------------------------------------------------------------------------------------


def worker_argv(threads: int, out_path: str, opts) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(threads), "--worker-out", out_path,
            "--busy", *map(str, opts.busy), "--shapes", *opts.shapes, "--libs", *opts.libs,
            "--seconds", str(opts.seconds), "--rounds", str(opts.rounds), "--pause-ms", str(opts.pause_ms)]
    if opts.calls:
        argv += ["--calls", str(opts.calls)]
    if opts.quick:
        argv.append("--quick")
    if opts.no_progress:
        argv.append("--no-progress")
    return argv


def run_thread_count(threads: int, opts) -> dict:
    """The worker for `threads` in a fresh interpreter with the thread variables set."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        proc = subprocess.run(worker_argv(threads, out_path, opts), env={**os.environ, **thread_env(threads)})
        if proc.returncode != 0 or not os.path.exists(out_path):
            why = f"status {proc.returncode}"
            if proc.returncode < 0:
                why += f" ({signal.Signals(-proc.returncode).name})"
            return {"threads": threads, "error": f"worker exited with {why}"}
        with open(out_path) as f:
            return json.load(f)


def versions(libs: list[str]) -> dict[str, str | None]:
    """Installed versions of the libraries timed and of NumPy, read without importing them."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in ("attnx", "numpy", *libs):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help="thread counts, each run in its own subprocess (default: 1 and the core count)")
    p.add_argument("--busy", type=int, nargs="+", default=list(range(cores)), metavar="K",
                   help="numbers of busy processes beside the timing (default: 0 .. cores-1; 0 = quiet)")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                   help=f"compare.py's shapes by number or name (default: {' '.join(DEFAULT_SHAPES)}); e.g. "
                        + ", ".join(s.name for s in SHAPES + EXTRA_SHAPES + LAYER_SHAPES))
    p.add_argument("--libs", nargs="+", default=list(LIBRARIES), choices=LIBRARIES,
                   help="libraries to time (default: attnx torch; attnx is always run)")
    p.add_argument("--seconds", type=float, help="timing per cell (case, library, threads, load), default 3, --quick 0.3")
    p.add_argument("--calls", type=int, help="calls per cell instead of --seconds' worth")
    p.add_argument("--rounds", type=int, help="interleaved blocks per library and cell (default 10, --quick 4)")
    p.add_argument("--pause-ms", type=float, default=30.0, help="sleep before each block (default 30)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 0.3 s per cell, at least 20 calls")
    p.add_argument("--out", "--json", dest="out", metavar="PATH",
                   help="results file (default: benchmarks/results/MACHINE.json; --quick runs are "
                        "saved only when this is given)")
    p.add_argument("--no-save", action="store_true", help="print the report only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(WORKER_FLAG, type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.seconds is None:
        opts.seconds = 0.3 if opts.quick else 3.0
    if opts.rounds is None:
        opts.rounds = 4 if opts.quick else 10
    opts.min_calls = 20 if opts.quick else 200
    if "attnx" not in opts.libs:
        opts.libs = ["attnx", *opts.libs]
    if min(opts.threads) < 1 or min(opts.busy) < 0 or opts.rounds < 1 or (opts.calls is not None and opts.calls < 1):
        p.error("--threads, --rounds and --calls must be at least 1, --busy at least 0")
    select_shapes(opts.shapes)  # validate early
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker is not None:
        result = run_worker(opts.worker, opts)
        with open(opts.worker_out, "w") as f:
            json.dump(result, f)
        return 0
    report = {
        "benchmark": "latency of single calls, quiet and beside busy processes",
        "machine": {"cpu_model": results_file.cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "versions": versions(opts.libs),
        "config": {"threads": opts.threads, "busy": opts.busy, "shapes": opts.shapes, "libs": opts.libs,
                   "seconds": opts.seconds, "calls": opts.calls, "min_calls": opts.min_calls, "rounds": opts.rounds,
                   "pause_ms": opts.pause_ms, "quick": opts.quick},
        "runs": [],
    }
    for threads in opts.threads:
        log(f"[threads={threads}] timing {len(opts.shapes)} case(s) beside {' / '.join(map(str, opts.busy))} "
            f"busy process(es) ...")
        report["runs"].append(run_thread_count(threads, opts))
    print(contention_report(report))
    if not opts.no_save and (opts.out or not opts.quick):
        path = results_file.write_section("contention", report, opts.out)
        print(f"\nwrote the 'contention' section of {path}")
    return 0 if all("error" not in run for run in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
