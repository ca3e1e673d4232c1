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
def mha(
    num_heads: int,
    query: npt.NDArray[np.floating],
    key: npt.NDArray[np.floating],
    value: npt.NDArray[np.floating],
    w_q: npt.NDArray[np.floating],
    w_k: npt.NDArray[np.floating],
    w_v: npt.NDArray[np.floating],
    b_q: npt.NDArray[np.floating] | None,
    b_k: npt.NDArray[np.floating] | None,
    b_v: npt.NDArray[np.floating] | None,
    bias_k: npt.NDArray[np.floating] | None,
    bias_v: npt.NDArray[np.floating] | None,
    add_zero_attn: bool,
    static_k: npt.NDArray[np.floating] | None,
    static_v: npt.NDArray[np.floating] | None,
    attn_mask: npt.NDArray[np.floating] | None,
    key_padding_mask: npt.NDArray[np.floating] | None,
    causal: bool,
    w_out: npt.NDArray[np.floating],
    b_out: npt.NDArray[np.floating] | None,
    out: npt.NDArray[np.floating],
    weights: npt.NDArray[np.floating] | None,
    average_weights: bool,
    bottom_right: bool = False,
) -> None: ...
class MhaPlan:
    def __init__(
        self,
        num_heads: int,
        w_q: npt.NDArray[np.floating],
        w_k: npt.NDArray[np.floating],
        w_v: npt.NDArray[np.floating],
        b_q: npt.NDArray[np.floating] | None,
        b_k: npt.NDArray[np.floating] | None,
        b_v: npt.NDArray[np.floating] | None,
        bias_k: npt.NDArray[np.floating] | None,
        bias_v: npt.NDArray[np.floating] | None,
        add_zero_attn: bool,
        w_out: npt.NDArray[np.floating],
        b_out: npt.NDArray[np.floating] | None,
        batch_first: bool,
    ) -> None: ...
    def __call__(
        self,
        query: object,
        key: object,
        value: object,
        need_weights: object,
        average_weights: object,
        causal: bool,
        bottom_right: bool,
    ) -> tuple[npt.NDArray[np.floating], npt.NDArray[np.floating] | None] | None: ...

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
    def widen_16bit(
        src: npt.NDArray[np.uint16], format: str
    ) -> npt.NDArray[np.float32]: ...
    @staticmethod
    def trace_balanced_loop(
        n: int, threads: int, microseconds: int = 0, slow_thread: int = -1,
        slow_microseconds: int = 0
    ) -> tuple[list[int], list[int]]: ...

_testing: _TestingModule
