"""Regression tests for the SPEC's reliability rules, each on a small model of its own.

Every expected value comes from outside jaxslice: ``model.apply`` (with Flax's own
``nn.intercept_methods`` recording of each call, see ``helpers.oracles.record_calls``), eager
calls of NNX submodules, hand-written math, and Flax's own errors. The rules checked:

- linen models are traced with exactly the ``mutable`` asked for, and a train-mode call
  that updates state without ``mutable`` raises as linen does;
- caches never return stale traces (a plain function with other parameter shapes, an NNX
  model whose submodule was swapped);
- variables passed to ``apply``, ``merge`` and ``extract`` are checked (path, shape, dtype);
- a ``MissingInputError``'s suggested ``start`` gives a working slice;
- errors raised while tracing the model are ``ModelTraceError``s naming the boundary, with
  the model's own error as ``__cause__``; ``KeyboardInterrupt`` passes through;
- a slice keeps alive only its own variables; caches are bounded and clearable;
- tied weights are reported in ``shared_variables``; ``build_info`` says how a slice was
  built.
"""

from __future__ import annotations

import ast
import gc
import re
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors as flax_errors
from flax import nnx

import jaxslice as js

from helpers.oracles import assert_trees_all_close, random_input, record_calls

# --------------------------------------------------------------------------- helpers


def f64(x):
    return np.asarray(x, np.float64)


def close(actual, expected):
    """`actual` (float32) equals hand-written float64 math `expected` within tolerance."""
    assert_trees_all_close(
        actual, jax.tree.map(lambda e: np.asarray(e, np.float32), expected), atol=1e-5
    )


def dense_np(p, x):
    return f64(x) @ f64(p["kernel"]) + f64(p["bias"])


def suggested_start(message: str) -> list:
    """The ``start=[...]`` a `MissingInputError` suggests, parsed as a Python literal."""
    match = re.search(r"start=(\[.*?\])", message)
    assert match, f"no start=[...] suggestion in: {message}"
    return ast.literal_eval(match.group(1))


def _parse(spec: str) -> tuple[str, int, str | None]:
    name, _, port = spec.partition(":")
    base, _, k = name.partition("@")
    return base, int(k) if k else 0, port or None


def recorded_inputs(calls: dict, start: list) -> list:
    """What a slice starting at `start` takes, from Flax's own recording of the calls."""
    out = []
    for spec in start:
        base, k, port = _parse(spec)
        args, _, output = calls[base][k]
        if port == "output":
            out.append(output)
        else:
            out.extend(args)
    return out


# --------------------------------------------------------------------------- 1. mutable


class OldStyleBN(nn.Module):
    """Updates a running mean only when ``train`` and params are immutable (older idiom)."""

    @nn.compact
    def __call__(self, x, train):
        mean = self.variable("batch_stats", "mean", lambda: jnp.zeros(x.shape[-1]))
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        if train and not self.is_mutable_collection("params"):
            m = x.mean(0)
            mean.value = 0.9 * mean.value + 0.1 * m
            return (x - m) * scale
        return (x - mean.value) * scale


class BNBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.relu(OldStyleBN(name="bn")(nn.Dense(4, name="fc")(x), train))


class BNNet(nn.Module):
    """Two blocks with running statistics, then a stateless head."""

    @nn.compact
    def __call__(self, x, train=False):
        x = BNBlock(name="b0")(x, train)
        x = BNBlock(name="b1")(x, train)
        return nn.Dense(2, name="head")(x)


def _bn_net():
    model = BNNet()
    x = random_input(1, (5, 4))
    variables = model.init(jax.random.key(0), x)
    # Non-zero running means, so eval mode and stale statistics are visible.
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.3 if p[0].key == "batch_stats" else v, variables
    )
    return model, variables, x


def test_linen_whole_model_slice_returns_the_updates_model_apply_returns():
    model, variables, x = _bn_net()
    want_out, want_upd = model.apply(variables, x, train=True, mutable=["batch_stats"])
    sub = js.slice(model, variables, x, start=None, end=None, train=True, mutable=["batch_stats"])
    out, upd = sub.apply(sub.variables, x, train=True, mutable=["batch_stats"])
    assert_trees_all_close(out, want_out)
    assert_trees_all_close(upd, want_upd)


def test_linen_slice_with_every_collection_mutable_takes_the_models_own_branch():
    # With mutable=True, params are mutable too, so `OldStyleBN` uses its running mean
    # and updates nothing; a trace with any other `mutable` would take the other branch.
    model, variables, x = _bn_net()
    want = model.apply(variables, x, train=True, mutable=True)
    sub = js.slice(model, variables, x, start=None, end=None, train=True, mutable=True)
    assert_trees_all_close(sub.apply(sub.variables, x, train=True, mutable=True), want)


def test_linen_middle_block_slice_returns_that_blocks_updates():
    model, variables, x = _bn_net()
    want_out, want_upd = model.apply(variables, x, train=True, mutable=["batch_stats"])
    calls = record_calls(model, variables, x, jit=False, train=True, mutable=["batch_stats"])
    recorded = js.intermediates(
        model, variables, x, names=["b1:input"], train=True, mutable=["batch_stats"]
    )[0]["b1:input"]
    assert_trees_all_close(recorded, calls["b1"][0][0][0])

    sub = js.slice(model, variables, x, start="b1", end="b1", train=True, mutable=["batch_stats"])
    out, upd = sub.apply(sub.variables, recorded, train=True, mutable=["batch_stats"])
    assert_trees_all_close(out, calls["b1"][0][2])
    assert_trees_all_close(upd, {"batch_stats": {"b1": want_upd["batch_stats"]["b1"]}})


def test_linen_train_call_without_mutable_raises_like_linen():
    model, variables, x = _bn_net()
    with pytest.raises(flax_errors.ModifyScopeVariableError):
        model.apply(variables, x, train=True)  # the oracle: linen refuses too
    sub = js.slice(model, variables, x, end=None, train=True, mutable=["batch_stats"])
    with pytest.raises(js.SliceError, match="mutable"):
        sub(x)


def test_linen_intermediates_in_train_mode_without_mutable_raises():
    model, variables, x = _bn_net()
    with pytest.raises(js.SliceError, match="mutable"):
        js.intermediates(model, variables, x, train=True)


def test_linen_stateless_head_of_a_train_mode_model_needs_no_mutable():
    model, variables, x = _bn_net()
    h = random_input(2, (5, 4))
    sub = js.slice(model, variables, x, start="head", end=None, train=True)
    assert set(sub.variables) == {"params"}
    close(sub(h), dense_np(variables["params"]["head"], h))
    close(sub.apply(sub.variables, h, train=True), dense_np(variables["params"]["head"], h))


# --------------------------------------------------------------------------- 2. stale traces


@js.mark("body")
def _body(p, x):
    return jnp.tanh(x @ p["w"])


@js.mark("out")
def _out(p, h):
    return h @ p["v"]


def plain_net(params, x):
    return _out(params, _body(params, x))


def _plain_params(width: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(3, width)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(width, 2)), jnp.float32),
    }


def test_plain_intermediates_follow_new_parameter_widths():
    x = random_input(3, (4, 3))
    for width, seed in [(4, 0), (6, 1), (4, 2)]:
        params = _plain_params(width, seed)
        got = js.intermediates(plain_net, params, x, names=["body", "out"])
        body = np.tanh(f64(x) @ f64(params["w"]))
        close(got, {"body": body, "out": body @ f64(params["v"])})


class NNXBody(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.lin(x))


class NNXNet(nnx.Module):
    def __init__(self, *, rngs):
        self.body = NNXBody(rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(x))


class OtherHead(nnx.Module):
    """Another class for `head`, with a nonlinearity the old head does not have."""

    def __init__(self, out: int, *, rngs):
        self.lin = nnx.Linear(4, out, rngs=rngs)

    def __call__(self, h):
        return jnp.sin(self.lin(h)) * 2.0


@pytest.mark.parametrize(
    "new_head",
    [
        lambda rngs: OtherHead(2, rngs=rngs),  # another class, same output shape
        lambda rngs: nnx.Linear(4, 5, rngs=rngs),  # the same class, another size
        lambda rngs: nnx.Linear(4, 2, rngs=rngs),  # the same class and size, new weights
    ],
    ids=["other-class", "other-size", "same-shape"],
)
def test_nnx_intermediates_after_swapping_a_submodule(new_head):
    model = NNXNet(rngs=nnx.Rngs(0))
    x = random_input(4, (3, 3))
    before = js.intermediates(model, x, names=["head"])
    assert_trees_all_close(before, {"head": model.head(model.body(x))})
    model.head = new_head(nnx.Rngs(1))
    after = js.intermediates(model, x, names=["head"])
    assert_trees_all_close(after, {"head": model.head(model.body(x))})


def test_nnx_slice_after_swapping_a_submodule_runs_the_new_one():
    model = NNXNet(rngs=nnx.Rngs(0))
    x = random_input(5, (3, 3))
    h = random_input(6, (3, 4))
    old = js.slice(model, x, start="head", end=None)
    assert_trees_all_close(old(h), model.head(h))
    model.head = OtherHead(3, rngs=nnx.Rngs(2))
    new = js.slice(model, x, start="head", end=None)
    assert_trees_all_close(new(h), model.head(h))


def test_nnx_slice_retraces_when_a_shared_submodule_changes_structure():
    model = NNXNet(rngs=nnx.Rngs(0))
    x = random_input(7, (3, 3))
    sub = js.slice(model, x, start=None, end="body")
    assert_trees_all_close(sub(x), model.body(x))
    # `sub` holds the model's own `body`: replacing a submodule inside it (here with a
    # deeper one) changes the graph the slice runs, so it must trace again.
    rngs = nnx.Rngs(3)
    model.body.lin = nnx.Sequential(
        nnx.Linear(3, 5, rngs=rngs), jnp.tanh, nnx.Linear(5, 4, rngs=rngs)
    )
    assert_trees_all_close(sub(x), model.body(x))


@pytest.mark.parametrize("batch", [3, 5], ids=["same-batch", "new-batch"])
def test_an_nnx_layer_widened_after_observing_or_slicing_is_named(batch):
    """A tracker or per-channel statistics keep state sized for the layers' old widths,
    and a slice holds the old layer: after `head` is replaced by a wider one, each says
    the model changed, naming the layer or variable and both shapes, at the batch size
    it was made with and at a new one (a raw broadcasting error from inside JAX before).
    A replacement of the same shape is read at the next call."""
    model = NNXNet(rngs=nnx.Rngs(0))
    x = random_input(8, (3, 3))
    tracker = js.coverage.Tracker(model, x, criteria=[js.coverage.NC(0.0)])
    stats = js.ActivationStats(model, x, per="channel")
    sub = js.slice(model, x, end="head")
    model.head = nnx.Linear(4, 2, rngs=nnx.Rngs(4))  # same shape: new values, read live
    stats.update(x)
    want = np.asarray(model.head(model.body(x))).max(axis=0)
    np.testing.assert_allclose(stats.result()["head"]["max"], want, rtol=1e-5)
    model.head = nnx.Linear(4, 5, rngs=nnx.Rngs(5))
    y = random_input(9, (batch, 3))
    for run in (tracker.update, stats.update):
        with pytest.raises(js.VariablesMismatchError, match=r"changed.*'head'.*5\]"):
            run(y)
    with pytest.raises(js.VariablesMismatchError, match=r"head was replaced.*\(5,\).* now"):
        sub(y)


def test_an_nnx_slice_refuses_a_held_submodule_replaced_by_one_of_the_same_shapes():
    """The slice holds the model's `head`; after `model.head = NegLinear(...)` (the same
    variable shapes, other code) it ran the new code on the old layer's variables, which
    is neither model. Now it says so; a replaced submodule it does not hold (`body`,
    before its start) changes nothing, and the slice still runs under `nnx.jit`."""

    class NegLinear(nnx.Linear):
        def __call__(self, h):
            return -super().__call__(h)

    model = NNXNet(rngs=nnx.Rngs(0))
    x, h = random_input(10, (3, 3)), random_input(11, (3, 4))
    sub = js.slice(model, x, start="head", end=None)
    head = model.head
    model.body = type(model.body)(rngs=nnx.Rngs(7))
    assert_trees_all_close(sub(h), head(h))
    assert_trees_all_close(nnx.jit(lambda s, h: s(h))(sub, h), head(h))
    model.head = NegLinear(4, 2, rngs=nnx.Rngs(5))
    with pytest.raises(js.VariablesMismatchError, match=r"head was replaced.*NegLinear"):
        sub(h)
    with pytest.raises(js.VariablesMismatchError, match=r"head was replaced"):
        nnx.jit(lambda s, h: s(h))(sub, h)
    assert_trees_all_close(js.slice(model, x, start="head", end=None)(h), model.head(h))


# --------------------------------------------------------------------------- 3. variables


class TwoDense(nn.Module):
    width: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.width, name="stem")(x))
        return nn.Dense(2, name="head")(h)


def _two_dense(width: int = 4):
    model = TwoDense(width)
    x = random_input(8, (3, 3))
    return model, model.init(jax.random.key(0), x), x


def _with_head_kernel(variables, kernel):
    params = {**variables["params"], "head": {**variables["params"]["head"], "kernel": kernel}}
    return {**variables, "params": params}


BAD_KERNELS = [
    (lambda k: jnp.zeros((4, 3), k.dtype), "float32[4, 3]"),  # another shape
    (lambda k: k.astype(jnp.float16), "float16[4, 2]"),  # another dtype
]


def _assert_names_head_kernel(error, got: str) -> None:
    message = str(error.value)
    assert "'head'" in message and "'kernel'" in message, message
    assert got in message, message  # the offending shape and dtype
    assert "float32[4, 2]" in message, message  # what the slice was traced with


@pytest.mark.parametrize("bad, got", BAD_KERNELS, ids=["shape", "dtype"])
def test_apply_with_a_mismatched_leaf_names_its_path_shape_and_dtype(bad, got):
    model, variables, x = _two_dense()
    sub = js.slice(model, variables, x, start="head")
    wrong = _with_head_kernel(sub.variables, bad(sub.variables["params"]["head"]["kernel"]))
    with pytest.raises(js.VariablesMismatchError) as error:
        sub.apply(wrong, jnp.ones((3, 4)))
    _assert_names_head_kernel(error, got)


@pytest.mark.parametrize("bad, got", BAD_KERNELS, ids=["shape", "dtype"])
def test_merge_with_a_mismatched_leaf_raises(bad, got):
    model, variables, x = _two_dense()
    sub = js.slice(model, variables, x, start="head")
    wrong = _with_head_kernel(sub.variables, bad(sub.variables["params"]["head"]["kernel"]))
    with pytest.raises(js.VariablesMismatchError) as error:
        sub.merge(variables, wrong)
    _assert_names_head_kernel(error, got)


def test_extract_from_variables_of_other_shapes_raises():
    model, variables, x = _two_dense()
    _, other, _ = _two_dense(width=5)  # same paths, the head's kernel is [5, 2]
    sub = js.slice(model, variables, x, start="head")
    assert_trees_all_close(sub.extract(variables), sub.variables)
    with pytest.raises(js.VariablesMismatchError) as error:
        sub.extract(other)
    _assert_names_head_kernel(error, "float32[5, 2]")


# --------------------------------------------------------------------------- 4. suggestions


class CacheBlock(nn.Module):
    """Returns ``(h, cache)``, as a transformer block with ``use_cache=True`` does.

    With `computed`, the cache is computed inside the block (as GPT-2's reshaped keys and
    values are), so no boundary but the block's own output holds it; otherwise it is the
    output of the submodule ``kv``.
    """

    computed: bool

    @nn.compact
    def __call__(self, h):
        kv = nn.Dense(4, name="kv")(h)
        return h + jnp.tanh(kv), kv * 2.0 if self.computed else kv


class CachedStack(nn.Module):
    """Collects every block's cache into a tuple and returns ``(logits, caches)``."""

    computed: bool

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="embed")(x)
        caches = []
        for i in range(3):
            h, cache = CacheBlock(self.computed, name=f"blocks_{i}")(h)
            caches.append(cache)
        return nn.Dense(2, name="head")(h), tuple(caches)


@pytest.mark.parametrize("computed", [False, True], ids=["kv-output", "computed-cache"])
@pytest.mark.parametrize("start", ["blocks_1", "blocks_2", "blocks_1/kv"])
def test_missing_input_suggestion_gives_a_working_slice(start, computed):
    model = CachedStack(computed)
    x = random_input(9, (2, 3))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(js.MissingInputError) as error:
        js.slice(model, variables, x, start=start, end=None)
    suggested = suggested_start(str(error.value))
    assert None not in suggested, suggested  # a suggestion short of starting over

    sub = js.slice(model, variables, x, start=suggested, end=None)
    calls = record_calls(model, variables, x, jit=False)
    got = sub(*recorded_inputs(calls, suggested))
    assert_trees_all_close(got, model.apply(variables, x))


# --------------------------------------------------------------------------- 5. model errors


class Raises(nn.Module):
    """Raises `error` (a Python exception instance) or branches on a traced value."""

    error: BaseException | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(3, name="fc")(x)
        if self.error is not None:
            raise self.error
        if x.sum() > 0:  # a Python `if` on a traced value
            return x
        return -x


class Outer(nn.Module):
    error: BaseException | None = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3, name="stem")(x)
        return nn.Dense(2, name="head")(Raises(self.error, name="inner")(h))


def _outer_variables():
    # Built by hand: `init` would trace the failing module too.
    rng = np.random.default_rng(0)

    def dense(n_in, n_out):
        return {
            "kernel": jnp.asarray(rng.normal(size=(n_in, n_out)), jnp.float32),
            "bias": jnp.zeros((n_out,), jnp.float32),
        }

    return {
        "params": {
            "stem": dense(3, 3),
            "inner": {"fc": dense(3, 3)},
            "head": dense(3, 2),
        }
    }


class NNXRaises(nnx.Module):
    def __init__(self, error, *, rngs):
        self.fc = nnx.Linear(3, 3, rngs=rngs)
        self.error = error

    def __call__(self, x):
        x = self.fc(x)
        if self.error is not None:
            raise self.error
        if x.sum() > 0:  # a Python `if` on a traced value
            return x
        return -x


class NNXOuter(nnx.Module):
    def __init__(self, error=None, *, rngs):
        self.stem = nnx.Linear(3, 3, rngs=rngs)
        self.inner = NNXRaises(error, rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.inner(self.stem(x)))


def _failing(kind: str, error: BaseException | None) -> tuple:
    """``(target, *args)`` of a model whose submodule ``inner`` fails while traced."""
    x = random_input(10, (2, 3))
    if kind == "linen":
        return Outer(error), _outer_variables(), x
    return NNXOuter(error, rngs=nnx.Rngs(0)), x


KINDS = ["linen", "nnx"]


@pytest.mark.parametrize("kind", KINDS)
def test_python_branch_on_a_traced_value_is_a_model_trace_error(kind):
    with pytest.raises(js.ModelTraceError) as error:
        js.slice(*_failing(kind, None), start="stem", end="head")
    assert "'inner'" in str(error.value), str(error.value)
    assert isinstance(
        error.value.__cause__,
        (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError),
    ), repr(error.value.__cause__)


@pytest.mark.parametrize("kind", KINDS)
def test_value_error_in_a_submodule_is_a_model_trace_error_with_it_as_cause(kind):
    raised = ValueError("bad width in inner")
    with pytest.raises(js.ModelTraceError) as error:
        js.slice(*_failing(kind, raised), end=None)
    assert error.value.__cause__ is raised
    message = str(error.value)
    assert "'inner'" in message and "bad width in inner" in message, message


@pytest.mark.parametrize("kind", KINDS)
def test_keyboard_interrupt_in_a_submodule_passes_through_unchanged(kind):
    raised = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as error:
        js.slice(*_failing(kind, raised), end=None)
    assert error.value is raised


# --------------------------------------------------------------------------- 6. other mutable


class MutableAwareHead(nn.Module):
    """Uses and updates batch statistics only when ``batch_stats`` is mutable."""

    @nn.compact
    def __call__(self, x):
        mean = self.variable("batch_stats", "mean", lambda: jnp.full(x.shape[-1], 0.25))
        if self.is_mutable_collection("batch_stats"):
            m = x.mean(0)
            mean.value = 0.5 * mean.value + 0.5 * m
        else:
            m = mean.value
        return nn.Dense(2, name="fc")(x - m)


class AwareNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return MutableAwareHead(name="head")(BNBlock(name="b0")(x, train))


def _aware_net():
    model = AwareNet()
    x = random_input(13, (5, 4))
    variables = model.init(jax.random.key(0), x)
    out, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    calls = record_calls(model, variables, x, jit=False, train=True, mutable=["batch_stats"])
    (h,) = calls["head"][0][0]
    return model, variables, x, h, (out, {"batch_stats": {"head": updates["batch_stats"]["head"]}})


def test_head_sliced_with_mutable_matches_model_apply_with_mutable():
    model, variables, x, h, want = _aware_net()
    sub = js.slice(model, variables, x, start="head", train=True, mutable=["batch_stats"])
    got = sub.apply(sub.variables, h, train=True, mutable=["batch_stats"])
    assert_trees_all_close(got, want)


def test_head_sliced_without_mutable_applied_with_mutable_is_right_or_says_mutable():
    model, variables, x, h, want = _aware_net()
    sub = js.slice(model, variables, x, start="head", train=True, mutable=False)
    try:
        got = sub.apply(sub.variables, h, train=True, mutable=["batch_stats"])
    except js.VariablesMismatchError as error:
        # The slice cannot run that call with its variables: the message must say that
        # `mutable` is what differs, not just "the mode".
        assert "mutable=['batch_stats']" in str(error), str(error)
    else:
        assert_trees_all_close(got, want)


# --------------------------------------------------------------------------- 7. keep-alive


class BigStem(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(1024, name="big")(x))  # a 4 MB kernel
        return nn.Dense(2, name="head")(h)


def _big_stem_variables(rng):
    def dense(n_in, n_out):
        return {
            "kernel": jnp.asarray(rng.normal(size=(n_in, n_out)) / 32, jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(n_out,)), jnp.float32),
        }

    return {"params": {"big": dense(1024, 1024), "head": dense(1024, 2)}}


def test_slice_does_not_keep_arrays_before_its_start_alive():
    variables = _big_stem_variables(np.random.default_rng(0))
    big = weakref.ref(variables["params"]["big"]["kernel"])
    head = jax.tree.map(np.asarray, variables["params"]["head"])
    x = random_input(14, (2, 1024))
    whole = js.slice(BigStem(), variables, x, start=None)
    sub = js.slice(BigStem(), variables, x, start="head")
    del variables
    gc.collect()
    assert big() is whole.variables["params"]["big"]["kernel"]  # the control: it is needed
    del whole
    gc.collect()
    assert big() is None, "the slice keeps the model's unused 4 MB kernel alive"
    # Its own variables stay alive and usable.
    h = random_input(15, (3, 1024))
    close(sub(h), dense_np(head, h))


# --------------------------------------------------------------------------- 8. bounded caches


def test_slice_at_many_batch_sizes_stays_right_and_survives_clear_caches():
    model, variables, x = _two_dense()
    sub = js.slice(model, variables, x, start="stem", end=None)
    xs = np.asarray(random_input(16, (40, 3)))
    want = np.asarray(model.apply(variables, xs))  # row by row: rows [:n] are batch n
    first = {}
    for n in range(1, 41):  # more signatures than a slice keeps compiled
        first[n] = sub(jnp.asarray(xs[:n]))
        assert_trees_all_close(first[n], want[:n])
    js.clear_caches()
    for n in [1, 17, 40]:  # evicted early, in the middle, still cached
        assert_trees_all_close(sub(jnp.asarray(xs[:n])), first[n])


# --------------------------------------------------------------------------- 9. tied weights


class TiedLM(nn.Module):
    """Embeds token ids with a table and scores outputs against the same table."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(7, 4, name="embed")
        h = jnp.tanh(nn.Dense(4, name="body")(embed(ids)))
        return h @ embed.embedding.T


def _tied_lm():
    model = TiedLM()
    ids = jnp.asarray([[0, 3, 6], [2, 2, 5]], jnp.int32)
    return model, model.init(jax.random.key(0), ids), ids


TABLE = "['params']['embed']['embedding']"


def test_slice_reading_a_tied_table_at_the_input_reports_it_as_shared():
    model, variables, ids = _tied_lm()
    sub = js.slice(model, variables, ids, start=None, end="body")
    assert sub.shared_variables == [TABLE]
    assert TABLE in repr(sub), repr(sub)
    p = variables["params"]
    want = dense_np(p["body"], f64(p["embed"]["embedding"])[np.asarray(ids)])
    close(sub(ids), want)


def test_slice_reading_a_tied_table_at_the_output_reports_it_as_shared():
    model, variables, ids = _tied_lm()
    sub = js.slice(model, variables, ids, start="body", end=None)
    assert sub.shared_variables == [TABLE]
    assert TABLE in repr(sub), repr(sub)
    p = variables["params"]
    e = random_input(18, (2, 3, 4))
    close(sub(e), np.tanh(dense_np(p["body"], e)) @ f64(p["embed"]["embedding"]).T)


def test_slice_not_sharing_variables_reports_none():
    model, variables, ids = _tied_lm()
    sub = js.slice(model, variables, ids, start="body", end="body")
    assert sub.shared_variables == []
    assert "shared" not in repr(sub), repr(sub)
    e = random_input(17, (2, 3, 4))
    close(sub(e), dense_np(variables["params"]["body"], e))


# --------------------------------------------------------------------------- 10. build info


class Twice(nn.Module):
    """``shared`` is called twice with the same parameters, then a head."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(3, name="shared")
        h = shared(nn.Dense(3, name="stem")(x))
        h = shared(jnp.tanh(h))
        return nn.Dense(2, name="head")(h)


def _twice():
    model = Twice()
    x = random_input(19, (2, 3))
    return model, model.init(jax.random.key(0), x), x


def _assert_build_info(info: js.BuildInfo) -> None:
    assert isinstance(info, js.BuildInfo)
    assert info.trace_seconds > 0 and info.analysis_seconds > 0, info
    assert info.equations > 0, info
    assert isinstance(info.stopped_early, bool), info


def test_build_info_of_a_whole_model_slice():
    model, variables, x = _twice()
    sub = js.slice(model, variables, x, start=None, end=None)
    _assert_build_info(sub.build_info)
    assert sub.build_info.stopped_early is False  # the output is the last thing computed
    assert_trees_all_close(sub(x), model.apply(variables, x))


def test_slice_ending_at_a_first_call_stops_tracing_early():
    model, variables, x = _twice()
    js.clear_caches()  # a model traced in full before is not traced again at all
    sub = js.slice(model, variables, x, start=None, end="shared@0")
    _assert_build_info(sub.build_info)
    assert sub.build_info.stopped_early is True
    whole = js.slice(model, variables, x, start=None, end=None)
    assert sub.build_info.equations < whole.build_info.equations
    calls = record_calls(model, variables, x, jit=False)
    assert_trees_all_close(sub(x), calls["shared"][0][2])
