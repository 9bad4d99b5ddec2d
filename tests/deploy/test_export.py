"""`sub.export(...)`: a slice as a `jax.export.Exported`, and shipping it with orbax.

The exported program is checked three ways: against the slice it came from, against an
oracle outside jaxslice (Flax's ``capture_intermediates``, ``model.apply`` and
hand-written math), and after a round trip through ``serialize``/``deserialize`` at batch
sizes other than the traced one (the batch size is symbolic). Slices that are not pure
functions of their inputs in their mode (randomness, state updates) or whose inputs are
not all arrays are refused with a `js.SliceError` that says what to do instead.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, captured, random_input, random_variables


class Block(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Conv(self.features, (3, 3), name="conv")(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(h)
        return nn.relu(h)


class Net(nn.Module):
    """Two conv blocks with BatchNorm, dropout, global pooling and a dense head."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = Block(4, name="b1")(x, train)
        h = Block(6, name="b2")(h, train)
        h = nn.Dropout(0.5, deterministic=not train, name="drop")(h)
        h = jnp.mean(h, axis=(1, 2))
        return nn.Dense(3, name="head")(h)


SHAPE = (6, 6, 3)


def _x(n: int, seed: int = 0) -> jax.Array:
    return random_input(seed, (n, *SHAPE))


@pytest.fixture(scope="module")
def net():
    model = Net()
    x = _x(2)
    # Random running statistics: BatchNorm in eval mode is not an identity.
    return model, random_variables(model, x), x


def _roundtrip(exported):
    pytest.importorskip("flatbuffers")  # jax.export's serialisation needs it
    return jax.export.deserialize(exported.serialize())


def test_exported_feature_extractor_runs_at_any_batch_size_after_serialisation(net):
    model, variables, x = net
    features = js.slice(model, variables, x, end="b2")
    exported = features.export()
    assert isinstance(exported, jax.export.Exported)
    assert str(exported.in_avals[0].shape[0]) == "b"
    again = _roundtrip(exported)
    for n in (1, 5):
        xn = _x(n, seed=n)
        want = captured(model, variables, xn)["b2"][0]  # Flax, eval-mode BatchNorm
        assert_trees_all_close(again.call(xn), want)
        assert_trees_all_close(again.call(xn), features(xn))


def test_exported_variables_are_an_input_of_the_program(net):
    """With ``variables_as_input``, other variables (same structure) give other results,
    as the model's: nothing of ``sub.variables`` is built into the program."""
    model, variables, x = net
    tail = js.slice(model, variables, x, start="b2")  # batch-first input: b1's output
    exported = tail.export(variables_as_input=True)
    others = random_variables(model, x, seed=7)
    for n, v in ((3, variables), (4, others)):
        xn = _x(n, seed=n)
        h = captured(model, v, xn)["b1"][0]
        assert_trees_all_close(exported.call(tail.extract(v), h), model.apply(v, xn))


def test_exported_slice_keeps_the_structure_of_dict_and_list_ends(net):
    model, variables, x = net
    as_dict = js.slice(model, variables, x, end={"low": "b1", "high": "b2/bn"}).export()
    as_tuple = js.slice(model, variables, x, end=["b1", "b2/bn"]).export()
    xn = _x(3, seed=3)
    seen = captured(model, variables, xn)
    assert_trees_all_close(as_dict.call(xn), {"low": seen["b1"][0], "high": seen["b2/bn"][0]})
    assert_trees_all_close(as_tuple.call(xn), (seen["b1"][0], seen["b2/bn"][0]))


def test_exported_slice_at_the_traced_shapes_without_a_symbolic_batch(net):
    model, variables, x = net
    exported = js.slice(model, variables, x, end="b1").export(batch=None)
    assert exported.in_avals[0].shape == x.shape
    assert_trees_all_close(exported.call(x), captured(model, variables, x)["b1"][0])


def test_export_of_a_train_mode_slice_that_is_a_pure_function(net):
    """The head in train mode draws nothing and updates nothing: it exports, although the
    model before it needs a dropout key (the re-trace at the symbolic batch size gets the
    keys the slice was made with)."""
    model, variables, x = net
    rngs = {"dropout": jax.random.key(0)}
    head = js.slice(model, variables, x, start="head", train=True, rngs=rngs)
    exported = head.export(platforms=("cpu", "tpu"))  # lowering for TPU needs no TPU
    assert exported.platforms == ("cpu", "tpu")
    pooled = random_input(9, (5, 6))
    p = variables["params"]["head"]
    assert_trees_all_close(exported.call(pooled), pooled @ p["kernel"] + p["bias"])


def test_export_refuses_a_slice_that_updates_state_and_says_what_to_do(net):
    model, variables, x = net
    rngs = {"dropout": jax.random.key(0)}
    sub = js.slice(model, variables, x, end="b2", train=True, mutable=["batch_stats"], rngs=rngs)
    with pytest.raises(js.SliceError) as info:
        sub.export()
    message = str(info.value)
    assert "updates ['batch_stats']" in message and "train=False" in message
    assert "mutable=['batch_stats']" in message
    # The fix the message offers works.
    v = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sub.variables)
    spec = jax.ShapeDtypeStruct((*jax.export.symbolic_shape("b"), *SHAPE), jnp.float32)
    fn = lambda v, x: sub.apply(v, x, mutable=["batch_stats"], rngs=rngs)  # noqa: E731
    exported = jax.export.export(jax.jit(fn))(v, spec)
    xn = _x(3, seed=4)
    assert_trees_all_close(exported.call(sub.variables, xn), fn(sub.variables, xn))


def test_export_refuses_a_slice_that_draws_random_numbers(net):
    model, variables, x = net
    rngs = {"dropout": jax.random.key(0)}
    sub = js.slice(model, variables, x, start="drop", train=True, rngs=rngs)
    with pytest.raises(js.SliceError, match=r"draws random numbers.*rngs=\{'dropout': key\}"):
        sub.export()


class Scaled(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        return nn.Dense(2, name="dense")(inputs["x"]) * inputs["scale"]


class WithOptions(nn.Module):
    """`scale` reaches `s` inside a dict next to an array, as a Python number."""

    @nn.compact
    def __call__(self, x):
        return Scaled(name="s")({"x": nn.Dense(3, name="a")(x), "scale": 3.0})


def test_export_refuses_an_input_holding_values_fixed_by_the_trace():
    model, x = WithOptions(), random_input(1, (2, 4))
    variables = random_variables(model, x)
    sub = js.slice(model, variables, x, start="s")
    with pytest.raises(js.SliceError, match=r"'s:input'.*fixed by the trace.*':output' port"):
        sub.export()
    # Starting at the value, not the module's argument, exports.
    exported = js.slice(model, variables, x, start="a:output").export()
    h = random_input(2, (5, 3))
    p = variables["params"]["s"]["dense"]
    assert_trees_all_close(exported.call(h), (h @ p["kernel"] + p["bias"]) * 3.0)


class Gate(nn.Module):
    @nn.compact
    def __call__(self, x, *, mask):
        return nn.Dense(3, name="dense")(x) * mask


class Gated(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        return Gate(name="gate")(nn.Dense(4, name="a")(x), mask=mask)


def test_exported_slice_takes_keyword_inputs_of_its_start_by_keyword():
    model, x, mask = Gated(), random_input(1, (2, 5)), random_input(2, (2, 3))
    variables = random_variables(model, x, mask)
    exported = js.slice(model, variables, x, mask, start="gate").export()
    assert [str(a.shape[0]) for a in exported.in_avals] == ["b", "b"]
    h, m = random_input(3, (4, 4)), random_input(4, (4, 3))
    p = variables["params"]["gate"]["dense"]
    assert_trees_all_close(exported.call(h, mask=m), (h @ p["kernel"] + p["bias"]) * m)


def test_exported_slice_of_a_plain_function():
    @js.mark("encoder")
    def encoder(params, x):
        return jnp.tanh(x @ params["w"])

    def fn(params, x):
        return encoder(params, x).sum(-1)

    params = {"w": random_input(3, (4, 5))}
    exported = js.slice(fn, params, random_input(4, (2, 4)), end="encoder").export()
    x = random_input(5, (7, 4))
    assert_trees_all_close(exported.call(x), jnp.tanh(x @ params["w"]))


# --------------------------------------------------------------------------- orbax


def test_shipping_a_feature_extractor_with_orbax(net, tmp_path):
    """Save the slice's variables with orbax and its program with `jax.export`; load both
    without the model (the restore target comes from the program's own signature) and
    get the model's feature."""
    ocp = pytest.importorskip("orbax.checkpoint")
    pytest.importorskip("flatbuffers")  # jax.export's serialisation needs it
    model, variables, x = net
    features = js.slice(model, variables, x, end="b2")
    program = tmp_path / "features.jax"
    program.write_bytes(features.export(variables_as_input=True).serialize())
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "variables", features.variables)
    checkpointer.wait_until_finished()
    checkpointer.close()
    shapes = jax.eval_shape(lambda v: v, features.variables)
    del features

    loaded = jax.export.deserialize(bytearray(program.read_bytes()))
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in loaded.in_avals]
    (target, _), _ = jax.tree_util.tree_unflatten(loaded.in_tree, specs)
    assert target == shapes
    checkpointer = ocp.StandardCheckpointer()
    restored = checkpointer.restore(tmp_path / "variables", target)
    checkpointer.close()
    for n in (1, 4):
        xn = _x(n, seed=8)
        want = captured(model, variables, xn)["b2"][0]
        assert_trees_all_close(loaded.call(restored, xn), want)


def test_an_nnx_slice_exports_in_its_current_mode_with_its_variables_built_in():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(self.drop(jax.nn.relu(self.bn(self.lin(x)))))

    model = Net(nnx.Rngs(0))
    x = random_input(0, (3, 4))
    sub = js.slice(model, x, end="drop")
    with pytest.raises(js.SliceError, match="sub.eval"):
        sub.export()  # train mode: batch statistics and dropout counters change
    sub.eval()
    received = _roundtrip(sub.export())
    xs = random_input(3, (7, 4))
    # The oracle: the model's own submodules, called eagerly in eval mode.
    assert_trees_all_close(received.call(xs), jax.nn.relu(model.bn(model.lin(xs))))
