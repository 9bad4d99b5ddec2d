"""Tracing a target into a `Graph` (stages 1 and 2 of the pipeline, driven here).

A target and its call arguments are split by its adapter into variables, random keys,
inputs and mode. The program traced is ``f(variable_leaves, rng_leaves, input_leaves)``:
array leaves become jaxpr invars (in that order) and every other leaf (Python scalars,
strings, flags) is fixed by the trace, like a static argument of `jax.jit`. Leaves may be
`jax.ShapeDtypeStruct`s, so a model can be re-traced at new shapes without data.

A trace may stop early, once every end of a slice has returned (`markers.StopRule`),
when the adapter allows it. Any exception the model raises while traced becomes a
`ModelTraceError` naming the boundary that was running, with the model's error chained.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat
from .._caches import LRU
from .._errors import ModelTraceError, SliceError
from .._fingerprint import input_ids, model_key
from .._shared import SHARED
from .._trees import is_traced_leaf, shape_key, tree_key
from . import markers
from .build import Signature, build
from .contract import Adapter, Split
from .graph import Graph
from .ports import spec_items
from .selection import Name, Selection


@dataclasses.dataclass
class Traced:
    """A traced target: its graph and the split it was traced with."""

    graph: Graph
    adapter: Adapter
    target: Any
    split: Split
    param_counts: dict[str, int]
    seconds: float = 0.0  # time spent tracing, graph building included
    build_seconds: float = 0.0  # of which building the graph (for `Sliced.build_info`)


def trace(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    stop_at: Any = None,
    *,
    adapter: Adapter,
) -> Traced:
    """Traces ``target(*args, **kwargs)`` as its `adapter` (`adapters.adapter_for`) says."""
    split = adapter.split(target, args, kwargs)
    return trace_split(adapter, target, split, stop_at)


def stop_specs(start: Any, end: Any) -> list[Any] | None:
    """The names a trace must reach for a slice from `start` to `end`, each parsed
    (`ports.parsed`), or None: everything."""
    if end is None:
        return None
    return [s for s in spec_items(start) if s is not None] + spec_items(end)


# Call counts per boundary name of models already traced in full, so that a later trace
# can stop early without hiding a repeated call (a bare name must stay ambiguous).
_CALL_COUNTS = LRU(maxsize=64)
# The last graph traced of each model and signature, so that a second slice,
# `js.boundaries` after a slice, `js.intermediates` or `js.edit` of the same model at the
# same shapes trace nothing. A graph of a trace that stopped early serves only what it
# reached (`_cached_graph`); a complete one, traced later, takes its place.
_GRAPHS = LRU(maxsize=16)


def traced_key(adapter: Adapter, target: Any, split: Split) -> Any:
    """The key every cache of traced programs uses (here the graphs and call counts,
    `js.intermediates` its programs): what decides a traced program (SPEC "Reliability
    rules"), the model's structure and everything it holds by value (`model_key`: a
    config object it reads, class attributes, the contents of arrays it holds that are
    not its variables, which the trace fixes), the paths, shapes and dtypes of
    variables, the inputs' structure, shapes, dtypes and fixed values (each of its own
    type), the mode, `mutable` and the random keys' structure. None when part of it
    cannot be hashed or described by value (nothing is cached then)."""
    flat = adapter.flatten_variables(split.variables)[0]
    model = model_key(target, input_ids(x for _, x in flat))
    if model is None:
        return None
    variables = tuple((path, shape_key(x)) for path, x in flat)
    key = (
        type(adapter),
        adapter.structure_key(target),
        model,
        variables,
        tree_key((split.args, split.kwargs)),
        tree_key(split.mode),
        tree_key(split.mutable),
        tree_key(split.rngs),
    )
    try:
        hash(key)
    except TypeError:  # unhashable targets or arguments: no early stopping for them
        return None
    return key


def _remember(key: Any, graph: Graph, adapter: Adapter) -> None:
    """Keeps a complete graph's call counts and, where the model's structure is known,
    the graph itself (complete or partial)."""
    if key is None:
        return
    if not graph.partial:
        counts: dict[str, int] = {}
        for call in graph.calls:
            counts[call.name] = counts.get(call.name, 0) + 1
        _CALL_COUNTS.put(key, counts)
    if adapter.caches_traces:
        _GRAPHS.put(key, graph)


def stop_rule(
    adapter: Adapter, target: Any, split: Split, ends: list[Any] | None, key: Any = None
) -> markers.StopRule | None:
    """How to end a trace early once these boundaries (`stop_specs`) ran, or None.

    Only named ends qualify, and only where the adapter allows it (module names known at
    call time, no state that is returned only at the end). A name with a call index
    (``name@k``), or a record resolved on an earlier trace (which knows its call's
    index), stops after that call. A bare name stops after its call only if the
    same model, traced in full before with these variables, inputs and mode, called that
    module exactly once; otherwise the whole model is traced, so a repeated call is still
    reported as ambiguous. `key` is the split's `traced_key` where the caller has it.
    """
    points = [_stop_point(s) for s in ends] if ends is not None else [None]
    if None in points or not adapter.can_stop_early(split):
        return None
    if key is None:
        key = traced_key(adapter, target, split)
    known = _CALL_COUNTS.get(key, {})
    if any(index is None and known.get(base) != 1 for base, index in points):
        return None
    return markers.StopRule(_needs(points))


def _stop_point(spec: Any) -> tuple[str, int | None] | None:
    """The boundary and call index (None: not given) a trace can stop after for a parsed
    name or a record naming no iteration of a loop; None for any other end."""
    if isinstance(spec, Name) and not spec.given:
        return spec.base, spec.index
    if isinstance(spec, Selection) and spec.call is not None and spec.call.loop is None:
        return spec.call.name, spec.call.index
    return None


def _needs(points: list[tuple[str, int | None]]) -> dict[str, int]:
    """How many calls of each boundary must have returned (``name@k`` needs k + 1)."""
    needs: dict[str, int] = {}
    for base, index in points:
        needs[base] = max(needs.get(base, 0), (index or 0) + 1)
    return needs


# Python numbers among the variables: constants of a trace (`checks.check_numbers`).
_NUMBERS = (bool, int, float, complex)


@dataclasses.dataclass
class _Leaves:
    """A pytree split into traced leaves (arrays) and fixed ones."""

    treedef: Any
    mask: list[bool]
    statics: list[Any]
    arrays: list[Any]

    @classmethod
    def of(cls, leaves: Sequence[Any], treedef: Any = None) -> _Leaves:
        mask = [is_traced_leaf(x) for x in leaves]
        statics = [x for x, m in zip(leaves, mask, strict=True) if not m]
        return cls(treedef, mask, statics, [x for x, m in zip(leaves, mask, strict=True) if m])

    def merge(self, arrays: Sequence[Any]) -> list[Any]:
        a, s = iter(arrays), iter(self.statics)
        return [next(a) if m else next(s) for m in self.mask]

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, self.merge(arrays))


def trace_split(adapter: Adapter, target: Any, split: Split, stop_at: Any = None) -> Traced:
    """Traces a target from an existing split (new shapes, a new mode, ...), or takes a
    graph of the same model traced before at the same signature (`_cached_graph`)."""
    began = time.perf_counter()
    key = traced_key(adapter, target, split)
    graph = _cached_graph(key, adapter, target, split, stop_at)
    built = 0.0
    if graph is None:
        graph = _trace_widening(adapter, target, split, stop_at, key)
        _remember(key, graph, adapter)
        built = graph.build_seconds
    counts = adapter.parameter_counts(split.variables)
    seconds = time.perf_counter() - began
    return Traced(graph, adapter, target, split, counts, seconds, built)


def _cached_graph(
    key: Any, adapter: Adapter, target: Any, split: Split, stop_at: Any
) -> Graph | None:
    """The complete graph of this model and signature, or a partial one that reached
    every call a trace stopping at `stop_at` needs; None when neither is cached."""
    graph = _GRAPHS.get(key) if key is not None else None
    if graph is None or not graph.partial:
        return graph
    rule = stop_rule(adapter, target, split, stop_at, key)
    if rule is None or any(graph.reached.get(n, 0) < k for n, k in rule.needs.items()):
        return None
    return graph


def _trace_widening(
    adapter: Adapter, target: Any, split: Split, stop_at: Any, key: Any = None
) -> Graph:
    """Traces with the `mutable` asked for, or with more where the adapter says the
    model needs it (see `Adapter.wider_mutable`)."""
    try:
        return _trace_deep(adapter, target, split, split.mutable, stop_at, key)
    except ModelTraceError as error:
        wider = adapter.wider_mutable(split, error.__cause__)
        if wider is None:
            raise
        return _trace_deep(adapter, target, split, wider, stop_at)


# Marking adds two Python frames per module level, so a model nested nearly as deep as
# Python's recursion limit allows (linen handles about 150 levels) can overflow while
# jaxslice traces it. Such a trace is retried once with a higher limit, which is restored
# when the last deep trace ends (traces in other threads may overlap).
_DEEP_LIMIT = 20_000


def _raise_limit() -> Any:
    saved = sys.getrecursionlimit()
    sys.setrecursionlimit(max(saved, _DEEP_LIMIT))
    return lambda: sys.setrecursionlimit(saved)


def _trace_deep(
    adapter: Adapter, target: Any, split: Split, mutable: Any, stop_at: Any, key: Any = None
) -> Graph:
    """`_trace_once`, again with a higher recursion limit where the model went too deep;
    `key` is the split's `traced_key` (for the stop rule), if known."""
    try:
        return _trace_once(adapter, target, split, mutable, stop_at, key)
    except ModelTraceError as error:
        if not isinstance(error.__cause__, RecursionError):
            raise
    with SHARED.held({"recursion limit": _raise_limit}):
        return _trace_once(adapter, target, split, mutable, stop_at, key)


def _trace_once(
    adapter: Adapter, target: Any, split: Split, mutable: Any, stop_at: Any, key: Any = None
) -> Graph:
    var_flat, rebuild_variables = adapter.flatten_variables(split.variables)
    variables = _Leaves.of([x for _, x in var_flat])
    var_paths = [p for (p, _), m in zip(var_flat, variables.mask, strict=True) if m]
    rngs = _Leaves.of(*jax.tree_util.tree_flatten(split.rngs))
    inputs = _Leaves.of(*jax.tree_util.tree_flatten((split.args, split.kwargs)))
    info: dict[str, Any] = {"partial": False, "failed": [], "rule": None}
    remark = adapter.program_of(target)  # a slice's program marks its calls again

    def program(var_a: list[Any], rng_a: list[Any], in_a: list[Any]) -> Any:
        call_args, call_kwargs = inputs.rebuild(in_a)
        # A retry with wider `mutable` must not stop before the state comes back.
        rule = stop_rule(adapter, target, dataclasses.replace(split, mutable=mutable), stop_at, key)
        info["rule"] = rule
        try:
            with markers.marking(rule, remark) as info["failed"]:
                call = Split(
                    variables=rebuild_variables(variables.merge(var_a)),
                    rngs=rngs.rebuild(rng_a),
                    args=call_args,
                    kwargs={**call_kwargs, **split.mode},
                    mode=split.mode,
                    mutable=mutable,
                )
                out, state = adapter.call(target, call)
        except markers.StopTracing as stop:
            info["partial"] = True
            out, state = (), stop.state
        return _outputs(adapter, out, state, info)

    try:
        closed, _ = _compat.make_jaxpr(program, variables.arrays, rngs.arrays, inputs.arrays)
    except SliceError:
        raise
    except Exception as error:
        raise _model_error(adapter, split, error, info["failed"]) from error
    signature = Signature(
        variable_paths=var_paths,
        num_rngs=len(rngs.arrays),
        input_tree=inputs.treedef,
        input_is_array=inputs.mask,
        input_statics=inputs.statics,
        out_tree=info["tree"],
        out_statics=info["statics"],
        state_paths=info["state_paths"],
        number_variables={p: x for p, x in var_flat if isinstance(x, _NUMBERS)},
    )
    began = time.perf_counter()
    graph = build(closed, signature, name_scopes=adapter.name_scopes)
    return graph.freeze(
        partial=info["partial"],
        reached=dict(info["rule"].seen) if info["partial"] else {},
        build_seconds=time.perf_counter() - began,
    )


def _outputs(adapter: Adapter, out: Any, state: Any, info: dict[str, Any]) -> Any:
    """The program's results (output arrays, state arrays); the rest goes into `info`."""
    leaves, info["tree"] = jax.tree_util.tree_flatten(out)
    info["statics"] = {i: x for i, x in enumerate(leaves) if not is_traced_leaf(x)}
    state_flat = [(p, x) for p, x in adapter.flatten_state(state) if is_traced_leaf(x)]
    info["state_paths"] = [p for p, _ in state_flat]
    return [x for x in leaves if is_traced_leaf(x)], [x for _, x in state_flat]


def _model_error(
    adapter: Adapter, split: Split, error: Exception, failed: list[str]
) -> ModelTraceError:
    mode = f" (mode {split.mode}, mutable={split.mutable!r})" if split.mode or split.mutable else ""
    where = f" in the call of {failed[0]!r}" if failed else ""
    hint = adapter.error_hint(error) + _array_flag_hint(split, error)
    return ModelTraceError(
        mode=mode, where=where, kind=type(error).__name__, error=error, hint=hint
    )


def _array_flag_hint(split: Split, error: Exception) -> str:
    """Advice for a model that branched on a keyword given as a one-element array
    (``train=jnp.asarray(True)``), which jaxslice traces as an input."""
    if not isinstance(error, jax.errors.ConcretizationTypeError):
        return ""
    flags = [k for k, v in split.kwargs.items() if is_traced_leaf(v) and jax.numpy.size(v) == 1]
    if not flags:
        return ""
    return (
        f"\nThe keyword(s) {flags} are arrays, so they are traced as inputs; if the model "
        "branches on them as modes (train=, deterministic=), pass Python values instead "
        "(`train=True`)."
    )


_compat.register_frames_exclusion(__file__)
