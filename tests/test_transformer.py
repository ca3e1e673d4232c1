"""attnx's transformer classes compute what torch's compute, with torch's parameters and habits.

``TransformerEncoderLayer``, ``TransformerDecoderLayer``, ``TransformerEncoder``,
``TransformerDecoder`` and ``Transformer`` are built in torch (eval mode, every parameter moved
off its initial value), copied with ``from_torch`` and with ``load_state_dict``, and compared
with torch under ``torch.inference_mode()`` on the non-padded positions (attnx's outputs at padded
positions are zeros, as torch's nested-tensor path gives, where torch's other paths compute them:
tests/test_padding_free_layers.py). The masks keep every query row at least one key, so that
torch gives no NaN.

torch's encoder fast path (``torch._transformer_encoder_layer_fwd``, taken in eval mode with
``batch_first``, an even ``nhead`` and no grad; and the nested tensors of
``TransformerEncoder``) reads a float mask as a bool one (nonzero = masked) where its other
path adds it to the scores, as torch documents. The cases with float masks of values other
than 0 and -inf compare with torch's other path (``torch.backends.mha.set_fastpath_enabled``);
the others with torch's default path.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import pickle

import numpy as np
import pytest

import attnx
from attnx import reference
from attnx.transformer import LayerNorm, Linear
from conftest import quiet_torch

TOL = {np.float32: {"rtol": 3e-5, "atol": 3e-5}, np.float64: {"rtol": 1e-10, "atol": 1e-10}}


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


# ---------------------------------------------------------------------------------------------
# Configurations: each builds one torch module, its inputs and its masks
# ---------------------------------------------------------------------------------------------

# Defaults of a configuration; each entry of CONFIGS changes some.
BASE = dict(E=16, H=4, F=32, L=6, S=8, N=3, layers=2, norm=True, activation="relu", eps=1e-5, batch_first=False,
            norm_first=False, bias=True, dtype=np.float32, unbatched=False, masks={}, hints={})

ENC_LAYER, DEC_LAYER, ENCODER, DECODER, MODEL = "encoder_layer", "decoder_layer", "encoder", "decoder", "transformer"


def case(kind, **changes):
    return {**BASE, "kind": kind, **changes}


CONFIGS = {
    # TransformerEncoderLayer
    "enc_layer_plain": case(ENC_LAYER),
    "enc_layer_batch_first_pre_norm_gelu": case(ENC_LAYER, batch_first=True, norm_first=True, activation="gelu"),
    "enc_layer_no_bias_eps_bool_mask": case(ENC_LAYER, bias=False, eps=1e-3, masks={"src_mask": "bool2d"}),
    "enc_layer_float_mask": case(ENC_LAYER, batch_first=True, masks={"src_mask": "float2d"}),
    "enc_layer_bool3d_padding": case(ENC_LAYER, masks={"src_mask": "bool3d", "src_key_padding_mask": "bool"}),
    "enc_layer_fast_padding": case(ENC_LAYER, batch_first=True, masks={"src_key_padding_mask": "bool"}),
    "enc_layer_fast_inf_padding": case(ENC_LAYER, batch_first=True, masks={"src_key_padding_mask": "float_inf"}),
    "enc_layer_float_padding_mask": case(ENC_LAYER, masks={"src_mask": "float_inf2d", "src_key_padding_mask": "float"}),
    "enc_layer_causal_hint": case(ENC_LAYER, masks={"src_mask": "causal_float"}, hints={"is_causal": True}),
    "enc_layer_causal_bool_hint_padding": case(ENC_LAYER, batch_first=True, norm_first=True,
                                               masks={"src_mask": "causal_bool", "src_key_padding_mask": "bool"},
                                               hints={"is_causal": True}),
    "enc_layer_unbatched": case(ENC_LAYER, unbatched=True, masks={"src_mask": "float3d", "src_key_padding_mask": "bool"}),
    "enc_layer_unbatched_batch_first": case(ENC_LAYER, unbatched=True, batch_first=True, norm_first=True,
                                            activation="gelu_module"),
    "enc_layer_callable": case(ENC_LAYER, activation="callable", norm_first=True, masks={"src_mask": "float_inf2d"}),
    "enc_layer_f64": case(ENC_LAYER, dtype=np.float64, norm_first=True, activation="gelu",
                          masks={"src_mask": "float3d", "src_key_padding_mask": "float"}),
    "enc_layer_wide": case(ENC_LAYER, E=64, H=8, F=48, L=12, N=2, batch_first=True),
    "enc_layer_odd_heads": case(ENC_LAYER, E=24, H=3, batch_first=True,
                                masks={"src_mask": "float2d", "src_key_padding_mask": "bool"}),
    # TransformerDecoderLayer
    "dec_layer_plain": case(DEC_LAYER),
    "dec_layer_batch_first_pre_norm": case(DEC_LAYER, batch_first=True, norm_first=True, activation="gelu"),
    "dec_layer_masks": case(DEC_LAYER, masks={"tgt_mask": "bool2d", "memory_mask": "float2d",
                                              "tgt_key_padding_mask": "bool", "memory_key_padding_mask": "bool"}),
    "dec_layer_masks_3d": case(DEC_LAYER, batch_first=True, bias=False,
                               masks={"tgt_mask": "float3d", "memory_mask": "bool3d",
                                      "memory_key_padding_mask": "float"}),
    "dec_layer_causal_hints": case(DEC_LAYER, masks={"tgt_mask": "causal_float", "memory_mask": "causal_bool"},
                                   hints={"tgt_is_causal": True, "memory_is_causal": True}),
    "dec_layer_unbatched": case(DEC_LAYER, unbatched=True, eps=1e-4,
                                masks={"tgt_mask": "causal_bool", "memory_key_padding_mask": "bool"}),
    "dec_layer_callable_f64": case(DEC_LAYER, dtype=np.float64, activation="callable", batch_first=True,
                                   masks={"tgt_mask": "float2d", "tgt_key_padding_mask": "float_inf"}),
    "dec_layer_wide": case(DEC_LAYER, E=48, H=6, F=40, L=10, S=12, N=2, norm_first=True),
    # TransformerEncoder
    "encoder_plain": case(ENCODER),
    "encoder_nested_padding": case(ENCODER, batch_first=True, masks={"src_key_padding_mask": "bool"}),
    "encoder_nested_inf_padding": case(ENCODER, batch_first=True, layers=3,
                                       masks={"src_key_padding_mask": "float_inf"}),
    "encoder_float_padding": case(ENCODER, batch_first=True, masks={"src_key_padding_mask": "float"}),
    "encoder_detects_causal": case(ENCODER, norm=False, masks={"mask": "causal_float"}),
    "encoder_causal_bool_padding": case(ENCODER, norm_first=True, activation="gelu",
                                        masks={"mask": "causal_bool", "src_key_padding_mask": "bool"},
                                        hints={"is_causal": True}),
    "encoder_mask_not_causal": case(ENCODER, batch_first=True, masks={"mask": "bool3d"}, hints={"is_causal": False}),
    "encoder_unbatched_f64": case(ENCODER, unbatched=True, dtype=np.float64, bias=False,
                                  masks={"mask": "float2d", "src_key_padding_mask": "bool"}),
    # TransformerDecoder
    "decoder_plain": case(DECODER),
    "decoder_detects_causal": case(DECODER, batch_first=True, masks={"tgt_mask": "causal_bool",
                                                                     "memory_key_padding_mask": "bool"}),
    "decoder_masks": case(DECODER, norm=False, norm_first=True, layers=3,
                          masks={"tgt_mask": "float3d", "memory_mask": "float2d", "tgt_key_padding_mask": "bool"},
                          hints={"memory_is_causal": False}),
    "decoder_unbatched": case(DECODER, unbatched=True, batch_first=True, activation="callable",
                              masks={"tgt_mask": "causal_float"}, hints={"tgt_is_causal": True}),
    # Transformer
    "model_plain": case(MODEL),
    "model_batch_first_masks": case(MODEL, batch_first=True,
                                    masks={"src_key_padding_mask": "bool", "memory_key_padding_mask": "src",
                                           "tgt_mask": "causal_float", "tgt_key_padding_mask": "bool"}),
    "model_pre_norm_gelu": case(MODEL, norm_first=True, activation="gelu", bias=False,
                                masks={"src_mask": "bool2d", "memory_mask": "float2d"},
                                hints={"src_is_causal": False, "tgt_is_causal": False}),
    "model_unbatched": case(MODEL, unbatched=True, masks={"tgt_mask": "causal_bool"}),
    "model_f64_callable": case(MODEL, dtype=np.float64, activation="callable", layers=1, eps=1e-6,
                               masks={"src_mask": "float3d", "tgt_mask": "causal_float", "memory_mask": "bool3d"}),
    "model_fast_encoder": case(MODEL, batch_first=True, layers=3, E=32, H=4,
                               masks={"src_key_padding_mask": "float_inf", "memory_key_padding_mask": "src"}),
}


def torch_activation(torch, name):
    return {"relu": "relu", "gelu": torch.nn.functional.gelu, "gelu_module": torch.nn.GELU(),
            "callable": torch.tanh}[name]


def attnx_activation(name):
    return {"relu": "relu", "gelu": "gelu", "gelu_module": "gelu", "callable": np.tanh}[name]


def torch_dtype(torch, dtype):
    return {np.float32: torch.float32, np.float64: torch.float64}[dtype]


def layer_args(torch, cfg, torch_side):
    activation = torch_activation(torch, cfg["activation"]) if torch_side else attnx_activation(cfg["activation"])
    return (cfg["E"], cfg["H"], cfg["F"], 0.1, activation, cfg["eps"], cfg["batch_first"], cfg["norm_first"],
            cfg["bias"])


def build_torch(torch, cfg, seed=0):
    """The torch module of `cfg` in eval mode, every parameter moved off its initial value."""
    nn = torch.nn
    torch.manual_seed(seed)
    dtype = torch_dtype(torch, cfg["dtype"])
    args = layer_args(torch, cfg, True)
    kind = cfg["kind"]
    with quiet_torch():  # the stacks warn where they will not use nested tensors
        if kind == ENC_LAYER:
            module = nn.TransformerEncoderLayer(*args, dtype=dtype)
        elif kind == DEC_LAYER:
            module = nn.TransformerDecoderLayer(*args, dtype=dtype)
        elif kind == ENCODER:
            norm = nn.LayerNorm(cfg["E"], cfg["eps"], bias=cfg["bias"], dtype=dtype) if cfg["norm"] else None
            module = nn.TransformerEncoder(nn.TransformerEncoderLayer(*args, dtype=dtype), cfg["layers"], norm)
        elif kind == DECODER:
            norm = nn.LayerNorm(cfg["E"], cfg["eps"], bias=cfg["bias"], dtype=dtype) if cfg["norm"] else None
            module = nn.TransformerDecoder(nn.TransformerDecoderLayer(*args, dtype=dtype), cfg["layers"], norm)
        else:
            E, H, F, dropout, activation, eps, batch_first, norm_first, bias = args
            module = nn.Transformer(E, H, cfg["layers"], cfg["layers"], F, dropout, activation, None, None, eps,
                                    batch_first, norm_first, bias, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return module.eval()


def build_attnx(cfg, seed=1):
    """The attnx module of `cfg`, built from its constructor (eval mode)."""
    args = layer_args(None, cfg, False)
    kind, dtype = cfg["kind"], cfg["dtype"]
    if kind == ENC_LAYER:
        return attnx.TransformerEncoderLayer(*args, dtype=dtype, seed=seed).eval()
    if kind == DEC_LAYER:
        return attnx.TransformerDecoderLayer(*args, dtype=dtype, seed=seed).eval()
    norm = LayerNorm(cfg["E"], cfg["eps"], bias=cfg["bias"], dtype=dtype) if cfg["norm"] else None
    if kind == ENCODER:
        return attnx.TransformerEncoder(attnx.TransformerEncoderLayer(*args, dtype=dtype, seed=seed), cfg["layers"],
                                        norm).eval()
    if kind == DECODER:
        return attnx.TransformerDecoder(attnx.TransformerDecoderLayer(*args, dtype=dtype, seed=seed), cfg["layers"],
                                        norm).eval()
    E, H, F, dropout, activation, eps, batch_first, norm_first, bias = args
    return attnx.Transformer(E, H, cfg["layers"], cfg["layers"], F, dropout, activation, None, None, eps,
                             batch_first, norm_first, bias, dtype=dtype, seed=seed).eval()


def from_torch(module, cfg):
    cls = {ENC_LAYER: attnx.TransformerEncoderLayer, DEC_LAYER: attnx.TransformerDecoderLayer,
           ENCODER: attnx.TransformerEncoder, DECODER: attnx.TransformerDecoder, MODEL: attnx.Transformer}[cfg["kind"]]
    if cfg["activation"] == "callable":  # torch.tanh computes on tensors: its NumPy counterpart is given
        return cls.from_torch(module, activation=np.tanh)
    return cls.from_torch(module)


# Which masks each kind takes, as (name, query sequence, key sequence, kind of mask).
MASKS = {
    ENC_LAYER: [("src_mask", "src", "src", "attn"), ("src_key_padding_mask", None, "src", "padding")],
    ENCODER: [("mask", "src", "src", "attn"), ("src_key_padding_mask", None, "src", "padding")],
    DEC_LAYER: [("tgt_mask", "tgt", "tgt", "attn"), ("memory_mask", "tgt", "memory", "attn"),
                ("tgt_key_padding_mask", None, "tgt", "padding"), ("memory_key_padding_mask", None, "memory", "padding")],
    MODEL: [("src_mask", "src", "src", "attn"), ("tgt_mask", "tgt", "tgt", "attn"), ("memory_mask", "tgt", "src", "attn"),
            ("src_key_padding_mask", None, "src", "padding"), ("tgt_key_padding_mask", None, "tgt", "padding"),
            ("memory_key_padding_mask", None, "src", "padding")],
}
MASKS[DECODER] = MASKS[DEC_LAYER]


def lengths(cfg):
    """The sequence lengths by name: src / memory have S positions, tgt L (the encoders' src L)."""
    if cfg["kind"] in (ENC_LAYER, ENCODER):
        return {"src": cfg["L"]}
    if cfg["kind"] == MODEL:
        return {"src": cfg["S"], "tgt": cfg["L"]}
    return {"tgt": cfg["L"], "memory": cfg["S"]}


def sequences(rng, cfg):
    """The inputs by name, in the configuration's layout and dtype."""
    out = {}
    for name, n in lengths(cfg).items():
        shape = (n, cfg["E"]) if cfg["unbatched"] else (cfg["N"], n, cfg["E"]) if cfg["batch_first"] else (n, cfg["N"], cfg["E"])
        out[name] = rng.standard_normal(shape).astype(cfg["dtype"])
    return out


def attn_mask(rng, kind, N, H, L, S, batched, dtype):
    """An attention mask (True / -inf: not allowed) in which key 0 is open to every query."""
    heads = N * H if batched else H
    shape = (heads, L, S) if kind.endswith("3d") else (L, S)
    closed = rng.random(shape) < 0.4
    closed[..., 0] = False
    if kind.startswith("causal"):
        closed = np.triu(np.ones((L, S), bool), 1)
    if kind.startswith("bool") or kind == "causal_bool":
        return closed
    if kind.startswith("float_inf") or kind == "causal_float":
        return np.where(closed, -np.inf, 0.0).astype(dtype)
    return np.where(closed, -np.inf, rng.uniform(-2.0, 1.0, shape)).astype(dtype)  # additive values


def padding_mask(rng, kind, N, S, batched, dtype):
    """A key padding mask (True / -inf: padding) of trailing positions; every sequence keeps one."""
    valid = rng.integers(1, S + 1, size=N)
    valid[0] = S - 2  # some padding in every case
    padded = np.arange(S)[None, :] >= valid[:, None]
    if kind == "bool":
        mask = padded
    elif kind == "float_inf":
        mask = np.where(padded, -np.inf, 0.0).astype(dtype)
    else:  # additive values on the valid keys
        mask = np.where(padded, -np.inf, rng.uniform(-1.0, 1.0, (N, S))).astype(dtype)
    return mask if batched else mask[0]


def make_masks(rng, cfg):
    """The masks of `cfg` by argument name, and the padding of each sequence (bool, (N, n))."""
    n = lengths(cfg)
    if cfg["kind"] == MODEL:
        n["memory"] = n["src"]
    batched, N = not cfg["unbatched"], 1 if cfg["unbatched"] else cfg["N"]
    masks, padding = {}, {}
    for name, query, key, kind in MASKS[cfg["kind"]]:
        spec = cfg["masks"].get(name)
        if spec is None:
            continue
        if spec == "src":  # the encoder's padding for the decoder's memory, as models pass it
            masks[name] = masks["src_key_padding_mask"]
            continue
        if kind == "attn":
            masks[name] = attn_mask(rng, spec, N, cfg["H"], n[query], n[key], batched, cfg["dtype"])
        else:
            masks[name] = padding_mask(rng, spec, N, n[key], batched, cfg["dtype"])
            padding[key] = np.asarray(masks[name] == -np.inf if masks[name].dtype != bool else masks[name])
    return masks, padding


def additive_floats(masks):
    """Whether a float mask holds values other than 0 and -inf (torch's fast path reads them as bool)."""
    return any(m.dtype != bool and not np.all((m == 0) | (m == -np.inf)) for m in masks.values())


@contextlib.contextmanager
def fastpath(torch, enabled):
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def call(module, cfg, inputs, masks, convert=lambda a: a):
    names = ["src"] if cfg["kind"] in (ENC_LAYER, ENCODER) else ["src", "tgt"] if cfg["kind"] == MODEL else ["tgt", "memory"]
    kwargs = {name: convert(m) for name, m in masks.items()}
    kwargs.update(cfg["hints"])
    return module(*[convert(inputs[name]) for name in names], **kwargs)


def torch_output(torch, module, cfg, inputs, masks):
    with fastpath(torch, not additive_floats(masks)), quiet_torch(), torch.inference_mode():
        return call(module, cfg, inputs, masks, torch.from_numpy).numpy()


def compared_rows(cfg, padding):
    """Bool of the output's leading dims (without E): the positions whose rows are specified."""
    query = "src" if cfg["kind"] in (ENC_LAYER, ENCODER) else "tgt"
    n = lengths(cfg)[query]
    N = 1 if cfg["unbatched"] else cfg["N"]
    keep = ~padding[query] if query in padding else np.ones((N, n), bool)
    if cfg["unbatched"]:
        return keep.reshape(-1)  # (n,): the unbatched mask's positions
    return keep if cfg["batch_first"] else keep.T


def assert_matches(actual, expected, rows, dtype, err_msg=""):
    assert actual.dtype == dtype and actual.shape == expected.shape, (actual.dtype, actual.shape, expected.shape)
    assert not np.isnan(expected[rows]).any(), "torch gave NaN: a masked row in the configuration"
    np.testing.assert_allclose(actual[rows], expected[rows], err_msg=err_msg, **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_match_torch(torch, rng, name):
    cfg = CONFIGS[name]
    module = build_torch(torch, cfg)
    inputs = sequences(rng, cfg)
    masks, padding = make_masks(rng, cfg)
    expected = torch_output(torch, module, cfg, inputs, masks)
    rows = compared_rows(cfg, padding)
    copied = from_torch(module, cfg)
    assert not copied.training
    assert_matches(call(copied, cfg, inputs, masks), expected, rows, cfg["dtype"], "from_torch")
    loaded = build_attnx(cfg)
    assert loaded.load_state_dict(module.state_dict()) == ([], [])
    assert_matches(call(loaded, cfg, inputs, masks), expected, rows, cfg["dtype"], "load_state_dict")


LAYER_CONFIGS = [name for name, cfg in CONFIGS.items() if cfg["kind"] in (ENC_LAYER, DEC_LAYER)]


@pytest.mark.parametrize("name", LAYER_CONFIGS)
def test_reference_matches_torch_in_float64(torch, rng, name):
    cfg = {**CONFIGS[name], "dtype": np.float64}
    module = build_torch(torch, cfg)
    inputs = sequences(rng, cfg)
    masks, padding = make_masks(rng, cfg)
    expected = torch_output(torch, module, cfg, inputs, masks)
    params = {key: value.numpy() for key, value in module.state_dict().items()}
    options = dict(activation=attnx_activation(cfg["activation"]), layer_norm_eps=cfg["eps"],
                   norm_first=cfg["norm_first"], batch_first=cfg["batch_first"], **masks, **cfg["hints"])
    if cfg["kind"] == ENC_LAYER:
        ours = reference.transformer_encoder_layer(inputs["src"], params, cfg["H"], **options)
    else:
        ours = reference.transformer_decoder_layer(inputs["tgt"], inputs["memory"], params, cfg["H"], **options)
    assert_matches(ours, expected, compared_rows(cfg, padding), np.float64)


def test_reference_layer_norm_matches_torch(torch, rng):
    x = rng.standard_normal((3, 5, 8))
    weight, bias = rng.standard_normal(8), rng.standard_normal(8)
    for w, b in ((weight, bias), (weight, None), (None, None)):
        expected = torch.nn.functional.layer_norm(
            torch.from_numpy(x), (8,), None if w is None else torch.from_numpy(w),
            None if b is None else torch.from_numpy(b), 1e-3).numpy()
        np.testing.assert_allclose(reference.layer_norm(x, w, b, 1e-3), expected, rtol=1e-12, atol=1e-12)


def test_unbatched_is_a_batch_of_one(rng):
    layer = attnx.TransformerDecoderLayer(16, 4, 32, 0.0, batch_first=True, seed=0)
    tgt, memory = rng.standard_normal((5, 16)), rng.standard_normal((7, 16))
    mask = attnx.Transformer.generate_square_subsequent_mask(5)
    padding = np.array([False] * 5 + [True] * 2)
    one = layer(tgt, memory, tgt_mask=mask, memory_key_padding_mask=padding)
    batch = layer(tgt[None], memory[None], tgt_mask=mask, memory_key_padding_mask=padding[None])
    assert one.shape == (5, 16)
    np.testing.assert_array_equal(one, batch[0])


def test_is_causal_without_a_mask_is_the_causal_mask(rng):
    # torch needs the mask with the hint (it raises without); attnx applies the causal mask.
    mask = attnx.Transformer.generate_square_subsequent_mask(6)
    encoder = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(16, 4, 32, 0.0, seed=0), 2)
    src = rng.standard_normal((6, 2, 16)).astype(np.float32)
    np.testing.assert_allclose(encoder(src, is_causal=True), encoder(src, mask=mask), **TOL[np.float32])
    model = attnx.Transformer(16, 4, 1, 2, 32, 0.0, batch_first=True, seed=0)
    src, tgt = rng.standard_normal((2, 4, 16)), rng.standard_normal((2, 6, 16))
    np.testing.assert_allclose(model(src, tgt, tgt_is_causal=True), model(src, tgt, tgt_mask=mask), **TOL[np.float32])
    # memory_is_causal: the top-left (T, S) causal mask on the attention to memory.
    layer = attnx.TransformerDecoderLayer(16, 4, 32, 0.0, seed=0)
    tgt, memory = rng.standard_normal((6, 2, 16)), rng.standard_normal((4, 2, 16))
    top_left = np.triu(np.ones((6, 4), bool), 1)
    np.testing.assert_allclose(layer(tgt, memory, memory_is_causal=True), layer(tgt, memory, memory_mask=top_left),
                               **TOL[np.float32])


def test_stacks_detect_the_causal_mask_as_torch(torch, monkeypatch, rng):
    from torch.nn.modules.transformer import _detect_is_causal_mask

    seen = []
    encode, decode = attnx._layers.encode, attnx._layers.decode

    def record_encoder(layers, norm, src, mask, padding, is_causal, precisions):
        seen.extend([is_causal] * len(layers))  # every layer's
        return encode(layers, norm, src, mask, padding, is_causal, precisions)

    def record_decoder(layers, norm, tgt, memory, tgt_mask, memory_mask, tgt_padding, memory_padding, tgt_is_causal,
                       memory_is_causal, precisions):
        seen.extend([tgt_is_causal] * len(layers))
        return decode(layers, norm, tgt, memory, tgt_mask, memory_mask, tgt_padding, memory_padding, tgt_is_causal,
                      memory_is_causal, precisions)

    monkeypatch.setattr(attnx._layers, "encode", record_encoder)
    monkeypatch.setattr(attnx._layers, "decode", record_decoder)
    encoder = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(8, 2, 16, 0.0, seed=0), 2)
    decoder = attnx.TransformerDecoder(attnx.TransformerDecoderLayer(8, 2, 16, 0.0, seed=0), 2)
    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    causal = np.triu(np.full((5, 5), -np.inf, np.float32), 1)
    masks = [None, causal, causal.astype(np.float64), np.triu(np.ones((5, 5), bool), 1), np.where(causal == 0, 0.0, -1e9),
             np.triu(np.ones((5, 5), bool), 2), np.broadcast_to(causal, (4, 5, 5)).copy()]
    for mask in masks:
        for hint in (None, True, False):
            expected = _detect_is_causal_mask(None if mask is None else torch.from_numpy(mask), hint, 5)
            for stack, kwargs in ((encoder, {"mask": mask, "is_causal": hint}),
                                  (decoder, {"tgt_mask": mask, "tgt_is_causal": hint})):
                seen.clear()
                stack(x, x, **kwargs) if stack is decoder else stack(x, **kwargs)
                assert seen == [expected] * 2, (mask, hint, stack)


def test_torch_tensors_are_read_as_arrays(torch, rng):
    layer = attnx.TransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True, seed=0)
    src = rng.standard_normal((2, 5, 16)).astype(np.float32)
    padding = np.array([[False] * 5, [False] * 3 + [True] * 2])
    mask = np.triu(np.ones((5, 5), bool), 1)
    expected = layer(src, mask, padding)
    given = layer(torch.from_numpy(src).requires_grad_(), torch.from_numpy(mask), torch.from_numpy(padding))
    np.testing.assert_array_equal(given, expected)


def test_half_precision_storage_computes_in_float32(rng):
    pytest.importorskip("ml_dtypes")
    wide = attnx.Transformer(16, 4, 1, 1, 32, 0.0, seed=0)
    for dtype in (np.float16, "bfloat16"):
        narrow = attnx.Transformer(16, 4, 1, 1, 32, 0.0, dtype=dtype, seed=0)
        narrow.load_state_dict(wide.state_dict())
        rounded = attnx.Transformer(16, 4, 1, 1, 32, 0.0, seed=0)
        rounded.load_state_dict(narrow.state_dict())  # the half-precision values, in float32
        src, tgt = rng.standard_normal((7, 2, 16)), rng.standard_normal((3, 2, 16))
        out = narrow(src, tgt)
        assert out.dtype == narrow.encoder.layers[0].dtype
        expected = rounded(src.astype(narrow.encoder.layers[0].dtype), tgt.astype(narrow.encoder.layers[0].dtype))
        np.testing.assert_allclose(out.astype(np.float32), expected, atol=0.05, rtol=0.02)


def test_layer_norm_and_linear_holders_compute_as_torch(torch, rng):
    norm = torch.nn.LayerNorm(8, eps=1e-3).eval()
    linear = torch.nn.Linear(8, 5)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    ours = LayerNorm.from_torch(norm)
    ours_linear = Linear(8, 5, seed=0)
    ours_linear.load_state_dict(linear.state_dict())
    x = rng.standard_normal((3, 8)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(ours(x), norm(torch.from_numpy(x)).numpy(), **TOL[np.float32])
        np.testing.assert_allclose(ours_linear(x), linear(torch.from_numpy(x)).numpy(), **TOL[np.float32])
    assert (ours.normalized_shape, ours.eps, ours_linear.in_features, ours_linear.out_features) == ((8,), 1e-3, 8, 5)
    assert LayerNorm(8, bias=False).bias is None and LayerNorm(8, elementwise_affine=False).weight is None
    assert list(LayerNorm(8, bias=False).state_dict()) == list(torch.nn.LayerNorm(8, bias=False).state_dict())


# ---------------------------------------------------------------------------------------------
# torch's constructors, names, keys and modes
# ---------------------------------------------------------------------------------------------

CLASSES = ["TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder",
           "Transformer"]


@pytest.mark.parametrize("name", CLASSES)
def test_signatures_are_torchs(torch, name):
    ours, theirs = getattr(attnx, name), getattr(torch.nn, name)
    for method in ("__init__", "forward"):
        mine = inspect.signature(getattr(ours, method)).parameters
        torchs = inspect.signature(getattr(theirs, method)).parameters
        positional = [(p.name, p.default) for p in mine.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        expected = [(p.name, "relu" if p.name == "activation" else p.default) for p in torchs.values()]
        assert positional == expected, method
    if "seed" in inspect.signature(ours.__init__).parameters:
        assert inspect.signature(ours.__init__).parameters["seed"].kind is inspect.Parameter.KEYWORD_ONLY
    assert name in attnx.__all__


@pytest.mark.parametrize("kind", [ENC_LAYER, DEC_LAYER, ENCODER, DECODER, MODEL])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_parameter_names_and_order_are_torchs(torch, kind, bias):
    cfg = case(kind, bias=bias, norm=bias)
    module, ours = build_torch(torch, cfg), build_attnx(cfg)
    assert list(ours.state_dict()) == list(module.state_dict())
    named = [(name, tuple(p.shape)) for name, p in ours.named_parameters(prefix="m")]
    assert named == [(name, tuple(p.shape)) for name, p in module.named_parameters(prefix="m")]
    assert [p.shape for p in ours.parameters()] == [tuple(p.shape) for p in module.parameters()]
    assert list(ours.named_parameters(recurse=False)) == []  # every parameter is a submodule's, as in torch
    assert all(p.dtype == np.float32 for p in ours.parameters())


def test_attributes_are_torchs():
    layer = attnx.TransformerDecoderLayer(16, 4, 24, 0.2, "gelu", 1e-4, True, True, False, "cpu", np.float64, seed=0)
    assert isinstance(layer.self_attn, attnx.MultiheadAttention) and isinstance(layer.multihead_attn,
                                                                                 attnx.MultiheadAttention)
    assert (layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.self_attn.dropout) == (16, 4, 0.2)
    assert layer.self_attn.in_proj_bias is None and layer.self_attn.batch_first and layer.batch_first
    assert (layer.linear1.in_features, layer.linear1.out_features, layer.linear1.weight.shape) == (16, 24, (24, 16))
    assert layer.linear2.weight.shape == (16, 24) and layer.linear1.bias is None
    for norm in (layer.norm1, layer.norm2, layer.norm3):
        assert norm.normalized_shape == (16,) and norm.eps == 1e-4 and norm.bias is None and norm.weight.dtype == np.float64
    assert (layer.activation, layer.norm_first, layer.dropout, layer.dtype) == ("gelu", True, 0.2, np.float64)
    layer.batch_first = False
    assert not layer.self_attn.batch_first and not layer.multihead_attn.batch_first
    model = attnx.Transformer(16, 4, 2, 3, 32, batch_first=True, seed=0)
    assert (model.d_model, model.nhead, model.batch_first) == (16, 4, True)
    assert len(model.encoder.layers) == model.encoder.num_layers == 2 and len(model.decoder.layers) == 3
    assert isinstance(model.encoder.norm, LayerNorm) and isinstance(model.decoder.norm, LayerNorm)
    encoder = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(16, 4), 2, None, False, False)
    assert encoder.norm is None and not encoder.enable_nested_tensor and not encoder.mask_check


def test_initialisation_follows_torchs_distributions():
    E, F = 16, 40
    layer = attnx.TransformerEncoderLayer(E, 4, F, seed=0)
    assert np.abs(layer.linear1.weight).max() <= 1 / math.sqrt(E) and np.abs(layer.linear1.bias).max() <= 1 / math.sqrt(E)
    assert np.abs(layer.linear2.weight).max() <= 1 / math.sqrt(F) and np.abs(layer.linear2.weight).max() > 0.8 / math.sqrt(F)
    assert (layer.norm1.weight == 1).all() and (layer.norm2.bias == 0).all()
    assert (layer.self_attn.in_proj_bias == 0).all()
    again = attnx.TransformerEncoderLayer(E, 4, F, seed=0)
    for (name, a), (_, b) in zip(layer.named_parameters(), again.named_parameters()):
        np.testing.assert_array_equal(a, b, err_msg=name)  # the seed decides
    # The stacks' layers are deep copies: equal values, their own arrays.
    encoder = attnx.TransformerEncoder(layer, 2)
    assert encoder.layers[0] is not layer and encoder.layers[0].linear1.weight is not encoder.layers[1].linear1.weight
    np.testing.assert_array_equal(encoder.layers[0].linear1.weight, encoder.layers[1].linear1.weight)
    # The model draws every matrix again from xavier_uniform_: the layers differ.
    model = attnx.Transformer(E, 4, 2, 1, F, seed=0)
    w1 = model.encoder.layers[1].linear1.weight
    assert not np.array_equal(model.encoder.layers[0].linear1.weight, w1)
    bound = math.sqrt(6 / (E + F))
    assert np.abs(w1).max() <= bound and np.abs(w1).max() > 0.8 * bound
    assert np.abs(model.decoder.layers[0].multihead_attn.in_proj_weight).max() <= math.sqrt(6 / (4 * E))
    np.testing.assert_array_equal(model.encoder.layers[0].linear1.bias, model.encoder.layers[1].linear1.bias)


def test_custom_encoder_and_decoder_are_used_and_initialised_again(rng):
    # As torch: the model keeps the given stacks and draws their matrices again.
    encoder = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(16, 4, 32, 0.0, seed=0), 1)
    decoder = attnx.TransformerDecoder(attnx.TransformerDecoderLayer(16, 4, 32, 0.0, seed=0), 2, LayerNorm(16))
    weight, bias = encoder.layers[0].linear1.weight, encoder.layers[0].linear1.bias
    model = attnx.Transformer(16, 4, custom_encoder=encoder, custom_decoder=decoder, seed=1)
    assert model.encoder is encoder and model.decoder is decoder and model.encoder.norm is None
    assert not np.array_equal(encoder.layers[0].linear1.weight, weight)
    np.testing.assert_array_equal(encoder.layers[0].linear1.bias, bias)
    src, tgt = rng.standard_normal((5, 2, 16)), rng.standard_normal((3, 2, 16))
    np.testing.assert_allclose(model(src, tgt), decoder(tgt, encoder(src)), **TOL[np.float32])


def test_generate_square_subsequent_mask_is_torchs(torch):
    for sz in (0, 1, 5):
        ours = attnx.Transformer.generate_square_subsequent_mask(sz)
        theirs = torch.nn.Transformer.generate_square_subsequent_mask(sz).numpy()
        assert ours.dtype == theirs.dtype == np.float32 and ours.shape == (sz, sz)
        np.testing.assert_array_equal(ours, theirs)
    assert attnx.Transformer.generate_square_subsequent_mask(3, "cpu", torch.float64).dtype == np.float64
    assert attnx.Transformer(16, 4, 1, 1, 32).generate_square_subsequent_mask(2, dtype=np.float64).dtype == np.float64
    with pytest.raises(TypeError, match="sz"):
        attnx.Transformer.generate_square_subsequent_mask(2.5)
    with pytest.raises(ValueError, match="sz"):
        attnx.Transformer.generate_square_subsequent_mask(-1)
    with pytest.raises(ValueError, match="device"):
        attnx.Transformer.generate_square_subsequent_mask(2, device="cuda")


@pytest.mark.parametrize("kind", [ENC_LAYER, DEC_LAYER, ENCODER, DECODER, MODEL])
def test_pickle_round_trip_gives_the_same_outputs(rng, kind):
    cfg = case(kind, activation="gelu", batch_first=True)
    module = build_attnx(cfg)
    inputs = sequences(rng, cfg)
    copy = pickle.loads(pickle.dumps(module))
    assert list(copy.state_dict()) == list(module.state_dict()) and copy.training == module.training
    np.testing.assert_array_equal(call(copy, cfg, inputs, {}), call(module, cfg, inputs, {}))


def test_training_mode_with_dropout_raises_as_multihead_attention(torch, rng):
    # torch's default dropout=0.1 and training mode: torch would apply dropout, attnx refuses.
    src = rng.standard_normal((4, 2, 16)).astype(np.float32)
    layer = attnx.TransformerEncoderLayer(16, 4, 32)
    assert layer.training and layer.self_attn.training and layer.dropout == 0.1
    with pytest.raises(NotImplementedError, match=r"TransformerEncoderLayer with dropout=0.1 in training mode.*\.eval\(\)"):
        layer(src)
    assert layer.eval() is layer and not layer.training and not layer.self_attn.training
    layer(src)
    layer.self_attn.train()  # torch applies the attention's dropout by the attention's own flag
    with pytest.raises(NotImplementedError, match="self_attn"):
        layer(src)
    # dropout=0.0 computes the same in both modes.
    quiet = attnx.TransformerDecoderLayer(16, 4, 32, 0.0, seed=0)
    np.testing.assert_array_equal(quiet(src, src), quiet.eval()(src, src))
    # The stacks and the model check every layer; train() and eval() reach them all.
    model = attnx.Transformer(16, 4, 1, 2, 32)
    with pytest.raises(NotImplementedError, match="dropout=0.1"):
        model(src, src)
    assert model.eval() is model and not any(
        m.training for m in [model, model.encoder, model.decoder.layers[1], model.decoder.layers[1].multihead_attn,
                             model.decoder.norm, model.encoder.layers[0].linear1])
    model(src, src)
    model.train()
    assert model.decoder.layers[1].multihead_attn.training
    # from_torch copies the modes: a torch module in training mode with dropout refuses.
    with quiet_torch():
        trained = attnx.TransformerEncoder.from_torch(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32), 1))
    with pytest.raises(NotImplementedError):
        trained(src)
    trained.eval()(src)
    with pytest.raises(TypeError, match="training"):
        layer.training = "yes"
    with pytest.raises(ValueError, match="dropout"):
        attnx.TransformerEncoderLayer(16, 4, 32, 1.5)


def test_from_torch_activations(torch):
    nn, F = torch.nn, torch.nn.functional
    for given, expected in (("relu", "relu"), ("gelu", "gelu"), (F.relu, "relu"), (F.gelu, "gelu"),
                            (nn.ReLU(), "relu"), (nn.GELU(), "gelu")):
        module = nn.TransformerEncoderLayer(8, 2, 16, activation=given)
        assert attnx.TransformerEncoderLayer.from_torch(module).activation == expected
        assert attnx.TransformerEncoderLayer(8, 2, 16, activation=given).activation == expected
    for other in (nn.GELU(approximate="tanh"), F.silu, torch.tanh):
        module = nn.TransformerDecoderLayer(8, 2, 16, activation=other)
        with pytest.raises(ValueError, match="activation="):
            attnx.TransformerDecoderLayer.from_torch(module)
        with pytest.raises(ValueError, match="NumPy"):
            attnx.TransformerDecoderLayer(8, 2, 16, activation=other)
        assert attnx.TransformerDecoderLayer.from_torch(module, activation=np.tanh).activation is np.tanh
    with pytest.raises(ValueError, match="activation"):
        attnx.TransformerEncoderLayer(8, 2, 16, activation="tanh")
    with pytest.raises(TypeError, match="activation"):
        attnx.TransformerEncoderLayer(8, 2, 16, activation=3)
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        attnx.TransformerEncoderLayer.from_torch(nn.Linear(2, 2))


def test_from_torch_copies_configuration_and_modes(torch):
    with quiet_torch():
        module = torch.nn.Transformer(16, 4, 1, 2, 24, 0.0, "gelu", batch_first=True, norm_first=True,
                                      dtype=torch.float64, layer_norm_eps=1e-3)
    module.decoder.layers[1].norm3.eps = 1e-2
    module.encoder.layers[0].self_attn.eval()
    model = attnx.Transformer.from_torch(module)
    assert (model.d_model, model.nhead, model.batch_first, model.training) == (16, 4, True, True)
    layer = model.decoder.layers[1]
    assert (layer.activation, layer.norm_first, layer.dtype, layer.linear1.out_features) == ("gelu", True, np.float64, 24)
    assert (layer.norm1.eps, layer.norm3.eps, model.decoder.norm.eps) == (1e-3, 1e-2, 1e-3)
    assert not model.encoder.layers[0].self_attn.training and model.encoder.layers[0].training
    for (name, ours), (key, theirs) in zip(model.state_dict().items(), module.state_dict().items()):
        assert name == key
        np.testing.assert_array_equal(ours, theirs.numpy())
        assert ours.dtype == np.float64
    # Each norm's own eps counts.
    rng = np.random.default_rng(0)
    src, tgt = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 4, 16))
    with torch.inference_mode():
        expected = module.eval()(torch.from_numpy(src), torch.from_numpy(tgt)).numpy()
    np.testing.assert_allclose(model.eval()(src, tgt), expected, **TOL[np.float64])


# ---------------------------------------------------------------------------------------------
# Errors and the caller's arrays
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_naming_the_argument(rng):
    layer = attnx.TransformerEncoderLayer(16, 4, 32, 0.0, seed=0)
    src = rng.standard_normal((5, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"src has 8 features, expected d_model = 16: src \(5, 2, 8\)"):
        layer(src[..., :8])
    with pytest.raises(ValueError, match="src must be 2-D"):
        layer(src[None])
    with pytest.raises(TypeError, match="src must be a floating-point array"):
        layer(src.astype(np.int32))
    with pytest.raises(TypeError, match="src_mask must be a bool or floating-point array, got dtype int64"):
        layer(src, np.zeros((5, 5), np.int64))
    with pytest.raises(ValueError, match=r"src_mask must have shape \(L, S\) = \(5, 5\) or \(N\*nhead, L, S\) = \(8, 5, 5\), got \(5, 4\)"):
        layer(src, np.zeros((5, 4), bool))
    with pytest.raises(ValueError, match=r"src_key_padding_mask must have shape \(N, S\) = \(2, 5\), got \(5, 2\)"):
        layer(src, src_key_padding_mask=np.zeros((5, 2), bool))
    with pytest.raises(ValueError, match=r"src_key_padding_mask must have shape \(S,\)"):
        layer(src[:, 0], src_key_padding_mask=np.zeros((1, 5), bool))
    with pytest.raises(TypeError, match="is_causal"):
        layer(src, is_causal=None)

    decoder = attnx.TransformerDecoder(attnx.TransformerDecoderLayer(16, 4, 32, 0.0, seed=0), 1)
    memory = rng.standard_normal((7, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"memory has 12 features, expected d_model = 16: memory \(7, 2, 12\)"):
        decoder(src, memory[..., :12])
    with pytest.raises(ValueError, match=r"tgt and memory must have the same batch size: tgt \(5, 2, 16\), memory \(7, 3, 16\)"):
        decoder(src, np.concatenate([memory, memory[:, :1]], axis=1))
    with pytest.raises(ValueError, match="memory must be 3-D"):
        decoder(src, memory[:, 0])
    with pytest.raises(ValueError, match=r"memory_mask must have shape \(L, S\) = \(5, 7\)"):
        decoder(src, memory, memory_mask=np.zeros((5, 5), bool))
    with pytest.raises(ValueError, match=r"memory_key_padding_mask must have shape \(N, S\) = \(2, 7\)"):
        decoder(src, memory, memory_key_padding_mask=np.zeros((2, 5), bool))

    model = attnx.Transformer(16, 4, 1, 1, 32, 0.0, seed=0)
    with pytest.raises(ValueError, match=r"src and tgt must have the same batch size: src \(7, 2, 16\), tgt \(5, 3, 16\)"):
        model(memory, rng.standard_normal((5, 3, 16)))
    with pytest.raises(ValueError, match=r"tgt has 8 features, expected d_model = 16"):
        model(memory, src[..., :8])
    with pytest.raises(ValueError, match="src and tgt must both be batched"):
        model(memory, src[:, 0])
    with pytest.raises(ValueError, match="src_key_padding_mask"):
        model(memory, src, src_key_padding_mask=np.zeros((2, 5), bool))


def test_bad_constructor_arguments_raise():
    with pytest.raises(ValueError, match="divisible"):
        attnx.TransformerEncoderLayer(10, 4)
    with pytest.raises(TypeError, match="dim_feedforward"):
        attnx.TransformerEncoderLayer(8, 2, 16.0)
    with pytest.raises(ValueError, match="device"):
        attnx.TransformerDecoderLayer(8, 2, device="cuda")
    with pytest.raises(TypeError, match="layer_norm_eps"):
        attnx.TransformerDecoderLayer(8, 2, layer_norm_eps="small")
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        attnx.TransformerEncoder(attnx.TransformerDecoderLayer(8, 2), 2)
    with pytest.raises(ValueError, match="num_layers"):
        attnx.TransformerDecoder(attnx.TransformerDecoderLayer(8, 2), 0)
    with pytest.raises(TypeError, match="norm"):
        attnx.TransformerEncoder(attnx.TransformerEncoderLayer(8, 2), 1, norm="layer")
    with pytest.raises(TypeError, match="custom_encoder"):
        attnx.Transformer(8, 2, custom_encoder=attnx.TransformerEncoderLayer(8, 2))
    with pytest.raises(ValueError, match="normalized_shape"):
        LayerNorm((4, 4))


def test_load_state_dict_checks_keys_and_shapes():
    layer = attnx.TransformerEncoderLayer(8, 2, 16, seed=0)
    state = layer.state_dict()
    before = layer.state_dict()
    bad = dict(state, **{"linear1.weight": np.zeros((16, 7))})
    with pytest.raises(ValueError, match=r"state_dict\['linear1.weight'\] has shape \(16, 7\), but the parameter has shape \(16, 8\)"):
        layer.load_state_dict(bad)
    missing = {k: v for k, v in state.items() if k != "norm2.bias"}
    with pytest.raises(ValueError, match="missing keys 'norm2.bias'"):
        layer.load_state_dict(missing)
    with pytest.raises(ValueError, match="unexpected keys 'norm3.weight'"):
        layer.load_state_dict(dict(state, **{"norm3.weight": np.ones(8)}))
    with pytest.raises(TypeError, match="norm1.weight"):
        layer.load_state_dict(dict(state, **{"norm1.weight": np.ones(8, complex)}))
    for key, value in layer.state_dict().items():
        np.testing.assert_array_equal(value, before[key])  # nothing loaded by a failed call
    result = layer.load_state_dict(dict(missing, extra=np.ones(1)), strict=False)
    assert result == (["norm2.bias"], ["extra"])


def test_the_callers_arrays_are_neither_modified_nor_kept(rng):
    model = attnx.Transformer(16, 4, 1, 1, 32, 0.0, batch_first=True, seed=0)
    src, tgt = rng.standard_normal((2, 7, 16)), rng.standard_normal((2, 3, 16)).astype(np.float32)
    masks = {"src_key_padding_mask": np.array([[False] * 7, [False] * 5 + [True] * 2]),
             "memory_key_padding_mask": np.array([[0.0] * 7, [0.0] * 5 + [-np.inf] * 2]),
             "tgt_mask": attnx.Transformer.generate_square_subsequent_mask(3), "src_mask": np.zeros((7, 7))}
    arrays = [src, tgt, *masks.values()]
    before = [a.copy() for a in arrays]
    out = model(src, tgt, **masks)
    for a, b in zip(arrays, before):
        np.testing.assert_array_equal(a, b)
        assert not np.may_share_memory(out, a)
    state = model.state_dict()
    state["encoder.layers.0.linear1.weight"][...] = 0  # a copy: the model keeps its own
    assert model.encoder.layers[0].linear1.weight.any()
    model.load_state_dict(state)
    state["encoder.layers.0.linear1.bias"][...] = 7
    assert not (model.encoder.layers[0].linear1.bias == 7).any()
