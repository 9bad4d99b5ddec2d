"""Slicing Flax NNX models: names, values, sharing, modes and errors.

`js.slice(model, *inputs, start=..., end=...)` on an `nnx.Module` returns a `SlicedModule`
that holds the model's own submodules. Every expected value here comes from outside
jaxslice: eager calls of the model's submodules written out by hand
(``model.head(model.blocks[1](h))``) and deep copies of the model (`nnx.clone`) run the
same way. Training (optimizer steps, gradients, batch statistics, dropout RNG state) is in
``test_nnx_training.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxslice as js
from jaxslice import SlicedModule

from helpers.nnx_zoo import (
    CNN_NAMES,
    TRACES,
    X_CNN,
    X_ZOO,
    ZOO_NAMES,
    Block,
    ConvBlock,
    assert_close,
    cnn_eager_eval,
    cnn_tail,
    make,
    make_cnn,
    make_zoo,
    rand,
    snapshot,
    variable_ids,
    zoo_eager,
    zoo_tail,
)

# --------------------------------------------------------------------------- names


def test_boundaries_names_for_list_dict_sequential():
    table = js.boundaries(make_zoo(), X_ZOO)
    assert [b.name for b in table] == ZOO_NAMES
    types = {b.name: b.module_type for b in table}
    assert types["blocks/1"] == "Block"
    assert types["blocks/1/lin"] == "Linear"
    assert types["seq"] == "Sequential"
    assert types["branches/b"] == "Linear"
    b = {b.name: b for b in table}["blocks/0/lin"]
    assert [tuple(a.shape) for a in b.inputs] == [(4, 8)]
    assert [tuple(a.shape) for a in b.outputs] == [(4, 8)]
    assert b.param_count == 8 * 8 + 8
    assert {b.name: b.param_count for b in table}["seq"] == 2 * (8 * 8 + 8)
    text = str(table)
    for name in ZOO_NAMES:
        assert name in text


def test_boundary_names_are_the_same_in_train_and_eval_mode():
    model = make_cnn()
    eval_names = [b.name for b in js.boundaries(model, X_CNN)]
    model.train()
    train_names = [b.name for b in js.boundaries(model, X_CNN)]
    assert eval_names == train_names == CNN_NAMES


def test_oracle_covers_every_boundary():
    assert set(zoo_eager(make_zoo(), X_ZOO)) == set(ZOO_NAMES)
    assert set(cnn_eager_eval(make_cnn(), X_CNN)) == set(CNN_NAMES)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_every_zoo_boundary_from_the_input(name):
    model = make_zoo()
    sub = js.slice(model, X_ZOO, end=name)
    assert isinstance(sub, SlicedModule) and isinstance(sub, nnx.Module)
    assert_close(sub(X_ZOO), zoo_eager(model, X_ZOO)[name])
    x2 = rand(3, (4, 3))  # same signature, new data: the current values are used
    assert_close(sub(x2), zoo_eager(model, x2)[name])


@pytest.mark.parametrize("name", CNN_NAMES)
def test_every_cnn_boundary_from_the_input_eval_mode(name):
    model = make_cnn()
    sub = js.slice(model, X_CNN, end=name)
    expected = cnn_eager_eval(model, X_CNN)[name]
    assert_close(sub(X_CNN), expected)


def test_slice_to_none_is_the_whole_model():
    model = make_zoo()
    assert_close(js.slice(model, X_ZOO)(X_ZOO), model(X_ZOO))


def _zoo_in(name):
    """A random value with the shape of `name`'s input in `Zoo` (batch 4)."""
    return rand(sum(map(ord, name)), (4, 8))


MIDDLE_CASES = {
    # id: (start, end, oracle(model, h))
    "block-to-output": ("blocks/1", None, zoo_tail),
    "block-to-head": ("blocks/1", "head", zoo_tail),
    "nested-module-start": (
        "blocks/1/lin",
        "blocks/1",
        lambda m, h: jax.nn.relu(m.blocks[1].lin(h)),
    ),
    "dict-entry-start-sibling-reads-same-value": (
        "branches/a",
        "seq",
        lambda m, h: m.seq(m.branches["a"](h) * jax.nn.sigmoid(m.branches["b"](h))),
    ),
    "sequential-inner-start": ("seq/layers/2", None, lambda m, h: m.head(m.seq.layers[2](h))),
    "sequential-to-inner-end": ("seq", "seq/layers/0", lambda m, h: m.seq.layers[0](h)),
    "output-port-start": (
        "stem:output",
        "blocks/1/lin",
        lambda m, h: m.blocks[1].lin(m.blocks[0](h)),
    ),
    "input-port-end": ("blocks/0", "blocks/1/lin:input", lambda m, h: m.blocks[0](h)),
    "list-end": (
        "blocks/1",
        ["branches/a", "head"],
        lambda m, h: (m.branches["a"](m.blocks[1](h)), zoo_tail(m, h)),
    ),
    "dict-end": (
        "blocks/1",
        {"feat": "blocks/1", "logits": "head"},
        lambda m, h: {"feat": m.blocks[1](h), "logits": zoo_tail(m, h)},
    ),
}


@pytest.mark.parametrize("case", list(MIDDLE_CASES))
def test_start_in_the_middle(case):
    start, end, oracle = MIDDLE_CASES[case]
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start=start, end=end)
    h = _zoo_in(case)
    assert_close(sub(h), oracle(model, h))


def test_cnn_start_in_the_middle():
    model = make_cnn()
    h = rand(5, (4, 8, 8, 4))
    sub = js.slice(model, X_CNN, start="block2", end="head")
    assert_close(sub(h), model.head(jnp.mean(model.block2(h), axis=(1, 2))))
    c = rand(6, (4, 8, 8, 8))
    sub = js.slice(model, X_CNN, start="block2/bn", end="block2")
    assert_close(sub(c), jax.nn.relu(model.block2.bn(c)))


def test_new_batch_size():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    for n in (7, 4):
        h = rand(n, (n, 8))
        assert_close(sub(h), zoo_tail(model, h))
    full = js.slice(model, X_ZOO, end="seq")
    x = rand(9, (5, 3))
    assert_close(full(x), zoo_eager(model, x)["seq"])
    cnn = make_cnn()
    sub = js.slice(cnn, X_CNN, start="block2", end="head")
    h = rand(10, (3, 8, 8, 4))
    assert_close(sub(h), cnn.head(jnp.mean(cnn.block2(h), axis=(1, 2))))


def test_works_under_nnx_jit():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    h = _zoo_in("jit")
    run = nnx.jit(lambda s, v: s(v))
    assert_close(run(sub, h), zoo_tail(model, h))
    h7 = rand(7, (7, 8))  # a new batch size, first seen inside the jit trace
    assert_close(run(sub, h7), zoo_tail(model, h7))


# --------------------------------------------------------------------------- sharing


def test_slice_holds_exactly_the_original_variables_it_needs():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    expected = set().union(
        *(variable_ids(m) for m in (model.blocks[1], model.branches, model.seq, model.head))
    )
    assert variable_ids(sub) == expected
    early = js.slice(model, X_ZOO, end="blocks/0")
    assert variable_ids(early) == variable_ids(model.stem) | variable_ids(model.blocks[0])
    inner = js.slice(model, X_ZOO, start="seq/layers/2", end="seq/layers/2")
    assert variable_ids(inner) == variable_ids(model.seq.layers[2])


def test_changing_the_original_parameter_changes_the_slice():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    h = _zoo_in("share")
    before = np.asarray(sub(h))
    model.head.kernel[...] = model.head.kernel[...] * 2.0 + 0.5
    model.blocks[1].lin.bias[...] = model.blocks[1].lin.bias[...] - 0.3
    after = sub(h)
    assert not np.allclose(before, np.asarray(after))
    assert_close(after, zoo_tail(model, h))


def test_changing_a_parameter_through_the_slice_changes_the_original():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    for _, v in nnx.iter_graph(sub):
        if isinstance(v, nnx.Param):
            v[...] = v[...] + 1.0
    expected = zoo_eager(make_zoo(), X_ZOO)["blocks/0"]  # before the slice: untouched
    assert_close(zoo_eager(model, X_ZOO)["blocks/0"], expected)
    np.testing.assert_allclose(
        np.asarray(model.head.bias[...]), np.asarray(make_zoo().head.bias[...]) + 1.0, rtol=1e-6
    )


def test_slicing_does_not_change_the_model():
    model = make_cnn(train=True)
    before = snapshot(model)
    graphdef = nnx.graphdef(model)
    linear_call = nnx.Linear.__call__
    block_call = ConvBlock.__dict__["__call__"]
    js.boundaries(model, X_CNN)
    js.slice(model, X_CNN, start="block2", end="head")
    js.slice(model, X_CNN, end="block1/bn")
    after = snapshot(model)
    assert before.keys() == after.keys()
    for k in before:  # batch statistics and RNG counters included
        np.testing.assert_array_equal(after[k], before[k], err_msg=str(k))
    assert nnx.graphdef(model) == graphdef
    assert nnx.Linear.__call__ is linear_call
    assert ConvBlock.__dict__["__call__"] is block_call  # the marking wrappers are gone


class Tally(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.n = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.n[...] += 1
        return self.lin(x)


class Loose(nnx.Module):
    """Variables owned by the root itself: a parameter and a call counter (as state)."""

    def __init__(self, *, rngs):
        self.stem = Tally(rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)
        self.gain = nnx.Param(jnp.full((3,), 1.5))
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.head(self.stem(x) * self.gain)


def test_parameter_owned_by_the_root_is_shared_and_trained():
    model = make(Loose)
    sub = js.slice(model, X_ZOO, start="stem:output")
    h = rand(40, (4, 3))
    assert_close(sub(h), model.head(h * model.gain[...]))
    held = variable_ids(sub)
    assert variable_ids(model.head) | {id(model.gain)} <= held
    assert not variable_ids(model.stem) & held
    model.gain[...] = model.gain[...] * 3.0
    assert_close(sub(h), model.head(h * model.gain[...]))
    before = snapshot(model, nnx.Param)
    opt = nnx.Optimizer(sub, optax.sgd(0.1), wrt=nnx.Param)
    opt.update(sub, nnx.grad(lambda s: jnp.sum(s(h) ** 2))(sub))
    after = snapshot(model, nnx.Param)
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == {("gain",), ("head", "kernel"), ("head", "bias")}


def test_counters_kept_in_variables_are_written_back_like_the_model():
    # The attribute-mutation error tells users to keep such counters in nnx.Variables,
    # "which jaxslice tracks as state": a slice of the whole model must update them.
    model = make(Loose)
    ref = nnx.clone(model)
    full = js.slice(model, X_ZOO)
    for _ in range(2):
        assert_close(full(X_ZOO), ref(X_ZOO))
    assert int(ref.stem.n[...]) == int(ref.calls[...]) == 2
    assert int(model.stem.n[...]) == 2, "a submodule's counter"
    assert int(model.calls[...]) == 2, "the root module's counter"


# --------------------------------------------------------------------------- plain array attributes


class Gained(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.gain = jnp.linspace(0.5, 1.5, 3)  # a plain array, not an nnx.Variable

    def __call__(self, x):
        return self.lin(x) * self.gain


class PlainArrays(nnx.Module):
    """Plain JAX arrays held as attributes (part of `nnx.state`, no `nnx.Variable`): a
    submodule's gain, the root's shift, and a step counter the root reassigns."""

    def __init__(self, *, rngs):
        self.stem = Gained(rngs=rngs)
        self.shift = jnp.arange(3.0)
        self.head = nnx.Linear(3, 2, rngs=rngs)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps = self.steps + 1
        return self.head(jax.nn.relu(self.stem(x) + self.shift))


def _plain_eager(model, x):
    """``{boundary: output}`` of PlainArrays by eager calls of its submodules."""
    lin = model.stem.lin(x)
    stem = lin * model.stem.gain
    return {"stem/lin": lin, "stem": stem, "head": model.head(jax.nn.relu(stem + model.shift))}


H_PLAIN = rand(41, (4, 3))
PLAIN_SLICES = {  # (start, end): the oracle, from eager calls of the model's submodules
    (None, "stem/lin"): lambda m: _plain_eager(m, X_ZOO)["stem/lin"],
    (None, "stem"): lambda m: _plain_eager(m, X_ZOO)["stem"],
    (None, None): lambda m: _plain_eager(m, X_ZOO)["head"],
    ("stem/lin:output", "stem"): lambda m: H_PLAIN * m.stem.gain,
    ("stem:output", None): lambda m: m.head(jax.nn.relu(H_PLAIN + m.shift)),
}


@pytest.mark.parametrize("start, end", list(PLAIN_SLICES), ids=str)
def test_plain_array_attributes_are_read_at_every_call_of_a_slice(start, end):
    model = PlainArrays(rngs=nnx.Rngs(0))
    oracle, x = PLAIN_SLICES[start, end], X_ZOO if start is None else H_PLAIN
    sub = js.slice(model, X_ZOO, start=start, end=end)
    jitted = nnx.jit(lambda s, v: s(v))
    for scale in (1.0, -2.0):  # the arrays as made, then other arrays in their place
        model.shift = jnp.arange(3.0) * scale
        model.stem.gain = jnp.linspace(0.5, 1.5, 3) * scale
        assert_close(sub(x), oracle(model))
        assert_close(jitted(sub, x), oracle(model))


def test_plain_array_reassigned_by_the_model_is_written_back():
    model = PlainArrays(rngs=nnx.Rngs(0))
    ref = nnx.clone(model)
    full = js.slice(model, X_ZOO)
    for _ in range(2):
        assert_close(full(X_ZOO), ref(X_ZOO))
    assert int(model.steps) == int(ref.steps) == 2
    nnx.jit(lambda s, v: s(v))(full, X_ZOO)  # updates the counter the slice holds
    ref(X_ZOO)
    assert_close(full(X_ZOO), ref(X_ZOO))  # ... which the next call gives the model too
    assert int(model.steps) == int(ref.steps) == 4


# --------------------------------------------------------------------------- skips, repeated calls


class Skip(nnx.Module):
    def __init__(self, *, rngs):
        self.stem = nnx.Linear(4, 4, rngs=rngs)
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        s = self.stem(x)
        h = self.b(jax.nn.relu(self.a(s)))
        return self.head(h + s)


def test_missing_skip_input_and_its_fix():
    model = make(Skip)
    x = rand(0, (3, 4))
    with pytest.raises(js.MissingInputError) as info:
        js.slice(model, x, start="b", end="head")
    assert "stem" in str(info.value)
    sub = js.slice(model, x, start=["b", "stem:output"], end="head")
    hb, s = rand(1, (3, 4)), rand(2, (3, 4))
    assert_close(sub(hb, s), model.head(model.b(hb) + s))


class Twice(nnx.Module):
    def __init__(self, *, rngs):
        self.pre = nnx.Linear(4, 4, rngs=rngs)
        self.shared = nnx.Linear(4, 4, rngs=rngs)
        self.post = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.post(self.shared(jax.nn.relu(self.shared(self.pre(x)))))


def test_module_called_twice():
    model = make(Twice)
    x = rand(0, (3, 4))
    assert [b.name for b in js.boundaries(model, x)] == ["pre", "shared@0", "shared@1", "post"]
    with pytest.raises(js.AmbiguousBoundaryError) as info:
        js.slice(model, x, end="shared")
    assert "shared@0" in str(info.value) and "shared@1" in str(info.value)
    first = js.slice(model, x, end="shared@0")
    assert_close(first(x), model.shared(model.pre(x)))
    h = rand(1, (3, 4))
    second = js.slice(model, x, start="shared@1", end="post")
    assert_close(second(h), model.post(model.shared(h)))
    assert variable_ids(second) == variable_ids(model.shared) | variable_ids(model.post)


# --------------------------------------------------------------------------- modes


def test_train_eval_switching_and_no_retrace_for_an_unchanged_mode():
    model = make_cnn(train=False)
    h = rand(7, (4, 8, 8, 4))
    sub = js.slice(model, X_CNN, start="block2", end="block2")
    traces = TRACES["cnn"]

    # eval: matches eager eval, statistics untouched, no retrace
    stats = snapshot(model, nnx.BatchStat)
    out_eval = sub(h)
    assert_close(out_eval, model.block2(h))
    assert_close(sub(h), out_eval)
    sub.eval()  # unchanged mode
    assert_close(sub(h), out_eval)
    assert TRACES["cnn"] == traces, "an unchanged mode must not retrace"
    for k, v in snapshot(model, nnx.BatchStat).items():
        np.testing.assert_array_equal(v, stats[k], err_msg=str(k))

    # train: switches the shared submodules, matches an eager copy from the same state
    sub.train()
    assert model.block2.bn.use_running_average is False
    assert model.block1.bn.use_running_average is True  # not in the slice
    ref = nnx.clone(model)
    out_train = sub(h)
    assert TRACES["cnn"] == traces + 1, "a changed mode must retrace once"
    assert_close(out_train, ref.block2(h))
    assert not np.allclose(np.asarray(out_train), np.asarray(out_eval))
    h2 = rand(8, (4, 8, 8, 4))
    assert_close(sub(h2), ref.block2(h2))
    assert TRACES["cnn"] == traces + 1
    assert_close(snapshot(model, nnx.BatchStat), snapshot(ref, nnx.BatchStat))

    # back to eval: cached, and reads the statistics updated in train mode
    sub.eval()
    assert model.block2.bn.use_running_average is True
    out_eval2 = sub(h)
    assert TRACES["cnn"] == traces + 1, "a mode seen before must not retrace"
    ref.eval()
    assert_close(out_eval2, ref.block2(h))
    assert not np.allclose(np.asarray(out_eval2), np.asarray(out_eval))


def test_dropout_slice_made_in_train_mode_switches_to_eval_and_back():
    model = make_cnn(train=True)
    ref = nnx.clone(model)
    sub = js.slice(model, X_CNN, start="drop", end="head")
    h = rand(9, (4, 8)) + 2.0
    first = sub(h)
    assert_close(first, ref.head(ref.drop(h)))
    sub.eval()
    assert model.drop.deterministic is True
    assert_close(sub(h), model.head(h))  # dropout is the identity in eval mode
    assert_close(sub(h), model.head(h))
    sub.train()
    second = sub(h)  # the RNG counter did not move in eval mode
    assert_close(second, ref.head(ref.drop(h)))
    assert not np.allclose(np.asarray(first), np.asarray(second))
    assert_close(snapshot(model, nnx.RngState), snapshot(ref, nnx.RngState))


def test_sub_train_enables_dropout_in_a_slice_made_in_eval_mode():
    # In eval mode `drop` is an identity call: the slice must still hold it, so that
    # sub.train() switches it like model.train() would.
    model = make_cnn(train=False)
    sub = js.slice(model, X_CNN, start="block2", end="head")
    h = rand(7, (4, 8, 8, 4))
    assert_close(sub(h), cnn_tail(model, h))
    sub.train()
    assert model.block2.bn.use_running_average is False
    assert model.drop.deterministic is False, "sub.train() did not switch the slice's dropout"
    ref = nnx.clone(model)
    assert_close(sub(h), cnn_tail(ref, h))
    assert_close(sub(h), cnn_tail(ref, h))


def test_switching_the_model_switches_the_slice():
    model = make_cnn(train=False)
    sub = js.slice(model, X_CNN, start="drop", end="head")
    h = rand(8, (4, 8)) + 2.0
    assert_close(sub(h), model.head(h))  # eval: dropout is the identity
    model.train()
    ref = nnx.clone(model)
    out = sub(h)
    assert_close(out, ref.head(ref.drop(h)))
    assert not np.allclose(np.asarray(out), np.asarray(model.head(h)))
    model.eval()
    assert_close(sub(h), model.head(h))


# --------------------------------------------------------------------------- Sliceable


class SliceableNet(js.Sliceable, nnx.Module):
    def __init__(self, *, rngs):
        self.stem = nnx.Linear(3, 8, rngs=rngs)
        self.blocks = nnx.List([Block(8, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_sliceable_mixin():
    net = make(SliceableNet)
    sub = net.slice(X_ZOO, end="blocks/1")
    assert isinstance(sub, SlicedModule)
    assert_close(sub(X_ZOO), net.blocks[1](net.blocks[0](net.stem(X_ZOO))))
    h = rand(3, (4, 8))
    head = net.slice(X_ZOO, start="head")
    assert_close(head(h), net.head(h))
    assert variable_ids(head) == variable_ids(net.head)
    assert_close(net(X_ZOO), net.head(net.blocks[1](net.blocks[0](net.stem(X_ZOO)))))


# --------------------------------------------------------------------------- errors


def test_unknown_name_suggests_the_closest():
    model = make_zoo()
    with pytest.raises(js.UnknownBoundaryError) as info:
        js.slice(model, X_ZOO, end="haed")
    assert "head" in str(info.value).replace("haed", "")
    with pytest.raises(js.UnknownBoundaryError) as info:
        js.slice(model, X_ZOO, start="blocks/1/linn")
    assert "blocks/1/lin" in str(info.value).replace("blocks/1/linn", "")
    with pytest.raises(js.UnknownBoundaryError):
        js.slice(model, X_ZOO, end="blocks")  # a container is never called: not a prefix match
    with pytest.raises(js.UnknownBoundaryError):
        js.slice(model, X_ZOO, end="blocks.1")
    assert issubclass(js.UnknownBoundaryError, js.SliceError)


def test_disconnected_start_and_end():
    model = make_zoo()
    with pytest.raises(js.DisconnectedError):
        js.slice(model, X_ZOO, start="head", end="stem")


def test_wrong_non_batch_shape_or_dtype():
    model = make_zoo()
    sub = js.slice(model, X_ZOO, start="blocks/1", end="head")
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((4, 9)))
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((4, 8), jnp.int32))
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((4, 8)), jnp.ones((4, 8)))


class Counting(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.out = nnx.Linear(3, 2, rngs=rngs)
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.out(self.lin(x))


def test_model_that_mutates_a_python_attribute_is_rejected():
    model = make(Counting)
    call = Counting.__dict__["__call__"]
    linear_call = nnx.Linear.__call__
    with pytest.raises(js.SliceError) as info:
        js.slice(model, X_ZOO, end="lin")
    assert "calls" in str(info.value)
    # classes are restored even though tracing failed
    assert Counting.__dict__["__call__"] is call
    assert nnx.Linear.__call__ is linear_call
