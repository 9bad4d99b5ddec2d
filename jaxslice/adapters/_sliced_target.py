"""A `js.Sliced` passed back as a target: a slice, or an edited model, of any kind whose
slices are `js.Sliced` (linen, plain functions, and through their engine ``sub.sliced``
Haiku and Keras slices).

It is traced as it is called, ``sub(*inputs, **kwargs)`` with ``sub.variables`` (or,
given ``sub.apply``, ``sub.apply(variables, *inputs, **kwargs)``), and its program marks
the calls it computes again while it is traced (`_core.remark`), so ``js.boundaries(sub,
x)`` lists the model's boundaries that lie in the slice (an edited model's calls and new
nodes), ``js.intermediates(sub, x)`` reads them, and ``js.slice(sub, x, start=...,
end=...)`` cuts a piece of the slice. Everything that depends on the model's kind (how
variables are nested and counted, where state belongs, what a slice is returned as) is
answered by the adapter of the slice's own model.

Slices of NNX and Equinox models (and their edited models) are modules of their own
library and are traced by that library's adapter; their programs mark their calls again
the same way (`Adapter.program_of`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._errors import PlainNoParamsError, SlicedTargetArgumentsError
from .._sliced import Sliced
from .._view import RunsProgram, program_of
from ._base import Adapter, NewModule, Split, split_kwargs


def _engine(target: Any) -> tuple[Any, bool]:
    """``(the js.Sliced a target runs, whether the variables are given first)``, or
    ``(None, False)`` for another target: a `js.Sliced`, a view of one (``sub.sliced``),
    or the bound ``apply`` of either."""
    owner = target.__self__ if inspect.ismethod(target) and target.__name__ == "apply" else None
    found = target if owner is None else owner
    if not isinstance(found, Sliced):
        found = getattr(found, "sliced", None) if isinstance(found, RunsProgram) else None
    if not isinstance(found, Sliced):
        return None, False
    return found, owner is not None


def _check_not_variables(first: Any, variables: Any) -> None:
    """Refuses a first argument that is a container shaped like the slice's variables
    (or like one collection of them, as Haiku's ``apply(params, x)`` takes it): the
    slice has its own. (A single array is no telling sign: inputs are arrays too.)"""
    structure = jax.tree_util.tree_structure(first)
    if jax.tree_util.treedef_is_leaf(structure):
        return
    parts = {"its variables": variables}
    if isinstance(variables, Mapping):
        parts.update({f"its {k!r} collection": v for k, v in variables.items()})
    for what, part in parts.items():
        if structure == jax.tree_util.tree_structure(part):
            raise SlicedTargetArgumentsError(what=what)


class SlicedAdapter(Adapter):
    """A `js.Sliced` as a target; the questions of its model's kind go to `inner`, the
    adapter its program was traced with."""

    name_scopes = False  # its boundaries are the calls its program marks again

    def __init__(self, inner: Adapter) -> None:
        self.inner = inner
        self.has_collections = inner.has_collections
        self.always_returns_state = inner.always_returns_state
        self.state_includes_variables = inner.state_includes_variables
        self.separate_nodes = inner.separate_nodes

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return _engine(target)[0] is not None

    @classmethod
    def for_target(cls, target: Any) -> Adapter:
        return cls(program_of(_engine(target)[0]).adapter)

    def program_of(self, target: Any) -> Any:
        return program_of(_engine(target)[0])

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        engine, given = _engine(target)
        kwargs = dict(kwargs)
        rngs = kwargs.pop("rngs", None) if self.has_collections else None
        mutable = kwargs.pop("mutable", False) if self.has_collections else False
        if given and not args:
            raise PlainNoParamsError()
        variables, args = (args[0], args[1:]) if given else (engine.variables, args)
        if not given and args:
            _check_not_variables(args[0], variables)
        inputs, mode = split_kwargs(kwargs)
        return Split(variables, rngs, tuple(args), inputs, mode, mutable)

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        program = self.program_of(target)
        out = program.apply_checked(call.variables, call.args, call.kwargs, call.rngs, call.mutable)
        return out if call.mutable else (out, None)

    # -- the model's kind answers the rest

    def _model(self, target: Any) -> Any:
        """The model the slice was cut from (as its program keeps it)."""
        return self.program_of(target).target

    def accepted_keywords(self, target: Any) -> set[str] | None:
        return self.inner.accepted_keywords(self._model(target))

    def structure_key(self, target: Any) -> Any:
        return self.inner.structure_key(self._model(target))

    def flatten_variables(
        self, variables: Any
    ) -> tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any]]:
        return self.inner.flatten_variables(variables)

    def flatten_state(self, state: Any) -> list[tuple[Any, Any]]:
        return self.inner.flatten_state(state)

    def flat_values(self, variables: Any) -> dict[tuple[Any, ...], Any]:
        return self.inner.flat_values(variables)

    def wider_mutable(self, split: Split, error: BaseException | None) -> Any:
        return self.inner.wider_mutable(split, error)

    def error_hint(self, error: BaseException) -> str:
        return self.inner.error_hint(error)

    def state_owner(self, path: tuple[Any, ...]) -> tuple[str, ...]:
        return self.inner.state_owner(path)

    def variables_view(self, target: Any, variables: Any) -> Callable[[], Any] | None:
        return self.inner.variables_view(self._model(target), variables)

    def sliced_view(self, target: Any, sliced: Any) -> Any:
        return self.inner.sliced_view(self._model(target), sliced)

    def edit_node(self, obj: Any, name: str, args: tuple[Any, ...]) -> NewModule | None:
        return self.inner.edit_node(obj, name, args)

    def edited_view(self, target: Any, edited: Any) -> Any:
        return self.inner.edited_view(self._model(target), edited)

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        return self.inner.parameter_counts(variables)

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        return self.inner.own_parameter_modules(variables)

    def node_of(self, path: tuple[Any, ...]) -> str | None:
        return self.inner.node_of(path)

    def with_node(self, variables: dict[Any, Any], name: str, node_variables: Any) -> None:
        self.inner.with_node(variables, name, node_variables)

    def node_variables(self, variables: Any, name: str, node_variables: Any) -> Any:
        return self.inner.node_variables(variables, name, node_variables)

    def variable_names(self, variables: Any) -> set[str]:
        return self.inner.variable_names(variables)
