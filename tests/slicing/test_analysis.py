"""The pure graph algorithms, on hand-made and random programs (no JAX tracing)."""

import random

import pytest

from jaxslice._core import analysis as _cut


def _producer(program):
    return {v: i for i, (_, outs) in enumerate(program) for v in outs}


def _random_program(rng, n_inputs=3, n_eqns=30):
    values = list(range(n_inputs))
    program = []
    nxt = n_inputs
    for _ in range(n_eqns):
        k = rng.randint(1, min(3, len(values)))
        ins = tuple(rng.sample(values, k))
        outs = tuple(range(nxt, nxt + rng.randint(1, 2)))
        nxt += len(outs)
        values += outs
        program.append((ins, outs))
    return program, values


def _reference_needed(program, producer, starts, outputs):
    """Needed equations by brute force: an equation is needed iff one of its outputs is
    an output, or is read by a needed equation, unless it is a start."""
    needed = set()
    changed = True
    wanted = set(outputs) - set(starts)
    while changed:
        changed = False
        for i, (ins, outs) in enumerate(program):
            if i not in needed and wanted & set(outs):
                needed.add(i)
                wanted |= set(ins) - set(starts)
                changed = True
    return needed


@pytest.mark.parametrize("seed", range(25))
def test_cut_matches_brute_force(seed):
    rng = random.Random(seed)
    program, values = _random_program(rng)
    producer = _producer(program)
    computed = [v for v in values if v in producer]
    starts = set(rng.sample(computed, 3))
    outputs = rng.sample(computed, 2)
    got = _cut.cut(program, producer, starts, lambda v: False, outputs)
    assert set(got.eqns) == _reference_needed(program, producer, starts, outputs)
    assert list(got.eqns) == sorted(got.eqns)
    # Everything the cut reads is a start, a program input (missing) or computed inside it.
    inside = {v for e in got.eqns for v in program[e][1]}
    for e in got.eqns:
        for v in program[e][0]:
            assert v in inside or v in got.used_starts or v in got.missing


def test_free_values_stop_the_walk():
    program = [((0,), (1,)), ((1, 9), (2,))]
    got = _cut.cut(program, {1: 0, 2: 1}, starts={1}, is_free=lambda v: v == 9, outputs=[2])
    assert (
        got.eqns == (1,) and got.used_free == {9} and got.used_starts == {1} and got.missing == ()
    )


def test_missing_program_input_is_reported():
    program = [((0,), (1,)), ((1, 5), (2,))]
    got = _cut.cut(program, {1: 0, 2: 1}, starts={1}, is_free=lambda v: False, outputs=[2])
    assert got.missing == (5,)


def test_frontier_names_the_skip_not_the_mixed_value():
    # 0 -> 1 (enc, landmark) -> 2 (start) ; out 3 = f(2, 1): value 1 is the skip.
    program = [((0,), (1,)), ((1,), (2,)), ((2, 1), (3,))]
    found = _cut.frontier(
        program, _producer(program), {2}, lambda v: False, [3], is_landmark=lambda v: v in (1, 3)
    )
    assert found == [1]


def test_frontier_walks_past_values_that_depend_on_the_start():
    # out 4 = g(3) where 3 = f(2, 1) is a landmark that mixes the start 2 and the skip 1.
    program = [((0,), (1,)), ((1,), (2,)), ((2, 1), (3,)), ((3,), (4,))]
    found = _cut.frontier(
        program, _producer(program), {2}, lambda v: False, [4], is_landmark=lambda v: v in (1, 3)
    )
    assert found == [1]
