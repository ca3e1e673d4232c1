"""examples/onnx_attention.py: ONNX's own Attention test cases, reproduced by attnx.

The cases are those of onnx's backend test suite for the operator, from the installed onnx: the
export functions of ``onnx.backend.test.case.node.attention``, each of which calls
``expect(node, inputs=..., outputs=..., name=...)``. They are collected by running those
functions again with the module's ``expect`` replaced by one that records its arguments, each
after ``np.random.seed(0)`` as onnx's own collection does. (``onnx.backend.test.case.node.
collect_testcases("Attention")`` gives the same cases, but it imports and runs the cases of
every operator first: 4 s per test process instead of 0.3 s.) Each node runs through the
example's ``run_attention_node``, and every output the node names (``Y``, ``present_key``,
``present_value``, ``qk_matmul_output``) must have the expected dtype and shape, and values
within the tolerance of its dtype (``assert_allclose``: ``|got - expected| <= atol + rtol *
|expected|``, equal infinities match):

- float32: rtol 1e-5, atol 1e-6 -- attnx's float32 contract; the expected values are computed
  in float32 by onnx's reference.
- float16: rtol 2e-3, atol 1e-3 -- two and one units of float16's epsilon (2^-10): the
  reference rounds every step to float16, attnx computes in float32 and rounds once.
- bfloat16: rtol 1.6e-2, atol 8e-3 -- two and one units of bfloat16's epsilon (2^-7), likewise.

The float32 tolerance tells a softcap applied after the mask from one applied before it
(``test_tolerance_tells_softcap_after_the_mask_apart``).

onnx >= 1.23: earlier versions' reference, and so their cases, differ from the operator's text
(1.18 split 3-D heads without a transpose; before 1.22 the softcap came after the mask; before
1.23 causal masks ignored ``nonpad_kv_seqlen`` and a query with no open key gave NaN).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import warnings
from typing import NamedTuple
from unittest import mock

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", minversion="1.23")

from onnx import TensorProto, helper  # noqa: E402

import attnx  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "onnx_attention.py"

TOLERANCES = {
    "float32": {"rtol": 1e-5, "atol": 1e-6},
    "float16": {"rtol": 2e-3, "atol": 1e-3},
    "bfloat16": {"rtol": 1.6e-2, "atol": 8e-3},
}


def load_example():
    spec = importlib.util.spec_from_file_location("onnx_attention", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Case(NamedTuple):
    node: onnx.NodeProto
    inputs: list  # one entry per node.input, None where the name is empty
    expected: list  # one array per output the node names
    opset_imports: list


def collect_cases() -> dict:
    """{name: Case} of onnx's Attention cases."""
    with warnings.catch_warnings():
        # The module's import runs its cases through onnx's own expect, which also builds
        # the operator's function body; warnings of onnx's reference there are onnx's.
        warnings.simplefilter("ignore")
        import onnx.backend.test.case.node.attention as module
    from onnx.backend.test.case.base import Base

    cases = {}

    def record(node, inputs, outputs, name, **kwargs):
        present = iter(inputs)
        aligned = [next(present) if input_name else None for input_name in node.input]
        opsets = kwargs.get("opset_imports") or [
            helper.make_opsetid("", onnx.defs.get_schema(node.op_type, domain=node.domain).since_version)]
        cases[name] = Case(node, aligned, list(outputs), list(opsets))

    exporters = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Base) and c is not Base]
    state = np.random.get_state()
    try:
        with mock.patch.object(module, "expect", record):
            for exporter in exporters:
                for attribute in vars(exporter):
                    if attribute.startswith("export"):
                        np.random.seed(0)
                        getattr(exporter, attribute)()
    finally:
        np.random.set_state(state)
    return cases


CASES = collect_cases()


@pytest.fixture(scope="module")
def example():
    return load_example()


def case_model(case: Case) -> onnx.ModelProto:
    """The one-node model of a case, as onnx's expect makes it."""
    node = case.node
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
              for name, x in zip(node.input, case.inputs) if name]
    outputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(y.dtype), y.shape)
               for name, y in zip((n for n in node.output if n), case.expected)]
    graph = helper.make_graph([node], "case", inputs, outputs)
    return helper.make_model(graph, opset_imports=case.opset_imports)


def as_float64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def test_the_suite_is_collected():
    # onnx 1.23 has 93 one-node cases; a later onnx may add some, none is lost silently.
    assert len(CASES) >= 93, sorted(CASES)
    kinds = " ".join(CASES)
    for feature in ("3d", "gqa", "causal", "attn_mask", "past_and_present", "softcap", "qk_matmul",
                    "nonpad", "window", "bf16", "fp16"):
        assert feature in kinds, feature


@pytest.mark.parametrize("name", list(CASES))
def test_onnx_case(example, name):
    node, inputs, expected, _ = CASES[name]
    got = example.run_attention_node(node, inputs)
    assert len(got) == len(node.output)
    named = [(output, result) for output, result in zip(node.output, got) if output]
    assert all(result is None for output, result in zip(node.output, got) if not output)
    assert len(named) == len(expected)
    for (output, result), want in zip(named, expected):
        assert result.dtype == want.dtype, (output, result.dtype, want.dtype)
        assert result.shape == want.shape, (output, result.shape, want.shape)
        np.testing.assert_allclose(as_float64(result), as_float64(want), err_msg=f"{name}: {output}",
                                   **TOLERANCES[want.dtype.name])


@pytest.mark.parametrize("name", ["test_attention_4d_softcap_neginf_mask", "test_attention_4d_with_qk_matmul_softcap"])
def test_tolerance_tells_softcap_after_the_mask_apart(name):
    # softmax(c * tanh((s + mask) / c)) @ V, the wrong order, is outside the float32 tolerance
    # of the case's expected Y (softcap first): a -inf mask becomes -c and leaks probability,
    # a finite one is squashed with the scores.
    node, (Q, K, V, mask, *_), expected, _ = CASES[name]
    softcap = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "softcap")
    q, k, v, m = (as_float64(x) for x in (Q, K, V, mask))
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    wrong = softcap * np.tanh((scores + m) / softcap)
    p = np.exp(wrong - wrong.max(-1, keepdims=True))
    y_wrong = (p / p.sum(-1, keepdims=True)) @ v
    assert not np.allclose(y_wrong, as_float64(expected[0]), **TOLERANCES["float32"])


@pytest.mark.parametrize("name", [
    "test_attention_4d_with_past_and_present_qk_matmul_bias_4d_mask_causal",
    "test_attention_3d_gqa_with_past_and_present",
    "test_attention_4d_causal_nonpad_attn_mask_composition",
    "test_attention_local_window_gqa_rank4_mask",
])
def test_run_model_runs_attention_by_attnx(example, monkeypatch, name):
    # run_model: ReferenceEvaluator with the example's Attention, which calls attnx once per node.
    node, inputs, _, _ = CASES[name]
    model = case_model(CASES[name])
    calls = []
    sdpa = attnx.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(example.attnx, "scaled_dot_product_attention", counted)
    feeds = {vi.name: x for vi, x in zip(model.graph.input, (x for x in inputs if x is not None))}
    got = example.run_model(model, feeds)
    assert len(calls) == 1
    direct = [result for output, result in zip(node.output, example.run_attention_node(node, inputs)) if output]
    assert len(got) == len(direct)
    for a, b in zip(got, direct):
        np.testing.assert_array_equal(a, b)


def test_main_compares_with_the_reference(example, capsys):
    assert example.main(["--batch", "1", "--tokens", "3", "--past", "4", "--width", "16", "--heads", "4",
                         "--kv-heads", "2", "--head-size", "4", "--softcap", "5"]) == 0
    out = capsys.readouterr().out
    assert "attnx matches onnx's reference" in out and out.rstrip().endswith("True"), out
    for name in ("out", "present_key", "present_value", "probs"):
        assert any(line.startswith(name) for line in out.splitlines()), out


# Runs the example's command line in a fresh interpreter in which `import torch` fails.
WITHOUT_TORCH = """
import runpy, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_command_line_without_torch(tmp_path):
    saved = tmp_path / "model.onnx"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, str(EXAMPLE), "--window", "2", "--dtype", "float16",
         "--tokens", "3", "--past", "5", "--save", str(saved)],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "opset 25" in proc.stdout and "left_window_size=2" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("True"), proc.stdout
    model = onnx.load(str(saved))
    assert [n.op_type for n in model.graph.node] == ["MatMul", "MatMul", "MatMul", "Attention", "MatMul"]


def _node(inputs=("Q", "K", "V"), outputs=("Y",), op_type="Attention", **attributes):
    return helper.make_node(op_type, list(inputs), list(outputs), **attributes)


Q4 = np.ones((1, 2, 3, 4), np.float32)


@pytest.mark.parametrize("node, inputs, match", [
    (_node(op_type="MultiHeadAttention"), [Q4, Q4, Q4], "not an ONNX Attention node"),
    (_node(sliding=3), [Q4, Q4, Q4], r"attribute\(s\) \['sliding'\] cannot be mapped"),
    (_node(("Q", "K", "V", "m")), [Q4, Q4, Q4, np.ones((3, 3), np.int64)], "attn_mask must be bool or float"),
    (_node(("Q", "K", "V", "m")), [Q4, Q4, Q4, np.ones((3, 4), bool)], "at most the total key length 3"),
    (_node(softcap=-1.0), [Q4, Q4, Q4], "softcap must be 0"),
    (_node(qk_matmul_output_mode=4), [Q4, Q4, Q4], "qk_matmul_output_mode"),
    (_node(softmax_precision=TensorProto.INT32), [Q4, Q4, Q4], "softmax_precision"),
    (_node(left_window_size=-2), [Q4, Q4, Q4], "window sizes"),
    (_node(), [Q4[0], Q4[0], Q4[0]], "q_num_heads and kv_num_heads"),
    (_node(q_num_heads=3, kv_num_heads=3), [Q4[0], Q4[0], Q4[0]], "not a multiple of 3 heads"),
    (_node(q_num_heads=4), [Q4, Q4, Q4], "disagrees"),
    (_node(), [np.ones((1, 3, 3, 4), np.float32), Q4, Q4], "multiple of the key/value heads"),
    (_node(("Q", "K", "V", "", "pk", "pv", "n")), [Q4, Q4, Q4, None, Q4, Q4, np.array([3])], "nonpad_kv_seqlen"),
    (_node(("Q", "K", "V", "", "pk")), [Q4, Q4, Q4, None, Q4], "together"),
    (_node(), [Q4, Q4], "3 inputs, 2 given"),
])
def test_what_cannot_be_mapped_raises_value_error(example, node, inputs, match):
    with pytest.raises(ValueError, match=match):
        example.run_attention_node(node, inputs)
