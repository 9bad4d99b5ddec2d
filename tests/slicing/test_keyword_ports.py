"""Keyword arguments of a module call are shown in the order the call passed them.

JAX flattens a call's ``(args, kwargs)`` with the keywords sorted; a user who wrote
``block(x, zeta=z, alpha=a)`` expects the boundary table, and everything that describes
a slice started there, to list ``x, zeta, alpha``. Each model kind is called here with
keywords out of alphabetical order and of different shapes, so the order is visible.

Oracles come from outside jaxslice: the submodule applied by hand (linen's ``apply`` of
the block's own variables, the NNX/Equinox/Keras module called directly, the marked
function called unmarked) and Flax's ``intercept_methods`` recording of the call.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, import_keras, random_input, record_calls

B = 2
X = random_input(31, (B, 4))
Z = random_input(32, (B, 2))  # passed as `zeta`, first
A = random_input(33, (B, 3))  # passed as `alpha`, second
IN_CALL_ORDER = [(B, 4), (B, 2), (B, 3)]  # x, zeta, alpha


def mix(h, zeta, alpha):
    """What every block does with its inputs: all three matter to the result."""
    return jnp.tanh(h) * jnp.sum(zeta, -1, keepdims=True) + jnp.sum(alpha, -1, keepdims=True)


def row(table, name):
    (found,) = [b for b in table if b.name == name]
    return found


def assert_table_in_call_order(table, name, shapes=IN_CALL_ORDER):
    assert [tuple(a.shape) for a in row(table, name).inputs] == shapes
    printed = next(line for line in str(table).splitlines() if line.startswith(name + " "))
    assert printed.index(_shape_text(shapes[1])) < printed.index(_shape_text(shapes[2]))


def _shape_text(shape):
    return f"float32[{', '.join(map(str, shape))}]"


def assert_described_in_call_order(sub, x):
    """The slice's errors list its keyword inputs as the call passed them."""
    with pytest.raises(js.InputMismatchError) as error:
        sub(x, x)  # one positional input too many: the message lists every input
    text = str(error.value)
    assert text.index("argument 0") < text.index("keyword 'zeta'") < text.index("keyword 'alpha'")
    with pytest.raises(js.InputMismatchError, match="Missing keyword input 'zeta'"):
        sub(x)  # both keywords missing: the first one the call passed is named


def assert_keywords_in_any_order(sub, want, x, z, a):
    assert_trees_all_close(sub(x, zeta=z, alpha=a), want)
    assert_trees_all_close(sub(x, alpha=a, zeta=z), want)


# --------------------------------------------------------------------------- linen


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, zeta=None, alpha=None):
        return mix(nn.Dense(4, name="dense")(x), zeta, alpha)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        z, a = jnp.sin(h[:, :2]), jnp.cos(h[:, 1:])
        return nn.Dense(3, name="head")(LinenBlock(name="block")(h, zeta=z, alpha=a))


@pytest.fixture(scope="module")
def linen_net():
    model = LinenNet()
    return model, model.init(jax.random.key(0), X)


def test_linen_keywords_are_listed_in_call_order(linen_net):
    model, variables = linen_net
    assert_table_in_call_order(js.boundaries(model, variables, X), "block")
    sub = js.slice(model, variables, X, start="block", end="block")
    assert_described_in_call_order(sub, X)
    own = {"params": variables["params"]["block"]}
    want = LinenBlock().apply(own, X, zeta=Z, alpha=A)
    assert_keywords_in_any_order(sub, want, X, Z, A)


def test_linen_slice_fed_the_recorded_call_returns_its_output(linen_net):
    model, variables = linen_net
    ((h,), kwargs, out) = record_calls(model, variables, X)["block"][0]
    sub = js.slice(model, variables, X, start="block", end="block")
    assert_trees_all_close(sub(h, alpha=kwargs["alpha"], zeta=kwargs["zeta"]), out)
    tail = js.slice(model, variables, X, start="block")
    assert_trees_all_close(tail(h, **kwargs), model.apply(variables, X))


def test_an_input_end_keeps_its_value_in_jax_order(linen_net):
    # Only the description follows the call; the value of `block:input` is as before:
    # the positional arguments, then the keywords by name.
    model, variables = linen_net
    ((h,), kwargs, _) = record_calls(model, variables, X)["block"][0]
    got = js.slice(model, variables, X, end="block:input")(X)
    assert_trees_all_close(got, (h, kwargs["alpha"], kwargs["zeta"]))


# --------------------------------------------------------------------------- NNX


def test_nnx_keywords_are_listed_in_call_order():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x, zeta, alpha):
            return mix(self.dense(x), zeta, alpha)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.block = Block(rngs)

        def __call__(self, x, z, a):
            return self.block(x, zeta=z, alpha=a)

    model = Net(nnx.Rngs(0))
    assert_table_in_call_order(js.boundaries(model, X, Z, A), "block")
    sub = js.slice(model, X, Z, A, start="block", end="block")
    assert_described_in_call_order(sub, X)
    assert_keywords_in_any_order(sub, model.block(X, zeta=Z, alpha=A), X, Z, A)


# --------------------------------------------------------------------------- Keras


def test_keras_keywords_are_listed_in_call_order():
    keras = import_keras()

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4, name="dense")

        def call(self, x, zeta=None, alpha=None):
            return mix(self.dense(x), zeta, alpha)

    keras.utils.set_random_seed(3)
    block = Block(name="block")
    inputs = [keras.Input((4,)), keras.Input((2,)), keras.Input((3,))]
    model = keras.Model(inputs, block(inputs[0], zeta=inputs[1], alpha=inputs[2]))
    sample = [np.asarray(X), np.asarray(Z), np.asarray(A)]
    assert_table_in_call_order(js.boundaries(model, sample), "block")
    sub = js.slice(model, sample, start="block", end="block")
    assert_described_in_call_order(sub, X)
    want = np.asarray(block(X, zeta=Z, alpha=A))
    assert_keywords_in_any_order(sub, want, X, Z, A)


# --------------------------------------------------------------------------- Equinox


def test_equinox_keywords_are_listed_in_call_order():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        dense: eqx.nn.Linear

        def __call__(self, x, *, zeta, alpha):
            return mix(self.dense(x), zeta, alpha)

    class Net(eqx.Module):
        block: Block

        def __call__(self, x, z, a):
            return self.block(x, zeta=z, alpha=a)

    model = Net(Block(eqx.nn.Linear(4, 4, key=jax.random.key(0))))
    x, z, a = X[0], Z[0], A[0]
    assert_table_in_call_order(js.boundaries(model, x, z, a), "block", [(4,), (2,), (3,)])
    sub = js.slice(model, x, z, a, start="block", end="block")
    assert_keywords_in_any_order(sub, model.block(x, zeta=z, alpha=a), x, z, a)


# --------------------------------------------------------------------------- Haiku


def test_haiku_keywords_are_listed_in_call_order():
    hk = pytest.importorskip("haiku")

    class Block(hk.Module):
        def __call__(self, x, zeta, alpha):
            return mix(hk.Linear(4, name="dense")(x), zeta, alpha)

    def net(x, z, a):
        return Block(name="block")(x, zeta=z, alpha=a)

    f = hk.without_apply_rng(hk.transform(net))
    params = f.init(jax.random.key(0), X, Z, A)
    assert_table_in_call_order(js.boundaries(f, params, X, Z, A), "block")
    sub = js.slice(f, params, X, Z, A, start="block", end="block")
    assert_described_in_call_order(sub, X)
    assert_keywords_in_any_order(sub, f.apply(params, X, Z, A), X, Z, A)


# --------------------------------------------------------------------------- js.mark


def block_fn(x, zeta, alpha):
    return mix(x, zeta, alpha)


marked_block = js.mark("block", block_fn)


def marked_net(w, x, z, a):
    return marked_block(x @ w, zeta=z, alpha=a)


W = random_input(34, (4, 4))


def test_marked_function_keywords_are_listed_in_call_order():
    assert_table_in_call_order(js.boundaries(marked_net, W, X, Z, A), "block")
    sub = js.slice(marked_net, W, X, Z, A, start="block", end="block")
    assert_described_in_call_order(sub, X)
    assert_keywords_in_any_order(sub, block_fn(X, zeta=Z, alpha=A), X, Z, A)


def scanned_net(ws, x, z, a):
    def body(h, w):
        return marked_block(h @ w, zeta=z, alpha=a), None

    return jax.lax.scan(body, x, ws)[0]


def test_a_call_in_a_loop_lists_its_keywords_in_call_order():
    ws = jnp.stack([W, W.T, W * 0.5])
    table = js.boundaries(scanned_net, ws, X, Z, A)
    assert_table_in_call_order(table, "block[:]")
    sub = js.slice(scanned_net, ws, X, Z, A, start="block[2]")
    assert_described_in_call_order(sub, X)
    # The slice takes the last iteration's call's inputs and returns its result.
    assert_keywords_in_any_order(sub, block_fn(X, zeta=Z, alpha=A), X, Z, A)
