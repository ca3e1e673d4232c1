"""What ships: typing files, docstrings of the public API, the stub of the extension, a light import.

Run against an installed wheel (as CI does), the file checks check what the wheel installed.
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import pydoc
import re
import subprocess
import sys
import types

import pytest

import attnx
import attnx._core as core
from _hardening import under_address_sanitizer

PACKAGE = pathlib.Path(attnx.__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# Typing files
# ---------------------------------------------------------------------------------------------


def test_typing_files_ship_next_to_the_extension():
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_core.pyi").is_file()
    # The stub describes the extension that is actually imported.
    assert pathlib.Path(core.__file__).resolve().parent == PACKAGE
    assert pathlib.Path(core.__file__).name.startswith("_core.")


def _stub_functions() -> dict:
    """{name: ast.FunctionDef} of the stub's top-level functions."""
    tree = ast.parse((PACKAGE / "_core.pyi").read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _stub_attributes() -> dict:
    tree = ast.parse((PACKAGE / "_core.pyi").read_text())
    return {node.target.id: ast.unparse(node.annotation) for node in tree.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def _split_top_level(text: str) -> list:
    """Split ``a: x[b, c], d: e`` at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


# The extension's submodules: the stub describes each by a class of static methods, the type
# of the module's attribute (``_testing: _TestingModule``).
SUBMODULE_STUBS = {"_testing": "_TestingModule"}


def _stub_classes(submodules: bool = False) -> dict:
    """{name: {method name: ast.FunctionDef}} of the stub's top-level classes: those of the
    extension's classes, or with ``submodules`` those that describe its submodules."""
    tree = ast.parse((PACKAGE / "_core.pyi").read_text())
    return {node.name: {item.name: item for item in node.body if isinstance(item, ast.FunctionDef)}
            for node in tree.body if isinstance(node, ast.ClassDef)
            and (node.name in SUBMODULE_STUBS.values()) == submodules}


def _extension_signature(function) -> tuple:
    """(positional names, keyword-only names, return type) from pybind11's signature line,
    e.g. ``f(a: int, *, b: bool = False) -> bool``."""
    line = function.__doc__.splitlines()[0]
    match = re.fullmatch(rf"{function.__name__}\((.*)\) -> (.+)", line)
    assert match, f"unexpected pybind11 signature line: {line!r}"
    names = [part.split(":")[0].split("=")[0].strip() for part in _split_top_level(match.group(1))]
    keyword_only = []
    if "*" in names:
        star = names.index("*")
        names, keyword_only = names[:star], names[star + 1 :]
    return names, keyword_only, match.group(2).strip()


def _extension_functions(module=core) -> dict:
    return {name: getattr(module, name) for name in dir(module)
            if not name.startswith("__") and callable(getattr(module, name))
            and not isinstance(getattr(module, name), type)}


def _extension_classes() -> dict:
    return {name: getattr(core, name) for name in dir(core)
            if not name.startswith("__") and isinstance(getattr(core, name), type)}


# The methods of the extension's classes that the stub describes.
CLASS_METHODS = ("__init__", "__call__")


def test_stub_has_exactly_the_extensions_functions():
    assert sorted(_stub_functions()) == sorted(_extension_functions())


def test_stub_has_exactly_the_extensions_classes():
    stub = _stub_classes()
    assert sorted(stub) == sorted(_extension_classes())
    for name, cls in _extension_classes().items():
        expected = [m for m in CLASS_METHODS if m in vars(cls)]
        assert sorted(stub[name]) == sorted(expected), name


def _check_stub_signature(stub, extension_function, skip_self=False):
    names, keyword_only, returns = _extension_signature(extension_function)
    stub_names = [arg.arg for arg in stub.args.args]
    if skip_self:
        assert names[0] == "self" and stub_names[0] == "self"
        names, stub_names = names[1:], stub_names[1:]
    assert stub_names == names
    assert [arg.arg for arg in stub.args.kwonlyargs] == keyword_only
    assert not stub.args.vararg and not stub.args.kwarg
    # Plain return types must agree; pybind11 says `object` where the stub is more precise.
    stub_returns = ast.unparse(stub.returns)
    if returns in ("None", "bool", "int", "str", "float"):
        assert stub_returns == returns
    else:
        assert returns == "object" or stub_returns != "None"


@pytest.mark.parametrize(
    "name, method",
    [(name, m) for name, cls in sorted(_extension_classes().items()) for m in CLASS_METHODS
     if m in vars(cls)],
)
def test_stub_method_signature_matches_the_extension(name, method):
    _check_stub_signature(_stub_classes()[name][method],
                          getattr(_extension_classes()[name], method), skip_self=True)


@pytest.mark.parametrize("name", sorted(_extension_functions()))
def test_stub_signature_matches_the_extension(name):
    _check_stub_signature(_stub_functions()[name], _extension_functions()[name])


def test_stub_attributes_exist():
    attributes = _stub_attributes()
    assert attributes == {"__version__": "str", **SUBMODULE_STUBS}
    assert isinstance(core.__version__, str) and core.__version__ == attnx.__version__


def test_stub_has_exactly_the_extensions_submodules():
    submodules = [name for name in dir(core) if isinstance(getattr(core, name), types.ModuleType)]
    assert sorted(submodules) == sorted(SUBMODULE_STUBS)
    stubs = _stub_classes(submodules=True)
    for name, stub_class in SUBMODULE_STUBS.items():
        module = getattr(core, name)
        assert module.__name__ == f"attnx._core.{name}"
        assert sorted(stubs[stub_class]) == sorted(_extension_functions(module)), name
        assert all(any(ast.unparse(d) == "staticmethod" for d in f.decorator_list)
                   for f in stubs[stub_class].values()), name


@pytest.mark.parametrize(
    "submodule, name",
    [(sub, name) for sub in sorted(SUBMODULE_STUBS)
     for name in sorted(_extension_functions(getattr(core, sub)))],
)
def test_stub_submodule_signature_matches_the_extension(submodule, name):
    stub = _stub_classes(submodules=True)[SUBMODULE_STUBS[submodule]][name]
    _check_stub_signature(stub, getattr(getattr(core, submodule), name))


def test_testing_hooks_are_apart_and_reexported():
    # The hooks only the tests use live in attnx._core._testing, not among the extension's
    # functions, and attnx._testing re-exports each of them.
    from attnx import _testing

    hooks = _extension_functions(core._testing)
    assert hooks and not set(hooks) & set(_extension_functions())
    assert sorted(_testing.__all__) == sorted(hooks)
    for name, hook in hooks.items():
        assert getattr(_testing, name) is hook, name


# ---------------------------------------------------------------------------------------------
# Docstrings (NumPy style)
# ---------------------------------------------------------------------------------------------


def _sections(doc: str) -> dict:
    """{section title: body} of a NumPy-style docstring."""
    parts = re.split(r"^([A-Z][A-Za-z ]*)\n-{3,}[ \t]*$", doc, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _entries(section: str) -> set:
    """The names a Parameters section documents (``a, b : type`` lines at the margin)."""
    names = set()
    for line in section.splitlines():
        match = re.match(r"^(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?::|$)", line)
        if match:
            names.update(name.strip().lstrip("*") for name in match.group(1).split(","))
    return names


def _public_callables():
    """(qualified name, object, needs Returns) of every public function and method."""
    import attnx.reference as reference

    found = []
    for module, names in ((attnx, attnx.__all__), (reference, reference.__all__)):
        for name in names:
            obj = getattr(module, name)
            qualified = f"{module.__name__}.{name}"
            if inspect.ismodule(obj):
                continue
            found.append((qualified, obj))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") or attr == "__call__":
                        member = getattr(obj, attr)
                        if callable(member):
                            found.append((f"{qualified}.{attr}", member))
    return found


PUBLIC = _public_callables()


def test_every_public_name_has_a_docstring():
    for name in attnx.__all__:
        doc = inspect.getdoc(getattr(attnx, name))
        assert doc and len(doc.splitlines()[0]) > 10, name
    assert inspect.getdoc(attnx) and "scaled_dot_product_attention" in inspect.getdoc(attnx)


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_numpy_docstring_sections(name, obj):
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    sections = _sections(doc)
    parameters = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
    if parameters:
        assert "Parameters" in sections, f"{name}: no Parameters section"
        documented = _entries(sections["Parameters"])
        for parameter in parameters:
            # An entry of its own, or named in another entry (``q_proj_weight`` under
            # ``use_separate_proj_weight``).
            assert parameter in documented or f"``{parameter}``" in sections["Parameters"], (
                f"{name}: parameter {parameter!r} is not documented"
            )
        assert not documented - set(parameters), f"{name}: documents unknown {documented - set(parameters)}"
    if inspect.isclass(obj):
        return
    returns = inspect.signature(obj).return_annotation
    if returns not in (None, "None"):
        assert "Returns" in sections or "Yields" in sections, f"{name}: no Returns section"


def test_help_of_sdpa_is_useful():
    text = pydoc.render_doc(attnx.scaled_dot_product_attention, renderer=pydoc.plaintext)
    # The signature with its annotations and defaults, then the documentation of each argument
    # and the result. The annotations are strings (`from __future__ import annotations`).
    assert "is_causal: \"bool | Literal['top_left', 'bottom_right']\" = False" in text
    names = re.sub(r""": (?:'[^']*'|"[^"]*")( = )?""", lambda m: "=" if m.group(1) else "", text)
    assert "scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False" in names
    for word in ("Parameters", "Returns", "attn_mask", "dropout_p", "is_causal", "enable_gqa", "scale", "softcap",
                 "return_scores", "out"):
        assert word in text, word


# ---------------------------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------------------------


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())


def test_import_is_lazy_and_never_imports_torch():
    code = (
        "import sys, attnx\n"
        "print('attnx.reference' in sys.modules, 'torch' in sys.modules)\n"
        "from attnx import reference\n"
        "import attnx.reference as r2\n"
        "print(reference is attnx.reference is r2, 'reference' in dir(attnx))\n"
        "print(callable(attnx.reference.scaled_dot_product_attention))\n"
        "try:\n"
        "    attnx.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "False False", "True True", "True", "module 'attnx' has no attribute 'no_such_name'",
    ]


def test_star_import_gives_the_public_names():
    proc = _python("from attnx import *\nprint(sorted(k for k in dir() if not k.startswith('_')))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(sorted(attnx.__all__))


def _cumulative_us(importtime: str, module: str) -> int:
    for line in importtime.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 3 and fields[2] == module:
            return int(fields[1])
    raise AssertionError(f"{module} not in -X importtime output")


@pytest.mark.skipif(under_address_sanitizer(),
                    reason="an instrumented extension loads slower: the shipped build's import time is what counts")
def test_attnx_adds_little_to_numpys_import_time():
    # attnx's own part of `import attnx` (its modules and the extension, numpy excluded) is a
    # few milliseconds; 50 ms leaves room for a slow or busy machine. The best of three runs.
    own = []
    for _ in range(3):
        proc = _python("import attnx", "-X", "importtime")
        assert proc.returncode == 0, proc.stderr
        own.append(_cumulative_us(proc.stderr, "attnx") - _cumulative_us(proc.stderr, "numpy"))
    assert min(own) < 50_000, own


# ---------------------------------------------------------------------------------------------
# The test tools
# ---------------------------------------------------------------------------------------------


def _pyproject_list(section, key):
    """The list ``key = [...]`` of ``[section]`` in the checkout's pyproject.toml, written on one
    line (read as a Python literal, so that Python 3.9 and 3.10, without tomllib, check it too)."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text("utf-8")
    body = re.search(rf"^\[{re.escape(section)}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert body, f"pyproject.toml has no [{section}]"
    line = re.search(rf"^{re.escape(key)} = (\[.*\])$", body.group(1), re.M)
    assert line, f"[{section}] of pyproject.toml has no one-line {key} = [...]"
    return ast.literal_eval(line.group(1))


def test_test_group_and_test_extra_list_the_same_tools():
    # The README installs the test tools with `pip install -r requirements-test.txt` (any pip);
    # the wheel's users and .ci/ship get them from the `test` extra, and tools that read
    # dependency groups from the `test` group. The three must not drift apart.
    group = _pyproject_list("dependency-groups", "test")
    extra = _pyproject_list("project.optional-dependencies", "test")
    lines = (pathlib.Path(__file__).resolve().parents[1] / "requirements-test.txt").read_text("utf-8").splitlines()
    requirements = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert group == extra == requirements and "pytest>=7" in group, (group, extra, requirements)


def test_version_is_pyprojects():
    # pip builds pass the version to CMake; a plain `cmake -S .` build reads it from
    # pyproject.toml (CMakeLists.txt). Either way the extension reports the project's version.
    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text("utf-8")
    version = re.search(r'^version = "([^"]+)"$', text, re.M).group(1)
    assert attnx.__version__ == version == attnx.show_config()["version"], (attnx.__version__, version)


def test_metadata_names_the_project_urls_and_the_changelog_has_this_version():
    # The installed distribution's metadata carries the URLs (what PyPI shows beside the
    # package), and the changelog has a section for the version being built.
    from importlib.metadata import metadata

    urls = dict(entry.split(", ", 1) for entry in metadata("attnx").get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls), urls
    assert all(url.startswith("https://") for url in urls.values()), urls
    changelog = (pathlib.Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text("utf-8")
    assert re.search(rf"^## \[{re.escape(attnx.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M), (
        f"CHANGELOG.md has no section for {attnx.__version__}")
    assert "## [Unreleased]" in changelog


def test_isa_code_is_included_only_where_its_flags_apply():
    # The kernels of csrc/kernels/simd/ (the kernel parts and the vector types) are compiled
    # with one instruction set's flags: included from a driver or a binding, built for plain
    # x86-64, they would put AVX2 or AVX-512 instructions on a path that runs on every CPU, or
    # let the linker keep one ISA's copy of a function for all. Only the one translation unit
    # per ISA includes them (or the simd headers one another), and it includes its own vector
    # type alone.
    csrc = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    own_vector_type = {"avx2": "vec_avx2.h", "avx512": "vec_avx512.h", "avx512_bf16": "vec_avx512.h",
                       "scalar": "vec_portable.h"}
    sources = [p for p in csrc.rglob("*") if p.suffix in (".h", ".cpp")]
    assert len(sources) > 20, f"no sources found under {csrc}"
    units = {}
    for path in sources:
        rel = path.relative_to(csrc).as_posix()
        included = re.findall(r'^#include "kernels/simd/([^"]+)"', path.read_text("utf-8"), re.M)
        if not included or rel.startswith("kernels/simd/"):
            continue
        unit = re.fullmatch(r"kernels/(\w+)/kernels__\1\.cpp", rel)
        assert unit and unit.group(1) in own_vector_type, f"{rel} includes ISA code {included}"
        vector_types = [name for name in included if name.startswith("vec_")]
        assert vector_types == [own_vector_type[unit.group(1)]], (rel, vector_types)
        units[unit.group(1)] = included
    assert sorted(units) == sorted(own_vector_type), units
