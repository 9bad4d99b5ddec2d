"""Modes given as arrays, and arrays that no longer exist.

A mode keyword given as a one-element array (``train=jnp.asarray(True)``) means what its
value says, as it does when the model's own ``apply`` branches on it; a traced or
many-element mode is a clear error. An array that was donated or deleted gives a
`SliceError` naming the variable or input, not JAX's bare ``RuntimeError``. Oracles: the
model's own `apply` (or call) in the same mode.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.oracles import import_keras

X = jax.random.normal(jax.random.key(1), (6, 3))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(4, name="dense")(x)
        h = nn.BatchNorm(use_running_average=not train, name="bn")(h)
        return nn.Dropout(0.5, deterministic=not train, name="drop")(h)


MODEL = Net()
VARIABLES = MODEL.init(jax.random.key(0), X)
RNGS = {"dropout": jax.random.key(3)}


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("made_with", [False, True])
@pytest.mark.parametrize("flag", [jnp.asarray, np.bool_, np.asarray], ids=["jax", "np_bool", "np"])
def test_a_mode_given_as_a_one_element_array_means_its_value(flag, made_with):
    sub = js.slice(
        MODEL, VARIABLES, X, train=made_with, rngs=RNGS, mutable=["batch_stats"], end="drop"
    )
    for value in (True, False):
        got = sub.apply(sub.variables, X, train=flag(value), rngs=RNGS, mutable=["batch_stats"])
        want = MODEL.apply(VARIABLES, X, train=value, rngs=RNGS, mutable=["batch_stats"])
        close(got, want)


def test_a_traced_mode_is_an_error_naming_it():
    sub = js.slice(MODEL, VARIABLES, X, end="dense")
    with pytest.raises(js.SliceError, match=r"train=.*traced"):
        jax.jit(lambda t: sub.apply(sub.variables, X, train=t))(jnp.asarray(True))


def test_a_mode_of_many_elements_is_an_error():
    sub = js.slice(MODEL, VARIABLES, X, end="dense")
    with pytest.raises(js.SliceError):
        sub.apply(sub.variables, X, train=jnp.asarray([True, False]))


def test_an_array_flag_given_when_slicing_gets_advice():
    with pytest.raises(js.ModelTraceError, match=r"\['train'\] are arrays"):
        js.slice(MODEL, VARIABLES, X, train=jnp.asarray(True), end="dense")


def test_keras_training_given_as_an_array():
    keras = import_keras()
    inputs = keras.Input((3,))
    out = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4, name="d")(inputs))
    model = keras.Model(inputs, out)
    x = np.asarray(X)
    sub = js.slice(model, x, end="bn")
    got, _ = sub.apply(sub.variables, x, training=jnp.asarray(True), mutable=True)
    close(got, model(x, training=True))


# ----------------------------------------------------------------------------- deleted arrays


def test_a_deleted_variable_is_named():
    sub = js.slice(MODEL, VARIABLES, X, end="dense")
    variables = jax.tree.map(jnp.copy, sub.variables)
    variables["params"]["dense"]["kernel"].delete()
    for call in (lambda: sub.apply(variables, X), lambda: sub.apply(variables, X, train=False)):
        with pytest.raises(js.SliceError, match=r"\['params'\]\['dense'\]\['kernel'\].*deleted"):
            call()


def test_a_deleted_input_is_named():
    sub = js.slice(MODEL, VARIABLES, X, end="dense")
    x = jnp.copy(X)
    x.delete()
    with pytest.raises(js.SliceError, match=r"input at \[0\].*deleted"):
        sub(x)


def test_a_deleted_variable_of_an_nnx_model_is_named():
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    sub = js.slice(model, X, end="layers/0")
    close(sub(X), model.layers[0](X))
    model.layers[0].kernel.get_value().delete()
    with pytest.raises(js.SliceError, match=r"kernel.*deleted"):
        sub(X)
