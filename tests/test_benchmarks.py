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
            "benchmarks/report.py", "benchmarks/contention.py"} <= scripts, scripts
    assert "PYTHONPATH=" not in README.read_text("utf-8")  # the installed attnx is the one timed


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_starts(command):
    words = shlex.split(command)
    proc = run([*words[1:], "--help"])
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "usage:" in proc.stdout


def test_results_files_are_one_per_machine_each_section_dated():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    # results/ holds the current runs, which benchmarks/README.md cites; older ones live in git's
    # history.
    readme = (RESULTS.parent / "README.md").read_text("utf-8")
    for path in files:
        assert path.name in readme, f"{path.name} is not cited by benchmarks/README.md"
        data = json.loads(path.read_text("utf-8"))
        assert path.name == f"{data['machine']['label']}.json", path.name
        assert data["machine"]["cpu_model"] and data["machine"]["cores"] >= 1
        sections = {k: v for k, v in data.items() if k not in ("machine", "peaks")}
        # A benchmark's section, or one of its variants ("compare-bfloat16", "decode-bfloat16").
        kinds = {"compare", "transformer", "ragged", "decode", "sweep", "paged", "contention", "scaling_quick"}
        assert sections and all(k.split("-")[0] in kinds for k in sections), sorted(data)
        for key, section in sections.items():
            assert re.fullmatch(r"[0-9a-f]{7,12}", section["commit"]), (path.name, key, section["commit"])
            assert re.fullmatch(r"\d{4}-\d\d-\d\d .*", section["date"]), (path.name, key, section["date"])
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
    path = pathlib.Path(results_file.default_path(machine))
    assert path.name == "some-cpu-avx2-2core.json", path.name
    written = results_file.write_section("decode", {"run": {}}, None, commit="abc1234", machine=machine)
    assert written == str(path)
    # A later run on the same machine, of another build, adds its section to the same file, and a
    # section run again replaces the old one.
    results_file.write_section("sweep", {"runs": []}, None, commit="def5678", machine=machine)
    results_file.write_section("decode", {"run": {"x": 1}}, None, commit="def5678", machine=machine)
    data = json.loads(path.read_text())
    assert list(data) == ["machine", "decode", "sweep"], list(data)
    assert data["decode"]["commit"] == "def5678" and data["decode"]["run"] == {"x": 1}
    assert data["sweep"]["commit"] == "def5678"
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
    stamp = {"date": "2000-01-01 00:00:00 UTC", "commit": "abc1234"}
    data = {"machine": {"label": "test-cpu", "cpu_model": "test", "isa": "scalar", "cores": 2, "kernel": "0"},
            "compare": {**stamp, "versions": versions, "runs": runs},
            "sweep": {**stamp, "versions": versions, "runs": sweep}}
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


def _contention_results(tmp_path) -> pathlib.Path:
    """A results file with a contention section of made-up latencies: two shapes, attnx and torch
    (not installed for one), 1 and 2 threads, quiet and beside one busy process."""
    def stats(ms):
        return {"p50_ms": ms, "p99_ms": 3 * ms, "mean_ms": 1.5 * ms, "min_ms": ms / 2, "max_ms": 4 * ms, "calls": 200,
                "calls_per_block": 20}

    def result(name, kind, ms, threads):
        shape = {"name": name, "label": f"{name} label", "kind": kind, "B": 1, "H": 4, "L": 16, "S": 16, "D": 16,
                 "E": 64, "causal": False, "mask_given": False}
        libs = {"attnx": {"status": "ok", "ok": True}, "torch": {"status": "ok", "ok": True}}
        loads = [{"busy": k, "background_cpu_fraction": 0.5 * k,
                  "libs": {"attnx": stats(ms * (1 + k) * threads), "torch": stats(2 * ms * (1 + k))}} for k in (0, 1)]
        if kind == "mha":
            libs["torch"] = {"status": "not installed", "note": "no torch"}
            for load in loads:
                del load["libs"]["torch"]
        return {"shape": shape, "libs": libs, "loads": loads}

    runs = [{"threads": t, "results": [result("tiny", "sdpa", 0.004, t), result("mha-e64", "mha", 0.02, t)]}
            for t in (1, 2)]
    section = {"date": "2000-01-01 00:00:00 UTC", "commit": "abc1234",
               "machine": {"cpu_model": "test", "cores": 2}, "versions": {"attnx": "0", "numpy": "0", "torch": "0"},
               "config": {"threads": [1, 2], "busy": [0, 1], "seconds": 3.0, "calls": None, "min_calls": 200,
                          "rounds": 10}, "runs": runs}
    data = {"machine": {"label": "test-cpu", "cpu_model": "test", "isa": "scalar", "cores": 2, "kernel": "0"},
            "contention": section}
    path = tmp_path / "contention.json"
    path.write_text(json.dumps(data))
    return path


def test_report_prints_contention_tables(tmp_path):
    proc = run(["benchmarks/report.py", str(_contention_results(tmp_path))])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "## quiet" in out and "## 1 busy process" in out, out
    assert "| attnx p50 2t / 1t | attnx p99 2t / 1t | torch p50 2t / 1t | torch p99 2t / 1t |" in out, out
    # attnx's made-up times double from 1 to 2 threads, torch's do not change.
    assert "| tiny label | 0.004 / 0.012 | 0.008 / 0.024 | 0.008 / 0.024 | 0.008 / 0.024 | 2.00 | 2.00 | 1.00 | 1.00 |" in out
    assert "| mha-e64 label | 0.02 / 0.06 | 0.04 / 0.12 | not installed | not installed | 2.00 | 2.00 | - | - |" in out


def test_plot_draws_contention(tmp_path):
    pytest.importorskip("matplotlib")
    proc = run(["benchmarks/plot.py", str(_contention_results(tmp_path)), "--out-dir", str(tmp_path / "plots")])
    assert proc.returncode == 0, proc.stderr
    for name in ("contention-test-cpu-quiet.png", "contention-test-cpu-busy1.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_contention_prints_p50_and_p99(tmp_path):
    """contention.py end to end on the tiny sdpa case: 1 and 2 threads, each in its worker, quiet
    and beside one busy process; the table of each load gives p50 / p99 per thread count and the
    2-thread / 1-thread ratios, and no busy process outlives the run."""
    proc = run(["benchmarks/contention.py", "--quick", "--threads", "1", "2", "--busy", "0", "1", "--shapes", "tiny",
                "--libs", "attnx", "--no-save", "--no-progress"], timeout=120)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    out = proc.stdout
    number = r"[0-9.e+-]+"
    row = re.compile(rf"^\| sdpa B1 H4 L16 S16 D16 \| ({number}) / ({number}) \| ({number}) / ({number}) \| "
                     rf"({number}) \| ({number}) \|$", re.M)
    for load in ("## quiet", "## 1 busy process"):
        assert load in out, out
        table = out.split(load, 1)[1]
        assert "| shape | attnx 1t p50 / p99 ms | attnx 2t p50 / p99 ms | attnx p50 2t / 1t | attnx p99 2t / 1t |" in table
        match = row.search(table)
        assert match, table
        p50_1, p99_1, p50_2, p99_2, ratio50, ratio99 = map(float, match.groups())
        assert 0 < p50_1 <= p99_1 and 0 < p50_2 <= p99_2, match.group(0)
        assert ratio50 > 0 and ratio99 > 0
    assert "wrote" not in out  # --no-save
    # The busy processes are killed with their worker (their loop is timing.py's _SPIN).
    spinning = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"os.getppid() == parent" in cmdline.read_bytes():
                spinning.append(cmdline.parent.name)
        except OSError:
            pass
    assert not spinning, spinning


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
