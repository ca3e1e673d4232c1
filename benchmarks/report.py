#!/usr/bin/env python3
"""Markdown tables of a results file (benchmarks/results/DATE-MACHINE-COMMIT.json).

    python benchmarks/report.py benchmarks/results/2026-11-28-amd-epyc-avx2-2core-7e97ddc.json

prints, for each section the file has, the tables that benchmarks/README.md shows: compare.py's
per thread count (times, best peer, speed-ups, attnx's fraction of the FMA peak or of the read
bandwidth; for the transformer layers also the speed-up over each peer), the machine's peaks,
the --sweep times and decode.py's table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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
    import compare

    libs = [n for n in compare.LIBRARIES if any(n in r["libs"] for r in run["results"])]
    head = ["L = S", *[f"{n} ms" for n in libs], "best peer", "speed-up", "attnx GFLOP/s", "% of FMA peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in sorted(run["results"], key=lambda r: r["shape"]["L"]):
        cells = [str(r["shape"]["L"])] + [compare.fmt_ms(r["libs"].get(n, {"status": "-"})) for n in libs]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a results file written by compare.py / decode.py")
    opts = p.parse_args(argv)
    with open(opts.results) as f:
        data = json.load(f)
    import compare

    m = data.get("machine", {})
    print(f"{m.get('cpu_model')} ({m.get('isa')}, {m.get('cores')} cores, kernel {m.get('kernel')}); "
          f"build {data.get('commit')}: {data.get('build')}")
    for key in ("compare", "transformer", "ragged", "compare-bfloat16", "transformer-bfloat16", "ragged-bfloat16",
                "scaling_quick"):
        if key not in data:
            continue
        v = data[key]["versions"]
        what = "compare.py" if key == "compare" else f"compare.py ({key})"
        print(f"\n{what}, {data[key].get('date')}; " + ", ".join(f"{n} {str(v.get(n)).split('-')[0] if v.get(n) else '(not installed)'}"
                                                                for n in compare.LIBRARIES) + ".")
        for run in data[key]["runs"]:
            if "results" not in run:
                continue
            print(f"\n**{run['threads']} thread(s).** {peaks_line(run)}.{background(run)}\n")
            print(compare.markdown_table(run))
            speedups = compare.peer_speedup_lines(run)
            if speedups:
                print("\n" + "\n".join(f"- {line}" for line in speedups))
    if "scaling_quick" in data:
        print("\nSpeed-up over the best peer and fraction of peak by thread count (compare and scaling_quick):\n")
        print(scaling_table(data["compare"]["runs"] + data["scaling_quick"]["runs"]))
    if "sweep" in data:
        print(f"\ncompare.py --sweep, {data['sweep'].get('date')}.")
        for run in data["sweep"]["runs"]:
            if "results" in run:
                print(f"\n**{run['threads']} thread(s).**{background(run)}\n")
                print(sweep_table(run))
    if "decode" in data:
        import decode

        d = data["decode"]
        c, run = d["config"], d["run"]
        print(f"\ndecode.py, {d.get('date') or d['machine'].get('date')}; {c['threads']} thread(s), "
              f"{c['kv_heads']} KV heads; DRAM read bandwidth {run['peaks']['read_bandwidth']['gbs']:.1f} GB/s."
              f"{background(run)}\n")
        print(decode.markdown_table(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
