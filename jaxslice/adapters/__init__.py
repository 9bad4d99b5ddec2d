"""One adapter per model kind: how a target is split into (variables, inputs, mode), how
it is called while tracing, and how its module calls are marked.

Adapters import their model library lazily, so jaxslice imports without Flax installed.
"""

from __future__ import annotations

from typing import Any

from .._errors import UnsupportedTargetError
from ._base import Adapter


def adapter_for(target: Any) -> Adapter:
    """The adapter that knows how to trace `target`."""
    from . import _linen, _plain

    if _linen.is_linen(target):
        return _linen.LinenAdapter()
    from . import _nnx

    if _nnx.is_nnx(target):
        return _nnx.NNXAdapter()
    if callable(target):
        adapter = _plain.PlainAdapter()
        adapter.name_scopes = getattr(target, "_jaxslice_name_scopes", True)
        return adapter
    raise UnsupportedTargetError(UnsupportedTargetError.TEMPLATE.format(kind=type(target).__name__))


__all__ = ["Adapter", "adapter_for"]
