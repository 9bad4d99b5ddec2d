"""`js.coverage.Tracker` on a Keras model that trains after the tracker was made.

A Keras model holds its variables; a tracker reads them at each update, as the model's
slices do, so its figures follow the training. Oracle: the trained model's layer outputs
from a functional Keras sub-model (``keras.Model(model.inputs, layer.output)``) and the
NumPy reference of `helpers.coverage_reference`.
"""

from __future__ import annotations

import numpy as np

import jaxslice as js

from helpers.coverage_reference import Spec, assert_result, ref_result
from helpers.oracles import import_keras

C = js.coverage
LAYERS = ["fc1", "fc2", "head"]
SPECS = [Spec("SignSign"), Spec("ValueValue", 1.5)]


def mlp(keras):
    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    h = keras.layers.Dense(6, activation="relu", name="fc1")(inp)
    h = keras.layers.Dense(5, name="fc2")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


def layer_outputs(keras, model, x):
    """Each layer's output, from a functional sub-model sharing the model's layers."""
    sub = keras.Model(model.inputs[0], [model.get_layer(n).output for n in LAYERS])
    return {n: np.asarray(o) for n, o in zip(LAYERS, sub(x), strict=True)}


def test_a_tracker_reads_a_keras_model_as_it_trains():
    keras = import_keras()
    model = mlp(keras)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    t = C.Tracker(model, x[:2], criteria=[C.SignSign(), C.ValueValue(ratio=1.5)], layers=LAYERS)
    before = ref_result(SPECS, LAYERS, layer_outputs(keras, model, x))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, rng.normal(size=(16, 2)).astype(np.float32), epochs=10, verbose=0)
    t.update(x[:8])
    t.update(x[8:])
    after = ref_result(SPECS, LAYERS, layer_outputs(keras, model, x))
    assert after != before  # the training changed what is covered
    assert_result(t.result(), after)
    fresh = C.Tracker(model, x[:2], criteria=[C.SignSign(), C.ValueValue(ratio=1.5)], layers=LAYERS)
    fresh.update(x)
    assert_result(fresh.result(), after)
