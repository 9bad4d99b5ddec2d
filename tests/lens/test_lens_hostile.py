"""`js.lens` called with inputs of other shapes than it was made with, values of other
dtypes than the site's, and bad sweep arguments.

The oracles are the models written out step by step by hand (a Python loop over the
steps of a recurrence, with the intervention applied after the step it names), never the
lens's own output. Errors are caught by their public category and checked by class name,
as in `test_lens_errors.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close

H = 3


class Cell(nn.Module):
    """``h' = tanh(W h + U x_t)``."""

    @nn.compact
    def __call__(self, h, xt):
        return jnp.tanh(nn.Dense(H, name="wh")(h) + nn.Dense(H, name="wx")(xt)), None


class RNN(nn.Module):
    """`Cell` scanned over the first (time) axis of its input: the scan's length is T."""

    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False})
        h, _ = scan(name="cell")(jnp.zeros((xs.shape[1], H)), xs)
        return nn.Dense(1, name="out")(h)


class Unrolled(nn.Module):
    """One `Dense` called once per step of a Python loop over T: T calls ``cell@t``."""

    @nn.compact
    def __call__(self, xs):
        cell = nn.Dense(H, name="cell")
        h = jnp.zeros(H)
        for t in range(xs.shape[0]):
            h = jnp.tanh(cell(h) + xs[t])
        return h


XS5 = jax.random.normal(jax.random.key(0), (5, 2, 2))
XS7 = jax.random.normal(jax.random.key(1), (7, 2, 2))
RNN_VARS = RNN().init(jax.random.key(2), XS5)
VEC = jnp.array([1.0, -2.0, 3.0])


def rnn_by_hand(xs: Any, edits: dict[int, Any]) -> tuple[Any, list[Any]]:
    """The RNN step by step, ``edits[t](h)`` after step t: its output and every step's
    state (after the edit)."""
    p = RNN_VARS["params"]
    h, states = jnp.zeros((xs.shape[1], H)), []
    for t in range(xs.shape[0]):
        h = jnp.tanh(h @ p["cell"]["wh"]["kernel"] + p["cell"]["wh"]["bias"]
                     + xs[t] @ p["cell"]["wx"]["kernel"] + p["cell"]["wx"]["bias"])  # fmt: skip
        h = edits[t](h) if t in edits else h
        states.append(h)
    return h @ p["out"]["kernel"] + p["out"]["bias"], states


@contextlib.contextmanager
def raises(name: str, category: type[Exception], match: str) -> Iterator[Any]:
    """`pytest.raises` of the lens error class `name` (by its public category)."""
    with pytest.raises(category, match=match) as info:
        yield info
    assert type(info.value).__name__ == name, repr(info.value)


@pytest.fixture(scope="module")
def rnn_lens() -> js.Lens:
    return js.lens(RNN(), RNN_VARS, XS5)  # made with sequences of 5 steps


# --------------------------------------------------------------------------- other lengths


def test_a_negative_iteration_is_this_calls_last_step(rnn_lens):
    out = rnn_lens(XS7, add={"cell[-1]": VEC})
    assert_trees_all_close(out, rnn_by_hand(XS7, {6: lambda h: h + VEC})[0])
    out = rnn_lens(XS7, add={"cell[6]": VEC})  # past the length the lens was made with
    assert_trees_all_close(out, rnn_by_hand(XS7, {6: lambda h: h + VEC})[0])


def test_a_read_of_one_iteration_is_this_calls_step(rnn_lens):
    _, states = rnn_by_hand(XS7, {})
    _, cache = rnn_lens(XS7, read=["cell[-1]", "cell[-3]", "cell[:]"])
    assert_trees_all_close(cache["cell[-1]"], states[6])
    assert_trees_all_close(cache["cell[-3]"], states[4])
    assert_trees_all_close(cache["cell[:]"], jnp.stack(states))


def test_every_iteration_values_have_this_calls_rows(rnn_lens):
    rows = jnp.arange(7.0)[:, None, None] * jnp.ones(H)  # step t adds t
    out = rnn_lens(XS7, add={"cell[:]": rows})
    want, _ = rnn_by_hand(XS7, {t: (lambda h, t=t: h + t) for t in range(7)})
    assert_trees_all_close(out, want)
    with raises("LensValueShapeError", js.InputMismatchError, r"\(7, 2, 3\)"):
        rnn_lens(XS7, add={"cell[:]": rows[:5]})  # the made length's rows: not clamped


def test_a_sweep_at_another_length_picks_this_calls_step(rnn_lens):
    vs = jnp.stack([VEC, 2 * VEC])
    outs = rnn_lens.sweep(XS7, add={"cell[-2]": vs})
    want = jnp.stack([rnn_by_hand(XS7, {5: lambda h, v=v: h + v})[0] for v in vs])
    assert_trees_all_close(outs, want)


def test_an_iteration_past_this_calls_length_is_refused(rnn_lens):
    xs3 = XS7[:3]
    with raises("LensSiteNotAtCallError", js.InvalidSpecError, r"'cell\[4\]'.*runs 3 times"):
        rnn_lens(xs3, add={"cell[4]": VEC})
    with raises("LensSiteNotAtCallError", js.InvalidSpecError, r"'cell\[-4\]'"):
        rnn_lens(xs3, read=["cell[-4]"])
    out = rnn_lens(xs3, add={"cell[-1]": VEC})
    assert_trees_all_close(out, rnn_by_hand(xs3, {2: lambda h: h + VEC})[0])


def test_iterations_at_another_length_compile_once(rnn_lens):
    """The iteration stays data at every input shape: each step of a 7-step input, in
    turn, runs one program."""
    names: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kwargs.get("fun_name")))

    rnn_lens(XS7, add={"cell[0]": VEC})
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        outs = [rnn_lens(XS7, add={f"cell[{t}]": VEC}) for t in range(1, 7)]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert names == [], names
    assert_trees_all_close(outs[-1], rnn_by_hand(XS7, {6: lambda h: h + VEC})[0])


# --------------------------------------------------------------------------- other calls


def test_a_site_this_call_has_works_when_others_are_missing():
    """Made at T=3 (``cell@0..2``), called at T=2: only the sites named must exist."""
    x3, x2 = jnp.ones((3, H)), 0.5 * jnp.ones((2, H))
    variables = Unrolled().init(jax.random.key(0), x3)
    lens = js.lens(Unrolled(), variables, x3)
    assert list(lens.sites) == ["cell@0", "cell@1", "cell@2"]
    k = variables["params"]["cell"]
    h = jnp.tanh(jnp.zeros(H) @ k["kernel"] + k["bias"] + 1.0 + x2[0])
    want = jnp.tanh(h @ k["kernel"] + k["bias"] + x2[1])
    assert_trees_all_close(lens(x2, add={"cell@0": jnp.ones(H)}), want)
    _, cache = lens(x2, read=True)  # every site this call has
    assert sorted(cache) == ["cell@0", "cell@1"]
    with raises("LensSiteNotAtCallError", js.InvalidSpecError, r"'cell@2'"):
        lens(x2, add={"cell@2": jnp.ones(H)})


# --------------------------------------------------------------------------- dtypes


class Count(nn.Module):
    """An integer-valued call: 4 x the number of positive entries per row."""

    def __call__(self, h):
        return (h > 0).sum(-1).astype(jnp.int32) * 4


class Counting(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="a")(x)
        return Count(name="count")(h).astype(jnp.float32)


def test_scale_and_add_compute_in_the_promoted_dtype():
    x = jax.random.normal(jax.random.key(3), (3, 4))
    variables = Counting().init(jax.random.key(4), x)
    lens = js.lens(Counting(), variables, x)
    p = variables["params"]["a"]
    count = ((x @ p["kernel"] + p["bias"] > 0).sum(-1) * 4).astype(jnp.int32)
    for s in (0.5, 1.5):
        want = (count * s).astype(jnp.int32).astype(jnp.float32)  # h * s, cast back
        assert_trees_all_close(lens(x, scale={"count": s}), want)
    want = (count - 0.5).astype(jnp.int32).astype(jnp.float32)  # 28 - 0.5 -> 27
    assert_trees_all_close(lens(x, add={"count": -0.5}), want)
    with raises("LensComplexValueError", js.InputMismatchError, r"'a'.*complex64.*float32"):
        lens(x, add={"a": 1j})


# --------------------------------------------------------------------------- sweeps


@pytest.mark.parametrize("batch_size", [-1, 1.0, "4", True])
def test_a_bad_batch_size_is_refused(rnn_lens, batch_size):
    with raises("LensBatchSizeError", js.InputMismatchError, r"batch_size= takes a non-neg"):
        rnn_lens.sweep(XS5, add={"cell[1]": jnp.stack([VEC, VEC])}, batch_size=batch_size)
