"""`js.intermediates`: values at chosen boundaries from one compiled call.

Oracles: Flax's ``capture_intermediates`` and ``intercept_methods`` recordings (the zoo
fixtures of tests/conftest.py), hand-written math for plain functions, and eager calls of NNX
submodules. Whether only the needed part is computed is read from the equations of the
program a slice with the same ends re-emits, against ``jax.make_jaxpr`` of the model.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import RESNET_NAMES
from helpers.oracles import (
    assert_trees_all_close,
    captured,
    count_primitive,
    random_input,
    random_variables,
)

# --------------------------------------------------------------------------- linen


def expected_from_capture(zoo):
    """{boundary name: output} from Flax's capture_intermediates (``name@k`` if called twice)."""
    out = {}
    for name, values in zoo.intermediates.items():
        if not name or name.endswith(".setup"):  # the model itself; setup is not a call
            continue
        if len(values) == 1:
            out[name] = values[0]
        else:
            out.update({f"{name}@{k}": v for k, v in enumerate(values)})
    return out


@pytest.mark.parametrize(
    "zoo_name", ["resnet", "shared_zoo", "tuple_zoo", "skip_zoo", "method_zoo", "identity_zoo"]
)
def test_all_boundaries_equal_capture_intermediates(zoo_name, request):
    zoo = request.getfixturevalue(zoo_name)
    got = js.intermediates(zoo.model, zoo.variables, zoo.x)
    expected = expected_from_capture(zoo)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert_trees_all_close(got[name], value)
    if zoo_name == "resnet":
        assert list(got) == RESNET_NAMES  # in call order


def test_chosen_names_with_call_index_and_ports(shared_zoo, skip_zoo):
    zoo = shared_zoo
    names = ["shared@1", "shared@0:input", "shared@1:input", "stem:input", "head:output"]
    got = js.intermediates(zoo.model, zoo.variables, zoo.x, names=names)
    assert list(got) == names
    assert_trees_all_close(got["shared@1"], zoo.out_of("shared", 1))
    assert_trees_all_close(got["shared@0:input"], zoo.args_of("shared", 0)[0])
    assert_trees_all_close(got["shared@1:input"], zoo.args_of("shared", 1)[0])
    assert_trees_all_close(got["stem:input"], zoo.x)
    assert_trees_all_close(got["head:output"], zoo.model.apply(zoo.variables, zoo.x))
    # a module of two arguments: its input is the tuple of them
    got = js.intermediates(skip_zoo.model, skip_zoo.variables, skip_zoo.x, names=["dec:input"])
    assert_trees_all_close(got["dec:input"], tuple(skip_zoo.args_of("dec")))


def test_bad_names(shared_zoo):
    zoo = shared_zoo
    with pytest.raises(js.SliceError, match="shared@0"):
        js.intermediates(zoo.model, zoo.variables, zoo.x, names=["shared"])  # ambiguous
    with pytest.raises(js.SliceError, match="'stem'"):
        js.intermediates(zoo.model, zoo.variables, zoo.x, names=["stme"])
    with pytest.raises(js.SliceError):
        js.intermediates(zoo.model, zoo.variables, zoo.x, names="stem")


def test_early_name_computes_less(resnet):
    """The program for an early feature has fewer convolutions and no head matmul."""
    zoo = resnet
    full = jax.make_jaxpr(zoo.model.apply)(zoo.variables, zoo.x)
    assert count_primitive(full, "conv_general_dilated") == 6
    assert count_primitive(full, "dot_general") == 1
    early = js.slice(zoo.model, zoo.variables, zoo.x, end={"stage1/conv1": "stage1/conv1"}).jaxpr
    assert count_primitive(early, "conv_general_dilated") == 2  # stem and stage1/conv1
    assert count_primitive(early, "dot_general") == 0
    got = js.intermediates(zoo.model, zoo.variables, zoo.x, names=["stage1/conv1"])
    assert_trees_all_close(got["stage1/conv1"], zoo.intermediates["stage1/conv1"][0])


TRACES = []


class Counting(nn.Module):
    @nn.compact
    def __call__(self, x):
        TRACES.append(x.shape)  # runs once per trace, never at run time
        h = nn.Dense(4, name="stem")(x)
        return nn.Dense(2, name="head")(jnp.tanh(h))


def test_no_retrace_for_a_seen_shape_and_fresh_variables():
    model = Counting()
    x, x2, x3 = random_input(0, (3, 5)), random_input(1, (3, 5)), random_input(2, (6, 5))
    variables = random_variables(model, x, seed=0)
    variables2 = jax.tree_util.tree_map(lambda a: a * 2.0 + 0.5, variables)
    want2 = captured(model, variables, x2)["stem"][0]  # oracles first: they trace the model too
    want22 = captured(model, variables2, x2)["stem"][0]
    want3 = captured(model, variables, x3)["stem"][0]
    js.intermediates(model, variables, x, names=["stem"])
    n = len(TRACES)
    again = js.intermediates(model, variables, x2, names=["stem"])
    assert len(TRACES) == n  # same shape: no retrace
    assert_trees_all_close(again["stem"], want2)
    # new variables of the same shapes: still no retrace, and their values are used
    new = js.intermediates(model, variables2, x2, names=["stem"])
    assert len(TRACES) == n
    assert_trees_all_close(new["stem"], want22)
    # another batch size works too
    assert_trees_all_close(js.intermediates(model, variables, x3, names=["stem"])["stem"], want3)


def test_mode_keyword_is_passed_to_the_model():
    """Keyword arguments of ``apply`` (``train=False``) reach the model."""

    class Dropper(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = nn.Dense(4, name="stem")(x)
            h = nn.Dropout(0.5, deterministic=not train)(h)
            return nn.Dense(2, name="head")(h)

    model = Dropper()
    x = random_input(3, (4, 5))
    v = random_variables(model, x, seed=3)
    got = js.intermediates(model, v, x, names=["head"], train=False)
    assert_trees_all_close(got["head"], model.apply(v, x, train=False))


# --------------------------------------------------------------------------- plain functions

RNG = np.random.default_rng(5)
W1 = jnp.asarray(RNG.normal(size=(5, 4)), jnp.float32)
W2 = jnp.asarray(RNG.normal(size=(4, 3)), jnp.float32)


@js.mark("proj")
def proj(w, x):
    return x @ w


def plain(p, x):
    h = proj(p["w1"], x)
    with jax.named_scope("act"):
        a = jnp.tanh(h) * 2.0
    return proj(p["w2"], a) + a.sum(-1, keepdims=True)


def test_plain_function_marks_and_scopes():
    p = {"w1": W1, "w2": W2}
    x = random_input(4, (3, 5))
    h = np.asarray(x, np.float64) @ np.asarray(W1, np.float64)
    a = np.tanh(h) * 2.0
    out = a @ np.asarray(W2, np.float64)
    got = js.intermediates(plain, p, x)
    assert list(got) == ["proj@0", "act", "proj@1"]
    for name, want in [("proj@0", h), ("act", a), ("proj@1", out)]:
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-5, atol=1e-5)
    got = js.intermediates(plain, p, x, names=["proj@1:input", "act"])
    assert list(got) == ["proj@1:input", "act"]
    np.testing.assert_allclose(np.asarray(got["proj@1:input"]), a, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- NNX


def test_nnx_model_against_eager_submodules():
    from flax import nnx

    from helpers.nnx_zoo import Residual as Block

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Linear(5, 4, rngs=rngs)
            self.blocks = nnx.List([Block(rngs), Block(rngs)])
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            h = self.stem(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    model = Model(nnx.Rngs(0))
    x = random_input(6, (3, 5))
    got = js.intermediates(model, x)
    h0 = model.stem(x)
    h1 = model.blocks[0](h0)
    h2 = model.blocks[1](h1)
    expected = {
        "stem": h0,
        "blocks/0": h1,  # in call order: a block is called before its linear
        "blocks/0/linear": model.blocks[0].linear(h0),
        "blocks/1": h2,
        "blocks/1/linear": model.blocks[1].linear(h1),
        "head": model.head(h2),
    }
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert_trees_all_close(got[name], value)
    # the model's current parameters are read at each call, not frozen at the first
    model.stem.bias[...] = model.stem.bias[...] + 1.0
    again = js.intermediates(model, x, names=["blocks/0:input"])
    assert_trees_all_close(again["blocks/0:input"], model.stem(x))


def test_every_value_follows_the_variables_given():
    """``names="all"`` twice on one model with other variables of the same shapes: each
    call's values are its own variables' (Flax's ``capture_intermediates``)."""
    model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    x = jnp.linspace(-1.0, 1.0, 15).reshape(3, 5)
    for seed in (0, 1):
        variables = model.init(jax.random.key(seed), x)
        got = js.intermediates(model, variables, x, names="all")
        _, state = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
        captured = state["intermediates"]
        assert list(got) == ["layers_0", "layers_2"]
        for name in got:
            np.testing.assert_allclose(got[name], captured[name]["__call__"][0], atol=1e-6)
