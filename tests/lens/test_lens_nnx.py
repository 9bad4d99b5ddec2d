"""`js.lens` on Flax NNX models: a stack made by `nnx.vmap` and run by `nnx.scan`, and a
plain MLP. The lens reads an NNX model's variables live, so a change made in place is
seen by the next call.

Oracles: the model's own call, and the same models written by hand in JAX, reading the
model's parameters at the time of the call, with the intervention written in by hand.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxslice as js  # noqa: E402

from helpers.models import SCAN_LAYERS, SCAN_WIDTH, nnx_scanned  # noqa: E402
from helpers.oracles import assert_trees_all_close, random_input  # noqa: E402

L, D = SCAN_LAYERS, SCAN_WIDTH
X = random_input(20, (2, 4))


def linear(m: Any, h: Any, k: int | None = None) -> Any:
    w, b = m.kernel[...], m.bias[...]
    if k is not None:
        w, b = w[k], b[k]
    return h @ w + b


def scanned_by_hand(model: Any, x: Any, hook: Any) -> Any:
    """`nnx_scanned`'s model by hand: ``hook(site, layer, value)`` at each site."""
    h = hook("embed", None, linear(model.embed, x))
    for k in range(L):
        a = hook("layers[:]/attn", k, linear(model.layers.attn, h, k))
        m = hook("layers[:]/mlp", k, linear(model.layers.mlp, jnp.tanh(a), k))
        h = hook("layers[:]", k, h + m)
    return hook("head", None, linear(model.head, h))


def at(site: str, layer: int | None, change: Any) -> Any:
    def hook(name: str, k: int | None, value: Any) -> Any:
        if name != site or (layer is not None and k != layer):
            return value
        return change(k, value)

    return hook


def keep(name: str, k: int | None, value: Any) -> Any:
    return value


@pytest.fixture(scope="module")
def scanned() -> Any:
    return nnx_scanned(nnx.Rngs(0))


def test_the_hand_written_stack_is_the_model(scanned):
    assert_trees_all_close(scanned_by_hand(scanned, X, keep), scanned(X))


def test_interventions_in_an_nnx_scanned_stack(scanned):
    lens = js.lens(scanned, X)
    assert lens.sites["layers[:]/attn"].stacked.shape == (L, 2, D)
    assert_trees_all_close(lens(X), scanned(X))
    v = random_input(21, (D,))
    want = scanned_by_hand(scanned, X, at("layers[:]", 2, lambda k, h: h + v))
    assert_trees_all_close(lens(X, add={"layers[2]": v}), want)
    want = scanned_by_hand(scanned, X, at("layers[:]/attn", None, lambda k, a: 0.0 * a))
    assert_trees_all_close(lens(X, scale={"layers[:]/attn": 0.0}), want)
    rows = random_input(22, (L, 1, D))
    want = scanned_by_hand(scanned, X, at("layers[:]/mlp", None, lambda k, m: m + rows[k]))
    assert_trees_all_close(lens(X, add={"layers[:]/mlp": rows}), want)


def test_reads_and_a_sweep_in_an_nnx_scanned_stack(scanned):
    lens = js.lens(scanned, X, sites=["layers[:]", "layers[:]/mlp", "head"])
    seen: dict[str, list[Any]] = {}

    def record(name: str, k: int | None, value: Any) -> Any:
        seen.setdefault(name, []).append(value)
        return value

    want_out = scanned_by_hand(scanned, X, record)
    out, cache = lens(X, read=True)
    assert_trees_all_close(out, want_out)
    assert_trees_all_close(cache["layers[:]"], jnp.stack(seen["layers[:]"]))
    assert_trees_all_close(cache["layers[:]/mlp"], jnp.stack(seen["layers[:]/mlp"]))
    assert_trees_all_close(cache["head"], seen["head"][0])

    vs = random_input(23, (3, D))
    swept = lens.sweep(X, add={"layers[3]/mlp": vs})
    for i in range(3):
        want = scanned_by_hand(scanned, X, at("layers[:]/mlp", 3, lambda k, m, i=i: m + vs[i]))
        assert_trees_all_close(swept[i], want)


def test_the_lens_sees_an_nnx_stack_changed_in_place(scanned):
    model = nnx.clone(scanned)  # changed below; the fixture stays as it is
    lens = js.lens(model, X, sites=["layers[:]"])
    v = random_input(24, (D,))
    before = lens(X, add={"layers[1]": v})
    model.layers.mlp.kernel[...] = model.layers.mlp.kernel[...] * 1.5 + 0.1
    model.head.bias[...] = model.head.bias[...] - 0.3
    want = scanned_by_hand(model, X, at("layers[:]", 1, lambda k, h: h + v))
    got = lens(X, add={"layers[1]": v})
    assert_trees_all_close(got, want)
    assert not np.allclose(got, before)
    assert_trees_all_close(lens(X), model(X))


class MLP(nnx.Module):
    def __init__(self, rngs: Any):
        self.fc1 = nnx.Linear(4, 6, rngs=rngs)
        self.fc2 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.fc2(jax.nn.relu(self.fc1(x)))


def mlp_by_hand(model: MLP, x: Any, fc1: Any = lambda h: h) -> Any:
    return linear(model.fc2, jax.nn.relu(fc1(linear(model.fc1, x))))


def test_a_plain_nnx_mlp_and_its_parameters_changed_in_place():
    model = MLP(nnx.Rngs(2))
    lens = js.lens(model, X)
    assert set(lens.sites) == {"fc1", "fc2"}
    v = random_input(25, (6,))
    assert_trees_all_close(lens(X), model(X))
    assert_trees_all_close(lens(X, add={"fc1": v}), mlp_by_hand(model, X, lambda h: h + v))
    out, cache = lens(X, scale={"fc1": 0.5}, read=["fc1"])
    assert_trees_all_close(out, mlp_by_hand(model, X, lambda h: 0.5 * h))
    assert_trees_all_close(cache["fc1"], 0.5 * linear(model.fc1, X))

    model.fc1.kernel[...] = -model.fc1.kernel[...]
    model.fc2.bias[...] = model.fc2.bias[...] + 1.0
    got = lens(X, add={"fc1": v})
    assert_trees_all_close(got, mlp_by_hand(model, X, lambda h: h + v))
    assert_trees_all_close(lens(X), model(X))
    # a submodule replaced by a new one of the same shapes, and a whole state update
    model.fc2 = nnx.Linear(6, 3, rngs=nnx.Rngs(3))
    nnx.update(model, jax.tree_util.tree_map(lambda a: 0.5 * a, nnx.state(model)))
    got = lens(X, add={"fc1": v})
    assert_trees_all_close(got, mlp_by_hand(model, X, lambda h: h + v))
    assert_trees_all_close(lens(X), model(X))


def test_apply_takes_an_nnx_state(scanned):
    # KNOWN BUG, reported to be fixed in the library (not here): on JAX 0.10.2 and the
    # Flax installed with it, `lens.apply(nnx.state(model), x)` raises a bare
    # AttributeError ("No attribute 'flat' in State"): `apply` only takes the private
    # object `lens.variables` returns for NNX. It should run the model with that state,
    # as `nnx.merge(graphdef, state)` would, or raise a `js.SliceError` saying what to pass.
    lens = js.lens(scanned, X, sites=["layers[:]"])
    halved = jax.tree_util.tree_map(lambda a: 0.5 * a, nnx.state(scanned))
    other = nnx.clone(scanned)
    nnx.update(other, halved)
    v = random_input(26, (D,))
    try:
        got = lens.apply(halved, X, add={"layers[1]": v})
    except js.SliceError as error:  # a clear refusal is an acceptable fix too
        assert "nnx" in str(error).lower(), error
        return
    assert_trees_all_close(got, scanned_by_hand(other, X, at("layers[:]", 1, lambda k, h: h + v)))
