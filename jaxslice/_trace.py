"""Lowering a target to a `Graph`.

A target and its call arguments are split by its adapter into variables, random keys,
inputs and mode. The program traced is ``f(variable_leaves, rng_leaves, input_leaves)``:
array leaves become jaxpr invars (in that order) and every other leaf (Python scalars,
strings, flags) is fixed by the trace, like a static argument of `jax.jit`. Leaves may be
`jax.ShapeDtypeStruct`s, so a model can be re-traced at new shapes without data.
"""

from __future__ import annotations

import collections
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


def stop_specs(start: Any, end: Any) -> list[Any] | None:
    """The names a trace must reach for a slice from `start` to `end` (None: everything)."""
    if end is None:
        return None
    ends = [end] if isinstance(end, str) else list(end.values()) if isinstance(end, dict) else end
    if not isinstance(ends, (list, tuple)):
        return None
    starts = [] if start is None else [start] if isinstance(start, str) else start
    if not isinstance(starts, (list, tuple)):
        return None
    return [s for s in starts if s is not None] + list(ends)


def trace(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], stop_at: Any = None
) -> Traced:
    adapter = adapter_for(target)
    split = adapter.split(target, args, kwargs)
    return trace_split(adapter, target, split, stop_at)


# Call counts per boundary name of models already traced in full, so that a later trace
# can stop early without hiding a repeated call (a bare name must stay ambiguous).
_CALL_COUNTS: collections.OrderedDict[Any, dict[str, int]] = collections.OrderedDict()
_CALL_COUNTS_SIZE = 64


def _counts_key(adapter: Adapter, target: Any, split: Split) -> Any:
    try:
        structure = adapter.structure_key(target)
        if structure is None:
            structure = target
        leaves = jax.tree_util.tree_leaves((split.args, split.kwargs))
        key = (
            adapter.kind,
            structure,
            tuple(
                (tuple(jax.numpy.shape(x)), str(x.dtype)) if is_traced_leaf(x) else x
                for x in leaves
            ),
            tuple(sorted(split.mode.items())),
        )
        hash(key)
        return key
    except Exception:  # unhashable targets or arguments: no early stopping for them
        return None


def _remember_counts(key: Any, graph: _graph.Graph) -> None:
    if key is None or graph.partial:
        return
    counts: dict[str, int] = {}
    for call in graph.calls:
        counts[call.name] = counts.get(call.name, 0) + 1
    _CALL_COUNTS[key] = counts
    _CALL_COUNTS.move_to_end(key)
    while len(_CALL_COUNTS) > _CALL_COUNTS_SIZE:
        _CALL_COUNTS.popitem(last=False)


def stop_rule(
    adapter: Adapter, target: Any, split: Split, ends: list[Any] | None
) -> _markers.StopRule | None:
    """How to end a trace early once these boundaries (`stop_specs`) ran, or None.

    Only named ends of linen and NNX models qualify (their names are known at call time),
    and not when linen state updates are asked for (linen returns them only at the end).
    A name with a call index (``name@k``) stops after that call. A bare name stops after
    its call only if the same model, traced in full before with these input shapes and
    mode, called that module exactly once; otherwise the whole model is traced, so a
    repeated call is still reported as ambiguous.
    """
    if ends is None or adapter.kind not in ("linen", "nnx"):
        return None
    if adapter.kind == "linen" and split.mutable:
        return None
    from ._names import parse

    known = None
    needs: dict[str, int] = {}
    for spec in ends:
        if not isinstance(spec, str):
            return None
        base, index, _ = parse(spec)
        if index is None:
            if known is None:
                key = _counts_key(adapter, target, split)
                known = _CALL_COUNTS.get(key, {}) if key is not None else {}
            if known.get(base) != 1:
                return None
        needs[base] = max(needs.get(base, 0), (index or 0) + 1)
    return _markers.StopRule(needs)


def trace_split(adapter: Adapter, target: Any, split: Split, stop_at: Any = None) -> Traced:
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
        call_args, call_kwargs = jax.tree_util.tree_unflatten(
            in_tree, _merge(in_mask, in_a, in_statics)
        )
        rule = stop_rule(adapter, target, split, stop_at)
        try:
            with _markers.marking(), _markers.stopping(rule):
                out, state = adapter.call(
                    target, variables, rngs, call_args, {**call_kwargs, **split.mode}, split.mutable
                )
        except _markers.StopTracing as stop:
            out_info["partial"] = True
            out, state = (), stop.state
        leaves, treedef = jax.tree_util.tree_flatten(out)
        mask = [is_traced_leaf(x) for x in leaves]
        out_info["tree"] = treedef
        out_info["statics"] = {
            i: x for i, (x, m) in enumerate(zip(leaves, mask, strict=True)) if not m
        }
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
    graph.partial = out_info.get("partial", False)
    _remember_counts(_counts_key(adapter, target, split), graph)
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
    raise ModelTraceError(
        ModelTraceError.TEMPLATE.format(mode=mode, error=error, hint=hint)
    ) from error


_compat.register_frames_exclusion(__file__)
