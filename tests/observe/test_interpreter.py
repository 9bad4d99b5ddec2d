"""`js.Interpreter`: boundary and equation hooks over a model's traced program.

Oracles come from outside jaxslice: Flax's ``intercept_methods`` and
``capture_intermediates`` (what each module call saw and returned), ``jax.make_jaxpr`` of
the model (its equations), eager ``apply`` of submodules with a value swapped in by hand
(what a replacement must do downstream), and ``jax.grad``/``jax.vmap`` of the model itself.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, random_input, random_variables

# --------------------------------------------------------------------------- model


class Res(nn.Module):
    """A residual block: its input feeds both the branch and the skip add."""

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1], name="fc")(nn.relu(x))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        h = Res(name="res")(h)
        return nn.Dense(2, name="head")(jnp.tanh(h))


MODEL = Net()
X = random_input(0, (3, 5))
VARIABLES = random_variables(MODEL, X, seed=0)
P = VARIABLES["params"]


def stem(x):
    return nn.Dense(4).apply({"params": P["stem"]}, x)


def fc(h):
    return nn.Dense(4).apply({"params": P["res"]["fc"]}, h)


def head(h):
    return nn.Dense(2).apply({"params": P["head"]}, h)


def events_by_flax(model, variables, x):
    """[(name, side, value)] in the order Flax enters and leaves every submodule call."""
    events = []

    def interceptor(next_fun, args, kwargs, context):
        name = "/".join(context.module.scope.path)
        if context.method_name != "__call__" or not name:
            return next_fun(*args, **kwargs)
        events.append((name, "input", args[0] if len(args) == 1 else args))
        out = next_fun(*args, **kwargs)
        events.append((name, "output", out))
        return out

    with nn.intercept_methods(interceptor):
        model.apply(variables, x)
    return events


class Recorder(js.Interpreter):
    def __init__(self):
        self.boundaries = []
        self.equations = []

    def boundary(self, name, side, value):
        self.boundaries.append((name, side))
        self.emit((name, side), value)
        return value

    def equation(self, eqn, inputs, outputs):
        self.equations.append(eqn)
        if eqn.primitive == "dot_general":
            self.emit(("dot", eqn.index), (inputs, outputs))
        return outputs


@pytest.fixture(scope="module")
def recorded():
    rec = Recorder()
    fn = rec.build(MODEL, VARIABLES, X)
    out, emitted = fn(VARIABLES, X)
    return rec, fn, out, emitted


# --------------------------------------------------------------------------- observing


def test_boundary_hook_sees_every_call_in_order(recorded):
    rec, _, out, emitted = recorded
    expected = events_by_flax(MODEL, VARIABLES, X)
    assert rec.boundaries == [(n, s) for n, s, _ in expected]
    assert len(emitted) == len(expected) + 3  # plus three dot_generals
    for name, side, value in expected:
        assert_trees_all_close(emitted[(name, side)], value)
    assert_trees_all_close(out, MODEL.apply(VARIABLES, X))


def test_boundary_outputs_match_capture_intermediates(recorded):
    _, _, _, emitted = recorded
    _, state = MODEL.apply(VARIABLES, X, capture_intermediates=True, mutable=["intermediates"])
    inter = state["intermediates"]
    for name, path in [
        ("stem", ["stem"]),
        ("res", ["res"]),
        ("res/fc", ["res", "fc"]),
        ("head", ["head"]),
    ]:
        node = inter
        for p in path:
            node = node[p]
        assert_trees_all_close(emitted[(name, "output")], node["__call__"][0])


def test_equation_hook_sees_every_equation(recorded):
    rec, _, _, emitted = recorded
    jaxpr = jax.make_jaxpr(MODEL.apply)(VARIABLES, X).jaxpr
    assert [e.primitive for e in rec.equations] == [e.primitive.name for e in jaxpr.eqns]
    assert [e.index for e in rec.equations] == list(range(len(jaxpr.eqns)))
    dots = [e for e in rec.equations if e.primitive == "dot_general"]
    assert [e.boundary for e in dots] == ["stem", "res/fc", "head"]
    assert "tanh" in [e.primitive for e in rec.equations if e.boundary is None]
    for e in dots:  # inputs and outputs are the equation's own values
        (a, b), (c,) = emitted[("dot", e.index)]
        np.testing.assert_allclose(
            np.asarray(c), np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5
        )
        assert e.params["dimension_numbers"] == (((1,), (0,)), ((), ()))


def test_hooks_run_at_trace_time_once_per_shape():
    rec = Recorder()
    fn = rec.build(MODEL, VARIABLES, X)
    fn(VARIABLES, X)
    n = len(rec.equations)
    assert n > 0
    fn(VARIABLES, X + 1.0)  # same shape: compiled already, hooks do not run again
    assert len(rec.equations) == n


# --------------------------------------------------------------------------- replacing


class Replace(js.Interpreter):
    def __init__(self, name, side, fn):
        self.target = (name, side)
        self.fn = fn

    def boundary(self, name, side, value):
        return self.fn(value) if (name, side) == self.target else value


def test_replacing_an_output_changes_everything_downstream():
    fn = Replace("stem", "output", lambda h: 2.0 * h + 1.0).build(MODEL, VARIABLES, X)
    out, _ = fn(VARIABLES, X)
    h = 2.0 * stem(X) + 1.0
    assert_trees_all_close(out, head(jnp.tanh(h + fc(nn.relu(h)))))


def test_replacing_a_block_input_reaches_branch_and_skip():
    """`res`'s input is read by the branch and the skip add, both inside `res`."""
    fn = Replace("res", "input", lambda h: -h).build(MODEL, VARIABLES, X)
    out, _ = fn(VARIABLES, X)
    h = -stem(X)
    assert_trees_all_close(out, head(jnp.tanh(h + fc(nn.relu(h)))))


def test_replacing_an_input_affects_only_that_module():
    """`res/fc`'s input is relu(h); the skip add outside `fc` keeps reading the original h."""
    fn = Replace("res/fc", "input", lambda a: a * 0.0 + 3.0).build(MODEL, VARIABLES, X)
    out, _ = fn(VARIABLES, X)
    h = stem(X)
    assert_trees_all_close(out, head(jnp.tanh(h + fc(jnp.full_like(h, 3.0)))))


class SkipUser(nn.Module):
    """`stem`'s output feeds `fc` and, outside any module, the add after it."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        y = nn.Dense(4, name="fc")(h)
        return nn.Dense(2, name="head")(jnp.tanh(y) + h)


def test_replacing_an_input_leaves_other_readers_alone():
    model = SkipUser()
    v = random_variables(model, X, seed=1)
    p = v["params"]
    fn = Replace("fc", "input", jnp.zeros_like).build(model, v, X)
    out, _ = fn(v, X)
    h = nn.Dense(4).apply({"params": p["stem"]}, X)
    y = nn.Dense(4).apply({"params": p["fc"]}, jnp.zeros_like(h))
    assert_trees_all_close(out, nn.Dense(2).apply({"params": p["head"]}, jnp.tanh(y) + h))


def test_replacing_an_equation_output():
    class NoTanh(js.Interpreter):
        def equation(self, eqn, inputs, outputs):
            return inputs if eqn.primitive == "tanh" else outputs

    out, _ = NoTanh().build(MODEL, VARIABLES, X)(VARIABLES, X)
    h = stem(X)
    assert_trees_all_close(out, head(h + fc(nn.relu(h))))


def test_replacement_with_wrong_structure_is_an_error():
    fn = Replace("stem", "output", lambda h: (h, h)).build(MODEL, VARIABLES, X)
    with pytest.raises(js.SliceError, match="stem"):
        fn(VARIABLES, X)


# --------------------------------------------------------------------------- transformations


class Identity(js.Interpreter):
    """Hooks that return what they get, and observe something on the way."""

    def boundary(self, name, side, value):
        if side == "output":
            self.emit(name, jnp.mean(value))
        return value


@pytest.fixture(scope="module")
def identity_fn():
    return Identity().build(MODEL, VARIABLES, X, jit=False)


def test_emitted_values_and_jit(identity_fn):
    out, emitted = jax.jit(identity_fn)(VARIABLES, X)
    assert_trees_all_close(out, MODEL.apply(VARIABLES, X))
    h = stem(X)
    r = h + fc(nn.relu(h))
    expected = {"stem": h, "res/fc": fc(nn.relu(h)), "res": r, "head": head(jnp.tanh(r))}
    assert set(emitted) == set(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(float(emitted[k]), float(jnp.mean(v)), rtol=1e-5, atol=1e-6)


def test_grad_equals_model_grad(identity_fn):
    def loss(v, fn):
        return jnp.sum(fn(v, X) ** 2)

    got = jax.grad(lambda v: loss(v, lambda v, x: identity_fn(v, x)[0]))(VARIABLES)
    want = jax.grad(lambda v: loss(v, MODEL.apply))(VARIABLES)
    assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


def test_vmap_over_batches(identity_fn):
    xs = random_input(1, (4, 3, 5))
    got = jax.vmap(lambda x: identity_fn(VARIABLES, x)[0])(xs)
    want = jnp.stack([MODEL.apply(VARIABLES, x) for x in xs])
    assert_trees_all_close(got, want)


def test_new_input_shapes():
    fn = Identity().build(MODEL, VARIABLES, X)
    for shape in [(7, 5), (2, 3, 5)]:
        x = random_input(2, shape)
        out, emitted = fn(VARIABLES, x)
        assert_trees_all_close(out, MODEL.apply(VARIABLES, x))
        np.testing.assert_allclose(
            float(emitted["stem"]), float(jnp.mean(stem(x))), rtol=1e-5, atol=1e-6
        )


# --------------------------------------------------------------------------- recursion


@jax.jit
def helper(x):
    return jnp.sin(x) * 2.0


def plain(p, x):
    return jax.nn.relu(helper(x @ p))


class Prims(js.Interpreter):
    def __init__(self, recurse, drop_max=False):
        self.recurse = recurse
        self.drop_max = drop_max
        self.seen = []

    def equation(self, eqn, inputs, outputs):
        self.seen.append(eqn.primitive)
        if self.drop_max and eqn.primitive == "max":
            return [inputs[0]]  # relu becomes the identity
        return outputs


def test_recurse_sees_inside_jit_and_custom_jvp():
    w = random_input(3, (5, 4))
    flat = Prims(recurse=False)
    out, _ = flat.build(plain, w, X)(w, X)
    assert_trees_all_close(out, plain(w, X))
    assert "sin" not in flat.seen and "max" not in flat.seen  # opaque calls by default
    deep = Prims(recurse=True)
    out, _ = deep.build(plain, w, X)(w, X)
    assert_trees_all_close(out, plain(w, X))
    assert {"dot_general", "sin", "mul", "max"} <= set(deep.seen)
    hacked = Prims(recurse=True, drop_max=True)
    out, _ = hacked.build(plain, w, X)(w, X)
    assert_trees_all_close(out, jnp.sin(X @ w) * 2.0)


# --------------------------------------------------------------------------- zoo: shared calls, tuples


@pytest.mark.parametrize(
    "zoo_name", ["shared_zoo", "tuple_zoo", "skip_zoo", "method_zoo", "unused_zoo"]
)
def test_boundary_values_match_flax_recording(zoo_name, request):
    """Shared modules (``name@k``), tuple outputs, several arguments and other methods."""
    zoo = request.getfixturevalue(zoo_name)
    rec = Recorder()
    _, emitted = rec.build(zoo.model, zoo.variables, zoo.x)(zoo.variables, zoo.x)
    expected = {}
    for name, calls in zoo.calls.items():
        for k, (args, _, out) in enumerate(calls):
            key = f"{name}@{k}" if len(calls) > 1 else name
            expected[(key, "input")] = args[0] if len(args) == 1 else tuple(args)
            expected[(key, "output")] = out
    got = {k: v for k, v in emitted.items() if k[0] != "dot"}
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert_trees_all_close(got[key], value)


def dense(params, x):
    return x @ params["kernel"] + params["bias"]


def test_replacing_one_call_of_a_shared_module(shared_zoo):
    """``shared@0``'s output replaced; ``shared@1`` (same parameters) runs on the new value."""
    z = shared_zoo
    p = z.variables["params"]
    fn = Replace("shared@0", "output", jnp.zeros_like).build(z.model, z.variables, z.x)
    out, _ = fn(z.variables, z.x)
    h = jnp.zeros((z.x.shape[0], 4))
    assert_trees_all_close(out, dense(p["head"], dense(p["shared"], jnp.tanh(h))), atol=1e-5)


def test_replacing_one_argument_of_a_two_argument_module(skip_zoo):
    """``dec(h, skip)``: its input is the tuple of both; only the second is replaced."""
    z = skip_zoo
    p = z.variables["params"]
    fn = Replace("dec", "input", lambda hs: (hs[0], 0.0 * hs[1])).build(z.model, z.variables, z.x)
    out, _ = fn(z.variables, z.x)
    h, skip = z.args_of("dec")
    d = dense(p["dec"]["fc"], jnp.concatenate([h, jnp.zeros_like(skip)], axis=-1))
    assert_trees_all_close(out, dense(p["head"], d), atol=1e-5)


def test_nnx_model():
    from flax import nnx

    from helpers.nnx_zoo import Residual as Block

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Linear(5, 4, rngs=rngs)
            self.block = Block(rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(self.block(self.stem(x)))

    model = Model(nnx.Rngs(0))
    fn = Replace("block/linear", "output", lambda y: -y).build(model, X)
    out, _ = fn(nnx.state(model), X)
    h = model.stem(X)
    assert_trees_all_close(out, model.head(h + jax.nn.relu(-model.block.linear(h))))
    rec = Recorder()
    out, emitted = rec.build(model, X)(nnx.state(model), X)
    assert_trees_all_close(out, model(X))
    assert [n for n, s in rec.boundaries if s == "output"] == [
        "stem",
        "block/linear",
        "block",
        "head",
    ]
    assert_trees_all_close(emitted[("block", "output")], model.block(h))
