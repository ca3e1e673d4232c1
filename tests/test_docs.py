"""The documentation's code runs as written.

Every ```python block of README.md and docs/*.md runs here: the blocks of one file in order, in
one namespace (a later block uses the names of the blocks before it), with the working directory
a fresh temporary one (files a block writes land there). A block that imports an optional
package (torch, safetensors, dask) is skipped when that package is not installed, and only then;
nothing later in its file may depend on it. ```bash blocks are shown, not run.

A failure names the file and the line of the failing statement in it.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import traceback

import pytest

import attnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

# Packages a block may need that the test tools do not install. A block importing one of these
# runs when it is installed and is skipped (and reported) when it is not.
OPTIONAL = {"torch", "safetensors", "dask", "distributed"}

FENCE = re.compile(r"^```(\S*)\s*$")


def fenced_blocks(path: pathlib.Path) -> list:
    """[(language, first line number of the code, code)] of the file's fenced blocks."""
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1):
        match = FENCE.match(line)
        if language is None and match:
            language, start, lines = match.group(1), number + 1, []
        elif language is not None and line.strip() == "```":
            blocks.append((language, start, "\n".join(lines) + "\n"))
            language = None
        elif language is not None:
            lines.append(line)
    assert language is None, f"{path.name}: a fence opened at line {start - 1} is never closed"
    return blocks


def imported_packages(code: str) -> set:
    """The top-level names of the packages a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def missing_optional(code: str) -> list:
    return sorted(name for name in imported_packages(code) & OPTIONAL
                  if importlib.util.find_spec(name) is None)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
# dask.distributed's own shutdown chatter (serving.md starts a LocalCluster), not attnx's.
@pytest.mark.filterwarnings("ignore:.*unclosed.*:ResourceWarning")
def test_python_blocks_run_in_order(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # As a script: blocks guarded by `if __name__ == "__main__":` run too.
    namespace = {"__name__": "__main__"}
    skipped = []
    threads = attnx.get_num_threads()   # a block may set the process's count; restored below
    try:
        run_blocks(path, namespace, skipped)
    finally:
        attnx.set_num_threads(threads)
    if skipped:
        pytest.skip("; ".join(skipped) + " (not installed)")


def run_blocks(path, namespace, skipped):
    for language, line, code in fenced_blocks(path):
        if language != "python":
            continue
        missing = missing_optional(code)
        if missing:
            skipped.append(f"{path.name}:{line} needs {', '.join(missing)}")
            continue
        # Padded with blank lines, so that tracebacks give the line numbers of the file itself.
        compiled = compile("\n" * (line - 1) + code, str(path), "exec")
        try:
            exec(compiled, namespace)
        except Exception:
            pytest.fail(f"the block at {path.name}:{line} failed:\n{traceback.format_exc()}", pytrace=False)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_names_its_language(path):
    # python blocks run; bash and text blocks are shown only. An unnamed fence would be neither.
    for language, line, _ in fenced_blocks(path):
        assert language in {"python", "bash", "text"}, f"{path.name}:{line - 1}: fence {language!r}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_files(path):
    text = path.read_text("utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name}: link to {target} reaches nothing"


README = ROOT / "README.md"


def test_readme_is_short():
    assert len(README.read_text("utf-8").splitlines()) <= 250


def test_readme_set_up_commands_are_those_ci_runs():
    # .ci/run runs these two commands as they are written here.
    text = README.read_text("utf-8")
    assert "pip install . && python -m attnx" in text
    assert "pip install -r requirements-test.txt && python -m pytest" in text


def test_readme_lists_the_deviations_from_torch():
    text = README.read_text("utf-8")
    section = text[text.index("## Deviations from PyTorch"):]
    section = section[: section.index("\n## ", 1)]
    for phrase in ("all masked gives a **zero**", "is_causal=True", "dropout_p", "batch_first=",
                   "float16 and bfloat16", "bottom_right", "subnormal"):
        assert phrase in section, phrase


@pytest.mark.parametrize("page", ["README.md", "docs/api.md"])
def test_every_public_name_is_documented(page):
    text = (ROOT / page).read_text("utf-8")
    missing = [name for name in attnx.__all__ if f"{name}" not in text]
    assert not missing, f"{page} does not mention {missing}"
    for method in ("step", "new_cache", "from_torch", "load_state_dict", "state_dict",
                   "append", "reset", "lengths"):
        assert f"{method}(" in text or f"`{method}`" in text, f"{page}: {method}"
