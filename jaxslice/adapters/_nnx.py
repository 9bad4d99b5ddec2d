"""Flax NNX: `model(*inputs)`, with the model's variables inside it.

To trace, the model is split into a graph definition and its variables (`nnx.split`);
the traced program merges them back into a fresh copy and calls it, and returns the
copy's variables afterwards as updated state (batch statistics, RNG counters).

Submodule calls are marked by wrapping ``__call__`` on the classes of the copy's
submodules while the trace runs (`_patching.marked_calls`: only this context's model is
marked). Names are attribute paths joined by ``/`` (``blocks/0/linear``); only
``__call__`` is marked.

Sharp edge: a model that changes its Python attributes while it runs (a counter kept in
a plain attribute, say) cannot be replayed by a slice, so tracing checks that the graph
definition is the same after the call and raises otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .._core.markers import StopTracing
from .._errors import AttributeMutationError
from .._trees import is_array
from ._base import Adapter, NewModule, Split, count_by_prefix, keywords_of, split_kwargs
from ._nnx_state import (
    assign,
    flat_state,
    get_value,
    is_variable,
    set_value,
    state_from_flat,
    with_value,
)
from ._patching import callable_classes, marked_calls


def module_paths(model: Any) -> dict[int, tuple[str, ...]]:
    """``id(submodule) -> path`` for every module in `model` (first path of shared ones)."""
    from flax import nnx

    paths: dict[int, tuple[str, ...]] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and id(node) not in paths:
            paths[id(node)] = tuple(str(p) for p in path)
    return paths


# NNX transforms (`nnx.scan`, `nnx.vmap`, `nnx.remat`, `nnx.jit`) call fresh copies of a
# model's submodules, merged from its graph definition inside the transform. While a model
# is traced, each submodule of the traced copy carries its path in this attribute, which
# the graph definition (and so every such copy) keeps; it is removed after the call.
_PATH_ATTRIBUTE = "_jaxslice_path"


@contextlib.contextmanager
def _marked(model: Any) -> Iterator[None]:
    """Marks the calls of `model`'s submodules inside the block (this context only)."""
    from flax import nnx

    paths = module_paths(model)
    modules = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]
    with marked_calls(paths, callable_classes(modules), _tagged_path), _tagged(modules, paths):
        yield


def _tagged_path(module: Any) -> tuple[str, ...] | None:
    return module.__dict__.get(_PATH_ATTRIBUTE)


@contextlib.contextmanager
def _tagged(modules: list[Any], paths: dict[int, tuple[str, ...]]) -> Iterator[None]:
    """Each module carries its path (`_PATH_ATTRIBUTE`) inside the block."""
    tagged = [node for node in modules if paths.get(id(node))]
    for node in tagged:
        object.__setattr__(node, _PATH_ATTRIBUTE, paths[id(node)])
    try:
        yield
    finally:
        for node in tagged:
            node.__dict__.pop(_PATH_ATTRIBUTE, None)


class NNXAdapter(Adapter):
    state_includes_variables = True
    holds_variables = True
    model_class = ("flax.nnx", "Module")

    def can_stop_early(self, split: Split) -> bool:
        return True

    def live_variables(self, target: Any) -> dict[tuple[Any, ...], Any]:
        from flax import nnx

        return {path: get_value(v) for path, v in flat_state(nnx.state(target))}

    def flat_values(self, variables: Any) -> dict[tuple[Any, ...], Any]:
        return {p: get_value(v) for p, v in flat_state(variables)}

    def write_back(self, target: Any, state: list[tuple[Any, Any]]) -> None:
        from flax import nnx

        variables = dict(flat_state(nnx.state(target)))
        for path, value in state:
            if is_variable(variables[path]):
                set_value(variables[path], value)
            else:  # a plain array: replaced on its module
                assign(target, path, value)

    def slice_view(self, target: Any, program: Any) -> Any:
        from ._nnx_module import SlicedModule

        return SlicedModule(target, program)

    def edit_node(self, obj: Any, name: str, args: tuple[Any, ...]) -> NewModule | None:
        from flax import nnx

        if not isinstance(obj, nnx.Module):
            return None
        from ._nnx_edit import node_of

        fn, variables, structure = node_of(obj)
        return NewModule(fn, variables=variables, structure=structure)

    def edited_view(self, target: Any, edited: Any) -> Any:
        from ._nnx_edit import EditedModule

        return EditedModule(target, edited)

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        from flax import nnx

        inputs, mode = split_kwargs(kwargs)
        graphdef, state = nnx.split(target)
        flat = flat_state(state)
        variables = _NNXVariables(graphdef, flat)
        return Split(
            variables=variables, rngs=None, args=tuple(args), kwargs=inputs, mode=mode, mutable=True
        )

    def resplit(self, target: Any, split: Split) -> Split:
        from flax import nnx

        graphdef, state = nnx.split(target)
        return Split(
            variables=_NNXVariables(graphdef, flat_state(state)),
            rngs=None,
            args=split.args,
            kwargs=split.kwargs,
            mode=split.mode,
            mutable=True,
        )

    def structure_key(self, target: Any) -> Any:
        from flax import nnx

        return nnx.graphdef(target)

    def flatten_variables(
        self, variables: Any
    ) -> tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any]]:
        flat = [(tuple(path), get_value(v)) for path, v in variables.flat]
        return flat, variables.rebuild

    def flatten_state(self, state: Any) -> list[tuple[Any, Any]]:
        return state

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:

        model, graphdef = call.variables
        args, kwargs = call.args, call.kwargs
        before = _static_attributes(model)
        try:
            with _marked(model):
                out = model(*args, **kwargs)
        except StopTracing as stop:
            # Ending early: the state so far is what the slice may have updated.
            state = _unchanged(model, graphdef, before)
            stop.state = [(path, get_value(v)) for path, v in flat_state(state)]
            raise
        state = _unchanged(model, graphdef, before)
        return out, [(path, get_value(v)) for path, v in flat_state(state)]

    def accepted_keywords(self, target: Any) -> set[str] | None:
        names = keywords_of(type(target).__call__)
        return None if names is None else names - {"self"}

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        from flax import nnx

        return {
            tuple(str(p) for p in path[:-1])
            for path, v in variables.flat
            if isinstance(v, nnx.Param)
        }

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        from flax import nnx

        flat = {}
        for path, v in variables.flat:
            if isinstance(v, nnx.Param) or (hasattr(v, "type") and issubclass(v.type, nnx.Param)):
                flat[tuple(str(p) for p in path)] = int(getattr(get_value(v), "size", 1))
        counts = count_by_prefix({k[:-1]: 0 for k in flat})
        for key, size in count_by_prefix(flat).items():
            counts[key] = size
        return counts


def _unchanged(model: Any, graphdef: Any, before: dict[str, str]) -> Any:
    """The model's state, once its graph definition is checked to be the one traced
    (also when a trace ends early: a change made before the end is seen there)."""
    from flax import nnx

    after, state = nnx.split(model)
    if after != graphdef:
        changed = _changes(before, _static_attributes(model))
        raise AttributeMutationError(detail=changed)
    return state


def _static_attributes(model: Any) -> dict[str, str]:
    """``{"path.attr": repr(value)}`` of the plain Python attributes of every submodule."""
    from flax import nnx

    out = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        for name, value in vars(node).items():
            if (
                name.startswith("_")
                or isinstance(value, (nnx.Module, nnx.Variable))
                or is_array(value)
            ):
                continue
            if isinstance(value, (bool, int, float, str, tuple, type(None))):
                out[".".join([*map(str, path), name])] = repr(value)
    return out


def _changes(before: dict[str, str], after: dict[str, str]) -> str:
    keys = sorted(set(before) | set(after))
    diffs = [
        f"{k}: {before.get(k, '<unset>')} -> {after.get(k, '<unset>')}"
        for k in keys
        if before.get(k) != after.get(k)
    ]
    return "; ".join(diffs[:4]) or "its graph structure changed"


class _NNXVariables:
    """An NNX model's variables as a flat list of ``(path, variable)``, plus how to rebuild it."""

    def __init__(self, graphdef: Any, flat: list[tuple[Any, Any]]):
        self.graphdef = graphdef
        self.flat = flat

    def rebuild(self, leaves: list[Any]) -> tuple[Any, Any]:
        from flax import nnx

        pairs = []
        for (path, var), value in zip(self.flat, leaves, strict=True):
            pairs.append((path, with_value(var, value)))
        state = state_from_flat(pairs)
        return nnx.merge(self.graphdef, state), self.graphdef
