"""A slice or an edited model passed back to jaxslice as a target.

It is traced as it is called (``sub(*inputs)``, with its own variables), and its
boundaries are the model's calls that lie in the slice, plus an edit's new nodes:
`js.boundaries` lists them with their own parameter counts (the inputs are no
parameters), `js.intermediates` reads them and `js.slice` cuts a piece of the slice.

Oracles are independent of jaxslice: the layers written out by hand from the variables,
Flax's ``capture_intermediates`` of the unrolled twin of a scanned stack, eager NNX,
Equinox and Keras calls of the model's own submodules, and the parameter sizes read off
the variables.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.models import SCAN_LAYERS, ScannedModel, ScanUnrolled, scan_unrolled_params
from helpers.oracles import assert_trees_all_close, captured, import_keras, random_input


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(8, name="embed")(x))
        h = nn.relu(nn.Dense(8, name="mid")(h))
        return nn.Dense(2, name="head")(h)


X = random_input(0, (4, 3))
H = random_input(1, (5, 8))  # `mid`'s input, at another batch size


@pytest.fixture(scope="module")
def net():
    model = Net()
    return model, model.init(jax.random.key(0), X)


def dense(p, x):
    return x @ p["kernel"] + p["bias"]


def size(p):
    return sum(int(a.size) for a in jax.tree_util.tree_leaves(p))


def test_boundaries_of_a_slice_are_the_model_calls_in_it(net):
    """Not the linen name-scope regions of its program (``Net``, ``Net/head``) with the
    inputs counted as parameters."""
    model, variables = net
    p = variables["params"]
    sub = js.slice(model, variables, X, start="mid")
    table = js.boundaries(sub, H)
    assert table.names() == ["mid", "head"]
    assert [b.param_count for b in table] == [size(p["mid"]), size(p["head"])]
    assert [(b.inputs[0].shape, b.outputs[0].shape) for b in table] == [
        ((5, 8), (5, 8)),
        ((5, 8), (5, 2)),
    ]


def test_intermediates_of_a_slice(net):
    model, variables = net
    p = variables["params"]
    sub = js.slice(model, variables, X, start="mid")
    mid = dense(p["mid"], H)
    want = {"mid": mid, "head": dense(p["head"], jax.nn.relu(mid))}
    assert_trees_all_close(js.intermediates(sub, H), want)
    assert_trees_all_close(
        js.intermediates(sub, H, names=["head:input"]), {"head:input": jax.nn.relu(mid)}
    )


def test_a_slice_of_a_slice_holds_its_own_part(net):
    model, variables = net
    p = variables["params"]
    sub = js.slice(model, variables, X, start="mid")
    first = js.slice(sub, H, end="mid")
    assert isinstance(first, js.Sliced) and list(first.variables["params"]) == ["mid"]
    assert first.variables["params"]["mid"]["kernel"] is p["mid"]["kernel"]
    assert_trees_all_close(first(H), dense(p["mid"], H))
    last = js.slice(sub, H, start="head")
    assert list(last.variables["params"]) == ["head"]
    assert_trees_all_close(last(H), dense(p["head"], H))
    with pytest.raises(js.UnknownBoundaryError):  # before the slice: not one of its calls
        js.slice(sub, H, end="embed")


def test_its_apply_runs_with_the_variables_given(net):
    model, variables = net
    sub = js.slice(model, variables, X, start="mid")
    doubled = jax.tree_util.tree_map(lambda a: 2 * a, sub.variables)
    p = doubled["params"]
    got = js.intermediates(sub.apply, doubled, H, names=["mid"])
    assert_trees_all_close(got, {"mid": dense(p["mid"], H)})


def test_an_edited_model_lists_the_model_calls_and_its_new_nodes(net):
    model, variables = net
    p = variables["params"]
    edited = js.edit(model, variables, X).insert_after("embed", lambda h: 2 * h, name="dbl").build()
    table = js.boundaries(edited, X)
    assert table.names() == ["embed", "dbl", "mid", "head"]
    assert [b.param_count for b in table] == [size(p["embed"]), 0, size(p["mid"]), size(p["head"])]
    embed = dense(p["embed"], X)
    got = js.intermediates(edited, X, names=["dbl", "mid"])
    assert_trees_all_close(got, {"dbl": 2 * embed, "mid": dense(p["mid"], jax.nn.relu(2 * embed))})
    tail = js.slice(edited, X, start="dbl", end="mid")  # from dbl's input, embed's output
    assert list(tail.variables["params"]) == ["mid"]
    assert_trees_all_close(tail(H), dense(p["mid"], jax.nn.relu(2 * H)))


def test_a_slice_of_a_scanned_stack():
    """The loop inside the slice keeps its per-iteration names; values as Flax records
    them in the unrolled twin."""
    model = ScannedModel()
    x = random_input(2, (2, 4))
    variables = model.init(jax.random.key(0), x)
    sub = js.slice(model, variables, x, start="layers")
    twin = captured(ScanUnrolled(), scan_unrolled_params(variables), x)
    h = twin["embed"][0]
    table = js.boundaries(sub, h)
    assert "layers[:]/mlp" in table.names() and table.names()[-1] == "head"
    assert {b.iterations for b in table if b.name.startswith("layers[:]")} == {SCAN_LAYERS}
    got = js.intermediates(sub, h, names=["layers[2]/mlp", "head"])
    assert_trees_all_close(got, {"layers[2]/mlp": twin["layers_2/mlp"][0], "head": twin["head"][0]})


def test_nnx_slices_and_edited_models():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)
            self.c = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.c(jax.nn.relu(self.b(jax.nn.relu(self.a(x)))))

    m = M(nnx.Rngs(0))
    h = random_input(3, (5, 4))
    sub = js.slice(m, X, start="b")
    table = js.boundaries(sub, h)
    assert table.names() == ["b", "c"]
    assert [b.param_count for b in table] == [20, 10]
    assert_trees_all_close(js.intermediates(sub, h, names=["b"]), {"b": m.b(h)})
    first = js.slice(sub, h, end="b")
    assert isinstance(first, nnx.Module)
    assert_trees_all_close(first(h), m.b(h))
    edited = js.edit(m, X).insert_after("a", lambda t: 2 * t, name="dbl").build()
    assert js.boundaries(edited, X).names() == ["a", "dbl", "b", "c"]
    assert_trees_all_close(js.intermediates(edited, X, names=["dbl"]), {"dbl": 2 * m.a(X)})


def test_equinox_slices_and_edited_models():
    eqx = pytest.importorskip("equinox")

    class E(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.a, self.b = eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    e = E(jax.random.key(0))
    x, h = X[0], H[0, :4]
    sub = js.slice(e, x, start="b")
    table = js.boundaries(sub, h)
    assert table.names() == ["b"] and table[0].param_count == 10
    assert_trees_all_close(js.intermediates(sub, h), {"b": e.b(h)})
    edited = js.edit(e, x).insert_after("a", lambda t: -t, name="neg").build()
    assert js.boundaries(edited, x).names() == ["a", "neg", "b"]
    assert_trees_all_close(js.intermediates(edited, x, names=["neg"]), {"neg": -e.a(x)})


def test_keras_and_haiku_slices():
    keras = import_keras()
    from helpers.models import keras_block_model

    model = keras_block_model(keras)
    x = np.asarray(random_input(4, (2, 4)))
    h = np.asarray(random_input(5, (3, 6)))
    sub = js.slice(model, x, start="block")
    assert js.boundaries(sub, h).names() == ["block", "block/a", "block/b", "head"]
    block = model.get_layer("block")
    got = js.intermediates(sub, h, names=["block/a", "block"])
    assert_trees_all_close(got, {"block/a": block.a(h), "block": block(h)}, atol=1e-5)

    hk = pytest.importorskip("haiku")
    f = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([4, 3, 2], name="mlp")(x)))
    params = f.init(jax.random.key(0), X)
    hsub = js.slice(f, params, X, start="mlp/~/linear_1")
    assert js.boundaries(hsub, H[:, :4]).names() == ["mlp/~/linear_1", "mlp/~/linear_2"]
    p = params["mlp/~/linear_1"]
    want = H[:, :4] @ p["w"] + p["b"]
    assert_trees_all_close(
        js.intermediates(hsub, H[:, :4], names=["mlp/~/linear_1"]), {"mlp/~/linear_1": want}
    )
