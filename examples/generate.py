"""Greedy generation from a Llama-architecture decoder: a paged KV cache and continuous batching.

    python examples/generate.py                          # build, serve, compare with transformers
    python examples/generate.py --layers 4 --requests 16 --max-new-tokens 32 --cache-dtype float16
    python examples/generate.py --no-check --threads 2   # serving only: tokens per second

A small model of Llama's architecture (grouped-query attention, rotary embeddings with Llama 3's
frequency scaling, RMSNorm, a SwiGLU MLP) is made with random weights and saved as safetensors:
by transformers' ``LlamaForCausalLM`` where transformers and torch are installed, by NumPy under
the same state_dict keys where not. Nothing is downloaded.

The model is then served with NumPy and attnx alone (``load_model``): NumPy matmuls for the
projections and the MLP, ``attnx.paged_attention`` with an ``attnx.RotaryEmbedding`` for the
attention, one ``attnx.PagedKVCache`` per layer. ``serve`` runs the requests with continuous
batching: requests arrive at different steps; each step packs the prompt chunks of new requests
(at most ``--prefill-chunk`` prompt tokens a step, so a long prompt never stalls the decoding of
the others) and one decode row of every running request into one ``paged_attention`` call per
layer; a request that has its tokens leaves the cache at once, freeing its blocks. Requests 0
and 1 have the same prompt: it is prefilled once (all but its last token) and forked, so both
read the same blocks.

``--check`` compares every request's greedy tokens with transformers' ``generate``
(``do_sample=False``) of the same weights and exits 1 on a difference; by default the comparison
runs where transformers is installed (``--no-check``: never). A float32 cache must give
transformers' tokens exactly; a float16, bfloat16 or int8 cache rounds the keys and values, so
its tokens may differ where two logits are close: the example then prints the logits' error
instead of failing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

import attnx

# The model: a small Llama 3 (transformers' LlamaConfig fields). Llama 3's rope scaling divides
# the frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor by
# `factor` and blends those between the two limits; a short original length puts the frequencies
# of this small model in all three bands.
CONFIG = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,        # 4 query heads share each key/value head
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64},
    "initializer_range": 0.05,       # random weights large enough that logits rarely tie
    "tie_word_embeddings": False,
    "bos_token_id": None,            # no end-of-sequence token: every request runs to its limit
    "eos_token_id": None,
    "pad_token_id": None,
}


# --------------------------------------------------------------------------------------------
# The model file: made by transformers where installed, by NumPy where not
# --------------------------------------------------------------------------------------------


def make_model(path: str, config: dict, seed: int) -> str:
    """Writes a randomly initialised model to ``path`` (safetensors, the config as JSON in its
    metadata) and returns which library made it."""
    from safetensors.numpy import save_file

    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        weights, maker = numpy_weights(config, seed), "numpy"
    else:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**config))
        weights = {k: t.detach().numpy().copy() for k, t in model.state_dict().items()}
        maker = "transformers"
    save_file(weights, path, metadata={"config": json.dumps(config)})
    return maker


def numpy_weights(config: dict, seed: int) -> dict:
    """Random weights under LlamaForCausalLM's state_dict keys (Linear weights are (out, in))."""
    rng = np.random.default_rng(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def normal(*shape):
        return (rng.standard_normal(shape) * config["initializer_range"]).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], h),
               "model.norm.weight": np.ones(h, np.float32),
               "lm_head.weight": normal(config["vocab_size"], h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32)})
    return weights


# --------------------------------------------------------------------------------------------
# Serving: NumPy and attnx only
# --------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), with sigmoid written through tanh: no overflow for large |x|.
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


class Llama:
    """The decoder's forward pass over packed rows, reading and extending paged caches."""

    def __init__(self, config: dict, weights: dict):
        self.config = config
        self.eps = config["rms_norm_eps"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["head_dim"]
        # Linear weights transposed once, to (in, out): each projection is then `x @ w`.
        self.w = {k: np.ascontiguousarray(v.T) if v.ndim == 2 and "embed" not in k else v
                  for k, v in weights.items()}
        rope = dict(config["rope_parameters"])
        self.rope = attnx.RotaryEmbedding(self.head_dim, rope.pop("rope_theta"), scaling=rope)

    def new_caches(self, num_blocks: int, block_size: int, dtype) -> list:
        return [attnx.PagedKVCache(num_blocks, block_size, self.kv_heads, self.head_dim, dtype)
                for _ in range(self.config["num_hidden_layers"])]

    def forward(self, caches: list, seqs: list, tokens: np.ndarray, query_lens: list) -> np.ndarray:
        """Runs ``tokens`` (packed: sequence i's ``query_lens[i]`` rows in turn) through the model,
        appending their keys and values to the caches, and returns the logits of each sequence's
        last row, ``(len(seqs), vocab)``. ``seqs[i]`` holds sequence i's handle in each layer's
        cache."""
        w, t = self.w, len(tokens)
        x = w["model.embed_tokens.weight"][tokens]
        for n, cache in enumerate(caches):
            p = f"model.layers.{n}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
            q = (h @ w[p + "self_attn.q_proj.weight"]).reshape(t, self.heads, self.head_dim)
            k = (h @ w[p + "self_attn.k_proj.weight"]).reshape(t, self.kv_heads, self.head_dim)
            v = (h @ w[p + "self_attn.v_proj.weight"]).reshape(t, self.kv_heads, self.head_dim)
            # One call for the whole step: the rows' keys and values are rotated, appended to
            # their sequences, and every query attends its own sequence's keys up to itself.
            a = attnx.paged_attention(q, cache, [s[n] for s in seqs], query_lens, k, v, rope=self.rope)
            x = x + a.reshape(t, -1) @ w[p + "self_attn.o_proj.weight"]
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
            gate, up = h @ w[p + "mlp.gate_proj.weight"], h @ w[p + "mlp.up_proj.weight"]
            x = x + (silu(gate) * up) @ w[p + "mlp.down_proj.weight"]
        last = np.cumsum(query_lens) - 1          # only the rows that pick a token need logits
        return rms_norm(x[last], w["model.norm.weight"], self.eps) @ w["lm_head.weight"]


def read_config(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        return json.loads(f.metadata()["config"])


def load_model(path: str) -> Llama:
    from safetensors.numpy import load_file

    return Llama(read_config(path), load_file(path))


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list
    max_new_tokens: int
    arrival: int = 0                      # the step at which the request arrives
    parent: Request | None = None         # a prompt prefix already prefilled: forked, not recomputed
    tokens: list = dataclasses.field(default_factory=list)   # the greedy tokens
    logits: list = dataclasses.field(default_factory=list)   # the logits each was picked from
    seqs: list | None = None              # the sequence's handle in each layer's cache
    cached: int = 0                       # prompt tokens in the cache


def serve(model, caches: list, requests: list, prefill_chunk: int = 32) -> int:
    """Greedy decoding of ``requests`` with continuous batching; returns the number of steps.

    A request whose ``parent`` is set must arrive with it, and its prompt must extend the
    parent's; the parent (``max_new_tokens=0``) is prefilled, then forked once per child and
    removed: the children share its blocks until they write into them."""
    children = {}
    for r in requests:
        if r.parent is not None:
            children.setdefault(id(r.parent), []).append(r)
    waiting = sorted((r for r in requests if r.parent is None), key=lambda r: r.arrival)
    running, step = [], 0
    while waiting or running:
        while waiting and waiting[0].arrival <= step:
            r = waiting.pop(0)
            r.seqs = [cache.add_sequence() for cache in caches]
            running.append(r)
        batch, rows, budget = [], [], prefill_chunk
        for r in running:
            if r.cached < len(r.prompt):          # prefill: the next chunk of the prompt
                chunk = r.prompt[r.cached : r.cached + budget]
                budget -= len(chunk)
            else:                                 # decode: the last token
                chunk = r.tokens[-1:]
            if chunk:
                batch.append(r)
                rows.append(chunk)
        if batch:
            # A pool too small raises attnx.CacheFullError before anything is written; a server
            # would then hold a request back (remove it and recompute it later).
            logits = model.forward(caches, [r.seqs for r in batch], np.concatenate(rows),
                                   [len(c) for c in rows])
            for r, chunk, row in zip(batch, rows, logits):
                if r.cached < len(r.prompt):
                    r.cached += len(chunk)
                    if r.cached < len(r.prompt):
                        continue                  # more of the prompt next step
                if r.max_new_tokens == 0:         # a shared prefix, prefilled: fork it
                    for child in children.get(id(r), []):
                        child.seqs = [c.fork(s) for c, s in zip(caches, r.seqs)]
                        child.cached = r.cached
                        running.append(child)
                else:
                    r.tokens.append(int(np.argmax(row)))
                    r.logits.append(row)
                if len(r.tokens) == r.max_new_tokens:  # finished: its blocks go back to the pool
                    for cache, s in zip(caches, r.seqs):
                        cache.remove(s)
                    running.remove(r)
        step += 1
    return step


def make_requests(rng: np.random.Generator, n: int, max_new_tokens: int, vocab: int) -> list:
    """``n`` requests of random prompts (4 to 48 tokens), arriving two steps apart, each asking
    for ``max_new_tokens // 2`` to ``max_new_tokens`` tokens (at least 1). Requests 0 and 1 arrive
    together with the same prompt: a parent request holding all of it but its last token is
    prefilled once and forked for both (appended last)."""
    requests = []
    for i in range(n):
        prompt = rng.integers(0, vocab, size=int(rng.integers(4, 49))).tolist()
        new = int(rng.integers(max(1, max_new_tokens // 2), max_new_tokens + 1))
        requests.append(Request(prompt, new, arrival=2 * i))
    if n >= 2:
        shared = requests[0].prompt
        parent = Request(shared[:-1], 0, arrival=0)
        requests[0].parent = requests[1].parent = parent
        requests[1].prompt, requests[1].arrival = list(shared), 0
        requests.append(parent)
    return requests


# --------------------------------------------------------------------------------------------
# The comparison with transformers
# --------------------------------------------------------------------------------------------


def hf_generate(path: str, requests: list) -> list:
    """transformers' greedy tokens and their logits for each request, from the same file."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**read_config(path), attn_implementation="eager")).eval()
    model.load_state_dict(load_file(path))
    results = []
    with torch.inference_mode():
        for r in requests:
            out = model.generate(torch.tensor([r.prompt]), max_new_tokens=r.max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(r.prompt):].tolist()
            results.append((tokens, np.stack([x[0].numpy() for x in out.logits])))
    return results


def check(path: str, requests: list, exact: bool) -> bool:
    """Prints how many requests have transformers' tokens and the logits' largest error; False
    where a token differs and ``exact``."""
    equal, worst = 0, 0.0
    for r, (tokens, logits) in zip(requests, hf_generate(path, requests)):
        equal += r.tokens == tokens
        steps = min(len(r.logits), len(logits))
        for ours, theirs in zip(r.logits[:steps], logits[:steps]):
            worst = max(worst, float(np.abs(ours - theirs).max() / np.abs(theirs).max()))
            if int(np.argmax(ours)) != int(np.argmax(theirs)):
                break                             # past a different token the inputs differ
    print(f"transformers' greedy tokens: {equal} of {len(requests)} requests equal; "
          f"logits' max error {worst:.2e} (relative to the largest |logit|)")
    return equal == len(requests) or not exact


def blas_threads(n):
    """NumPy's matmuls limited to ``n`` threads too, where threadpoolctl is installed: a BLAS
    that starts threads of its own beside attnx's oversubscribes the cores."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(n, user_api="blas") if n else contextlib.nullcontext()


def run(args, tmp: str) -> int:
    config = dict(CONFIG, num_hidden_layers=args.layers)
    path = os.path.join(tmp, "model.safetensors")
    maker = make_model(path, config, args.seed)
    model = load_model(path)
    rng = np.random.default_rng(args.seed)
    requests = make_requests(rng, args.requests, args.max_new_tokens, config["vocab_size"])
    answered = [r for r in requests if r.max_new_tokens > 0]

    # The pool holds every request at its longest at once: a block per block_size tokens,
    # rounded up per request.
    blocks = sum(-(-(len(r.prompt) + r.max_new_tokens) // args.block_size) for r in requests)
    caches = model.new_caches(blocks, args.block_size, args.cache_dtype)
    start = time.perf_counter()
    steps = serve(model, caches, requests, args.prefill_chunk)
    seconds = time.perf_counter() - start
    generated = sum(len(r.tokens) for r in answered)
    prompt = sum(len(r.prompt) - (len(r.parent.prompt) if r.parent else 0) for r in requests)
    print(f"model made by {maker}: {args.layers} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}; cache {args.cache_dtype}, {blocks} blocks of {args.block_size}")
    print(f"{len(answered)} requests, {steps} steps: {prompt} prompt tokens and {generated} generated "
          f"in {seconds:.3f} s, {generated / seconds:.1f} generated tokens/s")
    assert all(cache.free_blocks == blocks and not cache.sequences for cache in caches)
    if args.save_tokens:
        with open(args.save_tokens, "w") as f:
            json.dump([{"prompt": r.prompt, "tokens": r.tokens} for r in answered], f)

    if args.check is False:
        return 0
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        if args.check:
            print("--check needs transformers and torch", file=sys.stderr)
            return 2
        print("transformers is not installed: no comparison")
        return 0
    return 0 if check(path, answered, exact=args.cache_dtype == "float32") else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--cache-dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=32, help="prompt tokens per step, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="attnx's threads, and NumPy's BLAS's where threadpoolctl is installed")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare with transformers (default: where it is installed)")
    parser.add_argument("--save-tokens", metavar="FILE.json", help="write each request's prompt and tokens")
    args = parser.parse_args(argv)
    threads = attnx.get_num_threads()
    try:
        if args.threads:
            attnx.set_num_threads(args.threads)
        with blas_threads(args.threads), tempfile.TemporaryDirectory() as tmp:
            return run(args, tmp)
    finally:
        attnx.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
