"""Type stubs of the private C++ extension. Use the attnx package instead."""

from typing import Any, Sequence

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
        softcap: float = 0.0,
        scores: int = -1,
        precision: int = 0,
    ) -> None: ...
    causal: bool
    bottom_right: bool
    scale: float
    window_left: int
    window_right: int
    enable_gqa: bool
    softcap: float
    scores: int
    precision: int

def sdpa(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    options: SdpaOptions,
    out: object,
) -> npt.NDArray[np.floating[Any]] | tuple[npt.NDArray[np.floating[Any]], npt.NDArray[np.floating[Any]]]: ...
def cached_attention(
    query: npt.NDArray[np.floating[Any]],
    key: npt.NDArray[np.floating[Any]] | npt.NDArray[np.int8],
    value: npt.NDArray[np.floating[Any]] | npt.NDArray[np.int8],
    key_lengths: npt.NDArray[np.int64],
    query_lengths: npt.NDArray[np.int64],
    options: SdpaOptions,
    out: npt.NDArray[np.floating[Any]],
    key_scales: npt.NDArray[np.float32] | None = None,
    value_scales: npt.NDArray[np.float32] | None = None,
) -> None: ...
def varlen_attention(
    query: npt.NDArray[np.floating[Any]],
    key: npt.NDArray[np.floating[Any]],
    value: npt.NDArray[np.floating[Any]],
    cu_seqlens_q: npt.NDArray[np.int64],
    cu_seqlens_k: npt.NDArray[np.int64],
    options: SdpaOptions,
    out: npt.NDArray[np.floating[Any]],
) -> None: ...
def paged_attention(
    query: npt.NDArray[np.floating[Any]],
    key_pool: npt.NDArray[Any],
    value_pool: npt.NDArray[Any],
    key_scales: npt.NDArray[np.float32] | None,
    value_scales: npt.NDArray[np.float32] | None,
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int64],
    cu_seqlens_q: npt.NDArray[np.int64],
    options: SdpaOptions,
    out: npt.NDArray[np.floating[Any]],
) -> None: ...
def quantize_int8(
    src: npt.NDArray[np.floating[Any]], dst: npt.NDArray[np.int8], scales: npt.NDArray[np.float32]
) -> None: ...
class MhaOptions:
    def __init__(
        self,
        causal: bool,
        bottom_right: bool,
        need_weights: bool,
        average_weights: bool,
        batch_first: bool,
        precision: int = 0,
    ) -> None: ...
    causal: bool
    bottom_right: bool
    need_weights: bool
    average_weights: bool
    batch_first: bool
    precision: int

class MhaWeights:
    def __init__(
        self,
        num_heads: int,
        projections: tuple[Any, ...],
        in_biases: object,
        out_projection: tuple[Any, ...],
        bias_kv: object,
        add_zero_attn: bool,
        dtype: np.dtype[Any],
    ) -> None: ...
    dtype: np.dtype[Any]
    num_heads: int
    embed_dim: int
    out_dim: int
    kdim: int
    vdim: int
    bias_kv: bool
    add_zero_attn: bool

def head_dim(embed_dim: int, num_heads: int) -> int: ...
def mha(
    weights: object,
    query: object,
    key: object,
    value: object,
    extras: object,
    options: object,
) -> tuple[npt.NDArray[np.floating[Any]], npt.NDArray[np.floating[Any]] | None]: ...
def mha_step(
    weights: MhaWeights,
    rows: npt.NDArray[np.floating[Any]],
    cache: object,
    lengths: npt.NDArray[np.int64] | None,
    options: object,
) -> npt.NDArray[np.floating[Any]]: ...
def linear(
    x: npt.NDArray[np.floating[Any]],
    w: npt.NDArray[np.floating[Any]],
    b: npt.NDArray[np.floating[Any]] | None,
    out: npt.NDArray[np.floating[Any]],
    precision: int = 0,
) -> None: ...
class TransformerLayerWeights:
    def __init__(
        self,
        self_attn: MhaWeights,
        cross_attn: MhaWeights | None,
        linear1: tuple[Any, Any],
        linear2: tuple[Any, Any],
        norms: tuple[tuple[Any, Any, float], ...],
        norm_first: bool,
        activation: object,
    ) -> None: ...
    d_model: int
    num_heads: int
    dim_feedforward: int
    decoder: bool
    is_double: bool

class TransformerLayerOptions:
    def __init__(
        self,
        batch_first: bool,
        self_causal: bool,
        cross_causal: bool,
        precision: int = 0,
        final_norm: tuple[Any, Any, float] | None = None,
    ) -> None: ...
    batch_first: bool
    self_causal: bool
    cross_causal: bool
    precision: int

def transformer_layer(
    weights: TransformerLayerWeights,
    x: npt.NDArray[np.floating[Any]],
    memory: npt.NDArray[np.floating[Any]] | None,
    self_masks: tuple[Any, Any] | None,
    cross_masks: tuple[Any, Any] | None,
    options: TransformerLayerOptions,
    lengths: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None] | None = None,
    step: tuple[object, tuple[Any, Any] | None] | None = None,
) -> npt.NDArray[np.floating[Any]]: ...
def active_isa() -> str: ...
def cpu_isa() -> str: ...
def compiled_isas() -> list[str]: ...
def precision_kernels() -> dict[str, str]: ...
def get_num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def have_openmp() -> bool: ...
def fma_peak(threads: int, seconds: float = 0.25) -> float: ...
def compiler() -> str: ...

class _TestingModule:
    """The submodule attnx._core._testing: hooks for attnx's tests (attnx._testing)."""
    @staticmethod
    def run_mha(
        weights: MhaWeights, call: tuple[Any, ...], options: object
    ) -> tuple[npt.NDArray[np.floating[Any]], npt.NDArray[np.floating[Any]] | None]: ...
    @staticmethod
    def fail_next_step(stage: str) -> None: ...
    @staticmethod
    def plan_sdpa(
        call: dict[str, Any], query_tile: int, vector_width: int, threads: int, bf16_pairs: bool = ...
    ) -> dict[str, Any]: ...
    @staticmethod
    def sdpa_work(call: dict[str, Any]) -> float: ...
    @staticmethod
    def kernel_facts(dtype: str) -> dict[str, Any]: ...
    @staticmethod
    def planner_constants() -> dict[str, Any]: ...
    @staticmethod
    def run_sdpa(
        query: npt.NDArray[np.floating[Any]],
        key: npt.NDArray[np.floating[Any]],
        value: npt.NDArray[np.floating[Any]],
        attn_mask: npt.NDArray[np.floating[Any]] | None,
        options: SdpaOptions,
        out: npt.NDArray[np.floating[Any]],
        weights: npt.NDArray[np.floating[Any]] | None,
    ) -> None: ...
    @staticmethod
    def narrow_16bit(
        src: npt.NDArray[np.floating[Any]], format: str
    ) -> npt.NDArray[np.uint16]: ...
    @staticmethod
    def bf16_gemm(
        a: npt.NDArray[np.uint32],
        b: npt.NDArray[np.uint32],
        c: npt.NDArray[np.float32],
        init: str,
        init_values: npt.NDArray[np.float32] | None = None,
        table: str | None = None,
        repeat: int = 1,
    ) -> None: ...
    @staticmethod
    def int8_scores(
        q: npt.NDArray[np.int8],
        q_scales: npt.NDArray[np.float32],
        k: npt.NDArray[np.int8],
        k_scales: npt.NDArray[np.float32],
        table: str | None = None,
    ) -> npt.NDArray[np.float32]: ...
    @staticmethod
    def int8_accumulate_pv(
        p: npt.NDArray[np.float32],
        v: npt.NDArray[np.int8],
        v_scales: npt.NDArray[np.float32],
        acc: npt.NDArray[np.float32],
        table: str | None = None,
    ) -> None: ...
    @staticmethod
    def gemm_f32(
        a: npt.NDArray[np.float32],
        b: npt.NDArray[np.float32],
        c: npt.NDArray[np.float32],
        init: str,
        init_values: npt.NDArray[np.float32] | None = None,
        wide: bool = False,
        repeat: int = 1,
    ) -> None: ...
    @staticmethod
    def bf16_round(
        x: npt.NDArray[np.float32], table: str | None = None
    ) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.float32]]: ...
    @staticmethod
    def bf16_pack_pairs(
        x: npt.NDArray[np.float32], scale: float = 1.0, table: str | None = None
    ) -> npt.NDArray[np.uint32]: ...
    @staticmethod
    def widen_16bit(
        src: npt.NDArray[np.uint16], format: str
    ) -> npt.NDArray[np.float32]: ...
    @staticmethod
    def activate(x: npt.NDArray[np.floating[Any]], kind: str) -> npt.NDArray[np.floating[Any]]: ...
    @staticmethod
    def trace_balanced_loop(
        n: int, threads: int, microseconds: int = 0, slow_thread: int = -1,
        slow_microseconds: int = 0
    ) -> tuple[list[int], list[int]]: ...
    @staticmethod
    def core_sharing(rounds: Sequence[tuple[float, float]]) -> list[bool]: ...
    @staticmethod
    def core_wait_ns() -> int: ...

_testing: _TestingModule
