"""Slicing models from other libraries through the plain-function path.

Libraries such as Keras 3 (JAX backend) and Haiku name their layers only with
`jax.named_scope` (Haiku through `jax.named_call`), so jaxslice sees their layers as
named-scope regions of ``fn(variables, *inputs)``. The first part needs only JAX: a
hand-written model in that "foreign" style, checked against hand-written NumPy math,
plus the documented limits of name-scope regions. The Keras and Haiku parts are skipped
where those libraries are not installed; their oracles are the libraries' own ways of
getting an intermediate output (a Keras sub-model or eager layer calls, Haiku's
`hk.intercept_methods`).

"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import keras_block_model
from helpers.oracles import assert_trees_all_close, import_keras, random_input

RNG = np.random.default_rng(2024)


def _linear_params(n_in: int, n_out: int) -> dict[str, jax.Array]:
    return {
        "w": jnp.asarray(RNG.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32),
        "b": jnp.asarray(RNG.normal(size=(n_out,)) * 0.5, jnp.float32),
    }


def np_linear(p, x):
    return np.asarray(x, np.float64) @ np.asarray(p["w"], np.float64) + np.asarray(
        p["b"], np.float64
    )


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def close(actual, expected):
    assert_trees_all_close(
        actual, jax.tree_util.tree_map(lambda e: np.asarray(e, np.float32), expected)
    )


def f32(x):
    return jnp.asarray(x, jnp.float32)


# --------------------------------------------------------------------------- foreign-style model


def linear(name, p, x):
    """A layer as Keras/Haiku-style code writes it: a helper that enters a named scope."""
    with jax.named_scope(name):
        return x @ p["w"] + p["b"]


def foreign(params, x):
    s = linear("stem", params["stem"], x)  # feeds two later layers: encoder and gate
    with jax.named_scope("encoder"):
        h = linear("fc1", params["encoder"]["fc1"], jax.nn.relu(s))  # relu inside encoder
        # An activation between nested scopes:
        h = linear("fc2", params["encoder"]["fc2"], jnp.tanh(h))
    with jax.named_scope("gate"):
        g = jax.nn.sigmoid(s @ params["gate"]["w"])
    # An activation and a product between scopes, in no region:
    return linear("head", params["head"], jax.nn.relu(h) * g)


P = {
    "stem": _linear_params(3, 4),
    "encoder": {"fc1": _linear_params(4, 5), "fc2": _linear_params(5, 4)},
    "gate": {"w": _linear_params(4, 4)["w"]},
    "head": _linear_params(4, 2),
}
X = random_input(31, (2, 3))


def ref_stem(x):
    return np_linear(P["stem"], x)


def ref_fc1_in(s):
    return np.maximum(np.asarray(s, np.float64), 0.0)


def ref_fc1(u):
    return np_linear(P["encoder"]["fc1"], u)


def ref_fc2(h1):
    return np_linear(P["encoder"]["fc2"], np.tanh(np.asarray(h1, np.float64)))


def ref_encoder(s):
    return ref_fc2(ref_fc1(ref_fc1_in(s)))


def ref_gate(s):
    return np_sigmoid(np.asarray(s, np.float64) @ np.asarray(P["gate"]["w"], np.float64))


def ref_head_in(h, g):
    return np.maximum(np.asarray(h, np.float64), 0.0) * np.asarray(g, np.float64)


def ref_head(u):
    return np_linear(P["head"], u)


def ref_foreign(x):
    s = ref_stem(x)
    return ref_head(ref_head_in(ref_encoder(s), ref_gate(s)))


S = f32(ref_stem(X))  # stem's output: the input of encoder and of gate
U = f32(ref_fc1_in(S))  # fc1's input (after the relu inside encoder)
H = f32(ref_encoder(S))
G = f32(ref_gate(S))

FOREIGN_NAMES = ["stem", "encoder", "encoder/fc1", "encoder/fc2", "gate", "head"]


def test_foreign_scopes_are_listed_with_nested_names_shapes_and_params():
    table = js.boundaries(foreign, P, X)
    assert [b.name for b in table] == FOREIGN_NAMES
    by = {b.name: b for b in table}
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    assert by["stem"].inputs == (sds(2, 3),) and by["stem"].outputs == (sds(2, 4),)
    assert by["encoder"].inputs == (sds(2, 4),) and by["encoder"].outputs == (sds(2, 4),)
    assert by["encoder/fc1"].outputs == (sds(2, 5),)
    assert by["head"].inputs == (sds(2, 4),) and by["head"].outputs == (sds(2, 2),)
    assert all(b.module_type == "named_scope" and b.num_calls == 1 for b in table)
    # A region's parameter count is the parameters its equations read.
    assert by["stem"].param_count == 3 * 4 + 4
    assert by["encoder"].param_count == (4 * 5 + 5) + (5 * 4 + 4)
    assert by["gate"].param_count == 16
    assert by["head"].param_count == 4 * 2 + 2


def test_foreign_prefix_slices_match_reference_math():
    close(js.slice(foreign, P, X, end="stem")(X), ref_stem(X))
    close(js.slice(foreign, P, X, end="encoder/fc1")(X), ref_fc1(U))
    close(js.slice(foreign, P, X, end="encoder")(X), ref_encoder(S))
    close(js.slice(foreign, P, X, end=None)(X), ref_foreign(X))
    sub = js.slice(foreign, P, X, end="gate")
    close(sub(X), ref_gate(S))
    assert set(sub.variables) == {"stem", "gate"}  # the encoder is not computed


def test_foreign_nested_region_slice_owns_only_its_parameters():
    sub = js.slice(foreign, P, X, start="encoder/fc1", end="encoder/fc2")
    close(sub(U), ref_fc2(ref_fc1(U)))
    assert set(sub.variables) == {"encoder"}
    assert sub.variables["encoder"]["fc1"]["w"] is P["encoder"]["fc1"]["w"]
    # Starting at the outer region includes the relu that runs inside it before fc1.
    close(js.slice(foreign, P, X, start="encoder", end="encoder")(S), ref_encoder(S))


def test_foreign_fan_out_from_one_layer_to_two():
    # stem's output feeds encoder and gate; a slice from it computes both branches.
    sub = js.slice(foreign, P, X, start="stem:output", end=None)
    close(sub(S), ref_head(ref_head_in(ref_encoder(S), ref_gate(S))))
    sub = js.slice(foreign, P, X, start="stem:output", end={"enc": "encoder", "gate": "gate"})
    close(sub(S), {"enc": ref_encoder(S), "gate": ref_gate(S)})


def test_foreign_activation_between_scopes_belongs_to_no_region():
    # head's input is relu(encoder) * gate, computed outside every scope.
    sub = js.slice(foreign, P, X, start=["encoder:output", "gate:output"], end="head")
    close(sub(H, G), ref_head(ref_head_in(H, G)))
    assert set(sub.variables) == {"head"}
    close(
        js.slice(foreign, P, X, start="head", end="head")(f32(ref_head_in(H, G))),
        ref_head(ref_head_in(H, G)),
    )


def test_foreign_missing_branch_is_an_error_naming_it():
    # From fc1 to head, gate's output (computed from stem, before the start) is missing.
    with pytest.raises(js.SliceError, match="gate"):
        js.slice(foreign, P, X, start="encoder/fc1", end="head")


def test_foreign_slice_trains_under_jit_and_grad():
    sub = js.slice(foreign, P, X, start=["encoder:output", "gate:output"], end="head")

    def loss(v, h, g):
        return jnp.sum(sub.apply(v, h, g) ** 2)

    def ref_loss(p, h, g):
        return jnp.sum(((jax.nn.relu(h) * g) @ p["head"]["w"] + p["head"]["b"]) ** 2)

    got = jax.jit(jax.grad(loss))(sub.variables, H, G)
    want = jax.grad(ref_loss)({"head": P["head"]}, H, G)
    assert_trees_all_close(got, want)
    new = jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, sub.variables, got)
    merged = sub.merge(P, new)
    assert merged["stem"]["w"] is P["stem"]["w"]
    assert_trees_all_close(merged["head"], new["head"])


def test_foreign_intermediates_match_reference_math():
    got = js.intermediates(foreign, P, X, names=["encoder/fc1", "gate"])
    close(dict(got), {"encoder/fc1": ref_fc1(U), "gate": ref_gate(S)})


def test_foreign_scope_inside_a_loop_slices_as_the_whole_loop():
    params = {"w": _linear_params(3, 3)["w"]}

    def model(p, x):
        def body(c, _):
            with jax.named_scope("cell"):
                c = jnp.tanh(c @ p["w"])
            return c, None

        with jax.named_scope("loop"):
            c, _ = jax.lax.scan(body, x, None, length=3)
        return c * 2.0

    ref = np.asarray(X, np.float64)
    for _ in range(3):
        ref = np.tanh(ref @ np.asarray(params["w"], np.float64))
    close(js.slice(model, params, X, end="loop")(X), ref)
    with pytest.raises(js.SliceError):  # a region inside the loop body is not sliceable
        js.slice(model, params, X, end="loop/cell")


# --------------------------------------------------------------------------- documented limits


def test_back_to_back_calls_of_one_scope_are_one_region_and_js_mark_tells_them_apart():
    """The sharp edge documented in jaxslice/_graph.py: a name-stack region cannot tell two
    back-to-back calls of the same scope apart (nothing between them leaves the scope);
    `js.mark` records each call explicitly."""
    p = {"shared": _linear_params(4, 4)}
    x = random_input(32, (2, 4))

    def scoped(params, x):
        h = linear("shared", params["shared"], x)
        h = linear("shared", params["shared"], h)  # back to back with the first call
        h = jnp.tanh(h)  # leaves the scope: the next call is a new region
        return linear("shared", params["shared"], h)

    table = js.boundaries(scoped, p, x)
    assert [b.name for b in table] == ["shared@0", "shared@1"]
    twice = js.slice(scoped, p, x, start="shared@0", end="shared@0")
    lin = lambda v: np_linear(p["shared"], v)  # noqa: E731
    close(twice(x), lin(lin(x)))  # the first region is both calls

    shared = js.mark("shared", lambda q, v: v @ q["w"] + q["b"])

    def marked(params, x):
        h = shared(params["shared"], shared(params["shared"], x))
        return shared(params["shared"], jnp.tanh(h))

    assert [b.name for b in js.boundaries(marked, p, x)] == ["shared@0", "shared@1", "shared@2"]
    close(js.slice(marked, p, x, start="shared@0", end="shared@0")(x), lin(x))
    h1 = f32(lin(x))
    close(js.slice(marked, p, x, start="shared@1", end="shared@1")(h1), lin(h1))


def test_identity_scope_is_no_boundary_but_an_identity_mark_is():
    """A scope with no equations leaves no trace in the jaxpr; `js.mark` does."""
    p = {"stem": _linear_params(3, 4)}

    def scoped(params, x):
        h = linear("stem", params["stem"], x)
        with jax.named_scope("ident"):
            h = h
        return jnp.tanh(h)

    assert [b.name for b in js.boundaries(scoped, p, X)] == ["stem"]
    ident = js.mark("ident", lambda v: v)

    def marked(params, x):
        return jnp.tanh(ident(linear("stem", params["stem"], x)))

    assert [b.name for b in js.boundaries(marked, p, X)] == ["stem", "ident"]
    close(js.slice(marked, p, X, end="ident")(X), np_linear(p["stem"], X))


def _inner_block(w, h):
    with jax.named_scope("inner"):
        return jnp.tanh(h @ w)


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_scope_inside_jit_or_checkpoint_is_a_boundary(wrap):
    p = {"w": _linear_params(3, 3)["w"]}

    def model(params, x):
        return wrap(_inner_block)(params["w"], x) + 1.0

    assert [b.name for b in js.boundaries(model, p, X)] == ["inner"]


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_mark_inside_jit_or_checkpoint_is_a_boundary(wrap):
    p = {"w": _linear_params(3, 3)["w"]}
    inner = js.mark("inner", lambda w, h: jnp.tanh(h @ w))

    def model(params, x):
        return wrap(inner)(params["w"], x) + 1.0

    assert [b.name for b in js.boundaries(model, p, X)] == ["inner"]
    close(
        js.slice(model, p, X, end="inner")(X),
        np.tanh(np.asarray(X, np.float64) @ np.asarray(p["w"], np.float64)),
    )


def test_two_starts_on_one_value_are_an_error_or_feed_their_own_modules():
    try:
        sub = js.slice(foreign, P, X, start=["encoder", "gate"], end=["encoder", "gate"])
    except js.SliceError:
        return
    a, b = S, f32(-2.0 * np.asarray(S))
    close(sub(a, b), (ref_encoder(a), ref_gate(b)))


_ORDER_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, jaxslice as js

    def f(p, x):
        with jax.named_scope("a"):
            with jax.named_scope("b"):
                with jax.named_scope("c"):
                    y = jnp.sin(x) * p
        return y + 1.0

    p, x = jnp.ones(3), jnp.ones(3)
    names = [b.name for b in js.boundaries(f, p, x)]
    graph = js.slice(f, p, x, end=None).to_networkx()
    print(names, graph.nodes["a/b/c"]["parent"])
    """
)


def test_nested_scopes_with_one_span_are_ordered_outer_first_in_every_process():
    seen = set()
    for seed in ("0", "1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run(
            [sys.executable, "-c", _ORDER_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        seen.add(out)
    assert seen == {"['a', 'a/b', 'a/b/c'] a/b"}


# --------------------------------------------------------------------------- Keras 3 (JAX backend)


def _keras_variables(model):
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )


def _keras_fn(model):
    def fn(variables, x, training=False):
        return model.stateless_call(variables[0], variables[1], x, training=training)[0]

    return fn


class _KerasZoo:
    def __init__(self):
        keras = import_keras()
        self.model = keras_block_model(keras)
        bn = self.model.get_layer("bn")  # running statistics that are not the identity
        bn.moving_mean.assign(np.linspace(-0.5, 0.5, 6).astype(np.float32))
        bn.moving_variance.assign(np.linspace(0.5, 2.0, 6).astype(np.float32))
        self.keras = keras
        self.variables = _keras_variables(self.model)
        self.fn = _keras_fn(self.model)
        self.x = random_input(33, (3, 4))

    def submodel_output(self, name, x):
        """Keras' own intermediate output: a functional sub-model ending at `name`."""
        m = self.model
        return self.keras.Model(inputs=m.inputs, outputs=m.get_layer(name).output)(
            x, training=False
        )

    def variable_indices(self, layers):
        """Indices into (trainable, non_trainable) of the variables of `layers`."""
        m = self.model
        own = lambda v: any(v.path == n or v.path.startswith(n + "/") for n in layers)  # noqa: E731
        return (
            {i for i, v in enumerate(m.trainable_variables) if own(v)},
            {i for i, v in enumerate(m.non_trainable_variables) if own(v)},
        )


@pytest.fixture(scope="module")
def kz():
    return _KerasZoo()


def _assert_keras_subset(sub_variables, variables, indices):
    for group, full, keep in zip(sub_variables, variables, indices, strict=True):
        if not keep:
            assert group is None or all(v is None for v in group)
            continue
        assert len(group) == len(full)
        for i, (got, orig) in enumerate(zip(group, full, strict=True)):
            assert (got is orig) if i in keep else (got is None), i


def test_keras_layers_are_boundaries(kz):
    table = js.boundaries(kz.fn, kz.variables, kz.x)
    assert [b.name for b in table] == ["stem", "bn", "act", "block", "block/a", "block/b", "head"]
    by = {b.name: b for b in table}
    assert by["stem"].inputs == (jax.ShapeDtypeStruct((3, 4), jnp.float32),)
    assert by["head"].outputs == (jax.ShapeDtypeStruct((3, 2), jnp.float32),)
    assert by["block"].param_count == 2 * (6 * 6 + 6)


@pytest.mark.parametrize("name", ["stem", "bn", "act", "block"])
def test_keras_prefix_slices_match_keras_submodels(kz, name):
    sub = js.slice(kz.fn, kz.variables, kz.x, end=name)
    close(sub(kz.x), kz.submodel_output(name, kz.x))
    layers = ["stem", "bn", "act", "block"][: ["stem", "bn", "act", "block"].index(name) + 1]
    _assert_keras_subset(sub.variables, kz.variables, kz.variable_indices(layers))


def test_keras_slice_between_layers_matches_the_model(kz):
    sub = js.slice(kz.fn, kz.variables, kz.x, start="block", end="head")
    feats = kz.submodel_output("act", kz.x)
    close(sub(feats), kz.model(kz.x, training=False))
    _assert_keras_subset(sub.variables, kz.variables, kz.variable_indices(["block", "head"]))
    # A new batch size needs no re-slicing.
    x5 = random_input(34, (5, 4))
    close(sub(kz.submodel_output("act", x5)), kz.model(x5, training=False))


def test_keras_nested_sublayers_match_eager_calls(kz):
    block = kz.model.get_layer("block")
    feats = kz.submodel_output("act", kz.x)
    sub = js.slice(kz.fn, kz.variables, kz.x, start="block/a", end="block/b")
    close(sub(feats), block.b(kz.keras.ops.tanh(block.a(feats))))
    close(js.slice(kz.fn, kz.variables, kz.x, end="block/a")(kz.x), block.a(feats))
    _assert_keras_subset(sub.variables, kz.variables, kz.variable_indices(["block/a", "block/b"]))


def test_keras_training_mode_is_a_mode_keyword(kz):
    bn = kz.model.get_layer("bn")
    bn_in = kz.submodel_output("stem", kz.x)
    sub = js.slice(kz.fn, kz.variables, kz.x, start="bn", end="bn")
    close(sub(bn_in), bn(bn_in, training=False))
    close(sub.apply(sub.variables, bn_in, training=True), bn(bn_in, training=True))
    train = js.slice(kz.fn, kz.variables, kz.x, start="bn", end="bn", training=True)
    close(train(bn_in), bn(bn_in, training=True))


def test_keras_shared_layer_calls_are_numbered_unless_back_to_back():
    keras = import_keras()
    keras.utils.set_random_seed(1)
    x = random_input(35, (3, 4))

    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    h = shared(keras.layers.Dense(4, name="mid")(shared(inp)))
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(h))
    fn, variables = _keras_fn(model), _keras_variables(model)
    assert [b.name for b in js.boundaries(fn, variables, x)] == [
        "shared@0",
        "mid",
        "shared@1",
        "head",
    ]
    with pytest.raises(js.SliceError, match="shared@1"):
        js.slice(fn, variables, x, end="shared")
    mid = model.get_layer("mid")(shared(x))
    close(js.slice(fn, variables, x, start="shared@1", end="shared@1")(mid), shared(mid))

    # Back-to-back calls of the same layer are one name-scope region (see the limit above).
    inp = keras.Input((4,))
    twice = keras.layers.Dense(4, name="twice")
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(twice(twice(inp))))
    fn, variables = _keras_fn(model), _keras_variables(model)
    assert [b.name for b in js.boundaries(fn, variables, x)] == ["twice", "head"]
    close(js.slice(fn, variables, x, end="twice")(x), twice(twice(x)))


# --------------------------------------------------------------------------- Haiku


def _haiku_forward(x):
    import haiku as hk

    h = hk.nets.MLP([6, 5], activate_final=True, name="mlp")(x)
    shared = hk.Linear(5, name="shared")
    h = shared(jnp.tanh(shared(h)))  # two calls, separated by a tanh outside the layer
    return hk.Linear(2, name="head")(h)


def _haiku_recorded(x):
    """Every module call's inputs and output, recorded with Haiku's own interceptor."""
    import haiku as hk

    calls = {}

    def interceptor(next_fn, args, kwargs, context):
        out = next_fn(*args, **kwargs)
        if context.method_name == "__call__":
            calls.setdefault(context.module.module_name, []).append((args, out))
        return out

    with hk.intercept_methods(interceptor):
        y = _haiku_forward(x)
    return y, calls


class _HaikuZoo:
    def __init__(self):
        hk = pytest.importorskip("haiku")
        self.hk = hk
        self.x = random_input(36, (3, 4))
        self.transformed = hk.transform(_haiku_forward)
        self.params = self.transformed.init(jax.random.key(0), self.x)
        recorder = hk.transform(_haiku_recorded)
        self.y, self.calls = jax.jit(recorder.apply)(self.params, None, self.x)

    def fn(self, params, x):
        return self.transformed.apply(params, None, x)


@pytest.fixture(scope="module")
def hz():
    return _HaikuZoo()


# A plain function that applies a transformed function gets Haiku's own names, keyed
# exactly as its parameters are ("mlp/~/linear_0", `~` included), not the names of the
# `jax.named_call` scopes Haiku opens ("mlp/linear_0"), which are not listed twice.
HAIKU_NAMES = {
    "mlp": ("mlp", 0),
    "mlp/~/linear_0": ("mlp/~/linear_0", 0),
    "mlp/~/linear_1": ("mlp/~/linear_1", 0),
    "shared@0": ("shared", 0),
    "shared@1": ("shared", 1),
    "head": ("head", 0),
}


def test_haiku_modules_are_boundaries(hz):
    table = js.boundaries(hz.fn, hz.params, hz.x)
    assert [b.name for b in table] == list(HAIKU_NAMES)
    assert {b.name for b in table if b.name != "mlp"} <= {*hz.params, "shared@0", "shared@1"}
    assert {b.name: b.param_count for b in table}["mlp"] == (4 * 6 + 6) + (6 * 5 + 5)


@pytest.mark.parametrize("name", list(HAIKU_NAMES))
def test_haiku_prefix_slices_match_intercepted_outputs(hz, name):
    module, k = HAIKU_NAMES[name]
    sub = js.slice(hz.fn, hz.params, hz.x, end=name)
    close(sub(hz.x), hz.calls[module][k][1])


def test_haiku_slice_between_modules_matches_apply(hz):
    (h,), _ = hz.calls["mlp/~/linear_1"][0]
    sub = js.slice(hz.fn, hz.params, hz.x, start="mlp/~/linear_1", end="head")
    close(sub(h), hz.y)
    assert set(sub.variables) == {"mlp/~/linear_1", "shared", "head"}
    assert sub.variables["shared"]["w"] is hz.params["shared"]["w"]
    (s1,), out = hz.calls["shared"][1]
    close(js.slice(hz.fn, hz.params, hz.x, start="shared@1", end="shared@1")(s1), out)
