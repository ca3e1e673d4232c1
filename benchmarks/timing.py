"""Timing helpers shared by the benchmark scripts, and the thread settings they run under.

Holds: the thread variables (``thread_env``) and their setting at import in a worker process,
the per-call timing (``time_calls``, ``calibrate``, ``run_block``, ``measure_interleaved``,
``summarize``, ``gc_paused``), the machine's peaks (``measure_fma_peak``, ``measure_gemm_peak``,
``measure_read_bandwidth``), the background load (``cpu_busy_seconds``, ``BackgroundLoad``,
``wait_for_quiet_machine``), the load a run can start beside itself (``BusyProcesses``) and
``log``.

OpenMP and BLAS runtimes read their thread variables once, when NumPy (or torch) loads them, so
this module sets them before it imports NumPy: a script imports it before anything that imports
NumPy (shapes.py and peers.py import it first themselves).
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from peers import Bench
    from progress import Progress

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


def _optional_torch():
    """torch, or None when it is not installed (the peaks are then NumPy's alone)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextmanager
def gc_paused():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_calls(run: Callable[[], Any], k: int, reset: Callable[[], None] | None = None) -> list[float]:
    """Per-call wall times (seconds) of `k` consecutive calls; `reset`, if any, runs before each
    call, outside the timed region."""
    clock = time.perf_counter
    times = []
    for _ in range(k):
        if reset is not None:
            reset()
        t0 = clock()
        run()
        times.append(clock() - t0)
    return times


def calibrate(run: Callable[[], Any], block_seconds: float, max_calls: int = 2000,
              reset: Callable[[], None] | None = None) -> int:
    """Calls per block so that a block lasts about `block_seconds` (after a warm-up call)."""
    time_calls(run, 1, reset)
    once = min(time_calls(run, 2, reset))
    return max(1, min(max_calls, int(block_seconds / max(once, 1e-7))))


def run_block(run: Callable[[], Any], k: int, pause_s: float, reset: Callable[[], None] | None = None) -> list[float]:
    """One block: sleep `pause_s` (other runtimes' spinning threads go quiet), then time `k` calls."""
    time.sleep(pause_s)
    return time_calls(run, k, reset)


def measure_interleaved(benches: dict[str, Bench], rounds: int, block_seconds: float, pause_s: float,
                        progress: Progress | None = None) -> dict:
    """Rounds of blocks, one block per library per round, rotating the order each round."""
    names = list(benches)
    calls = {}
    for name in names:
        time.sleep(pause_s)
        calls[name] = calibrate(benches[name].run, block_seconds, reset=benches[name].reset)
    samples: dict[str, list[float]] = {name: [] for name in names}
    block_medians: dict[str, list[float]] = {name: [] for name in names}
    with gc_paused():
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                times = run_block(benches[name].run, calls[name], pause_s, benches[name].reset)
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
    torch = _optional_torch()
    if torch is not None:
        torch.set_num_threads(threads)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        rates["torch"] = flops / best_time(lambda: torch.mm(ta, tb), repeats) / 1e9
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
    torch = _optional_torch()
    if torch is not None:
        torch.set_num_threads(threads)
        ta = torch.from_numpy(a)
        kernels["torch sum"] = lambda: ta.sum()
    rates = {name: a.nbytes / best_time(fn, repeats) / 1e9 for name, fn in kernels.items()}
    by = max(rates, key=rates.get)
    return {"gbs": rates[by], "by": by, "mib": mib, "all": rates}



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


# A busy process: a pure-Python loop at 100% of one core, that says when it spins and stops
# when its parent has gone (os.getppid() changes), so that a killed benchmark leaves no
# spinning orphans behind.
_SPIN = """
import os, sys
parent = os.getppid()
sys.stdout.write("spinning\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(200000):
        pass
"""


class BusyProcesses:
    """A context manager that runs `count` busy processes (each a separate Python process
    spinning a pure-Python loop on one core) while its block runs, and kills them when the
    block ends, also on an exception or Ctrl-C. With count 0 it does nothing."""

    def __init__(self, count: int, settle_s: float = 0.05):
        self.count, self.settle_s = count, settle_s
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyProcesses":
        try:
            for _ in range(self.count):
                # The thread variables do not matter to a pure-Python loop; the environment is
                # passed as it is.
                self.procs.append(subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE,
                                                   stdin=subprocess.DEVNULL))
            for proc in self.procs:
                if proc.stdout is None or not proc.stdout.readline():
                    raise RuntimeError(f"a busy process exited with status {proc.wait()}")
            time.sleep(self.settle_s)  # the scheduler has placed them before the timing starts
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []

