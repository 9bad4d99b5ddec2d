"""Editing Keras models: Keras layers as new nodes.

The oracle is Keras itself: a functional `keras.Model` built from the model's own layers
with the new layer inserted (so the same variables apply), called eagerly and through
`stateless_call` in training mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import keras_block_model
from helpers.oracles import import_keras, random_input

X = random_input(0, (5, 4))


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def keras():
    return import_keras()


def twin(keras, model, adapter):
    """The model rebuilt with Keras's functional API, `adapter` after `act`."""
    inp = keras.Input((4,))
    h = model.get_layer("act")(model.get_layer("bn")(model.get_layer("stem")(inp)))
    out = model.get_layer("head")(model.get_layer("block")(adapter(h)))
    return keras.Model(inp, out)


def test_an_inserted_keras_layer_equals_a_functional_model(keras):
    model = keras_block_model(keras)
    keras.utils.set_random_seed(1)
    adapter = keras.layers.Dense(6, name="adapter")
    g = js.edit(model, X).insert_after("act", adapter, name="adapter")
    variables = g.variables
    assert set(variables["trainable"]["adapter"]) == {"kernel", "bias"}
    edited = g.build()
    reference = twin(keras, model, adapter)
    close(edited(X), reference(X))
    # Training mode: the same output and the same new moving statistics as Keras's.
    trainable = [v.value for v in reference.trainable_variables]
    fixed = [v.value for v in reference.non_trainable_variables]
    want, new_fixed = reference.stateless_call(trainable, fixed, X, training=True)
    trained = js.edit(model, X, training=True).insert_after("act", adapter, name="adapter").build()
    got, state = trained.apply(trained.variables, X, mutable=["non_trainable"])
    close(got, want)
    moving = {v.path: n for v, n in zip(reference.non_trainable_variables, new_fixed, strict=True)}
    close(state["non_trainable"]["bn"]["moving_mean"], moving["bn/moving_mean"])
    # Gradients reach the new layer as Keras's own would.
    grads = jax.grad(lambda v: jnp.sum(edited.apply(v, X) ** 2))(edited.variables)

    def loss(kernel):
        values = [kernel if v is adapter.kernel else v.value for v in reference.trainable_variables]
        return jnp.sum(reference.stateless_call(values, fixed, X)[0] ** 2)

    close(grads["trainable"]["adapter"]["kernel"], jax.grad(loss)(adapter.kernel.value))
    g.remove("adapter")
    close(g.build()(X), model(X))


def test_call_time_inputs_on_a_keras_model(keras):
    model = keras_block_model(keras)
    edited = js.edit(model, X).insert_after("block", lambda h, v: h * v, inputs=("v",)).build()
    mask = jnp.asarray(np.random.default_rng(3).integers(0, 2, size=(5, 6)), jnp.float32)
    inp = keras.Input((4,))
    h = model.get_layer("block")(
        model.get_layer("act")(model.get_layer("bn")(model.get_layer("stem")(inp)))
    )
    features = keras.Model(inp, h)
    close(edited(X, v=mask), model.get_layer("head")(features(X) * mask))
