"""Widening of float16 / bfloat16 storage to float32, under every SIMD kernel.

``_testing.widen_16bit`` (private) runs the active float kernel table's ``widen_float16`` /
``widen_bfloat16``. The kernel is chosen once, at import, from ATTNX_ISA, so each kernel the
CPU supports is checked in one subprocess (as in test_kernels.py): every one of the 65,536
bit patterns of both formats, lengths 0..70 from every start offset modulo 16 elements (so
unaligned starts and every partial tail), and sources that end or start at a page boundary
next to an unreadable page, where a read outside src[0..n) would crash the subprocess.

Expected values: NumPy's float16 -> float32 conversion, and for bfloat16 the bits shifted into
the top half of a float32. Non-NaN results must be bit-for-bit equal; a NaN must come out NaN
with the same sign and payload, made quiet (the quiet bit set), which is what x86's vcvtph2ps
does, so every kernel gives the same bits.
"""

from __future__ import annotations

import functools
import json
import os
import textwrap

import numpy as np
import pytest

import attnx
from attnx import _testing
from conftest import run_under_isa, usable_isas

FORMATS = ["float16", "bfloat16"]
QUIET = np.uint32(0x00400000)


def expected_table():
    """float32 values of every bit pattern, per format (index = the 16-bit pattern)."""
    u = np.arange(65536, dtype=np.uint16)
    return {
        "float16": u.view(np.float16).astype(np.float32),
        "bfloat16": (u.astype(np.uint32) << 16).view(np.float32),
    }


def mismatch(got, want):
    """None if got matches want under the rule above, else a short description."""
    if got.dtype != np.float32 or got.shape != want.shape:
        return f"dtype {got.dtype} shape {got.shape}, expected float32 {want.shape}"
    g, w = got.view(np.uint32), want.view(np.uint32)
    nan = np.isnan(want)
    bad = np.flatnonzero((g != w) & ~nan)
    if bad.size == 0:
        bad = np.flatnonzero((g != (w | QUIET)) & nan)
    if bad.size:
        i = bad[0]
        return f"{bad.size} wrong, first at {i}: got {g[i]:#010x}, expected {w[i]:#010x}"
    return None


# Runs in a subprocess under one ATTNX_ISA; prints a JSON line.
SWEEP = textwrap.dedent(
    """
    import ctypes, hashlib, json, mmap, sys
    import numpy as np
    from attnx import _core, _testing
    sys.path.insert(0, sys.argv[1])
    from test_half_kernels import FORMATS, expected_table, mismatch

    want = expected_table()
    failures = []
    digests = {}

    def check(name, src, fmt):
        problem = mismatch(_testing.widen_16bit(src, fmt), want[fmt][src.astype(np.intp)])
        if problem:
            failures.append(f"{name} {fmt}: {problem}")

    every = np.arange(65536, dtype=np.uint16)
    for fmt in FORMATS:
        got = _testing.widen_16bit(every, fmt)
        problem = mismatch(got, want[fmt])
        if problem:
            failures.append(f"all patterns {fmt}: {problem}")
        digests[fmt] = hashlib.sha256(got.tobytes()).hexdigest()

    # Lengths 0..70 from starts 0..16: every alignment to a 16- or 32-byte vector and every
    # tail length of 8- and 16-lane vectors. The pool mixes specials with random patterns.
    rng = np.random.default_rng(5)
    specials = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00,
                0x7C01, 0x7E00, 0xFFFF, 0x007F, 0x0080, 0x7F7F, 0x7F80, 0xFF80, 0x7F81, 0x7FC0]
    pool = rng.integers(0, 65536, 128).astype(np.uint16)
    pool[rng.choice(128, len(specials), replace=False)] = specials
    for start in range(17):
        for n in range(71):
            for fmt in FORMATS:
                check(f"start {start} length {n}", pool[start:start + n], fmt)

    # Sources next to an unreadable page (Linux): [no access][readable][no access].
    if sys.platform.startswith("linux"):
        page = mmap.PAGESIZE
        buf = mmap.mmap(-1, 3 * page)
        raw = np.frombuffer(buf, dtype=np.uint8)
        mid = raw[page:2 * page].view(np.uint16)
        mid[:] = rng.integers(0, 65536, mid.size).astype(np.uint16)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = raw.ctypes.data
        if libc.mprotect(base, page, 0) == 0 and libc.mprotect(base + 2 * page, page, 0) == 0:
            for n in range(71):
                for fmt in FORMATS:
                    check(f"length {n} ending at a page end", mid[mid.size - n:], fmt)
                    check(f"length {n} starting at a page start", mid[:n], fmt)
        libc.mprotect(base, 3 * page, 3)  # read + write again before the map is freed

    print(json.dumps({"isa": _core.active_isa(), "failures": failures, "digests": digests}))
    """
)


@functools.lru_cache(maxsize=None)
def run_sweep(isa):
    return run_under_isa(isa, SWEEP, os.path.dirname(os.path.abspath(__file__)), timeout=300)


@pytest.mark.parametrize("isa", usable_isas())
def test_widening_is_exact(isa):
    result = run_sweep(isa)
    assert result["isa"] == isa
    assert result["failures"] == []


def test_every_kernel_gives_the_same_bits():
    digests = {isa: run_sweep(isa)["digests"] for isa in usable_isas()}
    assert len({json.dumps(d, sort_keys=True) for d in digests.values()}) == 1, digests


def _misaligned(a):
    buf = bytearray(a.nbytes + 1)
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1)
    out[...] = a
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "layout",
    ["strided", "negative", "big_endian", "misaligned", "readonly", "empty", "single"],
)
def test_any_layout_of_the_source(layout, fmt):
    rng = np.random.default_rng(11)
    base = rng.integers(0, 65536, 3 * 37).astype(np.uint16)
    if layout == "strided":
        src = base[::3]
    elif layout == "negative":
        src = base[::-2]
    elif layout == "big_endian":
        src = base.astype(">u2")
    elif layout == "misaligned":
        src = _misaligned(base)
    elif layout == "readonly":
        src = base.copy()
        src.flags.writeable = False
    elif layout == "empty":
        src = base[5:5]
    else:
        src = base[7:8]
    before = src.copy()
    want = expected_table()[fmt][np.asarray(src, dtype=np.uint16).astype(np.intp)]
    got = _testing.widen_16bit(src, fmt)
    assert mismatch(got, want) is None, mismatch(got, want)
    assert got.flags.c_contiguous and not np.shares_memory(got, src)
    np.testing.assert_array_equal(src, before)


def test_bad_arguments():
    u = np.zeros(4, dtype=np.uint16)
    with pytest.raises(ValueError, match="format"):
        _testing.widen_16bit(u, "float8")
    with pytest.raises(TypeError, match="uint16"):
        _testing.widen_16bit(np.zeros(4, dtype=np.int16), "float16")
    with pytest.raises(TypeError, match="uint16"):
        _testing.widen_16bit(np.zeros(4, dtype=np.float16), "float16")
    with pytest.raises(ValueError, match="1-D"):
        _testing.widen_16bit(np.zeros((2, 2), dtype=np.uint16), "bfloat16")
