"""Hooks for attnx's own tests: not part of the API, and may change at any time."""

from ._core import _testing as _hooks

sdpa = _hooks.sdpa

__all__ = ["sdpa"]
