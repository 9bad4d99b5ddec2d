"""Editing models at their boundaries: `js.edit` with insert_after, replace and remove.

Oracles are independent of jaxslice: hand-written math over the variables, eager
``nn.Module.apply`` of the model's submodules on their own variables, and the arguments
Flax itself passed to each submodule (recorded with ``nn.intercept_methods`` in
``helpers.oracles``). Every test also checks that editing left the original model and its
variables untouched: the same leaf objects, the same values, the same outputs.
"""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxslice as js

from helpers.models import Identity, ResBlock
from helpers.oracles import assert_trees_all_close, leaf_paths, make_zoo, random_input, record_calls

# --------------------------------------------------------------------------- models and oracles


class Block(nn.Module):
    """A container: one Dense layer and a relu."""

    features: int

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(self.features, name="fc")(x))


class Net(nn.Module):
    """stem -> block1 -> ident -> block2 -> head (5 -> 8 -> 8 -> 8 -> 8 -> 3)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(8, name="stem")(x))
        h = Block(8, name="block1")(h)
        h = Identity(name="ident")(h)
        h = Block(8, name="block2")(h)
        return nn.Dense(3, name="head")(h)


def dense(p: Any, x: Any) -> Any:
    return x @ p["kernel"] + p["bias"]


def net_by_hand(params: Any, x: Any, *, after_block1=None, block1=True, head=None) -> Any:
    """Net's forward pass by hand, with optional edits: a function applied after block1,
    block1 bypassed, or another head."""
    h = jax.nn.relu(dense(params["stem"], x))
    if block1:
        h = jax.nn.relu(dense(params["block1"]["fc"], h))
    if after_block1 is not None:
        h = after_block1(h)
    h = jax.nn.relu(dense(params["block2"]["fc"], h))
    return head(h) if head is not None else dense(params["head"], h)


def backbone_by_hand(params: Any, x: Any) -> Any:
    """Net's features after block1 (what an adapter inserted there receives)."""
    return jax.nn.relu(dense(params["block1"]["fc"], jax.nn.relu(dense(params["stem"], x))))


class Snapshot:
    """The model's variables (leaf objects and copies of their values) and its output,
    taken before editing, to check that editing changed none of them."""

    def __init__(self, model: nn.Module, variables: Any, x: Any):
        self.model, self.variables, self.x = model, variables, x
        self.leaves = leaf_paths(variables)
        self.values = {p: np.array(v) for p, v in self.leaves.items()}
        self.output = np.array(model.apply(variables, x))

    def check(self) -> None:
        now = leaf_paths(self.variables)
        assert set(now) == set(self.leaves), "the variables' structure changed"
        for path, leaf in now.items():
            assert leaf is self.leaves[path], f"{path} was replaced"
            np.testing.assert_array_equal(np.asarray(leaf), self.values[path], err_msg=str(path))
        np.testing.assert_array_equal(
            np.asarray(self.model.apply(self.variables, self.x)), self.output
        )


@pytest.fixture(scope="module")
def net():
    return make_zoo(Net(), random_input(20, (4, 5)), seed=20)


@pytest.fixture
def snap(net):
    s = Snapshot(net.model, net.variables, net.x)
    yield s
    s.check()


def names(g: js.Editor) -> list[str]:
    return [b.name for b in g.boundaries()]


# --------------------------------------------------------------------------- insert_after


def test_insert_function_equals_doing_it_by_hand(resnet):
    """Doubling after stage1 of the ResNet equals applying its submodules eagerly with
    Flax and doubling in between."""
    snap = Snapshot(resnet.model, resnet.variables, resnet.x)
    p, bs = resnet.variables["params"], resnet.variables["batch_stats"]
    g = js.edit(resnet.model, resnet.variables, resnet.x).insert_after(
        "stage1", lambda z: 2 * z, name="double"
    )

    def by_hand(x):
        h = nn.relu(nn.Conv(4, (3, 3)).apply({"params": p["stem"]}, x))
        h1 = ResBlock(4).apply({"params": p["stage1"], "batch_stats": bs["stage1"]}, h)
        h2 = ResBlock(8).apply({"params": p["stage2"], "batch_stats": bs["stage2"]}, 2 * h1)
        return nn.Dense(3).apply({"params": p["head"]}, jnp.mean(h2, axis=(1, 2)))

    expected = by_hand(resnet.x)
    sub = g.build()
    assert isinstance(sub, js.Sliced)
    assert_trees_all_close(sub(resnet.x), expected)
    assert_trees_all_close(jax.jit(sub.apply)(sub.variables, resnet.x), expected)
    # Flax's own record of stage1's output, doubled, through the slice after the new node.
    rest = g.slice(start="stage2", end=None)
    assert_trees_all_close(rest(2 * resnet.out_of("stage1")), expected)
    # A new batch size works without editing again.
    x5 = random_input(101, (5, 8, 8, 3))
    assert_trees_all_close(sub(x5), by_hand(x5))
    assert not np.allclose(sub(x5), resnet.model.apply(resnet.variables, x5))
    snap.check()


def test_inserted_linen_adapter_is_trainable_and_matches_hand_computation(net, snap):
    key = jax.random.key(3)
    g = js.edit(net.model, net.variables, net.x).insert_after(
        "block1", nn.Dense(8), key=key, name="adapter"
    )
    sub = g.build()
    params = sub.variables["params"]
    assert set(params) == {"stem", "block1", "block2", "head", "adapter"}
    adapter = params["adapter"]
    assert adapter["kernel"].shape == (8, 8) and adapter["bias"].shape == (8,)
    # Initialised with the given key, as Flax would initialise the module itself.
    assert_trees_all_close(adapter, nn.Dense(8).init(key, jnp.zeros((4, 8)))["params"])
    assert_trees_all_close(g.variables["params"]["adapter"], adapter)

    expected = net_by_hand(net.variables["params"], net.x, after_block1=lambda h: dense(adapter, h))
    assert_trees_all_close(sub(net.x), expected)
    # Every other variable of the edited model is the model's own array, not a copy.
    original = leaf_paths(net.variables)
    for path, leaf in leaf_paths(sub.variables).items():
        if path[1] != "adapter":
            assert leaf is original[path], path

    def loss(variables):
        return jnp.sum(sub.apply(variables, net.x) ** 2)

    grads = jax.jit(jax.grad(loss))(sub.variables)
    for leaf in jax.tree_util.tree_leaves(grads["params"]["adapter"]):
        assert np.all(np.isfinite(leaf)) and np.any(np.abs(leaf) > 0)

    def loss_by_hand(adapter_params):
        out = net_by_hand(
            net.variables["params"], net.x, after_block1=lambda h: dense(adapter_params, h)
        )
        return jnp.sum(out**2)

    assert_trees_all_close(
        grads["params"]["adapter"], jax.grad(loss_by_hand)(adapter), atol=1e-4, rtol=1e-4
    )


def test_insert_after_the_second_call_of_a_shared_module(shared_zoo):
    snap = Snapshot(shared_zoo.model, shared_zoo.variables, shared_zoo.x)
    p = shared_zoo.variables["params"]
    g = js.edit(shared_zoo.model, shared_zoo.variables, shared_zoo.x)
    with pytest.raises(js.SliceError, match=r"shared@0"):
        g.insert_after("shared", lambda z: z + 1)
    g.insert_after("shared@0", lambda z: z + 1, name="plus1")
    h = dense(p["shared"], jnp.tanh(dense(p["shared"], dense(p["stem"], shared_zoo.x)) + 1))
    assert_trees_all_close(g.build()(shared_zoo.x), dense(p["head"], h))
    assert names(g) == ["stem", "shared@0", "plus1", "shared@1", "head"]
    snap.check()


def test_insert_after_a_module_returning_a_tuple_receives_the_tuple(tuple_zoo):
    """The inserted function is ``f(value)`` with the module's output value (here a tuple),
    and returns a value of the same structure."""
    snap = Snapshot(tuple_zoo.model, tuple_zoo.variables, tuple_zoo.x)
    p = tuple_zoo.variables["params"]
    g = js.edit(tuple_zoo.model, tuple_zoo.variables, tuple_zoo.x)
    g.insert_after("pair", lambda ab: (2 * ab[0], ab[1]), name="scale_a")
    a, b = tuple_zoo.out_of("pair")
    assert_trees_all_close(g.build()(tuple_zoo.x), dense(p["head"], 2 * a * b + 2 * a))
    snap.check()


class DictOut(nn.Module):
    @nn.compact
    def __call__(self, x):
        return {"u": nn.Dense(4, name="d")(x)}


class WithDict(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = DictOut(name="enc")(x)
        return nn.Dense(2, name="head")(jnp.tanh(h["u"]))


class DictAdapter(nn.Module):
    @nn.compact
    def __call__(self, h):
        return {"u": h["u"] + nn.Dense(4, name="fc")(h["u"])}


def test_insert_linen_module_after_a_module_returning_a_dict():
    model, x = WithDict(), random_input(21, (2, 3))
    z = make_zoo(model, x, seed=21)
    snap = Snapshot(model, z.variables, x)
    g = js.edit(model, z.variables, x).insert_after(
        "enc", DictAdapter(), key=jax.random.key(0), name="adapter"
    )
    sub = g.build()
    ad = sub.variables["params"]["adapter"]
    p = z.variables["params"]
    u = dense(p["enc"]["d"], x)
    assert_trees_all_close(sub(x), dense(p["head"], jnp.tanh(u + dense(ad["fc"], u))))
    snap.check()


# --------------------------------------------------------------------------- remove


def test_removing_an_identity_module_changes_nothing(identity_zoo):
    snap = Snapshot(identity_zoo.model, identity_zoo.variables, identity_zoo.x)
    g = js.edit(identity_zoo.model, identity_zoo.variables, identity_zoo.x)
    assert g.remove("ident") is g
    assert_trees_all_close(
        g.build()(identity_zoo.x), identity_zoo.model.apply(identity_zoo.variables, identity_zoo.x)
    )
    snap.check()


def test_removing_a_same_shaped_module_bypasses_it(net, snap):
    p = net.variables["params"]
    g = js.edit(net.model, net.variables, net.x).remove("block1")
    assert_trees_all_close(g.build()(net.x), net_by_hand(p, net.x, block1=False))
    # Inside a container: block1 becomes just its relu.
    g = js.edit(net.model, net.variables, net.x).remove("block1/fc")
    expected = net_by_hand(p, net.x, block1=False, after_block1=jax.nn.relu)
    assert_trees_all_close(g.build()(net.x), expected)


def test_removing_a_module_that_changes_the_shape_names_both_shapes(net, snap):
    g = js.edit(net.model, net.variables, net.x)
    with pytest.raises(js.SliceError) as info:
        g.remove("stem")
    message = str(info.value)
    assert "stem" in message
    assert re.search(r"4,\s*5\b", message), message  # input  float32[4, 5]
    assert re.search(r"4,\s*8\b", message), message  # output float32[4, 8]
    with pytest.raises(js.SliceError, match=r"4,\s*3\b"):
        g.remove("head")
    # The failed edits left the editor as it was.
    assert_trees_all_close(g.build()(net.x), net.model.apply(net.variables, net.x))


def test_removing_a_module_that_changes_the_dtype_is_an_error():
    half = js.mark("half", lambda x: x.astype(jnp.float16))

    def model(params, x):
        return half(x * params["w"]).astype(jnp.float32) + params["b"]

    params = {"w": jnp.ones(3), "b": jnp.ones(3)}
    g = js.edit(model, params, jnp.ones((2, 3)))
    with pytest.raises(js.SliceError, match=r"float32[\s\S]*float16"):
        g.remove("half")


def test_removing_a_module_that_changes_the_structure_is_an_error(tuple_zoo):
    g = js.edit(tuple_zoo.model, tuple_zoo.variables, tuple_zoo.x)
    with pytest.raises(js.SliceError, match="pair"):
        g.remove("pair")  # one array in, a tuple of two out


# --------------------------------------------------------------------------- replace


def test_replacing_the_head_gives_new_trainable_parameters(net, snap):
    key = jax.random.key(5)
    g = js.edit(net.model, net.variables, net.x)
    assert g.replace("head", nn.Dense(6), key=key) is g
    sub = g.build()
    new = sub.variables["params"]["head"]
    assert new["kernel"].shape == (8, 6) and new["bias"].shape == (6,)
    assert_trees_all_close(new, nn.Dense(6).init(key, jnp.zeros((4, 8)))["params"])

    features = record_calls(net.model, net.variables, net.x)["head"][0][0][0]  # as Flax saw them
    expected = nn.Dense(6).apply({"params": new}, features)
    out = sub(net.x)
    assert out.shape == (4, 6)
    assert_trees_all_close(out, expected)
    # The new head alone, sliced from the edited model, on the recorded features.
    head_only = g.slice(start="head", end="head")
    assert set(leaf_paths(head_only.variables)) == {
        ("params", "head", "kernel"),
        ("params", "head", "bias"),
    }
    assert_trees_all_close(head_only(features), expected)

    def loss(variables):
        return jnp.mean((sub.apply(variables, net.x) - 1.0) ** 2)

    grads = jax.grad(loss)(sub.variables)["params"]["head"]
    assert grads["kernel"].shape == (8, 6)
    for leaf in jax.tree_util.tree_leaves(grads):
        assert np.any(np.abs(leaf) > 0)
    expected_grads = jax.grad(
        lambda q: jnp.mean((nn.Dense(6).apply({"params": q}, features) - 1.0) ** 2)
    )(new)
    assert_trees_all_close(grads, expected_grads, atol=1e-4, rtol=1e-4)


def test_replacing_a_module_with_a_function(net, snap):
    p = net.variables["params"]
    g = js.edit(net.model, net.variables, net.x).replace("block1", lambda h: jnp.tanh(h))
    assert_trees_all_close(
        g.build()(net.x), net_by_hand(p, net.x, block1=False, after_block1=jnp.tanh)
    )


# --------------------------------------------------------------------------- composition


def test_edits_compose(net, snap):
    p = net.variables["params"]
    x = net.x
    g = js.edit(net.model, net.variables, x)
    g.insert_after("block1", lambda h: h + 1, name="plus1").insert_after(
        "plus1", lambda h: 3 * h, name="times3"
    )
    assert_trees_all_close(g.build()(x), net_by_hand(p, x, after_block1=lambda h: 3 * (h + 1)))
    assert (
        names(g).index("block1/fc")
        < names(g).index("plus1")
        < names(g).index("times3")
        < names(g).index("ident")
    )

    g.replace("plus1", lambda h: h - 1)  # replace an inserted node
    assert_trees_all_close(g.build()(x), net_by_hand(p, x, after_block1=lambda h: 3 * (h - 1)))

    g.remove("plus1")  # remove an inserted node: the node after it moves up
    assert "plus1" not in names(g)
    assert_trees_all_close(g.build()(x), net_by_hand(p, x, after_block1=lambda h: 3 * h))

    g.remove("times3")
    assert "times3" not in names(g)
    assert_trees_all_close(g.build()(x), net.model.apply(net.variables, x))


def test_linen_nodes_compose(net, snap):
    p = net.variables["params"]
    x = net.x
    g = js.edit(net.model, net.variables, x)
    g.insert_after("block1", nn.Dense(8), key=jax.random.key(1), name="adapter")
    first = g.variables["params"]["adapter"]
    g.insert_after("adapter", nn.Dense(8, use_bias=False), key=jax.random.key(2), name="mix")
    mix = g.variables["params"]["mix"]
    assert set(mix) == {"kernel"}
    expected = net_by_hand(p, x, after_block1=lambda h: dense(first, h) @ mix["kernel"])
    assert_trees_all_close(g.build()(x), expected)

    # Replace the inserted adapter by another module: it gets its own new variables.
    g.replace("adapter", nn.Dense(8, use_bias=False), key=jax.random.key(4))
    second = g.variables["params"]["adapter"]
    assert set(second) == {"kernel"}
    assert not np.allclose(second["kernel"], first["kernel"])
    sub = g.build()
    assert_trees_all_close(sub.variables["params"]["adapter"], second)
    expected = net_by_hand(p, x, after_block1=lambda h: h @ second["kernel"] @ mix["kernel"])
    assert_trees_all_close(sub(x), expected)

    # Removing inserted modules takes their variables out of the edited model.
    g.remove("adapter").remove("mix")
    assert "adapter" not in g.variables["params"] and "mix" not in g.variables["params"]
    assert_trees_all_close(g.build()(x), net.model.apply(net.variables, x))


# --------------------------------------------------------------------------- inserted nodes are boundaries


def test_inserted_nodes_are_boundaries(net, snap):
    x = net.x
    p = net.variables["params"]
    g = js.edit(net.model, net.variables, x).insert_after(
        "block1", nn.Dense(8), key=jax.random.key(7), name="adapter"
    )
    assert names(g) == [
        "stem",
        "block1",
        "block1/fc",
        "adapter",
        "ident",
        "block2",
        "block2/fc",
        "head",
    ]
    by_name = {b.name: b for b in g.boundaries()}
    assert by_name["adapter"].module_type == "Dense"
    assert by_name["adapter"].param_count == 8 * 8 + 8
    assert [o.shape for o in by_name["adapter"].outputs] == [(4, 8)]

    adapter = g.variables["params"]["adapter"]
    features = backbone_by_hand(p, x)
    tail = g.slice(start="adapter", end="head")  # the adapter's input: the adapter is in
    assert set(tail.variables["params"]) == {"adapter", "block2", "head"}
    expected = net_by_hand(p, x, after_block1=lambda h: dense(adapter, h))
    assert_trees_all_close(tail(features), expected)
    after = g.slice(start="adapter:output", end="head")  # the adapter's output: it is out
    assert set(after.variables["params"]) == {"block2", "head"}
    assert_trees_all_close(after(dense(adapter, features)), expected)
    front = g.slice(end="adapter")
    assert_trees_all_close(front(x), dense(adapter, features))


def test_edited_boundaries_report_the_same_parameter_counts_as_the_model(resnet):
    """Edited models list untouched modules exactly as `js.boundaries` lists them on the
    original (BatchNorm statistics are not parameters)."""
    original = {b.name: b for b in js.boundaries(resnet.model, resnet.variables, resnet.x)}
    g = js.edit(resnet.model, resnet.variables, resnet.x).insert_after(
        "stage1", lambda z: 2 * z, name="double"
    )
    edited = {b.name: b for b in g.boundaries()}
    assert set(edited) == set(original) | {"double"}
    for name, b in original.items():
        assert edited[name].module_type == b.module_type, name
        assert edited[name].outputs == b.outputs, name
        assert edited[name].param_count == b.param_count, name


# --------------------------------------------------------------------------- plain functions


@js.mark("enc")
def _enc(p, x):
    return jnp.tanh(x @ p["w"])


@js.mark("mid")
def _mid(p, h):
    return jnp.sin(h @ p["w"])


@js.mark("dec")
def _dec(p, h):
    return h @ p["w"]


def plain_model(params, x):
    return _dec(params["dec"], _mid(params["mid"], _enc(params["enc"], x)))


def _plain_params():
    rng = np.random.default_rng(9)
    return {
        "enc": {"w": jnp.asarray(rng.normal(size=(3, 6)) / np.sqrt(3), jnp.float32)},
        "mid": {"w": jnp.asarray(rng.normal(size=(6, 6)) / np.sqrt(6), jnp.float32)},
        "dec": {"w": jnp.asarray(rng.normal(size=(6, 2)) / np.sqrt(6), jnp.float32)},
    }


def test_plain_function_edits():
    params = _plain_params()
    x = random_input(22, (4, 3))
    leaves = leaf_paths(params)
    values = {k: np.array(v) for k, v in leaves.items()}
    before = np.array(plain_model(params, x))
    enc = jnp.tanh(x @ params["enc"]["w"])
    mid = jnp.sin(enc @ params["mid"]["w"])

    g = js.edit(plain_model, params, x).insert_after("enc", lambda h: h * h, name="square")
    assert [b.name for b in g.boundaries()] == ["enc", "square", "mid", "dec"]
    assert_trees_all_close(
        g.build()(x), jnp.sin((enc * enc) @ params["mid"]["w"]) @ params["dec"]["w"]
    )

    key = jax.random.key(8)
    g = js.edit(plain_model, params, x).insert_after("mid", nn.Dense(6), key=key, name="adapter")
    sub = g.build()
    ad = sub.variables["adapter"]["params"]
    assert_trees_all_close(ad, nn.Dense(6).init(key, jnp.zeros((4, 6)))["params"])
    assert_trees_all_close(sub(x), dense(ad, mid) @ params["dec"]["w"])
    grads = jax.grad(lambda v: jnp.sum(sub.apply(v, x) ** 2))(sub.variables)
    assert all(np.any(np.abs(leaf) > 0) for leaf in jax.tree_util.tree_leaves(grads["adapter"]))
    assert_trees_all_close(g.slice(start="adapter", end="adapter")(mid), dense(ad, mid))

    g = js.edit(plain_model, params, x).replace("dec", lambda h: jnp.sum(h, axis=-1))
    assert_trees_all_close(g.build()(x), jnp.sum(mid, axis=-1))

    g = js.edit(plain_model, params, x).remove("mid")
    assert_trees_all_close(g.build()(x), enc @ params["dec"]["w"])
    with pytest.raises(js.SliceError, match=r"4,\s*6\b[\s\S]*4,\s*2\b"):
        g.remove("dec")

    np.testing.assert_array_equal(np.array(plain_model(params, x)), before)
    for path, leaf in leaf_paths(params).items():
        assert leaf is leaves[path]
        np.testing.assert_array_equal(np.asarray(leaf), values[path])


# --------------------------------------------------------------------------- fine-tuning an adapter


def test_training_only_the_adapter_with_optax_decreases_the_loss(net, snap):
    x = net.x
    target = jnp.asarray(np.random.default_rng(23).normal(size=(4, 3)), jnp.float32)
    g = js.edit(net.model, net.variables, x).insert_after(
        "block1", nn.Dense(8), key=jax.random.key(9), name="adapter"
    )
    sub = g.build()
    variables = sub.variables
    frozen = {k: v for k, v in leaf_paths(variables).items() if k[1] != "adapter"}

    def loss_fn(adapter, variables):
        params = {**variables["params"], "adapter": adapter}
        return jnp.mean((sub.apply({**variables, "params": params}, x) - target) ** 2)

    tx = optax.adam(3e-2)
    adapter = variables["params"]["adapter"]
    opt_state = tx.init(adapter)

    @jax.jit
    def step(adapter, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(adapter, variables)
        updates, opt_state = tx.update(grads, opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state, loss

    losses = []
    for _ in range(60):
        adapter, opt_state, loss = step(adapter, opt_state)
        losses.append(float(loss))
    final = float(loss_fn(adapter, variables))
    assert final < 0.8 * losses[0], losses
    assert losses[-1] < losses[len(losses) // 2] < losses[0], losses
    # Only the adapter moved; everything else is still the model's own arrays.
    for path, leaf in leaf_paths(sub.variables).items():
        if path in frozen:
            assert leaf is frozen[path]
    # The trained adapter in the edited model equals the hand computation.
    trained = {**variables, "params": {**variables["params"], "adapter": adapter}}
    expected = net_by_hand(net.variables["params"], x, after_block1=lambda h: dense(adapter, h))
    assert_trees_all_close(sub.apply(trained, x), expected)


# --------------------------------------------------------------------------- errors


def test_unknown_names_suggest_the_closest(net, snap):
    g = js.edit(net.model, net.variables, net.x)
    for edit in (
        lambda: g.insert_after("blok1", lambda h: h),
        lambda: g.replace("blok1", lambda h: h),
        lambda: g.remove("blok1"),
    ):
        with pytest.raises(js.SliceError, match="block1"):
            edit()
    with pytest.raises(js.SliceError, match="block1"):
        g.insert_after("fc", lambda h: h)  # a leaf name is not a path


def test_linen_module_without_key_is_an_error(net, snap):
    g = js.edit(net.model, net.variables, net.x)
    with pytest.raises(js.SliceError, match="key"):
        g.insert_after("block1", nn.Dense(8))
    with pytest.raises(js.SliceError, match="key"):
        g.replace("head", nn.Dense(3))
    assert names(g) == ["stem", "block1", "block1/fc", "ident", "block2", "block2/fc", "head"]


def test_duplicate_node_names_are_errors(net, snap):
    g = js.edit(net.model, net.variables, net.x)
    with pytest.raises(js.SliceError, match="block2"):
        g.insert_after("block1", lambda h: h, name="block2")
    g.insert_after("block1", lambda h: h, name="same")
    with pytest.raises(js.SliceError, match="same"):
        g.insert_after("block2", lambda h: h, name="same")
    with pytest.raises(js.SliceError):
        g.insert_after("block2", lambda h: h, name="a:b")
    assert names(g).count("same") == 1


def test_edits_that_break_the_model_are_errors_and_change_nothing(net, snap):
    g = js.edit(net.model, net.variables, net.x)
    g.insert_after("block1", lambda h: h + 1, name="plus1")
    expected = net_by_hand(net.variables["params"], net.x, after_block1=lambda h: h + 1)
    with pytest.raises(js.SliceError, match="narrow"):
        g.insert_after("block1", lambda h: h[:, :3], name="narrow")  # block2 reads 8 features
    with pytest.raises(js.SliceError, match="block1"):
        g.replace("block1", nn.Dense(5), key=jax.random.key(0))
    with pytest.raises(js.SliceError, match="plus1"):
        g.replace("plus1", lambda h: jnp.concatenate([h, h], axis=-1))
    with pytest.raises(js.SliceError):
        g.replace("block2", 42)
    assert "narrow" not in names(g)
    assert "narrow" not in g.variables["params"]
    assert_trees_all_close(g.build()(net.x), expected)


def test_replacing_a_shared_module_by_a_linen_module_is_an_error(shared_zoo):
    g = js.edit(shared_zoo.model, shared_zoo.variables, shared_zoo.x)
    with pytest.raises(js.SliceError, match="shared"):
        g.replace("shared@1", nn.Dense(4), key=jax.random.key(0))
    p = shared_zoo.variables["params"]
    g.replace("shared@1", jnp.tanh)  # a function is fine
    h = jnp.tanh(jnp.tanh(dense(p["shared"], dense(p["stem"], shared_zoo.x))))
    assert_trees_all_close(g.build()(shared_zoo.x), dense(p["head"], h))


class TrainNet(nn.Module):
    """Dense -> BatchNorm -> Dropout -> Dense; `double` doubles fc's output by hand."""

    double: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Dense(4, name="fc")(x)
        h = 2 * h if self.double else h
        h = nn.BatchNorm(use_running_average=not train, name="bn")(h)
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(2, name="head")(h)


def test_an_edited_model_in_train_mode_updates_statistics_as_linen_does():
    x = random_input(3, (6, 5))
    variables = TrainNet().init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(1)}
    g = js.edit(TrainNet(), variables, x, train=True, rngs=rngs)
    edited = g.insert_after("fc", lambda h: 2 * h).build()
    got, state = edited.apply(edited.variables, x, rngs=rngs, mutable=["batch_stats"])
    want, want_state = TrainNet(double=True).apply(
        variables, x, train=True, rngs=rngs, mutable=["batch_stats"]
    )
    assert_trees_all_close(got, want)
    assert_trees_all_close(state, want_state)
    with pytest.raises(js.SliceError, match="batch_stats"):  # linen raises without mutable
        edited.apply(edited.variables, x, rngs=rngs)


def test_an_edited_model_takes_a_positional_flag_as_the_model_does():
    """``model(x, train)`` with `train` positional: edited and called as the model is."""
    x = random_input(3, (6, 5))
    variables = TrainNet().init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(1)}
    want = TrainNet(double=True).apply(variables, x, False)
    edited = js.edit(TrainNet(), variables, x, False).insert_after("fc", lambda h: 2 * h).build()
    assert_trees_all_close(edited(x, False), want)
    assert_trees_all_close(edited(x), want)
    g = js.edit(TrainNet(), variables, x, True, rngs=rngs)
    edited = g.insert_after("fc", lambda h: 2 * h).build()
    got, state = edited.apply(edited.variables, x, True, rngs=rngs, mutable=["batch_stats"])
    want, want_state = TrainNet(double=True).apply(
        variables, x, True, rngs=rngs, mutable=["batch_stats"]
    )
    assert_trees_all_close(got, want)
    # The statistics the edited model updated go back to the model; the rest is its own.
    merged = edited.merge(variables, state)
    assert_trees_all_close(merged["batch_stats"], want_state["batch_stats"])
    for path, leaf in leaf_paths(merged["params"]).items():
        assert leaf is leaf_paths(variables["params"])[path]


def test_a_call_time_input_may_be_a_python_number(net, snap):
    g = js.edit(net.model, net.variables, net.x)
    edited = g.insert_after("block1", lambda h, s: h * s, inputs={"s": jnp.float32(1)}).build()
    want = net_by_hand(net.variables["params"], net.x, after_block1=lambda h: h * 3)
    for s in (3.0, np.float32(3.0), jnp.float32(3.0), 3.0):
        assert_trees_all_close(edited(net.x, s=s), want)
    with pytest.raises(js.SliceError, match="'s'"):  # another dtype is still named
        edited(net.x, s=3)


@pytest.mark.parametrize("name", ["a[0]", "a/b", "a@1", "a:b", "a\\b", "a]"])
def test_node_names_that_would_read_as_paths_or_ports_are_refused(net, snap, name):
    g = js.edit(net.model, net.variables, net.x)
    with pytest.raises(js.InvalidSpecError, match="node name"):
        g.insert_after("block1", lambda h: h, name=name)
    assert names(g) == ["stem", "block1", "block1/fc", "ident", "block2", "block2/fc", "head"]


def test_an_edited_model_lists_the_models_names(net):
    """Method calls keep their method (``ae.encode``) and marks their scope path
    (``grp/lin``) in the edited model, as `js.boundaries` lists them for the model."""

    class AutoEncoder(nn.Module):
        def setup(self):
            self.enc, self.dec = nn.Dense(3), nn.Dense(5)

        def encode(self, x):
            return self.enc(x)

        def __call__(self, x):
            return self.dec(self.encode(x))

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            ae = AutoEncoder(name="ae")
            return ae.encode(x) * 2 + ae(x)[:, :3]

    x = random_input(4, (2, 5))
    model = Twice()
    variables = model.init(jax.random.key(0), x)
    listed = [b.name for b in js.boundaries(model, variables, x)]
    g = js.edit(model, variables, x).insert_after("ae/dec", jnp.tanh, name="squash")
    assert [n for n in names(g) if n != "squash"] == listed
    p = variables["params"]["ae"]
    encoded = dense(p["enc"], x)
    want = encoded * 2 + jnp.tanh(dense(p["dec"], encoded))[:, :3]
    assert_trees_all_close(g.slice(start="ae.encode@1", end=None)(x), want)

    def f(w, x):
        with jax.named_scope("grp"):
            return js.mark("lin")(lambda h: h @ w)(x)

    w = jnp.ones((5, 5))
    listed = [b.name for b in js.boundaries(f, w, x)]
    g = js.edit(f, w, x).insert_after("grp/lin", jnp.sin, name="s")
    assert [n for n in names(g) if n != "s"] == listed
    assert_trees_all_close(g.slice(end="grp/lin")(x), x @ w)


# --------------------------------------------------------------------------- merging after edits


class Residual(nn.Module):
    """``h + Dense(h)``, the Dense starting at zero: an adapter that starts as a no-op."""

    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(h.shape[-1], kernel_init=nn.initializers.zeros, name="fc")(h)


def test_trained_weights_go_back_to_the_model_and_the_nodes_apart(net, snap):
    """Training the model and an adapter together, then `merge` (the model as trained,
    without the adapter) and `nodes` (the adapter's variables): both equal the same sgd
    steps taken by hand with `jax.grad` of the forward pass written with the adapter."""
    x, params = net.x, net.variables["params"]
    y = jnp.asarray(np.random.default_rng(5).normal(size=(4, 3)), jnp.float32)
    g = js.edit(net.model, net.variables, x)
    edited = g.insert_after("block1", Residual(), key=jax.random.key(2), name="adapter").build()

    def by_hand(model_params, fc):
        after = lambda h: h + dense(fc, h)  # noqa: E731
        return jnp.mean((net_by_hand(model_params, x, after_block1=after) - y) ** 2)

    def sgd(tree, grads):
        return jax.tree.map(lambda w, d: w - 0.2 * d, tree, grads)

    trained = edited.variables
    want, want_fc = params, trained["params"]["adapter"]["fc"]
    tx = optax.sgd(0.2)
    state = tx.init(trained)
    for _ in range(3):
        grads = jax.grad(lambda v: jnp.mean((edited.apply(v, x) - y) ** 2))(trained)
        updates, state = tx.update(grads, state)
        trained = optax.apply_updates(trained, updates)
        grad_model, grad_fc = jax.grad(by_hand, argnums=(0, 1))(want, want_fc)
        want, want_fc = sgd(want, grad_model), sgd(want_fc, grad_fc)
    merged = edited.merge(net.variables, trained)
    assert sorted(merged["params"]) == sorted(params)
    assert_trees_all_close(merged["params"], want, atol=1e-5, rtol=1e-5)
    assert not np.allclose(merged["params"]["stem"]["kernel"], params["stem"]["kernel"])
    # The model runs as trained, without the adapter.
    assert_trees_all_close(net.model.apply(merged, x), net_by_hand(want, x), atol=1e-5)
    # The adapter's variables apart, as its module takes them.
    nodes = edited.nodes(trained)
    assert list(nodes) == ["adapter"]
    assert_trees_all_close(nodes["adapter"]["params"]["fc"], want_fc, atol=1e-5, rtol=1e-5)
    h = backbone_by_hand(want, x)
    assert_trees_all_close(Residual().apply(nodes["adapter"], h), h + dense(want_fc, h), atol=1e-5)
    # A part (only the head and the adapter trained): the rest stays the model's own.
    part = {"params": {k: trained["params"][k] for k in ("head", "adapter")}}
    merged = edited.merge(net.variables, part)
    assert merged["params"]["stem"]["kernel"] is params["stem"]["kernel"]
    assert_trees_all_close(merged["params"]["head"], trained["params"]["head"])
    assert_trees_all_close(edited.nodes(part)["adapter"], nodes["adapter"])
    with pytest.raises(js.VariablesMismatchError):  # a model entry of another shape
        edited.merge(net.variables, {"params": {"head": {"bias": jnp.ones(5)}}})
