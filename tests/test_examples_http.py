"""examples/serve_http.py and examples/load_test.py: the service answers what attnx computes.

The service runs as its own process on 127.0.0.1, on a port the system picks, with two worker
processes of one thread; it is stopped (SIGTERM) at the end, and every wait is bounded.
"""

from __future__ import annotations

import http.client
import importlib.util
import io
import json
import pathlib
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import attnx

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
HOST = "127.0.0.1"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """(port, weights path) of a running service; stopped and reaped afterwards."""
    weights = tmp_path_factory.mktemp("service") / "model.npz"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "serve_http.py"), "--weights", str(weights), "--create",
         "--embed-dim", "32", "--num-heads", "4", "--seed", "7", "--host", HOST, "--port", "0",
         "--processes", "2", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith(f"serving on http://{HOST}:"), (line, proc.poll())
        yield int(line.rsplit(":", 1)[1]), weights
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise
        finally:
            proc.stdout.close()
            proc.stderr.close()


def call(port: int, method: str, path: str, body: bytes | None = None,
         content_type: str = "application/json"):
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": content_type})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def expected_module() -> attnx.MultiheadAttention:
    # What --create wrote: a seeded batch-first module.
    return attnx.MultiheadAttention(32, 4, batch_first=True, seed=7)


def test_health_reports_the_layer_and_each_worker_has_its_threads(service):
    port, _ = service
    status, body = call(port, "GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok"
    assert health["config"]["embed_dim"] == 32 and health["config"]["num_heads"] == 4
    assert health["attnx"]["threads"] == 1


def test_json_request_answers_the_layers_output(service):
    port, _ = service
    rng = np.random.default_rng(0)
    query = rng.standard_normal((2, 5, 32), dtype=np.float32)
    key = rng.standard_normal((2, 7, 32), dtype=np.float32)
    padding = np.zeros((2, 7), dtype=bool)
    padding[1, 4:] = True
    request = {"query": query.tolist(), "key": key.tolist(), "value": key.tolist(),
               "key_padding_mask": padding.tolist()}
    status, body = call(port, "POST", "/attention", json.dumps(request).encode())
    assert status == 200, body
    answer = json.loads(body)
    output = np.asarray(answer["output"], dtype=np.float32)
    assert answer["shape"] == [2, 5, 32]

    module = expected_module()
    mine, _ = module(query, key, key, key_padding_mask=padding, need_weights=False)
    np.testing.assert_array_equal(output, mine)  # float32 survives JSON exactly
    # And against the float64 NumPy reference, sequence-first as torch's function.
    p = {name: None if a is None else a.astype(np.float64) for name, a in module.state_dict().items()}
    reference, _ = attnx.reference.multi_head_attention_forward(
        query.astype(np.float64).transpose(1, 0, 2), key.astype(np.float64).transpose(1, 0, 2),
        key.astype(np.float64).transpose(1, 0, 2), 32, 4, p["in_proj_weight"], p["in_proj_bias"],
        None, None, False, 0.0, p["out_proj.weight"], p["out_proj.bias"], training=False,
        key_padding_mask=padding, need_weights=False)
    np.testing.assert_allclose(output, reference.transpose(1, 0, 2), rtol=1e-5, atol=1e-5)


def test_causal_json_and_npy_requests(service):
    port, _ = service
    query = np.random.default_rng(1).standard_normal((3, 6, 32), dtype=np.float32)
    module = expected_module()

    status, body = call(port, "POST", "/attention",
                        json.dumps({"query": query.tolist(), "is_causal": True}).encode())
    assert status == 200, body
    causal, _ = module(query, query, query, is_causal=True, need_weights=False)
    np.testing.assert_array_equal(np.asarray(json.loads(body)["output"], np.float32), causal)

    buffer = io.BytesIO()
    np.save(buffer, query)
    status, body = call(port, "POST", "/attention", buffer.getvalue(), "application/x-npy")
    assert status == 200, body
    output = np.load(io.BytesIO(body), allow_pickle=False)
    assert output.dtype == np.float32
    np.testing.assert_array_equal(output, module(query, query, query, need_weights=False)[0])


def test_bad_requests_get_400_with_attnxs_message(service):
    port, _ = service
    status, body = call(port, "POST", "/attention", json.dumps({"query": [[1.0, 2.0]]}).encode())
    assert status == 400 and "embed_dim" in json.loads(body)["error"]
    status, body = call(port, "POST", "/attention", b"not json")
    assert status == 400
    status, body = call(port, "POST", "/attention", json.dumps([1, 2]).encode())
    assert status == 400 and "query" in json.loads(body)["error"]
    assert call(port, "GET", "/nowhere")[0] == 404


@pytest.mark.parametrize("fmt", ["json", "npy"])
def test_load_test_runs_and_reports(service, fmt):
    port, _ = service
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "load_test.py"), "--port", str(port), "--clients", "4",
         "--requests", "20", "--duration", "60", "--tokens", "8", "--format", fmt, "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["requests"] == 20 and report["errors"] == 0 and report["clients"] == 4
    assert report["requests_per_s"] > 0
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    assert report["shape"] == [1, 8, 32] and report["server"]["embed_dim"] == 32
    assert report["busy_processes"] == 0


def test_load_test_beside_a_busy_process(service):
    port, _ = service
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "load_test.py"), "--port", str(port), "--clients", "2",
         "--requests", "10", "--duration", "60", "--tokens", "4", "--busy", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 requests (0 errors)" in proc.stdout and "1 busy process(es) beside the server" in proc.stdout


def test_load_test_stops_at_its_duration(service):
    port, _ = service
    start = time.perf_counter()
    report = load_example("load_test").run(port, clients=2, requests=10**9, duration=0.5, tokens=4)
    assert time.perf_counter() - start < 30
    assert report["errors"] == 0 and 0 < report["requests"] < 10**9


def test_weights_files_round_trip(tmp_path):
    serve_http = load_example("serve_http")
    module = attnx.MultiheadAttention(16, 2, batch_first=True, seed=3)
    x = np.random.default_rng(2).standard_normal((2, 3, 16), dtype=np.float32)
    suffixes = [".npz"] + ([".safetensors"] if importlib.util.find_spec("safetensors") else [])
    for suffix in suffixes:
        path = str(tmp_path / f"layer{suffix}")
        serve_http.save_weights(path, module)
        loaded = serve_http.load_module(path)
        assert (loaded.embed_dim, loaded.num_heads, loaded.batch_first) == (16, 2, True)
        np.testing.assert_array_equal(loaded(x, x, x)[0], module(x, x, x)[0], err_msg=suffix)
