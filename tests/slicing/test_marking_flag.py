"""jaxslice's traces and the model's own traces never share JAX's jit caches.

Every kind of model is traced by JAX before jaxslice sees it (`make_jaxpr`, `jit`,
`grad` and `vmap`, of the model and of an equal model), with jitted code at the top and
inside (linen `nn.jit` with a static ``self`` as the gemma library writes it, `jax.jit`,
`nn.remat`; `nnx.jit`; `eqx.filter_jit`; a jitted helper in a Haiku module; `js.mark`
inside and outside `jax.jit`). The boundaries must all be found and slices must compute
what the model's own submodules compute; then, in the other direction, a plain call of
the model must hold no jaxslice marker and compute the model's values. Each kind runs in a
fresh process, so no earlier test has filled JAX's caches.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import functools
import jax, jax.numpy as jnp, numpy as np
import jaxslice as js
from jaxslice import _compat

def markers(jaxpr):
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if _compat.marker_payload(eqn) is not None:
            found.append(eqn)
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else [value]:
                if hasattr(item, "eqns") or hasattr(item, "jaxpr"):
                    found += markers(item)
    return found

def trace_before(fn, *args):
    # What a user does before slicing: look at the program, compile it, differentiate
    # it, batch it.
    jax.make_jaxpr(fn)(*args)
    jax.jit(fn)(*args)
    jax.grad(lambda *a: jnp.sum(jax.tree.leaves(fn(*a))[0]))(*args)
    jax.vmap(fn, in_axes=(None,) * (len(args) - 1) + (0,))(*args[:-1], args[-1][None])

def plain_is_clean(fn, *args, want):
    assert not markers(jax.make_jaxpr(fn)(*args)), "a plain trace holds jaxslice markers"
    close(jax.jit(fn)(*args), want)

def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
"""

LINEN = """
import flax.linen as nn

class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(4, name="dense")(x))

class Net(nn.Module):
    depth: int = 2

    @functools.partial(nn.jit, static_argnames=("self", "train"))
    @nn.compact
    def __call__(self, x, train=False):
        for i in range(self.depth):
            x = Layer(name=f"layer_{i}")(x)
        x = nn.jit(Layer)(name="jitted")(x)
        x = nn.remat(Layer)(name="remat")(x)
        x = jax.jit(lambda v: v * 2.0)(x)
        return nn.Dense(2, name="head")(x)

model, x = Net(), jnp.ones((3, 4))
variables = model.init(jax.random.key(0), x)
trace_before(model.apply, variables, x)
trace_before(Net().apply, variables, x)  # an equal model
want = model.apply(variables, x)
p = variables["params"]

names = js.boundaries(Net(), variables, x).names()
assert names[:4] == ["layer_0", "layer_0/dense", "layer_1", "layer_1/dense"], names
assert {"jitted", "jitted/dense", "remat", "remat/dense", "head"} <= set(names), names
first = js.slice(Net(), variables, x, end="layer_0")(x)
close(first, Layer().apply({"params": p["layer_0"]}, x))
h = js.slice(model, variables, x, start="jitted", end="remat/dense")(first)
close(h, nn.Dense(4).apply({"params": p["remat"]["dense"]}, Layer().apply({"params": p["jitted"]}, first)))
close(js.slice(model, variables, x)(x), want)
plain_is_clean(model.apply, variables, x, want=want)
plain_is_clean(Net().apply, variables, x, want=want)
"""

NNX = """
from flax import nnx

class Net(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(5, 4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        h = nnx.jit(lambda m, v: m(v))(self.body, x)
        return self.head(jax.jit(jnp.tanh)(h))

model, x = Net(nnx.Rngs(0)), jnp.ones((3, 5))
want = model(x)
graphdef, state = nnx.split(model)
plain = lambda s, v: nnx.merge(graphdef, s)(v)
trace_before(plain, state, x)
nnx.jit(lambda m, v: m(v))(model, x)
nnx.grad(lambda m, v: m(v).sum())(model, x)
assert js.boundaries(model, x).names() == ["body", "head"]
close(js.slice(model, x, end="body")(x), model.body(x))
close(js.slice(model, x, start="head")(jnp.tanh(model.body(x))), want)
plain_is_clean(plain, state, x, want=want)
"""

EQUINOX = """
import equinox as eqx

class Net(eqx.Module):
    body: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.body = eqx.nn.Linear(5, 4, key=a)
        self.head = eqx.nn.Linear(4, 2, key=b)

    def __call__(self, x):
        h = eqx.filter_jit(lambda m, v: jnp.tanh(m(v)))(self.body, x)
        return self.head(h)

model, x = Net(jax.random.key(0)), jnp.ones(5)
want = model(x)
trace_before(lambda m, v: m(v), model, x)
trace_before(lambda m, v: m(v), Net(jax.random.key(0)), x)
eqx.filter_jit(lambda m, v: m(v))(model, x)
assert js.boundaries(model, x).names() == ["body", "head"]
close(js.slice(model, x, end="body")(x), model.body(x))
close(js.slice(model, x)(x), want)
plain_is_clean(lambda m, v: m(v), model, x, want=want)
"""

HAIKU = """
import haiku as hk

def forward(x):
    h = hk.Linear(4, name="body")(x)
    h = jax.jit(jnp.tanh)(h)
    return hk.Linear(2, name="head")(h)

f = hk.without_apply_rng(hk.transform(forward))
x = jnp.ones((3, 5))
params = f.init(jax.random.key(0), x)
want = f.apply(params, x)
trace_before(f.apply, params, x)
assert js.boundaries(f, params, x).names() == ["body", "head"]
body = js.slice(f, params, x, end="body")(x)
close(body, x @ params["body"]["w"] + params["body"]["b"])
close(js.slice(f, params, x)(x), want)
plain_is_clean(f.apply, params, x, want=want)
"""

MARK = """
inner = js.mark("inner", lambda p, x: jnp.tanh(x @ p["w"]))
jitted = jax.jit(inner)

@js.mark("outer")
def outer(p, x):
    return jax.jit(lambda v: v @ p["v"])(x)

def fn(params, x):
    return outer(params, jitted(params, x) * 2.0)

params, x = {"w": jnp.ones((5, 4)) * 0.1, "v": jnp.ones((4, 2))}, jnp.ones((3, 5))
want = fn(params, x)
trace_before(fn, params, x)
assert js.boundaries(fn, params, x).names() == ["inner", "outer"]
close(js.slice(fn, params, x, end="inner")(x), jnp.tanh(x @ params["w"]))
close(js.slice(fn, params, x)(x), want)
plain_is_clean(fn, params, x, want=want)
"""


def _run(code):
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PRELUDE + code)],
        capture_output=True,
        text=True,
        timeout=600,  # guards against a hang only
        env={"JAX_PLATFORMS": "cpu", "PATH": "", "KERAS_BACKEND": "jax"},
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_linen_jitted_at_the_top_and_inside_after_earlier_traces():
    _run(LINEN)


def test_nnx_jit_inside_after_earlier_traces():
    _run(NNX)


def test_equinox_filter_jit_inside_after_earlier_traces():
    pytest.importorskip("equinox")
    _run(EQUINOX)


def test_haiku_jitted_helper_after_earlier_traces():
    pytest.importorskip("haiku")
    _run(HAIKU)


def test_marked_functions_inside_and_around_jit_after_earlier_traces():
    _run(MARK)
