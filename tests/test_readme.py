"""The README's quickstart runs as written and does what its comments say."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def quickstart_code() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_runs_and_shapes_match_its_comments():
    namespace: dict = {}
    exec(compile(quickstart_code(), "README quickstart", "exec"), namespace)
    assert namespace["out"].shape == (2, 8, 128, 64)
    assert namespace["y"].shape == (4, 100, 768)
    assert namespace["weights"].shape == (4, 100, 100)
    # Padded keys get no weight.
    weights, padding = namespace["weights"], namespace["padding"]
    assert np.all(weights[padding[:, None, :].repeat(100, axis=1)] == 0)
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-5)


def test_decoding_section_runs_and_shapes_match_its_comments():
    text = README.read_text()
    section = text[text.index("## Decoding with a KV cache") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README decoding", "exec"), namespace)
    assert namespace["y"].shape == (2, 1, 256) and namespace["y"].dtype == np.float32
    assert namespace["cache"].lengths.tolist() == [15, 0]
    assert namespace["kv"].lengths.tolist() == [4, 4]
    assert namespace["out"].shape == (2, 8, 1, 64)


def test_sections_users_look_up_are_all_there_in_order():
    headings = re.findall(r"^## (.+)$", README.read_text(), re.M)
    expected = [
        "Set-up", "Quickstart", "API in brief", "Decoding with a KV cache",
        "Deviations from PyTorch", "Benchmarks", "Threads", "Serving a PyTorch model",
        "Building wheels", "Layout",
    ]
    found = [next((h for h in headings if h.startswith(e)), None) for e in expected]
    assert None not in found, f"missing: {[e for e, f in zip(expected, found) if f is None]}"
    assert [headings.index(f) for f in found] == sorted(headings.index(f) for f in found)


def test_deviations_from_pytorch_list_the_api_contracts_deviations():
    text = README.read_text()
    section = text[text.index("## Deviations from PyTorch") : text.index("## Benchmarks")]
    for phrase in ("all masked gives a **zero**", "is_causal=True", "dropout_p", "batch_first=",
                   "float16 and bfloat16", "bottom_right"):
        assert phrase in section, phrase
