"""The values one state entry takes between the calls of a module called several times.

A module called more than once (a shared block with a batch norm, in train mode)
updates its state in each call, and each call reads what the one before it wrote. The
traced program keeps those in-between values as ordinary values with nothing that says
which entry they belong to; this module finds them, walking back from the entry's final
value. Model: the value an updating call reads is the one value its update takes from
before the call that is neither one of the call's arguments, a constant, a random key
nor another variable, and has the entry's shape and dtype.

Sharp edge: where that is not exactly one value (an update that reads two entries of
the same shape, or none while earlier calls of the module exist), the chain is unknown
(None), and the planner keeps the model's final value for the entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from .graph import Call, Graph


@dataclasses.dataclass(frozen=True)
class Chain:
    """A state entry's values around its module's updating calls, in program order."""

    before: int | None  # what the first updating call reads (the stored variable); None: nothing
    steps: tuple[tuple[Call, int], ...]  # each updating call and the value it leaves

    def in_slice(self, runs: Collection[int]) -> tuple[int | None, int | None]:
        """``(read, after)`` for a slice that runs the calls whose `id` is in `runs`:
        the value its first updating call reads and the value its last one leaves;
        ``(None, None)`` where it runs none of them."""
        ran = [k for k, (call, _) in enumerate(self.steps) if id(call) in runs]
        if not ran:
            return None, None
        first = ran[0]
        read = self.before if first == 0 else self.steps[first - 1][1]
        return read, self.steps[ran[-1]][1]


def update_chain(graph: Graph, calls: Sequence[Call], final: int, stored: int | None) -> Any:
    """The `Chain` of the entry whose final value is `final` and whose stored value (a
    variable) is `stored`, over `calls`, the calls of its module outside loops; None
    where it cannot be told. Only entries of a module with several calls need one."""
    steps: list[tuple[Call, int]] = []
    value: int | None = final
    while value is not None and value != stored:
        call = _innermost(calls, graph.producer.get(value))
        if call is None:
            break
        if steps and call.start >= steps[-1][0].start:
            return None  # not an earlier call: no chain to follow
        steps.append((call, value))
        found = _read_before(graph, call, value, stored)
        if len(found) > 1 or (not found and any(c.start < call.start for c in calls)):
            return None
        value = found[0] if found else None
    return Chain(value, tuple(reversed(steps)))


def _innermost(calls: Sequence[Call], eqn: int | None) -> Call | None:
    """The call with the shortest span that holds equation `eqn`."""
    if eqn is None:
        return None
    holding = [c for c in calls if c.start <= eqn < c.stop]
    return min(holding, key=lambda c: c.stop - c.start, default=None)


def _read_before(graph: Graph, call: Call, value: int, stored: int | None) -> list[int]:
    """The values from before `call` that its equations computing `value` read and that
    could be the entry's previous value (see the module docstring)."""
    aval = graph.avals[value]
    arguments = {s.id for s in call.in_slots}
    others = set(graph.variable_ids) - {stored}
    found: list[int] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        eqn = graph.producer.get(v)
        if eqn is not None and call.start <= eqn < call.stop:
            stack.extend(graph.eqns[eqn].ins)
        elif not (v in arguments or v in others or (graph.is_free(v) and v != stored)):
            if _same_type(graph.avals[v], aval):
                found.append(v)
    return found


def _same_type(a: Any, b: Any) -> bool:
    return getattr(a, "shape", None) == getattr(b, "shape", None) and getattr(
        a, "dtype", None
    ) == getattr(b, "dtype", None)
