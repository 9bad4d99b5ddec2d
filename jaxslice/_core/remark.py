"""A slice run with its calls marked again, for a slice passed back as a target.

A slice's re-emitted program holds no markers, so a trace of ``sub(x)`` would see one
opaque computation. While such a slice is itself the target of a trace
(`markers.remarks`), its program runs through `marked` instead: the same equations
(`emit.emit`), with every module call that lies in the slice marked again around them,
so the new trace lists exactly the slice's boundaries (for an edited model, the
model's calls and the inserted nodes) with the values they have there.

A call lies in the slice when the slice computes or is given every array of both its
sides. Calls inside loop bodies and inside call-like regions the slice runs whole (a
`jit` it needs entirely) keep the markers their bodies already hold, so they are not
marked a second time.

Model calls are marked again as nodes (`markers.Origin.NODE`): the new trace's variables
are the slice's, held wherever the slice keeps them (an NNX slice module's ``parts``), so
a call's parameters are those its equations read, not those found under its path.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .emit import emit
from .graph import Call, Graph, Region, Slot
from .markers import INPUT, OUTPUT, Origin, mark_side, new_record
from .ports import array_ids, keyword_order


@dataclasses.dataclass(frozen=True)
class _Event:
    """One side of one call, marked before step `step` of the emitted equations."""

    step: int
    order: tuple[int, float]  # (equation position, marker order): the order events run in
    side: str
    call: Call


def marked(
    graph: Graph,
    eqns: Sequence[Any],
    arg_ids: Sequence[Sequence[int]],
    output_ids: Sequence[int],
) -> Callable[..., list[Any]]:
    """`emit.emit`'s function, marking the calls that lie in the slice again as it runs."""
    given = {v for ids in arg_ids for v in ids} | set(graph.consts)
    known = given | {v for e in eqns for v in e.outs}
    events = _events(graph, eqns, known)
    records: dict[int, Any] = {}

    def before(step: int, values: dict[int, Any]) -> None:
        for event in events.get(step, ()):
            _mark(event, values, records)

    return emit(graph, eqns, arg_ids, output_ids, before)


def _events(graph: Graph, eqns: Sequence[Any], known: set[int]) -> dict[int, list[_Event]]:
    """The sides of the calls that lie in the slice, by the step they are marked before,
    in the order they happen (as `evaluate` shows them)."""
    steps = _positions(graph, eqns)
    whole = [r for r in graph.regions if r.eqn in eqns]
    events = []
    for call in graph.calls:
        if call.loop is not None or not _lies_in(call, known, whole):
            continue
        # A call without equations closes right after it opens.
        out_seq = max(call.out_seq, call.in_seq) if call.start == call.stop else call.out_seq
        for side, at, seq in ((INPUT, call.start, call.in_seq), (OUTPUT, call.stop, out_seq)):
            step = bisect.bisect_left(steps, at)  # the first step at or after `at`
            events.append(_Event(step, (at, seq), side, call))
    by_step: dict[int, list[_Event]] = {}
    for event in sorted(events, key=lambda e: (e.step, e.order)):
        by_step.setdefault(event.step, []).append(event)
    return by_step


def _positions(graph: Graph, eqns: Sequence[Any]) -> list[int]:
    """The position of each emitted equation in the graph (in order): a region run as
    its original equation is at the first of the equations it was inlined into."""
    position = {id(e): i for i, e in enumerate(graph.eqns)}
    position.update({id(r.eqn): r.start for r in graph.regions})
    return [position[id(e)] for e in eqns]


def _lies_in(call: Call, known: set[int], whole: Sequence[Region]) -> bool:
    """Whether the slice has every array of a call's two sides, and the call is not inside
    a region that runs as one equation (whose body marks it already)."""
    if any(r.start <= call.start and call.stop <= r.stop for r in whole):
        return False
    if call.out_seq == float("-inf") and not call.is_scope:  # no output: not a whole call
        return False
    ids = array_ids([*call.in_slots, *call.out_slots])
    return all(v in known for v in ids)


def _mark(event: _Event, values: dict[int, Any], records: dict[int, Any]) -> None:
    call = event.call
    filled = jax.tree_util.tree_map(
        lambda s: s.static if s.id is None else values[s.id],
        call.port_tree(event.side),
        is_leaf=lambda x: isinstance(x, Slot),
    )
    if event.side == OUTPUT:
        mark_side(records.pop(id(call)), OUTPUT, filled)
        return
    record = records[id(call)] = new_record(
        origin=Origin.NODE if call.origin in (Origin.MODULE, Origin.SCOPE) else call.origin,
        path=_path(call),
        method=call.method,
        module_type=call.module_type,
        scope=getattr(call.record, "scope", None),
    )
    args, kwargs = filled
    mark_side(record, INPUT, (args, {k: kwargs[k] for k in keyword_order(call, kwargs)}))


def _path(call: Call) -> tuple[str, ...]:
    """The path a call is marked again under, so that it keeps its name: a `js.mark` is
    named by the scopes around it too, which the new trace does not open; an iteration
    of a loop written out (``layers[3]/attn``) has no loop around it there, so its
    index becomes part of its name (listed as ``layers\\[3]/attn``)."""
    if call.origin is Origin.MARK:
        return (call.name,)
    if getattr(call.record, "display", None) is not None:
        return tuple(call.name.split("/"))
    return call.path
