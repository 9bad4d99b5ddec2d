"""What a call of a compiled slice is checked for before it runs: variables of the
traced shapes and dtypes, arrays that still exist, modes that are Python values, and the
`mutable` linen's rules ask for. Each check raises a `SliceError` that names the leaf or
keyword and says what to pass instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._errors import (
    DeletedArrayError,
    MissingModelVariablesError,
    ModelChangedError,
    NoStateError,
    NumberVariableError,
    TracedModeError,
    UnaskedUpdatesError,
    VariableShapeError,
)
from .._trees import describe_aval, hashable, is_traced_leaf, path_str
from .plan import Plan


def check_leaves(paths: Any, leaves: list[Any], avals: Any, live: bool = False) -> None:
    """Each leaf has the shape and dtype of the variable traced at its path. `live`: the
    leaves are the variables a model holds (NNX), read from it at a call, so one of
    another shape means the model changed (a layer replaced by a wider one)."""
    for path, leaf, aval in zip(paths, leaves, avals, strict=True):
        # An array of the right shape and dtype passes at the cost of two comparisons.
        dtype = getattr(leaf, "dtype", None)
        if getattr(leaf, "shape", None) != aval.shape or dtype is None or dtype != aval.dtype:
            try:
                _check_leaf(path, leaf, aval)
            except VariableShapeError as error:
                if not live:
                    raise
                got, want = error.facts["got"], error.facts["want"]
                change = f"its variable {path_str(path)} is {got}, traced as {want}"
                raise ModelChangedError(change=change) from None


def values_at(graph: Any, flat: Mapping[Any, Any], live: bool = False) -> list[Any]:
    """The values of `graph.variable_ids`, looked up by path in `flat`, checked against
    the trace (`check_leaves`, `check_numbers`). `live`: read from a model that holds its
    variables (NNX), so another shape means the model changed."""
    missing = [p for p in graph.variable_paths if p not in flat]
    if missing:
        raise MissingModelVariablesError(paths=", ".join(path_str(p) for p in missing[:6]))
    values = [flat[p] for p in graph.variable_paths]
    check_leaves(graph.variable_paths, values, [graph.avals[v] for v in graph.variable_ids], live)
    check_numbers(graph.number_variables, flat)
    return values


def check_numbers(numbers: Mapping[Any, Any], flat: Mapping[Any, Any]) -> None:
    """Each variable that held a Python number when traced (`Graph.number_variables`),
    where `flat` (variables by path) has it, holds that number still: the program
    computes with it, as `jax.jit` does with a static argument. Under a transformation
    (`jax.jit` of `sub.apply`) a number becomes a scalar tracer, whose value cannot be
    read: a scalar there passes."""
    for path, number in numbers.items():
        now = flat.get(path, number)
        if hasattr(now, "shape") and not now.shape and _compat.tracing():
            continue  # a number passed through a transformation: its value is not known
        same = type(now) is type(number) and (now == number or (now != now and number != number))
        if not same:
            now = f"an array {describe_aval(now)}" if hasattr(now, "shape") else repr(now)
            raise NumberVariableError(path=path_str(path), traced=repr(number), now=now)


def _check_leaf(path: Any, leaf: Any, aval: Any) -> None:
    shape, dtype = jnp.shape(leaf), getattr(leaf, "dtype", None)
    if tuple(shape) != tuple(aval.shape) or dtype is None or jnp.dtype(dtype) != aval.dtype:
        got = f"{jnp.result_type(leaf) if dtype is None else dtype}{list(shape)}"
        want = f"{aval.dtype}{list(aval.shape)}"
        raise VariableShapeError(path=path_str(path), got=got, want=want)


def mode_value(name: str, value: Any) -> Any:
    """A mode keyword as the Python value the model's code branches on: a concrete
    one-element array of booleans or numbers (``train=jnp.asarray(True)``) becomes its
    scalar; a traced one is an error, since the mode decides which program runs. Other
    values (random keys among them) are left as they are."""
    if not is_traced_leaf(value) or np.size(value) != 1:
        return value
    if not (jnp.issubdtype(value.dtype, jnp.bool_) or jnp.issubdtype(value.dtype, jnp.number)):
        return value
    try:
        return np.asarray(value).item()
    except jax.errors.TracerArrayConversionError:
        raise TracedModeError(name=name) from None


def mode_key(value: Any) -> Any:
    """A mode value in a cache key: a Python number with its type (``train=1`` and
    ``train=True`` are equal, but may trace different programs), anything else as
    itself (or its repr, where it does not hash)."""
    if isinstance(value, (bool, int, float, complex)):
        return type(value), value
    return hashable(value)


def check_alive(variables: Any, inputs: Any, variable_paths: Any = None) -> None:
    """Raises a `SliceError` naming the first deleted array (donated to a jitted function,
    or `.delete()`d) among `variables` (a pytree, or leaves at `variable_paths`) and
    `inputs`; JAX's own error names none."""
    if variable_paths is None:
        flat = jax.tree_util.tree_flatten_with_path(variables)[0]
        variable_paths, variables = [p for p, _ in flat], [x for _, x in flat]
    named = [("variable", p, x) for p, x in zip(variable_paths, variables, strict=True)]
    named += [("input", p, x) for p, x in jax.tree_util.tree_flatten_with_path(inputs)[0]]
    for kind, path, leaf in named:
        if isinstance(leaf, _compat.CONCRETE_ARRAY) and leaf.is_deleted():
            raise DeletedArrayError(kind=kind, path=path_str(path), aval=describe_aval(leaf))


def check_mutable(plan_: Plan, mutable: Any, adapter: Any) -> None:
    """linen's rules: updated state must be asked for, and what is asked for must exist
    (unless the model's own call returns its state in every mode, as Haiku's does)."""
    if not adapter.has_collections:
        return
    if not mutable and plan_.updated_collections:
        raise UnaskedUpdatesError(names=list(plan_.updated_collections))
    if mutable and not plan_.state_paths and not adapter.always_returns_state:
        wanted = "any collection" if mutable is True else repr(mutable)
        raise NoStateError(wanted=wanted, have=list(plan_.state_collections))


_compat.register_frames_exclusion(__file__)
