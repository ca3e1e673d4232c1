"""The fuzz target (fuzz/fuzz_attnx.py, its entry points' modules in fuzz/attnx_fuzz/): a short
fixed-seed run, its oracle, and the regressions it found.

``.ci/run`` runs the fuzzer for real (a fixed seed, a time bound, the count of inputs
reported); here a few seconds of it run in a child process on every ``python -m pytest``,
so that the target itself keeps working and the commonest failures show at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import attnx
from _hardening import record, scaled

pytestmark = pytest.mark.hardening

FUZZ = pathlib.Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_attnx.py"
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(attnx.__file__)))


def load_fuzz_module():
    """The entry script, loaded by path; it puts its folder on sys.path, where its modules (the
    package attnx_fuzz) are then imported from."""
    spec = importlib.util.spec_from_file_location("fuzz_attnx_under_test", FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_fuzz_common():
    """The fuzzer's shared module (attnx_fuzz.common): Provider, the oracle, the outcome counts."""
    load_fuzz_module()
    return importlib.import_module("attnx_fuzz.common")


@pytest.mark.slow
def test_short_fixed_seed_fuzz_run(tmp_path):
    # A fixed number of inputs (not a time bound), so that the run is the same every time.
    inputs = scaled(2000, 8000)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PYTHON_DIR, env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run(
        [sys.executable, str(FUZZ), "--seconds", "1200", "--max-inputs", str(inputs), "--seed", "12345",
         "--save-last", str(tmp_path / "last-input")],
        capture_output=True, text=True, env=env, timeout=1500,
    )
    assert proc.returncode in (0, 1), f"the fuzzer crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    record("fuzz (pytest, short)", inputs=result["inputs"], seconds=result["seconds"],
           failures=len(result["failures"]))
    assert result["failures"] == {}, proc.stderr[-6000:]
    assert proc.returncode == 0
    assert result["inputs"] == inputs
    outcomes = result["outcomes"]
    # Every entry point ran, and the oracle compared results.
    for entry in ("fuzz_sdpa", "fuzz_mha", "fuzz_module", "fuzz_core", "fuzz_set_num_threads", "fuzz_cache",
                  "fuzz_step", "fuzz_transformer_layer", "fuzz_transformer_step", "fuzz_varlen",
                  "fuzz_paged_cache"):
        assert outcomes.get(f"entry {entry}", 0) > 0, entry
    assert outcomes.get("result checked", 0) > inputs // 5


def test_the_oracle_catches_a_wrong_result(monkeypatch):
    """The fuzzer's checks have teeth: an sdpa 1% off, or one raising RuntimeError, fails."""
    fz = load_fuzz_module()
    real = attnx.scaled_dot_product_attention
    monkeypatch.setattr(fz.attnx, "scaled_dot_product_attention", lambda *a, **k: real(*a, **k) * 1.01)
    caught = 0
    for i in range(300):
        data = np.random.default_rng(i).bytes(64)
        try:
            fz.TestOneInput(bytes([0]) + data)  # first byte 0: the sdpa entry
        except AssertionError:
            caught += 1
    assert caught > 10

    def raising(*a, **k):
        raise RuntimeError("not an allowed outcome")

    monkeypatch.setattr(fz.attnx, "scaled_dot_product_attention", raising)
    with pytest.raises(RuntimeError):
        for i in range(50):
            fz.TestOneInput(bytes([0]) + np.random.default_rng(i).bytes(64))



@pytest.mark.slow
def test_the_step_oracle_catches_a_wrong_result_and_a_late_error(monkeypatch):
    """The decoding step's checks have teeth: a result 1% off fails, and so does a step that
    appends the new tokens to the cache and then raises (an allowed ValueError, too late)."""
    fz = load_fuzz_module()
    entry = bytes([fz.ENTRY_POINTS.index(fz.mha_step.fuzz_step)])
    real = attnx.multi_head_attention_step

    def count_failures(inputs=300):
        caught = 0
        for i in range(inputs):
            try:
                fz.TestOneInput(entry + np.random.default_rng(i).bytes(300))
            except AssertionError:
                caught += 1
        return caught

    assert count_failures(100) == 0
    monkeypatch.setattr(fz.attnx, "multi_head_attention_step", lambda *a, **k: real(*a, **k) * 1.01)
    assert count_failures() > 10

    def late_error(*a, **k):
        real(*a, **k)
        raise ValueError("after the append")

    monkeypatch.setattr(fz.attnx, "multi_head_attention_step", late_error)
    assert count_failures() > 10


@pytest.mark.slow
def test_the_transformer_oracles_catch_a_wrong_result_and_a_late_error(monkeypatch):
    """The transformer entries' checks have teeth: an encoder layer 0.1% off fails, a decoding
    step 1% off fails, and so does a step that appends its positions and then raises."""
    fz = load_fuzz_module()
    from attnx import _layers

    def failures(entry, message, inputs=400):
        index = bytes([fz.ENTRY_POINTS.index(entry)])
        caught = 0
        for i in range(inputs):
            try:
                fz.TestOneInput(index + np.random.default_rng(i).bytes(300))
            except Exception as exc:  # noqa: BLE001 - only the failures of the sabotage are counted
                caught += message in str(exc)
        return caught

    real_layer = _layers.encoder_layer
    monkeypatch.setattr(_layers, "encoder_layer", lambda *a, **k: real_layer(*a, **k) * 1.001)
    assert failures(fz.transformer.fuzz_transformer_layer, "not equal to the reference", 600) > 10
    monkeypatch.setattr(_layers, "encoder_layer", real_layer)

    real_step = attnx.TransformerDecoder.step
    monkeypatch.setattr(attnx.TransformerDecoder, "step", lambda self, *a, **k: real_step(self, *a, **k) * 1.01)
    assert failures(fz.transformer.fuzz_transformer_step, "not equal to the reference", 200) > 10

    def late_error(self, *a, **k):
        real_step(self, *a, **k)
        raise ValueError("after the append")

    monkeypatch.setattr(attnx.TransformerDecoder, "step", late_error)
    assert failures(fz.transformer.fuzz_transformer_step, "raised after appending", 200) > 10


def test_the_varlen_oracle_catches_a_wrong_result_and_accepted_bad_offsets(monkeypatch):
    """varlen_attention's checks have teeth: a result 1% off fails, and so does a
    varlen_attention that computes (zeros) where it should refuse its offsets or head counts;
    the real one passes the same inputs."""
    fz, common = load_fuzz_module(), load_fuzz_common()
    entry = bytes([fz.ENTRY_POINTS.index(fz.varlen.fuzz_varlen)])
    real = attnx.varlen_attention

    def failures(message, inputs=300):
        caught = 0
        for i in range(inputs):
            try:
                fz.TestOneInput(entry + np.random.default_rng(i).bytes(300))
            except AssertionError as exc:
                caught += message in str(exc)
        return caught

    assert failures("", 150) == 0
    monkeypatch.setattr(fz.attnx, "varlen_attention", lambda *a, **k: real(*a, **k) * 1.01)
    assert failures("") > 10

    def lenient(query, key, value, cu_seqlens_q, cu_seqlens_k=None, **kwargs):
        try:
            return real(query, key, value, cu_seqlens_q, cu_seqlens_k, **kwargs)
        except ValueError as exc:
            if "cu_seqlens" not in str(exc) and "multiple of key heads" not in str(exc):
                raise
            q, v = np.asarray(common.plain(query)), np.asarray(common.plain(value))
            return np.zeros(q.shape[:2] + v.shape[2:], q.dtype)

    monkeypatch.setattr(fz.attnx, "varlen_attention", lenient)
    assert failures("computed with invalid offsets") > 10
    assert failures("computed with query heads") > 3


def test_the_paged_oracle_catches_a_wrong_result_a_late_error_and_a_changed_pool(monkeypatch):
    """paged_attention's checks have teeth: a result 1% off fails; so does a call that appends
    its keys and then raises (an allowed ValueError, too late), and one that computes right but
    then writes into blocks it was not asked to (held by other sequences too). The real one
    passes the same inputs."""
    fz = load_fuzz_module()
    entry = bytes([fz.ENTRY_POINTS.index(fz.paged_cache.fuzz_paged_cache)])
    real = attnx.paged_attention

    def failures(message, inputs=300):
        caught = 0
        for i in range(inputs):
            try:
                fz.TestOneInput(entry + np.random.default_rng(i).bytes(300))
            except AssertionError as exc:
                caught += message in str(exc)
        return caught

    assert failures("", 150) == 0
    monkeypatch.setattr(fz.attnx, "paged_attention", lambda *a, **k: real(*a, **k) * 1.01)
    assert failures("Not equal to tolerance") > 10

    def late_error(query, cache, seqs, query_lens=None, key=None, value=None, **kwargs):
        result = real(query, cache, seqs, query_lens, key, value, **kwargs)
        if key is not None:
            raise ValueError("after the append")
        return result

    monkeypatch.setattr(fz.attnx, "paged_attention", late_error)
    assert failures("after changing the cache") > 10

    def stray_write(query, cache, seqs, *args, **kwargs):
        result = real(query, cache, seqs, *args, **kwargs)
        cache._key[..., :1, :] += 1  # the first row of every block, held or free
        return result

    monkeypatch.setattr(fz.attnx, "paged_attention", stray_write)
    assert failures("read back from the pool differ") > 10


# ---------------------------------------------------------------------------------------------
# Regressions found by the fuzzer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["yes", None, 2, np.array([True, False])], ids=["str", "None", "int", "array"])
def test_enable_gqa_is_checked_on_every_path(flag):
    """Found by the fuzzer: ``enable_gqa`` that is not a bool raises TypeError on the general
    path (with a mask, a scale or ``out=``) but was accepted silently on the plain fast path
    (three 4-D arrays, no mask, default scale: a fast path then handed them to the core
    before any flag is checked). The same call must not succeed or fail depending on whether
    a scale was passed."""
    q = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(TypeError, match="enable_gqa"):
        attnx.scaled_dot_product_attention(q, q, q, scale=0.5, enable_gqa=flag)
    with pytest.raises(TypeError, match="enable_gqa"):
        attnx.scaled_dot_product_attention(q, q, q, enable_gqa=flag)


def test_oracle_judges_list_inputs_by_their_values():
    """Found by the fuzzer: a key passed as a list of values near float32's limit made
    float32 scores overflow (a NaN row, where the float64 reference stays finite), and the
    oracle compared the results with the tolerance because it judged only ndarray inputs as
    well or badly scaled. A list's values now count as an array's do."""
    common = load_fuzz_common()
    got = np.full((1, 2), np.nan, np.float32)
    expected = np.ones((1, 2))
    extreme = [[-3e38, 2e38, 1.0]]
    before = common.OUTCOMES["result not comparable (extreme values)"]
    common.compare(got, expected, np.dtype(np.float32), "list input", [np.ones((1, 3), np.float32), extreme])
    assert common.OUTCOMES["result not comparable (extreme values)"] == before + 1
    # A well-scaled list still gets the tolerance check.
    with pytest.raises(AssertionError):
        common.compare(got, expected, np.dtype(np.float32), "list input", [np.ones((1, 3), np.float32), [[0.5, 1.0]]])


@pytest.mark.parametrize("entry", ["sdpa", "varlen"])
def test_a_softcap_past_float32_range_has_no_effect(entry):
    """Found by the fuzzer (fuzz_varlen): ``softcap=1e39`` (any finite value past float32's
    largest, 3.4e38) gave NaN everywhere in a float32 computation (the cap rounded to Inf:
    Inf * tanh(s / Inf) = NaN) where the float64 reference gives the result without a cap.
    Such a cap is float32's largest: a finite score keeps its value."""
    q = np.random.default_rng(0).standard_normal((5, 2, 8)).astype(np.float32)  # (tokens, H, E)
    call = {"sdpa": lambda **kw: attnx.scaled_dot_product_attention(*(q.transpose(1, 0, 2),) * 3, **kw),
            "varlen": lambda **kw: attnx.varlen_attention(q, q, q, [0, 2, 5], **kw)}[entry]
    np.testing.assert_allclose(call(softcap=1e39), call(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entry", ["sdpa", "varlen"])
def test_a_huge_softcap_with_bfloat16_products_has_no_effect(entry):
    """Found by the fuzzer (fuzz_varlen): with ``precision="bfloat16"``, a large softcap
    (about 1e37 and up, still within float32's range) gave results far from the reference
    of the same rounding (off by 0.13 at 1e37, 2.7 at 1e38, for N(0, 1) inputs): the rounded
    queries carried the cap's division (scale * q / softcap, flushed to zero as a bfloat16
    subnormal), where the reference rounds scale * q and divides the float32 scores."""
    from attnx import reference

    q = np.random.default_rng(0).standard_normal((20, 2, 8)).astype(np.float32)  # (tokens, H, E)
    if entry == "sdpa":
        qh = q.transpose(1, 0, 2)
        got = attnx.scaled_dot_product_attention(qh, qh, qh, softcap=1e38, precision="bfloat16")
        expected = reference.scaled_dot_product_attention(qh, qh, qh, softcap=1e38, precision="bfloat16")
    else:
        got = attnx.varlen_attention(q, q, q, [0, 5, 20], softcap=1e38, precision="bfloat16")
        expected = reference.varlen_attention(q, q, q, [0, 5, 20], softcap=1e38, precision="bfloat16")
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)
