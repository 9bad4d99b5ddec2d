"""Editing a Flax NNX model: NNX modules as new nodes, and the edited model as an `nnx.Module`.

A new node is an NNX module instance. It is called purely inside the edited program: its
graph definition is merged with the variable values it is given (`node_of`), so the
program never holds the module itself, and a node that would update its own state while
called (batch statistics, random-number counters) is refused with advice instead of
losing the update.

`EditedModule` holds the model and the new nodes as attributes, so its variables *are*
theirs: ``nnx.Optimizer(edited, tx, wrt=nnx.Param)`` trains the model in place together
with the new nodes, and ``edited.train()``/``edited.eval()`` switch both. Each call reads
the current values of both, runs the edited program (a `js.Sliced`, compiled once per
input signature and per graph definition of the model and nodes) and writes the state
the model updated back into it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from .. import _compat
from .._core.checks import check_leaves, check_numbers
from .._errors import NNXEditedExportStateError, NNXEditedNotCopyableError, NNXNodeStateError
from .._trees import joined_key
from .._view import RunsProgram
from ._nnx_state import (
    assign,
    flat_state,
    get_value,
    is_variable,
    set_value,
    state_from_flat,
    with_value,
)


def node_of(module: Any) -> tuple[Callable[..., Any], dict[str, Any], Callable[[], Any]]:
    """``(fn, values, structure)``: ``fn(values, *args)`` calls `module` as it is now (its
    current graph definition: a mode switched after the edit counts) with those variable
    values; ``structure()`` is that graph definition."""
    kind = type(module).__name__

    def fn(values: dict[str, Any], *args: Any) -> Any:
        graphdef, state = nnx.split(module)
        flat = flat_state(state)
        pairs = [(p, with_value(v, values[joined_key(p)])) for p, v in flat]
        copy = nnx.merge(graphdef, state_from_flat(pairs))
        out = copy(*args)
        after = {joined_key(p): get_value(v) for p, v in flat_state(nnx.state(copy))}
        changed = [k for k, v in after.items() if v is not values.get(k)]
        if changed:
            raise NNXNodeStateError(kind=kind, paths=changed[:4])
        return out

    values = {joined_key(p): get_value(v) for p, v in flat_state(nnx.state(module))}
    return fn, values, lambda: nnx.graphdef(module)


class _Static:
    """Data an NNX graph must treat as static: compared and hashed by identity."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


class EditedModule(RunsProgram, nnx.Module):
    """An edited NNX model: an `nnx.Module` holding the model and the new nodes.

    Create one with ``js.edit(model, *inputs)....build()``. Calling it runs the edited
    model (``edited(*inputs, **call_inputs)``); its variables are the model's and the
    nodes' own, so training it with `nnx.Optimizer` trains the original model in place.
    """

    def __init__(self, model: Any, edited: Any):
        self.model = model
        self.nodes = nnx.List(list(edited.nodes.values()))
        self._jaxslice = _Static(
            sliced=edited.sliced, program=edited.program, names=tuple(edited.nodes)
        )

    def _slice_program(self) -> Any:
        return self._jaxslice.program

    def _variables(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``({"model": ..., "nodes": ...}, the model's state leaves by key)``, current
        values."""
        held = {joined_key(p): (p, v) for p, v in flat_state(nnx.state(self.model))}
        nodes = {
            name: {joined_key(p): get_value(v) for p, v in flat_state(nnx.state(node))}
            for name, node in zip(self._jaxslice.names, self.nodes, strict=True)
        }
        values = {k: get_value(v) for k, (_, v) in held.items()}
        return {"model": values, "nodes": nodes}, held

    def __call__(self, *inputs: Any, **call_inputs: Any) -> Any:
        variables, held = self._variables()
        program = self._jaxslice.program  # the edited model's, compiled per signature
        entry, leaves = program.lookup(inputs, call_inputs, None, False)
        flat = program.adapter.flat_values(variables)
        values = [flat[p] for p in entry.plan.variable_paths]  # those this mode reads
        check_leaves(entry.plan.variable_paths, values, entry.variable_avals, live=True)
        check_numbers(entry.traced.graph.number_variables, flat)
        out, state = program.run(entry, values, [], leaves, False)
        for key, value in state.items():
            path, leaf = held[key]
            if is_variable(leaf):
                set_value(leaf, value)
            else:  # a plain array: replaced on its module
                assign(self.model, path, value)
        return out

    def export(self, *, batch: str | None = "b", platforms: Any = None) -> Any:
        """The edited model as a `jax.export.Exported`, with the current values of its
        variables built in (see `js.Sliced.export`; export it in evaluation mode)."""
        variables, _ = self._variables()
        sliced = self._jaxslice.sliced
        variables["model"] = {k: variables["model"][k] for k in sliced.variables["model"]}

        def output(result: Any) -> Any:
            out, state = result
            if state:  # written back by a call: not a pure function
                raise NNXEditedExportStateError(names=sorted(state)[:6])
            return out

        return sliced.export(batch=batch, platforms=platforms, variables=variables, pick=output)

    def __reduce__(self) -> Any:
        raise NNXEditedNotCopyableError()

    def __deepcopy__(self, memo: Any) -> Any:
        raise NNXEditedNotCopyableError()


_compat.register_frames_exclusion(__file__)
