"""Ports in editing: ``insert_after("block:input", f)`` acts on what ``block`` receives.

``insert_after(name)`` and ``insert_after("name:output")`` act on a module's output;
``insert_after("name:input")`` transforms the module's input, so the module computes on
``f(input)``. ``replace`` and ``remove`` act on whole calls and refuse a port suffix with
an `InvalidSpecError` that suggests the bare name.

Oracles are hand-written math over the model's own parameters. Every test also checks
that the original model and variables are untouched, that editor methods chain, that a
failed edit leaves the editor as it was, and that ``copy`` branches independently.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, leaf_paths

# --------------------------------------------------------------------------- model and oracles


class Block(nn.Module):
    """relu(fc(x)): a container with one Dense layer."""

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(8, name="fc")(x))


class Net(nn.Module):
    """stem (5 -> 8), relu, block (8 -> 8), head (8 -> 3)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(8, name="stem")(x))
        h = Block(name="block")(h)
        return nn.Dense(3, name="head")(h)


class SharedNet(nn.Module):
    """One Dense called twice: ``shared@0`` then ``shared@1``."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(4, name="shared")
        h = jnp.tanh(shared(x))
        return shared(h)


def dense(p: Any, x: Any) -> Any:
    return x @ p["kernel"] + p["bias"]


def stem_out(p: Any, x: Any) -> Any:
    """What ``block`` receives."""
    return jax.nn.relu(dense(p["stem"], x))


def block_out(p: Any, h: Any) -> Any:
    return jax.nn.relu(dense(p["block"]["fc"], h))


def net_oracle(
    p: Any,
    x: Any,
    *,
    pre_stem=lambda z: z,
    pre_block=lambda z: z,
    pre_fc=lambda z: z,
    post_block=lambda z: z,
) -> Any:
    """The Net with functions applied on stem's input, block's input, fc's input, block's output."""
    h = stem_out(p, pre_stem(x))
    h = pre_block(h)
    h = jax.nn.relu(dense(p["block"]["fc"], pre_fc(h)))
    h = post_block(h)
    return dense(p["head"], h)


def double(z):
    return 2.0 * z


def shift(z):
    return z - 0.25


def square(z):
    return z * z


@pytest.fixture(scope="module")
def net():
    model = Net()
    x = jax.random.normal(jax.random.key(1), (4, 5))
    variables = model.init(jax.random.key(0), x)
    # Non-zero biases, so a bias applied to the wrong value shows up.
    variables = jax.tree_util.tree_map(
        lambda a: a + 0.1 * jax.random.normal(jax.random.key(7), a.shape), variables
    )
    return model, variables, x


@pytest.fixture
def pristine(net):
    """Records the model's variables (leaf objects and values) and output before a test."""
    model, variables, x = net
    leaves = leaf_paths(variables)
    values = {k: np.array(v) for k, v in leaves.items()}
    out = np.array(model.apply(variables, x))
    yield
    after = leaf_paths(variables)
    assert set(after) == set(leaves), "editing changed the variables' structure"
    for path, leaf in after.items():
        assert leaf is leaves[path], f"{path} was replaced"
        np.testing.assert_array_equal(np.asarray(leaf), values[path], err_msg=str(path))
    np.testing.assert_array_equal(np.asarray(model.apply(variables, x)), out)


def names_of(g: js.Editor) -> list[str]:
    return [b.name for b in g.boundaries()]


# --------------------------------------------------------------------------- insert_after ports


def test_insert_on_input_port_transforms_what_the_module_receives(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x)
    assert g.insert_after("block:input", double, name="pre") is g
    expected = net_oracle(p, x, pre_block=double)
    assert_trees_all_close(g.build()(x), expected)
    # Not the output: double on block's output gives a different result.
    wrong = net_oracle(p, x, post_block=double)
    assert not np.allclose(np.asarray(expected), np.asarray(wrong))


def test_input_port_node_is_a_boundary_that_runs_before_the_module(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).insert_after("block:input", double, name="pre")
    names = names_of(g)
    assert "pre" in names and "block" in names, names
    assert names.index("pre") < names.index("block/fc"), names
    # Sliced at the node: its output is double(what block receives).
    assert_trees_all_close(g.slice(end="pre")(x), double(stem_out(p, x)))
    # Block's output in the edited model is block applied to the doubled value.
    assert_trees_all_close(g.slice(end="block")(x), block_out(p, double(stem_out(p, x))))
    # And what block receives (its input port) is the node's output.
    assert_trees_all_close(g.slice(end="block:input")(x), double(stem_out(p, x)))


@pytest.mark.parametrize("at", ["block", "block:output"])
def test_insert_on_output_port_and_bare_name_act_on_the_output(net, pristine, at):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x)
    assert g.insert_after(at, double, name="post") is g
    assert_trees_all_close(g.build()(x), net_oracle(p, x, post_block=double))
    names = names_of(g)
    assert "post" in names, names
    assert names.index("post") > names.index("block/fc"), names
    assert_trees_all_close(g.slice(end="post")(x), double(block_out(p, stem_out(p, x))))


def test_input_and_output_insertions_combine(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = (
        js.edit(model, variables, x)
        .insert_after("block:input", double, name="pre")
        .insert_after("block:output", square, name="post")
        .insert_after("block/fc:input", shift, name="pre_fc")
    )
    expected = net_oracle(p, x, pre_block=double, pre_fc=shift, post_block=square)
    assert_trees_all_close(g.build()(x), expected)
    names = names_of(g)
    for n in ("pre", "post", "pre_fc"):
        assert n in names, names
    assert names.index("pre") < names.index("pre_fc") < names.index("post"), names


def test_two_insertions_on_one_input_port_apply_in_order(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x)
    g.insert_after("block:input", double, name="first").insert_after(
        "block:input", shift, name="second"
    )
    expected = net_oracle(p, x, pre_block=lambda z: shift(double(z)))
    assert_trees_all_close(g.build()(x), expected)


def test_insert_on_the_first_modules_input_transforms_the_model_input(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).insert_after("stem:input", square, name="pre_stem")
    assert_trees_all_close(g.build()(x), net_oracle(p, x, pre_stem=square))
    assert_trees_all_close(g.slice(end="pre_stem")(x), square(x))


def test_insert_linen_module_on_input_port(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).insert_after(
        "block:input", nn.Dense(8), key=jax.random.key(3), name="adapter"
    )
    new = g.variables["params"]["adapter"]
    assert new["kernel"].shape == (8, 8)
    expected = net_oracle(p, x, pre_block=lambda h: dense(new, h))
    assert_trees_all_close(g.build()(x), expected)
    # The new module's parameters are trainable variables of the built slice.
    sub = g.build()
    assert "adapter" in sub.variables["params"]
    grads = jax.grad(lambda v: jnp.sum(sub.apply(v, x) ** 2))(sub.variables)
    assert float(jnp.abs(grads["params"]["adapter"]["kernel"]).sum()) > 0


def test_input_port_of_one_call_of_a_shared_module():
    model = SharedNet()
    x = jax.random.normal(jax.random.key(2), (3, 4))
    variables = model.init(jax.random.key(0), x)
    p = variables["params"]["shared"]
    g = js.edit(model, variables, x).insert_after("shared@1:input", double, name="pre1")
    expected = dense(p, double(jnp.tanh(dense(p, x))))
    assert_trees_all_close(g.build()(x), expected)
    g0 = js.edit(model, variables, x).insert_after("shared@0:input", double, name="pre0")
    assert_trees_all_close(g0.build()(x), dense(p, jnp.tanh(dense(p, double(x)))))


# --------------------------------------------------------------------------- replace/remove refuse ports


@pytest.mark.parametrize(
    ("op", "spec"),
    [
        ("replace", "block:input"),
        ("replace", "block:output"),
        ("remove", "block:input"),
        ("remove", "block:output"),
    ],
)
def test_replace_and_remove_refuse_a_port(net, pristine, op, spec):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).insert_after("block", double, name="post")
    args = (spec, double) if op == "replace" else (spec,)
    with pytest.raises(js.InvalidSpecError) as info:
        getattr(g, op)(*args)
    assert isinstance(info.value, js.SliceError)
    msg = str(info.value)
    assert op in msg, msg
    assert "whole" in msg, msg
    assert "'block'" in msg, msg  # suggests the bare name
    # The refused edit changed nothing.
    assert_trees_all_close(g.build()(x), net_oracle(p, x, post_block=double))


def test_replace_and_remove_of_the_bare_name_still_work(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).replace("block", shift)
    assert_trees_all_close(g.build()(x), dense(p["head"], shift(stem_out(p, x))))
    g = js.edit(model, variables, x).remove("block")
    assert_trees_all_close(g.build()(x), dense(p["head"], stem_out(p, x)))


# --------------------------------------------------------------------------- failed edits, copies


def first_two(z):
    return z[..., :2]


@pytest.mark.parametrize("at", ["block:input", "block:output", "block"])
def test_failed_insert_leaves_earlier_edits_intact(net, pristine, at):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).insert_after("block:input", double, name="pre")
    expected = net_oracle(p, x, pre_block=double)
    with pytest.raises(js.SliceError):
        g.insert_after(at, first_two, name="bad")
    assert "bad" not in names_of(g)
    assert_trees_all_close(g.build()(x), expected)
    # The editor still takes edits, and the failed node's name is free again.
    g.insert_after("block:output", square, name="bad")
    assert_trees_all_close(g.build()(x), net_oracle(p, x, pre_block=double, post_block=square))


def test_failed_edit_error_is_a_slice_error_not_a_jax_error(net, pristine):
    model, variables, x = net
    g = js.edit(model, variables, x)
    with pytest.raises(js.SliceError) as info:
        g.insert_after("block:input", first_two, name="bad")
    assert not isinstance(info.value, (TypeError, ValueError))


def test_copy_is_independent_on_input_ports(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).insert_after("block:input", double, name="pre")
    h = g.copy()
    assert h is not g
    assert h.insert_after("block:output", square, name="post") is h
    # Editing the copy leaves the original as it was...
    assert_trees_all_close(g.build()(x), net_oracle(p, x, pre_block=double))
    assert "post" not in names_of(g)
    assert_trees_all_close(h.build()(x), net_oracle(p, x, pre_block=double, post_block=square))
    # ...and editing the original leaves the copy.
    g.insert_after("stem:input", shift, name="pre_stem")
    assert_trees_all_close(g.build()(x), net_oracle(p, x, pre_stem=shift, pre_block=double))
    assert "pre_stem" not in names_of(h)
    assert_trees_all_close(h.build()(x), net_oracle(p, x, pre_block=double, post_block=square))


def test_remove_an_input_port_node_restores_the_model(net, pristine):
    model, variables, x = net
    p = variables["params"]
    g = js.edit(model, variables, x).insert_after("block:input", double, name="pre")
    g.remove("pre")
    assert "pre" not in names_of(g)
    assert_trees_all_close(g.build()(x), net_oracle(p, x))


def test_edited_model_with_input_port_works_under_jit_and_new_batch(net, pristine):
    model, variables, x = net
    p = variables["params"]
    sub = js.edit(model, variables, x).insert_after("block:input", double, name="pre").build()
    x2 = jax.random.normal(jax.random.key(5), (7, 5))
    assert_trees_all_close(jax.jit(sub)(x2), net_oracle(p, x2, pre_block=double))
