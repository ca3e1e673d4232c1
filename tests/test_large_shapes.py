"""Index arithmetic past 2^31: element offsets and element counts that overflow 32 bits.

* Offsets: every array argument of sdpa, multi_head_attention_forward, the module and the
  private core, laid out with rows 2^27 elements apart, so that the last rows sit more than
  2^31 elements (8 or 16 GiB) past the first. The memory is an anonymous mapping reserved
  but never touched except at those rows (a few pages), so the test needs no RAM to speak
  of. A 32-bit offset anywhere would read or write the wrong row (or crash): the results
  must equal the reference's on contiguous copies, and a guard row next to the output rows
  must stay untouched.
* Counts: broadcast (stride-0) operands give an sdpa call of more than 2^31 scores (and,
  under the ``thorough`` profile, a mask of more than 2^31 logical elements) in a second or so
  of compute; every batch must equal the one computed alone.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

import attnx
from _hardening import thorough, under_address_sanitizer
from attnx import _core
from conftest import core_sdpa, DTYPE_IDS, DTYPES, assert_close, ref_mha, ref_sdpa

pytestmark = pytest.mark.hardening

ROW_GAP = 2**27  # elements between consecutive rows of every array below
TWO31 = 2**31


class SparseArena:
    """Arrays whose rows are ROW_GAP elements apart, in one reserved, untouched mapping.

    Array i starts at byte 4096 * i, so the arrays interleave without sharing an element.
    """

    def __init__(self, dtype, max_rows=40):
        self.dtype = np.dtype(dtype)
        self.size = max_rows * ROW_GAP * self.dtype.itemsize + 2**20
        # MAP_NORESERVE (Linux's 0x4000; Python < 3.12 lacks the name): address space only,
        # no commit charge, so a mapping larger than RAM is fine while it stays untouched.
        noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | noreserve
        self.map = mmap.mmap(-1, self.size, flags=flags)
        self.count = 0
        self.max_rows = max_rows

    def array(self, values):
        """A view in the arena holding `values`: C order, but each row ROW_GAP elements on."""
        values = np.asarray(values, dtype=self.dtype)
        shape = values.shape
        rows = int(np.prod(shape[:-1]))
        assert rows <= self.max_rows and shape[-1] * self.dtype.itemsize <= 2048
        strides = [self.dtype.itemsize]
        step = ROW_GAP * self.dtype.itemsize
        for n in reversed(shape[:-1]):
            strides.insert(0, step)
            step *= n
        offset = 4096 * self.count
        self.count += 1
        view = np.ndarray(shape, self.dtype, buffer=self.map, offset=offset, strides=tuple(strides))
        view[...] = values
        return view

    @staticmethod
    def max_offset(view):
        """The largest element offset of the view from its first element."""
        return sum((n - 1) * s for n, s in zip(view.shape, view.strides)) // view.itemsize


@pytest.fixture(params=DTYPES, ids=DTYPE_IDS)
def arena(request):
    try:
        a = SparseArena(request.param)
    except (OSError, ValueError, OverflowError) as exc:  # pragma: no cover - 32-bit or no overcommit
        pytest.skip(f"cannot reserve {40 * ROW_GAP * np.dtype(request.param).itemsize >> 30} GiB of address space: {exc}")
    yield a
    a.map.close()


def test_sdpa_offsets_past_2_31(arena, rng):
    dt = arena.dtype
    L, S, E, Ev = 2, 3, 8, 4
    q = arena.array(rng.standard_normal((2, 3, 2, L, E)))  # two lead dims: the mask's offset table
    k = arena.array(rng.standard_normal((2, 1, 2, S, E)))
    v = arena.array(rng.standard_normal((2, 1, 2, S, Ev)))
    mask = arena.array(np.where(rng.random((2, 3, 2, L, S)) < 0.7, rng.standard_normal((2, 3, 2, L, S)), -np.inf))
    for a in (q, mask):
        assert SparseArena.max_offset(a) > TWO31
    for kw in ({}, {"attn_mask": mask}, {"is_causal": True, "scale": 0.3}):
        got = attnx.scaled_dot_product_attention(q, k, v, **kw)
        assert_close(got, ref_sdpa(q, k, v, **kw), dt, err_msg=str(sorted(kw)))
    # Grouped-query heads on the same layout.
    k1, v1 = k[:, :, :1], v[:, :, :1]  # one key head for the query's two
    got = attnx.scaled_dot_product_attention(q, k1, v1, enable_gqa=True)
    assert_close(got, ref_sdpa(q, k1, v1, enable_gqa=True), dt)


def test_core_sdpa_writes_past_2_31(arena, rng):
    """The output written through offsets past 2^31, and the weights path reading through them."""
    dt = arena.dtype
    B, H, L, S, E = 3, 2, 5, 2, 4
    q = arena.array(rng.standard_normal((B, H, L, E)))
    k = arena.array(rng.standard_normal((B, 1, S, E)))
    v = arena.array(rng.standard_normal((B, 1, S, E)))
    mask = arena.array(rng.standard_normal((B, H, L, S)))
    out = arena.array(np.full((B, H, L, E), 7.0))
    guard = arena.array(np.full((B, H, L, E), 9.0))  # interleaved with `out`: must not change
    assert SparseArena.max_offset(out) > TWO31
    weights = np.empty((B, H, L, S), dt)
    for w in (None, weights):
        core_sdpa(q, k, v, mask, True, 0.5, out, w)
        bias = np.where(np.arange(S) > np.arange(L)[:, None], -np.inf, np.asarray(mask, np.float64))
        from attnx import reference

        exp_out, exp_w = reference._attention(
            np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), H, 1),
            np.repeat(np.asarray(v, np.float64), H, 1), bias, 0.5)
        assert_close(np.array(out), exp_out, dt)
        if w is not None:
            assert_close(w, exp_w, dt)
        np.testing.assert_array_equal(guard, 9.0)


def test_mha_offsets_past_2_31(arena, rng):
    dt = arena.dtype
    E, H, L, S, N = 8, 2, 3, 4, 2
    w = 1 / np.sqrt(E)
    args = dict(
        query=arena.array(rng.standard_normal((L, N, E))),
        key=arena.array(rng.standard_normal((S, N, E))),
        value=arena.array(rng.standard_normal((S, N, E))),
        embed_dim_to_check=E, num_heads=H,
        in_proj_weight=arena.array(rng.standard_normal((3 * E, E)) * w),
        in_proj_bias=rng.standard_normal(3 * E).astype(dt),
        bias_k=None, bias_v=None, add_zero_attn=True, dropout_p=0.0,
        out_proj_weight=arena.array(rng.standard_normal((E, E)) * w),
        out_proj_bias=rng.standard_normal(E).astype(dt),
        training=False,
        key_padding_mask=arena.array(np.where(rng.random((N, S)) < 0.3, -np.inf, 0.0)),
        attn_mask=arena.array(rng.standard_normal((N * H, L, S))),
        is_causal=False,
    )
    assert SparseArena.max_offset(args["in_proj_weight"]) > TWO31
    for need_weights, average in ((True, True), (True, False), (False, True)):
        out, weights = attnx.multi_head_attention_forward(**args, need_weights=need_weights,
                                                          average_attn_weights=average)
        exp = ref_mha(**args, need_weights=need_weights, average_attn_weights=average)
        assert_close(out, exp[0], dt)
        if need_weights:
            assert_close(weights, exp[1], dt)
    # Static keys/values and separate projection weights through the same layout.
    sep = dict(args, use_separate_proj_weight=True, in_proj_weight=None, add_zero_attn=False,
               q_proj_weight=arena.array(rng.standard_normal((E, E)) * w),
               k_proj_weight=arena.array(rng.standard_normal((E, E)) * w),
               v_proj_weight=arena.array(rng.standard_normal((E, E)) * w),
               static_k=arena.array(rng.standard_normal((N * H, S, E // H))),
               static_v=arena.array(rng.standard_normal((N * H, S, E // H))))
    out, weights = attnx.multi_head_attention_forward(**sep)
    exp = ref_mha(**sep)
    assert_close(out, exp[0], dt)
    assert_close(weights, exp[1], dt)


def test_module_offsets_past_2_31(arena, rng):
    dt = arena.dtype
    m = attnx.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True, dtype=dt, seed=0)
    x = arena.array(rng.standard_normal((4, 5, 8)))
    assert SparseArena.max_offset(x) > TWO31
    out, weights = m(x, x, x)  # the module's plain path hands x to the core as it is
    exp = ref_mha(query=x, key=x, value=x, embed_dim_to_check=8, num_heads=2,
                  in_proj_weight=m.in_proj_weight, in_proj_bias=m.in_proj_bias, bias_k=m.bias_k,
                  bias_v=m.bias_v, add_zero_attn=False, dropout_p=0.0, out_proj_weight=m.out_proj_weight,
                  out_proj_bias=m.out_proj_bias, batch_first=True)
    assert_close(out, exp[0], dt)
    assert_close(weights, exp[1], dt)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32], ids=["f32"])
@pytest.mark.skipif(
    under_address_sanitizer(),
    reason="2^31 scores take 80 s in the instrumented kernels (1.5 s in a release build); the "
    "release builds' suites run this test, where an offset that overflowed would give a wrong "
    "batch or a crash")
def test_more_than_2_31_scores(rng, dtype):
    """One sdpa call of B x L x S > 2^31 scores (and a float mask of that many logical
    elements), on stride-0 operands: every batch equals the batch computed alone."""
    B, L, S, E = 2048, 1024, 1025, 1
    assert B * L * S > TWO31
    q1 = rng.standard_normal((1, 1, L, E)).astype(dtype)
    k1 = rng.standard_normal((1, 1, S, E)).astype(dtype)
    v1 = rng.standard_normal((1, 1, S, E)).astype(dtype)
    m1 = np.where(rng.random((L, S)) < 0.8, 0.0, -np.inf).astype(dtype)
    q, k, v = (np.broadcast_to(a, (B, 1) + a.shape[2:]) for a in (q1, k1, v1))
    mask = np.broadcast_to(m1, (B, 1, L, S))
    cases = [({}, {})]
    if thorough():  # the masked tile path reads the mask per score: ~10x the time, so CI only
        cases.append(({"attn_mask": mask}, {"attn_mask": m1}))
    for kw, kw1 in cases:
        got = attnx.scaled_dot_product_attention(q, k, v, **kw)
        alone = attnx.scaled_dot_product_attention(q1, k1, v1, **kw1)
        assert got.shape == (B, 1, L, E)
        np.testing.assert_array_equal(got, np.broadcast_to(alone, got.shape))
        assert_close(alone, ref_sdpa(q1, k1, v1, **kw1), dtype)
