"""examples/export_torch_attention.py: trained in torch, served by attnx in a process without torch."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "export_torch_attention.py"

# Runs the example's `serve` step in a fresh interpreter in which `import torch` fails.
SERVE_WITHOUT_TORCH = """
import runpy, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
example, directory = sys.argv[1:]
sys.argv = [example, "serve", directory]
runpy.run_path(example, run_name="__main__")
"""


def load_example():
    spec = importlib.util.spec_from_file_location("export_torch_attention", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(directory, weight files written, example module): the example's export step, run once."""
    torch = pytest.importorskip("torch")
    example = load_example()
    directory = tmp_path_factory.mktemp("exported")
    rng_before = torch.random.get_rng_state()
    threads_before = torch.get_num_threads()
    written = example.export(directory)
    # The caller's torch state is left as it was.
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.get_num_threads() == threads_before
    return directory, written, example


@pytest.mark.torch
def test_export_then_serve_without_torch(exported):
    import torch

    tmp_path, written, example = exported
    names = {p.name for p in written}
    assert "attention.npz" in names
    if importlib.util.find_spec("safetensors") is not None:
        assert "attention.safetensors" in names

    # The exported weights were trained: they differ from a fresh layer's.
    with np.load(tmp_path / "attention.npz") as data:
        trained = data["in_proj_weight"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        fresh = torch.nn.MultiheadAttention(**example.CONFIG).in_proj_weight.detach().numpy()
    assert np.max(np.abs(trained - fresh)) > 1e-3

    proc = subprocess.run(
        [sys.executable, "-c", SERVE_WITHOUT_TORCH, str(EXAMPLE), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for name in names:
        assert any(line.startswith(f"{name}: attnx matches torch") for line in lines), proc.stdout
    assert "torch imported: False" in lines


@pytest.mark.torch
def test_serve_detects_wrong_weights(exported, tmp_path):
    # The check can fail: slightly different weights do not reproduce torch's output.
    directory, _, example = exported
    for name in ("config.json", "check.npz"):
        shutil.copy(directory / name, tmp_path / name)
    state = example.load_weights(directory / "attention.npz")
    assert example.serve(directory)  # the originals pass
    state["out_proj.weight"] = state["out_proj.weight"] * np.float32(1.01)
    np.savez(tmp_path / "attention.npz", **state)
    with pytest.raises(AssertionError):
        example.serve(tmp_path)


def test_load_weights_reads_both_formats(tmp_path):
    # Without torch: the file readers give back exactly what was written.
    example = load_example()
    rng = np.random.default_rng(0)
    state = {"in_proj_weight": rng.standard_normal((96, 32)).astype(np.float32),
             "out_proj.bias": rng.standard_normal(32).astype(np.float32)}
    np.savez(tmp_path / "w.npz", **state)
    formats = ["w.npz"]
    if importlib.util.find_spec("safetensors") is not None:
        from safetensors.numpy import save_file

        save_file(state, str(tmp_path / "w.safetensors"))
        formats.append("w.safetensors")
    for name in formats:
        loaded = example.load_weights(tmp_path / name)
        assert sorted(loaded) == sorted(state)
        for key in state:
            np.testing.assert_array_equal(loaded[key], state[key])
