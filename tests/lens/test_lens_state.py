"""A lens on a model in training mode behaves as the model does: each call draws new
random numbers and updates the state the model holds (NNX, Keras), and a linen or Haiku
lens takes this call's random keys (``rngs=``).

Oracles: the model's own calls from the same state (an `nnx.clone` of an NNX model, a
Keras model's variables restored between the two runs) and linen's and Haiku's `apply`
with the same key.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, import_keras, random_input

X = random_input(40, (6, 4))


# --------------------------------------------------------------------------- NNX


def _nnx_model() -> Any:
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs: Any):
            self.fc = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.head(self.drop(jax.nn.relu(self.bn(self.fc(x)))))

    model = Net(nnx.Rngs(0, dropout=1))
    model.train()
    return model


def _state(model: Any) -> Any:
    from flax import nnx

    def host(x: Any) -> Any:
        key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(x) if key else x)

    return jax.tree_util.tree_map(host, nnx.to_pure_dict(nnx.state(model)))


def test_an_nnx_lens_in_training_mode_runs_as_the_model_does_call_after_call():
    from flax import nnx

    model = _nnx_model()
    twin = nnx.clone(model)
    lens = js.lens(model, X)
    outs = [lens(X), lens(X, read=["bn"])[0], lens(X)]
    wants = [twin(X) for _ in outs]
    for out, want in zip(outs, wants, strict=True):
        assert_trees_all_close(out, want)
    assert not np.allclose(outs[0], outs[2])  # a new dropout mask each call
    # batch statistics and the dropout stream's count, as the model's own calls left them
    assert_trees_all_close(_state(model), _state(twin))


def test_every_intermediate_of_an_nnx_model_in_training_mode_updates_it_as_its_call_does():
    from flax import nnx

    model = _nnx_model()
    twin = nnx.clone(model)
    first = js.intermediates(model, X, names="all")
    second = js.intermediates(model, X, names="all")
    assert_trees_all_close(first["head"], twin(X))
    assert_trees_all_close(second["head"], twin(X))
    assert_trees_all_close(_state(model), _state(twin))


def test_an_nnx_lens_leaves_the_state_as_it_was_in_transforms_sweeps_and_apply():
    from flax import nnx

    model = _nnx_model()
    before = _state(model)
    lens = js.lens(model, X)
    v = random_input(41, (8,))
    jax.jit(lambda x: lens(x))(X)
    jax.grad(lambda d: jnp.sum(lens(X, add={"fc": d})))(v)
    lens.sweep(X, add={"fc": jnp.stack([v, 2 * v])})
    lens.apply(nnx.state(model), X)
    assert_trees_all_close(_state(model), before)
    # no traced value was left in the model: its own call still runs
    twin = nnx.clone(model)
    assert_trees_all_close(model(X), twin(X))


# --------------------------------------------------------------------------- linen


def test_a_linen_lens_takes_this_calls_random_keys():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: Any, train: bool = False) -> Any:
            h = nn.Dropout(0.5, deterministic=not train, name="drop")(nn.Dense(8, name="fc")(x))
            return nn.Dense(3, name="head")(h)

    model = Net()
    variables = model.init(jax.random.key(0), X)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    lens = js.lens(model, variables, X, train=True, rngs={"dropout": k1})

    def want(key: Any) -> Any:
        return model.apply(variables, X, train=True, rngs={"dropout": key})

    assert_trees_all_close(lens(X), want(k1))
    assert_trees_all_close(lens(X, rngs={"dropout": k2}), want(k2))
    assert_trees_all_close(lens.apply(variables, X, rngs={"dropout": k2}), want(k2))
    assert not np.allclose(want(k1), want(k2))


def test_a_haiku_lens_takes_this_calls_key():
    hk = pytest.importorskip("haiku")

    def net(x: Any) -> Any:
        h = hk.Linear(8, name="fc")(x)
        return hk.Linear(3, name="head")(hk.dropout(hk.next_rng_key(), 0.5, h))

    f = hk.transform(net)
    params = f.init(jax.random.key(0), X)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    lens = js.lens(f, params, X, rngs=k1)
    assert_trees_all_close(lens(X), f.apply(params, k1, X))
    assert_trees_all_close(lens(X, rngs=k2), f.apply(params, k2, X))


# --------------------------------------------------------------------------- Keras


def test_a_keras_lens_in_training_mode_runs_as_the_model_does():
    keras = import_keras()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, name="fc")(inputs))
    outputs = keras.layers.Dense(3, name="head")(keras.layers.Dropout(0.5, name="drop")(h))
    model = keras.Model(inputs, outputs)
    # Made in training mode: the lens reads the moving statistics too (only the state
    # update reads them there).
    lens = js.lens(model, X, training=True)

    def values() -> list[Any]:
        return [np.asarray(v.value) for v in model.variables]

    start = values()
    out = [lens(X), lens(X)]
    after = values()
    for v, value in zip(model.variables, start, strict=True):
        v.assign(value)
    want = [np.asarray(model(X, training=True)) for _ in out]
    for o, w in zip(out, want, strict=True):
        assert_trees_all_close(o, w)
    assert not np.allclose(out[0], out[1])  # the seed state moved on
    assert_trees_all_close(after, values())
    # In inference mode nothing changes.
    now = values()
    assert_trees_all_close(lens(X, training=False), np.asarray(model(X, training=False)))
    assert_trees_all_close(values(), now)
