"""The transformer layers: TransformerEncoderLayer and TransformerDecoderLayer, alone or in
TransformerEncoder / TransformerDecoder stacks, with their parameters changed and masks of
every kind (``fuzz_transformer_layer``), and TransformerDecoder.step decoding a few steps over
a TransformerDecoderCache, a layer broken for one of them (``fuzz_transformer_step``). Results
must match ``attnx.reference``'s layers over the values the modules hold.
"""

from __future__ import annotations

import math

import numpy as np

import attnx
from attnx import reference

from .common import (
    BF16, BF16_TOL, F16, F32, F64, HALVES, I8, LAST_ERROR, OUTCOMES, SCALAR_JUNK, Disallowed, GradTensor,
    Planted, Provider, call, check_garbage_refused, check_untouched, held, input_arrays, is_float, malformed,
    module_or_call_precision, nan_inf_only, plain, raised, rarely, reference_of, relayout, same_held,
    snapshot, torch_habits, values, well_scaled,
)


def act_tanh(h):
    return np.tanh(h)


def act_relu_in_place(h):
    """Writes into the array it is given (attnx's own copy of the hidden rows) and returns it."""
    np.maximum(h, 0, out=h)
    return h


def act_softsign_f64(h):
    """Another dtype than the one it is given (float64)."""
    return (h / (1 + np.abs(h))).astype(np.float64)


def act_list(h):
    """A nested list, not an array."""
    return (0.5 * np.asarray(h)).tolist()


def act_fortran(h):
    """An array of another layout (Fortran order)."""
    return np.asfortranarray(np.sin(h))


def act_first_column(h):
    """The wrong shape, unless dim_feedforward is 1."""
    return h[..., :1]


def act_raises(h):
    raise Planted("raised by the activation")


LAYER_ACTIVATIONS = ["relu", "relu", "gelu", "gelu", act_tanh, act_relu_in_place, act_softsign_f64, act_list,
                     act_fortran, act_first_column, act_raises]
ACTIVATION_JUNK = ["tanh", "RELU", "", None, 3, np.float32(1.0), b"relu", ["relu"]]
LAYER_EPS = [1e-5, 1e-5, 1e-5, 1e-3, 1e-9, 0.25, 0.0]
# The unit roundoff of each dtype: how much a computation in it may lose per operation.
UNIT = {F32: 2.0**-24, F64: 2.0**-53, F16: 2.0**-11}
if BF16 is not None:
    UNIT[BF16] = 2.0**-8
# An int8 cache's row holds each value to half a step of its scale, max|x| / 127: 2^-8 of the
# row's largest, more of its smaller values; taken as 2^-7.
UNIT[I8] = 2.0**-7
# Base tolerances of a transformer layer's result (a chain of projections, softmaxes and norms);
# an ill-conditioned input (a norm's row of tiny variance, logits that cancel) widens them by
# the spread of the reference itself between float32 and float64 (see compare_layer).
LAYER_TOL = {F32: dict(rtol=2e-5, atol=2e-5), F64: dict(rtol=1e-11, atol=1e-11),
             F16: dict(rtol=2e-3, atol=2e-3)}  # (float16 parameters and results, computed in float32)


def real_parameter(value) -> bool:
    """Whether a parameter's value holds real numbers: floats, or integers as load_state_dict
    takes them (what attnx must refuse with a TypeError otherwise: complex, bool, strings,
    objects)."""
    try:
        a = np.asarray(plain(value))
    except Exception:  # noqa: BLE001 - a value whose conversion raises holds no numbers
        return False
    return is_float(a) or a.dtype.kind in "iu"


def layer_slots(module):
    """(key, owner, attribute) of every parameter slot of a transformer layer or stack."""
    return [(key, owner, attr) for key, owner, attr, _ in module._slots()]


def layer_params(module, dtype):
    """The module's parameters as the reference takes them: its state_dict keys, float64
    arrays of the values the module computes with (rounded to `dtype`, the module's)."""
    params = {}
    for key, owner, attr in layer_slots(module):
        value = getattr(owner, attr)
        if value is not None:
            params[key] = np.asarray(plain(value)).astype(dtype).astype(np.float64)
    return params


def randomize_parameters(p: Provider, module):
    """New values for every parameter, loaded with load_state_dict: weights N(0, 1/fan_in),
    norm weights 1 + N(0, 0.09), biases N(0, 0.09)."""
    rng = np.random.default_rng(p.seed())
    state = {}
    for key, value in module.state_dict().items():
        owner = key.rsplit(".", 2)[-2] if key.count(".") else ""
        if value.ndim == 2:
            state[key] = rng.standard_normal(value.shape) / math.sqrt(value.shape[1])
        elif owner.startswith("norm") and key.endswith("weight"):
            state[key] = 1 + 0.3 * rng.standard_normal(value.shape)
        else:
            state[key] = 0.3 * rng.standard_normal(value.shape)
    module.load_state_dict(state)


def mutate_parameter(p: Provider, layer) -> bool:
    """Changes one parameter of `layer` as a user might: a malformed value, NaN/Inf values, a
    copy in another float dtype or layout, None, a tensor that requires grad, a write in place.
    Returns whether the layer may now be invalid (a call may then raise)."""
    key, owner, attr = p.choice(layer_slots(layer))
    current = getattr(owner, attr)
    kind = p.int(0, 5)
    if kind == 0 or not is_float(current):
        setattr(owner, attr, malformed(p, current))
        OUTCOMES["transformer: parameter malformed"] += 1
        return True
    if kind == 1:  # NaN or Inf at a place (valid: they must reach the result as the reference's)
        bad = np.array(current, dtype=np.float64)
        if bad.size:  # (a parameter of no elements has no place)
            bad.reshape(-1)[p.int(0, bad.size - 1)] = p.choice([np.nan, np.inf, -np.inf])
        setattr(owner, attr, bad.astype(current.dtype))
        return False
    if kind == 2:  # another float dtype and layout (valid: read as its values)
        setattr(owner, attr, relayout(p, np.asarray(current).astype(p.choice([F32, F64, F16]))))
        return False
    if kind == 3:  # None: no bias, or no norm weight (valid); no weight (invalid)
        setattr(owner, attr, None)
        return not (attr.endswith("bias") or owner.__class__.__name__ == "LayerNorm")
    if kind == 4:  # what copying from a torch module by attribute gives (valid: its values)
        setattr(owner, attr, GradTensor(np.asarray(current)))
        OUTCOMES["transformer: parameter a tensor that requires grad"] += 1
        return False
    if isinstance(current, np.ndarray) and current.flags.writeable:  # in place (seen by the next call)
        current *= current.dtype.type(p.choice([0.5, 1.5, -1.0]))
    return False


def layer_mask(p: Provider, shape, dtype):
    """A mask of `shape` as torch's attention takes it: bool (True = masked) or float (-inf
    where masked, elsewhere 0 or other finite values); rows may be masked wholly."""
    rng = np.random.default_rng(p.seed())
    closed = rng.random(shape) < p.choice([0.0, 0.2, 0.5, 0.9, 1.0])
    kind = p.int(0, 3)
    if kind <= 1:
        return closed
    m = np.where(closed, -np.inf, p.choice([0.0, 0.0, 0.5, -1.0]))
    if kind == 3:
        m = m + 0.3 * rng.standard_normal(shape)
    return m.astype(p.choice([dtype, dtype, F32, F64, F16]))


def closed_rows(mask, shape):
    """Where a key padding mask marks positions as padding (True, or -inf), as a bool array of
    `shape` (the mask's own, batched); None where there is no such mask."""
    if mask is None:
        return None
    m = np.asarray(plain(mask))
    marked = m if m.dtype == np.bool_ else np.isneginf(m.astype(np.float64))
    return marked.reshape(shape)


def scale_view(x):
    """A mask as the judge of scaling sees it: -inf closes a key and is no value."""
    x = plain(x)
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return np.where(np.isneginf(x), 0, x)
    return x


def compare_layer(got, expected, spread, dtype, what, inputs, unit=None, skip_rows=None, bf16=False):
    """compare() for a transformer layer's or decoder's result (in canonical (N, L, E) order):
    within LAYER_TOL[dtype] plus 16 times the reference's own spread between float32 and
    float64 (`spread`: the float32 reference's result, or a tuple of such results (one of them
    with its inputs nudged by a few roundoffs): the largest difference in each row,
    scaled from float32's unit roundoff to `unit`, the least precise one the computation went
    through: a half-precision cache's), so that a row a norm amplifies rounding in (tiny
    variance) is judged by that amplification; where `unit` is coarser than `dtype`'s, also
    16 units of it more. Rows marked in `skip_rows` (padded query positions, whose outputs are
    not specified) are not compared. With `bf16` (precision "bfloat16": `expected` is the
    reference of the same rounding), also BF16_TOL of (1 + |expected|): a float32
    intermediate near a tie rounds to the other bfloat16 neighbour, an error the spread does
    not show."""
    if not isinstance(got, np.ndarray):
        raise Disallowed(f"{what}: not an ndarray: {type(got).__name__}")
    if got.dtype != dtype or got.shape != expected.shape:
        raise Disallowed(f"{what}: dtype/shape {got.dtype} {got.shape}, expected {dtype} {expected.shape}")
    g, e = got.astype(np.float64), np.asarray(expected, np.float64)
    if skip_rows is not None and skip_rows.any():
        OUTCOMES["transformer: padded rows skipped"] += 1
        g, e = g.copy(), e.copy()
        g[skip_rows] = e[skip_rows] = 0
    arrays = input_arrays(inputs)
    if not well_scaled(arrays):
        if not nan_inf_only(arrays):
            OUTCOMES["result not comparable (extreme values)"] += 1
            return
        # As compare(): non-finite exactly where the reference is, NaN wherever it has NaN.
        OUTCOMES["nan pattern checked"] += 1
        bad = (np.isfinite(g) != np.isfinite(e)) | (np.isnan(e) & ~np.isnan(g))
        if bad.any():
            at = tuple(np.argwhere(bad)[0])
            raise Disallowed(f"{what}: NaN/Inf in other places than the reference's\n{int(bad.sum())} of {bad.size} "
                             f"elements, first at {at}: got {g[at]!r}, expected {e[at]!r}")
        return
    OUTCOMES["result checked"] += 1
    tol = LAYER_TOL[dtype]
    factor = (UNIT[dtype] if unit is None else unit) / UNIT[F32]
    with np.errstate(all="ignore"):
        spreads = spread if isinstance(spread, tuple) else (spread,)
        widen = np.max([np.nan_to_num(np.abs(np.asarray(x, np.float64) - e), nan=np.inf) for x in spreads], axis=0)
        if widen.size:  # each row's largest spread: its norm's conditioning
            widen = np.broadcast_to(widen.max(axis=-1, keepdims=True), widen.shape)
        allowed = tol["atol"] + tol["rtol"] * np.abs(e) + 16 * factor * widen
        if unit is not None and unit > UNIT[dtype]:  # keys and values stored in a narrower dtype
            allowed = allowed + 16 * unit * (1 + np.abs(e))
        if bf16:
            allowed = allowed + BF16_TOL * (1 + np.abs(e))
        bad = ~(np.abs(g - e) <= allowed) & ~(np.isnan(g) & np.isnan(e))
    if bad.any():
        at = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: not equal to the reference within the tolerance\n{int(bad.sum())} of "
                             f"{bad.size} elements differ, first at {at}: got {g[at]!r}, expected {e[at]!r} "
                             f"(allowed {allowed[at]:.3g})")


def canonical(x, batched, batch_first):
    """A layer's input or output in (N, L, E) order."""
    x = np.asarray(x)
    if not batched:
        return x[None]
    return x if batch_first else x.transpose(1, 0, 2)


LAYER_CTOR_JUNK = [None, 0, -3, 1.5, "8", True, np.int32(4), 2**62, np.float16, "float16", "cuda", -1, [1],
                   float("nan"), 7, np.float64(1e-5)]


def fuzz_transformer_layer(p: Provider):
    """TransformerEncoderLayer and TransformerDecoderLayer of small random configurations
    (relu, gelu or a callable activation; pre- or post-norm; with or without biases; batch
    first, sequence first or unbatched; float32 or float64), alone or in a TransformerEncoder
    or TransformerDecoder of one or two copies with or without a final norm: construction
    (perhaps with a malformed argument), new parameter values, a parameter changed (malformed,
    NaN/Inf, another dtype or layout, None, a tensor, written in place after a first call),
    masks of every kind (bool, float, per head, fully masked rows; malformed), relaid-out
    inputs. A call that returns must match attnx.reference's layers over the values the
    module holds; nothing else but a clear exception; inputs and parameters unchanged; the
    result its own memory."""
    decoder = p.bool()
    cls = attnx.TransformerDecoderLayer if decoder else attnx.TransformerEncoderLayer
    H = p.int(1, 3)
    E = H * p.choice([1, 2, 4, 8])
    kw = dict(d_model=E, nhead=H, dim_feedforward=p.choice([1, 2, 5, 16]), dropout=p.choice([0.0, 0.0, 0.1]),
              activation=p.choice(LAYER_ACTIVATIONS), layer_norm_eps=p.choice(LAYER_EPS), batch_first=p.bool(),
              norm_first=p.bool(), bias=p.bool(0.8), device=p.choice([None, None, "cpu"]),
              dtype=p.choice([np.float32, np.float32, np.float64, "float64", None]), seed=p.int(0, 1000))
    huge = False
    if rarely(p, 0.15):
        name = p.choice(list(kw))
        kw[name] = p.choice(ACTIVATION_JUNK if name == "activation" else LAYER_CTOR_JUNK)
        huge = name in ("d_model", "dim_feedforward")
    ok, layer = call(f"{cls.__name__}()", lambda: cls(**kw), huge=huge)
    if not ok:
        return
    stack = p.bool(0.25)
    module = layer
    if stack:
        norm = attnx.transformer.LayerNorm(layer.d_model, p.choice(LAYER_EPS[:-1]), bias=p.bool(0.8),
                                           dtype=layer.dtype) if p.bool() else None
        module = (attnx.TransformerDecoder if decoder else attnx.TransformerEncoder)(layer, p.int(1, 2), norm)
    layers = module.layers if stack else [module]
    prefixes = [f"layers.{i}." for i in range(len(layers))] if stack else [""]
    if p.bool(0.8):
        module.eval()
    if p.bool(0.6):
        randomize_parameters(p, module)
    dtype = layer.dtype
    call_precision, bf16, invalid = module_or_call_precision(p, module, dtype)
    E, H = layer.d_model, layer.self_attn.num_heads
    batch_first = layer.batch_first
    N, L, S = p.int(0, 3), p.choice([0, 1, 2, 5, 9]), p.choice([0, 1, 3, 7])
    batched = not (N == 1 and p.bool(0.25))

    def seq(length):
        shape = ((N, length, E) if batch_first else (length, N, E)) if batched else (length, E)
        return values(p, shape, p.choice([dtype, dtype, dtype, F32, F64, F16]))

    def attn_mask(rows, cols):
        shape = (rows, cols) if p.bool() else ((N * H if batched else H), rows, cols)
        return layer_mask(p, shape, dtype)

    def padding(cols):
        return layer_mask(p, (N, cols) if batched else (cols,), dtype)

    # The flags of a stack default to None (detected from the mask, as torch does).
    flag = (lambda p_true: p.choice([None, True, False])) if stack else (lambda p_true: p.bool(p_true))
    if decoder:
        args = {"tgt": seq(L), "memory": seq(S), "tgt_mask": None, "memory_mask": None,
                "tgt_key_padding_mask": None, "memory_key_padding_mask": None,
                "tgt_is_causal": flag(0.3), "memory_is_causal": p.bool(0.15)}
        if p.bool(0.4):
            args["tgt_mask"] = attn_mask(L, L)
        if p.bool(0.3):
            args["memory_mask"] = attn_mask(L, S)
        if p.bool(0.3):
            args["tgt_key_padding_mask"] = padding(L)
        if p.bool(0.4):
            args["memory_key_padding_mask"] = padding(S)
        arrays = ["tgt", "memory", "tgt_mask", "memory_mask", "tgt_key_padding_mask", "memory_key_padding_mask"]
        flags, padding_name = ["tgt_is_causal", "memory_is_causal"], "tgt_key_padding_mask"
    else:
        mask_name = "mask" if stack else "src_mask"
        args = {"src": seq(L), mask_name: None, "src_key_padding_mask": None, "is_causal": flag(0.3)}
        if p.bool(0.4):
            args[mask_name] = attn_mask(L, L)
        if p.bool(0.4):
            args["src_key_padding_mask"] = padding(L)
        arrays, flags, padding_name = ["src", mask_name, "src_key_padding_mask"], ["is_causal"], "src_key_padding_mask"
    for name in arrays:
        if args[name] is not None and rarely(p, 0.15):
            args[name] = relayout(p, args[name])
    sequences = arrays[: 1 + decoder]

    def run():
        return module(*(args[n] for n in sequences), **{n: args[n] for n in arrays[1 + decoder:] + flags},
                      precision=call_precision)

    what = type(module).__name__
    changes = p.choice([0, 0, 0, 1, 1, 2])
    # (With bfloat16 products the weights are rounded once, at the first call: values written
    # in place after it are not seen, as documented.)
    if rarely(p, 0.2) and not (module.training and layer.dropout) and not bf16:
        # A first call (which keeps the core's view of the parameters), then a parameter
        # changed in place or assigned: the next call must see the new values.
        call(f"{what} (first call)", run)
        OUTCOMES["transformer: parameter changed after a call"] += 1
        changes = max(changes, 1)
    n_mut = int(invalid)
    for _ in range(changes):
        n_mut += mutate_parameter(p, module)
    if rarely(p, 0.05):
        owner = p.choice([getattr(x, n) for x in layers for n in ("norm1", "norm2", "norm3")[: 2 + decoder]]
                         + ([module.norm] if stack and module.norm is not None else []))
        owner.eps = p.choice([0.0, -1.0, float("nan"), float("inf"), 1e-3, None, True])
        n_mut += 1
    if rarely(p, 0.05):
        p.choice(layers).activation = p.choice(ACTIVATION_JUNK)
        n_mut += 1
    n_mut += sum(x.activation is act_raises or (x.activation is act_first_column and x.linear1.out_features != 1)
                 for x in layers)
    n_arg_mut = p.choice([0, 0, 0, 1, 1, 2])
    for _ in range(n_arg_mut):
        name = p.choice(arrays + flags)
        args[name] = p.choice(SCALAR_JUNK) if name in flags else malformed(p, args[name])
    n_mut += n_arg_mut
    garbage = torch_habits(p, args, arrays)

    slots = layer_slots(module)
    shapes = [shape for *_, shape in module._slots()]
    held_params = [getattr(owner, attr) for _, owner, attr in slots]
    inputs = [plain(args[n]) for n in arrays]
    snap = snapshot(inputs + [plain(x) for x in held_params])
    ok, got = call(what, run)
    check_untouched(snap, what)
    if any(getattr(owner, attr) is not x for (_, owner, attr), x in zip(slots, held_params)):
        raise Disallowed(f"{what}: the call replaced a parameter")
    check_garbage_refused(ok, garbage, n_mut, what)
    n_mut += len(garbage)
    if module.training and layer.dropout > 0:
        if ok:
            raise Disallowed(f"{what}: computed in training mode with dropout > 0")
        OUTCOMES[f"{what}: dropout in training mode, {LAST_ERROR[0] and LAST_ERROR[0].__name__}"] += 1
        return
    if not ok:
        if n_mut == 0:
            raise Disallowed(f"{what}: a valid call raised {raised()}")
        return
    for x in inputs + [plain(x) for x in held_params]:
        if isinstance(x, np.ndarray) and np.shares_memory(got, x):
            raise Disallowed(f"{what}: the result shares memory with an input or a parameter")
    odd = sorted({str(np.asarray(plain(x)).dtype) for x in held_params if x is not None and not real_parameter(x)})
    if odd:
        raise Disallowed(f"{what}: computed with a parameter that holds no real numbers ({', '.join(odd)})")
    for (key, _, _), shape, x in zip(slots, shapes, held_params):
        # (Another extent may be valid, as in torch: linear1 and linear2 of another consistent
        # dim_feedforward. Another rank is not.)
        if x is not None and np.ndim(plain(x)) != len(shape):
            raise Disallowed(f"{what}: computed with a parameter of another rank than its own\n"
                             f"{key} of shape {np.shape(plain(x))}, expected {shape}")
    params = layer_params(module, dtype)

    def reference_in(run_dtype, rounded=False, nudged=False):
        # nudged: the inputs a few units of float32's roundoff off, to see how much the layer
        # amplifies a rounding error (a norm over nearly equal values does, at any precision).
        def arr(name):
            x = np.asarray(plain(args[name])).astype(dtype).astype(run_dtype)
            return x * run_dtype(1 + 2.0**-21) if nudged else x

        masks = {n: plain(args[n]) for n in arrays[1 + decoder:]}
        if stack and not decoder:
            masks["src_mask"] = masks.pop("mask")
        x = arr(sequences[0])
        for one, prefix in zip(layers, prefixes):
            own = {k[len(prefix):]: v.astype(run_dtype) for k, v in params.items() if k.startswith(prefix)}
            eps = tuple(float(getattr(one, n).eps) for n in ("norm1", "norm2", "norm3")[: 2 + decoder])
            common = dict(activation=one.activation, norm_first=bool(one.norm_first), batch_first=batch_first,
                          layer_norm_eps=eps, precision="bfloat16" if rounded else None)
            if decoder:
                x = reference.transformer_decoder_layer(
                    x, arr("memory"), own, H, tgt_is_causal=bool(args["tgt_is_causal"]),
                    memory_is_causal=bool(args["memory_is_causal"]), **masks, **common)
            else:
                x = reference.transformer_encoder_layer(x, own, H, is_causal=bool(args["is_causal"]), **masks, **common)
        if stack and module.norm is not None:
            weight, bias = params.get("norm.weight"), params.get("norm.bias")
            x = reference.layer_norm(x, None if weight is None else weight.astype(run_dtype),
                                     None if bias is None else bias.astype(run_dtype), float(module.norm.eps))
        return x

    # attnx runs the layers on the real tokens only: where every position is padding, it has no
    # rows to give the activation (and returns zeros).
    padded = None
    if args[padding_name] is not None and got.size:
        padded = closed_rows(args[padding_name], canonical(got, batched, batch_first).shape[:2])
    no_rows = got.size == 0 or (padded is not None and bool(padded.all()))
    try:
        if bf16:
            # The reference of the same rounding; the spread is its distance from float64
            # without rounding: the rounding as the row's norms amplify it.
            expected = reference_of(lambda: reference_in(np.float32, rounded=True))
            spread = reference_of(lambda: reference_in(np.float64))
        else:
            expected = reference_of(lambda: reference_in(np.float64))
            spread = (reference_of(lambda: reference_in(np.float32)),
                      reference_of(lambda: reference_in(np.float32, nudged=True)))
            spread = None if any(x is None for x in spread) else spread
    except Planted:  # the activation raised in the reference: attnx had no rows to give it
        if not no_rows:
            raise Disallowed(f"{what}: a result where the activation raised") from None
        return
    if (expected is None or spread is None) and no_rows and any(callable(x.activation) for x in layers):
        return  # (the reference called an activation that refuses even no rows; attnx had none to give it)
    if expected is None or spread is None:
        raise Disallowed(f"{what}: attnx computed a result for a call the reference rejects")
    got_rows, exp_rows = (canonical(x, batched, batch_first) for x in (got, expected))
    spread_rows = (tuple(canonical(x, batched, batch_first) for x in spread) if isinstance(spread, tuple)
                   else canonical(spread, batched, batch_first))
    skip = None
    if args[padding_name] is not None:
        skip = closed_rows(args[padding_name], got_rows.shape[:2])
        if np.asarray(got_rows)[skip].any():
            raise Disallowed(f"{what}: an output at a padded position is not 0")
    scaled = inputs[:1 + decoder] + [scale_view(args[n]) for n in arrays[1 + decoder:]] + list(params.values())
    if bf16:
        OUTCOMES[f"{what}: bfloat16 precision checked"] += 1
    compare_layer(got_rows, exp_rows, spread_rows, dtype, what, scaled, skip_rows=skip, bf16=bf16)
    if stack:
        OUTCOMES[f"{what}: result checked"] += 1


def additive(mask, shape):
    """A bool (True = masked) or float mask as float64 values added to the scores, broadcast
    to `shape`; zeros where there is no mask."""
    if mask is None:
        return np.zeros(shape)
    m = np.asarray(plain(mask))
    m = np.where(m, -np.inf, 0.0) if m.dtype == np.bool_ else m.astype(np.float64)
    return np.broadcast_to(m, shape)


def decoder_reference(decoder, params, tokens, memory, cross_bias, run_dtype, precision=None):
    """The reference decoder (each layer's attnx.reference.transformer_decoder_layer, then the
    final norm) over whole sequences with the causal tgt_mask: `tokens` (n, L, E) and `memory`
    (n, S, E) batch first, `cross_bias` (n * nhead, L, S) the memory attention's mask; with
    the products of `precision`."""
    x, mem = tokens.astype(run_dtype), memory.astype(run_dtype)
    L = x.shape[1]
    causal = np.triu(np.ones((L, L), bool), 1)
    for i, layer in enumerate(decoder.layers):
        prefix = f"layers.{i}."
        own = {k[len(prefix):]: v.astype(run_dtype) for k, v in params.items() if k.startswith(prefix)}
        eps = tuple(float(getattr(layer, n).eps) for n in ("norm1", "norm2", "norm3"))
        x = reference.transformer_decoder_layer(
            x, mem, own, layer.self_attn.num_heads, tgt_mask=causal, memory_mask=cross_bias.astype(run_dtype),
            activation=layer.activation, layer_norm_eps=eps, norm_first=bool(layer.norm_first), batch_first=True,
            precision=precision)
    if decoder.norm is not None:
        weight, bias = params.get("norm.weight"), params.get("norm.bias")
        x = reference.layer_norm(x, None if weight is None else weight.astype(run_dtype),
                                 None if bias is None else bias.astype(run_dtype), decoder.norm.eps)
    return x


def norm_conditioning(fn):
    """``(fn(), k)``: k the largest max|x| / sqrt(var + eps) of a row that reference.layer_norm
    normalized while fn ran (how much the norm amplifies a rounding of the row's values)."""
    real, worst = reference.layer_norm, [0.0]

    def recording(x, weight, bias, eps):
        a = np.asarray(x, np.float64)
        if a.size:
            with np.errstate(all="ignore"):
                k = np.abs(a).max(axis=-1) / np.sqrt(a.var(axis=-1) + eps)
            k = k[np.isfinite(k)]
            worst[0] = max(worst[0], float(k.max(initial=0.0)))
        return real(x, weight, bias, eps)

    reference.layer_norm = recording
    try:
        return fn(), worst[0]
    finally:
        reference.layer_norm = real


def cache_state(cache):
    """Every layer's lengths and the keys and values it holds."""
    return [(c.lengths.copy(), held(c)) for c in cache.layers]


def fuzz_transformer_step(p: Provider):
    """TransformerDecoder.step over a TransformerDecoderCache: a decoder of 1 to 3 layers (a
    final norm or none) decodes a few steps of 0 to 3 new positions per sequence, over a
    memory with ragged padding and per-step memory masks, with a slot of the cache reset now
    and then; some steps get a malformed argument (tgt, memory, masks, cache) or are too long
    for the cache. A step that raises must leave every layer's lengths, keys and values as
    they were; one that returns must append its positions to every layer, keep what they held,
    and give, at the new positions, the reference decoder's output over each whole sequence
    with the causal tgt_mask."""
    dtype = p.choice([F32, F32, F64])
    H = p.int(1, 3)
    E = H * p.choice([1, 2, 4, 8])
    eps = p.choice([1e-5, 1e-5, 1e-3, 0.25])
    dropout = p.choice([0.0, 0.0, 0.0, 0.1])
    layer = attnx.TransformerDecoderLayer(
        E, H, p.choice([1, 3, 8]), dropout, p.choice(["relu", "gelu", act_tanh, act_relu_in_place]), eps,
        p.bool(), p.bool(), p.bool(0.8), dtype=dtype, seed=p.int(0, 1000))
    norm = attnx.transformer.LayerNorm(E, eps, bias=p.bool(0.8), dtype=dtype) if p.bool() else None
    decoder = attnx.TransformerDecoder(layer, p.int(1, 3), norm)
    if p.bool(0.85):
        decoder.eval()
    if p.bool(0.7):
        randomize_parameters(p, decoder)
    dropout_applies = decoder.training and dropout > 0
    step_precision, bf16, invalid = module_or_call_precision(p, decoder, dtype)  # every step's
    batch_first = layer.batch_first
    B = p.int(1, 3)
    batched = not (B == 1 and p.bool(0.3))
    cache = decoder.new_cache(B, p.choice([1, 3, 6, 10]), p.choice([dtype, dtype, dtype, F32, F64, I8] + HALVES))
    unit = max(UNIT[dtype], UNIT[cache.dtype])
    params = layer_params(decoder, dtype)

    def layout(x):  # (B, L, E) -> the decoder's layout
        return x.transpose(1, 0, 2) if batched and not batch_first else (x if batched else x[0])

    S = p.choice([0, 1, 3, 6])
    memory = values(p, (B, S, E), dtype).astype(np.float64)  # canonical, the decoder's values
    kpm = None
    if p.bool(0.6):
        ends = np.random.default_rng(p.seed()).integers(0, S + 1, B)
        closed = np.arange(S)[None, :] >= ends[:, None]
        kpm = closed if p.bool() else np.where(closed, -np.inf, 0.0).astype(p.choice([dtype, F32, F64]))
        kpm = kpm if batched else kpm[0]
    masked_steps = p.bool(0.4)
    tokens = [[] for _ in range(B)]  # per sequence: the positions' inputs (E,)
    cross = [[] for _ in range(B)]  # their memory attention's mask rows (H, S)
    outputs = [[] for _ in range(B)]  # the step's results at them (E,)

    def check(seqs):
        """The outputs of sequences `seqs` against the reference over their whole sequences."""
        groups: dict = {}
        for b in seqs:
            if tokens[b]:
                groups.setdefault(len(tokens[b]), []).append(b)
        for bs in groups.values():
            x = np.array([tokens[b] for b in bs])
            bias = np.array([cross[b] for b in bs]).transpose(0, 2, 1, 3).reshape(len(bs) * H, x.shape[1], S)
            mem = memory[bs]
            if bf16:
                # The reference of the same rounding; the spread is its distance from float64
                # without rounding (as in fuzz_transformer_layer).
                expected, conditioning = norm_conditioning(lambda: reference_of(
                    lambda: decoder_reference(decoder, params, x, mem, bias, np.float32, "bfloat16")))
                spread = reference_of(lambda: decoder_reference(decoder, params, x, mem, bias, np.float64))
                OUTCOMES["TransformerDecoder.step: bfloat16 precision checked"] += 1
            else:
                expected, conditioning = norm_conditioning(
                    lambda: reference_of(lambda: decoder_reference(decoder, params, x, mem, bias, np.float64)))
                spread = reference_of(lambda: decoder_reference(decoder, params, x, mem, bias, np.float32))
            if expected is None or spread is None:
                raise Disallowed("TransformerDecoder.step: results where the reference rejects the decoder")
            got = np.array([outputs[b] for b in bs], dtype)
            if (cache.dtype in HALVES or cache.dtype == I8) and UNIT[cache.dtype] * conditioning > 0.02:
                # A norm of a row whose values nearly cancel (as two near-equal values of a
                # d_model of 2 do) amplifies the rounding of half-precision or int8 keys and values past
                # any tolerance: such decodes are not compared.
                OUTCOMES["TransformerDecoder.step: not comparable (half-precision cache, a norm ill-conditioned)"] += 1
                continue
            compare_layer(got, expected, spread, dtype, "TransformerDecoder.step", [x, mem, scale_view(bias)]
                          + list(params.values()), unit=unit, bf16=bf16)

    for _ in range(p.int(1, 4)):
        if rarely(p, 0.12):
            index = p.choice([None, p.int(0, B - 1)])
            seqs = range(B) if index is None else [index]
            check(seqs)
            cache.reset(index)
            for b in seqs:
                tokens[b], cross[b], outputs[b] = [], [], []
            if any(int(c.lengths[b]) for c in cache.layers for b in seqs):
                raise Disallowed("TransformerDecoderCache.reset: a layer kept positions")
            OUTCOMES["TransformerDecoder.step: cache reset"] += 1
        T = p.choice([0, 1, 1, 2, 3])
        x = values(p, (B, T, E), p.choice([dtype, dtype, F32, F64, F16]))
        mem_arg = layout(memory.astype(dtype))
        mem_arg = p.choice([lambda: mem_arg, lambda: relayout(p, mem_arg), lambda: mem_arg.astype(F64)])()
        args = {"tgt": layout(x), "memory": mem_arg, "cache": cache, "memory_key_padding_mask": kpm,
                "memory_mask": None}
        if masked_steps and p.bool(0.8):
            shape = (T, S) if p.bool() else ((B * H if batched else H), T, S)
            args["memory_mask"] = layer_mask(p, shape, dtype)
        for name in ("tgt", "memory", "memory_key_padding_mask", "memory_mask"):
            if isinstance(args[name], np.ndarray) and rarely(p, 0.15):
                args[name] = relayout(p, args[name])
        n_mut = p.choice([0, 0, 0, 0, 1, 2])
        for _ in range(n_mut):
            name = p.choice(["tgt", "memory", "memory_key_padding_mask", "memory_mask", "cache"])
            if name == "cache":
                args[name] = p.choice([
                    lambda: None, lambda: "cache", lambda: cache.layers[0],
                    lambda: attnx.TransformerDecoderCache(len(decoder.layers) + 1, B, H, cache.max_len, E // H),
                    lambda: attnx.TransformerDecoderCache(len(decoder.layers), B, E, cache.max_len, 1),
                    lambda: decoder.new_cache(B + 1, cache.max_len)])()
            else:
                args[name] = malformed(p, args[name])
        garbage = torch_habits(p, args, ["tgt", "memory", "memory_key_padding_mask", "memory_mask"])
        broken = None
        if rarely(p, 0.1):
            # One layer (a later one, too) broken for this step only: a malformed parameter, or
            # an activation that raises. Layers before it may have appended: the step must
            # undo that, and leave no trace of the broken parameter for the next steps.
            layer_i = p.choice(decoder.layers)
            if p.bool(0.3):
                broken = (layer_i, "activation", layer_i.activation)
                layer_i.activation = act_raises
            else:
                _, owner, attr = p.choice(layer_slots(layer_i))
                broken = (owner, attr, getattr(owner, attr))
                integral = is_float(broken[2]) and p.bool(0.3)  # (a copy of integers: refused by the attention)
                setattr(owner, attr, np.rint(broken[2] * 4).astype(int) if integral else malformed(p, broken[2]))
            n_mut += 1
            OUTCOMES["TransformerDecoder.step: a layer broken for a step"] += 1
        n_mut += invalid  # (a precision the decoder cannot take: every step raises)
        inputs = [plain(args[n]) for n in ("tgt", "memory", "memory_key_padding_mask", "memory_mask")]
        snap = snapshot(inputs)
        before = cache_state(cache)
        ok, got = call("TransformerDecoder.step", lambda: decoder.step(
            args["tgt"], args["memory"], args["cache"], memory_key_padding_mask=args["memory_key_padding_mask"],
            memory_mask=args["memory_mask"], precision=step_precision))
        check_untouched(snap, "TransformerDecoder.step")
        if broken is not None:  # the parameter back, for the steps to come
            setattr(*broken)
        after = cache_state(cache)
        for (lengths, kept), (_, now) in zip(before, after):
            trimmed = [(k[:, :kb.shape[1]], v[:, :kb.shape[1]]) for (k, v), (kb, _) in zip(now, kept)]
            if not same_held(trimmed, kept):
                raise Disallowed("TransformerDecoder.step: a cached position's key or value changed")
        check_garbage_refused(ok, garbage, n_mut, "TransformerDecoder.step")
        n_mut += len(garbage)
        if dropout_applies and ok:
            raise Disallowed("TransformerDecoder.step: computed in training mode with dropout > 0")
        if not ok:
            if any(not np.array_equal(b[0], a[0]) for b, a in zip(before, after)):
                raise Disallowed("TransformerDecoder.step: raised after appending to the cache")
            if n_mut == 0 and not dropout_applies and np.all(before[0][0] + T <= cache.max_len):
                raise Disallowed(f"TransformerDecoder.step: a valid step raised {raised()}")
            continue
        for a in inputs:
            if isinstance(a, np.ndarray) and np.shares_memory(got, a):
                raise Disallowed("TransformerDecoder.step: the result shares memory with an input")
        if broken is not None:
            # The changed parameter was valid after all (another layout, None for a bias, ...):
            # the positions of this step were made with it, which the reference's forward pass
            # over the whole sequences cannot follow. Compare what came before, then stop.
            OUTCOMES["TransformerDecoder.step: a broken layer accepted (decode ends)"] += 1
            check(range(B))
            return
        if args["cache"] is not cache:  # another cache of this decoder's layout: valid, and ours untouched
            if any(not np.array_equal(b[0], a[0]) for b, a in zip(before, after)):
                raise Disallowed("TransformerDecoder.step: a step given another cache changed this one")
            OUTCOMES["TransformerDecoder.step: another cache of the same layout"] += 1
            continue
        tgt = canonical(np.asarray(plain(args["tgt"])).astype(dtype).astype(np.float64), batched, batch_first)
        n = tgt.shape[1]
        for i, ((lengths, _), (now, _)) in enumerate(zip(before, after)):
            if not np.array_equal(now, lengths + n):
                raise Disallowed(f"TransformerDecoder.step: layer {i} holds {now.tolist()} positions, expected "
                                 f"{(lengths + n).tolist()}")
        mem_used = canonical(np.asarray(plain(args["memory"])).astype(dtype).astype(np.float64), batched, batch_first)
        if mem_used.shape != memory.shape or not np.array_equal(mem_used, memory, equal_nan=True):
            # A malformed memory that is valid after all (another length, other values): the
            # positions cached so far were made with the other memory, which the reference's
            # whole-sequence forward pass cannot follow. Compare what came before, then stop.
            OUTCOMES["TransformerDecoder.step: another memory (decode ends)"] += 1
            check(range(B))
            return
        got_rows = canonical(got, batched, batch_first)
        if got_rows.dtype != dtype or got_rows.shape != tgt.shape:
            raise Disallowed(f"TransformerDecoder.step: dtype/shape {got.dtype} {got.shape}, expected {dtype}, "
                             f"{n} positions")
        m = None if args["memory_mask"] is None else np.asarray(plain(args["memory_mask"]))
        if m is not None and m.shape not in ((n, S), ((B if batched else 1) * H, n, S)):
            raise Disallowed(f"TransformerDecoder.step: accepted a memory_mask of shape {m.shape}")
        kp = None if args["memory_key_padding_mask"] is None else np.asarray(plain(args["memory_key_padding_mask"]))
        if kp is not None and kp.shape != ((B, S) if batched else (S,)):
            raise Disallowed(f"TransformerDecoder.step: accepted a memory_key_padding_mask of shape {kp.shape}")
        bias = additive(None if m is None else (m.reshape(B, H, n, S) if m.ndim == 3 else m), (B, H, n, S))
        bias = bias + additive(None if kp is None else kp.reshape(B, 1, 1, S), (B, H, n, S))
        for b in range(B):
            tokens[b].extend(tgt[b])
            cross[b].extend(bias[b].transpose(1, 0, 2))
            outputs[b].extend(got_rows[b])
        OUTCOMES["TransformerDecoder.step: positions appended"] += 1
    check(range(B))
