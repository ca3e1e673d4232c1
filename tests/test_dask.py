"""examples/dask_attention.py: attnx on dask.distributed workers equals attnx in one process.

A LocalCluster of 2 worker processes x 1 thread. Skipped only when dask or distributed is not
installed (CI installs them).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import attnx  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

pytestmark = [
    # distributed's own start-up and shutdown chatter, not attnx's.
    pytest.mark.filterwarnings("ignore:Port .* is already in use:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*unclosed.*:ResourceWarning"),
]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("dask_attention", EXAMPLES / "dask_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def client():
    # The workers import the example module by name, as they would any installed code.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(EXAMPLES)] + ([path] if path else []))
    try:
        cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
        )
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path
    with cluster, distributed.Client(cluster) as c:
        yield c


def test_workers_are_other_processes_with_one_attnx_thread(client):
    pids = client.run(os.getpid)
    assert len(pids) == 2 and os.getpid() not in pids.values()
    assert len(set(pids.values())) == 2
    # dask.distributed sets OMP_NUM_THREADS to the worker's thread count; attnx follows it.
    assert set(client.run(attnx.get_num_threads).values()) == {1}


def test_distributed_result_equals_single_process(client, example):
    results = example.run(client, batch=96, tokens=24, width=32, heads=4, chunk=16)
    for name, (distributed_result, local) in results.items():
        assert distributed_result.dtype == np.float32, name
        assert distributed_result.shape == local.shape, name
        np.testing.assert_array_equal(distributed_result, local, err_msg=name)
    assert results["self_attention"][0].shape == (96, 24, 32)
    assert results["sdpa"][0].shape == (96, 4, 24, 8)


def test_module_reaches_a_worker_intact(client):
    # Sent as a task argument, the module is pickled here and unpickled in a worker process.
    module = attnx.MultiheadAttention(16, 2, add_bias_kv=True, batch_first=True, seed=3)
    pid, text, state = client.submit(lambda m: (os.getpid(), repr(m), m.state_dict()), module).result()
    assert pid != os.getpid()
    assert text == repr(module)
    local = module.state_dict()
    assert list(state) == list(local)
    for key in local:
        assert state[key].dtype == local[key].dtype, key
        np.testing.assert_array_equal(state[key], local[key], err_msg=key)


def test_rejects_sequence_first_module(example):
    import dask.array as da

    module = attnx.MultiheadAttention(8, 2, batch_first=False)
    with pytest.raises(ValueError, match="batch_first"):
        example.self_attention(da.zeros((4, 3, 8), chunks=2), module)


def test_example_script_runs():
    # The script as documented, with its own LocalCluster (2 processes x 1 thread).
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "dask_attention.py"), "--batch", "64", "--chunk", "16",
         "--tokens", "16", "--width", "32", "--heads", "4"],
        capture_output=True, text=True, timeout=180, cwd=EXAMPLES.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "self_attention: shape (64, 16, 32), equal to the single-process result: True" in proc.stdout
    assert "sdpa: shape (64, 4, 16, 8), equal to the single-process result: True" in proc.stdout
