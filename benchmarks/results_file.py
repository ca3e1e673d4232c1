"""One results file per machine: ``benchmarks/results/MACHINE.json``.

Every script (compare.py's ``compare``, ``sweep`` and other sections, decode.py's ``decode``,
paged.py's, contention.py's) writes its report as one section of the machine's file; a section
run again replaces the old one, whose figures stay in git's history. The file holds:

* ``machine``: label (CPU model, the SIMD kernel attnx dispatches to, cores), CPU model, kernel
  release, cores,
* ``peaks``: per thread count, the FP32 FMA peak, the achievable GEMM rate and the read
  bandwidth that the ``compare`` section measured,
* one key per section, each the full report of the script that wrote it, with its ``date`` (UTC)
  and ``commit``: ``git rev-parse --short HEAD`` of the checkout the script ran from
  (``"unknown"`` outside a checkout). The attnx imported is the installed one, so install the
  checkout first (``pip install .``); sections of one file may measure different builds.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")


def git_commit(cwd: str = HERE) -> str:
    """Short hash of HEAD of the checkout holding these scripts, or "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def attnx_isa() -> str:
    """The SIMD kernel attnx dispatches to on this CPU (avx512, avx2, neon, scalar...)."""
    try:
        import attnx

        return str(attnx.show_config().get("isa", "unknown"))
    except Exception:  # attnx missing or too old: the label still names the CPU
        return "unknown"


def slug(text: str) -> str:
    text = re.sub(r"\((R|TM|C)\)", "", text, flags=re.I)
    text = re.sub(r"\bCPU\b|@.*$", "", text, flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "cpu"


def machine_info() -> dict:
    model, isa, cores = cpu_model(), attnx_isa(), os.cpu_count() or 1
    return {"label": f"{slug(model)}-{isa}-{cores}core", "cpu_model": model, "isa": isa, "cores": cores,
            "kernel": platform.release(), "platform": platform.platform(), "python": platform.python_version()}


def default_path(machine: dict | None = None) -> str:
    """The machine's file: ``results/MACHINE.json``."""
    machine = machine or machine_info()
    return os.path.join(RESULTS_DIR, f"{machine['label']}.json")


def peaks_summary(compare_report: dict) -> dict:
    """Per thread count: FMA peak, GEMM rate and read bandwidth, from a compare.py report."""
    out = {}
    for run in compare_report.get("runs", []):
        p = run.get("peaks")
        if not p:
            continue
        out[str(run["threads"])] = {
            "fma_gflops": p["fma"]["gflops"], "fma_by": p["fma"]["by"],
            "gemm_gflops": p["gemm"]["gflops"], "gemm_by": f"{p['gemm']['by']} {p['gemm']['n']}^3 matmul",
            "read_gbs": p["read_bandwidth"]["gbs"],
            "read_by": f"{p['read_bandwidth']['by']} over {p['read_bandwidth']['mib']} MiB",
        }
    return out


def write_section(section: str, report: dict, path: str | None = None, *, commit: str | None = None,
                  machine: dict | None = None) -> str:
    """Put `report` under `section` of the machine's results file (created when missing), stamped
    with the date and the commit it measured; returns the path written."""
    machine = machine or machine_info()
    commit = commit or git_commit()
    path = os.path.abspath(path) if path else default_path(machine)
    data: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data.setdefault("machine", machine)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit, **report}
    data[section] = report
    if section == "compare":
        data["peaks"] = peaks_summary(report)
    ordered = {k: data[k] for k in ("machine", "peaks") if k in data}
    ordered.update({k: v for k, v in data.items() if k not in ordered})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(ordered, f, indent=1)
        f.write("\n")
    return path
