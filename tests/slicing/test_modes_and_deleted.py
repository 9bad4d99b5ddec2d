"""Modes given as arrays, and arrays that no longer exist.

A mode keyword given as a one-element array (``train=jnp.asarray(True)``) means what its
value says, as it does when the model's own ``apply`` branches on it, through every view
that passes modes on (a slice, an interpreter, an edited model); a traced or many-element
mode is a clear error, and modes of equal value and other type (``1``, ``1.0``) run
apart. An array that was donated or deleted gives a
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


class Identity(js.Interpreter):
    """Observes nothing: runs the model as it is."""


def _views():
    """Each way a mode reaches a traced program, as ``run(train) -> output``: a slice's
    `apply` and call, an interpreter's function, an edited model's call and `apply`."""
    sub = js.slice(MODEL, VARIABLES, X, rngs=RNGS, mutable=["batch_stats"], end="drop")
    interpreted = Identity().build(
        MODEL, VARIABLES, X, rngs=RNGS, mutable=["batch_stats"], jit=False
    )
    editor = js.edit(MODEL, VARIABLES, X)
    editor.insert_after("dense", lambda h: h)  # an edit that changes nothing
    edited = editor.build()
    kw = {"rngs": RNGS, "mutable": ["batch_stats"]}
    return {
        "slice apply": lambda t: sub.apply(sub.variables, X, train=t, **kw)[0],
        "slice call": lambda t: sub(X, train=t, **kw)[0],
        "interpreter": lambda t: interpreted(VARIABLES, X, rngs=RNGS, train=t)[0],
        "edited call": lambda t: edited(X, train=t, **kw)[0],
        "edited apply": lambda t: edited.apply(edited.variables, X, train=t, **kw)[0],
    }


@pytest.mark.parametrize("flag", [jnp.asarray, np.bool_, np.asarray], ids=["jax", "np_bool", "np"])
def test_every_view_reads_an_array_mode_as_its_value(flag):
    """Each mode in turn (False first, then True) through every view: each call computes
    what the model's own `apply` computes in that mode."""
    for name, run in _views().items():
        for value in (False, True):
            want = MODEL.apply(VARIABLES, X, train=value, rngs=RNGS, mutable=["batch_stats"])[0]
            try:
                close(run(flag(value)), want)
            except AssertionError as error:
                raise AssertionError(f"{name}, train={flag(value)!r}") from error


def test_a_traced_mode_of_an_interpreter_is_an_error_naming_it():
    fn = Identity().build(MODEL, VARIABLES, X, rngs=RNGS, mutable=["batch_stats"])
    with pytest.raises(js.SliceError, match=r"train=.*traced"):
        fn(VARIABLES, X, rngs=RNGS, train=jnp.asarray(True))


class Offset(nn.Module):
    @nn.compact
    def __call__(self, x, offset=1):
        return nn.Dense(3, name="dense")(x), jnp.arange(3) * offset


@pytest.mark.parametrize("first, then", [(1, 1.0), (1.0, 1)])
def test_modes_of_equal_value_and_other_type_run_apart(first, then):
    """``offset=1`` then ``offset=1.0`` at call time: the second gets its own program
    (a float result), as the model's `apply` does."""
    model = Offset()
    variables = model.init(jax.random.key(0), X)
    sub = js.slice(model, variables, X)
    interpreted = Identity().build(model, variables, X, jit=False)
    for call in (
        lambda v: sub.apply(sub.variables, X, offset=v)[1],
        lambda v: interpreted(variables, X, offset=v)[0][1],
    ):
        call(first)
        got, want = call(then), model.apply(variables, X, offset=then)[1]
        assert got.dtype == want.dtype
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
