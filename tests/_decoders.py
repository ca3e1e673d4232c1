"""NumPy forward passes of four transformers decoder architectures, attention by attnx.

Llama, Gemma 2, Phi and GPT-J, each as a ``forward(caches, seqs, tokens, query_lens)`` over
packed rows that ``examples/generate.py``'s ``serve`` drives (continuous batching, chunked
prefill, forked prefixes): the weights are a transformers model's state_dict as NumPy arrays,
the attention one ``attnx.paged_attention`` call per layer and step. ``hf_model`` makes the
transformers model of each architecture, small and with random weights.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import numpy as np

import attnx

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate.py"


def load_example():
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# The transformers configurations: a few layers of width 64, 4 query heads of 16 over 2
# key/value heads (GPT-J has no grouped heads: 4 over 4), a vocabulary of 256. Weights of std
# 0.2 (not transformers' 0.02) give attention that is not uniform and logits far from ties.
COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 512, "initializer_range": 0.2,
          "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
CONFIGS = {
    "llama": dict(COMMON, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}),
    # Sliding attention (a window of 6 tokens) on layers 0 and 2, full on 1; caps that bite.
    "gemma2": dict(COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                   hidden_activation="gelu_pytorch_tanh", rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 10000.0}),
    # Half of each head rotated, positions divided by 2.
    "phi": dict(COMMON, num_key_value_heads=2, hidden_act="gelu_new",
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5}),
    # Pairs (0, 1), (2, 3), ... of the first 8 of 16 features rotated.
    "gptj": {"vocab_size": 256, "n_embd": 64, "n_inner": 128, "n_layer": 2, "n_head": 4, "rotary_dim": 8,
             "n_positions": 512, "initializer_range": 0.2, "activation_function": "gelu_new",
             "bos_token_id": None, "eos_token_id": None, "pad_token_id": None},
}
ARCHS = list(CONFIGS)


def hf_model(arch: str, seed: int = 0):
    """transformers' model of ``arch``, random weights; the vectors (norm weights, biases) are
    drawn too, so that each takes part (they start as ones and zeros)."""
    import torch
    import transformers

    names = {"llama": "Llama", "gemma2": "Gemma2", "phi": "Phi", "gptj": "GPTJ"}
    config = getattr(transformers, names[arch] + "Config")(**CONFIGS[arch], attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, names[arch] + "ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x):
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


def rope_of(arch: str, config) -> attnx.RotaryEmbedding:
    """Each architecture's rotary embedding, from its configuration's fields."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "gptj":                       # GPT-J rotates interleaved pairs, base 10000
        return attnx.RotaryEmbedding(head_dim, 10000.0, rotary_dim=config.rotary_dim, interleaved=True)
    params = dict(config.rope_parameters)
    base = params.pop("rope_theta")
    rotary_dim = int(head_dim * params.pop("partial_rotary_factor", 1.0))
    scaling = None if params["rope_type"] == "default" else params
    return attnx.RotaryEmbedding(head_dim, base, rotary_dim=rotary_dim, scaling=scaling)


class Decoder:
    """A decoder's forward pass over packed rows; ``layer`` and ``head`` are each architecture's."""

    def __init__(self, arch: str, model):
        config = model.config
        self.arch, self.config = arch, config
        self.w = {k: t.detach().numpy().copy() for k, t in model.state_dict().items()}
        # Linear weights (out, in) transposed once to (in, out): a projection is `x @ w`.
        for k in list(self.w):
            if self.w[k].ndim == 2 and not k.endswith(("embed_tokens.weight", "wte.weight")):
                self.w[k] = np.ascontiguousarray(self.w[k].T)
        self.layers = config.num_hidden_layers
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.rope = rope_of(arch, config)

    def new_caches(self, num_blocks, block_size, dtype=np.float32):
        return [attnx.PagedKVCache(num_blocks, block_size, self.kv_heads, self.head_dim, dtype)
                for _ in range(self.layers)]

    def forward(self, caches, seqs, tokens, query_lens):
        x = self.embed(np.asarray(tokens))
        for n, cache in enumerate(caches):
            def attend(q, k, v, **options):
                t = len(q)
                q, k, v = (a.reshape(t, -1, self.head_dim) for a in (q, k, v))
                out = attnx.paged_attention(q, cache, [s[n] for s in seqs], query_lens, k, v, rope=self.rope,
                                            **options)
                return out.reshape(t, -1)
            x = getattr(self, "layer_" + self.arch)(f"model.layers.{n}.", n, x, attend)
        return self.head(x[np.cumsum(query_lens) - 1])

    def embed(self, tokens):
        if self.arch == "gptj":
            return self.w["transformer.wte.weight"][tokens]
        x = self.w["model.embed_tokens.weight"][tokens]
        if self.arch == "gemma2":            # scaled by sqrt(hidden), rounded to float32 first
            x = x * np.float32(self.config.hidden_size ** 0.5)
        return x

    def head(self, x):
        w, c = self.w, self.config
        if self.arch == "llama":
            return rms_norm(x, w["model.norm.weight"], c.rms_norm_eps) @ w["lm_head.weight"]
        if self.arch == "gemma2":
            lm_head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"].T
            logits = rms_norm(x, 1.0 + w["model.norm.weight"], c.rms_norm_eps) @ lm_head
            cap = c.final_logit_softcapping
            return cap * np.tanh(logits / cap)
        if self.arch == "phi":
            x = layer_norm(x, w["model.final_layernorm.weight"], w["model.final_layernorm.bias"], c.layer_norm_eps)
        else:
            x = layer_norm(x, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], c.layer_norm_epsilon)
        return x @ w["lm_head.weight"] + w["lm_head.bias"]

    def layer_llama(self, p, n, x, attend):
        w, eps = self.w, self.config.rms_norm_eps
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        a = attend(h @ w[p + "self_attn.q_proj.weight"], h @ w[p + "self_attn.k_proj.weight"],
                   h @ w[p + "self_attn.v_proj.weight"])
        x = x + a @ w[p + "self_attn.o_proj.weight"]
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        return x + (silu(h @ w[p + "mlp.gate_proj.weight"]) * (h @ w[p + "mlp.up_proj.weight"])) @ w[
            p + "mlp.down_proj.weight"]

    def layer_gemma2(self, p, n, x, attend):
        w, c = self.w, self.config

        def norm(x, name):                   # Gemma's RMSNorm scales by (1 + weight)
            return rms_norm(x, 1.0 + w[p + name + ".weight"], c.rms_norm_eps)

        # transformers' sliding_window=W: a query sees itself and the W - 1 keys before it.
        window = (c.sliding_window - 1, 0) if c.layer_types[n] == "sliding_attention" else None
        h = norm(x, "input_layernorm")
        a = attend(h @ w[p + "self_attn.q_proj.weight"], h @ w[p + "self_attn.k_proj.weight"],
                   h @ w[p + "self_attn.v_proj.weight"], scale=c.query_pre_attn_scalar ** -0.5,
                   softcap=c.attn_logit_softcapping, window=window)
        x = x + norm(a @ w[p + "self_attn.o_proj.weight"], "post_attention_layernorm")
        h = norm(x, "pre_feedforward_layernorm")
        m = (gelu_tanh(h @ w[p + "mlp.gate_proj.weight"]) * (h @ w[p + "mlp.up_proj.weight"])) @ w[
            p + "mlp.down_proj.weight"]
        return x + norm(m, "post_feedforward_layernorm")

    def layer_phi(self, p, n, x, attend):
        # Attention and MLP side by side on one LayerNorm's output, both added to the residual.
        w = self.w
        h = layer_norm(x, w[p + "input_layernorm.weight"], w[p + "input_layernorm.bias"], self.config.layer_norm_eps)
        q, k, v = (h @ w[p + f"self_attn.{s}_proj.weight"] + w[p + f"self_attn.{s}_proj.bias"] for s in "qkv")
        a = attend(q, k, v) @ w[p + "self_attn.dense.weight"] + w[p + "self_attn.dense.bias"]
        m = gelu_tanh(h @ w[p + "mlp.fc1.weight"] + w[p + "mlp.fc1.bias"]) @ w[p + "mlp.fc2.weight"] + w[
            p + "mlp.fc2.bias"]
        return x + a + m

    def layer_gptj(self, p, n, x, attend):
        w = self.w
        p = f"transformer.h.{n}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], self.config.layer_norm_epsilon)
        a = attend(h @ w[p + "attn.q_proj.weight"], h @ w[p + "attn.k_proj.weight"], h @ w[p + "attn.v_proj.weight"])
        m = gelu_tanh(h @ w[p + "mlp.fc_in.weight"] + w[p + "mlp.fc_in.bias"]) @ w[p + "mlp.fc_out.weight"] + w[
            p + "mlp.fc_out.bias"]
        return x + a @ w[p + "attn.out_proj.weight"] + m


def hf_generate(model, prompt, max_new_tokens):
    """transformers' greedy tokens and the logits each was picked from, ``(steps, vocab)``."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), np.stack([x[0].numpy() for x in out.logits])


def relative_error(ours, theirs):
    """max |ours - theirs| relative to the largest |logit| of theirs, per step."""
    return np.abs(ours - theirs).max(-1) / np.abs(theirs).max(-1)


def top2_margin(logits):
    """The gap between the two largest logits of each step, relative to the largest |logit|."""
    top = np.sort(logits, axis=-1)[..., -2:]
    return (top[..., 1] - top[..., 0]) / np.abs(logits).max(-1)
