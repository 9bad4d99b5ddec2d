"""Training NNX slices: optimizer steps, gradients, batch statistics and dropout RNG state.

A slice shares the model's `nnx.Variable`s, so training it must train exactly the
model's corresponding parameters. Every expectation is computed without jaxslice: a deep
copy of the model (`nnx.clone`) runs the same submodules eagerly, with `nnx.grad` and
optax applied by hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxslice as js

from helpers.nnx_zoo import (
    X_CNN,
    X_ZOO,
    as_numpy,
    assert_close,
    cnn_tail,
    make_cnn,
    make_zoo,
    rand,
    snapshot,
    zoo_tail,
)

ZOO_TAIL = [("blocks", "1"), ("branches",), ("seq",), ("head",)]  # modules of blocks/1 -> head
CNN_TAIL = [("block2",), ("drop",), ("head",)]  # modules of block2 -> head


def mse(a, b):
    return jnp.mean((a - b) ** 2)


def under(path, prefixes):
    return any(path[: len(p)] == p for p in prefixes)


def grads_by_model_path(model, container, grads):
    """`grads` (a State over `container`'s variables) keyed by the model's own paths."""
    model_path = {
        id(v): tuple(map(str, p)) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)
    }
    held = {
        tuple(map(str, p)): v for p, v in nnx.iter_graph(container) if isinstance(v, nnx.Variable)
    }
    return {
        model_path[id(held[tuple(map(str, p))])]: as_numpy(g[...])
        for p, g in nnx.to_flat_state(grads)
    }


def changed_paths(before, after):
    assert before.keys() == after.keys()
    return {k for k in before if not np.array_equal(before[k], after[k])}


def handwritten_training(ref, tail_fn, tx, batches):
    """The oracle: optax steps on `ref`'s parameters, the loss from `tail_fn`'s direct calls
    of `ref`'s submodules (no jaxslice). Jitted with `nnx.jit` only to compile once."""

    @nnx.jit
    def step(ref, opt_state, h, y):
        loss, grads = nnx.value_and_grad(lambda m: mse(tail_fn(m, h), y))(ref)
        params = nnx.state(ref, nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        nnx.update(ref, optax.apply_updates(params, updates))
        return loss, opt_state

    opt_state = tx.init(nnx.state(ref, nnx.Param))
    losses = []
    for h, y in batches:
        loss, opt_state = step(ref, opt_state, h, y)
        losses.append(float(loss))
    return losses


@nnx.jit
def train_step(sub, opt, h, y):
    loss, grads = nnx.value_and_grad(lambda s: mse(s(h), y))(sub)
    opt.update(sub, grads)
    return loss


# --------------------------------------------------------------------------- optimizer


def test_sgd_steps_on_a_slice_train_exactly_its_parameters_and_match_handwritten():
    model = make_zoo()
    ref = nnx.clone(model)
    before = snapshot(model, nnx.Param)
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    opt = nnx.Optimizer(sub, optax.sgd(0.2), wrt=nnx.Param)
    batches = [(rand(20 + k, (4, 8)), rand(40 + k, (4, 2))) for k in range(4)]
    losses = [float(train_step(sub, opt, h, y)) for h, y in batches]

    after = snapshot(model, nnx.Param)
    expected_changed = {k for k in before if under(k, ZOO_TAIL)}
    assert expected_changed and len(expected_changed) < len(before)
    assert changed_paths(before, after) == expected_changed  # all others bit-identical

    ref_losses = handwritten_training(ref, zoo_tail, optax.sgd(0.2), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_close(after, snapshot(ref, nnx.Param), atol=1e-5, rtol=1e-4)


def test_adam_steps_with_batchnorm_and_dropout_in_train_mode_match_handwritten():
    model = make_cnn(train=True)
    ref = nnx.clone(model)
    before = snapshot(model)
    sub = js.slice(model, X_CNN, start="block2", end="head")
    opt = nnx.Optimizer(sub, optax.adam(0.05), wrt=nnx.Param)
    batches = [(rand(60 + k, (4, 8, 8, 4)), rand(80 + k, (4, 3))) for k in range(3)]
    losses = [float(train_step(sub, opt, h, y)) for h, y in batches]

    after = snapshot(model)
    expected = {k for k in before if under(k, CNN_TAIL)} - {("drop", "rngs", "key")}
    assert changed_paths(before, after) == expected  # the dropout counter moves, its key not
    ref_losses = handwritten_training(ref, cnn_tail, optax.adam(0.05), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    # parameters, batch statistics and dropout RNG counters all followed the eager copy
    assert_close(after, snapshot(ref), atol=1e-5, rtol=1e-4)


def test_weight_decay_touches_only_parameters_the_slice_uses():
    # `seq/layers/2` -> output uses seq.layers[2] and head; seq.layers[0] sits in the same
    # container but is not part of the slice, so an optimizer over the slice must not own it.
    model = make_zoo()
    before = snapshot(model, nnx.Param)
    sub = js.slice(model, X_ZOO, start="seq/layers/2")
    opt = nnx.Optimizer(sub, optax.adamw(1e-2, weight_decay=0.5), wrt=nnx.Param)
    for k in range(2):
        train_step(sub, opt, rand(100 + k, (4, 8)), rand(120 + k, (4, 2)))
    expected = {k for k in before if under(k, [("seq", "layers", "2"), ("head",)])}
    assert changed_paths(before, snapshot(model, nnx.Param)) == expected


# --------------------------------------------------------------------------- gradients


def test_grad_of_a_slice_equals_grad_of_the_eager_submodules():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    h, y = rand(30, (4, 8)), rand(31, (4, 2))

    g_sub = nnx.grad(lambda s: mse(s(h), y))(sub)
    # the oracle: direct submodule calls (jitted only to compile once instead of per op)
    g_ref = nnx.jit(nnx.grad(lambda m: mse(zoo_tail(m, h), y)))(model)

    got = grads_by_model_path(model, sub, g_sub)
    expected = {tuple(map(str, p)): as_numpy(g[...]) for p, g in nnx.to_flat_state(g_ref)}
    expected = {k: v for k, v in expected.items() if under(k, ZOO_TAIL)}
    assert got.keys() == expected.keys()  # the slice has gradients for its own parameters only
    assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert all(np.any(v != 0) for v in got.values())


def test_grad_with_respect_to_the_slice_input():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    h = rand(32, (4, 8))
    got = jax.grad(lambda v: jnp.sum(sub(v) ** 2))(h)
    expected = jax.jit(jax.grad(lambda v: jnp.sum(zoo_tail(model, v) ** 2)))(h)
    assert_close(got, expected, atol=1e-6)


# --------------------------------------------------------------------------- batch statistics


def test_batchnorm_statistics_in_train_mode_are_updated_like_eager():
    model = make_cnn(train=True)
    a, b = nnx.clone(model), nnx.clone(model)  # a: sliced, b: eager oracle
    initial = snapshot(model)
    sub = js.slice(a, X_CNN, end="block2")
    for seed in (11, 12):
        x = rand(seed, (4, 8, 8, 1))
        assert_close(sub(x), b.block2(b.block1(x)))
    after = snapshot(a)
    assert changed_paths(initial, after) == {k for k in initial if k[-1] in ("mean", "var")}
    assert_close(snapshot(a, nnx.BatchStat), snapshot(b, nnx.BatchStat))

    # a slice starting at block2 updates block2's statistics only
    mid = js.slice(a, X_CNN, start="block2", end="block2")
    h = rand(13, (4, 8, 8, 4))
    assert_close(mid(h), b.block2(h))
    changed = changed_paths(after, snapshot(a))
    assert changed == {("block2", "bn", "mean"), ("block2", "bn", "var")}
    assert_close(snapshot(a), snapshot(b))


def test_batchnorm_statistics_are_untouched_in_eval_mode():
    model = make_cnn(train=False)
    before = snapshot(model)
    sub = js.slice(model, X_CNN, end="block2")
    assert_close(sub(X_CNN), model.block2(model.block1(X_CNN)))
    assert changed_paths(before, snapshot(model)) == set()


def test_batchnorm_train_mode_under_nnx_jit_writes_back_statistics():
    model = make_cnn(train=True)
    ref = nnx.clone(model)
    sub = js.slice(model, X_CNN, start="block2", end="block2")
    h = rand(14, (4, 8, 8, 4))
    out = nnx.jit(lambda s, v: s(v))(sub, h)
    assert_close(out, ref.block2(h))
    assert_close(snapshot(model, nnx.BatchStat), snapshot(ref, nnx.BatchStat))


# --------------------------------------------------------------------------- dropout


def test_dropout_in_train_mode_matches_eager_from_the_same_rng_state():
    model = make_cnn(train=True)
    a, b = nnx.clone(model), nnx.clone(model)
    sub = js.slice(a, X_CNN, start="drop", end="head")
    h = rand(15, (4, 8)) + 2.0
    outs = []
    for _ in range(3):
        out = sub(h)
        assert_close(out, b.head(b.drop(h)))
        outs.append(np.asarray(out))
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2])
    assert_close(snapshot(a, nnx.RngState), snapshot(b, nnx.RngState))
    assert changed_paths(snapshot(model, nnx.RngState), snapshot(a, nnx.RngState))

    mask = js.slice(a, X_CNN, start="drop", end="drop")
    dropped = np.asarray(mask(h))
    assert_close(dropped, b.drop(h))
    ratio = dropped / np.asarray(h)
    assert set(np.round(np.unique(ratio), 5)) <= {0.0, 2.0}
    assert 0 < np.count_nonzero(ratio) < ratio.size


def test_dropout_is_the_identity_in_eval_mode():
    model = make_cnn(train=False)
    before = snapshot(model, nnx.RngState)
    sub = js.slice(model, X_CNN, start="drop", end="head")
    h = rand(16, (4, 8))
    assert_close(sub(h), model.head(h))
    assert_close(sub(h), model.head(h))
    assert changed_paths(before, snapshot(model, nnx.RngState)) == set()
    ident = js.slice(model, X_CNN, start="drop", end="drop")
    assert_close(ident(h), h)
