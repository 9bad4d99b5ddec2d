"""Equinox models: slices against Equinox's own submodule calls and `eqx.filter_grad`.

Every oracle is computed by Equinox itself: eager calls of the model's submodules,
`eqx.filter_grad` of the full model, and an optax step on the full model with a filter
that freezes everything the slice does not hold.
"""

from __future__ import annotations

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

KEYS = jax.random.split(jax.random.key(0), 8)


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def conv_stack():
    """Three same-class convs back to back, then a flatten and a linear head."""
    k = KEYS
    return eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[0]),
            eqx.nn.Conv2d(3, 3, 3, padding=1, key=k[1]),
            eqx.nn.Conv2d(3, 3, 3, padding=1, key=k[2]),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(3 * 6 * 6, 4, key=k[3]),
        ]
    )


X = jax.random.normal(KEYS[4], (2, 6, 6))


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, n, key):
        self.linear = eqx.nn.Linear(n, n, key=key)
        self.norm = eqx.nn.LayerNorm(n)

    def __call__(self, x):
        return x + jax.nn.gelu(self.linear(self.norm(x)))


class Net(eqx.Module):
    embed: eqx.nn.Linear
    block: Block
    head: eqx.nn.Linear
    scale: jax.Array

    def __init__(self, key):
        a, b, c = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(3, 8, key=a)
        self.block = Block(8, b)
        self.head = eqx.nn.Linear(8, 2, key=c)
        self.scale = jnp.full((2,), 0.5)

    def __call__(self, x):
        h = self.block(self.block(self.embed(x)))  # one module called twice
        return self.head(h) * self.scale


def test_every_call_is_a_boundary_by_attribute_path():
    table = js.boundaries(conv_stack(), X)
    assert table.names() == [f"layers/{i}" for i in range(5)]
    assert [b.module_type for b in table] == ["Conv2d", "Conv2d", "Conv2d", "Lambda", "Linear"]
    model = conv_stack()
    sizes = [
        sum(x.size for x in jax.tree.leaves(eqx.filter(m, eqx.is_array))) for m in model.layers
    ]
    assert [b.param_count for b in table] == sizes


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_prefix_slices_equal_the_submodules_called_eagerly(k):
    model = conv_stack()
    sub = js.slice(model, X, end=f"layers/{k}")
    expected = X
    for layer in model.layers[: k + 1]:
        expected = layer(expected)
    close(sub(X), expected)
    # Back-to-back convs are distinct: the slice holds exactly the layers it runs.
    assert sub.paths == tuple(f"layers/{i}" for i in range(k + 1) if i != 3 or k > 3)


def test_named_submodules_and_a_module_called_twice():
    net = Net(KEYS[5])
    x = jnp.arange(3.0)
    names = js.boundaries(net, x).names()
    assert names[:4] == ["embed", "block@0", "block/norm@0", "block/linear@0"]
    assert "block@1" in names and names[-1] == "head"
    with pytest.raises(js.SliceError, match="block@0"):
        js.slice(net, x, end="block")
    h0 = net.embed(x)
    h1 = net.block(h0)
    close(js.slice(net, x, end="block@0")(x), h1)
    close(js.slice(net, x, start="block@1", end="block@1")(h1), net.block(h1))
    inner = js.slice(net, x, start="block/linear@1", end="block/linear@1")
    close(inner(h1), net.block.linear(h1))
    # The root's own array is held as a loose part of a slice that reads it.
    tail = js.slice(net, x, start="head")
    close(tail(net.block(h1)), net(x))
    assert tail.paths == ("head", "scale")


def test_gradients_equal_filter_grad_of_the_full_model():
    model = conv_stack()
    head = js.slice(model, X, start="layers/2")
    h = model.layers[1](model.layers[0](X))
    loss = lambda m, v: jnp.sum(m(v) ** 2)  # noqa: E731
    got = eqx.filter_grad(loss)(head, h)
    want = eqx.filter_grad(loss)(model, X)
    parts = dict(zip(head.paths, got.parts, strict=True))
    assert head.paths == ("layers/2", "layers/3", "layers/4")  # the Lambda runs too
    close((parts["layers/2"], parts["layers/4"]), (want.layers[2], want.layers[4]))


def test_batched_with_vmap_and_jitted_with_filter_jit():
    model = conv_stack()
    xs = jax.random.normal(KEYS[6], (5, 2, 6, 6))
    sub = js.slice(model, X, end="layers/2")
    expected = jax.vmap(lambda x: model.layers[2](model.layers[1](model.layers[0](x))))(xs)
    close(jax.vmap(sub)(xs), expected)
    close(eqx.filter_jit(sub)(xs[0]), expected[0])
    close(eqx.filter_jit(lambda s, x: jax.vmap(s)(x))(sub, xs), expected)


def test_fine_tuning_the_head_with_optax_equals_freezing_the_rest_of_the_model():
    model = conv_stack()
    xs = jax.random.normal(KEYS[6], (6, 2, 6, 6))
    ys = jax.random.normal(KEYS[7], (6, 4))
    head = js.slice(model, X, start="layers/2")
    feats = jax.vmap(lambda x: model.layers[1](model.layers[0](x)))(xs)
    tx = optax.adam(1e-2)

    def train(module, inputs, spec):
        params, static = eqx.partition(module, spec)
        state = tx.init(params)

        def loss(p):
            m = eqx.combine(p, static)
            return jnp.mean((jax.vmap(m)(inputs) - ys) ** 2)

        for _ in range(3):
            grads = jax.grad(loss)(params)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return eqx.combine(params, static)

    trained = train(head, feats, eqx.is_inexact_array)
    # The oracle: the full model trained with everything but layers 2 and 4 frozen.
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(
        lambda m: (m.layers[2], m.layers[4]),
        spec,
        (
            jax.tree.map(eqx.is_inexact_array, model.layers[2]),
            jax.tree.map(eqx.is_inexact_array, model.layers[4]),
        ),
    )
    reference = train(model, xs, spec)
    merged = head.merge(model, trained)
    close(eqx.filter(merged, eqx.is_array), eqx.filter(reference, eqx.is_array))
    assert merged.layers[0].weight is model.layers[0].weight  # untouched leaves: same objects
    with pytest.raises(js.SliceError, match="same parts"):
        head.merge(model, js.slice(model, X, end="layers/1"))


def stateful_net():
    class BNNet(eqx.Module):
        conv: eqx.nn.Conv2d
        bn: eqx.nn.BatchNorm
        drop: eqx.nn.Dropout
        head: eqx.nn.Linear

        def __init__(self, key):
            a, b = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(2, 4, 3, padding=1, key=a)
            self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
            self.drop = eqx.nn.Dropout(0.5)
            self.head = eqx.nn.Linear(4, 3, key=b)

        def __call__(self, x, state, key=None):
            h, state = self.bn(jax.nn.relu(self.conv(x)), state)
            return self.head(self.drop(h.mean((1, 2)), key=key)), state

    return eqx.nn.make_with_state(BNNet)(KEYS[0])


def test_batch_norm_state_flows_through_a_vmapped_model():
    net, state = stateful_net()
    batched = eqx.filter_vmap(net, in_axes=(0, None, None), out_axes=(0, None), axis_name="batch")
    xs = jax.random.normal(KEYS[1], (5, 2, 6, 6))
    sub = js.slice(batched, xs, state, KEYS[2], end="_fun/bn")

    def upto_bn(x, s):
        return net.bn(jax.nn.relu(net.conv(x)), s)

    want_y, want_state = jax.vmap(
        upto_bn, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
    )(xs, state)
    got_y, got_state = sub(xs, state, KEYS[2])
    close(got_y, want_y)
    close(got_state, want_state)
    # The statistics really moved, so the comparison above is not of two unchanged states.
    moved = [
        not np.allclose(a, b)
        for a, b in zip(jax.tree.leaves(want_state), jax.tree.leaves(state), strict=True)
    ]
    assert any(moved)


def test_inference_mode_switches_a_slice_like_the_model():
    net, state = stateful_net()
    batched = eqx.filter_vmap(net, in_axes=(0, None, None), out_axes=(0, None), axis_name="batch")
    xs = jax.random.normal(KEYS[1], (5, 2, 6, 6))
    train_sub = js.slice(batched, xs, state, KEYS[2], end="_fun/drop")
    inference = eqx.nn.inference_mode(net)

    def upto_drop(m, x, s, key):
        h, s = m.bn(jax.nn.relu(m.conv(x)), s)
        return m.drop(h.mean((1, 2)), key=key)

    run = jax.vmap(upto_drop, in_axes=(None, 0, None, None), axis_name="batch")
    close(train_sub(xs, state, KEYS[2]), run(net, xs, state, KEYS[2]))
    switched = eqx.nn.inference_mode(train_sub)
    close(switched(xs, state, KEYS[2]), run(inference, xs, state, KEYS[2]))
    # ...and the original slice is unchanged.
    close(train_sub(xs, state, KEYS[2]), run(net, xs, state, KEYS[2]))


def test_a_model_of_another_structure_is_traced_again():
    relu = eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.relu, key=KEYS[3])
    tanh = eqx.tree_at(lambda m: m.activation, relu, jnp.tanh)
    x = jnp.linspace(-1.0, 1.0, 3)
    for model in (relu, tanh, relu):
        sub = js.slice(model, x, end="layers/1")
        close(sub(x), model.layers[1](model.activation(model.layers[0](x))))
        close(js.intermediates(model, x, names=["layers/1"])["layers/1"], sub(x))


def test_a_slice_keeps_alive_only_the_parts_it_holds():
    model = conv_stack()
    head_weight = weakref.ref(model.layers[4].weight)
    sub = js.slice(model, X, end="layers/0")
    del model
    gc.collect()
    assert head_weight() is None
    assert sub(X).shape == (3, 6, 6)


def test_slices_from_several_threads_agree():
    model = conv_stack()
    want = model.layers[1](model.layers[0](X))
    results = [None] * 4

    def work(i):
        results[i] = js.slice(model, X, end="layers/1")(X)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        close(got, want)


def test_clear_errors():
    model = conv_stack()
    with pytest.raises(js.SliceError, match="jax.vmap\\(sub\\)"):
        js.boundaries(jax.vmap(model), jnp.stack([X, X]))
    with pytest.raises(js.SliceError, match="layers/1"):
        js.slice(model, X, end="layer/1")


def test_a_batched_slice_exports_with_a_symbolic_batch():
    model = conv_stack()
    sub = js.slice(model, X, end="layers/1")
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, *X.shape), X.dtype)
    exported = jax.export.export(jax.jit(jax.vmap(sub)))(spec)
    xs = jax.random.normal(KEYS[6], (3, *X.shape))
    want = jax.vmap(lambda x: model.layers[1](model.layers[0](x)))(xs)
    close(exported.call(xs), want)


def test_merge_refuses_trained_parts_of_another_shape_or_dtype():
    model = conv_stack()
    head = js.slice(model, X, start="layers/2")
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, head)
    with pytest.raises(js.VariablesMismatchError, match="bfloat16"):
        head.merge(model, cast)


def test_a_batch_given_to_a_one_example_slice_is_an_error_with_the_fix():
    model = eqx.nn.MLP(3, 2, 8, 2, key=KEYS[0])
    sub = js.slice(model, jnp.ones(3), end="layers/1")
    with pytest.raises(js.SliceError, match="jax.vmap\\(sub\\)"):
        sub(jnp.ones((5, 3)))
    close(jax.vmap(sub)(jnp.ones((5, 3)))[0], sub(jnp.ones(3)))
