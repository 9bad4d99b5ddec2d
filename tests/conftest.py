"""The session fixtures of the jaxslice test suite (pytest applies them in every folder).

Every zoo model is tiny and built once per test session; JAX compilation dominates the
suite's run time, so tests share these fixtures instead of re-creating models. The models
themselves are in `helpers.models`, the oracles that record them in `helpers.oracles`.
"""

from __future__ import annotations

import jax
import pytest

from helpers.models import (
    TinyResNet,
    WithIdentity,
    WithMethod,
    WithShared,
    WithSkip,
    WithTuple,
    WithUnused,
)
from helpers.oracles import Zoo, make_zoo, random_input


def _dense_input(seed: int, shape=(2, 4)) -> jax.Array:
    return random_input(seed, shape)


@pytest.fixture(scope="session")
def resnet() -> Zoo:
    return make_zoo(TinyResNet(), random_input(100, (2, 8, 8, 3)))


@pytest.fixture(scope="session")
def identity_zoo() -> Zoo:
    return make_zoo(WithIdentity(), _dense_input(1), seed=1)


@pytest.fixture(scope="session")
def tuple_zoo() -> Zoo:
    return make_zoo(WithTuple(), _dense_input(2), seed=2)


@pytest.fixture(scope="session")
def unused_zoo() -> Zoo:
    return make_zoo(WithUnused(), _dense_input(3), seed=3)


@pytest.fixture(scope="session")
def shared_zoo() -> Zoo:
    return make_zoo(WithShared(), _dense_input(4), seed=4)


@pytest.fixture(scope="session")
def skip_zoo() -> Zoo:
    return make_zoo(WithSkip(), _dense_input(5), seed=5)


@pytest.fixture(scope="session")
def method_zoo() -> Zoo:
    return make_zoo(WithMethod(), _dense_input(6), seed=6)
