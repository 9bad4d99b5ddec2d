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
    want = model.get_layer("head")(features(X) * mask)
    close(edited(X, v=mask), want)
    # Keras's one value: the model's input and the call-time input, in order or by name.
    assert edited.input_names[1:] == ["v"]
    close(edited.predict([X, mask], verbose=0), want)
    close(edited.predict(dict(zip(edited.input_names, [X, mask], strict=True)), verbose=0), want)


Y = random_input(1, (5, 2))


def adapter_layer(keras, **kwargs):
    keras.utils.set_random_seed(1)
    layer = keras.layers.Dense(6, **kwargs)
    layer.build((None, 6))
    return layer


def test_an_edited_keras_model_is_a_keras_model_that_trains_the_model_in_place(keras):
    model, other = keras_block_model(keras), keras_block_model(keras)
    adapter, other_adapter = adapter_layer(keras), adapter_layer(keras)
    edited = js.edit(model, X).insert_after("act", adapter, name="adapter").build()
    assert isinstance(edited, keras.Model)
    assert edited.model is model and edited.nodes == {"adapter": adapter}
    assert edited.get_layer("adapter") is adapter and edited.get_layer("head") is model.get_layer(
        "head"
    )
    held = [*model.trainable_variables, *adapter.trainable_variables]
    assert {id(v) for v in edited.trainable_variables} == {id(v) for v in held}
    oracle = twin(keras, other, other_adapter)
    close(edited.predict(X, verbose=0), oracle.predict(X, verbose=0))
    for m in (edited, oracle):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.fit(X, Y, batch_size=5, epochs=2, shuffle=False, verbose=0)
        m.fit(X, Y, batch_size=2, epochs=1, shuffle=False, verbose=0)  # new batch sizes
    # The model, as trained without the inserted layer, and the layer apart: as Keras's.
    assert not np.allclose(model.get_layer("bn").moving_mean.value, 0)
    for mine, theirs in zip(model.variables, other.variables, strict=True):
        close(mine.value, theirs.value)
    for mine, theirs in zip(adapter.variables, other_adapter.variables, strict=True):
        close(mine.value, theirs.value)
    close(model(X), other(X))
    close(edited.predict(X[:3], verbose=0), oracle.predict(X[:3], verbose=0))


def test_an_inserted_keras_layer_is_named_by_the_edit_or_by_its_own_name(keras):
    model = keras_block_model(keras)
    g = js.edit(model, X).insert_after("act", adapter_layer(keras, name="my_adapter"))
    assert "my_adapter" in g.boundaries().names()
    assert sorted(g.build().nodes) == ["my_adapter"]
    g.insert_after("my_adapter", adapter_layer(keras, name="stem"))  # taken: a fresh name
    assert "Dense_0" in g.build().nodes
    renamed = js.edit(model, X).insert_after("act", adapter_layer(keras), name="adapter")
    assert renamed.build().get_layer("adapter").name != "adapter"  # the layer is not renamed


def test_merge_writes_variables_trained_with_jax_back_to_the_model_and_the_layers(keras):
    model, adapter = keras_block_model(keras), adapter_layer(keras)
    edited = js.edit(model, X).insert_after("act", adapter, name="adapter").build()
    grads = jax.grad(lambda v: jnp.sum(edited.apply(v, X) ** 2))(edited.variables)
    trained = jax.tree.map(lambda w, g: w - 0.1 * g, edited.variables, grads)
    model_variables = js.slice(model, X).variables
    merged = edited.merge(model_variables, trained)  # as for linen: the model's entries
    assert sorted(merged["trainable"]) == sorted(model_variables["trainable"])
    assert edited.merge(model, trained) is model
    close(model.get_layer("head").kernel.value, trained["trainable"]["head"]["kernel"])
    close(adapter.kernel.value, trained["trainable"]["adapter"]["kernel"])
    close(merged["trainable"]["head"]["kernel"], trained["trainable"]["head"]["kernel"])
    oracle = twin(keras, model, adapter)  # Keras's own model over the written variables
    close(edited(X), oracle(X))
    with pytest.raises(js.SliceError, match="edited.model"):
        edited.merge(keras_block_model(keras), trained)


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_an_edited_keras_model_saves_weights_and_refuses_a_keras_file(keras, tmp_path):
    model, adapter = keras_block_model(keras), adapter_layer(keras)
    edited = js.edit(model, X).insert_after("act", adapter, name="adapter").build()
    path = str(tmp_path / "edited.weights.h5")
    edited.save_weights(path)
    want = np.asarray(edited(X))
    kernels = [adapter.kernel, model.get_layer("head").kernel]
    saved = [np.asarray(k.value) for k in kernels]
    for k in kernels:
        k.assign(np.zeros(k.shape, "float32"))
    edited.load_weights(path)
    for k, value in zip(kernels, saved, strict=True):
        np.testing.assert_array_equal(k.value, value)
    close(edited(X), want)
    with pytest.raises(js.SliceError, match="save_weights"):
        edited.save(str(tmp_path / "edited.keras"))
