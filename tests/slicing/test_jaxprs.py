"""The jaxpr toolkit both evaluators share (`_core/jaxprs.py`), against plain Python
loops and indexing, and what it buys a slice of a scanned stack: no nested `jit` per
stacked parameter in the loop body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js
from jaxslice._core.jaxprs import Env, Finder, carried_scan, row

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
