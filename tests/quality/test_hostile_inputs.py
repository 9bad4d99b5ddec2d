"""Careless or hostile use: a clear `js.SliceError`, or a correct result.

Never a raw TypeError/AttributeError/ValueError from deep inside JAX or Flax, never a
silently wrong value. Covers empty and odd ``names`` for `js.intermediates`, non-array
slice inputs, malformed ``rngs``, pickling and copying slices (linen and NNX),
`jax.export` with a symbolic batch, modules whose own names contain the characters of
the name grammar (``:``, ``@``, ``/``, ``[``), and a module that receives one value
twice. Oracles: hand-written math over the parameters, ``model.apply`` and Flax's
``capture_intermediates``.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.oracles import assert_trees_all_close

# --------------------------------------------------------------------------- models


class Net(nn.Module):
    """a (8 -> 8), relu, dropout, b (8 -> 3)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(8, name="a")(x))
        h = nn.Dropout(0.5, deterministic=not train, name="drop")(h)
        return nn.Dense(3, name="b")(h)


class SetupNet(nn.Module):
    """stem, relu, block, relu, head; submodules defined in setup so methods can reach them."""

    def setup(self):
        self.stem = nn.Dense(8)
        self.block = nn.Dense(8)
        self.head = nn.Dense(3)

    def tail(self, h):
        return self.head(nn.relu(self.block(h)))

    def __call__(self, x):
        return self.tail(nn.relu(self.stem(x)))


def dense(p: Any, x: Any) -> Any:
    return x @ p["kernel"] + p["bias"]


def _initialised(model: nn.Module) -> tuple[nn.Module, Any, Any]:
    """The model, its variables and the (4, 8) sample input they were made with."""
    x = jax.random.normal(jax.random.key(1), (4, 8))
    return model, model.init(jax.random.key(0), x), x


@pytest.fixture(scope="module")
def net():
    return _initialised(Net())


@pytest.fixture(scope="module")
def sub(net):
    model, variables, x = net
    return js.slice(model, variables, x, start="a", end="b")


def assert_clear_error(info: pytest.ExceptionInfo, *words: str) -> str:
    """The error is a SliceError (not a raw Python error) and mentions every word."""
    error = info.value
    assert isinstance(error, js.SliceError), type(error)
    msg = str(error)
    for word in words:
        assert word in msg, f"{word!r} not in message:\n{msg}"
    return msg


# --------------------------------------------------------------------------- intermediates names


@pytest.mark.parametrize("names", [[], (), "iter"], ids=["list", "tuple", "iterator"])
def test_intermediates_empty_names_is_a_spec_error(net, names):
    model, variables, x = net
    names = iter([]) if names == "iter" else names
    with pytest.raises(js.InvalidSpecError) as info:
        js.intermediates(model, variables, x, names=names)
    assert_clear_error(info, "names")


def test_intermediates_accepts_an_iterator_of_names(net):
    model, variables, x = net
    from_list = js.intermediates(model, variables, x, names=["a", "b"])
    from_iter = js.intermediates(model, variables, x, names=iter(["a", "b"]))
    from_gen = js.intermediates(model, variables, x, names=(n for n in ["a", "b"]))
    assert list(from_iter) == ["a", "b"]
    assert_trees_all_close(from_iter, from_list)
    assert_trees_all_close(from_gen, from_list)
    p = variables["params"]
    h = dense(p["a"], x)
    assert_trees_all_close(from_iter["a"], h)
    assert_trees_all_close(from_iter["b"], dense(p["b"], jax.nn.relu(h)))


@pytest.mark.parametrize("names", ["a", 5, [3], [None]], ids=["str", "int", "list-int", "none"])
def test_intermediates_names_of_the_wrong_type(net, names):
    model, variables, x = net
    with pytest.raises(js.InvalidSpecError) as info:
        js.intermediates(model, variables, x, names=names)
    assert_clear_error(info, "names")


# --------------------------------------------------------------------------- slice inputs


@pytest.mark.parametrize("start", ["a", None], ids=["start", "no-start"])
@pytest.mark.parametrize(
    "bad",
    ["hello", b"abc", object(), jax.ShapeDtypeStruct((4, 8), jnp.float32)],
    ids=["str", "bytes", "object", "ShapeDtypeStruct"],
)
def test_slice_called_with_a_non_array(net, start, bad):
    model, variables, x = net
    s = js.slice(model, variables, x, start=start, end="b")
    with pytest.raises(js.InputMismatchError) as info:
        s(bad)
    assert_clear_error(info)


def test_shape_dtype_struct_still_works_for_eval_shape(sub):
    out = jax.eval_shape(sub, jax.ShapeDtypeStruct((5, 8), jnp.float32))
    assert out.shape == (5, 3) and out.dtype == jnp.float32


@pytest.mark.parametrize(
    "args",
    [(None,), ({"x": 1.0},), (), ("x", "y")],
    ids=["None", "dict", "nothing", "two"],
)
def test_slice_called_with_wrong_structure(sub, args):
    with pytest.raises(js.InputMismatchError) as info:
        sub(*args)
    assert_clear_error(info)


# --------------------------------------------------------------------------- rngs


@pytest.mark.parametrize(
    "rngs",
    [{"dropout": 0}, {"dropout": "abc"}, 0, [jax.random.key(0)], {"wrong": jax.random.key(0)}],
    ids=["int-key", "str-key", "int", "list", "wrong-name"],
)
def test_bad_rngs_in_train_mode_is_a_slice_error(sub, rngs):
    with pytest.raises(js.SliceError) as info:
        sub.apply(sub.variables, jnp.ones((4, 8)), rngs=rngs, train=True)
    assert not isinstance(info.value, (ValueError, TypeError))
    msg = str(info.value).lower()
    assert "rng" in msg or "key" in msg, msg


def test_good_rngs_in_train_mode_match_the_model(net, sub):
    model, variables, x = net
    key = jax.random.key(3)
    # The model itself, started at `a` by hand: the same keys give the same dropout mask.
    full = model.apply(variables, x, train=True, rngs={"dropout": key})
    assert_trees_all_close(sub.apply(sub.variables, x, rngs={"dropout": key}, train=True), full)


# --------------------------------------------------------------------------- pickling and copying


def _cloudpickle_dumps(obj: Any) -> bytes:
    cloudpickle = pytest.importorskip("cloudpickle")
    return cloudpickle.dumps(obj)


COPIERS = {
    "pickle": pickle.dumps,
    "deepcopy": copy.deepcopy,
    "cloudpickle": _cloudpickle_dumps,
}


@pytest.mark.parametrize("how", list(COPIERS))
def test_pickling_a_linen_slice_says_what_to_save(sub, how):
    with pytest.raises(js.SliceError) as info:
        COPIERS[how](sub)
    assert_clear_error(info, "variables")


class NnxModel(nnx.Module):
    """a (8 -> 8), relu, b (8 -> 3); at module level so pickle can find the class."""

    def __init__(self, rngs):
        self.a = nnx.Linear(8, 8, rngs=rngs)
        self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


@pytest.fixture(scope="module")
def nnx_slice():
    model = NnxModel(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    s = js.slice(model, x, start="b", end="b")
    return model, s, x


@pytest.mark.parametrize("how", list(COPIERS))
def test_pickling_an_nnx_slice_is_a_slice_error_or_works(nnx_slice, how):
    model, s, x = nnx_slice
    assert isinstance(s, js.SlicedModule)
    h = jax.random.normal(jax.random.key(2), (4, 8))
    expected = np.asarray(model.b(h))
    try:
        result = COPIERS[how](s)
    except js.SliceError as error:
        msg = str(error)
        assert "variables" in msg or "state" in msg, msg
        return
    # It worked: the copy must compute the same thing.
    copied = pickle.loads(result) if isinstance(result, bytes) else result
    assert_trees_all_close(copied(h), expected)
    if how == "deepcopy":
        # A deep copy is independent: changing its parameters leaves the original's.
        params = nnx.state(copied, nnx.Param)
        nnx.update(copied, jax.tree_util.tree_map(lambda a: a + 1.0, params))
        assert_trees_all_close(s(h), expected)
        assert_trees_all_close(model.b(h), expected)


# --------------------------------------------------------------------------- jax.export


@pytest.fixture(scope="module")
def setup_net():
    return _initialised(SetupNet())


def _export_oracle(model: nn.Module, variables: Any, h: Any) -> Any:
    return model.apply(variables, h, method=SetupNet.tail)


def _symbolic_spec(form: str) -> jax.ShapeDtypeStruct:
    if form == "dim":
        (batch,) = jax.export.symbolic_shape("b")
        return jax.ShapeDtypeStruct((batch, 8), jnp.float32)
    return jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 8"), jnp.float32)


@pytest.mark.parametrize("form", ["dim", "shape string"])
def test_jax_export_with_symbolic_batch_on_a_slice_with_a_start(setup_net, form):
    """A slice with a start re-traces at a symbolic batch size (no
    InconclusiveDimensionOperation), so `jax.export` works at any batch."""
    model, variables, x = setup_net
    s = js.slice(model, variables, x, start="block", end="head")
    exported = jax.export.export(jax.jit(s))(_symbolic_spec(form))
    for n in (2, 3, 11):
        h = jax.random.normal(jax.random.key(n), (n, 8))
        assert_trees_all_close(exported.call(h), _export_oracle(model, variables, h))


def test_jax_export_of_a_slice_survives_serialisation(setup_net):
    pytest.importorskip("flatbuffers")  # jax.export's serialisation needs it
    model, variables, x = setup_net
    s = js.slice(model, variables, x, start="block", end="head")
    exported = jax.export.export(jax.jit(s))(_symbolic_spec("shape string"))
    again = jax.export.deserialize(exported.serialize())
    h = jax.random.normal(jax.random.key(5), (5, 8))
    assert_trees_all_close(again.call(h), _export_oracle(model, variables, h))


def test_slice_has_an_export_method(setup_net):
    """SPEC: ``sub.export(...)`` is a jax.export.Exported of a slice, symbolic batch size."""
    model, variables, x = setup_net
    s = js.slice(model, variables, x, start="block", end="head")
    assert hasattr(s, "export"), "js.Sliced has no `export` method (SPEC, Public API)"
    exported = s.export()
    assert isinstance(exported, jax.export.Exported)
    for n in (3, 7):
        h = jax.random.normal(jax.random.key(n), (n, 8))
        assert_trees_all_close(exported.call(h), _export_oracle(model, variables, h))


# --------------------------------------------------------------------------- names with grammar characters


class OddNames(nn.Module):
    """Modules whose own names contain ':' and '@', beside ones whose names they mimic."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="a:input")(x)
        h = nn.Dense(4, name="b@1")(h)
        h = nn.Dense(4, name="x:output")(h)
        return nn.Dense(3, name="a")(h)


class OddNamesShared(nn.Module):
    """A module ``b`` called twice (so ``b@1`` is its second call) and one named 'b@1'."""

    @nn.compact
    def __call__(self, x):
        b = nn.Dense(4, name="b")
        h = b(b(nn.Dense(4, name="pre")(x)))
        return nn.Dense(4, name="b@1")(h)


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="q")(x)


class OddNamesSlash(nn.Module):
    """A module named 'p/q' beside a module 'p' with a child 'q'; and one named 'c[0]'."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="p/q")(x)
        h = Inner(name="p")(h)
        return nn.Dense(2, name="c[0]")(h)


def _captured_in_call_order(model: nn.Module, variables: Any, x: Any) -> list[Any]:
    """Every submodule call's output, in call order, recorded by Flax itself."""
    outputs = []

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.module.scope.path and context.method_name == "__call__":
            outputs.append(out)
        return out

    with nn.intercept_methods(interceptor):
        model.apply(variables, x)
    return outputs


@pytest.mark.parametrize("cls", [OddNames, OddNamesShared, OddNamesSlash])
def test_every_listed_name_resolves_to_its_module(cls):
    model = cls()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    table = js.boundaries(model, variables, x)
    names = [b.name for b in table]
    printed = str(table)
    for name in names:
        assert name in printed
    expected = _captured_in_call_order(model, variables, x)
    assert len(names) == len(expected), names
    assert len(set(names)) == len(names), f"two boundaries are listed under one name: {names}"
    for name, want in zip(names, expected, strict=True):
        got = js.slice(model, variables, x, end=name)(x)
        assert_trees_all_close(got, want)


def test_odd_names_param_counts_are_per_module():
    model = OddNamesSlash()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    counts = [b.param_count for b in js.boundaries(model, variables, x)]
    # p/q: 8*4+4, p: 4*4+4, p/q (inside p): 4*4+4, c[0]: 4*2+2.
    assert sorted(counts) == sorted([36, 20, 20, 10]), counts


def test_end_at_a_module_named_like_a_port_is_not_silently_another_port():
    """'a:input' is both a port of module 'a' and a module's own name: it is refused,
    and each spelling the error offers gives its own value."""
    model = OddNames()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    p = variables["params"]
    with pytest.raises(js.AmbiguousBoundaryError) as info:
        js.slice(model, variables, x, end="a:input")
    assert "a\\\\:input" in str(info.value) and "a@0:input" in str(info.value)
    module = js.slice(model, variables, x, end="a\\:input")(x)
    assert_trees_all_close(module, dense(p["a:input"], x))
    port = js.slice(model, variables, x, end="a@0:input")(x)
    h = dense(p["x:output"], dense(p["b@1"], dense(p["a:input"], x)))
    assert_trees_all_close(port, h)


# --------------------------------------------------------------------------- one value received twice


class DictBlock(nn.Module):
    @nn.compact
    def __call__(self, x, act):
        return nn.relu(nn.Dense(4, name="fc")(x) + act["x"])


class DictNet(nn.Module):
    """block(h, {"x": h}), as flaxmodels' ResNets pass activations along."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        h = DictBlock(name="block")(h, {"x": h})
        return nn.Dense(3, name="head")(h)


class TupleBlock(nn.Module):
    @nn.compact
    def __call__(self, x, act):
        return nn.relu(nn.Dense(4, name="fc")(x) + act[0])


class TupleNet(nn.Module):
    """block(x, (x,)) straight on the model's input: no module produces the value."""

    @nn.compact
    def __call__(self, x):
        h = TupleBlock(name="block")(x, (x,))
        return nn.Dense(3, name="head")(h)


def test_value_received_twice_names_arguments_and_producer():
    model = DictNet()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(js.SliceError) as info:
        js.slice(model, variables, x, start="block")
    assert_clear_error(info, "argument 0", "argument 1", "stem", "block")


def test_value_received_twice_suggested_fix_works():
    model = DictNet()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    p = variables["params"]
    s = js.slice(model, variables, x, start="stem:output")
    h = dense(p["stem"], x)
    expected = dense(p["head"], jax.nn.relu(dense(p["block"]["fc"], h) + h))
    assert_trees_all_close(s(h), expected)
    assert_trees_all_close(s(h), model.apply(variables, x))


def test_model_input_received_twice_is_a_clear_error():
    model = TupleNet()
    x = jax.random.normal(jax.random.key(1), (4, 4))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(js.SliceError) as info:
        js.slice(model, variables, x, start="block")
    msg = assert_clear_error(info, "argument 0", "argument 1")
    assert "input" in msg, msg
