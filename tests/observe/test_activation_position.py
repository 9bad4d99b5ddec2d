"""``position="activation"``: the activation applied to a layer's output, taken whole.

An activation is often several equations (GELU, ``h * sigmoid(h)``, ``relu(2 * h)``);
what is observed is its result, never one of its steps, and never a step of the next
module (a BatchNorm after a convolution). Oracles: the layer applied by hand (its own
Flax, Haiku or Keras module on its parameters) and the activation applied to that in
NumPy or JAX outside jaxslice; statistics in NumPy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import import_keras, random_variables

X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)


def _mish(h):
    return h * jnp.tanh(jax.nn.softplus(h))


ACTIVATIONS = {
    "relu": nn.relu,
    "gelu (tanh form)": nn.gelu,
    "gelu (erf form)": lambda h: nn.gelu(h, approximate=False),
    "h * sigmoid(h)": lambda h: h * jax.nn.sigmoid(h),
    "mish": _mish,
    "relu(2 h)": lambda h: nn.relu(2.0 * h),
    "where(h > 0, h, 0.1 h)": lambda h: jnp.where(h > 0, h, 0.1 * h),
}


class PReLU(nn.Module):
    """Dense, then a PReLU written in the caller's own code (a learned slope)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="fc")(x)
        slope = self.param("slope", lambda key, shape: jnp.full(shape, 0.25), (8,))
        h = jnp.maximum(h, 0.0) + slope * jnp.minimum(h, 0.0)
        return nn.Dense(2, name="head")(h)


def _assert_observed(stats, name, want):
    got = stats.result()[name]
    want = np.asarray(want, np.float64).reshape(-1, want.shape[-1])
    np.testing.assert_allclose(got["mean"], want.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["min"], want.min(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["max"], want.max(0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_an_activation_of_several_equations_is_observed_whole(name):
    act = ACTIVATIONS[name]
    model = nn.Sequential([nn.Dense(8), act, nn.Dense(2)])
    variables = random_variables(model, X)
    stats = js.ActivationStats(
        model, variables, X, names=["layers_0"], per="channel", position="activation"
    )
    stats.update(X)
    h = nn.Dense(8).apply({"params": variables["params"]["layers_0"]}, X)
    _assert_observed(stats, "layers_0", act(h))


def test_a_learned_slope_in_the_callers_code_is_part_of_the_activation():
    model = PReLU()
    variables = random_variables(model, X)
    tracker = js.coverage.Tracker(
        model, variables, X, layers=["fc"], criteria=[js.coverage.NC(0.0)], position="activation"
    )
    tracker.profile([X])
    params = variables["params"]
    h = nn.Dense(8).apply({"params": params["fc"]}, X)
    want = np.maximum(h, 0) + np.asarray(params["slope"]) * np.minimum(h, 0)
    np.testing.assert_allclose(tracker.profile_stats["fc"]["low"], want.min(0), rtol=1e-6)
    np.testing.assert_allclose(tracker.profile_stats["fc"]["high"], want.max(0), rtol=1e-6)


def test_a_batchnorm_after_a_haiku_conv_is_not_its_activation():
    hk = pytest.importorskip("haiku")

    def forward(x, is_training):
        h = hk.Conv2D(4, 3, name="conv")(x)
        h = hk.BatchNorm(True, True, 0.9, name="bn")(h, is_training)
        return hk.Linear(2, name="head")(jax.nn.relu(h).mean((1, 2)))

    f = hk.transform_with_state(forward)
    x = np.random.default_rng(1).normal(size=(4, 6, 6, 3)).astype(np.float32)
    params, state = f.init(jax.random.key(0), x, True)
    state = jax.tree_util.tree_map(lambda a: a + 5.0, state)  # a running mean far from 0
    stats = js.ActivationStats(
        f, params, state, x, is_training=False, names=["conv", "bn"], per="channel",
        position="activation",
    )  # fmt: skip
    stats.update(x)
    conv = hk.transform(lambda x: hk.Conv2D(4, 3, name="conv")(x)).apply(params, None, x)
    # Nothing is applied to the conv's output before the BatchNorm module: the output.
    _assert_observed(stats, "conv", conv)
    mean, var = state["bn/~/mean_ema"]["average"], state["bn/~/var_ema"]["average"]
    p = params["bn"]
    normalised = (conv - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["offset"]
    _assert_observed(stats, "bn", jax.nn.relu(normalised))


def test_a_keras_activation_layer_is_the_activation_of_the_layer_before():
    keras = import_keras()
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(8, name="fc"),
        keras.layers.Activation("gelu", name="act"),
        keras.layers.Dense(2, name="head"),
    ])  # fmt: skip
    stats = js.ActivationStats(model, X, names=["fc"], per="channel", position="activation")
    stats.update(X)
    h = np.asarray(model.get_layer("fc")(X))
    _assert_observed(stats, "fc", np.asarray(keras.activations.gelu(h)))


def test_functional_dropout_after_the_activation_is_not_part_of_it():
    hk = pytest.importorskip("haiku")

    def forward(x):
        h = jax.nn.relu(hk.Linear(8, name="fc")(x))
        return hk.Linear(2, name="head")(hk.dropout(hk.next_rng_key(), 0.5, h))

    f = hk.transform(forward)
    params = f.init(jax.random.key(0), X)
    stats = js.ActivationStats(
        f, params, X, rngs=jax.random.key(1), names=["fc"], per="channel", position="activation"
    )
    stats.update(X)
    h = hk.transform(lambda x: hk.Linear(8, name="fc")(x)).apply(params, None, X)
    _assert_observed(stats, "fc", jax.nn.relu(h))
