"""The transformer layers skip padded positions: with a key padding mask, a stack runs on the real
tokens only (packed once at its entry, unpacked once at its exit) and its outputs at padded
positions are exactly 0, as torch's nested tensors give.

The reference of a padded batch is each sequence alone: torch's module (eval, under
``torch.inference_mode()``) on the sequence's real tokens, without padding, which is what the
key padding mask asks for at the real positions whatever the path torch takes. Where torch's
encoder takes its nested-tensor path, its whole output, zeros included, is compared too. Where
the packed rows cannot express a call (an attention mask other than the causal one, a float
padding mask of other values than 0 and -inf), the padded batch runs with its masks and the
padded outputs are set to 0 (``attnx._layers.last_route()`` names the route).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import _layers, reference
from attnx.transformer import LayerNorm
from conftest import quiet_torch

E, H, F = 16, 4, 32
TOL = {np.float32: {"rtol": 3e-5, "atol": 3e-5}, np.float64: {"rtol": 1e-10, "atol": 1e-10}}
PACKED = _layers.PACKED


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def padding(lengths_and_holes, L):
    """(N, L) bool, True = padding: each entry (real count, positions of holes in the middle)."""
    out = np.ones((len(lengths_and_holes), L), bool)
    for b, (n, holes) in enumerate(lengths_and_holes):
        out[b, :n] = False
        out[b, list(holes)] = True
    return out


# Padding at the end, in the middle and both, and a sequence without padding.
PADDINGS = {
    "end": [(7, ()), (4, ()), (2, ())],
    "middle": [(7, (1, 4)), (6, (0, 3)), (7, ())],
    "fully_padded": [(5, (2,)), (0, ()), (7, ())],
}
NESTED = {  # padding at the end only, which torch's nested tensors take
    "end": PADDINGS["end"],
    "fully_padded": [(5, ()), (0, ()), (7, ())],
}


def to_layout(x, batch_first):
    """(N, L, E) as the layers take it."""
    return x if batch_first else x.transpose(1, 0, 2).copy()


def from_layout(x, batch_first):
    return x if batch_first else x.transpose(1, 0, 2)


def torch_encoder(torch, norm_first, batch_first, layers=2, dtype=np.float32, nested=False, norm=True):
    torch.manual_seed(0)
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    layer = torch.nn.TransformerEncoderLayer(E, H, F, 0.0, batch_first=batch_first, norm_first=norm_first,
                                             dtype=tdtype)
    with quiet_torch():
        module = torch.nn.TransformerEncoder(layer, layers, torch.nn.LayerNorm(E, dtype=tdtype) if norm else None,
                                             enable_nested_tensor=nested)
    with torch.no_grad():
        for p in module.parameters():  # off their initial values (norms too)
            p.add_(torch.randn_like(p) * 0.1)
    return module.eval()


def torch_decoder(torch, norm_first, batch_first, layers=2, dtype=np.float32):
    torch.manual_seed(1)
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    layer = torch.nn.TransformerDecoderLayer(E, H, F, 0.0, batch_first=batch_first, norm_first=norm_first,
                                             dtype=tdtype)
    module = torch.nn.TransformerDecoder(layer, layers, torch.nn.LayerNorm(E, dtype=tdtype))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return module.eval()


def run_torch(torch, module, *args, **kwargs):
    with quiet_torch(), torch.inference_mode():
        return module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in args),
                      **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}).numpy()


def causal_mask(n, dtype=np.float32):
    return np.triu(np.full((n, n), -np.inf, dtype), 1)


def per_sequence(torch, module, x, pad, memory=None, memory_pad=None, causal=False):
    """(N, L, E): each sequence's real tokens through `module` alone (batch of one, batch_first
    as the module's), zeros at its padding."""
    batch_first = (module.layers[0].self_attn.batch_first)
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        real = ~pad[b]
        if not real.any():
            continue
        xs = x[b, real][None]
        args = [to_layout(xs, batch_first)]
        kwargs = {}
        if memory is not None:
            m = memory[b] if memory_pad is None else memory[b, ~memory_pad[b]]
            args.append(to_layout(m[None], batch_first))
        if causal:
            kwargs["tgt_mask" if memory is not None else "mask"] = causal_mask(xs.shape[1], x.dtype)
        out[b, real] = from_layout(run_torch(torch, module, *args, **kwargs), batch_first)[0]
    return out


def assert_padding_free(got, want, pad, dtype=np.float32):
    """`got` (N, L, E) equal to `want` at the real positions, exactly 0 at the padded ones."""
    assert got.dtype == dtype
    assert not got[pad].any(), "padded positions must be exactly 0"
    np.testing.assert_allclose(got[~pad], want[~pad], **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Encoders
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", list(PADDINGS))
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_runs_on_the_real_tokens(torch, rng, where, batch_first, norm_first, causal):
    module = torch_encoder(torch, norm_first, batch_first)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = padding(PADDINGS[where], 8)
    x = rng.standard_normal((3, 8, E)).astype(np.float32)
    kwargs = {"mask": causal_mask(8), "is_causal": True} if causal else {}
    got = from_layout(ours(to_layout(x, batch_first), src_key_padding_mask=pad, **kwargs), batch_first)
    assert _layers.last_route() == PACKED
    assert_padding_free(got, per_sequence(torch, module, x, pad, causal=causal), pad)


@pytest.mark.parametrize("where", list(NESTED))
def test_encoder_equals_torch_nested_tensors_zeros_included(torch, rng, where):
    # torch's nested-tensor path: batch_first, post-norm, eval, inference mode, padding at the end;
    # without a final norm, which torch applies to the padded output, zeros included.
    module = torch_encoder(torch, False, True, layers=3, nested=True, norm=False)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = padding(NESTED[where], 8)
    x = rng.standard_normal((3, 8, E)).astype(np.float32)
    want = run_torch(torch, module, x, src_key_padding_mask=pad)
    got = ours(x, src_key_padding_mask=pad)
    assert _layers.last_route() == PACKED
    assert not want[pad].any()  # torch's zeros
    real = ~pad
    np.testing.assert_allclose(got[real], want[real], **TOL[np.float32])
    np.testing.assert_array_equal(got[pad], want[pad])


def test_encoder_with_a_final_norm_keeps_zeros_where_torch_normalizes_them(torch, rng):
    # torch's nested tensors are unpacked before the stack's final norm, which turns their zeros
    # into the norm's bias; attnx's padded outputs stay 0.
    module = torch_encoder(torch, False, True, nested=True)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = padding(NESTED["end"], 8)
    x = rng.standard_normal((3, 8, E)).astype(np.float32)
    want = run_torch(torch, module, x, src_key_padding_mask=pad)
    got = ours(x, src_key_padding_mask=pad)
    np.testing.assert_allclose(got[~pad], want[~pad], **TOL[np.float32])
    np.testing.assert_allclose(want[pad], np.broadcast_to(module.norm.bias.detach().numpy(), want[pad].shape),
                               **TOL[np.float32])
    assert not got[pad].any()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_alone(torch, rng, batch_first, norm_first):
    tl = torch_encoder(torch, norm_first, batch_first, layers=1).layers[0]
    ours = attnx.TransformerEncoderLayer.from_torch(tl)
    pad = padding(PADDINGS["middle"], 8)
    x = rng.standard_normal((3, 8, E)).astype(np.float32)
    got = from_layout(ours(to_layout(x, batch_first), src_key_padding_mask=pad), batch_first)
    assert _layers.last_route() == PACKED
    want = np.zeros_like(x)
    for b in range(3):
        real = ~pad[b]
        want[b, real] = from_layout(run_torch(torch, tl, to_layout(x[b, real][None], batch_first)), batch_first)[0]
    assert_padding_free(got, want, pad)


def test_encoder_float64(torch, rng):
    module = torch_encoder(torch, True, False, dtype=np.float64)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = padding(PADDINGS["middle"], 8)
    x = rng.standard_normal((3, 8, E))
    got = from_layout(ours(to_layout(x, False), src_key_padding_mask=pad), False)
    assert_padding_free(got, per_sequence(torch, module, x, pad), pad, np.float64)


def test_float_padding_of_zeros_and_minus_inf_is_packed(torch, rng):
    module = torch_encoder(torch, False, True)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = padding(PADDINGS["middle"], 8)
    x = rng.standard_normal((3, 8, E)).astype(np.float32)
    got = ours(x, src_key_padding_mask=np.where(pad, -np.inf, 0.0).astype(np.float32))
    assert _layers.last_route() == PACKED
    np.testing.assert_array_equal(got, ours(x, src_key_padding_mask=pad))


def test_unbatched_input(torch, rng):
    module = torch_encoder(torch, False, False)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = np.array([False, True, False, False, True, False])
    x = rng.standard_normal((6, E)).astype(np.float32)
    got = ours(x, src_key_padding_mask=pad)
    want = run_torch(torch, module, x[~pad])
    assert not got[pad].any()
    np.testing.assert_allclose(got[~pad], want, **TOL[np.float32])


def test_every_sequence_fully_padded_gives_zeros(rng):
    encoder = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(E, H, F, 0.0, seed=0), 2).eval()
    x = rng.standard_normal((5, 2, E)).astype(np.float32)
    out = encoder(x, src_key_padding_mask=np.ones((2, 5), bool))
    assert out.shape == x.shape and out.dtype == np.float32 and not out.any()


# ---------------------------------------------------------------------------------------------
# Decoders and the Transformer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("masks", ["tgt", "memory", "both"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_runs_on_the_real_tokens(torch, rng, masks, batch_first, norm_first):
    module = torch_decoder(torch, norm_first, batch_first)
    ours = attnx.TransformerDecoder.from_torch(module)
    tgt = rng.standard_normal((3, 8, E)).astype(np.float32)
    memory = rng.standard_normal((3, 6, E)).astype(np.float32)
    tgt_pad = padding(PADDINGS["middle"], 8) if masks != "memory" else np.zeros((3, 8), bool)
    memory_pad = padding([(6, (2,)), (3, ()), (5, (0, 1))], 6) if masks != "tgt" else None
    kwargs = {"tgt_mask": causal_mask(8), "tgt_is_causal": True}
    if masks != "memory":
        kwargs["tgt_key_padding_mask"] = tgt_pad
    if memory_pad is not None:
        kwargs["memory_key_padding_mask"] = memory_pad
    got = from_layout(ours(to_layout(tgt, batch_first), to_layout(memory, batch_first), **kwargs), batch_first)
    assert _layers.last_route() == PACKED
    want = per_sequence(torch, module, tgt, tgt_pad, memory, memory_pad, causal=True)
    assert_padding_free(got, want, tgt_pad)


def test_decoder_float64_and_layer_alone(torch, rng):
    module = torch_decoder(torch, False, True, layers=1, dtype=np.float64)
    ours = attnx.TransformerDecoderLayer.from_torch(module.layers[0])
    tgt, memory = rng.standard_normal((3, 8, E)), rng.standard_normal((3, 6, E))
    tgt_pad, memory_pad = padding(PADDINGS["fully_padded"], 8), padding([(6, ()), (2, ()), (4, (1,))], 6)
    got = ours(tgt, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=memory_pad)
    assert _layers.last_route() == PACKED
    want = np.zeros_like(tgt)
    for b in range(3):
        real = ~tgt_pad[b]
        if real.any():
            want[b, real] = run_torch(torch, module.layers[0], tgt[b, real][None], memory[b, ~memory_pad[b]][None])[0]
    assert_padding_free(got, want, tgt_pad, np.float64)


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_with_the_source_padding_alone(torch, rng, batch_first):
    # The memory's padded rows are 0 (the encoder's output there) and the decoder attends them,
    # as torch's nested-tensor encoder gives them to its decoder.
    torch.manual_seed(2)
    with quiet_torch():
        module = torch.nn.Transformer(E, H, 2, 2, F, 0.0, batch_first=batch_first).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = attnx.Transformer.from_torch(module)
    src, tgt = rng.standard_normal((3, 8, E)).astype(np.float32), rng.standard_normal((3, 5, E)).astype(np.float32)
    src_pad, tgt_pad = padding(PADDINGS["middle"], 8), padding([(5, ()), (3, ()), (5, (2,))], 5)
    got = from_layout(ours(to_layout(src, batch_first), to_layout(tgt, batch_first), src_key_padding_mask=src_pad,
                           tgt_key_padding_mask=tgt_pad, tgt_is_causal=True,
                           tgt_mask=causal_mask(5)), batch_first)
    memory = per_sequence(torch, module.encoder, src, src_pad)
    assert not memory[src_pad].any()
    want = per_sequence(torch, module.decoder, tgt, tgt_pad, memory, None, causal=True)
    assert_padding_free(got, want, tgt_pad)
    # With the memory's padding given, cross-attention reads the real memory rows only.
    got = from_layout(ours(to_layout(src, batch_first), to_layout(tgt, batch_first), src_key_padding_mask=src_pad,
                           tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad), batch_first)
    want = per_sequence(torch, module.decoder, tgt, tgt_pad, memory, src_pad)
    assert_padding_free(got, want, tgt_pad)


# ---------------------------------------------------------------------------------------------
# The padded batch, where the packed rows cannot express the call
# ---------------------------------------------------------------------------------------------


def test_an_attention_mask_runs_the_padded_batch_then_zeroes_the_padding(torch, rng):
    module = torch_encoder(torch, False, False)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = padding(PADDINGS["end"], 8)
    mask = rng.random((8, 8)) < 0.3
    mask[:, 0] = False
    x = rng.standard_normal((8, 3, E)).astype(np.float32)
    got = ours(x, mask=mask, src_key_padding_mask=pad)
    assert _layers.last_route() == "src_mask is not the causal mask"
    want = run_torch(torch, module, x, mask=mask, src_key_padding_mask=pad)
    assert_padding_free(got.transpose(1, 0, 2), want.transpose(1, 0, 2), pad)


def test_float_padding_of_other_values_runs_the_padded_batch(torch, rng):
    module = torch_encoder(torch, False, False)
    ours = attnx.TransformerEncoder.from_torch(module)
    pad = padding(PADDINGS["end"], 8)
    additive = np.where(pad, -np.inf, rng.uniform(-1, 1, pad.shape)).astype(np.float32)
    x = rng.standard_normal((8, 3, E)).astype(np.float32)
    got = ours(x, src_key_padding_mask=additive)
    assert "float" in _layers.last_route()
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # torch's fast path reads float masks as bool
    try:
        want = run_torch(torch, module, x, src_key_padding_mask=additive)
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    assert_padding_free(got.transpose(1, 0, 2), want.transpose(1, 0, 2), pad)


@pytest.mark.parametrize("kwargs,reason", [
    ({"memory_mask": "random"}, "memory_mask is given"),
    ({"memory_is_causal": True}, "memory_is_causal is set"),  # torch: with the causal memory_mask
    ({"tgt_mask": "random"}, "tgt_mask is not the causal mask"),
])
def test_decoder_calls_the_pack_cannot_express(torch, rng, kwargs, reason):
    module = torch_decoder(torch, False, True)
    ours = attnx.TransformerDecoder.from_torch(module)
    tgt, memory = rng.standard_normal((3, 8, E)).astype(np.float32), rng.standard_normal((3, 8, E)).astype(np.float32)
    tgt_pad = padding(PADDINGS["end"], 8)
    kwargs = dict(kwargs)
    for name in ("memory_mask", "tgt_mask"):
        if kwargs.get(name) == "random":
            m = rng.random((8, 8)) < 0.3
            m[:, 0] = False
            kwargs[name] = m
    got = ours(tgt, memory, tgt_key_padding_mask=tgt_pad, **kwargs)
    assert _layers.last_route() == reason
    if kwargs.get("memory_is_causal"):
        kwargs["memory_mask"] = causal_mask(8)
    want = run_torch(torch, module, tgt, memory, tgt_key_padding_mask=tgt_pad, **kwargs)
    assert_padding_free(got, want, tgt_pad)


# ---------------------------------------------------------------------------------------------
# Full batches: the route and the numbers of before
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_mask_without_padding_changes_nothing(rng, batch_first):
    layer = attnx.TransformerEncoderLayer(E, H, F, 0.0, batch_first=batch_first, seed=0)
    encoder = attnx.TransformerEncoder(layer, 2, LayerNorm(E)).eval()
    dlayer = attnx.TransformerDecoderLayer(E, H, F, 0.0, batch_first=batch_first, seed=1)
    decoder = attnx.TransformerDecoder(dlayer, 2).eval()
    x = rng.standard_normal((3, 7, E)).astype(np.float32)
    memory = rng.standard_normal((3, 5, E)).astype(np.float32)
    if not batch_first:
        x, memory = x.transpose(1, 0, 2).copy(), memory.transpose(1, 0, 2).copy()
    none = np.zeros((3, 7), bool)
    plain = encoder(x)
    assert _layers.last_route() == ""
    np.testing.assert_array_equal(encoder(x, src_key_padding_mask=none), plain)
    assert _layers.last_route() == ""
    np.testing.assert_array_equal(encoder(x, src_key_padding_mask=none.astype(np.float32)), plain)
    plain = decoder(x, memory, tgt_is_causal=True, tgt_mask=causal_mask(7))
    got = decoder(x, memory, tgt_is_causal=True, tgt_mask=causal_mask(7), tgt_key_padding_mask=none,
                  memory_key_padding_mask=np.zeros((3, 5), bool))
    assert _layers.last_route() == ""
    np.testing.assert_array_equal(got, plain)


def test_full_batches_go_through_the_core_as_before(rng):
    # The stack's call of the core without padding: one transformer_layer per layer, no lengths.
    from attnx import _core

    layer = attnx.TransformerEncoderLayer(E, H, F, 0.0, batch_first=True, seed=0).eval()
    x = rng.standard_normal((3, 7, E)).astype(np.float32)
    options = _core.TransformerLayerOptions(True, False, False, 0)
    direct = _core.transformer_layer(_layers.layer_weights(layer), x, None, None, None, options)
    np.testing.assert_array_equal(layer(x), direct)


def test_padded_results_do_not_depend_on_what_is_at_the_padding(rng):
    layer = attnx.TransformerEncoderLayer(E, H, F, 0.0, batch_first=True, norm_first=True, seed=0).eval()
    encoder = attnx.TransformerEncoder(layer, 2).eval()
    pad = padding(PADDINGS["middle"], 8)
    x = rng.standard_normal((3, 8, E)).astype(np.float32)
    y = x.copy()
    y[pad] = np.nan  # never read
    np.testing.assert_array_equal(encoder(y, src_key_padding_mask=pad), encoder(x, src_key_padding_mask=pad))


def test_packed_rows_equal_each_sequence_alone_bit_for_bit_in_float64(rng):
    layer = attnx.TransformerEncoderLayer(E, H, F, 0.0, batch_first=True, seed=0, dtype=np.float64).eval()
    pad = padding(PADDINGS["middle"], 8)
    x = rng.standard_normal((3, 8, E))
    got = layer(x, src_key_padding_mask=pad, is_causal=True)
    for b in range(3):
        alone = layer(x[b, ~pad[b]][None], is_causal=True)[0]
        np.testing.assert_allclose(got[b, ~pad[b]], alone, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# bfloat16 products
# ---------------------------------------------------------------------------------------------


def test_bfloat16_within_the_documented_bounds(rng):
    from test_precision import _layer_bounds

    layer = attnx.TransformerEncoderLayer(64, 4, 128, 0.0, "gelu", batch_first=True, norm_first=True, seed=0,
                                          precision="bfloat16").eval()
    pad = padding([(40, (3, 17)), (25, ()), (33, (0,))], 40)
    src = rng.standard_normal((3, 40, 64)).astype(np.float32)
    got = layer(src, src_key_padding_mask=pad, is_causal=True)
    assert _layers.last_route() == PACKED
    _layer_bounds(got, layer, src, src_key_padding_mask=pad, is_causal=True, keep=~pad)


def test_bfloat16_decoder_stack_against_the_reference(rng):
    from test_precision import REF_BOUND

    dlayer = attnx.TransformerDecoderLayer(32, 4, 64, 0.0, batch_first=True, seed=3).eval()
    decoder = attnx.TransformerDecoder(dlayer, 2, precision="bfloat16").eval()
    tgt, memory = rng.standard_normal((2, 9, 32)).astype(np.float32), rng.standard_normal((2, 7, 32)).astype(np.float32)
    tgt_pad, memory_pad = padding([(9, (4,)), (5, ())], 9), padding([(7, ()), (4, (1,))], 7)
    got = decoder(tgt, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=memory_pad, tgt_is_causal=True)
    assert _layers.last_route() == PACKED
    assert not got[tgt_pad].any()
    params = dlayer.state_dict()
    for b in range(2):
        x, m = tgt[b, ~tgt_pad[b]][None], memory[b, ~memory_pad[b]][None]
        for _ in range(2):
            x = reference.transformer_decoder_layer(x, m, params, 4, batch_first=True, tgt_is_causal=True,
                                                    precision="bfloat16")
        assert np.abs(got[b, ~tgt_pad[b]] - x[0]).max() <= 2 * REF_BOUND["layer"]


# ---------------------------------------------------------------------------------------------
# MultiheadAttention: trailing key padding as the keys' lengths
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mha_does_not_read_trailing_padded_keys(torch, rng, kind):
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    mha = attnx.MultiheadAttention.from_torch(tm)
    q = rng.standard_normal((3, 5, E)).astype(np.float32)
    k = rng.standard_normal((3, 7, E)).astype(np.float32)
    pad = np.arange(7)[None, :] >= np.array([7, 3, 1])[:, None]
    mask = pad if kind == "bool" else np.where(pad, -np.inf, 0.0).astype(np.float32)
    got = mha(q, k, k, key_padding_mask=mask, need_weights=False)[0]
    want = run_torch(torch, lambda *a, **kw: tm(*a, **kw, need_weights=False)[0], q, k, k, key_padding_mask=mask)
    np.testing.assert_allclose(got, want, **TOL[np.float32])  # every position, padded queries none
    poisoned = k.copy()
    poisoned[pad] = np.nan  # never read: the padding is the keys' lengths
    np.testing.assert_array_equal(mha(q, poisoned, poisoned, key_padding_mask=mask, need_weights=False)[0], got)
    # With the weights asked for too: padded keys weigh 0, as torch's.
    out, weights = mha(q, poisoned, poisoned, key_padding_mask=mask)
    np.testing.assert_allclose(out, got, **TOL[np.float32])  # (the path that returns the weights)
    with torch.inference_mode():
        want_weights = tm(*(torch.from_numpy(a) for a in (q, k, k)), key_padding_mask=torch.from_numpy(mask))[1]
    np.testing.assert_allclose(weights, want_weights.numpy(), **TOL[np.float32])
    assert not weights[np.broadcast_to(pad[:, None, :], weights.shape)].any()


def test_mha_padding_in_the_middle_keeps_the_mask(torch, rng):
    tm = torch.nn.MultiheadAttention(E, H).eval()
    mha = attnx.MultiheadAttention.from_torch(tm)
    q = rng.standard_normal((5, 2, E)).astype(np.float32)
    pad = np.array([[False, True, False, False, False], [False, False, False, True, True]])
    got = mha(q, q, q, key_padding_mask=pad, need_weights=False)[0]
    want = run_torch(torch, lambda *a, **kw: tm(*a, **kw, need_weights=False)[0], q, q, q, key_padding_mask=pad)
    np.testing.assert_allclose(got, want, **TOL[np.float32])


# ---------------------------------------------------------------------------------------------
# The binding's packed rows
# ---------------------------------------------------------------------------------------------


def test_the_binding_checks_packed_rows():
    from attnx import _core

    enc = attnx.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True, seed=0).eval()
    dec = attnx.TransformerDecoderLayer(8, 2, 16, 0.0, batch_first=True, seed=0).eval()
    w, wd = _layers.layer_weights(enc), _layers.layer_weights(dec)
    options = _core.TransformerLayerOptions(True, False, False, 0)
    rows = np.ones((5, 8), np.float32)
    for lengths, match in [((np.array([2, 2]), None), "sum to 4"), ((np.array([2, 4]), None), "sum to the rows"),
                           ((np.array([-1, 6]), None), ">= 0"), ((np.array([[5]]), None), "1-D"),
                           ((np.array([5]),), "expected")]:
        with pytest.raises(ValueError, match=match):
            _core.transformer_layer(w, rows, None, None, None, options, lengths)
    with pytest.raises(ValueError, match="no masks"):
        _core.transformer_layer(w, rows, None, (None, None), None, options, (np.array([5]), None))
    with pytest.raises(ValueError, match="cross_causal"):
        _core.transformer_layer(wd, rows, np.ones((2, 3, 8), np.float32), None, None,
                                _core.TransformerLayerOptions(True, False, True, 0), (np.array([5, 0]), None))
    with pytest.raises(ValueError, match="memory lengths"):
        _core.transformer_layer(wd, rows, np.ones((4, 8), np.float32), None, None, options,
                                (np.array([5, 0]), np.array([1, 2])))
    with pytest.raises(ValueError, match="precision"):
        _core.TransformerLayerOptions(True, False, False, 3)
    # A sequence without rows, and a memory without rows: no keys to attend.
    assert _core.transformer_layer(w, rows, None, None, None, options, (np.array([5, 0]), None)).shape == (5, 8)
    out = _core.transformer_layer(wd, rows, np.ones((0, 8), np.float32), None, None, options,
                                  (np.array([5, 0]), np.array([0, 0])))
    assert out.shape == (5, 8) and np.isfinite(out).all()


def test_head_dim_is_checked_by_the_core_alone():
    from attnx import _core

    assert _core.head_dim(12, 3) == 4
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(3\)"):
        _core.head_dim(10, 3)
    with pytest.raises(ValueError, match="at least 1"):
        _core.head_dim(0, 2)
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(3\)"):
        attnx.MultiheadAttention(10, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_cross_attention_projects_the_real_keys_only(torch, rng, dtype, batch_first):
    # Keys and values of their own width (separate projections), trailing padding: the padded
    # rows are neither projected nor read (NaN there changes nothing), the results are torch's.
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    torch.manual_seed(4)
    tm = torch.nn.MultiheadAttention(E, H, kdim=12, vdim=20, batch_first=batch_first, dtype=tdtype).eval()
    mha = attnx.MultiheadAttention.from_torch(tm)
    q = rng.standard_normal((3, 9, E)).astype(dtype)
    k, v = rng.standard_normal((3, 11, 12)).astype(dtype), rng.standard_normal((3, 11, 20)).astype(dtype)
    pad = np.arange(11)[None, :] >= np.array([11, 4, 1])[:, None]
    q, k, v = (to_layout(a, batch_first) for a in (q, k, v))
    for is_causal in (False, True):
        extra = {"attn_mask": np.triu(np.ones((9, 11), bool), 1)} if is_causal else {}
        got = mha(q, k, v, key_padding_mask=pad, need_weights=False, is_causal=is_causal)[0]
        want = run_torch(torch, lambda *a, **kw: tm(*a, **kw, need_weights=False)[0], q, k, v, key_padding_mask=pad,
                         **extra)
        np.testing.assert_allclose(got, want, **TOL[dtype])
        kp, vp = k.copy(), v.copy()
        kp[pad if batch_first else pad.T] = np.nan
        vp[pad if batch_first else pad.T] = np.nan
        np.testing.assert_array_equal(mha(q, kp, vp, key_padding_mask=pad, need_weights=False, is_causal=is_causal)[0],
                                      got)
