"""Extra peak memory of one long sdpa call: L = S = 32768, B1 H1 D64, float32.

The flash path keeps no L x S matrix: its scratch is a few tiles per thread.
This measures the growth of the process's peak resident set across the call
(inputs and the output are allocated before it), in a fresh process.

    python benchmarks/memory.py [--length 32768] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

import attnx


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    attnx.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shape = (1, 1, args.length, 64)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    out = np.empty_like(q)
    # A small call first, so that thread pools and per-thread scratch exist.
    attnx.scaled_dot_product_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64])
    before = peak_rss_mib()
    start = time.perf_counter()
    attnx.scaled_dot_product_attention(q, k, v, out=out)
    seconds = time.perf_counter() - start
    after = peak_rss_mib()
    inputs = 3 * q.nbytes / 2**20
    print(
        f"sdpa L=S={args.length} B1 H1 D64 float32, {args.threads} threads: {seconds:.2f} s; "
        f"inputs {inputs:.0f} MiB, output {out.nbytes / 2**20:.0f} MiB; "
        f"peak RSS {before:.1f} -> {after:.1f} MiB: {after - before:.2f} MiB extra"
    )


if __name__ == "__main__":
    main()
