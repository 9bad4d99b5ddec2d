"""The contract every model-kind adapter fulfils."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass
class Split:
    """A target's call arguments, sorted by role."""

    variables: Any  # parameters and state (a pytree)
    rngs: Any  # random keys (a pytree, often None)
    args: tuple[Any, ...]  # positional model inputs
    kwargs: dict[str, Any]  # keyword model inputs that hold arrays
    mode: dict[str, Any]  # keyword arguments without arrays: they select a mode
    mutable: Any = False  # collections the call may update (linen's `mutable`)


class Adapter:
    """How one kind of model is split, called and marked."""

    kind: str = ""
    #: whether `jax.named_scope` regions count as boundaries
    name_scopes: bool = False

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        raise NotImplementedError

    def call(
        self,
        target: Any,
        variables: Any,
        rngs: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        mutable: Any,
    ) -> tuple[Any, Any]:
        """Runs the model with its module calls marked (marking is already switched on).

        Returns ``(output, updated_state)``; the state is None unless `mutable` is set.
        """
        raise NotImplementedError

    def accepted_keywords(self, target: Any) -> set[str] | None:
        """Keyword arguments the model accepts, or None if it takes any."""
        return None

    def flatten_variables(
        self, variables: Any
    ) -> tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any]]:
        """``[(path, leaf)]`` of the variables, and a function rebuilding them from leaves."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
        return flat, lambda leaves: jax.tree_util.tree_unflatten(treedef, leaves)

    def flatten_state(self, state: Any) -> list[tuple[Any, Any]]:
        """``[(path, leaf)]`` of the updated state returned by `call`."""
        return jax.tree_util.tree_flatten_with_path(state)[0]

    def resplit(self, target: Any, split: Split) -> Split:
        """A split that reflects the target's current structure (for re-tracing)."""
        return split

    def structure_key(self, target: Any) -> Any:
        """A hashable key of what, besides arguments, decides the traced program."""
        return None

    #: where a state entry's module path starts in its path (after the collection name)
    state_owner_offset: int = 1

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        """Parameter count per module path (`/`-joined), including submodules."""
        return {}

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        """Paths of modules that hold parameters themselves, or None if unknown."""
        return None


def keywords_of(fn: Any) -> set[str] | None:
    """The keyword parameter names of `fn`, or None when it takes ``**kwargs``."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return names


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separates keyword inputs holding arrays from mode keywords (flags, strings)."""
    from .._markers import is_array

    inputs, mode = {}, {}
    for k, v in kwargs.items():
        if any(
            is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
            for leaf in jax.tree_util.tree_leaves(v)
        ):
            inputs[k] = v
        else:
            mode[k] = v
    return inputs, mode


def count_by_prefix(flat: dict[tuple[str, ...], int]) -> dict[str, int]:
    """Sums leaf sizes keyed by path into every prefix of that path."""
    counts: dict[str, int] = {}
    for path, size in flat.items():
        for k in range(len(path) + 1):
            key = "/".join(path[:k])
            counts[key] = counts.get(key, 0) + size
    return counts
