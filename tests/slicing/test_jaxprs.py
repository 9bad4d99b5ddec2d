"""The jaxpr toolkit (`_core/jaxprs.py`): the one evaluator and what its clients share,
against plain Python loops and indexing and the programs' own results, and what it buys
a slice of a scanned stack: no nested `jit` per stacked parameter in the loop body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js
from jaxslice._core.jaxprs import Env, Evaluator, Finder, carried_scan, loop_rule, row
from jaxslice._core.markers import marking

from helpers.models import ScannedModel
from helpers.oracles import count_primitive, iter_eqns


@pytest.mark.parametrize("reverse", [False, True])
def test_carried_scan_gives_each_step_its_row(reverse):
    """Rows 2..5 of a stack: the step sees the row it runs, visited last to first in a
    reverse scan, and the results are stacked in row order (as `lax.scan` stacks them)."""
    xs = jnp.arange(10.0) * 100

    def step(carry, i, _):
        (c,) = carry
        return [c * 10 + i], (i, row(xs, i))

    (carry,), (seen, rows) = carried_scan(step, [0], None, rows=(2, 6), reverse=reverse, unroll=1)
    visits = [5, 4, 3, 2] if reverse else [2, 3, 4, 5]
    want = 0
    for i in visits:  # the oracle: the same recurrence in Python
        want = want * 10 + i
    assert int(carry) == want
    np.testing.assert_array_equal(seen, [2, 3, 4, 5])
    np.testing.assert_array_equal(rows, np.asarray(xs)[2:6])


def _loop_eqn(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if loop_rule(e) is not None]
    return eqn


@pytest.mark.parametrize("jit", [False, True])
def test_the_while_rule_runs_its_body_with_the_iteration_index_and_keeps_the_last_values(jit):
    """A `while` run again by its rule with a step that also sees the iteration index and
    lets a value leave the loop: the loop's results as JAX's own, the value the last
    iteration's, and the number of iterations known only when the loop runs."""

    def loop(x):
        return jax.lax.while_loop(lambda c: c.sum() < 20.0, lambda c: c * 2.0 + 1.0, x)

    x = jnp.ones(2)
    eqn = _loop_eqn(loop, x)
    rule = loop_rule(eqn)
    assert rule.length(eqn) is None and not rule.counted

    def step(jaxpr, consts, args, i, free):
        outs = Evaluator().run(jaxpr, consts, args, None)
        return outs, {"i": i, "out": outs[0]}

    def again(x):
        return rule.run(eqn, [x], [False], step)

    for start in (x, x * 4.0):  # another number of iterations, one compiled loop
        outs, leaving = (jax.jit(again) if jit else again)(start)
        c, seen = start, []  # the oracle: the loop in Python
        while float(c.sum()) < 20.0:
            c = c * 2.0 + 1.0
            seen.append(c)
        np.testing.assert_allclose(outs[0], loop(start))
        assert int(leaving["i"]) == len(seen) - 1
        np.testing.assert_allclose(leaving["out"], seen[-1])


def test_the_scan_rule_stacks_what_leaves_its_body():
    def loop(c, xs):
        return jax.lax.scan(lambda c, x: (c + x, c * x), c, xs)

    c, xs = jnp.float32(1.0), jnp.arange(4.0)
    eqn = _loop_eqn(loop, c, xs)
    rule = loop_rule(eqn)
    assert rule.length(eqn) == 4 and rule.counted

    def step(jaxpr, consts, args, i, free):
        return Evaluator().run(jaxpr, consts, args, None), {"i": i}

    outs, leaving = rule.run(eqn, [c, xs], [False, False], step)
    want = loop(c, xs)
    np.testing.assert_allclose(outs[0], want[0])
    np.testing.assert_allclose(outs[1], want[1])
    np.testing.assert_array_equal(leaving["i"], [0, 1, 2, 3])


def test_row_is_one_dynamic_slice_and_matches_indexing():
    stacked = jnp.arange(24.0).reshape(4, 3, 2)
    jaxpr = jax.make_jaxpr(row)(stacked, 1)
    assert [e.primitive.name for e in iter_eqns(jaxpr)] == ["dynamic_slice", "squeeze"]
    for i in range(4):
        np.testing.assert_array_equal(jax.jit(row)(stacked, i), stacked[i])


def test_finder_looks_through_nested_bodies():
    def inner(x):
        return jnp.sin(x) * 2

    def model(x):
        y = jax.jit(inner)(x)
        return jax.lax.scan(lambda c, _: (jnp.cos(c), None), y, None, length=3)[0]

    jaxpr = jax.make_jaxpr(model)(1.0).jaxpr
    sin = Finder(lambda e: e.primitive.name == "sin")
    cos = Finder(lambda e: e.primitive.name == "cos")
    jit_eqn, scan_eqn = jaxpr.eqns
    assert sin.inside(jit_eqn) and not sin.inside(scan_eqn)
    assert cos.inside(scan_eqn) and not cos.inside(jit_eqn)
    assert sin.in_jaxpr(jaxpr) and cos.in_jaxpr(jaxpr)
    assert not Finder(lambda e: e.primitive.name == "tan").in_jaxpr(jaxpr)


def test_env_reads_literals_as_themselves():
    jaxpr = jax.make_jaxpr(lambda x: x + 1.0)(2.0).jaxpr
    env = Env()
    env.write(jaxpr.invars, [3.0])
    (eqn,) = jaxpr.eqns
    assert env.reads(eqn.invars) == [3.0, 1.0]


def test_a_slice_of_a_scanned_stack_adds_no_nested_jit_to_the_loop():
    """Each iteration reads its rows of the stacked parameters with `dynamic_slice`
    primitives, not through one nested `jit` per parameter (`lax.dynamic_index_in_dim`),
    so a slice's program holds no more `jit` equations than the model's own."""
    model, x = ScannedModel(), jax.random.normal(jax.random.key(1), (2, 5))
    variables = model.init(jax.random.key(0), x)
    full = jax.make_jaxpr(lambda v, a: model.apply(v, a))(variables, x)
    for spec in ({"end": "layers[1]"}, {"start": "layers[1]"}):
        sub = js.slice(model, variables, x, **spec)
        assert count_primitive(sub.jaxpr, "jit") <= count_primitive(full, "jit"), spec


def _every_kind(x):
    """A program with each kind of equation: a jit, a scan, a while, a cond."""
    y = jax.jit(lambda a: jnp.sin(a) * 2)(x)
    y = jax.lax.scan(lambda c, r: (c + r, c * r), y, jnp.arange(3.0))[0]
    y = jax.lax.fori_loop(0, jnp.int32(2), lambda i, c: c * 1.5, y)  # a while (traced bound)
    return jax.lax.cond(y.sum() > 0, jnp.cos, jnp.tanh, y)


def test_the_evaluator_with_its_default_rules_gives_the_programs_results():
    x = jnp.linspace(-1.0, 1.0, 4)
    closed = jax.make_jaxpr(_every_kind)(x)

    def again(a):
        return Evaluator().run(closed.jaxpr, closed.consts, [a], None)[0]

    np.testing.assert_allclose(again(x), _every_kind(x), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(again)(x), _every_kind(x), rtol=1e-6)
    # traced again, the program keeps its loops as loops
    names = [e.primitive.name for e in jax.make_jaxpr(again)(x).jaxpr.eqns]
    assert names == [e.primitive.name for e in closed.jaxpr.eqns]


class _Recorder(Evaluator):
    """Default rules that note which rule saw what."""

    def __init__(self):
        self.seen = []

    def call_side(self, markers, env, ctx):
        self.seen.append(("side", len(markers)))
        super().call_side(markers, env, ctx)

    def loop(self, eqn, rule, ins, env, ctx):
        self.seen.append(("loop", eqn.primitive.name))
        return super().loop(eqn, rule, ins, env, ctx)

    def call(self, eqn, body, ins, env, ctx):
        self.seen.append(("call", eqn.primitive.name))
        return self.run(body[0], body[1], ins, ctx)  # inline: its equations reach the rules

    def other(self, eqn, ins, env, ctx):
        self.seen.append(("other", eqn.primitive.name))
        return super().other(eqn, ins, env, ctx)


def test_each_kind_of_equation_reaches_its_rule_and_a_call_side_comes_whole():
    @js.mark("pair")
    def pair(a, b):
        return a * b

    def model(x):
        return _every_kind(pair(x, x + 1.0))

    x = jnp.linspace(-1.0, 1.0, 4)
    with marking():
        closed = jax.make_jaxpr(model)(x)
    recorder = _Recorder()
    out = recorder.run(closed.jaxpr, closed.consts, [x], None)[0]
    np.testing.assert_allclose(out, model(x), rtol=1e-6)
    kinds = [k for k, _ in recorder.seen]
    # the two input markers of `pair` come as one side, its one output marker as another
    assert [s for s in recorder.seen if s[0] == "side"] == [("side", 2), ("side", 1)]
    assert kinds.index("side") < kinds.index("call")
    assert ("loop", "scan") in recorder.seen and ("loop", "while") in recorder.seen
    assert ("call", "jit") in recorder.seen
    assert ("other", "while") in recorder.seen and ("other", "cond") in recorder.seen
    assert ("other", "sin") in recorder.seen  # the jit's body, run inline by the call rule
