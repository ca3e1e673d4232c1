"""Shared knobs of the hardening tests: how hard to push, and where to report.

The hardening tests (marked ``hardening``: property tests, leak checks, concurrency, fuzzing,
offsets and counts past 2^31) run in every suite in a quick version: property tests with a few
dozen cases, leak checks over a few thousand calls, ... Hypothesis' profile ``thorough``
(``python -m pytest -m hardening --hypothesis-profile=thorough``, as ``.ci/harden`` runs them)
gives the long versions: thousands of cases per property (conftest.py registers the profiles),
100k calls per entry point in the leak checks, more threads and calls in the concurrency tests,
a mask of more than 2^31 elements.

Tests that measure something (examples run, calls made, RSS before and after) record it
with :func:`record`; when ``ATTNX_HARDENING_REPORT`` names a file, each record is appended
to it as one JSON line (``ATTNX_HARDENING_RUN`` labels the run), and ``.ci/harden`` prints
them at the end.
"""

from __future__ import annotations

import json
import os
import sys

from hypothesis import settings

THOROUGH = "thorough"
# The Hypothesis profile of this run (--hypothesis-profile), set by conftest.py.
PROFILE = "default"


def thorough() -> bool:
    """Whether this run loaded the Hypothesis profile ``thorough`` (the long hardening checks)."""
    return PROFILE == THOROUGH


def scaled(quick, long):
    """``long`` under the ``thorough`` profile, else ``quick``."""
    return long if thorough() else quick


def under_address_sanitizer() -> bool:
    """Whether the ASan runtime is loaded in this process (the sanitizer build's suite)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def record(test: str, **figures) -> None:
    """Report figures of a hardening test (appended to $ATTNX_HARDENING_REPORT as JSON)."""
    entry = {"test": test, "isa": _isa(), "run": os.environ.get("ATTNX_HARDENING_RUN", PROFILE), **figures}
    path = os.environ.get("ATTNX_HARDENING_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")


def _isa() -> str:
    attnx = sys.modules.get("attnx")
    return attnx.show_config()["isa"] if attnx is not None else "?"


def rss_bytes() -> int:
    """The resident set size of this process, in bytes."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil  # the test extra installs it where /proc is missing

        return psutil.Process().memory_info().rss


def malloc_in_use_bytes():
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: all arenas plus
    mmapped blocks), or None where that is not available. Unlike the RSS, it grows with a
    leak even while the allocator still has freed memory resident to hand out again."""
    import ctypes
    import ctypes.util

    global _MALLINFO2
    if _MALLINFO2 is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.mallinfo2
        except (OSError, AttributeError):
            _MALLINFO2 = False
        else:
            class Mallinfo2(ctypes.Structure):
                _fields_ = [(name, ctypes.c_size_t) for name in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                    "uordblks", "fordblks", "keepcost")]

            fn.restype = Mallinfo2
            _MALLINFO2 = fn
    if not _MALLINFO2:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


_MALLINFO2 = None


def hypothesis_settings(weight: float = 1.0, **overrides):
    """Settings for a property test: ``weight`` times the profile's number of cases (the
    profiles, registered in conftest.py, say the rest: derandomized, no deadline, no database)."""
    return settings(max_examples=max(1, round(weight * settings().max_examples)), **overrides)
