"""The bfloat16 product kernels (csrc/kernels/bf16_table.h), every table this CPU runs, against
exact NumPy references: the rounding to bfloat16 (round, round_in_place), the packing of pairs,
and the gemm over pairs, whose every step the reference repeats in float32. A product of two
bfloat16 values is exact in float32 (8-bit significands make at most 16 bits), so a step
acc + a*b rounded once, as the kernels' multiply-adds and vdpbf16ps do, is NumPy's float32
addition of acc and the float32 product: the reference gives the kernels' bits exactly wherever
nothing is subnormal (vdpbf16ps flushes subnormals, the emulations do not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import attnx
from attnx import _core, _testing

ALL_TABLES = ["scalar", "avx2", "avx512", "native"]


def _runs(table):
    try:
        _testing.bf16_round(np.zeros(1, np.float32), table=table)
    except ValueError:
        return False
    return True


TABLES = [t for t in ALL_TABLES if _runs(t)]

RUN_PAIRS = 64  # kSumRun (128 elements) in pairs: the sums fold into C every 64 pairs


# ------------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------------


def round_bits(x):
    """The bfloat16 bits (uint16) nearest float32 x as vcvtneps2bf16 rounds: to nearest, ties to
    even; subnormal -> zero of its sign; NaN -> quiet NaN of its sign and top payload."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    magnitude = u & 0x7FFFFFFF
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    rounded = np.where(magnitude < 0x00800000, (u >> 16) & 0x8000, rounded)
    rounded = np.where(magnitude > 0x7F800000, ((u | 0x00400000) >> 16) & 0xFFFF, rounded)
    return rounded.astype(np.uint16)


def bf16_values(bits):
    """float32 values of bfloat16 bits."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def pairs_of(x):
    """(K + 1) // 2 x N uint32 pairs of the K x N float32 values x (already bfloat16)."""
    x = np.asarray(x, np.float32)
    if x.shape[0] % 2:
        x = np.concatenate([x, np.zeros((1, x.shape[1]), np.float32)])
    bits = round_bits(x).astype(np.uint32)
    return bits[0::2] | (bits[1::2] << 16)


def halves(pairs):
    """float32 (low, high) values of uint32 pairs."""
    pairs = np.asarray(pairs, np.uint32)
    return (pairs << 16).view(np.float32), (pairs & 0xFFFF0000).view(np.float32)


def gemm_reference(a, b, c, init, init_values):
    """C as the tables compute it: per run of 64 pairs, acc from the run's start (init in the
    first, zero and a fold into C by one addition in later ones), then per pair
    acc += a.high b.high, acc += a.low b.low, each a float32 addition of an exact product."""
    a_lo, a_hi = halves(a)
    b_lo, b_hi = halves(b)
    M, K2 = a.shape
    N = b.shape[1]
    c = np.array(c, np.float32, copy=True)
    with np.errstate(all="ignore"):
        for k0 in range(0, max(K2, 1), RUN_PAIRS):
            run_init = init if k0 == 0 else "add_sum"
            if run_init in ("zero", "add_sum"):
                acc = np.zeros((M, N), np.float32)
            elif run_init == "accumulate":
                acc = c.copy()
            elif run_init == "scale_rows":
                acc = c * init_values[:, None]
            elif run_init == "bias_columns":
                acc = np.broadcast_to(init_values[None, :], (M, N)).astype(np.float32)
            elif run_init == "bias_rows":
                acc = np.broadcast_to(init_values[:, None], (M, N)).astype(np.float32)
            for p in range(k0, min(k0 + RUN_PAIRS, K2)):
                acc = acc + a_hi[:, p, None] * b_hi[None, p, :]
                acc = acc + a_lo[:, p, None] * b_lo[None, p, :]
            c = c + acc if run_init == "add_sum" else acc
    return c


def random_pairs(rng, shape, scale=1.0):
    values = (rng.standard_normal((shape[0] * 2, shape[1])) * scale).astype(np.float32)
    return pairs_of(bf16_values(round_bits(values)))


def same_bits(x, y):
    x = np.ascontiguousarray(x, np.float32)
    y = np.ascontiguousarray(y, np.float32)
    return x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def run_gemm(table, a, b, init, c=None, init_values=None):
    M, N = a.shape[0], b.shape[1]
    c = np.full((M, N), 0.5, np.float32) if c is None else c.copy()
    _testing.bf16_gemm(a, b, c, init, init_values, table=table)
    return c


# ------------------------------------------------------------------------------------------------
# The tables
# ------------------------------------------------------------------------------------------------


def test_tables_this_cpu_runs():
    # Every level up to the CPU's that this build has, and the native table where the best level
    # runs it.
    cfg = attnx.show_config()
    levels = ALL_TABLES[: ALL_TABLES.index(cfg["cpu_isa"]) + 1]
    assert TABLES[: len(levels)] == [t for t in levels if t in cfg["kernels"]]
    if "ATTNX_ISA" not in os.environ and "ATTNX_BF16_PRODUCTS" not in os.environ:
        # The native table runs the products where it makes more of them per second than the
        # float32 multiply-adds (a probe decides); else the float kernels multiply rounded operands.
        bf16 = cfg["precisions"]["bfloat16"]
        assert bf16 in (("avx512_bf16", "avx512 (float32 products)") if "native" in TABLES
                        else (f"{cfg['isa']} (float32 products)",))


def test_unknown_or_missing_table_raises():
    with pytest.raises(ValueError, match="table must be"):
        _testing.bf16_round(np.zeros(1, np.float32), table="avx1024")
    for table in set(ALL_TABLES) - set(TABLES):
        with pytest.raises(ValueError, match=f"table '{table}'"):
            _testing.bf16_round(np.zeros(1, np.float32), table=table)


# ------------------------------------------------------------------------------------------------
# round and round_in_place
# ------------------------------------------------------------------------------------------------

SPECIAL_BITS = np.array([
    0x00000000, 0x80000000,  # +-0
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00400000,  # subnormals: -> +-0
    0x00800000, 0x80800000, 0x00807FFF, 0x00808000, 0x00818000,  # the smallest normals, ties
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF818000,  # ties to even
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,  # the largest: to inf, or not
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FC0FFFF, 0xFFFFFFFF,  # NaN
], np.uint32)


@pytest.mark.parametrize("table", TABLES)
def test_round_special_values(table):
    x = SPECIAL_BITS.view(np.float32)
    bits, values = _testing.bf16_round(x, table=table)
    expected = round_bits(x)
    assert np.array_equal(bits, expected), [hex(v) for v in bits]
    assert np.array_equal(values.view(np.uint32), expected.astype(np.uint32) << 16)
    # Spelled out: subnormals to signed zeros, NaN quiet with its sign, ties to even.
    named = dict(zip(SPECIAL_BITS.tolist(), bits.tolist()))
    assert named[0x00000001] == 0 and named[0x807FFFFF] == 0x8000
    assert named[0x7F800001] == 0x7FC0 and named[0xFF800001] == 0xFFC0
    assert named[0x3F808000] == 0x3F80 and named[0x3F818000] == 0x3F82
    assert named[0x3F808001] == 0x3F81 and named[0x7F7FFFFF] == 0x7F80


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100])
def test_round_random_bits_every_length(table, n):
    rng = np.random.default_rng(n)
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits, values = _testing.bf16_round(x, table=table)
    assert np.array_equal(bits, round_bits(x))
    assert np.array_equal(values.view(np.uint32), bits.astype(np.uint32) << 16)


@pytest.mark.parametrize("table", TABLES)
def test_round_vectors_of_normal_values_and_one_special_lane(table):
    # A vector whose lanes are all normal numbers or infinities is rounded by the addition alone;
    # one NaN, zero or subnormal lane among them sends the whole vector through every rule.
    normal = SPECIAL_BITS[7:24]
    x = np.resize(normal, 64)
    for lanes in (x, np.roll(x, 5)):
        bits, values = _testing.bf16_round(lanes.view(np.float32), table=table)
        assert np.array_equal(bits, round_bits(lanes.view(np.float32))), [hex(v) for v in bits]
    for special in SPECIAL_BITS[np.r_[0:7, 24:len(SPECIAL_BITS)]]:
        for at in (0, 3, 7, 12, 15, 31, 40, 63):
            lanes = x.copy()
            lanes[at] = special
            bits, values = _testing.bf16_round(lanes.view(np.float32), table=table)
            assert np.array_equal(bits, round_bits(lanes.view(np.float32))), (hex(special), at)
            assert np.array_equal(values.view(np.uint32), bits.astype(np.uint32) << 16)


def test_round_reference_agrees_with_ml_dtypes_on_normal_values():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    magnitude = x.view(np.uint32) & 0x7FFFFFFF
    normal = (magnitude >= 0x00800000) & (magnitude <= 0x7F800000)
    x = np.concatenate([x[normal], SPECIAL_BITS.view(np.float32)[7:24]])
    assert np.array_equal(round_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("table", TABLES)
def test_round_checks_its_argument(table):
    with pytest.raises(TypeError, match="bf16_round: x"):
        _testing.bf16_round(np.zeros(4, np.float64), table=table)
    with pytest.raises(ValueError, match="bf16_round: x"):
        _testing.bf16_round(np.zeros((2, 2), np.float32), table=table)
    with pytest.raises(ValueError, match="contiguous"):
        _testing.bf16_round(np.zeros(8, np.float32)[::2], table=table)


# ------------------------------------------------------------------------------------------------
# pack_pairs
# ------------------------------------------------------------------------------------------------


def pack_reference(x, scale):
    with np.errstate(all="ignore"):
        scaled = np.asarray(x, np.float32) * np.float32(scale)
    bits = round_bits(scaled).astype(np.uint32)
    if bits.shape[0] % 2:
        bits = np.concatenate([bits, np.zeros((1, bits.shape[1]), np.uint32)])
    return bits[0::2] | (bits[1::2] << 16)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("layout", ["rows", "transposed", "strided"])
@pytest.mark.parametrize("K", [1, 2, 3, 31, 32, 33, 64, 70])
@pytest.mark.parametrize("N", [1, 7, 8, 16, 17, 40])
def test_pack_pairs(table, layout, K, N):
    rng = np.random.default_rng(K * 100 + N)
    x = rng.standard_normal((K, N)).astype(np.float32) * 3
    if layout == "transposed":  # X(k, n) = src[n * ld + k]: the pairs adjacent in memory
        x = np.ascontiguousarray(x.T).T
    elif layout == "strided":
        big = np.zeros((2 * K, 3 * N), np.float32)
        big[::2, ::3] = x
        x = big[::2, ::3]
    for scale in (1.0, 0.125, 3.0):
        got = _testing.bf16_pack_pairs(x, scale, table=table)
        assert got.dtype == np.uint32 and got.shape == ((K + 1) // 2, N)
        assert np.array_equal(got, pack_reference(x, scale)), scale


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("transposed", [False, True])
def test_pack_pairs_special_values_and_odd_padding(table, transposed):
    # An odd K's last pair has a zero high half, whatever the scale (0 * inf would be NaN).
    values = SPECIAL_BITS.view(np.float32)
    x = np.resize(values, (33, 34)).astype(np.float32)
    if transposed:
        x = np.ascontiguousarray(x.T).T
    for scale in (1.0, -2.0, float("inf")):
        got = _testing.bf16_pack_pairs(x, scale, table=table)
        assert np.array_equal(got, pack_reference(x, scale)), scale
        assert not np.any(got[-1] >> 16)


def test_pack_pairs_checks_its_arguments():
    with pytest.raises(TypeError, match="bf16_pack_pairs: x"):
        _testing.bf16_pack_pairs(np.zeros((2, 2), np.float64))
    with pytest.raises(ValueError, match="negative strides"):
        _testing.bf16_pack_pairs(np.zeros((4, 4), np.float32)[::-1])


# ------------------------------------------------------------------------------------------------
# gemm
# ------------------------------------------------------------------------------------------------

INITS = ["zero", "accumulate", "scale_rows", "bias_columns", "bias_rows", "add_sum"]


def init_values_for(init, M, N, rng):
    if init in ("scale_rows", "bias_rows"):
        return rng.standard_normal(M).astype(np.float32)
    if init == "bias_columns":
        return rng.standard_normal(N).astype(np.float32)
    return None


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("M, N, K2", [(1, 1, 1), (12, 32, 32), (13, 17, 65), (25, 33, 130),
                                      (7, 16, 3), (40, 8, 64), (24, 48, 129), (5, 100, 20)])
def test_gemm_matches_the_exact_reference(table, init, M, N, K2):
    rng = np.random.default_rng(M * 1000 + N * 10 + K2)
    a = random_pairs(rng, (K2, M)).T.copy()  # (M, K2), row-major
    b = random_pairs(rng, (K2, N))
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    values = init_values_for(init, M, N, rng)
    got = run_gemm(table, a, b, init, c0, values)
    assert same_bits(got, gemm_reference(a, b, c0, init, values))


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("M, N, K2", [(128, 32, 32), (31, 16, 8), (12, 64, 70), (17, 33, 5),
                                      (16, 16, 64), (3, 32, 130)])
def test_gemm_column_major_and_strided_a(table, M, N, K2):
    # A(m, p) at a[m + p * M] (the flash tile's P.V: probabilities as pairs [p][query]), and at
    # a row stride that is no row's length.
    rng = np.random.default_rng(M + N + K2)
    a_cm = random_pairs(rng, (K2, M))  # (K2, M)
    b = random_pairs(rng, (K2, N))
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    expected = gemm_reference(a_cm.T, b, c0, "accumulate", None)
    assert same_bits(run_gemm(table, a_cm.T, b, "accumulate", c0), expected)
    wide = np.zeros((M, 3 * K2 + 1), np.uint32)
    wide[:, 1::3] = a_cm.T
    assert same_bits(run_gemm(table, wide[:, 1::3], b, "accumulate", c0), expected)
    b_wide = np.zeros((K2, N + 5), np.uint32)  # B and C rows further apart than N
    b_wide[:, :N] = b
    c_wide = np.zeros((M, N + 3), np.float32)
    c_wide[:, :N] = c0
    _testing.bf16_gemm(a_cm.T, b_wide[:, :N], c_wide[:, :N], "accumulate", table=table)
    assert same_bits(c_wide[:, :N], expected) and not np.any(c_wide[:, N:])


def test_all_tables_give_the_same_bits():
    rng = np.random.default_rng(11)
    for M, N, K2 in [(128, 32, 32), (61, 45, 200), (12, 768 // 8, 96)]:
        a = random_pairs(rng, (K2, M), scale=10.0).T.copy()
        b = random_pairs(rng, (K2, N), scale=0.1)
        results = [run_gemm(t, a, b, "bias_columns", init_values=np.ones(N, np.float32))
                   for t in TABLES]
        assert all(same_bits(r, results[0]) for r in results[1:])


def test_gemm_sums_are_float32_accurate():
    # Against float64 over the same bfloat16 operands: runs of 64 pairs keep the error of a long
    # sum near that of a short one.
    rng = np.random.default_rng(3)
    M, N, K2 = 16, 32, 512
    a = random_pairs(rng, (K2, M)).T.copy()
    b = random_pairs(rng, (K2, N))
    a_lo, a_hi = halves(a)
    b_lo, b_hi = halves(b)
    exact = a_lo.astype(np.float64) @ b_lo + a_hi.astype(np.float64) @ b_hi
    got = run_gemm(TABLES[-1], a, b, "zero")
    scale = np.abs(a_lo).astype(np.float64) @ np.abs(b_lo) + np.abs(a_hi).astype(np.float64) @ np.abs(b_hi)
    assert np.max(np.abs(got - exact) / scale) < 64 * 2.0**-24


@pytest.mark.parametrize("table", TABLES)
def test_gemm_propagates_nan_and_inf(table):
    rng = np.random.default_rng(4)
    M, N, K2 = 13, 40, 70
    a = random_pairs(rng, (K2, M)).T.copy()
    b = random_pairs(rng, (K2, N))
    a[2, 5] = (a[2, 5] & 0xFFFF) | (0x7FC0 << 16)  # NaN: row 2
    a[4, 66] = (a[4, 66] & 0xFFFF0000) | 0x7F80  # +inf: row 4, but inf * 0 is NaN
    b[66, 7] = b[66, 7] & 0xFFFF0000  # low half 0 in column 7
    got = run_gemm(table, a, b, "zero")
    expected = gemm_reference(a, b, np.zeros((M, N), np.float32), "zero", None)
    assert np.array_equal(np.isnan(got), np.isnan(expected)) and np.isnan(got[2]).all()
    assert np.isnan(got[4, 7]) and np.array_equal(got[4], expected[4], equal_nan=True)
    finite = np.isfinite(expected)
    assert same_bits(got[finite], expected[finite])


def test_native_table_flushes_subnormals():
    """vdpbf16ps takes subnormal operands as zero (the emulations do not): what the tables agree
    on ends there."""
    if "native" not in TABLES:
        pytest.skip("no AVX512_BF16")
    tiny = 0x0001  # the smallest bfloat16 subnormal
    a = np.array([[tiny | (0x3F80 << 16)]], np.uint32)  # low: subnormal, high: 1
    b = np.array([[0x7F00 | (0x3F80 << 16)]], np.uint32)  # low: 2^127, high: 1
    native = run_gemm("native", a, b, "zero")
    emulated = run_gemm(TABLES[-2], a, b, "zero")
    assert native[0, 0] == 1.0 and emulated[0, 0] > 1.0


def test_gemm_checks_its_arguments():
    a = np.zeros((4, 3), np.uint32)
    b = np.zeros((3, 5), np.uint32)
    c = np.zeros((4, 5), np.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        _testing.bf16_gemm(a, np.zeros((2, 5), np.uint32), c, "zero")
    with pytest.raises(TypeError, match="bf16_gemm: a"):
        _testing.bf16_gemm(a.astype(np.int32), b, c, "zero")
    with pytest.raises(TypeError, match="bf16_gemm: c"):
        _testing.bf16_gemm(a, b, c.astype(np.float64), "zero")
    with pytest.raises(ValueError, match="bf16_gemm: c: the array is read-only"):
        c_ro = c.copy()
        c_ro.flags.writeable = False
        _testing.bf16_gemm(a, b, c_ro, "zero")
    with pytest.raises(ValueError, match="bf16_gemm: b: the last dimension"):
        _testing.bf16_gemm(a, np.zeros((5, 3), np.uint32).T, c, "zero")
    with pytest.raises(ValueError, match="needs init_values"):
        _testing.bf16_gemm(a, b, c, "bias_rows")
    with pytest.raises(ValueError, match="must have 5 values"):
        _testing.bf16_gemm(a, b, c, "bias_columns", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="init must be"):
        _testing.bf16_gemm(a, b, c, "bogus")
    with pytest.raises(ValueError, match="repeat"):
        _testing.bf16_gemm(a, b, c, "zero", repeat=0)


# ------------------------------------------------------------------------------------------------
# Dispatch: ATTNX_ISA and show_config()["precisions"]
# ------------------------------------------------------------------------------------------------

CONFIG_SCRIPT = "import json, attnx; print(json.dumps(attnx.show_config()))"


def config_under(isa, products="pairs"):
    env = dict(os.environ, ATTNX_ISA=isa, ATTNX_BF16_PRODUCTS=products)
    return subprocess.run([sys.executable, "-c", CONFIG_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)


def test_show_config_names_each_precisions_kernel():
    cfg = attnx.show_config()
    precisions = cfg["precisions"]
    assert precisions["float32"] == precisions["float64"] == cfg["isa"]
    named = ("avx512_bf16", f"{cfg['isa']} (float32 products)", f"{cfg['isa']} (emulated)")
    assert precisions["bfloat16"] in named


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512_bf16"])
def test_float_products_run_on_each_levels_float_kernels(isa):
    proc = config_under(isa, "float")
    if {"avx512_bf16": "native"}.get(isa, isa) not in TABLES:
        assert proc.returncode != 0
        return
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cfg["precisions"]["bfloat16"] == f"{cfg['isa']} (float32 products)"


def test_unknown_bf16_products_raises_naming_the_choices():
    proc = config_under("scalar", " Pears ")
    assert proc.returncode != 0
    assert "ATTNX_BF16_PRODUCTS=' Pears ' is not known; use pairs or float" in proc.stderr


def _int8_kernels(isa):
    """show_config's int8 kernels at a level: vpdpbusd at the AVX-512 levels of a CPU with
    AVX512_VNNI, else AVX2's vpmaddubsw, or the scalar float kernels."""
    if isa.startswith("avx512") and "avx512_vnni" in _cpu_flags():
        return "avx512_vnni"
    return "scalar (float32 products)" if isa == "scalar" else "avx2 (vpmaddubsw)"


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512_bf16"])
def test_attnx_isa_picks_the_bfloat16_table(isa):
    proc = config_under(isa)
    table = {"avx512_bf16": "native"}.get(isa, isa)
    if table not in TABLES:
        assert proc.returncode != 0 and f"ATTNX_ISA='{isa}'" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout.strip().splitlines()[-1])
    # The float kernels at avx512_bf16 are the AVX-512 ones: "isa" names them.
    assert cfg["isa"] == ("avx512" if isa == "avx512_bf16" else isa)
    assert cfg["precisions"] == {
        "float32": cfg["isa"], "float64": cfg["isa"],
        "bfloat16": "avx512_bf16" if isa == "avx512_bf16" else f"{isa} (emulated)",
        "int8": _int8_kernels(isa)}


def test_best_level_runs_the_native_table_where_the_cpu_has_it():
    # ... and where its vdpbf16ps makes more products per second than the float32 multiply-adds
    # (a probe decides): else the float kernels multiply the rounded operands.
    if "ATTNX_ISA" in os.environ or "ATTNX_BF16_PRODUCTS" in os.environ:
        pytest.skip("ATTNX_ISA or ATTNX_BF16_PRODUCTS is set")
    bf16 = _core.precision_kernels()["bfloat16"]
    if "native" not in TABLES:
        assert bf16 == f"{_core.active_isa()} (float32 products)"
    else:
        assert bf16 in ("avx512_bf16", "avx512 (float32 products)")
