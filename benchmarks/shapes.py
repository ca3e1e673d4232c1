"""The benchmark cases, their inputs and the float64 references every output is checked against.

Holds: ``Shape`` and the case lists (``SHAPES``, the numbered defaults; ``EXTRA_SHAPES``,
``LAYER_SHAPES`` and ``RAGGED_SHAPES``, run only when named; ``sweep_shapes``), ``select_shapes``,
the input builders (``make_inputs``, ``layer_state``, the padding helpers), the NumPy
implementations (``numpy_sdpa``, ``numpy_mha``; in float64 the references ``reference_output``
and ``reference_layer_output``) and ``check_output``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import timing  # noqa: F401  (sets the thread variables before NumPy is imported)

import numpy as np  # noqa: E402


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


def describe(shape: Shape) -> dict:
    """The JSON-able description of `shape` a results file keeps."""
    described = {"name": shape.name, "label": shape.label, "kind": shape.kind, "B": shape.B, "H": shape.H,
                 "L": shape.L, "S": shape.S, "D": shape.D, "E": shape.E, "causal": shape.causal,
                 "mask_given": shape.mask_given}
    if shape.kind in LAYER_KINDS:
        described.update(ff=shape.ff, layers=shape.layers, activation=shape.activation, padded=shape.padded,
                         memory=shape.memory)
    if shape.ragged:
        described.update(ragged=True, lengths=padding_lengths(shape))
    return described


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

