"""The NNX models and oracles shared by the NNX tests (`tests/adapters/test_nnx.py`,
`tests/adapters/test_nnx_training.py`, the observe tests): `Zoo` (an MLP built from every
NNX container), `Residual` (a residual linear block) and `CNN` (conv, BatchNorm,
Dropout), filled with random values by numpy and never compiled (`make_zoo`,
`make_cnn`), their boundary names, eager oracles written out by hand (`zoo_eager`,
`zoo_tail`, `cnn_eager_eval`, `cnn_tail`), and small pytree checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ATOL = 1e-5
RTOL = 1e-5

# --------------------------------------------------------------------------- helpers


def assert_close(actual, expected, *, atol=ATOL, rtol=RTOL):
    """Same pytree structure, shapes and dtypes; leaves equal within tolerance."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"structure {a_tree} != {e_tree}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (
            f"leaf {i}: {a.dtype}{a.shape} != {e.dtype}{e.shape}"
        )
        np.testing.assert_allclose(a, e, atol=atol, rtol=rtol, err_msg=f"leaf {i}")


def as_numpy(x):
    """A numpy copy of an array leaf (typed PRNG keys as their raw key data)."""
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.array(x)


def snapshot(model, *filters):
    """``{path: numpy copy}`` of the model's variables (all, or those matching one filter)."""
    state = nnx.state(model, *filters)
    return {tuple(map(str, p)): as_numpy(v[...]) for p, v in nnx.to_flat_state(state)}


def variable_ids(node):
    """Ids of every `nnx.Variable` reachable from `node`."""
    return {id(v) for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)}


def rand(seed, shape):
    """Standard normal float32 data (numpy's generator: no JAX compilation per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


# --------------------------------------------------------------------------- models


class Block(nnx.Module):
    def __init__(self, d, *, rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.lin(x))


class Residual(nnx.Module):
    """``x + relu(linear(x))`` at width 4: the block of the observe tests' NNX models."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.relu(self.linear(x))


class Zoo(nnx.Module):
    """An MLP built from every NNX container: nnx.List, nnx.Dict, nnx.Sequential."""

    def __init__(self, *, rngs):
        self.stem = nnx.Linear(3, 8, rngs=rngs)
        self.blocks = nnx.List([Block(8, rngs=rngs) for _ in range(2)])
        self.branches = nnx.Dict(
            {"a": nnx.Linear(8, 8, rngs=rngs), "b": nnx.Linear(8, 8, rngs=rngs)}
        )
        self.seq = nnx.Sequential(
            nnx.Linear(8, 8, rngs=rngs), jnp.tanh, nnx.Linear(8, 8, rngs=rngs)
        )
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        x = self.branches["a"](x) * jax.nn.sigmoid(self.branches["b"](x))
        x = self.seq(x)
        return self.head(x)


ZOO_NAMES = [
    "stem",
    "blocks/0",
    "blocks/0/lin",
    "blocks/1",
    "blocks/1/lin",
    "branches/a",
    "branches/b",
    "seq",
    "seq/layers/0",
    "seq/layers/2",
    "head",
]


def zoo_eager(m, x):
    """Every boundary output of `Zoo`, computed by calling its submodules eagerly."""
    out = {}
    out["stem"] = h = m.stem(x)
    out["blocks/0/lin"] = m.blocks[0].lin(h)
    out["blocks/0"] = h = m.blocks[0](h)
    out["blocks/1/lin"] = m.blocks[1].lin(h)
    out["blocks/1"] = h = m.blocks[1](h)
    out["branches/a"] = a = m.branches["a"](h)
    out["branches/b"] = b = m.branches["b"](h)
    h = a * jax.nn.sigmoid(b)
    out["seq/layers/0"] = s = m.seq.layers[0](h)
    out["seq/layers/2"] = m.seq.layers[2](jnp.tanh(s))
    out["seq"] = h = m.seq(h)
    out["head"] = m.head(h)
    return out


def zoo_tail(m, h):
    """`Zoo` from the input of ``blocks/1`` to the output: the oracle of that slice."""
    h = m.blocks[1](h)
    h = m.branches["a"](h) * jax.nn.sigmoid(m.branches["b"](h))
    return m.head(m.seq(h))


@functools.cache
def _initialised(cls, seed):
    """A model of class `cls` with random values drawn by numpy, never compiled.

    The structure comes from `nnx.eval_shape`; filling it from numpy instead of running
    the initialisers keeps JAX from compiling each init op (most of a tiny test's time).
    Every test gets its own deep copy (`make`).
    """
    model = nnx.eval_shape(lambda: cls(rngs=nnx.Rngs(seed, dropout=seed + 100)))
    rng = np.random.default_rng(seed)

    def fill(path, x):
        name = path[-2].key  # the variable's attribute name (path[-1] is `.value`)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(seed + 100)
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jnp.zeros(x.shape, x.dtype)
        if name == "var":
            return jnp.asarray(rng.uniform(0.5, 1.5, x.shape).astype(np.float32))
        if name == "scale":
            return jnp.asarray(1.0 + 0.2 * rng.standard_normal(x.shape, dtype=np.float32))
        fan_in = int(np.prod(x.shape[:-1])) if len(x.shape) > 1 else 25
        return jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32) / np.sqrt(fan_in))

    nnx.update(model, jax.tree_util.tree_map_with_path(fill, nnx.state(model)))
    return model


def make(cls, seed=0):
    return nnx.clone(_initialised(cls, seed))


def make_zoo(seed=0):
    return make(Zoo, seed)


TRACES = {"cnn": 0}  # incremented by CNN.__call__, i.e. once per trace of the full model


class ConvBlock(nnx.Module):
    def __init__(self, cin, cout, *, rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(cout, momentum=0.8, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.conv(x)))


class CNN(nnx.Module):
    def __init__(self, *, rngs):
        self.block1 = ConvBlock(1, 4, rngs=rngs)
        self.block2 = ConvBlock(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        TRACES["cnn"] += 1
        x = self.block1(x)
        x = self.block2(x)
        x = jnp.mean(x, axis=(1, 2))
        return self.head(self.drop(x))


CNN_NAMES = [
    "block1",
    "block1/conv",
    "block1/bn",
    "block2",
    "block2/conv",
    "block2/bn",
    "drop",
    "head",
]


def cnn_eager_eval(m, x):
    """Every boundary output of `CNN` in eval mode, by eager submodule calls."""
    out = {}
    out["block1/conv"] = c = m.block1.conv(x)
    out["block1/bn"] = m.block1.bn(c)
    out["block1"] = h = m.block1(x)
    out["block2/conv"] = c = m.block2.conv(h)
    out["block2/bn"] = m.block2.bn(c)
    out["block2"] = h = m.block2(h)
    h = jnp.mean(h, axis=(1, 2))
    out["drop"] = h = m.drop(h)
    out["head"] = m.head(h)
    return out


def cnn_tail(m, v):
    """`CNN` from the input of ``block2`` to the output, by eager submodule calls."""
    return m.head(m.drop(jnp.mean(m.block2(v), axis=(1, 2))))


def make_cnn(seed=0, *, train=False):
    model = make(CNN, seed)
    if train:
        model.train()
    else:
        model.eval()
    return model


X_ZOO = rand(1, (4, 3))
X_CNN = rand(2, (4, 8, 8, 1))
