"""Threads, the kernel in use, and build facts."""

from __future__ import annotations

from . import _core
from ._arrays import as_positive_int

# After NumPy (imported by _arrays), which imports typing itself: `import attnx` stays as short.
from typing import TypedDict  # noqa: E402


def set_num_threads(n: int) -> None:
    """Set the number of threads attnx's kernels use (process-wide).

    Parameters
    ----------
    n : int
        At least 1. Until this is called, attnx follows OpenMP's setting for
        the calling thread: ``OMP_NUM_THREADS``, or a limit set with
        ``threadpoolctl.threadpool_limits``. Once called, ``n`` applies to
        every thread of the process. In a build without OpenMP the count is
        kept (and reported) but the kernels run on one thread.

    Examples
    --------
    >>> import attnx
    >>> before = attnx.get_num_threads()
    >>> attnx.set_num_threads(2)
    >>> attnx.get_num_threads(), attnx.show_config()["threads"]
    (2, 2)
    >>> attnx.set_num_threads(before)       # the earlier count again
    """
    _core.set_num_threads(as_positive_int(n, "n"))


def get_num_threads() -> int:
    """The number of threads attnx's kernels use.

    Returns
    -------
    int
        The count given to :func:`set_num_threads`, or, until that is called,
        OpenMP's setting for the calling thread (``omp_get_max_threads()``:
        ``OMP_NUM_THREADS``, the number of cores, or a
        ``threadpoolctl.threadpool_limits`` in force); 1 in a build without
        OpenMP. Small calls run on one thread whatever this says, and so does
        every call in a build without OpenMP (``show_config()["openmp"]``).

    Examples
    --------
    >>> import attnx
    >>> attnx.get_num_threads() == attnx.show_config()["threads"] >= 1
    True
    """
    return _core.get_num_threads()


class Config(TypedDict):
    """What :func:`show_config` returns."""

    version: str
    isa: str
    cpu_isa: str
    kernels: list[str]
    precisions: dict[str, str]
    threads: int
    openmp: bool
    compiler: str


def show_config() -> Config:
    """How this attnx was built and what it runs with.

    Returns
    -------
    dict
        ``version``, ``isa`` (the SIMD kernel in use), ``cpu_isa`` (the best
        the CPU supports), ``kernels`` (the kernels this build has, lowest
        first: ``["scalar", "avx2", "avx512"]`` on x86-64, ``["scalar"]``
        elsewhere), ``precisions`` (the kernels of each ``precision=``'s
        products: ``{"float32": isa, "float64": isa, "bfloat16": b, "int8":
        i}``, ``b`` ``"avx512_bf16"`` where they run on AVX512_BF16's
        ``vdpbf16ps``, ``isa + " (float32 products)"`` where they run as
        float32 multiply-adds of the rounded operands (CPUs whose
        ``vdpbf16ps`` is no faster than those, or that have none), ``isa +
        " (emulated)"`` with ``ATTNX_BF16_PRODUCTS=pairs`` on the others;
        ``i`` ``"avx512_vnni"`` where the integer products run on
        ``vpdpbusd``, ``"avx2 (vpmaddubsw)"`` on AVX2's, else ``"scalar
        (float32 products)"``: the same sums, exact in float32), ``threads``,
        ``openmp`` (bool) and ``compiler``.

    Examples
    --------
    >>> import attnx
    >>> config = attnx.show_config()
    >>> sorted(config)
    ['compiler', 'cpu_isa', 'isa', 'kernels', 'openmp', 'precisions', 'threads', 'version']
    >>> config["version"] == attnx.__version__, config["kernels"][0], config["isa"] in config["kernels"]
    (True, 'scalar', True)
    """
    return {
        "version": _core.__version__,
        "isa": _core.active_isa(),
        "cpu_isa": _core.cpu_isa(),
        "kernels": _core.compiled_isas(),
        "precisions": _core.precision_kernels(),
        "threads": _core.get_num_threads(),
        "openmp": _core.have_openmp(),
        "compiler": _core.compiler(),
    }
