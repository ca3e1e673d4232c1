"""examples/generate.py: a Llama-architecture model served through attnx's paged cache.

Run small, the example's greedy tokens must equal transformers' where transformers is installed
(its own comparison, which exits 1 on a difference); in a fresh interpreter in which torch and
transformers cannot be imported it makes its model with NumPy, serves it and writes every
request's tokens, and ``--check`` fails there for want of transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import _decoders

EXAMPLE = str(_decoders.EXAMPLE)
SMALL = ["--layers", "1", "--requests", "5", "--max-new-tokens", "6", "--block-size", "4", "--threads", "1"]

# Runs the example's command line in a fresh interpreter in which torch and transformers
# cannot be imported.
RUN_WITHOUT_TORCH = """
import runpy, sys
sys.modules["torch"] = sys.modules["transformers"] = None  # importing either raises ImportError
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("safetensors")
    return _decoders.load_example()


@pytest.mark.torch
def test_tokens_equal_transformers(example, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    assert example.main(SMALL + ["--check", "--prefill-chunk", "16"]) == 0
    printed = capsys.readouterr().out
    assert "model made by transformers" in printed
    assert "transformers' greedy tokens: 5 of 5 requests equal" in printed, printed


def test_serves_without_torch_or_transformers(example, tmp_path):
    tokens = tmp_path / "tokens.json"
    run = [sys.executable, "-c", RUN_WITHOUT_TORCH, EXAMPLE, *SMALL]
    proc = subprocess.run(run + ["--save-tokens", str(tokens)], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model made by numpy" in proc.stdout
    assert "transformers is not installed: no comparison" in proc.stdout
    assert "generated tokens/s" in proc.stdout
    answers = json.loads(tokens.read_text())
    assert len(answers) == 5
    assert answers[0]["prompt"] == answers[1]["prompt"]     # the pair that shares a forked prompt
    for answer in answers:
        assert 3 <= len(answer["tokens"]) <= 6
        assert all(0 <= t < example.CONFIG["vocab_size"] for t in answer["tokens"])

    proc = subprocess.run(run + ["--check"], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 2 and "--check needs transformers and torch" in proc.stderr, proc.stderr


def test_requests_join_over_time_and_two_share_a_prompt():
    # NumPy only (no safetensors): the first two requests share their prompt through a parent
    # that is prefilled and forked; the others arrive two steps apart.
    example = _decoders.load_example()
    requests = example.make_requests(np.random.default_rng(0), 6, 8, 1000)
    answered = [r for r in requests if r.max_new_tokens]
    parent = requests[-1]
    assert len(answered) == 6 and parent.max_new_tokens == 0
    assert requests[0].parent is requests[1].parent is parent
    assert requests[0].prompt == requests[1].prompt == parent.prompt + requests[0].prompt[-1:]
    assert [r.arrival for r in answered] == [0, 0, 4, 6, 8, 10]
    assert all(4 <= r.max_new_tokens <= 8 for r in answered)
