"""Running part of a graph again as an ordinary JAX function (stage 4).

`emit` makes a function that reads a fixed list of value ids from its arguments,
evaluates the chosen equations in program order by binding each primitive again
(`_compat.bind_eqn`, as `jax.core.eval_jaxpr` does), and returns the requested values.
Marker equations are not in the graph's equation list, so they never appear in the
result. Because evaluation happens at trace time, wrapping the function in `jax.jit`
compiles exactly the chosen equations and nothing else.

`emit_jaxpr` makes the same function from one ready-made jaxpr of those equations, for
the calls `jax.jit` traces at the traced shapes: its equations are not bound again.

`evaluate.py` runs a whole graph with hooks at every boundary and equation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from .. import _compat
from .graph import Graph, Slot
from .ports import map_ports


def emit(
    graph: Graph,
    eqns: Sequence[Any],
    arg_ids: Sequence[Sequence[int]],
    output_ids: Sequence[int],
    before: Callable[[int, dict[int, Any]], None] | None = None,
) -> Callable[..., list[Any]]:
    """A function ``f(*groups) -> outputs``; ``groups[k]`` holds values for ``arg_ids[k]``.

    `before`, if given, is called as ``before(k, values)`` before the k-th equation runs
    and once more, with ``k = len(eqns)``, after the last (`remark` marks calls there);
    `values` holds every value computed so far, by id."""
    eqns = list(eqns)
    consts = _consts(graph, eqns, output_ids, set())
    arg_ids = [tuple(ids) for ids in arg_ids]
    output_ids = tuple(output_ids)

    kept = _kept_results(eqns, {v for ids in arg_ids for v in ids})

    def run(*groups: Sequence[Any]) -> list[Any]:
        env: dict[int, Any] = dict(consts)
        for ids, values in zip(arg_ids, groups, strict=True):
            env.update(zip(ids, values, strict=True))
        for i, (eqn, keep) in enumerate(zip(eqns, kept, strict=True)):
            if before is not None:
                before(i, env)
            outs = _compat.bind_eqn(eqn.jax_eqn, [env[v] for v in eqn.ins])
            pairs = zip(eqn.outs, outs, strict=True)
            env.update(
                pairs if keep is None else (p for p, k in zip(pairs, keep, strict=True) if k)
            )
        if before is not None:
            before(len(eqns), env)
        return [env[v] for v in output_ids]

    return run


def emit_jaxpr(
    graph: Graph,
    eqns: Sequence[Any],
    arg_ids: Sequence[Sequence[int]],
    output_ids: Sequence[int],
) -> Callable[..., list[Any]] | None:
    """`emit`'s function made of one ready-made jaxpr of the same equations, renamed but
    not bound again (`_compat.call_inlined`): where `jax.jit` traces it, the equations
    join that trace as they are, with no abstract evaluation per equation. The jaxpr's
    shapes are the traced ones, so it serves calls of the traced signature (not `export`,
    whose batch size is symbolic). None where the arguments repeat a value (a jaxpr's
    inputs are distinct) or a constant has no JAX type."""
    flat = [v for ids in arg_ids for v in ids]
    name = _Names(graph, given=set(flat))
    consts = _consts(graph, eqns, output_ids, name.given)
    if len(name.given) != len(flat) or None in map(graph.avals.__getitem__, consts):
        return None
    invars = list(map(name, flat))
    constvars = list(map(name, consts))
    renamed = [_compat.renamed_eqn(e.jax_eqn, map(name, e.ins), name.results(e)) for e in eqns]
    outvars = list(map(name, output_ids))
    closed = _compat.new_closed_jaxpr(constvars, list(consts.values()), invars, outvars, renamed)

    def run(*groups: Sequence[Any]) -> list[Any]:
        return _compat.call_inlined(closed, [x for values in groups for x in values])

    return run


class _Names:
    """A new jaxpr variable for each value of a graph, made when first asked for."""

    def __init__(self, graph: Graph, given: set[int]):
        self.avals = graph.avals
        self.given = given  # the values the function is given
        self.made: dict[int, Any] = {}

    def __call__(self, v: int) -> Any:
        found = self.made.get(v)
        if found is None:
            found = self.made[v] = _compat.new_var(self.avals[v])
        return found

    def results(self, eqn: Any) -> list[Any]:
        """An equation's results; one the function is given stays the given value (a
        variable nothing reads takes its place, as in `_kept_results`)."""
        return [_compat.new_var(self.avals[v]) if v in self.given else self(v) for v in eqn.outs]


def _consts(
    graph: Graph, eqns: Sequence[Any], output_ids: Sequence[int], given: set[int]
) -> dict[int, Any]:
    """The graph's constants that the equations read or the outputs are (by id, in id
    order), except those the function is given."""
    read = {v for e in eqns for v in e.ins} | set(output_ids)
    return {v: graph.consts[v] for v in sorted(read - given) if v in graph.consts}


def _kept_results(eqns: Sequence[Any], given: set[int]) -> list[list[bool] | None]:
    """Per equation, which results to keep (None: all). An equation the slice needs for
    one result may also compute a value the slice is given (a loop whose carry is a
    start, say): the given value wins."""
    return [[v not in given for v in e.outs] if given & set(e.outs) else None for e in eqns]


def assemble(trees: Any, values: Sequence[Any]) -> Any:
    """Fills pytrees of `Slot`s (one, a plain tuple or a plain dict of them) with `values`
    in order. Each tree keeps its own structure: a NamedTuple, a dataclass or a dict
    subclass the model returns comes back as that type, its None fields included."""
    it = iter(values)

    def fill(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda s: next(it) if s.id is not None else s.static,
            tree,
            is_leaf=lambda x: isinstance(x, Slot),
        )

    return map_ports(fill, trees)


_compat.register_frames_exclusion(__file__)
