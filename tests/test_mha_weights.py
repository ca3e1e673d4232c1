"""Multi-head attention's one route: checked parameters (attnx._core.MhaWeights) and _core.mha.

Inputs already canonical (plain 3-D ndarrays of the parameters' dtype with contiguous rows, no
masks) run as they are; anything else goes through the Python rules (attnx._canonical.mha_call)
first. Both must give the reference's result, the same bits for the same values, and every
refusal comes with the rules' message.
"""

import warnings

import numpy as np
import pytest

import attnx
from attnx import _core, reference

E, H, N, L, S = 24, 3, 2, 5, 7
TOL = {np.float32: {"rtol": 2e-5, "atol": 2e-5}, np.float64: {"rtol": 1e-12, "atol": 1e-12}}


def _module(dtype, **kwargs):
    return attnx.MultiheadAttention(E, H, dtype=dtype, seed=1, **kwargs)


def _inputs(module, dtype, seed=0, length=L):
    rng = np.random.default_rng(seed)

    def draw(n, dim):
        shape = (N, n, dim) if module.batch_first else (n, N, dim)
        return rng.standard_normal(shape).astype(dtype)

    return draw(length, E), draw(S, module.kdim), draw(S, module.vdim)


def _expected(module, q, k, v, **kwargs):
    return reference.multi_head_attention_forward(
        q, k, v, module.embed_dim, module.num_heads,
        module.in_proj_weight, module.in_proj_bias, module.bias_k, module.bias_v,
        module.add_zero_attn, 0.0, module.out_proj_weight, module.out_proj_bias,
        training=False, use_separate_proj_weight=module.in_proj_weight is None,
        q_proj_weight=module.q_proj_weight, k_proj_weight=module.k_proj_weight,
        v_proj_weight=module.v_proj_weight, batch_first=module.batch_first, **kwargs,
    )


CONFIGS = {
    "packed": {},
    "batch_first": {"batch_first": True},
    "separate": {"kdim": 5, "vdim": 9},
    "bias_kv_zero_attn": {"add_bias_kv": True, "add_zero_attn": True},
    "no_bias": {"bias": False},
}


def _weights(module):
    return module._weights()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
def test_canonical_inputs_match_the_reference(config, dtype, need_weights, average):
    module = _module(dtype, **CONFIGS[config])
    q, k, v = _inputs(module, dtype)
    options = _core.MhaOptions(False, False, need_weights, average, module.batch_first)
    out, weights = _core.mha(_weights(module), q, k, v, None, options)
    expected_out, expected_weights = _expected(module, q, k, v, need_weights=True, average_attn_weights=average)
    assert out.dtype == dtype and out.shape == expected_out.shape
    np.testing.assert_allclose(out, expected_out, **TOL[dtype])
    if need_weights:
        np.testing.assert_allclose(weights, expected_weights, **TOL[dtype])
    else:
        assert weights is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("length", [1, 3, 8, 40])
def test_causal_matches_an_explicit_mask(dtype, length):
    module = _module(dtype, batch_first=True)
    x = np.random.default_rng(length).standard_normal((N, length, E)).astype(dtype)
    mask = np.triu(np.ones((length, length), bool), 1)
    out, _ = module(x, x, x, need_weights=False, is_causal=True)
    general, _ = module(x, x, x, need_weights=False, attn_mask=mask)
    np.testing.assert_allclose(out, general, **TOL[dtype])


def _converted_inputs(q):
    """Inputs of the right values that are not canonical: they go through the Python rules."""

    class Sub(np.ndarray):
        pass

    strided = np.repeat(q, 2, axis=-1)[..., ::2]  # rows not contiguous
    assert np.array_equal(strided, q)
    return {
        "subclass": q.view(Sub),
        "other_dtype": q.astype(np.float64 if q.dtype == np.float32 else np.float32),
        "strided_rows": strided,
        "list": q.tolist(),
    }


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["subclass", "other_dtype", "strided_rows", "list"])
def test_converted_inputs_give_the_bits_of_canonical_ones(dtype, kind):
    module = _module(dtype)
    q, k, v = _inputs(module, dtype)
    odd = _converted_inputs(q)[kind]
    out, _ = module(odd, k, v, need_weights=False)
    canonical, _ = module(np.asarray(odd, dtype), k, v, need_weights=False)  # the module's dtype
    np.testing.assert_array_equal(out, canonical)


@pytest.mark.parametrize("flag", [1, 0, None, "yes"])
def test_flags_that_are_not_bools_are_refused(flag):
    module = _module(np.float32)
    q, k, v = _inputs(module, np.float32)
    with pytest.raises(TypeError, match="need_weights"):
        module(q, k, v, need_weights=flag)
    with pytest.raises(TypeError, match="average_attn_weights"):
        module(q, k, v, average_attn_weights=flag)


def test_shapes_that_do_not_match_are_explained():
    module = _module(np.float32)
    q, k, v = _inputs(module, np.float32)
    with pytest.raises(ValueError, match="embed_dim"):
        module(q[..., :-1], k, v)
    with pytest.raises(ValueError, match="key"):
        module(q, k[:, :1], v, need_weights=False)
    with pytest.raises(ValueError, match="same length"):
        module(q, k, v[:-1])
    out, _ = module(q[:, 0], k[:, 0], v[:, 0])  # unbatched
    batched, _ = module(q[:, :1], k[:, :1], v[:, :1])
    np.testing.assert_array_equal(out, batched[:, 0])


def test_weights_reject_inconsistent_parameters():
    w = np.zeros((E, E), np.float32)
    b = np.zeros(E, np.float32)
    f32 = np.dtype(np.float32)
    _core.MhaWeights(H, (w, w, w), (b, b, b), (w, b), None, False, f32)
    with pytest.raises(TypeError, match="q_proj_weight"):
        _core.MhaWeights(H, tuple(x.astype(np.float16) for x in (w, w, w)), None, (w, b), None, False, f32)
    with pytest.raises(TypeError, match="out_proj_weight"):
        _core.MhaWeights(H, (w, w, w), None, (w.astype(np.float64), b), None, False, f32)
    with pytest.raises(ValueError, match="divisible"):
        _core.MhaWeights(5, (w, w, w), None, (w, b), None, False, f32)
    with pytest.raises(ValueError, match="out_proj_weight"):
        _core.MhaWeights(H, (w, w, w), None, (w[:, :-1].copy(), b), None, False, f32)
    with pytest.raises(ValueError, match="q bias"):
        _core.MhaWeights(H, (w, w, w), (b[:-1].copy(), b, b), (w, b), None, False, f32)
    with pytest.raises(ValueError, match="together"):
        _core.MhaWeights(H, (w, w, w), None, (w, b), (b, None), False, f32)
    with pytest.raises(TypeError, match="k_proj_weight"):
        _core.MhaWeights(H, (w, None, w), None, (w, b), None, False, f32)


def test_a_call_leaves_the_inputs_unchanged():
    module = _module(np.float32, batch_first=True)
    q, k, v = _inputs(module, np.float32)
    before = [x.copy() for x in (q, k, v)]
    module(q, k, v, average_attn_weights=False)
    for x, y in zip((q, k, v), before):
        np.testing.assert_array_equal(x, y)


def _outputs(weights, dtype=np.float32):
    """The output of weights (w_q, w_k, w_v, w_out) as given, on fixed inputs."""
    w_q, w_k, w_v, w_out = weights
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((N, n, w.shape[1])).astype(dtype) for n, w in ((L, w_q), (S, w_k), (S, w_v)))
    b = rng.standard_normal(E).astype(dtype)
    params = _core.MhaWeights(H, (w_q, w_k, w_v), (b, None, b), (w_out, b), None, False, np.dtype(dtype))
    out, _ = _core.mha(params, q, k, v, None, _core.MhaOptions(False, False, False, True, True))
    return out


def test_weights_are_read_through_their_row_strides():
    rng = np.random.default_rng(5)
    wide = rng.standard_normal((E, 2 * E)).astype(np.float32)
    sliced = wide[:, ::1][:, E // 2:E // 2 + E]  # rows 2E apart
    broadcast = np.broadcast_to(rng.standard_normal(E).astype(np.float32), (E, E))  # rows 0 apart
    square = rng.standard_normal((E, E)).astype(np.float32)
    for weights in ((sliced, square, square, square), (square, sliced, sliced, broadcast),
                    (broadcast, broadcast, square, sliced)):
        got = _outputs(weights)
        contiguous = _outputs([np.ascontiguousarray(w) for w in weights])
        np.testing.assert_allclose(got, contiguous, rtol=2e-5, atol=2e-5)


def test_weights_keep_the_shapes_they_checked_when_the_caller_reshapes():
    rng = np.random.default_rng(6)
    w = [rng.standard_normal((E, E)).astype(np.float32) for _ in range(4)]
    b = np.zeros(E, np.float32)
    params = _core.MhaWeights(H, tuple(w[:3]), (b, b, b), (w[3], b), None, False, np.dtype(np.float32))
    q = rng.standard_normal((N, L, E)).astype(np.float32)
    options = _core.MhaOptions(False, False, False, True, True)
    before, _ = _core.mha(params, q, q, q, None, options)
    # The same memory, seen another way. NumPy 2.5 deprecates assigning .shape; while it
    # still works, a caller can still do this to an array the weights hold.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        w[3].shape = (E // 2, 2 * E)
    after, _ = _core.mha(params, q, q, q, None, options)
    np.testing.assert_array_equal(after, before)
    w[3][:] = 0  # values written in place are still used
    zeroed, _ = _core.mha(params, q, q, q, None, options)
    np.testing.assert_array_equal(zeroed, np.zeros_like(zeroed))
