"""Concurrency: many Python threads on every entry point at once, the GIL, thread counts, fork.

* Every entry point (sdpa on each of its paths, multi_head_attention_forward, the module and
  its load_state_dict, the private _core functions, the runtime functions) called from many
  Python threads at once, on shared and on per-thread inputs, while another thread keeps
  changing ``set_num_threads``: every result equals the serial one bit for bit.
* The GIL is released during every compute call: another Python thread makes steady
  progress while one call runs.
* ``set_num_threads`` with absurd counts is capped, not fatal.
* ``os.fork()`` after attnx has run its OpenMP threads: the child computes the same numbers
  (libgomp's pool of the forking thread is stale in the child; attnx runs that thread's
  calls alone there), in a plain fork, a multiprocessing "fork" pool, and a fork from a
  worker thread.

The default run uses 8 threads x 40 calls; the ``thorough`` profile (see _hardening.py)
16 threads x 400 calls.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import attnx
from _hardening import record, scaled, under_address_sanitizer
from conftest import core_mha, core_sdpa, assert_identical, mha_args, mha_mask, randn, sdpa_mask

pytestmark = pytest.mark.hardening

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(attnx.__file__)))


def run_child(code, timeout=120, **env_overrides):
    """Runs `code` in a fresh interpreter in its own process group. On a timeout the whole
    group is killed (a hung forked grandchild included) and the test fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PYTHON_DIR, env.get("PYTHONPATH", "")] if p)
    env.update(env_overrides)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the child did not finish in {timeout} s (hung?)\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ---------------------------------------------------------------------------------------------
# Jobs: one per entry point and path; each returns a tuple of arrays
# ---------------------------------------------------------------------------------------------


def make_inputs(seed, dtype=np.float32):
    """The arrays the jobs read (a fresh set per seed)."""
    rng = np.random.default_rng(seed)
    d = {
        # Big enough for parallel regions (work > 2^20), small enough for many calls.
        "q": randn(rng, (2, 4, 48, 32), dtype),
        "k": randn(rng, (2, 4, 80, 32), dtype),
        "v": randn(rng, (2, 4, 80, 16), dtype),
        "mask": sdpa_mask(rng, "float", (1, 4, 48, 80), dtype),
        "bmask": sdpa_mask(rng, "bool", (48, 80)),
        "q1": randn(rng, (1, 2, 1, 64), dtype),  # decoding: the chunked row path
        "k1": randn(rng, (1, 2, 1500, 64), dtype),
        "kg": randn(rng, (2, 2, 80, 32), dtype),  # grouped-query keys/values
        "vg": randn(rng, (2, 2, 80, 16), dtype),
    }
    args = mha_args(rng, L=24, S=40, N=2, E=32, H=4, dtype=dtype, bias_kv=True, add_zero_attn=True)
    args["key_padding_mask"] = mha_mask(rng, "bool", (2, 40))
    args["attn_mask"] = mha_mask(rng, "float", (24, 40), dtype)
    d["mha"] = args
    module = attnx.MultiheadAttention(32, 4, batch_first=True, dtype=dtype, seed=seed)
    d["module"] = module
    d["state"] = attnx.MultiheadAttention(32, 4, batch_first=True, dtype=dtype, seed=seed + 1).state_dict()
    d["x"] = randn(rng, (2, 24, 32), dtype)
    d["kpm"] = mha_mask(rng, "bool", (2, 24))
    return d


def _core_sdpa(d):
    out = np.empty(d["q"].shape[:3] + (d["v"].shape[3],), d["q"].dtype)
    weights = np.empty(d["q"].shape[:3] + (d["k"].shape[2],), d["q"].dtype)
    core_sdpa(d["q"], d["k"], d["v"], np.broadcast_to(d["mask"], (2, 4, 48, 80)), False, 0.2, out, weights)
    return out, weights


def _core_mha(d):
    a = d["mha"]
    E = 32
    w = a["in_proj_weight"]
    b = a["in_proj_bias"]
    q, k, v = (np.ascontiguousarray(a[n].transpose(1, 0, 2)) for n in ("query", "key", "value"))
    N, L, S = q.shape[0], q.shape[1], k.shape[1]
    out = np.empty((N, L, E), q.dtype)
    weights = np.empty((N, L, S), q.dtype)
    core_mha(4, q, k, v, w[:E], w[E:2 * E], w[2 * E:], b[:E], b[E:2 * E], b[2 * E:], None, None,
              False, None, None, None, None, True, a["out_proj_weight"], a["out_proj_bias"], out,
              weights, True)
    return out, weights


def _load_state_then_forward(d):
    # A module of the calling thread's own: load_state_dict, then forward.
    m = attnx.MultiheadAttention(32, 4, batch_first=True, dtype=d["x"].dtype, seed=0)
    m.load_state_dict(d["state"])
    return m(d["x"], d["x"], d["x"], need_weights=False)[0], *m.state_dict().values()


def _runtime(d):
    cfg = attnx.show_config()
    assert cfg["threads"] >= 1 and attnx.get_num_threads() >= 1
    return (np.array([cfg["version"] == attnx.__version__]),)


JOBS = {
    "sdpa_plain": lambda d: (attnx.scaled_dot_product_attention(d["q"], d["k"], d["v"]),),
    "sdpa_causal": lambda d: (attnx.scaled_dot_product_attention(d["q"], d["k"], d["v"], is_causal=True),),
    "sdpa_float_mask": lambda d: (attnx.scaled_dot_product_attention(d["q"], d["k"], d["v"], d["mask"], scale=0.3),),
    "sdpa_bool_mask_out": lambda d: (attnx.scaled_dot_product_attention(
        d["q"], d["k"], d["v"], d["bmask"], out=np.empty((2, 4, 48, 16), d["q"].dtype)),),
    "sdpa_gqa": lambda d: (attnx.scaled_dot_product_attention(d["q"], d["kg"], d["vg"], enable_gqa=True),),
    "sdpa_decode": lambda d: (attnx.scaled_dot_product_attention(d["q1"], d["k1"], d["k1"]),),
    "mha_weights": lambda d: attnx.multi_head_attention_forward(**d["mha"]),
    "mha_no_weights": lambda d: attnx.multi_head_attention_forward(
        **{**d["mha"], "need_weights": False, "average_attn_weights": False})[:1],
    "module_plain": lambda d: d["module"](d["x"], d["x"], d["x"]),
    "module_masked": lambda d: d["module"](d["x"], d["x"], d["x"], key_padding_mask=d["kpm"],
                                           average_attn_weights=False, is_causal=True),
    "module_load_state_dict": _load_state_then_forward,
    "core_sdpa": _core_sdpa,
    "core_sdpa_plain": lambda d: (attnx.scaled_dot_product_attention(d["q"], d["k"], d["v"], is_causal=True),),
    "core_mha": _core_mha,
    "runtime": _runtime,
}


def run_all(d):
    return {name: job(d) for name, job in JOBS.items()}


def assert_same_results(got, expected, where):
    assert len(got) == len(expected), where
    for a, b in zip(got, expected):
        if a is None or b is None:
            assert a is None and b is None, where
        else:
            assert_identical(np.asarray(a), np.asarray(b), err_msg=where)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_every_entry_point_from_many_threads_while_thread_count_changes(threads, dtype):
    n_threads = scaled(8, 16)
    calls_per_thread = scaled(40, 400)
    shared = make_inputs(1, dtype)
    own = [make_inputs(100 + t, dtype) for t in range(n_threads)]
    expected_shared = run_all(shared)  # serial, in this thread
    expected_own = [run_all(d) for d in own]
    for name, res in expected_shared.items():
        assert res is not None and len(res) >= 1, name

    barrier = threading.Barrier(n_threads + 1)
    stop = threading.Event()
    errors = []
    done_calls = [0] * n_threads
    switches = [0]

    def worker(t):
        rng = np.random.default_rng(t)
        names = list(JOBS)
        try:
            barrier.wait()
            for i in range(calls_per_thread):
                name = names[int(rng.integers(len(names)))]
                use_shared = i % 2 == 0
                d = shared if use_shared else own[t]
                expected = (expected_shared if use_shared else expected_own[t])[name]
                assert_same_results(JOBS[name](d), expected, f"thread {t} call {i} {name}")
                done_calls[t] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def switcher():
        barrier.wait()
        n = 0
        while not stop.is_set():
            attnx.set_num_threads(1 + n % 4)
            n += 1
            switches[0] = n
            time.sleep(0.0005)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    sw = threading.Thread(target=switcher)
    for th in pool + [sw]:
        th.start()
    for th in pool:
        th.join()
    stop.set()
    sw.join()
    if errors:
        raise errors[0]
    total = sum(done_calls)
    assert total == n_threads * calls_per_thread
    assert switches[0] > 1
    record(f"concurrency: every entry point ({np.dtype(dtype).name})", threads=n_threads,
           calls_per_thread=calls_per_thread, total_calls=total, entry_points=len(JOBS),
           set_num_threads_changes=switches[0])


def test_separate_modules_load_state_dict_concurrently():
    # Each thread loads its own module from a shared state_dict and from its own, repeatedly.
    n_threads = scaled(8, 16)
    rounds = scaled(20, 200)
    source = [attnx.MultiheadAttention(16, 2, add_bias_kv=True, seed=s) for s in range(4)]
    states = [m.state_dict() for m in source]
    x = np.random.default_rng(0).standard_normal((5, 2, 16)).astype(np.float32)
    expected = [m(x, x, x) for m in source]
    errors = []

    def worker(t):
        try:
            m = attnx.MultiheadAttention(16, 2, add_bias_kv=True, seed=100 + t)
            for r in range(rounds):
                s = (t + r) % len(states)
                m.load_state_dict(states[s])
                out, w = m(x, x, x)
                assert_identical(out, expected[s][0])
                assert_identical(w, expected[s][1])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------------
# The GIL is released while attnx computes
# ---------------------------------------------------------------------------------------------


def _long_call(entry, size):
    """A call of one compute entry point; `size` (1, 2, 4, ...) scales its work."""
    rng = np.random.default_rng(0)
    f = np.float32
    L = 256 * size
    q = randn(rng, (1, 4, L, 64), f)
    if entry.startswith("sdpa") or entry.startswith("core_sdpa"):
        mask = sdpa_mask(rng, "float", (1, 1, L, L), f) if entry == "sdpa_general" else None
        out = np.empty((1, 4, L, 64), f)
        return {
            "sdpa_plain": lambda: attnx.scaled_dot_product_attention(q, q, q),
            "sdpa_general": lambda: attnx.scaled_dot_product_attention(q, q, q, mask, scale=0.1),
            "core_sdpa": lambda: core_sdpa(q, q, q, None, True, 0.1, out, None),
            "core_sdpa_plain": lambda: attnx.scaled_dot_product_attention(q, q, q),
        }[entry]
    x = randn(rng, (size, 256, 256), f)
    if entry == "module":
        m = attnx.MultiheadAttention(256, 8, batch_first=True, seed=0)
        return lambda: m(x, x, x)
    args = mha_args(rng, L=256, S=256, N=size, E=256, H=8, dtype=f, batch_first=True)
    args["query"] = args["key"] = args["value"] = x
    return lambda: attnx.multi_head_attention_forward(**args)


def _seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def spinner_pause_during(call, held, tries=3):
    """(call seconds, longest pause of a spinning Python thread during it, its steps then).

    Of up to `tries` calls (the machine may be busy, and the spinner or the caller may wait for
    a core), the one that speaks most for `held`: the longest pause for the share of the call
    when the GIL should be held, the shortest when it should be released."""
    stamps = []
    done = threading.Event()

    def spin():
        while not done.is_set():
            stamps.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    spinner = threading.Thread(target=spin)
    spinner.start()
    results = []
    try:
        for _ in range(tries):
            time.sleep(0.02)
            start = time.perf_counter()
            call()
            end = time.perf_counter()
            inside = [s for s in stamps[-2000000:] if start <= s <= end]
            points = [start] + inside + [end]
            longest_pause = max(b - a for a, b in zip(points, points[1:]))
            results.append((end - start, longest_pause, len(inside)))
            if held and longest_pause > 0.9 * (end - start):
                break
            if not held and longest_pause < 0.5 * (end - start) and len(inside) > 100:
                break
    finally:
        done.set()
        spinner.join()
        sys.setswitchinterval(old)
    return (max if held else min)(results, key=lambda r: r[1] / r[0])


def test_the_gil_probe_sees_a_held_gil():
    # sum() over a range runs in C without releasing the GIL: the spinner stops for it, all but
    # the moments around the call's start and end, when either thread may wait for a core
    # (0.87 of a 58 ms call once, in a suite run beside another on two cores).
    n = 1_000_000
    while True:
        start = time.perf_counter()
        sum(range(n))
        if time.perf_counter() - start > 0.1 or n > 10**9:
            break
        n *= 2
    duration, pause, _ = spinner_pause_during(lambda: sum(range(n)), held=True)
    assert pause > 0.8 * duration, (duration, pause)


GIL_ENTRIES = ["sdpa_plain", "sdpa_general", "core_sdpa", "core_sdpa_plain", "mha", "module"]


@pytest.mark.parametrize("entry", GIL_ENTRIES)
def test_gil_is_released_during_each_call(threads, entry):
    """While one thread is inside a call, a Python thread keeps running: its longest pause
    during the call is a small part of the call. Were the GIL held, it would stop for the
    whole call (it can only run between bytecodes of the calling thread)."""
    attnx.set_num_threads(1)  # leave the other core to the spinner
    size = 1
    while True:  # a call of 0.1 s at least, whatever the kernel's speed
        call = _long_call(entry, size)
        call()  # also warms up (scratch, pools)
        # The fastest of three: one call slowed by a busy machine must not stop the growth early.
        if min(_seconds(call) for _ in range(3)) > 0.1 or size >= 256:
            break
        size *= 2
    duration, pause, count = spinner_pause_during(call, held=False)
    assert duration > 0.05, f"{entry}: the call ({duration:.3f} s) was too short to tell"
    assert pause < 0.5 * duration and count > 100, (entry, duration, pause, count)
    record(f"GIL released: {entry}", call_seconds=round(duration, 3),
           spinner_longest_pause_seconds=round(pause, 4), spinner_steps_during_call=count)


# ---------------------------------------------------------------------------------------------
# set_num_threads: absurd counts are capped, never fatal
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1000, 100_000, 2**31 - 1])
def test_huge_thread_counts_are_capped(n):
    """Regression: set_num_threads(100000) then a (2, 4, 256, 64) sdpa call crashed the
    process (SIGSEGV: libgomp builds a team's start data on the caller's stack), and
    set_num_threads(2**31 - 1) made the same small call raise MemoryError (scratch for
    2^31 - 1 threads). The count used is now capped (at max(64, 4 x CPUs))."""
    code = f"""
        import numpy as np, attnx
        rng = np.random.default_rng(0)
        q = rng.standard_normal((2, 4, 256, 64)).astype(np.float32)
        x = rng.standard_normal((64, 4, 64)).astype(np.float32)
        m = attnx.MultiheadAttention(64, 4, seed=0)
        attnx.set_num_threads(1)
        one = attnx.scaled_dot_product_attention(q, q, q), m(x, x, x)[0]
        attnx.set_num_threads({n})
        n_used = attnx.get_num_threads()
        many = attnx.scaled_dot_product_attention(q, q, q), m(x, x, x)[0]
        same = all(np.array_equal(a, b) for a, b in zip(one, many))
        print(n_used, same)
    """
    proc = run_child(code, timeout=300)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    n_used, same = proc.stdout.split()
    assert same == "True"
    assert 1 <= int(n_used) <= max(64, 4 * (os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------
# fork
# ---------------------------------------------------------------------------------------------

FORK_PRELUDE = """
    import os, sys, threading
    import numpy as np, attnx
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 200, 32)).astype(np.float32)
    x = rng.standard_normal((40, 3, 32)).astype(np.float32)
    m = attnx.MultiheadAttention(32, 4, seed=0)
    def compute():
        return (attnx.scaled_dot_product_attention(q, q, q), attnx.scaled_dot_product_attention(q[:, :, :1], q, q),
                *m(x, x, x))
    def same(a, b):
        return all(np.array_equal(u, v) for u, v in zip(a, b))
    attnx.set_num_threads({threads})
    expected = compute()  # the parent has now run OpenMP teams of {threads} threads
"""


@pytest.mark.parametrize("threads_before", [1, 2, 4])
def test_fork_after_parallel_calls(threads_before):
    """Regression: with 2 or more threads, a child forked after attnx had computed hung
    forever in its first call (libgomp's pool of the forking thread lists the parent's
    worker threads, which do not exist in the child)."""
    code = FORK_PRELUDE.format(threads=threads_before) + """
    pid = os.fork()
    if pid == 0:
        ok = same(compute(), expected)
        # A thread the child starts has a fresh pool and may use several threads.
        box = []
        t = threading.Thread(target=lambda: box.append(compute()))
        t.start(); t.join()
        ok = ok and same(box[0], expected)
        # The child may fork again.
        pid2 = os.fork()
        if pid2 == 0:
            os._exit(0 if same(compute(), expected) else 4)
        _, st = os.waitpid(pid2, 0)
        ok = ok and os.waitstatus_to_exitcode(st) == 0
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
    print("parent", same(compute(), expected))
    """
    proc = run_child(code, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["child", "0", "parent", "True"]


def test_multiprocessing_fork_pool():
    code = FORK_PRELUDE.format(threads=2) + """
    import multiprocessing as mp
    def work(i):
        return same(compute(), expected)
    if __name__ == "__main__":
        with mp.get_context("fork").Pool(3) as pool:
            print(all(pool.map(work, range(9))))
    """
    proc = run_child(code, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "True"


@pytest.mark.skipif(
    under_address_sanitizer(),
    reason="GCC 12's ASan runtime does not lock its allocator around fork(): a fork while another "
    "thread is inside the allocator leaves its lock held in the child, whose first allocation hangs")
def test_fork_from_a_worker_thread_while_another_computes():
    code = FORK_PRELUDE.format(threads=2) + """
    stop = threading.Event()
    def busy():
        while not stop.is_set():
            compute()
    bg = threading.Thread(target=busy)
    bg.start()
    box = []
    def forker():
        compute()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if same(compute(), expected) else 3)
        _, st = os.waitpid(pid, 0)
        box.append(os.waitstatus_to_exitcode(st))
    t = threading.Thread(target=forker)
    t.start(); t.join()
    stop.set(); bg.join()
    print(box)
    """
    proc = run_child(code, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[0]"
