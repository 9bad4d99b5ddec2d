"""A fresh slice sees a change of a class the model uses, not only of the objects it holds.

docs/training.md: a new `js.slice` "traces again whenever what the model computes could
have changed". Each case slices, changes a class attribute of a config class (held as an
instance or as the class itself), a class-level function of a module class, or a slot
of a config object, then slices again; the oracle is the model's own call after the
change. The last case checks that a model whose classes hold methods, functions and
objects that cannot be described by value is still traced once (its code counts).
"""

from __future__ import annotations

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxslice as js

X = jnp.array([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]])


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_nnx_config_instance_whose_class_attribute_changed():
    class Config:
        scale = 1.0

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.cfg = Config()
            self.body = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return self.body(x) * self.cfg.scale

    model = Net(nnx.Rngs(0))
    js.slice(model, X)(X)
    Config.scale = 4.0
    close(js.slice(model, X)(X), model(X))
    got = js.intermediates(model, X, names=["body"])["body"]
    close(got * 4.0, model(X))


def test_class_attribute_changed_on_a_base_of_the_config_class():
    class Defaults:
        scale = 1.0

    class Config(Defaults):
        pass

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.cfg = Config()
            self.body = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return self.body(x) * self.cfg.scale

    model = Net(nnx.Rngs(1))
    js.slice(model, X)(X)
    Defaults.scale = -3.0
    close(js.slice(model, X)(X), model(X))


def test_linen_config_class_held_as_a_field_changed():
    class LCfg:
        scale = 1.0

    class LNet(nn.Module):
        cfg: type

        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="body")(x) * self.cfg.scale

    model = LNet(LCfg)
    variables = model.init(jax.random.key(0), X)
    js.slice(model, variables, X)(X)
    js.lens(model, variables, X)(X)
    LCfg.scale = 4.0
    close(js.slice(model, variables, X)(X), model.apply(variables, X))
    out = js.lens(model, variables, X)(X)
    close(out[0] if isinstance(out, tuple) else out, model.apply(variables, X))


def test_class_level_activation_of_a_module_class_changed():
    class Block(nnx.Module):
        act = staticmethod(jax.nn.relu)

        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            return self.act(self.lin(x))

    model = Block(nnx.Rngs(0))
    js.slice(model, X)(X)
    Block.act = staticmethod(jnp.tanh)
    close(js.slice(model, X)(X), model(X))

    class Scaled(nnx.Module):  # a classmethod reading the class
        factor = 2.0

        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)

        @classmethod
        def scale(cls, x):
            return x * cls.factor

        def __call__(self, x):
            return self.scale(self.lin(x))

    scaled = Scaled(nnx.Rngs(2))
    js.slice(scaled, X)(X)
    Scaled.scale = classmethod(lambda cls, x: x - cls.factor)
    close(js.slice(scaled, X)(X), scaled(X))


def test_slot_of_a_config_object_changed():
    class Base:
        pass

    class SlotCfg(Base):  # a slot, and a __dict__ from its base
        __slots__ = ("scale", "__shift")

        def __init__(self, scale):
            self.scale = scale
            self.__shift = 0.0

        def shift(self):
            return self.__shift

        def set_shift(self, value):
            self.__shift = value

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.cfg = SlotCfg(1.0)

        def __call__(self, x):
            return self.lin(x) * self.cfg.scale + self.cfg.shift()

    model = Net(nnx.Rngs(0))
    js.slice(model, X)(X)
    model.cfg.scale = 5.0
    close(js.slice(model, X)(X), model(X))
    model.cfg.set_shift(2.5)  # a private (mangled) slot
    close(js.slice(model, X)(X), model(X))


def test_classes_with_methods_and_opaque_attributes_are_traced_once():
    traces = {"n": 0}

    class Config:
        lock = threading.Lock()  # no fields: described by identity
        act = staticmethod(jax.nn.relu)

        def scale(self):
            return 2.0

    Config.default = Config()  # leads back to its class

    class Block(nnx.Module):
        kind = Config

        def __init__(self, rngs):
            self.cfg = Config.default
            self.lin = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            traces["n"] += 1
            return self.cfg.act(self.lin(x)) * self.kind.default.scale()

    model = Block(nnx.Rngs(0))
    js.slice(model, X)(X)
    before = traces["n"]
    sub = js.slice(model, X)
    names = js.boundaries(model, X).names()
    assert traces["n"] == before
    assert names == ["lin"]
    close(sub(X), model(X))
