#!/usr/bin/env python3
"""Plots of a results file (benchmarks/results/MACHINE.json) as PNGs.

    python benchmarks/plot.py benchmarks/results/intel-xeon-processor-avx512-2core.json

writes, into ``--out-dir`` (default benchmarks/plots/), with the machine label in the names:

* ``speedup-MACHINE.png``: per shape of the ``compare`` section, attnx's speed-up over the
  fastest correct peer (best peer's median time / attnx's), one bar per thread count;
* ``sweep-MACHINE.png``: from the ``sweep`` section (``compare.py --sweep``), the median time of
  attnx and of each peer against the sequence length, one panel per thread count;
* ``contention-MACHINE-LOAD.png``: from the ``contention`` section (contention.py), one per load
  (``quiet``, ``busy1``, ...): per shape, each library's p50 and p99 on 1 thread and on all
  cores.

Every title names the machine, the load the figures were measured under and the commit.

Needs matplotlib (``pip install .[bench]`` or ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARIES = ("attnx", "numpy", "torch", "onnxruntime", "openvino")
SHORT = {"numpy": "NumPy", "torch": "torch", "onnxruntime": "ORT", "openvino": "OV"}
COLORS = {"attnx": "#d62728", "numpy": "#7f7f7f", "torch": "#1f77b4", "onnxruntime": "#2ca02c",
          "openvino": "#9467bd"}


def short_label(shape: dict) -> str:
    """A compact two-line label for the x axis."""
    if shape["kind"] not in ("sdpa", "mha"):  # a transformer layer or ragged batch: its label's first words
        words = shape["label"].split()
        return " ".join(words[:3]) + "\n" + " ".join(words[3:6])
    if shape["kind"] == "mha":
        return f"MHA B{shape['B']}\nL{shape['L']} E{shape['E']}"
    tag = "causal " if shape.get("causal") else ("decode " if shape["L"] * 16 <= shape["S"] else "")
    if shape.get("mask_given"):
        tag = "mask "
    return f"{tag}B{shape['B']} H{shape['H']}\nL{shape['L']} S{shape['S']} D{shape['D']}"


def title_of(data: dict, section: str, load: str) -> str:
    """The machine (label, CPU, kernel, cores), the load the figures were measured under and the
    commit the section measured."""
    m = data.get("machine", {})
    return (f"{m.get('cpu_model', '?')}, {m.get('isa', '?')}, {m.get('cores', '?')} cores; "
            f"attnx {data[section].get('commit', '?')}\nload: {load}")


def background_load(runs: list[dict]) -> str:
    """The load of compare.py's runs: no busy processes started, and the share of the CPU that
    other processes used meanwhile, as each worker measured it."""
    shares = [100 * r["background_cpu_fraction"] for r in runs if r.get("background_cpu_fraction") is not None]
    if not shares:
        return "no busy processes"
    span = f"{min(shares):.0f}%" if round(min(shares)) == round(max(shares)) else f"{min(shares):.0f}-{max(shares):.0f}%"
    return f"quiet (no busy processes; other processes {span} of the CPU)"


def load_name(busy: int) -> str:
    return "quiet" if busy == 0 else f"{busy} busy process" + ("es" if busy > 1 else "")


def plot_speedup(data: dict, path: str, dpi: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r for r in data["compare"]["runs"] if "results" in r), key=lambda r: r["threads"])
    shapes = [r["shape"] for r in runs[0]["results"]]
    names = [s["name"] for s in shapes]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 * len(names) + 2), 4.2))
    top = 1.0
    for i, run in enumerate(runs):
        by_name = {r["shape"]["name"]: r for r in run["results"]}
        xs, ys, peers = [], [], []
        for j, name in enumerate(names):
            r = by_name.get(name)
            if r and r.get("speedup"):
                xs.append(j + (i - (len(runs) - 1) / 2) * width)
                ys.append(r["speedup"])
                peers.append(r["best_peer"])
        top = max([top, *ys])
        bars = ax.bar(xs, ys, width * 0.95, label=f"{run['threads']} thread{'s' if run['threads'] > 1 else ''}",
                      color=("#f4a582", "#ca0020", "#92c5de", "#0571b0")[i % 4])
        for bar, y, peer in zip(bars, ys, peers):
            ax.annotate(f"{y:.2f}\n{SHORT.get(peer, peer)}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                        fontsize=6.5, xytext=(0, 1), textcoords="offset points")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), [short_label(s) for s in shapes], fontsize=7.5)
    ax.set_ylabel("speed-up over the best peer (x)")
    ax.set_ylim(0, top * 1.2)
    ax.set_title("attnx's speed-up over the fastest peer (> 1: attnx faster; ORT = ONNX Runtime, OV = OpenVINO)\n"
                 + title_of(data, "compare", background_load(runs)), fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_sweep(data: dict, path: str, dpi: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r for r in data["sweep"]["runs"] if "results" in r), key=lambda r: r["threads"])
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.2), squeeze=False, sharey=True)
    for ax, run in zip(axes[0], runs):
        results = sorted(run["results"], key=lambda r: r["shape"]["L"])
        lengths = [r["shape"]["L"] for r in results]
        for lib in LIBRARIES:
            pts = [(r["shape"]["L"], r["libs"][lib]["median_ms"]) for r in results
                   if r["libs"].get(lib, {}).get("ok") and "median_ms" in r["libs"][lib]]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3.5, lw=2.2 if lib == "attnx" else 1.2, label=lib,
                        color=COLORS[lib], zorder=3 if lib == "attnx" else 2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("sequence length L = S")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(f"{run['threads']} thread{'s' if run['threads'] > 1 else ''}", fontsize=9)
    shape = runs[0]["results"][0]["shape"]
    axes[0][0].set_ylabel("median time per call (ms)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"sdpa B{shape['B']} H{shape['H']} D{shape['D']}, float32, time against length\n"
                 + title_of(data, "sweep", background_load(runs)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_contention(data: dict, busy: int, path: str, dpi: int) -> str:
    """contention.py's figures under one load: per shape, a bar per library and thread count
    (the lowest and the highest), p99 drawn light behind p50; log scale, since the shapes' times
    differ by orders of magnitude."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    section = data["contention"]
    runs = sorted((r for r in section["runs"] if "results" in r), key=lambda r: r["threads"])
    threads = sorted({runs[0]["threads"], runs[-1]["threads"]})
    shapes = [r["shape"] for r in runs[0]["results"]]
    libs = list(dict.fromkeys(name for run in runs for r in run["results"] for name in r["libs"]))
    libs.sort(key=lambda n: n != "attnx")
    cells = {}
    for run in runs:
        for r in run["results"]:
            for load in r["loads"]:
                if load["busy"] == busy:
                    for name, e in load["libs"].items():
                        cells[(r["shape"]["name"], name, run["threads"])] = e
    bars = [(lib, n) for lib in libs for n in threads]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(shapes) + 2), 4.4))
    shades = {threads[0]: 0.45, threads[-1]: 1.0}
    for i, (lib, n) in enumerate(bars):
        color = COLORS.get(lib, "#8c564b")
        xs, p50, p99 = [], [], []
        for j, s in enumerate(shapes):
            e = cells.get((s["name"], lib, n))
            if e and "p50_ms" in e:
                xs.append(j + (i - (len(bars) - 1) / 2) * width)
                p50.append(e["p50_ms"])
                p99.append(e["p99_ms"])
        ax.bar(xs, p99, width * 0.9, color=color, alpha=0.25 * shades[n], edgecolor=color, lw=0.6)
        ax.bar(xs, p50, width * 0.9, color=color, alpha=shades[n],
               label=f"{lib}, {n} thread{'s' if n > 1 else ''}: p50 (solid), p99 (light)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(shapes)), [short_label(s) for s in shapes], fontsize=7.5)
    ax.set_ylabel("time per call (ms), log scale")
    ax.grid(True, axis="y", which="major", alpha=0.3)
    ax.set_title(f"Latency of single calls, p50 and p99, {threads[0]} thread vs {threads[-1]} threads\n"
                 + title_of(data, "contention", load_name(busy)), fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a results file written by compare.py / decode.py / contention.py")
    p.add_argument("--out-dir", default=os.path.join(HERE, "plots"), help="where the PNGs go (default benchmarks/plots)")
    p.add_argument("--dpi", type=int, default=100, help="resolution (default 100)")
    opts = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    with open(opts.results) as f:
        data = json.load(f)
    label = data.get("machine", {}).get("label", os.path.splitext(os.path.basename(opts.results))[0])
    os.makedirs(opts.out_dir, exist_ok=True)
    written = []
    if "compare" in data:
        written.append(plot_speedup(data, os.path.join(opts.out_dir, f"speedup-{label}.png"), opts.dpi))
    if "sweep" in data:
        written.append(plot_sweep(data, os.path.join(opts.out_dir, f"sweep-{label}.png"), opts.dpi))
    if "contention" in data:
        for busy in data["contention"]["config"]["busy"]:
            name = "quiet" if busy == 0 else f"busy{busy}"
            written.append(plot_contention(data, busy, os.path.join(opts.out_dir, f"contention-{label}-{name}.png"),
                                           opts.dpi))
    if not written:
        print(f"{opts.results}: no 'compare', 'sweep' or 'contention' section to plot", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
