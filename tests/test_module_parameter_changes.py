"""MultiheadAttention uses its parameters as they are at each call.

The module keeps checked views of its parameters between calls (so that a small call does not
check and slice them again). These tests change the parameters after a call -- in place,
by assigning new arrays (of the module's dtype or another), through load_state_dict, and in
a pickled or deep-copied clone -- and compare the next call with attnx.reference computed
from the parameters as they are then.
"""

import copy
import pickle

import numpy as np
import pytest

import attnx
from attnx import reference

E, H, N, L, S = 16, 4, 2, 5, 7
TOL = {np.float32: {"rtol": 2e-5, "atol": 2e-5}, np.float64: {"rtol": 1e-12, "atol": 1e-12}}
CONFIGS = {
    "packed": {},
    "packed_batch_first": {"batch_first": True},
    "separate": {"kdim": 5, "vdim": 6},
    "bias_kv_no_bias": {"add_bias_kv": True, "bias": False},
}


def _inputs(module, dtype, seed=0):
    rng = np.random.default_rng(seed)

    def draw(length, dim):
        shape = (N, length, dim) if module.batch_first else (length, N, dim)
        return rng.standard_normal(shape).astype(dtype)

    return draw(L, E), draw(S, module.kdim), draw(S, module.vdim)


def _expected(module, q, k, v):
    """The reference output for the module's parameters as they are now."""
    separate = module.in_proj_weight is None
    out, weights = reference.multi_head_attention_forward(
        q, k, v, module.embed_dim, module.num_heads,
        module.in_proj_weight, module.in_proj_bias, module.bias_k, module.bias_v,
        module.add_zero_attn, 0.0, module.out_proj_weight, module.out_proj_bias,
        training=False, need_weights=True, use_separate_proj_weight=separate,
        q_proj_weight=module.q_proj_weight, k_proj_weight=module.k_proj_weight,
        v_proj_weight=module.v_proj_weight, batch_first=module.batch_first,
    )
    return out, weights


def _check(module, q, k, v):
    dtype = module.dtype.type
    expected_out, expected_weights = _expected(module, q, k, v)
    out, weights = module(q, k, v)
    np.testing.assert_allclose(out, expected_out, **TOL[dtype])
    np.testing.assert_allclose(weights, expected_weights, **TOL[dtype])
    plain, none = module(q, k, v, need_weights=False)
    assert none is None
    np.testing.assert_allclose(plain, expected_out, **TOL[dtype])


def _first_projection(module):
    return module.in_proj_weight if module.in_proj_weight is not None else module.q_proj_weight


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_values_written_in_place_are_used(name, dtype):
    module = attnx.MultiheadAttention(E, H, dtype=dtype, seed=1, **CONFIGS[name])
    q, k, v = _inputs(module, dtype)
    before, _ = module(q, k, v, need_weights=False)
    _first_projection(module)[...] *= -0.5
    module.out_proj_weight[:, : E // 2] = 0
    if module.out_proj_bias is not None:
        module.out_proj_bias += 1
    if module.bias_k is not None:
        module.bias_k[...] = 3
    after, _ = module(q, k, v, need_weights=False)
    assert not np.allclose(before, after)
    _check(module, q, k, v)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_assigned_arrays_are_used(name):
    dtype = np.float32
    module = attnx.MultiheadAttention(E, H, dtype=dtype, seed=2, **CONFIGS[name])
    q, k, v = _inputs(module, dtype)
    module(q, k, v)
    rng = np.random.default_rng(3)
    module.out_proj_weight = rng.standard_normal((E, E)).astype(dtype)
    _check(module, q, k, v)
    # An array of another dtype, or not contiguous: the general path converts it.
    module.out_proj_weight = np.asfortranarray(rng.standard_normal((E, E)))
    _check(module, q, k, v)
    if module.in_proj_weight is not None:
        module.in_proj_weight = rng.standard_normal((3 * E, E)).astype(dtype)
    else:
        module.k_proj_weight = rng.standard_normal((E, module.kdim)).astype(dtype)
    _check(module, q, k, v)


def test_load_state_dict_after_a_call_is_used():
    module = attnx.MultiheadAttention(E, H, seed=4)
    q, k, v = _inputs(module, np.float32)
    module(q, k, v)
    other = attnx.MultiheadAttention(E, H, seed=5)
    module.load_state_dict(other.state_dict())
    np.testing.assert_array_equal(module(q, k, v)[0], other(q, k, v)[0])
    _check(module, q, k, v)


@pytest.mark.parametrize("clone", [lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy, copy.copy])
def test_clones_made_after_a_call_use_their_own_parameters(clone):
    module = attnx.MultiheadAttention(E, H, seed=6)
    q, k, v = _inputs(module, np.float32)
    original, _ = module(q, k, v)
    twin = clone(module)
    if twin.in_proj_weight is module.in_proj_weight:  # copy.copy shares the arrays
        twin.in_proj_weight = module.in_proj_weight.copy()
    twin.in_proj_weight[...] *= 2
    _check(twin, q, k, v)
    # The original is unchanged by what was done to the clone.
    np.testing.assert_array_equal(module(q, k, v)[0], original)
    _check(module, q, k, v)
