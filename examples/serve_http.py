"""An HTTP inference service for one attention layer, on NumPy, attnx and the standard library.

    python examples/serve_http.py --weights model.npz --create      # make seeded weights, serve
    python examples/serve_http.py --weights model.npz --port 8000 --processes 2 --threads 1
    python examples/serve_http.py --weights attention.safetensors   # weights exported from torch

The layer is an ``attnx.MultiheadAttention`` (batch-first) whose weights come from a file: an
``.npz`` or a ``.safetensors`` file holding a torch-style state_dict (``in_proj_weight``,
``out_proj.weight``, ...) and the layer's config (``embed_dim``, ``num_heads``) as JSON, in the
npz under the key ``config``, in the safetensors metadata. ``--create`` writes such a file from
a seeded module first (safetensors needs the ``safetensors`` package; npz does not).

Endpoints:

- ``GET /health``: ``{"status": "ok", "config": {...}, "attnx": show_config()}``.
- ``POST /attention`` with ``Content-Type: application/json``: ``{"query": [...]}``, a
  ``(batch, tokens, embed_dim)`` or ``(tokens, embed_dim)`` nested list, and optionally
  ``"key"`` and ``"value"`` (default: self-attention over the query), ``"key_padding_mask"``
  (bool, True = ignore that key) and ``"is_causal"``. Answers ``{"output": [...], "shape":
  [...]}``.
- ``POST /attention`` with ``Content-Type: application/x-npy``: the query as an ``.npy`` file
  (``np.save``), self-attention; answers the output as an ``.npy`` file. No JSON to parse.

Bad requests get status 400 and ``{"error": "..."}``.

Workers: ``--processes P`` processes each serve the same listening socket (forked before any
attention is computed), and each answers requests on a thread per connection; ``--threads T``
sets attnx's threads per process. attnx releases the GIL while it computes, so a process's
request threads compute side by side: size ``P x T`` (and the concurrent requests) to the cores.
The server listens on 127.0.0.1 unless ``--host`` says otherwise. It prints
``serving on http://HOST:PORT`` once it listens, and stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

import attnx


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def save_weights(path: str, module: attnx.MultiheadAttention) -> None:
    """Write ``module``'s state_dict and config to an .npz or .safetensors file."""
    config = {"embed_dim": module.embed_dim, "num_heads": module.num_heads}
    state = {name: np.ascontiguousarray(array) for name, array in module.state_dict().items()}
    if path.endswith(".safetensors"):
        from safetensors.numpy import save_file

        save_file(state, path, metadata={"config": json.dumps(config)})
    else:
        np.savez(path, config=np.array(json.dumps(config)), **state)


def load_module(path: str) -> attnx.MultiheadAttention:
    """A batch-first ``MultiheadAttention`` with the weights and config of ``path``."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        from safetensors.numpy import load_file

        with safe_open(path, framework="numpy") as f:
            config = json.loads(f.metadata()["config"])
        state = load_file(path)
    else:
        with np.load(path, allow_pickle=False) as f:
            state = {name: f[name] for name in f.files}
        config = json.loads(str(state.pop("config")))
    dtype = state["out_proj.weight"].dtype
    module = attnx.MultiheadAttention(config["embed_dim"], config["num_heads"], batch_first=True,
                                      bias="in_proj_bias" in state, add_bias_kv="bias_k" in state,
                                      dtype=dtype)
    module.load_state_dict(state)
    return module


# --------------------------------------------------------------------------------------------
# The service
# --------------------------------------------------------------------------------------------


class BadRequest(ValueError):
    pass


def attend(module: attnx.MultiheadAttention, request: dict) -> np.ndarray:
    """The layer's output for one decoded JSON request (see the module docstring)."""
    if not isinstance(request, dict) or "query" not in request:
        raise BadRequest('the body must be a JSON object with a "query"')
    query = np.asarray(request["query"], dtype=module.dtype)
    key = np.asarray(request.get("key", query), dtype=module.dtype)
    value = np.asarray(request.get("value", key), dtype=module.dtype)
    mask = request.get("key_padding_mask")
    mask = None if mask is None else np.asarray(mask, dtype=bool)
    out, _ = module(query, key, value, key_padding_mask=mask, need_weights=False,
                    is_causal=bool(request.get("is_causal", False)))
    return out


def make_handler(module: attnx.MultiheadAttention, config: dict):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection
        # Headers and body go out in separate writes: without this, Nagle's algorithm holds the
        # body back until the client's delayed ACK, about 40 ms a response.
        disable_nagle_algorithm = True

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode())

        def do_GET(self):
            if self.path == "/health":  # show_config() of this worker: its threads
                health = {"status": "ok", "config": config, "attnx": attnx.show_config()}
                self._send(200, json.dumps(health).encode())
            else:
                self._error(404, f"no such path: {self.path}")

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if self.path != "/attention":
                return self._error(404, f"no such path: {self.path}")
            content_type = (self.headers.get("Content-Type") or "application/json").split(";")[0]
            try:
                if content_type == "application/x-npy":
                    query = np.load(io.BytesIO(body), allow_pickle=False)
                    out, _ = module(query, query, query, need_weights=False)
                    buffer = io.BytesIO()
                    np.save(buffer, out)
                    return self._send(200, buffer.getvalue(), "application/x-npy")
                out = attend(module, json.loads(body))
            except (ValueError, TypeError) as error:  # attnx's argument errors, bad JSON
                return self._error(400, f"{type(error).__name__}: {error}")
            self._send(200, json.dumps({"output": out.tolist(), "shape": list(out.shape)}).encode())

        def log_message(self, format, *args):  # one line per request is too many under load
            pass

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


def serve(server: Server, threads: int | None) -> None:
    """One worker process: set attnx's threads, answer requests until SIGTERM or SIGINT."""
    if threads:
        attnx.set_num_threads(threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", required=True, help="an .npz or .safetensors file")
    parser.add_argument("--create", action="store_true",
                        help="first write seeded weights to --weights (overwriting it)")
    parser.add_argument("--embed-dim", type=int, default=256, help="with --create")
    parser.add_argument("--num-heads", type=int, default=4, help="with --create")
    parser.add_argument("--seed", type=int, default=0, help="with --create")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--processes", type=int, default=1, help="worker processes")
    parser.add_argument("--threads", type=int, default=None,
                        help="attnx threads per process (default: OMP_NUM_THREADS, else all cores)")
    args = parser.parse_args(argv)

    if args.create:
        save_weights(args.weights, attnx.MultiheadAttention(
            args.embed_dim, args.num_heads, batch_first=True, seed=args.seed))
    module = load_module(args.weights)
    config = {"embed_dim": module.embed_dim, "num_heads": module.num_heads,
              "dtype": str(module.dtype), "processes": args.processes, "threads": args.threads}
    # The socket is bound here and shared by every worker; no attention has run in this process
    # yet, so forked workers get attnx's full thread count.
    server = Server((args.host, args.port), make_handler(module, config))
    host, port = server.server_address[:2]
    print(f"serving on http://{host}:{port}", flush=True)
    if args.processes <= 1:
        serve(server, args.threads)
        return 0

    children = []
    for _ in range(args.processes):
        pid = os.fork()
        if pid == 0:  # a worker
            serve(server, args.threads)
            os._exit(0)
        children.append(pid)
    server.server_close()  # the workers hold the socket

    def stop(*_):
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for pid in children:
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
