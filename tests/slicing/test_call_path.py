"""Calling a slice at the cost of a jitted function, with every check still in place.

A repeated ``sub(x)`` / ``sub.apply(variables, x)`` costs what a `jax.jit` function of the
same arguments costs: the work jaxslice does per call does not grow with the number of
variables. What must still happen: variables of another shape or dtype (same structure)
are a `VariablesMismatchError` naming the leaf on every such call, a new input dtype
re-traces (no `start`) or is a clear error (with one), a new mode or batch size is traced
once, and arguments a jitted function cannot take behave as before.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, captured, count_compiles, random_input

TRACES = collections.Counter()


class Mlp(nn.Module):
    """Dense(16)-relu-Dense(4); `double` is a mode that changes the result."""

    layers: int = 2

    @nn.compact
    def __call__(self, x, double: bool = False):
        TRACES["mlp"] += 1
        for i in range(self.layers - 1):
            x = nn.relu(nn.Dense(16, name=f"hidden{i}")(x))
        y = nn.Dense(4, name="out")(x)
        return 2 * y if double else y


@pytest.fixture
def net() -> tuple[Mlp, Any, jax.Array]:
    model = Mlp()
    x = random_input(0, (8, 5))
    return model, model.init(jax.random.key(0), x), x


def traces_during(fn: Any) -> int:
    before = TRACES["mlp"]
    fn()
    return TRACES["mlp"] - before


# --------------------------------------------------------------------------- checks kept


@pytest.mark.parametrize(
    "change, got",
    [
        (lambda a: a.astype(jnp.bfloat16), "bfloat16[16, 4]"),
        (lambda a: a.astype(jnp.int32), "int32[16, 4]"),
        (lambda a: jnp.zeros((16, 5), a.dtype), "float32[16, 5]"),
    ],
    ids=["bfloat16", "int32", "shape"],
)
def test_variables_of_another_dtype_or_shape_name_the_leaf_on_every_call(net, change, got):
    model, variables, x = net
    sub = js.slice(model, variables, x)
    for _ in range(3):  # warm: the call is cached for these variables' structure
        sub(x)
    kernel = sub.variables["params"]["out"]["kernel"]
    bad = jax.tree_util.tree_map(lambda a: a, sub.variables)
    bad["params"]["out"]["kernel"] = change(kernel)
    for _ in range(2):  # not remembered as good after the first error
        with pytest.raises(js.VariablesMismatchError) as info:
            sub.apply(bad, x)
        message = str(info.value)
        assert "['params']['out']['kernel']" in message and got in message, message
    assert_trees_all_close(sub.apply(sub.variables, x), model.apply(variables, x))


def test_variables_of_another_structure_are_an_error_after_warm_calls(net):
    model, variables, x = net
    sub = js.slice(model, variables, x)
    sub(x)
    extra = {**sub.variables, "params": {**sub.variables["params"], "more": jnp.ones(3)}}
    with pytest.raises(js.VariablesMismatchError, match="more"):
        sub.apply(extra, x)
    lacking = {"params": {"out": sub.variables["params"]["out"]}}
    with pytest.raises(js.VariablesMismatchError, match="hidden0"):
        sub.apply(lacking, x)


def test_trained_variables_of_the_same_shapes_are_used(net):
    model, variables, x = net
    sub = js.slice(model, variables, x)
    sub(x)
    trained = jax.tree_util.tree_map(lambda a: a * 0.5 + 1.0, sub.variables)
    with count_compiles() as counts:
        got = sub.apply(trained, x)
    assert counts.compiles == 0  # same structure, shapes and dtypes: the cached program
    assert_trees_all_close(got, model.apply(trained, x))


def test_a_new_input_dtype_is_traced_again_without_a_start(net):
    model, variables, x = net
    sub = js.slice(model, variables, x)
    sub(x)
    half = x.astype(jnp.bfloat16)
    assert traces_during(lambda: sub(half)) == 1
    assert traces_during(lambda: sub(half)) == 0
    out = sub(half)
    expected = model.apply(variables, half)
    assert out.dtype == expected.dtype
    assert_trees_all_close(out.astype(jnp.float32), expected.astype(jnp.float32))
    assert sub(x).dtype == jnp.float32


def test_a_new_input_dtype_with_a_start_is_a_clear_error(net):
    model, variables, x = net
    head = js.slice(model, variables, x, start="out")
    h = jnp.ones((8, 16))
    head(h)
    for _ in range(2):
        with pytest.raises(js.InputMismatchError, match="bfloat16"):
            head(h.astype(jnp.bfloat16))
    assert head(jnp.ones((3, 16))).shape == (3, 4)  # a new batch size is fine


def test_a_new_mode_is_traced_once(net):
    model, variables, x = net
    sub = js.slice(model, variables, x)
    assert traces_during(lambda: sub(x)) == 0
    assert traces_during(lambda: sub(x, double=True)) == 1
    assert traces_during(lambda: sub(x, double=True)) == 0
    assert traces_during(lambda: sub.apply(sub.variables, x, double=True)) == 0
    assert traces_during(lambda: sub(x)) == 0
    assert_trees_all_close(sub(x, double=True), model.apply(variables, x, double=True))
    assert_trees_all_close(sub(x, double=False), model.apply(variables, x))


def test_a_new_batch_size_is_traced_once_per_shape(net):
    model, variables, x = net
    head = js.slice(model, variables, x, start="out")
    for batch in (3, 5, 3, 5):
        head(jnp.ones((batch, 16)))
    with count_compiles() as counts:
        for batch in (3, 5):
            assert head(jnp.ones((batch, 16))).shape == (batch, 4)
    assert counts.compiles == 0


# --------------------------------------------------------------------------- arguments jit cannot take


def test_outputs_and_arguments_that_are_not_arrays_behave_as_before():
    def f(params, x, n):
        return {"y": x @ params["w"] * n, "n": n, "tag": "out"}

    params = {"w": jnp.ones((3, 2))}
    x = jnp.ones((4, 3))
    sub = js.slice(f, params, x, 2)
    for _ in range(2):
        out = sub(x)
        assert out["n"] == 2 and type(out["n"]) is int and out["tag"] == "out"
        assert_trees_all_close(out["y"], f(params, x, 2)["y"])
    assert_trees_all_close(sub(x, 2)["y"], f(params, x, 2)["y"])  # called as the model is
    with pytest.raises(js.InputMismatchError, match="fixed it to 2"):
        sub(x, 3)
    with pytest.raises(js.InputMismatchError):
        sub("x")


def test_a_python_number_for_an_array_input_and_a_flag_before_the_arrays():
    """A slice without a start takes a Python number where it was traced with an array
    (as `jax.jit` does), and a call with the model's flag in front of the arrays keeps
    it in its place when a new shape is traced."""

    def f(params, flag, x, s):
        return x @ params["w"] * s * (2.0 if flag else 1.0)

    params = {"w": jnp.arange(6.0).reshape(3, 2)}
    sub = js.slice(f, params, True, jnp.ones((4, 3)), jnp.float32(2.0))
    for x in (jnp.ones((4, 3)), jnp.arange(15.0).reshape(5, 3)):
        assert_trees_all_close(sub(True, x, 3.0), f(params, True, x, 3.0))
        assert_trees_all_close(sub(x, 3.0), f(params, True, x, 3.0))
        assert_trees_all_close(sub(True, x, jnp.float32(0.5)), f(params, True, x, 0.5))


def test_mutable_state_comes_back_nested(net):
    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen = self.variable("stats", "seen", jnp.zeros, ())
            seen.value = seen.value + x.shape[0]
            return nn.Dense(2, name="dense")(x)

    model, x = Counted(), jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)
    sub = js.slice(model, variables, x, mutable=["stats"])
    for _ in range(2):
        out, state = sub(x, mutable=["stats"])
        want, want_state = model.apply(variables, x, mutable=["stats"])
        assert_trees_all_close((out, state), (want, want_state))


# --------------------------------------------------------------------------- no per-variable work


def _python_calls(fn: Any) -> int:
    """Python-level calls (functions and C functions called from Python) during `fn()`."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("how", ["call", "apply"])
def test_a_repeated_call_does_no_python_work_per_variable(how):
    """The Python work of a repeated call is the same for 2 and 40 layers (before the fast
    path it grew by about 30 calls per variable: paths hashed, leaves checked one by one)."""

    def calls_for(layers: int) -> int:
        model, x = Mlp(layers), jnp.ones((2, 5))
        variables = model.init(jax.random.key(0), x)
        sub = js.slice(model, variables, x)
        trained = jax.tree_util.tree_map(lambda a: a + 1, sub.variables)
        call = (lambda: sub(x)) if how == "call" else (lambda: sub.apply(trained, x))
        for _ in range(3):
            call()
        return min(_python_calls(call) for _ in range(3))

    small, large = calls_for(2), calls_for(40)
    assert large == small, (small, large)


class _Name(str):
    """A dict key that counts how often it is hashed."""

    hashes = 0

    def __hash__(self) -> int:
        _Name.hashes += 1
        return str.__hash__(self)


def test_a_repeated_call_hashes_variable_paths_no_more_than_jax_jit():
    """jax.jit hashes a dict's keys once per call (its cache key); the slice adds none."""

    def f(params, x):
        for k in sorted(params):
            x = jnp.tanh(x @ params[k])
        return x

    params = {_Name(f"w{i:02d}"): jnp.eye(3) * 0.5 for i in range(20)}
    x = jnp.ones((2, 3))
    sub, jitted = js.slice(f, params, x), jax.jit(f)

    def hashes(fn: Any) -> int:
        for _ in range(3):
            fn()
        _Name.hashes = 0
        for _ in range(10):
            fn()
        return _Name.hashes

    plain = hashes(lambda: jitted(params, x))
    assert hashes(lambda: sub(x)) <= plain
    assert hashes(lambda: sub.apply(params, x)) <= plain
    assert_trees_all_close(sub(x), jitted(params, x))


def test_a_call_with_a_python_number_leaves_array_calls_jitted():
    """Whether a call takes the jitted path is decided from its inputs before the call: one
    with a Python number (here the one the trace fixed) goes through the checked path, and
    array calls after it stay as cheap as before it."""

    def f(params, x, n):
        return x @ params["w"] * n

    params = {"w": jnp.ones((3, 2))}
    x = jnp.ones((4, 3))
    sub = js.slice(f, params, x, 2)
    for _ in range(3):
        sub(x)
    warm = min(_python_calls(lambda: sub(x)) for _ in range(3))
    assert_trees_all_close(sub(x, 2), f(params, x, 2))
    for _ in range(2):
        sub(x)
    assert min(_python_calls(lambda: sub(x)) for _ in range(3)) == warm
    assert_trees_all_close(sub(x), f(params, x, 2))


# --------------------------------------------------------------------------- a path decided up front

PACKAGE_DIR = js.__file__.rsplit("/", 1)[0]


def _exceptions_in_jaxslice(fn: Any) -> list[str]:
    """``file:line ExceptionType`` for every exception raised or passing through a
    jaxslice frame while `fn()` runs (JAX's own frames are not looked at)."""
    seen: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(PACKAGE_DIR):
            return None
        if event == "exception":
            seen.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {arg[0].__name__}")
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seen


def test_no_call_that_succeeds_raises_on_the_way():
    """The path of a call (jitted or checked) is decided from facts before it runs: a call
    that succeeds raises and catches nothing inside jaxslice, whether its kind is jitted
    (arrays), checked for good (outputs that are constants of the trace), or checked for
    this call only (a Python number the trace fixed), first call or repeated."""

    def f(params, x, n):
        return {"y": x @ params["w"] * n, "n": n, "tag": "out"}

    def g(params, x):
        return jnp.tanh(x @ params["w"])

    params, x = {"w": jnp.ones((3, 2))}, jnp.ones((4, 3))
    with_constants, plain = js.slice(f, params, x, 2), js.slice(g, params, x)
    calls = {
        "constants, first": lambda: with_constants(x),
        "constants, again": lambda: with_constants(x),
        "python number": lambda: with_constants(x, 2),
        "arrays, first": lambda: plain(x),
        "arrays, again": lambda: plain(x),
        "apply": lambda: plain.apply(plain.variables, x),
    }
    for name, call in calls.items():
        assert _exceptions_in_jaxslice(call) == [], name
    out = with_constants(x)
    assert type(out["n"]) is int and out["tag"] == "out"  # as `f` returns them
    assert_trees_all_close(out["y"], f(params, x, 2)["y"])
    assert_trees_all_close(plain(x), g(params, x))


def test_a_failed_call_decides_nothing_for_its_kind(net):
    """A first call of its kind with variables of another dtype raises jaxslice's error
    (not JAX's) and leaves the kind jitted: later calls with good variables cost what the
    calls of a slice that never failed cost, and compute the model's values."""
    model, variables, x = net
    failed, fresh = js.slice(model, variables, x), js.slice(model, variables, x)
    bad = jax.tree_util.tree_map(lambda a: a.astype(jnp.int32), failed.variables)
    for _ in range(2):
        with pytest.raises(js.VariablesMismatchError, match="int32"):
            failed.apply(bad, x)
    for sub in (failed, fresh):
        for _ in range(3):
            sub.apply(sub.variables, x)
    cost = [
        min(_python_calls(lambda s=s: s.apply(s.variables, x)) for _ in range(3))
        for s in (failed, fresh)
    ]
    assert cost[0] == cost[1], cost
    assert_trees_all_close(failed.apply(failed.variables, x), model.apply(variables, x))


# --------------------------------------------------------------------------- the first call


class _Residual(nn.Module):
    """Conv + BatchNorm blocks with a skip, a scalar literal and a closed-over constant."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Conv(6, (3, 3), name="stem")(x)
        h = nn.BatchNorm(use_running_average=not train, name="norm")(h)
        skip = h
        h = nn.relu(nn.Conv(6, (3, 3), name="body")(h)) * 0.5 + jnp.arange(6.0)
        return nn.Dense(3, name="head")((h + skip).mean((1, 2)))


def test_the_first_call_runs_the_planned_equations_without_binding_them_again(monkeypatch):
    """`jax.jit` traces a slice's first call; its equations join that trace from one
    ready-made jaxpr instead of being bound one by one again. Every call kind that goes
    through `jax.jit` (plain, a mode, mutable state, a start and an end) gives the model's
    own values (Flax's recorded intermediates)."""
    from jaxslice import _compat  # the door every re-bound equation goes through

    bound = collections.Counter()
    rebind = _compat.bind_eqn

    def counting(eqn: Any, invals: Any) -> list[Any]:
        bound[eqn.primitive.name] += 1
        return rebind(eqn, invals)

    model, x = _Residual(), random_input(3, (2, 6, 6, 1))
    variables = model.init(jax.random.key(0), x)
    want = captured(model, variables, x)
    body = js.slice(model, variables, x, start="body", end="body")
    tail = js.slice(model, variables, x, start=["body:output", "norm:output"], end="head")
    full = js.slice(model, variables, x, mutable=["batch_stats"])
    monkeypatch.setattr(_compat, "bind_eqn", counting)
    skip = want["norm"][0]
    assert_trees_all_close(body(skip), want["body"][0])
    assert_trees_all_close(tail(want["body"][0], skip), want["head"][0])
    out, state = full(x, train=True, mutable=["batch_stats"])
    want_out, want_state = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert_trees_all_close((out, state), (want_out, want_state))
    assert not bound, f"equations bound again at the first calls: {dict(bound)}"
