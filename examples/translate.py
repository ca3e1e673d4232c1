"""A sequence-to-sequence Transformer trained in PyTorch, served by greedy decoding with attnx.

    python examples/translate.py --seconds 60 --out model.safetensors  # train, export, serve
    python examples/translate.py --serve model.safetensors             # serve only: no torch
    python examples/translate.py --tiny --seconds 5 --out tiny.safetensors

The task is a toy translation: a string of digits (random length, 1 to ``max_digits``) is
"translated" into the same digits reversed. Tokens: ``PAD`` (0), ``BOS`` (1), ``EOS`` (2) and the
digits 0-9 (3-12). A source is its digits, PAD-padded to the batch's longest; a target is
``BOS``, the reversed digits, ``EOS``.

The model is ``Seq2Seq``: a token embedding (sources and targets share the vocabulary) plus
sinusoidal positional encodings, an ``nn.Transformer`` (batch_first) and a ``Linear`` generator
to the vocabulary's logits. The default configuration (``CONFIG``) reaches 100% greedy accuracy
within a minute of training on 2 idle cores (about 500 steps of 64 sources); ``--tiny``
(``TINY_CONFIG``) trains in seconds, to a model that is right about half the time.

Steps:

- ``train`` (torch) trains it with teacher forcing for a time budget or a number of steps.
- ``export`` writes its state_dict to a ``.safetensors`` file, its config as JSON in the file's
  metadata.
- ``load_model`` (NumPy + attnx, no torch) reads that file back: the ``transformer.*`` weights
  into an ``attnx.Transformer`` (``load_state_dict``, ``eval()``), the embedding and the
  generator as NumPy arrays. ``greedy_decode_full`` runs the decoder over the whole prefix at
  each step (causal ``tgt_mask``); ``greedy_decode_cached`` feeds one token per step through
  ``TransformerDecoder.step`` over a ``new_cache`` of the decoder's keys and values. Both give
  the same tokens as ``torch_greedy_decode``, torch's greedy decoding of the trained model.

Every decoder returns ``(batch, steps)`` tokens: the generated tokens up to and including the
first ``EOS``, then ``PAD``. Sources of different lengths are batched with a padding mask
(``src_key_padding_mask`` for the encoder, ``memory_key_padding_mask`` for the decoder).

Without ``--serve``, ``main`` trains, exports, then decodes a batch of new sources with torch and
with attnx (both decoders) and prints a few examples, the accuracy (whole sequences right) and
whether attnx's tokens equal torch's. ``--serve FILE`` loads an exported model without importing
torch and decodes new sources with attnx; ``--save-tokens FILE.npz`` writes the sources and both
decoders' tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings

import numpy as np

PAD, BOS, EOS = 0, 1, 2
DIGIT0 = 3  # the token of digit 0; digit d is DIGIT0 + d
VOCAB_SIZE = DIGIT0 + 10

# The default model: learns to reverse strings of up to 10 digits within a minute on 2 cores.
CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "d_model": 64,
    "nhead": 4,
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
    "dim_feedforward": 128,
    "dropout": 0.0,
    "max_digits": 10,
}

# The learning rate's linear warm-up, in optimizer steps.
WARMUP_STEPS = 100

# A tiny model: a few seconds of training (tests, a quick look).
TINY_CONFIG = dict(CONFIG, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                   dim_feedforward=32, max_digits=6)


# --------------------------------------------------------------------------------------------
# Data and positions (NumPy: both sides use them)
# --------------------------------------------------------------------------------------------


def make_batch(rng: np.random.Generator, batch: int, max_digits: int):
    """Random sources and their targets.

    Returns ``(src, tgt)``: ``src`` ``(batch, S)`` int64, the digits' tokens PAD-padded to the
    longest source; ``tgt`` ``(batch, S + 2)`` int64, ``BOS``, the reversed digits, ``EOS``,
    PAD-padded.
    """
    lengths = rng.integers(1, max_digits + 1, size=batch)
    longest = int(lengths.max())
    src = np.full((batch, longest), PAD, dtype=np.int64)
    tgt = np.full((batch, longest + 2), PAD, dtype=np.int64)
    for i, length in enumerate(lengths):
        digits = DIGIT0 + rng.integers(0, 10, size=length)
        src[i, :length] = digits
        tgt[i, 0] = BOS
        tgt[i, 1 : length + 1] = digits[::-1]
        tgt[i, length + 1] = EOS
    return src, tgt


def expected_tokens(src: np.ndarray, steps: int) -> np.ndarray:
    """What a perfect decoder returns for ``src``: the reversed digits, ``EOS``, then ``PAD``
    up to ``steps`` tokens (``steps`` >= the longest source + 1)."""
    out = np.full((len(src), steps), PAD, dtype=np.int64)
    for i, row in enumerate(src):
        digits = row[row != PAD]
        out[i, : len(digits)] = digits[::-1]
        out[i, len(digits)] = EOS
    return out


def positional_encoding(positions: int, d_model: int) -> np.ndarray:
    """The sinusoidal encodings ``(positions, d_model)`` float32 of "Attention Is All You Need":
    ``sin(p / 10000^(2i / d))`` at even features ``2i``, ``cos`` of the same at odd ones.

    Computed in float64 and rounded once, so that the torch model (which holds this table as a
    buffer) and the NumPy serving side add the same numbers."""
    position = np.arange(positions, dtype=np.float64)[:, None]
    frequency = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(10000.0) / d_model))
    table = np.zeros((positions, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(position * frequency)
    table[:, 1::2] = np.cos(position * frequency)
    return table.astype(np.float32)


def max_positions(config: dict) -> int:
    """The longest sequence the model sees: a target of ``max_digits`` digits, ``BOS`` and ``EOS``."""
    return config["max_digits"] + 2


def decode_steps(config: dict) -> int:
    """Greedy decoding's number of steps: the longest answer, ``max_digits`` digits and ``EOS``."""
    return config["max_digits"] + 1


def sequence_accuracy(tokens: np.ndarray, src: np.ndarray) -> float:
    """The fraction of rows of ``tokens`` that are exactly the reversal of their source."""
    return float(np.mean(np.all(tokens == expected_tokens(src, tokens.shape[1]), axis=1)))


def _finish(tokens: list, batch: int, steps: int) -> np.ndarray:
    """The decoders' common result: ``(batch, steps)`` int64 from per-step token columns, every
    token after a row's first ``EOS`` replaced by ``PAD`` (columns past an early stop are PAD)."""
    out = np.full((batch, steps), PAD, dtype=np.int64)
    if tokens:
        out[:, : len(tokens)] = np.stack(tokens, axis=1)
    after_eos = np.cumsum(out == EOS, axis=1) - (out == EOS) > 0
    out[after_eos] = PAD
    return out


# --------------------------------------------------------------------------------------------
# torch: the model, training, greedy decoding, export
# --------------------------------------------------------------------------------------------


def build_torch_model(config: dict):
    """The torch model (``Seq2Seq``) for ``config``, with torch's default initialization; its
    ``config`` attribute is a copy of ``config``."""
    import torch
    from torch import nn

    class Seq2Seq(nn.Module):
        """Embedding + positions -> nn.Transformer -> generator."""

        def __init__(self, config):
            super().__init__()
            self.config = dict(config)  # what export writes to the file's metadata
            d_model = config["d_model"]
            self.embedding = nn.Embedding(config["vocab_size"], d_model)
            # Not in the state_dict: the serving side computes the same table.
            table = torch.from_numpy(positional_encoding(max_positions(config), d_model))
            self.register_buffer("positions", table, persistent=False)
            self.transformer = nn.Transformer(
                d_model, config["nhead"], config["num_encoder_layers"], config["num_decoder_layers"],
                config["dim_feedforward"], config["dropout"], batch_first=True,
            )
            self.generator = nn.Linear(d_model, config["vocab_size"])

        def embed(self, tokens, start: int = 0):
            """Token embeddings plus the encodings of positions ``start``, ``start + 1``, ..."""
            return self.embedding(tokens) + self.positions[start : start + tokens.shape[1]]

        def encode(self, src):
            return self.transformer.encoder(self.embed(src), src_key_padding_mask=src == PAD)

        def decode(self, tgt, memory, memory_key_padding_mask, tgt_key_padding_mask=None):
            # Boolean masks throughout (True = may not attend): torch warns when a float mask
            # and a boolean padding mask meet in one attention.
            length = tgt.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=tgt.device).triu(1)
            return self.transformer.decoder(
                self.embed(tgt), memory, tgt_mask=causal, tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=True,
            )

        def forward(self, src, tgt):
            """Logits ``(N, T, vocab)`` of the next token at each target position."""
            memory = self.encode(src)
            out = self.decode(tgt, memory, src == PAD, tgt_key_padding_mask=tgt == PAD)
            return self.generator(out)

    return Seq2Seq(config)


def torch_greedy_decode(model, src: np.ndarray, steps: int | None = None) -> np.ndarray:
    """torch's greedy decoding of ``src`` by ``model`` (in eval mode, without gradients): at each
    step the decoder runs over the whole prefix with ``nn.Transformer``'s causal mask."""
    import torch

    steps = decode_steps(model.config) if steps is None else steps
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torch's encoder packs padded sources as a nested tensor in eval mode, and warns
            # that nested tensors are a prototype; the padded positions' outputs, which that
            # changes, are masked out of the decoder's cross-attention.
            warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
            src_t = torch.from_numpy(np.asarray(src, dtype=np.int64))
            padding = src_t == PAD
            memory = model.encode(src_t)
            batch = src_t.shape[0]
            ys = torch.full((batch, 1), BOS, dtype=torch.int64)
            done = torch.zeros(batch, dtype=torch.bool)
            tokens = []
            for _ in range(steps):
                mask = torch.nn.Transformer.generate_square_subsequent_mask(ys.shape[1])
                out = model.transformer.decoder(model.embed(ys), memory, tgt_mask=mask,
                                                memory_key_padding_mask=padding)
                token = model.generator(out[:, -1]).argmax(-1)
                tokens.append(token.numpy())
                done |= token == EOS
                if bool(done.all()):
                    break
                ys = torch.cat([ys, token[:, None]], dim=1)
    finally:
        model.train(was_training)
    return _finish(tokens, len(src), steps)


def train(config: dict | None = None, *, seconds: float | None = 60.0, steps: int | None = None,
          batch: int = 64, lr: float = 3e-3, seed: int = 0, threads: int | None = None,
          log=None, log_every: int = 250):
    """Train a ``Seq2Seq`` on the reversal task; returns the model, in eval mode.

    Training runs for ``steps`` optimizer steps or ``seconds`` of training, whichever comes
    first (``None``: no such limit); the learning rate warms up over ``WARMUP_STEPS`` steps,
    then decays to 0 (a cosine) over that budget. A run with ``steps`` and ``seconds=None`` is
    reproducible: the same seed and threads give the same weights. ``threads`` sets torch's
    threads for the run (restored afterwards); the caller's torch RNG state is left as it was.
    ``log(message)``, when given, receives a line every ``log_every`` steps: the loss and greedy
    decoding's accuracy on 256 held-out sources. The model's ``trained_steps`` and
    ``train_seconds`` say what the run did.
    """
    import torch

    if steps is None and seconds is None:
        raise ValueError("train needs a limit: steps or seconds")
    config = dict(CONFIG if config is None else config)
    rng = np.random.default_rng(seed)
    held_out = make_batch(np.random.default_rng(seed + 1), 256, config["max_digits"])[0]
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng():  # leaves the caller's torch RNG as it was
            torch.manual_seed(seed)
            model = build_torch_model(config)
            optimizer = torch.optim.Adam(model.parameters(), lr=lr)
            loss_fn = torch.nn.CrossEntropyLoss(ignore_index=PAD)
            model.train()
            start = time.perf_counter()
            step = 0
            while True:
                progress = max(0.0 if steps is None else step / steps,
                               0.0 if seconds is None else (time.perf_counter() - start) / seconds)
                if progress >= 1.0:
                    break
                # A linear warm-up (a post-norm Transformer diverges at the full rate from the
                # start), then a cosine decay to 0 over the budget: the last steps' small rates
                # settle the weights.
                warmup = min(1.0, (step + 1) / WARMUP_STEPS)
                for group in optimizer.param_groups:
                    group["lr"] = lr * warmup * 0.5 * (1.0 + math.cos(math.pi * progress))
                src, tgt = (torch.from_numpy(a) for a in make_batch(rng, batch, config["max_digits"]))
                # Teacher forcing: the target's tokens but the last in, each next token out.
                logits = model(src, tgt[:, :-1])
                loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if log is not None and step % log_every == 0:
                    accuracy = sequence_accuracy(torch_greedy_decode(model, held_out), held_out)
                    log(f"step {step:5d}  {time.perf_counter() - start:5.1f} s  "
                        f"loss {loss.item():.4f}  held-out accuracy {accuracy:.3f}")
            model.train_seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads_before)
    model.eval()
    model.trained_steps = step
    return model


def export(model, path) -> None:
    """Write ``model``'s state_dict (torch's keys, as NumPy arrays) to the ``.safetensors`` file
    ``path``, its config as JSON under the metadata key ``config``."""
    from safetensors.numpy import save_file

    state = {key: np.ascontiguousarray(t.detach().cpu().numpy()) for key, t in model.state_dict().items()}
    save_file(state, str(path), metadata={"config": json.dumps(model.config)})


# --------------------------------------------------------------------------------------------
# Serving: NumPy and attnx alone (no torch)
# --------------------------------------------------------------------------------------------


class Model:
    """The exported model on the serving side.

    ``transformer`` is an ``attnx.Transformer`` (eval mode); ``embedding`` ``(vocab, d_model)``,
    ``generator_weight`` ``(vocab, d_model)`` and ``generator_bias`` ``(vocab,)`` are NumPy
    arrays; ``positions`` is ``positional_encoding`` of the config.
    """

    def __init__(self, config: dict, state: dict):
        import attnx

        self.config = config
        d_model = config["d_model"]
        self.embedding = state["embedding.weight"]
        self.positions = positional_encoding(max_positions(config), d_model)
        self.generator_weight = state["generator.weight"]
        self.generator_bias = state["generator.bias"]
        self.transformer = attnx.Transformer(
            d_model, config["nhead"], config["num_encoder_layers"], config["num_decoder_layers"],
            config["dim_feedforward"], config["dropout"], batch_first=True,
        )
        prefix = "transformer."
        self.transformer.load_state_dict({key[len(prefix):]: value for key, value in state.items()
                                          if key.startswith(prefix)})
        self.transformer.eval()

    def embed(self, tokens: np.ndarray, start: int = 0) -> np.ndarray:
        """``(N, T, d_model)`` float32: the tokens' embeddings plus the encodings of positions
        ``start``, ``start + 1``, ..."""
        return self.embedding[tokens] + self.positions[start : start + tokens.shape[1]]

    def generate(self, out: np.ndarray) -> np.ndarray:
        """The generator's logits for decoder outputs ``(..., d_model)``."""
        return out @ self.generator_weight.T + self.generator_bias

    def encode(self, src: np.ndarray):
        """``(memory, padding)``: the encoder's output for ``src`` and its padding mask."""
        padding = src == PAD
        return self.transformer.encoder(self.embed(src), src_key_padding_mask=padding), padding


def load_model(path) -> Model:
    """The model exported to the ``.safetensors`` file ``path``, for serving (no torch)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(str(path), framework="np") as f:
        config = json.loads(f.metadata()["config"])
    return Model(config, load_file(str(path)))


def greedy_decode_full(model: Model, src: np.ndarray, steps: int | None = None) -> np.ndarray:
    """Greedy decoding that runs the decoder over the whole prefix at each step, with
    ``Transformer.generate_square_subsequent_mask`` as ``tgt_mask`` (as ``torch_greedy_decode``)."""
    import attnx

    src = np.asarray(src, dtype=np.int64)
    steps = decode_steps(model.config) if steps is None else steps
    memory, padding = model.encode(src)
    batch = len(src)
    ys = np.full((batch, 1), BOS, dtype=np.int64)
    done = np.zeros(batch, dtype=bool)
    tokens = []
    for _ in range(steps):
        mask = attnx.Transformer.generate_square_subsequent_mask(ys.shape[1])
        out = model.transformer.decoder(model.embed(ys), memory, tgt_mask=mask,
                                        memory_key_padding_mask=padding)
        token = model.generate(out[:, -1]).argmax(-1)
        tokens.append(token)
        done |= token == EOS
        if done.all():
            break
        ys = np.concatenate([ys, token[:, None]], axis=1)
    return _finish(tokens, batch, steps)


def greedy_decode_cached(model: Model, src: np.ndarray, steps: int | None = None) -> np.ndarray:
    """Greedy decoding that feeds one token per step through ``TransformerDecoder.step``: each
    layer's self-attention keys and values of the earlier positions stay in the cache (and the
    memory's cross-attention keys and values are projected once), so a step costs one position's
    work instead of the whole prefix's."""
    src = np.asarray(src, dtype=np.int64)
    steps = decode_steps(model.config) if steps is None else steps
    memory, padding = model.encode(src)
    batch = len(src)
    decoder = model.transformer.decoder
    cache = decoder.new_cache(batch, steps)  # the decoder sees BOS and up to steps - 1 tokens
    token = np.full(batch, BOS, dtype=np.int64)
    done = np.zeros(batch, dtype=bool)
    tokens = []
    for position in range(steps):
        out = decoder.step(model.embed(token[:, None], start=position), memory, cache,
                           memory_key_padding_mask=padding)
        token = model.generate(out[:, -1]).argmax(-1)
        tokens.append(token)
        done |= token == EOS
        if done.all():
            break
    return _finish(tokens, batch, steps)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _show(src: np.ndarray, tokens: np.ndarray, rows: int) -> None:
    def digits(row):
        return "".join(str(t - DIGIT0) for t in row if t >= DIGIT0)

    for i in range(min(rows, len(src))):
        answer = digits(tokens[i])
        mark = "ok" if answer == digits(src[i])[::-1] else "WRONG"
        print(f"  {digits(src[i]):>12} -> {answer:<12} {mark}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="translate.safetensors", help="the exported model's file")
    parser.add_argument("--seconds", type=float, default=None,
                        help="training's time budget (default: 60 s, none with --steps)")
    parser.add_argument("--steps", type=int, default=None, help="training's step limit (reproducible)")
    parser.add_argument("--tiny", action="store_true", help="the tiny configuration (seconds of training)")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads for training")
    parser.add_argument("--seed", type=int, default=0, help="training's seed")
    parser.add_argument("--serve", metavar="FILE", help="only serve FILE, an exported model (no torch)")
    parser.add_argument("--batch", type=int, default=256, help="sources to decode")
    parser.add_argument("--data-seed", type=int, default=12345, help="the decoded sources' seed")
    parser.add_argument("--save-tokens", metavar="FILE.npz", help="write the sources and tokens")
    parser.add_argument("--show", type=int, default=5, help="examples to print")
    args = parser.parse_args(argv)

    if args.serve is None:
        config = TINY_CONFIG if args.tiny else CONFIG
        seconds = args.seconds if args.seconds is not None or args.steps is not None else 60.0
        model = train(config, seconds=seconds, steps=args.steps, seed=args.seed, threads=args.threads,
                      log=print)
        print(f"trained {model.trained_steps} steps in {model.train_seconds:.1f} s")
        export(model, args.out)
        print(f"wrote {args.out}")
        path = args.out
    else:
        model, path = None, args.serve

    served = load_model(path)
    src = make_batch(np.random.default_rng(args.data_seed), args.batch, served.config["max_digits"])[0]
    start = time.perf_counter()
    full = greedy_decode_full(served, src)
    full_seconds = time.perf_counter() - start
    start = time.perf_counter()
    cached = greedy_decode_cached(served, src)
    cached_seconds = time.perf_counter() - start
    _show(src, cached, args.show)
    print(f"attnx greedy (full prefix): accuracy {sequence_accuracy(full, src):.4f} ({full_seconds:.3f} s)")
    print(f"attnx greedy (cached):      accuracy {sequence_accuracy(cached, src):.4f} ({cached_seconds:.3f} s)")
    print(f"cached tokens equal full tokens: {np.array_equal(full, cached)}")
    if model is not None:
        reference = torch_greedy_decode(model, src)
        print(f"torch greedy:               accuracy {sequence_accuracy(reference, src):.4f}")
        print(f"attnx tokens equal torch's: full {np.array_equal(full, reference)}, "
              f"cached {np.array_equal(cached, reference)}")
    if args.save_tokens:
        np.savez(args.save_tokens, src=src, full=full, cached=cached)
        print(f"wrote {args.save_tokens}")
    print(f"torch imported: {sys.modules.get('torch') is not None}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
