"""A slice's inputs: from a call's arguments to the input leaves its plan reads.

A plan's `arguments` say, for each positional or keyword input of the slice, its pytree
structure and which of its leaves are values of the graph (the others were fixed by the
trace). `input_leaves` binds a call to them; `retrace_inputs` makes the model's inputs for
tracing again at a new batch size. Everything here is a pure function of the plan, the
split the slice was traced with and the call: nothing is cached or changed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._errors import (
    FixedArgumentChangedError,
    InputShapesChangedError,
    InputStructureError,
    MissingKeywordInputError,
    NotAnArrayInputError,
    PositionalInputCountError,
)
from .._trees import abstract, is_traced_leaf, is_weak, tree_key
from .plan import Plan


def signature(leaves: Any) -> tuple[Any, ...]:
    """The shapes, dtypes and weak types of arrays (or avals), hashable."""
    return tuple((tuple(x.shape), x.dtype, getattr(x, "weak_type", False)) for x in leaves)


def input_leaves(
    plan: Plan, traced_args: tuple[Any, ...], inputs: tuple[Any, ...], kw_inputs: dict[str, Any]
) -> list[Any]:
    """The leaves of a call's inputs that the plan reads, in its order, checked for arity
    and structure. `traced_args` are the model's positional arguments as traced."""
    inputs = _like_the_model(plan, traced_args, inputs)
    positional = [a for a in plan.arguments if a.keyword is None]
    if len(inputs) != len(positional):
        described = ", ".join(a.describe() for a in plan.arguments) or "none"
        raise PositionalInputCountError(expected=len(positional), inputs=described, got=len(inputs))
    given = iter(inputs)
    leaves: list[Any] = []
    for arg in plan.arguments:
        if arg.keyword is None:
            leaves += _argument_leaves(arg, next(given))
        elif arg.keyword in kw_inputs:
            leaves += _argument_leaves(arg, kw_inputs[arg.keyword])
        else:
            raise MissingKeywordInputError(keyword=arg.keyword, input=arg.describe())
    return leaves


def _like_the_model(plan: Plan, traced: tuple[Any, ...], inputs: tuple[Any, ...]) -> tuple:
    """The array arguments of a slice from the model's inputs called as the model is
    (every positional argument, ``None`` and flags included), once the others are
    checked to be what the trace fixed; other calls' inputs, unchanged."""
    taken = [a.position for a in plan.arguments if a.keyword is None]
    if plan.starts is not None or len(inputs) in (len(taken), 0) or len(inputs) != len(traced):
        return inputs  # (a wrong count is reported by `input_leaves`)
    for i, (given, fixed) in enumerate(zip(inputs, traced, strict=True)):
        if i not in taken and tree_key(given) != tree_key(fixed):
            raise FixedArgumentChangedError(position=i, fixed=fixed, given=given)
    return tuple(inputs[i] for i in taken)


def _argument_leaves(arg: Any, value: Any) -> list[Any]:
    flat, tree = jax.tree_util.tree_flatten(value)
    if tree != arg.tree:
        raise InputStructureError(input=arg.describe(), tree=tree, traced=arg.tree)
    return [
        _as_array(arg, leaf) for leaf, v in zip(flat, arg.slot_ids, strict=True) if v is not None
    ]


def _as_array(arg: Any, leaf: Any) -> Any:
    if is_traced_leaf(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    try:
        return jnp.asarray(leaf)
    except (TypeError, ValueError) as error:
        raise NotAnArrayInputError(
            input=arg.describe(), kind=type(leaf).__name__, value=leaf
        ) from error


# --------------------------------------------------------------------------- new shapes


def retrace_inputs(
    plan: Plan,
    expected: tuple[Any, ...],
    split: Any,
    avals: tuple[Any, ...],
    inputs: tuple[Any, ...],
    kw_inputs: dict,
    later: bool = False,
) -> dict[str, Any] | None:
    """The model's inputs (``{"args", "kwargs"}`` of `split`'s) for a re-trace at the shapes
    of `avals`, the slice's input leaves traced as `expected` (empty: as they were).

    Without a start, the slice's inputs are the model's. With one, only the batch size may
    change: each model input's batch axis is the one of the old batch size, the leading
    one first, or with `later` the last (None where that is the choice already tried).
    """
    if plan.starts is None:
        return None if later else _model_inputs(plan, split, inputs, kw_inputs)
    batch = _new_batch_size(expected, avals)
    if batch is None:
        return None if later else {}
    old = next(e.shape[0] for e in expected if e.shape and not same_dim(e.shape[0], batch))
    leaves = [*jax.tree_util.tree_leaves(split.args), *jax.tree_util.tree_leaves(split.kwargs)]
    if later and all(_batch_axis(x, old, later) in (None, 0) for x in leaves):
        return None
    resize = lambda x: with_batch(x, _batch_axis(x, old, later), batch)  # noqa: E731
    return {
        "args": jax.tree_util.tree_map(resize, split.args),
        "kwargs": jax.tree_util.tree_map(resize, split.kwargs),
    }


def _model_inputs(plan: Plan, split: Any, inputs: tuple[Any, ...], kw_inputs: dict) -> dict:
    """The model's arguments with the slice's inputs in their places, as avals; the
    leaves the plan reads as arrays are arrays even where given as Python numbers (which
    would otherwise be fixed by the new trace, as the model's flags are)."""
    args, kwargs = list(split.args), dict(split.kwargs)
    given = iter(_like_the_model(plan, split.args, inputs))
    for arg in plan.arguments:
        value = kw_inputs[arg.keyword] if arg.keyword is not None else next(given)
        flat, tree = jax.tree_util.tree_flatten(value)  # its structure is checked
        slots = zip(flat, arg.slot_ids, strict=True)
        value = tree.unflatten(
            [abstract(_as_array(arg, x) if v is not None else x) for x, v in slots]
        )
        if arg.keyword is not None:
            kwargs[arg.keyword] = value
        else:
            args[arg.position] = value
    return {"args": tuple(args), "kwargs": kwargs}


def _batch_axis(x: Any, old: Any, later: bool) -> int | None:
    """The axis of a model input that has the old batch size: the leading one if it has
    it (the last such with `later`), or None for an input without one."""
    shape = jnp.shape(x) if is_traced_leaf(x) else ()
    axes = [k for k, n in enumerate(shape) if same_dim(n, old)]
    if not axes:
        return None
    return axes[-1] if later else axes[0]


def with_batch(x: Any, axis: int | None, batch: Any) -> Any:
    """A model input (or its aval) with its batch axis at the new size."""
    if axis is None:
        return x
    shape = list(jnp.shape(x))
    shape[axis] = batch
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype, weak_type=is_weak(x))


def same_dim(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # symbolic dimensions (jax.export) that cannot be compared
        return a is b


def _new_batch_size(expected: tuple[Any, ...], got: tuple[Any, ...]) -> Any:
    """The new leading dimension of `got`, None if unchanged; other changes raise."""
    if not all(_same_but_batch(e, g) for e, g in zip(expected, got, strict=True)):
        raise InputShapesChangedError.of(expected, got)
    pairs = zip(expected, got, strict=True)
    changed = [g.shape[0] for e, g in pairs if e.shape and not same_dim(e.shape[0], g.shape[0])]
    if any(not same_dim(b, changed[0]) for b in changed):
        raise InputShapesChangedError.of(expected, got)
    return changed[0] if changed else None


def _same_but_batch(e: Any, g: Any) -> bool:
    """Same dtype and shape, except perhaps the leading axis."""
    if str(e.dtype) != str(g.dtype) or len(e.shape) != len(g.shape):
        return False
    return all(same_dim(a, b) for a, b in zip(e.shape[1:], g.shape[1:], strict=True))


def same_shapes(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two sequences of avals have the same shapes and dtypes (symbolic
    dimensions compared by name)."""
    shapes = lambda avals: tuple((tuple(map(str, x.shape)), str(x.dtype)) for x in avals)  # noqa: E731
    return shapes(a) == shapes(b)
