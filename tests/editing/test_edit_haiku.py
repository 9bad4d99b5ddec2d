"""Editing Haiku functions: functions that build Haiku modules as new nodes.

Oracles are Haiku itself: the network written again by hand with the node in place (its
modules under the node's name, so the same parameters apply), `hk.intercept_methods`
changing a module's output the way an edit does, and `jax.grad` of those.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

hk = pytest.importorskip("haiku")

X = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)), jnp.float32)


def net(x):
    h = jax.nn.relu(hk.Linear(6, name="stem")(x))
    h = hk.Linear(6, name="mid")(h)
    return hk.Linear(3, name="head")(jax.nn.relu(h))


def adapter(h):
    return h + hk.Linear(6, name="up")(hk.Linear(2, name="down")(h))


def twin(x):
    """`net` with the adapter after `mid`, written by hand."""
    h = jax.nn.relu(hk.Linear(6, name="stem")(x))
    h = hk.Linear(6, name="mid")(h)
    with hk.name_scope("adapter"):
        h = adapter(h)
    return hk.Linear(3, name="head")(jax.nn.relu(h))


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def f_and_params():
    f = hk.transform(net)
    return f, f.init(jax.random.key(0), X)


def test_a_haiku_node_gets_its_parameters_under_its_name(f_and_params):
    f, params = f_and_params
    g = js.edit(f, params, X).insert_after("mid", adapter, key=jax.random.key(1), name="adapter")
    variables = g.variables
    assert sorted(variables["params"]) == sorted(hk.transform(twin).init(jax.random.key(0), X))
    edited = g.build()
    want = hk.transform(twin).apply(variables["params"], None, X)
    close(edited(X), want)

    def loss(p):
        return jnp.sum(hk.transform(twin).apply(p, None, X) ** 2)

    # as a slice of it is: Haiku's params dict and Haiku's `apply(params, rng, x)`
    assert sorted(edited.params) == sorted(variables["params"])
    got = jax.grad(lambda p: jnp.sum(edited.apply(p, None, X) ** 2))(edited.params)
    want_grads = jax.grad(loss)(variables["params"])
    for module in ("adapter/down", "adapter/up", "stem"):
        close(got[module]["w"], want_grads[module]["w"])
    g.remove("adapter")
    close(g.build()(X), f.apply(params, None, X))
    assert params.keys() == {"stem", "mid", "head"}  # the model's own are untouched


def test_a_function_edit_equals_haiku_intercept_methods(f_and_params):
    f, params = f_and_params
    edited = js.edit(f, params, X).replace("mid", lambda h: jnp.tanh(h)).build()

    def tanh_mid(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.module.module_name == "mid" and context.method_name == "__call__":
            return jnp.tanh(args[0])
        return out

    def intercepted(x):
        with hk.intercept_methods(tanh_mid):
            return net(x)

    close(edited(X), hk.transform(intercepted).apply(params, None, X))


def test_steering_a_haiku_function_with_call_time_inputs(f_and_params):
    f, params = f_and_params
    edited = js.edit(f, params, X).insert_after("mid", lambda h, v: h + v, inputs=("v",)).build()
    vs = jax.random.normal(jax.random.key(2), (3, 5, 6))

    def steered(v):
        def add(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            mid = context.module.module_name == "mid" and context.method_name == "__call__"
            return out + v if mid else out

        def fn(x):
            with hk.intercept_methods(add):
                return net(x)

        return hk.transform(fn).apply(params, None, X)

    got = jax.vmap(lambda v: edited(X, v=v))(vs)
    for i in range(3):
        close(got[i], steered(vs[i]))


def test_an_edited_stateful_function_is_applied_as_haikus_apply():
    def bn_net(x, is_training):
        h = hk.Linear(6, name="stem")(x)
        h = hk.BatchNorm(True, True, 0.9, name="bn")(h, is_training)
        return hk.Linear(2, name="head")(jax.nn.relu(h))

    def tanh_bn(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        bn = context.module.module_name == "bn" and context.method_name == "__call__"
        return jnp.tanh(out) if bn else out

    def intercepted(x, is_training):
        with hk.intercept_methods(tanh_bn):
            return bn_net(x, is_training)

    f = hk.transform_with_state(bn_net)
    params, state = f.init(jax.random.key(0), X, is_training=True)
    oracle = hk.transform_with_state(intercepted)
    for training in (True, False):
        edited = (
            js.edit(f, params, state, X, is_training=training)
            .insert_after("bn", jnp.tanh, name="squash")
            .build()
        )
        out, new_state = edited.apply(edited.params, state, None, X)
        want, want_state = oracle.apply(params, state, None, X, is_training=training)
        close(out, want)
        assert jax.tree.structure(new_state) == jax.tree.structure(want_state)
        for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True):
            close(a, b)


def stacked_layer(h):
    return jnp.tanh(hk.Linear(4, name="lin")(h))


def stacked_net(x):
    return hk.Linear(2, name="head")(hk.layer_stack(3)(stacked_layer)(x))


def doubled(next_fun, args, kwargs, context):
    """An interceptor doubling the output of each call of the module `lin`."""
    out = next_fun(*args, **kwargs)
    lin = context.module.module_name == "lin" and context.method_name == "__call__"
    return 2.0 * out if lin else out


def test_edits_at_the_layers_of_an_hk_layer_stack():
    x = X[:, :4]
    f = hk.transform(stacked_net)
    params = f.init(jax.random.key(0), x)
    name = "__layer_stack_no_per_layer/lin"  # as Haiku keys the stacked parameters

    def intercepted(x):
        with hk.intercept_methods(doubled):
            return stacked_net(x)

    # every layer: Haiku's own stack with each layer's `lin` doubled
    every = js.edit(f, params, x).insert_after(f"{name}[:]", lambda h: 2.0 * h).build()
    close(every(x), hk.transform(intercepted).apply(params, None, x))

    # layer 1 only: Haiku's stacks of one layer given each row, the middle one doubled
    one = js.edit(f, params, x).insert_after(f"{name}[1]", lambda h: 2.0 * h).build()
    plain = hk.transform(lambda h: hk.layer_stack(1)(stacked_layer)(h))
    h = x
    for k in range(3):
        row = {name: {p: v[k : k + 1] for p, v in params[name].items()}}
        with hk.intercept_methods(doubled) if k == 1 else contextlib.nullcontext():
            h = plain.apply(row, None, h)
    close(one(x), h @ params["head"]["w"] + params["head"]["b"])


def test_a_haiku_function_with_a_positional_flag_is_edited():
    """``f(x, is_training)`` with the flag given positionally, as Haiku users call it."""

    def bn_net(x, is_training):
        h = hk.Linear(6, name="stem")(x)
        h = hk.BatchNorm(True, True, 0.9, name="bn")(h, is_training)
        return hk.Linear(2, name="head")(jax.nn.relu(h))

    def doubled(x, is_training):
        def double_bn(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            bn = context.module.module_name == "bn" and context.method_name == "__call__"
            return 2 * out if bn else out

        with hk.intercept_methods(double_bn):
            return bn_net(x, is_training)

    f = hk.transform_with_state(bn_net)
    params, state = f.init(jax.random.key(0), X, True)
    oracle = hk.transform_with_state(doubled)
    for training in (True, False):
        g = js.edit(f, params, state, X, training).insert_after("bn", lambda h: 2 * h)
        out, new_state = g.build().apply(params, state, None, X, training)
        want, want_state = oracle.apply(params, state, None, X, training)
        close(out, want)
        for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True):
            close(a, b)


def test_trained_weights_go_back_to_the_model_and_the_nodes_apart(f_and_params):
    """Training an edited function, then `merge` (the model as trained, without the
    adapter) and `nodes` (the adapter's parameters): both equal the same sgd steps taken
    by hand on `hk.transform` of the network written with the adapter in place."""
    f, params = f_and_params
    edited = (
        js.edit(f, params, X).insert_after("mid", adapter, key=jax.random.key(1), name="adapter")
    ).build()
    y = jnp.ones((5, 3))
    by_hand = hk.transform(twin)

    def step(apply, p):
        grads = jax.grad(lambda p: jnp.mean((apply(p, None, X) - y) ** 2))(p)
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

    trained, want = edited.params, edited.params
    for _ in range(3):
        trained, want = step(edited.apply, trained), step(by_hand.apply, want)
    merged = edited.merge(params, trained)
    assert sorted(merged) == sorted(params)
    nodes = edited.nodes(trained)
    assert sorted(nodes) == ["adapter/down", "adapter/up"]
    for module in merged:
        close(merged[module]["w"], want[module]["w"])
    for module in nodes:
        close(nodes[module]["w"], want[module]["w"])
    assert not np.allclose(merged["stem"]["w"], params["stem"]["w"])  # it did train
    # The model runs as trained, without the adapter; `merge` of a part keeps the rest.
    close(f.apply(merged, None, X), f.apply({k: want[k] for k in params}, None, X))
    part = edited.merge(params, {"head": trained["head"], "adapter/up": trained["adapter/up"]})
    assert part["stem"]["w"] is params["stem"]["w"]
    close(part["head"]["w"], trained["head"]["w"])
