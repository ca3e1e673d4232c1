"""varlen_attention: sequences packed along the first axis (flash-attn's cu_seqlens layout).

Each sequence's rows must equal scaled_dot_product_attention on that sequence alone, with the
same options, and the float64 reference; no padded position may be read or written (the rows
after the last sequence are checked untouched through `out=` views, and a sanitizer build runs
this file in .ci/harden). Bad offsets raise errors that name the argument.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
import attnx.reference as reference
from conftest import assert_close, assert_identical, num_threads, randn

f16, f32, f64 = np.float16, np.float32, np.float64


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def packed(rng, lengths, heads, dim, dtype=f32):
    return randn(rng, (int(sum(lengths)), heads, dim), dtype)


def per_sequence_sdpa(q, k, v, cu_q, cu_k, **options):
    """sdpa on each sequence alone, in its own (H, L, E) layout, packed back."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), attnx.scaled_dot_product_attention(
        q[:1].transpose(1, 0, 2), k[:1].transpose(1, 0, 2), v[:1].transpose(1, 0, 2), enable_gqa=True,
        **options).dtype if q.shape[0] and k.shape[0] else f64)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            continue
        alone = attnx.scaled_dot_product_attention(
            q[rows].transpose(1, 0, 2), k[keys].transpose(1, 0, 2), v[keys].transpose(1, 0, 2),
            enable_gqa=True, **options)
        out[rows] = alone.transpose(1, 0, 2)
    return out


def random_case(rng):
    """A random ragged batch and options: empty sequences, cross lengths, GQA, every option."""
    batch = int(rng.integers(1, 7))
    cross = rng.random() < 0.4
    long_one = rng.random() < 0.2
    lengths_q = rng.integers(0, 70, batch)
    if long_one:
        lengths_q[rng.integers(batch)] = rng.integers(200, 400)
    lengths_k = rng.integers(0, 90, batch) if cross else lengths_q.copy()
    if rng.random() < 0.3:  # decoding-like: one or a few queries over many keys
        lengths_q = rng.integers(0, 4, batch)
        lengths_k = rng.integers(0, 600, batch)
    hk = int(rng.choice([1, 2, 3]))
    hq = hk * int(rng.choice([1, 2, 4]))
    e = int(rng.choice([8, 16, 33, 64]))
    ev = e if rng.random() < 0.7 else int(rng.choice([8, 24]))
    options = {}
    causal = rng.choice(["none", "top_left", "bottom_right", "true"])
    if causal != "none":
        options["is_causal"] = True if causal == "true" else str(causal)
    if rng.random() < 0.3:
        options["window"] = (int(rng.integers(0, 40)) if rng.random() < 0.8 else None,
                             int(rng.integers(0, 40)) if rng.random() < 0.5 else None)
    if rng.random() < 0.2:
        options["softcap"] = float(rng.uniform(2, 30))
    if rng.random() < 0.2:
        options["scale"] = float(rng.uniform(0.05, 0.5))
    return lengths_q, lengths_k, hq, hk, e, ev, options


@pytest.mark.parametrize("seed", range(240))
def test_random_batches_equal_sdpa_per_sequence(seed):
    rng = np.random.default_rng(seed)
    lengths_q, lengths_k, hq, hk, e, ev, options = random_case(rng)
    dtype = [f32, f64, f16][seed % 3]
    q = packed(rng, lengths_q, hq, e, dtype)
    k = packed(rng, lengths_k, hk, e, dtype)
    v = packed(rng, lengths_k, hk, ev, dtype)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    out = attnx.varlen_attention(q, k, v, cu_q, cu_k, **options)
    assert out.shape == (q.shape[0], hq, ev) and out.dtype == dtype
    expected = reference.varlen_attention(q.astype(f64), k.astype(f64), v.astype(f64), cu_q, cu_k, **options)
    if dtype == f16:  # a float32 result rounded to float16: half an ulp of it
        np.testing.assert_allclose(out.astype(f64), expected, rtol=1e-3, atol=1e-3)
    else:
        # The drawn scales reach 0.5 at E = 64: scores of 4 standard deviations, whose float32
        # round-off an output row near 0 carries past float32's usual 1e-6 (1.3e-6 seen).
        assert_close(out, expected, dtype, err_msg=f"{lengths_q} {lengths_k} {options}",
                     atol=5e-6 if dtype == f32 else None)
    # The same route as sdpa: each sequence as sdpa computes it alone (the paths' float32
    # round-off aside; float16 results are rounded from float32 on both sides, so may differ by
    # an ulp of float16).
    alone = per_sequence_sdpa(q, k, v, cu_q, cu_k, **options)
    tol = {f32: 4e-6, f64: 1e-14, f16: 1e-3}[dtype]
    np.testing.assert_allclose(out.astype(f64), alone.astype(f64), rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(40))
def test_bfloat16_products_equal_sdpa_per_sequence(seed):
    rng = np.random.default_rng(1000 + seed)
    lengths_q, lengths_k, hq, hk, e, ev, options = random_case(rng)
    q, k, v = packed(rng, lengths_q, hq, e), packed(rng, lengths_k, hk, e), packed(rng, lengths_k, hk, ev)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    out = attnx.varlen_attention(q, k, v, cu_q, cu_k, precision="bfloat16", **options)
    expected = reference.varlen_attention(q, k, v, cu_q, cu_k, precision="bfloat16", **options)
    # The bfloat16 reference rounds the same operands; the sums' order differs.
    np.testing.assert_allclose(out, expected, rtol=2e-2, atol=2e-2)
    alone = per_sequence_sdpa(q, k, v, cu_q, cu_k, precision="bfloat16", **options)
    np.testing.assert_allclose(out, alone, rtol=1e-5, atol=1e-5)


def test_half_keys_and_values_are_read_in_place():
    rng = np.random.default_rng(1)
    lengths = [40, 0, 17, 90]
    q = packed(rng, lengths, 4, 32)
    k, v = packed(rng, lengths, 2, 32, f16), packed(rng, lengths, 2, 32, f16)
    cu = offsets(lengths)
    out = attnx.varlen_attention(q, k, v, cu, is_causal=True)
    expected = reference.varlen_attention(q.astype(f64), k.astype(f64), v.astype(f64), cu, is_causal=True)
    assert_close(out, expected, f32)


def test_the_docs_batch_of_bert_lengths_equals_padded_sdpa():
    """The benchmark's ragged batch: lengths 128..16 in steps of 16, H12 D64; packed rows equal
    the padded batch through sdpa with a key padding mask, at the real positions."""
    rng = np.random.default_rng(2)
    lengths = [128, 112, 96, 80, 64, 48, 32, 16]
    q, k, v = (packed(rng, lengths, 12, 64) for _ in range(3))
    cu = offsets(lengths)
    padded = np.zeros((3, 8, 12, 128, 64), f32)
    for b, n in enumerate(lengths):
        for i, x in enumerate((q, k, v)):
            padded[i, b, :, :n] = x[cu[b]:cu[b + 1]].transpose(1, 0, 2)
    keep = np.arange(128)[None, :] < np.array(lengths)[:, None]  # (B, S): True = real key
    for causal in (False, True):
        out = attnx.varlen_attention(q, k, v, cu, is_causal=causal)
        dense = attnx.scaled_dot_product_attention(*padded, keep[:, None, None, :], is_causal=causal)
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(out[cu[b]:cu[b + 1]], dense[b, :, :n].transpose(1, 0, 2),
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lengths_q, lengths_k", [
    ([0, 0, 0], [0, 0, 0]),          # nothing at all
    ([3, 0, 2], [0, 5, 0]),          # queries without keys: zeros; keys without queries
    ([], []),                        # no sequences
    ([1], [1]),
])
def test_empty_sequences(lengths_q, lengths_k):
    rng = np.random.default_rng(3)
    q, k, v = packed(rng, lengths_q, 2, 8), packed(rng, lengths_k, 2, 8), packed(rng, lengths_k, 2, 8)
    out = attnx.varlen_attention(q, k, v, offsets(lengths_q), offsets(lengths_k), is_causal="bottom_right")
    expected = reference.varlen_attention(q, k, v, offsets(lengths_q), offsets(lengths_k), is_causal="bottom_right")
    assert out.shape == (sum(lengths_q), 2, 8)
    assert_close(out, expected, f32)


def test_out_is_written_in_place_and_nothing_past_the_rows():
    """out= is filled row for row; a view into a larger buffer shows that no row beyond the
    packed queries is written, and the inputs are not changed."""
    rng = np.random.default_rng(4)
    lengths = [7, 30, 1]
    q, k, v = (packed(rng, lengths, 4, 16) for _ in range(3))
    before = [x.copy() for x in (q, k, v)]
    buffer = np.full((40, 4, 16), 7.0, f32)
    out = buffer[:38]
    result = attnx.varlen_attention(q, k, v, offsets(lengths), is_causal=True, out=out)
    assert result is out
    assert (buffer[38:] == 7.0).all()
    assert_identical(out, attnx.varlen_attention(q, k, v, offsets(lengths), is_causal=True))
    for x, y in zip((q, k, v), before):
        assert_identical(x, y)


def test_results_do_not_depend_on_the_thread_count(threads):
    rng = np.random.default_rng(5)
    lengths = [300, 3, 1, 90, 17, 0, 250]  # one long sequence among short ones
    q, k, v = (packed(rng, lengths, 4, 64) for _ in range(3))
    cu = offsets(lengths)
    results = []
    for n in (1, 2, 3):
        with num_threads(n):
            results.append(attnx.varlen_attention(q, k, v, cu, is_causal=True))
    for r in results[1:]:
        assert_identical(r, results[0])


def test_int32_offsets_and_lists_are_accepted():
    rng = np.random.default_rng(6)
    q, k, v = (packed(rng, [3, 4], 2, 8) for _ in range(3))
    a = attnx.varlen_attention(q, k, v, np.array([0, 3, 7], np.int32))
    b = attnx.varlen_attention(q, k, v, [0, 3, 7], [0, 3, 7])
    assert_identical(a, b)


@pytest.mark.parametrize("cu_q, cu_k, match", [
    ([1, 3, 7], None, "cu_seqlens_q: must start at 0, got 1"),
    ([0, 5, 3, 7], None, "cu_seqlens_q: must not decrease, got 5 then 3 at index 2"),
    ([0, 3, 6], None, "cu_seqlens_q: must end at 7, the query's rows, got 6"),
    ([0, 3, 8], None, "cu_seqlens_q: must end at 7"),
    ([0, 3, 7], [0, 7], "cu_seqlens_q and cu_seqlens_k: 2 and 1 sequences"),
    ([0, 3, 7], [0, 2, 9], "cu_seqlens_k: must end at 7, the key's rows, got 9"),
    ([0, 3, -2**63], None, "cu_seqlens_q: must not decrease, got 3 then -9223372036854775808"),
    ([0, 2**63 - 1, 7], None, "cu_seqlens_q: must not decrease, got 9223372036854775807 then 7"),
    ([], None, "cu_seqlens_q: expected \\(batch \\+ 1\\) offsets starting at 0"),
    ([[0, 3, 7]], None, "cu_seqlens_q must be 1-D"),
])
def test_bad_offsets_name_the_argument(cu_q, cu_k, match):
    rng = np.random.default_rng(7)
    q, k, v = (packed(rng, [3, 4], 2, 8) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        attnx.varlen_attention(q, k, v, np.array(cu_q, np.int64), cu_k)


def test_bad_arguments_raise_clear_errors():
    rng = np.random.default_rng(8)
    q, k, v = (packed(rng, [3, 4], 4, 8) for _ in range(3))
    cu = [0, 3, 7]
    with pytest.raises(TypeError, match="cu_seqlens_q must be an array of integers"):
        attnx.varlen_attention(q, k, v, np.array([0.0, 3.0, 7.0]))
    with pytest.raises(TypeError, match="cu_seqlens_k must be an array of integers"):
        attnx.varlen_attention(q, k, v, cu, [0, 3.5, 7])
    with pytest.raises(ValueError, match="query heads \\(4\\) must be a multiple of key heads \\(3\\)"):
        attnx.varlen_attention(q, k[:, :3], v[:, :3], cu)
    with pytest.raises(ValueError, match="query must be \\(total_q, Hq, E\\)"):
        attnx.varlen_attention(q[None], k, v, cu)
    with pytest.raises(ValueError, match="key .* and value .* must be"):
        attnx.varlen_attention(q, k[:, :, :4], v, cu)
    with pytest.raises(TypeError, match="query must be a floating-point array"):
        attnx.varlen_attention(q.astype(np.int32), k, v, cu)
    with pytest.raises(ValueError, match="is_causal must be"):
        attnx.varlen_attention(q, k, v, cu, is_causal="diagonal")
    with pytest.raises(ValueError, match="precision='bfloat16' computes in float32"):
        attnx.varlen_attention(q.astype(f64), k, v, cu, precision="bfloat16")
    with pytest.raises(ValueError, match="out has shape"):
        attnx.varlen_attention(q, k, v, cu, out=np.empty((7, 4, 9), f32))
    with pytest.raises(TypeError, match="out has dtype"):
        attnx.varlen_attention(q, k, v, cu, out=np.empty((7, 4, 8), f64))


def test_non_contiguous_inputs_are_read_as_given():
    rng = np.random.default_rng(9)
    lengths = [5, 9]
    q = randn(rng, (14, 8, 4), f32).transpose(0, 2, 1)  # (14, 4, 8), head axis strided
    k = randn(rng, (28, 2, 8), f32)[::2]
    v = randn(rng, (14, 2, 8), f32)
    cu = offsets(lengths)
    out = attnx.varlen_attention(q, k, v, cu, is_causal=True)
    expected = attnx.varlen_attention(np.ascontiguousarray(q), np.ascontiguousarray(k), v, cu, is_causal=True)
    assert_identical(out, expected)
