"""Keras 3 models (JAX backend) as a model kind: layers are the boundaries.

Oracles come from Keras itself: functional sub-models built from a layer's output,
eager calls of the layers, `stateless_call` of the full model (values, gradients and
the moving statistics it returns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import keras_block_model
from helpers.oracles import import_keras


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


X = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")


@pytest.fixture(scope="module")
def keras():
    return import_keras()


def sub_model(keras, model, name):
    """Keras's own feature extractor: a functional model ending at a layer's output."""
    return keras.Model(model.inputs, model.get_layer(name).output)


def test_layers_are_the_boundaries_with_their_classes(keras):
    model = keras_block_model(keras)
    table = js.boundaries(model, X)
    assert table.names() == ["stem", "bn", "act", "block", "block/a", "block/b", "head"]
    assert [b.module_type for b in table][:3] == ["Dense", "BatchNormalization", "Activation"]
    assert table[0].param_count == model.get_layer("stem").count_params()
    assert table[3].param_count == model.get_layer("block").count_params()


@pytest.mark.parametrize("name", ["stem", "bn", "block", "head"])
def test_prefix_slices_equal_keras_sub_models(keras, name):
    model = keras_block_model(keras)
    sub = js.slice(model, X, end=name)
    close(sub(X), sub_model(keras, model, name)([X]))


def test_a_slice_holds_only_its_layers_variables_keyed_by_path(keras):
    model = keras_block_model(keras)
    head = js.slice(model, X, start="block")
    assert jax.tree.map(jnp.shape, head.variables) == {
        "trainable": {
            "block": {"a": {"bias": (6,), "kernel": (6, 6)}, "b": {"bias": (6,), "kernel": (6, 6)}},
            "head": {"bias": (2,), "kernel": (6, 2)},
        }
    }
    feats = sub_model(keras, model, "act")([X])
    close(head(feats), model(X))
    inner = js.slice(model, X, start="block/b", end="block/b")
    block = model.get_layer("block")
    close(inner(feats), block.b(feats))


def test_gradients_equal_those_of_stateless_call(keras):
    model = keras_block_model(keras)
    head = js.slice(model, X, start="block")
    feats = sub_model(keras, model, "act")([X])
    got = jax.grad(lambda v: jnp.sum(head.apply(v, feats) ** 2))(head.variables)

    def full(trainable):
        fixed = [v.value for v in model.non_trainable_variables]
        return jnp.sum(model.stateless_call(trainable, fixed, X)[0] ** 2)

    want = jax.grad(full)([v.value for v in model.trainable_variables])
    by_path = {v.path: g for v, g in zip(model.trainable_variables, want, strict=True)}
    close(got["trainable"]["head"]["kernel"], by_path["head/kernel"])
    close(got["trainable"]["block"]["a"]["kernel"], by_path["block/a/kernel"])


def test_training_mode_returns_moving_statistics_only_when_asked(keras):
    model = keras_block_model(keras)
    train = js.slice(model, X, end="bn", training=True)
    with pytest.raises(js.SliceError, match="non_trainable"):
        train(X)  # the moving statistics change: never silently dropped
    train = js.slice(model, X, end="bn", training=True, mutable=["non_trainable"])
    out, updates = train(X, mutable=["non_trainable"])
    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]
    _, new_fixed = model.stateless_call(trainable, fixed, X, training=True)
    moved = {v.path: x for v, x in zip(model.non_trainable_variables, new_fixed, strict=True)}
    close(updates["non_trainable"]["bn"]["moving_mean"], moved["bn/moving_mean"])
    assert not np.allclose(moved["bn/moving_mean"], model.get_layer("bn").moving_mean.value)
    close(out, sub_model(keras, model, "bn")([X], training=True))


def test_merge_assigns_trained_values_to_the_model(keras):
    model = keras_block_model(keras)
    head = js.slice(model, X, start="head")
    stem_kernel = model.get_layer("stem").kernel.value
    trained = jax.tree.map(lambda a: a + 1.0, head.variables)
    assert head.merge(model, trained) is model
    close(model.get_layer("head").kernel.value, trained["trainable"]["head"]["kernel"])
    assert model.get_layer("stem").kernel.value is stem_kernel  # untouched
    with pytest.raises(js.VariablesMismatchError):
        head.merge(model, {"trainable": {"head": {"kernel": jnp.ones((3, 3))}}})


def test_attention_is_a_layer_and_starts_follow_the_call(keras):
    class Encoder(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attn = keras.layers.MultiHeadAttention(2, 4, name="attn")
            self.ffn = keras.layers.Dense(8, name="ffn")
            self.drop = keras.layers.Dropout(0.2, name="drop")

        def call(self, x, padding_mask=None):
            h = x + self.attn(x, x, attention_mask=padding_mask)
            return self.drop(self.ffn(h))

    keras.utils.set_random_seed(1)
    tokens = keras.Input((5, 8))
    mask = keras.Input((5, 5), dtype="bool")
    enc = Encoder(name="encoder")
    model = keras.Model([tokens, mask], enc(tokens, padding_mask=mask))
    x = np.random.default_rng(1).normal(size=(2, 5, 8)).astype("float32")
    m = np.tril(np.ones((2, 5, 5), bool))
    names = js.boundaries(model, [x, m]).names()
    assert names[:2] == ["encoder", "encoder/attn"]
    assert not any("->" in n for n in names)  # no einsum equations as boundaries
    table = js.boundaries(model, [x, m])
    assert "encoder/drop" in table.names()
    for b in table:  # parameters as Keras counts them (a Dropout's seed state is none)
        assert b.param_count == _layer_at(model, b.name).count_params(), b.name
    sub = js.slice(model, [x, m], start="encoder", end="encoder")
    close(sub(x, padding_mask=m), enc(x, padding_mask=m))  # the call's own order


def _layer_at(model, name):
    """The layer at a boundary's path, found by layer names from the model down."""
    layer = model
    for part in name.split("/"):
        (layer,) = [c for c in layer._flatten_layers(include_self=False) if c.name == part]
    return layer


def test_a_shared_layer_and_a_sequential_model(keras):
    keras.utils.set_random_seed(2)
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(shared(shared(inp))))
    assert js.boundaries(model, X).names() == ["shared@0", "shared@1", "head"]
    close(js.slice(model, X, end="shared@1")(X), shared(shared(X)))
    seq = keras.Sequential([keras.layers.Dense(5, name="d0"), keras.layers.Dense(3, name="d1")])
    seq.build((None, 4))
    close(js.slice(seq, X, end="d0")(X), seq.layers[0](X))


def test_clear_errors(keras):
    model = keras_block_model(keras)
    with pytest.raises(js.SliceError, match="block/a"):
        js.slice(model, X, end="block/c")
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(js.SliceError, match="build it first"):
        js.slice(unbuilt, X)


def test_two_variables_with_one_name_keep_their_own_values(keras):
    class Two(keras.layers.Layer):
        def build(self, shape):
            self.w1 = self.add_weight(shape=(shape[-1], 3), name="w")
            self.w2 = self.add_weight(shape=(3, 3), name="w")

        def call(self, x):
            return x @ self.w1 @ self.w2

    inp = keras.Input((4,))
    model = keras.Model(inp, Two(name="two")(inp))
    sub = js.slice(model, X, end="two")
    assert jax.tree.map(jnp.shape, sub.variables) == {
        "trainable": {"two": {"w": (4, 3), "w_1": (3, 3)}}
    }
    layer = model.get_layer("two")
    close(sub(X), X @ layer.w1.value @ layer.w2.value)


def test_two_models_sliced_from_several_threads(keras):
    import threading

    models = [keras_block_model(keras), keras_block_model(keras)]
    for v in models[1].trainable_variables:
        v.assign(v.value * 2.0)
    want = [sub_model(keras, m, "block")([X]) for m in models]
    got = [None] * 4

    def work(i):
        got[i] = js.slice(models[i % 2], X, end="block")(X)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, value in enumerate(got):
        close(value, want[i % 2])


def test_training_reaches_sublayers_as_in_an_eager_call(keras):
    """`training=True` reaches a sublayer as `model(x, training=True)` passes it (through
    Keras's call context), also when the model's `call` does not take it or pass it on."""
    x = np.random.RandomState(7).randn(8, 4).astype(np.float32)

    class Quiet(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(4, name="d")
            self.bn = keras.layers.BatchNormalization(name="bn")

        def call(self, x):
            return self.bn(self.d(x))

    class Deaf(Quiet):
        def call(self, x, training=None):  # takes `training` but does not pass it on
            return self.bn(self.d(x))

    for cls in (Quiet, Deaf):
        model = cls()
        model(x)
        sub = js.slice(model, x, end="bn", training=True, mutable=True)
        out, updates = sub.apply(sub.variables, x, mutable=True)
        np.testing.assert_allclose(out, model(x, training=True), rtol=1e-5, atol=1e-5)
        assert set(updates["non_trainable"]["bn"]) == {"moving_mean", "moving_variance"}


def test_intermediates_in_both_modes_and_from_several_threads(keras):
    import threading

    x = np.random.RandomState(8).randn(8, 4).astype(np.float32)
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="a")(inp)
    h = keras.layers.BatchNormalization(momentum=0.5, name="bn")(h)
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(h))
    upto = lambda name: keras.Model(inp, model.get_layer(name).output)  # noqa: E731

    got = js.intermediates(model, x, names=["a", "bn"])
    np.testing.assert_allclose(got["bn"], upto("bn")(x, training=False), rtol=1e-5, atol=1e-5)
    with pytest.raises(js.SliceError, match="mutable"):
        js.intermediates(model, x, names=["bn"], training=True)
    bn, a = model.get_layer("bn"), np.asarray(upto("a")(x))
    want = 0.5 * np.asarray(bn.moving_mean.value) + 0.5 * a.mean(0)  # Keras's update rule
    got, updates = js.intermediates(model, x, names=["bn"], training=True, mutable=True)
    # (the eager training call below updates the model's own statistics, as Keras does)
    np.testing.assert_allclose(got["bn"], upto("bn")(x, training=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(updates["non_trainable"]["bn"]["moving_mean"], want, rtol=1e-5)

    results = [None] * 4

    def work(k):
        results[k] = np.asarray(js.slice(model, x, start="bn", end="head")(a))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_allclose(r, model(x, training=False), rtol=1e-5, atol=1e-5)


def test_rngs_are_refused_with_advice(keras):
    x = np.ones((2, 4), np.float32)
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dropout(0.5, name="drop")(inp))
    sub = js.slice(model, x, end="drop")
    with pytest.raises(js.SliceError, match="seed generators"):
        sub.apply(sub.variables, x, rngs={"dropout": jax.random.key(0)})
