"""Type aliases of attnx's annotations.

Only type checkers import this module (under ``typing.TYPE_CHECKING``): with
``from __future__ import annotations`` the annotations are never evaluated, so
``import attnx`` neither pays for it nor needs a NumPy whose scalar types are
subscriptable.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Protocol

import numpy as np
import numpy.typing as npt

#: A floating-point array: results are in the query's (or the module's) dtype,
#: float32, float64, float16 or bfloat16.
FloatArray = npt.NDArray[np.floating[Any]]

#: A feed-forward activation of the transformer layers other than "relu" and "gelu": a function
#: of a float32 or float64 array that gives an array of the same shape.
ActivationFunction = Callable[[FloatArray], npt.ArrayLike]

#: A ``precision=`` of the entry points and modules (None is "float32").
Precision = Literal["float32", "bfloat16"]
#: A ``precision=`` of attention over a cache: also "int8" (an int8 cache's integer products).
CachePrecision = Literal["float32", "bfloat16", "int8"]

#: The int64 lengths of a KVCache.
IntArray = npt.NDArray[np.int64]


class TorchDType(Protocol):
    """A ``torch.dtype`` (``torch.float64``, ...), which attnx reads by its name."""

    @property
    def is_floating_point(self) -> bool: ...

    @property
    def itemsize(self) -> int: ...


class TorchDevice(Protocol):
    """A ``torch.device``, which attnx reads by its name (only ``"cpu"`` is accepted)."""

    @property
    def type(self) -> str: ...
