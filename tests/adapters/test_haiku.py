"""Haiku functions (`hk.transform`, `hk.transform_with_state`) as a model kind.

Oracles come from Haiku itself: the same modules transformed in a function that stops
where the slice ends (same module names, so the same parameters), Haiku's own `apply`
of the full network, and `jax.grad` of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

hk = pytest.importorskip("haiku")


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


X = jax.random.normal(jax.random.key(1), (3, 5))


def mlp_fn(x):
    return hk.nets.MLP([8, 8, 2], name="mlp")(x)


def test_names_are_haiku_parameter_keys():
    f = hk.without_apply_rng(hk.transform(mlp_fn))
    params = f.init(jax.random.key(0), X)
    table = js.boundaries(f, params, X)
    assert table.names() == ["mlp", "mlp/~/linear_0", "mlp/~/linear_1", "mlp/~/linear_2"]
    assert set(params) == {"mlp/~/linear_0", "mlp/~/linear_1", "mlp/~/linear_2"}
    sizes = {k: sum(v.size for v in leaves.values()) for k, leaves in params.items()}
    assert [b.param_count for b in table] == [sum(sizes.values()), *sizes.values()]
    assert [b.module_type for b in table] == ["MLP", "Linear", "Linear", "Linear"]


def test_slices_equal_haiku_truncated_and_full_networks():
    f = hk.without_apply_rng(hk.transform(mlp_fn))
    params = f.init(jax.random.key(0), X)
    body = js.slice(f, params, X, end="mlp/~/linear_1")
    assert set(body.params) == {"mlp/~/linear_0", "mlp/~/linear_1"}  # a Haiku params dict
    assert body.params["mlp/~/linear_0"]["w"] is params["mlp/~/linear_0"]["w"]
    assert body.state == {}

    def truncated(x):  # the same modules, so the same names and parameters
        mlp = hk.nets.MLP([8, 8, 2], name="mlp")
        return mlp.layers[1](jax.nn.relu(mlp.layers[0](x)))

    want = hk.without_apply_rng(hk.transform(truncated)).apply(params, X)
    close(body(X), want)
    close(body.apply(body.params, X), want)  # `without_apply_rng`: apply(params, x)
    with pytest.raises(js.SliceError, match="without `rng`"):
        body(X, rng=jax.random.key(0))
    head = js.slice(f, params, X, start="mlp/~/linear_2")
    close(head(jax.nn.relu(want)), f.apply(params, X))
    close(js.intermediates(f, params, X, names=["mlp/~/linear_1"])["mlp/~/linear_1"], want)


def test_gradients_and_merge():
    f = hk.transform(mlp_fn)  # with an rng argument (unused)
    params = f.init(jax.random.key(0), X)
    head = js.slice(f, params, X, start="mlp/~/linear_1")
    first = params["mlp/~/linear_0"]
    h = jax.nn.relu(X @ first["w"] + first["b"])
    loss = lambda out: jnp.sum(out**2)  # noqa: E731
    # Haiku's order for `hk.transform`: apply(params, rng, *inputs)
    got = jax.grad(lambda p: loss(head.apply(p, None, h)))(head.params)
    want = jax.grad(lambda p: loss(f.apply(p, None, X)))(params)
    assert set(got) == {"mlp/~/linear_1", "mlp/~/linear_2"}
    for key in ("mlp/~/linear_1", "mlp/~/linear_2"):
        close(got[key], want[key])
    trained = jax.tree.map(lambda p, g: p - 0.1 * g, head.params, got)
    merged = head.merge(params, trained)  # a Haiku params dict in, one out
    assert set(merged) == set(params)
    assert merged["mlp/~/linear_0"]["w"] is params["mlp/~/linear_0"]["w"]
    assert set(head.extract(merged)) == set(head.params)
    close(head.extract(merged), trained)
    close(
        merged["mlp/~/linear_2"],
        jax.tree.map(lambda p, g: p - 0.1 * g, params["mlp/~/linear_2"], want["mlp/~/linear_2"]),
    )


class Net(hk.Module):
    def __call__(self, x, is_training):
        h = hk.Conv2D(4, 3, name="conv")(x)
        h = jax.nn.relu(hk.BatchNorm(True, True, 0.9, name="bn")(h, is_training))
        shared = hk.Linear(4, name="shared")
        h = shared(shared(jnp.mean(h, axis=(1, 2))))  # one module called twice
        return hk.Linear(2, name="head")(h)


def net_fn(x, is_training):
    return Net(name="net")(x, is_training)


IMAGES = jax.random.normal(jax.random.key(2), (4, 6, 6, 3))


def test_batch_norm_state_in_train_and_eval_mode():
    f = hk.transform_with_state(net_fn)
    params, state = f.init(jax.random.key(0), IMAGES, True)
    assert "net/bn/~/mean_ema" in state  # created in `__call__`: no `~` before `bn`

    def upto_bn(x, is_training):
        class Net(hk.Module):  # the same names as the full network, up to `bn`
            def __call__(self, x):
                h = hk.Conv2D(4, 3, name="conv")(x)
                return hk.BatchNorm(True, True, 0.9, name="bn")(h, is_training)

        return Net(name="net")(x)

    reference = hk.transform_with_state(upto_bn)
    for training in (False, True):
        want, want_state = reference.apply(params, state, None, IMAGES, training)
        sub = js.slice(f, params, state, IMAGES, end="net/bn", is_training=training)
        # Haiku's order for `hk.transform_with_state`: apply(params, state, rng, *inputs),
        # returning the new state beside the output (never silently dropped). Given the
        # model's whole state, as Haiku's `apply` is, it returns all of it, updated.
        out, new_state = sub.apply(sub.params, state, None, IMAGES)
        close(out, want)
        assert jax.tree.structure(new_state) == jax.tree.structure(want_state)
        close(new_state, want_state)
        close(jax.jit(sub.apply)(sub.params, state, None, IMAGES), (want, want_state))
        if training:
            assert all(new_state[k]["counter"] == state[k]["counter"] + 1 for k in new_state)
        # `sub.state` holds the entries the slice reads, keyed as Haiku keys them
        assert set(sub.state) <= set(state)
        read = [(m, e) for m, v in sub.state.items() for e in v]
        assert all(sub.state[m][e] is state[m][e] for m, e in read)
        out, own = sub(IMAGES)  # with sub.state: its entries, and those it writes
        close(out, want)
        close(own, {m: {e: want_state[m][e] for e in v} for m, v in own.items()})
        assert all(e in own[m] for m, e in read)
        out, again = sub.apply(sub.params, own, None, IMAGES)  # a loop keeps its structure
        assert jax.tree.structure(again) == jax.tree.structure(own)
        merged = sub.merge_state(state, own)
        assert set(merged) == set(state)
        for name, entries in want_state.items():  # by hand: Haiku's new state, entry by entry
            close({e: merged[name][e] for e in own[name]}, {e: entries[e] for e in own[name]})
        with pytest.raises(js.SliceError, match="net/bn"):
            sub.apply({**sub.params, "net/bn": {}}, state, None, IMAGES)


def test_a_module_called_twice_and_the_full_stateful_output():
    f = hk.transform_with_state(net_fn)
    params, state = f.init(jax.random.key(0), IMAGES, True)
    names = js.boundaries(f, params, state, IMAGES, is_training=False).names()
    assert "net/shared@0" in names and "net/shared@1" in names
    assert "net/bn/~/mean_ema.average" in names  # a method other than __call__
    tail = js.slice(f, params, state, IMAGES, start="net/shared@1", is_training=False)
    h = jax.random.normal(jax.random.key(3), (4, 4))
    p = params
    want = (h @ p["net/shared"]["w"] + p["net/shared"]["b"]) @ p["net/head"]["w"] + p["net/head"][
        "b"
    ]
    close(tail(h)[0], want)
    full = js.slice(f, params, state, IMAGES, is_training=False)
    want = f.apply(params, state, None, IMAGES, is_training=False)
    close(full.apply(full.params, state, None, IMAGES), want)  # Haiku's own call, whole
    close(full(IMAGES)[0], want[0])


def test_random_keys_are_haikus_rng():
    def fn(x):
        h = hk.Linear(6, name="a")(x)
        return hk.Linear(2, name="b")(hk.dropout(hk.next_rng_key(), 0.5, h))

    f = hk.transform(fn)
    params = f.init(jax.random.key(0), X)
    key = jax.random.key(7)
    sub = js.slice(f, params, X, start="b:input", rngs=key)
    full = js.slice(f, params, X, rngs=key)
    close(full(X, rng=key), f.apply(params, key, X))
    close(full.apply(full.params, key, X), f.apply(params, key, X))  # Haiku's own order
    h = jnp.ones((3, 6))
    b = params["b"]
    close(sub(h, rng=key), h @ b["w"] + b["b"])
    with pytest.raises(js.SliceError, match="rng"):
        full(X)  # re-traced without a key: Haiku's error, with what to pass
    with pytest.raises(js.SliceError, match="rngs=key"):
        js.slice(f, params, X, rng=key)  # js.slice takes keys as every kind does: told so
    with pytest.raises(js.SliceError, match="apply\\(params, rng"):
        sub.apply(sub.params)  # the arguments Haiku's `apply` takes, named


def test_clear_errors():
    f = hk.transform_with_state(net_fn)
    with pytest.raises(js.SliceError, match="params, state"):
        js.slice(f, end="net/head")
    g = hk.without_apply_rng(hk.transform(mlp_fn))
    params = g.init(jax.random.key(0), X)
    with pytest.raises(js.SliceError, match="mlp/~/linear_1"):
        js.slice(g, params, X, end="mlp/linear_1")


def test_haiku_transforms_inside_the_function():
    def fn(x):
        h = hk.remat(lambda y: hk.Linear(4, name="inner")(y))(x)
        cell = hk.Linear(4, name="cell")
        c, _ = hk.scan(lambda c, _: (jnp.tanh(cell(c)), None), h, None, length=3)
        return hk.Linear(2, name="head")(c)

    f = hk.without_apply_rng(hk.transform(fn))
    params = f.init(jax.random.key(0), X[:, :4])
    x = X[:, :4]
    names = js.boundaries(f, params, x).names()
    assert {"inner", "cell[:]", "head"} <= set(names)
    inner, cell = params["inner"], params["cell"]
    h = x @ inner["w"] + inner["b"]
    close(js.slice(f, params, x, end="inner")(x), h)
    want = jnp.tanh(h @ cell["w"] + cell["b"]) @ cell["w"] + cell["b"]  # iteration 1, by hand
    close(js.slice(f, params, x, end="cell[1]")(x), want)
    close(js.slice(f, params, x)(x), f.apply(params, x))


def test_slices_from_several_threads_agree():
    import threading

    f = hk.without_apply_rng(hk.transform(mlp_fn))
    params = f.init(jax.random.key(0), X)
    first = params["mlp/~/linear_0"]
    want = X @ first["w"] + first["b"]
    got = [None] * 4

    def work(i):
        got[i] = js.slice(f, params, X, end="mlp/~/linear_0")(X)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for value in got:
        close(value, want)


# `hk.layer_stack`: a lifted transform whose parameters Haiku keys under the stack's name
# (``__layer_stack_no_per_layer/lin``, rows stacked per layer) and whose layers run in a
# `scan`. Oracles: Haiku's own stack over fewer layers given the rows it runs, and the
# body's modules applied by hand to one row.

STACK = "__layer_stack_no_per_layer/lin"


def stacked_layer(h):
    return jnp.tanh(hk.Linear(4, name="lin")(h))


def stack_fn(layers, head=True):
    def fn(x):
        h = hk.layer_stack(layers)(stacked_layer)(x)
        return hk.Linear(2, name="head")(h) if head else h

    return hk.without_apply_rng(hk.transform(fn))


def rows(params, index, stack="__layer_stack_no_per_layer"):
    """Rows `index` (a slice or one row) of the parameters stacked under `stack`."""
    return {
        k: jax.tree.map(lambda a: a[index], v) if k.startswith(stack + "/") else v
        for k, v in params.items()
    }


def module_apply(module, params, *args):
    """A Haiku module built by `module` applied with `params` (its own keys)."""
    return hk.without_apply_rng(hk.transform(lambda *a: module()(*a))).apply(params, *args)


def lin_row(params, k, h):
    """The stack's `lin` in layer k, by hand."""
    return module_apply(lambda: hk.Linear(4, name="lin"), {"lin": rows(params, k)[STACK]}, h)


def stacked_block(h):
    h = h + hk.Linear(4, name="attn")(h)
    return jnp.tanh(hk.nets.MLP([4, 4], name="mlp")(h))


class StackedModel(hk.Module):
    def __init__(self, layers=2, head=True, name="model"):
        super().__init__(name=name)
        self.layers, self.head = layers, head

    def __call__(self, x):
        h = hk.layer_stack(self.layers, name="stack")(stacked_block)(x)
        return hk.Linear(2, name="head")(h) if self.head else h


def test_layer_stack_names_are_haiku_parameter_keys():
    f = stack_fn(3)
    params = f.init(jax.random.key(0), X[:, :4])
    table = js.boundaries(f, params, X[:, :4])
    # the stack as a whole (its body is one module), every layer, then the head: no
    # boundary for the lift that only hands the layers their parameters
    assert table.names() == [STACK, f"{STACK}[:]", "head"]
    size = sum(v.size for v in params[STACK].values())
    assert [b.param_count for b in table] == [size, size, 10]

    def two_stacks(x):  # two stacks with the same body, and a module named as the body's
        h = hk.layer_stack(2, name="a")(stacked_layer)(x)
        return hk.layer_stack(3, name="b")(stacked_layer)(hk.Linear(4, name="lin")(h))

    g = hk.without_apply_rng(hk.transform(two_stacks))
    names = js.boundaries(g, g.init(jax.random.key(0), X[:, :4]), X[:, :4]).names()
    assert names == ["a/lin", "a/lin[:]", "lin", "b/lin", "b/lin[:]"]

    h = hk.without_apply_rng(hk.transform(lambda x: StackedModel()(x)))
    params = h.init(jax.random.key(0), X[:, :4])
    table = js.boundaries(h, params, X[:, :4])
    assert table.names() == [
        "model",
        "model/stack/attn[:]",
        "model/stack/mlp[:]",
        "model/stack/mlp[:]/~/linear_0",
        "model/stack/mlp[:]/~/linear_1",
        "model/head",
    ]
    for b in table:  # without its iteration slot, a name is a prefix of Haiku's keys
        key = b.name.replace("[:]", "")
        owned = [v for k, v in params.items() if k == key or k.startswith(key + "/")]
        assert b.param_count == sum(a.size for leaves in owned for a in leaves.values())
    # a body of several modules is no one module's loop
    with pytest.raises(js.SliceError, match=r"model/stack/attn\[0\]"):
        js.slice(h, params, X[:, :4], end="model/stack/attn")


def test_layer_stack_slices_equal_haiku_stacks_of_fewer_layers():
    x = X[:, :4]
    f = stack_fn(3)
    params = f.init(jax.random.key(0), x)
    after_0 = stack_fn(1, head=False).apply(rows(params, slice(0, 1)), x)
    want_1 = lin_row(params, 1, after_0)
    close(js.slice(f, params, x, end=f"{STACK}[1]")(x), want_1)
    # from layer 1 on: Haiku's stack of the two last layers, then the head
    close(
        js.slice(f, params, x, start=f"{STACK}[1]")(after_0),
        stack_fn(2).apply(rows(params, slice(1, 3)), after_0),
    )
    close(
        js.slice(f, params, x, start=f"{STACK}[1]", end=f"{STACK}[2]")(after_0),
        lin_row(params, 2, jnp.tanh(want_1)),
    )
    # every layer's `lin`, stacked, and the stack as a whole
    h, outs = x, []
    for k in range(3):
        outs.append(lin_row(params, k, h))
        h = jnp.tanh(outs[-1])
    close(js.slice(f, params, x, end=f"{STACK}[:]")(x), jnp.stack(outs))
    close(js.slice(f, params, x, end=STACK)(x), stack_fn(3, head=False).apply(params, x))
    close(js.slice(f, params, x)(x), f.apply(params, x))


def test_layer_stack_with_nested_module_names_slices_as_haiku():
    x = X[:, :4]
    h = hk.without_apply_rng(hk.transform(lambda x: StackedModel()(x)))
    params = h.init(jax.random.key(0), x)
    sub = js.slice(h, params, x, end="model/stack/mlp[1]/~/linear_0")
    assert set(sub.params) == {
        "model/stack/attn",
        "model/stack/mlp/~/linear_0",
        "model/stack/mlp/~/linear_1",
    }
    # the model's stack over its first layer, then layer 1 by hand with the body's names
    first = hk.without_apply_rng(hk.transform(lambda x: StackedModel(1, head=False)(x)))
    after_0 = first.apply(rows(params, slice(0, 1), "model/stack"), x)

    def layer_1_upto_linear_0(h):
        h = h + hk.Linear(4, name="attn")(h)
        return hk.nets.MLP([4, 4], name="mlp").layers[0](h)

    stacked = rows(params, 1, "model/stack").items()
    own = {k.removeprefix("model/stack/"): v for k, v in stacked if k.startswith("model/stack/")}
    want = hk.without_apply_rng(hk.transform(layer_1_upto_linear_0)).apply(own, after_0)
    close(sub(x), want)
    close(js.slice(h, params, x)(x), h.apply(params, x))


def test_a_positional_python_bool_argument_is_fixed_by_the_trace():
    def net(x, is_training):
        h = hk.Linear(6, name="stem")(x)
        h = hk.dropout(hk.next_rng_key(), 0.5, h) if is_training else h
        return hk.Linear(2, name="head")(jax.nn.relu(h))

    def upto_dropout(x, is_training):
        h = hk.Linear(6, name="stem")(x)
        return hk.dropout(hk.next_rng_key(), 0.5, h) if is_training else h

    f = hk.transform(net)
    params = f.init(jax.random.key(0), X, True)
    key = jax.random.key(4)
    h = jax.random.normal(jax.random.key(5), (3, 6))
    for training in (True, False):
        want = hk.transform(upto_dropout).apply(params, key, X, training)
        sub = js.slice(f, params, X, training, end="head:input", rngs=key)
        close(sub(X, rng=key), jax.nn.relu(want))
        close(sub.apply(sub.params, key, X, training), jax.nn.relu(want))  # as Haiku's apply
        head = js.slice(f, params, X, training, start="head", rngs=key)
        close(head(h, rng=key), h @ params["head"]["w"] + params["head"]["b"])
        full = js.slice(f, params, X, training, rngs=key)
        close(full.apply(full.params, key, X, training), f.apply(params, key, X, training))
        with pytest.raises(js.SliceError, match="fixed"):
            full.apply(full.params, key, X, not training)
