"""The engine (stage 5): a planned slice as compiled entries, one per call signature.

A `SliceProgram` keeps the trace and plan it was made from and one compiled entry per
input signature (shapes, dtypes, mode, `mutable` and the structure of `rngs`), like
`jax.jit`. A new signature re-traces the model at the new shapes (from
`jax.ShapeDtypeStruct`s, no data), plans the same `start`/`end` again and compiles the
new cut. With a `start`, only the batch size may change. Every view users hold — `Sliced`,
the NNX slice module, `js.intermediates`, observers, interpreters, the editor — is a thin
layer over this class's public methods.

It is a facade over pure parts: binding a call's inputs and the model's inputs for a
re-trace (`arguments`), finding the variables a plan reads (`variables`), repeated calls
under one `jax.jit` per mode and `mutable` (`jitted`), and export (`exporting`).

The program keeps only what it needs: the variables the slice reads (the original
arrays, pruned) and the shapes of everything else. It never changes the `Traced` it is
made from.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any

import jax

from .. import _compat
from .._caches import LRU
from .._errors import (
    InputShapesChangedError,
    ModelTraceError,
    NewBatchTraceError,
    NoCollectionsError,
    UnknownKeywordsError,
)
from .._trees import abstract, abstract_tree, hashable, is_traced_leaf, nest, prune, tree_key
from . import emit as emit_
from . import exporting, loops, markers, remark
from . import variables as variables_
from .arguments import input_leaves, retrace_inputs, same_shapes, signature
from .checks import check_alive, check_leaves, check_mutable, check_numbers, mode_key, mode_value
from .jitted import JitCalls
from .plan import Plan, StateRules, plan
from .ports import adopted, parsed, written
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
        return self.avals(self.plan.variable_ids)

    def avals(self, ids: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The shape and dtype traced for each of the values `ids`."""
        g = self.traced.graph
        return tuple(jax.ShapeDtypeStruct(g.avals[i].shape, g.avals[i].dtype) for i in ids)

    @functools.cached_property
    def inlined(self) -> Any:
        """`fn` as one ready-made jaxpr (`emit.emit_jaxpr`), for the calls `jax.jit`
        traces; `fn` where there is none."""
        made = emit_.emit_jaxpr(self.traced.graph, self.plan.to_run, *_emitted(self.plan))
        return self.fn if made is None else made

    @functools.cached_property
    def marked(self) -> Any:
        """`fn` marking the calls in the slice again (`remark`), for a trace of the slice
        as a target."""
        return remark.marked(self.traced.graph, self.plan.to_run, *_emitted(self.plan))

    @functools.cached_property
    def static_outputs(self) -> bool:
        """Whether some output leaves are constants of the trace, not arrays (`jax.jit`
        would turn them into arrays)."""
        slots = jax.tree_util.tree_leaves(self.plan.output_trees)  # `Slot`s are leaves
        return len(slots) != len(self.plan.output_ids)


def make_entry(traced: Traced, names: tuple[Any, Any]) -> Entry:
    """The entry for `names`, ``(start, end)`` parsed (`ports.parsed`)."""
    names = adopted(traced.graph, names)  # records of another trace: this one's calls
    looped = loops.loop_selections(traced.graph, *names)
    if looped:  # names of iterations inside scans: plan on the loops written out
        traced = dataclasses.replace(traced, graph=loops.expanded(traced.graph, looped))
    adapter = traced.adapter
    rules = StateRules(adapter.state_owner, adapter.state_includes_variables)
    p = plan(traced.graph, *names, traced.split.mutable, rules)
    fn = emit_.emit(traced.graph, p.to_run, *_emitted(p))
    return Entry(traced, p, fn, jax.jit(fn))


def _emitted(p: Plan) -> tuple[list[Any], Any]:
    """What an entry's function takes, ``(variables, random keys, inputs)``, and returns,
    the outputs and then the updated state."""
    return [p.variable_ids, p.rng_ids, p.input_ids], p.output_ids + p.state_ids


class SliceProgram:
    """A sub-network between named boundaries of one model, compiled per signature."""

    def __init__(self, traced: Traced, start: Any, end: Any):
        began = time.perf_counter()
        self.names = (parsed(start), parsed(end))  # parsed once, for every re-trace too
        self.start, self.end = written(start), written(end)  # as the user wrote them
        self.adapter = traced.adapter
        base = make_entry(traced, self.names)
        self.build_info = BuildInfo(
            traced.seconds - traced.build_seconds,
            traced.build_seconds + time.perf_counter() - began,
            len(traced.graph.eqns),
            traced.graph.partial,
        )
        holds = self.adapter.holds_variables
        split = traced.split
        paths = set(base.plan.variable_paths)
        self.variables = None if holds else prune(split.variables, paths)
        # The program keeps the model's shapes, not its arrays (re-tracing needs nothing
        # more), and a model that is a pytree of its arrays as its structure only. The
        # `Traced` given is left as it is: its caller may use it again.
        if not holds:
            split = dataclasses.replace(split, variables=abstract_tree(split.variables))
        self.target = self.adapter.skeleton(traced.target)
        #: where the model holds its variables' values (Keras), ``variables_view()`` reads
        #: them now (`Adapter.variables_view`); the program keeps only their shapes then
        self.variables_view = self.adapter.variables_view(self.target, self.variables)
        if self.variables_view is not None:
            self.variables = abstract_tree(self.variables)
        kept = dataclasses.replace(base.traced, target=self.target, split=split)
        self.base = dataclasses.replace(base, traced=kept)
        self._entries = LRU(MAX_ENTRIES)
        #: the names of the slice's keyword inputs (other keywords are modes)
        self.keywords = frozenset(a.keyword for a in self.base.plan.arguments)
        base_key = self._key(
            signature(self._traced_avals(self.base)), split.rngs, split.mode, split.mutable
        )
        self._entries.put(base_key, self.base)
        #: the calls through `jax.jit` (`apply`, `call`)
        self.calls = JitCalls(self, MAX_ENTRIES)
        #: ``apply(variables, inputs, {})``, the usual call (``sub(x)``), by the shortest
        #: path (`JitCalls.call`; an attribute, not a method: no call in between)
        self.call = self.calls.call

    @classmethod
    def build(
        cls,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        start: Any = None,
        end: Any = None,
        *,
        adapter: Any,
        stop_early: bool = True,
    ) -> SliceProgram:
        """Traces `target` with its `adapter` (stopping once `end` is computed, where
        possible) and plans."""
        start, end = parsed(start), parsed(end)
        stop_at = stop_specs(start, end) if stop_early else None
        return cls(trace(target, args, kwargs, stop_at, adapter=adapter), start, end)

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
        ``(values, state)``, the state nested as linen returns it. Through the path decided
        for this kind of call (`jitted`): its jitted function, or `apply_checked`."""
        return self.calls.apply(variables, inputs, kwargs, rngs, mutable, strict)

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
        """`apply` with jaxslice's lookup and checks (also run as `jax.jit` traces
        `apply`: with `jitting`, see `run`)."""
        if not self.adapter.has_collections and (rngs is not None or mutable):
            raise NoCollectionsError()
        entry, leaves = self.lookup(inputs, kwargs, rngs, mutable)
        var_leaves = self.variable_leaves(entry, variables, strict)
        rng_leaves = self.rng_leaves(entry, rngs)
        out = self.run(entry, var_leaves, rng_leaves, leaves, mutable, inline=jitting)
        return _nest_state(*out) if mutable else out

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
        check_leaves(entry.plan.variable_paths, leaves, entry.variable_avals, live=True)
        check_numbers(entry.traced.graph.number_variables, live)
        return leaves

    def run(
        self,
        entry: Entry,
        var_leaves: list[Any],
        rng_leaves: list[Any],
        leaves: list[Any],
        mutable: Any,
        inline: bool = False,
    ) -> Any:
        """Runs a compiled entry; with `mutable`, returns ``(outputs, updated_state)``.
        With `inline` (while `jax.jit` traces a call, `jitted`), the entry's equations go
        straight into that trace as they are (`Entry.inlined`), not bound again into a
        nested `jit` of their own, which XLA would inline again."""
        check_mutable(entry.plan, mutable, self.adapter)
        # Traced as a target (`markers.remarks`), a slice marks its calls again.
        fn = entry.marked if markers.remarks(self) else entry.inlined if inline else entry.jitted
        try:
            outs = fn(var_leaves, rng_leaves, leaves)
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
        key = self._key(signature(leaves), rngs, mode, mutable)
        entry = self._entries.get(key)
        if entry is None:
            split = self.base.traced.split
            call = dataclasses.replace(split, mode=mode, rngs=rngs, mutable=mutable)
            avals = tuple(abstract(x) for x in leaves)
            entry = self._retrace(avals, inputs, kw_inputs, call)
            self._entries.put(key, entry)
        return entry, leaves

    def _split_kwargs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(keyword inputs, mode)`` of a call's keyword arguments; a mode given as a
        one-element array is its Python value (`checks.mode_value`), whichever view
        called."""
        mode = self.base.traced.split.mode
        if not kwargs:
            return {}, mode
        new_mode = {k: v for k, v in kwargs.items() if k not in self.keywords}
        self.check_mode(new_mode)
        new_mode = {k: mode_value(k, v) for k, v in new_mode.items()}
        kw_inputs = {k: v for k, v in kwargs.items() if k in self.keywords}
        return kw_inputs, {**mode, **new_mode}

    def _key(self, signature: tuple[Any, ...], rngs: Any, mode: Any, mutable: Any) -> Any:
        return (
            signature,
            _static_key(rngs),
            tuple(sorted((k, mode_key(v)) for k, v in mode.items())),
            _static_key(mutable),
            hashable(self.adapter.structure_key(self.target)),
        )

    # ------------------------------------------------------------------ inputs

    def check_mode(self, mode: Mapping[str, Any]) -> None:
        """Raises a `SliceError` naming keywords the model does not accept."""
        if not mode:
            return
        accepted = self.adapter.accepted_keywords(self.target)
        unknown = [k for k in mode if accepted is not None and k not in accepted]
        if unknown:
            raise UnknownKeywordsError(unknown=unknown, accepted=sorted(accepted or ()))

    def _input_leaves(self, inputs: tuple[Any, ...], kw_inputs: dict[str, Any]) -> list[Any]:
        return input_leaves(self.base.plan, self.base.traced.split.args, inputs, kw_inputs)

    def _traced_avals(self, entry: Entry) -> tuple[jax.ShapeDtypeStruct, ...]:
        return entry.avals(entry.plan.input_ids)

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
            expected = self._traced_avals(base)
            new = retrace_inputs(base.plan, expected, split, avals, inputs, kw_inputs, later)
            if later and new is None:
                break
            try:
                traced = trace_split(
                    self.adapter,
                    self.target,
                    dataclasses.replace(split, **(new or {})),
                    stop_specs(*self.names),
                )
            except ModelTraceError as failed:
                if not new:
                    raise
                error = failed
                continue
            entry = make_entry(traced, self.names)
            if base.plan.starts is None or same_shapes(self._traced_avals(entry), avals):
                return entry
            error = InputShapesChangedError.of(expected, avals)
        if isinstance(error, ModelTraceError):
            raise NewBatchTraceError(error=error) from error
        raise error or AssertionError("no re-trace was tried")

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
        if numbers := entry.traced.graph.number_variables:  # Python numbers it computes with
            check_numbers(numbers, dict(jax.tree_util.tree_flatten_with_path(variables)[0]))
        return picked

    def _index_variables(self, entry: Entry, variables: Any, strict: bool) -> list[int]:
        own = {p for p, _ in jax.tree_util.tree_flatten_with_path(self.variables)[0]}
        why = lambda: variables_.call_differs(self.base.traced.split, entry.traced.split)  # noqa: E731
        return variables_.leaf_index(entry.plan.variable_paths, variables, own, strict, why)

    def rng_leaves(self, entry: Entry, rngs: Any) -> list[Any]:
        if not entry.plan.rng_ids:
            return []
        leaves = [x for x in jax.tree_util.tree_leaves(rngs) if is_traced_leaf(x)]
        position = {v: i for i, v in enumerate(entry.traced.graph.rng_ids)}
        return [leaves[position[v]] for v in entry.plan.rng_ids]

    def extract(self, full_variables: Any) -> Any:
        """The slice's part of a model's full variables (the inverse of `merge`)."""
        plan_ = self.base.plan
        return variables_.extract(full_variables, plan_.variable_paths, self.base.variable_avals)

    def merge(self, full_variables: Any, new_variables: Any) -> Any:
        """The model's variables with the slice's entries replaced by `new_variables`
        (or, given a model that holds its variables, the model, updated in place)."""
        held = self.adapter.model_variables(full_variables)
        if held is not None:
            self.adapter.assign(full_variables, self.merge(held, new_variables))
            return full_variables
        return variables_.merge(full_variables, new_variables)

    def input_specs(self, batch: Any = None) -> tuple[list[Any], dict[str, Any]]:
        """``(args, kwargs)`` of `jax.ShapeDtypeStruct`s the slice takes (`exporting`)."""
        return exporting.input_specs(self.base, batch)

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
        groups = [e.avals(p.variable_ids), e.avals(p.rng_ids), e.avals(p.input_ids)]
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
            full = make_entry(trace_split(self.adapter, self.target, traced.split), self.names)
            self.__dict__["_full"] = full
        return full


# --------------------------------------------------------------------------- helpers


def _nest_state(values: Any, state: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """``(values, state)`` with the state's ``(path, value)`` pairs nested as linen does."""
    return values, nest([p for p, _ in state], [v for _, v in state])


def _static_key(tree: Any) -> Any:
    """A cache key for `rngs` or `mutable` (cheap for the common None and booleans)."""
    return tree if tree is None or isinstance(tree, bool) else tree_key(tree)


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
        text += f", shared with the rest of the model: {variables_.paths_str(shared)}"
    return text
