"""Lowering a target to a `Graph`.

A target and its call arguments are split by its adapter into variables, random keys,
inputs and mode. The program traced is ``f(variable_leaves, rng_leaves, input_leaves)``:
array leaves become jaxpr invars (in that order) and every other leaf (Python scalars,
strings, flags) is fixed by the trace, like a static argument of `jax.jit`. Leaves may be
`jax.ShapeDtypeStruct`s, so a model can be re-traced at new shapes without data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from . import _compat, _graph, _markers
from ._errors import ModelTraceError
from .adapters import Adapter, adapter_for
from .adapters._base import Split


def is_traced_leaf(x: Any) -> bool:
    return _markers.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def abstract(x: Any) -> Any:
    """A leaf's shape and dtype (for signatures); other leaves stand for themselves."""
    if is_traced_leaf(x):
        return jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype)
    return x


@dataclasses.dataclass
class Traced:
    """A traced target: its graph and the split it was traced with."""

    graph: _graph.Graph
    adapter: Adapter
    target: Any
    split: Split
    variable_leaves: list[Any]  # the original leaf objects, in graph.variable_ids order
    param_counts: dict[str, int]


def _partition(tree: Any) -> tuple[list[Any], Any, list[bool], list[Any]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mask = [is_traced_leaf(x) for x in leaves]
    statics = [x for x, m in zip(leaves, mask, strict=True) if not m]
    return leaves, treedef, mask, statics


def _merge(mask: list[bool], arrays: list[Any], statics: list[Any]) -> list[Any]:
    a, s = iter(arrays), iter(statics)
    return [next(a) if m else next(s) for m in mask]


def trace(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Traced:
    adapter = adapter_for(target)
    split = adapter.split(target, args, kwargs)
    return trace_split(adapter, target, split)


def trace_split(adapter: Adapter, target: Any, split: Split) -> Traced:
    var_flat, rebuild_variables = adapter.flatten_variables(split.variables)
    var_mask = [is_traced_leaf(x) for _, x in var_flat]
    var_arrays = [x for (_, x), m in zip(var_flat, var_mask, strict=True) if m]
    var_statics = [x for (_, x), m in zip(var_flat, var_mask, strict=True) if not m]
    var_paths = [p for (p, _), m in zip(var_flat, var_mask, strict=True) if m]

    rng_leaves, rng_tree, rng_mask, rng_statics = _partition(split.rngs)
    rng_arrays = [x for x, m in zip(rng_leaves, rng_mask, strict=True) if m]
    in_leaves, in_tree, in_mask, in_statics = _partition((split.args, split.kwargs))
    in_arrays = [x for x, m in zip(in_leaves, in_mask, strict=True) if m]

    out_info: dict[str, Any] = {}

    def program(var_a: list[Any], rng_a: list[Any], in_a: list[Any]) -> tuple[list[Any], list[Any]]:
        variables = rebuild_variables(_merge(var_mask, var_a, var_statics))
        rngs = jax.tree_util.tree_unflatten(rng_tree, _merge(rng_mask, rng_a, rng_statics))
        call_args, call_kwargs = jax.tree_util.tree_unflatten(in_tree, _merge(in_mask, in_a, in_statics))
        with _markers.marking():
            out, state = adapter.call(
                target, variables, rngs, call_args, {**call_kwargs, **split.mode}, split.mutable
            )
        leaves, treedef = jax.tree_util.tree_flatten(out)
        mask = [is_traced_leaf(x) for x in leaves]
        out_info["tree"] = treedef
        out_info["statics"] = {i: x for i, (x, m) in enumerate(zip(leaves, mask, strict=True)) if not m}
        state_flat = [(p, x) for p, x in adapter.flatten_state(state) if is_traced_leaf(x)]
        out_info["state_paths"] = [p for p, _ in state_flat]
        return [x for x, m in zip(leaves, mask, strict=True) if m], [x for _, x in state_flat]

    try:
        closed, _ = _compat.make_jaxpr(program, var_arrays, rng_arrays, in_arrays)
    except Exception as e:
        _reraise_model_error(e, split)
        raise
    graph = _graph.build(
        closed,
        variable_paths=var_paths,
        num_rngs=len(rng_arrays),
        input_tree=in_tree,
        input_is_array=in_mask,
        input_statics=in_statics,
        out_tree=out_info["tree"],
        out_statics=out_info["statics"],
        state_paths=out_info["state_paths"],
        name_scopes=adapter.name_scopes,
    )
    return Traced(
        graph=graph,
        adapter=adapter,
        target=target,
        split=split,
        variable_leaves=var_arrays,
        param_counts=adapter.parameter_counts(split.variables),
    )


def _reraise_model_error(error: Exception, split: Split) -> None:
    """Turns Flax's own errors about how the model was called into a `SliceError`."""
    try:
        import flax.errors
    except ImportError:  # pragma: no cover
        return
    if not isinstance(error, flax.errors.FlaxError):
        return
    hint = ModelTraceError.RNG_HINT if isinstance(error, flax.errors.InvalidRngError) else ""
    mode = f" (mode {split.mode}, mutable={split.mutable!r})" if split.mode or split.mutable else ""
    raise ModelTraceError(ModelTraceError.TEMPLATE.format(mode=mode, error=error, hint=hint)) from error


_compat.register_frames_exclusion(__file__)
