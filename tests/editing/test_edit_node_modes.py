"""New nodes that behave differently in training (batch statistics, dropout) are named
when inserted, since a node is not told the model's mode and cannot keep the state it
would update; their inference forms insert and compute as the layers do by hand.

Before: a linen BatchNorm in training mode was reported as breaking the model after
it (Flax's immutable-variable error); a Keras BatchNormalization or Dropout ran in
inference mode even in a training call (a Dropout(0.9) zeroed nothing), and its moving
statistics never moved.

Oracles: the layers applied by hand (linen's `apply`, Keras's own call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, import_keras, random_input

X = random_input(60, (5, 3))


def test_linen_nodes_that_update_state_or_draw_keys_are_named():
    nn = pytest.importorskip("flax.linen")
    model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
    variables = model.init(jax.random.key(0), X)
    for node in (nn.BatchNorm(use_running_average=False), nn.Dropout(0.5, deterministic=False)):
        editor = js.edit(model, variables, X)
        with pytest.raises(js.SliceError, match=type(node).__name__) as info:
            editor.insert_after("layers_0", node, key=jax.random.key(1), name="extra")
        assert type(info.value).__name__ == "LinenNodeStateError"
    # In evaluation mode the same modules insert, computing as linen does.
    bn = nn.BatchNorm(use_running_average=True)
    edited = (
        js.edit(model, variables, X)
        .insert_after("layers_0", bn, key=jax.random.key(1), name="extra")
        .build()
    )
    p, stats = variables["params"], edited.variables["batch_stats"]["extra"]
    h = X @ p["layers_0"]["kernel"] + p["layers_0"]["bias"]
    h = bn.apply({"params": edited.variables["params"]["extra"], "batch_stats": stats}, h)
    want = h @ p["layers_1"]["kernel"] + p["layers_1"]["bias"]
    assert_trees_all_close(edited(X), want)


def test_keras_layers_with_a_training_mode_are_named_and_their_inference_form_inserts():
    keras = import_keras()
    inputs = keras.Input((3,))
    head = keras.layers.Dense(2, name="head")(keras.layers.Dense(4, name="a")(inputs))
    model = keras.Model(inputs, head)
    x = np.asarray(X)
    bn = keras.layers.BatchNormalization()
    for node in (bn, keras.layers.Dropout(0.9), keras.Sequential([keras.layers.Dropout(0.5)])):
        with pytest.raises(js.SliceError, match="behaves differently in training") as info:
            js.edit(model, x, training=True).insert_after("head", node, name="extra")
        assert type(info.value).__name__ == "KerasNodeModeError"
    # Layers without a training mode are taken, and a stateful one in its inference form.
    block = keras.Sequential([keras.layers.Dense(2), keras.layers.LayerNormalization()])
    edited = js.edit(model, x).insert_after("head", block, name="block").build()
    assert_trees_all_close(np.asarray(edited(x)), np.asarray(block(model(x))), atol=1e-5)
    fixed = lambda h: bn(h, training=False)  # noqa: E731
    edited = js.edit(model, x).insert_after("head", fixed, name="bn").build()
    want = np.asarray(bn(model(x), training=False))
    assert_trees_all_close(np.asarray(edited(x)), want, atol=1e-5)
    assert not np.allclose(jnp.asarray(want), np.asarray(model(x)))  # the BN does something
