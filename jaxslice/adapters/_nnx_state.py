"""Reading and writing NNX variables across Flax releases."""

from __future__ import annotations

from typing import Any


def flat_state(state: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``[(path, variable)]`` of an `nnx.State` (`nnx.to_flat_state` since flax 0.11)."""
    from flax import nnx

    if hasattr(nnx, "to_flat_state"):
        return [(tuple(p), v) for p, v in nnx.to_flat_state(state)]
    return [(tuple(p), v) for p, v in state.flat_state()]  # pragma: no cover - older flax


def state_from_flat(pairs: list[tuple[tuple[Any, ...], Any]]) -> Any:
    from flax import nnx

    if hasattr(nnx, "from_flat_state"):
        return nnx.from_flat_state(pairs)
    return nnx.State.from_flat_path(pairs)  # pragma: no cover - older flax


def get_value(variable: Any) -> Any:
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def set_value(variable: Any, value: Any) -> None:
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:  # pragma: no cover - older flax
        variable.value = value
