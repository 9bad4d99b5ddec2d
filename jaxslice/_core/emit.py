"""Running part of a graph again as an ordinary JAX function (stage 4).

`emit` makes a function that reads a fixed list of value ids from its arguments,
evaluates the chosen equations in program order by binding each primitive again
(`_compat.bind_eqn`, as `jax.core.eval_jaxpr` does), and returns the requested values.
Marker equations are not in the graph's equation list, so they never appear in the
result. Because evaluation happens at trace time, wrapping the function in `jax.jit`
compiles exactly the chosen equations and nothing else.

`evaluate` runs a whole graph and calls hooks at every boundary and equation (the engine
behind `js.Interpreter` and `js.edit`): a hook may replace the values it is shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from .. import _compat
from .._errors import SliceError
from .graph import Call, Graph, Slot, innermost
from .markers import INPUT
from .ports import Port, array_ids, map_ports, port_value_tree


def emit(
    graph: Graph,
    eqns: Sequence[Any],
    arg_ids: Sequence[Sequence[int]],
    output_ids: Sequence[int],
) -> Callable[..., list[Any]]:
    """A function ``f(*groups) -> outputs``; ``groups[k]`` holds values for ``arg_ids[k]``."""
    eqns = list(eqns)
    needed = {v for e in eqns for v in e.ins} | set(output_ids)
    consts = {v: graph.consts[v] for v in needed & graph.consts.keys()}
    arg_ids = [tuple(ids) for ids in arg_ids]
    output_ids = tuple(output_ids)

    kept = _kept_results(eqns, {v for ids in arg_ids for v in ids})

    def run(*groups: Sequence[Any]) -> list[Any]:
        env: dict[int, Any] = dict(consts)
        for ids, values in zip(arg_ids, groups, strict=True):
            env.update(zip(ids, values, strict=True))
        for eqn, keep in zip(eqns, kept, strict=True):
            outs = _compat.bind_eqn(eqn.jax_eqn, [env[v] for v in eqn.ins])
            pairs = zip(eqn.outs, outs, strict=True)
            env.update(
                pairs if keep is None else (p for p, k in zip(pairs, keep, strict=True) if k)
            )
        return [env[v] for v in output_ids]

    return run


def _kept_results(eqns: Sequence[Any], given: set[int]) -> list[list[bool] | None]:
    """Per equation, which results to keep (None: all). An equation the slice needs for
    one result may also compute a value the slice is given (a loop whose carry is a
    start, say): the given value wins."""
    return [[v not in given for v in e.outs] if given & set(e.outs) else None for e in eqns]


def assemble(trees: Any, values: Sequence[Any]) -> Any:
    """Fills pytrees of `Slot`s (one, a tuple or a dict of them) with `values` in order."""
    it = iter(values)

    def fill(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda s: next(it) if s.id is not None else s.static,
            tree,
            is_leaf=lambda x: isinstance(x, Slot),
        )

    return map_ports(fill, trees)


# --------------------------------------------------------------------------- hooks


@dataclasses.dataclass(frozen=True)
class BoundaryEvent:
    """One side of one module call, as a hook sees it."""

    call: Call
    side: str  # "input" or "output"
    value: Any  # the call's array arguments (input) or its result pytree (output)

    @property
    def name(self) -> str:
        return self.call.qualname


@dataclasses.dataclass(frozen=True)
class Equation:
    """What an `Interpreter.equation` hook learns about one equation.

    Attributes:
      primitive: the primitive's name (``"dot_general"``, ``"max"``, ...).
      params: the primitive's parameters.
      index: the equation's position in the flat program.
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


class Hooks(Protocol):
    recurse: bool

    def on_boundary(self, event: BoundaryEvent) -> Any: ...

    def equation(self, eqn: Equation, inputs: list[Any], outputs: list[Any]) -> list[Any]: ...


def _events(graph: Graph) -> dict[int, list[tuple[float, str, Call]]]:
    """Boundary events by equation position, in the order they happen there.

    Calls that share a position open in the order of their first input marker and close in
    that of their last output marker (`Call.in_seq`, `Call.out_seq`). Scope regions have no
    markers: their orders (infinite by default) open them after, and close them before,
    the marked calls there.
    """
    events: dict[int, list[tuple[float, str, Call]]] = {}
    for call in _outside_loops(graph):
        events.setdefault(call.start, []).append((call.in_seq, INPUT, call))
        events.setdefault(call.stop, []).append((call.out_seq, "output", call))
    for evs in events.values():
        evs.sort(key=lambda e: e[0])
    return events


class _Env:
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
) -> Any:
    """Runs `graph` equation by equation, calling `hooks`; returns the model's output."""
    env = _Env(_initial_values(graph, var_values, rng_values, inputs))
    events = _events(graph)
    owners = innermost(_outside_loops(graph), len(graph.eqns))
    # Regions inlined only to drop dead code run as their original equation here, as
    # the hooks saw them before inlining (unless the hooks look inside call-like ones).
    whole = (
        {}
        if hooks.recurse
        else {r.start: r for r in graph.regions if r.opaque and r.stop > r.start}
    )
    pos = 0
    while pos < len(graph.eqns):
        owner = owners[pos].qualname if owners[pos] else None
        _boundaries(graph, hooks, env, pos, events.get(pos, ()))
        region = whole.get(pos)
        _equation(hooks, env, pos, owner, region.eqn if region else graph.eqns[pos])
        pos = region.stop if region else pos + 1
    end = len(graph.eqns)
    _boundaries(graph, hooks, env, end, events.get(end, ()))
    out_tree = jax.tree_util.tree_unflatten(graph.out_tree, graph.out_slots)
    return assemble(out_tree, [env.values[v] for v in array_ids(graph.out_slots)])


def _initial_values(
    graph: Graph, var_values: list[Any], rng_values: list[Any], inputs: list[Any]
) -> dict[int, Any]:
    values = dict(graph.consts)
    values.update(zip(graph.variable_ids, var_values, strict=True))
    values.update(zip(graph.rng_ids, rng_values, strict=False))
    values.update(zip(graph.input_ids, inputs, strict=True))
    return values


def _outside_loops(graph: Graph) -> list[Call]:
    return [c for c in graph.calls if c.loop is None]


HOOK_STRUCTURE = (
    "The boundary hook for {name!r} ({side}) returned a value of structure {got}; it must "
    "keep the structure {want}."
)


def _boundaries(
    graph: Graph, hooks: Hooks, env: _Env, pos: int, events: Sequence[tuple[float, str, Call]]
) -> None:
    """The boundary events at equation position `pos`, in order."""
    env.advance(pos)
    for _, side, call in events:
        _boundary(graph, hooks, env, pos, call, side)


def _boundary(graph: Graph, hooks: Hooks, env: _Env, pos: int, call: Call, side: str) -> None:
    tree = port_value_tree(graph, Port(call.qualname, call, side))
    ids = array_ids(jax.tree_util.tree_leaves(tree))
    value = assemble(tree, [env.read(v, pos) for v in ids])
    new = hooks.on_boundary(BoundaryEvent(call, side, value))
    if new is not value:
        leaves = _leaves_like(new, value, call, side)
        if side == INPUT:  # seen only by the call's own equations
            env.overlays.append((call.stop, dict(zip(ids, leaves, strict=True))))
        else:
            env.values.update(zip(ids, leaves, strict=True))


def _leaves_like(new: Any, value: Any, call: Call, side: str) -> list[Any]:
    """The leaves of a hook's replacement `new`, which must have `value`'s structure."""
    leaves, treedef = jax.tree_util.tree_flatten(new)
    want = jax.tree_util.tree_structure(value)
    if treedef != want:
        raise SliceError(
            HOOK_STRUCTURE.format(name=call.qualname, side=side, got=treedef, want=want)
        )
    return leaves


@dataclasses.dataclass(frozen=True)
class _Site:
    """Where the equations of a call-like equation's body run, as hooks see them: the
    position of that equation in the flat program, its scopes and its innermost boundary."""

    pos: int
    scopes: tuple[str, ...]
    owner: str | None

    def info(self, jax_eqn: Any, scopes: tuple[str, ...]) -> Equation:
        return Equation(
            _compat.primitive_name(jax_eqn),
            dict(jax_eqn.params),
            self.pos,
            scopes,
            self.owner,
            _compat.source_line(jax_eqn),
        )


def _equation(hooks: Hooks, env: _Env, pos: int, owner: str | None, eqn: Any) -> None:
    site = _Site(pos, eqn.scopes, owner)
    ins = [env.read(v, pos) for v in eqn.ins]
    outs = _outputs(eqn.jax_eqn, ins, hooks, site)
    outs = hooks.equation(site.info(eqn.jax_eqn, eqn.scopes), ins, outs)
    env.values.update(zip(eqn.outs, outs, strict=True))


def _outputs(jax_eqn: Any, ins: list[Any], hooks: Hooks, site: _Site) -> list[Any]:
    """Runs one equation: its body equation by equation when the hooks recurse into
    call-like equations, else its primitive."""
    body = _compat.call_body(jax_eqn) if hooks.recurse else None
    if body is None:
        return _compat.bind_eqn(jax_eqn, ins)
    return _eval_body(body, ins, hooks, site)


def _eval_body(body: Any, ins: list[Any], hooks: Hooks, site: _Site) -> list[Any]:
    jaxpr, consts = body
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, ins, strict=True))
    for eqn in jaxpr.eqns:
        args = [_read(env, a) for a in eqn.invars]
        outs = _outputs(eqn, args, hooks, site)
        info = site.info(eqn, site.scopes + _compat.eqn_scopes(eqn))
        for v, o in zip(eqn.outvars, hooks.equation(info, args, outs), strict=True):
            if not _compat.is_dropvar(v):
                env[v] = o
    return [_read(env, a) for a in jaxpr.outvars]


def _read(env: dict[Any, Any], atom: Any) -> Any:
    return _compat.literal_value(atom) if _compat.is_literal(atom) else env[atom]


_compat.register_frames_exclusion(__file__)
