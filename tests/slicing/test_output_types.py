"""A model's output keeps its own type through whatever jaxslice makes from the model.

A model or module may return a NamedTuple, or a dict subclass registered as a pytree
(HF Flax's ``ModelOutput``: a ``flax.struct.dataclass`` that subclasses ``OrderedDict``
and lists only its fields that are not None as dict items). A slice, a lens and an
edited model return that same type, with the same fields, None ones included; only the
user's own container of several ends (``end=[...]``, ``end={...}``) is a plain tuple or
dict.

Oracles: the model's own ``apply`` and ``jax.jit(model.apply)`` (type, tree structure
and values) and Flax's ``capture_intermediates`` for a submodule's output.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

X = jnp.linspace(-1.0, 1.0, 15).reshape(3, 5)


class Out(NamedTuple):
    logits: jax.Array
    feats: jax.Array


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="body")(x)
        return Out(nn.Dense(2, name="head")(h), h)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        o = Block(name="block")(x)
        return Out(o.logits * 2, jnp.tanh(o.feats))


@flax.struct.dataclass
class LMOutput(OrderedDict):
    """A small HF ``ModelOutput``: its dict items are its fields that are not None."""

    logits: jax.Array
    hidden: jax.Array | None = None
    attentions: jax.Array | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return LMOutput(logits=nn.Dense(3, name="proj")(x))


class LM(nn.Module):
    @nn.compact
    def __call__(self, x):
        o = Encoder(name="encoder")(x)
        return LMOutput(logits=o.logits + 1.0, hidden=o.logits)


def _assert_same(got, want):
    """Same type and tree structure (None leaves included) as `want`, and close values."""
    assert type(got) is type(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _made(model, variables):
    """What jaxslice makes from the model that returns the model's own output."""
    return {
        "slice": js.slice(model, variables, X),
        "slice_jit": jax.jit(js.slice(model, variables, X)),
        "lens": js.lens(model, variables, X),
        "edited": js.edit(model, variables, X).build(),
    }


@pytest.mark.parametrize("model", [Net(), LM()], ids=["namedtuple", "model_output"])
def test_model_output_keeps_its_type(model):
    variables = model.init(jax.random.key(0), X)
    want = jax.jit(model.apply)(variables, X)
    assert type(want) is type(model.apply(variables, X))
    for what, made in _made(model, variables).items():
        got = made(X)
        assert type(got) is type(want), what
        _assert_same(got, want)
    # an attribute a user reads works, and a None field stays None
    if isinstance(want, LMOutput):
        assert js.slice(model, variables, X)(X).attentions is None


@pytest.mark.parametrize(
    ("model", "name"), [(Net(), "block"), (LM(), "encoder")], ids=["namedtuple", "model_output"]
)
def test_module_output_keeps_its_type(model, name):
    variables = model.init(jax.random.key(0), X)
    _, state = model.apply(variables, X, capture_intermediates=True, mutable=["intermediates"])
    (want,) = state["intermediates"][name]["__call__"]
    _assert_same(js.slice(model, variables, X, end=name)(X), want)
    _assert_same(js.intermediates(model, variables, X, names=[name])[name], want)
    # several ends: the user's container is plain, each end's tree keeps its type
    whole = model.apply(variables, X)
    pair = js.slice(model, variables, X, end=[name, None])(X)
    assert type(pair) is tuple
    _assert_same(pair[0], want)
    _assert_same(pair[1], whole)
    named = js.slice(model, variables, X, end={"mid": name, "out": None})(X)
    assert type(named) is dict and list(named) == ["mid", "out"]
    _assert_same(named["mid"], want)
    _assert_same(named["out"], whole)


def test_slice_from_a_module_returns_the_models_type():
    model = Net()
    variables = model.init(jax.random.key(0), X)
    whole = model.apply(variables, X)
    h = nn.Dense(4).apply({"params": variables["params"]["block"]["body"]}, X)
    got = js.slice(model, variables, X, start="block/head:input")(h)
    _assert_same(got, whole)


def test_equinox_namedtuple_output():
    eqx = pytest.importorskip("equinox")

    class EqxNet(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            h = self.lin(x)
            return Out(h * 2, h)

    model = EqxNet(eqx.nn.Linear(5, 2, key=jax.random.key(0)))
    x = X[0]
    want = eqx.filter_jit(model)(x)
    _assert_same(js.slice(model, x)(x), want)
    _assert_same(js.lens(model, x)(x), want)


def test_user_container_subclasses_stay_containers_of_ends():
    """An OrderedDict (a dict subclass) given as `end` is still a container of names."""
    model = Net()
    variables = model.init(jax.random.key(0), X)
    _, state = model.apply(variables, X, capture_intermediates=True, mutable=["intermediates"])
    (want,) = state["intermediates"]["block"]["body"]["__call__"]
    got = js.slice(model, variables, X, end=OrderedDict(body="block/body"))(X)
    assert list(got) == ["body"]
    np.testing.assert_allclose(got["body"], want, rtol=1e-6)


def test_hf_flax_gpt2_output_type():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    hf = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    module, variables = hf.module, {"params": hf.params}
    ids = jnp.array([[1, 2, 3, 4]])
    args = (ids, jnp.ones_like(ids), jnp.arange(4)[None])
    want = jax.jit(lambda v, *a: module.apply(v, *a, deterministic=True))(variables, *args)
    got = js.slice(module, variables, *args, deterministic=True)(*args)
    _assert_same(got, want)
    assert got.logits.shape == (1, 4, 50)
