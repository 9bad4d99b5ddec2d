"""Boundaries that end (or start) at the same equation are met innermost-last on the way
in and innermost-first on the way out, for `jax.named_scope` regions nested in each
other, marked calls inside a scope and an Equinox MLP (whose calls are scopes): an
intervention at the outer boundary sees, and overrides, one at the inner.

Oracles: the functions written out by hand with the change at each place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, random_input

X = random_input(50, (3,))
W = random_input(51, (3, 3))


def nested(p: Any, x: Any) -> Any:
    with jax.named_scope("outer"):
        h = jnp.tanh(x)
        with jax.named_scope("inner"):
            y = h * 3.0  # the outer scope's output is the inner one's
    return y + 1.0


def marked_inside(w: Any, x: Any) -> Any:
    with jax.named_scope("grp"):
        h = jnp.tanh(x)
        return js.mark("lin")(lambda h: h @ w)(h)  # ends with the scope


def test_nested_scopes_end_inner_first():
    lens = js.lens(nested, None, X)
    inner = 3.0 * jnp.tanh(X)
    ones = jnp.ones(3)
    out, cache = lens(X, add={"outer/inner": ones}, read=["outer"])
    assert_trees_all_close(cache["outer"], inner + 1.0)
    assert_trees_all_close(out, inner + 2.0)
    # The outer `set` is last: the inner `add` does not survive it.
    out = lens(X, set={"outer": jnp.zeros(3)}, add={"outer/inner": ones})
    assert_trees_all_close(out, ones)
    # The same order for edits.
    edited = (
        js.edit(nested, None, X)
        .insert_after("outer/inner", lambda h: h + 1.0, name="plus")
        .insert_after("outer", lambda h: 2.0 * h, name="twice")
    )
    assert_trees_all_close(edited.build()(X), 2.0 * (inner + 1.0) + 1.0)


def test_a_scope_ends_after_the_marked_call_it_holds():
    lens = js.lens(marked_inside, W, X)
    ones = jnp.ones(3)
    out, cache = lens(X, add={"grp/lin": ones}, read=["grp"])
    assert_trees_all_close(cache["grp"], jnp.tanh(X) @ W + 1.0)
    assert_trees_all_close(lens(X, set={"grp": jnp.zeros(3)}, add={"grp/lin": ones}), 0 * ones)


def test_an_equinox_mlp_in_a_plain_function():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(3, 2, 5, 2, key=jax.random.key(0))
    xs = random_input(52, (4, 3))

    def f(p: Any, x: Any) -> Any:
        return jax.vmap(mlp)(x)

    lens = js.lens(f, None, xs)
    top = next(s for s in lens.sites if s.endswith("MLP"))
    last = next(s for s in lens.sites if s.endswith("Linear@2"))
    ones = jnp.ones(2)
    out, cache = lens(xs, add={last: ones}, read=[top])
    assert_trees_all_close(cache[top], f(None, xs) + 1.0)
    assert_trees_all_close(lens(xs, set={top: jnp.zeros(2)}, add={last: ones}), jnp.zeros((4, 2)))
