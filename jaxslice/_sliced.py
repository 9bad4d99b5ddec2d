"""The `Sliced` object users hold: a sub-network as a compiled, trainable function.

A `Sliced` keeps the trace it was made from and one compiled entry per input signature
(shapes, dtypes and mode), like `jax.jit`. A new signature re-traces the whole model at
the new shapes (from `jax.ShapeDtypeStruct`s, no data), plans the same `start`/`end`
again and compiles the new cut. With a `start`, only the batch size may change: the
model's inputs are re-traced with the new leading dimension and the slice's inputs must
then match exactly.

Variables are passed explicitly (`apply`) in the same nesting as the model's, pruned to
what the slice reads; `sub.variables` holds the original arrays (no copies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat, _interpret, _plan, _trace
from ._errors import InputMismatchError, SliceError, VariablesMismatchError
from ._graph import Slot
from ._names import Resolver
from ._trace import Traced


@dataclasses.dataclass
class _Entry:
    traced: Traced
    plan: _plan.Plan
    fn: Any  # the re-emitted function, not jitted
    jitted: Any


def _make_entry(traced: Traced, start: Any, end: Any) -> _Entry:
    graph = traced.graph
    p = _plan.plan(graph, Resolver(graph), start, end)
    fn = _interpret.emit(graph, p.cut.eqns, [p.variable_ids, p.rng_ids, p.input_ids], p.output_ids)
    return _Entry(traced, p, fn, jax.jit(fn))


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


class Sliced:
    """A sub-network between named boundaries, as a standalone jit-compiled function.

    Create one with `js.slice`. Call it as ``sub(*inputs)`` with its own variables, or
    ``sub.apply(variables, *inputs)`` with variables of the same structure as
    ``sub.variables`` (for example after training them).

    Attributes:
      variables: the model variables the slice reads, with the model's nesting and keys
        (every collection), holding the original arrays.
      start: the `start` it was sliced with; end: the `end`.
    """

    def __init__(self, traced: Traced, start: Any, end: Any):
        self.start = start
        self.end = end
        entry = _make_entry(traced, start, end)
        self._base = entry
        self._entries: dict[Any, _Entry] = {}
        self._entries[self._signature(entry, self._traced_input_avals(entry), traced.split.mode)] = entry
        self._variables = prune(traced.split.variables, set(entry.plan.variable_paths))

    # ------------------------------------------------------------------ public

    @property
    def variables(self) -> Any:
        return self._variables

    @property
    def jaxpr(self) -> Any:
        """The re-emitted program (a closed jaxpr) for the shapes it was sliced with."""
        e = self._base
        graph = e.traced.graph
        avals = lambda ids: [jax.ShapeDtypeStruct(graph.avals[i].shape, graph.avals[i].dtype) for i in ids]  # noqa: E731
        closed, _ = _compat.make_jaxpr(
            e.fn, avals(e.plan.variable_ids), avals(e.plan.rng_ids), avals(e.plan.input_ids)
        )
        return closed

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.apply(self._variables, *inputs, **kwargs)

    def apply(self, variables: Any, *inputs: Any, rngs: Any = None, mutable: Any = False, **kwargs: Any) -> Any:
        """Runs the slice with the given variables.

        Args:
          variables: variables with the structure of ``sub.variables``.
          *inputs: the slice's inputs, one per start argument (see `js.slice`).
          rngs: random keys, as for the model's ``apply``.
          mutable: not supported yet; must be False.
          **kwargs: keyword inputs of the start boundaries, and mode keywords (such as
            ``train=True``) that are passed to the model; a new mode is traced once and
            cached.

        Returns:
          The values at ``end``: one pytree, a tuple, or a dict, as ``end`` was given.
        """
        if mutable:
            raise SliceError("`mutable` is not supported by this version of jaxslice; pass mutable=False.")
        base = self._base
        keyword_names = {a.keyword for a in base.plan.arguments if a.keyword is not None}
        kw_inputs = {k: v for k, v in kwargs.items() if k in keyword_names}
        mode = {**base.traced.split.mode, **{k: v for k, v in kwargs.items() if k not in keyword_names}}
        leaves = self._input_leaves(base.plan, inputs, kw_inputs)
        avals = tuple(_trace.abstract(x) for x in leaves)
        key = self._signature(base, avals, mode)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._retrace(leaves, avals, inputs, kw_inputs, mode)
            self._entries[key] = entry
        var_leaves = self._variable_leaves(entry.plan, variables)
        rng_leaves = self._rng_leaves(entry, rngs)
        outs = entry.jitted(var_leaves, rng_leaves, leaves)
        return _assemble(entry.plan.output_trees, entry.plan.output_ids, outs)

    def __repr__(self) -> str:
        p = self._base.plan
        n = sum(int(getattr(x, "size", 0)) for x in jax.tree_util.tree_leaves(self._variables))
        return (
            f"Sliced(start={self.start!r}, end={self.end!r}, equations={len(p.cut.eqns)}, "
            f"variables={len(p.variable_ids)} arrays/{n} values)"
        )

    # ------------------------------------------------------------------ inputs

    @staticmethod
    def _signature(entry: _Entry, avals: tuple[Any, ...], mode: Mapping[str, Any]) -> Any:
        shapes = tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, jax.ShapeDtypeStruct) else a for a in avals)
        return shapes, tuple(sorted((k, _hashable(v)) for k, v in mode.items()))

    @staticmethod
    def _traced_input_avals(entry: _Entry) -> tuple[Any, ...]:
        g = entry.traced.graph
        return tuple(jax.ShapeDtypeStruct(g.avals[i].shape, g.avals[i].dtype) for i in entry.plan.input_ids)

    def _input_leaves(self, plan: _plan.Plan, inputs: tuple[Any, ...], kw_inputs: dict[str, Any]) -> list[Any]:
        positional = [a for a in plan.arguments if a.keyword is None]
        if len(inputs) != len(positional):
            raise InputMismatchError(
                f"This slice takes {len(positional)} positional input(s) "
                f"({', '.join(_describe_argument(a) for a in positional) or 'none'}), got {len(inputs)}."
            )
        given = iter(inputs)
        leaves: list[Any] = []
        for arg in plan.arguments:
            value = kw_inputs.get(arg.keyword) if arg.keyword is not None else next(given)
            if arg.keyword is not None and arg.keyword not in kw_inputs:
                raise InputMismatchError(f"Missing keyword input {arg.keyword!r} ({_describe_argument(arg)}).")
            flat, tree = jax.tree_util.tree_flatten(value)
            if tree != arg.tree:
                raise InputMismatchError(
                    f"Input {_describe_argument(arg)} has structure {tree}, but the slice was traced "
                    f"with {arg.tree}. Pass a value of the same pytree structure."
                )
            for leaf, vid in zip(flat, arg.slot_ids, strict=True):
                if vid is not None:
                    leaves.append(leaf if _trace.is_traced_leaf(leaf) else jnp.asarray(leaf))
        return leaves

    def _retrace(
        self,
        leaves: list[Any],
        avals: tuple[Any, ...],
        inputs: tuple[Any, ...],
        kw_inputs: dict[str, Any],
        mode: dict[str, Any],
    ) -> _Entry:
        base = self._base
        split = base.traced.split
        expected = self._traced_input_avals(base)
        if base.plan.starts is None:
            args, kwargs = list(split.args), dict(split.kwargs)
            given = iter(inputs)
            for arg in base.plan.arguments:
                value = kw_inputs[arg.keyword] if arg.keyword is not None else next(given)
                value = jax.tree_util.tree_map(_trace.abstract, value)
                if arg.keyword is not None:
                    kwargs[arg.keyword] = value
                else:
                    args[arg.position] = value
            new_split = dataclasses.replace(split, args=tuple(args), kwargs=kwargs, mode=mode)
        else:
            batch = _new_batch_size(base, expected, avals)
            if batch is None:
                new_args, new_kwargs = split.args, split.kwargs
            else:
                resize = lambda x: (  # noqa: E731
                    jax.ShapeDtypeStruct((batch, *jnp.shape(x)[1:]), x.dtype)
                    if _trace.is_traced_leaf(x) and jnp.ndim(x) >= 1
                    else x
                )
                new_args = jax.tree_util.tree_map(resize, split.args)
                new_kwargs = jax.tree_util.tree_map(resize, split.kwargs)
            new_split = dataclasses.replace(split, args=new_args, kwargs=new_kwargs, mode=mode)
        traced = _trace.trace_split(base.traced.adapter, base.traced.target, new_split)
        entry = _make_entry(traced, self.start, self.end)
        got = self._traced_input_avals(entry)
        if base.plan.starts is not None and _shapes(got) != _shapes(avals):
            raise InputMismatchError(_mismatch_message(base, expected, avals))
        return entry

    # ------------------------------------------------------------------ variables

    def _variable_leaves(self, plan: _plan.Plan, variables: Any) -> list[Any]:
        flat = {
            p: x for p, x in jax.tree_util.tree_flatten_with_path(variables)[0] if _trace.is_traced_leaf(x)
        }
        missing = [p for p in plan.variable_paths if p not in flat]
        expected = set(plan.variable_paths)
        extra = [p for p in flat if p not in expected]
        if missing or extra:
            lines = []
            if missing:
                lines.append("missing: " + ", ".join(_path_str(p) for p in missing[:8]))
            if extra:
                lines.append("not used by the slice: " + ", ".join(_path_str(p) for p in extra[:8]))
            raise VariablesMismatchError(
                "The variables passed do not match the slice's variables ("
                + "; ".join(lines)
                + ").\nPass `sub.variables`, or variables of the same structure (for example the "
                "result of training them)."
            )
        return [flat[p] for p in plan.variable_paths]

    def _rng_leaves(self, entry: _Entry, rngs: Any) -> list[Any]:
        if not entry.plan.rng_ids:
            return []
        source = rngs if rngs is not None else entry.traced.split.rngs
        leaves = [x for x in jax.tree_util.tree_leaves(source) if _trace.is_traced_leaf(x)]
        position = {v: i for i, v in enumerate(entry.traced.graph.rng_ids)}
        if len(leaves) != len(position):
            raise SliceError(
                f"`rngs` must have the structure used when slicing ({len(position)} key(s)), got {rngs!r}."
            )
        return [leaves[position[v]] for v in entry.plan.rng_ids]


def _shapes(avals: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), str(a.dtype)) for a in avals)


def _new_batch_size(entry: _Entry, expected: tuple[Any, ...], got: tuple[Any, ...]) -> int | None:
    batch = None
    for e, g in zip(expected, got, strict=True):
        if str(e.dtype) != str(g.dtype) or len(e.shape) != len(g.shape) or tuple(e.shape[1:]) != tuple(g.shape[1:]):
            raise InputMismatchError(_mismatch_message(entry, expected, got))
        if e.shape and e.shape[0] != g.shape[0]:
            if batch is not None and batch != g.shape[0]:
                raise InputMismatchError(_mismatch_message(entry, expected, got))
            batch = int(g.shape[0])
    return batch


def _mismatch_message(entry: _Entry, expected: tuple[Any, ...], got: tuple[Any, ...]) -> str:
    fmt = lambda avals: ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)  # noqa: E731
    return (
        f"The slice's inputs were traced as ({fmt(expected)}) but got ({fmt(got)}).\n"
        "A slice with a `start` accepts a new batch size (the leading axis) but not other "
        "changes of shape or dtype. For other shapes, slice again with sample inputs of that "
        "shape, or use start=None."
    )


def _describe_argument(arg: _plan.Argument) -> str:
    where = f"keyword {arg.keyword!r}" if arg.keyword is not None else (
        f"argument {arg.position}" if arg.position is not None else "output"
    )
    return f"{arg.port.label} {where}"


def _assemble(trees: Any, output_ids: tuple[int, ...], values: list[Any]) -> Any:
    it = iter(values)

    def fill(tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda s: next(it) if s.id is not None else s.static, tree,
                                      is_leaf=lambda x: isinstance(x, Slot))

    if isinstance(trees, tuple):
        return tuple(fill(t) for t in trees)
    if isinstance(trees, dict):
        return {k: fill(t) for k, t in trees.items()}
    return fill(trees)


_EMPTY = object()


def prune(tree: Any, keep: set[tuple[Any, ...]], path: tuple[Any, ...] = ()) -> Any:
    """The part of `tree` whose leaves are at `keep` paths, keeping its nesting.

    Mappings lose the keys they no longer need; other containers keep their shape, with
    None where a subtree is not needed.

    >>> prune({"a": {"w": 1, "b": 2}, "c": [3, 4]}, {(jax.tree_util.DictKey("c"), jax.tree_util.SequenceKey(1))})
    {'c': [None, 4]}
    """
    out = _prune(tree, keep, path)
    return None if out is _EMPTY else out


def _prune(node: Any, keep: set[tuple[Any, ...]], path: tuple[Any, ...]) -> Any:
    if path in keep:
        return node
    children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1:  # a leaf that is not kept
        return _EMPTY
    kept = [_prune(child, keep, path + p) for p, child in children]
    if all(k is _EMPTY for k in kept):
        return _EMPTY
    if isinstance(node, Mapping):
        items = {p[0].key: k for (p, _), k in zip(children, kept, strict=True) if k is not _EMPTY}
        try:
            return type(node)(items)
        except TypeError:
            return items
    return jax.tree_util.tree_unflatten(treedef, [None if k is _EMPTY else k for k in kept])


_compat.register_frames_exclusion(__file__)
