"""Only the equations a slice needs are in its program, and no boundary markers are.

`sub.jaxpr` is the re-emitted program. It is compared with ``jax.make_jaxpr`` of the full
model (equation counts, counts of the heavy primitives) and, for a prefix, equation by
equation with a hand-written truncated model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import count_eqns, count_primitive, iter_eqns, random_input

MARKER_PRIMITIVE = "name"  # markers are `checkpoint_name` equations; none may survive


def full_jaxpr(zoo):
    return jax.make_jaxpr(zoo.model.apply)(zoo.variables, zoo.x)


def assert_no_markers(jaxpr):
    prims = {e.primitive.name for e in iter_eqns(jaxpr)}
    assert MARKER_PRIMITIVE not in prims, prims


# --------------------------------------------------------------------------- ResNet


def test_early_slice_is_much_smaller_than_the_full_model(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, end="stem")
    full = full_jaxpr(resnet)
    assert count_primitive(full, "conv_general_dilated") == 6
    assert count_primitive(sub.jaxpr, "conv_general_dilated") == 1
    assert count_eqns(sub.jaxpr) * 5 < count_eqns(full)
    assert count_primitive(sub.jaxpr, "dot_general") == 0  # the head is not computed
    assert_no_markers(sub.jaxpr)


@pytest.mark.parametrize(
    "start, end, convs, dots",
    [
        (None, "stage1", 3, 0),
        (None, "stage2/conv1", 4, 0),
        ("stage2", "stage2", 3, 0),
        ("stage2/proj", "stage2/proj", 1, 0),
        ("stage2", None, 3, 1),
        ("head", None, 0, 1),
        (None, None, 6, 1),
    ],
)
def test_resnet_slice_computes_only_its_convolutions(resnet, start, end, convs, dots):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start=start, end=end)
    assert count_primitive(sub.jaxpr, "conv_general_dilated") == convs
    assert count_primitive(sub.jaxpr, "dot_general") == dots
    assert_no_markers(sub.jaxpr)


def test_slice_equation_counts_grow_with_the_slice(resnet):
    counts = [
        count_eqns(js.slice(resnet.model, resnet.variables, resnet.x, end=end).jaxpr)
        for end in ["stem", "stage1", "stage2", "head"]
    ]
    assert counts == sorted(counts) and len(set(counts)) == 4
    assert counts[-1] <= count_eqns(full_jaxpr(resnet))


# --------------------------------------------------------------------------- zoo


def test_unused_module_is_not_computed_by_the_whole_model_slice(unused_zoo):
    z = unused_zoo
    assert count_primitive(full_jaxpr(z), "dot_general") == 3
    sub = js.slice(z.model, z.variables, z.x)
    assert count_primitive(sub.jaxpr, "dot_general") == 2
    assert_no_markers(sub.jaxpr)


def test_slice_of_an_unused_module_does_not_compute_the_head(unused_zoo):
    z = unused_zoo
    sub = js.slice(z.model, z.variables, z.x, end="probe")
    assert count_primitive(sub.jaxpr, "dot_general") == 2  # stem and probe
    # The probe's weights are read, the head's are not.
    shapes = {tuple(v.aval.shape) for v in sub.jaxpr.jaxpr.invars}
    assert (4, 5) in shapes and (4, 2) not in shapes


def test_identity_slice_has_no_equations(identity_zoo):
    z = identity_zoo
    sub = js.slice(z.model, z.variables, z.x, start="ident", end="ident")
    assert count_eqns(sub.jaxpr) == 0


def test_first_call_of_shared_module_does_not_compute_the_second(shared_zoo):
    z = shared_zoo
    sub = js.slice(z.model, z.variables, z.x, end="shared@0")
    assert count_primitive(sub.jaxpr, "dot_general") == 2
    assert count_primitive(sub.jaxpr, "tanh") == 0
    sub = js.slice(z.model, z.variables, z.x, start="shared@1", end="shared@1")
    assert count_primitive(sub.jaxpr, "dot_general") == 1


def test_skip_slice_does_not_recompute_the_skip_source(skip_zoo):
    z = skip_zoo
    sub = js.slice(z.model, z.variables, z.x, start=["enc2", "enc1:output"], end="dec")
    assert count_primitive(sub.jaxpr, "dot_general") == 2  # enc2 and dec/fc, not enc1
    assert count_primitive(sub.jaxpr, "max") == 0  # relu(enc1) is enc2's given input


def test_method_slice_computes_only_that_method(method_zoo):
    z = method_zoo
    sub = js.slice(z.model, z.variables, z.x, start="ae.encode", end="ae.encode")
    assert count_primitive(sub.jaxpr, "dot_general") == 1
    assert count_primitive(sub.jaxpr, "tanh") == 1


# --------------------------------------------------------------------------- plain functions


def _dense(p, x):
    return x @ p["w"] + p["b"]


_l1, _l2, _l3 = js.mark("l1", _dense), js.mark("l2", _dense), js.mark("l3", _dense)


def _mlp(params, x):
    h = jax.nn.relu(_l1(params["l1"], x))
    h = jax.nn.relu(_l2(params["l2"], h))
    return _l3(params["l3"], h)


def _params():
    rng = np.random.default_rng(3)
    return {
        k: {
            "w": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=4), jnp.float32),
        }
        for k in ("l1", "l2", "l3")
    }


def test_plain_prefix_slice_does_not_contain_later_dot_generals():
    params, x = _params(), random_input(0, (2, 4))
    assert count_primitive(jax.make_jaxpr(_mlp)(params, x), "dot_general") == 3
    assert count_primitive(js.slice(_mlp, params, x, end="l1").jaxpr, "dot_general") == 1
    assert count_primitive(js.slice(_mlp, params, x, end="l2").jaxpr, "dot_general") == 2
    assert (
        count_primitive(js.slice(_mlp, params, x, start="l2", end="l2").jaxpr, "dot_general") == 1
    )
    assert count_primitive(js.slice(_mlp, params, x, start="l3").jaxpr, "dot_general") == 1


def test_plain_prefix_slice_equals_hand_truncated_model_equation_by_equation():
    params, x = _params(), random_input(0, (2, 4))
    sub = js.slice(_mlp, params, x, end="l2")
    truncated = jax.make_jaxpr(lambda p, x: _dense(p["l2"], jax.nn.relu(_dense(p["l1"], x))))(
        params, x
    )
    got = [e.primitive.name for e in iter_eqns(sub.jaxpr)]
    want = [e.primitive.name for e in iter_eqns(truncated)]
    assert got == want
    assert_no_markers(sub.jaxpr)


def test_markers_of_the_traced_program_never_reach_the_slice():
    params, x = _params(), random_input(0, (2, 4))
    for start, end in [(None, None), ("l2", None), (None, "l1:output"), ("l1", "l3:input")]:
        assert_no_markers(js.slice(_mlp, params, x, start=start, end=end).jaxpr)
