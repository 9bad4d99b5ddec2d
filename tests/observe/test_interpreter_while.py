"""`js.Interpreter` on models whose module calls run inside a `while_loop` body.

The loop stays one `while_loop`: the hooks run once, at trace time, and see each call of
the body under its every-iteration name (``loop/step[:]``); a value emitted there leaves
the loop as the last iteration's. Oracles: the loop unrolled eagerly in Python (what each
iteration computes), the models' own ``apply``/eager call, and the same loop written by
hand with the change a hook makes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.while_models import (
    PLAIN_PARAMS,
    STEPS,
    NNXLoop,
    X,
    dense,
    linen_loop,
    plain_model,
    plain_steps,
)


class Emits(js.Interpreter):
    """Emits every call's output under its name, noting the names the hooks saw."""

    def __init__(self):
        self.seen = []

    def boundary(self, name, side, value):
        self.seen.append((name, side))
        if side == "output":
            self.emit(name, value)
        return value


def test_hooks_see_a_while_body_call_once_under_its_every_iteration_name():
    hooks = Emits()
    out, emitted = hooks.build(plain_model, PLAIN_PARAMS, X)(PLAIN_PARAMS, X)
    assert ("loop/step[:]", "input") in hooks.seen and ("loop/step[:]", "output") in hooks.seen
    assert hooks.seen.count(("loop/step[:]", "output")) == 1  # the body is traced once
    np.testing.assert_allclose(out, plain_model(PLAIN_PARAMS, X), rtol=1e-6)
    # the loop stays a while loop (not unrolled): one `while` in the built program
    jaxpr = jax.make_jaxpr(hooks.build(plain_model, PLAIN_PARAMS, X, jit=False))(PLAIN_PARAMS, X)
    assert [e.primitive.name for e in jaxpr.jaxpr.eqns].count("while") == 1


def test_a_value_emitted_in_a_while_body_is_the_last_iterations():
    _, emitted = Emits().build(plain_model, PLAIN_PARAMS, X)(PLAIN_PARAMS, X)
    steps = plain_steps(PLAIN_PARAMS, X)
    assert len(steps) > 1  # the oracle: the loop unrolled eagerly
    np.testing.assert_allclose(emitted["loop/step[:]"], steps[-1], rtol=1e-6)
    # another input runs the loop another number of times, in the same compiled function
    x2 = X * 4.0
    _, emitted = Emits().build(plain_model, PLAIN_PARAMS, X)(PLAIN_PARAMS, x2)
    assert len(plain_steps(PLAIN_PARAMS, x2)) != len(steps)
    np.testing.assert_allclose(
        emitted["loop/step[:]"], plain_steps(PLAIN_PARAMS, x2)[-1], rtol=1e-6
    )


def test_a_while_that_runs_no_iteration_emits_zeros():
    small = X / 100.0  # the loop's condition is false at once
    assert plain_steps(PLAIN_PARAMS, small) == []
    out, emitted = Emits().build(plain_model, PLAIN_PARAMS, X)(PLAIN_PARAMS, small)
    np.testing.assert_array_equal(emitted["loop/step[:]"], np.zeros_like(small))
    np.testing.assert_allclose(out, plain_model(PLAIN_PARAMS, small), rtol=1e-6)


class Halves(js.Interpreter):
    def boundary(self, name, side, value):
        return value * 0.5 if (name, side) == ("loop/step[:]", "output") else value


def test_a_replacement_in_a_while_body_runs_in_every_iteration():
    out, _ = Halves().build(plain_model, PLAIN_PARAMS, X)(PLAIN_PARAMS, X)

    def by_hand(p, x):
        c = jax.lax.while_loop(
            lambda c: jnp.abs(c).max() > 1.0, lambda c: 0.5 * (0.5 * (c @ p["w"])), x
        )
        return jnp.tanh(c) + p["b"]

    np.testing.assert_allclose(out, by_hand(PLAIN_PARAMS, X), rtol=1e-6)


def test_a_linen_module_called_in_nn_while_loop_is_seen_in_every_iteration():
    model, variables = linen_loop()
    n = jnp.int32(STEPS)
    hooks = Emits()
    out, emitted = hooks.build(model, variables, X, n)(variables, X, n)
    np.testing.assert_allclose(out, model.apply(variables, X, n), rtol=1e-6)
    h, last = X, None
    for _ in range(STEPS):  # the oracle: the loop unrolled eagerly
        last = dense(variables["params"]["cell"], h)
        h = jnp.tanh(last)
    np.testing.assert_allclose(emitted["cell[:]"], last, rtol=1e-5)
    assert ("cell[:]", "output") in hooks.seen


def test_an_nnx_module_called_in_nnx_while_loop_is_seen_in_every_iteration():
    model = NNXLoop(nnx.Rngs(0))
    n = jnp.int32(STEPS)
    out, emitted = Emits().build(model, X, n)(nnx.state(model), X, n)
    np.testing.assert_allclose(out, model(X, n), rtol=1e-6)
    h, last = X, None
    for _ in range(STEPS):
        last = model.cell(h)
        h = jnp.tanh(last)
    np.testing.assert_allclose(emitted["cell[:]"], last, rtol=1e-5)


def test_observers_that_slice_refuse_a_while_body_call_and_name_the_interpreter():
    """`ActivationStats` (like `js.intermediates`) runs a slice to the layers it observes,
    and a `while` gives no value of one of its calls outside the loop."""
    model, variables = linen_loop()
    with pytest.raises(js.BoundaryInLoopError, match="js.Interpreter"):
        js.observe.ActivationStats(model, variables, X, jnp.int32(STEPS), names=["cell[:]"])
