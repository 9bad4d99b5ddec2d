"""When jaxslice keeps its traces apart from JAX's jit caches: only once `js.mark` has
wrapped a function (a marked function inside a `jax.jit` traced before, outside
jaxslice, would otherwise be reused unmarked). Module calls of every kind are marked at
each trace, also inside jitted code that ran before. Each case runs in a fresh process,
so no earlier test has made a marked function; the oracle is the model's own output."""

from __future__ import annotations

import subprocess
import sys
import textwrap

LINEN = """
import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js

class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(4, name="dense")(x))

class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.jit(Block)(name="block")(x)
        h = jax.jit(lambda v: v * 2.0)(h)
        return nn.Dense(2, name="head")(h)

model, x = Net(), jnp.ones((3, 5))
variables = model.init(jax.random.key(0), x)
want = model.apply(variables, x)  # JAX's caches hold these traces, unmarked
jax.jit(model.apply)(variables, x)
names = js.boundaries(model, variables, x).names()
assert names == ["block", "block/dense", "head"], names
assert jnp.allclose(js.slice(model, variables, x)(x), want)
block = js.slice(model, variables, x, end="block/dense")(x)
p = variables["params"]["block"]["dense"]
assert jnp.allclose(block, x @ p["kernel"] + p["bias"], atol=1e-6)
"""

NNX = """
import jax, jax.numpy as jnp, jaxslice as js
from flax import nnx

class Net(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(5, 4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        h = nnx.jit(lambda m, v: m(v))(self.body, x)
        return self.head(h)

model, x = Net(nnx.Rngs(0)), jnp.ones((3, 5))
want = model(x)  # nnx.jit's cache holds this trace, unmarked
names = js.boundaries(model, x).names()
assert names == ["body", "head"], names
assert jnp.allclose(js.slice(model, x, end="body")(x), model.body(x))
assert jnp.allclose(js.slice(model, x)(x), want)
"""

MARK = """
import jax, jax.numpy as jnp, jaxslice as js

inner = js.mark("inner", lambda p, x: jnp.tanh(x @ p["w"]))
jitted = jax.jit(inner)

def fn(params, x):
    return jitted(params, x) * 2.0

params, x = {"w": jnp.ones((5, 4)) * 0.1}, jnp.ones((3, 5))
jax.jit(fn)(params, x)  # `jitted` is traced (inside a trace) and cached before jaxslice sees it
assert js.boundaries(fn, params, x).names() == ["inner"]
assert jnp.allclose(js.slice(fn, params, x, end="inner")(x), jnp.tanh(x @ params["w"]))
"""


def _run(code):
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_linen_modules_inside_jit_that_ran_before_are_boundaries():
    _run(LINEN)


def test_nnx_modules_inside_nnx_jit_that_ran_before_are_boundaries():
    _run(NNX)


def test_a_marked_function_inside_a_jit_that_ran_before_is_a_boundary():
    _run(MARK)
