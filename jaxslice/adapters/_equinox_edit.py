"""Editing an Equinox model: Equinox modules as new nodes, the edited model an `eqx.Module`.

A new node is an `eqx.Module`; inside the edited program it is its arrays (`eqx.filter`)
combined again with the rest of it (`eqx.combine`), so gradients reach exactly its
arrays. The edited model (`edited_class`) is an `eqx.Module` holding the whole model and
the new nodes, so `eqx.filter_jit`, `eqx.filter_grad`, `eqx.partition` and optax work
on it as on any Equinox model, and training it trains both; ``edited.merge(model,
trained)`` returns the model as trained (as a slice's `merge` does).

Sharp edge: the edited program is traced for the structure the model and the nodes had
when they were edited. A changed structure (``eqx.nn.inference_mode(edited)``, a swapped
layer) is refused with advice: edit the changed model again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from .._errors import EquinoxOtherEditedError, EquinoxStructureChangedError
from .._trees import abstract_tree, is_traced_leaf, tree_key


def node_of(module: Any) -> tuple[Callable[..., Any], Any, Callable[[], Any]]:
    """``(fn, arrays, structure)``: ``fn(arrays, *args)`` calls `module` with `arrays`."""
    import equinox as eqx

    arrays, rest = eqx.partition(module, eqx.is_array)

    def fn(values: Any, *args: Any) -> Any:
        return eqx.combine(values, rest)(*args)

    key = tree_key(abstract_tree(module))
    return fn, arrays, lambda: key


@functools.cache
def edited_class() -> type:
    """`EditedEquinox`, defined once Equinox is imported (jaxslice does not import it)."""
    import equinox as eqx

    class _Static:
        """The edited program and the structure it was traced for (hashed by identity)."""

        def __init__(self, program: Any, sliced: Any, names: tuple[str, ...], key: Any):
            self.program, self.sliced, self.names, self.key = program, sliced, names, key

    from .._view import RunsProgram

    class EditedEquinox(RunsProgram, eqx.Module):
        """An edited Equinox model: an `eqx.Module` holding the model and the new nodes.

        ``edited(*inputs, **call_inputs)`` runs the edited model (one example per call,
        like the model; batch it with `jax.vmap`).
        """

        model: Any
        nodes: tuple[Any, ...]
        edits: _Static = eqx.field(static=True)

        def __init__(self, model: Any, built: Any):
            self.model = model
            self.nodes = tuple(built.nodes.values())
            key = _structure(model, self.nodes)
            self.edits = _Static(built.program, built.sliced, tuple(built.nodes), key)

        def _slice_program(self) -> Any:
            return self.edits.program

        def _variables(self) -> dict[str, Any]:
            changed = _changed(self.edits.key, _structure(self.model, self.nodes))
            if changed:
                raise EquinoxStructureChangedError(what=changed)
            nodes = {
                name: eqx.filter(node, eqx.is_array)
                for name, node in zip(self.edits.names, self.nodes, strict=True)
            }
            return {"model": eqx.filter(self.model, is_traced_leaf), "nodes": nodes}

        def __call__(self, *inputs: Any, **call_inputs: Any) -> Any:
            program = self.edits.program
            entry, leaves = program.lookup(inputs, call_inputs, None, False)
            flat = program.adapter.flat_values(self._variables())
            values = [flat[p] for p in entry.plan.variable_paths]
            return program.run(entry, values, [], leaves, False)

        def merge(self, model: Any, trained: Any) -> Any:
            """`model` as trained in `trained` (this edited model after training).

            The edited model holds the whole model, so this is ``trained.model``, checked
            to have `model`'s structure."""
            if not isinstance(trained, EditedEquinox) or trained.edits is not self.edits:
                raise EquinoxOtherEditedError()
            if tree_key(abstract_tree(trained.model)) != tree_key(abstract_tree(model)):
                raise EquinoxStructureChangedError(what="the model")
            return trained.model

        def export(self, *, batch: str | None = None, platforms: Any = None) -> Any:
            """The edited model as a `jax.export.Exported` with its current arrays built
            in (one example per call, so no symbolic batch size by default)."""
            return self.edits.sliced.export(
                batch=batch, platforms=platforms, variables=_pruned(self, self._variables())
            )

    return EditedEquinox


def _pruned(edited: Any, variables: dict[str, Any]) -> dict[str, Any]:
    """`variables` cut to the entries the edited program reads (as its `js.Sliced` has)."""
    flat = dict(jax.tree_util.tree_flatten_with_path(variables)[0])
    want = jax.tree_util.tree_flatten_with_path(edited.edits.sliced.variables)
    return jax.tree_util.tree_unflatten(want[1], [flat[p] for p, _ in want[0]])


def _structure(model: Any, nodes: tuple[Any, ...]) -> tuple[Any, Any]:
    return tree_key(abstract_tree(model)), tuple(tree_key(abstract_tree(n)) for n in nodes)


def _changed(before: tuple[Any, Any], now: tuple[Any, Any]) -> str:
    if before[0] != now[0]:
        return "the model"
    return "a new node" if before[1] != now[1] else ""
