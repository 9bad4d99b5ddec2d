"""`js.lens` on the other model kinds: Equinox (a `lax.scan` over stacked layers), Keras 3
(a Sequential model), Haiku (an `hk.transform` MLP and an `hk.layer_stack`), and plain
JAX functions with `js.mark` and `lax.scan`.

Oracles: each library's own call or apply, and the model written by hand in JAX from its
own parameters, with the intervention written in by hand.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, import_keras, random_input

N, D = 4, 6
X = random_input(30, (2, 4))


# --------------------------------------------------------------------------- Equinox


def equinox_stack() -> Any:
    eqx = pytest.importorskip("equinox")

    class Stack(eqx.Module):
        """``embed``, `N` stacked linear cells run by `lax.scan` (``cell[k]``), ``head``."""

        embed: eqx.nn.Linear
        cells: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self, key: Any):
            k = jax.random.split(key, 3)
            self.embed = eqx.nn.Linear(4, D, key=k[0])
            make = lambda key: eqx.nn.Linear(D, D, key=key)  # noqa: E731
            self.cells = eqx.filter_vmap(make)(jax.random.split(k[1], N))
            self.head = eqx.nn.Linear(D, 3, key=k[2])

        def __call__(self, x: Any) -> Any:
            arrays, rest = eqx.partition(self.cells, eqx.is_array)
            cell = js.mark("cell", lambda h, row: (jnp.tanh(eqx.combine(row, rest)(h)), None))
            return self.head(jax.lax.scan(cell, self.embed(x), arrays)[0])

    return Stack(jax.random.key(0))


def test_an_equinox_scanned_stack():
    model = equinox_stack()
    x = X[0]

    def by_hand(change: Any = lambda k, h: h, model: Any = model) -> Any:
        c = model.cells
        h = model.embed.weight @ x + model.embed.bias
        for k in range(N):
            h = change(k, jnp.tanh(c.weight[k] @ h + c.bias[k]))
        return model.head.weight @ h + model.head.bias

    lens = js.lens(model, x)
    assert {"embed", "cell[:]", "head"} <= set(lens.sites)
    assert lens.sites["cell[:]"].stacked.shape == (N, D)
    assert_trees_all_close(lens(x), model(x))
    assert_trees_all_close(by_hand(), model(x))
    v = random_input(31, (D,))
    want = by_hand(lambda k, h: h + v if k == 2 else h)
    assert_trees_all_close(lens(x, add={"cell[2]": v}), want)
    rows = random_input(32, (N, 1))
    out, cache = lens(x, scale={"cell[:]": rows}, read=["cell[:]"])
    seen = []
    want = by_hand(lambda k, h: seen.append(h * rows[k]) or seen[-1])
    assert_trees_all_close(out, want)
    assert_trees_all_close(cache["cell[:]"], jnp.stack(seen))
    # `apply` takes another model of the same structure
    other = jax.tree_util.tree_map(lambda a: -0.5 * a, model)
    assert_trees_all_close(
        lens.apply(other, x, add={"cell[2]": v}),
        by_hand(lambda k, h: h + v if k == 2 else h, other),
    )


def test_an_equinox_mlp():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 3, width_size=5, depth=2, key=jax.random.key(1))
    x = X[1]
    lens = js.lens(model, x)
    assert list(lens.sites) == ["layers/0", "layers/1", "layers/2"]
    layers = model.layers

    def by_hand(change: Any) -> Any:
        h = change(layers[0].weight @ x + layers[0].bias)
        h = jax.nn.relu(layers[1].weight @ jax.nn.relu(h) + layers[1].bias)
        return layers[2].weight @ h + layers[2].bias

    assert_trees_all_close(lens(x), model(x))
    v = random_input(33, (5,))
    assert_trees_all_close(lens(x, add={"layers/0": v}), by_hand(lambda h: h + v))


# --------------------------------------------------------------------------- Keras


def test_a_keras_sequential_model_and_its_weights_assigned_in_place():
    keras = import_keras()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="relu", name="a"),
            keras.layers.Dense(2, name="b"),
        ]
    )
    a, b = model.get_layer("a"), model.get_layer("b")

    def by_hand(change: Any) -> Any:
        h = change(jax.nn.relu(X @ jnp.asarray(a.kernel) + jnp.asarray(a.bias)))
        return h @ jnp.asarray(b.kernel) + jnp.asarray(b.bias)

    lens = js.lens(model, X)
    assert set(lens.sites) == {"a", "b"}
    assert_trees_all_close(lens(X), jnp.asarray(model(X)))
    v = random_input(34, (5,))
    assert_trees_all_close(lens(X, add={"a": v}), by_hand(lambda h: h + v))
    mask = jnp.array([True, False, True, False, True])
    out, cache = lens(X, set={"a": (v, mask)}, read=["a"])
    assert_trees_all_close(out, by_hand(lambda h: jnp.where(mask, v, h)))
    assert_trees_all_close(
        cache["a"], jnp.where(mask, v, jax.nn.relu(X @ jnp.asarray(a.kernel) + jnp.asarray(a.bias)))
    )

    a.kernel.assign(np.asarray(a.kernel) * -2.0)
    assert_trees_all_close(lens(X, add={"a": v}), by_hand(lambda h: h + v))


# --------------------------------------------------------------------------- Haiku


def test_a_haiku_mlp():
    hk = pytest.importorskip("haiku")

    def mlp(x: Any) -> Any:
        h = jax.nn.relu(hk.Linear(5, name="fc1")(x))
        return hk.Linear(3, name="fc2")(h)

    f = hk.transform(mlp)
    params = f.init(jax.random.key(0), X)
    p = params

    def by_hand(change: Any) -> Any:
        h = change(X @ p["fc1"]["w"] + p["fc1"]["b"])
        return jax.nn.relu(h) @ p["fc2"]["w"] + p["fc2"]["b"]

    lens = js.lens(f, params, X)
    assert set(lens.sites) == {"fc1", "fc2"}
    assert_trees_all_close(lens(X), f.apply(params, None, X))
    v = random_input(35, (5,))
    assert_trees_all_close(lens(X, add={"fc1": v}), by_hand(lambda h: h + v))
    assert_trees_all_close(lens(X, scale={"fc1": 0.0}), by_hand(lambda h: 0.0 * h))
    # `apply` takes variables of the structure of `lens.variables` (Haiku's params inside)
    halved = jax.tree_util.tree_map(lambda a: a * 0.5, lens.variables)
    want = f.apply(jax.tree_util.tree_map(lambda a: a * 0.5, params), None, X)
    assert_trees_all_close(lens.apply(halved, X), want)


def test_a_haiku_layer_stack():
    hk = pytest.importorskip("haiku")

    def layer(h: Any) -> Any:
        return jnp.tanh(hk.Linear(4, name="lin")(h))

    def net(x: Any) -> Any:
        return hk.Linear(2, name="head")(hk.layer_stack(3)(layer)(x))

    f = hk.transform(net)
    x = X[:, :4]
    params = f.init(jax.random.key(0), x)
    name = "__layer_stack_no_per_layer/lin"  # as Haiku keys the stacked parameters
    p = params[name]

    def by_hand(change: Any) -> Any:
        h = x
        for k in range(3):
            h = jnp.tanh(change(k, h @ p["w"][k] + p["b"][k]))
        return h @ params["head"]["w"] + params["head"]["b"]

    lens = js.lens(f, params, x)
    assert f"{name}[:]" in lens.sites
    assert lens.sites[f"{name}[:]"].stacked.shape == (3, 2, 4)
    assert_trees_all_close(lens(x), f.apply(params, None, x))
    v = random_input(36, (4,))
    want = by_hand(lambda k, h: h + v if k == 1 else h)
    assert_trees_all_close(lens(x, add={f"{name}[1]": v}), want)
    seen = []
    want = by_hand(lambda k, h: seen.append(-h) or seen[-1])
    out, cache = lens(x, scale={f"{name}[:]": -1.0}, read=[f"{name}[:]"])
    assert_trees_all_close(out, want)
    assert_trees_all_close(cache[f"{name}[:]"], jnp.stack(seen))


# --------------------------------------------------------------------------- plain JAX

step = js.mark("step", lambda h, w: (jnp.tanh(h @ w), None))


def plain(p: Any, x: Any) -> Any:
    h = js.mark("embed", lambda x: x @ p["e"])(x)
    h = jax.lax.scan(step, h, p["w"])[0]
    return h @ p["o"]


PARAMS = {
    "e": random_input(37, (4, D)),
    "w": random_input(38, (N, D, D)) / np.sqrt(D),
    "o": random_input(39, (D, 2)),
}


def plain_by_hand(p: Any, x: Any, change: Any = lambda name, k, h: h) -> Any:
    h = change("embed", None, x @ p["e"])
    for k in range(N):
        h = change("step[:]", k, jnp.tanh(h @ p["w"][k]))
    return h @ p["o"]


def test_a_plain_function_with_a_marked_scan_body():
    lens = js.lens(plain, PARAMS, X)
    assert set(lens.sites) == {"embed", "step[:]"}
    assert_trees_all_close(lens(X), plain(PARAMS, X))
    v = random_input(40, (D,))
    want = plain_by_hand(PARAMS, X, lambda n, k, h: h + v if (n, k) == ("step[:]", 3) else h)
    assert_trees_all_close(lens(X, add={"step[-1]": v}), want)
    want = plain_by_hand(PARAMS, X, lambda n, k, h: 0.0 * h if n == "embed" else h)
    assert_trees_all_close(lens(X, scale={"embed": 0.0}), want)
    other = jax.tree_util.tree_map(lambda a: -a, PARAMS)
    want = plain_by_hand(other, X, lambda n, k, h: h + v if n == "step[:]" else h)
    assert_trees_all_close(lens.apply(other, X, add={"step[:]": v}), want)
    vs = random_input(41, (3, D))
    swept = lens.sweep(X, add={"step[1]": vs})
    for i in range(3):
        change = lambda n, k, h, i=i: h + vs[i] if (n, k) == ("step[:]", 1) else h  # noqa: E731
        assert_trees_all_close(swept[i], plain_by_hand(PARAMS, X, change))
