"""A cached trace is reused only when the program could not have changed.

Every case slices (or reads) a model, changes something the traced program depends on
without changing its structure, then slices again. The oracle is always the model's own
call made after the change; a wrong cache hit shows as a stale value or a wrong dtype.
Families: settings the model reads from objects and classes (linen, NNX, Equinox, Haiku
and plain functions), fixed Python arguments of equal value and different type, weak
and strong types, and models that cannot be described by value (traced every time).
"""

from __future__ import annotations

import array

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

X = jax.random.normal(jax.random.key(1), (2, 3))


class Config:
    """A mutable settings object, hashed by identity (as most config classes are)."""

    def __init__(self, scale):
        self.scale = scale


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- settings the model reads


class ConfiguredLinen(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, name="body")(x) * self.config.scale
        return nn.Dense(2, name="head")(h + self.config.scale)


def test_linen_config_object_changed_between_slices():
    config = Config(1.0)
    model = ConfiguredLinen(config)
    variables = model.init(jax.random.key(0), X)
    js.slice(model, variables, X)(X)
    js.intermediates(model, variables, X, names=["head"])
    config.scale = 4.7
    close(js.slice(model, variables, X)(X), model.apply(variables, X))
    got = js.intermediates(model, variables, X, names=["head"])["head"]
    close(got, model.apply(variables, X))
    # An equal model with an equal (but separate) config is equally right.
    twin = ConfiguredLinen(Config(4.7))
    close(js.slice(twin, variables, X, end="head")(X), model.apply(variables, X))


class Scaled(nn.Module):
    factor = 1.0  # a class-level setting, read by a module built inside @nn.compact

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="dense")(x) * self.factor


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Scaled(name="scaled")(x).sum(-1)


def test_linen_class_attribute_of_an_inner_module_changed_between_slices(monkeypatch):
    model = Outer()
    variables = model.init(jax.random.key(0), X)
    js.slice(model, variables, X)(X)
    monkeypatch.setattr(Scaled, "factor", 3.0)
    close(js.slice(model, variables, X)(X), model.apply(variables, X))
    got = js.intermediates(model, variables, X, names=["scaled"])["scaled"]
    close(got.sum(-1), model.apply(variables, X))


class ConfiguredNNX(nnx.Module):
    def __init__(self, config, rngs):
        self.config = config
        self.body = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return self.body(x) * self.config.scale


def test_nnx_config_object_changed_between_slices():
    config = Config(1.0)
    model = ConfiguredNNX(config, nnx.Rngs(0))
    js.slice(model, X)(X)
    config.scale = -2.5
    close(js.slice(model, X)(X), model(X))
    close(js.intermediates(model, X, names=["body"])["body"], model.body(X))


def test_equinox_static_config_changed_between_slices():
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        body: eqx.nn.Linear
        config: Config = eqx.field(static=True)

        def __call__(self, x):
            return self.body(x) * self.config.scale

    config = Config(1.0)
    model = Net(eqx.nn.Linear(3, 3, key=jax.random.key(0)), config)
    x = X[0]
    js.slice(model, x)(x)
    config.scale = 0.25
    close(js.slice(model, x)(x), model(x))


def test_haiku_module_class_attribute_changed_between_slices(monkeypatch):
    hk = pytest.importorskip("haiku")

    class Scale(hk.Module):
        factor = 1.0

        def __call__(self, x):
            return hk.Linear(3, name="linear")(x) * self.factor

    f = hk.without_apply_rng(hk.transform(lambda x: Scale(name="scale")(x)))
    params = f.init(jax.random.key(0), X)
    js.slice(f, params, X)(X)
    monkeypatch.setattr(Scale, "factor", 5.0)
    close(js.slice(f, params, X)(X), f.apply(params, X))


def test_plain_function_closing_over_a_changed_setting():
    settings = {"scale": 1.0}

    def fn(params, x):
        return jnp.tanh(x @ params["w"]) * settings["scale"]

    params = {"w": jnp.ones((3, 3)) * 0.3}
    js.slice(fn, params, X)(X)
    settings["scale"] = 7.0
    close(js.slice(fn, params, X)(X), fn(params, X))


# ------------------------------------------------------------------ arrays the model holds
#
# A linen module's array fields, arrays a function closes over and NumPy attributes are
# constants of the traced program: keyed by their contents. (Arrays that are a model's
# variables, as in NNX and Equinox, are inputs of the trace: see test_trace_cache.py.)


class Masked(nn.Module):
    mask: object  # a NumPy or JAX array

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, name="body")(x) * jnp.asarray(self.mask)
        return nn.Dense(2, name="head")(h)


@pytest.mark.parametrize("array", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
def test_linen_array_fields_of_other_values_trace_apart(array):
    first = Masked(array(np.array([1.0, 0.0, 1.0], np.float32)))
    variables = first.init(jax.random.key(0), X)
    second = Masked(array(np.array([5.0, 2.0, -3.0], np.float32)))
    close(js.slice(first, variables, X)(X), first.apply(variables, X))
    close(js.slice(second, variables, X)(X), second.apply(variables, X))
    got = js.intermediates(second, variables, X, names=["head"])["head"]
    close(got, second.apply(variables, X))


def test_linen_numpy_field_changed_in_place():
    model = Masked(np.array([1.0, 0.0, 1.0], np.float32))
    variables = model.init(jax.random.key(0), X)
    js.slice(model, variables, X)(X)
    model.mask[:] = [-2.0, 3.0, 0.5]
    close(js.slice(model, variables, X)(X), model.apply(variables, X))
    close(js.intermediates(model, variables, X, names=["head"])["head"], model.apply(variables, X))


def test_plain_function_closing_over_an_array_rebound():
    table = jnp.ones(3)

    def fn(params, x):
        return jnp.tanh(x @ params["w"]) * table

    params = {"w": jnp.ones((3, 3)) * 0.3}
    js.slice(fn, params, X)(X)
    table = jnp.asarray([2.0, -1.0, 0.5])
    close(js.slice(fn, params, X)(X), fn(params, X))


# ---------------------------------------------------------------- fixed arguments and types


class Offset(nn.Module):
    @nn.compact
    def __call__(self, x, offset):
        h = nn.Dense(3, name="dense")(x)
        return h, jnp.arange(3) * offset


@pytest.mark.parametrize("first, then", [(1, 1.0), (1.0, 1), (1, True), (True, 1), (0.0, False)])
def test_python_numbers_of_equal_value_and_other_type_trace_apart(first, then):
    model = Offset()
    variables = model.init(jax.random.key(0), X, 1)
    js.slice(model, variables, X, first)(X)
    got = js.slice(model, variables, X, then)(X)
    want = model.apply(variables, X, then)
    assert got[1].dtype == want[1].dtype
    close(got[1], want[1])


def test_weak_and_strong_variables_trace_apart():
    def fn(p, x):
        return jnp.tanh(x * p)

    x = jnp.ones(3, jnp.bfloat16)
    strong, weak = jnp.float32(2.0), jax.device_put(2.0)
    assert weak.weak_type and not strong.weak_type
    for first, then in [(strong, weak), (weak, strong)]:
        js.slice(fn, first, x)(x)
        got = js.slice(fn, then, x)(x)
        assert got.dtype == fn(then, x).dtype


def test_weak_typed_inputs_of_a_slice_retrace():
    def fn(p, x):
        return x * p

    p = jnp.ones((), jnp.bfloat16)
    sub = js.slice(fn, p, jnp.float32(1.0))
    strong, weak = sub(jnp.float32(2.0)), sub(jax.device_put(2.0))
    assert strong.dtype == fn(p, jnp.float32(2.0)).dtype == jnp.float32
    assert weak.dtype == fn(p, jax.device_put(2.0)).dtype == jnp.bfloat16


# ------------------------------------------------------------------ models not keyed by value


def test_a_model_that_cannot_be_keyed_is_traced_every_time():
    # An instance of a C type: no fields to read, not hashable, changed in place.
    config = array.array("f", [1.0])

    class Net(nn.Module):
        config: array.array

        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="dense")(x) * self.config[0]

    model = Net(config)
    variables = model.init(jax.random.key(0), X)
    js.slice(model, variables, X)(X)
    config[0] = 9.0
    close(js.slice(model, variables, X)(X), model.apply(variables, X))
