"""The core of transformer layers: the activation kernels on every kernel, and the properties of
the one-call layer that torch cannot check (thread counts, in-place parameters, failed steps).

The layers' agreement with torch is tests/test_transformer.py's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import attnx
from attnx import _testing
from conftest import run_under_isa, usable_isas

# Where GELU is well conditioned (x >= -3: Phi(x) changes by less than |x| times its
# argument's relative change), the kernels stay within a few units in the last place of
# x Phi(x) (the SIMD kernels 7, the C library's erfcf of the portable one 10); below, any float computation loses ~x^2 / 2 units to the rounding of x^2, and the
# bound is on the error relative to max(1, |x|) (docs/tuning.md: the fit and its error).
GELU_ULPS_WELL_CONDITIONED = 12.0
GELU_ABS_ERROR = 2e-7


def gelu_points() -> np.ndarray:
    ramp = np.linspace(-14, 14, 56001)
    tiny = np.logspace(-30, 1.2, 4000)
    return np.concatenate([ramp, tiny, -tiny]).astype(np.float32)


def gelu_exact(x: np.ndarray) -> np.ndarray:
    """x Phi(x) in float64, by erfc (accurate where Phi is tiny)."""
    return np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])


def gelu_errors(x: np.ndarray, got: np.ndarray) -> dict:
    want = gelu_exact(x)
    diff = np.abs(got.astype(np.float64) - want)
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    well = x >= -3
    return {
        "ulps": float((diff[well] / ulp[well]).max()),
        "abs": float((diff / np.maximum(1.0, np.abs(x.astype(np.float64)))).max()),
    }


SPECIALS = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3e38, -3e38, 1e-40], np.float32)


def test_gelu_accuracy_on_the_active_kernel():
    x = gelu_points()
    errors = gelu_errors(x, _testing.activate(x[None], "gelu")[0])
    assert errors["ulps"] <= GELU_ULPS_WELL_CONDITIONED, errors
    assert errors["abs"] <= GELU_ABS_ERROR, errors


def test_gelu_float64_uses_the_accurate_erfc():
    x = np.linspace(-12, 12, 4001)
    got = _testing.activate(x[None], "gelu")[0]
    want = gelu_exact(x)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-300)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activation_specials(dtype):
    x = SPECIALS.astype(dtype)[None]
    gelu = _testing.activate(x, "gelu")[0]
    relu = _testing.activate(x, "relu")[0]
    # +inf stays +inf, -inf gives NaN (as 0.5 x (1 + erf(x / sqrt 2)): an infinity is not
    # zeroed), huge negatives go to their limit 0, NaN stays NaN.
    assert gelu[0] == np.inf and np.isnan(gelu[1]) and np.isnan(gelu[2])
    assert gelu[3] == 0 and gelu[4] == 0 and gelu[5] == x[0, 5] and gelu[6] == 0
    assert relu[0] == np.inf and relu[1] == 0 and np.isnan(relu[2]) and relu[5] == x[0, 5] and relu[6] == 0
    # Any row length: the tail of a row goes through a partial vector.
    for n in (1, 7, 17, 33):
        row = np.linspace(-4, 4, n).astype(dtype)[None]
        np.testing.assert_allclose(_testing.activate(row, "gelu")[0], gelu_exact(row[0]), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(_testing.activate(row, "relu")[0], np.maximum(row[0], 0))


def test_activate_rejects_bad_input():
    with pytest.raises(ValueError, match="kind must be"):
        _testing.activate(np.zeros((1, 4), np.float32), "tanh")
    with pytest.raises(TypeError, match="float32 or float64"):
        _testing.activate(np.zeros((1, 4), np.int32), "relu")


KERNEL_SWEEP = """
import json, math, sys
import numpy as np
import attnx
from attnx import _testing
sys.path.insert(0, sys.argv[1])
import test_transformer_core as t
x = t.gelu_points()
errors = t.gelu_errors(x, _testing.activate(x[None], "gelu")[0])
specials = _testing.activate(t.SPECIALS[None], "gelu")[0]
print(json.dumps({"isa": attnx.show_config()["isa"], **errors,
                  "specials": [None if math.isnan(v) else float(v) for v in specials]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa", usable_isas())
def test_gelu_on_every_kernel(isa, request):
    result = run_under_isa(isa, KERNEL_SWEEP, str(request.path.parent))
    assert result["ulps"] <= GELU_ULPS_WELL_CONDITIONED, result
    assert result["abs"] <= GELU_ABS_ERROR, result
    assert result["specials"][0] == math.inf and result["specials"][1:3] == [None, None], result


# ---------------------------------------------------------------------------------------------
# The one-call layer
# ---------------------------------------------------------------------------------------------

D_MODEL, NHEAD, DIM_FF = 32, 4, 48


def encoder_layer(seed=0, **kw):
    kw = {"dropout": 0.0, "batch_first": True, **kw}
    return attnx.TransformerEncoderLayer(D_MODEL, NHEAD, DIM_FF, seed=seed, **kw).eval()


def decoder(num_layers=3, seed=0, **kw):
    kw = {"dropout": 0.0, "batch_first": True, **kw}
    layer = attnx.TransformerDecoderLayer(D_MODEL, NHEAD, DIM_FF, seed=seed, **kw)
    norm = attnx.Transformer(D_MODEL, NHEAD, 1, 1, DIM_FF, 0.0, seed=seed).decoder.norm
    return attnx.TransformerDecoder(layer, num_layers, norm=norm).eval()


def inputs(rng, N=3, L=9, S=7, dtype=np.float32):
    x = rng.standard_normal((N, L, D_MODEL)).astype(dtype)
    memory = rng.standard_normal((N, S, D_MODEL)).astype(dtype)
    return x, memory


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_layers_do_not_depend_on_the_thread_count(rng, norm_first, activation):
    enc = encoder_layer(norm_first=norm_first, activation=activation)
    dec = decoder(norm_first=norm_first, activation=activation)
    # Enough rows for the packed products and the threads to share them out.
    x, memory = inputs(rng, N=4, L=80, S=40)
    padding = np.zeros((4, 80), bool)
    padding[1, 50:] = True
    mask = attnx.Transformer.generate_square_subsequent_mask(80)
    before = attnx.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            attnx.set_num_threads(threads)
            results.append((enc(x, src_key_padding_mask=padding), dec(x, memory, tgt_mask=mask)))
    finally:
        attnx.set_num_threads(before)
    for got in results[1:]:
        np.testing.assert_array_equal(got[0], results[0][0])
        np.testing.assert_array_equal(got[1], results[0][1])


def test_parameters_changed_in_place_or_assigned_are_seen(rng):
    layer = encoder_layer()
    x, _ = inputs(rng)
    first = layer(x)
    layer.linear1.weight *= 2  # in place: the core shares the array
    doubled = layer(x)
    assert not np.array_equal(doubled, first)
    twin = encoder_layer()
    twin.linear1.weight = twin.linear1.weight * 2  # a new array: the core takes it
    np.testing.assert_array_equal(twin(x), doubled)
    twin.norm2.bias = twin.norm2.bias + 1
    np.testing.assert_allclose(twin(x), doubled + 1, rtol=1e-5, atol=1e-5)


def test_a_callable_activation(rng):
    layer = encoder_layer(activation=np.tanh)
    x, _ = inputs(rng)
    expected = attnx.reference.transformer_encoder_layer(
        x.astype(np.float64), layer.state_dict(), NHEAD, activation=np.tanh, batch_first=True
    )
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=2e-5)
    layer.activation = lambda h: h[:, :3]
    with pytest.raises(ValueError, match="activation: the callable must return an array of the shape"):
        layer(x)

    def failing(h):
        raise RuntimeError("no activation today")

    layer.activation = failing
    with pytest.raises(RuntimeError, match="no activation today"):
        layer(x)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_step_equals_the_causal_forward(rng, norm_first, dtype):
    dec = decoder(norm_first=norm_first, dtype=dtype)
    x, memory = inputs(rng, dtype=dtype)
    memory_padding = np.zeros((3, 7), bool)
    memory_padding[2, 4:] = True
    mask = attnx.Transformer.generate_square_subsequent_mask(9)
    full = dec(x, memory, tgt_mask=mask, memory_key_padding_mask=memory_padding)
    cache = dec.new_cache(3, 16, dtype=dtype)
    parts, pos = [], 0
    for tokens in (4, 1, 1, 3):
        parts.append(dec.step(x[:, pos:pos + tokens], memory, cache, memory_key_padding_mask=memory_padding))
        pos += tokens
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=tol, atol=tol)
    np.testing.assert_array_equal(cache.lengths, [9, 9, 9])


def test_a_new_memory_is_projected_anew(rng):
    dec = decoder()
    x, memory = inputs(rng)
    other = memory + 1
    cache = dec.new_cache(3, 16)
    dec.step(x[:, :2], memory, cache)
    got = dec.step(x[:, 2:3], other, cache)
    # The cache holds the first two tokens' keys, made with the first memory in layers > 0.
    reference_cache = dec.new_cache(3, 16)
    dec.step(x[:, :2], memory, reference_cache)
    reference_cache._memory = None  # (the kept projections dropped: projected anew)
    np.testing.assert_array_equal(got, dec.step(x[:, 2:3], other, reference_cache))
    memory[...] = other  # the same array, new values: projected anew too
    np.testing.assert_array_equal(dec.step(x[:, 3:4], memory, cache), dec.step(x[:, 3:4], other, reference_cache))


def test_a_failed_step_leaves_every_layer_as_it_was(rng):
    calls = {"count": 0, "fail_at": None}

    def fails_when_told(h):
        calls["count"] += 1
        if calls["count"] == calls["fail_at"]:
            raise MemoryError("injected")
        return np.maximum(h, 0)

    dec = decoder(activation=fails_when_told)
    x, memory = inputs(rng)
    cache = dec.new_cache(3, 16)
    dec.step(x[:, :2], memory, cache)
    calls.update(count=0, fail_at=2)  # the second layer's feed-forward block
    with pytest.raises(MemoryError, match="injected"):
        dec.step(x[:, 2:3], memory, cache)
    assert [list(c.lengths) for c in cache.layers] == [[2, 2, 2]] * 3
    calls["fail_at"] = None
    # Too long a step for the cache: nothing appended anywhere.
    with pytest.raises(ValueError, match="max_len"):
        dec.step(np.repeat(x, 2, axis=1), memory, cache)
    assert [list(c.lengths) for c in cache.layers] == [[2, 2, 2]] * 3
    relu = decoder()
    expected = relu(x[:, :3], memory, tgt_mask=attnx.Transformer.generate_square_subsequent_mask(3))
    np.testing.assert_allclose(dec.step(x[:, 2:3], memory, cache), expected[:, 2:3], rtol=2e-5, atol=2e-5)
