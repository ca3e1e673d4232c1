"""attnx: fast, PyTorch-compatible multi-head attention for NumPy on the CPU."""

try:
    from . import _core
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "attnx's compiled core (attnx._core) could not be imported. Did you build it? "
        "Install attnx with `pip install .` from a checkout (a C++17 compiler is needed), "
        "and do not run Python from inside the source tree's python/ folder."
    ) from exc

from . import reference
from ._runtime import _select_isa_from_environment, get_num_threads, set_num_threads, show_config
from .functional import multi_head_attention_forward, scaled_dot_product_attention
from .modules import MultiheadAttention

_select_isa_from_environment()

__version__ = _core.__version__

__all__ = [
    "MultiheadAttention",
    "get_num_threads",
    "multi_head_attention_forward",
    "reference",
    "scaled_dot_product_attention",
    "set_num_threads",
    "show_config",
]
