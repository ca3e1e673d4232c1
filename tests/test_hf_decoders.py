"""Greedy generation through attnx's paged cache gives transformers' tokens, on four decoders.

Llama (grouped heads, Llama 3 rope scaling), Gemma 2 (logit soft caps, a sliding window on
alternate layers, query_pre_attn_scalar, (1 + w) RMSNorm, feed-forward norms, a scaled
embedding), Phi (partial rotary, linear rope scaling, biases, attention and MLP in parallel) and
GPT-J (interleaved rotary on part of each head, parallel residual): transformers' model with
random weights, and the same weights in ``_decoders.Decoder``'s NumPy forward pass, its attention
by ``attnx.paged_attention``. ``examples/generate.py``'s ``serve`` runs the requests with
continuous batching: requests join at different steps, prompts longer than a step's budget are
prefilled in chunks next to other requests' decode rows in one call per layer, and two requests
start from a fork of a prefilled shared prefix. Each request's greedy tokens must equal
``generate(do_sample=False)``'s for its prompt alone, and the logits each token was picked from
must agree to 1e-4 of the largest |logit|.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import attnx

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import _decoders  # noqa: E402  (imports nothing optional; after the skips all the same)

TOLERANCE = 1e-4     # of the logits, relative to the largest |logit| of the step
MIN_MARGIN = 1e-3    # the top two logits of every compared step at least this far apart
BLOCK_SIZE = 4       # small blocks: sequences span many, and the shared prefix ends inside one
PREFILL_CHUNK = 8    # prompt tokens per step


@functools.lru_cache(maxsize=None)
def example():
    return _decoders.load_example()


def make_requests(vocab: int, seed: int = 1) -> list:
    """Seven requests: prompts of 1 to 19 tokens joining at steps 0 to 6, and a prefix of 9
    tokens (not a whole number of blocks) that two of them extend by 1 and by 3 tokens."""
    Request = example().Request
    rng = np.random.default_rng(seed)

    def prompt(n):
        return rng.integers(0, vocab, n).tolist()

    prefix = Request(prompt(9), 0, arrival=1)
    return [Request(prompt(5), 8, arrival=0),
            Request(prompt(19), 6, arrival=0),      # 3 chunks, beside request 0's decoding
            prefix,
            Request(prefix.prompt + prompt(1), 7, arrival=1, parent=prefix),
            Request(prefix.prompt + prompt(3), 6, arrival=1, parent=prefix),
            Request(prompt(3), 10, arrival=2),
            Request(prompt(11), 5, arrival=4),
            Request(prompt(1), 4, arrival=6)]


class Recorder:
    """A model that records each step's ``query_lens`` on its way to the real one."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def forward(self, caches, seqs, tokens, query_lens):
        self.steps.append(list(query_lens))
        return self.model.forward(caches, seqs, tokens, query_lens)


@functools.lru_cache(maxsize=None)
def reference(arch: str):
    """(transformers' model, its greedy tokens and logits per request of make_requests)."""
    model = _decoders.hf_model(arch)
    requests = [r for r in make_requests(model.config.vocab_size) if r.max_new_tokens]
    return model, [_decoders.hf_generate(model, r.prompt, r.max_new_tokens) for r in requests]


def serve(arch: str, dtype=np.float32):
    model, _ = reference(arch)
    decoder = Recorder(_decoders.Decoder(arch, model))
    requests = make_requests(model.config.vocab_size)
    caches = decoder.model.new_caches(64, BLOCK_SIZE, dtype)
    example().serve(decoder, caches, requests, PREFILL_CHUNK)
    # Every request finished and left: all blocks are free again.
    assert all(c.free_blocks == 64 and not c.sequences for c in caches)
    return decoder.steps, [r for r in requests if r.max_new_tokens]


@pytest.mark.parametrize("arch", _decoders.ARCHS)
def test_greedy_tokens_and_logits_equal_transformers(arch, monkeypatch):
    calls = []
    paged_attention = attnx.paged_attention
    monkeypatch.setattr(attnx, "paged_attention", lambda *a, **k: calls.append(1) or paged_attention(*a, **k))
    forks = []
    fork = attnx.PagedKVCache.fork

    def recording_fork(cache, seq):
        child = fork(cache, seq)
        forks.append((cache.block_table(seq).tolist(), cache.block_table(child).tolist()))
        return child

    monkeypatch.setattr(attnx.PagedKVCache, "fork", recording_fork)
    steps, requests = serve(arch)
    model, expected = reference(arch)
    # The prefix of 9 tokens was forked for both of its requests in every layer: they start
    # from its 3 blocks, shared.
    assert len(forks) == 2 * model.config.num_hidden_layers
    assert all(parent == child and len(parent) == 3 for parent, child in forks), forks

    # One call per layer and step, and the schedule was what it is meant to be: steps that mix
    # a prompt chunk with decode rows, a prompt cut into chunks, more than 3 sequences at once.
    assert len(calls) == len(steps) * model.config.num_hidden_layers
    assert any(len(lens) > 1 and max(lens) > 1 and min(lens) == 1 for lens in steps), steps
    assert any(PREFILL_CHUNK in lens for lens in steps)
    assert all(sum(lens) <= PREFILL_CHUNK + len(lens) for lens in steps)
    assert max(len(lens) for lens in steps) > 3

    worst = 0.0
    for r, (tokens, logits) in zip(requests, expected):
        assert r.tokens == tokens, (r.prompt, r.tokens, tokens)
        assert len(r.logits) == len(logits) == r.max_new_tokens
        error = _decoders.relative_error(np.stack(r.logits), logits)
        assert error.max() <= TOLERANCE, error
        # Not a coincidence of near ties: the tokens are picked by clear margins.
        assert _decoders.top2_margin(logits).min() >= MIN_MARGIN
        worst = max(worst, float(error.max()))
    print(f"{arch}: {len(requests)} requests, {sum(map(len, (r.tokens for r in requests)))} tokens equal; "
          f"logits' max relative error {worst:.2e}")


@pytest.mark.parametrize("dtype, bound", [("float16", 1e-2), ("int8", 1e-1)])
def test_lossy_cache_dtypes_on_llama(dtype, bound):
    # A float16 or int8 cache rounds the keys and values: the logits move a little, and a token
    # may legitimately differ where transformers' top two logits are closer than that. Up to a
    # request's first different token (past it, the inputs differ), the logits agree to `bound`,
    # and a different token is one whose margin the error explains.
    _, expected = reference("llama")
    _, requests = serve("llama", dtype)
    equal, worst = 0, 0.0
    for r, (tokens, logits) in zip(requests, expected):
        ours = np.stack(r.logits)
        differ = [i for i, (a, b) in enumerate(zip(r.tokens, tokens)) if a != b]
        stop = differ[0] + 1 if differ else len(tokens)
        error = _decoders.relative_error(ours[:stop], logits[:stop])
        assert error.max() <= bound, error
        if differ:
            i = differ[0]
            assert _decoders.top2_margin(logits[i]) <= 2 * error[i], (i, error[i])
        equal += not differ
        worst = max(worst, float(error.max()))
    print(f"llama, {dtype} cache: {equal} of {len(requests)} requests' tokens equal transformers'; "
          f"logits' max relative error {worst:.2e}")


@pytest.mark.parametrize("arch", _decoders.ARCHS)
def test_rotary_from_config_is_the_explicit_one(arch):
    # RotaryEmbedding.from_config reads the same fields as _decoders.rope_of spells out.
    config = reference(arch)[0].config
    explicit, derived = _decoders.rope_of(arch, config), attnx.RotaryEmbedding.from_config(config)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 3, 16), dtype=np.float32)    # every head_dim here is 16
    positions = rng.integers(0, 500, 40)
    np.testing.assert_array_equal(derived(x, positions), explicit(x, positions))
