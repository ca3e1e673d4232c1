"""set_num_threads with every kind of value (counts out of range, floats, strings, NumPy
scalars, arrays): a refused value leaves the count as it was, the count stays within bounds, and
a computation with the new count gives the bits of the usual one.
"""

from __future__ import annotations

import os

import numpy as np

import attnx

from .common import BASE_THREADS, Disallowed, Provider, call


def fuzz_set_num_threads(p: Provider):
    n = p.choice([0, -1, 1, 2, 3, 64, 1000, 10**6, 2**31 - 1, 2**31, 2**63, -(2**63), 1.0, 2.5, "2",
                  None, True, False, np.int8(3), np.uint64(2**64 - 1), np.int64(4), np.float64(2.0),
                  np.array(2), np.array([2]), [2], object()])
    before = attnx.get_num_threads()
    ok, _ = call("set_num_threads", lambda: attnx.set_num_threads(n))
    now = attnx.get_num_threads()
    if not ok and now != before:
        raise Disallowed("set_num_threads raised but changed the count")
    if not (isinstance(now, int) and 1 <= now <= max(64, 4 * (os.cpu_count() or 1))):
        raise Disallowed(f"get_num_threads() = {now!r} after set_num_threads({n!r})")
    # A computation with the new count gives the numbers of the usual one.
    rng = np.random.default_rng(p.seed())
    q = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 700, 16)).astype(np.float32)
    got = attnx.scaled_dot_product_attention(q, k, k)
    attnx.set_num_threads(BASE_THREADS)
    if not np.array_equal(got, attnx.scaled_dot_product_attention(q, k, k)):
        raise Disallowed(f"a result depends on the thread count ({now})")
