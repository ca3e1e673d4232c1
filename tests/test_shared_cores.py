"""Threads on a machine with other work (csrc/dispatch/worker_pool.h, core_waits.h).

A loop's iterations are claimed by the threads that run; a worker that the OS keeps waiting
never holds a call up, and one whose core another busy thread shares keeps its claims short.
These tests check the rule that judges a core shared, and that every result stays the
one-thread result, bit for bit, beside busy processes on the same cores.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import attnx
from attnx import _testing
from conftest import assert_identical, num_threads

LONG = 600  # us: a round that waited longer than CoreSharing::kLongWait (500 us)
SHORT = 50


def test_a_single_long_wait_never_says_shared():
    # A quiet machine: a timer or a kernel thread now and then, each alone.
    rounds = [(SHORT, i) for i in range(200)]
    for i in (20, 60, 100, 140):
        rounds[i] = (LONG, i)
    assert not any(_testing.core_sharing(rounds))


def test_two_long_waits_close_together_say_shared():
    got = _testing.core_sharing([(SHORT, 0), (LONG, 1), (SHORT, 2), (LONG, 3), (SHORT, 4)])
    assert got == [False, False, False, True, True]


def test_shared_holds_while_long_waits_come_and_ends_200_ms_after_the_last():
    rounds = [(LONG, 0), (LONG, 1)]
    # Long waits far apart (every 150 ms, alone): each renews the judgement.
    rounds += [(LONG if i % 150 == 0 else SHORT, 2 + i) for i in range(1, 600)]
    last_long = max(at for waited, at in rounds if waited == LONG)
    rounds += [(SHORT, last_long + 199), (SHORT, last_long + 201)]
    got = _testing.core_sharing(rounds)
    assert all(got[1:-1])
    assert got[-1] is False


def test_bad_rounds_are_refused():
    with pytest.raises(ValueError, match="core_sharing"):
        _testing.core_sharing([(-1.0, 0.0)])


def test_wait_clock_never_goes_back():
    first = _testing.core_wait_ns()
    sum(range(200000))
    assert _testing.core_wait_ns() >= first >= 0


def _busy_processes(count):
    """`count` processes spinning on this process's cores."""
    code = "while True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    if hasattr(os, "sched_getaffinity"):
        cores = os.sched_getaffinity(0)
        for proc in procs:
            os.sched_setaffinity(proc.pid, cores)
    return procs


def test_same_bits_beside_busy_processes(rng):
    # As many busy processes as cores: every worker shares its core, is kept waiting, claims
    # for short stretches or arrives after the caller has run everything. Outputs start as NaN,
    # so a skipped iteration would show; each must be the one-thread result.
    q = rng.standard_normal((2, 6, 200, 32)).astype(np.float32)
    kd = rng.standard_normal((1, 8, 3000, 64)).astype(np.float32)
    qd = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    mha = attnx.MultiheadAttention(256, 8, batch_first=True, seed=0)
    x = rng.standard_normal((4, 150, 256)).astype(np.float32)
    layer = attnx.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, seed=0)
    xl = rng.standard_normal((4, 100, 64)).astype(np.float32)
    calls = [
        ("sdpa", (2, 6, 200, 32), lambda out: attnx.scaled_dot_product_attention(q, q, q, out=out)),
        ("decode", (1, 8, 1, 64), lambda out: attnx.scaled_dot_product_attention(qd, kd, kd, out=out)),
        ("mha", None, lambda out: mha(x, x, x, need_weights=False)[0]),
        ("layer", None, lambda out: layer(xl)),
    ]
    expected = {}
    with num_threads(1):
        for name, shape, call in calls:
            out = None if shape is None else np.full(shape, np.nan, np.float32)
            expected[name] = np.array(call(out))
    procs = _busy_processes(os.cpu_count() or 1)
    try:
        for threads in (2, 4):
            with num_threads(threads):
                for _ in range(20):
                    for name, shape, call in calls:
                        out = None if shape is None else np.full(shape, np.nan, np.float32)
                        assert_identical(np.array(call(out)), expected[name],
                                         err_msg=f"{name}, {threads} threads")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
