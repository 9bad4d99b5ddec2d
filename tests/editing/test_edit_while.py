"""`js.edit` at calls inside a `while_loop` body: ``name[:]``, every iteration.

A `while` has no static number of iterations, so its calls are named only for every
iteration (``loop/step[:]``); an inserted node or a replacement runs in each iteration
of the one loop, and a node's variables are shared by the iterations (as the body's own
are). One iteration (``[k]``), the bare name, or a slice at such a call is refused with
`js.BoundaryInLoopError`. Oracles: the same `while_loop` written by hand with the edit in
its body, using the models' own parameters (and the node's, read back from the edited
model).
"""

from __future__ import annotations

import flax.linen as nn
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
)

N = jnp.int32(STEPS)


def _linen_by_hand(variables, x, n, edit):
    """`LinenLoop` written by hand, `edit(h)` on the cell's output in each iteration."""
    p = variables["params"]

    def body(c):
        return c[0] + 1, jnp.tanh(edit(dense(p["cell"], c[1])))

    _, h = jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))
    return dense(p["head"], h)


def test_a_function_inserted_in_a_while_body_runs_in_every_iteration():
    edited = js.edit(plain_model, PLAIN_PARAMS, X).insert_after("loop/step[:]", jnp.sin).build()

    def by_hand(p, x):
        cond = lambda c: jnp.abs(c).max() > 1.0  # noqa: E731
        c = jax.lax.while_loop(cond, lambda c: jnp.sin(0.5 * (c @ p["w"])), x)
        return jnp.tanh(c) + p["b"]

    for x in (X, X * 8.0):  # another number of iterations
        np.testing.assert_allclose(edited(x), by_hand(PLAIN_PARAMS, x), rtol=1e-6)


def test_a_linen_module_inserted_in_a_while_body_shares_its_variables_across_iterations():
    model, variables = linen_loop()
    g = js.edit(model, variables, X, N)
    g.insert_after("cell[:]", nn.Dense(3), key=jax.random.key(1), name="adapter")
    edited = g.build()
    adapter = edited.variables["params"]["adapter"]
    assert adapter["kernel"].shape == (3, 3)  # one set, not one per iteration
    assert "adapter[:]" in [b.name for b in g.boundaries()]
    want = _linen_by_hand(variables, X, N, lambda h: dense(adapter, h))
    np.testing.assert_allclose(edited(X, N), want, rtol=1e-5)
    np.testing.assert_allclose(
        edited(X, N + 2),
        _linen_by_hand(variables, X, N + 2, lambda h: dense(adapter, h)),
        rtol=1e-5,
    )


def test_a_call_in_a_while_body_can_be_replaced_and_removed():
    model, variables = linen_loop()
    replaced = js.edit(model, variables, X, N).replace("cell[:]", lambda h: h * 0.5).build()
    by_hand = _linen_by_hand(variables, X, N, lambda h: h)  # then swap the cell by hand
    p = variables["params"]

    def swapped(x, n, cell):
        _, h = jax.lax.while_loop(
            lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(cell(c[1]))), (0, x)
        )
        return dense(p["head"], h)

    np.testing.assert_allclose(replaced(X, N), swapped(X, N, lambda h: h * 0.5), rtol=1e-6)
    removed = js.edit(model, variables, X, N).remove("cell[:]").build()
    np.testing.assert_allclose(removed(X, N), swapped(X, N, lambda h: h), rtol=1e-6)
    assert not np.allclose(removed(X, N), by_hand)


def test_an_nnx_module_in_nnx_while_loop_is_edited_in_every_iteration():
    model = NNXLoop(nnx.Rngs(0))
    edited = js.edit(model, X, N).insert_after("cell[:]", lambda h: -h).build()

    def by_hand(x, n):
        body = lambda c: (c[0] + 1, jnp.tanh(-model.cell(c[1])))  # noqa: E731
        _, h = jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))
        return model.head(h)

    np.testing.assert_allclose(edited(X, N), by_hand(X, N), rtol=1e-5)


@pytest.mark.parametrize("at", ["cell[0]", "cell[-1]", "cell"])
def test_one_iteration_of_a_while_cannot_be_edited(at):
    model, variables = linen_loop()
    with pytest.raises(js.BoundaryInLoopError) as info:
        js.edit(model, variables, X, N).insert_after(at, jnp.sin)
    assert "inside the body of a `while`" in str(info.value)
    assert "'cell[:]'" in str(info.value)  # the fix: every iteration


def test_a_slice_or_intermediates_at_a_while_body_call_says_how_to_observe_it():
    model, variables = linen_loop()
    with pytest.raises(js.BoundaryInLoopError, match="js.Interpreter"):
        js.slice(model, variables, X, N, end="cell[:]")
    with pytest.raises(js.BoundaryInLoopError, match="'cell\\[:\\]'"):
        js.intermediates(model, variables, X, N, names=["cell[:]"])


def test_a_call_time_input_at_a_while_body_call_is_read_by_every_iteration():
    model, variables = linen_loop()
    g = js.edit(model, variables, X, N)
    edited = g.insert_after("cell[:]", lambda h, shift: h + shift, inputs=("shift",)).build()
    shift = jnp.full(X.shape, 0.3)  # one value, not one row per iteration
    want = _linen_by_hand(variables, X, N, lambda h: h + shift)
    np.testing.assert_allclose(edited(X, N, shift=shift), want, rtol=1e-5)
