"""Marking changes nothing the model sees: values, containers and their identity.

Modules here check what they receive *while being traced by jaxslice* (a failed check
raises inside the trace), and the whole-model slice must equal ``model.apply`` exactly.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import (
    assert_trees_all_close,
    assert_trees_equal,
    iter_eqns,
    random_input,
    random_variables,
    record_calls,
)

X = random_input(21, (2, 3))


# --------------------------------------------------------------------------- mutated containers


class Writer(nn.Module):
    """Writes its result, and who it was given, into the dict its caller passed."""

    @nn.compact
    def __call__(self, x, store):
        y = nn.Dense(4, name="fc")(x)
        store["y"] = y
        store["owner"] = id(store)
        return jnp.tanh(y)


class WritingParent(nn.Module):
    @nn.compact
    def __call__(self, x):
        store = {}
        out = Writer(name="writer")(x, store)
        # Fails while tracing if the writer was handed a copy of `store`.
        assert store["owner"] == id(store), "the submodule was given a different dict"
        return nn.Dense(2, name="head")(out + 2.0 * store["y"])


@pytest.fixture(scope="module")
def writing():
    model = WritingParent()
    return model, random_variables(model, X, seed=21)


def test_submodule_mutating_its_callers_dict_is_traced_faithfully(writing):
    model, variables = writing
    names = [b.name for b in js.boundaries(model, variables, X)]
    assert names == ["writer", "writer/fc", "head"]
    sub = js.slice(model, variables, X, end=None)
    assert_trees_equal(sub(X), model.apply(variables, X))


def test_slice_starting_at_the_mutating_module(writing):
    model, variables = writing
    sub = js.slice(model, variables, X, start="writer", end=None)
    assert_trees_all_close(sub(X), model.apply(variables, X))
    sub = js.slice(model, variables, X, start="writer", end="writer")
    p = variables["params"]["writer"]["fc"]
    expected = np.tanh(np.asarray(X) @ np.asarray(p["kernel"]) + np.asarray(p["bias"]))
    assert_trees_all_close(sub(X), expected)


def test_dict_passed_by_the_caller_of_a_marked_function_is_mutated():
    seen = []

    @js.mark("fill")
    def fill(d, x):
        d["out"] = x * 2.0
        seen.append(d)
        return x + 1.0

    def model(params, x):
        d = {}
        y = fill(d, x)
        assert seen[-1] is d, "the marked function was given a different dict"
        return y + d["out"] * params

    p = jnp.float32(3.0)
    sub = js.slice(model, p, X, end=None)
    assert_trees_all_close(sub(X), np.asarray(X) + 1.0 + np.asarray(X) * 2.0 * 3.0)
    # The empty dict holds no arrays, so it is fixed by the trace: x is the only input.
    sub = js.slice(model, p, X, start="fill", end="fill")
    assert_trees_all_close(sub(X), np.asarray(X) + 1.0)


# --------------------------------------------------------------------------- identity of objects


class PassThrough(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


class CheckingParent(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, name="fc")(x)
        same = PassThrough(name="through")(h)
        assert same is h, "the module's result is not the object it returned"
        return same * 2.0


def test_returned_object_is_the_object_the_module_returned():
    model = CheckingParent()
    variables = random_variables(model, X, seed=22)
    sub = js.slice(model, variables, X, end=None)
    assert_trees_equal(sub(X), model.apply(variables, X))
    sub = js.slice(model, variables, X, start="through", end="through")
    h = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    assert_trees_all_close(sub(h), h, atol=0, rtol=0)


def test_marked_function_returns_the_very_object():
    @js.mark("same")
    def same(tree):
        return tree

    def model(params, x):
        tree = {"a": x, "b": (x * 2.0, None)}
        assert same(tree) is tree
        return x * params

    sub = js.slice(model, jnp.float32(2.0), X)
    assert_trees_all_close(sub(X), np.asarray(X) * 2.0)


# --------------------------------------------------------------------------- argument kinds


class Multi(nn.Module):
    """Takes a tuple, a dict, None and a Python int."""

    @nn.compact
    def __call__(self, pair, mapping, nothing, k):
        assert type(pair) is tuple and len(pair) == 2
        assert type(mapping) is dict and set(mapping) == {"c"}
        assert nothing is None
        assert type(k) is int and k == 3
        a, b = pair
        return nn.Dense(3, name="fc")(a * b + mapping["c"]) * k


class MultiParent(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, name="pre")(x)
        return Multi(name="multi")((h, h + 1.0), {"c": h * 2.0}, None, 3)


@pytest.fixture(scope="module")
def multi():
    model = MultiParent()
    variables = random_variables(model, X, seed=23)
    calls = record_calls(model, variables, X, jit=False)
    return model, variables, calls


def test_module_with_tuple_dict_none_and_int_arguments(multi):
    model, variables, calls = multi
    by_name = {b.name: b for b in js.boundaries(model, variables, X)}
    assert by_name["multi"].inputs == (jax.ShapeDtypeStruct((2, 3), jnp.float32),) * 3
    assert_trees_equal(js.slice(model, variables, X)(X), model.apply(variables, X))


def test_slice_from_module_with_structured_arguments(multi):
    model, variables, calls = multi
    (pair, mapping, nothing, k), _, out = calls["multi"][0]
    assert nothing is None and k == 3
    sub = js.slice(model, variables, X, start="multi", end="multi")
    assert_trees_all_close(sub(pair, mapping), out)
    a, b = jnp.ones((2, 3), jnp.float32), jnp.full((2, 3), 2.0, jnp.float32)
    c = jnp.full((2, 3), 0.5, jnp.float32)
    p = variables["params"]["multi"]["fc"]
    expected = (np.asarray(a * b + c) @ np.asarray(p["kernel"]) + np.asarray(p["bias"])) * 3
    assert_trees_all_close(sub((a, b), {"c": c}), expected)


def test_prefix_slice_ending_at_module_with_structured_arguments(multi):
    model, variables, calls = multi
    sub = js.slice(model, variables, X, end="multi")
    assert_trees_all_close(sub(X), calls["multi"][0][2])
    sub = js.slice(model, variables, X, end="multi:input")
    (pair, mapping, _, _), _, _ = calls["multi"][0]
    assert_trees_all_close(sub(X), (pair, mapping))


class TopLevelMulti(nn.Module):
    @nn.compact
    def __call__(self, pair, mapping, nothing, k):
        assert nothing is None and type(k) is int
        return nn.Dense(2, name="fc")(pair[0] - pair[1] + mapping["c"]) * k


def test_model_inputs_with_tuple_dict_none_and_int():
    model = TopLevelMulti()
    pair, mapping = (X, X * 3.0), {"c": X + 1.0}
    variables = random_variables(model, pair, mapping, None, 4, seed=24)
    expected = model.apply(variables, pair, mapping, None, 4)
    sub = js.slice(model, variables, pair, mapping, None, 4, end=None)
    # The array arguments are the slice's inputs; None and 4 are fixed by the trace.
    assert_trees_equal(sub(pair, mapping), expected)
    sub = js.slice(model, variables, pair, mapping, None, 4, start="fc", end="fc")
    p = variables["params"]["fc"]
    h = jnp.ones((2, 3), jnp.float32)
    assert_trees_all_close(sub(h), np.asarray(h) @ np.asarray(p["kernel"]) + np.asarray(p["bias"]))


class Scaled(nn.Module):
    @nn.compact
    def __call__(self, x, *, scale):
        return nn.Dense(3, name="fc")(x) * scale


class KeywordParent(nn.Module):
    @nn.compact
    def __call__(self, x):
        s = jnp.exp(nn.Dense(3, name="gate")(x))
        return Scaled(name="scaled")(x, scale=s)


def test_module_with_keyword_array_argument():
    model = KeywordParent()
    variables = random_variables(model, X, seed=25)
    calls = record_calls(model, variables, X)
    sub = js.slice(model, variables, X, start="scaled", end="scaled")
    (x,), kwargs, out = calls["scaled"][0]
    assert_trees_all_close(sub(x, scale=kwargs["scale"]), out)
    assert_trees_equal(js.slice(model, variables, X)(X), model.apply(variables, X))


class StaticOut(nn.Module):
    @nn.compact
    def __call__(self, x):
        return {"y": nn.Dense(3, name="fc")(x), "n": 3, "tag": "hi", "none": None}


class StaticParent(nn.Module):
    @nn.compact
    def __call__(self, x):
        out = StaticOut(name="static")(x)
        assert out["n"] == 3 and out["tag"] == "hi"
        return out["y"] * out["n"]


def test_non_array_leaves_of_a_module_output_come_back_unchanged():
    model = StaticParent()
    variables = random_variables(model, X, seed=26)
    sub = js.slice(model, variables, X, end="static")
    out = sub(X)
    assert set(out) == {"y", "n", "tag", "none"}
    assert type(out["n"]) is int and out["n"] == 3
    assert out["tag"] == "hi" and out["none"] is None
    assert_trees_all_close(out["y"], model.apply(variables, X) / 3.0)


# --------------------------------------------------------------------------- exact values


@pytest.mark.parametrize(
    "zoo_name",
    ["resnet", "identity_zoo", "tuple_zoo", "unused_zoo", "shared_zoo", "skip_zoo", "method_zoo"],
)
def test_whole_model_slice_equals_apply_exactly(request, zoo_name):
    zoo = request.getfixturevalue(zoo_name)
    sub = js.slice(zoo.model, zoo.variables, zoo.x, end=None)
    # Bit for bit against the same program compiled by jax.jit; op-by-op (eager) execution
    # is not bit-identical to any compiled program (XLA fuses and reassociates), so it is
    # compared to float32 rounding.
    assert_trees_equal(sub(zoo.x), jax.jit(zoo.model.apply)(zoo.variables, zoo.x))
    assert_trees_all_close(sub(zoo.x), zoo.model.apply(zoo.variables, zoo.x), atol=1e-6, rtol=1e-6)


def test_marks_do_nothing_outside_jaxslice():
    calls = []

    @js.mark("double")
    def double(x):
        calls.append(x)
        return 2.0 * x

    assert double.__name__ == "double"
    np.testing.assert_array_equal(double(X), 2.0 * X)
    assert calls[-1] is X
    jaxpr = jax.make_jaxpr(lambda x: double(x) + 1.0)(X)
    assert [e.primitive.name for e in iter_eqns(jaxpr)] == ["mul", "add"]


def test_model_is_unchanged_after_slicing(resnet):
    before = jax.make_jaxpr(resnet.model.apply)(resnet.variables, resnet.x)
    js.slice(resnet.model, resnet.variables, resnet.x, start="stage1", end="stage2")
    after = jax.make_jaxpr(resnet.model.apply)(resnet.variables, resnet.x)
    assert [e.primitive.name for e in iter_eqns(after)] == [
        e.primitive.name for e in iter_eqns(before)
    ]
    assert "name" not in {e.primitive.name for e in iter_eqns(after)}
