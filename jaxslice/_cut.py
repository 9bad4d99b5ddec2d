"""Pure graph algorithms over a flat program: the cut and the missing-input frontier.

A program is a sequence of equations, each a pair ``(ins, outs)`` of value ids, and a
map from each computed value to the equation that writes it. Nothing here knows about
JAX; these functions are tested on hand-made programs.

The cut of a slice is the set of equations the requested outputs depend on, walking
backwards from the outputs and stopping at start values and at free values (constants,
variables, random keys). Everything else is dead code and is dropped. Each value and
equation is visited once, so the cut is linear in the size of the program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

Program = Sequence[tuple[Sequence[int], Sequence[int]]]


@dataclasses.dataclass(frozen=True)
class Cut:
    eqns: tuple[int, ...]  # equation indices to evaluate, in program order
    used_starts: frozenset[int]
    used_free: frozenset[int]
    missing: tuple[int, ...]  # values needed that are neither given nor computable


def cut(
    program: Program,
    producer: Mapping[int, int],
    starts: Collection[int],
    is_free: Callable[[int], bool],
    outputs: Sequence[int],
) -> Cut:
    """The equations needed to compute `outputs` from `starts` and free values.

    >>> prog = [((0,), (1,)), ((1,), (2,)), ((0,), (3,))]
    >>> c = cut(prog, {1: 0, 2: 1, 3: 2}, starts={1}, is_free=lambda v: False, outputs=[2])
    >>> c.eqns, sorted(c.used_starts), c.missing
    ((1,), [1], ())
    """
    starts = set(starts)
    needed: set[int] = set()
    used_starts: set[int] = set()
    used_free: set[int] = set()
    missing: list[int] = []
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in starts:
            used_starts.add(v)
        elif is_free(v):
            used_free.add(v)
        elif v in producer:
            e = producer[v]
            if e not in needed:
                needed.add(e)
                stack.extend(program[e][0])
        else:
            missing.append(v)
    return Cut(tuple(sorted(needed)), frozenset(used_starts), frozenset(used_free), tuple(missing))


def computable(
    program: Program,
    starts: Collection[int],
    is_free: Callable[[int], bool],
    eqns: Sequence[int] | None = None,
) -> set[int]:
    """Every value computable from `starts` and free values (over `eqns`, default all).

    >>> sorted(computable([((0,), (1,)), ((1, 5), (2,))], {0}, lambda v: False))
    [0, 1]
    """
    done = set(starts)
    for e in range(len(program)) if eqns is None else eqns:
        ins, outs = program[e]
        if all(v in done or is_free(v) for v in ins):
            done.update(outs)
    return done


def frontier(
    program: Program,
    producer: Mapping[int, int],
    starts: Collection[int],
    is_free: Callable[[int], bool],
    outputs: Sequence[int],
    is_landmark: Callable[[int], bool],
) -> list[int]:
    """The latest values that the outputs need but that cannot be computed.

    Walks back from the outputs through values that cannot be computed from `starts` and
    free values, and stops on each path at the first landmark (a value some boundary
    names) that does not depend on any start, or at a program input. These are the values
    to add to ``start``.

    >>> prog = [((0,), (1,)), ((1,), (2,)), ((2, 1), (3,))]
    >>> frontier(prog, {1: 0, 2: 1, 3: 2}, starts={2}, is_free=lambda v: False,
    ...          outputs=[3], is_landmark=lambda v: v == 1)
    [1]
    """
    starts = set(starts)
    reachable = cut(program, producer, starts, is_free, outputs)
    done = computable(program, starts, is_free, reachable.eqns)
    from_start: set[int] = set(starts)
    for e in reachable.eqns:
        ins, outs = program[e]
        if any(v in from_start for v in ins):
            from_start.update(outs)
    found: list[int] = []
    seen: set[int] = set()
    stack = [v for v in outputs]
    while stack:
        v = stack.pop()
        if v in seen or v in done or is_free(v):
            continue
        seen.add(v)
        if (is_landmark(v) and v not in from_start) or v not in producer:
            found.append(v)
            continue
        stack.extend(program[producer[v]][0])
    return sorted(found)
