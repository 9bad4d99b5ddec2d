"""The contract every model-kind adapter fulfils.

An adapter answers every question whose answer depends on the kind of model: how a
target is split into (variables, rngs, inputs, mode), how it is called while traced, how
its variables are read and written, who owns a state entry, whether a trace may stop
early, and what a slice of it is returned as. Nothing outside `adapters/` asks which
kind a target is.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._core.contract import Split
from .._trees import is_traced_leaf, join_name, path_names
from .._view import program_of


@dataclasses.dataclass(frozen=True)
class NewModule:
    """A module of a model's library inserted by an edit (see `Adapter.edit_node`).

    Attributes:
      fn: ``fn(variables, *args)`` calls the module purely with those variables.
      variables: the variables the module holds (NNX, Equinox modules), or None.
      init: ``init(key) -> variables`` for a module initialised on the values it receives
        (linen, Haiku), or None. The editor calls it once per iteration (each with its own
        key) where the module is inserted in every iteration of a loop.
      structure: ``structure()`` is what else decides the call (an NNX module's graph
        definition: its mode), or None.
    """

    fn: Callable[..., Any]
    variables: Any = None
    init: Callable[[Any], Any] | None = None
    structure: Callable[[], Any] | None = None


class Adapter:
    """How one kind of model is split, called and marked (defaults: a plain function)."""

    #: whether `jax.named_scope` regions count as boundaries
    name_scopes: bool = False
    #: whether the returned state lists unchanged variables too (so those are no updates)
    state_includes_variables: bool = False
    #: whether calls take linen's `rngs=` and `mutable=`
    has_collections: bool = False
    #: whether the model's call returns its state in every mode (Haiku's `apply`), so
    #: asking for state that a slice does not update gives none instead of an error
    always_returns_state: bool = False
    #: whether the model holds its variables (read with `live_variables`, not passed)
    holds_variables: bool = False
    #: whether the model holds the values of the variables it is traced with, and so the
    #: state a call updates (Keras's moving statistics and seed states), as NNX's does
    holds_values: bool = False
    #: whether an edit's new modules keep their variables apart from the model's
    #: (``{"model": ..., "nodes": ...}``), as modules that hold their own do
    separate_nodes: bool = False
    #: whether a complete trace may be reused for a model of the same `structure_key`
    #: (or, without one, the same target) at the same signature
    caches_traces: bool = True

    #: ``(module, class)`` of the models this adapter takes, or None for any callable
    model_class: tuple[str, str] | None = None

    @classmethod
    def accepts(cls, target: Any) -> bool:
        """Whether `target` is this kind of model. The model library is not imported: a
        target of its class exists only if the user imported it."""
        if cls.model_class is None:
            return callable(target)
        module = sys.modules.get(cls.model_class[0])
        return module is not None and isinstance(target, getattr(module, cls.model_class[1]))

    @classmethod
    def for_target(cls, target: Any) -> Adapter:
        """The adapter for `target`, one it `accepts`."""
        return cls()

    def program_of(self, target: Any) -> Any:
        """The `SliceProgram` that a slice or an edited model passed as a target runs (its
        calls are marked again while it is traced), or None for a model."""
        return program_of(target)

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        raise NotImplementedError

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        """Runs the model with its module calls marked (marking is already switched on).

        `call` holds the traced values: variables, rngs, inputs, and in `kwargs` the
        keyword inputs and the mode; `mutable` as the trace asks for it.
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

    def skeleton(self, target: Any) -> Any:
        """What a trace keeps of the target to call it again with traced variables: the
        target without its arrays, for a kind whose model is a pytree of them."""
        return target

    def resplit(self, target: Any, split: Split) -> Split:
        """A split that reflects the target's current structure (for re-tracing)."""
        return split

    def structure_key(self, target: Any) -> Any:
        """A hashable key of what, besides arguments, decides the traced program."""
        return None

    def can_stop_early(self, split: Split) -> bool:
        """Whether a trace may end once a slice's ends have returned."""
        return False

    def wider_mutable(self, split: Split, error: BaseException | None) -> Any:
        """Collections to trace as mutable after `error`, or None to report the error."""
        return None

    def error_hint(self, error: BaseException) -> str:
        """Advice to add to a `ModelTraceError` caused by `error`."""
        return ""

    def state_owner(self, path: tuple[Any, ...]) -> tuple[str, ...]:
        """The module path a state entry belongs to (it starts the entry's path)."""
        return path_names(path)

    def live_variables(self, target: Any) -> dict[tuple[Any, ...], Any] | None:
        """``{path: value}`` read from a model that holds its variables, else None."""
        return None

    def flat_values(self, variables: Any) -> dict[tuple[Any, ...], Any]:
        """``{path: leaf}`` of variables given in this kind's form (as `split` makes them)."""
        return dict(jax.tree_util.tree_flatten_with_path(variables)[0])

    def write_back(self, target: Any, state: list[tuple[Any, Any]]) -> None:
        """Stores updated ``(path, value)`` state in a model that holds its variables."""

    def model_variables(self, value: Any) -> Any:
        """The variables of `value` as `split` makes them, when it is a model of this kind
        that `merge` writes into in place (`assign`); None for anything else."""
        return None

    def assign(self, model: Any, variables: Any) -> None:
        """Writes `variables` (as `model_variables` gives them) into `model`."""
        raise NotImplementedError

    def variables_view(self, target: Any, variables: Any) -> Callable[[], Any] | None:
        """For a kind whose model holds variable objects that its slices share (Keras):
        a function returning `variables` (a slice's part, as `split` makes them) with the
        values `target` holds when it is called; None where a slice keeps its values."""
        return None

    def slice_view(self, target: Any, program: Any) -> Any:
        """What `js.slice` returns for this kind, or None for a `js.Sliced`."""
        return None

    def sliced_view(self, target: Any, sliced: Any) -> Any:
        """What `js.slice` returns for this kind as a view over the program's `js.Sliced`
        (the library's own calling conventions over the same engine), or None for that
        `js.Sliced`. Asked only where `slice_view` gives None."""
        return None

    def edit_node(self, obj: Any, name: str, args: tuple[Any, ...]) -> NewModule | None:
        """A module of this kind's library as an edit's new node named `name`, which
        receives values like `args` (one iteration's); None when `obj` is no such module
        (a plain function, say)."""
        return None

    def node_name(self, obj: Any) -> str | None:
        """The name `obj`, a module of this kind's library inserted by an edit without a
        ``name``, has in its library (a Keras layer's), or None; the node takes it where
        it is free."""
        return None

    def edited_view(self, target: Any, edited: Any) -> Any:
        """What `Editor.build` returns for this kind (`edited` is the edited model's
        `js.Sliced` over ``{"model": ..., "nodes": ...}``), or None for that `js.Sliced`."""
        return None

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        """Parameter count per module path (`/`-joined), including submodules."""
        return {}

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        """Paths of modules that hold parameters themselves, or None if unknown."""
        return None

    # -- where an edit's new nodes keep their variables (default: ``variables[name]``)

    def node_of(self, path: tuple[Any, ...]) -> str | None:
        """The node name a variable path belongs to, if it is under one."""
        names = path_names(path)
        return names[0] if names else None

    def with_node(self, variables: dict[Any, Any], name: str, node_variables: Any) -> None:
        """Adds a new node's variables to `variables` (in place)."""
        variables[name] = node_variables

    def node_variables(self, variables: Any, name: str, node_variables: Any) -> Any:
        """A node's variables, read back from the edited model's `variables`."""
        return variables[name]

    def variable_names(self, variables: Any) -> set[str]:
        """Names new nodes must not take (they would collide with a variable)."""
        return {str(k) for k in variables} if isinstance(variables, Mapping) else set()


class CollectionNodes:
    """Where an edit's new modules keep their variables in a model whose variables are
    collections of per-module dicts (linen's ``params``, Keras's ``trainable``): under
    the node's name in each collection they have (``variables["params"][name]``)."""

    def node_of(self, path: tuple[Any, ...]) -> str | None:
        names = path_names(path)
        return names[1] if len(names) > 2 else None  # (collection, node, ...)

    def with_node(self, variables: dict[Any, Any], name: str, node_variables: Any) -> None:
        for collection, values in node_variables.items():
            if values:
                variables.setdefault(collection, {})[name] = values

    def node_variables(self, variables: Any, name: str, node_variables: Any) -> Any:
        return {c: variables[c][name] if v else {} for c, v in node_variables.items()}


def keywords_of(fn: Any) -> set[str] | None:
    """The keyword parameter names of `fn`, or None when it takes ``**kwargs``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in kinds}


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separates keyword inputs holding arrays from mode keywords (flags, strings)."""
    inputs, mode = {}, {}
    for k, v in kwargs.items():
        holds_arrays = any(is_traced_leaf(x) for x in jax.tree_util.tree_leaves(v))
        (inputs if holds_arrays else mode)[k] = v
    return inputs, mode


def count_by_prefix(flat: dict[tuple[str, ...], int]) -> dict[str, int]:
    """Sums leaf sizes keyed by path into every prefix of that path."""
    counts: dict[str, int] = {}
    for path, size in flat.items():
        for k in range(len(path) + 1):
            key = join_name(path[:k])
            counts[key] = counts.get(key, 0) + size
    return counts


def leaf_sizes(variables: Any) -> dict[tuple[str, ...], int]:
    """``{path names: size}`` of every leaf of a pytree of variables."""
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {path_names(p): int(getattr(x, "size", 1)) for p, x in flat}
