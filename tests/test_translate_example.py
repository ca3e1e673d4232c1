"""examples/translate.py: a Transformer trained in torch, greedily decoded by attnx without torch.

A tiny model is trained for a fixed number of steps (one thread, a fixed seed: the same weights
on every run) and exported to a ``.safetensors`` file. The example's serving side then runs in a
fresh interpreter in which ``import torch`` fails, decodes a batch of sources of different
lengths with both of its greedy decoders, and its tokens must equal torch's greedy decoding of
the same model. The comparison does not depend on how well the model has learnt the task.

The tests that train need torch and safetensors, and skip without them; those of the NumPy
helpers need neither.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "translate.py"

# Runs the example's command line in a fresh interpreter in which `import torch` fails.
RUN_WITHOUT_TORCH = """
import runpy, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

TRAIN_STEPS = 300  # the tiny model's: about 2 s on one core, far from perfect but trained


def load_example():
    spec = importlib.util.spec_from_file_location("translate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def torch():
    pytest.importorskip("safetensors")
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def trained(torch, tmp_path_factory):
    """(example module, trained torch model, exported .safetensors path), made once."""
    example = load_example()
    rng_before = torch.random.get_rng_state()
    threads_before = torch.get_num_threads()
    model = example.train(example.TINY_CONFIG, seconds=None, steps=TRAIN_STEPS, threads=1, seed=0)
    # The caller's torch state is left as it was.
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.get_num_threads() == threads_before
    assert model.trained_steps == TRAIN_STEPS and not model.training
    path = tmp_path_factory.mktemp("translate") / "model.safetensors"
    example.export(model, path)
    return example, model, path


@pytest.mark.slow  # trains a model in torch first
def test_serving_without_torch_gives_torchs_tokens(trained, tmp_path):
    example, model, path = trained
    tokens = tmp_path / "tokens.npz"
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_TORCH, str(EXAMPLE), "--serve", str(path), "--batch", "48",
         "--data-seed", "7", "--save-tokens", str(tokens), "--show", "3"],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch imported: False" in proc.stdout.splitlines(), proc.stdout

    with np.load(tokens) as saved:
        src, full, cached = saved["src"], saved["full"], saved["cached"]
    # The batch mixes source lengths: the padding masks matter.
    lengths = (src != example.PAD).sum(1)
    assert lengths.min() == 1 and lengths.max() == example.TINY_CONFIG["max_digits"], lengths
    reference = example.torch_greedy_decode(model, src)
    assert reference.shape == (48, example.decode_steps(example.TINY_CONFIG))
    np.testing.assert_array_equal(full, reference)
    np.testing.assert_array_equal(cached, reference)
    # The model was trained: it answers some sources right, and its answers vary.
    assert 0.0 < example.sequence_accuracy(reference, src)
    assert len({tuple(row) for row in reference}) > 10


@pytest.mark.slow  # trains a model in torch first
def test_decoders_agree_in_process_on_odd_batches(trained):
    # Batches of one source, of equal lengths, and fewer steps than a full answer needs.
    example, model, path = trained
    served = example.load_model(path)
    assert served.config == example.TINY_CONFIG
    assert not served.transformer.training
    rng = np.random.default_rng(3)
    one = example.make_batch(rng, 1, 6)[0]
    same = np.full((5, 4), example.DIGIT0, dtype=np.int64) + rng.integers(0, 10, size=(5, 4))
    for src, steps in ((one, None), (same, None), (same, 2)):
        reference = example.torch_greedy_decode(model, src, steps)
        np.testing.assert_array_equal(example.greedy_decode_full(served, src, steps), reference)
        np.testing.assert_array_equal(example.greedy_decode_cached(served, src, steps), reference)


@pytest.mark.slow  # trains a model in torch first
def test_exported_file_holds_torchs_state_and_the_config(trained):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    example, model, path = trained
    state = load_file(str(path))
    expected = model.state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(state[key], value.numpy(), err_msg=key)
    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["config"]
    assert example.load_model(path).config == example.TINY_CONFIG


@pytest.mark.slow  # trains a model in torch first
def test_main_trains_exports_and_compares(torch, tmp_path, capsys):
    example = load_example()
    out = tmp_path / "cli.safetensors"
    assert example.main(["--tiny", "--steps", "150", "--threads", "1", "--out", str(out), "--batch", "16",
                         "--show", "2"]) == 0
    printed = capsys.readouterr().out
    assert out.is_file()
    assert "trained 150 steps" in printed
    assert "attnx tokens equal torch's: full True, cached True" in printed, printed


def test_data_and_positions():
    # NumPy only: the task's batches and the positional encodings.
    example = load_example()
    src, tgt = example.make_batch(np.random.default_rng(0), 32, 5)
    assert src.shape[0] == tgt.shape[0] == 32 and tgt.shape[1] == src.shape[1] + 2
    for s, t in zip(src, tgt):
        digits = s[s != example.PAD]
        assert 1 <= len(digits) <= 5 and np.all(s[len(digits):] == example.PAD)
        assert np.all((digits >= example.DIGIT0) & (digits < example.VOCAB_SIZE))
        answer = np.concatenate([[example.BOS], digits[::-1], [example.EOS]])
        np.testing.assert_array_equal(t[: len(answer)], answer)
        assert np.all(t[len(answer):] == example.PAD)
    # A perfect answer scores 1, a wrong digit 0 for its row.
    perfect = example.expected_tokens(src, 6)
    assert example.sequence_accuracy(perfect, src) == 1.0
    perfect[0, 0] = example.DIGIT0 + (perfect[0, 0] - example.DIGIT0 + 1) % 10
    assert example.sequence_accuracy(perfect, src) == 31 / 32

    table = example.positional_encoding(7, 6)
    assert table.dtype == np.float32 and table.shape == (7, 6)
    for p in range(7):
        for i in range(3):
            angle = p / 10000 ** (2 * i / 6)
            assert math.isclose(table[p, 2 * i], math.sin(angle), abs_tol=1e-7)
            assert math.isclose(table[p, 2 * i + 1], math.cos(angle), abs_tol=1e-7)


def test_finish_pads_after_the_first_eos():
    example = load_example()
    PAD, EOS = example.PAD, example.EOS
    columns = [np.array([5, EOS, 7]), np.array([EOS, 6, EOS]), np.array([9, 9, 8])]
    out = example._finish(columns, 3, 4)
    np.testing.assert_array_equal(out, [[5, EOS, PAD, PAD], [EOS, PAD, PAD, PAD], [7, EOS, PAD, PAD]])
