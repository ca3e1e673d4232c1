"""Leaks: the resident set size stays flat over many calls of every entry point.

Each entry point -- on its success path and on paths that raise (bad shapes, bad dtypes,
bad flags) -- is called N times with small shapes after a warm-up; the RSS after the calls
may exceed the RSS before them by at most a small allowance. Hypothesis' profile ``thorough``
(``--hypothesis-profile=thorough``, as ``.ci/harden`` runs it) makes N 100 000, where the 2 MiB
allowance is 21 bytes a call: leaking one result array, one Python object or one C++ buffer
per call is caught. The default run makes N 4 000 (then 2 MiB is 524 bytes a call: a leaked
result array is still caught). RSS before and after is recorded for every entry point.
Because the RSS misses a leak fed from memory the allocator already holds, malloc's count of
bytes in use (glibc mallinfo2) and Python's count of live blocks must stay flat too.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import attnx
from conftest import core_mha, core_sdpa
from _hardening import malloc_in_use_bytes, record, rss_bytes, scaled, under_address_sanitizer
from attnx import _core

# ASan replaces the allocator: freed memory waits in its quarantine (hundreds of MiB) before
# reuse and mallinfo2 reports nothing, so neither the RSS nor malloc's count says anything
# about leaks there. The release builds are checked on every run of the suite.
pytestmark = [
    pytest.mark.hardening,
    pytest.mark.skipif(under_address_sanitizer(),
                       reason="leak measurements are meaningless under ASan's allocator"),
]

CALLS = scaled(4_000, 100_000)
ALLOWANCE = 2 * 1024 * 1024

rng = np.random.default_rng(0)
f32 = np.float32
Q = rng.standard_normal((1, 2, 4, 8)).astype(f32)
K = rng.standard_normal((1, 2, 6, 8)).astype(f32)
V = rng.standard_normal((1, 2, 6, 8)).astype(f32)
MASK = rng.random((4, 6)) < 0.7
FMASK = np.where(MASK, 0.0, -np.inf).astype(f32)
OUT = np.empty((1, 2, 4, 8), f32)
WEIGHTS = np.empty((1, 2, 4, 6), f32)
X = rng.standard_normal((5, 2, 8)).astype(f32)
MODULE = attnx.MultiheadAttention(8, 2, add_bias_kv=True, seed=0)
STATE = attnx.MultiheadAttention(8, 2, add_bias_kv=True, seed=1).state_dict()
BAD_STATE = {**STATE, "out_proj.weight": np.zeros((3, 3), f32)}
W = rng.standard_normal((3 * 8, 8)).astype(f32) / 3
WO = rng.standard_normal((8, 8)).astype(f32) / 3
B = rng.standard_normal(3 * 8).astype(f32)
XC = np.ascontiguousarray(X.transpose(1, 0, 2))  # (N, L, E) for _core.mha
MHA_OUT = np.empty((2, 5, 8), f32)
MHA_W = np.empty((2, 5, 6), f32)  # S + the zero-attention key
KPM = rng.random((2, 5)) < 0.3


def mha(**over):
    kw = dict(embed_dim_to_check=8, num_heads=2, in_proj_weight=W, in_proj_bias=B, bias_k=None,
              bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=WO, out_proj_bias=None,
              key_padding_mask=KPM, training=False)
    kw.update(over)
    return attnx.multi_head_attention_forward(X, X, X, **kw)


def _core_mha(out=MHA_OUT, num_heads=2):
    core_mha(num_heads, XC, XC, XC, W[:8], W[8:16], W[16:], B[:8], B[8:16], B[16:], None, None, True,
              None, None, None, None, True, WO, None, out, MHA_W, True)


def _load():
    MODULE.load_state_dict(STATE)


K16, V16 = K.astype(np.float16), V.astype(np.float16)
CACHE = attnx.KVCache(1, 2, 6, 8, np.float16)
FULL_CACHE = attnx.KVCache(1, 2, 6, 8)
FULL_CACHE.append(K, V)
STEP_MODULE = attnx.MultiheadAttention(8, 2, seed=2)
STEP_CACHE = STEP_MODULE.new_cache(2, 8)
LINEAR_OUT = np.empty((5, 24), f32)


def _cached_attention():
    CACHE.reset()
    attnx.cached_attention(Q, CACHE, K[:, :, :4], V[:, :, :4], lengths=np.array([3]))


def _step():
    STEP_CACHE.reset()
    STEP_MODULE.step(X[:3], STEP_CACHE)
    STEP_MODULE.step(X[3:4], STEP_CACHE)


# name -> (call, exception it must raise or None)
ENTRIES = {
    "sdpa plain": (lambda: attnx.scaled_dot_product_attention(Q, K, V), None),
    "sdpa bool mask + out=": (lambda: attnx.scaled_dot_product_attention(Q, K, V, MASK, out=OUT), None),
    "sdpa float mask + scale": (lambda: attnx.scaled_dot_product_attention(Q, K, V, FMASK, scale=0.3), None),
    "sdpa raises (shapes)": (lambda: attnx.scaled_dot_product_attention(Q, K[..., :5], V), ValueError),
    "sdpa raises (dtype)": (lambda: attnx.scaled_dot_product_attention(Q.astype(np.int32), K, V), TypeError),
    "sdpa raises (mask dtype)": (lambda: attnx.scaled_dot_product_attention(Q, K, V, MASK.astype(np.int8)), TypeError),
    "mha with weights": (lambda: mha(), None),
    "mha no weights, causal": (lambda: mha(need_weights=False, is_causal=True), None),
    "mha raises (embed_dim)": (lambda: mha(embed_dim_to_check=9), ValueError),
    "mha raises (dropout)": (lambda: mha(dropout_p=0.5, training=True), NotImplementedError),
    "module forward": (lambda: MODULE(X, X, X), None),
    "module forward, masks": (lambda: MODULE(X, X, X, key_padding_mask=KPM, average_attn_weights=False), None),
    "module raises (shape)": (lambda: MODULE(X[..., :5], X, X), ValueError),
    "load_state_dict": (_load, None),
    "load_state_dict raises": (lambda: MODULE.load_state_dict(BAD_STATE), ValueError),
    "set/get_num_threads": (lambda: attnx.set_num_threads(attnx.get_num_threads()), None),
    "set_num_threads raises": (lambda: attnx.set_num_threads(0), ValueError),
    "_core.sdpa": (lambda: core_sdpa(Q, K, V, None, True, 0.5, OUT, WEIGHTS), None),
    "_core.sdpa raises": (lambda: core_sdpa(Q, K, V, None, False, 0.5, WEIGHTS, None), ValueError),
    "sdpa, canonical inputs": (lambda: attnx.scaled_dot_product_attention(Q, K, V), None),
    "_core.mha": (_core_mha, None),
    "_core.mha raises": (lambda: _core_mha(num_heads=3), ValueError),
    "sdpa bottom-right, window": (
        lambda: attnx.scaled_dot_product_attention(Q, K, V, is_causal="bottom_right", window=(2, 0)), None),
    "sdpa float16 keys/values": (lambda: attnx.scaled_dot_product_attention(Q, K16, V16), None),
    "sdpa raises (window)": (lambda: attnx.scaled_dot_product_attention(Q, K, V, window=(-1, 0)), ValueError),
    "cached_attention, append": (_cached_attention, None),
    "cached_attention raises (full)": (lambda: attnx.cached_attention(Q, FULL_CACHE, K[:, :, :1], V[:, :, :1]),
                                       ValueError),
    "module step": (_step, None),
    "_core.linear": (lambda: _core.linear(X[0], W, B, LINEAR_OUT[:2]), None),
}


@pytest.mark.parametrize("name", list(ENTRIES))
def test_rss_stays_flat(threads, name):
    call, exc = ENTRIES[name]
    attnx.set_num_threads(2)

    def run(n):
        if exc is None:
            for _ in range(n):
                call()
        else:
            for _ in range(n):
                try:
                    call()
                except exc:
                    pass
                else:
                    raise AssertionError(f"{name}: did not raise {exc.__name__}")

    def measure():
        gc.collect()
        before, heap_before, blocks_before = rss_bytes(), malloc_in_use_bytes(), sys.getallocatedblocks()
        run(CALLS)
        gc.collect()
        return before, heap_before, blocks_before, rss_bytes(), malloc_in_use_bytes(), sys.getallocatedblocks()

    run(max(CALLS // 10, 500))  # warm up: caches, scratch, allocator pools
    blocks_bound = max(CALLS // 100, 200)
    before, heap_before, blocks_before, after, heap_after, blocks_after = measure()
    if blocks_after - blocks_before >= blocks_bound:
        # Python's count of blocks is the process's: in a pytest-xdist worker, another thread
        # receives the controller's messages meanwhile (tests to run: a list of ints). A leak
        # grows in every window of CALLS calls; such a message arrives in one.
        before, heap_before, blocks_before, after, heap_after, blocks_after = measure()
    heap_growth = None if heap_before is None else heap_after - heap_before
    record(f"leaks: {name}", calls=CALLS, rss_before_kib=before // 1024, rss_after_kib=after // 1024,
           rss_growth_kib=(after - before) // 1024,
           malloc_growth_bytes=heap_growth, python_blocks_growth=blocks_after - blocks_before)
    assert after - before <= ALLOWANCE, (
        f"{name}: RSS grew by {(after - before) / 1024:.0f} KiB over {CALLS} calls "
        f"({(after - before) / CALLS:.1f} bytes a call)")
    # The RSS misses a leak that the allocator feeds from memory freed earlier (and kept
    # resident); malloc's own count and Python's count of live objects do not.
    if heap_growth is not None:
        assert heap_growth <= ALLOWANCE // 4, f"{name}: malloc'd bytes grew by {heap_growth} over {CALLS} calls"
    assert blocks_after - blocks_before < blocks_bound, (
        f"{name}: {blocks_after - blocks_before} more live Python blocks after {CALLS} calls")


def test_the_allocation_probes_see_a_leak():
    # 300 bytes kept a call over the default count of calls: malloc's count and Python's
    # count of live blocks both see it, even where the RSS would not move.
    n = 4_000
    heap, blocks = malloc_in_use_bytes(), sys.getallocatedblocks()
    kept = [np.empty(300 // 8) for _ in range(n)]  # numpy data: malloc; the array objects: Python
    if heap is not None:
        assert malloc_in_use_bytes() - heap > ALLOWANCE // 4
    assert sys.getallocatedblocks() - blocks >= n
    del kept


def test_the_leak_probe_sees_a_leak():
    # The probe itself: 96 MiB kept and written shows in the RSS. (One block above glibc's
    # largest dynamic mmap threshold, 64 MiB, so that it gets fresh pages rather than heap
    # memory that earlier tests freed and the allocator kept resident.)
    before = rss_bytes()
    kept = np.ones(12 * 2**20)
    after = rss_bytes()
    assert after - before > 32 * ALLOWANCE
    del kept
