#!/usr/bin/env python3
"""Benchmark attnx against NumPy, PyTorch, ONNX Runtime and OpenVINO on the CPU.

Usage (from a checkout, after ``pip install .``; the installed attnx is the one timed)::

    python benchmarks/compare.py --quick                # smoke run, nothing saved
    python benchmarks/compare.py                        # full run, saved under benchmarks/results/
    python benchmarks/compare.py --sweep                # time against sequence length, same file
    python benchmarks/compare.py --threads 2 --shapes l1024 --out run.json
    python benchmarks/compare.py --shapes encoder-layer encoder-stack decoder-step
    python benchmarks/compare.py --shapes varlen-b8-l128 varlen-causal-b8-l128 encoder-layer-ragged
    python benchmarks/compare.py --precision bfloat16 --shapes b8-l128 l1024 causal-l2048 d128-l2048 mha-e768

Results go to ``benchmarks/results/DATE-MACHINE-COMMIT.json`` (see results_file.py): the
``compare`` section for the shapes, ``sweep`` for ``--sweep``, ``transformer`` for a run of the
transformer layers only and ``ragged`` for a run of the ragged cases only (so that neither
replaces the shapes' section), and the same names suffixed ``-bfloat16`` for ``--precision
bfloat16``. ``--out`` names another file.

``--precision bfloat16`` compares bfloat16 inference: attnx with ``precision="bfloat16"``, torch
on bfloat16 tensors and modules (``.to(torch.bfloat16)``), OpenVINO with its default inference
precision (bfloat16 on CPUs with AVX512_BF16 or AMX; the precision it chose is recorded). NumPy
and ONNX Runtime (whose CPU provider runs these models in float32) sit that comparison out. The
outputs are checked against the float64 reference with a bfloat16 tolerance, and the fraction of
the peak is still that of the float32 FMA peak (bfloat16 products can exceed 1).

Method
------
* **One process per thread count.** The driver (this script without ``--worker``) starts
  itself once per thread count as a subprocess with ``OMP_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to that count (and
  ``OPENBLAS_THREAD_TIMEOUT=4`` so OpenBLAS's idle threads go to sleep quickly). These must be
  set before NumPy is imported, which is why each count gets a fresh interpreter. Inside the
  worker every library is also told the count through its own API: ``attnx.set_num_threads``,
  ``torch.set_num_threads``, ONNX Runtime's ``intra_op_num_threads`` and OpenVINO's
  ``INFERENCE_NUM_THREADS``.
* **All libraries in the same process, on the same inputs.** float32 inputs are drawn once per
  shape; every library gets those arrays (zero-copy where the library allows it). ONNX
  Runtime's ``MultiHeadAttention`` wants ``(B, L, H*D)`` inputs, so for it the layout is
  converted once at set-up, outside the timed region.
* **Interleaved blocks.** For each round, each library runs a block of ``k`` calls (``k`` is
  calibrated per library so that a block lasts about ``--block-seconds``; at least one call),
  and every call is timed on its own with ``time.perf_counter``. The order of the libraries
  rotates from round to round. Interleaving spreads slow drifts of the machine (frequency,
  other tenants, page cache) over all libraries alike instead of penalising whichever ran last.
* **A pause between libraries.** OpenMP, OpenBLAS and TBB keep their worker threads spinning
  for a while after a parallel region. Without a pause, the previous library's spinning
  threads would compete with the next library's threads for the same cores. The script sleeps
  ``--pause-ms`` (30 ms) before each block; ONNX Runtime is additionally told not to spin.
* **Medians.** Each library's figure is the median of all its per-call times, which ignores
  the occasional interruption; GFLOP/s are computed from it. The speed-up is
  ``median(best peer) / median(attnx)``, where the best peer is the fastest library other than
  attnx whose output agreed with the reference (so > 1 means attnx is faster).
* **Per-round speed-up.** The shared VMs this runs on change speed from one minute to the next
  (neighbours), and a pooled median can then set one library's fast blocks against another's
  slow ones. The table also gives the median over rounds of the best peer's block median over
  attnx's in the same round ("per round"): each ratio compares blocks run a few tenths of a
  second apart.
* **Checked outputs.** Every library's output (including attnx's) is compared with a float64
  NumPy reference of the same computation; the max absolute difference is reported and a peer
  that disagrees is flagged and excluded from "best peer", so a broken set-up is visible
  rather than a silently fast wrong answer.
* **Machine peaks.** Each worker measures an achievable FP32 GEMM rate (a large float32 matmul
  with torch and with NumPy, best of a few) and the memory read bandwidth (reductions over a
  512 MiB float32 array: torch sum on n threads, NumPy max, BLAS sdot; the best of a few), and
  the FP32 FMA peak: by default measured with attnx's own probe (``attnx._core.fma_peak``:
  register-resident chains of vector multiply-adds in the active kernel, on n threads, the best
  of five), or taken from ``--peak-gflops`` (all cores) scaled to the thread count.
  attnx's fraction of peak uses the FMA peak for the compute-bound shapes and, for the decode
  shape (bytes = K and V read once = ``2*B*H*S*D*4``), the read bandwidth measured the same way
  over an array of the K+V size: K and V are re-read on every call, so they live in whichever
  cache level holds that size (64 MiB fits a large L3), and the 512 MiB (DRAM) figure would be
  the wrong roof. The fraction of the DRAM bandwidth is printed as well.
* **Background load.** Each worker reports the share of the machine's CPU time used by other
  processes while it ran (from /proc/stat) and warns above 5%; ``--wait-quiet`` waits for an
  idle machine before each thread count.

FLOP counts: sdpa ``4*B*H*L*S*D`` (two matmuls, 2 FLOPs per multiply-add); for causal shapes
only the computed half is counted (``2*B*H*L*S*D``); the MHA module adds ``8*B*L*E^2`` for the
four projections. Softmax work is not counted.

Transformer layers (``encoder-layer``, ``encoder-stack``, ``decoder-step``, named only)
--------------------------------------------------------------------------------------
* attnx's ``TransformerEncoderLayer`` / ``TransformerEncoder`` / ``TransformerDecoder`` and
  torch's modules load one float32 state dict (torch's keys; random biases and norms) and run in
  ``eval()``; torch under ``inference_mode`` (its fused fast path for the encoders). ONNX Runtime
  and OpenVINO run the torch module exported with ``torch.onnx.export(dynamo=False)``; a failed
  export or an exported model whose output disagrees with the reference is reported as
  "unavailable" with the reason. NumPy has no transformer peer ("n/a").
* A padded encoder's outputs are compared at the non-padded positions only (torch's fast path
  leaves the padded ones undefined).
* The decoder step: attnx's ``step`` over a cache filled with the S cached tokens, against
  "torch-recompute" (the decoder over all S + T tokens with a causal mask, the last T positions)
  and "torch-cached" (TorchCachedDecoder: a loop on the module's weights that caches keys and
  values in torch tensors). The caches are put back to S tokens before every call, untimed
  (``Bench.reset``). attnx's speed-up over every peer is in ``speedups``.
* FLOPs: an encoder layer ``2*B*L*(4*E^2 + 2*E*ff) + 4*B*L^2*E`` (padding not discounted), times
  the layers; a decoder step of T tokens, per layer ``2*B*T*(6*E^2 + 2*E*ff) +
  4*B*T*(S + T + M)*E``, times the layers (the memory's K/V projections are made once per cache).
  The step is memory-bound: its fraction is of the read bandwidth, over the bytes of those weights
  and both attentions' K/V.

Ragged batches (``varlen-b8-l128``, ``varlen-causal-b8-l128``, ``encoder-layer-ragged``, named only)
----------------------------------------------------------------------------------------------------
Eight sequences of 128, 112, ..., 16 tokens (``L - i*L/B``), self-attention, H12 D64 (d768):

* ``varlen-*``: attnx runs ``attnx.varlen_attention`` on the sequences packed along the first
  axis (``(tokens, H, D)``, flash-attn's ``cu_seqlens``), causal per sequence where the shape
  is. The peers run the equivalent padded ``(8, 12, 128, 64)`` batch with a key padding mask:
  NumPy (``numpy_sdpa`` with an additive 0 / -inf mask), torch (``F.scaled_dot_product_attention``
  with a bool mask, True = may attend, ``(B, 1, 1, S)``; for the causal shape the mask is the
  combined ``(B, 1, L, S)`` one, since torch cannot combine ``is_causal`` with ``attn_mask``) and
  "attnx-padded" (``attnx.scaled_dot_product_attention`` on the padded batch with the same bool
  mask). ONNX Runtime and OpenVINO have no model here ("n/a"). The padded outputs are packed to
  the real rows, and every output is compared with the float64 reference of each sequence alone.
* ``encoder-layer-ragged``: the ``encoder-layer`` case (B8 L128 d768 h12 ff3072 gelu, post-norm,
  batch_first) over these lengths. attnx runs its ``TransformerEncoderLayer`` with
  ``src_key_padding_mask``; "torch" is ``nn.TransformerEncoder(layer, num_layers=1,
  enable_nested_tensor=True)`` in ``eval()`` under ``inference_mode`` (torch's padding-free
  nested-tensor path; when torch does not take it, which gives exactly 0 at the padded
  positions, the peer is "unavailable" with the reason); ONNX Runtime and OpenVINO run the
  exported layer as for ``encoder-layer``; "attnx-full" is attnx's same layer on the full batch
  without a mask (the dense batch's time), checked against that batch's own reference. The
  others are compared at the real positions only.
* "attnx-padded" and "attnx-full" are attnx's own baselines: their columns show attnx's time
  with the padding computed, and attnx's speed-up over them (``speedups``, the speed-up line) is
  what skipping the padding gains; they never count as the best peer.
* FLOPs count the real work only, the same figure for every library: varlen the sum over the
  sequences of ``4*H*n^2*D`` (halved where causal); the ragged layer ``2*T*(4*E^2 + 2*E*ff) +
  4*sum(n^2)*E`` over its T real tokens.

Peers that are not installed are reported as "not installed", never as an error.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_file  # noqa: E402  (benchmarks/results_file.py)
from progress import Progress  # noqa: E402  (benchmarks/progress.py)

WORKER_FLAG = "--worker"


def thread_env(threads: int) -> dict[str, str]:
    """Environment variables that fix the thread count of OpenMP / BLAS runtimes."""
    n = str(threads)
    return {
        "OMP_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "OPENBLAS_THREAD_TIMEOUT": "4",
    }


def _set_thread_env_before_numpy() -> None:
    """In a worker process, set the thread variables before NumPy is imported."""
    if WORKER_FLAG in sys.argv:
        i = sys.argv.index(WORKER_FLAG)
        if i + 1 < len(sys.argv) and sys.argv[i + 1].isdigit():
            os.environ.update(thread_env(int(sys.argv[i + 1])))


_set_thread_env_before_numpy()

import numpy as np  # noqa: E402  (must come after the thread variables are set)

LIBRARIES = ("attnx", "numpy", "torch", "onnxruntime", "openvino")
PEERS = LIBRARIES[1:]


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------


LAYER_KINDS = ("encoder-layer", "encoder-stack", "decoder-step")


@dataclass(frozen=True)
class Shape:
    """One benchmark case. For "mha", H*D is the embedding width E and S == L.

    The transformer kinds (LAYER_KINDS) run torch's nn.Transformer layers, batch_first, with
    d_model E = H*D and `ff` the feed-forward width: "encoder-layer" one TransformerEncoderLayer
    over B sequences of L tokens; "encoder-stack" a TransformerEncoder of `layers` layers (and a
    final LayerNorm, as nn.Transformer's); "decoder-step" a TransformerDecoder of `layers` layers
    (and a final LayerNorm) decoding L new tokens over S cached ones, with a memory of `memory`
    tokens. All post-norm."""

    name: str
    kind: str  # "sdpa", "mha" or one of LAYER_KINDS
    B: int
    H: int
    L: int
    S: int
    D: int
    causal: bool = False
    memory_bound: bool = False
    # The causal mask given as an (L, S) float array of 0 / -inf, as model code often passes
    # it, rather than as a flag: each library then finds the closed keys in the mask.
    mask_given: bool = False
    ff: int = 0
    layers: int = 1
    activation: str = "relu"
    # A key padding mask with ragged lengths (padding_lengths): sequence i holds
    # L - i * (L // 2B) tokens, so the shortest holds a little over half.
    padded: bool = False
    memory: int = 0
    # The ragged-batch cases: sequence i holds L - i * (L // B) tokens (128, 112, ..., 16 for
    # B8 L128). "varlen" packs them end to end (attnx.varlen_attention) against the padded batch
    # and its mask; a ragged encoder layer is `padded` with these lengths. FLOPs count the real
    # tokens only.
    ragged: bool = False

    @property
    def E(self) -> int:
        return self.H * self.D

    @property
    def label(self) -> str:
        if self.kind == "mha":
            return f"MHA B{self.B} L{self.L} E{self.E} H{self.H}"
        if self.kind == "varlen":
            tag = " causal" if self.causal else ""
            return f"varlen{tag} B{self.B} H{self.H} L{self.L}..{min(padding_lengths(self))} D{self.D}"
        width = f"d{self.E} h{self.H} ff{self.ff} {self.activation}"
        if self.kind == "encoder-layer" and self.ragged:
            return f"EncoderLayer B{self.B} L{self.L}..{min(padding_lengths(self))} {width} ragged"
        if self.kind == "encoder-layer":
            return f"EncoderLayer B{self.B} L{self.L} {width}" + (" padded" if self.padded else "")
        if self.kind == "encoder-stack":
            return f"Encoder {self.layers}x B{self.B} L{self.L} {width}"
        if self.kind == "decoder-step":
            return f"Decoder {self.layers}x step B{self.B} T{self.L} S{self.S} M{self.memory} {width}"
        tag = " causal mask" if self.mask_given else (
            " causal" if self.causal else (" decode" if self.memory_bound else ""))
        return f"sdpa{tag} B{self.B} H{self.H} L{self.L} S{self.S} D{self.D}"

    @property
    def flops(self) -> float:
        E, ff = self.E, self.ff
        if self.ragged:
            # The real tokens' work only: per sequence of n tokens, the attention's two matmuls
            # (4*H*n^2*D, halved where causal) and, for the encoder layer, its projections and
            # feed-forward matmuls per token.
            lengths = padding_lengths(self)
            attention = 4.0 * self.H * self.D * sum(n * n for n in lengths)
            if self.causal:
                attention /= 2
            if self.kind == "varlen":
                return attention
            return self.layers * (2.0 * sum(lengths) * (4 * E**2 + 2 * E * ff) + attention)
        if self.kind in ("encoder-layer", "encoder-stack"):
            # Four E x E projections and the two feed-forward matmuls per token, and the two
            # attention matmuls; padded tokens are counted as computed.
            per_layer = 2.0 * self.B * self.L * (4 * E**2 + 2 * E * ff) + 4.0 * self.B * self.L * self.L * E
            return self.layers * per_layer
        if self.kind == "decoder-step":
            # Per new token: the self-attention's q, k, v and output projections, the
            # cross-attention's q and output projections (the memory's keys and values are
            # projected once per cache, not per step) and the feed-forward matmuls; the two
            # attention matmuls over the S + L cached and new keys and over the memory.
            per_layer = (2.0 * self.B * self.L * (6 * E**2 + 2 * E * ff)
                         + 4.0 * self.B * self.L * (self.S + self.L + self.memory) * E)
            return self.layers * per_layer
        attention = 4.0 * self.B * self.H * self.L * self.S * self.D
        if self.causal:
            attention /= 2  # only the computed (lower) half
        if self.kind == "mha":
            attention += 8.0 * self.B * self.L * self.E**2
        return attention

    @property
    def bytes_kv(self) -> float:
        """Bytes a memory-bound call reads (float32): K and V, each once, for sdpa; for
        decoder-step the weights the step multiplies with (as counted in `flops`) and the keys
        and values of both attentions."""
        if self.kind == "decoder-step":
            E, ff = self.E, self.ff
            weights = 6 * E**2 + 2 * E * ff
            keys_values = 2 * self.B * (self.S + self.L + self.memory) * E
            return 4.0 * self.layers * (weights + keys_values)
        if self.kind == "varlen":
            return 2.0 * sum(padding_lengths(self)) * self.H * self.D * 4  # the real rows only
        return 2.0 * self.B * self.H * self.S * self.D * 4

    @property
    def bytes_of(self) -> str:
        """What `bytes_kv` counts, in words."""
        return "weights + K/V" if self.kind == "decoder-step" else "K+V"


SHAPES = (
    Shape("b8-l128", "sdpa", B=8, H=12, L=128, S=128, D=64),
    Shape("l1024", "sdpa", B=1, H=12, L=1024, S=1024, D=64),
    Shape("causal-l2048", "sdpa", B=1, H=12, L=2048, S=2048, D=64, causal=True),
    Shape("decode-s2048", "sdpa", B=1, H=32, L=1, S=2048, D=128, memory_bound=True),
    Shape("tiny", "sdpa", B=1, H=4, L=16, S=16, D=16),
    Shape("mha-e768", "mha", B=8, H=12, L=128, S=128, D=64),
    Shape("mha-e64", "mha", B=1, H=4, L=16, S=16, D=16),
)
# Run only when named: a BERT-sized layer on one token (projections of one
# row: reading the weights is the work) and on a short sequence; a causal
# mask given as an array; long sequences and wide heads; a few queries against
# many keys.
EXTRA_SHAPES = (
    Shape("mha-e1024-l1", "mha", B=1, H=16, L=1, S=1, D=64),
    Shape("mha-e768-l64", "mha", B=1, H=12, L=64, S=64, D=64),
    Shape("causal-mask-l2048", "sdpa", B=1, H=12, L=2048, S=2048, D=64, causal=True,
          mask_given=True),
    # Heads whose keys and values outgrow L2 (2 MiB and 4 MiB a head), and wide heads.
    Shape("l8192", "sdpa", B=1, H=2, L=8192, S=8192, D=64),
    Shape("d128-l2048", "sdpa", B=1, H=8, L=2048, S=2048, D=128),
    Shape("d256-l512", "sdpa", B=1, H=8, L=512, S=512, D=256),
    # A step that checks 16 drafted tokens against a long cache: 128 MiB of keys and values,
    # read from memory.
    Shape("decode-l16-s4096", "sdpa", B=1, H=32, L=16, S=4096, D=128, memory_bound=True),
)

# nn.Transformer layers, run only when named: a BERT-base encoder layer over a padded batch; a
# 6-layer encoder over one long sequence; a step of a 6-layer decoder (the base Transformer's
# width) that adds one token to 256 cached ones. The "-tiny" ones are the same cases on small
# widths, for smoke runs.
LAYER_SHAPES = (
    Shape("encoder-layer", "encoder-layer", B=8, H=12, L=128, S=128, D=64, ff=3072, activation="gelu",
          padded=True),
    Shape("encoder-stack", "encoder-stack", B=1, H=12, L=512, S=512, D=64, ff=3072, layers=6,
          activation="gelu"),
    Shape("decoder-step", "decoder-step", B=4, H=8, L=1, S=256, D=64, ff=2048, layers=6, memory=128,
          memory_bound=True),
    Shape("encoder-layer-tiny", "encoder-layer", B=2, H=2, L=16, S=16, D=8, ff=32, activation="gelu",
          padded=True),
    Shape("encoder-stack-tiny", "encoder-stack", B=1, H=2, L=16, S=16, D=8, ff=32, layers=2,
          activation="gelu"),
    Shape("decoder-step-tiny", "decoder-step", B=2, H=2, L=1, S=8, D=8, ff=32, layers=2, memory=4,
          memory_bound=True),
    # The encoder layer over lengths 128, 112, ..., 16 (see RAGGED_SHAPES).
    Shape("encoder-layer-ragged", "encoder-layer", B=8, H=12, L=128, S=128, D=64, ff=3072, activation="gelu",
          padded=True, ragged=True),
    Shape("encoder-layer-ragged-tiny", "encoder-layer", B=4, H=2, L=16, S=16, D=8, ff=32, activation="gelu",
          padded=True, ragged=True),
)
# Ragged batches, run only when named: 8 self-attention sequences of 128, 112, ..., 16 tokens,
# packed end to end for attnx.varlen_attention, padded to (8, 12, 128, 64) with a key padding
# mask for the peers and for "attnx-padded" (attnx's sdpa on the padded batch); the ragged
# encoder layers (LAYER_SHAPES) are their layer-level counterpart.
RAGGED_SHAPES = (
    Shape("varlen-b8-l128", "varlen", B=8, H=12, L=128, S=128, D=64, ragged=True),
    Shape("varlen-causal-b8-l128", "varlen", B=8, H=12, L=128, S=128, D=64, causal=True, ragged=True),
    Shape("varlen-tiny", "varlen", B=4, H=2, L=16, S=16, D=8, causal=True, ragged=True),
)


SWEEP_LENGTHS = (128, 256, 512, 1024, 2048)


def sweep_shapes(lengths) -> list[Shape]:
    """The --sweep cases: sdpa B1 H12 D64 with L == S, one per length."""
    return [Shape(f"sweep-l{n}", "sdpa", B=1, H=12, L=n, S=n, D=64) for n in lengths]


def select_shapes(selectors: list[str] | None) -> list[Shape]:
    """Shapes by 1-based number or name; all when `selectors` is empty."""
    if not selectors:
        return list(SHAPES)
    chosen = []
    for sel in selectors:
        if sel.isdigit() and 1 <= int(sel) <= len(SHAPES):
            chosen.append(SHAPES[int(sel) - 1])
            continue
        matches = [s for s in SHAPES + EXTRA_SHAPES + LAYER_SHAPES + RAGGED_SHAPES if s.name == sel]
        if not matches:
            names = ", ".join([f"{i}={s.name}" for i, s in enumerate(SHAPES, 1)] +
                              [s.name for s in EXTRA_SHAPES + LAYER_SHAPES + RAGGED_SHAPES])
            raise SystemExit(f"unknown shape {sel!r}; choose from {names}")
        chosen.extend(matches)
    return chosen


def padding_lengths(shape: Shape) -> list[int]:
    """Tokens of each sequence of a padded shape: L - i * (L // 2B) (128 - 8*i for B8 L128);
    of a ragged one L - i * (L // B) (128 - 16*i)."""
    step = max(1, shape.L // (shape.B if shape.ragged else 2 * shape.B))
    return [max(1, shape.L - i * step) for i in range(shape.B)]


def key_padding_mask(shape: Shape) -> np.ndarray:
    """(B, L) bool, True at the padded positions (torch's convention)."""
    return np.arange(shape.L)[None, :] >= np.array(padding_lengths(shape))[:, None]


def pack_rows(shape: Shape, a: np.ndarray) -> np.ndarray:
    """A padded (B, H, L, D) batch of a varlen case as its packed rows (tokens, H, D): sequence
    b's first padding_lengths[b] positions, one sequence after another."""
    a = np.asarray(a)
    return np.concatenate([a[b, :, :n].transpose(1, 0, 2) for b, n in enumerate(padding_lengths(shape))])


def varlen_allowed_mask(shape: Shape) -> np.ndarray:
    """The padded batch's bool attention mask, True where a query may attend a key (sdpa's
    convention): (B, 1, 1, S) over the real keys; (B, 1, L, S) with the causal lower triangle
    too (torch's sdpa cannot combine is_causal with a mask)."""
    allowed = ~key_padding_mask(shape)[:, None, None, :]
    if shape.causal:
        allowed = allowed & np.tri(shape.L, shape.S, dtype=bool)
    return allowed


def layer_state(shape: Shape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """float32 parameters under torch's state_dict keys. Initialised like torch (xavier for the
    input projections, uniform +-1/sqrt(fan_in) for the linear layers), except that every bias
    and layer norm is random too, so that each of those paths is checked."""
    E, ff = shape.E, shape.ff
    state: dict[str, np.ndarray] = {}

    def uniform(bound, *dims):
        return rng.uniform(-bound, bound, dims).astype(np.float32)

    def linear(name, out_features, in_features):
        state[name + "weight"] = uniform(1.0 / math.sqrt(in_features), out_features, in_features)
        state[name + "bias"] = uniform(1.0 / math.sqrt(in_features), out_features)

    def attention(name):
        state[name + "in_proj_weight"] = uniform(math.sqrt(6.0 / (E + 3 * E)), 3 * E, E)
        state[name + "in_proj_bias"] = 0.1 * rng.standard_normal(3 * E, dtype=np.float32)
        linear(name + "out_proj.", E, E)

    def norm(name):
        state[name + "weight"] = 1.0 + 0.1 * rng.standard_normal(E, dtype=np.float32)
        state[name + "bias"] = 0.1 * rng.standard_normal(E, dtype=np.float32)

    decoder = shape.kind == "decoder-step"
    stack = shape.kind != "encoder-layer"
    for i in range(shape.layers):
        prefix = f"layers.{i}." if stack else ""
        attention(prefix + "self_attn.")
        if decoder:
            attention(prefix + "multihead_attn.")
        linear(prefix + "linear1.", ff, E)
        linear(prefix + "linear2.", E, ff)
        for j in range(1, 4 if decoder else 3):
            norm(f"{prefix}norm{j}.")
    if stack:
        norm("norm.")
    return state


def make_inputs(shape: Shape, seed: int = 0) -> dict[str, Any]:
    """float32 inputs: q, k, v (B, H, L|S, D) for sdpa; for varlen the same padded q, k, v, their
    packed rows q_packed, k_packed, v_packed (tokens, H, D), cu_seqlens and key_padding_mask;
    x (B, L, E) and weights for mha; for the transformer kinds the parameters ("state", torch's
    state_dict keys) and x (B, L, E) with "key_padding_mask" when padded (encoders), or tgt
    (B, S + L, E), the S cached tokens then the L new ones, and memory (B, M, E) (decoder-step)."""
    rng = np.random.default_rng(seed)

    def randn(*dims):
        return rng.standard_normal(dims, dtype=np.float32)

    if shape.kind in LAYER_KINDS:
        data: dict[str, Any] = {"state": layer_state(shape, rng)}
        if shape.kind == "decoder-step":
            data["tgt"] = randn(shape.B, shape.S + shape.L, shape.E)
            data["memory"] = randn(shape.B, shape.memory, shape.E)
        else:
            data["x"] = randn(shape.B, shape.L, shape.E)
            if shape.padded:
                data["key_padding_mask"] = key_padding_mask(shape)
        return data
    if shape.kind == "sdpa":
        return {
            "q": randn(shape.B, shape.H, shape.L, shape.D),
            "k": randn(shape.B, shape.H, shape.S, shape.D),
            "v": randn(shape.B, shape.H, shape.S, shape.D),
        }
    if shape.kind == "varlen":
        data = {name: randn(shape.B, shape.H, shape.L, shape.D) for name in ("q", "k", "v")}
        for name in ("q", "k", "v"):
            data[name + "_packed"] = pack_rows(shape, data[name])
        data["cu_seqlens"] = np.concatenate([[0], np.cumsum(padding_lengths(shape))]).astype(np.int32)
        data["key_padding_mask"] = key_padding_mask(shape)
        return data
    E = shape.E
    bound_in = math.sqrt(6.0 / (E + 3 * E))  # xavier_uniform_ on (3E, E), as torch
    bound_out = 1.0 / math.sqrt(E)
    return {
        "x": randn(shape.B, shape.L, E),
        "w_in": rng.uniform(-bound_in, bound_in, (3 * E, E)).astype(np.float32),
        "b_in": 0.1 * randn(3 * E),  # non-zero biases so the bias paths are checked too
        "w_out": rng.uniform(-bound_out, bound_out, (E, E)).astype(np.float32),
        "b_out": 0.1 * randn(E),
    }


# --------------------------------------------------------------------------------------------
# NumPy implementation (a peer, and in float64 the reference)
# --------------------------------------------------------------------------------------------


def causal_additive_mask(L: int, S: int, dtype) -> np.ndarray:
    """(L, S) float mask: 0 where key j <= query i (top-left aligned), -inf elsewhere."""
    mask = np.zeros((L, S), dtype=dtype)
    mask[np.triu_indices(L, k=1, m=S)] = -np.inf
    return mask


def numpy_sdpa(q, k, v, mask=None, softcap=None):
    """softmax(q @ k^T * scale + mask) @ v with matmul; normalises after the second matmul.
    With softcap, the scores are softcap * tanh(scores / softcap) before the mask."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = np.matmul(q * q.dtype.type(scale), np.swapaxes(k, -1, -2))
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if mask is not None:
        scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)
    out /= denom
    return out


def numpy_mha(x, w_in, b_in, w_out, b_out, num_heads, mask=None):
    """Self-attention MHA (batch_first): in-projection, sdpa per head, out-projection."""
    B, L, E = x.shape
    D = E // num_heads
    qkv = x @ w_in.T
    qkv += b_in
    qkv = qkv.reshape(B, L, 3, num_heads, D).transpose(2, 0, 3, 1, 4)  # (3, B, H, L, D)
    heads = numpy_sdpa(qkv[0], qkv[1], qkv[2], mask)
    merged = heads.transpose(0, 2, 1, 3).reshape(B, L, E)
    out = merged @ w_out.T
    out += b_out
    return out


def layer_output_view(shape: Shape, data: dict) -> Callable[[np.ndarray], np.ndarray]:
    """What of a transformer case's output is compared: for a padded encoder the rows at the
    non-padded positions only ((tokens, E)), since torch's fast path leaves the padded ones
    undefined (zeros); otherwise all of it."""
    if shape.padded:
        keep = ~data["key_padding_mask"]
        return lambda out: np.asarray(out)[keep]
    return np.asarray


def reference_layer_output(shape: Shape, data: dict) -> np.ndarray:
    """The float64 result of a transformer case, from attnx.reference's layers (float64 NumPy,
    exact GELU) chained as torch's stacks chain them; the decoder runs all S + L tokens at once
    with a causal mask, and its last L positions are the step's."""
    from attnx import reference

    state = {name: a.astype(np.float64) for name, a in data["state"].items()}

    def params(prefix: str) -> dict[str, np.ndarray]:
        return {name[len(prefix):]: a for name, a in state.items() if name.startswith(prefix)}

    def final_norm(x):
        return reference.layer_norm(x, state["norm.weight"], state["norm.bias"], 1e-5)

    common = dict(activation=shape.activation, batch_first=True)
    if shape.kind == "decoder-step":
        x, memory = data["tgt"].astype(np.float64), data["memory"].astype(np.float64)
        for i in range(shape.layers):
            x = reference.transformer_decoder_layer(x, memory, params(f"layers.{i}."), shape.H, tgt_is_causal=True,
                                                    **common)
        return final_norm(x)[:, shape.S:]
    x = data["x"].astype(np.float64)
    mask = data.get("key_padding_mask")
    if shape.kind == "encoder-layer":
        out = reference.transformer_encoder_layer(x, params(""), shape.H, src_key_padding_mask=mask, **common)
    else:
        for i in range(shape.layers):
            x = reference.transformer_encoder_layer(x, params(f"layers.{i}."), shape.H, src_key_padding_mask=mask,
                                                    **common)
        out = final_norm(x)
    return layer_output_view(shape, data)(out)


def reference_output(shape: Shape, data: dict[str, Any], softcap: float | None = None) -> np.ndarray:
    """The float64 NumPy result every library is checked against (the soft cap: sdpa only)."""
    if shape.kind in LAYER_KINDS:
        return reference_layer_output(shape, data)
    if shape.kind == "varlen":
        # Each sequence alone, no padding and no mask (but the causal one): the packed rows.
        rows = []
        for b, n in enumerate(padding_lengths(shape)):
            q, k, v = (data[name][b, :, :n].astype(np.float64) for name in ("q", "k", "v"))
            mask = causal_additive_mask(n, n, np.float64) if shape.causal else None
            rows.append(numpy_sdpa(q, k, v, mask).transpose(1, 0, 2))
        return np.concatenate(rows)
    d64 = {name: a.astype(np.float64) for name, a in data.items()}
    mask = causal_additive_mask(shape.L, shape.S, np.float64) if shape.causal else None
    if shape.kind == "sdpa":
        return numpy_sdpa(d64["q"], d64["k"], d64["v"], mask, softcap)
    return numpy_mha(d64["x"], d64["w_in"], d64["b_in"], d64["w_out"], d64["b_out"], shape.H, mask)


# --------------------------------------------------------------------------------------------
# Library adapters: setup_<lib>(shape, data, threads) -> Bench
# --------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """A prepared library call: `run()` is timed; `to_numpy(run())` gives the canonical output
    ((B, H, L, D) for sdpa, (B, L, E) for mha, layer_output_view's for the transformer kinds)
    and is not timed. `reset`, when given, runs untimed before every call: a decoding step puts
    its cache back to the length it had before the step. `exported`: the call runs a model
    exported from torch, and an output that disagrees with the reference makes the peer
    unavailable (the export's fault) rather than wrong. `reference`, when given, is the float64
    result this call is checked against instead of the case's: "attnx-full" computes the batch
    without its mask."""

    run: Callable[[], Any]
    to_numpy: Callable[[Any], np.ndarray] = np.asarray
    note: str = ""
    reset: Callable[[], None] | None = None
    exported: bool = False
    reference: np.ndarray | None = None


class NotInstalled(Exception):
    """The peer library cannot be imported."""


class Unavailable(Exception):
    """The peer is installed but cannot run this case (a failed model export, say)."""


class NotApplicable(Exception):
    """The peer has no implementation of this kind of case."""


def call_once(bench: Bench) -> Any:
    """One call of `bench` outside any timing, its reset first."""
    if bench.reset is not None:
        bench.reset()
    return bench.run()


def import_optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise NotInstalled(str(exc)) from None


def attnx_precision(precision: str) -> dict[str, str]:
    """The keyword attnx's calls take for `precision` (none for float32, the default)."""
    return {} if precision == "float32" else {"precision": precision}


def attnx_kernel_note(precision: str) -> str:
    import attnx

    kernels = attnx.show_config().get("precisions", {})
    return f"{precision} kernel {kernels.get(precision, attnx.show_config()['isa'])}"


def setup_attnx(shape: Shape, data, threads: int, softcap: float | None = None,
                precision: str = "float32") -> Bench:
    """attnx's call of a shape; with `softcap`, the sdpa shapes soft-cap their scores (ab.py's
    --after-softcap), and the multi-head and transformer ones, which have no soft cap, run as
    they are."""
    if shape.kind in LAYER_KINDS:
        return setup_attnx_layer(shape, data, threads, precision)
    import attnx

    attnx.set_num_threads(threads)
    if shape.kind == "varlen":
        q, k, v, cu = data["q_packed"], data["k_packed"], data["v_packed"], data["cu_seqlens"]
        extra = attnx_precision(precision)
        return Bench(lambda: attnx.varlen_attention(q, k, v, cu, is_causal=shape.causal, **extra),
                     note=f"attnx.varlen_attention on the packed rows, {attnx_kernel_note(precision)}")
    if shape.kind == "sdpa":
        q, k, v = data["q"], data["k"], data["v"]
        extra = {} if softcap is None else {"softcap": softcap}
        extra.update(attnx_precision(precision))
        if shape.mask_given:
            mask = causal_additive_mask(shape.L, shape.S, np.float32)
            return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra),
                         note=attnx_kernel_note(precision))
        return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, **extra),
                     note=attnx_kernel_note(precision))
    x = data["x"]
    module_cls = getattr(attnx, "MultiheadAttention", None)
    if module_cls is not None:
        module = module_cls(shape.E, shape.H, batch_first=True, dtype=np.float32, **attnx_precision(precision))
        module.load_state_dict(
            {
                "in_proj_weight": data["w_in"],
                "in_proj_bias": data["b_in"],
                "out_proj.weight": data["w_out"],
                "out_proj.bias": data["b_out"],
            }
        )
        return Bench(
            lambda: module(x, x, x, need_weights=False, is_causal=shape.causal)[0],
            note=f"attnx.MultiheadAttention, {attnx_kernel_note(precision)}",
        )
    args = (shape.E, shape.H, data["w_in"], data["b_in"], None, None, False, 0.0, data["w_out"], data["b_out"])
    return Bench(
        lambda: attnx.multi_head_attention_forward(
            x, x, x, *args, training=False, need_weights=False, is_causal=shape.causal, batch_first=True
        )[0],
        note="attnx.multi_head_attention_forward (attnx.MultiheadAttention not available)",
    )


def setup_attnx_padded(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """"attnx-padded", a varlen case's baseline: attnx's sdpa on the padded batch with the bool
    mask of the real keys (and the causal triangle), its output packed to the real rows."""
    import attnx

    attnx.set_num_threads(threads)
    q, k, v = data["q"], data["k"], data["v"]
    mask = varlen_allowed_mask(shape)
    extra = attnx_precision(precision)
    return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra),
                 lambda out: pack_rows(shape, out),
                 note=f"attnx.scaled_dot_product_attention on the padded batch, bool attn_mask "
                      f"{tuple(mask.shape)}, {attnx_kernel_note(precision)}")


def setup_attnx_full(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """"attnx-full", a ragged encoder layer's baseline: attnx's same layer on the full batch
    without a mask (every position real), checked against the float64 result of that batch."""
    dense = replace(shape, padded=False, ragged=False)
    unmasked = {name: a for name, a in data.items() if name != "key_padding_mask"}
    bench = setup_attnx_layer(dense, unmasked, threads, precision)
    bench.reference = reference_layer_output(dense, unmasked)
    bench.note += ", the full batch without a mask (checked against that batch's reference)"
    return bench


def setup_attnx_with_baselines(shape: Shape, data, threads: int,
                               precision: str = "float32") -> Bench | dict[str, Bench]:
    """ADAPTERS' attnx: setup_attnx's call and, for the ragged cases, attnx's own baseline beside
    it ("attnx-padded" for varlen, "attnx-full" for the ragged encoder layer): the speed-up over
    it is what skipping the padding gains. A baseline is never the "best peer"."""
    bench = setup_attnx(shape, data, threads, precision=precision)
    if shape.kind == "varlen":
        return {"attnx": bench, "attnx-padded": setup_attnx_padded(shape, data, threads, precision)}
    if shape.ragged:
        return {"attnx": bench, "attnx-full": setup_attnx_full(shape, data, threads, precision)}
    return bench


def setup_numpy(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    if shape.kind in LAYER_KINDS:
        raise NotApplicable("no NumPy transformer peer")
    if precision != "float32":
        raise NotApplicable("NumPy has no bfloat16 products")
    if shape.kind == "varlen":
        q, k, v = data["q"], data["k"], data["v"]
        additive = np.where(varlen_allowed_mask(shape), np.float32(0), np.float32(-np.inf))
        return Bench(lambda: numpy_sdpa(q, k, v, additive), lambda out: pack_rows(shape, out),
                     note="the padded batch, additive mask")
    mask = causal_additive_mask(shape.L, shape.S, np.float32) if shape.causal else None
    if shape.kind == "sdpa":
        q, k, v = data["q"], data["k"], data["v"]
        return Bench(lambda: numpy_sdpa(q, k, v, mask))
    d = data
    return Bench(lambda: numpy_mha(d["x"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], shape.H, mask))


def torch_dtype(torch, precision: str):
    return torch.bfloat16 if precision == "bfloat16" else torch.float32


def torch_note(torch, precision: str) -> str:
    """torch's dtype and the CPU capability its kernels dispatch to."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    return f"{precision}, CPU capability {capability}"


def setup_torch(shape: Shape, data, threads: int, precision: str = "float32") -> Bench | dict[str, Bench]:
    if shape.kind in LAYER_KINDS:
        return setup_torch_layer(shape, data, threads, precision)
    torch = import_optional("torch")
    torch.set_num_threads(threads)
    dtype = torch_dtype(torch, precision)
    to_numpy = lambda t: t.float().numpy()  # noqa: E731
    if shape.kind == "varlen":
        q, k, v = (torch.from_numpy(data[n]).to(dtype) for n in ("q", "k", "v"))
        allowed = torch.from_numpy(varlen_allowed_mask(shape))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_padded():
            with torch.inference_mode():
                return sdpa(q, k, v, attn_mask=allowed)

        return Bench(run_padded, lambda t: pack_rows(shape, t.float().numpy()),
                     note=f"F.scaled_dot_product_attention on the padded batch, bool attn_mask "
                          f"{tuple(allowed.shape)}, inference_mode, {torch_note(torch, precision)}")
    if shape.kind == "sdpa":
        q, k, v = (torch.from_numpy(data[n]).to(dtype) for n in ("q", "k", "v"))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        mask = torch.from_numpy(causal_additive_mask(shape.L, shape.S, np.float32)) if shape.mask_given else None
        if mask is not None:
            mask = mask.to(dtype)

        def run_sdpa():
            with torch.inference_mode():
                if mask is not None:
                    return sdpa(q, k, v, attn_mask=mask)
                return sdpa(q, k, v, is_causal=shape.causal)

        return Bench(run_sdpa, to_numpy,
                     note=f"F.scaled_dot_product_attention, inference_mode, {torch_note(torch, precision)}")
    module = torch.nn.MultiheadAttention(shape.E, shape.H, batch_first=True)
    module.load_state_dict(
        {
            "in_proj_weight": torch.from_numpy(data["w_in"]),
            "in_proj_bias": torch.from_numpy(data["b_in"]),
            "out_proj.weight": torch.from_numpy(data["w_out"]),
            "out_proj.bias": torch.from_numpy(data["b_out"]),
        }
    )
    module.eval().to(dtype)
    x = torch.from_numpy(data["x"]).to(dtype)
    mask = None
    if shape.causal:
        mask = torch.from_numpy(causal_additive_mask(shape.L, shape.S, np.float32)).to(dtype)

    def run_mha():
        with torch.inference_mode():
            return module(x, x, x, need_weights=False, attn_mask=mask)[0]

    return Bench(run_mha, to_numpy,
                 note=f"nn.MultiheadAttention eval(), inference_mode, {torch_note(torch, precision)}")


def _onnx_model_bytes(shape: Shape, data) -> bytes:
    """An in-memory ONNX model around com.microsoft MultiHeadAttention (BSH layout)."""
    onnx = import_optional("onnx")
    from onnx import TensorProto, helper, numpy_helper

    B, L, S, E = shape.B, shape.L, shape.S, shape.E
    attrs = {"num_heads": shape.H}
    if shape.causal and not shape.mask_given:
        attrs["unidirectional"] = 1
    f32 = TensorProto.FLOAT
    if shape.kind == "sdpa":
        inputs = [
            helper.make_tensor_value_info("query", f32, [B, L, E]),
            helper.make_tensor_value_info("key", f32, [B, S, E]),
            helper.make_tensor_value_info("value", f32, [B, S, E]),
        ]
        names = ["query", "key", "value"]
        if shape.mask_given:  # inputs 3, 4 (bias, key_padding_mask) absent; 5: attention_bias
            inputs.append(helper.make_tensor_value_info("attention_bias", f32, [1, 1, L, S]))
            names += ["", "", "attention_bias"]
        nodes = [helper.make_node("MultiHeadAttention", names, ["output"], domain="com.microsoft", **attrs)]
        initializers = []
    else:
        inputs = [helper.make_tensor_value_info("x", f32, [B, L, E])]
        initializers = [
            numpy_helper.from_array(np.ascontiguousarray(data["w_in"].T), "w_in_t"),
            numpy_helper.from_array(data["b_in"], "b_in"),
            numpy_helper.from_array(np.ascontiguousarray(data["w_out"].T), "w_out_t"),
            numpy_helper.from_array(data["b_out"], "b_out"),
            numpy_helper.from_array(np.array([E, E, E], dtype=np.int64), "split_sizes"),
        ]
        nodes = [
            helper.make_node("MatMul", ["x", "w_in_t"], ["qkv_mm"]),
            helper.make_node("Add", ["qkv_mm", "b_in"], ["qkv"]),
            helper.make_node("Split", ["qkv", "split_sizes"], ["q", "k", "v"], axis=2),
            helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["attn"], domain="com.microsoft", **attrs),
            helper.make_node("MatMul", ["attn", "w_out_t"], ["out_mm"]),
            helper.make_node("Add", ["out_mm", "b_out"], ["output"]),
        ]
    outputs = [helper.make_tensor_value_info("output", f32, [B, L, E])]
    graph = helper.make_graph(nodes, f"attnx_bench_{shape.name}", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _to_bsh(a: np.ndarray) -> np.ndarray:
    """(B, H, N, D) -> (B, N, H*D), contiguous."""
    B, H, N, D = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(B, N, H * D)


def _ort_bound_run(session, feeds: dict) -> Callable[[], Any]:
    """A call of `session` on `feeds`, bound once (zero-copy), as a server would: its output
    "output" as an array."""
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("output")

    def run():
        assert feeds  # bound zero-copy: the arrays must live as long as the binding
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    return run


def _ort_options(ort, threads: int):
    """Session options: `threads` intra-op threads that do not spin, all graph optimisations."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def setup_onnxruntime(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    if shape.kind == "varlen":
        raise NotApplicable("no packed or masked-padding attention model here")
    if precision != "float32":
        raise NotApplicable("ONNX Runtime's CPU provider runs these models in float32")
    if shape.kind in LAYER_KINDS:
        return setup_onnxruntime_layer(shape, data, threads)
    ort = import_optional("onnxruntime")
    session = ort.InferenceSession(_onnx_model_bytes(shape, data), _ort_options(ort, threads),
                                   providers=["CPUExecutionProvider"])

    if shape.kind == "sdpa":
        feeds = {"query": _to_bsh(data["q"]), "key": _to_bsh(data["k"]), "value": _to_bsh(data["v"])}
        if shape.mask_given:
            feeds["attention_bias"] = causal_additive_mask(shape.L, shape.S, np.float32)[None, None]
        B, H, L, D = shape.B, shape.H, shape.L, shape.D
        to_numpy = lambda out: out.reshape(B, L, H, D).transpose(0, 2, 1, 3)  # noqa: E731
        note = "com.microsoft.MultiHeadAttention" + (
            " attention_bias" if shape.mask_given else " unidirectional=1" if shape.causal else "")
    else:
        feeds = {"x": data["x"]}
        to_numpy = np.asarray
        note = "MatMul+Add, Split, com.microsoft.MultiHeadAttention, MatMul+Add"

    return Bench(_ort_bound_run(session, feeds), to_numpy, note=note)


def _openvino_ops():
    for name in ("openvino.opset13", "openvino.runtime.opset13"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NotInstalled("openvino.opset13 not found")


def _openvino_model(shape: Shape, data, ops, ov):
    """An ov.Model: opset13 ScaledDotProductAttention, with MatMul projections for mha."""
    B, H, L, S, D, E = shape.B, shape.H, shape.L, shape.S, shape.D, shape.E
    f32 = ov.Type.f32
    if shape.kind == "sdpa":
        params = [
            ops.parameter([B, H, L, D], f32, name="q"),
            ops.parameter([B, H, S, D], f32, name="k"),
            ops.parameter([B, H, S, D], f32, name="v"),
        ]
        if shape.mask_given:
            params.append(ops.parameter([L, S], f32, name="mask"))
            out = ops.scaled_dot_product_attention(*params, causal=False)
            return ov.Model([out], params, f"sdpa_{shape.name}")
        out = ops.scaled_dot_product_attention(*params, causal=shape.causal)
        return ov.Model([out], params, f"sdpa_{shape.name}")
    x = ops.parameter([B, L, E], f32, name="x")
    qkv = ops.add(ops.matmul(x, ops.constant(data["w_in"]), False, True), ops.constant(data["b_in"]))
    parts = ops.split(qkv, ops.constant(np.int64(2)), 3).outputs()

    def to_heads(t):
        t = ops.reshape(t, ops.constant(np.array([B, L, H, D], dtype=np.int64)), False)
        return ops.transpose(t, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64)))

    attn = ops.scaled_dot_product_attention(*(to_heads(p) for p in parts), causal=shape.causal)
    attn = ops.transpose(attn, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64)))
    attn = ops.reshape(attn, ops.constant(np.array([B, L, E], dtype=np.int64)), False)
    out = ops.add(ops.matmul(attn, ops.constant(data["w_out"]), False, True), ops.constant(data["b_out"]))
    return ov.Model([out], [x], f"mha_{shape.name}")


def _openvino_config(threads: int, precision: str = "float32") -> dict:
    """float32: the f32 hint; bfloat16: OpenVINO's default inference precision (no hint)."""
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "ENABLE_CPU_PINNING": False,  # pinning would also pin this process's other threads
    }
    if precision == "float32":
        config["INFERENCE_PRECISION_HINT"] = "f32"
    return config


def _openvino_note(compiled, what: str) -> str:
    chosen = compiled.get_property("INFERENCE_PRECISION_HINT")
    return f"{what}, inference precision {getattr(chosen, 'get_type_name', lambda: chosen)()}"


def setup_openvino(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    if shape.kind in LAYER_KINDS:
        return setup_openvino_layer(shape, data, threads, precision)
    if shape.kind == "varlen":
        raise NotApplicable("no packed or masked-padding attention model here")
    ov = import_optional("openvino")
    ops = _openvino_ops()
    compiled = ov.Core().compile_model(_openvino_model(shape, data, ops, ov), "CPU",
                                       _openvino_config(threads, precision))
    request = compiled.create_infer_request()
    names = ("q", "k", "v") if shape.kind == "sdpa" else ("x",)
    inputs = [data[name] for name in names]
    if shape.mask_given:
        inputs.append(causal_additive_mask(shape.L, shape.S, np.float32))
    for i, array in enumerate(inputs):  # inputs bound once, sharing the NumPy memory
        request.set_input_tensor(i, ov.Tensor(array, shared_memory=True))

    def run():
        # The tensors share the arrays' memory and do not own it: `inputs` (the mask made
        # here among them) must live as long as the request.
        assert inputs
        request.infer()
        return request.get_output_tensor(0).data

    return Bench(run, lambda out: np.array(out, copy=True),
                 note=_openvino_note(compiled, "opset13.ScaledDotProductAttention"))


# --------------------------------------------------------------------------------------------
# Transformer layers: the layer kinds' adapters
# --------------------------------------------------------------------------------------------


def setup_attnx_layer(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """attnx's nn.Transformer modules, loaded with the case's state dict, in eval mode. The
    decoder step runs TransformerDecoder.step over a cache that one step filled with the S
    cached tokens; the cache lengths are put back after each step."""
    import attnx

    attnx.set_num_threads(threads)
    E, H = shape.E, shape.H
    config = dict(dim_feedforward=shape.ff, activation=shape.activation, batch_first=True, dtype=np.float32,
                  **attnx_precision(precision))
    view = layer_output_view(shape, data)
    if shape.kind == "encoder-layer":
        module = attnx.TransformerEncoderLayer(E, H, **config)
    else:
        from attnx.transformer import LayerNorm

        norm = LayerNorm(E, dtype=np.float32)
        if shape.kind == "encoder-stack":
            module = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(E, H, **config), shape.layers, norm,
                                              **attnx_precision(precision))
        else:
            module = attnx.TransformerDecoder(attnx.TransformerDecoderLayer(E, H, **config), shape.layers, norm,
                                              **attnx_precision(precision))
    module.load_state_dict(data["state"])
    module.eval()
    name = type(module).__name__
    if shape.kind != "decoder-step":
        x = data["x"]
        mask = data.get("key_padding_mask")
        if mask is None:
            return Bench(lambda: module(x), view, note=f"attnx.{name}")
        return Bench(lambda: module(x, src_key_padding_mask=mask), view,
                     note=f"attnx.{name}, src_key_padding_mask")
    memory, tgt = data["memory"], data["tgt"]
    past, new = tgt[:, :shape.S], np.ascontiguousarray(tgt[:, shape.S:])
    cache = module.new_cache(shape.B, shape.S + shape.L, dtype=np.float32)
    module.step(past, memory, cache)
    lengths = [layer.storage().lengths.copy() for layer in cache.layers]
    stepped = [False]

    def reset():
        for layer, n in zip(cache.layers, lengths):
            layer.storage().lengths[:] = n
        stepped[0] = False

    def run():
        if stepped[0]:  # a caller that does not reset (ab.py): put the lengths back here
            reset()
        out = module.step(new, memory, cache)
        stepped[0] = True
        return out

    return Bench(run, view, reset=reset,
                 note=f"attnx.TransformerDecoder.step over new_cache(B, {shape.S + shape.L}) holding {shape.S} tokens")


def torch_layer_module(torch, shape: Shape, data):
    """torch's module of a transformer case, loaded with the case's state dict, in eval mode."""
    nn = torch.nn
    E, H = shape.E, shape.H
    config = dict(dim_feedforward=shape.ff, activation=shape.activation, batch_first=True)
    if shape.kind == "encoder-layer":
        module = nn.TransformerEncoderLayer(E, H, **config)
    elif shape.kind == "encoder-stack":
        module = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **config), shape.layers, nn.LayerNorm(E))
    else:
        module = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **config), shape.layers, nn.LayerNorm(E))
    module.load_state_dict({name: torch.from_numpy(a) for name, a in data["state"].items()})
    return module.eval()


class TorchCachedDecoder:
    """A decoding loop over an nn.TransformerDecoder's weights (post-norm, batch_first) that
    keeps the keys and values itself, in torch ops: per layer, the new tokens' q, k, v from
    self_attn.in_proj_weight, k and v written into preallocated (B, H, max_len, D) tensors,
    F.scaled_dot_product_attention over the filled part, out_proj, residual and norm1; the
    cross-attention over the memory's keys and values projected once here, residual and norm2;
    the feed-forward block, residual and norm3; the decoder's final norm. `length` is the number
    of cached tokens."""

    def __init__(self, torch, decoder, memory, max_len: int):
        F = torch.nn.functional
        self.torch, self.F, self.decoder = torch, F, decoder
        self.sdpa = F.scaled_dot_product_attention
        B, M, E = memory.shape
        self.H = decoder.layers[0].self_attn.num_heads
        D = E // self.H
        self.length = 0
        with torch.inference_mode():
            self.k = [torch.zeros(B, self.H, max_len, D) for _ in decoder.layers]
            self.v = [torch.zeros(B, self.H, max_len, D) for _ in decoder.layers]
            self.cross = []
            for layer in decoder.layers:
                if layer.norm_first:
                    raise Unavailable("TorchCachedDecoder follows post-norm layers only")
                w, b = layer.multihead_attn.in_proj_weight, layer.multihead_attn.in_proj_bias
                k = F.linear(memory, w[E:2 * E], b[E:2 * E]).view(B, M, self.H, D).transpose(1, 2)
                v = F.linear(memory, w[2 * E:], b[2 * E:]).view(B, M, self.H, D).transpose(1, 2)
                self.cross.append((w[:E], b[:E], k.contiguous(), v.contiguous()))

    def step(self, x):
        """The decoder's output at the new tokens x (B, T, E), which join the cache."""
        torch, F, sdpa = self.torch, self.F, self.sdpa
        B, T, E = x.shape
        H = self.H
        start, end = self.length, self.length + T
        with torch.inference_mode():
            # New token i sees the cached tokens and the new ones up to itself.
            mask = None if T == 1 else torch.ones(T, end, dtype=torch.bool).tril(start)
            for layer, k_cache, v_cache, (wq, bq, k_mem, v_mem) in zip(self.decoder.layers, self.k, self.v,
                                                                       self.cross):
                sa, ca = layer.self_attn, layer.multihead_attn
                q, k, v = F.linear(x, sa.in_proj_weight, sa.in_proj_bias).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
                k_cache[:, :, start:end] = k
                v_cache[:, :, start:end] = v
                a = sdpa(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask)
                x = layer.norm1(x + F.linear(a.transpose(1, 2).reshape(B, T, E), sa.out_proj.weight, sa.out_proj.bias))
                q = F.linear(x, wq, bq).view(B, T, H, E // H).transpose(1, 2)
                a = sdpa(q, k_mem, v_mem)
                x = layer.norm2(x + F.linear(a.transpose(1, 2).reshape(B, T, E), ca.out_proj.weight, ca.out_proj.bias))
                x = layer.norm3(x + layer.linear2(layer.activation(layer.linear1(x))))
            if self.decoder.norm is not None:
                x = self.decoder.norm(x)
        self.length = end
        return x


def torch_nested_encoder(torch, layer, x, mask, view, precision: str) -> Bench:
    """A ragged encoder layer's torch peer: nn.TransformerEncoder(layer, num_layers=1,
    enable_nested_tensor=True) in eval() under inference_mode, which packs the real tokens into a
    nested tensor and skips the padding. torch falls back to the padded batch with a warning at
    construction (norm_first, an odd head count, ...) or silently at the call (training mode, a
    mask that is not left-aligned, ...); the nested path alone gives exactly 0 at the padded
    positions, so a call that does not is reported as unavailable."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoder = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=True).eval()
    if not encoder.use_nested_tensor:
        reasons = "; ".join(str(w.message) for w in caught) or "use_nested_tensor is False"
        raise Unavailable(f"torch's nested-tensor path is off: {reasons}")

    def run_nested():
        with torch.inference_mode():
            return encoder(x, src_key_padding_mask=mask)

    with warnings.catch_warnings():  # torch's once-per-process note that nested tensors are a prototype
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype")
        padded = run_nested()[mask]
    if padded.numel() and bool(padded.abs().max() != 0):
        raise Unavailable("torch did not take its nested-tensor path (the padded positions' outputs are not 0)")
    return Bench(run_nested, lambda t: view(t.float().numpy()),
                 note=f"nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=True) eval(), inference_mode "
                      f"(nested-tensor path: padded outputs 0), {torch_note(torch, precision)}")


def setup_torch_layer(shape: Shape, data, threads: int, precision: str = "float32") -> Bench | dict[str, Bench]:
    """torch's own modules under inference_mode (the encoder layer and stack take torch's fused
    fast path there). The decoder step has two peers: "torch-recompute", the decoder's forward
    over all S + L target tokens with a causal tgt_mask, of which the last L positions are the
    step's; "torch-cached", TorchCachedDecoder's step over S cached tokens."""
    torch = import_optional("torch")
    torch.set_num_threads(threads)
    if precision != "float32" and shape.kind == "decoder-step":
        raise NotApplicable("the torch decoding loops run in float32")
    dtype = torch_dtype(torch, precision)
    module = torch_layer_module(torch, shape, data).to(dtype)
    view = layer_output_view(shape, data)
    to_numpy = lambda t: view(t.float().numpy())  # noqa: E731
    if shape.kind != "decoder-step":
        x = torch.from_numpy(data["x"]).to(dtype)
        mask = torch.from_numpy(data["key_padding_mask"]) if shape.padded else None
        kwargs = {} if mask is None else {"src_key_padding_mask": mask}
        if shape.ragged:
            return torch_nested_encoder(torch, module, x, mask, view, precision)

        def run_encoder():
            with torch.inference_mode():
                return module(x, **kwargs)

        return Bench(run_encoder, to_numpy, note=f"nn.{type(module).__name__} eval(), inference_mode (fast path), "
                                                 f"{torch_note(torch, precision)}")
    tgt, memory = torch.from_numpy(data["tgt"]), torch.from_numpy(data["memory"])
    n, T = shape.S + shape.L, shape.L
    causal = torch.nn.Transformer.generate_square_subsequent_mask(n)

    def run_recompute():
        with torch.inference_mode():
            return module(tgt, memory, tgt_mask=causal, tgt_is_causal=True)[:, -T:]

    cached = TorchCachedDecoder(torch, module, memory, n)
    cached.step(tgt[:, :shape.S])
    new = tgt[:, shape.S:].contiguous()
    stepped = [False]

    def reset():
        cached.length = shape.S
        stepped[0] = False

    def run_cached():
        if stepped[0]:  # a caller that does not reset: put the length back here
            reset()
        out = cached.step(new)
        stepped[0] = True
        return out

    # The loop against torch's own forward (the reference check follows in bench_shape).
    reset()
    full = run_recompute().numpy()
    agreement = float(np.max(np.abs(run_cached().numpy() - full)))
    return {
        "torch-recompute": Bench(run_recompute, to_numpy,
                                 note=f"nn.TransformerDecoder eval() over all {n} tokens, causal tgt_mask, "
                                      f"inference_mode, the last {T} position(s)"),
        "torch-cached": Bench(run_cached, to_numpy, reset=reset,
                              note=f"a loop over the decoder's weights caching k/v in torch tensors, "
                                   f"F.scaled_dot_product_attention, inference_mode (max |step - full forward| "
                                   f"= {agreement:.1e})"),
    }


_exported: dict[str, bytes] = {}


def export_onnx_layer(shape: Shape, data) -> bytes:
    """torch's module of an encoder case exported to ONNX with the TorchScript exporter
    (dynamo=False), inputs "src" and "src_key_padding_mask" (padded cases), output "output";
    made once per process and shared by ONNX Runtime and OpenVINO."""
    if shape.name in _exported:
        return _exported[shape.name]
    if shape.kind == "decoder-step":
        raise NotApplicable("the decoder step needs a cache the exported graph does not have")
    import io
    import warnings

    torch = import_optional("torch")
    import_optional("onnx")
    module = torch_layer_module(torch, shape, data)
    x = torch.from_numpy(data["x"])
    args, names = (x,), ["src"]
    if shape.padded:
        args, names = (x, None, torch.from_numpy(data["key_padding_mask"])), ["src", "src_key_padding_mask"]
    buffer = io.BytesIO()
    # Traced on torch's general path: the fused fast path (taken without gradients) is one
    # operator that has no ONNX export.
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, buffer, dynamo=False, input_names=names, output_names=["output"],
                              opset_version=17)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise Unavailable(f"torch.onnx.export(dynamo=False) failed: {type(exc).__name__}: {first_line}") from None
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    _exported[shape.name] = buffer.getvalue()
    return _exported[shape.name]


def _layer_feeds(shape: Shape, data) -> dict[str, np.ndarray]:
    feeds = {"src": data["x"]}
    if shape.padded:
        feeds["src_key_padding_mask"] = data["key_padding_mask"]
    return feeds


def setup_onnxruntime_layer(shape: Shape, data, threads: int) -> Bench:
    """ONNX Runtime on export_onnx_layer's model, all graph optimisations, inputs bound once
    (float32: setup_onnxruntime sits bfloat16 out)."""
    ort = import_optional("onnxruntime")
    model = export_onnx_layer(shape, data)
    try:
        session = ort.InferenceSession(model, _ort_options(ort, threads), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise Unavailable(f"ONNX Runtime cannot load the exported model: {type(exc).__name__}: {exc}") from None
    feeds = _layer_feeds(shape, data)
    return Bench(_ort_bound_run(session, feeds), layer_output_view(shape, data), exported=True,
                 note="the torch module exported with torch.onnx.export(dynamo=False), opset 17")


def setup_openvino_layer(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """OpenVINO reading export_onnx_layer's model, compiled as for the other shapes."""
    ov = import_optional("openvino")
    model = export_onnx_layer(shape, data)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        with open(path, "wb") as f:
            f.write(model)
        try:
            compiled = ov.Core().compile_model(ov.Core().read_model(path), "CPU",
                                               _openvino_config(threads, precision))
        except Exception as exc:
            raise Unavailable(f"OpenVINO cannot compile the exported model: {type(exc).__name__}: {exc}") from None
    request = compiled.create_infer_request()
    inputs = _layer_feeds(shape, data)
    for name, array in inputs.items():  # inputs bound once, sharing the NumPy memory
        request.set_tensor(name, ov.Tensor(array, shared_memory=True))

    def run():
        assert inputs  # shared, not owned: the arrays must live as long as the request
        request.infer()
        return request.get_output_tensor(0).data

    view = layer_output_view(shape, data)
    return Bench(run, lambda out: view(np.array(out, copy=True)), exported=True,
                 note=_openvino_note(compiled, "the exported ONNX model read by OpenVINO"))


# An adapter returns one Bench, or several by name (torch's two decoder-step peers, attnx's
# ragged cases with their baseline).
# Each takes (shape, data, threads, precision=...).
ADAPTERS: dict[str, Callable[..., Bench | dict[str, Bench]]] = {
    "attnx": setup_attnx_with_baselines,
    "numpy": setup_numpy,
    "torch": setup_torch,
    "onnxruntime": setup_onnxruntime,
    "openvino": setup_openvino,
}


def library_versions() -> dict[str, str | None]:
    """Versions of the libraries (None = not installed)."""
    versions: dict[str, str | None] = {}
    for name in (*LIBRARIES, "onnx"):
        try:
            versions[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except ImportError:
            versions[name] = None
    try:
        versions["numpy_blas"] = np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    except (AttributeError, KeyError, TypeError):
        versions["numpy_blas"] = "?"
    try:
        import attnx

        versions["attnx_config"] = json.dumps(attnx.show_config(), default=str)
    except ImportError:
        pass
    return versions


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


@contextmanager
def gc_paused():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_calls(run: Callable[[], Any], k: int, reset: Callable[[], None] | None = None) -> list[float]:
    """Per-call wall times (seconds) of `k` consecutive calls; `reset`, if any, runs before each
    call, outside the timed region."""
    clock = time.perf_counter
    times = []
    for _ in range(k):
        if reset is not None:
            reset()
        t0 = clock()
        run()
        times.append(clock() - t0)
    return times


def calibrate(run: Callable[[], Any], block_seconds: float, max_calls: int = 2000,
              reset: Callable[[], None] | None = None) -> int:
    """Calls per block so that a block lasts about `block_seconds` (after a warm-up call)."""
    time_calls(run, 1, reset)
    once = min(time_calls(run, 2, reset))
    return max(1, min(max_calls, int(block_seconds / max(once, 1e-7))))


def run_block(run: Callable[[], Any], k: int, pause_s: float, reset: Callable[[], None] | None = None) -> list[float]:
    """One block: sleep `pause_s` (other runtimes' spinning threads go quiet), then time `k` calls."""
    time.sleep(pause_s)
    return time_calls(run, k, reset)


def measure_interleaved(benches: dict[str, Bench], rounds: int, block_seconds: float, pause_s: float,
                        progress: Progress | None = None) -> dict:
    """Rounds of blocks, one block per library per round, rotating the order each round."""
    names = list(benches)
    calls = {}
    for name in names:
        time.sleep(pause_s)
        calls[name] = calibrate(benches[name].run, block_seconds, reset=benches[name].reset)
    samples: dict[str, list[float]] = {name: [] for name in names}
    block_medians: dict[str, list[float]] = {name: [] for name in names}
    with gc_paused():
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                times = run_block(benches[name].run, calls[name], pause_s, benches[name].reset)
                samples[name].extend(times)
                block_medians[name].append(statistics.median(times))
            if progress is not None:
                progress.update()
    return {name: summarize(samples[name], block_medians[name], calls[name]) for name in names}


def summarize(times: list[float], block_medians: list[float], calls_per_block: int) -> dict:
    ordered = sorted(times)
    pick = lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))]  # noqa: E731
    return {
        "median_ms": 1e3 * statistics.median(ordered),
        "min_ms": 1e3 * ordered[0],
        "p10_ms": 1e3 * pick(0.10),
        "p90_ms": 1e3 * pick(0.90),
        "calls": len(ordered),
        "calls_per_block": calls_per_block,
        "block_medians_ms": [1e3 * t for t in block_medians],
    }


# --------------------------------------------------------------------------------------------
# Machine peaks
# --------------------------------------------------------------------------------------------


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    return min(time_calls(fn, repeats))


def measure_gemm_peak(threads: int, n: int, repeats: int) -> dict:
    """Achievable FP32 GEMM GFLOP/s: an n x n x n float32 matmul, best of `repeats`."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    flops = 2.0 * n**3
    rates = {"numpy": flops / best_time(lambda: a @ b, repeats) / 1e9}
    try:
        torch = import_optional("torch")
        torch.set_num_threads(threads)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        rates["torch"] = flops / best_time(lambda: torch.mm(ta, tb), repeats) / 1e9
    except NotInstalled:
        pass
    by = max(rates, key=rates.get)
    return {"gflops": rates[by], "by": by, "n": n, "all": rates}


def measure_fma_peak(threads: int, repeats: int = 5) -> dict:
    """FP32 multiply-add GFLOP/s of attnx's active kernel on `threads` threads, in registers
    only (no memory traffic): the best of `repeats` runs of attnx._core.fma_peak."""
    import attnx
    from attnx import _core

    rate = max(_core.fma_peak(threads, 0.2) for _ in range(repeats))
    return {"gflops": rate, "by": f"measured, attnx {attnx.show_config()['isa']} kernel"}


def measure_read_bandwidth(threads: int, mib: float, repeats: int) -> dict:
    """Memory read GB/s over a `mib` MiB float32 array: the best of a few reductions
    (NumPy max, BLAS sdot of the array with itself, torch sum on `threads` threads),
    each the best of `repeats` passes."""
    a = np.ones(int(mib * 2**20) // 4, dtype=np.float32)
    kernels = {"numpy max": lambda: a.max(), "numpy dot": lambda: np.dot(a, a)}
    try:
        torch = import_optional("torch")
        torch.set_num_threads(threads)
        ta = torch.from_numpy(a)
        kernels["torch sum"] = lambda: ta.sum()
    except NotInstalled:
        pass
    rates = {name: a.nbytes / best_time(fn, repeats) / 1e9 for name, fn in kernels.items()}
    by = max(rates, key=rates.get)
    return {"gbs": rates[by], "by": by, "mib": mib, "all": rates}


# --------------------------------------------------------------------------------------------
# Worker: one thread count
# --------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# Tolerated max abs difference from the float64 reference, relative to max(1, max |ref|): float32
# round-off, or bfloat16 operands (8 significant bits).
CHECK_TOLERANCE = {"float32": 2e-4, "bfloat16": 6e-2}


def check_output(got: np.ndarray, ref: np.ndarray, precision: str = "float32") -> dict:
    """Max abs difference from the float64 reference; ok when within the precision's round-off."""
    got = np.asarray(got)
    if got.shape != ref.shape:
        return {"max_abs_diff": None, "ok": False, "problem": f"shape {got.shape} != {ref.shape}"}
    diff = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    tol = CHECK_TOLERANCE[precision] * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    return {"max_abs_diff": diff, "ok": bool(diff <= tol)}  # NaN compares False -> not ok


def bench_shape(shape: Shape, libs: list[str], threads: int, opts, progress: Progress | None = None) -> dict:
    """Set up every library for `shape`, check outputs, time them interleaved."""
    data = make_inputs(shape)
    reference = reference_output(shape, data)
    status: dict[str, dict] = {}
    benches: dict[str, Bench] = {}
    for lib in libs:
        try:
            made = ADAPTERS[lib](shape, data, threads, precision=opts.precision)
        except NotInstalled as exc:
            status[lib] = {"status": "not installed", "note": str(exc)}
            continue
        except Unavailable as exc:
            status[lib] = {"status": "unavailable", "note": str(exc)}
            continue
        except NotApplicable as exc:
            status[lib] = {"status": "n/a", "note": str(exc)}
            continue
        except Exception as exc:  # a peer's set-up problem is reported, not fatal
            if lib == "attnx":
                raise
            status[lib] = {"status": "error", "note": f"{type(exc).__name__}: {exc}"}
            continue
        for name, bench in (made.items() if isinstance(made, dict) else [(lib, made)]):
            want = reference if bench.reference is None else bench.reference
            try:
                check = check_output(bench.to_numpy(call_once(bench)), want, opts.precision)
            except Exception as exc:
                if name == "attnx":
                    raise
                status[name] = {"status": "error", "note": f"{type(exc).__name__}: {exc}"}
                continue
            if bench.exported and not check["ok"]:
                # A model exported from torch that computes something else is the export's
                # fault, not the runtime's: the peer is unavailable for this case.
                status[name] = {"status": "unavailable",
                                "note": f"{bench.note}: output differs from the reference by {check['max_abs_diff']}"}
                continue
            status[name] = {"status": "ok", "note": bench.note, **check}
            benches[name] = bench
            if not check["ok"]:
                log(f"  WARNING: {name} output differs from the reference by {check['max_abs_diff']}")
    timings = measure_interleaved(benches, opts.rounds, opts.block_seconds, opts.pause_ms / 1e3, progress)
    for name, t in timings.items():
        status[name].update(t)
        status[name]["gflops"] = shape.flops / (t["median_ms"] / 1e3) / 1e9
    described = {"name": shape.name, "label": shape.label, "kind": shape.kind, "B": shape.B, "H": shape.H,
                 "L": shape.L, "S": shape.S, "D": shape.D, "E": shape.E, "causal": shape.causal,
                 "mask_given": shape.mask_given}
    if shape.kind in LAYER_KINDS:
        described.update(ff=shape.ff, layers=shape.layers, activation=shape.activation, padded=shape.padded,
                         memory=shape.memory)
    if shape.ragged:
        described.update(ragged=True, lengths=padding_lengths(shape))
    return {
        "shape": described,
        "flops": shape.flops,
        "bytes_kv": shape.bytes_kv,
        "bytes_of": shape.bytes_of,
        "memory_bound": shape.memory_bound,
        "libs": status,
    }


def add_comparisons(result: dict, peaks: dict) -> None:
    """Best peer, speed-up and attnx's fraction of the machine's peak. attnx's own baselines of
    the ragged cases ("attnx-padded", "attnx-full") have their speed-up in `speedups` but are
    never the best peer."""
    libs = result["libs"]
    attnx_ms = libs["attnx"]["median_ms"]
    valid = {n: s["median_ms"] for n, s in libs.items() if n != "attnx" and s.get("ok") and "median_ms" in s}
    peers = [n for n in valid if n not in PEER_VARIANTS["attnx"]]
    best = min(peers, key=valid.get) if peers else None
    result["best_peer"] = best
    result["speedup"] = valid[best] / attnx_ms if best else None
    # attnx's speed-up over every correct peer: pooled medians, and per round.
    result["speedups"] = {}
    for peer, ms in valid.items():
        pairs = zip(libs[peer]["block_medians_ms"], libs["attnx"]["block_medians_ms"])
        result["speedups"][peer] = {"speedup": ms / attnx_ms,
                                    "per_round": statistics.median(p / own for p, own in pairs)}
    result["speedup_per_round"] = result["speedups"][best]["per_round"] if best else None
    attnx_gflops = libs["attnx"]["gflops"]
    result["attnx_gflops"] = attnx_gflops
    result["attnx_fraction_of_fma_peak"] = attnx_gflops / peaks["fma"]["gflops"]
    result["attnx_fraction_of_gemm_peak"] = attnx_gflops / peaks["gemm"]["gflops"]
    gbs = result["bytes_kv"] / (attnx_ms / 1e3) / 1e9
    result["attnx_read_gbs"] = gbs
    result["attnx_fraction_of_read_bw"] = gbs / peaks["read_bandwidth"]["gbs"]
    same_size = peaks["working_set_bandwidth"].get(result["shape"]["name"])
    if same_size is not None:
        result["attnx_fraction_of_working_set_bw"] = gbs / same_size["gbs"]
    if result["memory_bound"]:
        # K and V are re-read on every call, so they stay in whichever cache level holds them:
        # the roof is the read bandwidth measured over an array of the same size.
        result["fraction_kind"] = "read bandwidth at the K+V size"
        result["attnx_fraction_of_peak"] = result.get("attnx_fraction_of_working_set_bw",
                                                      result["attnx_fraction_of_read_bw"])
    else:
        result["fraction_kind"] = "FMA peak"
        result["attnx_fraction_of_peak"] = result["attnx_fraction_of_fma_peak"]


def cpu_busy_seconds() -> float | None:
    """Machine-wide non-idle CPU seconds since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


class BackgroundLoad:
    """The share of the machine's CPU time that other processes used between start and stop,
    so that a run disturbed by other work on the machine can be recognised."""

    def __init__(self):
        self.wall, self.busy, self.own = time.perf_counter(), cpu_busy_seconds(), sum(os.times()[:2])

    def fraction(self) -> float | None:
        busy = cpu_busy_seconds()
        if busy is None or self.busy is None:
            return None
        others = (busy - self.busy) - (sum(os.times()[:2]) - self.own)
        capacity = (time.perf_counter() - self.wall) * (os.cpu_count() or 1)
        return max(0.0, others / capacity)


def run_worker(threads: int, opts) -> dict:
    """Everything for one thread count; returns a JSON-able dict."""
    cores = os.cpu_count() or 1
    libs = [name for name in LIBRARIES if name in opts.libs]
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    shapes = sweep_shapes(opts.sweep_lengths) if opts.sweep else select_shapes(opts.shapes)
    load = BackgroundLoad()
    log(f"[threads={threads}] measuring machine peaks ...")
    gemm_n, reps = (1536, 3) if opts.quick else (2048, 5)
    peaks = {
        "fma": (measure_fma_peak(threads) if opts.peak_gflops is None else
                {"gflops": opts.peak_gflops * threads / cores, "by": "--peak-gflops"}),
        "gemm": measure_gemm_peak(threads, gemm_n, reps),
        "read_bandwidth": measure_read_bandwidth(threads, 512, reps),
        "working_set_bandwidth": {
            s.name: {**measure_read_bandwidth(threads, s.bytes_kv / 2**20, 3 * reps), "of": s.bytes_of}
            for s in shapes if s.memory_bound
        },
    }
    results = []
    with Progress(len(shapes) * opts.rounds, f"threads={threads}", unit="round",
                  enabled=not opts.no_progress) as progress:
        for shape in shapes:
            progress.write(f"[threads={threads}] {shape.label} ...")
            result = bench_shape(shape, libs, threads, opts, progress)
            add_comparisons(result, peaks)
            results.append(result)
    if affinity is not None and sorted(os.sched_getaffinity(0)) != affinity:
        log(f"WARNING: a library changed this process's CPU affinity to {sorted(os.sched_getaffinity(0))}")
    return {"threads": threads, "peaks": peaks, "results": results, "background_cpu_fraction": load.fraction()}


# --------------------------------------------------------------------------------------------
# Driver: one subprocess per thread count, then the report
# --------------------------------------------------------------------------------------------


cpu_model = results_file.cpu_model


def worker_argv(threads: int, out_path: str, opts) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, str(threads), "--worker-out", out_path,
            "--rounds", str(opts.rounds), "--block-seconds", str(opts.block_seconds),
            "--pause-ms", str(opts.pause_ms), "--libs", *opts.libs, "--precision", opts.precision]
    if opts.peak_gflops is not None:
        argv += ["--peak-gflops", str(opts.peak_gflops)]
    if opts.shapes:
        argv += ["--shapes", *opts.shapes]
    if opts.quick:
        argv.append("--quick")
    if opts.sweep:
        argv += ["--sweep", "--sweep-lengths", *map(str, opts.sweep_lengths)]
    if opts.no_progress:
        argv.append("--no-progress")
    return argv


def wait_for_quiet_machine(max_wait_s: float, threshold: float = 0.10, window_s: float = 2.0) -> float | None:
    """Wait (up to `max_wait_s`) until other processes use less than `threshold` of the CPUs
    over a `window_s` window; returns the last measured share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        load = BackgroundLoad()
        time.sleep(window_s)
        share = load.fraction()
        if share is None or share < threshold or time.monotonic() >= deadline:
            return share
        log(f"machine busy ({100 * share:.0f}% of its CPU time used by other processes), waiting ...")


def run_thread_count(threads: int, opts) -> dict:
    """Run the worker for `threads` in a fresh interpreter with clean thread settings."""
    if opts.wait_quiet > 0:
        wait_for_quiet_machine(opts.wait_quiet)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        env = {**os.environ, **thread_env(threads)}
        proc = subprocess.run(worker_argv(threads, out_path, opts), env=env)
        if proc.returncode != 0 or not os.path.exists(out_path):
            return {"threads": threads, "error": f"worker exited with status {proc.returncode}"}
        with open(out_path) as f:
            return json.load(f)


def fmt_ms(entry: dict) -> str:
    status = entry.get("status")
    if status != "ok":
        return status or "-"
    if "median_ms" not in entry:
        return "-"
    ms = entry["median_ms"]
    text = f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"
    return text if entry.get("ok") else f"{text} (wrong!)"


# Peers that one library provides several of, by name: a column each, shown when a run has them
# (attnx's: its baselines of the ragged cases).
PEER_VARIANTS = {"attnx": ("attnx-padded", "attnx-full"), "torch": ("torch-recompute", "torch-cached")}


def table_columns(run: dict) -> list[str]:
    """The libraries' columns: LIBRARIES, and the variants some result of `run` has."""
    present = {name for r in run["results"] for name in r["libs"]}
    columns = []
    for lib in LIBRARIES:
        columns.append(lib)
        columns.extend(v for v in PEER_VARIANTS.get(lib, ()) if v in present)
    return columns


def markdown_table(run: dict) -> str:
    columns = table_columns(run)
    head = ["shape", *[f"{n} ms" for n in columns], "best peer", "speed-up", "per round", "attnx GFLOP/s",
            "% of peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in run["results"]:
        libs = r["libs"]
        cells = [r["shape"]["label"]] + [fmt_ms(libs.get(n, {"status": "-"})) for n in columns]
        cells.append(r["best_peer"] or "-")
        cells.append(f"{r['speedup']:.2f}x" if r["speedup"] else "-")
        per_round = r.get("speedup_per_round")
        cells.append(f"{per_round:.2f}x" if per_round else "-")
        cells.append(f"{r['attnx_gflops']:.1f}")
        kind = "BW" if r["memory_bound"] else "FMA"
        cells.append(f"{100 * r['attnx_fraction_of_peak']:.1f}% {kind}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_table(run: dict) -> str:
    columns = table_columns(run)
    lines = ["| shape | " + " | ".join(columns) + " |", "|---|" + "|".join("---" for _ in columns) + "|"]
    for r in run["results"]:
        cells = []
        for name in columns:
            e = r["libs"].get(name, {})
            if e.get("status") != "ok":
                cells.append(e.get("status", "-"))
            else:
                cells.append(f"{e['max_abs_diff']:.1e}" + ("" if e["ok"] else " MISMATCH"))
        lines.append(f"| {r['shape']['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_speedup_lines(run: dict) -> list[str]:
    """For each transformer and ragged case of `run`: attnx's speed-up over every correct peer,
    pooled and per round (the decoder step has two torch peers, each its own ratio; the ragged
    cases attnx's baseline)."""
    lines = []
    for r in run["results"]:
        if (r["shape"]["kind"] in LAYER_KINDS or r["shape"].get("ragged")) and r.get("speedups"):
            each = ", ".join(f"{peer} {x['speedup']:.2f}x (per round {x['per_round']:.2f}x)"
                             for peer, x in r["speedups"].items())
            lines.append(f"{r['shape']['name']}: attnx's speed-up over each peer: {each}")
    return lines


def print_report(report: dict) -> None:
    m = report["machine"]
    v = report["versions"]
    print(f"\n# attnx benchmark — {m['cpu_model']}, {m['cores']} cores, {m['platform']}")
    print("versions: " + ", ".join(f"{n} {v[n] or 'not installed'}" for n in (*LIBRARIES, "onnx")))
    print(f"numpy BLAS: {v.get('numpy_blas')}; attnx config: {v.get('attnx_config')}")
    c = report["config"]
    print(f"method: {c['rounds']} interleaved rounds, blocks of ~{c['block_seconds']} s per library, "
          f"{c['pause_ms']} ms pause between libraries, median per-call time; "
          f"{c.get('precision', 'float32')} (see the notes for each library's kernel).")
    print("FLOPs: sdpa 4*B*H*L*S*D (causal: the computed half, 2*B*H*L*S*D); MHA adds 8*B*L*E^2. "
          "speed-up = best peer's median / attnx's (> 1: attnx faster); per round = the median over "
          "rounds of the same ratio of block medians.")
    kinds = {r["shape"]["kind"] for run in report["runs"] for r in run.get("results", [])}
    if kinds & {"encoder-layer", "encoder-stack"}:
        print("FLOPs of an encoder layer: 2*B*L*(4*E^2 + 2*E*ff) + 4*B*L^2*E (padding counted as computed, "
              "but for the ragged layers below), times the layers.")
    if any(r["shape"].get("ragged") for run in report["runs"] for r in run.get("results", [])):
        print("Ragged cases: FLOPs of the real tokens only, the same for every library: varlen "
              "sum over sequences of 4*H*n^2*D (causal: half); a ragged encoder layer 2*T*(4*E^2 + 2*E*ff) + "
              "4*sum(n^2)*E over its T real tokens. attnx-padded / attnx-full are attnx's own baselines "
              "(the padded batch with its mask / the full batch without one), not counted as best peer.")
    if "decoder-step" in kinds:
        print("FLOPs of a decoder step of T new tokens over S cached, memory M: per layer "
              "2*B*T*(6*E^2 + 2*E*ff) + 4*B*T*(S + T + M)*E (the memory's keys and values are projected once "
              "per cache, not counted); bytes = those weights and both attentions' K/V, read once (float32).")
    for run in report["runs"]:
        print(f"\n## {run['threads']} thread(s)\n")
        if "error" in run:
            print(f"worker failed: {run['error']}")
            continue
        p = run["peaks"]
        fma_source = (f"--peak-gflops scaled to {run['threads']} thread(s)" if p["fma"]["by"] == "--peak-gflops"
                      else f"{p['fma']['by']}, register-only multiply-adds on {run['threads']} thread(s)")
        print(f"Peaks: FMA {p['fma']['gflops']:.0f} GFLOP/s ({fma_source}); achievable GEMM {p['gemm']['gflops']:.1f} GFLOP/s "
              f"({p['gemm']['by']}, {p['gemm']['n']}^3 float32 matmul); read bandwidth "
              f"{p['read_bandwidth']['gbs']:.1f} GB/s ({p['read_bandwidth']['by']} over "
              f"{p['read_bandwidth']['mib']} MiB)", end="")
        for name, bw in p["working_set_bandwidth"].items():
            print(f"; read bandwidth over {bw['mib']:.3g} MiB (the {bw.get('of', 'K+V')} of {name}) {bw['gbs']:.1f} GB/s "
                  f"({bw['by']})", end="")
        print(".\n")
        print(markdown_table(run))
        background = run.get("background_cpu_fraction")
        if background is not None:
            warn = " — WARNING: other work on the machine may have disturbed these timings" if background > 0.05 else ""
            print(f"\nOther processes used {100 * background:.1f}% of the machine's CPU time during this run{warn}.")
        print("\n% of peak: FMA = attnx GFLOP/s / the FMA peak above; BW = attnx's bytes read (K+V; for the "
              "decoder step weights + K/V) per second / the read bandwidth measured over an array of that size.")
        for r in run["results"]:
            if r["memory_bound"]:
                print(f"{r['shape']['name']}: attnx reads {r.get('bytes_of', 'K+V')} at {r['attnx_read_gbs']:.1f} GB/s = "
                      f"{100 * r['attnx_fraction_of_read_bw']:.0f}% of the {p['read_bandwidth']['mib']} MiB "
                      f"(DRAM) read bandwidth.")
        gemm = ", ".join(f"{r['shape']['name']} {100 * r['attnx_fraction_of_gemm_peak']:.1f}%"
                         for r in run["results"] if not r["memory_bound"])
        print(f"attnx vs achievable GEMM rate: {gemm}")
        for line in peer_speedup_lines(run):
            print(line)
        print("\nmax |output - float64 reference|:\n")
        print(accuracy_table(run))
        notes = {}
        for r in run["results"]:
            for name, e in r["libs"].items():
                if e.get("note") and e.get("status") == "ok":
                    notes.setdefault(name, set()).add(e["note"])
                elif e.get("status") in ("error", "unavailable"):
                    print(f"- {name} on {r['shape']['label']}: {e['status']}: {e['note']}")
        for name, ns in notes.items():
            print(f"- {name}: {'; '.join(sorted(ns))}")


def parse_args(argv=None):
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help="thread counts, each run in its own subprocess (default: 1 and the core count)")
    p.add_argument("--shapes", nargs="+", help="shapes by number (1-7) or name: "
                   + ", ".join(f"{i}={s.name}" for i, s in enumerate(SHAPES, 1))
                   + "; named only: " + ", ".join(s.name for s in EXTRA_SHAPES)
                   + "; transformer layers (named only): " + ", ".join(s.name for s in LAYER_SHAPES)
                   + "; ragged batches (named only): " + ", ".join(s.name for s in RAGGED_SHAPES))
    p.add_argument("--libs", nargs="+", default=list(LIBRARIES), choices=LIBRARIES,
                   help="libraries to run (attnx is always run)")
    p.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                   help="the precision compared (default float32; bfloat16: see the module's docstring)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 7, --quick 2)")
    p.add_argument("--block-seconds", type=float, help="target length of one block (default 0.25, --quick 0.05)")
    p.add_argument("--pause-ms", type=float, default=30.0, help="sleep before each block (default 30)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="FP32 FMA peak of all cores, scaled by threads/cores (default: measured on each thread "
                        "count with attnx's register-only multiply-add probe)")
    p.add_argument("--out", "--json", dest="out", metavar="PATH",
                   help="results file (default: benchmarks/results/DATE-MACHINE-COMMIT.json; --quick runs are "
                        "saved only when this is given)")
    p.add_argument("--section", help="key of the results file to write (default: compare; sweep with --sweep; "
                                     "ragged when every shape is a ragged case; transformer when every shape "
                                     "is a transformer layer)")
    p.add_argument("--no-save", action="store_true", help="print the report only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sweep", action="store_true",
                   help="time against sequence length: sdpa B1 H12 D64, L = S over --sweep-lengths")
    p.add_argument("--sweep-lengths", type=int, nargs="+", default=list(SWEEP_LENGTHS), metavar="L",
                   help=f"lengths for --sweep (default {' '.join(map(str, SWEEP_LENGTHS))})")
    p.add_argument("--quick", action="store_true", help="a fast smoke run (fewer rounds, shorter blocks)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each thread count, wait up to SECONDS for other processes to leave the CPUs idle")
    p.add_argument(WORKER_FLAG, type=int, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.rounds is None:
        opts.rounds = 2 if opts.quick else 7
    if opts.block_seconds is None:
        opts.block_seconds = 0.05 if opts.quick else 0.25
    if "attnx" not in opts.libs:
        opts.libs = ["attnx", *opts.libs]
    if opts.shapes:
        select_shapes(opts.shapes)  # validate early
    return opts


def default_section(opts) -> str:
    """The results file's section a run writes: "sweep" for --sweep, "ragged" when every shape
    is a ragged case, "transformer" when every shape is a transformer layer (their own sections:
    a run of them alone must not replace the shapes'), else "compare"; suffixed "-bfloat16" for
    --precision bfloat16."""
    suffix = "" if opts.precision == "float32" else f"-{opts.precision}"
    if opts.sweep:
        return "sweep" + suffix
    if opts.shapes and all(s.ragged for s in select_shapes(opts.shapes)):
        return "ragged" + suffix
    if opts.shapes and all(s.kind in LAYER_KINDS for s in select_shapes(opts.shapes)):
        return "transformer" + suffix
    return "compare" + suffix


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker is not None:
        result = run_worker(opts.worker, opts)
        with open(opts.worker_out, "w") as f:
            json.dump(result, f)
        return 0
    if opts.sweep and opts.quick and opts.sweep_lengths == list(SWEEP_LENGTHS):
        opts.sweep_lengths = [64, 128]
    report = {
        "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "versions": library_versions(),
        "config": {"rounds": opts.rounds, "block_seconds": opts.block_seconds, "pause_ms": opts.pause_ms,
                   "peak_gflops_all_cores": opts.peak_gflops, "quick": opts.quick, "threads": opts.threads,
                   "sweep_lengths": opts.sweep_lengths if opts.sweep else None,
                   "precision": opts.precision},
        "runs": [run_thread_count(n, opts) for n in opts.threads],
    }
    print_report(report)
    if not opts.no_save and (opts.out or not opts.quick):
        section = opts.section or default_section(opts)
        path = results_file.write_section(section, report, opts.out)
        print(f"\nwrote the {section!r} section of {path}")
    return 0 if all("error" not in run for run in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
