"""What was made from a model meets the model's variables as they are at each call.

Two ways a variable can change under something already made from the model:
- a variable that held a Python number when traced (``nnx.Param(0.5)``, ``{"s": 0.5}``
  in a plain function's parameters) is a constant of the program, as a static argument
  of `jax.jit` is; another number (or an array) there later must not be ignored;
- an NNX model's plain array attribute changes shape or dtype under a lens or an edited
  model, as it already raised under a slice.

Oracles: the models called directly after the change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)


class Scaled(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 2, rngs=rngs)
        self.alpha = nnx.Param(0.5)  # a learnable scalar held as a Python float

    def __call__(self, x):
        return self.a(x) * self.alpha.get_value()


def _made(model):
    edited = js.edit(model, X).insert_after("a", lambda h: h).build()
    return {"slice": js.slice(model, X), "lens": js.lens(model, X), "edited": edited}


def test_nnx_number_variable_is_read_or_refused():
    model = Scaled(nnx.Rngs(0))
    made = _made(model)
    for name, fn in made.items():  # unchanged: the model's answer
        np.testing.assert_allclose(fn(X), model(X), rtol=1e-6, err_msg=name)
    for new in (2.0, jnp.asarray(3.0)):
        model.alpha.set_value(new)
        for name, fn in made.items():
            with pytest.raises(
                js.VariablesMismatchError, match=r"alpha\W* held the Python"
            ) as info:
                fn(X)
            assert "jnp.asarray(0.5)" in str(info.value), name
    # Made again, each follows the model.
    for name, fn in _made(model).items():
        np.testing.assert_allclose(fn(X), model(X), rtol=1e-6, err_msg=name)


def test_nnx_number_variable_held_as_an_array_is_read_at_each_call():
    model = Scaled(nnx.Rngs(0))
    model.alpha = nnx.Param(jnp.asarray(0.5))  # the fix the error suggests
    made = _made(model)
    model.alpha.set_value(jnp.asarray(4.0))
    for name, fn in made.items():
        np.testing.assert_allclose(fn(X), model(X), rtol=1e-6, err_msg=name)


@js.mark("body")
def _body(p, x):
    return x @ p["w"]


def _fn(params, x):
    return _body(params["body"], x) * params["s"]


def test_plain_number_variable_passed_to_apply():
    params = {"body": {"w": jnp.arange(6.0).reshape(3, 2)}, "s": 0.5}
    sub = js.slice(_fn, params, X)
    np.testing.assert_allclose(sub.apply(params, X), _fn(params, X), rtol=1e-6)
    assert sub.apply(dict(params), X).shape == (2, 2)  # an equal number passes
    for new in (2.0, 1, jnp.asarray(0.5)):
        changed = {**params, "s": new}
        with pytest.raises(js.VariablesMismatchError, match=r"\['s'\] held the Python number"):
            sub.apply(changed, X)
    # The slice's own variables hold no number: they run as traced.
    np.testing.assert_allclose(sub.apply(sub.variables, X), _fn(params, X), rtol=1e-6)
    # Under `jax.jit` the number is a tracer whose value cannot be read: an equal one runs.
    np.testing.assert_allclose(jax.jit(sub.apply)(params, X), _fn(params, X), rtol=1e-6)
    # A new slice computes with the new number.
    changed = {**params, "s": 2.0}
    np.testing.assert_allclose(js.slice(_fn, changed, X)(X), _fn(changed, X), rtol=1e-6)


class Masked(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)
        self.b = nnx.Linear(4, 2, rngs=rngs)
        self.mask = jnp.ones(4)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)) * self.mask)


@pytest.mark.parametrize("mask", [jnp.ones(4, jnp.float16), jnp.ones((1, 4))])
def test_nnx_lens_and_edit_refuse_a_changed_attribute(mask):
    model = Masked(nnx.Rngs(0))
    made = _made(model)
    model.mask = mask
    model(X)  # the model itself still runs
    for fn in made.values():
        with pytest.raises(js.VariablesMismatchError, match="model changed since.*mask"):
            fn(X)
    model.mask = jnp.full(4, 2.0)  # new values of the traced shape are read
    for name, fn in made.items():
        np.testing.assert_allclose(fn(X), model(X), rtol=1e-6, err_msg=name)
