"""attnx.RotaryEmbedding and cached_attention(rope=): transformers' rotary embeddings.

Against transformers' own rotary modules and apply_rotary_pos_emb (where transformers and
torch are installed: the tests taking the ``transformers`` fixture skip elsewhere), against
the float64 oracle attnx.reference.rotary_embedding, and by the properties a rotation has.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import attnx
from attnx import reference
from attnx import rotary as rotary_module

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


# Named by `name=`: a module attribute called torch would mark every test of the module
# (conftest marks the tests of modules that import torch).
@pytest.fixture(name="torch")
def torch_module():
    return pytest.importorskip("torch")


@pytest.fixture(name="transformers")
def transformers_module(torch):
    return pytest.importorskip("transformers")


def ulps(a, b):
    """The largest distance in float32 ulps between two float32 arrays of one sign pattern."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32)).max(initial=0))


def oracle(rope, x, positions):
    """The float64 reference of ``rope(x, positions)`` from the embedding's float32 frequencies."""
    return reference.rotary_embedding(x, positions, rope.inv_freq, rope.rotary_dim, rope.interleaved,
                                      rope.attention_scaling)


def angle_atol(x, positions):
    """What float32 angles (``float32(p) * inv_freq``, inv_freq <= 1) and float32 cos/sin may
    move a float64 rotation of ``x``: an ulp of the largest angle, and a few of cos and sin."""
    top = float(np.max(positions, initial=0))
    return 4 * float(np.abs(np.asarray(x, np.float64)).max(initial=1.0)) * (top + 4) * 2.0**-24


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


def _llama(transformers, **kwargs):
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                    max_position_embeddings=131072, **kwargs)


CONFIGS = {
    "llama-default": lambda t: _llama(t),
    "llama-linear": lambda t: _llama(t, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3": lambda t: _llama(t, rope_scaling=dict(LLAMA3), rope_theta=500000.0),
    "llama3-32": lambda t: _llama(t, rope_scaling={**LLAMA3, "factor": 32.0}, rope_theta=500000.0),
    "phi-linear": lambda t: t.PhiConfig(hidden_size=256, num_attention_heads=4, partial_rotary_factor=0.5,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "gemma2": lambda t: t.Gemma2Config(hidden_size=256, num_attention_heads=2, head_dim=128,
                                       rope_theta=10000.0),
}


def _hf_rotary(transformers, name):
    """(config, transformers' rotary module, its apply_rotary_pos_emb, rotary dims)."""
    config = CONFIGS[name](transformers)
    if name.startswith("phi"):
        from transformers.models.phi import modeling_phi as modeling
        module = modeling.PhiRotaryEmbedding(config)
        rotary_dim = int(config.hidden_size // config.num_attention_heads * config.rope_parameters["partial_rotary_factor"])
    elif name.startswith("gemma2"):
        from transformers.models.gemma2 import modeling_gemma2 as modeling
        module = modeling.Gemma2RotaryEmbedding(config)
        rotary_dim = config.head_dim
    else:
        from transformers.models.llama import modeling_llama as modeling
        module = modeling.LlamaRotaryEmbedding(config)
        rotary_dim = config.head_dim
    return config, module, modeling.apply_rotary_pos_emb, rotary_dim


def _torch_dtype(torch, dtype):
    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, BF16: torch.bfloat16}[dtype]


def _to_torch(torch, x):
    if x.dtype == BF16:
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def _to_numpy(t, dtype):
    return t.float().numpy().astype(dtype) if dtype == BF16 else t.numpy()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inv_freq_is_transformers(transformers, name):
    config, module, _, rotary_dim = _hf_rotary(transformers, name)
    rope = attnx.RotaryEmbedding.from_config(config)
    theirs = module.inv_freq.numpy()
    assert rope.rotary_dim == rotary_dim and rope.inv_freq.shape == theirs.shape
    # torch's float32 power is an approximation: within an ulp of the correctly rounded one.
    assert ulps(rope.inv_freq, theirs) <= 1
    assert rope.attention_scaling == module.attention_scaling == 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rotation_is_transformers(transformers, torch, rng, name, dtype):
    dtype = np.dtype(dtype)
    config, module, apply, rotary_dim = _hf_rotary(transformers, name)
    rope = attnx.RotaryEmbedding.from_config(config)
    # Where torch's frequencies differ by an ulp (test_inv_freq_is_transformers), the angles
    # of far positions differ by more than the rotation's rounding: the tables are compared
    # with the same frequencies.
    module.inv_freq = torch.from_numpy(rope.inv_freq.copy())
    total, heads, kv_heads, D = 40, 4, 2, rope.head_dim
    positions = rng.integers(0, 60000, total)
    positions[:3] = [0, 1, 8191]
    q = rng.standard_normal((total, heads, D)).astype(dtype)
    k = rng.standard_normal((total, kv_heads, D)).astype(dtype)

    qt, kt = _to_torch(torch, q).transpose(0, 1)[None], _to_torch(torch, k).transpose(0, 1)[None]
    cos, sin = module(qt, torch.from_numpy(positions)[None])
    if rotary_dim < D:
        # Phi's attention rotates the first rotary_dim dims and concatenates the rest.
        q_rot, k_rot = apply(qt[..., :rotary_dim], kt[..., :rotary_dim], cos, sin)
        q_hf, k_hf = torch.cat((q_rot, qt[..., rotary_dim:]), -1), torch.cat((k_rot, kt[..., rotary_dim:]), -1)
    else:
        q_hf, k_hf = apply(qt, kt, cos, sin)
    q_hf, k_hf = _to_numpy(q_hf[0].transpose(0, 1), dtype), _to_numpy(k_hf[0].transpose(0, 1), dtype)

    q_ours, k_ours = rope(q, positions), rope(k, positions)
    assert q_ours.dtype == k_ours.dtype == dtype
    _assert_as_torch(q_ours, q_hf, dtype)
    _assert_as_torch(k_ours, k_hf, dtype)


def _assert_as_torch(ours, theirs, dtype):
    if dtype == np.float32:
        # The same operations on cos and sin within an ulp of torch's.
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
        return
    # Rounded to the dtype as torch rounds: equal but where an ulp of cos or sin moves a rounding.
    a, b = ours.astype(np.float32), theirs.astype(np.float32)
    assert np.mean(a != b) <= 0.002
    step = 2.0**-7 if dtype == BF16 else 2.0**-10
    np.testing.assert_allclose(a, b, rtol=step, atol=step * 2.0**-6)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_gptj_interleaved_partial_is_transformers(transformers, torch, rng, dtype):
    from transformers.models.gptj import modeling_gptj as gptj

    dtype = np.dtype(dtype)
    config = transformers.GPTJConfig(n_embd=256, n_head=4, rotary_dim=32, n_positions=4096)
    rope = attnx.RotaryEmbedding.from_config(config)
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved, rope.base) == (64, 32, True, 10000.0)
    module = gptj.GPTJRotaryEmbedding(config)
    positions = rng.integers(0, 4096, 24)
    positions[0] = 0
    x = rng.standard_normal((24, 4, 64)).astype(dtype)

    # transformers' table: sin and cos of float32(p) * inv_freq, side by side.
    table = module.embed_positions.numpy()
    expected_sin, expected_cos = np.split(table[positions], 2, axis=-1)
    cos, sin = rope._compute(positions)
    assert ulps(cos, expected_cos) <= 1 and ulps(sin, expected_sin) <= 1
    # The full-width factors: each dimension's cosine, and the sine as it multiplies the other.
    wide_cos, wide_sin = rope._cos_sin(positions)
    assert np.array_equal(wide_cos[:, 0::2], cos) and np.array_equal(wide_cos[:, 1::2], cos)
    assert np.array_equal(wide_sin[:, 0::2], -sin) and np.array_equal(wide_sin[:, 1::2], sin)

    xt = _to_torch(torch, x)[None]                   # (batch, T, heads, D): GPT-J's layout
    sin_t, cos_t = module(xt, torch.from_numpy(positions)[None])
    rotated = gptj.apply_rotary_pos_emb(xt[..., :32], sin_t, cos_t)
    expected = _to_numpy(torch.cat((rotated, xt[..., 32:]), -1)[0], dtype)
    _assert_as_torch(rope(x, positions), expected, dtype)


def test_from_config_reads_configs_and_their_dicts(transformers):
    for name in CONFIGS:
        config = CONFIGS[name](transformers)
        rope = attnx.RotaryEmbedding.from_config(config)
        assert repr(attnx.RotaryEmbedding.from_config(config.to_dict())) == repr(rope), name
    llama3 = attnx.RotaryEmbedding.from_config(CONFIGS["llama3"](transformers))
    assert (llama3.base, llama3.scaling) == (500000.0, LLAMA3)
    phi = attnx.RotaryEmbedding.from_config(CONFIGS["phi-linear"](transformers))
    assert (phi.head_dim, phi.rotary_dim, phi.scaling) == (64, 32, {"rope_type": "linear", "factor": 2.0})
    gptj = attnx.RotaryEmbedding.from_config(transformers.GPTJConfig(n_embd=256, n_head=4, rotary_dim=32).to_dict())
    assert (gptj.head_dim, gptj.rotary_dim, gptj.interleaved) == (64, 32, True)


# ---------------------------------------------------------------------------------------------
# The oracle and the properties of a rotation
# ---------------------------------------------------------------------------------------------

EMBEDDINGS = [
    dict(head_dim=64),
    dict(head_dim=64, base=500000.0, scaling=LLAMA3),
    dict(head_dim=80, rotary_dim=32, scaling={"rope_type": "linear", "factor": 2.0}),
    dict(head_dim=64, rotary_dim=32, interleaved=True),
    dict(head_dim=2),
]


def _make(kwargs):
    kwargs = dict(kwargs)
    return attnx.RotaryEmbedding(kwargs.pop("head_dim"), kwargs.pop("base", 10000.0), **kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16],
                         ids=["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("kwargs", EMBEDDINGS, ids=str)
def test_matches_the_oracle(rng, kwargs, dtype):
    rope = _make(kwargs)
    dtype = np.dtype(dtype)
    positions = rng.integers(0, 3000, 17)
    x = rng.standard_normal((17, 3, rope.head_dim)).astype(dtype)
    before = x.copy()
    out = rope(x, positions)
    assert out.dtype == dtype and out.shape == x.shape
    assert np.array_equal(x.astype(np.float64), before.astype(np.float64))     # x is only read
    expected = oracle(rope, x.astype(np.float64), positions)
    atol = angle_atol(x, positions)
    if dtype in (np.float16, BF16):
        # cos and sin rounded to the dtype, and each product and the sum: a few of its ulps.
        atol += (2.0**-8 if dtype == BF16 else 2.0**-11) * 3 * float(np.abs(expected).max())
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=0, atol=atol)
    # Past rotary_dim, x passes through bit for bit.
    assert np.array_equal(out[..., rope.rotary_dim:].view(np.uint8), x[..., rope.rotary_dim:].view(np.uint8))


@pytest.mark.parametrize("kwargs", EMBEDDINGS, ids=str)
def test_position_zero_is_the_identity(rng, kwargs):
    rope = _make(kwargs)
    for dtype in (np.float32, np.float64, np.float16, BF16):
        x = rng.standard_normal((4, 2, rope.head_dim)).astype(dtype)
        assert np.array_equal(rope(x, np.zeros(4, np.int64)).astype(np.float64), x.astype(np.float64))


@pytest.mark.parametrize("kwargs", EMBEDDINGS, ids=str)
def test_rotation_keeps_each_pairs_norm(rng, kwargs):
    rope = _make(kwargs)
    x = rng.standard_normal((32, 2, rope.head_dim))
    out = rope(x, rng.integers(0, 100000, 32))
    r, half = rope.rotary_dim, rope.rotary_dim // 2
    if rope.interleaved:
        pairs = lambda a: np.hypot(a[..., 0:r:2], a[..., 1:r:2])  # noqa: E731
    else:
        pairs = lambda a: np.hypot(a[..., :half], a[..., half:r])  # noqa: E731
    # cos^2 + sin^2 of float32 cos and sin is 1 within a few float32 ulps.
    np.testing.assert_allclose(pairs(out), pairs(x), rtol=1e-6)


@pytest.mark.parametrize("kwargs", EMBEDDINGS, ids=str)
def test_scores_depend_on_the_distance_only(rng, kwargs):
    rope = _make(kwargs)
    q = rng.standard_normal((1, 2, rope.head_dim))
    k = rng.standard_normal((1, 2, rope.head_dim))

    def score(m, n):
        return np.einsum("hd,hd->h", rope(q, [m])[0], rope(k, [n])[0])

    for m, n in [(5, 3), (0, 9), (700, 700)]:
        for shift in (1, 37, 1000):
            # float32 angles: the shifted ones are an ulp of the larger angle away.
            atol = angle_atol(np.abs(q).max() * np.abs(k).max() * rope.head_dim, [m + shift, n + shift])
            np.testing.assert_allclose(score(m + shift, n + shift), score(m, n), rtol=0, atol=atol)


def test_interleaved_pairs_are_the_halves_pairs_reordered(rng):
    # Interleaved pair i is dims (2i, 2i + 1); rotate_half's is (i, i + r / 2): the same
    # rotation of the same pairs, in another order of the dimensions.
    halves = attnx.RotaryEmbedding(48, rotary_dim=32)
    interleaved = attnx.RotaryEmbedding(48, rotary_dim=32, interleaved=True)
    order = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2), np.arange(32, 48)])
    x = rng.standard_normal((9, 3, 48), dtype=np.float32)
    positions = rng.integers(0, 5000, 9)
    assert np.array_equal(halves(x[..., order], positions), interleaved(x, positions)[..., order])


def test_tables_give_what_computing_gives(rng, monkeypatch):
    rope = attnx.RotaryEmbedding(64, 500000.0, scaling=LLAMA3)
    x = rng.standard_normal((300, 2, 64), dtype=np.float32)
    positions = np.arange(300)
    prefill = rope(x, positions)
    # Decoding one position at a time (the tables grow by doubling as they go) gives each row
    # of the prefill bit for bit, and a fresh embedding's rows (computed, not looked up).
    decoder = attnx.RotaryEmbedding(64, 500000.0, scaling=LLAMA3)
    for p in (0, 1, 2, 63, 64, 65, 130, 299):
        assert np.array_equal(decoder(x[p:p + 1], [p]), prefill[p:p + 1])
    assert len(decoder._tables[0]) >= 300
    cos, sin = rope._cos_sin(positions)
    fresh = rope._spread(*rope._compute(positions))
    assert np.array_equal(cos, fresh[0]) and np.array_equal(sin, fresh[1])
    # Positions past what the tables hold are computed for the call, with the same values.
    monkeypatch.setattr(rotary_module, "_TABLE_ENTRIES", 32 * 128)
    small = attnx.RotaryEmbedding(64, 500000.0, scaling=LLAMA3)
    assert np.array_equal(small(x, positions), prefill)
    assert np.array_equal(small(x[:5], positions[:5]), prefill[:5])
    assert len(small._tables[0]) <= 128


def test_tables_grown_from_threads_at_once(rng):
    # A table is replaced whole when it grows: readers in other threads see an old table or
    # a new one, and every call gives what computing its positions gives.
    import concurrent.futures

    rope = attnx.RotaryEmbedding(32)
    x = rng.standard_normal((8, 2, 32), dtype=np.float32)
    starts = [int(s) for s in rng.integers(0, 20000, 64)]
    expected = [attnx.RotaryEmbedding(32)(x, np.arange(s, s + 8)) for s in starts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: rope(x, np.arange(s, s + 8)), starts))
    assert all(np.array_equal(a, b) for a, b in zip(results, expected))


def test_strided_inputs(rng):
    rope = attnx.RotaryEmbedding(16, rotary_dim=8, interleaved=True)
    x = rng.standard_normal((2, 5, 32), dtype=np.float32)[:, :, ::2].transpose(1, 0, 2)   # (5, 2, 16)
    positions = np.arange(10)[::2]
    assert np.array_equal(rope(x, positions), rope(np.ascontiguousarray(x), positions.copy()))


def test_positions_of_any_integer_dtype(rng):
    rope = attnx.RotaryEmbedding(16)
    x = rng.standard_normal((4, 1, 16), dtype=np.float32)
    expected = rope(x, np.array([0, 3, 7, 200]))
    for dtype in (np.int32, np.uint16, np.int64, np.uint64):
        assert np.array_equal(rope(x, np.array([0, 3, 7, 200], dtype)), expected)
    assert np.array_equal(rope(x, [0, 3, 7, 200]), expected)
    assert rope(np.zeros((0, 2, 16), np.float32), np.zeros(0, np.int64)).shape == (0, 2, 16)


def test_attributes_repr_and_pickle():
    rope = attnx.RotaryEmbedding(80, 10000.0, rotary_dim=32, interleaved=True,
                                 scaling={"rope_type": "linear", "factor": 2})
    assert (rope.head_dim, rope.rotary_dim, rope.base, rope.interleaved) == (80, 32, 10000.0, True)
    assert rope.scaling == {"rope_type": "linear", "factor": 2.0}
    rope.scaling["factor"] = 5.0                      # a copy
    assert rope.scaling["factor"] == 2.0
    assert rope.inv_freq.dtype == np.float32 and rope.inv_freq.shape == (16,)
    with pytest.raises(ValueError):
        rope.inv_freq[0] = 1.0
    assert rope.attention_scaling == 1.0
    assert repr(rope) == ("RotaryEmbedding(head_dim=80, base=10000.0, rotary_dim=32, interleaved=True, "
                          "scaling={'rope_type': 'linear', 'factor': 2.0})")
    assert repr(attnx.RotaryEmbedding(64)) == "RotaryEmbedding(head_dim=64, base=10000.0)"
    assert attnx.RotaryEmbedding(8, scaling={"rope_type": "default"}).scaling is None
    x = np.random.default_rng(0).standard_normal((3, 2, 80), dtype=np.float32)
    rope(x, [1, 2, 900])
    for clone in (pickle.loads(pickle.dumps(rope)), copy.deepcopy(rope), copy.copy(rope)):
        assert repr(clone) == repr(rope)
        assert np.array_equal(clone.inv_freq, rope.inv_freq) and not clone.inv_freq.flags.writeable
        assert np.array_equal(clone(x, [5, 6, 7]), rope(x, [5, 6, 7]))
    # The frequencies of the linear scaling are the default ones divided by its factor.
    plain = attnx.RotaryEmbedding(80, rotary_dim=32)
    assert np.array_equal(rope.inv_freq, plain.inv_freq / np.float32(2))


def test_from_config_dicts():
    rope = attnx.RotaryEmbedding.from_config(
        {"hidden_size": 512, "num_attention_heads": 8, "rope_theta": 1e6,
         "rope_scaling": {"type": "linear", "factor": 4.0}, "partial_rotary_factor": 0.5})
    assert (rope.head_dim, rope.rotary_dim, rope.base, rope.scaling) == (64, 32, 1e6, {"rope_type": "linear", "factor": 4.0})
    rope = attnx.RotaryEmbedding.from_config(
        {"head_dim": 128, "max_position_embeddings": 8192,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert rope.scaling == LLAMA3
    neox = attnx.RotaryEmbedding.from_config({"hidden_size": 512, "num_attention_heads": 4, "rotary_pct": 0.25})
    assert (neox.head_dim, neox.rotary_dim, neox.interleaved, neox.base) == (128, 32, False, 10000.0)
    forced = attnx.RotaryEmbedding.from_config({"head_dim": 64}, interleaved=True)
    assert forced.interleaved
    with pytest.raises(ValueError, match="yarn"):
        attnx.RotaryEmbedding.from_config({"head_dim": 64, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="layer type"):
        attnx.RotaryEmbedding.from_config({"head_dim": 64, "rope_parameters": {
            "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}})
    with pytest.raises(ValueError, match="head_dim"):
        attnx.RotaryEmbedding.from_config({"rope_theta": 10000.0})


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(head_dim=64, rotary_dim=31), ValueError, "rotary_dim must be even"),
    (dict(head_dim=64, rotary_dim=66), ValueError, "rotary_dim must be even"),
    (dict(head_dim=64, rotary_dim=0), ValueError, "rotary_dim"),
    (dict(head_dim=64, rotary_dim=32.0), TypeError, "rotary_dim must be an int"),
    (dict(head_dim=1), ValueError, "head_dim must be at least 2"),
    (dict(head_dim="64"), TypeError, "head_dim must be an int"),
    (dict(head_dim=64, base=float("inf")), ValueError, "base must be finite"),
    (dict(head_dim=64, base=float("nan")), ValueError, "base must be finite"),
    (dict(head_dim=64, base=0.0), ValueError, "base must be finite and > 0"),
    (dict(head_dim=64, base="10000"), TypeError, "base must be a number"),
    (dict(head_dim=64, interleaved=1), TypeError, "interleaved"),
    (dict(head_dim=64, scaling={"rope_type": "yarn", "factor": 2.0}), ValueError, "rope_type"),
    (dict(head_dim=64, scaling={"factor": 2.0}), ValueError, "rope_type"),
    (dict(head_dim=64, scaling="linear"), TypeError, "scaling must be None or a dict"),
    (dict(head_dim=64, scaling={"rope_type": "linear"}), ValueError, r"missing \['factor'\]"),
    (dict(head_dim=64, scaling={"rope_type": "linear", "factor": 0.0}), ValueError, r"scaling\['factor'\]"),
    (dict(head_dim=64, scaling={"rope_type": "linear", "factor": -2.0}), ValueError, r"scaling\['factor'\]"),
    (dict(head_dim=64, scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 1.0}), ValueError, "unexpected"),
    (dict(head_dim=64, scaling={k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}), ValueError,
     r"missing \['high_freq_factor'\]"),
    (dict(head_dim=64, scaling={**LLAMA3, "low_freq_factor": 4.0}), ValueError, "less than"),
    (dict(head_dim=64, scaling={**LLAMA3, "original_max_position_embeddings": 8192.5}), TypeError, "int"),
])
def test_bad_arguments_say_what_to_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        _make(kwargs)


def test_bad_inputs_raise(rng):
    rope = attnx.RotaryEmbedding(16)
    x = rng.standard_normal((3, 2, 16), dtype=np.float32)
    with pytest.raises(ValueError, match=r"\(total, H, head_dim\) with head_dim = 16"):
        rope(x[..., :8], [0, 1, 2])
    with pytest.raises(ValueError, match="head_dim"):
        rope(x[0], [0, 1])
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        rope(x.astype(np.int32), [0, 1, 2])
    with pytest.raises(TypeError, match="positions must be an array of integers"):
        rope(x, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(TypeError, match="positions must be an array of integers"):
        rope(x, np.array([True, False, True]))
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\)"):
        rope(x, [0, 1])
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\)"):
        rope(x, [[0, 1, 2]])
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rope(x, [0, -1, 2])


def test_non_native_byte_order(rng):
    rope = attnx.RotaryEmbedding(16)
    x = rng.standard_normal((3, 2, 16), dtype=np.float32)
    swapped = x.astype(x.dtype.newbyteorder())
    assert np.array_equal(rope(swapped, [1, 2, 3]), rope(x, [1, 2, 3]))


# ---------------------------------------------------------------------------------------------
# cached_attention(rope=, positions=)
# ---------------------------------------------------------------------------------------------


def _rotate_4d(rope, x, positions):
    """(B, H, T, E) rotated at positions (B, T) with the public (total, H, E) call."""
    B, H, T, E = x.shape
    rows = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(B * T, H, E)
    return rope(rows, np.asarray(positions).reshape(-1)).reshape(B, T, H, E).transpose(0, 2, 1, 3)


def _snapshot(cache):
    key, value, lengths = cache.storage()
    return key.copy(), value.copy(), lengths.copy()


def _same_cache(a, b):
    return all(np.array_equal(x.astype(np.float64), y.astype(np.float64)) for x, y in zip(_snapshot(a), _snapshot(b)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("kwargs", [dict(head_dim=16), dict(head_dim=16, rotary_dim=8, interleaved=True)], ids=str)
def test_cached_attention_rotates_queries_and_new_keys(rng, kwargs, dtype):
    rope = _make(kwargs)
    B, Hq, Hk, E = 3, 4, 2, 16
    with_rope = attnx.KVCache(B, Hk, 64, E)
    by_hand = attnx.KVCache(B, Hk, 64, E)
    # A prompt of ragged lengths, then steps of one and of several tokens.
    for T, lengths in [(6, [6, 3, 0]), (1, None), (3, [3, 1, 2]), (1, [1, 0, 1]), (2, None)]:
        n = np.full(B, T) if lengths is None else np.array(lengths)
        q = rng.standard_normal((B, Hq, T, E)).astype(dtype)
        k = rng.standard_normal((B, Hk, T, E)).astype(dtype)
        v = rng.standard_normal((B, Hk, T, E)).astype(dtype)
        start = by_hand.lengths.copy()
        positions = start[:, None] + np.arange(T)
        q_before = q.copy()
        out = attnx.cached_attention(q, with_rope, k, v, lengths=lengths, rope=rope)
        assert np.array_equal(q, q_before)
        expected = attnx.cached_attention(_rotate_4d(rope, q, positions), by_hand, _rotate_4d(rope, k, positions), v,
                                          lengths=lengths)
        assert out.dtype == dtype
        valid = np.arange(T) < n[:, None]
        assert np.array_equal(out.transpose(0, 2, 1, 3)[valid], expected.transpose(0, 2, 1, 3)[valid])
        assert not out.transpose(0, 2, 1, 3)[~valid].any()       # padding rows are zeros
        assert _same_cache(with_rope, by_hand)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", np.int8], ids=["bfloat16", "int8"])
def test_cached_attention_rope_stores_rotated_keys_in_any_cache(rng, cache_dtype):
    rope = attnx.RotaryEmbedding(16, base=1000.0)
    with_rope = attnx.KVCache(1, 2, 16, 16, dtype=cache_dtype)
    by_hand = attnx.KVCache(1, 2, 16, 16, dtype=cache_dtype)
    q = rng.standard_normal((1, 2, 4, 16)).astype(BF16)
    k = v = rng.standard_normal((1, 2, 4, 16)).astype(BF16)
    out = attnx.cached_attention(q, with_rope, k, v, rope=rope)
    positions = np.arange(4)[None]
    expected = attnx.cached_attention(_rotate_4d(rope, q, positions), by_hand, _rotate_4d(rope, k, positions), v)
    assert out.dtype == BF16 and np.array_equal(out.astype(np.float32), expected.astype(np.float32))
    assert _same_cache(with_rope, by_hand)


def test_cached_attention_rope_without_new_keys(rng):
    # Queries of tokens already in the cache sit at lengths - n + t.
    rope = attnx.RotaryEmbedding(8)
    cache = attnx.KVCache(2, 1, 32, 8)
    k = rng.standard_normal((2, 1, 7, 8), dtype=np.float32)
    cache.append(k, k, lengths=[7, 4])
    q = rng.standard_normal((2, 2, 2, 8), dtype=np.float32)
    out = attnx.cached_attention(q, cache, rope=rope)
    positions = np.array([[5, 6], [2, 3]])
    assert np.array_equal(out, attnx.cached_attention(_rotate_4d(rope, q, positions), cache))
    assert cache.lengths.tolist() == [7, 4]


def test_cached_attention_positions_override(rng):
    rope = attnx.RotaryEmbedding(8, base=100.0)
    with_positions = attnx.KVCache(2, 1, 32, 8)
    by_hand = attnx.KVCache(2, 1, 32, 8)
    positions = np.array([[10, 11, 12], [100, 250, -7]], np.int32)   # -7: a padding token's
    for step in range(2):
        q = rng.standard_normal((2, 2, 3, 8), dtype=np.float32)
        k = v = rng.standard_normal((2, 1, 3, 8), dtype=np.float32)
        out = attnx.cached_attention(q, with_positions, k, v, lengths=[3, 2], rope=rope, positions=positions + step)
        at = np.where([[True] * 3, [True, True, False]], positions + step, 0)
        expected = attnx.cached_attention(_rotate_4d(rope, q, at), by_hand, _rotate_4d(rope, k, at), v, lengths=[3, 2])
        assert np.array_equal(out[0], expected[0]) and np.array_equal(out[1, :, :2], expected[1, :, :2])
        assert _same_cache(with_positions, by_hand)


def test_cached_attention_bad_rope_arguments_leave_the_cache(rng):
    rope = attnx.RotaryEmbedding(8)
    cache = attnx.KVCache(2, 1, 16, 8)
    first = rng.standard_normal((2, 1, 3, 8), dtype=np.float32)
    cache.append(first, first)
    before = _snapshot(cache)
    q = rng.standard_normal((2, 2, 1, 8), dtype=np.float32)
    k = v = rng.standard_normal((2, 1, 1, 8), dtype=np.float32)
    bad = [
        (dict(rope=rope, positions=np.array([[1], [2]], np.float32)), TypeError, "positions must be an array of integers"),
        (dict(rope=rope, positions=np.array([1, 2])), ValueError, r"positions must have shape \(batch, T\) = \(2, 1\)"),
        (dict(rope=rope, positions=np.array([[1], [-1]])), ValueError, "must be >= 0"),
        (dict(rope=attnx.RotaryEmbedding(16)), ValueError, r"rope.head_dim \(16\) must equal"),
        (dict(rope="rope"), TypeError, "rope must be an attnx.RotaryEmbedding"),
        (dict(positions=np.array([[1], [2]])), ValueError, "pass them with rope="),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            attnx.cached_attention(q, cache, k, v, **kwargs)
        after = _snapshot(cache)
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), kwargs
    # And the same call with good arguments appends.
    attnx.cached_attention(q, cache, k, v, rope=rope, positions=np.array([[3], [3]]))
    assert cache.lengths.tolist() == [4, 4]
