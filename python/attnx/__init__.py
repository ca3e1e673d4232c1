"""attnx: fast, PyTorch-compatible multi-head attention for NumPy on the CPU.

Functions
---------
scaled_dot_product_attention
    ``torch.nn.functional.scaled_dot_product_attention`` for NumPy arrays.
multi_head_attention_forward
    ``torch.nn.functional.multi_head_attention_forward`` for NumPy arrays.
MultiheadAttention
    ``torch.nn.MultiheadAttention`` (inference) with torch's parameter names
    and state_dict keys; ``step`` decodes with a KV cache.
Transformer, TransformerEncoder, TransformerDecoder, TransformerEncoderLayer, TransformerDecoderLayer
    ``torch.nn.Transformer`` and its stacks and layers (inference), with torch's
    parameter names and state_dict keys (module :mod:`attnx.transformer`).
KVCache
    Preallocated keys and values of a batch of sequences, for decoding.
cached_attention, multi_head_attention_step
    Attention of the newest tokens over a KVCache; one decoding step of
    multi-head self-attention.
varlen_attention
    Attention of sequences packed end to end (ragged batches, no padding).
PagedKVCache, paged_attention, CacheFullError
    Many sequences in one pool of cache blocks; one step of continuous batching over it.
RotaryEmbedding
    Rotary position embeddings with Hugging Face transformers' conventions
    (``cached_attention(..., rope=)`` and ``paged_attention(..., rope=)`` apply one).
set_num_threads, get_num_threads, show_config
    Threads, the SIMD kernel in use, and how this attnx was built.
reference
    The plain-NumPy oracle the tests check against (imported on first use).

Examples
--------
>>> import numpy as np, attnx
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 2, 8, 10, 64), dtype=np.float32)  # (batch, heads, L, E)
>>> out = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
>>> out.shape, out.dtype
((2, 8, 10, 64), dtype('float32'))
>>> expected = attnx.reference.scaled_dot_product_attention(q.astype(np.float64), k, v, is_causal=True)
>>> bool(np.allclose(out, expected, atol=1e-5))
True
"""

try:
    from . import _core
except ImportError as _error:
    # The core chooses its SIMD kernel as it loads (from CPUID and ATTNX_ISA), and fails to
    # load where ATTNX_ISA asks for a kernel it cannot run: its ValueError says why.
    if isinstance(_error.__cause__, ValueError):
        raise _error.__cause__ from None
    raise ImportError(  # pragma: no cover - depends on the installation
        "attnx's compiled core (attnx._core) could not be imported. Did you build it? "
        "Install attnx with `pip install .` from a checkout (a C++17 compiler is needed), "
        "and do not run Python from inside the source tree's python/ folder."
    ) from _error

from ._runtime import get_num_threads, set_num_threads, show_config
from .cache import KVCache, TransformerDecoderCache
from .functional import (
    cached_attention,
    multi_head_attention_forward,
    multi_head_attention_step,
    scaled_dot_product_attention,
)
from .modules import MultiheadAttention
from .ragged import varlen_attention
from .transformer import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

# After NumPy (imported above), which imports typing itself: `import attnx` stays as short.
from typing import TYPE_CHECKING  # noqa: E402

__version__: str = _core.__version__

__all__ = [
    "CacheFullError",
    "KVCache",
    "MultiheadAttention",
    "PagedKVCache",
    "RotaryEmbedding",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderCache",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "cached_attention",
    "get_num_threads",
    "multi_head_attention_forward",
    "multi_head_attention_step",
    "paged_attention",
    "reference",
    "scaled_dot_product_attention",
    "set_num_threads",
    "show_config",
    "varlen_attention",
]

# Submodules, and the names of the serving modules, imported on first use rather
# than with attnx (keeps `import attnx` short): `attnx.reference.X`,
# `from attnx import reference`, `import attnx.reference` and
# `attnx.PagedKVCache` all work.
_LAZY_SUBMODULES = ("reference",)
_LAZY_NAMES = {
    "CacheFullError": "paged",
    "PagedKVCache": "paged",
    "paged_attention": "paged",
    "RotaryEmbedding": "rotary",
}

if TYPE_CHECKING:
    # Type checkers see them as plain attributes (and no catch-all __getattr__, so that a
    # misspelt name is an error).
    from types import ModuleType

    from . import reference
    from .paged import CacheFullError, PagedKVCache, paged_attention
    from .rotary import RotaryEmbedding
else:

    def __getattr__(name: str) -> "ModuleType":
        import importlib

        if name in _LAZY_SUBMODULES:
            # Importing the submodule also binds it as an attribute of this package,
            # so this runs once per name.
            return importlib.import_module(f"{__name__}.{name}")
        if name in _LAZY_NAMES:
            value = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
            globals()[name] = value  # once per name
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES) | set(_LAZY_NAMES))
