"""The shares of the parallel loops (csrc/dispatch/balanced_shares.h, worker_pool.h).

Each thread starts on its own contiguous share of the iterations and, when done, takes the back
half of the largest share left. These tests check that every iteration runs exactly once, that
a slowed thread's share is taken over, that a thread runs its own share when none is slowed,
and that the attention calls built on it give the same bits while threads are slowed unevenly.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

import attnx
from attnx import _testing
from conftest import assert_identical, num_threads


@pytest.mark.parametrize("threads", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1000])
def test_every_iteration_runs_exactly_once(n, threads):
    runs, ran_on = _testing.trace_balanced_loop(n, threads)
    assert runs == [1] * n
    assert all(0 <= t < threads for t in ran_on)


def test_every_iteration_runs_once_with_a_slow_thread():
    runs, ran_on = _testing.trace_balanced_loop(200, 4, microseconds=50, slow_thread=2,
                                             slow_microseconds=2000)
    assert runs == [1] * 200
    assert set(ran_on) <= {0, 1, 2, 3}


def test_a_slowed_threads_share_is_taken_over():
    # Thread 1 takes 10 ms an iteration, thread 0 1 ms: by the time thread 0 has run its own
    # 32 iterations, thread 1 has run a few of its 32, and thread 0 takes over the rest. A
    # static schedule would leave thread 0 exactly its own 32.
    runs, ran_on = _testing.trace_balanced_loop(64, 2, microseconds=1000, slow_thread=1,
                                             slow_microseconds=10000)
    assert runs == [1] * 64
    assert ran_on[:32] == [0] * 32
    assert collections.Counter(ran_on)[0] > 32


def test_each_thread_runs_its_own_share():
    # Equal iterations: each thread runs its share from its front (what it reads stays in its
    # core's cache); only the ends, if any, move. Thread 1 would have to start more than 64 ms
    # late to lose most of its share.
    runs, ran_on = _testing.trace_balanced_loop(64, 2, microseconds=2000)
    assert runs == [1] * 64
    assert ran_on[0] == 0
    assert collections.Counter(ran_on[:32])[0] >= 24
    assert collections.Counter(ran_on[32:])[1] >= 16


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1, 2), "n must be in"),
        ((10, 0), "threads must be"),
        ((10, 2, -5), "microseconds must be in"),
    ],
)
def test_trace_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        _testing.trace_balanced_loop(*args)


def _calls(rng):
    """(name, call(out)) pairs covering the loops that take the balanced schedule."""
    q = rng.standard_normal((2, 6, 200, 32)).astype(np.float32)
    k = rng.standard_normal((2, 6, 300, 32)).astype(np.float32)
    v = rng.standard_normal((2, 6, 300, 32)).astype(np.float32)
    qd = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    kd = rng.standard_normal((1, 8, 3000, 64)).astype(np.float32)
    vd = rng.standard_normal((1, 8, 3000, 64)).astype(np.float32)
    mha = attnx.MultiheadAttention(256, 8, batch_first=True, dtype=np.float32)
    state = {name: (0.05 * rng.standard_normal(p.shape)).astype(np.float32)
             for name, p in mha.state_dict().items()}
    mha.load_state_dict(state)
    x_many = rng.standard_normal((4, 150, 256)).astype(np.float32)
    x_few = rng.standard_normal((1, 3, 256)).astype(np.float32)
    x_some = rng.standard_normal((1, 40, 256)).astype(np.float32)
    return [
        ("sdpa tiles", (2, 6, 200, 32),
         lambda out: attnx.scaled_dot_product_attention(q, k, v, out=out)),
        ("sdpa causal", (2, 6, 200, 32),
         lambda out: attnx.scaled_dot_product_attention(q, k[:, :, :200], v[:, :, :200],
                                                        is_causal=True, out=out)),
        ("sdpa decode chunks", (1, 8, 1, 64),
         lambda out: attnx.scaled_dot_product_attention(qd, kd, vd, out=out)),
        ("mha many rows", None, lambda out: mha(x_many, x_many, x_many, need_weights=False)[0]),
        ("mha few rows", None, lambda out: mha(x_few, x_few, x_few, need_weights=False)[0]),
        ("mha some rows", None, lambda out: mha(x_some, x_some, x_some, need_weights=False)[0]),
    ]


def test_same_bits_while_threads_are_slowed_unevenly(rng):
    # More threads than cores, and a busy Python thread competing for one of them: the threads
    # progress unevenly, shares are taken from each other, and every output must still be the
    # one-thread result (out starts as NaN, so a skipped iteration would show).
    calls = _calls(rng)
    expected = {}
    with num_threads(1):
        for name, shape, call in calls:
            out = None if shape is None else np.full(shape, np.nan, np.float32)
            expected[name] = np.array(call(out))
    stop = threading.Event()

    def busy():
        x = 0
        while not stop.is_set():
            x += 1

    neighbour = threading.Thread(target=busy)
    neighbour.start()
    try:
        for threads in (2, 8):
            with num_threads(threads):
                for _ in range(2):
                    for name, shape, call in calls:
                        out = None if shape is None else np.full(shape, np.nan, np.float32)
                        got = np.array(call(out))
                        assert_identical(got, expected[name], err_msg=f"{name}, {threads} threads")
    finally:
        stop.set()
        neighbour.join()
