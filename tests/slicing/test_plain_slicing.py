"""Slicing plain JAX functions ``fn(params, *inputs)``.

Boundaries come from `js.mark`ed functions and `jax.named_scope` regions. The oracle is
hand-written NumPy math for each piece of the model. Marked functions inside `jax.jit`,
`jax.checkpoint`, `jax.custom_jvp` and `jax.custom_vjp` can still be sliced at.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import assert_trees_all_close, assert_variables_are_subset_of, random_input

RNG = np.random.default_rng(7)


def _dense_params(n_in: int, n_out: int) -> dict[str, jax.Array]:
    return {
        "w": jnp.asarray(RNG.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
        "b": jnp.asarray(RNG.normal(size=(n_out,)) * 0.5, jnp.float32),
    }


def dense(p, x):
    return x @ p["w"] + p["b"]


def np_dense(p, x):
    return np.asarray(x, np.float64) @ np.asarray(p["w"], np.float64) + np.asarray(
        p["b"], np.float64
    )


def close(actual, expected):
    assert_trees_all_close(actual, np.asarray(expected, np.float32))


# --------------------------------------------------------------------------- js.mark MLP

layer1 = js.mark("layer1", dense)
layer2 = js.mark("layer2", dense)
head = js.mark("head", dense)


def mlp(params, x):
    h = jnp.tanh(layer1(params["l1"], x))
    h = jax.nn.relu(layer2(params["l2"], h)) + h  # residual add between boundaries
    return head(params["head"], h)


MLP_PARAMS = {"l1": _dense_params(3, 4), "l2": _dense_params(4, 4), "head": _dense_params(4, 2)}
X = random_input(11, (2, 3))


def ref_layer1(x):
    return np.tanh(np_dense(MLP_PARAMS["l1"], x))


def ref_block2(h):
    return np.maximum(np_dense(MLP_PARAMS["l2"], h), 0.0) + np.asarray(h, np.float64)


def ref_head(h):
    return np_dense(MLP_PARAMS["head"], h)


def ref_mlp(x):
    return ref_head(ref_block2(ref_layer1(x)))


H = jnp.asarray(ref_layer1(X), jnp.float32)  # layer2's input
H2 = jnp.asarray(ref_block2(H), jnp.float32)  # head's input


def test_marked_functions_are_boundaries():
    table = js.boundaries(mlp, MLP_PARAMS, X)
    assert [b.name for b in table] == ["layer1", "layer2", "head"]
    by_name = {b.name: b for b in table}
    assert by_name["layer1"].inputs == (jax.ShapeDtypeStruct((2, 3), jnp.float32),)
    assert by_name["layer1"].outputs == (jax.ShapeDtypeStruct((2, 4), jnp.float32),)
    assert by_name["head"].outputs == (jax.ShapeDtypeStruct((2, 2), jnp.float32),)
    assert by_name["layer2"].param_count == 4 * 4 + 4
    assert "layer2" in str(table)


def test_marked_model_runs_unchanged_outside_jaxslice():
    close(mlp(MLP_PARAMS, X), ref_mlp(X))
    close(jax.jit(mlp)(MLP_PARAMS, X), ref_mlp(X))


@pytest.mark.parametrize(
    "start, end, inputs, expected, modules",
    [
        (None, "layer1", (X,), lambda: np_dense(MLP_PARAMS["l1"], X), {"l1"}),
        (None, "layer2", (X,), lambda: np_dense(MLP_PARAMS["l2"], H), {"l1", "l2"}),
        (None, None, (X,), lambda: ref_mlp(X), {"l1", "l2", "head"}),
        ("layer2", "layer2", (H,), lambda: np_dense(MLP_PARAMS["l2"], H), {"l2"}),
        ("layer2", None, (H,), lambda: ref_head(ref_block2(H)), {"l2", "head"}),
        ("layer2", "head:input", (H,), lambda: ref_block2(H), {"l2"}),
        ("head", "head", (H2,), lambda: ref_head(H2), {"head"}),
        ("layer1", "head", (X,), lambda: ref_mlp(X), {"l1", "l2", "head"}),
        ("layer1:output", "layer2:input", (H,), lambda: np.tanh(np.asarray(H, np.float64)), set()),
    ],
)
def test_mlp_slice_matches_reference_math(start, end, inputs, expected, modules):
    sub = js.slice(mlp, MLP_PARAMS, X, start=start, end=end)
    close(sub(*inputs), expected())
    close(jax.jit(lambda *a: sub(*a))(*inputs), expected())
    # Parameters are keyed as in the params dict; modules here are its top-level keys.
    assert_variables_are_subset_of({"p": sub.variables or {}}, {"p": MLP_PARAMS}, modules)


def test_plain_slice_variables_are_the_original_arrays():
    sub = js.slice(mlp, MLP_PARAMS, X, start="layer2", end="head")
    assert set(sub.variables) == {"l2", "head"}
    assert sub.variables["l2"]["w"] is MLP_PARAMS["l2"]["w"]
    assert sub.variables["head"]["b"] is MLP_PARAMS["head"]["b"]


def test_plain_slice_apply_with_new_params():
    sub = js.slice(mlp, MLP_PARAMS, X, start="head", end="head")
    new = {"head": {"w": jnp.ones((4, 2), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}}
    close(sub.apply(new, H2), np.asarray(H2, np.float64) @ np.ones((4, 2)))


# --------------------------------------------------------------------------- named_scope


def scoped(params, x):
    with jax.named_scope("enc"):
        h = jnp.tanh(dense(params["enc"], x))
    with jax.named_scope("dec"):
        y = dense(params["dec"], h)
    return jax.nn.sigmoid(y)


SCOPED_PARAMS = {"enc": _dense_params(3, 4), "dec": _dense_params(4, 2)}


def test_named_scopes_are_boundaries():
    table = js.boundaries(scoped, SCOPED_PARAMS, X)
    assert [b.name for b in table] == ["enc", "dec"]
    assert table[0].inputs == (jax.ShapeDtypeStruct((2, 3), jnp.float32),)
    assert table[0].outputs == (jax.ShapeDtypeStruct((2, 4), jnp.float32),)
    assert table[1].outputs == (jax.ShapeDtypeStruct((2, 2), jnp.float32),)


def test_named_scope_slices_match_reference_math():
    h = np.tanh(np_dense(SCOPED_PARAMS["enc"], X))
    hj = jnp.asarray(h, jnp.float32)
    close(js.slice(scoped, SCOPED_PARAMS, X, end="enc")(X), h)
    sub = js.slice(scoped, SCOPED_PARAMS, X, start="dec", end="dec")
    close(sub(hj), np_dense(SCOPED_PARAMS["dec"], hj))
    assert set(sub.variables) == {"dec"}
    sub = js.slice(scoped, SCOPED_PARAMS, X, start="dec", end=None)
    close(sub(hj), 1 / (1 + np.exp(-np_dense(SCOPED_PARAMS["dec"], hj))))


def nested_scopes(params, x):
    with jax.named_scope("block"):
        with jax.named_scope("inner"):
            h = jnp.sin(dense(params, x))
        h = h * 2.0
    return h + 1.0


def test_nested_named_scopes_give_slash_names():
    p = _dense_params(3, 4)
    names = [b.name for b in js.boundaries(nested_scopes, p, X)]
    assert names == ["block", "block/inner"]
    sub = js.slice(nested_scopes, p, X, end="block/inner")
    close(sub(X), np.sin(np_dense(p, X)))
    sub = js.slice(nested_scopes, p, X, end="block")
    close(sub(X), 2 * np.sin(np_dense(p, X)))


# --------------------------------------------------------------------------- nested marks


@js.mark("inner")
def inner_fn(p, x):
    return jnp.tanh(dense(p, x))


@js.mark("outer")
def outer_fn(p, x):
    return inner_fn(p, x) * 3.0


def nested_marks(params, x):
    return outer_fn(params, x) - 1.0


def test_nested_marks_give_outer_slash_inner_names():
    p = _dense_params(3, 4)
    table = js.boundaries(nested_marks, p, X)
    assert [b.name for b in table] == ["outer", "outer/inner"]
    assert table[1].module_type == "inner_fn"
    sub = js.slice(nested_marks, p, X, start="outer/inner", end="outer/inner")
    close(sub(X), np.tanh(np_dense(p, X)))
    sub = js.slice(nested_marks, p, X, start="outer/inner:output", end=None)
    t = jnp.full((2, 4), 0.25, jnp.float32)
    close(sub(t), np.full((2, 4), 0.25 * 3.0 - 1.0))


def test_mark_inside_a_named_scope_is_prefixed_by_the_scope():
    p = _dense_params(3, 4)

    def model(params, x):
        with jax.named_scope("encoder"):
            return inner_fn(params, x) + 1.0

    names = [b.name for b in js.boundaries(model, p, X)]
    assert "encoder/inner" in names
    sub = js.slice(model, p, X, end="encoder/inner")
    close(sub(X), np.tanh(np_dense(p, X)))


# --------------------------------------------------------------------------- higher-order regions

mark_a = js.mark("a", dense)
mark_b = js.mark("b", dense)


@jax.custom_jvp
def sin2(h):
    return js.mark("cj", jnp.sin)(h) * 2.0


@sin2.defjvp
def _sin2_jvp(primals, tangents):
    (h,), (t,) = primals, tangents
    return sin2(h), t * 100.0  # deliberately not the true derivative


@jax.custom_vjp
def cos1(h):
    return js.mark("cv", jnp.cos)(h) + 1.0


def _cos1_fwd(h):
    return cos1(h), None


def _cos1_bwd(_, ct):
    return (ct * 7.0,)  # deliberately not the true derivative


cos1.defvjp(_cos1_fwd, _cos1_bwd)


def hop_model(params, x):
    h = jax.jit(mark_a)(params["a"], x)
    h = jax.checkpoint(mark_b)(params["b"], jnp.tanh(h))
    h = sin2(h)
    return cos1(h) * 0.5


HOP_PARAMS = {"a": _dense_params(3, 4), "b": _dense_params(4, 4)}


def ref_hop_pieces(x):
    a = np_dense(HOP_PARAMS["a"], x)
    b = np_dense(HOP_PARAMS["b"], np.tanh(a))
    cj = np.sin(b)
    cv = np.cos(cj * 2.0)
    return {"a": a, "b": b, "cj": cj, "cv": cv, "out": (cv + 1.0) * 0.5}


def test_boundaries_inside_jit_checkpoint_custom_jvp_and_custom_vjp_are_listed():
    names = [b.name for b in js.boundaries(hop_model, HOP_PARAMS, X)]
    assert names == ["a", "b", "cj", "cv"]


@pytest.mark.parametrize("name", ["a", "b", "cj", "cv"])
def test_prefix_slice_ending_inside_a_higher_order_region(name):
    sub = js.slice(hop_model, HOP_PARAMS, X, end=name)
    close(sub(X), ref_hop_pieces(X)[name])
    close(jax.jit(lambda x: sub(x))(X), ref_hop_pieces(X)[name])


def test_slice_of_one_boundary_inside_each_region():
    ref = ref_hop_pieces(X)
    h_a = jnp.tanh(jnp.asarray(ref["a"], jnp.float32))
    sub = js.slice(hop_model, HOP_PARAMS, X, start="a", end="a")
    close(sub(X), ref["a"])
    sub = js.slice(hop_model, HOP_PARAMS, X, start="b", end="b")
    close(sub(h_a), np_dense(HOP_PARAMS["b"], h_a))
    t = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)
    sub = js.slice(hop_model, HOP_PARAMS, X, start="cj", end="cj")
    close(sub(t), np.sin(np.asarray(t, np.float64)))
    sub = js.slice(hop_model, HOP_PARAMS, X, start="cv", end="cv")
    close(sub(t), np.cos(np.asarray(t, np.float64)))


def test_suffix_slice_starting_inside_a_higher_order_region():
    t = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)
    tt = np.asarray(t, np.float64)
    sub = js.slice(hop_model, HOP_PARAMS, X, start="cj", end=None)
    close(sub(t), (np.cos(np.sin(tt) * 2.0) + 1.0) * 0.5)
    sub = js.slice(hop_model, HOP_PARAMS, X, start="b", end="cv")
    close(sub(t), np.cos(np.sin(np_dense(HOP_PARAMS["b"], tt)) * 2.0))


def test_whole_model_slice_through_regions_matches_model():
    sub = js.slice(hop_model, HOP_PARAMS, X)
    close(sub(X), ref_hop_pieces(X)["out"])
    # (Not compared with a direct `hop_model` call: that would fill JAX's jit cache with
    # an unmarked trace of `mark_a`; see test_mark_inside_jit_that_already_ran_outside_jaxslice.)


def _custom_jvp_model(params, x):
    return sin2(dense(params, x)).sum()


def _custom_vjp_model(params, x):
    return cos1(dense(params, x)).sum()


@pytest.mark.parametrize(
    "model", [_custom_jvp_model, _custom_vjp_model], ids=["custom_jvp", "custom_vjp"]
)
def test_slice_containing_a_whole_custom_derivative_region_keeps_its_rule(model):
    """The model's own derivative rule must survive slicing when the slice holds the
    whole `custom_jvp`/`custom_vjp` call (here: the whole model)."""
    p = _dense_params(3, 4)
    sub = js.slice(model, p, X)
    expected = jax.grad(model)(p, X)
    assert_trees_all_close(jax.grad(lambda q: sub.apply(q, X))(p), expected)


def test_mark_inside_jit_that_already_ran_outside_jaxslice():
    """A jitted function that was already compiled by an ordinary call (JAX's jit cache
    holds a trace without markers) must still show its boundary."""
    inner = js.mark("cached", lambda p, x: jnp.tanh(dense(p, x)))
    jitted = jax.jit(inner)

    def model(params, x):
        return jitted(params, x) * 2.0

    p = _dense_params(3, 4)
    model(p, X)  # the user runs the model once before slicing it
    assert [b.name for b in js.boundaries(model, p, X)] == ["cached"]
    sub = js.slice(model, p, X, end="cached")
    close(sub(X), np.tanh(np_dense(p, X)))


@jax.custom_jvp
def _inner_mark_region(h):
    z = js.mark("m", jnp.sin)(h * 3.0)  # the boundary's input is not the region's input
    return js.mark("after", lambda z: z * 2.0)(z) + h


_inner_mark_region.defjvp(
    lambda primals, tangents: (_inner_mark_region(*primals), tangents[0] * 100.0)
)


def _region_model(p, x):
    return jnp.cos(_inner_mark_region(x * p))


def test_slice_cutting_through_the_middle_of_a_custom_jvp_region():
    p = jnp.float32(0.5)
    h = np.asarray(X, np.float64) * 0.5
    t = jnp.asarray(np.linspace(-1.0, 1.0, 6).reshape(2, 3), jnp.float32)
    tt = np.asarray(t, np.float64)
    close(js.slice(_region_model, p, X, end="m")(X), np.sin(h * 3.0))
    close(js.slice(_region_model, p, X, start="m", end="after")(t), 2.0 * np.sin(tt))
    close(js.slice(_region_model, p, X, start="m:output", end="after")(t), 2.0 * tt)
    close(
        js.slice(_region_model, p, X, start=["after", None], end=None)(t, X), np.cos(2.0 * tt + h)
    )
    whole = js.slice(_region_model, p, X)
    close(whole(X), np.cos(2.0 * np.sin(h * 3.0) + h))
    # The whole region is in the slice, so its own derivative rule applies.
    assert_trees_all_close(
        jax.grad(lambda q: whole.apply(q, X).sum())(p),
        jax.grad(lambda q: _region_model(q, X).sum())(p),
    )
