"""Editing Equinox models: Equinox modules as new nodes, the edited model an `eqx.Module`.

Oracles are independent of jaxslice: a twin `eqx.Module` written by hand that calls the
model's own submodules with the new node in place, `eqx.filter_grad` of it, and the same
optax step on it; hand-written loops over the stacked weights of a `lax.scan`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

N, D = 4, 6
KEYS = jax.random.split(jax.random.key(0), 8)
X = jax.random.normal(KEYS[7], (4,))


class Net(eqx.Module):
    layers: list

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(4, D, key=k[0]),
            eqx.nn.Linear(D, D, key=k[1]),
            eqx.nn.Linear(D, 3, key=k[2]),
        ]

    def __call__(self, x):
        h = jax.nn.relu(self.layers[0](x))
        h = jax.nn.relu(self.layers[1](h))
        return self.layers[2](h)


class Adapter(eqx.Module):
    down: eqx.nn.Linear
    up: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.down = eqx.nn.Linear(D, 2, key=a)
        self.up = eqx.nn.Linear(2, D, key=b)

    def __call__(self, h):
        return h + self.up(self.down(h))


class Twin(eqx.Module):
    """Net with the adapter after layers/1, by hand, around the same submodules."""

    net: Net
    adapter: Adapter

    def __call__(self, x):
        m = self.net
        h = jax.nn.relu(m.layers[0](x))
        h = jax.nn.relu(self.adapter(m.layers[1](h)))
        return m.layers[2](h)


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_an_inserted_equinox_module_trains_with_the_model():
    model, adapter = Net(KEYS[0]), Adapter(KEYS[1])
    edited = js.edit(model, X).insert_after("layers/1", adapter, name="adapter").build()
    assert isinstance(edited, eqx.Module)
    twin = Twin(model, adapter)
    close(edited(X), twin(X))
    xs, ys = jax.random.normal(KEYS[2], (5, 4)), jnp.zeros((5, 3))

    @eqx.filter_jit
    def loss(m):
        return jnp.mean((jax.vmap(m)(xs) - ys) ** 2)

    grads, twin_grads = eqx.filter_grad(loss)(edited), eqx.filter_grad(loss)(twin)
    close(grads.model, twin_grads.net)
    close(grads.nodes[0], twin_grads.adapter)
    tx = optax.adam(0.05)

    def step(m):
        params = eqx.filter(m, eqx.is_inexact_array)
        updates, _ = tx.update(eqx.filter_grad(loss)(m), tx.init(params), params)
        return eqx.apply_updates(m, updates)

    trained, twin_trained = step(edited), step(twin)
    close(edited.merge(model, trained), twin_trained.net)
    close(trained.nodes[0], twin_trained.adapter)
    close(trained(X), twin_trained(X))
    close(model.layers[0].weight, Net(KEYS[0]).layers[0].weight)  # the model is a value


def test_removing_the_node_and_a_changed_structure():
    model, adapter = Net(KEYS[0]), Adapter(KEYS[1])
    g = js.edit(model, X).insert_after("layers/1", adapter, name="adapter")
    edited = g.build()
    swapped = eqx.tree_at(lambda m: m.model.layers[2], edited, eqx.nn.Linear(D, 5, key=KEYS[3]))
    with pytest.raises(js.SliceError, match="Edit the changed model again"):
        swapped(X)
    g.remove("adapter")
    close(g.build()(X), model(X))


def test_call_time_inputs_vmap_and_export():
    model = Net(KEYS[0])
    edited = js.edit(model, X).insert_after("layers/0", lambda h, v: h + v, inputs=("v",)).build()
    vs = jax.random.normal(KEYS[4], (3, D))
    got = jax.vmap(lambda v: edited(X, v=v))(vs)
    m = model
    for i in range(3):
        want = m.layers[2](jax.nn.relu(m.layers[1](jax.nn.relu(m.layers[0](X) + vs[i]))))
        close(got[i], want)
    close(edited.export().call(X, v=vs[0]), got[0])


class Stack(eqx.Module):
    """Stacked linear cells run by `lax.scan` around a marked body (`cell[k]`)."""

    cells: eqx.nn.Linear

    def __init__(self, key):
        make = lambda k: eqx.nn.Linear(D, D, key=k)  # noqa: E731
        self.cells = eqx.filter_vmap(make)(jax.random.split(key, N))

    def __call__(self, h):
        arrays, rest = eqx.partition(self.cells, eqx.is_array)
        cell = js.mark("cell", lambda h, row: (jnp.tanh(eqx.combine(row, rest)(h)), None))
        return jax.lax.scan(cell, h, arrays)[0]


class Shift(eqx.Module):
    """A node for a cell's output ``(h, None)``."""

    linear: eqx.nn.Linear

    def __call__(self, out):
        return self.linear(out[0]), out[1]


def test_stacked_equinox_nodes_in_every_iteration_of_a_scan():
    model = Stack(KEYS[5])
    assert [b.name for b in js.boundaries(model, jnp.ones(D))] == ["cell[:]"]
    make = lambda k: Shift(eqx.nn.Linear(D, D, key=k))  # noqa: E731
    shift = eqx.filter_vmap(make)(jax.random.split(KEYS[6], N))
    g = js.edit(model, jnp.ones(D)).insert_after("cell[:]", shift, name="shift")
    edited = g.build()
    h = jnp.linspace(-1, 1, D)
    want = h
    w, s = model.cells, shift.linear
    for k in range(N):
        want = s.weight[k] @ jnp.tanh(w.weight[k] @ want + w.bias[k]) + s.bias[k]
    close(edited(h), want)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(h)))(edited)
    assert grads.nodes[0].linear.weight.shape == (N, D, D)
    with pytest.raises(js.SliceError, match=r"leading axes \[4\]"):
        js.edit(model, jnp.ones(D)).insert_after("cell[:]", Shift(eqx.nn.Linear(D, D, key=KEYS[0])))
