"""The libraries a benchmark compares, each set up to run one case: attnx and its peers.

Holds: ``Bench`` (a prepared, timed call), the statuses of a peer that does not run a case
(``NotInstalled``, ``Unavailable``, ``NotApplicable``), ``import_optional``, the ``setup_*``
functions of attnx, NumPy, torch, ONNX Runtime and OpenVINO for the sdpa, MHA, varlen and
transformer-layer cases (``ADAPTERS`` by library name), and ``library_versions``.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any, Callable

from timing import log  # (timing, imported first, sets the thread variables before NumPy)

import numpy as np  # noqa: E402

from shapes import (  # noqa: E402
    LAYER_KINDS,
    Shape,
    causal_additive_mask,
    check_output,
    layer_output_view,
    make_inputs,
    numpy_mha,
    numpy_sdpa,
    pack_rows,
    reference_layer_output,
    reference_output,
    varlen_allowed_mask,
)

LIBRARIES = ("attnx", "numpy", "torch", "onnxruntime", "openvino")
PEERS = LIBRARIES[1:]

# Peers that one library provides several of, by name: a column each, shown when a run has them
# (attnx's: its baselines of the ragged cases).
PEER_VARIANTS = {"attnx": ("attnx-padded", "attnx-full"), "torch": ("torch-recompute", "torch-cached")}


@dataclass
class Bench:
    """A prepared library call: `run()` is timed; `to_numpy(run())` gives the canonical output
    ((B, H, L, D) for sdpa, (B, L, E) for mha, layer_output_view's for the transformer kinds)
    and is not timed. `reset`, when given, runs untimed before every call: a decoding step puts
    its cache back to the length it had before the step. `exported`: the call runs a model
    exported from torch, and an output that disagrees with the reference makes the peer
    unavailable (the export's fault) rather than wrong. `reference`, when given, is the float64
    result this call is checked against instead of the case's: "attnx-full" computes the batch
    without its mask."""

    run: Callable[[], Any]
    to_numpy: Callable[[Any], np.ndarray] = np.asarray
    note: str = ""
    reset: Callable[[], None] | None = None
    exported: bool = False
    reference: np.ndarray | None = None


class NotInstalled(Exception):
    """The peer library cannot be imported."""


class Unavailable(Exception):
    """The peer is installed but cannot run this case (a failed model export, say)."""


class NotApplicable(Exception):
    """The peer has no implementation of this kind of case."""


def call_once(bench: Bench) -> Any:
    """One call of `bench` outside any timing, its reset first."""
    if bench.reset is not None:
        bench.reset()
    return bench.run()


def import_optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise NotInstalled(str(exc)) from None


def attnx_precision(precision: str) -> dict[str, str]:
    """The keyword attnx's calls take for `precision` (none for float32, the default)."""
    return {} if precision == "float32" else {"precision": precision}


def attnx_kernel_note(precision: str) -> str:
    import attnx

    kernels = attnx.show_config().get("precisions", {})
    return f"{precision} kernel {kernels.get(precision, attnx.show_config()['isa'])}"


def setup_attnx(shape: Shape, data, threads: int, softcap: float | None = None,
                precision: str = "float32") -> Bench:
    """attnx's call of a shape; with `softcap`, the sdpa shapes soft-cap their scores (ab.py's
    --after-softcap), and the multi-head and transformer ones, which have no soft cap, run as
    they are."""
    if shape.kind in LAYER_KINDS:
        return setup_attnx_layer(shape, data, threads, precision)
    import attnx

    attnx.set_num_threads(threads)
    if shape.kind == "varlen":
        q, k, v, cu = data["q_packed"], data["k_packed"], data["v_packed"], data["cu_seqlens"]
        extra = attnx_precision(precision)
        return Bench(lambda: attnx.varlen_attention(q, k, v, cu, is_causal=shape.causal, **extra),
                     note=f"attnx.varlen_attention on the packed rows, {attnx_kernel_note(precision)}")
    if shape.kind == "sdpa":
        q, k, v = data["q"], data["k"], data["v"]
        extra = {} if softcap is None else {"softcap": softcap}
        extra.update(attnx_precision(precision))
        if shape.mask_given:
            mask = causal_additive_mask(shape.L, shape.S, np.float32)
            return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra),
                         note=attnx_kernel_note(precision))
        return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, **extra),
                     note=attnx_kernel_note(precision))
    x = data["x"]
    module_cls = getattr(attnx, "MultiheadAttention", None)
    if module_cls is not None:
        module = module_cls(shape.E, shape.H, batch_first=True, dtype=np.float32, **attnx_precision(precision))
        module.load_state_dict(
            {
                "in_proj_weight": data["w_in"],
                "in_proj_bias": data["b_in"],
                "out_proj.weight": data["w_out"],
                "out_proj.bias": data["b_out"],
            }
        )
        return Bench(
            lambda: module(x, x, x, need_weights=False, is_causal=shape.causal)[0],
            note=f"attnx.MultiheadAttention, {attnx_kernel_note(precision)}",
        )
    args = (shape.E, shape.H, data["w_in"], data["b_in"], None, None, False, 0.0, data["w_out"], data["b_out"])
    return Bench(
        lambda: attnx.multi_head_attention_forward(
            x, x, x, *args, training=False, need_weights=False, is_causal=shape.causal, batch_first=True
        )[0],
        note="attnx.multi_head_attention_forward (attnx.MultiheadAttention not available)",
    )


def setup_attnx_padded(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """"attnx-padded", a varlen case's baseline: attnx's sdpa on the padded batch with the bool
    mask of the real keys (and the causal triangle), its output packed to the real rows."""
    import attnx

    attnx.set_num_threads(threads)
    q, k, v = data["q"], data["k"], data["v"]
    mask = varlen_allowed_mask(shape)
    extra = attnx_precision(precision)
    return Bench(lambda: attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra),
                 lambda out: pack_rows(shape, out),
                 note=f"attnx.scaled_dot_product_attention on the padded batch, bool attn_mask "
                      f"{tuple(mask.shape)}, {attnx_kernel_note(precision)}")


def setup_attnx_full(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """"attnx-full", a ragged encoder layer's baseline: attnx's same layer on the full batch
    without a mask (every position real), checked against the float64 result of that batch."""
    dense = replace(shape, padded=False, ragged=False)
    unmasked = {name: a for name, a in data.items() if name != "key_padding_mask"}
    bench = setup_attnx_layer(dense, unmasked, threads, precision)
    bench.reference = reference_layer_output(dense, unmasked)
    bench.note += ", the full batch without a mask (checked against that batch's reference)"
    return bench


def setup_attnx_with_baselines(shape: Shape, data, threads: int,
                               precision: str = "float32") -> Bench | dict[str, Bench]:
    """ADAPTERS' attnx: setup_attnx's call and, for the ragged cases, attnx's own baseline beside
    it ("attnx-padded" for varlen, "attnx-full" for the ragged encoder layer): the speed-up over
    it is what skipping the padding gains. A baseline is never the "best peer"."""
    bench = setup_attnx(shape, data, threads, precision=precision)
    if shape.kind == "varlen":
        return {"attnx": bench, "attnx-padded": setup_attnx_padded(shape, data, threads, precision)}
    if shape.ragged:
        return {"attnx": bench, "attnx-full": setup_attnx_full(shape, data, threads, precision)}
    return bench


def setup_numpy(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    if shape.kind in LAYER_KINDS:
        raise NotApplicable("no NumPy transformer peer")
    if precision != "float32":
        raise NotApplicable("NumPy has no bfloat16 products")
    if shape.kind == "varlen":
        q, k, v = data["q"], data["k"], data["v"]
        additive = np.where(varlen_allowed_mask(shape), np.float32(0), np.float32(-np.inf))
        return Bench(lambda: numpy_sdpa(q, k, v, additive), lambda out: pack_rows(shape, out),
                     note="the padded batch, additive mask")
    mask = causal_additive_mask(shape.L, shape.S, np.float32) if shape.causal else None
    if shape.kind == "sdpa":
        q, k, v = data["q"], data["k"], data["v"]
        return Bench(lambda: numpy_sdpa(q, k, v, mask))
    d = data
    return Bench(lambda: numpy_mha(d["x"], d["w_in"], d["b_in"], d["w_out"], d["b_out"], shape.H, mask))


def torch_dtype(torch, precision: str):
    return torch.bfloat16 if precision == "bfloat16" else torch.float32


def torch_note(torch, precision: str) -> str:
    """torch's dtype and the CPU capability its kernels dispatch to."""
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    return f"{precision}, CPU capability {capability}"


def setup_torch(shape: Shape, data, threads: int, precision: str = "float32") -> Bench | dict[str, Bench]:
    if shape.kind in LAYER_KINDS:
        return setup_torch_layer(shape, data, threads, precision)
    torch = import_optional("torch")
    torch.set_num_threads(threads)
    dtype = torch_dtype(torch, precision)
    to_numpy = lambda t: t.float().numpy()  # noqa: E731
    if shape.kind == "varlen":
        q, k, v = (torch.from_numpy(data[n]).to(dtype) for n in ("q", "k", "v"))
        allowed = torch.from_numpy(varlen_allowed_mask(shape))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run_padded():
            with torch.inference_mode():
                return sdpa(q, k, v, attn_mask=allowed)

        return Bench(run_padded, lambda t: pack_rows(shape, t.float().numpy()),
                     note=f"F.scaled_dot_product_attention on the padded batch, bool attn_mask "
                          f"{tuple(allowed.shape)}, inference_mode, {torch_note(torch, precision)}")
    if shape.kind == "sdpa":
        q, k, v = (torch.from_numpy(data[n]).to(dtype) for n in ("q", "k", "v"))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        mask = torch.from_numpy(causal_additive_mask(shape.L, shape.S, np.float32)) if shape.mask_given else None
        if mask is not None:
            mask = mask.to(dtype)

        def run_sdpa():
            with torch.inference_mode():
                if mask is not None:
                    return sdpa(q, k, v, attn_mask=mask)
                return sdpa(q, k, v, is_causal=shape.causal)

        return Bench(run_sdpa, to_numpy,
                     note=f"F.scaled_dot_product_attention, inference_mode, {torch_note(torch, precision)}")
    module = torch.nn.MultiheadAttention(shape.E, shape.H, batch_first=True)
    module.load_state_dict(
        {
            "in_proj_weight": torch.from_numpy(data["w_in"]),
            "in_proj_bias": torch.from_numpy(data["b_in"]),
            "out_proj.weight": torch.from_numpy(data["w_out"]),
            "out_proj.bias": torch.from_numpy(data["b_out"]),
        }
    )
    module.eval().to(dtype)
    x = torch.from_numpy(data["x"]).to(dtype)
    mask = None
    if shape.causal:
        mask = torch.from_numpy(causal_additive_mask(shape.L, shape.S, np.float32)).to(dtype)

    def run_mha():
        with torch.inference_mode():
            return module(x, x, x, need_weights=False, attn_mask=mask)[0]

    return Bench(run_mha, to_numpy,
                 note=f"nn.MultiheadAttention eval(), inference_mode, {torch_note(torch, precision)}")


def _onnx_model_bytes(shape: Shape, data) -> bytes:
    """An in-memory ONNX model around com.microsoft MultiHeadAttention (BSH layout)."""
    onnx = import_optional("onnx")
    from onnx import TensorProto, helper, numpy_helper

    B, L, S, E = shape.B, shape.L, shape.S, shape.E
    attrs = {"num_heads": shape.H}
    if shape.causal and not shape.mask_given:
        attrs["unidirectional"] = 1
    f32 = TensorProto.FLOAT
    if shape.kind == "sdpa":
        inputs = [
            helper.make_tensor_value_info("query", f32, [B, L, E]),
            helper.make_tensor_value_info("key", f32, [B, S, E]),
            helper.make_tensor_value_info("value", f32, [B, S, E]),
        ]
        names = ["query", "key", "value"]
        if shape.mask_given:  # inputs 3, 4 (bias, key_padding_mask) absent; 5: attention_bias
            inputs.append(helper.make_tensor_value_info("attention_bias", f32, [1, 1, L, S]))
            names += ["", "", "attention_bias"]
        nodes = [helper.make_node("MultiHeadAttention", names, ["output"], domain="com.microsoft", **attrs)]
        initializers = []
    else:
        inputs = [helper.make_tensor_value_info("x", f32, [B, L, E])]
        initializers = [
            numpy_helper.from_array(np.ascontiguousarray(data["w_in"].T), "w_in_t"),
            numpy_helper.from_array(data["b_in"], "b_in"),
            numpy_helper.from_array(np.ascontiguousarray(data["w_out"].T), "w_out_t"),
            numpy_helper.from_array(data["b_out"], "b_out"),
            numpy_helper.from_array(np.array([E, E, E], dtype=np.int64), "split_sizes"),
        ]
        nodes = [
            helper.make_node("MatMul", ["x", "w_in_t"], ["qkv_mm"]),
            helper.make_node("Add", ["qkv_mm", "b_in"], ["qkv"]),
            helper.make_node("Split", ["qkv", "split_sizes"], ["q", "k", "v"], axis=2),
            helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["attn"], domain="com.microsoft", **attrs),
            helper.make_node("MatMul", ["attn", "w_out_t"], ["out_mm"]),
            helper.make_node("Add", ["out_mm", "b_out"], ["output"]),
        ]
    outputs = [helper.make_tensor_value_info("output", f32, [B, L, E])]
    graph = helper.make_graph(nodes, f"attnx_bench_{shape.name}", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _to_bsh(a: np.ndarray) -> np.ndarray:
    """(B, H, N, D) -> (B, N, H*D), contiguous."""
    B, H, N, D = a.shape
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(B, N, H * D)


def _ort_bound_run(session, feeds: dict) -> Callable[[], Any]:
    """A call of `session` on `feeds`, bound once (zero-copy), as a server would: its output
    "output" as an array."""
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("output")

    def run():
        assert feeds  # bound zero-copy: the arrays must live as long as the binding
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    return run


def ort_session_options(ort, threads: int):
    """Session options: `threads` intra-op threads that do not spin, all graph optimisations."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def setup_onnxruntime(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    if shape.kind == "varlen":
        raise NotApplicable("no packed or masked-padding attention model here")
    if precision != "float32":
        raise NotApplicable("ONNX Runtime's CPU provider runs these models in float32")
    if shape.kind in LAYER_KINDS:
        return setup_onnxruntime_layer(shape, data, threads)
    ort = import_optional("onnxruntime")
    session = ort.InferenceSession(_onnx_model_bytes(shape, data), ort_session_options(ort, threads),
                                   providers=["CPUExecutionProvider"])

    if shape.kind == "sdpa":
        feeds = {"query": _to_bsh(data["q"]), "key": _to_bsh(data["k"]), "value": _to_bsh(data["v"])}
        if shape.mask_given:
            feeds["attention_bias"] = causal_additive_mask(shape.L, shape.S, np.float32)[None, None]
        B, H, L, D = shape.B, shape.H, shape.L, shape.D
        to_numpy = lambda out: out.reshape(B, L, H, D).transpose(0, 2, 1, 3)  # noqa: E731
        note = "com.microsoft.MultiHeadAttention" + (
            " attention_bias" if shape.mask_given else " unidirectional=1" if shape.causal else "")
    else:
        feeds = {"x": data["x"]}
        to_numpy = np.asarray
        note = "MatMul+Add, Split, com.microsoft.MultiHeadAttention, MatMul+Add"

    return Bench(_ort_bound_run(session, feeds), to_numpy, note=note)


def _openvino_ops():
    for name in ("openvino.opset13", "openvino.runtime.opset13"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NotInstalled("openvino.opset13 not found")


def _openvino_model(shape: Shape, data, ops, ov):
    """An ov.Model: opset13 ScaledDotProductAttention, with MatMul projections for mha."""
    B, H, L, S, D, E = shape.B, shape.H, shape.L, shape.S, shape.D, shape.E
    f32 = ov.Type.f32
    if shape.kind == "sdpa":
        params = [
            ops.parameter([B, H, L, D], f32, name="q"),
            ops.parameter([B, H, S, D], f32, name="k"),
            ops.parameter([B, H, S, D], f32, name="v"),
        ]
        if shape.mask_given:
            params.append(ops.parameter([L, S], f32, name="mask"))
            out = ops.scaled_dot_product_attention(*params, causal=False)
            return ov.Model([out], params, f"sdpa_{shape.name}")
        out = ops.scaled_dot_product_attention(*params, causal=shape.causal)
        return ov.Model([out], params, f"sdpa_{shape.name}")
    x = ops.parameter([B, L, E], f32, name="x")
    qkv = ops.add(ops.matmul(x, ops.constant(data["w_in"]), False, True), ops.constant(data["b_in"]))
    parts = ops.split(qkv, ops.constant(np.int64(2)), 3).outputs()

    def to_heads(t):
        t = ops.reshape(t, ops.constant(np.array([B, L, H, D], dtype=np.int64)), False)
        return ops.transpose(t, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64)))

    attn = ops.scaled_dot_product_attention(*(to_heads(p) for p in parts), causal=shape.causal)
    attn = ops.transpose(attn, ops.constant(np.array([0, 2, 1, 3], dtype=np.int64)))
    attn = ops.reshape(attn, ops.constant(np.array([B, L, E], dtype=np.int64)), False)
    out = ops.add(ops.matmul(attn, ops.constant(data["w_out"]), False, True), ops.constant(data["b_out"]))
    return ov.Model([out], [x], f"mha_{shape.name}")


def _openvino_config(threads: int, precision: str = "float32") -> dict:
    """float32: the f32 hint; bfloat16: OpenVINO's default inference precision (no hint)."""
    config = {
        "INFERENCE_NUM_THREADS": threads,
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
        "ENABLE_CPU_PINNING": False,  # pinning would also pin this process's other threads
    }
    if precision == "float32":
        config["INFERENCE_PRECISION_HINT"] = "f32"
    return config


def _openvino_note(compiled, what: str) -> str:
    chosen = compiled.get_property("INFERENCE_PRECISION_HINT")
    return f"{what}, inference precision {getattr(chosen, 'get_type_name', lambda: chosen)()}"


def setup_openvino(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    if shape.kind in LAYER_KINDS:
        return setup_openvino_layer(shape, data, threads, precision)
    if shape.kind == "varlen":
        raise NotApplicable("no packed or masked-padding attention model here")
    ov = import_optional("openvino")
    ops = _openvino_ops()
    compiled = ov.Core().compile_model(_openvino_model(shape, data, ops, ov), "CPU",
                                       _openvino_config(threads, precision))
    request = compiled.create_infer_request()
    names = ("q", "k", "v") if shape.kind == "sdpa" else ("x",)
    inputs = [data[name] for name in names]
    if shape.mask_given:
        inputs.append(causal_additive_mask(shape.L, shape.S, np.float32))
    for i, array in enumerate(inputs):  # inputs bound once, sharing the NumPy memory
        request.set_input_tensor(i, ov.Tensor(array, shared_memory=True))

    def run():
        # The tensors share the arrays' memory and do not own it: `inputs` (the mask made
        # here among them) must live as long as the request.
        assert inputs
        request.infer()
        return request.get_output_tensor(0).data

    return Bench(run, lambda out: np.array(out, copy=True),
                 note=_openvino_note(compiled, "opset13.ScaledDotProductAttention"))


# --------------------------------------------------------------------------------------------
# Transformer layers: the layer kinds' adapters
# --------------------------------------------------------------------------------------------


def setup_attnx_layer(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """attnx's nn.Transformer modules, loaded with the case's state dict, in eval mode. The
    decoder step runs TransformerDecoder.step over a cache that one step filled with the S
    cached tokens; the cache lengths are put back after each step."""
    import attnx

    attnx.set_num_threads(threads)
    E, H = shape.E, shape.H
    config = dict(dim_feedforward=shape.ff, activation=shape.activation, batch_first=True, dtype=np.float32,
                  **attnx_precision(precision))
    view = layer_output_view(shape, data)
    if shape.kind == "encoder-layer":
        module = attnx.TransformerEncoderLayer(E, H, **config)
    else:
        from attnx.transformer import LayerNorm

        norm = LayerNorm(E, dtype=np.float32)
        if shape.kind == "encoder-stack":
            module = attnx.TransformerEncoder(attnx.TransformerEncoderLayer(E, H, **config), shape.layers, norm,
                                              **attnx_precision(precision))
        else:
            module = attnx.TransformerDecoder(attnx.TransformerDecoderLayer(E, H, **config), shape.layers, norm,
                                              **attnx_precision(precision))
    module.load_state_dict(data["state"])
    module.eval()
    name = type(module).__name__
    if shape.kind != "decoder-step":
        x = data["x"]
        mask = data.get("key_padding_mask")
        if mask is None:
            return Bench(lambda: module(x), view, note=f"attnx.{name}")
        return Bench(lambda: module(x, src_key_padding_mask=mask), view,
                     note=f"attnx.{name}, src_key_padding_mask")
    memory, tgt = data["memory"], data["tgt"]
    past, new = tgt[:, :shape.S], np.ascontiguousarray(tgt[:, shape.S:])
    cache = module.new_cache(shape.B, shape.S + shape.L, dtype=np.float32)
    module.step(past, memory, cache)
    lengths = [layer.storage().lengths.copy() for layer in cache.layers]
    stepped = [False]

    def reset():
        for layer, n in zip(cache.layers, lengths):
            layer.storage().lengths[:] = n
        stepped[0] = False

    def run():
        if stepped[0]:  # a caller that does not reset (ab.py): put the lengths back here
            reset()
        out = module.step(new, memory, cache)
        stepped[0] = True
        return out

    return Bench(run, view, reset=reset,
                 note=f"attnx.TransformerDecoder.step over new_cache(B, {shape.S + shape.L}) holding {shape.S} tokens")


def torch_layer_module(torch, shape: Shape, data):
    """torch's module of a transformer case, loaded with the case's state dict, in eval mode."""
    nn = torch.nn
    E, H = shape.E, shape.H
    config = dict(dim_feedforward=shape.ff, activation=shape.activation, batch_first=True)
    if shape.kind == "encoder-layer":
        module = nn.TransformerEncoderLayer(E, H, **config)
    elif shape.kind == "encoder-stack":
        module = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, **config), shape.layers, nn.LayerNorm(E))
    else:
        module = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **config), shape.layers, nn.LayerNorm(E))
    module.load_state_dict({name: torch.from_numpy(a) for name, a in data["state"].items()})
    return module.eval()


class TorchCachedDecoder:
    """A decoding loop over an nn.TransformerDecoder's weights (post-norm, batch_first) that
    keeps the keys and values itself, in torch ops: per layer, the new tokens' q, k, v from
    self_attn.in_proj_weight, k and v written into preallocated (B, H, max_len, D) tensors,
    F.scaled_dot_product_attention over the filled part, out_proj, residual and norm1; the
    cross-attention over the memory's keys and values projected once here, residual and norm2;
    the feed-forward block, residual and norm3; the decoder's final norm. `length` is the number
    of cached tokens."""

    def __init__(self, torch, decoder, memory, max_len: int):
        F = torch.nn.functional
        self.torch, self.F, self.decoder = torch, F, decoder
        self.sdpa = F.scaled_dot_product_attention
        B, M, E = memory.shape
        self.H = decoder.layers[0].self_attn.num_heads
        D = E // self.H
        self.length = 0
        with torch.inference_mode():
            self.k = [torch.zeros(B, self.H, max_len, D) for _ in decoder.layers]
            self.v = [torch.zeros(B, self.H, max_len, D) for _ in decoder.layers]
            self.cross = []
            for layer in decoder.layers:
                if layer.norm_first:
                    raise Unavailable("TorchCachedDecoder follows post-norm layers only")
                w, b = layer.multihead_attn.in_proj_weight, layer.multihead_attn.in_proj_bias
                k = F.linear(memory, w[E:2 * E], b[E:2 * E]).view(B, M, self.H, D).transpose(1, 2)
                v = F.linear(memory, w[2 * E:], b[2 * E:]).view(B, M, self.H, D).transpose(1, 2)
                self.cross.append((w[:E], b[:E], k.contiguous(), v.contiguous()))

    def step(self, x):
        """The decoder's output at the new tokens x (B, T, E), which join the cache."""
        torch, F, sdpa = self.torch, self.F, self.sdpa
        B, T, E = x.shape
        H = self.H
        start, end = self.length, self.length + T
        with torch.inference_mode():
            # New token i sees the cached tokens and the new ones up to itself.
            mask = None if T == 1 else torch.ones(T, end, dtype=torch.bool).tril(start)
            for layer, k_cache, v_cache, (wq, bq, k_mem, v_mem) in zip(self.decoder.layers, self.k, self.v,
                                                                       self.cross):
                sa, ca = layer.self_attn, layer.multihead_attn
                q, k, v = F.linear(x, sa.in_proj_weight, sa.in_proj_bias).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
                k_cache[:, :, start:end] = k
                v_cache[:, :, start:end] = v
                a = sdpa(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask)
                x = layer.norm1(x + F.linear(a.transpose(1, 2).reshape(B, T, E), sa.out_proj.weight, sa.out_proj.bias))
                q = F.linear(x, wq, bq).view(B, T, H, E // H).transpose(1, 2)
                a = sdpa(q, k_mem, v_mem)
                x = layer.norm2(x + F.linear(a.transpose(1, 2).reshape(B, T, E), ca.out_proj.weight, ca.out_proj.bias))
                x = layer.norm3(x + layer.linear2(layer.activation(layer.linear1(x))))
            if self.decoder.norm is not None:
                x = self.decoder.norm(x)
        self.length = end
        return x


def torch_nested_encoder(torch, layer, x, mask, view, precision: str) -> Bench:
    """A ragged encoder layer's torch peer: nn.TransformerEncoder(layer, num_layers=1,
    enable_nested_tensor=True) in eval() under inference_mode, which packs the real tokens into a
    nested tensor and skips the padding. torch falls back to the padded batch with a warning at
    construction (norm_first, an odd head count, ...) or silently at the call (training mode, a
    mask that is not left-aligned, ...); the nested path alone gives exactly 0 at the padded
    positions, so a call that does not is reported as unavailable."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoder = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=True).eval()
    if not encoder.use_nested_tensor:
        reasons = "; ".join(str(w.message) for w in caught) or "use_nested_tensor is False"
        raise Unavailable(f"torch's nested-tensor path is off: {reasons}")

    def run_nested():
        with torch.inference_mode():
            return encoder(x, src_key_padding_mask=mask)

    with warnings.catch_warnings():  # torch's once-per-process note that nested tensors are a prototype
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype")
        padded = run_nested()[mask]
    if padded.numel() and bool(padded.abs().max() != 0):
        raise Unavailable("torch did not take its nested-tensor path (the padded positions' outputs are not 0)")
    return Bench(run_nested, lambda t: view(t.float().numpy()),
                 note=f"nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=True) eval(), inference_mode "
                      f"(nested-tensor path: padded outputs 0), {torch_note(torch, precision)}")


def setup_torch_layer(shape: Shape, data, threads: int, precision: str = "float32") -> Bench | dict[str, Bench]:
    """torch's own modules under inference_mode (the encoder layer and stack take torch's fused
    fast path there). The decoder step has two peers: "torch-recompute", the decoder's forward
    over all S + L target tokens with a causal tgt_mask, of which the last L positions are the
    step's; "torch-cached", TorchCachedDecoder's step over S cached tokens."""
    torch = import_optional("torch")
    torch.set_num_threads(threads)
    if precision != "float32" and shape.kind == "decoder-step":
        raise NotApplicable("the torch decoding loops run in float32")
    dtype = torch_dtype(torch, precision)
    module = torch_layer_module(torch, shape, data).to(dtype)
    view = layer_output_view(shape, data)
    to_numpy = lambda t: view(t.float().numpy())  # noqa: E731
    if shape.kind != "decoder-step":
        x = torch.from_numpy(data["x"]).to(dtype)
        mask = torch.from_numpy(data["key_padding_mask"]) if shape.padded else None
        kwargs = {} if mask is None else {"src_key_padding_mask": mask}
        if shape.ragged:
            return torch_nested_encoder(torch, module, x, mask, view, precision)

        def run_encoder():
            with torch.inference_mode():
                return module(x, **kwargs)

        return Bench(run_encoder, to_numpy, note=f"nn.{type(module).__name__} eval(), inference_mode (fast path), "
                                                 f"{torch_note(torch, precision)}")
    tgt, memory = torch.from_numpy(data["tgt"]), torch.from_numpy(data["memory"])
    n, T = shape.S + shape.L, shape.L
    causal = torch.nn.Transformer.generate_square_subsequent_mask(n)

    def run_recompute():
        with torch.inference_mode():
            return module(tgt, memory, tgt_mask=causal, tgt_is_causal=True)[:, -T:]

    cached = TorchCachedDecoder(torch, module, memory, n)
    cached.step(tgt[:, :shape.S])
    new = tgt[:, shape.S:].contiguous()
    stepped = [False]

    def reset():
        cached.length = shape.S
        stepped[0] = False

    def run_cached():
        if stepped[0]:  # a caller that does not reset: put the length back here
            reset()
        out = cached.step(new)
        stepped[0] = True
        return out

    # The loop against torch's own forward (the reference check follows in bench_shape).
    reset()
    full = run_recompute().numpy()
    agreement = float(np.max(np.abs(run_cached().numpy() - full)))
    return {
        "torch-recompute": Bench(run_recompute, to_numpy,
                                 note=f"nn.TransformerDecoder eval() over all {n} tokens, causal tgt_mask, "
                                      f"inference_mode, the last {T} position(s)"),
        "torch-cached": Bench(run_cached, to_numpy, reset=reset,
                              note=f"a loop over the decoder's weights caching k/v in torch tensors, "
                                   f"F.scaled_dot_product_attention, inference_mode (max |step - full forward| "
                                   f"= {agreement:.1e})"),
    }


_exported: dict[str, bytes] = {}


def export_onnx_layer(shape: Shape, data) -> bytes:
    """torch's module of an encoder case exported to ONNX with the TorchScript exporter
    (dynamo=False), inputs "src" and "src_key_padding_mask" (padded cases), output "output";
    made once per process and shared by ONNX Runtime and OpenVINO."""
    if shape.name in _exported:
        return _exported[shape.name]
    if shape.kind == "decoder-step":
        raise NotApplicable("the decoder step needs a cache the exported graph does not have")
    import io
    import warnings

    torch = import_optional("torch")
    import_optional("onnx")
    module = torch_layer_module(torch, shape, data)
    x = torch.from_numpy(data["x"])
    args, names = (x,), ["src"]
    if shape.padded:
        args, names = (x, None, torch.from_numpy(data["key_padding_mask"])), ["src", "src_key_padding_mask"]
    buffer = io.BytesIO()
    # Traced on torch's general path: the fused fast path (taken without gradients) is one
    # operator that has no ONNX export.
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, buffer, dynamo=False, input_names=names, output_names=["output"],
                              opset_version=17)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise Unavailable(f"torch.onnx.export(dynamo=False) failed: {type(exc).__name__}: {first_line}") from None
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    _exported[shape.name] = buffer.getvalue()
    return _exported[shape.name]


def _layer_feeds(shape: Shape, data) -> dict[str, np.ndarray]:
    feeds = {"src": data["x"]}
    if shape.padded:
        feeds["src_key_padding_mask"] = data["key_padding_mask"]
    return feeds


def setup_onnxruntime_layer(shape: Shape, data, threads: int) -> Bench:
    """ONNX Runtime on export_onnx_layer's model, all graph optimisations, inputs bound once
    (float32: setup_onnxruntime sits bfloat16 out)."""
    ort = import_optional("onnxruntime")
    model = export_onnx_layer(shape, data)
    try:
        session = ort.InferenceSession(model, ort_session_options(ort, threads), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise Unavailable(f"ONNX Runtime cannot load the exported model: {type(exc).__name__}: {exc}") from None
    feeds = _layer_feeds(shape, data)
    return Bench(_ort_bound_run(session, feeds), layer_output_view(shape, data), exported=True,
                 note="the torch module exported with torch.onnx.export(dynamo=False), opset 17")


def setup_openvino_layer(shape: Shape, data, threads: int, precision: str = "float32") -> Bench:
    """OpenVINO reading export_onnx_layer's model, compiled as for the other shapes."""
    ov = import_optional("openvino")
    model = export_onnx_layer(shape, data)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        with open(path, "wb") as f:
            f.write(model)
        try:
            compiled = ov.Core().compile_model(ov.Core().read_model(path), "CPU",
                                               _openvino_config(threads, precision))
        except Exception as exc:
            raise Unavailable(f"OpenVINO cannot compile the exported model: {type(exc).__name__}: {exc}") from None
    request = compiled.create_infer_request()
    inputs = _layer_feeds(shape, data)
    for name, array in inputs.items():  # inputs bound once, sharing the NumPy memory
        request.set_tensor(name, ov.Tensor(array, shared_memory=True))

    def run():
        assert inputs  # shared, not owned: the arrays must live as long as the request
        request.infer()
        return request.get_output_tensor(0).data

    view = layer_output_view(shape, data)
    return Bench(run, lambda out: view(np.array(out, copy=True)), exported=True,
                 note=_openvino_note(compiled, "the exported ONNX model read by OpenVINO"))


# An adapter returns one Bench, or several by name (torch's two decoder-step peers, attnx's
# ragged cases with their baseline).
# Each takes (shape, data, threads, precision=...).
ADAPTERS: dict[str, Callable[..., Bench | dict[str, Bench]]] = {
    "attnx": setup_attnx_with_baselines,
    "numpy": setup_numpy,
    "torch": setup_torch,
    "onnxruntime": setup_onnxruntime,
    "openvino": setup_openvino,
}


def prepare_benches(shape: Shape, libs: list[str], threads: int,
                    precision: str = "float32") -> tuple[dict[str, dict], dict[str, Bench]]:
    """Every library of `libs` set up for `shape` (ADAPTERS) and its output checked against the
    float64 reference: each name's status ("ok" with the check's figures, or why it does not
    run) and the Benches of those that run. A peer's failure is reported in its status; attnx's
    is raised."""
    data = make_inputs(shape)
    reference = reference_output(shape, data)
    status: dict[str, dict] = {}
    benches: dict[str, Bench] = {}
    for lib in libs:
        try:
            made = ADAPTERS[lib](shape, data, threads, precision=precision)
        except NotInstalled as exc:
            status[lib] = {"status": "not installed", "note": str(exc)}
            continue
        except Unavailable as exc:
            status[lib] = {"status": "unavailable", "note": str(exc)}
            continue
        except NotApplicable as exc:
            status[lib] = {"status": "n/a", "note": str(exc)}
            continue
        except Exception as exc:  # a peer's set-up problem is reported, not fatal
            if lib == "attnx":
                raise
            status[lib] = {"status": "error", "note": f"{type(exc).__name__}: {exc}"}
            continue
        for name, bench in (made.items() if isinstance(made, dict) else [(lib, made)]):
            want = reference if bench.reference is None else bench.reference
            try:
                check = check_output(bench.to_numpy(call_once(bench)), want, precision)
            except Exception as exc:
                if name == "attnx":
                    raise
                status[name] = {"status": "error", "note": f"{type(exc).__name__}: {exc}"}
                continue
            if bench.exported and not check["ok"]:
                # A model exported from torch that computes something else is the export's
                # fault, not the runtime's: the peer is unavailable for this case.
                status[name] = {"status": "unavailable",
                                "note": f"{bench.note}: output differs from the reference by {check['max_abs_diff']}"}
                continue
            status[name] = {"status": "ok", "note": bench.note, **check}
            benches[name] = bench
            if not check["ok"]:
                log(f"  WARNING: {name} output differs from the reference by {check['max_abs_diff']}")
    return status, benches


def library_versions() -> dict[str, str | None]:
    """Versions of the libraries (None = not installed)."""
    versions: dict[str, str | None] = {}
    for name in (*LIBRARIES, "onnx"):
        try:
            versions[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except ImportError:
            versions[name] = None
    try:
        versions["numpy_blas"] = np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    except (AttributeError, KeyError, TypeError):
        versions["numpy_blas"] = "?"
    try:
        import attnx

        versions["attnx_config"] = json.dumps(attnx.show_config(), default=str)
    except ImportError:
        pass
    return versions

