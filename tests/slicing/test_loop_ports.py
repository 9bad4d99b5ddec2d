"""Ports of calls inside loops: stacked parameters are parameters, and a lifted loop
inside another loop's iteration is a boundary as a whole.

Oracles are the models' own functions applied by hand (rows of the stacked parameters
sliced with numpy indexing), never jaxslice's own results.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

B, D = 2, 4
ATOL = 1e-5


def close(actual, expected):
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"{a_tree} != {e_tree}"
    for a, e in zip(a_leaves, e_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=ATOL, rtol=ATOL)


W = jnp.asarray(np.random.default_rng(0).normal(size=(3, D, D)) / 2, jnp.float32)
X = jnp.asarray(np.random.default_rng(1).normal(size=(B, D)), jnp.float32)


def layer(h, w):
    return jnp.tanh(h @ w)


def stacked(scale: float = 1.0, reverse: bool = False):
    """``scan(b)`` over the rows of stacked weights; `b` gets the row (times `scale`)."""

    def fn(p, x):
        b = js.mark("b", layer)

        def body(h, w):
            return b(h, w * scale if scale != 1.0 else w), None

        return jax.lax.scan(body, x, p, reverse=reverse)[0]

    return fn


def carries(order, scale: float = 1.0, w=W, x=X):
    """The carry before each iteration in `order`, then the result, by hand."""
    hs = [x]
    for k in order:
        hs.append(layer(hs[-1], w[k] * scale))
    return hs


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_a_start_inside_the_loop_takes_no_row_of_stacked_parameters(scale):
    """``start="b[1]"`` takes the carry alone; the row ``w[1]`` (or ``w[1] * 2``) comes
    from the slice's variables (it was a second input the caller had to pass)."""
    fn = stacked(scale)
    hs = carries(range(3), scale)
    to_end = js.slice(fn, W, X, start="b[1]", end=None)
    close(to_end(hs[1]), hs[3])
    close(jax.jit(to_end)(hs[1]), hs[3])
    other = layer(layer(hs[2], W[1] * scale), W[2] * scale)
    close(jax.vmap(to_end)(jnp.stack([hs[1], hs[2]])), jnp.stack([hs[3], other]))
    one = js.slice(fn, W, X, start="b[1]", end="b[2]")
    close(one(hs[1]), hs[3])
    with pytest.raises(js.InputMismatchError):
        one(hs[1], W[1])
    assert to_end.variables.shape == W.shape  # the stacked array, whole


def test_rows_of_a_reverse_scan_are_parameters_too():
    fn = stacked(reverse=True)
    hs = carries([2, 1, 0])
    close(js.slice(fn, W, X, start="b[1]", end=None)(hs[1]), hs[3])


def test_a_loop_constant_computed_from_the_variables_is_a_parameter():
    """``b(h, p[0] * 2)`` with the product made before the loop: not an input either."""

    def fn(p, x):
        b = js.mark("b", layer)
        w = p[0] * 2
        return jax.lax.scan(lambda h, _: (b(h, w), None), x, None, length=3)[0]

    hs = [X]
    for _ in range(3):
        hs.append(layer(hs[-1], W[0] * 2))
    close(js.slice(fn, W, X, start="b[1]", end=None)(hs[1]), hs[3])
    names = ["b[:]:input"] + [f"b[{k}]:input" for k in range(3)]
    got = js.intermediates(fn, W, X, names=names)
    close(got, {"b[:]:input": jnp.stack(hs[:3]), **{f"b[{k}]:input": hs[k] for k in range(3)}})


@pytest.mark.parametrize(("scale", "reverse"), [(1.0, False), (2.0, False), (2.0, True)])
def test_input_ports_leave_rows_of_stacked_parameters_out(scale, reverse):
    """``b[k]:input`` is the carry alone and ``b[:]:input`` the carries stacked, as for
    a loop constant (test_stacked_input_leaves_loop_constants_out)."""
    order = [2, 1, 0] if reverse else [0, 1, 2]
    hs = carries(order, scale)
    before = {k: hs[i] for i, k in enumerate(order)}  # iteration k's input
    names = ["b[:]:input", "b[:]"] + [f"b[{k}]:input" for k in range(3)]
    got = js.intermediates(stacked(scale, reverse), W, X, names=names)
    want = {
        "b[:]:input": jnp.stack([before[k] for k in range(3)]),
        "b[:]": jnp.stack([layer(before[k], W[k] * scale) for k in range(3)]),
        **{f"b[{k}]:input": before[k] for k in range(3)},
    }
    close(got, want)
    ends = js.slice(stacked(scale, reverse), W, X, end=["b[1]:input", "b[:]:input"])(X)
    close(ends, (want["b[1]:input"], want["b[:]:input"]))


def test_gradients_reach_only_the_rows_the_slice_runs():
    """`jax.grad` through ``b[1]`` to the output equals that of the layers written by
    hand: row 0 gets zero, and `merge` writes the stacked array back whole."""
    fn = stacked(2.0)
    hs = carries(range(3), 2.0)
    sub = js.slice(fn, W, X, start="b[1]", end=None)

    def reference(p, h):
        for k in (1, 2):
            h = layer(h, p[k] * 2.0)
        return jnp.sum(h**2)

    grads = jax.grad(lambda v: jnp.sum(sub.apply(v, hs[1]) ** 2))(sub.variables)
    close(grads, jax.grad(reference)(W, hs[1]))
    assert float(jnp.abs(grads[0]).max()) == 0.0
    new = sub.variables - 0.1 * grads
    close(sub.merge(W, new), new)


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(D, name="dense")(h)), None


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        lifted = nn.scan(_Dense, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        h, _ = lifted(name="inner")(h, None)
        return h * 1.5, None


class _Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(D, name="embed")(x)
        lifted = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        h, _ = lifted(name="outer")(h, None)
        return nn.Dense(2, name="head")(h)


def _nested():
    model = _Nested()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, 3)), jnp.float32)
    return model, model.init(jax.random.key(0), x), x


def _inner_by_hand(params, i, h):
    """``outer[i]/inner`` applied by hand: `_Dense` with its rows of the variables."""
    rows = params["outer"]["inner"]
    for j in range(2):
        h, _ = _Dense().apply({"params": jax.tree.map(lambda a, j=j: a[i, j], rows)}, h, None)
    return h


def _carries_by_hand(params, x):
    h = nn.Dense(D).apply({"params": params["embed"]}, x)
    hs = [h]
    for i in range(3):
        hs.append(_inner_by_hand(params, i, hs[-1]) * 1.5)
    return hs


def test_a_lifted_loop_inside_an_iteration_is_a_boundary_as_a_whole():
    """``outer[2]/inner`` is the inner ``nn.scan`` called in outer iteration 2: its
    input is that iteration's carry, its output the inner loop's result."""
    model, v, x = _nested()
    hs = _carries_by_hand(v["params"], x)
    names = ["outer[2]/inner", "outer[2]/inner:input", "outer[:]/inner", "outer[:]/inner:input"]
    got = js.intermediates(model, v, x, names=names)
    want = {
        "outer[2]/inner": (hs[3] / 1.5, None),
        "outer[2]/inner:input": hs[2],
        "outer[:]/inner": (jnp.stack(hs[1:]) / 1.5, None),
        "outer[:]/inner:input": jnp.stack(hs[:3]),
    }
    close(got, want)
    close(js.slice(model, v, x, end="outer[-1]/inner")(x), want["outer[2]/inner"])


def test_a_slice_starts_and_ends_at_lifted_loops_inside_iterations():
    model, v, x = _nested()
    params = v["params"]
    hs = _carries_by_hand(params, x)
    head = lambda h: nn.Dense(2).apply({"params": params["head"]}, h)  # noqa: E731
    sub = js.slice(model, v, x, start="outer[2]/inner", end=None)
    close(sub(hs[2] + 1.0), head(_inner_by_hand(params, 2, hs[2] + 1.0) * 1.5))
    between = js.slice(model, v, x, start="outer[1]/inner", end="outer[2]/inner")
    given = hs[1] - 0.5
    close(between(given), (_inner_by_hand(params, 2, _inner_by_hand(params, 1, given) * 1.5), None))

    def reference(p, h):
        return jnp.sum(_inner_by_hand(p, 2, _inner_by_hand(p, 1, h) * 1.5) ** 2)

    grads = jax.grad(lambda w: jnp.sum(between.apply(w, given)[0] ** 2))(between.variables)
    want = jax.grad(reference)({"outer": params["outer"]}, given)
    close(grads["params"], want)
    assert float(jnp.abs(grads["params"]["outer"]["inner"]["dense"]["kernel"][0]).max()) == 0.0


def test_a_wrong_iteration_of_a_lifted_loop_as_a_whole_is_a_clear_error():
    model, v, x = _nested()
    with pytest.raises(js.UnknownBoundaryError, match="runs 3 times"):
        js.slice(model, v, x, end="outer[3]/inner")
    with pytest.raises(js.SliceError, match="outer\\[0\\]/inner"):
        js.slice(model, v, x, start="outer[:]/inner", end=None)
