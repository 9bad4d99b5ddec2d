"""The benchmark's models: linen ResNets shaped like torchvision's, and their variables.

A 7x7 stem and a max-pool, four stages of basic or bottleneck blocks (widths 64..512) named
``stage1``..``stage4``, then a dense head. `Prefix` and `Suffix` are hand-written truncated
models with the same parameter names, the references for slices. `TRACES` counts how often
`ResNet.__call__` runs: it runs only while the model is traced, so it counts retraces.
A ResNet's `tag` changes nothing but makes the instance unequal to every other one, so a
"fresh" model (see `fresh`) never benefits from what jaxslice cached for an earlier one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxslice as js

TRACES = {"model": 0}

ARCHS: dict[str, tuple[tuple[int, ...], bool]] = {
    "resnet10": ((1, 1, 1, 1), False),  # --quick's compiled rows (short compiles)
    "resnet18": ((2, 2, 2, 2), False),
    "resnet34": ((3, 4, 6, 3), False),
    "resnet50": ((3, 4, 6, 3), True),
    "resnet101": ((3, 4, 23, 3), True),
    "resnet152": ((3, 8, 36, 3), True),
}


def _norm(train: bool, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, name=name)


def _shortcut(x: Any, y: Any, features: int, strides: int, train: bool) -> Any:
    """The identity, or a strided 1x1 projection when the block changes the shape."""
    if x.shape == y.shape:
        return x
    x = nn.Conv(features, (1, 1), strides=strides, use_bias=False, name="proj")(x)
    return _norm(train, "proj_bn")(x)


class Basic(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False, name="conv1")(x)
        y = nn.relu(_norm(train, "bn1")(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False, name="conv2")(y)
        y = _norm(train, "bn2")(y)
        return nn.relu(_shortcut(x, y, self.features, self.strides, train) + y)


class Bottleneck(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (1, 1), use_bias=False, name="conv1")(x)
        y = nn.relu(_norm(train, "bn1")(y))
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False, name="conv2")(y)
        y = nn.relu(_norm(train, "bn2")(y))
        y = nn.Conv(self.features * 4, (1, 1), use_bias=False, name="conv3")(y)
        y = _norm(train, "bn3")(y)
        return nn.relu(_shortcut(x, y, self.features * 4, self.strides, train) + y)


class Stage(nn.Module):
    features: int
    blocks: int
    strides: int
    bottleneck: bool

    @nn.compact
    def __call__(self, x, train: bool = False):
        block = Bottleneck if self.bottleneck else Basic
        for i in range(self.blocks):
            x = block(self.features, self.strides if i == 0 else 1, name=f"block{i}")(x, train)
        return x


def _stem(x, train):  # called inside a compact method: the layers belong to the caller
    x = nn.Conv(64, (7, 7), strides=2, use_bias=False, name="stem")(x)
    x = nn.relu(_norm(train, "stem_bn")(x))
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


def _stage(i: int, stage_sizes: Sequence[int], bottleneck: bool) -> Stage:
    return Stage(64 * 2**i, stage_sizes[i], 1 if i == 0 else 2, bottleneck, name=f"stage{i + 1}")


def _head(x, num_classes):
    return nn.Dense(num_classes, name="head")(jnp.mean(x, axis=(1, 2)))


class ResNet(nn.Module):
    """The full model. `tag` changes nothing; a new tag makes an instance unequal to others."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
    num_classes: int = 1000
    tag: int = 0

    @nn.compact
    def __call__(self, x, train: bool = False):
        TRACES["model"] += 1
        x = _stem(x, train)
        for i in range(len(self.stage_sizes)):
            x = _stage(i, self.stage_sizes, self.bottleneck)(x, train)
        return _head(x, self.num_classes)


class Prefix(nn.Module):
    """Hand-written truncated model: stem and stages 1..upto, same names as ResNet."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
    upto: int = 2

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = _stem(x, train)
        for i in range(self.upto):
            x = _stage(i, self.stage_sizes, self.bottleneck)(x, train)
        return x


class Suffix(nn.Module):
    """Hand-written tail: stages start..4 and the head, taking stage `start`'s input."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
    num_classes: int = 1000
    start: int = 3

    @nn.compact
    def __call__(self, x, train: bool = False):
        for i in range(self.start - 1, len(self.stage_sizes)):
            x = _stage(i, self.stage_sizes, self.bottleneck)(x, train)
        return _head(x, self.num_classes)


def resnet(arch: str, tag: int = 0) -> ResNet:
    sizes, bottleneck = ARCHS[arch]
    return ResNet(sizes, bottleneck, 1000, tag)


_TAGS = itertools.count(1)


def fresh(arch: str) -> ResNet:
    """A model no earlier build has seen: a new tag, and jaxslice's caches emptied when the
    installed version offers `js.clear_caches`. Call it outside timed regions."""
    clear = getattr(js, "clear_caches", None)
    if clear is not None:
        clear()
    return resnet(arch, next(_TAGS))


def abstract_model(arch: str, size: int = 64) -> tuple[Any, Any]:
    """Abstract variables and a batch-1 input: building costs the same as with real data."""
    x = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    return jax.eval_shape(resnet(arch).init, jax.random.key(0), x), x


def _fill(rng: np.random.Generator, path: Any, s: Any) -> Any:
    name = str(getattr(path[-1], "key", path[-1]))
    if name == "kernel":
        value = rng.standard_normal(s.shape, np.float32) / np.sqrt(np.prod(s.shape[:-1]))
    elif name in ("scale", "var"):
        value = np.ones(s.shape, np.float32)
    else:
        value = np.zeros(s.shape, np.float32)
    return jnp.asarray(value, s.dtype)


def init_variables(model: nn.Module, x: Any, seed: int = 0) -> Any:
    """Variables with the shapes of ``model.init``, filled with numpy (a jitted or eager
    ``init`` of a ResNet-50 takes seconds on CPU): kernels ~ N(0, 1/fan_in), BatchNorm
    scales and running variances 1, the rest 0."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(
        model.init, jax.random.key(seed), jax.ShapeDtypeStruct(x.shape, x.dtype)
    )
    return jax.tree_util.tree_map_with_path(lambda p, s: _fill(rng, p, s), shapes)


class TorchNamedResNet(nn.Module):
    """A ResNet whose top-level modules carry torchvision's names, flattened: ``conv1``,
    ``bn1``, blocks ``layer1_0``..``layer4_2`` (torchvision's ``layer2.3`` is ``layer2_3``)
    and ``fc``. With `upto` = (stage, block) it stops after that block: the hand-written
    truncated model, with the same variable names."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
    num_classes: int = 1000
    upto: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(64, (7, 7), strides=2, use_bias=False, name="conv1")(x)
        x = nn.relu(_norm(train, "bn1")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        block = Bottleneck if self.bottleneck else Basic
        for i, n in enumerate(self.stage_sizes):
            for j in range(n):
                strides = 2 if i > 0 and j == 0 else 1
                x = block(64 * 2**i, strides, name=f"layer{i + 1}_{j}")(x, train)
                if self.upto == (i + 1, j):
                    return x
        return nn.Dense(self.num_classes, name="fc")(jnp.mean(x, axis=(1, 2)))


def torch_named(arch: str, upto: tuple[int, int] | None = None) -> TorchNamedResNet:
    """`arch` (a key of ARCHS) with torchvision's module names, whole or up to `upto`."""
    sizes, bottleneck = ARCHS[arch]
    return TorchNamedResNet(sizes, bottleneck, 1000, upto)


class Mlp(nn.Module):
    """A tiny MLP (``fc1``, ``fc2``, ``fc3``); with `upto` = 2 it stops after ``fc2``."""

    upto: int = 3

    @nn.compact
    def __call__(self, x):
        for i, width in enumerate((64, 64, 10)[: self.upto]):
            x = nn.Dense(width, name=f"fc{i + 1}")(nn.relu(x) if i else x)
        return x
