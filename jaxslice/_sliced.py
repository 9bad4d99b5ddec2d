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
    p = _plan.plan(
        graph, Resolver(graph), start, end, traced.split.mutable, traced.adapter.state_owner_offset
    )
    fn = _interpret.emit(
        graph, p.program, [p.variable_ids, p.rng_ids, p.input_ids], p.output_ids + p.state_ids
    )
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
        split = traced.split
        key = (
            self._signature(self._traced_input_avals(entry), split.rngs, split.mode, split.mutable),
            traced.adapter.structure_key(traced.target),
        )
        self._entries: dict[Any, _Entry] = {key: entry}
        self._variables = (
            prune(split.variables, set(entry.plan.variable_paths))
            if traced.adapter.kind != "nnx"
            else None
        )
        self._variable_index: dict[Any, list[int]] = {}

    # ------------------------------------------------------------------ public

    @property
    def variables(self) -> Any:
        return self._variables

    @property
    def jaxpr(self) -> Any:
        """The re-emitted program (a closed jaxpr) for the shapes it was sliced with."""
        e = self._base
        graph = e.traced.graph
        avals = lambda ids: [
            jax.ShapeDtypeStruct(graph.avals[i].shape, graph.avals[i].dtype) for i in ids
        ]  # noqa: E731
        closed, _ = _compat.make_jaxpr(
            e.fn, avals(e.plan.variable_ids), avals(e.plan.rng_ids), avals(e.plan.input_ids)
        )
        return closed

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.apply(self._variables, *inputs, **kwargs)

    def apply(
        self, variables: Any, *inputs: Any, rngs: Any = None, mutable: Any = False, **kwargs: Any
    ) -> Any:
        """Runs the slice with the given variables, with linen's conventions.

        Args:
          variables: variables with the structure of ``sub.variables``.
          *inputs: the slice's inputs, one per start argument (see `js.slice`).
          rngs: random keys, as for the model's ``apply`` (``{"dropout": key}``); the
            same keys give the same random numbers as in the full model.
          mutable: collections whose updates to return, as for linen's ``apply``.
          **kwargs: keyword inputs of the start boundaries, and mode keywords (such as
            ``train=True``) passed to the model; each new mode is traced once and cached.

        Returns:
          The values at ``end`` (one pytree, a tuple or a dict, as ``end`` was given);
          with `mutable`, ``(values, updated_state)`` where the state holds only the
          slice's own entries.
        """
        base = self._base
        adapter = base.traced.adapter
        if adapter.kind == "plain" and (rngs is not None or mutable):
            raise SliceError(
                "A plain function takes random keys and state as ordinary inputs; `rngs` and "
                "`mutable` apply to Flax models only."
            )
        entry, leaves = self._lookup(inputs, kwargs, rngs, mutable)
        _check_mutable(entry.plan, mutable)
        var_leaves = self._variable_leaves(entry.plan, variables)
        rng_leaves = self._rng_leaves(entry, rngs)
        outs = entry.jitted(var_leaves, rng_leaves, leaves)
        n = len(entry.plan.output_ids)
        result = _assemble(entry.plan.output_trees, outs[:n])
        if not mutable:
            return result
        return result, _nest(entry.plan.state_paths, outs[n:])

    def _lookup(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], rngs: Any, mutable: Any
    ) -> tuple[_Entry, list[Any]]:
        """The compiled entry for these arguments (tracing it if new), and the input leaves."""
        base = self._base
        keyword_names = {a.keyword for a in base.plan.arguments if a.keyword is not None}
        kw_inputs = {k: v for k, v in kwargs.items() if k in keyword_names}
        new_mode = {k: v for k, v in kwargs.items() if k not in keyword_names}
        self._check_mode(new_mode)
        mode = {**base.traced.split.mode, **new_mode}
        leaves = self._input_leaves(base.plan, inputs, kw_inputs)
        avals = tuple(_trace.abstract(x) for x in leaves)
        traced = base.traced
        key = (
            self._signature(avals, rngs, mode, mutable),
            traced.adapter.structure_key(traced.target),
        )
        entry = self._entries.get(key)
        if entry is None:
            entry = self._retrace(avals, inputs, kw_inputs, mode, rngs, mutable)
            self._entries[key] = entry
        return entry, leaves

    def _forget_values(self) -> None:
        """Drops references to the model's arrays (keeping shapes), for long-lived caches.

        Afterwards the slice must be run with variables passed in (`_apply_full`).
        """
        traced = self._base.traced
        abstract = lambda t: jax.tree_util.tree_map(_trace.abstract, t)  # noqa: E731
        traced.split = dataclasses.replace(traced.split, variables=abstract(traced.split.variables))
        traced.variable_leaves = [_trace.abstract(x) for x in traced.variable_leaves]
        self._variables = abstract(self._variables)

    def _apply_full(
        self, variables: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rngs: Any
    ) -> Any:
        """Runs a slice from the model's inputs given the model's full variables."""
        entry, leaves = self._lookup(tuple(a for a in args), kwargs, rngs, False)
        var_leaves = self._variable_leaves(entry.plan, variables, strict=False)
        outs = entry.jitted(var_leaves, self._rng_leaves(entry, rngs), leaves)
        return _assemble(entry.plan.output_trees, outs[: len(entry.plan.output_ids)])

    def extract(self, full_variables: Any) -> Any:
        """The slice's part of a model's full variables (the inverse of `merge`).

        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
        >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
        >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
        >>> head = js.slice(model, variables, jnp.ones((1, 3)), start="layers_1")
        >>> list(head.extract(variables)["params"])
        ['layers_1']
        """
        paths = set(self._base.plan.variable_paths)
        found = {p for p, _ in jax.tree_util.tree_flatten_with_path(full_variables)[0]}
        missing = sorted(_path_str(p) for p in paths - found)
        if missing:
            raise VariablesMismatchError(
                "These variables lack entries the slice reads: " + ", ".join(missing[:8]) + "."
            )
        return prune(full_variables, paths)

    def merge(self, full_variables: Any, new_variables: Any) -> Any:
        """The model's variables with the slice's entries replaced by `new_variables`.

        The fine-tune-then-write-back round trip: `new_variables` has the structure of
        ``sub.variables`` (or is a part of it, such as the updated state returned with
        `mutable`). Leaves outside it are the same objects as in `full_variables`.

        Raises:
          VariablesMismatchError: if `new_variables` holds a path the model does not have.
        """
        updates = {p: x for p, x in jax.tree_util.tree_flatten_with_path(new_variables)[0]}
        flat, treedef = jax.tree_util.tree_flatten_with_path(full_variables)
        known = {p for p, _ in flat}
        unknown = [p for p in updates if p not in known]
        if unknown:
            raise VariablesMismatchError(
                "Cannot merge: the model's variables have no entry at "
                + ", ".join(_path_str(p) for p in unknown[:8])
                + ".\nPass the model's full variables first and the slice's variables second: "
                "`sub.merge(variables, new_sub_variables)`."
            )
        leaves = [updates.get(p, x) for p, x in flat]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    # ------------------------------------------------------------------ views

    def _dag(self, depth: int | None, whole: bool) -> Any:
        from . import _listing
        from .render import module_graph

        entry = self._base
        if entry.traced.graph.partial:  # traced only up to the ends: draw the whole model
            if getattr(self, "_full", None) is None:
                full = _trace.trace_split(
                    entry.traced.adapter, entry.traced.target, entry.traced.split
                )
                self._full = _make_entry(full, self.start, self.end)
            entry = self._full
        traced = entry.traced
        params = {b.name: b.param_count for b in _listing.describe(traced)}
        in_slice = None if whole else set(entry.plan.cut.eqns)
        return module_graph(traced.graph, depth=depth, parameters=params, in_slice=in_slice)

    def to_networkx(self, depth: int | None = None) -> Any:
        """The module-level DAG of the model, nodes marked ``in_slice`` (a networkx DiGraph).

        Args:
          depth: the deepest module path level shown; deeper calls fold into their parent.
        """
        return self._dag(depth, whole=False)

    def to_dot(self, depth: int | None = None, annotations: dict[str, Any] | None = None) -> str:
        """Graphviz DOT source of the model with this slice's region highlighted.

        Args:
          depth: the deepest module path level drawn (clusters collapse below it).
          annotations: ``{boundary name: value}`` drawn on the nodes (e.g. coverage).
        """
        from .render import to_dot

        return to_dot(self._dag(depth, whole=False), annotations=annotations)

    def render(
        self, path: Any, depth: int | None = None, annotations: dict[str, Any] | None = None
    ) -> str:
        """Renders `to_dot` to an SVG/PNG/PDF file with Graphviz's `dot` (by suffix)."""
        from .render import render_dot

        return render_dot(self.to_dot(depth, annotations), path)

    def __repr__(self) -> str:
        p = self._base.plan
        n = sum(int(getattr(x, "size", 0)) for x in jax.tree_util.tree_leaves(self._variables))
        return (
            f"Sliced(start={self.start!r}, end={self.end!r}, equations={len(p.cut.eqns)}, "
            f"variables={len(p.variable_ids)} arrays/{n} values)"
        )

    # ------------------------------------------------------------------ inputs

    @staticmethod
    def _signature(avals: tuple[Any, ...], rngs: Any, mode: Mapping[str, Any], mutable: Any) -> Any:
        shapes = tuple(
            (tuple(a.shape), str(a.dtype)) if isinstance(a, jax.ShapeDtypeStruct) else a
            for a in avals
        )
        rng_leaves, rng_tree = jax.tree_util.tree_flatten(rngs)
        rng_sig = (
            rng_tree,
            tuple((tuple(jnp.shape(k)), str(jnp.result_type(k))) for k in rng_leaves),
        )
        if mutable is True or not mutable:
            mut = bool(mutable)
        else:
            mut = (mutable,) if isinstance(mutable, str) else tuple(sorted(mutable))
        return shapes, rng_sig, tuple(sorted((k, _hashable(v)) for k, v in mode.items())), mut

    def _check_mode(self, mode: Mapping[str, Any]) -> None:
        if not mode:
            return
        traced = self._base.traced
        accepted = traced.adapter.accepted_keywords(traced.target)
        unknown = [k for k in mode if accepted is not None and k not in accepted]
        if unknown:
            raise SliceError(
                f"The model does not accept the keyword argument(s) {unknown}; it accepts "
                f"{sorted(accepted or ())}. Mode keywords such as `train=True` are passed to the model."
            )

    @staticmethod
    def _traced_input_avals(entry: _Entry) -> tuple[Any, ...]:
        g = entry.traced.graph
        return tuple(
            jax.ShapeDtypeStruct(g.avals[i].shape, g.avals[i].dtype) for i in entry.plan.input_ids
        )

    def _input_leaves(
        self, plan: _plan.Plan, inputs: tuple[Any, ...], kw_inputs: dict[str, Any]
    ) -> list[Any]:
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
                raise InputMismatchError(
                    f"Missing keyword input {arg.keyword!r} ({_describe_argument(arg)})."
                )
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
        avals: tuple[Any, ...],
        inputs: tuple[Any, ...],
        kw_inputs: dict[str, Any],
        mode: dict[str, Any],
        rngs: Any,
        mutable: Any,
    ) -> _Entry:
        base = self._base
        split = base.traced.adapter.resplit(base.traced.target, base.traced.split)
        expected = self._traced_input_avals(base)
        rngs = jax.tree_util.tree_map(_trace.abstract, rngs)
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
            new_args, new_kwargs = tuple(args), kwargs
        else:
            batch = _new_batch_size(base, expected, avals)
            if batch is None:
                new_args, new_kwargs = split.args, split.kwargs
            else:
                resize = (
                    lambda x: (  # noqa: E731
                        jax.ShapeDtypeStruct((batch, *jnp.shape(x)[1:]), x.dtype)
                        if _trace.is_traced_leaf(x) and jnp.ndim(x) >= 1
                        else x
                    )
                )
                new_args = jax.tree_util.tree_map(resize, split.args)
                new_kwargs = jax.tree_util.tree_map(resize, split.kwargs)
        new_split = dataclasses.replace(
            split, args=new_args, kwargs=new_kwargs, mode=mode, rngs=rngs, mutable=mutable
        )
        stop_at = _trace.stop_specs(self.start, self.end)
        traced = _trace.trace_split(base.traced.adapter, base.traced.target, new_split, stop_at)
        entry = _make_entry(traced, self.start, self.end)
        got = self._traced_input_avals(entry)
        if base.plan.starts is not None and _shapes(got) != _shapes(avals):
            raise InputMismatchError(_mismatch_message(base, expected, avals))
        return entry

    # ------------------------------------------------------------------ variables

    def _variable_leaves(self, plan: _plan.Plan, variables: Any, strict: bool = True) -> list[Any]:
        leaves, treedef = jax.tree_util.tree_flatten(variables)
        cache_key = (treedef, plan.variable_paths, strict)
        index = self._variable_index.get(cache_key)
        if index is None:
            index = self._index_variables(plan, variables, strict)
            self._variable_index[cache_key] = index
        return [leaves[i] for i in index]

    def _index_variables(self, plan: _plan.Plan, variables: Any, strict: bool = True) -> list[int]:
        flat = jax.tree_util.tree_flatten_with_path(variables)[0]
        position = {p: i for i, (p, x) in enumerate(flat) if _trace.is_traced_leaf(x)}
        allowed = {p for p, _ in jax.tree_util.tree_flatten_with_path(self._variables)[0]}
        missing = [p for p in plan.variable_paths if p not in position]
        extra = [p for p in position if p not in allowed] if strict else []
        if missing or extra:
            lines = []
            if missing:
                new = [p for p in missing if p not in allowed]
                lines.append("missing: " + ", ".join(_path_str(p) for p in missing[:8]))
                if new:
                    lines.append(
                        "(this mode reads variables that `sub.variables` lacks; slice with this mode)"
                    )
            if extra:
                lines.append("not used by the slice: " + ", ".join(_path_str(p) for p in extra[:8]))
            raise VariablesMismatchError(
                "The variables passed do not match the slice's variables ("
                + "; ".join(lines)
                + ").\nPass `sub.variables`, or variables of the same structure (for example the "
                "result of training them)."
            )
        return [position[p] for p in plan.variable_paths]

    def _rng_leaves(self, entry: _Entry, rngs: Any) -> list[Any]:
        if not entry.plan.rng_ids:
            return []
        leaves = [x for x in jax.tree_util.tree_leaves(rngs) if _trace.is_traced_leaf(x)]
        position = {v: i for i, v in enumerate(entry.traced.graph.rng_ids)}
        return [leaves[position[v]] for v in entry.plan.rng_ids]


def _check_mutable(plan: _plan.Plan, mutable: Any) -> None:
    """linen's rules: updated state must be asked for, and what is asked for must exist."""
    if not mutable and plan.updated_collections:
        names = list(plan.updated_collections)
        raise SliceError(
            f"In this mode the slice updates {names}; pass mutable={names} to get the updates "
            "(as `(outputs, updates)`), as linen's `apply` requires."
        )
    if mutable and not plan.state_paths:
        wanted = "any collection" if mutable is True else repr(mutable)
        raise SliceError(
            f"mutable={wanted}, but the slice has no state there (it has {list(plan.state_collections)}). "
            "Pass mutable=False, or collections the slice's modules use (e.g. ['batch_stats'])."
        )


def _shapes(avals: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), str(a.dtype)) for a in avals)


def _new_batch_size(entry: _Entry, expected: tuple[Any, ...], got: tuple[Any, ...]) -> int | None:
    batch = None
    for e, g in zip(expected, got, strict=True):
        if (
            str(e.dtype) != str(g.dtype)
            or len(e.shape) != len(g.shape)
            or tuple(e.shape[1:]) != tuple(g.shape[1:])
        ):
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
    where = (
        f"keyword {arg.keyword!r}"
        if arg.keyword is not None
        else (f"argument {arg.position}" if arg.position is not None else "output")
    )
    return f"{arg.port.label} {where}"


def _assemble(trees: Any, values: list[Any]) -> Any:
    it = iter(values)

    def fill(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda s: next(it) if s.id is not None else s.static,
            tree,
            is_leaf=lambda x: isinstance(x, Slot),
        )

    if isinstance(trees, tuple):
        return tuple(fill(t) for t in trees)
    if isinstance(trees, dict):
        return {k: fill(t) for k, t in trees.items()}
    return fill(trees)


def _nest(paths: tuple[tuple[Any, ...], ...], values: list[Any]) -> dict[Any, Any]:
    """Nested dicts from key paths, as linen returns updated collections."""
    out: dict[Any, Any] = {}
    for path, value in zip(paths, values, strict=True):
        node = out
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return out


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
