"""A typed program that uses attnx's public API: `mypy --strict` must accept it.

tests/test_typing.py type-checks it (and runs it, so that it stays a working program).
It calls the API as its documentation does, so that the annotations admit what the
documentation promises: ``is_causal="bottom_right"``, ``dtype=np.float16``, and so on.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import numpy.typing as npt

import attnx
from attnx import reference


def attend() -> npt.NDArray[np.floating[Any]]:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 1, 16), dtype=np.float32)
    k = v = rng.standard_normal((2, 4, 8, 16), dtype=np.float32)
    out = attnx.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", window=(3, None))
    top_left = attnx.scaled_dot_product_attention(q, k, v, is_causal="top_left", scale=0.25)
    causal = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, out=np.empty_like(out))
    masked = attnx.scaled_dot_product_attention([[1.0, 0.0]], [[1.0, 0.0]], [[2.0, 3.0]], attn_mask=[[True]])
    assert out.shape == top_left.shape == causal.shape and masked.shape == (1, 2)
    expected = reference.scaled_dot_product_attention(q, k, v, is_causal="bottom_right", window=(3, None))
    assert np.allclose(out, expected, atol=1e-5)
    packed = rng.standard_normal((9, 4, 16), dtype=np.float32)  # sequences of 4 and 5 tokens
    ragged = attnx.varlen_attention(packed, packed[:, :2], packed[:, :2], [0, 4, 9], is_causal="bottom_right",
                                    window=(2, 0), precision="bfloat16")
    assert ragged.shape == (9, 4, 16)
    return out


def module() -> None:
    mha = attnx.MultiheadAttention(16, 4, batch_first=True, dtype=np.float16, seed=0)
    x = np.ones((2, 5, 16), np.float16)
    out, weights = mha(x, x, x, is_causal="bottom_right")
    assert weights is not None and weights.shape == (2, 5, 5)
    out2, none = mha.forward(x, x, x, need_weights=False)
    assert none is None and out2.dtype == np.float16 == mha.dtype
    state = mha.state_dict()
    result = attnx.MultiheadAttention(16, 4, dtype="float64").load_state_dict(state, strict=False)
    missing: List[str] = result.missing_keys
    assert missing == [] and result.unexpected_keys == []
    weight: Optional[npt.NDArray[np.floating[Any]]] = mha.in_proj_weight
    assert weight is not None and mha.out_proj_weight.shape == (16, 16)
    assert out.shape == (2, 5, 16)

    cache = mha.new_cache(batch=2, max_len=32)
    first = mha.step(x, cache)
    second = mha.step(np.ones((2, 1, 16), np.float32), cache, lengths=[1, 0])
    assert first.shape == (2, 5, 16) and second.shape == (2, 1, 16)
    assert cache.lengths.tolist() == [6, 5]

    # torch's constructor order, modes and parameter views.
    torch_like = attnx.MultiheadAttention(16, 4, 0.1, True, False, False, None, None, True, "cpu", None, seed=1)
    same: attnx.MultiheadAttention = torch_like.eval()
    assert same is torch_like and not torch_like.training and torch_like.dropout == 0.1
    names: List[str] = [name for name, _ in torch_like.named_parameters(prefix="attn")]
    sizes = sum(p.size for p in torch_like.parameters(recurse=False))
    assert names[0] == "attn.in_proj_weight" and sizes == 48 * 16 + 48
    torch_like.out_proj.weight = np.eye(16, dtype=np.float32)
    bias: Optional[npt.NDArray[np.floating[Any]]] = torch_like.out_proj.bias
    assert torch_like.out_proj_weight is torch_like.out_proj.weight and bias is not None
    assert torch_like.train().training and torch_like.train(False) is torch_like


def decode() -> None:
    cache = attnx.KVCache(2, 2, 64, 8, dtype=np.float16, value_dim=8)
    k = v = np.ones((2, 2, 3, 8), np.float32)
    cache.append(k, v, lengths=[3, 1])
    q = np.ones((2, 4, 1, 8), np.float32)
    out = attnx.cached_attention(q, cache)
    new = attnx.cached_attention(q, cache, k[:, :, :1], v[:, :, :1], lengths=np.array([1, 1]), scale=0.5)
    key, value, lengths = cache.storage()
    n: int = cache.batch + cache.num_kv_heads + cache.max_len + cache.head_dim + cache.value_dim + cache.nbytes
    assert out.shape == new.shape == (2, 4, 1, 8) and key.shape == value.shape and n > 0
    assert lengths.tolist() == [4, 2] and cache.dtype == np.float16
    cache.reset(0)
    cache.reset()

    mha = attnx.MultiheadAttention(8, 2, seed=0)
    step_cache = mha.new_cache(1, 8)
    w = mha.in_proj_weight
    assert w is not None
    step = attnx.multi_head_attention_step(
        np.ones((1, 1, 8), np.float32), step_cache, 2, w, mha.in_proj_bias,
        mha.out_proj_weight, mha.out_proj_bias, lengths=[1],
    )
    full, weights = attnx.multi_head_attention_forward(
        np.ones((1, 1, 8), np.float32), np.ones((1, 1, 8), np.float32), np.ones((1, 1, 8), np.float32),
        8, 2, w, mha.in_proj_bias, None, None, False, 0.0, mha.out_proj_weight, mha.out_proj_bias,
        training=False, is_causal="bottom_right",
    )
    assert weights is not None and step.shape == full.shape == (1, 1, 8)
    expected, _ = reference.multi_head_attention_forward(
        np.ones((1, 1, 8)), np.ones((1, 1, 8)), np.ones((1, 1, 8)),
        8, 2, w, mha.in_proj_bias, None, None, False, 0.0, mha.out_proj_weight, mha.out_proj_bias,
        need_weights=False,
    )
    assert np.allclose(full, expected, atol=1e-5)
    lengths_ref = reference.cached_attention(q, key, value, [4, 2], query_lengths=[1, 1], window=(2, 0))
    assert lengths_ref.shape == (2, 4, 1, 8)


def rotary() -> None:
    rope = attnx.RotaryEmbedding(16, 500000.0, rotary_dim=8, interleaved=False,
                                 scaling={"rope_type": "linear", "factor": 2.0})
    x = np.ones((3, 2, 16), np.float32)
    rotated: npt.NDArray[np.floating[Any]] = rope(x, np.arange(3))
    freq: npt.NDArray[np.floating[Any]] = rope.inv_freq
    scaling: Optional[Dict[str, Any]] = rope.scaling
    dims: int = rope.head_dim + rope.rotary_dim
    assert rotated.shape == x.shape and freq.shape == (4,) and scaling is not None and dims == 24
    assert rope.base == 500000.0 and not rope.interleaved and rope.attention_scaling == 1.0
    gptj = attnx.RotaryEmbedding.from_config({"model_type": "gptj", "n_embd": 64, "n_head": 4, "rotary_dim": 8})
    assert gptj.interleaved and gptj.head_dim == 16
    cache = attnx.KVCache(1, 2, 16, 16)
    k = np.ones((1, 2, 3, 16), np.float32)
    out = attnx.cached_attention(np.ones((1, 4, 3, 16), np.float32), cache, k, k, rope=rope,
                                 positions=np.array([[4, 5, 6]]))
    expected = reference.rotary_embedding(x, [0, 1, 2], rope.inv_freq, 8)
    assert out.shape == (1, 4, 3, 16) and np.allclose(rotated, expected, atol=1e-6)


def transformer() -> None:
    model = attnx.Transformer(16, 4, 1, 2, 32, 0.1, "gelu", batch_first=True, dtype="float64", seed=0)
    same: attnx.Transformer = model.eval()
    src = np.ones((2, 7, 16), np.float32)
    tgt = np.ones((2, 3, 16), np.float32)
    mask = attnx.Transformer.generate_square_subsequent_mask(3)
    padding = np.zeros((2, 7), dtype=bool)
    out = model(src, tgt, tgt_mask=mask, src_key_padding_mask=padding, memory_key_padding_mask=padding)
    assert same is model and out.shape == (2, 3, 16) and out.dtype == np.float64

    def swish(x: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.floating[Any]]:
        y: npt.NDArray[np.floating[Any]] = x / (1.0 + np.exp(-x))
        return y

    layer = attnx.TransformerEncoderLayer(16, 4, 32, 0.0, swish, 1e-6, True, True, False, "cpu", None, seed=1)
    encoder = attnx.TransformerEncoder(layer, 2, attnx.transformer.LayerNorm(16), enable_nested_tensor=False)
    encoded = encoder.forward(src, mask=None, src_key_padding_mask=padding, is_causal=True)
    decoder_layer = attnx.TransformerDecoderLayer(16, 4, dropout=0.0, batch_first=True)
    decoder = attnx.TransformerDecoder(decoder_layer, 1)
    decoded = decoder(tgt, encoded, tgt_is_causal=None, memory_is_causal=False)
    single = layer(src[0], is_causal=False)
    assert decoded.shape == tgt.shape and single.shape == (7, 16)
    names: List[str] = [name for name, _ in decoder.named_parameters(prefix="decoder")]
    state = encoder.state_dict()
    result = attnx.TransformerEncoder(layer, 2, attnx.transformer.LayerNorm(16)).load_state_dict(state)
    weight: npt.NDArray[np.floating[Any]] = decoder_layer.linear1.weight
    bias: Optional[npt.NDArray[np.floating[Any]]] = decoder_layer.norm3.bias
    assert names[0] == "decoder.layers.0.self_attn.in_proj_weight" and result.missing_keys == []
    assert weight.shape == (2048, 16) and bias is not None and decoder_layer.batch_first is True
    expected = reference.transformer_encoder_layer(src[0].astype(np.float64), layer.state_dict(), 4,
                                                   activation=swish, layer_norm_eps=1e-6, norm_first=True)
    assert np.allclose(single, expected, atol=1e-5)


def runtime() -> None:
    threads: int = attnx.get_num_threads()
    attnx.set_num_threads(1)
    config = attnx.show_config()
    version: str = config["version"]
    kernels: List[str] = config["kernels"]
    openmp: bool = config["openmp"]
    assert config["threads"] == 1 and version == attnx.__version__ and kernels and openmp in (True, False)
    attnx.set_num_threads(threads)


def precision() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 4, 16), dtype=np.float32)
    out = attnx.scaled_dot_product_attention(q, q, q, is_causal=True, precision="bfloat16")
    rounded = reference.scaled_dot_product_attention(q, q, q, is_causal=True, precision="bfloat16")
    assert np.abs(out - rounded).max() < 3e-3
    mha = attnx.MultiheadAttention(16, 4, batch_first=True, seed=0, precision="bfloat16")
    x = np.ones((2, 3, 16), np.float32)
    y, _ = mha(x, x, x, precision="float32")
    mha.precision = "float32"
    step = mha.step(x, mha.new_cache(2, 4), precision="bfloat16")
    layer = attnx.TransformerEncoderLayer(16, 4, 32, 0.0, precision="bfloat16")
    encoder = attnx.TransformerEncoder(layer, 2, precision=None)
    z = encoder(x, precision="bfloat16")
    kept: Optional[str] = encoder.precision
    assert y.shape == step.shape == z.shape and kept == layer.precision == "bfloat16"


def main() -> None:
    attend()
    module()
    decode()
    rotary()
    transformer()
    runtime()
    precision()


if __name__ == "__main__":
    main()
