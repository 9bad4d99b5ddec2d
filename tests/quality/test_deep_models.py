"""Models nested about as deep as Flax itself allows are traced and sliced.

Marking adds Python frames to every module level; a linen model nested 150 levels deep
(which `model.init` and `model.apply` handle) must not hit `RecursionError` in jaxslice.
Oracle: `model.apply`.
"""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxslice as js

from helpers.oracles import assert_trees_all_close

DEPTH = 150


class Leaf(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="dense")(x)


class Nest(nn.Module):
    depth: int

    @nn.compact
    def __call__(self, x):
        if self.depth == 0:
            return Leaf(name="leaf")(x)
        return jnp.tanh(Nest(self.depth - 1, name="inner")(x))


def test_a_model_nested_150_deep_is_listed_and_sliced():
    model = Nest(DEPTH)
    x = jnp.ones((3, 2))
    variables = model.init(jax.random.key(0), x)
    limit = sys.getrecursionlimit()
    table = js.boundaries(model, variables, x)
    assert len(table) == DEPTH + 2  # the nested calls, the leaf and its Dense
    innermost = "/".join(["inner"] * DEPTH + ["leaf"])
    assert table[-2].name == innermost
    tail = js.slice(model, variables, x, start=innermost)
    assert_trees_all_close(tail(x), model.apply(variables, x))
    # The higher limit needed while tracing is not left behind.
    assert sys.getrecursionlimit() == limit
