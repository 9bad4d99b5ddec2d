"""Keras slices compute with the model's current variables, as Keras sub-models do.

A Keras model holds its variables (`keras.Variable`s), and a functional sub-model that
shares the layers always computes with their current values. So must a slice: after
`variable.assign`, `sub.merge`, or `model.fit`, `sub(x)` and `sub.variables` see the new
values, and a train loop that merges its updates accumulates BatchNormalization's moving
statistics and advances Dropout's seed states.

Oracles come from Keras: functional sub-models of the model (or of a twin with the same
weights) called eagerly, the values read from the layers' variables, and Keras's
documented moving-average rule computed in NumPy.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import keras_block_model
from helpers.oracles import import_keras

X = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def keras():
    return import_keras()


def sub_model(keras, model, name):
    """Keras's own feature extractor: a functional model ending at a layer's output."""
    return keras.Model(model.input, model.get_layer(name).output)


def test_a_slice_computes_with_a_kernel_assigned_after_slicing(keras):
    model = keras_block_model(keras)
    body = js.slice(model, X, end="block")
    head = js.slice(model, X, start="head")
    feats = sub_model(keras, model, "block")(X)
    body(X), head(feats)  # compiled with the old values
    stem, dense = model.get_layer("stem"), model.get_layer("head")
    stem.kernel.assign(np.asarray(stem.kernel.value) * -2.0 + 0.5)
    dense.kernel.assign(np.ones(dense.kernel.shape, "float32"))
    close(body(X), sub_model(keras, model, "block")(X))
    close(body.apply(body.variables, X), sub_model(keras, model, "block")(X))
    feats = sub_model(keras, model, "block")(X)
    close(head(feats), dense(feats))
    close(head(feats), model(X))


def test_variables_are_the_current_values_with_the_same_keys(keras):
    model = keras_block_model(keras)
    head = js.slice(model, X, start="block")
    shapes = jax.tree.map(jnp.shape, head.variables)
    layer = model.get_layer("block").a
    old = np.asarray(layer.kernel.value)
    layer.kernel.assign(old + 1.0)
    layer.bias.assign(np.full(layer.bias.shape, 3.0, "float32"))
    assert jax.tree.map(jnp.shape, head.variables) == shapes
    got = head.variables["trainable"]["block"]["a"]
    close(got["kernel"], layer.kernel.value)
    close(got["bias"], layer.bias.value)
    assert not np.allclose(got["kernel"], old)
    # every leaf is the value its variable holds now
    want = {v.path: v.value for v in model.variables}
    for path, leaf in jax.tree_util.tree_flatten_with_path(head.variables)[0]:
        names = [p.key for p in path][1:]
        np.testing.assert_array_equal(leaf, want["/".join(names)])


def test_a_slice_keeps_no_values_the_model_has_replaced(keras):
    model = keras_block_model(keras)
    sub = js.slice(model, X, end="stem")
    kernel = model.get_layer("stem").kernel
    old = jnp.asarray(kernel.value) + 0.0  # an array only the variable holds
    kernel.assign(old)
    ref = weakref.ref(kernel.value)
    del old
    sub(X)
    kernel.assign(np.zeros(kernel.shape, "float32"))
    gc.collect()
    assert ref() is None
    close(sub(X), np.broadcast_to(model.get_layer("stem").bias.value, (3, 6)))


def _bn_model(keras, momentum):
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,))
    h = keras.layers.Dense(5, name="dense")(inp)
    h = keras.layers.BatchNormalization(momentum=momentum, name="bn")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


def test_moving_statistics_accumulate_over_a_train_loop_that_merges(keras):
    momentum, steps = 0.6, 4
    model, twin = _bn_model(keras, momentum), _bn_model(keras, momentum)
    for mine, theirs in zip(twin.variables, model.variables, strict=True):
        mine.assign(theirs.value)
    sub = js.slice(model, X, end="bn", training=True, mutable=True)
    bn = model.get_layer("bn")
    mean, var = np.asarray(bn.moving_mean.value), np.asarray(bn.moving_variance.value)
    twin_bn = sub_model(keras, twin, "bn")
    rng = np.random.default_rng(5)
    for _ in range(steps):
        x = rng.normal(2.0, 3.0, size=(8, 4)).astype("float32")
        out, updates = sub.apply(sub.variables, x, training=True, mutable=True)
        sub.merge(model, updates)
        close(out, twin_bn(x, training=True))  # also moves the twin's statistics
        # Keras's rule: moving = moving * momentum + batch statistic * (1 - momentum)
        h = np.asarray(sub_model(keras, model, "dense")(x), np.float64)
        mean = mean * momentum + h.mean(0) * (1 - momentum)
        var = var * momentum + h.var(0) * (1 - momentum)
    close(bn.moving_mean.value, twin.get_layer("bn").moving_mean.value)
    close(bn.moving_variance.value, twin.get_layer("bn").moving_variance.value)
    close(bn.moving_mean.value, mean, tol=1e-4)
    close(bn.moving_variance.value, var, tol=1e-4)
    assert not np.allclose(mean, 0.0)
    # the inference-mode slice uses the accumulated statistics, as Keras does
    close(js.slice(model, X, end="bn")(X), sub_model(keras, model, "bn")(X))
    close(sub(X, training=False), sub_model(keras, model, "bn")(X))


def test_dropout_draws_a_new_mask_at_each_step_after_merge(keras):
    def make():
        inp = keras.Input((32,))
        return keras.Model(inp, keras.layers.Dropout(0.5, seed=3, name="drop")(inp))

    model, twin = make(), make()
    x = np.ones((2, 32), np.float32)
    sub = js.slice(model, x, end="drop", training=True, mutable=["non_trainable"])
    state = model.get_layer("drop").seed_generator.state
    masks, states = [], [np.asarray(state.value)]
    for _ in range(3):
        out, updates = sub.apply(sub.variables, x, training=True, mutable=["non_trainable"])
        sub.merge(model, updates)
        states.append(np.asarray(state.value))
        masks.append(np.asarray(out) != 0)
        # the same draw as Keras's eager call on a twin with the same seed state
        np.testing.assert_array_equal(out, twin(x, training=True))
    for k in range(1, 3):
        assert (masks[k] != masks[k - 1]).any()
    for k in range(1, 4):
        assert (states[k] != states[k - 1]).any()
    np.testing.assert_array_equal(states[-1], twin.get_layer("drop").seed_generator.state.value)


def test_a_slice_made_before_fit_computes_with_the_fitted_weights(keras):
    model = _bn_model(keras, 0.5)
    body = js.slice(model, X, end="bn")
    head = js.slice(model, X, start="head")
    before = np.asarray(body(X))
    rng = np.random.default_rng(7)
    xs = rng.normal(size=(16, 4)).astype("float32")
    ys = rng.normal(size=(16, 2)).astype("float32")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(xs, ys, epochs=1, batch_size=4, verbose=0)
    want = sub_model(keras, model, "bn")(X)
    assert not np.allclose(want, before)
    close(body(X), want)
    close(head(want), model(X))
    close(head.variables["trainable"]["head"]["kernel"], model.get_layer("head").kernel.value)


def test_an_edited_model_computes_with_the_models_current_values(keras):
    model = keras_block_model(keras)
    g = js.edit(model, X)
    g.insert_after("stem", lambda v: v * 2.0)
    edited = g.build()
    stem = model.get_layer("stem")

    def oracle():
        # The model with the stem's output doubled: the model itself, called with the
        # stem's (linear) kernel and bias doubled.
        kernel, bias = stem.kernel.value, stem.bias.value
        stem.kernel.assign(kernel * 2.0), stem.bias.assign(bias * 2.0)
        try:
            return np.asarray(model(X))
        finally:
            stem.kernel.assign(kernel), stem.bias.assign(bias)

    close(edited(X), oracle())
    stem.kernel.assign(np.asarray(stem.kernel.value) * -3.0)
    close(edited(X), oracle())
    close(g.build()(X), oracle())
