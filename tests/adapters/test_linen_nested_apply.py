"""A linen submodule applied on its own, ``self.head.apply({"params": ...}, h)``, is a
boundary.

HF Flax models apply a tied output layer that way (GPT-2's ``lm_head`` with the
embedding matrix). The submodule runs in a scope of its own whose path is ``()``; it is
named by where it is called (``head`` in the model's own call, ``block/inner`` in
block's), its own submodules below it (``block/inner/d``).

Oracles: the model's own ``apply`` and the same computation written out by hand from
the model's parameters (linen's ``capture_intermediates`` does not see inside a nested
``apply``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class Tied(nn.Module):
    """An output layer tied to the first layer's kernel, as HF ties ``lm_head``."""

    def setup(self):
        self.body = nn.Dense(4)
        self.head = nn.Dense(4, use_bias=False)

    def __call__(self, x):
        h = self.body(x)
        kernel = self.body.variables["params"]["kernel"]
        return self.head.apply({"params": {"kernel": kernel.T}}, h)


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="d")(x)


class Block(nn.Module):
    def setup(self):
        self.body = nn.Dense(4)
        self.inner = Inner()

    def __call__(self, x):
        h = jnp.tanh(self.body(x))
        p = self.body.variables["params"]
        tied = {"d": {"kernel": p["kernel"][:, :3], "bias": p["bias"][:3]}}
        return self.inner.apply({"params": tied}, h)


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="out")(Block(name="block")(x))


TIED = Tied()
TIED_VARS = TIED.init(jax.random.key(0), X)
OUTER = Outer()
OUTER_VARS = OUTER.init(jax.random.key(1), X)


def _tied_by_hand(x):
    p = TIED_VARS["params"]["body"]
    h = x @ p["kernel"] + p["bias"]
    return h, h @ p["kernel"].T


def _outer_by_hand(x, add=0.0):
    p = OUTER_VARS["params"]
    b = p["block"]["body"]
    h = jnp.tanh(x @ b["kernel"] + b["bias"])
    inner = h @ b["kernel"][:, :3] + b["bias"][:3]
    return h, inner, (inner + add) @ p["out"]["kernel"] + p["out"]["bias"]


def test_applied_submodule_is_a_boundary():
    assert js.boundaries(TIED, TIED_VARS, X).names() == ["body", "head"]
    names = js.boundaries(OUTER, OUTER_VARS, X).names()
    assert names == ["block", "block/body", "block/inner", "block/inner/d", "out"]


@pytest.mark.parametrize("jit", [False, True])
def test_slices_at_an_applied_submodule(jit):
    wrap = jax.jit if jit else (lambda f: f)
    h, out = _tied_by_hand(X)
    _close(TIED.apply(TIED_VARS, X), out)  # the hand-written oracle is the model
    _close(wrap(js.slice(TIED, TIED_VARS, X, end="head:input"))(X), h)
    _close(wrap(js.slice(TIED, TIED_VARS, X, end="head"))(X), out)
    h2 = h + 1.0
    kernel = TIED_VARS["params"]["body"]["kernel"]
    _close(wrap(js.slice(TIED, TIED_VARS, X, start="head:input"))(h2), h2 @ kernel.T)


def test_slices_inside_an_applied_submodule():
    h, inner, out = _outer_by_hand(X)
    _close(OUTER.apply(OUTER_VARS, X), out)
    _close(js.slice(OUTER, OUTER_VARS, X, end="block/inner:input")(X), h)
    _close(js.slice(OUTER, OUTER_VARS, X, end="block/inner/d")(X), inner)
    sub = js.slice(OUTER, OUTER_VARS, X, start="block/inner/d:input", end="block/inner")
    _close(sub(h), inner)
    _close(js.slice(OUTER, OUTER_VARS, X, start="block/inner:output")(inner), out)


def test_intermediates_and_lens_at_an_applied_submodule():
    h, inner, out = _outer_by_hand(X)
    got = js.intermediates(OUTER, OUTER_VARS, X, names=["block/inner", "block/inner/d"])
    _close(got["block/inner"], inner)
    _close(got["block/inner/d"], inner)
    assert js.intermediates(TIED, TIED_VARS, X, names=["head"])["head"].shape == (2, 4)
    _close(js.intermediates(TIED, TIED_VARS, X, names=["head"])["head"], _tied_by_hand(X)[1])
    lens = js.lens(OUTER, OUTER_VARS, X)
    assert "block/inner" in lens.sites
    v = jnp.array([0.5, -1.0, 2.0])
    y, cache = lens(X, add={"block/inner": v}, read="block/inner")
    _close(cache["block/inner"], inner + v)
    _close(y, _outer_by_hand(X, add=v)[2])


def test_model_own_methods_and_named_top_level_are_no_boundaries():
    """The model's own call (path ``()`` too) stays the model's inputs and output."""

    class TwoStep(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.step(nn.Dense(4, name="a")(x))

        def step(self, h):
            return jnp.tanh(h)

    for model in (TwoStep(), Tied(name="top")):
        variables = model.init(jax.random.key(2), X)
        names = js.boundaries(model, variables, X).names()
        assert names == (["a"] if isinstance(model, TwoStep) else ["body", "head"])
        _close(js.slice(model, variables, X)(X), model.apply(variables, X))


def test_hf_flax_gpt2_tied_lm_head():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    hf = transformers.FlaxGPT2LMHeadModel(config, seed=0)  # ties lm_head by default
    module, variables = hf.module, {"params": hf.params}
    ids = jnp.array([[1, 2, 3]])
    args = (ids, jnp.ones_like(ids), jnp.arange(3)[None])
    assert "lm_head" in js.boundaries(module, variables, *args, deterministic=True).names()
    hidden = js.slice(module, variables, *args, end="lm_head:input", deterministic=True)(*args)
    wte = variables["params"]["transformer"]["wte"]["embedding"]
    want = module.apply(variables, *args, deterministic=True).logits
    _close(hidden @ wte.T, want)
