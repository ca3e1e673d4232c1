"""Train attention in PyTorch, export its weights, serve them with attnx alone.

Two steps, run as two processes; only the first needs torch:

    python examples/export_torch_attention.py export DIR   # torch + numpy (+ safetensors)
    python examples/export_torch_attention.py serve DIR    # numpy + attnx (+ safetensors), no torch

``export`` trains a small torch model -- an ``nn.MultiheadAttention`` self-attention layer
(batch_first, padded sequences) and a linear readout -- for a few steps on a toy task, then writes

    DIR/config.json           the layer's constructor arguments
    DIR/attention.npz         its state_dict (torch's keys) as NumPy arrays, ``np.savez``
    DIR/attention.safetensors the same with safetensors' NumPy API, if safetensors is installed
    DIR/check.npz             an input batch, its padding mask and the layer's output in eval()

``serve`` never imports torch: it rebuilds the layer as ``attnx.MultiheadAttention``, loads the
weights from each file with ``load_state_dict`` and checks attnx's output against torch's. It
prints one line per file and exits non-zero if an output differs beyond float32 tolerance.

Inside one process that has torch, ``attnx.MultiheadAttention.from_torch(module)`` or
``mha.load_state_dict(module.state_dict())`` do the same without files.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

# The layer's shape: 32 wide, 4 heads; batches of 8 sequences of up to 12 tokens.
CONFIG = {"embed_dim": 32, "num_heads": 4, "bias": True, "batch_first": True}
BATCH, TOKENS = 8, 12


def _toy_batch(rng: np.random.Generator, batch: int = BATCH):
    """Random token vectors, a padding mask (True = padding) and the toy task's target.

    The target of each sequence is the mean of its unpadded tokens' first half, which one
    attention layer can learn.
    """
    x = rng.standard_normal((batch, TOKENS, CONFIG["embed_dim"])).astype(np.float32)
    lengths = rng.integers(TOKENS // 2, TOKENS + 1, size=batch)
    padding = np.arange(TOKENS)[None, :] >= lengths[:, None]
    x[padding] = 0.0
    target = (x[..., : CONFIG["embed_dim"] // 2].sum(1) / lengths[:, None]).astype(np.float32)
    return x, padding, target


def _train(torch, rng, steps):
    """Train the layer and a readout on the toy task.

    Returns the layer's state_dict as NumPy arrays, and a new batch (x, padding) with the
    trained layer's output and attention weights in eval() mode.
    """
    attention = torch.nn.MultiheadAttention(**CONFIG)
    readout = torch.nn.Linear(CONFIG["embed_dim"], CONFIG["embed_dim"] // 2)
    params = list(attention.parameters()) + list(readout.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        x, padding, target = (torch.from_numpy(a) for a in _toy_batch(rng, 32))
        out, _ = attention(x, x, x, key_padding_mask=padding, need_weights=False)
        keep = (~padding).unsqueeze(-1).float()
        prediction = readout((out * keep).sum(1) / keep.sum(1))
        loss = torch.nn.functional.mse_loss(prediction, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    attention.eval()
    x, padding, _ = _toy_batch(rng)
    with torch.no_grad():
        out, weights = attention(
            torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x),
            key_padding_mask=torch.from_numpy(padding),
        )
    # A torch state_dict as NumPy arrays: what each weight file holds.
    state = {key: t.detach().cpu().numpy() for key, t in attention.state_dict().items()}
    return state, x, padding, out.numpy(), weights.numpy()


def export(directory, steps: int = 30, seed: int = 0) -> list:
    """Train the torch model and write the files listed in the module docstring.

    Returns the paths of the weight files written.
    """
    import torch

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    threads = torch.get_num_threads()
    # The model is tiny: one thread is fastest (a team of threads costs more than it saves).
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():  # leaves the caller's torch RNG as it was
            torch.manual_seed(seed)
            state, x, padding, out, weights = _train(torch, rng, steps)
    finally:
        torch.set_num_threads(threads)

    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    np.savez(directory / "check.npz", x=x, padding=padding, output=out, weights=weights)
    written = [directory / "attention.npz"]
    np.savez(written[0], **state)
    try:
        from safetensors.numpy import save_file
    except ImportError:
        pass
    else:
        written.append(directory / "attention.safetensors")
        save_file(state, str(written[-1]))
    return written


def load_weights(path) -> dict:
    """A state_dict (str -> ndarray) from a ``.npz`` or ``.safetensors`` file."""
    path = pathlib.Path(path)
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return load_file(str(path))
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def serve(directory) -> dict:
    """Serve the exported layer with attnx alone and compare with torch's saved output.

    Returns ``{file name: max abs difference}``; raises AssertionError past tolerance.
    """
    import attnx

    directory = pathlib.Path(directory)
    config = json.loads((directory / "config.json").read_text())
    with np.load(directory / "check.npz") as check:
        x, padding, expected, expected_weights = (check[k] for k in ("x", "padding", "output", "weights"))
    differences = {}
    for path in sorted(directory.glob("attention.*")):
        mha = attnx.MultiheadAttention(**config)
        mha.load_state_dict(load_weights(path))
        out, weights = mha(x, x, x, key_padding_mask=padding)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6, err_msg=path.name)
        np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-6, err_msg=path.name)
        differences[path.name] = float(np.max(np.abs(out - expected)))
    if not differences:
        raise FileNotFoundError(f"no attention.* weight files in {directory}")
    return differences


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["export", "serve"])
    parser.add_argument("directory")
    args = parser.parse_args(argv)
    if args.step == "export":
        for path in export(args.directory):
            print(f"wrote {path}")
        return 0
    for name, difference in serve(args.directory).items():
        print(f"{name}: attnx matches torch (max abs difference {difference:.2e})")
    print(f"torch imported: {sys.modules.get('torch') is not None}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
