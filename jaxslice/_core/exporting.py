"""Exporting a slice: its inputs as `jax.ShapeDtypeStruct`s and `jax.export` of a call.

`jax.export` serialises a pure function of arrays. A slice is one in its mode unless it
draws random numbers or updates state (`check_exportable`), and its inputs are arrays
unless the trace fixed some of their leaves (`input_specs`). `export` is what every
``export()`` of a slice or an edited model does, given how to call it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import ExportRngsError, ExportUpdatesError, FixedLeavesExportError
from .._trees import abstract_tree
from .arguments import with_batch


def input_specs(entry: Any, batch: Any = None) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` of `jax.ShapeDtypeStruct`s a compiled entry takes, as traced.

    With `batch` (a dimension, e.g. symbolic), every input's leading axis is `batch`.
    """
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for arg in entry.plan.arguments:
        if any(i is None for i in arg.slot_ids):
            raise FixedLeavesExportError(arg=arg.describe())
        specs = list(entry.avals(arg.slot_ids))
        if batch is not None:
            specs = [with_batch(a, 0 if jnp.ndim(a) else None, batch) for a in specs]
        value = jax.tree_util.tree_unflatten(arg.tree, specs)
        if arg.keyword is None:
            args.append(value)
        else:
            kwargs[arg.keyword] = value
    return args, kwargs


def check_exportable(entry: Any) -> None:
    """Raises a `SliceError` if a compiled entry is no pure function of its variables and
    inputs in its mode: it draws random numbers, or it updates state."""
    plan, split = entry.plan, entry.traced.split
    mode = dict(split.mode)
    if plan.rng_ids:
        names = sorted(split.rngs) if isinstance(split.rngs, Mapping) else ["dropout"]
        rngs = "{" + ", ".join(f"{n!r}: key" for n in names) + "}"
        raise ExportRngsError(mode=mode, rngs=rngs)
    if plan.updated_collections:
        raise ExportUpdatesError(mode=mode, names=list(plan.updated_collections))


def export(
    entry: Any,
    run: Callable[..., Any],
    variables: Any,
    *,
    batch: str | None,
    variables_as_input: bool,
    platforms: Any,
    more_inputs: Callable[[Any], dict[str, Any]] | None = None,
) -> Any:
    """`jax.export` of ``run(variables, *inputs, **kwargs)`` at an entry's input shapes.

    Args:
      entry: the compiled entry whose inputs the exported function takes.
      run: calls the slice.
      variables: built into the program as constants, or with `variables_as_input` its
        first argument (as `jax.ShapeDtypeStruct`s).
      batch: the name of a symbolic leading dimension of every input with axes, or None.
      platforms: as for `jax.export.export`.
      more_inputs: the specs of keyword inputs beyond the entry's, given the batch
        dimension (None without `batch`).
    """
    check_exportable(entry)
    dim = jax.export.symbolic_shape(batch)[0] if batch is not None else None
    args, kwargs = input_specs(entry, dim)
    if more_inputs is not None:
        kwargs.update(more_inputs(dim))
    if variables_as_input:
        fn, args = run, [abstract_tree(variables), *args]
    else:
        fn = lambda *inputs, **kw: run(variables, *inputs, **kw)  # noqa: E731
    return jax.export.export(jax.jit(fn), platforms=platforms)(*args, **kwargs)
