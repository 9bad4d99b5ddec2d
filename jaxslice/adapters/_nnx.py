"""Flax NNX models: recognised so they are never mistaken for plain functions."""

from __future__ import annotations

from typing import Any

from .._errors import UnsupportedTargetError


def is_nnx(target: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover
        return False
    return isinstance(target, nnx.Module)


class NNXAdapter:
    """Placeholder that refuses NNX models with a clear message until they are supported."""

    def __init__(self) -> None:
        raise UnsupportedTargetError(
            "Flax NNX modules are not supported by this version of jaxslice yet. "
            "Slice the equivalent linen model, or a plain function `fn(state, x)` built with "
            "`nnx.split`/`nnx.merge` and `js.mark`."
        )
