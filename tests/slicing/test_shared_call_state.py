"""State of a module called twice (a shared block with a BatchNorm, train mode).

Each call updates the statistics the one before it left. A slice returns them as they
stand after the calls it runs, and its first call reads them from the variables it is
given, so slicing the calls apart and merging in turn gives the model's own state.

Oracles: the block applied by hand with its own variables (`Blk().apply`), the model's
own `apply`, and for Keras the model's own layers called one after the other.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, import_keras


class Blk(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        y = nn.BatchNorm(use_running_average=not train, momentum=0.5, name="bn")(
            nn.Dense(4, name="d")(x)
        )
        return x + nn.relu(y)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.Dense(4, name="stem")(x)
        blk = Blk(name="blk")
        return nn.Dense(2, name="head")(blk(blk(h, train), train))


@pytest.fixture(scope="module")
def shared():
    x = jax.random.normal(jax.random.key(1), (6, 3))
    model = Net()
    variables = model.init(jax.random.key(0), x, train=False)
    p = variables["params"]
    h0 = x @ p["stem"]["kernel"] + p["stem"]["bias"]
    blk_vars = {"params": p["blk"], "batch_stats": variables["batch_stats"]["blk"]}
    return model, variables, x, h0, blk_vars


def test_a_slice_ending_at_the_first_call_returns_the_state_after_it(shared):
    model, variables, x, h0, blk_vars = shared
    out0, once = Blk().apply(blk_vars, h0, mutable=["batch_stats"])
    sub = js.slice(model, variables, x, start="blk@0", end="blk@0", mutable=["batch_stats"])
    out, state = sub.apply(sub.variables, h0, mutable=["batch_stats"])
    assert_trees_all_close(out, out0)
    assert_trees_all_close(state, {"batch_stats": {"blk": once["batch_stats"]}})


def test_a_slice_from_the_second_call_updates_the_state_it_is_given(shared):
    model, variables, x, h0, blk_vars = shared
    h1, _ = Blk().apply(blk_vars, h0, mutable=["batch_stats"])
    out1, twice = Blk().apply(blk_vars, h1, mutable=["batch_stats"])
    p = variables["params"]
    sub = js.slice(model, variables, x, start="blk@1", mutable=["batch_stats"])
    out, state = sub.apply(sub.variables, h1, mutable=["batch_stats"])
    assert_trees_all_close(out, out1 @ p["head"]["kernel"] + p["head"]["bias"])
    assert_trees_all_close(state, {"batch_stats": {"blk": twice["batch_stats"]}})


def test_slicing_the_calls_apart_and_merging_gives_the_model_state(shared):
    model, variables, x, h0, _ = shared
    y, full_state = model.apply(variables, x, mutable=["batch_stats"])
    first = js.slice(model, variables, x, end="blk@0", mutable=["batch_stats"])
    h1, state = first.apply(first.variables, x, mutable=["batch_stats"])
    after_first = first.merge(variables, state)
    second = js.slice(model, variables, x, start="blk@1", mutable=["batch_stats"])
    out, state = second.apply(second.extract(after_first), h1, mutable=["batch_stats"])
    assert_trees_all_close(out, y)
    assert_trees_all_close(
        second.merge(after_first, state)["batch_stats"], full_state["batch_stats"]
    )


def test_a_slice_from_the_second_call_without_mutable_raises(shared):
    model, variables, x, h0, blk_vars = shared
    sub = js.slice(model, variables, x, start="blk@1", mutable=["batch_stats"])
    with pytest.raises(js.SliceError, match="pass mutable"):
        sub.apply(sub.variables, h0)


def test_keras_shared_block_sliced_from_its_second_call():
    keras = import_keras()

    class KBlk(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.d = keras.layers.Dense(4, name="d")
            self.bn = keras.layers.BatchNormalization(momentum=0.5, name="bn")

        def call(self, x, training=None):
            return x + keras.ops.relu(self.bn(self.d(x), training=training))

    class KNet(keras.Model):
        def __init__(self):
            super().__init__()
            self.stem = keras.layers.Dense(4, name="stem")
            self.blk = KBlk(name="blk")
            self.head = keras.layers.Dense(2, name="head")

        def call(self, x, training=None):
            h = self.blk(self.stem(x), training=training)
            return self.head(self.blk(h, training=training))

    x = np.asarray(jax.random.normal(jax.random.key(1), (6, 3)))
    oracle, model = KNet(), KNet()
    oracle(x)
    model(x)
    for mine, theirs in zip(model.weights, oracle.weights, strict=True):
        mine.assign(theirs.value)
    sub = js.slice(model, x, start="blk@1", training=True, mutable=["non_trainable"])
    h = oracle.blk(oracle.stem(x), training=True)  # the oracle's first call
    expected = oracle.head(oracle.blk(h, training=True))  # and its second
    model.blk(model.stem(x), training=True)  # the model's first call, by hand
    out, updates = sub(np.asarray(h), mutable=["non_trainable"])
    assert_trees_all_close(np.asarray(out), np.asarray(expected))
    sub.merge(model, updates)
    for name in ("moving_mean", "moving_variance"):
        got, want = getattr(model.blk.bn, name), getattr(oracle.blk.bn, name)
        assert_trees_all_close(jnp.asarray(got.value), jnp.asarray(want.value))
