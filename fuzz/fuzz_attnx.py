"""Fuzz target of attnx's Python entry points.

``TestOneInput(data)`` turns a byte string into one call of an attnx entry point --
``scaled_dot_product_attention``, ``multi_head_attention_forward``, ``MultiheadAttention``
(construction, forward, ``load_state_dict``), ``set_num_threads``, ``KVCache`` with
``cached_attention``, ``multi_head_attention_step`` (a few decoding steps over a cache),
``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (alone or in their stacks, with their
parameters changed, masks of every kind), ``TransformerDecoder.step`` (a few decoding steps
over a ``TransformerDecoderCache``, a layer broken for one of them), ``varlen_attention``
(ragged batches packed along the first axis, malformed ``cu_seqlens`` offsets),
``PagedKVCache`` with ``paged_attention`` (a small pool served over a few steps: sequences
joining, forking, leaving and cut back, prefill and decode rows in one call, rotary
embeddings, a pool that runs out), and the private
``_core.sdpa`` / ``_testing.run_sdpa`` / ``_core.mha`` / ``_core.MhaWeights`` --
built as a valid call that is then mutated 0 to 3 times: an argument replaced by a
malformed value (wrong rank, shape, dtype, strides, byte order, alignment, a list, a
string, None, an object whose ``__array__`` raises, ...), or resized, or re-typed, or
re-laid-out. The public entry points also get what torch code passes: tensors that require
grad (valid: read as their values), tensor subclasses whose conversion gives garbage of
another shape (they must raise), and ``CausalBias`` masks for sdpa. Each entry point's module
(below) says what it draws and checks. The only allowed outcomes:

* a result equal to the float64 reference's (``attnx.reference``, to the contract's
  tolerances, NaN/Inf where it has them) -- and an unmutated call must give one; a call
  with ``precision="bfloat16"`` (drawn for sdpa, multi-head attention, the module, the caches,
  the decoding steps, the transformer layers, varlen_attention and paged_attention) against
  the reference of the same rounding, within BF16_TOL of the values' magnitude, and one with
  ``precision="int8"`` (cached_attention over an int8 cache; refused over the others) against
  the reference's int8 arithmetic within the same;
* ``ValueError``, ``TypeError`` or ``NotImplementedError``;
* ``MemoryError`` only for requests that are truly huge (flagged where they are built).

Anything else -- another exception, a wrong result, a modified input, a crash -- fails.

Run it::

    python fuzz/fuzz_attnx.py --seconds 90 --seed 1        # built-in engine (default)
    python fuzz/fuzz_attnx.py --engine atheris --seconds 90 --seed 1   # libFuzzer, if installed

The built-in engine feeds random byte strings from a fixed seed (so a run is reproducible:
the same inputs in the same order), and prints a JSON summary: inputs run, seconds, and
the count of each outcome. ``--max-inputs N`` stops after N inputs (a run that is the same
every time, whatever the machine's speed). ``--save-last PATH`` writes each input there
before running it (to keep the input of a crash); ``--replay PATH`` runs one saved input
(``--replay hex:...`` one given in hex, as a failure's report prints it).

The modules, in fuzz/attnx_fuzz/::

    common.py       what the entry points share: Provider (decisions read from the bytes),
                    values and malformed values, torch look-alikes, precision=, call() and the
                    outcome counts (OUTCOMES), the oracle (compare, check_untouched, ...)
    sdpa.py         scaled_dot_product_attention
    varlen.py       varlen_attention
    mha.py          multi_head_attention_forward
    mha_module.py   MultiheadAttention (construction, load_state_dict, forward)
    threads.py      set_num_threads
    core.py         the private _core.sdpa, _testing.run_sdpa, _core.MhaWeights, _core.mha
    kv_cache.py     KVCache with cached_attention
    paged_cache.py  PagedKVCache with paged_attention
    mha_step.py     multi_head_attention_step
    transformer.py  the transformer layers and stacks; TransformerDecoder.step

This script holds the dispatch table (ENTRY_POINTS), TestOneInput and the engines.

Adding an entry point (say ``PagedKVCache`` with ``paged_attention``):

1. A module, fuzz/attnx_fuzz/paged_cache.py, whose docstring says what it fuzzes, with a
   ``fuzz_paged_cache(p: Provider)``: draw a valid call from ``p`` (``values``, ``relayout``),
   mutate it (``mutate``, ``malformed``, ``torch_habits``) counting the mutations, run it
   through ``call(what, fn)`` (which counts an allowed exception and refuses any other), then
   judge the outcome: ``check_untouched``, ``check_garbage_refused``; an unmutated call must
   succeed; a result goes to ``compare`` against ``attnx.reference`` (where the reference
   rejects the call, the result is a failure). Take what is shared from ``.common``; what
   two entry points share belongs there, not in one of them.
2. One line in ENTRY_POINTS below (and the module in the import beside it). The function's
   name is its outcome key (``entry fuzz_paged_cache``). The first byte of an input picks
   the entry point, modulo the table's length: a longer table sends the inputs of a seed
   elsewhere, so a run's counts are comparable only with runs of the same table.
3. In tests/test_fuzz.py: its name among the entries the short run must reach, and a test
   that its oracle catches a sabotaged result, as the others have.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import sys
import time
import warnings

# The modules are the package attnx_fuzz beside this script: on sys.path when it runs as a
# script (its folder comes first), added here when it is loaded by path (tests/test_fuzz.py).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# attnx_fuzz before attnx: its __init__ imports attnx instrumented under --engine atheris.
from attnx_fuzz import (  # noqa: E402
    core, kv_cache, mha, mha_module, mha_step, paged_cache, sdpa, threads, transformer, varlen,
)
from attnx_fuzz.common import BASE_THREADS, OUTCOMES, Provider  # noqa: E402

import attnx  # noqa: E402

# The dispatch table: an input's first byte picks its entry point (modulo the table's length).
# An entry listed twice gets twice the inputs. The order decides which inputs of a seed reach
# which entry point: append a new one at the end.
ENTRY_POINTS = [
    sdpa.fuzz_sdpa,
    sdpa.fuzz_sdpa,
    mha.fuzz_mha,
    mha.fuzz_mha,
    mha_module.fuzz_module,
    core.fuzz_core,
    core.fuzz_core,
    threads.fuzz_set_num_threads,
    kv_cache.fuzz_cache,
    mha_step.fuzz_step,
    transformer.fuzz_transformer_layer,
    transformer.fuzz_transformer_step,
    varlen.fuzz_varlen,
    paged_cache.fuzz_paged_cache,
]


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    p = Provider(data)
    entry = ENTRY_POINTS[p.int(0, len(ENTRY_POINTS) - 1)]
    OUTCOMES["inputs"] += 1
    OUTCOMES[f"entry {entry.__name__}"] += 1
    try:
        with warnings.catch_warnings():
            # Building malformed inputs warns (complex -> float casts, ...); attnx's own
            # warnings are not under test here.
            warnings.simplefilter("ignore")
            entry(p)
    finally:
        if attnx.get_num_threads() != BASE_THREADS:
            attnx.set_num_threads(BASE_THREADS)


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


def summary(seconds, engine, seed):
    inputs = OUTCOMES["inputs"]
    return {
        "engine": engine, "seed": seed, "inputs": inputs, "seconds": round(seconds, 1),
        "inputs_per_second": round(inputs / max(seconds, 1e-9), 1),
        "isa": attnx.show_config()["isa"],
        "outcomes": dict(sorted((k, v) for k, v in OUTCOMES.items() if k != "inputs")),
    }


FAILURES: dict = {}  # first line of the failure -> {"count", "input", "traceback"}


def run_builtin(seconds, seed, save_last, max_inputs, stop_on_failure):
    """Random byte strings from a fixed seed, for `seconds`. A disallowed outcome is recorded
    (deduplicated by its message's first line, with the first input that gave it) and the run
    goes on; a crash ends the process (--save-last keeps its input)."""
    import traceback

    rng = random.Random(seed)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and OUTCOMES["inputs"] < max_inputs:
        data = rng.randbytes(rng.choice([8, 32, 64, 128, 256, 512]))
        if save_last:
            with open(save_last, "wb") as f:
                f.write(data)
        try:
            TestOneInput(data)
        except Exception as exc:  # noqa: BLE001 - every failure is reported at the end
            key = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if "Not equal to tolerance" in str(exc) or "nan location mismatch" in str(exc):
                key = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            entry = FAILURES.setdefault(key, {"count": 0, "input": "hex:" + data.hex(),
                                              "traceback": traceback.format_exc()[-3000:]})
            entry["count"] += 1
            if stop_on_failure:
                break
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["builtin", "atheris"], default="builtin")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-inputs", type=int, default=10**12)
    ap.add_argument("--save-last", default=None)
    ap.add_argument("--stop-on-failure", action="store_true")
    ap.add_argument("--replay", default=None, help="run one saved input (a file, or hex with hex:)")
    ap.add_argument("--summary", default=None, help="also write the JSON summary to this file")
    args, rest = ap.parse_known_args(argv)
    attnx.set_num_threads(BASE_THREADS)
    if args.replay:
        data = bytes.fromhex(args.replay[4:]) if args.replay.startswith("hex:") else open(args.replay, "rb").read()
        TestOneInput(data)
        print(json.dumps(summary(0.0, "replay", None)))
        return 0
    if args.engine == "atheris":
        start = time.perf_counter()

        def report():
            s = json.dumps(summary(time.perf_counter() - start, "atheris", args.seed))
            print(s, flush=True)
            if args.summary:
                with open(args.summary, "w") as f:
                    f.write(s + "\n")

        atexit.register(report)
        import atheris  # (attnx_fuzz imported attnx instrumented: ATTNX_FUZZ_ATHERIS_INSTRUMENT)

        atheris.Setup([sys.argv[0], f"-seed={args.seed}", f"-max_total_time={int(args.seconds)}",
                       "-rss_limit_mb=8192", "-timeout=60", *rest], TestOneInput)
        atheris.Fuzz()
        return 0
    seconds = run_builtin(args.seconds, args.seed, args.save_last, args.max_inputs, args.stop_on_failure)
    result = summary(seconds, "builtin", args.seed)
    result["failures"] = {k: {"count": v["count"], "input": v["input"]} for k, v in FAILURES.items()}
    for key, v in FAILURES.items():
        print(f"\n=== FAILURE ({v['count']}x): {key}\n    replay: python fuzz/fuzz_attnx.py --replay {v['input']}\n"
              f"{v['traceback']}", file=sys.stderr)
    s = json.dumps(result)
    print(s)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(s + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    if "--engine" in sys.argv and "atheris" in sys.argv and not os.environ.get("ATTNX_FUZZ_ATHERIS_INSTRUMENT"):
        # Re-run with the attnx package instrumented for atheris' coverage feedback.
        os.environ["ATTNX_FUZZ_ATHERIS_INSTRUMENT"] = "1"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    sys.exit(main())
