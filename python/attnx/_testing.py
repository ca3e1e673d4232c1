"""Hooks into attnx's compiled core for attnx's own tests (private: no API, may change).

The extension keeps them apart from its other functions, in its submodule
``attnx._core._testing``; this module re-exports them, so that the tests write
``from attnx import _testing``.
"""

from ._core import _testing as _hooks

activate = _hooks.activate
bf16_gemm = _hooks.bf16_gemm
bf16_pack_pairs = _hooks.bf16_pack_pairs
bf16_round = _hooks.bf16_round
core_sharing = _hooks.core_sharing
core_wait_ns = _hooks.core_wait_ns
gemm_f32 = _hooks.gemm_f32
int8_accumulate_pv = _hooks.int8_accumulate_pv
int8_scores = _hooks.int8_scores
trace_balanced_loop = _hooks.trace_balanced_loop
widen_16bit = _hooks.widen_16bit
narrow_16bit = _hooks.narrow_16bit
run_sdpa = _hooks.run_sdpa
run_mha = _hooks.run_mha
fail_next_step = _hooks.fail_next_step
plan_sdpa = _hooks.plan_sdpa
sdpa_work = _hooks.sdpa_work
kernel_facts = _hooks.kernel_facts
planner_constants = _hooks.planner_constants

__all__ = [
    "activate",
    "bf16_gemm",
    "bf16_pack_pairs",
    "bf16_round",
    "core_sharing",
    "core_wait_ns",
    "gemm_f32",
    "fail_next_step",
    "int8_accumulate_pv",
    "int8_scores",
    "run_mha",
    "kernel_facts",
    "narrow_16bit",
    "plan_sdpa",
    "planner_constants",
    "run_sdpa",
    "sdpa_work",
    "trace_balanced_loop",
    "widen_16bit",
]
