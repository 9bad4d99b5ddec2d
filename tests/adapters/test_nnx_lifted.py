"""NNX lifted transforms (nnx.remat, nnx.scan): slicing around, across and inside them.

Inside an NNX transform the module is a copy made by the transform; its calls are still
boundaries under the model's own attribute paths, and a slice across or inside the
transform equals the eager model.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxslice as js


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.lin(x))


class Remat(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Linear(3, 4, rngs=rngs)
        self.rem = Block(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        x = nnx.remat(lambda m, h: m(h))(self.rem, x)
        return self.head(x)


class Scanned(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.stem = nnx.Linear(3, 4, rngs=rngs)
        self.layers = make(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, c):
            return layer(c)

        return self.head(body(self.layers, self.stem(x)))


X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)), jnp.float32)


def test_slice_across_nnx_remat_equals_the_model():
    m = Remat(nnx.Rngs(0))
    assert [b.name for b in js.boundaries(m, X)] == ["stem", "rem", "rem/lin", "head"]
    np.testing.assert_allclose(
        js.slice(m, X, start="rem", end="rem/lin")(m.stem(X)), m.rem.lin(m.stem(X)), atol=1e-6
    )
    sub = js.slice(m, X, start="stem:output", end="head")
    np.testing.assert_allclose(sub(m.stem(X)), m(X), atol=1e-6)
    grads = nnx.grad(lambda s: (s(m.stem(X)) ** 2).sum())(sub)
    # The slice holds `head` and the remat block, and both get gradients.
    assert sub.parts[1] is m.rem
    leaves = jax.tree_util.tree_leaves(grads)
    assert len(leaves) == 4 and all(float(jnp.abs(v).sum()) > 0 for v in leaves)


def test_slice_before_and_after_nnx_scan():
    m = Scanned(nnx.Rngs(1))
    head = js.slice(m, X, start="head")
    feats = js.slice(m, X, end="head:input")
    np.testing.assert_allclose(head(feats(X)), m(X), atol=1e-6)
    np.testing.assert_allclose(js.slice(m, X, end="stem")(X), m.stem(X), atol=1e-6)
