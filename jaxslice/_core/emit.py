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
from .ports import Port, port_value_tree


def emit(
    graph: Graph,
    eqns: Sequence[Any],
    arg_ids: Sequence[Sequence[int]],
    output_ids: Sequence[int],
) -> Callable[..., list[Any]]:
    """A function ``f(*groups) -> outputs``; ``groups[k]`` holds values for ``arg_ids[k]``."""
    eqns = list(eqns)
    needed = {v for e in eqns for v in e.ins} | set(output_ids)
    consts = {v: graph.consts[v] for v in needed if v in graph.consts}
    arg_ids = [tuple(ids) for ids in arg_ids]
    output_ids = tuple(output_ids)

    def run(*groups: Sequence[Any]) -> list[Any]:
        env: dict[int, Any] = dict(consts)
        for ids, values in zip(arg_ids, groups, strict=True):
            env.update(zip(ids, values, strict=True))
        for eqn in eqns:
            outs = _compat.bind_eqn(eqn.jax_eqn, [env[v] for v in eqn.ins])
            env.update(zip(eqn.outs, outs, strict=True))
        return [env[v] for v in output_ids]

    return run


def assemble(trees: Any, values: Sequence[Any]) -> Any:
    """Fills pytrees of `Slot`s (one, a tuple or a dict of them) with `values` in order."""
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
    """Boundary events by equation position, in the order they happen there."""
    events: dict[int, list[tuple[float, str, Call]]] = {}
    for call in graph.calls:
        if call.loop is None:
            events.setdefault(call.start, []).append((_order(call, INPUT), INPUT, call))
            events.setdefault(call.stop, []).append((_order(call, "output"), "output", call))
    for evs in events.values():
        evs.sort(key=lambda e: e[0])
    return events


def _order(call: Call, side: str) -> float:
    # Scope regions have no markers: they open after and close before marked calls.
    if side == INPUT:
        return 1e18 if call.is_scope else call.in_seq
    return -1e18 if call.is_scope else call.out_seq


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
    env = _Env(dict(graph.consts))
    env.values.update(zip(graph.variable_ids, var_values, strict=True))
    env.values.update(zip(graph.rng_ids, rng_values, strict=False))
    env.values.update(zip(graph.input_ids, inputs, strict=True))
    events = _events(graph)
    owner = [c.qualname if c else None for c in innermost(_outside_loops(graph), len(graph.eqns))]
    for pos in range(len(graph.eqns) + 1):
        env.advance(pos)
        for _, side, call in events.get(pos, ()):
            _boundary(graph, hooks, env, pos, call, side)
        if pos < len(graph.eqns):
            _equation(graph, hooks, env, pos, owner[pos])
    out_tree = jax.tree_util.tree_unflatten(graph.out_tree, graph.out_slots)
    return assemble(out_tree, [env.values[s.id] for s in graph.out_slots if s.id is not None])


def _outside_loops(graph: Graph) -> list[Call]:
    return [c for c in graph.calls if c.loop is None]


HOOK_STRUCTURE = (
    "The boundary hook for {name!r} ({side}) returned a value of structure {got}; it must "
    "keep the structure {want}."
)


def _boundary(graph: Graph, hooks: Hooks, env: _Env, pos: int, call: Call, side: str) -> None:
    tree = port_value_tree(graph, Port(call.qualname, call, side))
    ids = [s.id for s in jax.tree_util.tree_leaves(tree) if s.id is not None]
    value = assemble(tree, [env.read(v, pos) for v in ids])
    new = hooks.on_boundary(BoundaryEvent(call, side, value))
    if new is value:
        return
    leaves, treedef = jax.tree_util.tree_flatten(new)
    want = jax.tree_util.tree_structure(value)
    if treedef != want:
        raise SliceError(
            HOOK_STRUCTURE.format(name=call.qualname, side=side, got=treedef, want=want)
        )
    if side == INPUT:
        env.overlays.append((call.stop, dict(zip(ids, leaves, strict=True))))
    else:
        env.values.update(zip(ids, leaves, strict=True))


def _equation(graph: Graph, hooks: Hooks, env: _Env, pos: int, owner: str | None) -> None:
    eqn = graph.eqns[pos]
    ins = [env.read(v, pos) for v in eqn.ins]
    body = _compat.call_body(eqn.jax_eqn) if hooks.recurse else None
    if body is not None:
        outs = _eval_body(body, ins, hooks, pos, eqn.scopes, owner)
    else:
        outs = _compat.bind_eqn(eqn.jax_eqn, ins)
    info = _info(eqn.jax_eqn, pos, eqn.scopes, owner)
    env.values.update(zip(eqn.outs, hooks.equation(info, ins, outs), strict=True))


def _info(jax_eqn: Any, pos: int, scopes: tuple[str, ...], owner: str | None) -> Equation:
    return Equation(
        _compat.primitive_name(jax_eqn),
        dict(jax_eqn.params),
        pos,
        scopes,
        owner,
        _compat.source_line(jax_eqn),
    )


def _eval_body(
    body: Any, ins: list[Any], hooks: Hooks, pos: int, scopes: tuple[str, ...], owner: Any
) -> list[Any]:
    jaxpr, consts = body
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, ins, strict=True))

    def read(a: Any) -> Any:
        return _compat.literal_value(a) if _compat.is_literal(a) else env[a]

    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        sub = _compat.call_body(eqn)
        if sub is not None:
            outs = _eval_body(sub, args, hooks, pos, scopes, owner)
        else:
            outs = _compat.bind_eqn(eqn, args)
        info = _info(eqn, pos, scopes + _compat.eqn_scopes(eqn), owner)
        for v, o in zip(eqn.outvars, hooks.equation(info, args, outs), strict=True):
            if not _compat.is_dropvar(v):
                env[v] = o
    return [read(a) for a in jaxpr.outvars]


_compat.register_frames_exclusion(__file__)
