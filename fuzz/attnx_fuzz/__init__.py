"""The fuzz target's modules (fuzz/fuzz_attnx.py runs them): ``common``, what every entry
point's fuzzer shares, and one module per entry point, each with a ``fuzz_<name>(p)`` that
turns the decisions of a ``common.Provider`` into calls and judges their outcomes.

attnx is imported here, before any of the modules imports it: under ``--engine atheris``
(which sets ATTNX_FUZZ_ATHERIS_INSTRUMENT) it must be imported instrumented, for atheris'
coverage feedback, and a package's ``__init__`` runs before any of its modules.
"""

import os

if os.environ.get("ATTNX_FUZZ_ATHERIS_INSTRUMENT"):  # set by --engine atheris
    import atheris

    with atheris.instrument_imports(include=["attnx"]):
        import attnx  # noqa: F401 - imported for its instrumentation; the modules import it again
