"""jaxslice quickstart: feature extraction and a trainable head from a small ResNet.

Builds a tiny ResNet-style Flax linen CNN, lists its module boundaries, slices out two
intermediate feature maps, checks them against Flax's own `capture_intermediates`, and
slices the head so it can run (or be fine-tuned) on the extracted features.

Run it with ``python examples/quickstart.py``; it needs no downloads and runs on a CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxslice as js


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a (projected) shortcut."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        conv = functools.partial(nn.Conv, self.features, use_bias=False)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train)
        y = conv((3, 3), strides=self.strides, name="conv1")(x)
        y = nn.relu(norm(name="bn1")(y))
        y = conv((3, 3), name="conv2")(y)
        y = norm(name="bn2")(y)
        if x.shape != y.shape:
            x = conv((1, 1), strides=self.strides, name="proj")(x)
            x = norm(name="proj_bn")(x)
        return nn.relu(x + y)


class Stage(nn.Module):
    """A stack of residual blocks; the first one may downsample."""

    features: int
    blocks: int = 1
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        for i in range(self.blocks):
            strides = self.strides if i == 0 else 1
            x = ResidualBlock(self.features, strides, name=f"block{i}")(x, train)
        return x


class Head(nn.Module):
    """Global average pooling and a linear classifier."""

    num_classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes, name="fc")(jnp.mean(x, axis=(1, 2)))


class TinyResNet(nn.Module):
    widths: Sequence[int] = (8, 16, 32)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.widths[0], (3, 3), use_bias=False, name="stem")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, name="stem_bn")(x))
        for i, width in enumerate(self.widths):
            x = Stage(width, blocks=2, strides=1 if i == 0 else 2, name=f"stage{i + 1}")(x, train)
        return Head(self.num_classes, name="head")(x)


def main() -> None:
    model = TinyResNet()
    # Keys of the "rbg" kind compile much faster on CPU than the default kind.
    data_key, init_key = jax.random.split(jax.random.key(0, impl="rbg"))
    x = jax.random.normal(data_key, (4, 32, 32, 3))  # a batch of 4 RGB 32x32 images
    variables = jax.jit(model.init)(init_key, x)  # {"params": ..., "batch_stats": ...}

    # 1. Every module call the model makes, in the order the calls run.
    print(js.boundaries(model, variables, x))
    print()

    # 2. Two intermediate feature maps from one compiled function that stops at the last
    #    one requested: stage3 and the head are never computed.
    features = js.slice(model, variables, x, end={"stage1": "stage1", "stage2": "stage2"})
    feats = features(x)
    for key, value in feats.items():
        print(f"{key}: {value.shape} {value.dtype}")

    # 3. The same values from Flax's `capture_intermediates`, which runs the whole model.
    capture = functools.partial(model.apply, capture_intermediates=True, mutable=["intermediates"])
    logits, state = jax.jit(capture)(variables, x)
    captured = state["intermediates"]
    diff = max(float(jnp.max(jnp.abs(feats[k] - captured[k]["__call__"][0]))) for k in feats)
    print(f"max |jaxslice - capture_intermediates| = {diff:.1e}")
    assert diff < 1e-5, diff

    # 4. The rest of the network: from stage3's input to the model's output. It owns only
    #    the variables it reads, so it can be fine-tuned on cached stage2 features.
    head = js.slice(model, variables, x, start="stage3", end=None)
    print()
    print(head)
    print("head variables:", {c: sorted(v) for c, v in head.variables.items()})
    head_logits = head(feats["stage2"])
    diff = float(jnp.max(jnp.abs(head_logits - logits)))
    print(f"head(stage2 features): {head_logits.shape}, max |head - full model| = {diff:.1e}")
    assert diff < 1e-5, diff

    # A slice with a `start` takes other batch sizes; it is traced once per new size.
    print("head on a batch of 2:", head(feats["stage2"][:2]).shape)


if __name__ == "__main__":
    main()
