"""Narrowing of float32 / float64 values to float16 / bfloat16 storage, against NumPy.

``_testing.narrow_16bit`` (private) runs the core's ``narrow_to_float16`` /
``narrow_to_bfloat16``. Its bits must be exactly those NumPy writes with ``cache[...] = x``
into a float16 array (NumPy's own conversion) or a bfloat16 one (ml_dtypes), for float32 and
float64 sources: rounding to nearest even, overflow to inf, subnormals, signed zeros, and
every NaN as NumPy gives it (see ``NAN_CASES``).

float32 is checked on every top half of a pattern (sign, exponent, the high significand bits)
with a set of bottom halves that takes the round and sticky bits through their cases, and, with
``ATTNX_TEST_NARROWING_ALL=1``, on all 2^32 bit patterns (minutes: NumPy raises the underflow
or overflow flag value by value for half of them, at 100+ ns each). float64 is checked on
random bit patterns, random values near each format's range, and every value of each format
with the half-way points between them, each nudged by a few float64 ulps and by less than
half a float32 ulp (which the double rounding of float64 -> bfloat16 through float32 turns
into a tie).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from attnx import _testing

CHUNK = 1 << 22


def numpy_bits(x, fmt):
    """The bits NumPy (ml_dtypes for bfloat16) writes for x into a `fmt` array."""
    if fmt == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    else:
        dtype = np.float16
    out = np.empty(x.shape, dtype)
    with np.errstate(all="ignore"):
        out[...] = x
    return out.view(np.uint16)


def check(x, fmt):
    """Asserts that narrow_16bit gives NumPy's bits for every value of x."""
    got = _testing.narrow_16bit(x, fmt)
    want = numpy_bits(x, fmt)
    assert got.dtype == np.uint16 and got.shape == x.shape
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = bad[0]
        src = x.view(np.uint32 if x.dtype == np.float32 else np.uint64)[i]
        pytest.fail(f"{x.dtype} -> {fmt}: {bad.size} of {x.size} wrong, first {int(src):#x} "
                    f"({x[i]!r}): got {int(got[i]):#06x}, expected {int(want[i]):#06x}")


def float32_patterns(first, count):
    """float32 arrays of the bit patterns first, first + 1, ... (count of them), CHUNK at a
    time (the same buffer each time)."""
    base = np.arange(CHUNK, dtype=np.uint32)
    buf = np.empty(CHUNK, np.uint32)
    for start in range(first, first + count, CHUNK):
        n = min(CHUNK, first + count - start)
        np.add(base[:n], np.uint32(start), out=buf[:n])
        yield buf[:n].view(np.float32)


# ---------------------------------------------------------------------------------------------
# float32
# ---------------------------------------------------------------------------------------------

EVERY_PATTERN = pytest.mark.skipif(
    not os.environ.get("ATTNX_TEST_NARROWING_ALL"), reason="minutes; ATTNX_TEST_NARROWING_ALL=1")


def every_top_half(bottom):
    """float32 chunks of every top half (65,536) with each of the bottom halves given."""
    top = np.arange(65536, dtype=np.uint32)
    bits = (top[:, None] << 16 | np.asarray(bottom, np.uint32)).ravel()
    for start in range(0, bits.size, CHUNK):
        yield bits[start:start + CHUNK].view(np.float32)


def test_float32_to_bfloat16_every_top_half():
    # bfloat16 keeps the top half: the bottom half is the round bit (15) and the sticky bits
    # below it, taken through zero, one, all, and the tie cases, plus random ones. A NaN's
    # payload may lie in either half.
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    bottom = [0x0000, 0x0001, 0x3FFF, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFF]
    for x in every_top_half(bottom + list(rng.integers(0, 1 << 16, 16))):
        check(x, "bfloat16")


def test_float32_to_float16_every_top_half():
    # float16 keeps 10 significand bits: bits 13..15 of the bottom half are kept bits or the
    # round bit (a subnormal's round bit lies at bit 13 or above), so bits 12..15 take all
    # 16 values, and the bits below (sticky) zero, one, all, and the top or all but the top
    # one, plus random ones.
    sticky = np.array([0x000, 0x001, 0x7FF, 0x800, 0xFFF], np.uint32)
    rng = np.random.default_rng(1)
    bottom = np.concatenate([
        (np.arange(16, dtype=np.uint32)[:, None] << 12 | sticky).ravel(),
        rng.integers(0, 1 << 16, 16).astype(np.uint32)])
    for x in every_top_half(bottom):
        check(x, "float16")


# Slices of 2^28 patterns (sign, exponent's top 3 bits), so that xdist's workers share them out.
@EVERY_PATTERN
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("block", range(16))
def test_float32_every_bit_pattern(block, fmt):
    if fmt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    for x in float32_patterns(block << 28, 1 << 28):
        check(x, fmt)


# ---------------------------------------------------------------------------------------------
# float64
# ---------------------------------------------------------------------------------------------

def float64_of(bits):
    return np.asarray(bits, dtype=np.uint64).view(np.float64)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_float64_random_bit_patterns(fmt):
    if fmt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(2 if fmt == "float16" else 3)
    n = 2_000_000
    # Uniform bit patterns: mostly far outside either format's range.
    check(float64_of(rng.integers(0, 2**64, n, dtype=np.uint64)), fmt)
    # Random significands and signs, exponents across the format's range and beyond it (the
    # float16 range from 2^-25 to 2^16; bfloat16's through float32's, from 2^-150 to 2^128).
    low, high = (1023 - 30, 1023 + 20) if fmt == "float16" else (1023 - 155, 1023 + 133)
    sig = rng.integers(0, 1 << 52, n, dtype=np.uint64)
    # A quarter with the bits below the format's round bit cleared or set, a quarter with
    # those below float32's: ties and near-ties.
    keep = np.uint64(~((1 << (52 - 11)) - 1) & (2**64 - 1)) if fmt == "float16" else \
        np.uint64(~((1 << (52 - 8)) - 1) & (2**64 - 1))
    sig[: n // 8] &= keep
    sig[n // 8 : n // 4] |= ~keep & np.uint64(2**52 - 1)
    f32_keep = np.uint64(~((1 << (52 - 24)) - 1) & (2**64 - 1))
    sig[n // 4 : 3 * n // 8] &= f32_keep
    sig[3 * n // 8 : n // 2] |= ~f32_keep & np.uint64(2**52 - 1)
    exponent = rng.integers(low, high + 1, n, dtype=np.uint64)
    sign = rng.integers(0, 2, n, dtype=np.uint64)
    check(float64_of(sign << np.uint64(63) | exponent << np.uint64(52) | sig), fmt)


def format_values(fmt):
    """float64 values of every finite non-negative pattern of fmt, in increasing order."""
    if fmt == "float16":
        bits = np.arange(0x7C00, dtype=np.uint16)
        return bits.view(np.float16).astype(np.float64)
    bits = np.arange(0x7F80, dtype=np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


def nudged(points):
    """points, and each moved by 1..3 float64 ulps and by about 2^-26 and 2^-30 of itself
    (under half a float32 ulp: float32 rounds it back onto the point) either way."""
    points = points[np.isfinite(points)]
    out = [points]
    up, down = points, points
    with np.errstate(over="ignore"):  # float64's largest value goes to inf
        for _ in range(3):
            up, down = np.nextafter(up, np.inf), np.nextafter(down, -np.inf)
            out += [up, down]
        for k in (26, 30):
            out += [points * (1 + 2.0**-k), points * (1 - 2.0**-k)]
    return np.concatenate(out)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_float64_edge_cases(fmt):
    if fmt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    values = format_values(fmt)
    # Half-way points: between consecutive values (0 and the least subnormal, the largest
    # subnormal and the least normal included), and above the largest finite value, the
    # threshold of overflow (65520 for float16).
    halfway = (values[:-1] + values[1:]) / 2
    top_ulp = values[-1] - values[-2]
    threshold = values[-1] + top_ulp / 2
    assert fmt != "float16" or threshold == 65520.0
    points = np.concatenate([values, halfway, [threshold]])
    tiny = np.finfo(np.float32).smallest_subnormal.astype(np.float64)
    extra = np.array([
        # float32's subnormal and overflow boundaries (the first rounding of bfloat16's).
        tiny / 2, tiny, 1.5 * tiny, np.finfo(np.float32).smallest_normal,
        np.finfo(np.float32).max, float(np.finfo(np.float32).max) * (1 + 2.0**-24),
        # float64's own extremes.
        np.finfo(np.float64).smallest_subnormal, np.finfo(np.float64).smallest_normal,
        np.finfo(np.float64).max, 1.0, 2.0**-24, 2.0**-25, 2.0**-14, 2.0**-126, 2.0**-133,
        2.0**-134, 2.0**16, 2.0**128, 0.0, np.inf])
    x = nudged(np.concatenate([points, extra]))
    x = np.concatenate([x, -x, [np.inf, -np.inf, 0.0, -0.0]])
    check(x, fmt)


# ---------------------------------------------------------------------------------------------
# NaNs, double rounding, lengths and arguments
# ---------------------------------------------------------------------------------------------

# (source bits, float16 bits, bfloat16 bits), as NumPy 2.x and ml_dtypes give them on x86-64
# (NumPy converts in software, not with F16C, which would make signalling NaNs quiet).
# float16: the sign and the significand's top 10 bits, quiet bit included (a signalling NaN
# stays signalling), the lowest set where those are all zero. bfloat16: 0x7fc0 with the sign.
NAN_CASES = {
    np.float32: [
        (0x7FC00000, 0x7E00, 0x7FC0), (0xFFC00000, 0xFE00, 0xFFC0),
        (0x7FC00001, 0x7E00, 0x7FC0), (0x7FC02000, 0x7E01, 0x7FC0),
        (0x7FFFFFFF, 0x7FFF, 0x7FC0), (0xFFFFFFFF, 0xFFFF, 0xFFC0),
        (0x7F800001, 0x7C01, 0x7FC0), (0xFF800001, 0xFC01, 0xFFC0),
        (0x7F801FFF, 0x7C01, 0x7FC0), (0x7F802000, 0x7C01, 0x7FC0),
        (0x7F810000, 0x7C08, 0x7FC0), (0x7FA00000, 0x7D00, 0x7FC0),
        (0x7FBFFFFF, 0x7DFF, 0x7FC0), (0xFFBFFFFF, 0xFDFF, 0xFFC0),
    ],
    np.float64: [
        (0x7FF8000000000000, 0x7E00, 0x7FC0), (0xFFF8000000000000, 0xFE00, 0xFFC0),
        (0x7FF8000000000001, 0x7E00, 0x7FC0), (0x7FF8040000000000, 0x7E01, 0x7FC0),
        (0x7FFFFFFFFFFFFFFF, 0x7FFF, 0x7FC0), (0xFFFFFFFFFFFFFFFF, 0xFFFF, 0xFFC0),
        (0x7FF0000000000001, 0x7C01, 0x7FC0), (0xFFF0000000000001, 0xFC01, 0xFFC0),
        (0x7FF003FFFFFFFFFF, 0x7C01, 0x7FC0), (0x7FF0040000000000, 0x7C01, 0x7FC0),
        (0x7FF0000020000000, 0x7C01, 0x7FC0), (0x7FF0200000000000, 0x7C08, 0x7FC0),
        (0x7FF4000000000000, 0x7D00, 0x7FC0), (0x7FF7FFFFFFFFFFFF, 0x7DFF, 0x7FC0),
        (0xFFF7FFFFFFFFFFFF, 0xFDFF, 0xFFC0),
    ],
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_nans(dtype, fmt):
    if fmt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    cases = NAN_CASES[dtype]
    uint = np.uint32 if dtype == np.float32 else np.uint64
    x = np.array([c[0] for c in cases], uint).view(dtype)
    want = np.array([c[1 if fmt == "float16" else 2] for c in cases], np.uint16)
    np.testing.assert_array_equal(_testing.narrow_16bit(x, fmt), want)
    np.testing.assert_array_equal(numpy_bits(x, fmt), want)  # NumPy's rule, as stated


def test_float64_to_bfloat16_rounds_twice_and_float16_once():
    # 1 + 2^-8 + 2^-30 is above bfloat16's half-way point between 1 and 1 + 2^-7, but
    # float32 rounds it onto that point, which then rounds to even: 1.0, as ml_dtypes gives.
    # 1 + 2^-11 + 2^-40 rounds up to float16 in one step; through float32 it would give 1.0.
    x = np.array([1 + 2.0**-8 + 2.0**-30], np.float64)
    y = np.array([1 + 2.0**-11 + 2.0**-40], np.float64)
    assert _testing.narrow_16bit(y, "float16")[0] == 0x3C01
    assert numpy_bits(y, "float16")[0] == 0x3C01
    pytest.importorskip("ml_dtypes")
    assert _testing.narrow_16bit(x, "bfloat16")[0] == 0x3F80
    assert numpy_bits(x, "bfloat16")[0] == 0x3F80
    # Just below the overflow threshold of bfloat16, (2 - 2^-8) * 2^127, by less than half a
    # float32 ulp: float32 rounds onto it, and the tie goes to even, inf.
    z = np.array([(2 - 2.0**-8) * 2.0**127 * (1 - 2.0**-30)], np.float64)
    assert _testing.narrow_16bit(z, "bfloat16")[0] == 0x7F80
    assert numpy_bits(z, "bfloat16")[0] == 0x7F80


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_every_length_and_start(dtype, fmt):
    if fmt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    pool = (rng.standard_normal(128) * 10.0 ** rng.integers(-8, 6, 128)).astype(dtype)
    pool[::9] = [np.nan, -np.inf, np.inf, -0.0, 0.0, 65520, -65519, 1e-8, 3e38, 6e-8, 1e-45,
                 -2.0**-25, -np.nan, 1 + 2.0**-11, 1 + 2.0**-8][: pool[::9].size]
    for start in range(17):
        for n in range(71):
            check(pool[start:start + n], fmt)


def test_arguments():
    x = np.ones(4, np.float32)
    assert _testing.narrow_16bit(np.empty(0, np.float64), "float16").shape == (0,)
    with pytest.raises(ValueError, match="format"):
        _testing.narrow_16bit(x, "float8")
    for bad in (x.astype(np.float16), x.astype(np.int32), x.astype(">f4")):
        with pytest.raises(TypeError):
            _testing.narrow_16bit(bad, "float16")
    with pytest.raises(ValueError):
        _testing.narrow_16bit(x.reshape(2, 2), "float16")
    with pytest.raises(ValueError, match="contiguous"):
        _testing.narrow_16bit(x[::2], "bfloat16")
