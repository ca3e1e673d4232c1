"""A load test for examples/serve_http.py: concurrent clients on this machine, one number each.

    python examples/load_test.py --port 8000 --clients 4 --requests 400 --duration 30
    python examples/load_test.py --port 8000 --clients 16 --format npy --json
    python examples/load_test.py --port 8000 --clients 4 --busy 1

Each client is a thread with its own keep-alive connection to 127.0.0.1 (never another
address); it sends the same request (a seeded query of ``--batch`` x ``--tokens`` x the served
``embed_dim``, self-attention) again and again. The test stops after ``--requests`` requests in
all or ``--duration`` seconds, whichever comes first, and reports the requests per second and the
latency percentiles (p50, p99) of the answered requests. The first answer is checked against
the query's shape. With ``--json`` the report is one JSON object on one line.

``--busy K`` starts K busy processes beside the server while the test runs (each a separate
Python process spinning a pure-Python loop at 100% of one core), to see the latency when other
work holds some of the cores; the report says how many were busy.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import subprocess
import sys
import threading
import time

import numpy as np

HOST = "127.0.0.1"


def request_body(embed_dim: int, batch: int, tokens: int, fmt: str, seed: int = 0):
    """(body, content type) of the request every client sends."""
    query = np.random.default_rng(seed).standard_normal((batch, tokens, embed_dim), dtype=np.float32)
    if fmt == "npy":
        buffer = io.BytesIO()
        np.save(buffer, query)
        return buffer.getvalue(), "application/x-npy"
    return json.dumps({"query": query.tolist()}).encode(), "application/json"


def check_answer(body: bytes, fmt: str, shape: tuple) -> None:
    out = np.load(io.BytesIO(body)) if fmt == "npy" else np.asarray(json.loads(body)["output"])
    if out.shape != shape:
        raise RuntimeError(f"the service answered shape {out.shape}, expected {shape}")


def percentile(sorted_values: list, q: float) -> float:
    """The q-th percentile (0..100) of sorted values, nearest rank."""
    if not sorted_values:
        return float("nan")
    rank = max(1, int(np.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


# A busy process: a pure-Python loop at 100% of one core. It says when it spins, and stops when
# its parent has gone (os.getppid() changes), so that a killed load test leaves no spinning
# orphans behind.
SPIN = """
import os, sys
parent = os.getppid()
sys.stdout.write("spinning\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(200000):
        pass
"""


@contextlib.contextmanager
def busy_processes(count: int):
    """Run `count` busy processes while the block runs; they are killed when it ends, also on an
    exception or Ctrl-C."""
    procs = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL))
        for proc in procs:
            if not proc.stdout.readline():
                raise RuntimeError(f"a busy process exited with status {proc.wait()}")
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
            proc.stdout.close()


def run(port: int, clients: int, requests: int, duration: float, batch: int = 1,
        tokens: int = 16, fmt: str = "json", timeout: float = 30.0, busy: int = 0) -> dict:
    """Run the load test against 127.0.0.1:port, beside `busy` busy processes; return the report
    as a dict."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    conn.close()
    embed_dim = health["config"]["embed_dim"]
    body, content_type = request_body(embed_dim, batch, tokens, fmt)
    headers = {"Content-Type": content_type}

    lock = threading.Lock()
    sent = 0
    latencies, errors = [], []

    def take_one() -> bool:
        nonlocal sent
        with lock:
            if sent >= requests or time.perf_counter() >= deadline:
                return False
            sent += 1
            return True

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
        mine = []
        try:
            while take_one():
                start = time.perf_counter()
                try:
                    connection.request("POST", "/attention", body=body, headers=headers)
                    response = connection.getresponse()
                    answer = response.read()
                except (OSError, http.client.HTTPException) as error:
                    connection.close()
                    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
                    with lock:
                        errors.append(f"{type(error).__name__}: {error}")
                    continue
                elapsed = time.perf_counter() - start
                if response.status != 200:
                    with lock:
                        errors.append(f"status {response.status}: {answer[:200]!r}")
                    continue
                if index == 0 and not mine:
                    try:
                        check_answer(answer, fmt, (batch, tokens, embed_dim))
                    except (RuntimeError, ValueError, KeyError) as error:
                        with lock:
                            errors.append(str(error))
                        continue
                mine.append(elapsed)
        finally:
            connection.close()
            with lock:
                latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    with busy_processes(busy):
        # The deadline counts from here: starting the busy processes is not part of the test.
        deadline = time.perf_counter() + duration
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
    latencies.sort()
    return {
        "clients": clients,
        "busy_processes": busy,
        "requests": len(latencies),
        "errors": len(errors),
        "seconds": round(seconds, 3),
        "requests_per_s": round(len(latencies) / seconds, 1) if seconds > 0 else 0.0,
        "p50_ms": round(percentile(latencies, 50) * 1e3, 3),
        "p99_ms": round(percentile(latencies, 99) * 1e3, 3),
        "format": fmt,
        "shape": [batch, tokens, embed_dim],
        "server": health["config"],
        "first_errors": errors[:3],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="the service's port on 127.0.0.1")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=1000, help="stop after this many requests")
    parser.add_argument("--duration", type=float, default=30.0, help="or after this many seconds")
    parser.add_argument("--batch", type=int, default=1, help="sequences per request")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--format", choices=["json", "npy"], default="json")
    parser.add_argument("--busy", type=int, default=0, metavar="K",
                        help="busy processes (each spinning on one core) beside the server during the test")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.duration <= 0 or args.busy < 0:
        parser.error("--clients and --requests must be >= 1, --duration > 0 and --busy >= 0")

    report = run(args.port, args.clients, args.requests, args.duration, args.batch, args.tokens,
                 args.format, busy=args.busy)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['requests']} requests ({report['errors']} errors) in {report['seconds']} s "
              f"from {report['clients']} clients: {report['requests_per_s']} requests/s, "
              f"p50 {report['p50_ms']} ms, p99 {report['p99_ms']} ms; "
              f"{report['busy_processes']} busy process(es) beside the server")
        for error in report["first_errors"]:
            print("  error:", error)
    return 0 if report["errors"] == 0 and report["requests"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
