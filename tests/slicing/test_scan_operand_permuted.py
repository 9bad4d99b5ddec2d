"""A scan whose scanned operand the model permutes itself before the loop.

A batch-major RNN swaps its input's axes (``jnp.swapaxes(x, 0, 1)``, ``x.T``) and then
scans over time. That permutation is the model's own: the scanned module's input is the
time-major value. Flax's ``nn.scan(..., in_axes=1)`` makes the same permutation inside
the transform, where the module's caller passes the batch-major value. jaxslice must
tell the two apart: the first once made the lens, `js.edit` and
``js.intermediates(names="all")`` fail with a raw `KeyError`.

Oracles: each loop written out by hand.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

X = jax.random.normal(jax.random.key(1), (2, 5, 4))  # (batch, time, features)


class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, xt):
        c = jnp.tanh(nn.Dense(4, name="dense")(c) + xt)
        return c, c


class Swapped(nn.Module):
    """Swaps the axes itself; the scan runs over the leading axis."""

    @nn.compact
    def __call__(self, x):
        xs = jnp.swapaxes(x, 0, 1)
        scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False})
        c, _ = scan(name="cell")(jnp.zeros((xs.shape[1], 4)), xs)
        return c


class Lifted(nn.Module):
    """Lets `nn.scan` move the axis (``in_axes=1``)."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1)
        c, _ = scan(name="cell")(jnp.zeros((x.shape[0], 4)), x)
        return c


def _by_hand(variables, k, change=lambda y: y):
    """The loop written out, with `change` applied to the Dense output at step k."""
    p = variables["params"]["cell"]["dense"]
    c = jnp.zeros((X.shape[0], 4))
    for t in range(X.shape[1]):
        y = c @ p["kernel"] + p["bias"]
        c = jnp.tanh((change(y) if t == k else y) + X[:, t])
    return c


@pytest.mark.parametrize("cls", [Swapped, Lifted])
def test_linen_scan_input_permuted_by_the_model_or_by_the_transform(cls):
    model = cls()
    variables = model.init(jax.random.key(0), X)
    want = _by_hand(variables, 2, lambda y: y + 1.0)
    lens = js.lens(model, variables, X)
    np.testing.assert_allclose(lens(X, add={"cell[2]/dense": 1.0}), want, atol=1e-5)
    editor = js.edit(model, variables, X)
    editor.insert_after("cell[2]/dense", lambda y: y + 1.0, name="plus")
    np.testing.assert_allclose(editor.build()(X), want, atol=1e-5)
    every = js.intermediates(model, variables, X, names="all")
    np.testing.assert_allclose(every["cell"][0], _by_hand(variables, -1), atol=1e-5)
    # The scanned module's input as its caller passed it: time-major where the model
    # swapped the axes, batch-major where `nn.scan` moves them.
    carry, xs = js.intermediates(model, variables, X, names=["cell:input"])["cell:input"]
    np.testing.assert_allclose(carry, jnp.zeros((2, 4)))
    np.testing.assert_allclose(xs, jnp.swapaxes(X, 0, 1) if cls is Swapped else X)


def test_equinox_scan_over_a_transposed_input():
    eqx = pytest.importorskip("equinox")

    class EqxRNN(eqx.Module):
        cell: eqx.nn.Linear

        def __init__(self):
            self.cell = eqx.nn.Linear(4, 4, key=jax.random.key(0))

        def __call__(self, x):
            def step(c, xt):
                return jnp.tanh(self.cell(c) + xt), None

            c, _ = jax.lax.scan(step, jnp.zeros(4), x.T)
            return c

    model, x = EqxRNN(), X[0].T  # (features, time): the model transposes it

    def by_hand(change):
        c = jnp.zeros(4)
        for t in range(x.shape[1]):
            y = model.cell(c)
            c = jnp.tanh((change(y) if t == 2 else y) + x.T[t])
        return c

    want = by_hand(lambda y: y * 0.5)
    np.testing.assert_allclose(js.lens(model, x)(x, scale={"cell[2]": 0.5}), want, atol=1e-5)
    editor = js.edit(model, x)
    editor.insert_after("cell[2]", lambda y: y * 0.5, name="half")
    np.testing.assert_allclose(editor.build()(x), want, atol=1e-5)
    # The loop's operands as the model passed them: the transposed input.
    carry, xs = js.intermediates(model, x, names=["cell:input"])["cell:input"]
    np.testing.assert_allclose(carry, jnp.zeros(4))
    np.testing.assert_allclose(xs, x.T)
