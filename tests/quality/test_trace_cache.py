"""The cache of traced graphs: a model traced in full is not traced again at the same
signature, and anything that changes the traced program traces it again.

The oracle for "traced" is the model's own Python code running (a counter it bumps);
the values are checked against the model's own `apply`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

TRACES = {"n": 0}


class Counted(nn.Module):
    """Counts how often its Python code runs (once per trace)."""

    features: int = 4

    @nn.compact
    def __call__(self, x, scale: float = 1.0):
        TRACES["n"] += 1
        h = nn.relu(nn.Dense(self.features, name="body")(x)) * scale
        return nn.Dense(2, name="head")(h)


def _traces(fn):
    before = TRACES["n"]
    out = fn()
    return out, TRACES["n"] - before


def test_a_second_slice_boundaries_and_intermediates_trace_nothing():
    js.clear_caches()
    model, x = Counted(), jnp.ones((3, 5))
    variables = model.init(jax.random.key(0), x)
    _, n = _traces(lambda: js.slice(model, variables, x))  # traced in full
    assert n >= 1
    head, n = _traces(lambda: js.slice(model, variables, x, start="head"))
    assert n == 0
    _, n = _traces(lambda: js.boundaries(model, variables, x))
    assert n == 0
    feats, n = _traces(lambda: js.intermediates(model, variables, x, names=["body"]))
    assert n == 0
    want = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    np.testing.assert_allclose(feats["body"], want[1]["intermediates"]["body"]["__call__"][0])
    np.testing.assert_allclose(head(jax.nn.relu(feats["body"])), want[0], rtol=1e-6)


def test_what_changes_the_program_traces_again():
    js.clear_caches()
    model, x = Counted(), jnp.ones((3, 5))
    variables = model.init(jax.random.key(0), x)
    js.slice(model, variables, x)
    _, n = _traces(lambda: js.slice(Counted(), variables, x, end="body"))  # an equal model
    assert n == 0
    wide = Counted(features=6)
    wide_vars = wide.init(jax.random.key(1), x)
    for change in (
        lambda: js.slice(model, variables, x.astype(jnp.bfloat16)),  # a dtype
        lambda: js.slice(model, variables, jnp.ones((4, 5))),  # a shape
        lambda: js.slice(model, variables, x, scale=2.0),  # a value the trace fixes
        lambda: js.slice(wide, wide_vars, x),  # the model's structure
    ):
        _, n = _traces(change)
        assert n >= 1
    scaled = js.slice(model, variables, x, scale=2.0)
    np.testing.assert_allclose(scaled(x), model.apply(variables, x, 2.0), rtol=1e-6)
    js.clear_caches()
    _, n = _traces(lambda: js.slice(model, variables, x))
    assert n >= 1


def test_an_nnx_model_changed_between_calls_is_traced_again():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(self.drop(self.body(x)))

    model, x = Net(nnx.Rngs(0)), jnp.ones((3, 4))
    model.eval()
    first = js.slice(model, x, end="drop")
    np.testing.assert_allclose(first(x), model.body(x), rtol=1e-6)
    model.train()  # a changed graph definition: not the cached eval-mode trace
    train = js.slice(model, x, end="drop")
    out = train(x)
    assert not np.allclose(out, model.body(x))  # dropout ran


class Table(nn.Module):
    """A linen module holding an array field (a constant of its trace); counts traces."""

    table: object

    @nn.compact
    def __call__(self, x):
        TRACES["n"] += 1
        return nn.Dense(2, name="head")(x * jnp.asarray(self.table))


@pytest.mark.parametrize("array", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
def test_a_model_holding_an_array_field_is_traced_once(array):
    """An array field is keyed by its contents, and the same model sliced again (for a
    JAX array, also an equal model with an equal array) traces nothing."""
    js.clear_caches()
    x = jnp.ones((3, 4))
    model = Table(array(np.linspace(-1.0, 1.0, 4, dtype=np.float32)))
    variables = model.init(jax.random.key(0), x)
    js.slice(model, variables, x)
    sub, n = _traces(lambda: js.slice(model, variables, x, end="head"))
    assert n == 0
    np.testing.assert_allclose(sub(x), model.apply(variables, x), rtol=1e-6)
    if array is jnp.asarray:
        twin = Table(jnp.asarray(np.linspace(-1.0, 1.0, 4, dtype=np.float32)))
        _, n = _traces(lambda: js.slice(twin, variables, x))
        assert n == 0


def test_arrays_an_nnx_or_equinox_model_holds_are_inputs_keyed_by_shape():
    """NNX variables (with a plain array attribute and random keys among them) and an
    Equinox module's array leaves are inputs of the trace: a model with other values is
    not traced again, and computes with its own values."""
    eqx = pytest.importorskip("equinox")
    counts = {"n": 0}

    class NNXNet(nnx.Module):
        def __init__(self, seed):
            rngs = nnx.Rngs(seed)
            self.body = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.scale = jax.random.normal(jax.random.key(seed), (4,))
            self.eval()  # the dropout keeps its random keys but draws none

        def __call__(self, x):
            counts["n"] += 1
            return self.drop(self.body(x)) * self.scale

    class EqxNet(eqx.Module):
        body: eqx.nn.Linear
        scale: jax.Array

        def __call__(self, x):
            counts["n"] += 1
            return self.body(x) * self.scale

    def eqx_net(seed):
        key = jax.random.key(seed)
        return EqxNet(eqx.nn.Linear(4, 4, key=key), jax.random.normal(key, (4,)))

    js.clear_caches()
    x = jnp.ones((3, 4))
    for make, sample in ((NNXNet, x), (eqx_net, x[0])):
        js.slice(make(0), sample)
        other = make(1)
        before = counts["n"]
        sub = js.slice(other, sample)
        assert counts["n"] == before
        np.testing.assert_allclose(sub(sample), other(sample), rtol=1e-6)


class Chain(nn.Module):
    """Three layers; counts its traces like `Counted`."""

    @nn.compact
    def __call__(self, x):
        TRACES["n"] += 1
        h = nn.Dense(4, name="a")(x)
        h = nn.Dense(4, name="b")(jnp.tanh(h))
        return nn.Dense(2, name="c")(jnp.tanh(h))


def test_a_trace_that_stopped_early_serves_slices_it_reached():
    js.clear_caches()
    model, x = Chain(), jax.random.normal(jax.random.key(1), (3, 5))
    variables = model.init(jax.random.key(0), x)
    p = variables["params"]

    def dense(name, h):
        return h @ p[name]["kernel"] + p[name]["bias"]

    _, n = _traces(lambda: js.slice(model, variables, x, end="b@0"))
    assert n == 1
    first, n = _traces(lambda: js.slice(model, variables, x, end="a@0"))
    assert n == 0 and first.build_info.stopped_early
    np.testing.assert_allclose(first(x), dense("a", x), rtol=1e-5, atol=1e-6)
    h = jnp.tanh(dense("a", x))
    inner, n = _traces(lambda: js.slice(model, variables, x, start="b@0", end="b@0"))
    assert n == 0  # a start (b's input) and an end both reached
    np.testing.assert_allclose(inner(h), dense("b", h), rtol=1e-5, atol=1e-6)
    feats, n = _traces(lambda: js.intermediates(model, variables, x, names=["a@0", "b@0"]))
    assert n == 0
    np.testing.assert_allclose(feats["b@0"], dense("b", h), rtol=1e-5, atol=1e-6)
    last, n = _traces(lambda: js.slice(model, variables, x, end="c@0"))
    assert n == 1  # beyond where the cached trace stopped
    np.testing.assert_allclose(last(x), model.apply(variables, x), rtol=1e-5, atol=1e-6)


class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
        b = nn.Dense(4, name="b")
        h = b(nn.Dense(4, name="a")(x))
        return nn.Dense(2, name="c")(b(h))


def test_a_bare_name_after_an_early_stop_still_traces_the_whole_model():
    js.clear_caches()
    model, x = Twice(), jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)
    js.slice(model, variables, x, end="b@1")  # stops after b's second call
    with pytest.raises(js.AmbiguousBoundaryError, match="'b@0', 'b@1'"):
        js.slice(model, variables, x, end="b")  # not taken from the partial trace


def test_intermediates_programs_are_keyed_by_what_changes_the_trace():
    """`js.intermediates` keeps one program per traced signature: a value the trace
    fixes, a shape or a model that differs gets its own, and a repeat call reuses it."""
    js.clear_caches()
    model, x = Counted(), jnp.ones((3, 5))
    variables = model.init(jax.random.key(0), x)

    def body(scale, inputs=x):
        return js.intermediates(model, variables, inputs, scale=scale, names=["head"])["head"]

    for scale in (1.0, 2.0):
        want = model.apply(variables, x, scale)
        np.testing.assert_allclose(body(scale), want, rtol=1e-6)
        again, n = _traces(lambda scale=scale: body(scale))
        assert n == 0
        np.testing.assert_allclose(again, want, rtol=1e-6)
    wider = jnp.ones((4, 5))
    out, n = _traces(lambda: body(1.0, wider))
    assert n >= 1
    np.testing.assert_allclose(out, model.apply(variables, wider), rtol=1e-6)


def test_a_traced_graph_is_frozen_once_built():
    """Graphs are shared through the trace cache: a graph that slices, intermediates and
    boundaries read can no longer be changed, and slicing it twice changes nothing."""
    from jaxslice._core.trace import trace
    from jaxslice.adapters import adapter_for

    js.clear_caches()
    model, x = Counted(), jnp.ones((3, 5))
    variables = model.init(jax.random.key(0), x)
    graph = trace(model, (variables, x), {}, adapter=adapter_for(model)).graph
    calls = [(c.qualname, c.start, c.stop) for c in graph.calls]
    with pytest.raises(AttributeError, match="frozen"):
        graph.partial = True
    assert isinstance(graph.calls, tuple) and isinstance(graph.eqns, tuple)
    js.slice(model, variables, x, start="head")
    js.intermediates(model, variables, x, names=["body"])
    # the cached graph, unchanged
    assert trace(model, (variables, x), {}, adapter=adapter_for(model)).graph is graph
    assert [(c.qualname, c.start, c.stop) for c in graph.calls] == calls
