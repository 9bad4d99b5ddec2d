"""A Keras slice takes its inputs as a functional Keras model does: one array, a list in
input order or a dict keyed by input name, in calls, ``predict``, ``evaluate`` and
``fit``. Oracles: Keras's own functional models over twins with equal weights."""

from __future__ import annotations

import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import import_keras

A = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
B = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
M = (np.random.default_rng(2).random(size=(8,)) > 0.3).astype("float32")
Y = np.random.default_rng(3).normal(size=(8, 2)).astype("float32")


@pytest.fixture(scope="module")
def keras():
    return import_keras()


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def same_weights(model, twin):
    for mine, theirs in zip(model.weights, twin.weights, strict=True):
        close(mine.value, theirs.value)


def two_inputs(keras):
    keras.utils.set_random_seed(5)
    a, b = keras.Input((4,), name="a_in"), keras.Input((3,), name="b_in")
    h = keras.layers.Concatenate(name="cat")(
        [keras.layers.Dense(5, name="da")(a), keras.layers.Dense(5, name="db")(b)]
    )
    return keras.Model(
        [a, b], keras.layers.Dense(2, name="head")(keras.layers.Dense(3, name="mid")(h))
    )


def test_a_slice_of_a_list_input_model_takes_a_list_or_a_dict(keras):
    model, twin = two_inputs(keras), two_inputs(keras)
    sub = js.slice(model, [A, B], end="head")
    oracle = keras.Model(twin.inputs, twin.get_layer("head").output)
    assert sub.input_names == ["a_in", "b_in"]
    want = oracle.predict([A, B], verbose=0)
    for x in ([A, B], (A, B), {"a_in": A, "b_in": B}):
        close(sub(x), want)
        close(sub.predict(x, verbose=0), want)
    close(sub.predict([A[:3], B[:3]], verbose=0), want[:3])  # a new batch size
    for m in (sub, oracle):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    sub.fit({"a_in": A, "b_in": B}, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    oracle.fit([A, B], Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(
        model.get_layer("da").kernel.value, two_inputs(keras).get_layer("da").kernel.value
    )
    same_weights(model, twin)
    close(sub.evaluate([A, B], Y, verbose=0), oracle.evaluate([A, B], Y, verbose=0))
    # Several starts: one input each, by position or by start name.
    both = js.slice(model, [A, B], start=["da", "db"], end="cat")
    cat = keras.Model(twin.inputs, twin.get_layer("cat").output)
    assert both.input_names == ["da", "db"]
    close(both.predict({"db": B, "da": A}, verbose=0), cat.predict([A, B], verbose=0))
    close(both([A, B]), cat([A, B]))


def test_a_dict_without_an_input_name_is_refused_with_the_names(keras):
    sub = js.slice(two_inputs(keras), [A, B], end="mid")
    with pytest.raises(js.InputMismatchError, match=r"\['a_in', 'b_in'\].*without \['b_in'\]"):
        sub.predict({"a_in": A, "b": B}, verbose=0)


def masked_model(keras):
    class Masked(keras.layers.Layer):  # a layer taking a keyword input, as keras-hub's do
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(5, name="dense")

        def call(self, x, padding_mask=None):
            return self.dense(x) * keras.ops.expand_dims(padding_mask, -1)

    keras.utils.set_random_seed(6)
    x, m = keras.Input((4,), name="x"), keras.Input((), name="mask")
    h = keras.layers.Dense(4, name="stem")(x)
    h = Masked(name="block")(h, padding_mask=m)
    return keras.Model([x, m], keras.layers.Dense(2, name="head")(h))


def test_a_slice_starting_at_a_layer_with_a_keyword_input_fits_and_predicts(keras):
    model, twin = masked_model(keras), masked_model(keras)
    tail = js.slice(model, [A, M], start="block")
    assert tail.input_names == ["block", "padding_mask"]
    h = keras.Model(twin.inputs, twin.get_layer("stem").output).predict([A, M], verbose=0)
    h_in, m_in = keras.Input((4,)), keras.Input(())
    block, head = twin.get_layer("block"), twin.get_layer("head")
    oracle = keras.Model([h_in, m_in], head(block(h_in, padding_mask=m_in)))
    want = oracle.predict([h, M], verbose=0)
    for x in ([h, M], {"block": h, "padding_mask": M}):
        close(tail.predict(x, verbose=0), want)
        close(tail(x), want)
    close(tail(h, padding_mask=M), want)  # jaxslice's own convention still works
    for m in (tail, oracle):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    tail.fit({"block": h, "padding_mask": M}, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    oracle.fit([h, M], Y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(
        model.get_layer("head").kernel.value, masked_model(keras).get_layer("head").kernel.value
    )
    same_weights(model, twin)
