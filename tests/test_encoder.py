"""A real sentence encoder whose attention layers call attnx gives the embeddings of its PyTorch original.

The torch model is a small transformer sentence encoder: token and learned position embeddings,
two ``nn.TransformerEncoderLayer`` (batch_first, post-norm/ReLU or pre-norm/GELU) in an
``nn.TransformerEncoder`` with a final LayerNorm, and mean pooling over the non-padding tokens.
The NumPy copy reads the torch model's state_dict (as NumPy arrays) and does everything in plain
NumPy except attention, which goes through ``attnx.multi_head_attention_forward`` or an
``attnx.MultiheadAttention`` loaded from the layer's ``self_attn`` weights, with a
key_padding_mask for sentences of different lengths.
"""

import math
import warnings

import numpy as np
import pytest

import attnx

torch = pytest.importorskip("torch")
nn = torch.nn

VOCAB, D_MODEL, NHEAD, DIM_FF, NUM_LAYERS, MAX_LEN = 50, 32, 4, 64, 2, 16
PAD = 0
LENGTHS = [12, 7, 3, 9, 1]
TOL = {"rtol": 1e-5, "atol": 1e-5}


class TorchSentenceEncoder(nn.Module):
    def __init__(self, norm_first, activation):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL, padding_idx=PAD)
        self.pos = nn.Embedding(MAX_LEN, D_MODEL)
        layer = nn.TransformerEncoderLayer(
            D_MODEL, NHEAD, DIM_FF, dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first
        )
        # The nested-tensor path only exists for post-norm layers (torch warns otherwise).
        self.encoder = nn.TransformerEncoder(
            layer, NUM_LAYERS, norm=nn.LayerNorm(D_MODEL), enable_nested_tensor=not norm_first
        )

    def forward(self, tokens):
        padding = tokens == PAD  # True = ignore this key
        positions = torch.arange(tokens.shape[1])
        x = self.tok(tokens) + self.pos(positions)[None]
        x = self.encoder(x, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return (x * keep).sum(1) / keep.sum(1)


def make_torch_encoder(norm_first, activation):
    torch.manual_seed(0)
    model = TorchSentenceEncoder(norm_first, activation)
    with torch.no_grad():
        # Biases and LayerNorm parameters start at 0/1: make them random so that each one counts.
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def torch_embed(model, tokens):
    """The torch model's embeddings in eval mode, on NumPy token ids."""
    with torch.no_grad(), warnings.catch_warnings():
        # Post-norm layers take torch's nested-tensor path for padded batches, which warns that
        # nested tensors are a prototype; the path is what torch users run, so keep it.
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors", category=UserWarning)
        return model(torch.from_numpy(tokens)).numpy()


def make_batch(seed=0):
    """Token ids (N, max(LENGTHS)) padded with PAD, one sentence per row."""
    rng = np.random.default_rng(seed)
    tokens = np.full((len(LENGTHS), max(LENGTHS)), PAD, dtype=np.int64)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = rng.integers(1, VOCAB, size=n)
    return tokens


# ---------------------------------------------------------------------------------------------
# The NumPy encoder
# ---------------------------------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x):
    """Exact (erf) GELU, torch's default."""
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype)


def relu(x):
    return np.maximum(x, 0)


def layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def linear(x, weight, bias):
    return x @ weight.T + bias


class NumpySentenceEncoder:
    """The same encoder in NumPy, from the torch model's state_dict; attention by attnx."""

    def __init__(self, state, norm_first, activation, attention):
        self.p = state
        self.norm_first = norm_first
        self.activation = {"relu": relu, "gelu": gelu}[activation]
        self.attention = attention
        self.modules = []
        for i in range(NUM_LAYERS):
            prefix = f"encoder.layers.{i}.self_attn."
            module = attnx.MultiheadAttention(D_MODEL, NHEAD, batch_first=True, seed=0)
            module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            self.modules.append(module)

    def self_attention(self, i, x, padding):
        if self.attention == "module":
            out, weights = self.modules[i](x, x, x, key_padding_mask=padding, need_weights=False)
        else:
            p = lambda name: self.p[f"encoder.layers.{i}.self_attn.{name}"]  # noqa: E731
            out, weights = attnx.multi_head_attention_forward(
                x, x, x, D_MODEL, NHEAD,
                p("in_proj_weight"), p("in_proj_bias"), None, None, False, 0.0,
                p("out_proj.weight"), p("out_proj.bias"),
                training=False, key_padding_mask=padding, need_weights=False, batch_first=True,
            )  # fmt: skip
        assert weights is None
        return out

    def feed_forward(self, i, x):
        p = lambda name: self.p[f"encoder.layers.{i}.{name}"]  # noqa: E731
        h = self.activation(linear(x, p("linear1.weight"), p("linear1.bias")))
        return linear(h, p("linear2.weight"), p("linear2.bias"))

    def __call__(self, tokens):
        padding = tokens == PAD
        x = self.p["tok.weight"][tokens] + self.p["pos.weight"][: tokens.shape[1]][None]
        for i in range(NUM_LAYERS):
            p = lambda name: self.p[f"encoder.layers.{i}.{name}"]  # noqa: E731
            norm1 = lambda h: layer_norm(h, p("norm1.weight"), p("norm1.bias"))  # noqa: E731
            norm2 = lambda h: layer_norm(h, p("norm2.weight"), p("norm2.bias"))  # noqa: E731
            if self.norm_first:
                x = x + self.self_attention(i, norm1(x), padding)
                x = x + self.feed_forward(i, norm2(x))
            else:
                x = norm1(x + self.self_attention(i, x, padding))
                x = norm2(x + self.feed_forward(i, x))
        x = layer_norm(x, self.p["encoder.norm.weight"], self.p["encoder.norm.bias"])
        keep = (~padding)[..., None].astype(x.dtype)
        return (x * keep).sum(1) / keep.sum(1)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

VARIANTS = [(False, "relu"), (True, "gelu"), (False, "gelu"), (True, "relu")]


@pytest.mark.parametrize("attention", ["functional", "module"])
@pytest.mark.parametrize("norm_first, activation", VARIANTS, ids=lambda v: str(v))
def test_sentence_embeddings_match_torch(norm_first, activation, attention):
    model = make_torch_encoder(norm_first, activation)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ours_model = NumpySentenceEncoder(state, norm_first, activation, attention)
    tokens = make_batch()

    theirs = torch_embed(model, tokens)
    ours = ours_model(tokens)

    assert ours.shape == theirs.shape == (len(LENGTHS), D_MODEL)
    assert ours.dtype == np.float32
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, theirs, **TOL)


@pytest.mark.parametrize("attention", ["functional", "module"])
def test_padding_does_not_change_a_sentence_embedding(attention):
    """Each sentence alone (no padding) has the embedding it has in the padded batch, as in torch."""
    norm_first, activation = False, "relu"
    model = make_torch_encoder(norm_first, activation)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ours_model = NumpySentenceEncoder(state, norm_first, activation, attention)
    tokens = make_batch(seed=1)
    batch = ours_model(tokens)
    for i, n in enumerate(LENGTHS):
        alone = ours_model(tokens[i : i + 1, :n])
        np.testing.assert_allclose(alone[0], batch[i], **TOL)
        theirs = torch_embed(model, tokens[i : i + 1, :n])
        np.testing.assert_allclose(alone[0], theirs[0], **TOL)


def test_attention_layers_convert_with_from_torch():
    """The encoder layer's self_attn converts to an attnx module that reproduces its outputs."""
    model = make_torch_encoder(True, "gelu")
    tokens = make_batch(seed=2)
    padding = tokens == PAD
    with torch.no_grad():
        x = model.tok(torch.from_numpy(tokens)) + model.pos(torch.arange(tokens.shape[1]))[None]
        for layer in model.encoder.layers:
            h = layer.norm1(x)
            theirs, _ = layer.self_attn(h, h, h, key_padding_mask=torch.from_numpy(padding), need_weights=False)
            ours, _ = attnx.MultiheadAttention.from_torch(layer.self_attn)(
                h.numpy(), h.numpy(), h.numpy(), key_padding_mask=padding, need_weights=False
            )
            np.testing.assert_allclose(ours, theirs.numpy(), **TOL)
            x = layer(x, src_key_padding_mask=torch.from_numpy(padding))
