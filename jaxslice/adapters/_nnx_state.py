"""Reading and writing NNX state across Flax releases.

A leaf of an NNX model's state is an `nnx.Variable`, or a plain array the model holds as
an attribute (Flax keeps those in the state as they are: `nnx.state(model)` lists them,
`nnx.split`/`nnx.merge` carry them). A variable is a shared object whose value is set in
place; a plain array is replaced on the module that holds it (`assign`).
"""

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


def is_variable(leaf: Any) -> bool:
    from flax import nnx

    return isinstance(leaf, nnx.Variable)


def get_value(leaf: Any) -> Any:
    """A state leaf's value: a variable's, or the plain array itself."""
    if not is_variable(leaf):
        return leaf
    return leaf.get_value() if hasattr(leaf, "get_value") else leaf.value


def with_value(leaf: Any, value: Any) -> Any:
    """A state leaf like `leaf` holding `value` (a new variable, or `value` itself)."""
    return leaf.replace(value) if is_variable(leaf) else value


def assign(module: Any, path: tuple[Any, ...], value: Any) -> None:
    """Sets the state leaf at `path` (relative to `module`): a variable's value in place,
    a plain array on the module that holds it."""
    from flax import nnx

    nnx.update(module, state_from_flat([(path, value)]))


def set_value(variable: Any, value: Any) -> None:
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:  # pragma: no cover - older flax
        variable.value = value
