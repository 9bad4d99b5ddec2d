"""An Equinox model passed to a plain function keeps its attribute-path names.

Observing an Equinox module over a batch goes through a function that vmaps it,
``lambda m, x: jax.vmap(m)(x)`` (the advice of `LayerBatchAxisError`). The model is
then the function's first argument, and its submodules' calls must be the boundaries
the model has when it is the target (``c1``, ``c2``: its attribute names), so
``layers=["c1"]`` names the same layer either way. Oracles: the model's own fields, and
its submodules called directly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

eqx = pytest.importorskip("equinox")

C = js.coverage


class CNN(eqx.Module):
    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.c1 = eqx.nn.Conv2d(1, 3, 3, key=k1)
        self.c2 = eqx.nn.Conv2d(3, 2, 3, key=k2)

    def __call__(self, x):
        return self.c2(jax.nn.relu(self.c1(x)))


def batched(m, x):
    return jax.vmap(m)(x)


@pytest.fixture(scope="module")
def cnn():
    model = CNN(jax.random.key(0))
    xb = jax.random.normal(jax.random.key(1), (5, 1, 6, 6))
    return model, xb


def test_a_vmapping_function_lists_the_models_attribute_names(cnn):
    model, xb = cnn
    fields = [f.name for f in dataclasses.fields(model)]  # ['c1', 'c2']
    names = [b.name for b in js.boundaries(batched, model, xb)]
    assert [n for n in names if n in fields] == fields
    assert {b.name for b in js.boundaries(model, xb[0])} <= set(names)


def test_the_documented_tracker_takes_the_models_layer_names(cnn):
    model, xb = cnn
    tracker = C.Tracker(lambda m, x: jax.vmap(m)(x), model, xb, criteria=[C.NC(0.0)])
    tracker.update(xb)
    layers = tracker.result()["NC"]["layers"]
    assert {"c1", "c2"} <= set(layers)
    named = C.Tracker(
        batched, model, xb, layers=["c1"], criteria=[C.NC(0.5)], granularity="element"
    )
    named.update(xb)
    # NC (DeepXplore) on c1: per example, c1's output min-max scaled over its elements; a
    # neuron is covered when its scaled value exceeds the threshold for some example.
    out = np.asarray(jax.vmap(model.c1)(xb)).reshape(len(xb), -1)
    lo, hi = out.min(axis=1, keepdims=True), out.max(axis=1, keepdims=True)
    expected = float(np.mean(np.any((out - lo) / (hi - lo) > 0.5, axis=0)))
    assert named.result()["NC"]["layers"]["c1"] == pytest.approx(expected)


def test_a_slice_at_a_named_submodule_is_that_submodule(cnn):
    model, xb = cnn
    sub = js.slice(batched, model, xb, end="c1")
    np.testing.assert_allclose(sub(xb), jax.vmap(model.c1)(xb), rtol=1e-6, atol=1e-6)
    rest = js.slice(batched, model, xb, start="c2")
    hidden = jax.nn.relu(jax.vmap(model.c1)(xb))
    np.testing.assert_allclose(rest(hidden), batched(model, xb), rtol=1e-6, atol=1e-6)


def test_modules_inside_a_container_are_named_from_its_keys():
    k1, k2 = jax.random.split(jax.random.key(2))
    net = eqx.nn.Sequential([eqx.nn.Linear(4, 8, key=k1), eqx.nn.Linear(8, 2, key=k2)])
    x = jnp.ones((3, 4))

    def fn(params, x):
        return jax.vmap(params["net"])(x) * params["scale"]

    params = {"net": net, "scale": jnp.float32(2.0)}
    names = [b.name for b in js.boundaries(fn, params, x)]
    assert {"net/layers/0", "net/layers/1"} <= set(names)
    sub = js.slice(fn, params, x, end="net/layers/0")
    np.testing.assert_allclose(sub(x), jax.vmap(net.layers[0])(x), rtol=1e-6)


def test_plain_marks_and_scopes_keep_their_names(cnn):
    model, xb = cnn

    @js.mark("stem")
    def stem(m, x):
        return jax.vmap(m.c1)(x)

    def fn(m, x):
        with jax.named_scope("tail"):
            return jax.vmap(m.c2)(jax.nn.relu(stem(m, x)))

    # Marks and scopes nest by name; a submodule is named by its attribute path wherever
    # it is called, as when the model is the target.
    names = [b.name for b in js.boundaries(fn, model, xb)]
    assert {"tail", "tail/stem", "c1", "c2"} <= set(names)
