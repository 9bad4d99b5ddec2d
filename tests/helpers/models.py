"""The model zoo shared by the jaxslice tests: tiny linen models (a ResNet-style CNN and
one small model per feature: an identity module, a module returning a tuple, an unused
module, a shared module, a skip connection, a module with methods), the coverage tests'
MLP and CNN, the scanned stacks (linen `nn.scan` and NNX) shared by the scan,
interpreter and editing tests, and a small functional Keras model.

The session fixtures built from the linen zoo (``resnet``, ``skip_zoo``, ...) are in
``tests/conftest.py``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# --------------------------------------------------------------------------- zoo models


class ResBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a (projected) residual add."""

    features: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.features, (3, 3), name="conv1")(x)
        y = nn.BatchNorm(use_running_average=True, name="bn1")(y)
        y = nn.relu(y)
        y = nn.Conv(self.features, (3, 3), name="conv2")(y)
        y = nn.BatchNorm(use_running_average=True, name="bn2")(y)
        if x.shape[-1] != self.features:
            x = nn.Conv(self.features, (1, 1), name="proj")(x)
        return nn.relu(x + y)


class TinyResNet(nn.Module):
    """A ResNet-style CNN in eval mode with named stages."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), name="stem")(x)
        x = nn.relu(x)
        x = ResBlock(4, name="stage1")(x)
        x = ResBlock(8, name="stage2")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(3, name="head")(x)


RESNET_NAMES = [
    "stem",
    "stage1",
    "stage1/conv1",
    "stage1/bn1",
    "stage1/conv2",
    "stage1/bn2",
    "stage2",
    "stage2/conv1",
    "stage2/bn1",
    "stage2/conv2",
    "stage2/bn2",
    "stage2/proj",
    "head",
]


class Identity(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


class WithIdentity(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        h = Identity(name="ident")(h)
        return nn.Dense(2, name="head")(jnp.tanh(h))


class Pair(nn.Module):
    """Returns a tuple of two differently transformed copies of its input."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="a")(x), jnp.sin(nn.Dense(4, name="b")(x))


class WithTuple(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        a, b = Pair(name="pair")(h)
        return nn.Dense(2, name="head")(a * b + a)


class WithUnused(nn.Module):
    """``probe``'s output is never used by the model's result."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        _ = nn.Dense(5, name="probe")(h)
        return nn.Dense(2, name="head")(nn.relu(h))


class WithShared(nn.Module):
    """``shared`` is applied twice with the same parameters."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        shared = nn.Dense(4, name="shared")
        h = shared(h)
        h = shared(jnp.tanh(h))
        return nn.Dense(2, name="head")(h)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, h, skip):
        return nn.Dense(4, name="fc")(jnp.concatenate([h, skip], axis=-1))


class WithSkip(nn.Module):
    """A U-Net-like skip: ``dec`` reads ``enc1``'s output, bypassing ``enc2``."""

    @nn.compact
    def __call__(self, x):
        e1 = nn.Dense(4, name="enc1")(x)
        e2 = nn.Dense(4, name="enc2")(nn.relu(e1))
        d = Decoder(name="dec")(jnp.tanh(e2), e1)
        return nn.Dense(2, name="head")(d)


class AutoEncoder(nn.Module):
    """A submodule with methods other than ``__call__``."""

    def setup(self):
        self.enc = nn.Dense(3)
        self.dec = nn.Dense(4)

    def encode(self, x):
        return jnp.tanh(self.enc(x))

    def decode(self, z):
        return self.dec(z)

    def __call__(self, x):
        return self.decode(self.encode(x))


class WithMethod(nn.Module):
    @nn.compact
    def __call__(self, x):
        ae = AutoEncoder(name="ae")
        z = ae.encode(x)
        y = ae.decode(z * 2.0)
        return nn.Dense(2, name="head")(y)


def keras_block_model(keras: Any) -> Any:
    """A small functional Keras model: stem, BatchNormalization, relu, a layer with
    sublayers (``block``: a(x) -> tanh -> b, plus a residual add) and a head."""

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a = keras.layers.Dense(6, name="a")
            self.b = keras.layers.Dense(6, name="b")

        def call(self, x):
            return self.b(keras.ops.tanh(self.a(x))) + x

    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, name="stem")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Activation("relu", name="act")(h)
    h = Block(name="block")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


# --------------------------------------------------------------------------- coverage models
#
# Small models whose layers the coverage and statistics tests observe.


class CoverageMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(6, name="fc1")(x))
        x = jnp.tanh(nn.Dense(5, name="fc2")(x))
        return nn.Dense(3, name="head")(x)


class CoverageCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3), name="conv1")(x))
        x = nn.relu(nn.Conv(4, (3, 3), strides=2, name="conv2")(x))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(3, name="head")(x)


# --------------------------------------------------------------------------- scanned stacks
#
# Small stacks of scanned layers (5 layers of width 6 by default), shared by the scan,
# interpreter and editing tests: a linen `nn.scan` and an NNX stack made by `nnx.vmap`
# and run by `nnx.scan`, with the same block (``x + mlp(tanh(attn(x)))``).

SCAN_LAYERS = 5
SCAN_WIDTH = 6


class ScanBlock(nn.Module):
    """``(x, _) -> (x + mlp(tanh(attn(x))), None)``: `nn.scan`'s signature."""

    @nn.compact
    def __call__(self, x, _=None):
        a = nn.Dense(SCAN_WIDTH, name="attn")(x)
        return x + nn.Dense(SCAN_WIDTH, name="mlp")(jnp.tanh(a)), None


class ScannedModel(nn.Module):
    """``embed``, `ScanBlock` scanned `SCAN_LAYERS` times as ``layers``, ``head``."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(SCAN_WIDTH, name="embed")(x)
        stack = nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=SCAN_LAYERS
        )
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(3, name="head")(x)


class ScanUnrolled(nn.Module):
    """`ScannedModel` with its blocks applied in a Python loop: the oracle's twin, read
    with Flax's `capture_intermediates` (weights from `scan_unrolled_params`)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(SCAN_WIDTH, name="embed")(x)
        for k in range(SCAN_LAYERS):
            x, _ = ScanBlock(name=f"layers_{k}")(x)
        return nn.Dense(3, name="head")(x)


def scan_unrolled_params(variables: Any) -> Any:
    """A `ScannedModel`'s stacked weights, split per layer for `ScanUnrolled`."""
    p = dict(variables["params"])
    stacked = p.pop("layers")
    for k in range(SCAN_LAYERS):
        p[f"layers_{k}"] = jax.tree_util.tree_map(lambda a, k=k: a[k], stacked)
    return {"params": p}


def nnx_scanned(rngs: Any, layers: int = SCAN_LAYERS) -> Any:
    """The same model in NNX: ``embed``, `layers` stacked blocks (``nnx.vmap``) run by
    ``nnx.scan``, ``head``."""
    from flax import nnx

    class NBlock(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.Linear(SCAN_WIDTH, SCAN_WIDTH, rngs=rngs)
            self.mlp = nnx.Linear(SCAN_WIDTH, SCAN_WIDTH, rngs=rngs)

        def __call__(self, x):
            return x + self.mlp(jnp.tanh(self.attn(x)))

    class NScanned(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NBlock(rngs)

            self.embed = nnx.Linear(4, SCAN_WIDTH, rngs=rngs)
            self.layers = make(rngs)
            self.head = nnx.Linear(SCAN_WIDTH, 3, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(layer, h):
                return layer(h)

            return self.head(body(self.layers, self.embed(x)))

    return NScanned(rngs)


def eager_rows(stacked: Any) -> list[Any]:
    """An NNX module with stacked variables as one eager module per row (an oracle)."""
    from flax import nnx

    graphdef, state = nnx.split(stacked)
    n = jax.tree_util.tree_leaves(state)[0].shape[0]
    return [
        nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, k=k: a[k], state)) for k in range(n)
    ]
