"""One adapter per model kind; see `_base.Adapter` for the questions each answers.

Adapters import their model library only when a target of that kind is passed, so
``import jaxslice`` imports no model library beyond what jaxslice itself needs.
"""

from __future__ import annotations

from typing import Any

from .._errors import UnsupportedTargetError
from ._base import Adapter, Split
from ._equinox import EquinoxAdapter
from ._haiku import HaikuAdapter
from ._keras import KerasAdapter
from ._linen import LinenAdapter
from ._nnx import NNXAdapter
from ._plain import PlainAdapter
from ._sliced_target import SlicedAdapter

# Tried in order: each kind's `accepts` looks at the target without importing libraries
# the user has not imported; a plain function is the last resort. A `js.Sliced` (and a
# view that runs one: a Keras or Haiku slice) comes first, before the Keras model a
# Keras slice also is.
_KINDS = (
    SlicedAdapter,
    LinenAdapter,
    NNXAdapter,
    EquinoxAdapter,
    HaikuAdapter,
    KerasAdapter,
    PlainAdapter,
)


def adapter_for(target: Any) -> Adapter:
    """The adapter that knows how to trace `target`."""
    for kind in _KINDS:
        if kind.accepts(target):
            return kind.for_target(target)
    raise UnsupportedTargetError(kind=type(target).__name__)


__all__ = ["Adapter", "Split", "adapter_for"]
