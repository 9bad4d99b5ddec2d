"""The hook rules of the one evaluator: traced programs run again with every call shown.

`evaluate` runs a traced graph again as an ordinary JAX function, binding its equations one
by one (as `jax.core.eval_jaxpr` does), and shows `Hooks` every module call's two sides and
every equation; a hook may replace the values it is shown. `js.Interpreter`, `js.edit` and
the observers built on them are clients of this one evaluator.

Model: the flat graph's equations run in program order, with boundary events at the
positions where calls open and close, each equation by `_Rules`, the rules this module
gives `jaxprs.Evaluator`. Inside a loop body there is no flat graph: the evaluator walks
the body jaxpr with the same rules:

* the markers of one call side (the walk hands them over together) are shown to the
  hooks as one value (the call's arguments, or its result), and dropped;
* a call-like equation (jit, remat, custom_jvp/vjp) whose body holds boundaries runs its
  body inline, so its calls are seen (as at the top level, where the graph inlines them);
* a loop (`scan`, `while`: those with a `jaxprs.LoopRule`) whose body holds boundaries
  **stays a loop of its kind**: a new `lax.scan` or `lax.while_loop` whose body is
  evaluated by these same rules, so hooks run once, at trace time, on one iteration's
  values, and see its calls by their per-iteration names with ``[:]``
  (``layers[:]/mlp``); the iteration index is carried along (`BoundaryEvent.rows`), so
  a hook can act on one iteration (``lax.cond(row == 3, ...)``) or read row k of a
  stacked array in iteration k;
* every other equation is bound as it is.

Values hooks compute inside a loop body and want outside it (an interpreter's `emit`)
leave the loop as extra results (`Hooks.open_loop`/`close_loop`/`leave_loop`): stacked
over a scan's iterations, the last iteration's from a `while` (its number of iterations is
known only when it runs).

Sharp edges: hooks that replace a value must keep its structure, shapes and dtypes inside
a loop body (a loop's carry is fixed); a replaced input is seen only by the call's own
equations. Boundaries in `cond` branches are not shown (those run as they are).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from .. import _compat
from .._errors import HookStructureError
from .emit import assemble
from .graph import Call, Graph, innermost
from .jaxprs import Env, Evaluator, Finder, LoopRule
from .markers import INPUT, PLACEHOLDER
from .names import STACKED
from .ports import array_ids, port_value_tree
from .selection import Selection

# --------------------------------------------------------------------------- hooks


@dataclasses.dataclass(frozen=True)
class BoundaryEvent:
    """One side of one module call, as a hook sees it.

    Attributes:
      call: the call as the traced graph lists it.
      side: ``"input"`` or ``"output"``.
      value: the call's array arguments (one, or a tuple of them) or its result pytree.
      path: for a call inside loops, per enclosing loop (outermost first), the iteration
        it runs in where that is fixed, or ``":"`` inside a loop run as a loop.
      rows: per enclosing loop, the iteration index (a traced int32).
    """

    call: Call
    side: str
    value: Any
    path: tuple[Any, ...] = ()
    rows: tuple[Any, ...] = ()

    @property
    def where(self) -> Selection:
        """The event's record (`selection.Selection`): the call, the side and the
        iterations; a hook that was given a record meets the event by equality."""
        return Selection(self.call.qualname, self.call, self.side, tuple(self.path))

    @property
    def name(self) -> str:
        """The call's qualified name (``block/conv``, ``layers[:]/mlp``, ``layers[3]/mlp``)."""
        return self.where.name

    @property
    def stacked_name(self) -> str:
        """The name of this call in every iteration (``layers[:]/mlp``); `name` elsewhere."""
        return self.where.every().name


@dataclasses.dataclass(frozen=True)
class Equation:
    """What an `Interpreter.equation` hook learns about one equation.

    Attributes:
      primitive: the primitive's name (``"dot_general"``, ``"max"``, ...).
      params: the primitive's parameters.
      index: the equation's position in the flat program (for an equation inside a loop
        body, the position of the loop).
      scopes: the `jax.named_scope` names active at it.
      boundary: the innermost module call it belongs to (a qualified name), or None.
      source: ``file:line`` of the model code that produced it, when known.
    """

    primitive: str
    params: dict[str, Any]
    index: int
    scopes: tuple[str, ...]
    boundary: str | None
    source: str | None


class Hooks:
    """What `evaluate` calls; every method has a default that changes nothing."""

    #: whether call-like equations without boundaries run through their bodies
    recurse: bool = False

    def on_boundary(self, event: BoundaryEvent) -> Any:
        """One side of a call: returns its value or a replacement of the same structure."""
        return event.value

    def equation(self, eqn: Equation, inputs: list[Any], outputs: list[Any]) -> list[Any]:
        """One equation, after it ran: returns its outputs or replacements."""
        return outputs

    def open_loop(self) -> Any:
        """Called before a loop body is evaluated; returns a token for `close_loop`."""
        return None

    def close_loop(self, token: Any) -> dict[Any, Any]:
        """Called after a loop body: the per-iteration values that must leave the loop."""
        return {}

    def leave_loop(self, values: dict[Any, Any]) -> None:
        """Receives `close_loop`'s values stacked over a scan's iterations (from a
        `while`: the last iteration's, zeros where it ran none)."""

    def skipped_rows(self, eqn: Any, path: tuple[Any, ...]) -> int:
        """How many first iterations of the scan `eqn` (inside the loops `path`) the
        hooks have nothing to do in: those run as the model runs them, as a scan of their
        own, with zeros for what they would have let leave the loop."""
        return 0


def _leaves_like(new: Any, value: Any, name: str, side: str) -> list[Any]:
    """The leaves of a hook's replacement `new`, which must have `value`'s structure."""
    leaves, treedef = jax.tree_util.tree_flatten(new)
    want = jax.tree_util.tree_structure(value)
    if treedef != want:
        raise HookStructureError(name=name, side=side, got=treedef, want=want)
    return leaves


# --------------------------------------------------------------------------- the flat graph


def _events(graph: Graph) -> dict[int, list[tuple[Any, str, Call]]]:
    """Boundary events by equation position, in the order they happen there.

    Calls that share a position open in the order of their first input marker and close in
    that of their last output marker (`Call.in_seq`, `Call.out_seq`). Scope regions have no
    markers; by their spans and names, one opens just after the innermost marked call there
    that it lies in (the same span counts as in, unless the call's name is inside the
    scope's), else before the first it encloses, and closes the other way round. Nested
    scope regions open outer first and close inner first.
    """
    calls = _outside_loops(graph)
    marked = [c for c in calls if not c.is_scope]
    events: dict[int, list[tuple[Any, str, Call]]] = {}
    for call in calls:
        if call.is_scope:
            opening, closing = _scope_opens(call, marked), _scope_closes(call, marked)
        else:
            opening, closing = (call.in_seq, 0, 0), (call.out_seq, 0, 0)
        events.setdefault(call.start, []).append((opening, INPUT, call))
        events.setdefault(call.stop, []).append((closing, "output", call))
    for evs in events.values():
        evs.sort(key=lambda e: e[0])
    return events


def _scope_opens(scope: Call, marked: list[Call]) -> tuple[Any, ...]:
    """Where a scope region opens among the marked calls that start with it (`_events`'
    sort key): just after the innermost it lies in, else before the first it encloses."""
    starts = [c for c in marked if c.start == scope.start]
    if around := [c.in_seq for c in starts if c.stop >= scope.stop and not c.named_in(scope)]:
        return (max(around), 1, len(scope.path))
    return (min((c.in_seq for c in starts), default=math.inf), -1, len(scope.path))


def _scope_closes(scope: Call, marked: list[Call]) -> tuple[Any, ...]:
    """Where a scope region closes among the marked calls that end with it: just before
    the innermost it lies in, else after the last it encloses."""
    stops = [c for c in marked if c.stop == scope.stop]
    if around := [c.out_seq for c in stops if c.start <= scope.start and not c.named_in(scope)]:
        return (min(around), -1, -len(scope.path))
    return (max((c.out_seq for c in stops), default=-math.inf), 1, -len(scope.path))


def _outside_loops(graph: Graph) -> list[Call]:
    return [c for c in graph.calls if c.loop is None]


class _GraphEnv:
    """Values by id; a replaced input is seen only by its own call's equations."""

    def __init__(self, values: dict[int, Any]):
        self.values = values
        self.overlays: list[tuple[int, dict[int, Any]]] = []

    def read(self, v: int, pos: int) -> Any:
        for stop, values in reversed(self.overlays):
            if stop > pos and v in values:
                return values[v]
        return self.values[v]

    def advance(self, pos: int) -> None:
        self.overlays[:] = [o for o in self.overlays if o[0] > pos]


def evaluate(
    graph: Graph,
    hooks: Hooks,
    var_values: list[Any],
    rng_values: list[Any],
    inputs: list[Any],
    *,
    with_state: bool = False,
) -> Any:
    """Runs `graph` equation by equation, calling `hooks`; returns the model's output
    (with `with_state`, ``(output, values of graph.state_ids)``: the state it updated)."""
    values = dict(graph.consts)
    values.update(zip(graph.variable_ids, var_values, strict=True))
    values.update(zip(graph.rng_ids, rng_values, strict=False))
    env = _GraphEnv({**values, **dict(zip(graph.input_ids, inputs, strict=True))})
    events = _events(graph)
    owners = [[c.qualname] if c else [] for c in innermost(_outside_loops(graph), len(graph.eqns))]
    rules = _Rules(graph, hooks)
    # Regions inlined only to drop dead code run as their original equation here, as
    # the hooks saw them before inlining (unless the hooks look inside call-like ones).
    regions = () if hooks.recurse else graph.regions
    whole = {r.start: r for r in regions if r.opaque and r.stop > r.start}
    pos = 0
    while pos < len(graph.eqns):
        _boundaries(graph, hooks, env, pos, events.get(pos, ()))
        region = whole.get(pos)
        eqn, after = (region.eqn, region.stop) if region else (graph.eqns[pos], pos + 1)
        at = _At(pos, eqn.scopes, list(owners[pos]))
        ins = [env.read(v, pos) for v in eqn.ins]
        # the operands that are variables, random keys or constants, for the body rules
        operands = _RuleEnv.operands(eqn.jax_eqn, map(graph.is_free, eqn.ins))
        outs = rules.eqn(eqn.jax_eqn, ins, operands, at)
        env.values.update(zip(eqn.outs, outs, strict=True))
        pos = after
    end = len(graph.eqns)
    _boundaries(graph, hooks, env, end, events.get(end, ()))
    out_tree = jax.tree_util.tree_unflatten(graph.out_tree, graph.out_slots)
    out = assemble(out_tree, list(map(env.values.__getitem__, array_ids(graph.out_slots))))
    return (out, list(map(env.values.__getitem__, graph.state_ids))) if with_state else out


def _boundaries(
    graph: Graph, hooks: Hooks, env: _GraphEnv, pos: int, events: Sequence[tuple[float, str, Call]]
) -> None:
    """The boundary events at equation position `pos`, in order."""
    env.advance(pos)
    for _, side, call in events:
        tree = port_value_tree(graph, Selection(call.qualname, call, side))
        ids = array_ids(jax.tree_util.tree_leaves(tree))
        value = assemble(tree, [env.read(v, pos) for v in ids])
        new = hooks.on_boundary(BoundaryEvent(call, side, value))
        if new is value:
            continue
        leaves = _leaves_like(new, value, call.qualname, side)
        if side == INPUT:  # seen only by the call's own equations
            env.overlays.append((call.stop, dict(zip(ids, leaves, strict=True))))
        else:
            env.values.update(zip(ids, leaves, strict=True))


# --------------------------------------------------------------------------- loop bodies


@dataclasses.dataclass
class _At:
    """Where equations run, as hooks see them: the flat position, the scopes, the calls
    open around them (innermost last), and the iteration of each enclosing loop."""

    pos: int
    scopes: tuple[str, ...]
    owners: list[str]
    path: tuple[Any, ...] = ()
    rows: tuple[Any, ...] = ()
    inner: bool = False  # in a body: an equation's own scopes add to these

    def inside(self, row: Any) -> _At:
        path, rows = (*self.path, STACKED), (*self.rows, row)
        return _At(self.pos, self.scopes, list(self.owners), path, rows, True)

    def info(self, eqn: Any) -> Equation:
        scopes = self.scopes + _compat.eqn_scopes(eqn) if self.inner else self.scopes
        owner = self.owners[-1] if self.owners else None
        return Equation(
            _compat.primitive_name(eqn),
            dict(eqn.params),
            self.pos,
            scopes,
            owner,
            _compat.source_line(eqn),
        )


@dataclasses.dataclass(frozen=True)
class _Ref:
    """Stands for array leaf `leaf` of a call side while its value tree is built."""

    leaf: int


class _RuleEnv(Env):
    """A jaxpr's values as the rules see them: which are the program's variables
    (parameters), with replaced inputs overlaid (each seen until its call's output
    side, by the call's own equations). At the top level, where the flat graph holds
    the values, it only says which operands of the one equation are parameters."""

    def __init__(self, params: set[Any]):
        super().__init__()
        self.params = params
        self.overlays: list[tuple[int, dict[Any, Any]]] = []  # by id of the call's record

    def read(self, atom: Any) -> Any:
        if not _compat.is_literal(atom):
            for _, values in reversed(self.overlays):
                if atom in values:
                    return values[atom]
        return super().read(atom)

    @classmethod
    def operands(cls, eqn: Any, free: Iterable[bool]) -> _RuleEnv:
        """At the top level: which operands of the one equation `eqn` are parameters."""
        atoms = zip(eqn.invars, free, strict=True)
        return cls({a for a, f in atoms if f and not _compat.is_literal(a)})

    def is_param(self, atom: Any) -> bool:
        return _compat.is_literal(atom) or atom in self.params

    def params_of(self, eqn: Any) -> list[bool]:
        """Which operands of `eqn` are the program's variables (or constants) themselves."""
        return [self.is_param(a) for a in eqn.invars]


class _Rules(Evaluator):
    """The rules for equations: markers shown to the hooks, loops kept as loops,
    call-like bodies with boundaries inline, every equation bound shown to the
    equation hook."""

    def __init__(self, graph: Graph, hooks: Hooks):
        self.hooks = hooks
        self.calls = {
            id(c.record): c
            for c in graph.calls
            if c.loop is not None and c.record is not None and c.template is not None
        }
        # whether a boundary the graph lists is inside an equation's bodies
        self.holds = Finder(lambda e: self._is_ours(_compat.marker_payload(e))).inside

    def _is_ours(self, marker: Any) -> bool:
        return marker is not None and id(getattr(marker, "record", None)) in self.calls

    # ------------------------------------------------------------------ the rules

    def loop(self, eqn: Any, rule: LoopRule, ins: list[Any], env: _RuleEnv, at: _At) -> list[Any]:
        """A loop whose body holds boundaries stays a loop of its kind, its body run once
        through the rules, the iteration index carried for the hooks (`LoopRule.run`)."""
        if not self.holds(eqn):
            return self.other(eqn, ins, env, at)

        def step(jaxpr: Any, consts: Any, args: list[Any], i: Any, free: list[bool]) -> Any:
            token = self.hooks.open_loop()
            outs = self.body(jaxpr, consts, args, at.inside(i), free)
            return outs, self.hooks.close_loop(token)

        skip = self.hooks.skipped_rows(eqn, at.path) if rule.counted else 0
        outs, leaving = rule.run(eqn, ins, env.params_of(eqn), step, skip)
        if leaving:
            self.hooks.leave_loop(dict(leaving))
        return outs

    def call(
        self, eqn: Any, body: tuple[Any, Sequence[Any]], ins: list[Any], env: _RuleEnv, at: _At
    ) -> list[Any]:
        if not (self.hooks.recurse or self.holds(eqn)):
            return self.other(eqn, ins, env, at)
        inner = at if at.inner else dataclasses.replace(at, inner=True)
        return self.body(body[0], body[1], ins, inner, env.params_of(eqn))

    def other(self, eqn: Any, ins: list[Any], env: _RuleEnv, at: _At) -> list[Any]:
        outs = _compat.bind_eqn(eqn, ins)
        return self.hooks.equation(at.info(eqn), ins, outs)

    def body(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        at: _At,
        free: Sequence[bool],
    ) -> list[Any]:
        """A jaxpr evaluated by the rules, its markers shown to the hooks; `free` says
        which of `args` are the program's variables (a scanned row of stacked
        parameters, say): they are no module's input (SPEC: ports are arguments that are
        not parameters)."""
        params = {v for v, f in zip(jaxpr.invars, free, strict=True) if f}
        params.update(jaxpr.constvars)
        return self.run(jaxpr, consts, args, at, _RuleEnv(params))

    def call_side(self, markers: Sequence[Any], env: _RuleEnv, at: _At) -> None:
        """One side of a call the graph lists, shown to the hooks (the markers are
        dropped: the program the hooks see has none)."""
        first = _compat.marker_payload(markers[0])
        if self._is_ours(first):
            self._boundary(first.record, first.side, markers, env, at)

    def _boundary(
        self, record: Any, side: str, markers: Sequence[Any], env: _RuleEnv, at: _At
    ) -> None:
        found = {}
        for m in markers:
            leaf = _compat.marker_payload(m).leaf
            if leaf != PLACEHOLDER:
                found[leaf] = m.invars[0]
        refs = _side_refs(record, side, lambda r: env.is_param(found[r.leaf]))
        value = jax.tree_util.tree_map(lambda r: env.read(found[r.leaf]), refs)
        event = BoundaryEvent(self.calls[id(record)], side, value, at.path, at.rows)
        if side == INPUT:
            at.owners.append(event.name)
        new = self.hooks.on_boundary(event)
        if side != INPUT:
            env.overlays[:] = [o for o in env.overlays if o[0] != id(record)]
            if at.owners:
                at.owners.pop()
        if new is value:
            return
        new_leaves = _leaves_like(new, value, event.name, side)
        order = jax.tree_util.tree_leaves(refs)
        replaced = {
            found[r.leaf]: x
            for r, x in zip(order, new_leaves, strict=True)
            if not _compat.is_literal(found[r.leaf])
        }
        if side == INPUT:
            env.overlays.append((id(record), replaced))
        else:
            env.values.update(replaced)


def _side_refs(record: Any, side: str, is_param: Any) -> Any:
    """A call side's value tree with a `_Ref` per array leaf: the result, or the
    positional arguments that are not parameters (one, or a tuple of them; the keywords
    if there are none)."""
    if side == INPUT:
        is_array = record.in_is_array
        leaves = [_Ref(i) if a else None for i, a in enumerate(is_array)]
        args, kwargs = jax.tree_util.tree_unflatten(record.in_tree, leaves)
        args = [a for a in args if not _all_params(a, is_param)]
        if not args:
            return kwargs
        return args[0] if len(args) == 1 else tuple(args)
    statics = record.out_statics
    leaves = [_Ref(i) if a else statics[i] for i, a in enumerate(record.out_is_array)]
    return jax.tree_util.tree_unflatten(record.out_tree, leaves)


def _all_params(tree: Any, is_param: Any) -> bool:
    refs = jax.tree_util.tree_leaves(tree)
    return bool(refs) and all(is_param(r) for r in refs)


_compat.register_frames_exclusion(__file__)
