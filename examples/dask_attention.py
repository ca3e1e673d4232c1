"""Batched attention over a large dask.array, computed by attnx on dask.distributed workers.

    python examples/dask_attention.py                  # a LocalCluster: 2 processes x 1 thread
    python examples/dask_attention.py --scheduler tcp://host:8786 --batch 20000

Where one machine is not enough, attnx runs inside the distributed engine you already have: the
batch axis of a dask array is cut into chunks, and each worker calls attnx on its chunks with
``map_blocks``. Every chunk must hold whole sequences (all tokens, all features), so chunk the
batch axis only.

- ``self_attention``: a ``MultiheadAttention`` layer over (batch, tokens, features). The module
  object is an argument of ``map_blocks``, so it travels to the workers inside the task graph,
  by pickling (attnx modules pickle and unpickle: the parameters are NumPy arrays).
- ``sdpa``: ``attnx.scaled_dot_product_attention`` over (batch, heads, tokens, features) arrays,
  chunked over batch and heads.

Each worker process runs its own attnx with its own threads: size them so that
workers x threads <= cores (``LocalCluster(n_workers, threads_per_worker)``; dask.distributed
sets OMP_NUM_THREADS to the worker's thread count, which attnx follows). ``main`` checks the
distributed result against the same computation in this process.
"""

from __future__ import annotations

import argparse
import sys
import time

import dask.array as da
import numpy as np

import attnx


def _self_attention_block(block: np.ndarray, module: attnx.MultiheadAttention) -> np.ndarray:
    # Runs on a worker, on one chunk of whole sequences: (chunk, tokens, features).
    out, _ = module(block, block, block, need_weights=False)
    return out


def self_attention(x: da.Array, module: attnx.MultiheadAttention) -> da.Array:
    """``module(x, x, x)[0]`` for a batch-first (batch, tokens, features) dask array, lazily.

    Chunks of ``x`` along tokens and features are merged first (a chunk is whole sequences).
    """
    if not module.batch_first:
        raise ValueError("self_attention expects a batch_first module (batch, tokens, features)")
    x = x.rechunk({1: -1, 2: -1})
    return x.map_blocks(_self_attention_block, module, dtype=module.dtype,
                        meta=np.empty((0, 0, 0), module.dtype))


def sdpa(query: da.Array, key: da.Array, value: da.Array, **kwargs) -> da.Array:
    """``attnx.scaled_dot_product_attention`` on (batch, heads, tokens, features) dask arrays.

    The three arrays are chunked alike over batch and heads; tokens and features are merged.
    ``kwargs`` (``is_causal``, ``scale``, ...) go to attnx.
    """
    chunks = {0: query.chunks[0], 1: query.chunks[1], 2: -1, 3: -1}
    query, key, value = (a.rechunk(chunks) for a in (query, key, value))
    return da.map_blocks(attnx.scaled_dot_product_attention, query, key, value,
                         dtype=query.dtype, meta=np.empty((0, 0, 0, 0), query.dtype), **kwargs)


def inputs(batch: int, tokens: int, width: int, heads: int, chunk: int, seed: int = 0):
    """Random float32 inputs made chunk by chunk where they are computed (never in one piece).

    Returns the (batch, tokens, width) sequences and (query, key, value) of shape
    (batch, heads, tokens, width // heads), all chunked by ``chunk`` along the batch.
    """
    rng = da.random.default_rng(seed)
    x = rng.standard_normal((batch, tokens, width), chunks=(chunk, -1, -1), dtype=np.float32)
    shape = (batch, heads, tokens, width // heads)
    qkv = [rng.standard_normal(shape, chunks=(chunk, 1, -1, -1), dtype=np.float32) for _ in range(3)]
    return x, qkv


def run(client, batch: int = 512, tokens: int = 64, width: int = 128, heads: int = 8,
        chunk: int = 64, seed: int = 0) -> dict:
    """Compute both examples on ``client``'s cluster and in this process; compare.

    Returns the distributed results and their single-process twins as NumPy arrays.
    """
    module = attnx.MultiheadAttention(width, heads, batch_first=True, seed=seed)
    x, (q, k, v) = inputs(batch, tokens, width, heads, chunk, seed)
    y = self_attention(x, module)
    o = sdpa(q, k, v, is_causal=True)
    # One compute for everything: the inputs come back too, for the single-process check.
    x_np, q_np, k_np, v_np, y_np, o_np = client.compute([x, q, k, v, y, o], sync=True)
    return {
        "self_attention": (y_np, module(x_np, x_np, x_np, need_weights=False)[0]),
        "sdpa": (o_np, attnx.scaled_dot_product_attention(q_np, k_np, v_np, is_causal=True)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="address of a running dask scheduler (default: a LocalCluster)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=64, help="sequences per chunk")
    args = parser.parse_args(argv)

    from dask.distributed import Client, LocalCluster

    if args.scheduler:
        client = Client(args.scheduler)
    else:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=args.threads_per_worker,
                               processes=True, dashboard_address=None)
        client = Client(cluster)
    with client:
        threads = client.run(attnx.get_num_threads)
        print(f"workers (attnx threads): {threads}")
        start = time.perf_counter()
        results = run(client, args.batch, args.tokens, args.width, args.heads, args.chunk)
        print(f"computed in {time.perf_counter() - start:.2f} s")
    same = True
    for name, (distributed, local) in results.items():
        equal = np.array_equal(distributed, local)
        same &= equal
        print(f"{name}: shape {distributed.shape}, equal to the single-process result: {equal}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
