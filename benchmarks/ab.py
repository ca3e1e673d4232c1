#!/usr/bin/env python3
"""A/B timing of two installed builds of attnx, interleaved, on compare.py's shapes.

Usage (each of --before / --after is a Python interpreter, or a virtualenv, with attnx installed)::

    python benchmarks/ab.py --before /path/to/venv-a/bin/python --after /path/to/venv-b/bin/python \\
        --threads 2 1 --rounds 10 [--shapes 1 tiny mha-e768] [--json out.json]

    python benchmarks/ab.py --before .venv --after .venv --after-softcap 30   # the soft cap's cost

The driver (this script) needs only NumPy; it may run under either interpreter.

Method
------
* **One long-lived worker per build and thread count.** Each is this script run with the
  build's interpreter (``--worker N``), with ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and
  ``MKL_NUM_THREADS`` set before NumPy is imported (as compare.py does, through timing.py) and without
  ``PYTHONPATH``, so it imports the build installed in that environment. The workers answer
  requests as JSON lines over stdin/stdout and stay up for the whole run: imports, input
  generation and set-up are never timed.
* **Same inputs, same work.** Each worker draws the inputs with shapes.py's ``make_inputs``
  (same seed) and calls attnx through peers.py's ``setup_attnx``. Before timing, each
  build's output for the first thread count is checked against shapes.py's float64 reference,
  and the two builds' output bytes are compared. Both builds run blocks of the same number of
  calls: timing.py's calibration to about ``--block-seconds``, the smaller of the two counts.
* **Interleaved rounds.** Each round runs, for every shape and thread count, one block in the
  before build's worker and one in the after build's, the order alternating between rounds
  (before/after, then after/before). A block is timing.py's ``run_block``: a ``--pause-ms`` sleep (other
  threads stop spinning), then calls timed one by one with ``time.perf_counter``, garbage
  collection off; its median is recorded.
* **Ratios.** Per shape and thread count: each build's median (the median of its block
  medians), the pooled ratio ``before / after`` of those medians, and the median over rounds
  of the per-round ratio ``before block / after block`` with its min, max and quartiles.
  A ratio > 1 means the after build is faster. The two blocks of a round run a fraction of a
  second apart, so the per-round ratio is not thrown off by the machine's speed drifting
  between minutes, which can set one build's fast blocks against the other's slow ones in
  the pooled medians.
* **Background load.** The share of the machine's CPU time used by processes other than the
  driver and its workers is reported, with a warning above 5%.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# timing comes first: it sets the thread variables of a worker before NumPy is imported.
import timing  # noqa: E402  (benchmarks/timing.py: timing and thread helpers)
from timing import log  # noqa: E402
import peers  # noqa: E402  (benchmarks/peers.py: attnx's set-up)
import results_file  # noqa: E402  (benchmarks/results_file.py)
from shapes import (  # noqa: E402  (benchmarks/shapes.py: the shapes, inputs and references)
    EXTRA_SHAPES,
    SHAPES,
    check_output,
    make_inputs,
    reference_output,
    select_shapes,
)
from progress import Progress  # noqa: E402  (benchmarks/progress.py; tqdm when installed)

WORKER_FLAG = timing.WORKER_FLAG
BUILDS = ("before", "after")


# --------------------------------------------------------------------------------------------
# Worker: one build, one thread count; JSON lines on stdin / stdout
# --------------------------------------------------------------------------------------------


class WorkerState:
    def __init__(self, threads: int):
        self.threads = threads
        self.benches: dict[str, peers.Bench] = {}

    def info(self) -> dict:
        import attnx
        import numpy as np

        return {
            "pid": os.getpid(),
            "python": sys.executable,
            "python_version": platform.python_version(),
            "numpy": np.__version__,
            "attnx_version": getattr(attnx, "__version__", None),
            "attnx_file": attnx.__file__,
            "attnx_config": attnx.show_config(),
            "threads": self.threads,
        }

    def setup(self, req: dict) -> dict:
        """Prepare a shape (inputs, attnx call), optionally check it, and calibrate a block."""
        shape = select_shapes([req["shape"]])[0]
        t0 = time.perf_counter()
        data = make_inputs(shape)
        softcap = req.get("softcap")
        bench = peers.setup_attnx(shape, data, self.threads, softcap)
        out = {"ok": True, "note": bench.note}
        if req.get("check"):
            import numpy as np

            got = np.ascontiguousarray(bench.to_numpy(bench.run()))
            out["check"] = check_output(got, reference_output(shape, data, softcap))
            out["output_sha256"] = hashlib.sha256(got.tobytes()).hexdigest()
        out["calls"] = timing.calibrate(bench.run, req["block_seconds"])
        out["setup_s"] = time.perf_counter() - t0
        self.benches[shape.name] = bench
        return out

    def block(self, req: dict) -> dict:
        run = self.benches[req["shape"]].run
        with timing.gc_paused():
            times = timing.run_block(run, req["calls"], req["pause_ms"] / 1e3)
        return {"ok": True, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                "calls": len(times)}


def serve(threads: int) -> int:
    """Answer requests until "exit" or end of input; stdout carries only the replies."""
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything a library prints goes to stderr
    sys.stdout = sys.stderr
    state = WorkerState(threads)

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        reply({"ok": True, "info": state.info()})
    except Exception as exc:
        reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "setup":
                reply(state.setup(req))
            elif op == "block":
                reply(state.block(req))
            elif op == "cpu":
                reply({"ok": True, "cpu_s": sum(os.times()[:2])})
            elif op == "exit":
                reply({"ok": True})
                return 0
            else:
                reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


class Worker:
    """A worker process of one build at one thread count."""

    def __init__(self, build: str, python: str, threads: int):
        self.build, self.python, self.threads = build, python, threads
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(timing.thread_env(threads))
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), WORKER_FLAG, str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )
        self.info = self._read()["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"{self.build} worker ({self.python}, {self.threads} thread(s)) exited "
                              f"with status {code}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(f"{self.build} worker ({self.threads} thread(s)): {reply.get('error')}")
        return reply

    def request(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("exit")
            except (WorkerError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def resolve_python(path: str) -> str:
    """An interpreter path, or the bin/python of a virtualenv directory."""
    if os.path.isdir(path):
        for name in ("bin/python", "Scripts/python.exe"):
            candidate = os.path.join(path, name)
            if os.path.exists(candidate):
                return candidate
        raise SystemExit(f"{path}: a directory without bin/python")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no such interpreter")
    return path


def lscpu_model() -> str:
    """The "Model name" line of lscpu, else /proc/cpuinfo's model name."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"},
                             timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return results_file.cpu_model()


def ratio_stats(before: list[float], after: list[float]) -> dict:
    """Pooled and per-round before/after ratios of block medians (> 1: after is faster)."""
    med_b, med_a = statistics.median(before), statistics.median(after)
    per_round = [b / a for b, a in zip(before, after)]
    if len(per_round) >= 2:
        q1, _, q3 = statistics.quantiles(per_round, n=4, method="inclusive")
    else:
        q1 = q3 = per_round[0]
    return {
        "before_median_ms": med_b,
        "after_median_ms": med_a,
        "pooled_ratio": med_b / med_a,
        "per_round_ratios": per_round,
        "per_round_median": statistics.median(per_round),
        "per_round_min": min(per_round),
        "per_round_max": max(per_round),
        "per_round_q1": q1,
        "per_round_q3": q3,
        "rounds_after_faster": sum(r > 1 for r in per_round),
    }


def fmt_ms(ms: float) -> str:
    return f"{ms:.4f}" if ms < 0.1 else f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def table_rows(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["shape", "thr", "before ms", "after ms", "pooled b/a", "per round b/a", "min-max", "IQR",
            "after faster"]
    rows = []
    for r in results:
        s = r["stats"]
        rows.append([
            r["shape"]["name"], str(r["threads"]), fmt_ms(s["before_median_ms"]), fmt_ms(s["after_median_ms"]),
            f"{s['pooled_ratio']:.3f}", f"{s['per_round_median']:.3f}",
            f"{s['per_round_min']:.3f}-{s['per_round_max']:.3f}",
            f"{s['per_round_q1']:.3f}-{s['per_round_q3']:.3f}",
            f"{s['rounds_after_faster']}/{len(s['per_round_ratios'])}",
        ])
    return head, rows


def print_table(title: str, head: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        line = lambda cells: "  ".join(  # noqa: E731
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        print(f"\n{title}\n")
        print(line(head))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print(line(row))
        return
    table = Table(title=title)
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # a file or pipe: never cut cells to 80 columns
        console = Console(width=200)
    console.print(table)


def describe_build(name: str, info: dict) -> str:
    c = info["attnx_config"]
    cfg = ", ".join(f"{k}={v}" for k, v in c.items()) if isinstance(c, dict) else str(c)
    return f"{name}: attnx {info['attnx_version']} at {info['attnx_file']} ({cfg})"


def run(opts) -> dict:
    shapes = select_shapes(opts.shapes) if opts.shapes else list(SHAPES + EXTRA_SHAPES)
    pythons = {"before": resolve_python(opts.before), "after": resolve_python(opts.after)}
    if opts.wait_quiet > 0:
        timing.wait_for_quiet_machine(opts.wait_quiet)
    wall0, busy0, own0 = time.perf_counter(), timing.cpu_busy_seconds(), sum(os.times()[:2])
    workers: dict[tuple[str, int], Worker] = {}
    try:
        for threads in opts.threads:
            for build in BUILDS:
                log(f"starting the {build} worker, {threads} thread(s) ...")
                workers[build, threads] = Worker(build, pythons[build], threads)
        infos = {b: workers[b, opts.threads[0]].info for b in BUILDS}
        for b in BUILDS:
            log(describe_build(b, infos[b]))
        if infos["before"]["attnx_file"] == infos["after"]["attnx_file"] and opts.after_softcap is None:
            log("note: both builds import the same attnx files (an A/A run: the ratios show the noise)")

        # Set-up: inputs, checks and the calls per block, per shape and thread count.
        cases = []
        for shape in shapes:
            for i, threads in enumerate(opts.threads):
                log(f"setting up {shape.name}, {threads} thread(s) ...")
                setups = {b: workers[b, threads].request("setup", shape=shape.name, check=(i == 0),
                                                         block_seconds=opts.block_seconds,
                                                         softcap=opts.after_softcap if b == "after" else None)
                          for b in BUILDS}
                case = {"shape": {"name": shape.name, "label": shape.label}, "threads": threads,
                        "calls_per_block": min(s["calls"] for s in setups.values()),
                        "notes": {b: setups[b]["note"] for b in BUILDS}, "blocks": []}
                if i == 0:
                    case["check"] = {b: setups[b]["check"] for b in BUILDS}
                    case["outputs_identical"] = setups["before"]["output_sha256"] == setups["after"]["output_sha256"]
                    for b in BUILDS:
                        if not setups[b]["check"]["ok"]:
                            log(f"  WARNING: the {b} build's output differs from the reference: {setups[b]['check']}")
                cases.append(case)
        per_block = sum(c["calls_per_block"] for c in cases)
        log(f"{len(cases)} cases x {opts.rounds} rounds x 2 builds, {per_block} calls per round and build ...")

        # Interleaved rounds, with a progress bar and the time left.
        progress = Progress(opts.rounds, "A/B", unit="round")
        for r in range(opts.rounds):
            order = BUILDS if r % 2 == 0 else BUILDS[::-1]
            t0 = time.perf_counter()
            for case in cases:
                block = {"round": r, "first": order[0]}
                for b in order:
                    reply = workers[b, case["threads"]].request(
                        "block", shape=case["shape"]["name"], calls=case["calls_per_block"], pause_ms=opts.pause_ms)
                    block[f"{b}_ms"] = reply["median_ms"]
                    block[f"{b}_min_ms"] = reply["min_ms"]
                case["blocks"].append(block)
            progress.write(f"round {r + 1}/{opts.rounds} ({'/'.join(order)}): {time.perf_counter() - t0:.1f} s")
            progress.update()
        progress.close()

        cpu_workers = sum(w.request("cpu")["cpu_s"] for w in workers.values())
    finally:
        for w in workers.values():
            w.close()

    background = None
    busy1 = timing.cpu_busy_seconds()
    if busy0 is not None and busy1 is not None:
        others = (busy1 - busy0) - (sum(os.times()[:2]) - own0) - cpu_workers
        background = max(0.0, others / ((time.perf_counter() - wall0) * (os.cpu_count() or 1)))

    for case in cases:
        case["stats"] = ratio_stats([b["before_ms"] for b in case["blocks"]], [b["after_ms"] for b in case["blocks"]])
    return {
        "machine": {"cpu_model": lscpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "builds": {b: {"python": pythons[b], **infos[b]} for b in BUILDS},
        "config": {"threads": opts.threads, "rounds": opts.rounds, "block_seconds": opts.block_seconds,
                   "pause_ms": opts.pause_ms, "shapes": [s.name for s in shapes]},
        "background_cpu_fraction": background,
        "results": cases,
    }


def print_report(report: dict) -> None:
    m, c = report["machine"], report["config"]
    print(f"\n# attnx A/B — {m['cpu_model']}, {m['cores']} cores")
    for b in BUILDS:
        print(describe_build(b, report["builds"][b]))
    print(f"method: {c['rounds']} rounds, the build order alternating; blocks of ~{c['block_seconds']} s "
          f"(the same number of calls for both builds), {c['pause_ms']} ms pause before each; block medians.")
    print("b/a = before / after (> 1: the after build is faster). pooled: ratio of the medians of the block "
          "medians; per round: median over rounds of the ratio of the two blocks of a round, with its "
          "min-max and interquartile range; after faster: rounds with a ratio > 1.")
    head, rows = table_rows(report["results"])
    print_table("before / after", head, rows)
    ratios = [r["stats"]["per_round_median"] for r in report["results"]]
    geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
    print(f"\ngeometric mean of the per-round ratios: {geo:.3f}")
    for r in report["results"]:
        if "check" not in r:
            continue
        bad = [b for b in BUILDS if not r["check"][b]["ok"]]
        if bad:
            detail = ", ".join(f"{b} {r['check'][b]}" for b in bad)
            print(f"WARNING {r['shape']['name']}: {', '.join(bad)} output differs from the float64 reference "
                  f"({detail})")
    different = [r["shape"]["name"] for r in report["results"] if r.get("outputs_identical") is False]
    print("outputs: byte-identical between the builds" if not different else
          f"outputs: not byte-identical between the builds on {', '.join(different)}")
    background = report["background_cpu_fraction"]
    if background is not None:
        warn = " — WARNING: other work on the machine may have disturbed these timings" if background > 0.05 else ""
        print(f"Other processes used {100 * background:.1f}% of the machine's CPU time during this run{warn}.")


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", metavar="PYTHON", help="interpreter (or virtualenv) of the old build")
    p.add_argument("--after", metavar="PYTHON", help="interpreter (or virtualenv) of the new build")
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help="thread counts, each with its own worker per build (default: 1 and the core count)")
    p.add_argument("--shapes", nargs="+", help="compare.py's shapes by number (1-7) or name (default: all "
                   f"{len(SHAPES) + len(EXTRA_SHAPES)}): "
                   + ", ".join(f"{i}={s.name}" for i, s in enumerate(SHAPES, 1))
                   + ", " + ", ".join(s.name for s in EXTRA_SHAPES))
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    p.add_argument("--block-seconds", type=float, default=0.25, help="target length of one block (default 0.25)")
    p.add_argument("--pause-ms", type=float, default=30.0, help="sleep before each block (default 30)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for other processes to leave the CPUs idle")
    p.add_argument("--json", metavar="PATH", help="write the builds, the machine and every block time as JSON")
    p.add_argument("--after-softcap", type=float, metavar="C",
                   help="the after build's sdpa calls soft-cap their scores at C (with --after the same "
                        "interpreter as --before: the soft cap's cost, per round)")
    p.add_argument(WORKER_FLAG, type=int, metavar="N", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker is None:
        if not opts.before or not opts.after:
            p.error("--before and --after are required")
        if opts.rounds < 1:
            p.error("--rounds must be at least 1")
        if opts.shapes:
            select_shapes(opts.shapes)  # validate early
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker is not None:
        return serve(opts.worker)
    try:
        report = run(opts)
    except WorkerError as exc:
        log(f"error: {exc}")
        return 1
    print_report(report)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
