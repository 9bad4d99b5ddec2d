"""Call-like regions (`jax.jit`, `jax.checkpoint`) with several results.

A slice that needs one result of such a region computes only what that result needs
(no false missing input, no extra variables); a slice that needs it whole runs the
original region; an interpreter still sees it as one equation. Oracles: hand-written
math and `model.apply`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close


def region(a, b):
    return jnp.tanh(a) * 2.0, a * jnp.cos(b)  # the first result reads `a` only


class JitTwoResults(nn.Module):
    wrap: str = "jit"

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="d1")(x)
        wrapped = jax.jit(region) if self.wrap == "jit" else jax.checkpoint(region)
        first, _ = wrapped(h, nn.Dense(4, name="side")(x))
        return nn.Dense(3, name="head")(first)


def dense(p, x):
    return x @ p["kernel"] + p["bias"]


@pytest.mark.parametrize("wrap", ["jit", "checkpoint"])
def test_a_slice_needing_one_result_needs_only_its_inputs(wrap):
    model = JitTwoResults(wrap)
    x = jax.random.normal(jax.random.key(0), (2, 4))
    variables = model.init(jax.random.key(1), x)
    p = variables["params"]
    h = dense(p["d1"], x)
    tail = js.slice(model, variables, x, start="d1:output", end="head")
    assert sorted(tail.variables["params"]) == ["head"]
    assert_trees_all_close(tail(h), dense(p["head"], jnp.tanh(h) * 2.0))
    assert_trees_all_close(tail(h), model.apply(variables, x))


def test_a_whole_region_runs_as_the_original_equation():
    def f(p, x):
        u, v = jax.checkpoint(region)(x @ p, x)
        return u + v

    p, x = jnp.eye(3), jnp.arange(3.0)
    whole = js.slice(f, p, x)
    assert "remat" in str(whole.jaxpr)
    assert_trees_all_close(whole(x), f(p, x))


def test_an_interpreter_sees_a_region_without_boundaries_as_one_equation():
    seen = []

    class Record(js.Interpreter):
        def equation(self, eqn, inputs, outputs):
            seen.append(eqn.primitive)
            return outputs

    def f(p, x):
        u, v = jax.jit(lambda s, t: (s, t))(x, p)  # no equations inside
        w, z = jax.jit(region)(u, v)
        return w + z

    p, x = jnp.ones(3), jnp.arange(3.0)
    out, _ = Record().build(f, p, x)(p, x)
    assert_trees_all_close(out, f(p, x))
    assert seen.count("jit") == 1 and "tanh" not in seen
