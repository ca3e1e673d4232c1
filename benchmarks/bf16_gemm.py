#!/usr/bin/env python3
"""The bfloat16 product kernels' gemm against the float32 gemm and the FMA peak, one thread.

Usage (from a checkout, after ``pip install .``)::

    python benchmarks/bf16_gemm.py              # every table this CPU runs
    python benchmarks/bf16_gemm.py --seconds 1  # longer timings

Shapes: the flash tile's scores (M = 128 keys, N = 32 queries, K = 64: K2 = 32 pairs) and
P.V (M = 32 queries from a column-major A, N = 64, K = 128 keys), and a projection (M = 1024
rows, N = 768, K = 768). The operands stay in cache between calls: the kernels' arithmetic rate.
A multiply-add counts as 2 FLOP, so a pair step of vdpbf16ps's 16 lanes counts 64. The peak is
``_core.fma_peak(1)``: the float32 rate of the active kernel's multiply-adds.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attnx import _core, _testing

SHAPES = [  # name, M, N, K, A column-major
    ("scores 128x32x64", 128, 32, 64, False),
    ("P.V 32x64x128 (A col-major)", 32, 64, 128, True),
    ("projection 1024x768x768", 1024, 768, 768, False),
]
TABLES = ["native", "avx512", "avx2", "scalar"]


def best_rate(call, flops, seconds):
    """GFLOP/s of the fastest of five timed blocks of about seconds / 5 each."""
    call(1)
    start = time.perf_counter()
    call(1)
    once = max(time.perf_counter() - start, 1e-7)
    repeat = max(1, int(seconds / 5 / once))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        call(repeat)
        best = min(best, (time.perf_counter() - start) / repeat)
    return flops / best / 1e9


def operands(M, N, K, column_major, rng):
    """float32 A (M, K) and B (K, N), and their pairs: A's run along its rows, so they are those
    of A^T (K x M) transposed; a column-major A is the transpose of a (K, M) array."""
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    a_pairs = _testing.bf16_pack_pairs(a.T)  # (K2, M)
    if column_major:
        return np.ascontiguousarray(a.T).T, b, a_pairs.T, _testing.bf16_pack_pairs(b)
    return a, b, np.ascontiguousarray(a_pairs.T), _testing.bf16_pack_pairs(b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="time per kernel and shape")
    args = parser.parse_args()
    _core.set_num_threads(1)
    peak = _core.fma_peak(1, 0.5)
    print(f"float32 FMA peak, one thread ({_core.active_isa()}): {peak:.1f} GFLOP/s")
    rng = np.random.default_rng(0)
    tables = []
    for table in TABLES:
        try:
            _testing.bf16_round(np.zeros(1, np.float32), table=table)
            tables.append(table)
        except ValueError:
            pass
    print(f"{'shape':32} {'kernel':16} {'GFLOP/s':>8} {'of peak':>8}")
    for name, M, N, K, column_major in SHAPES:
        a, b, a_pairs, b_pairs = operands(M, N, K, column_major, rng)
        c = np.zeros((M, N), np.float32)
        flops = 2.0 * M * N * K
        rate = best_rate(lambda r: _testing.gemm_f32(a, b, c, "zero", repeat=r), flops, args.seconds)
        print(f"{name:32} {'float32 gemm':16} {rate:8.1f} {rate / peak:8.2f}")
        if not column_major:
            rate = best_rate(lambda r: _testing.gemm_f32(a, b, c, "zero", wide=True, repeat=r), flops,
                             args.seconds)
            print(f"{'':32} {'float32 wide':16} {rate:8.1f} {rate / peak:8.2f}")
        for table in tables:
            rate = best_rate(lambda r: _testing.bf16_gemm(a_pairs, b_pairs, c, "zero", table=table,
                                                          repeat=r), flops, args.seconds)
            print(f"{'':32} {'bf16 ' + table:16} {rate:8.1f} {rate / peak:8.2f}")


if __name__ == "__main__":
    main()
