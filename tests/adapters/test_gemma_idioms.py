"""Idioms of the `gemma` library's linen models: shared scopes, helper methods, and
positional arguments that hold no arrays.

gemma's feed-forward layer keeps its two einsums' weights directly under its own scope;
a LoRA wrapper adopts the scope of the Dense it wraps. Each call is still its own
boundary, named by where the module sits in the module tree. Helper methods that take
and return no arrays (building a submodule, reading a flag) are no boundaries.
A block called as ``block(x, positions, None, mask)`` (no KV cache) is sliced and read
with the same arguments. Oracles: the same weights applied with `jnp.einsum` /
`Dense.apply` by hand.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js


class Einsum(nn.Module):
    shape: tuple
    weight_name: str = "w"

    @nn.compact
    def __call__(self, eqn, x):
        w = self.param(self.weight_name, nn.initializers.normal(1.0), self.shape)
        return jnp.einsum(eqn, x, w)


class FeedForward(nn.Module):
    features: int
    hidden: int

    def setup(self):
        self.gating = Einsum((2, self.features, self.hidden), weight_name="gating_einsum")
        self.down = Einsum((self.hidden, self.features), weight_name="linear")
        nn.share_scope(self, self.gating)
        nn.share_scope(self, self.down)

    def projection(self):  # a helper: no arrays in or out
        return self.down

    def __call__(self, x):
        g = self.gating("...d,cdh->c...h", x)
        return self.projection()("...h,hd->...d", jax.nn.gelu(g[0]) * g[1])


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + FeedForward(4, 8, name="mlp")(nn.LayerNorm(name="norm")(x))


X = jax.random.normal(jax.random.key(1), (3, 4))


def test_modules_sharing_a_scope_are_distinct_boundaries():
    model = Block()
    variables = model.init(jax.random.key(0), X)
    table = js.boundaries(model, variables, X)
    assert table.names() == ["norm", "mlp", "mlp/gating", "mlp/down"]
    assert [b.module_type for b in table] == ["LayerNorm", "FeedForward", "Einsum", "Einsum"]
    assert all(b.num_calls == 1 for b in table)

    p = variables["params"]["mlp"]
    h = nn.LayerNorm().apply({"params": variables["params"]["norm"]}, X)
    gating = jnp.einsum("...d,cdh->c...h", h, p["gating_einsum"])
    hidden = jax.nn.gelu(gating[0]) * gating[1]
    np.testing.assert_allclose(
        js.slice(model, variables, X, end="mlp/gating")(X), gating, rtol=1e-5, atol=1e-5
    )
    down = js.slice(model, variables, X, start="mlp/down", end="mlp/down")
    np.testing.assert_allclose(down(hidden), hidden @ p["linear"], rtol=1e-5, atol=1e-5)
    assert jax.tree.map(jnp.shape, down.variables) == {"params": {"mlp": {"linear": (8, 4)}}}


def test_a_wrapper_that_adopts_a_layers_scope_is_named_by_its_own_name():
    class LoRA(nn.Module):
        base: nn.Dense

        def setup(self):
            nn.share_scope(self, self.base)

        @nn.compact
        def __call__(self, x):
            a = self.param("A", nn.initializers.normal(1.0), (x.shape[-1], 2))
            b = self.param("B", nn.initializers.normal(1.0), (2, self.base.features))
            return self.base(x) + x @ a @ b

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return LoRA(nn.Dense(3))(x)

    model = Model()
    variables = model.init(jax.random.key(0), X)
    p = variables["params"]["Dense_0"]
    assert sorted(p) == ["A", "B", "bias", "kernel"]  # one scope, as Flax documents
    assert js.boundaries(model, variables, X).names() == ["LoRA_0", "Dense_0"]
    base = X @ p["kernel"] + p["bias"]
    got = js.intermediates(model, variables, X)
    np.testing.assert_allclose(got["Dense_0"], base, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["LoRA_0"], base + X @ p["A"] @ p["B"], rtol=1e-5, atol=1e-5)


class CachedBlock(nn.Module):
    """gemma's block signature: ``(x, positions, cache, mask)`` with ``cache=None``."""

    @nn.compact
    def __call__(self, x, positions, cache, mask):
        h = nn.Dense(4, name="attn")(x) * mask[..., None] + positions[..., None]
        if cache is not None:
            h = h + cache
        return nn.Dense(4, name="mlp")(h)


def test_a_model_with_a_none_argument_is_called_as_the_model_is():
    model = CachedBlock()
    pos, mask = jnp.arange(3.0), jnp.array([1.0, 0.0, 1.0])
    variables = model.init(jax.random.key(0), X, pos, None, mask)
    p = variables["params"]
    attn = X @ p["attn"]["kernel"] + p["attn"]["bias"]
    out = (attn * mask[:, None] + pos[:, None]) @ p["mlp"]["kernel"] + p["mlp"]["bias"]
    got = js.intermediates(model, variables, X, pos, None, mask, names=["attn"])
    np.testing.assert_allclose(got["attn"], attn, rtol=1e-5, atol=1e-5)
    sub = js.slice(model, variables, X, pos, None, mask, end=["attn", None])
    for result in (sub(X, pos, None, mask), sub(X, pos, mask)):  # as the model, or arrays only
        np.testing.assert_allclose(result[0], attn, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result[1], out, rtol=1e-5, atol=1e-5)
    with pytest.raises(js.SliceError, match="argument 2 holds no arrays"):
        sub(X, pos, 0.5, mask)  # another value than the trace fixed: never ignored
