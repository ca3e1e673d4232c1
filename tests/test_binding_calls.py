"""The Python layer calls the compiled core with positional arguments only.

Given any keyword, pybind11 makes and interns a string for each parameter name of the call
(one per parameter) and frees them again: time spent on every call, and churn in the
interpreter's table of interned strings, which then grows by megabytes at some later call
(the leak checks saw 1.9 MB appear after 20 000 calls of multi_head_attention_forward).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import _canonical, _core, functional, modules


class _PositionalOnly:
    """Stands in for a callable of _core; records the names of keywords it is given."""

    def __init__(self, target, name, seen):
        self._target, self._name, self._seen = target, name, seen

    def __call__(self, *args, **kwargs):
        if kwargs:
            self._seen.append((self._name, sorted(kwargs)))
        return self._target(*args, **kwargs)


class _CoreProxy:
    def __init__(self, seen):
        self._seen = seen

    def __getattr__(self, name):
        target = getattr(_core, name)
        return _PositionalOnly(target, name, self._seen) if callable(target) else target


@pytest.fixture
def keyword_calls(monkeypatch):
    seen: list = []
    for module in (functional, modules, _canonical):
        monkeypatch.setattr(module, "_core", _CoreProxy(seen))
    return seen


rng = np.random.default_rng(7)
f32 = np.float32


def _qkv(L=5, S=7, E=8):
    return (rng.standard_normal((2, 3, L, E)).astype(f32), rng.standard_normal((2, 3, S, E)).astype(f32),
            rng.standard_normal((2, 3, S, E)).astype(f32))


def _sdpa_calls():
    q, k, v = _qkv()
    mask = rng.random((5, 7)) < 0.8
    attnx.scaled_dot_product_attention(q, k, v)
    attnx.scaled_dot_product_attention(q, k, v, mask, scale=0.4, out=np.empty((2, 3, 5, 8), f32))
    attnx.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", window=(2, 1))
    attnx.scaled_dot_product_attention(q, k.astype(np.float16), v.astype(np.float16), is_causal=True)


def _cache_calls():
    q, k, v = _qkv(L=2, S=2)
    cache = attnx.KVCache(2, 3, 6, 8)
    attnx.cached_attention(q, cache, k, v)
    attnx.cached_attention(q[:, :, :1], cache, k[:, :, :1], v[:, :, :1], window=(2, 0))


def _mha_calls():
    x = rng.standard_normal((5, 2, 8)).astype(f32)
    module = attnx.MultiheadAttention(8, 2, seed=0)
    kpm = rng.random((2, 5)) < 0.3
    module(x, x, x)
    module(x, x, x, need_weights=False, attn_mask=np.triu(np.ones((5, 5), bool), 1), is_causal=True)
    module(x, x, x, key_padding_mask=kpm, average_attn_weights=False)
    state = module.state_dict()
    attnx.multi_head_attention_forward(
        x, x, x, 8, 2, state["in_proj_weight"], state["in_proj_bias"], None, None, False, 0.0,
        state["out_proj.weight"], state["out_proj.bias"], key_padding_mask=kpm, training=False)
    cache = module.new_cache(2, 8)
    module.step(x[:3], cache)
    module.step(x[3:4], cache)


@pytest.mark.parametrize("calls", [_sdpa_calls, _cache_calls, _mha_calls], ids=["sdpa", "cache", "mha"])
def test_the_core_is_called_without_keywords(keyword_calls, calls):
    calls()
    assert keyword_calls == []


def test_the_proxy_sees_a_keyword(keyword_calls):
    # The check above could fail: a keyword call through the stand-in is recorded.
    q, k, v = _qkv()
    options = _canonical.sdpa_options(False, None, False, None)
    functional._core.sdpa(q, k, v, None, options, out=None)
    assert keyword_calls == [("sdpa", ["out"])]
