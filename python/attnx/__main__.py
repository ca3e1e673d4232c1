"""`python -m attnx`: run multi-head attention on a typical shape, check it, report.

Batch 8, 128 tokens, 768 wide, 12 heads (a BERT-base layer), float32, with a
padding mask. The result is checked against the float64 NumPy reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

import attnx
from attnx import reference


def mha_flops(batch: int, tokens: int, width: int) -> float:
    """Multiply-adds x 2 of one self-attention layer: 4 projections + QK^T + PV."""
    projections = 4 * 2 * batch * tokens * width * width
    attention = 2 * 2 * batch * tokens * tokens * width
    return float(projections + attention)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnx", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)

    mha = attnx.MultiheadAttention(args.width, args.heads, batch_first=True, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.tokens, args.width), dtype=np.float32)
    # Each sequence is padded after a different length.
    lengths = rng.integers(args.tokens // 2, args.tokens + 1, size=args.batch)
    padding = np.arange(args.tokens)[None, :] >= lengths[:, None]

    out, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)  # warm-up
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        out, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))

    params = {name: value.astype(np.float64) for name, value in mha.state_dict().items()}
    x64 = x.astype(np.float64)
    expected, _ = reference.multi_head_attention_forward(
        x64, x64, x64, args.width, args.heads,
        params["in_proj_weight"], params["in_proj_bias"], None, None, False, 0.0,
        params["out_proj.weight"], params["out_proj.bias"], training=False,
        key_padding_mask=padding, need_weights=False, batch_first=True,
    )
    error = float(np.max(np.abs(out - expected)))
    tolerance = 1e-6 + 1e-5 * float(np.max(np.abs(expected)))
    config = attnx.show_config()

    rows = [
        ("attnx", config["version"]),
        ("operation", "MultiheadAttention, self-attention, key_padding_mask, float32"),
        ("shape", f"batch {args.batch} x {args.tokens} tokens x {args.width} wide, {args.heads} heads"),
        ("time per call", f"{seconds * 1e3:.2f} ms (median of {args.repeat})"),
        ("GFLOP/s", f"{mha_flops(args.batch, args.tokens, args.width) / seconds / 1e9:.1f}"),
        ("max abs error", f"{error:.2e} vs the float64 reference ({'ok' if error <= tolerance else 'TOO LARGE'})"),
        ("kernel", f"{config['isa']} (CPU supports {config['cpu_isa']})"),
        ("threads", f"{config['threads']} (OpenMP: {'yes' if config['openmp'] else 'no'})"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0 if error <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
