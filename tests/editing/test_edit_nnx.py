"""Editing Flax NNX models: NNX modules as new nodes, the edited model an `nnx.Module`.

Oracles are independent of jaxslice: *twins* written by hand in NNX, holding the model's
own submodules (or modules built from copies of its weights) with the new node called in
place, trained with the same `nnx.Optimizer` step; eager calls of the submodules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxslice as js  # noqa: E402

from helpers.models import SCAN_WIDTH, eager_rows, nnx_scanned  # noqa: E402

N, D = 4, SCAN_WIDTH
X = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)), jnp.float32)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.fc(x))


class Net(nnx.Module):
    def __init__(self, rngs, dropout=0.0):
        self.stem = nnx.Linear(4, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.drop(h))


class Adapter(nnx.Module):
    def __init__(self, rngs):
        self.down = nnx.Linear(D, 2, rngs=rngs)
        self.up = nnx.Linear(2, D, rngs=rngs)

    def __call__(self, h):
        return h + self.up(self.down(h))


class Twin(nnx.Module):
    """Net with an adapter after blocks/0, written by hand around the same modules."""

    def __init__(self, net, adapter):
        self.net, self.adapter = net, adapter

    def __call__(self, x):
        m = self.net
        h = self.adapter(m.blocks[0](m.stem(x)))
        return m.head(m.drop(m.blocks[1](h)))


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def params(module):
    return jax.tree_util.tree_map(np.asarray, nnx.state(module, nnx.Param))


def test_an_inserted_nnx_module_trains_with_the_model_in_place():
    model, adapter = Net(nnx.Rngs(0)), Adapter(nnx.Rngs(1))
    edited = js.edit(model, X).insert_after("blocks/0", adapter, name="adapter").build()
    assert isinstance(edited, nnx.Module)
    twin = Twin(Net(nnx.Rngs(0)), Adapter(nnx.Rngs(1)))  # the same weights, other objects
    close(edited(X), twin(X))
    y = jnp.ones((5, 3))

    def loss(m):
        return jnp.mean((m(X) - y) ** 2)

    @nnx.jit
    def step(m, opt):
        value, grads = nnx.value_and_grad(loss)(m)
        opt.update(m, grads)
        return value

    opt = nnx.Optimizer(edited, optax.adam(0.05), wrt=nnx.Param)
    twin_opt = nnx.Optimizer(twin, optax.adam(0.05), wrt=nnx.Param)
    before = params(model)
    for _ in range(3):
        close(step(edited, opt), step(twin, twin_opt))
    # The original model and the adapter moved exactly as the hand-written twin's did.
    jax.tree_util.tree_map(close, params(model), params(twin.net))
    jax.tree_util.tree_map(close, params(adapter), params(twin.adapter))
    assert not np.allclose(before["stem"]["kernel"][...], params(model)["stem"]["kernel"][...])
    close(edited(X), twin(X))


def test_removing_the_node_leaves_the_trained_model():
    model, adapter = Net(nnx.Rngs(0)), Adapter(nnx.Rngs(1))
    g = js.edit(model, X).insert_after("blocks/0", adapter, name="adapter")
    edited = g.build()
    grads = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(edited)
    nnx.Optimizer(edited, optax.sgd(0.1), wrt=nnx.Param).update(edited, grads)
    g.remove("adapter")
    plain = g.build()
    close(plain(X), model(X))  # the model as trained, without the adapter
    assert "adapter" not in [b.name for b in g.boundaries()]


def rng_counts(module):
    return [int(c) for c in jax.tree_util.tree_leaves(nnx.state(module, nnx.RngCount))]


def test_modes_switch_the_model_and_the_nodes():
    model, adapter = Net(nnx.Rngs(0), dropout=0.5), Adapter(nnx.Rngs(1))
    model.eval()
    edited = js.edit(model, X).insert_after("blocks/0", adapter).build()
    twin = Twin(Net(nnx.Rngs(0), dropout=0.5), Adapter(nnx.Rngs(1)))  # same weights and keys
    twin.eval()
    close(edited(X), twin(X))
    edited.train()  # dropout on: the model draws and updates its RNG counter
    twin.train()
    assert not model.drop.deterministic
    before = rng_counts(model)
    out = edited(X)
    assert sum(rng_counts(model)) == sum(before) + 1  # the updated counter is written back
    close(out, twin(X))  # the same draw as the twin's from the same RNG state
    assert not np.allclose(np.asarray(edited(X)), np.asarray(out))  # the next draw differs
    edited.eval()
    twin.eval()
    close(edited(X), twin(X))


def test_a_node_that_updates_its_state_is_refused_with_advice():
    model = Net(nnx.Rngs(0))
    norm = nnx.BatchNorm(D, rngs=nnx.Rngs(2))
    with pytest.raises(js.SliceError, match=r"eval\(\)"):
        js.edit(model, X).insert_after("blocks/1", norm)
    norm.eval()
    edited = js.edit(model, X).insert_after("blocks/1", norm).build()
    m = model
    close(edited(X), m.head(norm(m.blocks[1](m.blocks[0](m.stem(X))))))


def test_call_time_steering_on_an_nnx_model_and_export():
    model = Net(nnx.Rngs(0))
    edited = js.edit(model, X).insert_after("blocks/1", lambda h, v: h + v, inputs=("v",)).build()
    v = jnp.linspace(0, 1, 5 * D).reshape(5, D)
    m = model
    want = m.head(m.blocks[1](m.blocks[0](m.stem(X))) + v)
    close(edited(X, v=v), want)
    exported = edited.export()
    xs = jnp.ones((7, 4))
    vs = jnp.ones((7, D))
    close(exported.call(xs, v=vs), m.head(m.blocks[1](m.blocks[0](m.stem(xs))) + vs))


# --------------------------------------------------------------------------- edits that break the model


def eager_net(m, x, after_fc=lambda h: h, fc=None):
    """Net by hand, with `after_fc` applied after (or `fc` in place of) blocks/0/fc."""
    h = m.stem(x)
    h = jax.nn.relu(after_fc((fc or m.blocks[0].fc)(h)))  # blocks/0
    return m.head(m.drop(m.blocks[1](h)))


BREAKING = {  # a node that returns what blocks/0's relu and blocks/1 cannot read
    "three features": lambda: nnx.Linear(D, 3, rngs=nnx.Rngs(5)),
    "another dtype": lambda: lambda h: h.astype(jnp.bfloat16),
}


@pytest.mark.parametrize("node", list(BREAKING))
def test_an_insert_that_breaks_the_model_is_refused_and_changes_nothing(node):
    model = Net(nnx.Rngs(0))
    g = js.edit(model, X)
    names = [b.name for b in g.boundaries()]
    with pytest.raises(js.SliceError, match="breaks the model"):
        g.insert_after("blocks/0/fc", BREAKING[node](), name="bad")
    with pytest.raises(js.SliceError, match="breaks the model"):
        g.replace("blocks/0/fc", BREAKING[node]())
    assert [b.name for b in g.boundaries()] == names
    close(g.build()(X), eager_net(model, X))
    adapter = Adapter(nnx.Rngs(1))  # a valid edit afterwards
    edited = g.insert_after("blocks/0/fc", adapter, name="adapter").build()
    close(edited(X), eager_net(model, X, after_fc=adapter))


def test_a_replacement_of_the_right_shape_after_a_refused_one():
    model = Net(nnx.Rngs(0))
    g = js.edit(model, X)
    with pytest.raises(js.SliceError, match="breaks the model"):
        g.replace("blocks/0/fc", nnx.Linear(D, 3, rngs=nnx.Rngs(5)))
    fc = nnx.Linear(D, D, rngs=nnx.Rngs(6))
    close(g.replace("blocks/0/fc", fc).build()(X), eager_net(model, X, fc=fc))


class Split(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h):
        return {"h": self.fc(h), "skip": h}  # one array in, a dict of two out


class Forked(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Linear(4, D, rngs=rngs)
        self.split = Split(rngs)
        self.mid = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        parts = self.split(self.stem(x))
        return self.head(jax.nn.relu(self.mid(parts["h"])) + parts["skip"])


def test_removing_a_call_whose_output_differs_from_its_input_is_refused():
    model = Forked(nnx.Rngs(0))
    g = js.edit(model, X)
    with pytest.raises(js.SliceError, match=r"split[\s\S]*skip"):
        g.remove("split")  # its output is a dict, its input one array
    with pytest.raises(js.SliceError, match=rf"stem[\s\S]*5,\s*4\b[\s\S]*5,\s*{D}\b"):
        g.remove("stem")  # (5, 4) in, (5, D) out
    m = model
    edited = g.remove("mid").build()  # the failed edits left the editor as it was
    h = m.split(m.stem(X))
    close(edited(X), m.head(jax.nn.relu(h["h"]) + h["skip"]))


# --------------------------------------------------------------------------- plain array attributes


class Shifted(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Linear(4, D, rngs=rngs)
        self.shift = jnp.arange(D, dtype=jnp.float32)  # a plain array, not an nnx.Variable
        self.head = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.stem(x) + self.shift))


class Offset(nnx.Module):
    def __init__(self):
        self.offset = jnp.ones(D)  # a plain array, not an nnx.Variable

    def __call__(self, h):
        return h + self.offset


def test_plain_array_attributes_of_the_model_and_a_node_are_read_at_every_call():
    model, node = Shifted(nnx.Rngs(0)), Offset()
    edited = js.edit(model, X).insert_after("stem", node, name="offset").build()
    for scale in (1.0, -3.0):  # the arrays as made, then other arrays in their place
        model.shift = jnp.arange(D, dtype=jnp.float32) * scale
        node.offset = jnp.linspace(-1.0, 1.0, D) * scale
        close(edited(X), model.head(jax.nn.relu(model.stem(X) + node.offset + model.shift)))


# --------------------------------------------------------------------------- nnx.scan


def NScanned(rngs):  # noqa: N802 - the model's constructor
    return nnx_scanned(rngs, layers=N)


def eager_layers(model):
    """The stacked layers as N eager NNX modules (the oracle)."""
    return eager_rows(model.layers)


class Lora(nnx.Module):
    def __init__(self, rngs):
        self.down = nnx.Linear(D, 2, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(2, D, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return h + self.up(self.down(h))


def test_stacked_nnx_adapters_in_every_layer_of_an_nnx_scan():
    model = NScanned(nnx.Rngs(0))

    @nnx.split_rngs(splits=N)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Lora(rngs)

    lora = make(nnx.Rngs(3))
    edited = js.edit(model, X).insert_after("layers[:]/mlp", lora, name="lora").build()
    layers, rows = eager_layers(model), eager_rows(lora)
    h = model.embed(X)
    for layer, row in zip(layers, rows, strict=True):
        h = h + row(layer.mlp(jnp.tanh(layer.attn(h))))
    close(edited(X), model.head(h))
    with pytest.raises(js.SliceError, match=r"leading axes \[4\]"):
        js.edit(model, X).insert_after("layers[:]/mlp", Lora(nnx.Rngs(4)))


def test_patch_one_layer_of_an_nnx_scan_in_a_vmapped_sweep():
    model = NScanned(nnx.Rngs(1))
    edited = js.edit(model, X).replace("layers[2]/mlp", lambda h, new: new, inputs=("new",)).build()
    patches = jax.random.normal(jax.random.key(0), (3, 5, D))
    got = jax.vmap(lambda p: edited(X, new=p))(patches)
    layers = eager_layers(model)
    for i in range(3):
        h = model.embed(X)
        for k, layer in enumerate(layers):
            h = h + (patches[i] if k == 2 else layer.mlp(jnp.tanh(layer.attn(h))))
        close(got[i], model.head(h))
