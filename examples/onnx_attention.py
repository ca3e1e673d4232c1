"""ONNX's Attention operator (opsets 23, 24 and 25) computed by attnx.

    python examples/onnx_attention.py                       # a small Gemma-2-like model
    python examples/onnx_attention.py --window 3 --dtype float16

``run_attention_node(node, inputs)`` computes one ``Attention`` node with
``attnx.scaled_dot_product_attention`` (and NumPy for the reshapes, the cache concatenation and
the masks attnx has no argument for); ``run_model(model, feeds)`` runs a whole model with
``onnx.reference.ReferenceEvaluator``, its ``Attention`` nodes (default domain) by attnx and
every other operator by onnx's NumPy reference. ``main`` builds a small model with
``onnx.helper``, runs it through attnx, through ``ReferenceEvaluator`` and through ONNX Runtime
where it is installed, and prints the largest differences. torch is never imported.

The semantics are those of onnx's reference implementation (``onnx/reference/ops/
op_attention.py``, onnx >= 1.23), which its backend test cases pin:

- inputs ``Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen`` (the last from opset
  24); 4-D ``(B, H, S, E)`` or 3-D ``(B, S, H * E)`` with ``q_num_heads`` and ``kv_num_heads``.
  ``past_key``/``past_value`` (4-D) are concatenated before ``K``/``V`` and returned as
  ``present_key``/``present_value`` (4-D, also for 3-D inputs).
- grouped-query attention (``Hq`` a multiple of ``Hk``): query head ``h`` uses key/value head
  ``h // (Hq // Hk)``, as attnx's ``enable_gqa``.
- ``scale`` (default ``1/sqrt(E)``) multiplies ``Q K^T``; ``softcap > 0`` maps the scaled
  scores to ``softcap * tanh(scores / softcap)`` before any mask.
- ``attn_mask``: bool (True = may attend) or float (added); broadcast to ``(B, Hq, L, S)``; a
  last dimension shorter than the total key length ``S`` is padded with False / -inf.
- ``is_causal`` is bottom-right aligned: query ``i`` attends key ``j`` iff ``j <= i + offset``,
  ``offset`` = ``past_key``'s length, or per batch ``nonpad_kv_seqlen[b] - L``, or 0. It
  applies together with ``attn_mask``. ``left_window_size``/``right_window_size`` (opset 25)
  restrict query ``i`` to keys ``[i + offset - left, i + offset + right]`` (-1: unbounded).
  ``nonpad_kv_seqlen[b]`` closes the keys at and after it. A query with no open key gives zeros.
- ``qk_matmul_output`` (4th output) as the reference outputs it: modes 0 and 1 give the scaled
  scores after the softcap (raw when there is none; the operator's text says mode 0 is the raw
  product, which ONNX Runtime follows), 2 the scores with the softcap and all masks (closed
  entries -inf), 3 the softmax probabilities (zeros for a query with no open key).
- float16/bfloat16 inputs are computed in float32 (attnx's rule) and the outputs rounded to the
  inputs' dtype. ``softmax_precision`` = DOUBLE computes in float64; FLOAT, FLOAT16 and
  BFLOAT16 compute in float32 (or float64 for float64 inputs), at least the precision asked for.

``run_attention_node`` raises ValueError for what it cannot map: another operator, an attribute
it does not know, an attribute that refers to a function's attribute (``run_model`` resolves
those), integer masks (bool or float only), a negative ``softcap``, an unknown
``softmax_precision`` or ``qk_matmul_output_mode``, inconsistent shapes or head counts.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

import attnx

# The operator's inputs and outputs, in their positions.
INPUTS = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
OUTPUTS = ("Y", "present_key", "present_value", "qk_matmul_output")

# Every attribute of opsets 23 to 25, with the schema's value where the node leaves it out.
DEFAULTS = {
    "is_causal": 0,
    "scale": None,
    "q_num_heads": None,
    "kv_num_heads": None,
    "softcap": 0.0,
    "softmax_precision": None,
    "qk_matmul_output_mode": 0,
    "left_window_size": -1,
    "right_window_size": -1,
}

# qk_matmul_output_mode -> attnx's return_scores, by what onnx's reference outputs (modes 0 and
# 1 use "qk" where there is no softcap).
_SCORES = {0: "softcapped", 1: "softcapped", 2: "masked", 3: "softmax"}

_SOFTMAX_PRECISIONS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def _is_float(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 is not a NumPy floating kind; onnx hands bfloat16 tensors out as it.
    return dtype.kind == "f" or dtype.name == "bfloat16"


def _split_heads(x: np.ndarray, num_heads, name: str) -> np.ndarray:
    """(B, S, H * E) -> (B, H, S, E), a view."""
    batch, length, hidden = x.shape
    if num_heads is None or num_heads <= 0 or hidden % num_heads:
        raise ValueError(f"{name} of shape {x.shape}: its last dimension {hidden} is not a multiple of "
                         f"{num_heads} heads")
    return x.reshape(batch, length, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _open_positions(L: int, S: int, offset, causal: bool, left: int, right: int) -> np.ndarray:
    """bool (L, S), or (B, 1, L, S) for per-batch offsets: True where the causal and window
    rules let query i (absolute position i + offset) attend key j."""
    position = np.arange(L)[:, None] + (np.reshape(offset, (-1, 1, 1, 1)) if np.ndim(offset) else offset)
    j = np.arange(S)
    allowed = np.ones(np.broadcast_shapes(position.shape, (S,)), dtype=bool)
    if causal:
        allowed &= j <= position
    if left >= 0:
        allowed &= j >= position - left
    if right >= 0:
        allowed &= j <= position + right
    return allowed


def _check_attributes(attributes: dict) -> dict:
    unknown = sorted(set(attributes) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"Attention attribute(s) {unknown} cannot be mapped (known: {sorted(DEFAULTS)})")
    return {**DEFAULTS, **attributes}


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
              is_causal=0, scale=None, q_num_heads=None, kv_num_heads=None, softcap=0.0,
              softmax_precision=None, qk_matmul_output_mode=0, left_window_size=-1,
              right_window_size=-1, qk_matmul_output=True):
    """The Attention operator on NumPy arrays: ``(Y, present_key, present_value, qk)``.

    The keywords are the operator's attributes; ``qk`` is None unless ``qk_matmul_output``.
    """
    Q, K, V = np.asarray(Q), np.asarray(K), np.asarray(V)
    if not (Q.ndim == K.ndim == V.ndim and Q.ndim in (3, 4)):
        raise ValueError(f"Q, K and V must all be 3-D or all 4-D, got shapes {Q.shape}, {K.shape}, {V.shape}")
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if not _is_float(x.dtype):
            raise ValueError(f"{name} must be a float tensor, got dtype {x.dtype}")
    if (past_key is None) != (past_value is None):
        raise ValueError("past_key and past_value must be given together")
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise ValueError("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    if qk_matmul_output_mode not in _SCORES:
        raise ValueError(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {qk_matmul_output_mode}")
    if softmax_precision is not None and softmax_precision not in _SOFTMAX_PRECISIONS:
        raise ValueError(f"softmax_precision must be one of {_SOFTMAX_PRECISIONS} (FLOAT, FLOAT16, "
                         f"DOUBLE, BFLOAT16), got {softmax_precision}")
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap must be 0 (none) or positive, got {softcap}")
    if left_window_size < -1 or right_window_size < -1:
        raise ValueError(f"window sizes must be -1 (unbounded) or >= 0, got left {left_window_size}, "
                         f"right {right_window_size}")

    if Q.ndim == 3:
        if q_num_heads is None or kv_num_heads is None:
            raise ValueError("3-D Q, K, V need the q_num_heads and kv_num_heads attributes")
        q, k, v = (_split_heads(Q, q_num_heads, "Q"), _split_heads(K, kv_num_heads, "K"),
                   _split_heads(V, kv_num_heads, "V"))
    else:
        q, k, v = Q, K, V
        for name, given, heads in (("q_num_heads", q_num_heads, Q.shape[1]), ("kv_num_heads", kv_num_heads, K.shape[1])):
            if given is not None and given != heads:
                raise ValueError(f"{name}={given} disagrees with the 4-D inputs' {heads} heads")

    if past_key is not None:
        past_key, past_value = np.asarray(past_key), np.asarray(past_value)
        if past_key.ndim != 4 or past_value.ndim != 4:
            raise ValueError(f"past_key and past_value must be 4-D, got shapes {past_key.shape}, {past_value.shape}")
        k = np.concatenate((past_key, k), axis=2)
        v = np.concatenate((past_value, v), axis=2)
        offset = past_key.shape[2]
    else:
        offset = 0
    present_key, present_value = np.ascontiguousarray(k), np.ascontiguousarray(v)

    batch, Hq, L, _ = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if v.shape[1] != Hk:
        raise ValueError(f"K has {Hk} heads, V has {v.shape[1]}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"the query heads ({Hq}) must be a multiple of the key/value heads ({Hk})")

    # attnx computes in the query's dtype, float16 and bfloat16 in float32; softmax_precision
    # DOUBLE asks for float64, so the inputs are widened to it. Float masks are converted to
    # the same dtype here (as attnx would), which also lets NumPy pad bfloat16 ones.
    wide = softmax_precision == TensorProto.DOUBLE or Q.dtype == np.float64
    compute = np.dtype(np.float64 if wide else np.float32)
    if compute == np.float64:
        q, k, v = (x.astype(np.float64) for x in (q, k, v))

    mask = None
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if mask.dtype != np.bool_:
            if not _is_float(mask.dtype):
                raise ValueError(f"attn_mask must be bool or float, got dtype {mask.dtype}")
            mask = mask.astype(compute)
        if mask.ndim == 0 or mask.shape[-1] > S:
            raise ValueError(f"attn_mask of shape {mask.shape}: its last dimension must be at most the "
                             f"total key length {S}")
        if mask.shape[-1] < S:
            # A shorter mask covers the first keys; the rest are closed.
            closed = False if mask.dtype == np.bool_ else -np.inf
            mask = np.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, S - mask.shape[-1])], constant_values=closed)

    causal = bool(is_causal)
    windowed = left_window_size >= 0 or right_window_size >= 0
    lengths = None
    if nonpad_kv_seqlen is not None:
        lengths = np.asarray(nonpad_kv_seqlen).reshape(-1).astype(np.int64)
        if lengths.shape != (batch,):
            raise ValueError(f"nonpad_kv_seqlen must have {batch} values (one per batch), got {lengths.size}")
        offset = lengths - L

    # attnx's own causal and window arguments align at offset 0 (top-left) or S - L
    # (bottom-right, with is_causal); other offsets become a bool mask built here.
    sdpa_causal, window, opened = False, None, None
    if causal or windowed:
        native = np.ndim(offset) == 0 and (offset == 0 or (causal and offset == S - L))
        if native:
            sdpa_causal = (True if offset == 0 else "bottom_right") if causal else False
            if windowed:
                window = (left_window_size if left_window_size >= 0 else None,
                          right_window_size if right_window_size >= 0 else None)
        else:
            opened = _open_positions(L, S, offset, causal, left_window_size, right_window_size)
    if lengths is not None:
        valid = (np.arange(S) < lengths[:, None]).reshape(batch, 1, 1, S)
        opened = valid if opened is None else opened & valid
    if opened is not None:
        if mask is None:
            mask = opened
        elif mask.dtype == np.bool_:
            mask = mask & opened
        else:
            mask = np.where(opened, mask, mask.dtype.type(-np.inf))

    kwargs = {"attn_mask": mask, "is_causal": sdpa_causal, "scale": None if scale is None else float(scale),
              "enable_gqa": Hq != Hk}
    if window is not None:
        kwargs["window"] = window
    # Only arguments in use are passed: a softcap of 0 is "none" in ONNX.
    if softcap > 0:
        kwargs["softcap"] = float(softcap)
    if qk_matmul_output:
        kwargs["return_scores"] = "qk" if qk_matmul_output_mode in (0, 1) and softcap == 0 else _SCORES[qk_matmul_output_mode]
        y, scores = attnx.scaled_dot_product_attention(q, k, v, **kwargs)
        scores = scores.astype(Q.dtype, copy=False)
    else:
        y, scores = attnx.scaled_dot_product_attention(q, k, v, **kwargs), None
    y = y.astype(Q.dtype, copy=False)
    if Q.ndim == 3:
        y = y.transpose(0, 2, 1, 3).reshape(batch, L, -1)
    return y, present_key, present_value, scores


def _attributes(node: onnx.NodeProto) -> dict:
    attributes = {}
    for att in node.attribute:
        if att.ref_attr_name:
            raise ValueError(f"attribute {att.name!r} refers to the function attribute {att.ref_attr_name!r}: "
                             "run the model with run_model, which resolves it")
        attributes[att.name] = helper.get_attribute_value(att)
    return _check_attributes(attributes)


def run_attention_node(node: onnx.NodeProto, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray | None]:
    """The outputs of one Attention node, computed by attnx.

    ``inputs`` has one entry per ``node.input`` (None where the name is empty: an input left
    out). Returns one entry per ``node.output``: the array, or None where the name is empty.
    """
    if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
        raise ValueError(f"not an ONNX Attention node: {node.domain or 'ai.onnx'}.{node.op_type}")
    if len(inputs) != len(node.input) or len(inputs) > len(INPUTS):
        raise ValueError(f"the node has {len(node.input)} inputs, {len(inputs)} given")
    if len(node.output) > len(OUTPUTS):
        raise ValueError(f"the node has {len(node.output)} outputs, Attention at most {len(OUTPUTS)}")
    arrays = [None if not name else x for name, x in zip(node.input, inputs)]
    wants_qk = len(node.output) == 4 and node.output[3] != ""
    results = attention(*arrays, **_attributes(node), qk_matmul_output=wants_qk)
    return [result if name else None for name, result in zip(node.output, results)]


class Attention(OpRun):
    """Attention by attnx, for ``ReferenceEvaluator(model, new_ops=[Attention])``.

    The evaluator picks a class of ``new_ops`` by its name and ``op_domain`` over its own
    implementation; it resolves attributes linked to a function's attributes before ``_run``.
    """

    op_domain = ""

    def _run(self, *inputs, **attributes):
        node = self.onnx_node
        if len(inputs) > len(INPUTS):
            raise ValueError(f"the node has {len(inputs)} inputs, Attention at most {len(INPUTS)}")
        # The evaluator passes every attribute of the newest schema; the node's own are read,
        # the others keep the operator's defaults (those of opsets 23 to 25).
        given = {att.name for att in node.attribute}
        attributes = _check_attributes({name: value for name, value in attributes.items() if name in given})
        wants_qk = len(node.output) == 4 and node.output[3] != ""
        results = attention(*inputs, **attributes, qk_matmul_output=wants_qk)
        # The evaluator takes arrays only: the results up to the last output the node names.
        named = [i for i, name in enumerate(node.output) if name]
        return results[: named[-1] + 1 if named else 0]


# The same operator under the default domain's other name.
_AttentionAiOnnx = type("Attention", (Attention,), {"op_domain": "ai.onnx"})


def run_model(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray], output_names=None) -> list[np.ndarray]:
    """The outputs of ``model``: its Attention nodes by attnx, the other operators by onnx's
    NumPy reference (``onnx.reference.ReferenceEvaluator``)."""
    return ReferenceEvaluator(model, new_ops=[Attention, _AttentionAiOnnx]).run(output_names, feeds)


# ---------------------------------------------------------------------------------------------
# A small model: attnx, onnx's reference and ONNX Runtime side by side
# ---------------------------------------------------------------------------------------------

# attnx vs onnx's reference (computed in the inputs' dtype) on the example model's outputs.
MODEL_TOLERANCES = {"float32": {"rtol": 1e-4, "atol": 1e-5}, "float16": {"rtol": 1e-2, "atol": 1e-2}}


def build_model(batch=2, tokens=4, past=6, width=64, heads=8, kv_heads=2, head_size=16, softcap=50.0,
                window=None, opset=None, dtype="float32", seed=0):
    """(model, feeds): a Gemma-2-like attention block with random weights.

    ``x @ Wq``, ``x @ Wk``, ``x @ Wv`` (MatMul) feed one Attention node with 3-D inputs,
    grouped-query heads, a causal mask, a logit softcap, a key/value cache of ``past`` positions
    and, with ``window``, a left window (opset 25); its output goes through ``@ Wo``. The
    graph's outputs: ``out``, ``present_key``, ``present_value`` and ``probs`` (the attention
    probabilities, ``qk_matmul_output_mode=3``).
    """
    if opset is None:
        opset = 25 if window is not None else 23
    if window is not None and opset < 25:
        raise ValueError("a window needs opset 25")
    np_dtype = np.dtype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np_dtype)
    rng = np.random.default_rng(seed)

    def weight(rows, cols, std):
        return (rng.standard_normal((rows, cols)) * std).astype(np_dtype)

    # Query and key weights large enough that the scores reach tens, where a softcap of 50 bends.
    weights = {
        "Wq": weight(width, heads * head_size, 4 / math.sqrt(width)),
        "Wk": weight(width, kv_heads * head_size, 4 / math.sqrt(width)),
        "Wv": weight(width, kv_heads * head_size, 1 / math.sqrt(width)),
        "Wo": weight(heads * head_size, width, 1 / math.sqrt(heads * head_size)),
    }
    attributes = {"is_causal": 1, "q_num_heads": heads, "kv_num_heads": kv_heads, "qk_matmul_output_mode": 3}
    if softcap:
        attributes["softcap"] = float(softcap)
    if window is not None:
        attributes["left_window_size"] = int(window)
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", ["x", "Wk"], ["k"]),
        helper.make_node("MatMul", ["x", "Wv"], ["v"]),
        helper.make_node("Attention", ["q", "k", "v", "", "past_key", "past_value"],
                         ["y", "present_key", "present_value", "probs"], **attributes),
        helper.make_node("MatMul", ["y", "Wo"], ["out"]),
    ]
    total = past + tokens
    graph = helper.make_graph(
        nodes, "attention_block",
        inputs=[
            helper.make_tensor_value_info("x", elem, [batch, tokens, width]),
            helper.make_tensor_value_info("past_key", elem, [batch, kv_heads, past, head_size]),
            helper.make_tensor_value_info("past_value", elem, [batch, kv_heads, past, head_size]),
        ],
        outputs=[
            helper.make_tensor_value_info("out", elem, [batch, tokens, width]),
            helper.make_tensor_value_info("present_key", elem, [batch, kv_heads, total, head_size]),
            helper.make_tensor_value_info("present_value", elem, [batch, kv_heads, total, head_size]),
            helper.make_tensor_value_info("probs", elem, [batch, heads, tokens, total]),
        ],
        initializer=[onnx.numpy_helper.from_array(w, name) for name, w in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    feeds = {
        "x": rng.standard_normal((batch, tokens, width)).astype(np_dtype),
        # The cached keys as the Wk projection of earlier positions would give them.
        "past_key": (rng.standard_normal((batch, kv_heads, past, head_size)) * 4).astype(np_dtype),
        "past_value": rng.standard_normal((batch, kv_heads, past, head_size)).astype(np_dtype),
    }
    return model, feeds


def max_difference(a, b) -> float:
    """max |a - b| over float64 copies; equal infinities differ by 0, a NaN on one side by inf."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    return float(np.nan_to_num(diff, nan=math.inf).max(initial=0.0))


def _onnxruntime_outputs(model, feeds, names):
    """ONNX Runtime's outputs, or a line saying why there are none."""
    try:
        import onnxruntime
    except ImportError:
        return "onnxruntime: not installed"
    try:
        inference = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return inference.run(names, feeds)
    except Exception as e:  # noqa: BLE001 -- any failure of an optional peer is reported, not raised
        return f"onnxruntime {onnxruntime.__version__} cannot run this model: {type(e).__name__}: {str(e).splitlines()[0]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4, help="new positions (queries)")
    parser.add_argument("--past", type=int, default=6, help="cached positions")
    parser.add_argument("--width", type=int, default=64, help="the model's width")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=16)
    parser.add_argument("--softcap", type=float, default=50.0, help="0 for none (Gemma 2: 50)")
    parser.add_argument("--window", type=int, default=None, help="left window size (opset 25)")
    parser.add_argument("--opset", type=int, choices=(23, 24, 25), default=None,
                        help="default 23, or 25 with --window")
    parser.add_argument("--dtype", choices=sorted(MODEL_TOLERANCES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="PATH", help="also write the model to PATH")
    args = parser.parse_args(argv)

    model, feeds = build_model(args.batch, args.tokens, args.past, args.width, args.heads, args.kv_heads,
                               args.head_size, args.softcap, args.window, args.opset, args.dtype, args.seed)
    if args.save:
        onnx.save(model, args.save)
    names = [o.name for o in model.graph.output]
    node = next(n for n in model.graph.node if n.op_type == "Attention")
    settings = ", ".join(f"{a.name}={helper.get_attribute_value(a)}" for a in node.attribute)
    print(f"model: opset {model.opset_import[0].version}, MatMul -> Attention({settings}) -> MatMul; "
          f"{args.dtype}, batch {args.batch}, {args.tokens} new + {args.past} cached positions")

    ours = run_model(model, feeds)
    reference = ReferenceEvaluator(model).run(None, feeds)
    runtime = _onnxruntime_outputs(model, feeds, names)
    columns = ["attnx vs reference"] + ([] if isinstance(runtime, str) else ["onnxruntime vs reference", "attnx vs onnxruntime"])
    print(f"{'max |difference|':<16}" + "".join(f"{c:>26}" for c in columns))
    for i, name in enumerate(names):
        diffs = [max_difference(ours[i], reference[i])]
        if not isinstance(runtime, str):
            diffs += [max_difference(runtime[i], reference[i]), max_difference(ours[i], runtime[i])]
        print(f"{name:<16}" + "".join(f"{d:>26.3g}" for d in diffs))
    if isinstance(runtime, str):
        print(runtime)
    tolerance = MODEL_TOLERANCES[args.dtype]
    close = all(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), **tolerance)
                for a, b in zip(ours, reference))
    print(f"attnx matches onnx's reference (rtol {tolerance['rtol']:g}, atol {tolerance['atol']:g}): {close}")
    return 0 if close else 1


if __name__ == "__main__":
    sys.exit(main())
