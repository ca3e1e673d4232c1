#!/usr/bin/env python3
"""Serving-step benchmark: attnx.paged_attention over a PagedKVCache, against the same work on a
contiguous KVCache and as separate calls.

Usage (from a checkout, after ``pip install .``; the installed attnx is the one timed)::

    python benchmarks/paged.py --quick                  # smoke run, nothing saved
    python benchmarks/paged.py --threads 1 2            # full run, saved under benchmarks/results/

A full run goes into the ``paged`` section of ``benchmarks/results/MACHINE.json``
(see results_file.py); ``--out`` names another file.

Cases
-----
32 query heads over 8 key/value heads (grouped-query attention), head size 128, cache blocks of
``--block-size`` tokens (default 16). The sequences' blocks are taken in turns, a block each, as
a server's decoding sequences take them, so that no sequence's blocks lie together.

* **decode**: 16 sequences of 2048 cached tokens, one query row each: ``paged_attention`` against
  ``cached_attention`` over a ``KVCache(16, 8, 2048, 128)`` holding the same tokens, for a float32,
  float16 and int8 cache. The ratio is taken per round (paged / contiguous block medians).
* **long among short**: one sequence of 32768 tokens beside 15 of 256, one decode row each. Its
  bytes (keys and values read once) over the median time, as a fraction of the read bandwidth
  ``timing.py`` measures over a buffer of the same size.
* **mixed**: one 512-token prefill chunk of a sequence holding 2048 tokens (its last 512) and
  15 decode rows over 2048-token contexts, in one call, against the same work as two calls (the
  chunk alone, then the decode rows): the per-round ratio of the one call to the two.
* **rope**: the decode step appending each sequence's new key and value first, with ``rope=`` (a
  ``RotaryEmbedding`` rotating the queries and new keys) against without. Each call's appended
  token is taken back (``truncate``, untimed) before the next.

Method
------
As decode.py: one worker process per thread count, with ``OMP_NUM_THREADS`` set before NumPy is
imported, and ``timing.py``'s interleaved rounds (``--rounds`` rounds of ``--block-seconds``
blocks, the order rotating); medians per call. The share of CPU time other processes used is
reported. Every case checks its results first: paged against contiguous (bit for bit where the
kernels read the same rows), the one mixed call against the two, rope= against rotating by hand.
"""

from __future__ import annotations

import argparse
import json
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
from peers import Bench  # noqa: E402  (benchmarks/peers.py)
import results_file  # noqa: E402

import numpy as np  # noqa: E402

WORKER_FLAG = timing.WORKER_FLAG
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CACHE_DTYPES = ("float32", "float16", "int8")


def filled_caches(lengths, dtype, block_size, seed, contiguous=True):
    """(PagedKVCache, handles, KVCache or None) holding the same random keys and values, the
    paged blocks taken in turns."""
    import attnx

    rng = np.random.default_rng(seed)
    storage = np.int8 if dtype == "int8" else np.dtype(dtype)
    blocks = sum(-(-n // block_size) for n in lengths) + len(lengths)
    paged = attnx.PagedKVCache(blocks, block_size, KV_HEADS, HEAD_DIM, storage)
    seqs = [paged.add_sequence() for _ in lengths]
    flat = attnx.KVCache(len(lengths), KV_HEADS, max(lengths), HEAD_DIM, storage) if contiguous else None
    lengths = np.asarray(lengths)
    for start in range(0, int(lengths.max()), block_size):
        n = np.clip(lengths - start, 0, block_size)
        live = [s for s, c in zip(seqs, n) if c]
        rows = int(n.sum())
        k = rng.standard_normal((rows, KV_HEADS, HEAD_DIM), dtype=np.float32)
        v = rng.standard_normal((rows, KV_HEADS, HEAD_DIM), dtype=np.float32)
        paged.append(live, k, v, n[n > 0])
        if flat is not None:  # the same rows, sequence by sequence
            lead = np.cumsum(np.concatenate([[0], n[n > 0]]))
            keys = np.zeros((len(lengths), KV_HEADS, block_size, HEAD_DIM), np.float32)
            values = np.zeros_like(keys)
            for i, b in enumerate(np.flatnonzero(n)):
                keys[b, :, : n[b]] = k[lead[i]:lead[i + 1]].transpose(1, 0, 2)
                values[b, :, : n[b]] = v[lead[i]:lead[i + 1]].transpose(1, 0, 2)
            flat.append(keys, values, lengths=n)
    return paged, seqs, flat


def per_round(timing: dict, over: dict) -> dict:
    """The per-round ratio of two interleaved benches' block medians."""
    ratios = [a / b for a, b in zip(timing["block_medians_ms"], over["block_medians_ms"])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def case_decode(dtype, opts, threads):
    import attnx

    paged, seqs, flat = filled_caches([2048] * 16, dtype, opts.block_size, opts.seed)
    q = np.random.default_rng(1).standard_normal((16, Q_HEADS, HEAD_DIM), dtype=np.float32)
    q4 = q[:, :, None]
    same = np.array_equal(attnx.paged_attention(q, paged, seqs), attnx.cached_attention(q4, flat)[:, :, 0])
    t = timing.measure_interleaved(
        {"paged": Bench(lambda: attnx.paged_attention(q, paged, seqs)),
         "contiguous": Bench(lambda: attnx.cached_attention(q4, flat))},
        opts.rounds, opts.block_seconds, opts.pause_ms / 1e3)
    return {"case": f"decode 16 x 2048, {dtype}", "bit_identical": bool(same), "timings": t,
            "paged_over_contiguous": per_round(t["paged"], t["contiguous"])}


def case_long_among_short(opts, threads):
    import attnx

    lengths = [32768] + [256] * 15
    paged, seqs, _ = filled_caches(lengths, "float32", opts.block_size, opts.seed, contiguous=False)
    q = np.random.default_rng(2).standard_normal((16, Q_HEADS, HEAD_DIM), dtype=np.float32)
    t = timing.measure_interleaved({"paged": Bench(lambda: attnx.paged_attention(q, paged, seqs))},
                                    opts.rounds, opts.block_seconds, opts.pause_ms / 1e3)
    nbytes = sum(lengths) * KV_HEADS * HEAD_DIM * 4 * 2
    bandwidth = timing.measure_read_bandwidth(threads, nbytes / 2**20, 3 if opts.quick else 15)
    gbs = nbytes / (t["paged"]["median_ms"] / 1e3) / 1e9
    return {"case": "1 x 32768 beside 15 x 256, float32", "timings": t, "bytes": nbytes, "gbs": gbs,
            "read_bandwidth_same_size": bandwidth, "fraction_of_read_bandwidth": gbs / bandwidth["gbs"]}


def case_mixed(opts, threads):
    import attnx

    paged, seqs, _ = filled_caches([2048] * 16, "float32", opts.block_size, opts.seed, contiguous=False)
    rng = np.random.default_rng(3)
    lens = [512] + [1] * 15
    q = rng.standard_normal((sum(lens), Q_HEADS, HEAD_DIM), dtype=np.float32)
    one = lambda: attnx.paged_attention(q, paged, seqs, lens)  # noqa: E731
    two = lambda: (attnx.paged_attention(q[:512], paged, seqs[:1], [512]),  # noqa: E731
                   attnx.paged_attention(q[512:], paged, seqs[1:]))
    first, rest = two()
    same = np.array_equal(one(), np.concatenate([first, rest]))
    t = timing.measure_interleaved({"one call": Bench(one), "two calls": Bench(two)},
                                    opts.rounds, opts.block_seconds, opts.pause_ms / 1e3)
    return {"case": "512-token chunk + 15 decode rows over 2048, float32", "bit_identical": bool(same),
            "timings": t, "one_over_two": per_round(t["one call"], t["two calls"])}


def case_rope(opts, threads):
    import attnx

    paged, seqs, _ = filled_caches([2048] * 16, "float32", opts.block_size, opts.seed, contiguous=False)
    rope = attnx.RotaryEmbedding(HEAD_DIM, 500000.0, scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    rng = np.random.default_rng(4)
    q = rng.standard_normal((16, Q_HEADS, HEAD_DIM), dtype=np.float32)
    k, v = (rng.standard_normal((16, KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in range(2))

    def back():
        for s in seqs:
            paged.truncate(s, 2048)

    with_rope = attnx.paged_attention(q, paged, seqs, None, k, v, rope=rope)
    back()
    positions = np.full(16, 2048)
    by_hand = attnx.paged_attention(rope(q, positions), paged, seqs, None, rope(k, positions), v)
    back()
    t = timing.measure_interleaved(
        {"rope": Bench(lambda: attnx.paged_attention(q, paged, seqs, None, k, v, rope=rope), reset=back),
         "no rope": Bench(lambda: attnx.paged_attention(q, paged, seqs, None, k, v), reset=back)},
        opts.rounds, opts.block_seconds, opts.pause_ms / 1e3)
    return {"case": "decode 16 x 2048 appending, rope= vs none, float32",
            "same_as_by_hand": bool(np.array_equal(with_rope, by_hand)), "timings": t,
            "rope_over_none": per_round(t["rope"], t["no rope"])}


def run_worker(threads: int, opts) -> dict:
    import attnx

    load = timing.BackgroundLoad()
    cases = [case_decode(d, opts, threads) for d in opts.dtypes]
    cases += [case_long_among_short(opts, threads), case_mixed(opts, threads), case_rope(opts, threads)]
    return {"threads": threads, "isa": attnx.show_config()["isa"], "cases": cases,
            "background_cpu_fraction": load.fraction()}


def report_lines(run: dict) -> list[str]:
    lines = [f"threads {run['threads']} ({run.get('isa')}; other processes used "
             f"{100 * run.get('background_cpu_fraction', 0):.1f}% of the CPU)"]
    for c in run["cases"]:
        times = ", ".join(f"{n} {t['median_ms']:.3g} ms" for n, t in c["timings"].items())
        ratio = next((f"{k}: {v['median']:.3f} (rounds {v['min']:.3f}-{v['max']:.3f})"
                      for k, v in c.items() if isinstance(v, dict) and "median" in v), "")
        extra = (f"{c['gbs']:.1f} GB/s = {100 * c['fraction_of_read_bandwidth']:.0f}% of the read bandwidth"
                 if "gbs" in c else ratio)
        check = "" if "bit_identical" not in c else f" [bits {'equal' if c['bit_identical'] else 'differ'}]"
        lines.append(f"  {c['case']}: {times}; {extra}{check}")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", help="thread counts (default 1 2; --quick 1)")
    p.add_argument("--dtypes", nargs="+", choices=CACHE_DTYPES, default=list(CACHE_DTYPES),
                   help="cache dtypes of the decode case")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache block (default 16)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 7, --quick 2)")
    p.add_argument("--block-seconds", type=float, help="target length of one block (default 0.3, --quick 0.02)")
    p.add_argument("--pause-ms", type=float, default=30.0, help="sleep before each block (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="PATH", help="results file to write (default: benchmarks/results/...)")
    p.add_argument("--no-save", action="store_true", help="print the report only")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 short rounds, float32 only, 1 thread")
    p.add_argument(WORKER_FLAG, type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.threads = opts.threads or ([1] if opts.quick else [1, 2])
    if opts.quick:
        opts.dtypes = ["float32"]
    opts.rounds = opts.rounds or (2 if opts.quick else 7)
    opts.block_seconds = opts.block_seconds or (0.02 if opts.quick else 0.3)
    if min(opts.threads) < 1 or opts.block_size < 1:
        p.error("--threads and --block-size must be at least 1")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker is not None:
        with open(opts.worker_out, "w") as f:
            json.dump(run_worker(opts.worker, opts), f)
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in opts.threads:
            out = os.path.join(tmp, f"{threads}.json")
            argv_worker = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(threads), "--worker-out", out,
                           "--dtypes", *opts.dtypes, "--block-size", str(opts.block_size), "--rounds", str(opts.rounds),
                           "--block-seconds", str(opts.block_seconds), "--pause-ms", str(opts.pause_ms),
                           "--seed", str(opts.seed)] + (["--quick"] if opts.quick else [])
            log(f"[threads={threads}] running the serving cases ...")
            proc = subprocess.run(argv_worker, env={**os.environ, **timing.thread_env(threads)})
            if proc.returncode != 0 or not os.path.exists(out):
                why = f"status {proc.returncode}"
                if proc.returncode < 0:
                    why += f" ({signal.Signals(-proc.returncode).name})"
                runs.append({"threads": threads, "error": f"worker exited with {why}"})
                continue
            with open(out) as f:
                runs.append(json.load(f))
    report = {
        "benchmark": "serving steps: attnx.paged_attention over a PagedKVCache",
        "machine": {"cpu_model": results_file.cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z")},
        "config": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": opts.block_size,
                   "dtypes": opts.dtypes, "rounds": opts.rounds, "block_seconds": opts.block_seconds,
                   "quick": opts.quick, "argv": sys.argv[1:] if argv is None else list(argv)},
        "runs": runs,
    }
    for run in runs:
        print("\n".join(report_lines(run)) if "error" not in run else f"threads {run['threads']}: {run['error']}")
    if not opts.no_save and (opts.out or not opts.quick):
        path = results_file.write_section("paged", report, opts.out)
        print(f"\nwrote the 'paged' section of {path}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
