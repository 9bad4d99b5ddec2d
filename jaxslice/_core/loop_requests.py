"""What to do with each loop a slice's names point into, and the pieces it is cut into.

`request` turns the records of the names (`selection.Selection`) into a tree that follows the program's
nesting: a `Body` (the program, or one loop body) holds, per loop equation in it, a
`Loop`: the iterations to write out (each a `Body` again) and the `Body` of the values
to stack over every iteration. `pieces` then cuts a loop's rows into the ranges that run
as scans and the iterations written out, around the iterations marked on the carry
(`Edge`, for the calls whose ports are the loop's carry and constants: `carry_ports`).

Pure bookkeeping over the request and the body jaxpr: nothing here traces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .. import _compat
from .lifted import body_ports
from .markers import INPUT, OUTPUT, CallRecord
from .names import STACKED
from .selection import Selection

# --------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Body:
    """What to do inside one loop body (or the top-level program)."""

    loops: dict[int, Loop] = dataclasses.field(default_factory=dict)  # by id of the eqn
    targets: set[tuple[int, str]] = dataclasses.field(default_factory=set)  # (record, side)
    # Loops named as a whole call (a lifted module): by id of the eqn, the record of
    # the call its body makes (`names.lifted_template`).
    wholes: dict[int, CallRecord] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Loop:
    """What to do with one loop equation: iterations to write out, values to stack."""

    splits: dict[int, Body] = dataclasses.field(default_factory=dict)
    stacked: Body | None = None


def request(refs: Sequence[Selection]) -> Body:
    """The loops to split, and how, for these names."""
    root = Body()
    for ref in refs:
        body = root
        sites = ref.sites
        for site, index in zip(sites, ref.path, strict=True):
            loop = body.loops.setdefault(id(site.eqn), Loop())
            if index == STACKED:
                loop.stacked = loop.stacked or Body()
                body = loop.stacked
            else:
                body = loop.splits.setdefault(index, Body())
        if ref.whole:
            body.wholes[id(ref.call.loop.eqn)] = ref.call.record
        body.targets.add((id(ref.call.record), ref.side))
    return root


def merged(a: Body | None, b: Body | None) -> Body:
    """Both requests for one body."""
    if a is None or b is None:
        return a or b or Body()
    loops = dict(a.loops)
    for key, loop in b.loops.items():
        mine = loops.get(key)
        loops[key] = loop if mine is None else _merged_loop(mine, loop)
    return Body(loops, a.targets | b.targets, {**a.wholes, **b.wholes})


def _merged_loop(a: Loop, b: Loop) -> Loop:
    splits = dict(a.splits)
    for k, body in b.splits.items():
        splits[k] = merged(splits.get(k), body)
    stacked = merged(a.stacked, b.stacked) if a.stacked or b.stacked else None
    return Loop(splits, stacked)


def relative_targets(body: Body, prefix: tuple[Any, ...] = ()) -> set[tuple[int, tuple]]:
    """``(record, path below this body)`` of every name a stacked body holds."""
    found = {(rid, prefix) for rid, _ in body.targets}
    for loop in body.loops.values():
        for k, sub in loop.splits.items():
            found |= relative_targets(sub, (*prefix, k))
        if loop.stacked is not None:
            found |= relative_targets(loop.stacked, (*prefix, STACKED))
    return found


# --------------------------------------------------------------------------- pieces


@dataclasses.dataclass(frozen=True)
class Edge:
    """An iteration named only as a whole call whose ports are the loop's carry (and
    constants): its record, ``{side: [(leaf, (kind, index))]}`` and the sides named."""

    record: CallRecord
    ports: dict[str, list[tuple[int, tuple[str, int]]]]
    sides: frozenset[str]


def only_record(body: Body) -> int | None:
    """The one call an iteration's request names, if it names one call and no loop."""
    rids = {rid for rid, _ in body.targets}
    return next(iter(rids)) if len(rids) == 1 and not body.loops and not body.wholes else None


def carry_ports(parts: Any) -> dict[int, Any]:
    """Records called directly in a scan body, once, whose array inputs are the body's
    constants or carry and whose array outputs are its carry results.

    Returns ``{id(record): (record, {side: [(leaf, (kind, index))]})}``.
    """
    found = {}
    for rid, (record, ports) in body_ports(parts.jaxpr).items():
        sides = {side: _carry_sources(side, leaves, parts) for side, leaves in ports.items()}
        if all(sources is not None for sources in sides.values()):
            found[rid] = (record, sides)
    return found


def _carry_sources(side: str, leaves: dict[int, int], parts: Any) -> list[Any] | None:
    """``[(leaf, (kind, index))]`` for leaves that are constants or carry, else None."""
    nc, nk = parts.num_consts, parts.num_carry
    out = []
    for leaf, j in leaves.items():
        if side == OUTPUT:
            source = ("carry", j) if j < nk else None
        elif j < nc:
            source = ("const", j)
        else:
            source = ("carry", j - nc) if j < nc + nk else None
        if source is None:
            return None
        out.append((leaf, source))
    return out


def pieces(
    length: int, splits: dict[int, Any], edges: dict[int, Edge], reverse: bool
) -> list[tuple[int, int, bool]]:
    """Row ranges ``(a, b, written_out)`` covering ``0:length`` in ascending order."""
    cuts = {0, length}
    written = {k for k in splits if k not in edges}
    for k in written:
        cuts |= {k, k + 1}
    for k, edge in edges.items():
        cuts |= _edge_cuts(k, edge.sides, reverse)
    ordered = sorted(cuts)
    pairs = zip(ordered[:-1], ordered[1:], strict=True)
    return [(a, b, a in written and b == a + 1) for a, b in pairs]


def _edge_cuts(k: int, sides: frozenset[str], reverse: bool) -> set[int]:
    """Where pieces must end for iteration `k`'s input (before it) and output (after it)."""
    before, after = (k + 1, k) if reverse else (k, k + 1)
    return {cut for side, cut in ((INPUT, before), (OUTPUT, after)) if side in sides}


_compat.register_frames_exclusion(__file__)
