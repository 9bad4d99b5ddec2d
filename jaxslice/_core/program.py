"""The engine (stage 5): a planned slice as compiled entries, one per call signature.

A `SliceProgram` keeps the trace and plan it was made from and one compiled entry per
input signature (shapes, dtypes, mode, `mutable` and the structure of `rngs`), like
`jax.jit`. A new signature re-traces the model at the new shapes (from
`jax.ShapeDtypeStruct`s, no data), plans the same `start`/`end` again and compiles the
new cut. With a `start`, only the batch size may change. Every view users hold — `Sliced`,
the NNX slice module, `js.intermediates`, observers, interpreters, the editor — is a thin
layer over this class's public methods.

Calls (`apply`) go through one `jax.jit` per mode and `mutable`, whose own cache is keyed
by the structure, shapes and dtypes of the variables and inputs: jaxslice's lookup and
checks run when that function traces, so a repeated call costs what a jitted function
costs, and a call whose leaves differ in any way traces, and is checked, again. Arguments
`jax.jit` cannot take as they are (strings, Python numbers where the trace fixed them) and
errors are redone on the checked path, which gives the reference behaviour.

The program keeps only what it needs: the variables the slice reads (the original
arrays, pruned) and the shapes of everything else.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat
from .._caches import LRU
from .._errors import InputMismatchError, ModelTraceError, SliceError, VariablesMismatchError
from .._trees import (
    abstract,
    abstract_tree,
    hashable,
    is_traced_leaf,
    is_weak,
    nest,
    path_str,
    prune,
    tree_key,
)
from . import emit as emit_
from . import loops
from .checks import check_alive, check_leaves, check_mutable, mode_value
from .plan import Plan, StateRules, plan
from .trace import Traced, stop_specs, trace, trace_split

#: compiled entries kept per slice (input signatures, modes)
MAX_ENTRIES = 32


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """How a slice was built: time spent, program size, and whether tracing stopped early.

    Attributes:
      trace_seconds: tracing the model (`jax.make_jaxpr` with boundary markers).
      analysis_seconds: building the graph and planning the slice.
      equations: equations in the traced program (after inlining).
      stopped_early: tracing ended once every end of the slice had been computed.
    """

    trace_seconds: float
    analysis_seconds: float
    equations: int
    stopped_early: bool


@dataclasses.dataclass
class Entry:
    """One compiled slice for one call signature."""

    traced: Traced
    plan: Plan
    fn: Any  # the re-emitted function, not jitted
    jitted: Any
    #: ``{(variables treedef, strict): leaf positions}`` (`SliceProgram.variable_leaves`)
    indexes: LRU = dataclasses.field(default_factory=lambda: LRU(MAX_ENTRIES), repr=False)

    @functools.cached_property
    def variable_avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The shape and dtype traced for each variable the entry reads."""
        return _avals(self, self.plan.variable_ids)

    @functools.cached_property
    def static_outputs(self) -> bool:
        """Whether some output leaves are constants of the trace, not arrays (`jax.jit`
        would turn them into arrays)."""
        slots = jax.tree_util.tree_leaves(self.plan.output_trees)  # `Slot`s are leaves
        return len(slots) != len(self.plan.output_ids)


def make_entry(traced: Traced, start: Any, end: Any) -> Entry:
    refs = loops.loop_refs(traced.graph, start, end)
    if refs:  # names of iterations inside scans: plan on the loops written out
        traced = dataclasses.replace(traced, graph=loops.expanded(traced.graph, refs))
    adapter = traced.adapter
    rules = StateRules(adapter.state_owner, adapter.state_includes_variables)
    p = plan(traced.graph, start, end, traced.split.mutable, rules)
    ids = [p.variable_ids, p.rng_ids, p.input_ids]
    fn = emit_.emit(traced.graph, p.program, ids, p.output_ids + p.state_ids)
    return Entry(traced, p, fn, jax.jit(fn))


def _avals(entry: Entry, ids: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    g = entry.traced.graph
    return tuple(jax.ShapeDtypeStruct(g.avals[i].shape, g.avals[i].dtype) for i in ids)


class SliceProgram:
    """A sub-network between named boundaries of one model, compiled per signature."""

    def __init__(self, traced: Traced, start: Any, end: Any):
        began = time.perf_counter()
        self.start, self.end = start, end
        self.adapter = traced.adapter
        # A model that is a pytree of its arrays is kept as its structure only.
        self.target = traced.target = self.adapter.skeleton(traced.target)
        self.base = make_entry(traced, start, end)
        self.build_info = BuildInfo(
            traced.seconds - traced.build_seconds,
            traced.build_seconds + time.perf_counter() - began,
            len(traced.graph.eqns),
            traced.graph.partial,
        )
        holds = self.adapter.holds_variables
        split = traced.split
        paths = set(self.base.plan.variable_paths)
        self.variables = None if holds else prune(split.variables, paths)
        # Keep shapes, not the model's arrays: re-tracing needs nothing more.
        if not holds:
            traced.split = dataclasses.replace(split, variables=abstract_tree(split.variables))
        self._entries = LRU(MAX_ENTRIES)
        self._keywords = frozenset(a.keyword for a in self.base.plan.arguments)
        base_key = self._key(
            _signature(self._traced_avals(self.base)), split.rngs, split.mode, split.mutable
        )
        self._entries.put(base_key, self.base)
        #: one `jax.jit` of `apply` per mode and `mutable` (or `_CHECKED`: not jitted)
        self._jits = LRU(MAX_ENTRIES)
        # Without a structure key, the target (which a program never swaps) decides the
        # program: the usual call's key is a constant.
        fixed = self.adapter.structure_key(self.target) is None
        self._usual_key = (None,) if fixed else None

    @classmethod
    def build(
        cls,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        start: Any = None,
        end: Any = None,
        *,
        stop_early: bool = True,
        adapter: Any = None,
    ) -> SliceProgram:
        """Traces `target` (stopping once `end` is computed, where possible) and plans."""
        stop_at = stop_specs(start, end) if stop_early else None
        return cls(trace(target, args, kwargs, stop_at, adapter), start, end)

    # ------------------------------------------------------------------ running

    def apply(
        self,
        variables: Any,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        rngs: Any = None,
        mutable: Any = False,
        strict: bool = True,
    ) -> Any:
        """Runs the slice with linen's conventions (see `js.Sliced.apply`); with `mutable`,
        ``(values, state)``, the state nested as linen returns it.

        Through one `jax.jit` per mode and `mutable` where it can (see the module's
        docstring), else (and to raise any error) through `apply_checked`.
        """
        modes = {k: v for k, v in kwargs.items() if k not in self._keywords}
        if any(map(is_traced_leaf, modes.values())):  # an array mode (`train=jnp.asarray(True)`)
            self._check_mode(modes)  # an unknown keyword is named as such, not as a mode
            kwargs = {**kwargs, **{k: mode_value(k, v) for k, v in modes.items()}}
        key = self._jit_key(kwargs, rngs, mutable, strict)
        try:
            jitted = self._jits.peek(key) or self._new_jitted(key, kwargs, mutable)
        except TypeError:  # an unhashable mode value or structure key
            jitted = _CHECKED
        if jitted is _CHECKED:
            return self.apply_checked(variables, inputs, kwargs, rngs, mutable, strict)
        try:
            return jitted(variables, inputs)
        except _REDO:
            pass  # outside the handler, so that an error raised again is not chained
        except RuntimeError:
            check_alive(variables, inputs)
            raise
        return self._redo(key, variables, inputs, kwargs, rngs, mutable, strict)

    def call(self, variables: Any, inputs: tuple[Any, ...]) -> Any:
        """``apply(variables, inputs, {})``, the usual call (``sub(x)``), by the shortest
        path: one dict read and the jitted function."""
        key = self._usual_key or (self.adapter.structure_key(self.target),)  # as `_jit_key`
        try:
            jitted = self._jits.peek(key)
        except TypeError:  # an unhashable structure key
            jitted = None
        if jitted is None or jitted is _CHECKED:
            return self.apply(variables, inputs, {})
        try:
            return jitted(variables, inputs)
        except _REDO:
            pass
        except RuntimeError:
            check_alive(variables, inputs)
            raise
        return self._redo(key, variables, inputs, {})

    def _redo(self, key: Any, variables: Any, inputs: Any, kwargs: Any, *rest: Any) -> Any:
        """`apply_checked` after the jitted function failed: it raises the error as jaxslice
        does, or, if the arguments are fine but not for `jax.jit`, calls of this key are
        not jitted from now on."""
        out = self.apply_checked(variables, inputs, kwargs, *rest)
        self._jits.put(key, _CHECKED)
        return out

    def apply_checked(
        self,
        variables: Any,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        rngs: Any = None,
        mutable: Any = False,
        strict: bool = True,
        jitting: bool = False,
    ) -> Any:
        """`apply` with jaxslice's lookup and checks (run as `jax.jit` traces `apply`, with
        `jitting`, where it fails on outputs that are not arrays)."""
        if not self.adapter.has_collections and (rngs is not None or mutable):
            raise SliceError(NO_COLLECTIONS)
        entry, leaves = self.lookup(inputs, kwargs, rngs, mutable)
        if jitting and entry.static_outputs:
            raise _NotJittable(entry)
        var_leaves = self.variable_leaves(entry, variables, strict)
        out = self.run(entry, var_leaves, self.rng_leaves(entry, rngs), leaves, mutable)
        return _nest_state(*out) if mutable else out

    def _jit_key(self, kwargs: dict[str, Any], rngs: Any, mutable: Any, strict: bool) -> Any:
        """The key of `apply`'s jitted function for a call, or None where calls of this
        kind are not jitted: random keys (`jax.jit` would take Python numbers as keys),
        keyword inputs."""
        if rngs is not None or not strict or not self._keywords.isdisjoint(kwargs):
            return None
        structure = self.adapter.structure_key(self.target)
        if mutable is False and not kwargs:
            return (structure,)  # the usual call's key (`call`)
        collections = tuple(mutable) if isinstance(mutable, list) else mutable
        return tuple(kwargs.items()), collections, structure

    def _new_jitted(self, key: Any, kwargs: dict[str, Any], mutable: Any) -> Any:
        """`apply` under `jax.jit` for calls of this key (`_CHECKED` for the None key)."""
        if key is None:
            return _CHECKED
        traced = functools.partial(_jitted_apply, weakref.ref(self), dict(kwargs), mutable)
        jitted = jax.jit(traced)
        self._jits.put(key, jitted)
        return jitted

    def apply_full(self, split: Any) -> tuple[Any, list[tuple[Any, Any]]]:
        """Runs a slice that starts at the model's inputs from a split of the full call.

        Variables are the model's full variables (or, for a model that holds them, read
        from it now, and updated state is written back). Returns ``(values, state)``.
        """
        kwargs = {**split.kwargs, **split.mode}
        entry, leaves = self.lookup(split.args, kwargs, split.rngs, split.mutable)
        var_leaves = self.model_variable_leaves(entry, split.variables)
        rng_leaves = self.rng_leaves(entry, split.rngs)
        out = self.run(entry, var_leaves, rng_leaves, leaves, split.mutable)
        values, state = out if split.mutable else (out, [])
        self.adapter.write_back(self.target, state)
        return values, state

    def model_variable_leaves(self, entry: Entry, variables: Any) -> list[Any]:
        """The leaves an entry reads, from the model's full variables (or, for a model
        that holds its variables, from the model as it is now)."""
        if not self.adapter.holds_variables:
            return self.variable_leaves(entry, variables, strict=False)
        live = self.adapter.live_variables(self.target)
        leaves = [live[p] for p in entry.plan.variable_paths]
        check_leaves(entry.plan.variable_paths, leaves, entry.variable_avals)
        return leaves

    def run(
        self,
        entry: Entry,
        var_leaves: list[Any],
        rng_leaves: list[Any],
        leaves: list[Any],
        mutable: Any,
    ) -> Any:
        """Runs a compiled entry; with `mutable`, returns ``(outputs, updated_state)``."""
        check_mutable(entry.plan, mutable, self.adapter)
        try:
            outs = entry.jitted(var_leaves, rng_leaves, leaves)
        except RuntimeError:
            check_alive(var_leaves, leaves, entry.plan.variable_paths)
            raise
        n = len(entry.plan.output_ids)
        result = emit_.assemble(entry.plan.output_trees, outs[:n])
        if not mutable:
            return result
        return result, list(zip(entry.plan.state_paths, outs[n:], strict=True))

    def lookup(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], rngs: Any, mutable: Any
    ) -> tuple[Entry, list[Any]]:
        """The compiled entry for these arguments (tracing it if new), and the input leaves."""
        kw_inputs, mode = self._split_kwargs(kwargs)
        leaves = self._input_leaves(inputs, kw_inputs)
        key = self._key(_signature(leaves), rngs, mode, mutable)
        entry = self._entries.get(key)
        if entry is None:
            split = self.base.traced.split
            call = dataclasses.replace(split, mode=mode, rngs=rngs, mutable=mutable)
            avals = tuple(abstract(x) for x in leaves)
            entry = self._retrace(avals, inputs, kw_inputs, call)
            self._entries.put(key, entry)
        return entry, leaves

    def _split_kwargs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(keyword inputs, mode)`` of a call's keyword arguments."""
        mode = self.base.traced.split.mode
        if not kwargs:
            return {}, mode
        new_mode = {k: v for k, v in kwargs.items() if k not in self._keywords}
        self._check_mode(new_mode)
        kw_inputs = {k: v for k, v in kwargs.items() if k in self._keywords}
        return kw_inputs, {**mode, **new_mode}

    def _key(self, signature: tuple[Any, ...], rngs: Any, mode: Any, mutable: Any) -> Any:
        return (
            signature,
            _static_key(rngs),
            tuple(sorted((k, hashable(v)) for k, v in mode.items())),
            _static_key(mutable),
            hashable(self.adapter.structure_key(self.target)),
        )

    # ------------------------------------------------------------------ inputs

    def _check_mode(self, mode: Mapping[str, Any]) -> None:
        if not mode:
            return
        accepted = self.adapter.accepted_keywords(self.target)
        unknown = [k for k in mode if accepted is not None and k not in accepted]
        if unknown:
            raise SliceError(
                UNKNOWN_KEYWORDS.format(unknown=unknown, accepted=sorted(accepted or ()))
            )

    def _input_leaves(self, inputs: tuple[Any, ...], kw_inputs: dict[str, Any]) -> list[Any]:
        arguments = self.base.plan.arguments
        inputs = self._like_the_model(inputs)
        _check_arity(arguments, inputs)
        given = iter(inputs)
        leaves: list[Any] = []
        for arg in arguments:
            if arg.keyword is None:
                leaves += _argument_leaves(arg, next(given))
            elif arg.keyword in kw_inputs:
                leaves += _argument_leaves(arg, kw_inputs[arg.keyword])
            else:
                raise InputMismatchError(
                    f"Missing keyword input {arg.keyword!r} ({arg.describe()})."
                )
        return leaves

    def _like_the_model(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """The array arguments of a slice from the model's inputs called as the model is
        (every positional argument, ``None`` and flags included), once the others are
        checked to be what the trace fixed; other calls' inputs, unchanged."""
        traced = self.base.traced.split.args
        taken = [a.position for a in self.base.plan.arguments if a.keyword is None]
        if self.base.plan.starts is not None or len(inputs) in (len(taken), 0):
            return inputs
        if len(inputs) != len(traced):
            return inputs  # `_check_arity` says what the slice takes
        for i, (given, fixed) in enumerate(zip(inputs, traced, strict=True)):
            if i not in taken and tree_key(given) != tree_key(fixed):
                raise InputMismatchError(FIXED_ARGUMENT.format(i=i, fixed=fixed, given=given))
        return tuple(inputs[i] for i in taken)

    def _traced_avals(self, entry: Entry) -> tuple[jax.ShapeDtypeStruct, ...]:
        return _avals(entry, entry.plan.input_ids)

    def _retrace(
        self, avals: tuple[Any, ...], inputs: tuple[Any, ...], kw_inputs: dict[str, Any], call: Any
    ) -> Entry:
        """The entry for new input shapes. With a start, the model is traced again with its
        inputs at the new batch size: each input's batch axis is taken to be the one of the
        old batch size, the leading one first; where that fails (an iterations-first
        ``xs[layers, batch, ...]`` whose two sizes are equal), a later one."""
        base = self.base
        split = self.adapter.resplit(self.target, base.traced.split)
        split = dataclasses.replace(
            split, mode=call.mode, rngs=abstract_tree(call.rngs), mutable=call.mutable
        )
        error: Exception | None = None
        for later in (False, True):
            new = self._new_inputs(split, avals, inputs, kw_inputs, later)
            if later and new is None:
                break
            try:
                traced = trace_split(
                    self.adapter,
                    self.target,
                    dataclasses.replace(split, **(new or {})),
                    stop_specs(self.start, self.end),
                )
            except ModelTraceError as failed:
                if not new:
                    raise
                error = failed
                continue
            entry = make_entry(traced, self.start, self.end)
            if base.plan.starts is None or _shapes(self._traced_avals(entry)) == _shapes(avals):
                return entry
            error = InputMismatchError(_mismatch_message(self._traced_avals(base), avals))
        if isinstance(error, ModelTraceError):
            raise InputMismatchError(NEW_BATCH.format(error=error)) from error
        raise error or AssertionError("no re-trace was tried")

    def _new_inputs(
        self,
        split: Any,
        avals: tuple[Any, ...],
        inputs: tuple[Any, ...],
        kw_inputs: dict,
        later: bool = False,
    ) -> dict[str, Any] | None:
        """The model's inputs for a re-trace at the shapes of `avals` (empty: as they
        were); with `later`, the batch axis of each is its last axis of the old batch size
        (None where that is the choice already tried)."""
        if self.base.plan.starts is None:
            return None if later else _model_inputs(self.base.plan, split, inputs, kw_inputs)
        expected = self._traced_avals(self.base)
        batch = _new_batch_size(expected, avals)
        if batch is None:
            return None if later else {}
        old = next(e.shape[0] for e in expected if e.shape and not _same_dim(e.shape[0], batch))
        axes = [_batch_axis(x, old, later) for x in jax.tree_util.tree_leaves(split.args)]
        axes += [_batch_axis(x, old, later) for x in jax.tree_util.tree_leaves(split.kwargs)]
        if later and all(a in (None, 0) for a in axes):
            return None
        resize = lambda x: _with_batch(x, _batch_axis(x, old, later), batch)  # noqa: E731
        return {
            "args": jax.tree_util.tree_map(resize, split.args),
            "kwargs": jax.tree_util.tree_map(resize, split.kwargs),
        }

    # ------------------------------------------------------------------ variables

    def variable_leaves(self, entry: Entry, variables: Any, strict: bool = True) -> list[Any]:
        """The leaves of `variables` the entry reads, checked against the traced shapes."""
        leaves, treedef = jax.tree_util.tree_flatten(variables)
        # Per entry and treedef: where its paths are was found once, by `_index_variables`.
        index = entry.indexes.get((treedef, strict))
        if index is None:
            index = self._index_variables(entry, variables, strict)
            entry.indexes.put((treedef, strict), index)
        picked = [leaves[i] for i in index]
        check_leaves(entry.plan.variable_paths, picked, entry.variable_avals)
        return picked

    def _index_variables(self, entry: Entry, variables: Any, strict: bool) -> list[int]:
        position = _array_positions(variables)
        own = self._own_paths()
        missing = _absent(entry.plan.variable_paths, position)
        extra = _absent(position, own) if strict else []
        if missing or extra:
            lacks = bool(_absent(missing, own))
            why = _call_differs(self.base.traced.split, entry.traced.split) if lacks else ""
            raise VariablesMismatchError(_structure_message(missing, extra, why))
        return [position[p] for p in entry.plan.variable_paths]

    def _own_paths(self) -> set[Any]:
        return {p for p, _ in jax.tree_util.tree_flatten_with_path(self.variables)[0]}

    def rng_leaves(self, entry: Entry, rngs: Any) -> list[Any]:
        if not entry.plan.rng_ids:
            return []
        leaves = [x for x in jax.tree_util.tree_leaves(rngs) if is_traced_leaf(x)]
        position = {v: i for i, v in enumerate(entry.traced.graph.rng_ids)}
        return [leaves[position[v]] for v in entry.plan.rng_ids]

    def extract(self, full_variables: Any) -> Any:
        """The slice's part of a model's full variables (the inverse of `merge`)."""
        plan_ = self.base.plan
        flat = dict(jax.tree_util.tree_flatten_with_path(full_variables)[0])
        missing = [p for p in plan_.variable_paths if p not in flat]
        if missing:
            raise VariablesMismatchError(
                "These variables lack entries the slice reads: "
                + ", ".join(path_str(p) for p in missing[:8])
                + "."
            )
        picked = [flat[p] for p in plan_.variable_paths]
        check_leaves(plan_.variable_paths, picked, _avals(self.base, plan_.variable_ids))
        return prune(full_variables, set(plan_.variable_paths))

    def merge(self, full_variables: Any, new_variables: Any) -> Any:
        """The model's variables with the slice's entries replaced by `new_variables`
        (or, given a model that holds its variables, the model, updated in place)."""
        held = self.adapter.model_variables(full_variables)
        if held is not None:
            self.adapter.assign(full_variables, self.merge(held, new_variables))
            return full_variables
        updates = dict(jax.tree_util.tree_flatten_with_path(new_variables)[0])
        flat, treedef = jax.tree_util.tree_flatten_with_path(full_variables)
        known = dict(flat)
        unknown = [p for p in updates if p not in known]
        if unknown:
            raise VariablesMismatchError(MERGE_UNKNOWN.format(paths=_paths(unknown)))
        _check_updates(known, updates)
        return jax.tree_util.tree_unflatten(treedef, [updates.get(p, x) for p, x in flat])

    def input_specs(self, batch: Any = None) -> tuple[list[Any], dict[str, Any]]:
        """``(args, kwargs)`` of `jax.ShapeDtypeStruct`s the slice takes, as traced.

        With `batch` (a dimension, e.g. symbolic), every input's leading axis is `batch`.
        """
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for arg in self.base.plan.arguments:
            if any(i is None for i in arg.slot_ids):
                raise SliceError(FIXED_LEAVES.format(arg=arg.describe()))
            specs = [
                _with_batch(a, 0 if jnp.ndim(a) else None, batch) if batch is not None else a
                for a in _avals(self.base, arg.slot_ids)
            ]
            value = jax.tree_util.tree_unflatten(arg.tree, specs)
            if arg.keyword is None:
                args.append(value)
            else:
                kwargs[arg.keyword] = value
        return args, kwargs

    def check_exportable(self) -> None:
        """Raises a `SliceError` if the slice is no pure function of its variables and
        inputs in its mode: it draws random numbers, or it updates state."""
        plan_, split = self.base.plan, self.base.traced.split
        mode = dict(split.mode)
        if plan_.rng_ids:
            names = sorted(split.rngs) if isinstance(split.rngs, Mapping) else ["dropout"]
            rngs = "{" + ", ".join(f"{n!r}: key" for n in names) + "}"
            raise SliceError(EXPORT_RNGS.format(mode=mode, rngs=rngs))
        if plan_.updated_collections:
            names = list(plan_.updated_collections)
            raise SliceError(EXPORT_UPDATES.format(mode=mode, names=names))

    @property
    def sample_rngs(self) -> Any:
        """The `rngs` the slice was made with: a re-trace of the whole model at new shapes
        may need them, though the slice itself reads none (`check_exportable`)."""
        return self.base.traced.split.rngs

    # ------------------------------------------------------------------ views

    @property
    def jaxpr(self) -> Any:
        """The re-emitted program (a closed jaxpr) for the shapes it was sliced with."""
        e = self.base
        p = e.plan
        groups = [_avals(e, p.variable_ids), _avals(e, p.rng_ids), _avals(e, p.input_ids)]
        return _compat.make_jaxpr(e.fn, *groups)[0]

    def summary(self) -> str:
        return summary(self)

    def knows_sharing(self) -> bool:
        """Whether `shared_paths` is known without tracing the model again."""
        return not self.base.traced.graph.partial or "_shared" in self.__dict__

    def shared_paths(self) -> list[tuple[Any, ...]]:
        """Variable paths the slice reads that the model also reads outside the slice."""
        cached = self.__dict__.get("_shared")
        if cached is None:
            entry = self.full_entry()
            graph, inside = entry.traced.graph, set(entry.plan.cut.eqns)
            read_outside = {v for i, e in enumerate(graph.eqns) if i not in inside for v in e.ins}
            mine = dict(zip(entry.plan.variable_ids, entry.plan.variable_paths, strict=True))
            cached = [p for v, p in mine.items() if v in read_outside]
            self.__dict__["_shared"] = cached
        return cached

    def full_entry(self) -> Entry:
        """An entry whose trace covers the whole model (for drawing it)."""
        if not self.base.traced.graph.partial:
            return self.base
        traced = self.base.traced
        full = self.__dict__.get("_full")
        if full is None:
            full = make_entry(
                trace_split(self.adapter, self.target, traced.split), self.start, self.end
            )
            self.__dict__["_full"] = full
        return full


# --------------------------------------------------------------------------- helpers

FIXED_LEAVES = (
    "The slice's input {arg} holds leaves fixed by the trace (non-arrays or parameters), "
    "which an exported function cannot take; export a slice whose inputs are arrays, e.g. "
    "start at an ':output' port."
)
FIXED_ARGUMENT = (
    "The model's positional argument {i} holds no arrays, so the trace fixed it to "
    "{fixed!r}; this call passes {given!r}. Slice the model again with that value (a "
    "slice takes the model's array arguments; non-array ones are part of its trace)."
)
EXPORT_RNGS = (
    "In its mode {mode} this slice draws random numbers (it reads the keys passed as "
    "`rngs`), and `sub.export()` makes a program that takes no random keys. Slice the model "
    "in a mode that draws none (e.g. train=False), or export your own function that takes "
    "the key, for example: jax.export.export(jax.jit(lambda v, x, key: sub.apply(v, x, "
    "rngs={rngs})))(...)."
)
EXPORT_UPDATES = (
    "In its mode {mode} this slice updates {names}, and `sub.export()` makes a program that "
    "returns only the slice's outputs, so those updates would be lost. To export a feature "
    "extractor, slice the model in evaluation mode (e.g. train=False). To export the "
    "updates too, export your own function, for example: jax.export.export(jax.jit("
    "lambda v, x: sub.apply(v, x, mutable={names})))(...)."
)
NO_COLLECTIONS = (
    "A plain function takes random keys and state as ordinary inputs; `rngs` and "
    "`mutable` apply to Flax models only."
)
UNKNOWN_KEYWORDS = (
    "The model does not accept the keyword argument(s) {unknown}; it accepts {accepted}. "
    "Mode keywords such as `train=True` are passed to the model."
)
MERGE_UNKNOWN = (
    "Cannot merge: the model's variables have no entry at {paths}.\n"
    "Pass the model's full variables first and the slice's variables second: "
    "`sub.merge(variables, new_sub_variables)`."
)
NEW_BATCH = (
    "The slice was called at a new batch size, so jaxslice traced the model again with "
    "its inputs' batch axis (the axis of the old batch size) resized, and the model "
    "failed: {error}\nSlice again with sample inputs of the new batch size."
)
#: errors after which `SliceProgram.apply` redoes a call with `apply_checked`: those of
#: arguments `jax.jit` cannot take (strings, objects), of arguments it converts (Python
#: numbers become arrays, where jaxslice would leave them alone), and jaxslice's own,
#: raised again without JAX's frames
_REDO = (TypeError, SliceError)
_CHECKED = object()  # calls of this key go through `apply_checked`


class _NotJittable(SliceError):
    """The outputs of this call hold constants of the trace (`Entry.static_outputs`)."""


def _jitted_apply(ref: Any, mode: dict[str, Any], mutable: Any, variables: Any, inputs: Any) -> Any:
    """`SliceProgram.apply` as `jax.jit` traces it: for each new structure, shape and dtype
    of the variables and inputs, the lookup and every check run again."""
    return ref().apply_checked(variables, inputs, mode, None, mutable, jitting=True)


def _nest_state(values: Any, state: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """``(values, state)`` with the state's ``(path, value)`` pairs nested as linen does."""
    return values, nest([p for p, _ in state], [v for _, v in state])


def _signature(leaves: Any) -> tuple[Any, ...]:
    """The shapes, dtypes and weak types of arrays (or avals), hashable."""
    return tuple((tuple(x.shape), x.dtype, getattr(x, "weak_type", False)) for x in leaves)


def _static_key(tree: Any) -> Any:
    """A cache key for `rngs` or `mutable` (cheap for the common None and booleans)."""
    return tree if tree is None or isinstance(tree, bool) else tree_key(tree)


def _check_updates(known: dict[Any, Any], updates: dict[Any, Any]) -> None:
    """New leaves have the shapes and dtypes of the leaves they replace."""
    paths = [p for p in updates if is_traced_leaf(known[p]) or is_traced_leaf(updates[p])]
    check_leaves(paths, [updates[p] for p in paths], [abstract(known[p]) for p in paths])


def _absent(paths: Any, known: Any) -> list[Any]:
    """The paths not in `known`."""
    return [p for p in paths if p not in known]


def _array_positions(tree: Any) -> dict[Any, int]:
    """``{path: leaf index}`` of the array leaves of a pytree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {p: i for i, (p, x) in enumerate(flat) if is_traced_leaf(x)}


def _check_arity(arguments: Any, inputs: tuple[Any, ...]) -> None:
    positional = [a for a in arguments if a.keyword is None]
    if len(inputs) != len(positional):
        described = ", ".join(a.describe() for a in arguments) or "none"
        raise InputMismatchError(
            f"This slice takes {len(positional)} positional input(s) (its inputs: {described}), "
            f"got {len(inputs)}."
        )


def _argument_leaves(arg: Any, value: Any) -> list[Any]:
    flat, tree = jax.tree_util.tree_flatten(value)
    if tree != arg.tree:
        raise InputMismatchError(
            f"Input {arg.describe()} has structure {tree}, but the slice was traced with "
            f"{arg.tree}. Pass a value of the same pytree structure."
        )
    leaves = []
    for leaf, vid in zip(flat, arg.slot_ids, strict=True):
        if vid is not None:
            leaves.append(_as_array(arg, leaf))
    return leaves


def _as_array(arg: Any, leaf: Any) -> Any:
    if is_traced_leaf(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    try:
        return jnp.asarray(leaf)
    except (TypeError, ValueError) as error:
        raise InputMismatchError(
            f"Input {arg.describe()} got {type(leaf).__name__} {leaf!r}, which is not an "
            "array; pass a JAX or NumPy array (a `jax.ShapeDtypeStruct` is for tracing "
            "with `jax.eval_shape` or `jax.export`, not for calling a slice)."
        ) from error


def _model_inputs(plan_: Plan, split: Any, inputs: tuple[Any, ...], kw_inputs: dict) -> dict:
    args, kwargs = list(split.args), dict(split.kwargs)
    given = iter(inputs)
    for arg in plan_.arguments:
        value = abstract_tree(kw_inputs[arg.keyword] if arg.keyword is not None else next(given))
        if arg.keyword is not None:
            kwargs[arg.keyword] = value
        else:
            args[arg.position] = value
    return {"args": tuple(args), "kwargs": kwargs}


def _batch_axis(x: Any, old: Any, later: bool) -> int | None:
    """The axis of a model input that has the old batch size: the leading one if it has
    it (the last such with `later`), or None for an input without one."""
    shape = jnp.shape(x) if is_traced_leaf(x) else ()
    axes = [k for k, n in enumerate(shape) if _same_dim(n, old)]
    if not axes:
        return None
    return axes[-1] if later else axes[0]


def _with_batch(x: Any, axis: int | None, batch: Any) -> Any:
    """A model input with its batch axis at the new size."""
    if axis is None:
        return x
    shape = list(jnp.shape(x))
    shape[axis] = batch
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype, weak_type=is_weak(x))


def _same_dim(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # symbolic dimensions (jax.export) that cannot be compared
        return a is b


def _new_batch_size(expected: tuple[Any, ...], got: tuple[Any, ...]) -> Any:
    """The new leading dimension of `got`, None if unchanged; other changes raise."""
    if not all(_same_but_batch(e, g) for e, g in zip(expected, got, strict=True)):
        raise InputMismatchError(_mismatch_message(expected, got))
    pairs = zip(expected, got, strict=True)
    changed = [g.shape[0] for e, g in pairs if e.shape and not _same_dim(e.shape[0], g.shape[0])]
    if any(not _same_dim(b, changed[0]) for b in changed):
        raise InputMismatchError(_mismatch_message(expected, got))
    return changed[0] if changed else None


def _same_but_batch(e: Any, g: Any) -> bool:
    """Same dtype and shape, except perhaps the leading axis."""
    if str(e.dtype) != str(g.dtype) or len(e.shape) != len(g.shape):
        return False
    return all(_same_dim(a, b) for a, b in zip(e.shape[1:], g.shape[1:], strict=True))


def _shapes(avals: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(str(d) for d in a.shape), str(a.dtype)) for a in avals)


def _mismatch_message(expected: tuple[Any, ...], got: tuple[Any, ...]) -> str:
    fmt = lambda avals: ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)  # noqa: E731
    return (
        f"The slice's inputs were traced as ({fmt(expected)}) but got ({fmt(got)}).\n"
        "A slice with a `start` accepts a new batch size (the leading axis) but not other "
        "changes of shape or dtype. For other shapes, slice again with sample inputs of that "
        "shape, or use start=None."
    )


def _call_differs(base: Any, now: Any) -> str:
    """What differs between the call a slice was made for and this one (for messages)."""
    what = []
    if base.mode != now.mode:
        what.append(f"mode {now.mode} where the slice was made with {base.mode}")
    if tree_key(base.mutable) != tree_key(now.mutable):
        what.append(f"mutable={now.mutable!r} where the slice was made with {base.mutable!r}")
    differs = " and ".join(what) or "a call that differs from the one the slice was made for"
    return (
        f"(this call has {differs}, and reads variables that `sub.variables` lacks; slice "
        "again with the mode and `mutable` you call it with)"
    )


def _structure_message(missing: list[Any], extra: list[Any], why: str) -> str:
    lines = []
    if missing:
        lines.append("missing: " + _paths(missing))
        if why:
            lines.append(why)
    if extra:
        lines.append("not used by the slice: " + _paths(extra))
    return (
        "The variables passed do not match the slice's variables (" + "; ".join(lines) + ").\n"
        "Pass `sub.variables`, or variables of the same structure (for example the result "
        "of training them)."
    )


def _paths(paths: list[Any]) -> str:
    return ", ".join(path_str(p) for p in paths[:8])


_compat.register_frames_exclusion(__file__)


def summary(program: SliceProgram) -> str:
    """A one-line description of a slice (for ``repr``)."""
    p = program.base.plan
    sizes = [getattr(x, "size", 0) for x in jax.tree_util.tree_leaves(program.variables)]
    text = (
        f"start={program.start!r}, end={program.end!r}, equations={len(p.cut.eqns)}, "
        f"variables={len(p.variable_ids)} arrays/{sum(int(s) for s in sizes)} values"
    )
    # A slice whose trace stopped early knows its sharing only after a full trace, which
    # `repr` does not pay for (`shared_variables` does).
    shared = program.shared_paths() if program.knows_sharing() else []
    if shared:
        text += f", shared with the rest of the model: {_paths(shared)}"
    return text
