"""`python -m attnx`: run multi-head attention on a typical shape, check it, report.

By default batch 8, 128 tokens, 768 wide, 12 heads (a BERT-base layer), float32,
with a padding mask. The result is checked against the float64 NumPy reference;
the exit status is 1 when the error is too large, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

import numpy as np

import attnx
from attnx import reference


def mha_flops(batch: int, tokens: int, width: int) -> float:
    """Multiply-adds x 2 of one self-attention layer: 4 projections + QK^T + PV."""
    projections = 4 * 2 * batch * tokens * width * width
    attention = 2 * 2 * batch * tokens * tokens * width
    return float(projections + attention)


def _positive_int(text: str) -> int:
    """argparse type of the sizes and counts: an int >= 1 (its error names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attnx",
        description=(__doc__ or "").splitlines()[0].split(": ", 1)[-1],
        epilog="The figures: the median time of a forward pass, its GFLOP/s, the largest "
        "absolute error against the float64 reference, and the kernel and threads used.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"attnx {attnx.__version__}")
    parser.add_argument("--batch", type=_positive_int, default=8, metavar="N", help="sequences per call")
    parser.add_argument("--tokens", type=_positive_int, default=128, metavar="L", help="tokens per sequence")
    parser.add_argument("--width", type=_positive_int, default=768, metavar="E",
                        help="embedding width (a multiple of --heads)")
    parser.add_argument("--heads", type=_positive_int, default=12, metavar="H", help="attention heads")
    parser.add_argument("--repeat", type=_positive_int, default=10, metavar="R",
                        help="timed calls (after one warm-up call); the median is reported")
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="T",
                        help="threads of attnx's kernels, for attnx.set_num_threads; None keeps "
                        "OpenMP's setting (OMP_NUM_THREADS, or the number of cores)")
    parser.add_argument("--json", action="store_true",
                        help="print the figures as one JSON object instead of a table")
    return parser


def _measure(batch: int, tokens: int, width: int, heads: int, repeat: int) -> dict[str, Any]:
    """Time and check self-attention with a padding mask on one shape: the report's figures."""
    mha = attnx.MultiheadAttention(width, heads, batch_first=True, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, tokens, width), dtype=np.float32)
    # Each sequence is padded after a different length.
    lengths = rng.integers(tokens // 2, tokens + 1, size=batch)
    padding = np.arange(tokens)[None, :] >= lengths[:, None]

    out, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
        times.append(time.perf_counter() - start)
    seconds = float(np.median(times))

    params = {name: value.astype(np.float64) for name, value in mha.state_dict().items()}
    x64 = x.astype(np.float64)
    expected, _ = reference.multi_head_attention_forward(
        x64, x64, x64, width, heads,
        params["in_proj_weight"], params["in_proj_bias"], None, None, False, 0.0,
        params["out_proj.weight"], params["out_proj.bias"], training=False,
        key_padding_mask=padding, need_weights=False, batch_first=True,
    )
    error = float(np.max(np.abs(out - expected)))
    tolerance = 1e-6 + 1e-5 * float(np.max(np.abs(expected)))
    config = attnx.show_config()
    return {
        "version": config["version"],
        "operation": "MultiheadAttention, self-attention, key_padding_mask",
        "dtype": "float32",
        "batch": batch,
        "tokens": tokens,
        "width": width,
        "heads": heads,
        "repeat": repeat,
        "seconds": seconds,
        "gflops": mha_flops(batch, tokens, width) / max(seconds, 1e-9) / 1e9,
        "max_abs_error": error,
        "tolerance": tolerance,
        "error_ok": error <= tolerance,
        "isa": config["isa"],
        "cpu_isa": config["cpu_isa"],
        "threads": config["threads"],
        "openmp": config["openmp"],
    }


def _table(figures: dict[str, Any]) -> str:
    f = figures
    rows = [
        ("attnx", f["version"]),
        ("operation", f"{f['operation']}, {f['dtype']}"),
        ("shape", f"batch {f['batch']} x {f['tokens']} tokens x {f['width']} wide, {f['heads']} heads"),
        ("time per call", f"{f['seconds'] * 1e3:.2f} ms (median of {f['repeat']})"),
        ("GFLOP/s", f"{f['gflops']:.1f}"),
        ("max abs error",
         f"{f['max_abs_error']:.2e} vs the float64 reference ({'ok' if f['error_ok'] else 'TOO LARGE'})"),
        ("kernel", f"{f['isa']} (CPU supports {f['cpu_isa']})"),
        ("threads", f"{f['threads']} (OpenMP: {'yes' if f['openmp'] else 'no'})"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check with the command line ``argv`` (default ``sys.argv[1:]``).

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments; ``--help`` lists them. A bad one exits with status 2
        and a usage message (argparse's ``SystemExit``).

    Returns
    -------
    int
        0 when the error against the reference is within tolerance, else 1.

    Examples
    --------
    >>> from attnx.__main__ import main
    >>> main(["--batch", "2", "--tokens", "16", "--width", "32", "--heads", "4", "--json"])
    {
      "version": "...",
      "operation": "MultiheadAttention, self-attention, key_padding_mask",
      "dtype": "float32",
      "batch": 2,
      "tokens": 16,
      "width": 32,
      "heads": 4,
      "repeat": 10,
      ...
      "error_ok": true,
      ...
    }
    0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.width % args.heads:
        parser.error(f"argument --width: {args.width} is not divisible by --heads {args.heads}")
    if args.threads is not None:
        attnx.set_num_threads(args.threads)
    try:
        figures = _measure(args.batch, args.tokens, args.width, args.heads, args.repeat)
    except MemoryError:
        parser.exit(1, f"{parser.prog}: error: not enough memory for this shape\n")
    print(json.dumps(figures, indent=2) if args.json else _table(figures))
    return 0 if figures["error_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
