"""What `js.coverage.generate` reads from a tracker and from its criteria, checked alone.

The tracker's side (`names`, `states`, `inputs`, `batch_size`, `run_layers`) and the
criteria's side (`open_requirements`, `holds`, `span`, `sign_changes`) are the only things
`generate` uses. Oracles: layer outputs from Flax's ``capture_intermediates`` and the
Dense layers' own outputs (never jaxslice's); open requirements and the exact check from
the NumPy reference of `helpers.coverage_reference`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.coverage_reference import KINDS, neurons, ref_pairs
from helpers.oracles import captured, random_variables

C = js.coverage


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(6, name="fc1")(x))
        x = nn.relu(nn.Dense(5, name="fc2")(x))
        return nn.Dense(3, name="head")(x)


@pytest.fixture(scope="module")
def mlp():
    model = MLP()
    x = jax.random.normal(jax.random.key(0), (12, 4))
    variables = random_variables(model, x)
    outs = {k: np.asarray(v[0]) for k, v in captured(model, variables, x).items()}
    return model, variables, x, outs


def _values(layer_outputs, granularity="channel"):
    return lambda v, r, x: [js.observe.neurons(o, granularity) for o in layer_outputs(v, r, x)]


def test_run_layers_gives_the_layers_outputs(mlp):
    model, variables, x, outs = mlp
    t = C.Tracker(model, variables, x, criteria=[C.NC(0.5)])
    got = t.run_layers(("test", "values"), x, _values)
    assert t.layers == ["fc1", "fc2", "head"]
    for name, value in zip(t.layers, got, strict=True):
        np.testing.assert_allclose(np.asarray(value), outs[name], rtol=1e-5, atol=1e-6)


def test_run_layers_before_the_activation(mlp):
    """At ``position="activation"``, `before` gives each Dense output and the outputs are
    its ReLU (the head has no activation: both are its output); at ``"output"`` nothing
    is before (None)."""
    model, variables, x, outs = mlp

    def both(layer_outputs):
        def step(v, r, x):
            now, before = layer_outputs(v, r, x)
            return now, before

        return step

    t = C.Tracker(model, variables, x, criteria=[C.SignSign()], position="activation")
    now, before = t.run_layers(("test", "before"), x, both, before=True)
    for name, act, raw in zip(t.layers, now, before, strict=True):
        relu = name != "head"
        np.testing.assert_allclose(np.asarray(raw), outs[name], rtol=1e-5, atol=1e-6)
        want = np.maximum(outs[name], 0) if relu else outs[name]
        np.testing.assert_allclose(np.asarray(act), want, rtol=1e-5, atol=1e-6)
    t = C.Tracker(model, variables, x, criteria=[C.SignSign()])
    now, before = t.run_layers(("test", "before"), x, both, before=True)
    assert before is None
    np.testing.assert_allclose(np.asarray(now[0]), outs["fc1"], rtol=1e-5, atol=1e-6)


def test_names_states_inputs_and_batch_size(mlp):
    model, variables, x, _ = mlp
    crits = [C.NC(0.5), C.NC(0.2), C.SignSign()]
    t = C.Tracker(model, variables, x, criteria=crits)
    assert t.names == ["NC(threshold=0.5)", "NC(threshold=0.2)", "SignSign"] == list(t.result())
    assert len(t.states) == 3
    assert t.batch_size(x[:5]) == 5
    (given,) = t.inputs(x[:5])
    np.testing.assert_array_equal(np.asarray(given), np.asarray(x[:5]))
    with pytest.raises(js.InputMismatchError):
        t.batch_size(jnp.ones((5, 7)))
    with pytest.raises(js.InputMismatchError):
        t.inputs(jnp.ones((5, 7)))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_open_requirements_are_the_references_uncovered_pairs(mlp, kind):
    model, variables, x, outs = mlp
    crit = C.SignSign() if kind == "SignSign" else getattr(C, kind)(ratio=2.0)
    t = C.Tracker(model, variables, x, criteria=[crit], layers=["fc1", "fc2", "head"])
    t.update(x)
    want = set()
    for group, (a, b) in enumerate(zip(t.layers[:-1], t.layers[1:], strict=True)):
        cov = ref_pairs(*KINDS[kind], neurons(outs[a], "channel"), neurons(outs[b], "channel"),
                        getattr(crit, "ratio", None), check=False)  # fmt: skip
        want |= {(group, int(n1), int(n2)) for n1, n2 in np.argwhere(~cov)}
    got = crit.open_requirements(t.states[0])
    assert len(got) == len(set(got))
    assert set(got) == want
    assert crit.span == 2
    first, second = KINDS[kind]
    assert crit.sign_changes == tuple(k for k, c in enumerate((first, second)) if c == "sign")


def test_nc_open_requirements_are_the_neurons_never_above_the_threshold(mlp):
    model, variables, x, outs = mlp
    crit = C.NC(0.6)
    t = C.Tracker(model, variables, x, criteria=[crit], granularity="element")
    t.update(x[:3])
    want = set()
    for group, name in enumerate(t.layers):
        out = outs[name][:3]
        lo, hi = out.min(axis=1, keepdims=True), out.max(axis=1, keepdims=True)
        nc = np.where(hi > lo, (out - lo) / np.where(hi > lo, hi - lo, 1), 0)
        want |= {(group, int(n), -1) for n in np.flatnonzero(~(nc > 0.6).any(axis=0))}
    assert set(crit.open_requirements(t.states[0])) == want
    assert (crit.span, crit.sign_changes) == (1, ())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_holds_is_the_references_definition(kind):
    """Every pair of 16 inputs and every requirement: `holds` says what the reference's
    check of that one pair says. Values from a few levels, so that sign patterns repeat
    and every kind of requirement is met somewhere."""
    crit = C.SignSign() if kind == "SignSign" else getattr(C, kind)(ratio=2.0)
    rng = np.random.default_rng(0)
    levels = np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0], np.float32)
    v1, v2 = rng.choice(levels, (16, 3)), rng.choice(levels, (16, 4))
    i, j = np.triu_indices(len(v1), 1)
    n1, n2 = np.meshgrid(np.arange(v1.shape[1]), np.arange(v2.shape[1]), indexing="ij")
    n1, n2 = n1.ravel(), n2.ravel()
    rows = np.repeat(np.arange(len(i)), len(n1))
    a, b = i[rows], j[rows]
    k1, k2 = np.tile(n1, len(i)), np.tile(n2, len(i))
    got = np.asarray(crit.holds([v1[a], v2[a]], [v1[b], v2[b]], jnp.asarray(k1), jnp.asarray(k2)))
    want = np.zeros(len(a), bool)
    for p in range(len(i)):  # one input pair's covered requirements, by the reference
        cov = ref_pairs(*KINDS[kind], v1[[i[p], j[p]]], v2[[i[p], j[p]]],
                        getattr(crit, "ratio", None), check=False)  # fmt: skip
        want[p * len(n1) : (p + 1) * len(n1)] = cov[n1, n2]
    np.testing.assert_array_equal(got, want)
    assert got.any()  # the check is not vacuous


class Counted(C.Criterion):
    """A criterion of the user's own: how many inputs were seen (nothing to search for)."""

    def init(self, sizes):
        return np.zeros((), np.int32)

    def update(self, state, values, scaled, profile):
        return state + values[0].shape[0]

    def counts(self, state):
        return [(state, 100)]

    def keys(self, layers):
        return ["all"]


def test_a_criterion_without_a_search_says_so(mlp):
    model, variables, x, _ = mlp
    t = C.Tracker(model, variables, x, criteria=[Counted(), C.TKNC(2)])
    t.update(x)
    for name in ("Counted", "TKNC"):
        with pytest.raises(js.InvalidSpecError, match=f"not {name}"):
            C.generate(t, x, name, eps=0.1)
