"""Pure graph analyses over a flat program (used by the planner, stage 3).

A program is a sequence of equations, each a pair ``(ins, outs)`` of value ids, and a
map from each computed value to the equation that writes it. Nothing here knows about
JAX, boundary names or error messages; these functions are tested on hand-made programs.

The cut of a slice is the set of equations the requested outputs depend on, walking
backwards from the outputs and stopping at start values and at free values (constants,
variables, random keys). Everything else is dead code and is dropped. Each value and
equation is visited once, so the cut is linear in the size of the program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from typing import Any

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
        if _all_in(ins, done, is_free):
            done.update(outs)
    return done


def parameter_values(
    program: Program, variables: Collection[int], is_free: Callable[[int], bool]
) -> set[int]:
    """The values computed from `variables` and other free values alone (a row of a
    stacked parameter, ``w * 2``): parameters too, never a slice's inputs.

    A value computed from free values none of which is a variable (a constant folded
    by hand) is not one: its equation reads no parameter.

    >>> sorted(parameter_values([((5,), (1,)), ((1, 0), (2,)), ((6,), (3,))], {5},
    ...                         lambda v: v in (5, 6)))
    [1]
    """
    found: set[int] = set()
    sources = set(variables)
    for ins, outs in program:
        if any(v in sources for v in ins) and _all_in(ins, sources, is_free):
            found.update(outs)
            sources.update(outs)
    return found


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
    from_start = depends_on(program, starts, reachable.eqns)
    found: list[int] = []
    seen = set(done)  # a computable value is never missing
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v in seen or is_free(v):
            continue
        seen.add(v)
        if (is_landmark(v) and v not in from_start) or v not in producer:
            found.append(v)
        else:
            stack.extend(program[producer[v]][0])
    return sorted(found)


def depends_on(program: Program, starts: Collection[int], eqns: Iterable[int]) -> set[int]:
    """`starts` and every value that `eqns` compute from them (in program order).

    >>> sorted(depends_on([((0,), (1,)), ((5,), (2,))], {0}, [0, 1]))
    [0, 1]
    """
    found = set(starts)
    for e in eqns:
        ins, outs = program[e]
        if any(v in found for v in ins):
            found.update(outs)
    return found


def effects_inside(
    program: Program,
    result: Cut,
    starts: Collection[int],
    is_free: Callable[[int], bool],
    has_effects: Callable[[int], bool],
) -> Cut:
    """`result` plus the side-effecting equations in its span whose inputs it has.

    A slice runs effects (``jax.debug.print``, callbacks) that sit inside it as the model
    does, although no output needs them.

    >>> prog = [((0,), (1,)), ((1,), ()), ((1,), (2,))]
    >>> c = cut(prog, {1: 0, 2: 2}, starts={0}, is_free=lambda v: False, outputs=[2])
    >>> effects_inside(prog, c, {0}, lambda v: False, lambda e: e == 1).eqns
    (0, 1, 2)
    """
    extra = _effects_left_out(program, result, starts, is_free, has_effects)
    if not extra:
        return result
    used_free = {v for i in extra for v in program[i][0] if is_free(v)}
    return dataclasses.replace(
        result,
        eqns=tuple(sorted({*result.eqns, *extra})),
        used_free=frozenset(result.used_free | used_free),
    )


def _effects_left_out(
    program: Program,
    result: Cut,
    starts: Collection[int],
    is_free: Callable[[int], bool],
    has_effects: Callable[[int], bool],
) -> list[int]:
    """The side-effecting equations between the first and the last of `result` that it
    leaves out although it has all their inputs."""
    if not result.eqns:
        return []
    needed = set(result.eqns)
    available = set(starts) | {v for i in needed for v in program[i][1]}
    span = range(result.eqns[0], result.eqns[-1] + 1)
    return [
        i
        for i in span
        if i not in needed and has_effects(i) and _all_in(program[i][0], available, is_free)
    ]


def _all_in(values: Iterable[int], known: Container[int], also: Callable[[int], bool]) -> bool:
    """Whether each of `values` is in `known` or passes `also`."""
    return all(v in known or also(v) for v in values)


def owner(path: Sequence[Any], owners: Container[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """The longest prefix of `path` that is in `owners` (a variable's module), or None.

    >>> owner(("a", "b", "w"), {("a",), ("a", "b")})
    ('a', 'b')
    """
    path = tuple(path)
    return next((path[:n] for n in range(len(path), 0, -1) if path[:n] in owners), None)


def spans_with(spans: Iterable[tuple[int, int]], eqns: Collection[int], size: int) -> list[bool]:
    """For each ``(start, stop)`` span, whether it holds one of `eqns` (linear overall).

    >>> spans_with([(0, 2), (2, 3), (3, 3)], {1}, size=4)
    [True, False, False]
    """
    before = [0] * (size + 1)
    for i in range(size):
        before[i + 1] = before[i] + (i in eqns)
    return [before[stop] > before[start] for start, stop in spans]


@dataclasses.dataclass(frozen=True)
class Span:
    """An inlined region: equations ``start:stop`` stand for one equation ``ins -> outs``."""

    start: int
    stop: int
    ins: tuple[int, ...]
    outs: tuple[int, ...]


def fold(
    program: Program,
    producer: Mapping[int, int],
    spans: Sequence[Span],
    result: Cut,
    starts: Collection[int],
    is_free: Callable[[int], bool],
    outputs: Sequence[int],
    is_const: Callable[[int], bool] = lambda v: False,
) -> tuple[Cut, list[tuple[str, int]]]:
    """Runs regions that a slice needs whole as their original equation.

    A region is folded when the slice needs some of its equations, neither starts nor
    ends inside it, needs every operand it reads (no dead code inside it) and can
    compute those operands. Returns the cut with the operands of folded regions, and the
    steps to run in order: ``("eqn", i)`` for an equation, ``("span", k)`` for `spans[k]`.

    >>> prog = [((0,), (1,)), ((1,), (2,)), ((2,), (3,))]
    >>> producer = {1: 0, 2: 1, 3: 2}
    >>> c = cut(prog, producer, {0}, lambda v: False, [3])
    >>> fold(prog, producer, [Span(0, 2, (0,), (2,))], c, {0}, lambda v: False, [3])[1]
    [('span', 0), ('eqn', 2)]
    """
    chosen = _foldable(program, spans, set(result.eqns), set(starts) | set(outputs), is_const)
    full = cut(program, producer, starts, is_free, tuple(outputs) + _operands(spans, chosen))
    if full.missing:  # some operand is not computable from the starts: keep those inlined
        chosen = [
            k for k in chosen if not cut(program, producer, starts, is_free, spans[k].ins).missing
        ]
        full = cut(program, producer, starts, is_free, tuple(outputs) + _operands(spans, chosen))
    return full, _steps(full.eqns, [spans[k] for k in chosen], chosen)


def _operands(spans: Sequence[Span], keys: Iterable[int]) -> tuple[int, ...]:
    return tuple(v for k in keys for v in spans[k].ins)


def _foldable(
    program: Program,
    spans: Sequence[Span],
    needed: set[int],
    ends: set[int],
    is_const: Callable[[int], bool],
) -> list[int]:
    chosen: list[int] = []
    order = sorted(range(len(spans)), key=lambda k: (spans[k].start, -spans[k].stop))
    for k in order:
        span = spans[k]
        nested = chosen and span.start < spans[chosen[-1]].stop
        if not nested and _folds(program, span, needed, ends, is_const):
            chosen.append(k)
    return chosen


def _folds(
    program: Program, span: Span, needed: set[int], ends: set[int], is_const: Callable
) -> bool:
    inside = [i for i in range(span.start, span.stop) if i in needed]
    if not inside or _internal_values(program, span) & ends:
        return False  # nothing to run, or the slice starts or ends inside the region
    read = {v for i in inside for v in program[i][0]}
    # Folding must not read more than the slice needs (dead code inside the region).
    return _all_in(span.ins, read, is_const)


def _internal_values(program: Program, span: Span) -> set[int]:
    """The values the region's equations make other than its results."""
    return {v for i in range(span.start, span.stop) for v in program[i][1]} - set(span.outs)


def _steps(eqns: Sequence[int], spans: list[Span], keys: list[int]) -> list[tuple[str, int]]:
    folded = {i for s in spans for i in range(s.start, s.stop)}
    at = {s.start: k for s, k in zip(spans, keys, strict=True)}
    steps: list[tuple[str, int]] = []
    for i in sorted(set(eqns) | set(at)):
        if i in at:
            steps.append(("span", at[i]))
        if i not in folded:
            steps.append(("eqn", i))
    return steps
