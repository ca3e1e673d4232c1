"""`python -m attnx`: its options, its report (table or JSON) and its usage errors.

Each test runs the installed package's command in a subprocess, on a small shape.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import attnx

SMALL = ["--batch", "2", "--tokens", "16", "--width", "32", "--heads", "4", "--repeat", "2"]


def _attnx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnx", *args], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())


def test_help_lists_every_option_with_its_default():
    proc = _attnx("--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines at the terminal's width
    for option, default in (("--batch", "8"), ("--tokens", "128"), ("--width", "768"), ("--heads", "12"),
                            ("--repeat", "10"), ("--threads", "None"), ("--json", "False")):
        assert option in text and f"(default: {default})" in text, option
    assert "--version" in text


def test_version():
    proc = _attnx("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"attnx {attnx.__version__}"


def test_json_report_with_one_thread():
    proc = _attnx(*SMALL, "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout)
    assert set(figures) == {
        "version", "operation", "dtype", "batch", "tokens", "width", "heads", "repeat", "seconds",
        "gflops", "max_abs_error", "tolerance", "error_ok", "isa", "cpu_isa", "threads", "openmp",
    }
    assert figures["threads"] == 1
    assert figures["error_ok"] is True and 0 <= figures["max_abs_error"] <= figures["tolerance"]
    assert (figures["batch"], figures["tokens"], figures["width"], figures["heads"], figures["repeat"]) == (
        2, 16, 32, 4, 2)
    assert figures["version"] == attnx.__version__ and figures["dtype"] == "float32"
    assert figures["seconds"] > 0 and figures["gflops"] > 0
    config = attnx.show_config()
    assert (figures["isa"], figures["cpu_isa"], figures["openmp"]) == (
        config["isa"], config["cpu_isa"], config["openmp"])


def test_table_report():
    proc = _attnx(*SMALL, "--threads", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # One row a line: the name, two spaces or more, the value.
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in proc.stdout.splitlines())
    assert list(rows) == ["attnx", "operation", "shape", "time per call", "GFLOP/s", "max abs error",
                          "kernel", "threads"]
    assert rows["attnx"] == attnx.__version__
    assert rows["shape"] == "batch 2 x 16 tokens x 32 wide, 4 heads"
    assert rows["threads"].startswith("2 (OpenMP: ")
    assert rows["max abs error"].endswith("(ok)")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--bogus"], "--bogus"),
        (["--batch", "0"], "--batch"),
        (["--tokens", "x"], "--tokens"),
        (["--width", "-8"], "--width"),
        (["--heads", "1.5"], "--heads"),
        (["--repeat", "0"], "--repeat"),
        (["--threads", "0"], "--threads"),
        (["--width", "30", "--heads", "4"], "--width"),
        (["--json", "--batch"], "--batch"),
    ],
)
def test_bad_arguments_are_usage_errors(args, flag):
    proc = _attnx(*SMALL, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.startswith("usage: python -m attnx"), proc.stderr
    assert "error:" in proc.stderr and flag in proc.stderr, proc.stderr
