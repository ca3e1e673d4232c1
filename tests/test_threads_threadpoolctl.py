"""attnx's OpenMP pool is visible to threadpoolctl, and threadpool_limits limits attnx.

Each check runs in a fresh interpreter: until set_num_threads is called, attnx follows the
calling thread's OpenMP setting (which threadpool_limits changes); once it is called (as other
tests do), the process-wide count wins.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import attnx

pytest.importorskip("threadpoolctl")

CHILD = """
import json, pathlib, threading
import numpy as np
import attnx
from threadpoolctl import threadpool_info, threadpool_limits

rng = np.random.default_rng(0)
q = rng.standard_normal((2, 4, 200, 32)).astype(np.float32)
k = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
facts = {"default": attnx.get_num_threads(), "openmp": attnx.show_config()["openmp"]}
facts["pools"] = [(i["user_api"], i["internal_api"], i["num_threads"], i["filepath"])
                  for i in threadpool_info()]
full = attnx.scaled_dot_product_attention(q, k, k)
with threadpool_limits(limits=1):
    facts["limited"] = attnx.get_num_threads()
    one = attnx.scaled_dot_product_attention(q, k, k)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(attnx.get_num_threads()))
    worker.start()
    worker.join()
    facts["other_thread_while_limited"] = seen[0]
    with threadpool_limits(limits=2, user_api="openmp"):
        facts["openmp_api_2"] = attnx.get_num_threads()
facts["after"] = attnx.get_num_threads()
facts["same_bits"] = bool((full.view(np.uint8) == one.view(np.uint8)).all())
attnx.set_num_threads(2)
with threadpool_limits(limits=1):
    facts["after_set_num_threads"] = attnx.get_num_threads()
package = pathlib.Path(attnx.__file__).parent
facts["bundled_libs"] = [str(p) for d in (package.parent / "attnx.libs", package / ".dylibs")
                         if d.is_dir() for p in d.iterdir()]
print(json.dumps(facts))
"""


def child_facts(**env):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD)], capture_output=True, text=True,
        timeout=120, env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(not attnx.show_config()["openmp"], reason="a build without OpenMP")
def test_threadpool_limits_limits_attnx():
    facts = child_facts(OMP_NUM_THREADS="3")
    assert facts["default"] == 3  # OMP_NUM_THREADS
    # threadpoolctl finds an OpenMP runtime, set to attnx's count, ...
    openmp = [pool for pool in facts["pools"] if pool[0] == "openmp"]
    assert openmp, facts["pools"]
    assert any(pool[2] == 3 for pool in openmp), openmp
    # ... and, in a repaired wheel, the one bundled with attnx.
    bundled = {pathlib.Path(p).name for p in facts["bundled_libs"]}
    if any(name.startswith(("libgomp", "libomp", "libiomp")) for name in bundled):
        assert any(pathlib.Path(pool[3]).name in bundled for pool in openmp), (openmp, bundled)
    # Limiting it limits attnx, in the calling thread, for that block only.
    assert facts["limited"] == 1
    assert facts["openmp_api_2"] == 2
    assert facts["after"] == 3
    # OpenMP's setting is per thread: another Python thread keeps the default.
    assert facts["other_thread_while_limited"] == 3
    # Fewer threads, the same numbers (bit for bit).
    assert facts["same_bits"]
    # After set_num_threads, attnx's own process-wide count wins.
    assert facts["after_set_num_threads"] == 2


@pytest.mark.skipif(attnx.show_config()["openmp"], reason="a build with OpenMP")
def test_without_openmp_attnx_is_single_threaded_whatever_the_limits():
    facts = child_facts(OMP_NUM_THREADS="3")
    assert facts["openmp"] is False
    assert facts["default"] == facts["limited"] == facts["after"] == 1
    assert facts["same_bits"]
