#!/usr/bin/env python3
"""Markdown tables of a results file (benchmarks/results/MACHINE.json).

    python benchmarks/report.py benchmarks/results/intel-xeon-processor-avx512-2core.json

prints, for each section the file has, the tables that benchmarks/README.md shows: compare.py's
per thread count (times, best peer, speed-ups, attnx's fraction of the FMA peak or of the read
bandwidth; for the transformer layers also the speed-up over each peer), the machine's peaks,
the --sweep times, decode.py's table and contention.py's latency tables.

It is also the table code the scripts print with: compare.py's report (``print_report``,
``markdown_table``, ``accuracy_table``, ``peer_speedup_lines``, ``fmt_ms``), decode.py's
(``decode_table``, ``fmt_us``, ``fmt_bytes``) and contention.py's (``contention_report``,
``contention_table``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import LIBRARIES, PEER_VARIANTS  # noqa: E402  (benchmarks/peers.py)
from shapes import LAYER_KINDS  # noqa: E402  (benchmarks/shapes.py)

# decode.py's libraries, its table's columns.
DECODE_LIBRARIES = ("attnx", "torch", "onnxruntime")


def fmt_ms(entry: dict) -> str:
    status = entry.get("status")
    if status != "ok":
        return status or "-"
    if "median_ms" not in entry:
        return "-"
    ms = entry["median_ms"]
    text = f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"
    return text if entry.get("ok") else f"{text} (wrong!)"



def table_columns(run: dict) -> list[str]:
    """The libraries' columns: LIBRARIES, and the variants some result of `run` has."""
    present = {name for r in run["results"] for name in r["libs"]}
    columns = []
    for lib in LIBRARIES:
        columns.append(lib)
        columns.extend(v for v in PEER_VARIANTS.get(lib, ()) if v in present)
    return columns


def markdown_table(run: dict) -> str:
    columns = table_columns(run)
    head = ["shape", *[f"{n} ms" for n in columns], "best peer", "speed-up", "per round", "attnx GFLOP/s",
            "% of peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in run["results"]:
        libs = r["libs"]
        cells = [r["shape"]["label"]] + [fmt_ms(libs.get(n, {"status": "-"})) for n in columns]
        cells.append(r["best_peer"] or "-")
        cells.append(f"{r['speedup']:.2f}x" if r["speedup"] else "-")
        per_round = r.get("speedup_per_round")
        cells.append(f"{per_round:.2f}x" if per_round else "-")
        cells.append(f"{r['attnx_gflops']:.1f}")
        kind = "BW" if r["memory_bound"] else "FMA"
        cells.append(f"{100 * r['attnx_fraction_of_peak']:.1f}% {kind}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_table(run: dict) -> str:
    columns = table_columns(run)
    lines = ["| shape | " + " | ".join(columns) + " |", "|---|" + "|".join("---" for _ in columns) + "|"]
    for r in run["results"]:
        cells = []
        for name in columns:
            e = r["libs"].get(name, {})
            if e.get("status") != "ok":
                cells.append(e.get("status", "-"))
            else:
                cells.append(f"{e['max_abs_diff']:.1e}" + ("" if e["ok"] else " MISMATCH"))
        lines.append(f"| {r['shape']['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_speedup_lines(run: dict) -> list[str]:
    """For each transformer and ragged case of `run`: attnx's speed-up over every correct peer,
    pooled and per round (the decoder step has two torch peers, each its own ratio; the ragged
    cases attnx's baseline)."""
    lines = []
    for r in run["results"]:
        if (r["shape"]["kind"] in LAYER_KINDS or r["shape"].get("ragged")) and r.get("speedups"):
            each = ", ".join(f"{peer} {x['speedup']:.2f}x (per round {x['per_round']:.2f}x)"
                             for peer, x in r["speedups"].items())
            lines.append(f"{r['shape']['name']}: attnx's speed-up over each peer: {each}")
    return lines


def print_report(report: dict) -> None:
    m = report["machine"]
    v = report["versions"]
    print(f"\n# attnx benchmark — {m['cpu_model']}, {m['cores']} cores, {m['platform']}")
    print("versions: " + ", ".join(f"{n} {v[n] or 'not installed'}" for n in (*LIBRARIES, "onnx")))
    print(f"numpy BLAS: {v.get('numpy_blas')}; attnx config: {v.get('attnx_config')}")
    c = report["config"]
    print(f"method: {c['rounds']} interleaved rounds, blocks of ~{c['block_seconds']} s per library, "
          f"{c['pause_ms']} ms pause between libraries, median per-call time; "
          f"{c.get('precision', 'float32')} (see the notes for each library's kernel).")
    print("FLOPs: sdpa 4*B*H*L*S*D (causal: the computed half, 2*B*H*L*S*D); MHA adds 8*B*L*E^2. "
          "speed-up = best peer's median / attnx's (> 1: attnx faster); per round = the median over "
          "rounds of the same ratio of block medians.")
    kinds = {r["shape"]["kind"] for run in report["runs"] for r in run.get("results", [])}
    if kinds & {"encoder-layer", "encoder-stack"}:
        print("FLOPs of an encoder layer: 2*B*L*(4*E^2 + 2*E*ff) + 4*B*L^2*E (padding counted as computed, "
              "but for the ragged layers below), times the layers.")
    if any(r["shape"].get("ragged") for run in report["runs"] for r in run.get("results", [])):
        print("Ragged cases: FLOPs of the real tokens only, the same for every library: varlen "
              "sum over sequences of 4*H*n^2*D (causal: half); a ragged encoder layer 2*T*(4*E^2 + 2*E*ff) + "
              "4*sum(n^2)*E over its T real tokens. attnx-padded / attnx-full are attnx's own baselines "
              "(the padded batch with its mask / the full batch without one), not counted as best peer.")
    if "decoder-step" in kinds:
        print("FLOPs of a decoder step of T new tokens over S cached, memory M: per layer "
              "2*B*T*(6*E^2 + 2*E*ff) + 4*B*T*(S + T + M)*E (the memory's keys and values are projected once "
              "per cache, not counted); bytes = those weights and both attentions' K/V, read once (float32).")
    for run in report["runs"]:
        print(f"\n## {run['threads']} thread(s)\n")
        if "error" in run:
            print(f"worker failed: {run['error']}")
            continue
        p = run["peaks"]
        fma_source = (f"--peak-gflops scaled to {run['threads']} thread(s)" if p["fma"]["by"] == "--peak-gflops"
                      else f"{p['fma']['by']}, register-only multiply-adds on {run['threads']} thread(s)")
        print(f"Peaks: FMA {p['fma']['gflops']:.0f} GFLOP/s ({fma_source}); achievable GEMM {p['gemm']['gflops']:.1f} GFLOP/s "
              f"({p['gemm']['by']}, {p['gemm']['n']}^3 float32 matmul); read bandwidth "
              f"{p['read_bandwidth']['gbs']:.1f} GB/s ({p['read_bandwidth']['by']} over "
              f"{p['read_bandwidth']['mib']} MiB)", end="")
        for name, bw in p["working_set_bandwidth"].items():
            print(f"; read bandwidth over {bw['mib']:.3g} MiB (the {bw.get('of', 'K+V')} of {name}) {bw['gbs']:.1f} GB/s "
                  f"({bw['by']})", end="")
        print(".\n")
        print(markdown_table(run))
        background = run.get("background_cpu_fraction")
        if background is not None:
            warn = " — WARNING: other work on the machine may have disturbed these timings" if background > 0.05 else ""
            print(f"\nOther processes used {100 * background:.1f}% of the machine's CPU time during this run{warn}.")
        print("\n% of peak: FMA = attnx GFLOP/s / the FMA peak above; BW = attnx's bytes read (K+V; for the "
              "decoder step weights + K/V) per second / the read bandwidth measured over an array of that size.")
        for r in run["results"]:
            if r["memory_bound"]:
                print(f"{r['shape']['name']}: attnx reads {r.get('bytes_of', 'K+V')} at {r['attnx_read_gbs']:.1f} GB/s = "
                      f"{100 * r['attnx_fraction_of_read_bw']:.0f}% of the {p['read_bandwidth']['mib']} MiB "
                      f"(DRAM) read bandwidth.")
        gemm = ", ".join(f"{r['shape']['name']} {100 * r['attnx_fraction_of_gemm_peak']:.1f}%"
                         for r in run["results"] if not r["memory_bound"])
        print(f"attnx vs achievable GEMM rate: {gemm}")
        for line in peer_speedup_lines(run):
            print(line)
        print("\nmax |output - float64 reference|:\n")
        print(accuracy_table(run))
        notes = {}
        for r in run["results"]:
            for name, e in r["libs"].items():
                if e.get("note") and e.get("status") == "ok":
                    notes.setdefault(name, set()).add(e["note"])
                elif e.get("status") in ("error", "unavailable"):
                    print(f"- {name} on {r['shape']['label']}: {e['status']}: {e['note']}")
        for name, ns in notes.items():
            print(f"- {name}: {'; '.join(sorted(ns))}")


def fmt_us(entry: dict) -> str:
    if entry.get("status") != "ok":
        return entry.get("status", "-")
    if "median_us" not in entry:
        return "-"
    us = entry["median_us"]
    text = f"{us:.1f}" if us < 100 else f"{us:.0f}"
    return text if entry.get("ok") else f"{text} (wrong!)"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def decode_table(run: dict) -> str:
    """decode.py's table: per cache dtype and length, each library's median step time, the best
    peer, the speed-up and attnx's bandwidth and fraction of the peaks."""
    head = ["dtype", "cache length", "K+V read", "fits L3", "attnx us", "torch us", "onnxruntime us",
            "best peer", "speed-up", "attnx GB/s", "read BW, same size GB/s", "% of read BW", "attnx GFLOP/s",
            "% of FMA peak"]
    # --precision: attnx at the default precision beside it, and their per-round ratio (and with
    # --beside-float32-cache, the default precision over a float32 cache, and its ratio).
    precision = run.get("precision", "float32")
    beside = precision != "float32"
    cache32 = beside and any("attnx_float32_cache" in r["libs"] for r in run["rows"])
    if beside:
        head += ["attnx float32 us", f"float32 / {precision} per round"]
    if cache32:
        head += ["attnx float32 cache us", f"float32 cache / {precision} per round"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in run["rows"]:
        same = r.get("read_bw_same_size")
        l3 = r.get("l3_bytes")
        fits = "?" if r["fits_l3"] is None else f"{'yes' if r['fits_l3'] else 'no'} ({100 * r['kv_bytes'] / l3:.2g}% of it)"
        cells = [r["dtype"], str(r["length"]), fmt_bytes(r["kv_bytes"]), fits]
        cells += [fmt_us(r["libs"].get(n, {"status": "-"})) for n in DECODE_LIBRARIES]
        cells.append(r["best_peer"] or "-")
        cells.append(f"{r['speedup']:.2f}x" if r["speedup"] else "-")
        cells.append(f"{r['attnx_gbs']:.1f}" if "attnx_gbs" in r else "-")
        cells.append(f"{same['gbs']:.1f}" if same else "-")
        frac = r.get("attnx_fraction_of_same_size_bw")
        cells.append(f"{100 * frac:.0f}%" if frac is not None else "-")
        cells.append(f"{r['attnx_gflops']:.1f}" if "attnx_gflops" in r else "-")
        fma = r.get("attnx_fraction_of_fma_peak")
        cells.append(f"{100 * fma:.0f}%" if fma is not None else "-")
        if beside:
            cells.append(fmt_us(r["libs"].get("attnx_float32", {"status": "-"})))
            # (results files before --precision int8 name it for bfloat16)
            ratio = r.get("default_vs_precision_per_round", r.get("default_vs_bfloat16_per_round"))
            cells.append(f"{ratio:.2f}" if ratio else "-")
        if cache32:
            cells.append(fmt_us(r["libs"].get("attnx_float32_cache", {"status": "-"})))
            ratio = r.get("float32_cache_vs_precision_per_round")
            cells.append(f"{ratio:.2f}" if ratio else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_name(busy: int) -> str:
    """A load in words: "quiet" or "N busy process(es)"."""
    return "quiet" if busy == 0 else f"{busy} busy process" + ("es" if busy > 1 else "")


def fmt_latency(ms: float) -> str:
    """Three significant digits below 1 ms (a small case's calls take microseconds)."""
    return f"{ms:.3g}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def contention_cells(section: dict) -> dict[tuple, dict]:
    """contention.py's entries by (busy, shape name, library, threads): a library's latency
    figures where it ran, else its status."""
    cells = {}
    for run in section["runs"]:
        for r in run.get("results", []):
            for load in r["loads"]:
                for name, status in r["libs"].items():
                    entry = load["libs"].get(name) or status
                    cells[(load["busy"], r["shape"]["name"], name, run["threads"])] = entry
    return cells


def contention_libraries(section: dict) -> list[str]:
    """The libraries of a contention section, attnx first, in the order they were set up."""
    names = [name for run in section["runs"] for r in run.get("results", []) for name in r["libs"]]
    return sorted(dict.fromkeys(names), key=lambda n: n != "attnx")


def contention_table(section: dict, busy: int) -> str:
    """contention.py's table for one load: per case, each library's p50 / p99 on each thread
    count, and the all-core / 1-thread ratios of p50 and p99 (highest over lowest count)."""
    threads = sorted({run["threads"] for run in section["runs"] if "results" in run})
    libs = contention_libraries(section)
    cells = contention_cells(section)
    shapes = {r["shape"]["name"]: r["shape"]["label"] for run in section["runs"] for r in run.get("results", [])}
    head = ["shape"] + [f"{lib} {n}t p50 / p99 ms" for lib in libs for n in threads]
    ratio = len(threads) > 1
    if ratio:
        lo, hi = threads[0], threads[-1]
        head += [f"{lib} {q} {hi}t / {lo}t" for lib in libs for q in ("p50", "p99")]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, label in shapes.items():
        row = [label]
        for lib in libs:
            for n in threads:
                e = cells.get((busy, name, lib, n), {})
                row.append(f"{fmt_latency(e['p50_ms'])} / {fmt_latency(e['p99_ms'])}" if "p50_ms" in e
                           else e.get("status", "-"))
        if ratio:
            for lib in libs:
                one, all_cores = cells.get((busy, name, lib, lo), {}), cells.get((busy, name, lib, hi), {})
                for q in ("p50_ms", "p99_ms"):
                    row.append(f"{all_cores[q] / one[q]:.2f}" if q in one and q in all_cores else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def contention_report(report: dict) -> str:
    """contention.py's report: a line on the method, then a table per load with the calls per
    cell and the CPU share other processes (the busy ones included) used while timing."""
    c = report["config"]
    out = [f"# Latency beside busy processes — {report['machine']['cpu_model']}, {report['machine']['cores']} cores",
           "versions: " + ", ".join(f"{n} {v or 'not installed'}" for n, v in report["versions"].items()),
           f"method: single calls timed one by one, {c['rounds']} interleaved blocks per library, "
           f"{'%d calls' % c['calls'] if c.get('calls') else '~%g s (at least %d calls)' % (c['seconds'], c['min_calls'])} "
           "per cell; a busy process spins a pure-Python loop on one core during the timing only. "
           "Ratios: the highest thread count's p50 (p99) over the lowest's, under the same load."]
    for run in report["runs"]:
        if "error" in run:
            out.append(f"\n{run['threads']} thread(s): worker failed: {run['error']}")
    cells = contention_cells(report)
    for busy in c["busy"]:
        out.append(f"\n## {load_name(busy)}\n")
        out.append(contention_table(report, busy))
        calls = [e["calls"] for (k, *_), e in cells.items() if k == busy and "calls" in e]
        shares = []
        for run in report["runs"]:
            for r in run.get("results", []):
                for load in r["loads"]:
                    if load["busy"] == busy and load.get("background_cpu_fraction") is not None:
                        shares.append((run["threads"], load["background_cpu_fraction"]))
        notes = []
        if calls:
            notes.append(f"calls per cell {min(calls)}-{max(calls)}")
        for n in sorted({n for n, _ in shares}):
            values = [100 * s for m, s in shares if m == n]
            span = f"{min(values):.0f}%" if round(min(values)) == round(max(values)) else \
                f"{min(values):.0f}-{max(values):.0f}%"
            notes.append(f"other processes (the busy ones included) used {span} of the CPU while timing on "
                         f"{n} thread(s)")
        if notes:
            out.append("\n" + "; ".join(notes) + ".")
    return "\n".join(out)


def peaks_line(run: dict) -> str:
    p = run["peaks"]
    text = (f"FMA peak {p['fma']['gflops']:.0f} GFLOP/s ({p['fma']['by']}); GEMM {p['gemm']['gflops']:.0f} GFLOP/s "
            f"({p['gemm']['by']} {p['gemm']['n']}^3); read bandwidth {p['read_bandwidth']['gbs']:.1f} GB/s "
            f"({p['read_bandwidth']['by']}, {p['read_bandwidth']['mib']} MiB)")
    for name, bw in p.get("working_set_bandwidth", {}).items():
        if bw:
            text += f", {bw['gbs']:.1f} GB/s over {bw['mib']:.0f} MiB ({bw.get('of', 'K+V')} of {name})"
    return text


def sweep_table(run: dict) -> str:
    libs = [n for n in LIBRARIES if any(n in r["libs"] for r in run["results"])]
    head = ["L = S", *[f"{n} ms" for n in libs], "best peer", "speed-up", "attnx GFLOP/s", "% of FMA peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in sorted(run["results"], key=lambda r: r["shape"]["L"]):
        cells = [str(r["shape"]["L"])] + [fmt_ms(r["libs"].get(n, {"status": "-"})) for n in libs]
        cells += [r["best_peer"] or "-", f"{r['speedup']:.2f}x" if r["speedup"] else "-",
                  f"{r['attnx_gflops']:.1f}", f"{100 * r['attnx_fraction_of_fma_peak']:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_table(runs: list[dict]) -> str:
    """Per shape and thread count: attnx's speed-up over the best peer and its fraction of peak."""
    runs = sorted((r for r in runs if "results" in r), key=lambda r: r["threads"])
    names = [r["shape"]["name"] for r in runs[0]["results"]]
    labels = {r["shape"]["name"]: r["shape"]["label"] for r in runs[0]["results"]}
    head = ["shape", *[f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}" for r in runs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name in names:
        cells = [labels[name]]
        for run in runs:
            r = next((x for x in run["results"] if x["shape"]["name"] == name), None)
            if r is None or not r.get("speedup"):
                cells.append("-")
                continue
            kind = "BW" if r["memory_bound"] else "FMA"
            cells.append(f"{r['speedup']:.2f}x {r['best_peer']}, {100 * r['attnx_fraction_of_peak']:.0f}% {kind}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def background(run: dict) -> str:
    share = run.get("background_cpu_fraction")
    return "" if share is None else f" Other processes used {100 * share:.1f}% of the machine's CPU time meanwhile."


def stamp(section: dict) -> str:
    """When a section was measured, and on which build."""
    return f"{section.get('date')}, build {section.get('commit')}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a results file written by compare.py / decode.py")
    opts = p.parse_args(argv)
    with open(opts.results) as f:
        data = json.load(f)
    m = data.get("machine", {})
    print(f"{m.get('cpu_model')} ({m.get('isa')}, {m.get('cores')} cores, kernel {m.get('kernel')}).")
    for key in ("compare", "transformer", "ragged", "compare-bfloat16", "transformer-bfloat16", "ragged-bfloat16",
                "scaling_quick"):
        if key not in data:
            continue
        v = data[key]["versions"]
        what = "compare.py" if key == "compare" else f"compare.py ({key})"
        print(f"\n{what}, {stamp(data[key])}; " + ", ".join(f"{n} {str(v.get(n)).split('-')[0] if v.get(n) else '(not installed)'}"
                                                                for n in LIBRARIES) + ".")
        for run in data[key]["runs"]:
            if "results" not in run:
                continue
            print(f"\n**{run['threads']} thread(s).** {peaks_line(run)}.{background(run)}\n")
            print(markdown_table(run))
            speedups = peer_speedup_lines(run)
            if speedups:
                print("\n" + "\n".join(f"- {line}" for line in speedups))
    if "scaling_quick" in data:
        print("\nSpeed-up over the best peer and fraction of peak by thread count (compare and scaling_quick):\n")
        print(scaling_table(data["compare"]["runs"] + data["scaling_quick"]["runs"]))
    if "sweep" in data:
        print(f"\ncompare.py --sweep, {stamp(data['sweep'])}.")
        for run in data["sweep"]["runs"]:
            if "results" in run:
                print(f"\n**{run['threads']} thread(s).**{background(run)}\n")
                print(sweep_table(run))
    if "decode" in data:
        d = data["decode"]
        c, run = d["config"], d["run"]
        print(f"\ndecode.py, {stamp(d)}; {c['threads']} thread(s), "
              f"{c['kv_heads']} KV heads; DRAM read bandwidth {run['peaks']['read_bandwidth']['gbs']:.1f} GB/s."
              f"{background(run)}\n")
        print(decode_table(run))
    if "contention" in data:
        print(f"\ncontention.py, {stamp(data['contention'])}.\n")
        print(contention_report(data["contention"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
