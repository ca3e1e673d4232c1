"""The examples in attnx's docstrings run, and print what they show.

doctest runs each module of the installed package (``import attnx.X``) with ELLIPSIS and
NORMALIZE_WHITESPACE. Examples print shapes, dtypes, exact values or comparisons, never
floating-point noise, and seed their random numbers. The examples of a docstring that
imports torch run where torch is installed (it is optional), and are skipped elsewhere.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import io
import re

import pytest

MODULES = [
    "attnx",
    "attnx.__main__",
    "attnx._runtime",
    "attnx.cache",
    "attnx.functional",
    "attnx.modules",
    "attnx.reference",
    "attnx.rotary",
    "attnx.transformer",
    "attnx._transformer_layers",
    "attnx._layer_parts",
]

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _docstring_tests(name: str) -> list:
    """The module's doctests that have examples, each docstring one test."""
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder().find(module, name)
    return sorted((t for t in tests if t.examples), key=lambda t: t.name)


def _needs_torch(test: doctest.DocTest) -> bool:
    return any(re.search(r"^\s*import\b.*\btorch\b", example.source) for example in test.examples)


def _run(test: doctest.DocTest) -> tuple:
    """(failed, attempted, report) of one docstring's examples."""
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failed, attempted = runner.run(test, out=out.write, clear_globs=True)
    return failed, attempted, out.getvalue()


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    ran = 0
    failures = []
    for test in _docstring_tests(name):
        if _needs_torch(test) and not _have_torch():
            continue
        failed, attempted, report = _run(test)
        ran += attempted
        if failed:
            failures.append(report)
    assert not failures, "\n".join(failures)
    assert ran > 0, f"{name} has no examples"


def test_every_example_runs():
    # No example is kept from running by a SKIP directive, and the examples are all found.
    count = 0
    for name in MODULES:
        for test in _docstring_tests(name):
            for example in test.examples:
                assert not example.options.get(doctest.SKIP), f"{test.name}: {example.source}"
                count += 1
    assert count >= 100, count


def test_every_public_function_and_class_has_an_example():
    import attnx
    import attnx.reference as reference

    for module in (attnx, reference):
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.ismodule(obj):
                assert ">>> " in (obj.__doc__ or ""), f"{module.__name__}.{name} has no example"
