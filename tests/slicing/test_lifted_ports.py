"""A lifted linen module (`nn.scan` with moved axes) shows the ports its caller sees.

Oracles: the scan written by hand with the module's parameters, and `model.apply`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close


class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        h = nn.Dense(6, name="dense")(x) + c
        return h, 2.0 * h


class TimeMajorLast(nn.Module):
    """Scans over axis 1 of a (batch, time, features) input, as sequence models do."""

    @nn.compact
    def __call__(self, x):
        loop = nn.scan(
            Cell,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )(name="loop")
        c, ys = loop(jnp.zeros((x.shape[0], 6)), x)
        return nn.Dense(2, name="head")(ys) + c[:, None, :2]


def by_hand(p, x):
    """The loop of `TimeMajorLast` written out: ``(final carry, stacked outputs)``."""
    c = jnp.zeros((x.shape[0], 6))
    ys = []
    for t in range(x.shape[1]):
        c = x[:, t] @ p["loop"]["dense"]["kernel"] + p["loop"]["dense"]["bias"] + c
        ys.append(2.0 * c)
    return c, jnp.stack(ys, axis=1)


@pytest.fixture(scope="module")
def scanned():
    model = TimeMajorLast()
    x = jax.random.normal(jax.random.key(0), (3, 4, 5))
    return model, model.init(jax.random.key(1), x), x


def test_end_at_a_lifted_scan_returns_what_the_caller_receives(scanned):
    model, variables, x = scanned
    got = js.slice(model, variables, x, end="loop")(x)
    want = by_hand(variables["params"], x)
    assert [a.shape for a in got] == [(3, 6), (3, 4, 6)]
    assert_trees_all_close(got, want)


def test_boundary_table_lists_the_callers_shapes(scanned):
    model, variables, x = scanned
    row = next(b for b in js.boundaries(model, variables, x) if b.name == "loop")
    assert [tuple(a.shape) for a in row.inputs] == [(3, 6), (3, 4, 5)]
    assert [tuple(a.shape) for a in row.outputs] == [(3, 6), (3, 4, 6)]


def test_start_at_a_lifted_scan_takes_the_callers_arrays(scanned):
    model, variables, x = scanned
    tail = js.slice(model, variables, x, start="loop")
    got = tail(jnp.zeros((3, 6)), x)
    assert_trees_all_close(got, model.apply(variables, x))
    grads = jax.grad(lambda v: tail.apply(v, jnp.zeros((3, 6)), x).sum())(tail.variables)
    full = jax.grad(lambda v: model.apply(v, x).sum())(variables)
    assert_trees_all_close(grads["params"]["loop"], full["params"]["loop"])


class Member(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="fc")(x)


class Ensemble(nn.Module):
    """Four members over axis 1 of the input, their outputs stacked on axis 1."""

    @nn.compact
    def __call__(self, x):
        members = nn.vmap(
            Member,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=1,
            out_axes=1,
            axis_size=4,
        )
        return jnp.tanh(members(name="ens")(x)).sum(axis=1)


def ensemble_by_hand(params, x):
    p = params["ens"]["fc"]
    outs = [x[:, k] @ p["kernel"][k] + p["bias"][k] for k in range(4)]
    return jnp.stack(outs, axis=1)


def test_a_vmapped_module_returns_what_its_caller_receives():
    model = Ensemble()
    x = jax.random.normal(jax.random.key(2), (2, 4, 5))
    variables = model.init(jax.random.key(3), x)
    row = next(b for b in js.boundaries(model, variables, x) if b.name == "ens")
    assert [tuple(a.shape) for a in row.inputs] == [(2, 4, 5)]
    assert [tuple(a.shape) for a in row.outputs] == [(2, 4, 3)]
    want = ensemble_by_hand(variables["params"], x)
    assert_trees_all_close(js.slice(model, variables, x, end="ens")(x), want)
    tail = js.slice(model, variables, x, start="ens:output", end=None)
    assert_trees_all_close(tail(want), model.apply(variables, x))
