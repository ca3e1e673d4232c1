#!/usr/bin/env python3
"""The error of attnx's precision="bfloat16" and of OpenVINO's default precision, against float64.

Usage (from a checkout, after ``pip install .``; the installed attnx is the one measured)::

    python benchmarks/accuracy.py                      # the five cases below, a Markdown table
    python benchmarks/accuracy.py --shapes b8-l128 mha-e768 --seeds 3 --json out.json

For each case the same float32 inputs (compare.py's, N(0, 1) queries, keys and values;
torch's initial distributions for the module's weights) go to:

* attnx with ``precision="bfloat16"`` (and, for scale, with the default float32 precision);
* OpenVINO's CPU plugin compiled with its default precision: bfloat16 on CPUs with AVX512_BF16
  or AMX, float32 elsewhere. The precision it chose is read back from the compiled model
  (``INFERENCE_PRECISION_HINT``) and printed.

The calls are compare.py's ``--precision bfloat16`` set-ups (peers.py's ``setup_attnx``,
``setup_openvino``): opset13 ScaledDotProductAttention for OpenVINO, with MatMul projections
for the module.

Each output is compared with shapes.py's float64 NumPy reference of the same computation: the
max and the mean absolute difference, the worst over ``--seeds`` draws of the inputs. The
tests' bounds (tests/test_precision.py) are set from these figures and stay within 1.5x
OpenVINO's bfloat16 error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402  (benchmarks/peers.py: the set-ups of attnx and OpenVINO)
from shapes import (  # noqa: E402  (benchmarks/shapes.py: the shapes, inputs and references)
    EXTRA_SHAPES,
    SHAPES,
    Shape,
    make_inputs,
    reference_output,
)
from results_file import cpu_model  # noqa: E402  (benchmarks/results_file.py)

DEFAULT_SHAPES = ("b8-l128", "l1024", "causal-l2048", "d128-l2048", "mha-e768")


def output(setup, shape: Shape, data: dict, threads: int, precision: str) -> tuple[np.ndarray, str]:
    """One call of compare.py's set-up of a library (``peers.setup_attnx``, ...) at `precision`:
    its output in compare.py's canonical layout and the set-up's note (OpenVINO's names the
    inference precision it chose)."""
    bench = setup(shape, data, threads, precision=precision)
    return np.asarray(bench.to_numpy(peers.call_once(bench)), dtype=np.float64), bench.note


def errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    diff = np.abs(np.asarray(got, np.float64) - want)
    return float(diff.max()), float(diff.mean())


def measure(names: list[str], seeds: int, threads: int) -> dict:
    import attnx

    attnx.set_num_threads(threads)
    shapes = {s.name: s for s in SHAPES + EXTRA_SHAPES}
    rows = []
    for name in names:
        shape = shapes[name]
        worst: dict[str, list[float]] = {}
        ov_precision = None
        for seed in range(seeds):
            data = make_inputs(shape, seed)
            want = reference_output(shape, data)
            results = {"attnx bfloat16": output(peers.setup_attnx, shape, data, threads, "bfloat16")[0],
                       "attnx float32": output(peers.setup_attnx, shape, data, threads, "float32")[0]}
            try:
                results["openvino"], note = output(peers.setup_openvino, shape, data, threads, "bfloat16")
                ov_precision = note.rpartition("inference precision ")[2]
            except peers.NotInstalled:
                ov_precision = "not installed"
            for lib, got in results.items():
                high, mean = errors(got, want)
                best = worst.setdefault(lib, [0.0, 0.0])
                best[0], best[1] = max(best[0], high), max(best[1], mean)
        rows.append({"shape": shape.label, "name": name, "openvino_precision": ov_precision,
                     "errors": {lib: {"max": v[0], "mean": v[1]} for lib, v in worst.items()}})
    return {"cpu": cpu_model(), "attnx": attnx.show_config(), "threads": threads, "seeds": seeds, "rows": rows}


def table(report: dict) -> str:
    cfg = report["attnx"]
    lines = [
        f"CPU: {report['cpu']}; attnx kernels {cfg['isa']}, {cfg['precisions']['bfloat16']} for bfloat16; "
        f"{report['threads']} threads, worst of {report['seeds']} seeds; max / mean abs error against float64.",
        "",
        "| case | attnx bfloat16 | OpenVINO (precision) | ratio of max errors | attnx float32 |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        e = row["errors"]
        bf, f32 = e["attnx bfloat16"], e["attnx float32"]
        ov = e.get("openvino")
        ov_cell = "-" if ov is None else f"{ov['max']:.2e} / {ov['mean']:.1e} ({row['openvino_precision']})"
        ratio = "-" if ov is None or ov["max"] == 0 else f"{bf['max'] / ov['max']:.2f}"
        lines.append(f"| {row['shape']} | {bf['max']:.2e} / {bf['mean']:.1e} | {ov_cell} | {ratio} | "
                     f"{f32['max']:.1e} / {f32['mean']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help=f"compare.py's shape names (default: {' '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--seeds", type=int, default=2, help="draws of the inputs per case (default 2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of both libraries")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    known = {s.name for s in SHAPES + EXTRA_SHAPES if s.kind in ("sdpa", "mha")}
    unknown = [name for name in args.shapes if name not in known]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {' '.join(sorted(known))}")
    report = measure(args.shapes, args.seeds, args.threads)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
