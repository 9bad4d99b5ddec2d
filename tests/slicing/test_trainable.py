"""Trainable slices of linen models: variables, gradients, train mode, merge, transforms.

Every expected value comes from outside jaxslice: the full model's ``model.apply`` with
Flax's ``capture_intermediates`` (for the values at a slice's boundaries), ``jax.grad`` of
the full model, and hand-written optax loops on the full model.

The model is tiny (Conv + BatchNorm + Dropout + Dense) and its slices are built once per
module, so the file stays fast; JAX compilation dominates its run time.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close as assert_close
from helpers.oracles import random_input as rand
from helpers.oracles import random_variables

# Incremented each time `Tap.__call__` runs, i.e. each time the model is traced or run
# eagerly. Tests read differences around calls of a slice, where it only counts traces.
TRACES = [0]


# --------------------------------------------------------------------------- model


class Pool(nn.Module):
    """Parameter-free: relu, then spatial mean. Its output is the head's input."""

    @nn.compact
    def __call__(self, x):
        return jnp.mean(nn.relu(x), axis=(1, 2))


class Tap(nn.Module):
    """Identity that counts how often it is traced."""

    @nn.compact
    def __call__(self, x):
        TRACES[0] += 1
        return x


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Conv(4, (3, 3), name="conv")(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn1")(h)
        h = Pool(name="pool")(h)
        h = nn.Dense(8, name="fc1")(h)
        h = Tap(name="tap")(h)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn2")(h)
        h = nn.relu(h)
        h = nn.Dropout(0.5, deterministic=not train, name="drop")(h)
        return nn.Dense(3, name="head")(h)


BODY = {"conv", "bn1"}  # modules with variables before the head
HEAD = {"fc1", "bn2", "head"}  # modules with variables from `fc1` to the end
BATCH = 4
X_SHAPE = (BATCH, 5, 5, 2)
H_SHAPE = (BATCH, 4)
OUT_SHAPE = (BATCH, 3)


# --------------------------------------------------------------------------- helpers


def paths(tree: Any) -> dict[tuple[str, ...], Any]:
    """``{("params", "fc1", "kernel"): leaf, ...}`` for every leaf of a nested mapping."""
    return {
        tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): leaf
        for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def module_paths(variables: Any, modules: set[str]) -> set[tuple[str, ...]]:
    """Leaf paths of `variables` (every collection) that belong to `modules`."""
    return {p for p in paths(variables) if p[1] in modules}


@functools.cache
def _recorder(model: nn.Module, train: bool, mutable: tuple[str, ...]) -> Any:
    def run(variables, x, rngs):
        return model.apply(
            variables,
            x,
            train=train,
            rngs=rngs,
            capture_intermediates=True,
            mutable=["intermediates", *mutable],
        )

    return jax.jit(run)  # one compilation instead of many eager op-by-op ones


def record(
    model: nn.Module,
    variables: Any,
    x: Any,
    *,
    train: bool,
    rngs: Any = None,
    mutable: tuple[str, ...] = (),
) -> tuple[Any, dict[str, Any]]:
    """The full model's output and updated state, with every module's output recorded.

    Flax's own ``capture_intermediates``. Returns ``(out, state)``;
    ``state["intermediates"][name]`` is the output of module `name`.
    """
    out, state = _recorder(model, train, tuple(mutable))(variables, x, rngs)
    state = dict(state)
    inter = state.pop("intermediates")
    state["intermediates"] = {k: v["__call__"][0] for k, v in inter.items() if k != "__call__"}
    return out, state


def loss_of(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out - target) ** 2) + 0.1 * jnp.sum(jnp.sin(out))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model() -> Net:
    return Net()


@pytest.fixture(scope="module")
def x() -> jax.Array:
    return rand(0, X_SHAPE)


@pytest.fixture(scope="module")
def variables(model, x) -> Any:
    return random_variables(model, x, seed=1)


@pytest.fixture(scope="module")
def eval_record(model, variables, x) -> tuple[Any, dict[str, Any]]:
    return record(model, variables, x, train=False)


@pytest.fixture(scope="module")
def h(eval_record) -> jax.Array:
    """The head's input (the output of `pool`) recorded in eval mode."""
    return eval_record[1]["intermediates"]["pool"]


@pytest.fixture(scope="module")
def head(model, variables, x) -> js.Sliced:
    """`fc1` .. the model's output, sliced in eval mode."""
    return js.slice(model, variables, x, start="fc1", train=False)


@pytest.fixture(scope="module")
def whole(model, variables, x) -> js.Sliced:
    """The model's inputs .. its output."""
    return js.slice(model, variables, x, train=False)


@pytest.fixture(scope="module")
def target() -> jax.Array:
    return rand(7, OUT_SHAPE)


# --------------------------------------------------------------------------- variables


def test_variables_hold_exactly_the_slice_modules(model, variables, x, head, whole):
    body = js.slice(model, variables, x, end="pool", train=False)
    original = paths(variables)
    for sub, modules in ((head, HEAD), (whole, BODY | HEAD), (body, BODY)):
        got = paths(sub.variables)
        assert set(got) == module_paths(variables, modules)
        for coll in ("params", "batch_stats"):
            assert {p[1] for p in got if p[0] == coll} == {
                p[1] for p in module_paths(variables, modules) if p[0] == coll
            }
        for p, leaf in got.items():
            assert leaf is original[p], f"{p} is a copy, not the original array"
    # Nesting and keys as the model's: the same collections, module names and leaf names.
    assert set(head.variables) == {"params", "batch_stats"}
    assert set(head.variables["params"]) == HEAD
    assert set(head.variables["batch_stats"]) == {"bn2"}
    assert set(head.variables["params"]["bn2"]) == {"scale", "bias"}
    assert set(head.variables["batch_stats"]["bn2"]) == {"mean", "var"}
    assert set(body.variables["params"]) == BODY
    assert set(body.variables["batch_stats"]) == {"bn1"}


def test_slice_matches_full_model_in_eval_mode(head, whole, x, h, eval_record):
    out, state = eval_record
    assert_close(head(h), out)
    assert_close(head.apply(head.variables, h), out)
    assert_close(whole(x), out)


# --------------------------------------------------------------------------- gradients


def test_grad_of_whole_slice_equals_grad_of_full_model(model, variables, whole, x, target):
    def full_loss(params):
        return loss_of(model.apply({**variables, "params": params}, x, train=False), target)

    def sub_loss(params):
        return loss_of(whole.apply({**whole.variables, "params": params}, x), target)

    expected = jax.jit(jax.grad(full_loss))(variables["params"])
    got = jax.grad(sub_loss)(whole.variables["params"])
    assert_close(got, expected)
    assert any(float(jnp.abs(g).max()) > 1e-3 for g in jax.tree_util.tree_leaves(got))


def test_grad_of_head_slice_equals_full_model_grad_of_head(model, variables, head, x, h, target):
    def full_loss(params):
        return loss_of(model.apply({**variables, "params": params}, x, train=False), target)

    def sub_loss(params):
        return loss_of(head.apply({**head.variables, "params": params}, h), target)

    full = jax.jit(jax.grad(full_loss))(variables["params"])
    expected = {k: full[k] for k in HEAD}
    got = jax.grad(sub_loss)(head.variables["params"])
    assert_close(got, expected)


def test_grad_with_respect_to_the_slice_input(model, variables, head, x, h, target):
    """The gradient flows into the slice's input as through the full model's pool output."""

    def through_model(hh):
        # Replace pool's output in the full model with `hh` (Flax's public interceptor).
        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.module.name == "pool" and context.method_name == "__call__":
                return hh
            return out

        with nn.intercept_methods(interceptor):
            return loss_of(model.apply(variables, x, train=False), target)

    expected = jax.jit(jax.grad(through_model))(h)
    got = jax.grad(lambda hh: loss_of(head(hh), target))(h)
    assert_close(got, expected)


# --------------------------------------------------------------------------- train mode


def test_train_mode_matches_full_model(model, variables, x, head):
    key = jax.random.key(3)
    out, state = record(
        model, variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
    )
    h_train = state["intermediates"]["pool"]
    got, updates = head.apply(
        head.variables, h_train, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
    )
    assert_close(got, out)
    # Only the slice's own state: bn2, not bn1 (which the full model also updated).
    assert set(updates) == {"batch_stats"}
    assert set(updates["batch_stats"]) == {"bn2"}
    assert_close(updates["batch_stats"]["bn2"], state["batch_stats"]["bn2"])
    # The updates really moved the statistics, and dropout really dropped something.
    assert not np.allclose(
        updates["batch_stats"]["bn2"]["mean"], variables["batch_stats"]["bn2"]["mean"]
    )
    other, _ = head.apply(
        head.variables,
        h_train,
        train=True,
        rngs={"dropout": jax.random.key(4)},
        mutable=["batch_stats"],
    )
    assert not np.allclose(other, got)


def test_train_mode_whole_slice_matches_full_model(model, variables, x, whole):
    key = jax.random.key(5)
    out, state = record(
        model, variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
    )
    got, updates = whole.apply(
        whole.variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
    )
    assert_close(got, out)
    assert_close(updates, {"batch_stats": state["batch_stats"]})


def test_train_mode_slice_without_batchnorm(model, variables, x):
    """A classifier slice (relu, dropout, dense) of a model whose body has BatchNorm.

    The slice holds no state, so in train mode it is called without `mutable` (there is
    nothing it could update) and must give the full model's output with the same dropout
    mask. The full model's bn1/bn2 updates are outside the slice.
    """
    clf = js.slice(model, variables, x, start="bn2:output", train=False)
    assert set(clf.variables) == {"params"} and set(clf.variables["params"]) == {"head"}
    key = jax.random.key(6)
    out, state = record(
        model, variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
    )
    got = clf.apply(clf.variables, state["intermediates"]["bn2"], train=True, rngs={"dropout": key})
    assert_close(got, out)
    # The slice updates no batch statistics: asking for them is an error.
    with pytest.raises(js.SliceError, match="batch_stats"):
        clf.apply(
            clf.variables,
            state["intermediates"]["bn2"],
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
    # Without keys for its dropout, the error says to pass rngs.
    with pytest.raises(js.ModelTraceError, match="rngs"):
        clf.apply(clf.variables, state["intermediates"]["bn2"], train=True)


def test_eval_mode_mutable_returns_the_slice_entries_as_linen_does(model, variables, x, head, h):
    """linen returns a mutable collection even when nothing changed it (eval mode)."""
    out, state = record(model, variables, x, train=False, mutable=["batch_stats"])
    got, updates = head.apply(head.variables, h, mutable=["batch_stats"])
    assert_close(got, out)
    assert_close(updates, {"batch_stats": {"bn2": state["batch_stats"]["bn2"]}})


def test_eval_mode_is_restored_after_train_mode(head, h, eval_record):
    head.apply(
        head.variables, h, train=True, rngs={"dropout": jax.random.key(0)}, mutable=["batch_stats"]
    )
    assert_close(head(h), eval_record[0])
    assert_close(head.apply(head.variables, h, train=False), eval_record[0])


# --------------------------------------------------------------------------- merge


def test_merge_replaces_only_the_slice_entries(variables, head):
    new = jax.tree_util.tree_map(lambda a: a + 1.0, head.variables)
    merged = head.merge(variables, new)
    assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(variables)
    original, new_leaves = paths(variables), paths(new)
    for p, leaf in paths(merged).items():
        if p in new_leaves:
            assert leaf is new_leaves[p], p
        else:
            assert p[1] in BODY
            assert leaf is original[p], p
    # The original variables are untouched.
    assert paths(variables)[("params", "fc1", "kernel")] is original[("params", "fc1", "kernel")]


def test_merge_of_state_updates_only(variables, head, h):
    _, updates = head.apply(
        head.variables, h, train=True, rngs={"dropout": jax.random.key(0)}, mutable=["batch_stats"]
    )
    merged = head.merge(variables, updates)
    original = paths(variables)
    for p, leaf in paths(merged).items():
        if p[:2] == ("batch_stats", "bn2"):
            assert leaf is updates["batch_stats"]["bn2"][p[2]]
        else:
            assert leaf is original[p], p


def test_merge_rejects_unknown_paths(variables, head):
    with pytest.raises(js.VariablesMismatchError, match="nonexistent"):
        head.merge(variables, {"params": {"nonexistent": {"kernel": jnp.ones(3)}}})


def test_finetune_head_with_optax_then_merge(model, variables, x, head, target):
    """Fine-tune the head in train mode (dropout + batch statistics) under jax.jit.

    The oracle is the same optax loop on the full model, updating only the head's
    parameters. Merged back, the full model agrees with the fine-tuned slice.
    """
    # SGD, not Adam: fc1's bias feeds a train-mode BatchNorm, so its gradient is ~0 and Adam
    # would blow rounding noise up to full-size steps.
    tx = optax.sgd(5e-2, momentum=0.9)
    keys = jax.random.split(jax.random.key(11), 3)
    h_train = record(
        model, variables, x, train=True, rngs={"dropout": keys[0]}, mutable=["batch_stats"]
    )[1]["intermediates"]["pool"]

    @jax.jit
    def sub_step(params, stats, opt_state, hh, key):
        def loss(p):
            out, upd = head.apply(
                {"params": p, "batch_stats": stats},
                hh,
                train=True,
                rngs={"dropout": key},
                mutable=["batch_stats"],
            )
            return loss_of(out, target), upd["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        upd, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), stats, opt_state, value

    @jax.jit
    def full_step(head_params, stats, opt_state, xx, key):
        def loss(p):
            out, st = model.apply(
                {"params": {**variables["params"], **p}, "batch_stats": stats},
                xx,
                train=True,
                rngs={"dropout": key},
                mutable=["batch_stats"],
            )
            return loss_of(out, target), st["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(head_params)
        upd, opt_state = tx.update(grads, opt_state, head_params)
        return optax.apply_updates(head_params, upd), stats, opt_state, value

    params, stats = head.variables["params"], head.variables["batch_stats"]
    opt_state = tx.init(params)
    ref_params = {k: variables["params"][k] for k in HEAD}
    ref_stats, ref_opt = variables["batch_stats"], tx.init(ref_params)
    losses, ref_losses = [], []
    for key in keys:
        params, stats, opt_state, value = sub_step(params, stats, opt_state, h_train, key)
        ref_params, ref_stats, ref_opt, ref_value = full_step(
            ref_params, ref_stats, ref_opt, x, key
        )
        losses.append(float(value))
        ref_losses.append(float(ref_value))

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]
    assert_close(params, ref_params, atol=1e-4, rtol=1e-4)
    assert_close(stats, {"bn2": ref_stats["bn2"]}, atol=1e-5, rtol=1e-5)

    new_sub = {"params": params, "batch_stats": stats}
    merged = head.merge(variables, new_sub)
    original = paths(variables)
    for p, leaf in paths(merged).items():
        if p[1] in BODY:
            assert leaf is original[p], p
        else:
            assert leaf is paths(new_sub)[p], p

    full_out, state = record(model, merged, x, train=False)
    assert_close(head.apply(new_sub, state["intermediates"]["pool"]), full_out)
    # The pool output did not change: the body was not touched.
    assert_close(
        state["intermediates"]["pool"],
        record(model, variables, x, train=False)[1]["intermediates"]["pool"],
    )


# --------------------------------------------------------------------------- transforms


def test_under_jit(head, whole, x, h, eval_record):
    out = eval_record[0]
    assert_close(jax.jit(lambda v, hh: head.apply(v, hh))(head.variables, h), out)
    assert_close(jax.jit(head)(h), out)
    assert_close(jax.jit(whole)(x), out)


def test_under_jit_with_a_new_batch_size(model, variables, head, x):
    small = x[:2]
    out, state = record(model, variables, small, train=False)
    got = jax.jit(lambda v, hh: head.apply(v, hh))(head.variables, state["intermediates"]["pool"])
    assert_close(got, out)


def test_under_vmap(model, variables, head, whole):
    stacked_x = rand(20, (3, *X_SHAPE))
    outs, hs = [], []
    for i in range(3):
        out, state = record(model, variables, stacked_x[i], train=False)
        outs.append(out)
        hs.append(state["intermediates"]["pool"])
    expected = jnp.stack(outs)
    stacked_h = jnp.stack(hs)
    assert_close(jax.vmap(head)(stacked_h), expected)
    assert_close(jax.vmap(whole)(stacked_x), expected)
    assert_close(jax.vmap(head.apply, in_axes=(None, 0))(head.variables, stacked_h), expected)
    assert_close(jax.jit(jax.vmap(whole))(stacked_x), expected)


def test_vmap_in_train_mode(model, variables, head):
    stacked_x = rand(21, (2, *X_SHAPE))
    key = jax.random.key(9)
    outs, hs, stats = [], [], []
    for i in range(2):
        out, state = record(
            model,
            variables,
            stacked_x[i],
            train=True,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        outs.append(out)
        hs.append(state["intermediates"]["pool"])
        stats.append(state["batch_stats"]["bn2"])

    def run(hh):
        return head.apply(
            head.variables, hh, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
        )

    got, updates = jax.vmap(run)(jnp.stack(hs))
    assert_close(got, jnp.stack(outs))
    assert_close(
        updates["batch_stats"]["bn2"], jax.tree_util.tree_map(lambda *a: jnp.stack(a), *stats)
    )


def test_grad_of_jitted_vmapped_slice(model, variables, head, target):
    """grad(jit(vmap(slice))) equals grad of the full model summed over the stacked batches."""
    stacked_x = rand(22, (2, *X_SHAPE))
    hs = jnp.stack(
        [
            record(model, variables, stacked_x[i], train=False)[1]["intermediates"]["pool"]
            for i in range(2)
        ]
    )

    def sub_loss(params):
        outs = jax.vmap(head.apply, in_axes=(None, 0))({**head.variables, "params": params}, hs)
        return sum(loss_of(outs[i], target) for i in range(2))

    def full_loss(params):
        return sum(
            loss_of(model.apply({**variables, "params": params}, stacked_x[i]), target)
            for i in range(2)
        )

    got = jax.jit(jax.grad(sub_loss))(head.variables["params"])
    full = jax.jit(jax.grad(full_loss))(variables["params"])
    assert_close(got, {k: full[k] for k in HEAD}, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- caching


def test_traces_are_cached_per_shape_and_mode(model, variables, x):
    js.clear_caches()  # no graph of this model traced by other tests
    sub = js.slice(model, variables, x, start="fc1", train=False)
    h1, h2 = rand(30, H_SHAPE), rand(31, H_SHAPE)
    key = {"dropout": jax.random.key(0)}

    def traces_during(fn):
        before = TRACES[0]
        fn()
        return TRACES[0] - before

    assert traces_during(lambda: sub(h1)) == 0  # the sample shape and mode: traced when sliced
    assert traces_during(lambda: sub(h2)) == 0
    assert (
        traces_during(lambda: sub.apply(sub.variables, h1, train=False)) == 0
    )  # the same mode, spelled out
    # A new mode is traced once, then cached.
    assert (
        traces_during(
            lambda: sub.apply(sub.variables, h1, train=True, rngs=key, mutable=["batch_stats"])
        )
        == 1
    )
    assert (
        traces_during(
            lambda: sub.apply(sub.variables, h2, train=True, rngs=key, mutable=["batch_stats"])
        )
        == 0
    )
    other_key = {"dropout": jax.random.key(1)}
    assert (
        traces_during(
            lambda: sub.apply(
                sub.variables, h1, train=True, rngs=other_key, mutable=["batch_stats"]
            )
        )
        == 0
    )
    # Switching back does not re-trace.
    assert traces_during(lambda: sub(h1)) == 0
    assert (
        traces_during(
            lambda: sub.apply(sub.variables, h1, train=True, rngs=key, mutable=["batch_stats"])
        )
        == 0
    )
    # A new batch size is traced once, then cached; the old one still is.
    small = rand(32, (2, 4))
    assert traces_during(lambda: sub(small)) == 1
    assert traces_during(lambda: sub(small)) == 0
    assert traces_during(lambda: sub(h1)) == 0


def test_second_call_does_not_recompile(head, h):
    head(h)
    h1, h2 = rand(40, H_SHAPE), rand(41, H_SHAPE)  # made before counting: eager ops compile too
    compiles = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        head(h1)
        head.apply(head.variables, h2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []


# --------------------------------------------------------------------------- errors


def test_extra_variables_are_named(variables, head, h):
    with pytest.raises(js.VariablesMismatchError) as info:
        head.apply(variables, h)
    message = str(info.value)
    assert "conv" in message and "bn1" in message


def test_missing_variables_are_named(head, h):
    params = {k: v for k, v in head.variables["params"].items() if k != "head"}
    with pytest.raises(js.VariablesMismatchError) as info:
        head.apply({**head.variables, "params": params}, h)
    message = str(info.value)
    assert "missing" in message and "'head'" in message
    assert issubclass(js.VariablesMismatchError, js.SliceError)


def test_missing_collection_is_named(head, h):
    with pytest.raises(js.VariablesMismatchError, match="batch_stats"):
        head.apply({"params": head.variables["params"]}, h)


def test_misspelled_mode_keyword(head, h):
    with pytest.raises(js.SliceError, match="trian"):
        head.apply(head.variables, h, trian=True)
    with pytest.raises(js.SliceError, match="trian"):
        head(h, trian=True)


def test_mutable_collection_the_slice_does_not_update(model, variables, x, head, h):
    # A collection the model has no entries in at all.
    with pytest.raises(js.SliceError, match="cache"):
        head.apply(head.variables, h, mutable=["cache"])
    # Train mode, where the full model updates bn1 and bn2, but the slice holds neither.
    mid = js.slice(model, variables, x, start="fc1", end="tap", train=False)
    assert set(mid.variables) == {"params"} and set(mid.variables["params"]) == {"fc1"}
    with pytest.raises(js.SliceError, match="batch_stats"):
        mid.apply(
            mid.variables,
            h,
            train=True,
            rngs={"dropout": jax.random.key(0)},
            mutable=["batch_stats"],
        )
    # The failed calls left nothing broken behind.
    expected = h @ variables["params"]["fc1"]["kernel"] + variables["params"]["fc1"]["bias"]
    assert_close(mid(h), expected)


def test_mutable_error_does_not_depend_on_the_slice_time_mode(model, variables, x):
    """The same call on the same slice fails whether or not its mode was the slice-time one.

    A slice with no state, sliced in train mode (Flax needs ``mutable`` to trace the full
    model then), asked for ``mutable=["batch_stats"]`` with that same mode: the slice
    updates nothing in ``batch_stats``, so this is an error, as it is for a slice made in
    eval mode and called in train mode (checked above).
    """
    key = jax.random.key(8)
    clf = js.slice(
        model,
        variables,
        x,
        start="bn2:output",
        train=True,
        rngs={"dropout": key},
        mutable=["batch_stats"],
    )
    hb = rand(50, (BATCH, 8))
    with pytest.raises(js.SliceError, match="batch_stats"):
        clf.apply(clf.variables, hb, train=True, rngs={"dropout": key}, mutable=["batch_stats"])


def test_missing_rngs_for_dropout_in_train_mode(head, h):
    with pytest.raises(js.ModelTraceError, match="rngs") as info:
        head.apply(head.variables, h, train=True, mutable=["batch_stats"])
    assert isinstance(info.value, js.SliceError)
    # The failed mode is not cached as broken: with keys it works.
    out, _ = head.apply(
        head.variables, h, train=True, rngs={"dropout": jax.random.key(0)}, mutable=["batch_stats"]
    )
    assert out.shape == OUT_SHAPE


def test_a_slice_that_stops_tracing_early_still_sees_unasked_state_updates():
    """A retry with wider `mutable` (the model updates state nobody asked for) must trace
    up to the state updates even when the name's call count allows stopping early."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            h = nn.BatchNorm(use_running_average=not train, name="bn")(nn.Dense(4, name="a")(x))
            return nn.Dense(2, name="head")(h)

    model, x = Net(), jnp.arange(8.0).reshape(2, 4)
    variables = model.init(jax.random.key(0), x)
    js.boundaries(model, variables, x, train=True)  # the call counts allow stopping early
    sub = js.slice(model, variables, x, end="bn", train=True)
    with pytest.raises(js.SliceError, match="mutable=\\['batch_stats'\\]"):
        sub(x)
    asked = js.slice(model, variables, x, end="bn", train=True, mutable=["batch_stats"])
    _, updates = asked(x, mutable=["batch_stats"])
    _, want = model.apply(variables, x, train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(
        updates["batch_stats"]["bn"]["mean"], want["batch_stats"]["bn"]["mean"]
    )


def test_state_of_a_module_whose_equations_feed_only_state_is_returned():
    """A module that only keeps statistics (its output is its input) still runs when the
    slice runs the call around it to its end, so its updates are returned, not dropped."""

    class Stats(nn.Module):
        @nn.compact
        def __call__(self, x):
            mean = self.variable("batch_stats", "mean", jnp.zeros, x.shape[-1:])
            if self.is_mutable_collection("batch_stats"):
                mean.value = 0.9 * mean.value + 0.1 * x.mean(0)
            return x

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="dense")(Stats(name="stats")(x))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="head")(Block(name="block")(x))

    model, x = Net(), jnp.arange(8.0).reshape(2, 4)
    variables = model.init(jax.random.key(0), x)
    sub = js.slice(model, variables, x, end="block", mutable=["batch_stats"])
    _, updates = sub(x, mutable=["batch_stats"])
    _, want = model.apply(variables, x, mutable=["batch_stats"])
    np.testing.assert_allclose(
        updates["batch_stats"]["block"]["stats"]["mean"],
        want["batch_stats"]["block"]["stats"]["mean"],
        rtol=1e-6,
    )
