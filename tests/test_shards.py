"""The shards that CI runs a suite in (.ci/shards.sh): with ``ATTNX_TEST_CLAIMS``, pytest
processes side by side take their tests from one queue (``pytest_runtestloop`` in conftest.py),
and between them run each test exactly once, with module fixtures set up and torn down in each
process that uses them."""

from __future__ import annotations

import collections
import os
import pathlib
import subprocess
import sys

import attnx

TESTS_DIR = pathlib.Path(__file__).resolve().parent

# A module of tests that log which process ran them, and its module fixture's set-ups and
# tear-downs; the short sleep lets every shard take some.
SAMPLE = '''
import os, time
import pytest

LOG = os.environ["SHARD_SAMPLE_LOG"]


def log(line):
    with open(LOG, "a") as f:
        f.write(f"{line} {os.getpid()}\\n")


@pytest.fixture(scope="module")
def module_resource():
    log("setup")
    yield
    log("teardown")


@pytest.mark.parametrize("i", range(30))
def test_sample(i, module_resource):
    time.sleep(0.01)
    log(f"ran-{i}")
'''


def _run_shards(tmp_path, n, extra_env=None):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    claims = tmp_path / "claims"
    claims.mkdir()
    log = tmp_path / "log.txt"
    env = dict(os.environ, ATTNX_TEST_CLAIMS=str(claims), SHARD_SAMPLE_LOG=str(log))
    env.update(extra_env or {})
    # conftest.py as a plugin (the sample lies outside tests/, where pytest would not find it),
    # and the attnx this process imported.
    paths = [str(TESTS_DIR), str(pathlib.Path(attnx.__file__).resolve().parents[1]),
             env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
             "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
            env=dict(env, ATTNX_TEST_SHARD=f"{k}/{n}"), cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for k in range(n)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    codes = [p.returncode for p in procs]
    lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return codes, outputs, lines, claims


def test_shards_run_every_test_exactly_once(tmp_path):
    codes, outputs, lines, claims = _run_shards(tmp_path, 3)
    assert codes == [0, 0, 0], outputs
    ran = collections.Counter(what for what, _ in lines if what.startswith("ran-"))
    assert ran == {f"ran-{i}": 1 for i in range(30)}, (ran, outputs)
    # Each process that ran a test set the module fixture up once and tore it down once.
    by_pid = collections.defaultdict(list)
    for what, pid in lines:
        by_pid[pid].append(what)
    for pid, events in by_pid.items():
        assert events[0] == "setup" and events[-1] == "teardown", events
        assert events.count("setup") == 1 and events.count("teardown") == 1, events
    # What .ci/shards.sh checks: 30 claims, and each shard's count of the tests it collected.
    assert sorted(p.name for p in claims.iterdir() if p.name.isdigit()) == sorted(map(str, range(30)))
    collected = [p.read_text().strip() for p in claims.iterdir() if p.name.startswith("collected-")]
    assert collected == ["30"] * 3, collected


def test_without_claims_the_shards_are_dealt_in_advance(tmp_path):
    # ATTNX_TEST_SHARD alone: shard k keeps every n-th test from the k-th.
    codes, outputs, lines, _ = _run_shards(tmp_path, 2, {"ATTNX_TEST_CLAIMS": ""})
    assert codes == [0, 0], outputs
    ran = collections.defaultdict(set)
    for what, pid in lines:
        if what.startswith("ran-"):
            ran[pid].add(int(what[4:]))
    assert sorted(map(sorted, ran.values())) == [list(range(0, 30, 2)), list(range(1, 30, 2))]
