"""benchmarks/: every command benchmarks/README.md shows starts as written, and the results files
follow their naming scheme.

The commands run with ``--help`` appended (argparse checks the options before it, then exits);
the peers are never imported by ``--help``. plot.py and report.py run for real on a results file
made here, and compare.py runs for real on the transformer layers' and the ragged batches' tiny
cases (a few seconds of timing, the peers' imports and the machine's peaks: marked slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
README = BENCH / "README.md"
RESULTS = BENCH / "results"

pytestmark = pytest.mark.skipif(not README.exists(), reason="benchmarks/ is not in this tree")


def readme_commands() -> list[str]:
    """The `python benchmarks/...` lines of the README's bash blocks, continuation lines joined."""
    if not README.exists():
        return []
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", README.read_text("utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("benchmarks/"):
                commands.append(shlex.join(words))
    return commands


def run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_readme_shows_commands():
    scripts = {shlex.split(c)[1] for c in readme_commands()}
    assert {"benchmarks/compare.py", "benchmarks/decode.py", "benchmarks/paged.py", "benchmarks/plot.py",
            "benchmarks/report.py"} <= scripts, scripts
    assert "PYTHONPATH=" not in README.read_text("utf-8")  # the installed attnx is the one timed


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_starts(command):
    words = shlex.split(command)
    proc = run([*words[1:], "--help"])
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "usage:" in proc.stdout


def test_results_files_are_named_by_date_machine_commit():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    # results/ holds the runs benchmarks/README.md cites; older ones live in git's history.
    readme = (RESULTS.parent / "README.md").read_text("utf-8")
    for path in files:
        assert path.name in readme, f"{path.name} is not cited by benchmarks/README.md"
        data = json.loads(path.read_text("utf-8"))
        name = f"{data['date']}-{data['machine']['label']}-{data['commit']}.json"
        assert path.name == name, (path.name, name)
        assert re.fullmatch(r"[0-9a-f]{7,12}|unknown", data["commit"]), data["commit"]
        assert {"compare", "transformer", "ragged", "decode", "sweep", "paged"} & set(data), sorted(data)
        assert data["build"] and data["machine"]["cpu_model"] and data["machine"]["cores"] >= 1
        if "compare" in data:
            threads = {str(r["threads"]) for r in data["compare"]["runs"]}
            assert set(data["peaks"]) == threads, (path.name, sorted(data["peaks"]), threads)


def test_default_path_and_commit(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import results_file
    finally:
        sys.path.remove(str(BENCH))
    assert results_file.git_commit(str(tmp_path)) == "unknown"  # not a checkout
    machine = {"label": "some-cpu-avx2-2core"}
    monkeypatch.setattr(results_file, "RESULTS_DIR", str(tmp_path))
    path = pathlib.Path(results_file.default_path(machine, "abc1234"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-some-cpu-avx2-2core-abc1234\.json", path.name), path.name
    written = results_file.write_section("decode", {"run": {}}, None, commit="abc1234", machine=machine)
    assert written == str(path)
    # A later run of the same machine and build adds its section to the same file.
    assert results_file.default_path(machine, "abc1234") == written
    results_file.write_section("sweep", {"runs": []}, None, commit="abc1234", machine=machine)
    data = json.loads(path.read_text())
    assert data["commit"] == "abc1234" and {"decode", "sweep"} <= set(data)
    assert results_file.slug("Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz") == "intel-xeon-gold-6338"


def _tiny_results(tmp_path) -> pathlib.Path:
    """A results file with one compare run and one sweep run of made-up times."""
    def result(name, kind, L, times):
        return {"shape": {"name": name, "label": name, "kind": kind, "B": 1, "H": 4, "L": L, "S": L, "D": 16,
                          "E": 64, "causal": False, "mask_given": False},
                "memory_bound": False, "best_peer": "numpy", "speedup": times["numpy"] / times["attnx"],
                "attnx_gflops": 1.0, "attnx_fraction_of_peak": 0.01, "attnx_fraction_of_fma_peak": 0.01,
                "speedup_per_round": 1.0,
                "libs": {n: {"status": "ok", "ok": True, "median_ms": t} for n, t in times.items()}}
    peaks = {"fma": {"gflops": 100.0, "by": "test"}, "gemm": {"gflops": 90.0, "by": "numpy", "n": 8},
             "read_bandwidth": {"gbs": 10.0, "by": "numpy max", "mib": 1}, "working_set_bandwidth": {}}
    runs = [{"threads": t, "peaks": peaks, "background_cpu_fraction": 0.0,
             "results": [result("tiny", "sdpa", 16, {"attnx": 1.0, "numpy": 2.0}),
                         result("mha-e64", "mha", 16, {"attnx": 1.0, "numpy": 3.0})]} for t in (1, 2)]
    sweep = [{"threads": t, "peaks": peaks, "results": [result(f"sweep-l{n}", "sdpa", n, {"attnx": n / 100, "numpy": n / 50})
                                                        for n in (64, 128)]} for t in (1, 2)]
    versions = {"attnx": "0", "numpy": "0"}
    data = {"date": "2000-01-01", "commit": "unknown", "build": "test", "machine": {"label": "test-cpu", "cpu_model": "test",
            "isa": "scalar", "cores": 2, "kernel": "0"},
            "compare": {"versions": versions, "runs": runs}, "sweep": {"versions": versions, "runs": sweep}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    return path


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    proc = run(["benchmarks/plot.py", str(_tiny_results(tmp_path)), "--out-dir", str(tmp_path / "plots")])
    assert proc.returncode == 0, proc.stderr
    for name in ("speedup-test-cpu.png", "sweep-test-cpu.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_prints_tables(tmp_path):
    proc = run(["benchmarks/report.py", str(_tiny_results(tmp_path))])
    assert proc.returncode == 0, proc.stderr
    assert "| sdpa" not in proc.stdout or "tiny" in proc.stdout
    assert proc.stdout.count("| tiny |") == 2 and "| 128 |" in proc.stdout


LAYER_SMOKE_SHAPES = ["encoder-layer-tiny", "encoder-stack-tiny", "decoder-step-tiny"]


@pytest.mark.slow
def test_compare_runs_transformer_layers(tmp_path):
    """compare.py end to end on small transformer cases: every library set up and checked
    against the float64 reference, timed in interleaved blocks, attnx's speed-up over each peer,
    the decoder step's two torch peers, and the table and results file carrying them."""
    import attnx

    if not hasattr(attnx, "TransformerDecoder"):
        pytest.skip("this build of attnx has no transformer modules")
    out = tmp_path / "run.json"
    proc = run(["benchmarks/compare.py", "--quick", "--threads", "1", "--rounds", "2", "--block-seconds", "0.01",
                "--pause-ms", "1", "--peak-gflops", "100", "--no-progress", "--shapes", *LAYER_SMOKE_SHAPES,
                "--out", str(out)], timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    data = json.loads(out.read_text("utf-8"))
    assert "compare" not in data  # a run of transformer layers alone has its own section
    (result,) = data["transformer"]["runs"]
    by_name = {r["shape"]["name"]: r for r in result["results"]}
    assert list(by_name) == LAYER_SMOKE_SHAPES
    for name, r in by_name.items():
        libs = r["libs"]
        assert libs["attnx"]["status"] == "ok" and libs["attnx"]["ok"], (name, libs["attnx"])
        for peer, entry in libs.items():
            # A peer that cannot run a case says why; none fails, none computes something else.
            assert entry["status"] in ("ok", "not installed", "unavailable", "n/a"), (name, peer, entry)
            if entry["status"] == "ok":
                assert entry["ok"] and entry["median_ms"] > 0 and entry["calls"] >= 2, (name, peer, entry)
        timed = {peer for peer, entry in libs.items() if peer != "attnx" and entry["status"] == "ok"}
        assert set(r["speedups"]) == timed, (name, r["speedups"])
        assert r["flops"] > 0 and r["attnx_fraction_of_peak"] > 0, name
    step = by_name["decoder-step-tiny"]
    assert step["memory_bound"] and step["bytes_of"] == "weights + K/V"
    assert not by_name["encoder-layer-tiny"]["memory_bound"]
    # The speed-up line names the peers that ran; with none installed there is nothing to compare.
    speedup_line = "decoder-step-tiny: attnx's speed-up over each peer"
    assert (speedup_line in proc.stdout) == bool(step["speedups"]), proc.stdout[-3000:]
    if importlib.util.find_spec("torch") is not None:
        assert speedup_line in proc.stdout
        assert {step["libs"]["torch-recompute"]["status"], step["libs"]["torch-cached"]["status"]} == {"ok"}
        assert by_name["encoder-layer-tiny"]["libs"]["torch"]["status"] == "ok"
        assert "torch-recompute ms" in proc.stdout and "torch-cached ms" in proc.stdout


RAGGED_SMOKE_SHAPES = ["varlen-tiny", "encoder-layer-ragged-tiny"]


@pytest.mark.slow
def test_compare_runs_ragged_batches(tmp_path):
    """compare.py end to end on the ragged batches' tiny cases: attnx's packed varlen_attention
    and its padded encoder layer checked at the real positions, each library's status one that
    says why it did not run, and attnx's speed-up over its own padded ("attnx-padded") and dense
    ("attnx-full") baselines reported in the results file and the printed report."""
    import attnx

    if not hasattr(attnx, "varlen_attention") or not hasattr(attnx, "TransformerEncoderLayer"):
        pytest.skip("this build of attnx has no varlen_attention or transformer modules")
    out = tmp_path / "run.json"
    proc = run(["benchmarks/compare.py", "--quick", "--threads", "1", "--rounds", "2", "--block-seconds", "0.01",
                "--pause-ms", "1", "--peak-gflops", "100", "--no-progress", "--shapes", *RAGGED_SMOKE_SHAPES,
                "--out", str(out)], timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    data = json.loads(out.read_text("utf-8"))
    assert "compare" not in data and "transformer" not in data  # the ragged cases have their own section
    (result,) = data["ragged"]["runs"]
    by_name = {r["shape"]["name"]: r for r in result["results"]}
    assert list(by_name) == RAGGED_SMOKE_SHAPES
    baselines = {"varlen-tiny": "attnx-padded", "encoder-layer-ragged-tiny": "attnx-full"}
    for name, r in by_name.items():
        libs = r["libs"]
        assert r["shape"]["ragged"] and len(r["shape"]["lengths"]) == r["shape"]["B"], r["shape"]
        assert libs["attnx"]["status"] == "ok" and libs["attnx"]["ok"], (name, libs["attnx"])
        for peer, entry in libs.items():
            assert entry["status"] in ("ok", "not installed", "unavailable", "n/a"), (name, peer, entry)
            if entry["status"] == "ok":
                assert entry["ok"] and entry["median_ms"] > 0 and entry["calls"] >= 2, (name, peer, entry)
        baseline = baselines[name]
        assert libs[baseline]["status"] == "ok", (name, libs[baseline])
        assert r["speedups"][baseline]["speedup"] > 0 and r["speedups"][baseline]["per_round"] > 0, r["speedups"]
        assert r["best_peer"] != baseline  # a baseline is never the best peer
        assert f"{name}: attnx's speed-up over each peer: " in proc.stdout and f"{baseline} " in proc.stdout
        # The real work only: fewer FLOPs than the padded batch's.
        s = r["shape"]
        padded = 4.0 * s["B"] * s["H"] * s["L"] * s["S"] * s["D"] / (2 if s["causal"] else 1)
        assert 0 < r["flops"] and (name != "varlen-tiny" or r["flops"] < padded), (name, r["flops"])
    assert {by_name["varlen-tiny"]["libs"][n]["status"] for n in ("onnxruntime", "openvino")} <= {
        "n/a", "not installed"}
    if importlib.util.find_spec("torch") is not None:
        assert by_name["varlen-tiny"]["libs"]["torch"]["status"] == "ok"
        torch_layer = by_name["encoder-layer-ragged-tiny"]["libs"]["torch"]
        assert torch_layer["status"] == "ok" and "enable_nested_tensor=True" in torch_layer["note"], torch_layer
