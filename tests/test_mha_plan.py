"""MultiheadAttention's common call, through its plan (attnx._core.MhaPlan).

The plan serves plain 3-D ndarrays of the module's dtype with contiguous rows and bool flags;
for anything else it returns None and the module takes its general path. Both routes must give
the reference's result, and the plan must never be the one to turn down a call the general path
would refuse with a message.
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
def test_plan_matches_the_reference(config, dtype, need_weights, average):
    module = _module(dtype, **CONFIGS[config])
    q, k, v = _inputs(module, dtype)
    plan = module._plain_plan()
    assert isinstance(plan, _core.MhaPlan)
    result = plan(q, k, v, need_weights, average, False, False)
    assert result is not None
    out, weights = result
    expected_out, expected_weights = _expected(
        module, q, k, v, need_weights=True, average_attn_weights=average)
    assert out.dtype == dtype and out.shape == expected_out.shape
    np.testing.assert_allclose(out, expected_out, **TOL[dtype])
    if need_weights:
        np.testing.assert_allclose(weights, expected_weights, **TOL[dtype])
    else:
        assert weights is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("length", [1, 3, 8, 40])
def test_plan_causal_matches_the_module_general_path(dtype, length):
    module = _module(dtype, batch_first=True)
    x = np.random.default_rng(length).standard_normal((N, length, E)).astype(dtype)
    mask = np.triu(np.ones((length, length), bool), 1)
    out, _ = module._plain_plan()(x, x, x, False, True, True, False)
    general, _ = module(x, x, x, need_weights=False, attn_mask=mask)
    np.testing.assert_allclose(out, general, **TOL[dtype])


def _declined_inputs(q):
    """Inputs of the right values that the plan leaves to the general path."""

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
def test_plan_declines_other_inputs_and_the_module_still_answers(dtype, kind):
    module = _module(dtype)
    q, k, v = _inputs(module, dtype)
    odd = _declined_inputs(q)[kind]
    assert module._plain_plan()(odd, k, v, False, True, False, False) is None
    out, _ = module(odd, k, v, need_weights=False)
    expected, _ = _expected(module, np.asarray(odd, dtype), k, v)  # the module's dtype
    np.testing.assert_allclose(out, expected, **TOL[dtype])


@pytest.mark.parametrize("flag", [1, 0, np.True_, None, "yes"])
def test_plan_declines_flags_that_are_not_bools(flag):
    module = _module(np.float32)
    q, k, v = _inputs(module, np.float32)
    plan = module._plain_plan()
    assert plan(q, k, v, flag, True, False, False) is None
    assert plan(q, k, v, True, flag, False, False) is None


def test_plan_declines_shapes_that_do_not_match():
    module = _module(np.float32)
    q, k, v = _inputs(module, np.float32)
    plan = module._plain_plan()
    assert plan(q[..., :-1], k, v, False, True, False, False) is None  # embed dim
    assert plan(q, k[:, :1], v, False, True, False, False) is None  # batch of key
    assert plan(q, k, v[:-1], False, True, False, False) is None  # length of value
    assert plan(q[0], k[0], v[0], False, True, False, False) is None  # unbatched
    with pytest.raises(ValueError, match="key"):
        module(q, k[:, :1], v, need_weights=False)


def test_plan_rejects_inconsistent_parameters():
    w = np.zeros((E, E), np.float32)
    b = np.zeros(E, np.float32)
    args = [H, w, w, w, b, b, b, None, None, False, w, b, True]
    _core.MhaPlan(*args)
    with pytest.raises(TypeError, match="float32 or float64"):
        _core.MhaPlan(H, *(x.astype(np.float16) for x in (w, w, w)), *args[4:])
    with pytest.raises(TypeError, match="out_proj_weight"):
        _core.MhaPlan(*args[:10], w.astype(np.float64), *args[11:])
    with pytest.raises(ValueError, match="divisible"):
        _core.MhaPlan(5, *args[1:])
    with pytest.raises(ValueError, match="out_proj_weight"):
        _core.MhaPlan(*args[:10], w[:, :-1].copy(), *args[11:])
    with pytest.raises(ValueError, match="q bias"):
        _core.MhaPlan(H, w, w, w, b[:-1].copy(), *args[5:])
    with pytest.raises(ValueError, match="together"):
        _core.MhaPlan(*args[:7], b, None, *args[9:])


def test_plan_leaves_the_inputs_unchanged():
    module = _module(np.float32, batch_first=True)
    q, k, v = _inputs(module, np.float32)
    before = [x.copy() for x in (q, k, v)]
    module._plain_plan()(q, k, v, True, False, False, False)
    for x, y in zip((q, k, v), before):
        np.testing.assert_array_equal(x, y)


def _plan_and_core_mha(weights, dtype=np.float32, batch_first=True):
    """The plan's output and _core.mha's on the same parameters and inputs."""
    w_q, w_k, w_v, w_out = weights
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((N, n, w.shape[1])).astype(dtype)
               for n, w in ((L, w_q), (S, w_k), (S, w_v)))
    b = rng.standard_normal(E).astype(dtype)
    plan = _core.MhaPlan(H, w_q, w_k, w_v, b, None, b, None, None, False, w_out, b, batch_first)
    got, _ = plan(q, k, v, False, True, False, False)
    expected = np.empty((N, L, E), dtype)
    _core.mha(H, q, k, v, w_q, w_k, w_v, b, None, b, None, None, False, None, None, None, None,
              False, w_out, b, expected, None, True, False)
    return got, expected


def test_plan_reads_weights_through_their_row_strides():
    rng = np.random.default_rng(5)
    wide = rng.standard_normal((E, 2 * E)).astype(np.float32)
    sliced = wide[:, ::1][:, E // 2:E // 2 + E]  # rows 2E apart
    broadcast = np.broadcast_to(rng.standard_normal(E).astype(np.float32), (E, E))  # rows 0 apart
    square = rng.standard_normal((E, E)).astype(np.float32)
    for weights in ((sliced, square, square, square), (square, sliced, sliced, broadcast),
                    (broadcast, broadcast, square, sliced)):
        got, expected = _plan_and_core_mha(weights)
        np.testing.assert_array_equal(got, expected)
        # ... and those equal the same weights made contiguous
        contiguous, _ = _plan_and_core_mha([np.ascontiguousarray(w) for w in weights])
        np.testing.assert_allclose(got, contiguous, rtol=2e-5, atol=2e-5)


def test_plan_keeps_the_shapes_it_checked_when_the_caller_reshapes():
    rng = np.random.default_rng(6)
    w = [rng.standard_normal((E, E)).astype(np.float32) for _ in range(4)]
    b = np.zeros(E, np.float32)
    plan = _core.MhaPlan(H, *w[:3], b, b, b, None, None, False, w[3], b, True)
    q = rng.standard_normal((N, L, E)).astype(np.float32)
    before, _ = plan(q, q, q, False, True, False, False)
    # The same memory, seen another way. NumPy 2.5 deprecates assigning .shape; while it
    # still works, a caller can still do this to an array a plan holds.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        w[3].shape = (E // 2, 2 * E)
    after, _ = plan(q, q, q, False, True, False, False)
    np.testing.assert_array_equal(after, before)
    w[3][:] = 0  # values written in place are still used
    zeroed, _ = plan(q, q, q, False, True, False, False)
    np.testing.assert_array_equal(zeroed, np.zeros_like(zeroed))
