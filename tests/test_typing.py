"""attnx's annotations: complete enough for type checkers, and right for typed programs.

Both checks read the installed package (its py.typed, annotations and _core.pyi), as a
user's type checker would. They run as subprocesses from an empty folder, so that no
checker configuration of the checkout applies.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import attnx

TYPED_USAGE = pathlib.Path(__file__).resolve().parent / "typed_usage.py"
PACKAGE = pathlib.Path(attnx.__file__).resolve().parent

# At least this share of the symbols attnx exports have known types (pyright's score).
COMPLETENESS = 0.95


def _run(args: list, cwd: pathlib.Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env or os.environ.copy())


@pytest.mark.slow
def test_type_completeness_of_the_public_api(tmp_path):
    pytest.importorskip("basedpyright")
    # pyright asks the `python` first on PATH for its import paths: this interpreter's.
    env = os.environ.copy()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = _run(["-m", "basedpyright", "--verifytypes", "attnx", "--ignoreexternal", "--outputjson"],
                tmp_path, env)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)["typeCompleteness"]
    # It read the installed package, not some other attnx (or none).
    assert report["pyTypedPath"] and pathlib.Path(report["packageRootDirectory"]).resolve() == PACKAGE, report
    counts = report["exportedSymbolCounts"]
    assert counts["withKnownType"] >= 50, counts
    unknown = [s["name"] for s in report["symbols"] if s["isExported"] and not s["isTypeKnown"]]
    assert report["completenessScore"] >= COMPLETENESS, (report["completenessScore"], unknown)


@pytest.mark.slow
def test_typed_program_passes_mypy_strict(tmp_path):
    pytest.importorskip("mypy")
    proc = _run(["-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
                 str(TYPED_USAGE)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_typed_program_runs(tmp_path):
    # What the annotations admit, attnx accepts: the type-checked program runs.
    proc = _run([str(TYPED_USAGE)], tmp_path)
    assert proc.returncode == 0, proc.stderr
