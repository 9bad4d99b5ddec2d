"""`jax.named_scope` regions as calls (part of stage 2, `build.py`, for targets that ask).

A region is a run of consecutive equations sharing a scope prefix: it reads the values
it uses but does not make, and returns those it makes that something after it reads.
Regions inside loop bodies are listed under their name but cannot be sliced (there is
one per iteration). A region is added only where no marked call already has its name.

Sharp edge: a region found only through the name stack cannot tell two back-to-back
calls of one scope apart; `js.mark` can.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from .graph import Call, Graph, LoopSite, Slot
from .markers import Origin
from .names import unslotted
from .ports import array_ids


def scope_prefixes(scopes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every non-empty prefix of `scopes`, outer first."""
    return [scopes[: k + 1] for k in range(len(scopes))]


def with_scope_calls(
    g: Graph, calls: list[Call], loop_scopes: dict[tuple[str, ...], tuple[int, LoopSite]]
) -> list[Call]:
    """The marked `calls` of `g` plus `jax.named_scope` regions no marked call already
    names, and the scopes seen in loop bodies (``{scope: (loop position, loop)}``)."""
    calls = list(calls)
    calls += _unnamed(_calls_from_scopes(g), calls)
    calls += _unnamed(_loop_scope_calls(loop_scopes), calls)
    marked = [c for c in calls if not c.is_scope]
    calls.sort(key=lambda c: _span_order(c, marked))
    return calls


def _unnamed(candidates: list[Call], calls: list[Call]) -> list[Call]:
    """The candidates whose name none of `calls` has."""
    known = {c.name for c in calls} | {unslotted(c.template) for c in calls if c.template}
    known |= {"/".join(c.record.scope) for c in calls if c.record and c.record.scope}
    return [c for c in candidates if c.name not in known]


def _loop_scope_calls(loop_scopes: dict[tuple[str, ...], tuple[int, LoopSite]]) -> list[Call]:
    """One call per name of the scope regions inside loop bodies (the first with it)."""
    calls: dict[str, Call] = {}
    for scope, (pos, loop) in loop_scopes.items():
        calls.setdefault("/".join(scope), _scope_call(scope, pos, pos + 1, [], [], loop))
    return list(calls.values())


def _span_order(c: Call, marked: list[Call]) -> tuple[Any, ...]:
    """Calls by span, outer first; on the same span marked calls in marker order, then
    scope regions outer first, except that a scope region comes just before the first
    marked call of its span named inside it (``grp`` before ``grp/lin``)."""
    if not c.is_scope:
        return (c.start, -c.stop, c.in_seq, 0, 0)
    same = [m for m in marked if (m.start, m.stop) == (c.start, c.stop)]
    inside = [m.in_seq for m in same if m.named_in(c)]
    return (c.start, -c.stop, min(inside, default=math.inf), -1 if inside else 1, len(c.path))


def _scope_call(
    scope: tuple[str, ...], start: int, stop: int, reads: list[int], outs: list[int], loop: Any
) -> Call:
    out_tree = jax.tree_util.tree_structure(outs[0] if len(outs) == 1 else tuple(outs))
    return Call(
        name="/".join(scope),
        index=0,
        module_type="named_scope",
        method="",
        origin=Origin.SCOPE,
        in_tree=jax.tree_util.tree_structure((tuple(range(len(reads))), {})),
        in_slots=[Slot(v) for v in reads],
        out_tree=out_tree,
        out_slots=[Slot(v) for v in outs],
        start=start,
        stop=stop,
        loop=loop,
        path=scope,
    )


def _calls_from_scopes(g: Graph) -> list[Call]:
    """Regions of consecutive equations that share a `jax.named_scope` prefix.

    A region reads the values it uses but does not make (free values aside), and returns
    those it makes that the model's output or a later equation reads.
    """
    last_read = _last_reader(g)
    calls = []
    for scope, start, stop in _scope_runs(g):
        reads, made = _region_values(g, start, stop)
        outs = [v for v in made if last_read.get(v, -1) >= stop]
        calls.append(_scope_call(scope, start, stop, reads, outs, None))
    return calls


def _scope_runs(g: Graph) -> list[tuple[tuple[str, ...], int, int]]:
    """``(scope, start, stop)`` of each run of equations sharing a scope prefix."""
    runs: list[tuple[tuple[str, ...], int, int]] = []
    open_runs: dict[tuple[str, ...], int] = {}  # scope -> start of its run
    for pos, eqn in enumerate(g.eqns):
        prefixes = scope_prefixes(eqn.scopes)
        runs += _close_runs(open_runs, prefixes, pos)
        for p in prefixes:
            open_runs.setdefault(p, pos)
    runs += _close_runs(open_runs, [], len(g.eqns))
    runs.sort(key=lambda r: (r[1], -r[2], len(r[0])))
    return runs


def _close_runs(
    open_runs: dict[tuple[str, ...], int], kept: list[tuple[str, ...]], stop: int
) -> list[tuple[tuple[str, ...], int, int]]:
    """Ends at `stop` (and forgets) the open runs whose scope is not in `kept`."""
    ended = [p for p in open_runs if p not in kept]
    return [(p, open_runs.pop(p), stop) for p in ended]


def _region_values(g: Graph, start: int, stop: int) -> tuple[list[int], list[int]]:
    """The values equations ``start:stop`` read from outside (in order), and those they make."""
    made: dict[int, None] = {}
    reads: dict[int, None] = {}
    for eqn in g.eqns[start:stop]:
        for v in eqn.ins:
            if v not in made and not g.is_free(v):
                reads.setdefault(v)
        made.update(dict.fromkeys(eqn.outs))
    return list(reads), list(made)


def _last_reader(g: Graph) -> dict[int, int]:
    """The position of the last equation that reads each value; the model's output reads
    its values after every equation (at ``len(g.eqns)``)."""
    last: dict[int, int] = {}
    for pos, eqn in enumerate(g.eqns):
        last.update(dict.fromkeys(eqn.ins, pos))
    last.update(dict.fromkeys(array_ids(g.out_slots), len(g.eqns)))
    return last
