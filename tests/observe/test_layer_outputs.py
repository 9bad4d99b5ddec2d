"""What the observers read from a layer's output, whatever its form: a layer returning
several arrays (a block's ``(h, aux)``) is observed at its first, as a lens reads it, and
the layers after it are read from their own outputs; a layer returning no array is named;
a layer whose leading axis is not the batch (an Equinox module given one example, a layer
inside `nn.vmap`) is named, or left out of the default layers; one value per input is one
channel; statistics stay finite for huge values; an empty batch adds nothing.

Oracles: the layers applied by hand (their own Flax modules on their parameters) and
NumPy statistics.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import random_variables

X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)


class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(6, name="d")(x)
        return h, jnp.tanh(h[:, :3])  # (hidden, aux)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        a, b = Two(name="two")(x)
        return nn.Dense(2, name="head")(a) + b[:, :2]


def _by_hand(variables):
    p = variables["params"]
    h = nn.Dense(6).apply({"params": p["two"]["d"]}, X)
    return {"two": np.asarray(h), "head": np.asarray(nn.Dense(2).apply({"params": p["head"]}, h))}


def test_a_layer_returning_a_tuple_is_observed_at_its_first_array():
    model = Net()
    variables = random_variables(model, X)
    want = _by_hand(variables)
    stats = js.ActivationStats(model, variables, X, names=["two", "head"], per="channel")
    stats.update(X)
    tracker = js.coverage.Tracker(
        model, variables, X, layers=["two", "head"], criteria=[js.coverage.KMNC(2)]
    )
    assert tracker.sizes == [6, 2]
    tracker.profile([X])
    for name in ("two", "head"):
        got = stats.result()[name]
        np.testing.assert_allclose(got["mean"], want[name].mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["max"], want[name].max(0), rtol=1e-6)
        np.testing.assert_allclose(
            tracker.profile_stats[name]["high"], want[name].max(0), rtol=1e-6
        )
        np.testing.assert_allclose(tracker.profile_stats[name]["low"], want[name].min(0), rtol=1e-6)


class Meta(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.param("p", nn.initializers.zeros, (1,))
        return 3  # a Python value, no array


class WithMeta(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(x) * Meta(name="meta")(x)


def test_a_layer_returning_no_array_is_named():
    model = WithMeta()
    variables = random_variables(model, X)
    for make in (
        lambda: js.ActivationStats(model, variables, X, names=["meta", "head"]),
        lambda: js.coverage.Tracker(model, variables, X, layers=["meta", "head"]),
    ):
        with pytest.raises(js.InvalidSpecError, match="'meta'"):
            make()


class Score(nn.Module):
    """A layer with one value per input: its output is (batch,)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, name="d")(x)[:, 0]


class Scored(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Score(name="score")(nn.relu(nn.Dense(5, name="fc")(x)))


def test_a_layer_with_one_value_per_input_is_one_channel():
    model = Scored()
    variables = random_variables(model, X)
    stats = js.ActivationStats(model, variables, X, names=["score"], per="channel")
    for batch in (X[:5], X[5:]):  # two sizes
        stats.update(batch)
    p = variables["params"]
    h = nn.relu(nn.Dense(5).apply({"params": p["fc"]}, X))
    want = np.asarray(nn.Dense(1).apply({"params": p["score"]["d"]}, h))  # (8, 1)
    got = stats.result()["score"]
    assert got["count"] == len(X)
    np.testing.assert_allclose(got["mean"], want.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["std"], want.std(0), rtol=1e-4, atol=1e-6)


class Huge(nn.Module):
    @nn.compact
    def __call__(self, x):
        return 0.0 * nn.Dense(3, name="d")(x) + 1e20  # 1e20 is finite in float32


class HugeNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Huge(name="huge")(x)


def test_statistics_of_huge_values_are_finite():
    # A constant 1e20: its square overflows, and the variance is 0.
    model = HugeNet()
    variables = random_variables(model, X)
    stats = js.ActivationStats(model, variables, X, names=["huge"], per="channel")
    stats.update(X[:3])
    stats.update(X[3:])
    got = stats.result()["huge"]
    np.testing.assert_array_equal(got["std"], np.zeros(3, np.float32))
    np.testing.assert_allclose(got["mean"], np.full(3, 1e20, np.float32), rtol=1e-6)


def test_an_empty_batch_adds_nothing():
    model = Scored()
    variables = random_variables(model, X)
    stats = js.ActivationStats(model, variables, X, names=["fc"])
    stats.update(X)
    before = stats.result()["fc"]
    stats.update(X[:0])
    assert stats.result()["fc"] == before


class Grouped(nn.Module):
    """A layer inside `nn.vmap` over groups of the batch: its leading axis is the group."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        vmapped = nn.vmap(
            nn.Dense, in_axes=0, out_axes=0, variable_axes={"params": 0},
            split_rngs={"params": True},
        )  # fmt: skip
        h = vmapped(4, name="grouped")(h.reshape(2, -1, 4))
        return nn.Dense(3, name="head")(h.reshape(-1, 4))


def test_a_layer_whose_leading_axis_is_not_the_batch_is_named_or_left_out():
    model = Grouped()
    variables = random_variables(model, X)
    # By default only the layers batched like the inputs are observed...
    assert js.ActivationStats(model, variables, X).names == ["embed", "head"]
    # ...and one named is refused, saying which axis.
    with pytest.raises(js.InputMismatchError, match=r"'grouped' outputs \[2, 4, 4\]"):
        js.coverage.Tracker(model, variables, X, layers=["grouped"])


def test_an_equinox_module_given_one_example_says_to_vmap_it():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    with pytest.raises(js.InputMismatchError, match="jax.vmap"):
        js.coverage.Tracker(mlp, X[0])
    # The vmapping function is observed per input (oracle: the first layer by hand).
    stats = js.ActivationStats(lambda m, x: jax.vmap(m)(x), mlp, X, per="channel")
    stats.update(X)
    first = stats.names[0]
    want = np.asarray(jax.vmap(mlp.layers[0])(X))
    np.testing.assert_allclose(stats.result()[first]["mean"], want.mean(0), rtol=1e-5, atol=1e-6)


class Spectrum(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = Complexify(name="cx")(x)
        return nn.Dense(2, name="head")(jnp.abs(h))


class Complexify(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="d")(x) * (1 + 1j)


def test_a_layer_with_complex_values_is_named():
    model = Spectrum()
    variables = random_variables(model, X)
    with pytest.raises(js.InvalidSpecError, match="complex values.*'cx'"):
        js.ActivationStats(model, variables, X, names=["cx", "head"])
