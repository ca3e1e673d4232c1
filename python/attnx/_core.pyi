"""Type stubs of the private C++ extension. Use the attnx package instead."""

import numpy as np
import numpy.typing as npt

__version__: str

class SdpaOptions:
    def __init__(
        self,
        causal: bool = False,
        bottom_right: bool = False,
        scale: float = ...,
        window_left: int = -1,
        window_right: int = -1,
        enable_gqa: bool = False,
    ) -> None: ...
    causal: bool
    bottom_right: bool
    scale: float
    window_left: int
    window_right: int
    enable_gqa: bool

def sdpa(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    options: SdpaOptions,
    out: object,
) -> npt.NDArray[np.floating]: ...
def cached_attention(
    query: npt.NDArray[np.floating],
    key: npt.NDArray[np.floating],
    value: npt.NDArray[np.floating],
    key_lengths: npt.NDArray[np.int64],
    query_lengths: npt.NDArray[np.int64],
    options: SdpaOptions,
    out: npt.NDArray[np.floating],
) -> None: ...
class MhaOptions:
    def __init__(
        self,
        causal: bool,
        bottom_right: bool,
        need_weights: bool,
        average_weights: bool,
        batch_first: bool,
    ) -> None: ...
    causal: bool
    bottom_right: bool
    need_weights: bool
    average_weights: bool
    batch_first: bool

class MhaWeights:
    def __init__(
        self,
        num_heads: int,
        projections: tuple,
        in_biases: object,
        out_projection: tuple,
        bias_kv: object,
        add_zero_attn: bool,
        dtype: np.dtype,
    ) -> None: ...
    dtype: np.dtype
    num_heads: int
    embed_dim: int
    out_dim: int
    kdim: int
    vdim: int
    bias_kv: bool
    add_zero_attn: bool

def mha(
    weights: object,
    query: object,
    key: object,
    value: object,
    extras: object,
    options: object,
) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating] | None]: ...
def mha_step(
    weights: MhaWeights,
    rows: npt.NDArray[np.floating],
    cache: object,
    lengths: npt.NDArray[np.int64] | None,
    options: object,
) -> npt.NDArray[np.floating]: ...
def linear(
    x: npt.NDArray[np.floating],
    w: npt.NDArray[np.floating],
    b: npt.NDArray[np.floating] | None,
    out: npt.NDArray[np.floating],
) -> None: ...
def active_isa() -> str: ...
def cpu_isa() -> str: ...
def compiled_isas() -> list[str]: ...
def get_num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def have_openmp() -> bool: ...
def fma_peak(threads: int, seconds: float = 0.25) -> float: ...
def compiler() -> str: ...

class _TestingModule:
    """The submodule attnx._core._testing: hooks for attnx's tests (attnx._testing)."""
    @staticmethod
    def run_mha(
        weights: MhaWeights, call: tuple, options: object
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating] | None]: ...
    @staticmethod
    def fail_next_step(stage: str) -> None: ...
    @staticmethod
    def plan_sdpa(
        call: dict, query_tile: int, vector_width: int, threads: int
    ) -> dict: ...
    @staticmethod
    def sdpa_work(call: dict) -> float: ...
    @staticmethod
    def kernel_facts(dtype: str) -> dict: ...
    @staticmethod
    def planner_constants() -> dict: ...
    @staticmethod
    def run_sdpa(
        query: npt.NDArray[np.floating],
        key: npt.NDArray[np.floating],
        value: npt.NDArray[np.floating],
        attn_mask: npt.NDArray[np.floating] | None,
        options: SdpaOptions,
        out: npt.NDArray[np.floating],
        weights: npt.NDArray[np.floating] | None,
    ) -> None: ...
    @staticmethod
    def narrow_16bit(
        src: npt.NDArray[np.floating], format: str
    ) -> npt.NDArray[np.uint16]: ...
    @staticmethod
    def widen_16bit(
        src: npt.NDArray[np.uint16], format: str
    ) -> npt.NDArray[np.float32]: ...
    @staticmethod
    def trace_balanced_loop(
        n: int, threads: int, microseconds: int = 0, slow_thread: int = -1,
        slow_microseconds: int = 0
    ) -> tuple[list[int], list[int]]: ...

_testing: _TestingModule
