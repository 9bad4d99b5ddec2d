"""A Keras slice's `fit` follows its layers' `trainable` flags as they are now.

Freezing (or unfreezing) a `BatchNormalization` changes what training mode does: a
frozen one keeps its moving statistics and its weights. After the flag flips and the
slice is compiled again, its `fit` must do what Keras's own `fit` does on a twin model
with the same weights and flags.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import import_keras

X = np.linspace(-2.0, 2.0, 12, dtype="float32").reshape(4, 3)
Y = np.linspace(0.0, 1.0, 8, dtype="float32").reshape(4, 2)


def _model(keras, bn_trainable):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="a")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    model = keras.Model(inputs, keras.layers.Dense(2, name="b")(h))
    model.get_layer("bn").trainable = bn_trainable
    return model


def _fit(model, keras):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0)


@pytest.mark.parametrize("first", [True, False])
def test_fit_after_flipping_a_batchnorm_trainable_flag(first):
    keras = import_keras()
    model, twin = _model(keras, first), _model(keras, first)
    sub = js.slice(model, X)
    _fit(sub, keras)
    _fit(twin, keras)
    for layer in (model, twin):
        layer.get_layer("bn").trainable = not first
    _fit(sub, keras)  # compiled again, as Keras asks after changing flags
    _fit(twin, keras)
    for name in ("a", "bn", "b"):
        for got, want in zip(
            model.get_layer(name).weights, twin.get_layer(name).weights, strict=True
        ):
            np.testing.assert_allclose(
                np.asarray(got.value), np.asarray(want.value), rtol=1e-5, atol=1e-6,
                err_msg=f"{name}/{got.name}",
            )  # fmt: skip
    np.testing.assert_allclose(np.asarray(sub(X)), np.asarray(twin(X)), rtol=1e-5, atol=1e-6)
