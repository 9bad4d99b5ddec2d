"""Slicing Flax linen models, checked against Flax's own recording of every module call.

The oracle test: a slice from A to B, fed the input Flax recorded for A, reproduces the
output Flax recorded for B — eagerly and under `jax.jit`. Prefix slices (``start=None``)
are compared with ``capture_intermediates``; single modules with eager ``nn.apply`` of the
submodule or hand-written math. Every slice also owns exactly the variables of the
modules it contains, as the very same array objects.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import RESNET_NAMES, AutoEncoder
from helpers.oracles import (
    Zoo,
    assert_trees_all_close,
    assert_variables_are_subset_of,
    random_input,
    random_variables,
    record_calls,
)

# --------------------------------------------------------------------------- helpers


def _parse(spec: str) -> tuple[str, int, str | None]:
    name, _, port = spec.partition(":")
    base, _, k = name.partition("@")
    return base, int(k) if k else 0, port or None


def inputs_for(zoo, start) -> list:
    """What a slice starting at `start` takes, as Flax recorded it."""
    if start is None:
        return [zoo.x]
    out = []
    for spec in [start] if isinstance(start, str) else start:
        base, k, port = _parse(spec)
        if port == "output":
            out.append(zoo.out_of(base, k))
        else:
            out.extend(zoo.args_of(base, k))
    return out


def expected_for(zoo, end):
    """What a slice ending at `end` returns, as Flax recorded it."""
    if end is None:
        return zoo.apply(zoo.variables, zoo.x)
    if isinstance(end, list):
        return tuple(expected_for(zoo, e) for e in end)
    if isinstance(end, dict):
        return {k: expected_for(zoo, e) for k, e in end.items()}
    base, k, port = _parse(end)
    if port == "input":
        (arg,) = zoo.args_of(base, k)
        return arg
    return zoo.out_of(base, k)


# (zoo fixture, start, end, modules whose variables the slice needs)
CASES = [
    # ResNet-style CNN with BatchNorm (eval) and residual adds.
    ("resnet", "stem", "stem", {"stem"}),
    ("resnet", "stage1", "stage2", {"stage1", "stage2"}),
    ("resnet", "stage1/conv2", "stage1/bn2", {"stage1/conv2", "stage1/bn2"}),
    ("resnet", "stage2/conv1", "stage2", {"stage2"}),
    ("resnet", "stage2", "head", {"stage2", "head"}),
    ("resnet", "stage1:output", "head", {"stage2", "head"}),
    ("resnet", ["stage1/conv2", "stage1:input"], "stage1", {"stage1/conv2", "stage1/bn2"}),
    # identity module
    ("identity_zoo", "ident", "ident", set()),
    ("identity_zoo", "stem", "ident", {"stem"}),
    ("identity_zoo", "ident:output", "head", {"head"}),
    # module returning a tuple
    ("tuple_zoo", "pair", "pair", {"pair"}),
    ("tuple_zoo", "pair:output", "head", {"head"}),
    ("tuple_zoo", "stem", ["pair/a", "pair/b"], {"stem", "pair"}),
    ("tuple_zoo", "pair", {"feat": "pair", "logits": "head"}, {"pair", "head"}),
    # module whose output is never used
    ("unused_zoo", "probe", "probe", {"probe"}),
    ("unused_zoo", "stem", "head", {"stem", "head"}),
    # module called twice
    ("shared_zoo", "shared@0", "shared@0", {"shared"}),
    ("shared_zoo", "shared@1", "shared@1", {"shared"}),
    ("shared_zoo", "shared@0", "shared@1", {"shared"}),
    ("shared_zoo", "shared@1", "head", {"shared", "head"}),
    # skip connection
    ("skip_zoo", ["enc2", "enc1:output"], "dec", {"enc2", "dec"}),
    ("skip_zoo", "enc1:output", "dec", {"enc2", "dec"}),
    ("skip_zoo", "dec", "head", {"dec", "head"}),
    ("skip_zoo", "enc1", "dec/fc:input", {"enc1", "enc2"}),
    # methods other than __call__
    ("method_zoo", "ae.encode", "ae.encode", {"ae/enc"}),
    ("method_zoo", "ae.decode", "head", {"ae/dec", "head"}),
    ("method_zoo", "ae.encode", "ae.decode", {"ae/enc", "ae/dec"}),
]


def _case_id(case) -> str:
    zoo, start, end, _ = case
    return f"{zoo}:{start}->{end}"


@pytest.fixture(scope="module", params=CASES, ids=[_case_id(c) for c in CASES])
def case(request):
    zoo_name, start, end, modules = request.param
    zoo = request.getfixturevalue(zoo_name)
    sub = js.slice(zoo.model, zoo.variables, zoo.x, start=start, end=end)
    return zoo, sub, start, end, modules


# --------------------------------------------------------------------------- oracle tests


def test_slice_reproduces_recorded_output(case):
    zoo, sub, start, end, _ = case
    assert_trees_all_close(sub(*inputs_for(zoo, start)), expected_for(zoo, end))


def test_slice_reproduces_recorded_output_under_jit(case):
    zoo, sub, start, end, _ = case
    out = jax.jit(lambda *a: sub(*a))(*inputs_for(zoo, start))
    assert_trees_all_close(out, expected_for(zoo, end))


def test_apply_with_own_variables_equals_call(case):
    zoo, sub, start, end, _ = case
    inputs = inputs_for(zoo, start)
    assert_trees_all_close(sub.apply(sub.variables, *inputs), sub(*inputs), atol=0, rtol=0)


def test_slice_variables_hold_exactly_its_modules_as_original_objects(case):
    zoo, sub, _, _, modules = case
    assert_variables_are_subset_of(sub.variables, zoo.variables, modules)


def test_apply_uses_the_variables_it_is_given(case):
    zoo, sub, start, end, modules = case
    if not modules:
        assert not jax.tree_util.tree_leaves(sub.variables)
        return
    # NumPy arithmetic: an eager jnp op per leaf shape would compile once per shape.
    doubled = jax.tree_util.tree_map(lambda v: jnp.asarray(np.asarray(v) * 2.0), sub.variables)
    inputs = inputs_for(zoo, start)
    # Run the full model with the same doubled leaves (and everything else unchanged).
    flat_sub = dict(jax.tree_util.tree_flatten_with_path(doubled)[0])
    full = jax.tree_util.tree_map_with_path(lambda p, v: flat_sub.get(p, v), zoo.variables)
    reference = Zoo(zoo.model, full, zoo.x, record_calls(zoo.model, full, zoo.x), {})
    if start is not None:
        # Same slice inputs as recorded under the original variables would differ; feed the
        # inputs recorded under the doubled variables so both sides see the same values.
        inputs = inputs_for(reference, start)
    assert_trees_all_close(
        sub.apply(doubled, *inputs), expected_for(reference, end), atol=1e-4, rtol=1e-4
    )


VMAP_CASES = [
    c for c in CASES if c[0] in ("resnet", "shared_zoo", "tuple_zoo") and c[1] is not None
][::3]


@pytest.mark.parametrize(
    "zoo_name, start, end, _", VMAP_CASES, ids=[_case_id(c) for c in VMAP_CASES]
)
def test_slice_under_vmap_equals_slice_per_example(request, zoo_name, start, end, _):
    zoo = request.getfixturevalue(zoo_name)
    sub = js.slice(zoo.model, zoo.variables, zoo.x, start=start, end=end)
    inputs = inputs_for(zoo, start)
    halves = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a) * 0.5), inputs)
    stacked = jax.tree_util.tree_map(lambda a, b: jnp.asarray(np.stack([a, b])), inputs, halves)
    out = jax.vmap(lambda *a: sub(*a))(*stacked)
    expected = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), sub(*inputs), sub(*halves))
    assert_trees_all_close(out, expected)
    assert_trees_all_close(jax.tree_util.tree_map(lambda a: a[0], out), expected_for(zoo, end))


def _capture_loss(zoo, name: str, k: int):
    """Sum of the k-th recorded output of `name`, as a function of all the variables."""
    base, _, method = name.partition(".")

    def loss(variables):
        _, state = zoo.model.apply(
            variables, zoo.x, capture_intermediates=lambda m, n: True, mutable=["intermediates"]
        )
        node = state["intermediates"]
        for part in base.split("/"):
            node = node[part]
        return sum(
            jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(node[method or "__call__"][k])
        )

    return loss


@pytest.mark.parametrize(
    "zoo_name, end, k",
    [
        ("resnet", "stage1/bn2", 0),
        ("shared_zoo", "shared@0", 0),
        ("shared_zoo", "shared@1", 1),
        ("tuple_zoo", "pair", 0),
        ("method_zoo", "ae.encode", 0),
    ],
)
def test_grad_of_prefix_slice_equals_grad_through_capture_intermediates(request, zoo_name, end, k):
    zoo = request.getfixturevalue(zoo_name)
    sub = js.slice(zoo.model, zoo.variables, zoo.x, end=end)

    def sub_loss(variables):
        return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(sub.apply(variables, zoo.x)))

    got = jax.jit(jax.grad(sub_loss))(sub.variables)
    full = jax.jit(jax.grad(_capture_loss(zoo, end.partition("@")[0], k)))(zoo.variables)
    got_flat = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    for path, g in jax.tree_util.tree_flatten_with_path(full)[0]:
        if path in got_flat:
            np.testing.assert_allclose(got_flat[path], g, atol=1e-4, rtol=1e-4, err_msg=str(path))
        elif path[0].key == "params":
            # Parameters outside the slice do not influence its output.
            np.testing.assert_array_equal(g, np.zeros_like(g), err_msg=str(path))
    assert got_flat, "the slice has parameters to differentiate"


# --------------------------------------------------------------------------- oracle sanity


@pytest.mark.parametrize(
    "zoo_name",
    ["resnet", "identity_zoo", "tuple_zoo", "unused_zoo", "shared_zoo", "skip_zoo", "method_zoo"],
)
def test_recorded_calls_agree_with_capture_intermediates(request, zoo_name):
    zoo = request.getfixturevalue(zoo_name)
    for name, calls in zoo.calls.items():
        assert_trees_all_close(tuple(c[2] for c in calls), zoo.intermediates[name])


# --------------------------------------------------------------------------- prefixes


@pytest.mark.parametrize("end", ["stem", "stage1/bn1", "stage1", "stage2/proj", "stage2", "head"])
def test_prefix_slice_matches_capture_intermediates(resnet, end):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, end=end)
    (expected,) = resnet.intermediates[end]
    assert_trees_all_close(sub(resnet.x), expected)
    assert_trees_all_close(jax.jit(lambda x: sub(x))(resnet.x), expected)


@pytest.mark.parametrize(
    "zoo_name, end, k",
    [
        ("identity_zoo", "ident", 0),
        ("tuple_zoo", "pair", 0),
        ("unused_zoo", "probe", 0),
        ("shared_zoo", "shared@0", 0),
        ("shared_zoo", "shared@1", 1),
        ("skip_zoo", "dec", 0),
        ("method_zoo", "ae.encode", 0),
        ("method_zoo", "ae.decode", 0),
    ],
)
def test_prefix_slice_of_zoo_matches_capture_intermediates(request, zoo_name, end, k):
    zoo = request.getfixturevalue(zoo_name)
    sub = js.slice(zoo.model, zoo.variables, zoo.x, end=end)
    expected = zoo.intermediates[end.partition("@")[0]][k]
    assert_trees_all_close(sub(zoo.x), expected)


def test_whole_model_slice_matches_apply(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x)
    assert_trees_all_close(sub(resnet.x), resnet.apply(resnet.variables, resnet.x))
    assert_variables_are_subset_of(sub.variables, resnet.variables, set(RESNET_NAMES))


def test_suffix_slice_to_model_output(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage2", end=None)
    (feat,) = resnet.args_of("stage2")
    assert_trees_all_close(sub(feat), resnet.apply(resnet.variables, resnet.x))


# --------------------------------------------------------------------------- ResNet specifics


def test_resnet_boundaries_are_every_module_call_in_order(resnet):
    table = js.boundaries(resnet.model, resnet.variables, resnet.x)
    assert [b.name for b in table] == RESNET_NAMES
    by_name = {b.name: b for b in table}
    stem = by_name["stem"]
    assert stem.module_type == "Conv"
    assert (stem.call_index, stem.num_calls) == (0, 1)
    assert stem.inputs == (jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32),)
    assert stem.outputs == (jax.ShapeDtypeStruct((2, 8, 8, 4), jnp.float32),)
    assert stem.param_count == 3 * 3 * 3 * 4 + 4
    assert by_name["stage2/bn1"].module_type == "BatchNorm"
    assert by_name["stage2/bn1"].param_count == 2 * 8  # scale and bias; batch_stats are not params
    assert by_name["head"].inputs == (jax.ShapeDtypeStruct((2, 8), jnp.float32),)
    assert by_name["stage2"].param_count == sum(
        x.size for x in jax.tree_util.tree_leaves(resnet.variables["params"]["stage2"])
    )
    text = str(table)
    for name in RESNET_NAMES:
        assert name in text
    assert "BatchNorm" in text and "ResBlock" in text
    assert "float32[2, 8, 8, 3]" in text


def test_resnet_slice_keeps_batch_stats_of_its_modules(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage2", end="head")
    assert set(sub.variables) == {"params", "batch_stats"}
    assert set(sub.variables["params"]) == {"stage2", "head"}
    assert set(sub.variables["batch_stats"]) == {"stage2"}
    assert set(sub.variables["params"]["stage2"]) == {"conv1", "bn1", "conv2", "bn2", "proj"}
    assert set(sub.variables["batch_stats"]["stage2"]) == {"bn1", "bn2"}


def test_batchnorm_slice_matches_hand_written_eval_math(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage1/bn1", end="stage1/bn1")
    (x,) = resnet.args_of("stage1/bn1")
    p = resnet.variables["params"]["stage1"]["bn1"]
    s = resnet.variables["batch_stats"]["stage1"]["bn1"]
    x, mean, var = np.asarray(x), np.asarray(s["mean"]), np.asarray(s["var"])
    expected = (x - mean) / np.sqrt(var + 1e-5) * np.asarray(p["scale"]) + np.asarray(p["bias"])
    assert_trees_all_close(sub(jnp.asarray(x)), expected.astype(np.float32))


def test_conv_slice_matches_eager_apply_of_the_submodule(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stem", end="stem")
    expected = nn.Conv(4, (3, 3)).apply({"params": resnet.variables["params"]["stem"]}, resnet.x)
    assert_trees_all_close(sub(resnet.x), expected)


def test_head_slice_matches_hand_written_dense(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="head")
    (feat,) = resnet.args_of("head")
    p = resnet.variables["params"]["head"]
    expected = np.asarray(feat) @ np.asarray(p["kernel"]) + np.asarray(p["bias"])
    assert_trees_all_close(sub(feat), expected)


def test_residual_stage_matches_hand_written_composition(resnet):
    """stage2 = relu(proj(x) + bn2(conv2(relu(bn1(conv1(x)))))), from eager submodule applies."""
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage2", end="stage2")
    (x,) = resnet.args_of("stage2")
    p, s = resnet.variables["params"]["stage2"], resnet.variables["batch_stats"]["stage2"]

    def conv(name, kernel, h):
        return nn.Conv(8, kernel).apply({"params": p[name]}, h)

    def bn(name, h):
        return nn.BatchNorm(use_running_average=True).apply(
            {"params": p[name], "batch_stats": s[name]}, h
        )

    @jax.jit  # one compilation instead of one per eager op
    def reference(x):
        y = bn("bn2", conv("conv2", (3, 3), nn.relu(bn("bn1", conv("conv1", (3, 3), x)))))
        return nn.relu(conv("proj", (1, 1), x) + y)

    expected = reference(x)
    assert_trees_all_close(sub(x), expected)


# --------------------------------------------------------------------------- identity


def test_identity_module_is_a_boundary_and_returns_its_input(identity_zoo):
    by_name = {
        b.name: b for b in js.boundaries(identity_zoo.model, identity_zoo.variables, identity_zoo.x)
    }
    assert by_name["ident"].param_count == 0
    assert by_name["ident"].module_type == "Identity"
    sub = js.slice(
        identity_zoo.model, identity_zoo.variables, identity_zoo.x, start="ident", end="ident"
    )
    h = jnp.arange(8.0, dtype=jnp.float32).reshape(2, 4)
    assert_trees_all_close(sub(h), h, atol=0, rtol=0)
    assert sub.variables in ({}, None) or not jax.tree_util.tree_leaves(sub.variables)


def test_slice_ending_at_identity_equals_previous_module_output(identity_zoo):
    sub = js.slice(identity_zoo.model, identity_zoo.variables, identity_zoo.x, end="ident")
    assert_trees_all_close(sub(identity_zoo.x), identity_zoo.intermediates["stem"][0])


# --------------------------------------------------------------------------- tuples


def test_slice_ending_at_tuple_module_returns_the_tuple(tuple_zoo):
    sub = js.slice(tuple_zoo.model, tuple_zoo.variables, tuple_zoo.x, end="pair")
    out = sub(tuple_zoo.x)
    assert isinstance(out, tuple) and len(out) == 2
    assert_trees_all_close(out, tuple_zoo.intermediates["pair"][0])
    a, b = out
    assert not np.allclose(a, b)


def test_slice_from_tuple_output_port_takes_the_whole_tuple(tuple_zoo):
    sub = js.slice(
        tuple_zoo.model, tuple_zoo.variables, tuple_zoo.x, start="pair:output", end="head"
    )
    a = jnp.ones((2, 4), jnp.float32)
    b = jnp.full((2, 4), 0.5, jnp.float32)
    p = tuple_zoo.variables["params"]["head"]
    expected = np.asarray(a * b + a) @ np.asarray(p["kernel"]) + np.asarray(p["bias"])
    assert_trees_all_close(sub((a, b)), expected)


def test_end_list_gives_tuple_and_end_dict_gives_dict(tuple_zoo):
    z = tuple_zoo
    sub = js.slice(z.model, z.variables, z.x, end=["head", "stem"])
    out = sub(z.x)
    assert isinstance(out, tuple)
    assert_trees_all_close(out, (z.out_of("head"), z.out_of("stem")))
    sub = js.slice(z.model, z.variables, z.x, end={"h": "head", "s": "stem"})
    out = sub(z.x)
    assert isinstance(out, dict)
    assert_trees_all_close(out, {"h": z.out_of("head"), "s": z.out_of("stem")})


# --------------------------------------------------------------------------- unused output


def test_unused_module_is_listed(unused_zoo):
    names = [b.name for b in js.boundaries(unused_zoo.model, unused_zoo.variables, unused_zoo.x)]
    assert names == ["stem", "probe", "head"]


def test_slices_that_do_not_need_the_unused_module_do_not_own_it(unused_zoo):
    z = unused_zoo
    sub = js.slice(z.model, z.variables, z.x)
    assert "probe" not in sub.variables["params"]
    assert_variables_are_subset_of(sub.variables, z.variables, {"stem", "head"})
    assert_trees_all_close(sub(z.x), z.apply(z.variables, z.x))


def test_prefix_slice_at_unused_module(unused_zoo):
    z = unused_zoo
    sub = js.slice(z.model, z.variables, z.x, end="probe")
    assert_trees_all_close(sub(z.x), z.intermediates["probe"][0])
    assert_variables_are_subset_of(sub.variables, z.variables, {"stem", "probe"})


# --------------------------------------------------------------------------- shared module


def test_shared_module_calls_are_listed_with_indices(shared_zoo):
    table = js.boundaries(shared_zoo.model, shared_zoo.variables, shared_zoo.x)
    assert [b.name for b in table] == ["stem", "shared@0", "shared@1", "head"]
    by_name = {b.name: b for b in table}
    assert (by_name["shared@0"].call_index, by_name["shared@0"].num_calls) == (0, 2)
    assert (by_name["shared@1"].call_index, by_name["shared@1"].num_calls) == (1, 2)


def test_each_call_of_a_shared_module_gives_its_own_values(shared_zoo):
    z = shared_zoo
    first = js.slice(z.model, z.variables, z.x, end="shared@0")(z.x)
    second = js.slice(z.model, z.variables, z.x, end="shared@1")(z.x)
    assert_trees_all_close(first, z.intermediates["shared"][0])
    assert_trees_all_close(second, z.intermediates["shared"][1])
    assert not np.allclose(first, second)


def test_bare_name_of_shared_module_is_ambiguous(shared_zoo):
    z = shared_zoo
    with pytest.raises(js.AmbiguousBoundaryError):
        js.slice(z.model, z.variables, z.x, end="shared")


# --------------------------------------------------------------------------- skip connection


def test_slice_needing_a_skip_connection_asks_for_it(skip_zoo):
    z = skip_zoo
    with pytest.raises(js.MissingInputError, match="enc1"):
        js.slice(z.model, z.variables, z.x, start="enc2", end="dec")


def test_skip_connection_added_to_start_matches_oracle(skip_zoo):
    z = skip_zoo
    sub = js.slice(z.model, z.variables, z.x, start=["enc2", "enc1:output"], end="head")
    (enc2_in,) = z.args_of("enc2")
    assert_trees_all_close(sub(enc2_in, z.out_of("enc1")), z.apply(z.variables, z.x))


def test_slice_from_two_argument_module(skip_zoo):
    z = skip_zoo
    sub = js.slice(z.model, z.variables, z.x, start="dec", end="dec")
    h, skip = z.args_of("dec")
    p = z.variables["params"]["dec"]["fc"]
    expected = np.concatenate([h, skip], axis=-1) @ np.asarray(p["kernel"]) + np.asarray(p["bias"])
    assert_trees_all_close(sub(h, skip), expected)


# --------------------------------------------------------------------------- methods


def test_method_boundaries_are_named_path_dot_method(method_zoo):
    names = [b.name for b in js.boundaries(method_zoo.model, method_zoo.variables, method_zoo.x)]
    assert "ae.encode" in names and "ae.decode" in names
    assert "ae/enc" in names and "ae/dec" in names
    assert "ae" not in names  # ae.__call__ is never called


def test_method_slice_matches_eager_method_apply(method_zoo):
    z = method_zoo
    ae_vars = {"params": z.variables["params"]["ae"]}
    encode = jax.jit(nn.apply(lambda m, x: m.encode(x), AutoEncoder()))
    decode = jax.jit(nn.apply(lambda m, x: m.decode(x), AutoEncoder()))
    sub = js.slice(z.model, z.variables, z.x, start="ae.encode", end="ae.encode")
    assert_trees_all_close(sub(z.x), encode(ae_vars, z.x))
    sub = js.slice(z.model, z.variables, z.x, start="ae.decode", end="ae.decode")
    zz = jnp.asarray(np.linspace(-1, 1, 6).reshape(2, 3), jnp.float32)
    assert_trees_all_close(sub(zz), decode(ae_vars, zz))


# --------------------------------------------------------------------------- parameters as arguments


class TakesWeight(nn.Module):
    @nn.compact
    def __call__(self, x, w):
        return jnp.tanh(x @ w)


class PassesWeight(nn.Module):
    """The parent hands one of its own parameters to a child as an argument."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (4, 3))
        return TakesWeight(name="child")(x, w) * 2.0


def test_parameter_passed_as_argument_is_not_a_slice_input():
    model = PassesWeight()
    x = random_input(31, (2, 4))
    variables = random_variables(model, x, seed=31)
    (child,) = js.boundaries(model, variables, x)
    assert child.name == "child"
    assert child.inputs == (jax.ShapeDtypeStruct((2, 4), jnp.float32),)
    sub = js.slice(model, variables, x, start="child", end="child")
    w = variables["params"]["w"]
    assert_trees_all_close(sub(x), np.tanh(np.asarray(x) @ np.asarray(w)))
    assert sub.variables["params"]["w"] is w


class Unrolled(nn.Module):
    """One Dense applied three times in a Python loop."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(4, name="d")
        for _ in range(3):
            x = jnp.tanh(dense(x))
        return x


def test_module_called_three_times_in_a_python_loop():
    model = Unrolled()
    x = random_input(32, (2, 4))
    variables = random_variables(model, x, seed=32)
    calls = record_calls(model, variables, x)
    assert [b.name for b in js.boundaries(model, variables, x)] == ["d@0", "d@1", "d@2"]
    sub = js.slice(model, variables, x, start="d@1", end="d@2")
    (d1_in,) = calls["d"][1][0]
    assert_trees_all_close(sub(d1_in), calls["d"][2][2])
    sub = js.slice(model, variables, x, start="d@2:output", end=None)
    t = jnp.asarray(np.linspace(-2, 2, 8).reshape(2, 4), jnp.float32)
    assert_trees_all_close(sub(t), np.tanh(np.asarray(t)))


class PosBlock(nn.Module):
    """A block passed the model's own position input, as Griffin passes `segment_pos`."""

    @nn.compact
    def __call__(self, h, pos):
        return h + jnp.tanh(nn.Dense(h.shape[-1], name="dense")(h) * pos[..., None])


class PosNet(nn.Module):
    @nn.compact
    def __call__(self, x, pos):
        h = nn.Dense(6, name="embed")(x)
        for i in range(3):
            h = PosBlock(name=f"blocks_{i}")(h, pos)
        return nn.Dense(2, name="head")(h)


def _pos_net():
    model = PosNet()
    x = random_input(40, (2, 5, 3))
    pos = jnp.broadcast_to(jnp.arange(5.0) * 0.3, (2, 5))
    return model, random_variables(model, x, pos, seed=40), x, pos


@pytest.mark.parametrize("end", [None, "blocks_2"])
def test_a_block_passed_a_model_input_starts_with_the_model_inputs(end):
    """``start=[block, None]``: the block's arguments that are the model's inputs come
    from the model's inputs (given once), the rest is the block's own input."""
    model, variables, x, pos = _pos_net()
    sub = js.slice(model, variables, x, pos, start=["blocks_1", None], end=end)
    calls = record_calls(model, variables, x, pos)
    (h1, _), _, _ = calls["blocks_1"][0]
    want = model.apply(variables, x, pos) if end is None else calls["blocks_2"][0][2]
    assert_trees_all_close(sub(h1, x, pos), want)
    # The block's input is the one given (not computed from x), `pos` the model's input.
    h, pos2 = jnp.tanh(h1 * 3.0), pos[:, ::-1]
    p = variables["params"]
    for name in ("blocks_1", "blocks_2"):
        h = PosBlock().apply({"params": p[name]}, h, pos2)
    if end is None:
        h = nn.Dense(2).apply({"params": p["head"]}, h)
    assert_trees_all_close(sub(jnp.tanh(h1 * 3.0), x, pos2), h)


def test_a_named_start_whose_values_derive_from_the_inputs_is_taken_not_dropped():
    """With the model's inputs among the starts, values derived from them outside any
    module are computed again; a named start made only of such values is still taken."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return {"y": nn.Dense(3, name="dense")(jnp.tanh(x)), "x": x}

    model, x = Net(), jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    variables = model.init(jax.random.key(0), x)
    sub = js.slice(model, variables, x, start=["dense", None])
    h = jnp.ones((2, 4))  # not tanh(x): the given value is what the slice uses
    got = sub(h, x)
    p = variables["params"]["dense"]
    np.testing.assert_allclose(got["y"], h @ p["kernel"] + p["bias"], rtol=1e-6)
    np.testing.assert_allclose(got["x"], x)
