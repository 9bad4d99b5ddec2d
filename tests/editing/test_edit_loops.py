"""Editing inside scanned stacks, and call-time inputs (interventions).

Oracles are independent of jaxslice: an *unrolled linen twin* of the scanned model (the
same blocks applied in a Python loop, with the scanned model's stacked weights split per
layer) with the edit written into its layer k by hand; hand-written loops for plain
`lax.scan`s; `jax.grad` of hand-written functions for attribution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxslice as js

from helpers.models import SCAN_LAYERS, SCAN_WIDTH, ScannedModel
from helpers.oracles import iter_eqns

N, D = SCAN_LAYERS, SCAN_WIDTH  # the shared scanned model's layers and width
Scanned = ScannedModel


class TwinBlock(nn.Module):
    """Block with edits written in: `mlp_edit(k, m)` on the mlp's output and
    `block_edit(k, y)` on the block's."""

    k: int
    mlp_edit: Callable[[int, Any], Any] | None = None
    block_edit: Callable[[int, Any], Any] | None = None

    @nn.compact
    def __call__(self, x):
        m = nn.Dense(D, name="mlp")(jnp.tanh(nn.Dense(D, name="attn")(x)))
        if self.mlp_edit is not None:
            m = self.mlp_edit(self.k, m)
        y = x + m
        return self.block_edit(self.k, y) if self.block_edit is not None else y


class Twin(nn.Module):
    mlp_edit: Callable[[int, Any], Any] | None = None
    block_edit: Callable[[int, Any], Any] | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="embed")(x)
        for k in range(N):
            x = TwinBlock(k, self.mlp_edit, self.block_edit, name=f"layers_{k}")(x)
        return nn.Dense(3, name="head")(x)


X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.float32)


@pytest.fixture(scope="module")
def scanned():
    model = Scanned()
    return model, model.init(jax.random.key(0), X)


def twin(variables, x=X, **edits):
    """The unrolled twin, with the scanned model's weights split per layer."""
    p = dict(variables["params"])
    stacked = p.pop("layers")
    for k in range(N):
        p[f"layers_{k}"] = jax.tree_util.tree_map(lambda a, k=k: a[k], stacked)
    return Twin(**edits).apply({"params": p}, x)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def scan_lengths(fn, *args, **kwargs):
    jaxpr = jax.make_jaxpr(fn)(*args, **kwargs)
    return sorted(e.params["length"] for e in iter_eqns(jaxpr) if e.primitive.name == "scan")


def unchanged(variables, before):
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), variables, before)


# --------------------------------------------------------------------------- every iteration


def test_an_edit_at_every_iteration_keeps_one_scan(scanned):
    model, variables = scanned
    before = jax.tree_util.tree_map(np.asarray, variables)
    g = js.edit(model, variables, X).insert_after("layers[:]/mlp", lambda m: 2 * m, name="double")
    edited = g.build()
    close(edited(X), twin(variables, mlp_edit=lambda k, m: 2 * m))
    assert scan_lengths(edited, X) == [N]
    assert "layers[:]/double" in [b.name for b in g.boundaries()]
    close(model.apply(variables, X), twin(variables))
    unchanged(variables, before)


@pytest.mark.parametrize("k", [0, 2, -1])
def test_an_edit_at_one_iteration_changes_only_that_one(scanned, k):
    model, variables = scanned
    i = k % N
    g = js.edit(model, variables, X).replace(f"layers[{k}]/mlp", lambda h: jnp.zeros_like(h))
    edited = g.build()
    close(edited(X), twin(variables, mlp_edit=lambda j, m: m * 0 if j == i else m))
    # The loop stays one scan; an element-wise edit is selected by the iteration index.
    assert scan_lengths(edited, X) == [N]
    assert "cond" not in {e.primitive.name for e in iter_eqns(jax.make_jaxpr(edited)(X))}


def test_a_module_at_one_iteration_runs_only_there(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X).insert_after(
        "layers[2]/mlp", nn.Dense(D, name="x"), key=jax.random.key(3), name="extra"
    )
    p = g.variables["params"]["extra"]
    edited = g.build()
    want = twin(variables, mlp_edit=lambda j, m: m @ p["kernel"] + p["bias"] if j == 2 else m)
    close(edited(X), want)
    # A module (a contraction) runs under a `cond` on the iteration index, in one scan.
    assert scan_lengths(edited, X) == [N]
    assert "cond" in {e.primitive.name for e in iter_eqns(jax.make_jaxpr(edited)(X))}


def test_edits_at_every_iteration_and_at_one_combine(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X)
    g.insert_after("layers[:]/mlp", lambda m: 2 * m, name="double")
    g.insert_after("layers[3]/mlp", lambda m: m + 1, name="plus")
    want = twin(variables, mlp_edit=lambda j, m: 2 * m + 1 if j == 3 else 2 * m)
    close(g.build()(X), want)
    names = [b.name for b in g.boundaries()]
    assert "layers[:]/double" in names and not any(
        "plus" in n for n in names
    )  # one iteration's node: no boundary


def test_a_module_inserted_at_every_iteration_gets_stacked_rows(scanned):
    model, variables = scanned

    class Lora(nn.Module):
        @nn.compact
        def __call__(self, h):
            down = nn.Dense(2, use_bias=False, name="down")(h)
            up = nn.Dense(D, use_bias=False, kernel_init=nn.initializers.normal(0.1), name="up")
            return h + up(down)

    g = js.edit(model, variables, X).insert_after(
        "layers[:]/mlp", Lora(), key=jax.random.key(1), name="lora"
    )
    rows = g.variables["params"]["lora"]
    assert jax.tree_util.tree_map(jnp.shape, rows) == {
        "down": {"kernel": (N, D, 2)},
        "up": {"kernel": (N, 2, D)},
    }
    # Each row is initialised from its own key, as Flax initialises each layer.
    keys = jax.random.split(jax.random.key(1), N)
    for k in (0, 3):
        own = Lora().init(keys[k], jnp.zeros((2, D)))["params"]
        close(rows["up"]["kernel"][k], own["up"]["kernel"])
    assert not np.allclose(rows["up"]["kernel"][0], rows["up"]["kernel"][1])

    def lora_k(k, m):
        return Lora().apply({"params": jax.tree_util.tree_map(lambda a: a[k], rows)}, m)

    edited = g.build()
    close(edited(X), twin(variables, mlp_edit=lora_k))
    assert scan_lengths(edited, X) == [N]


def test_fine_tune_stacked_adapters_then_remove_them(scanned):
    model, variables = scanned
    before = jax.tree_util.tree_map(np.asarray, variables)

    class Scale(nn.Module):
        @nn.compact
        def __call__(self, h):
            return h * (1 + self.param("s", nn.initializers.zeros, (D,)))

    g = js.edit(model, variables, X).insert_after(
        "layers[:]/mlp", Scale(), key=jax.random.key(2), name="scale"
    )
    edited = g.build()
    y = jnp.ones((2, 3))

    def loss(scale, v):
        merged = {"params": {**v["params"], "scale": scale}}
        return jnp.mean((edited.apply(merged, X) - y) ** 2)

    def loss_by_hand(s):
        return jnp.mean((twin(variables, mlp_edit=lambda k, m: m * (1 + s[k])) - y) ** 2)

    scale = edited.variables["params"]["scale"]
    got = jax.grad(loss)(scale, edited.variables)
    close(got["s"], jax.grad(loss_by_hand)(scale["s"]))
    tx = optax.sgd(0.5)
    state = tx.init(scale)
    for _ in range(3):
        updates, state = tx.update(jax.grad(loss)(scale, edited.variables), state)
        scale = optax.apply_updates(scale, updates)
    assert loss(scale, edited.variables) < loss(
        edited.variables["params"]["scale"], edited.variables
    )
    unchanged(variables, before)  # only the adapters trained
    g.remove("scale")
    assert "scale" not in g.variables["params"]
    close(g.build()(X), model.apply(variables, X))


# --------------------------------------------------------------------------- call-time inputs


def test_activation_patching_sweep_in_one_vmapped_call(scanned):
    model, variables = scanned
    patched = (
        js.edit(model, variables, X).replace("layers[3]/mlp", lambda h, new: new, inputs=("new",))
    ).build()
    patches = jax.random.normal(jax.random.key(5), (4, 2, D))
    got = jax.vmap(lambda p: patched(X, new=p))(patches)
    for i in range(4):
        want = twin(variables, mlp_edit=lambda k, m, i=i: patches[i] if k == 3 else m)
        close(got[i], want)


def test_steering_rows_go_to_their_iterations_and_grad_is_attribution(scanned):
    model, variables = scanned
    shape = jax.ShapeDtypeStruct((N, D), jnp.float32)
    g = js.edit(model, variables, X).insert_after(
        "layers[:]", lambda out, v: (out[0] + v, out[1]), inputs={"v": shape}, name="steer"
    )
    steered = g.build()
    v = jax.random.normal(jax.random.key(6), (N, D))
    close(steered(X, v=v), twin(variables, block_edit=lambda k, y: y + v[k]))
    close(steered(X, v=jnp.zeros((N, D))), model.apply(variables, X))

    def by_hand(v):
        return twin(variables, block_edit=lambda k, y: y + v[k]).sum()

    close(jax.grad(lambda v: steered(X, v=v).sum())(v), jax.grad(by_hand)(v))
    assert scan_lengths(steered, X, v=v) == [N]


def test_call_time_inputs_at_a_top_level_boundary(scanned):
    model, variables = scanned
    ablate = js.edit(model, variables, X).insert_after("embed", lambda h, m: h * m, inputs=("m",))
    edited = ablate.build()
    mask = jnp.asarray([1, 0, 1, 1, 0, 1], jnp.float32)

    def masked_embed(next_fun, args, kwargs, context):  # the same edit, by Flax's hook
        out = next_fun(*args, **kwargs)
        return out * mask if context.module.name == "embed" else out

    with nn.intercept_methods(masked_embed):
        want = model.apply(variables, X)
    close(edited(X, m=jnp.broadcast_to(mask, (2, D))), want)
    close(edited(X, m=jnp.ones((2, D))), twin(variables))


def test_wrong_missing_or_extra_call_time_inputs_are_named(scanned):
    model, variables = scanned
    shape = jax.ShapeDtypeStruct((N, D), jnp.float32)
    edited = (
        js.edit(model, variables, X)
        .insert_after("layers[:]", lambda out, v: (out[0] + v, out[1]), inputs={"v": shape})
        .build()
    )
    v = jnp.ones((N, D))
    with pytest.raises(js.SliceError, match="'v'"):
        edited(X)
    with pytest.raises(js.SliceError, match="'w'"):
        edited(X, v=v, w=v)
    with pytest.raises(js.SliceError, match=r"'v' must be float32 with leading axes \[5\]"):
        edited(X, v=v[:3])
    with pytest.raises(js.SliceError, match=r"v: float32\[7\]"):
        edited(X, v=jnp.ones((N, 7)))
    with pytest.raises(js.SliceError, match="'v' must be float32"):
        edited(X, v=jnp.ones((N, D), jnp.int32))


def test_bad_call_time_input_specs_are_refused(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X)
    with pytest.raises(js.SliceError, match="leading axes"):
        g.insert_after("layers[:]/mlp", lambda h, v: h + v, inputs={"v": jnp.ones(D)})
    with pytest.raises(js.SliceError, match="identifiers"):
        g.insert_after("embed", lambda h, v: h + v, inputs=("not a name",))
    g.insert_after("embed", lambda h, v: h + v, inputs=("v",))
    with pytest.raises(js.SliceError, match="already taken"):
        g.insert_after("head", lambda h, v: h + v, inputs=("v",))


def test_a_breaking_edit_inside_the_loop_changes_nothing(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X).insert_after("layers[:]/mlp", lambda m: m + 1, name="one")
    want = g.build()(X)
    with pytest.raises(js.SliceError, match="breaks the model"):
        g.insert_after("layers[2]/mlp", lambda m: m[:, :3], name="bad")
    close(g.build()(X), want)
    assert "bad" not in [b.name for b in g.boundaries()]


# --------------------------------------------------------------------------- plain lax.scan


def test_plain_scans_reverse_and_nested():
    w = jax.random.normal(jax.random.key(3), (N, 4, 4)) * 0.5
    x = jnp.ones((2, 4))

    def backwards(p, x):
        step = js.mark("step", lambda h, w: (jnp.tanh(h @ w), None))
        return jax.lax.scan(step, x, p, reverse=True)[0]

    def by_hand(edit):
        h = x
        for k in reversed(range(N)):
            h = edit(k, jnp.tanh(h @ w[k]))
        return h

    g = js.edit(backwards, w, x).insert_after("step[1]", lambda out: (out[0] * 3, out[1]))
    close(g.build()(x), by_hand(lambda k, h: h * 3 if k == 1 else h))
    g = js.edit(backwards, w, x).insert_after("step[:]", lambda out: (out[0] * 3, out[1]))
    close(g.build()(x), by_hand(lambda k, h: h * 3))

    w2 = jax.random.normal(jax.random.key(4), (3, 2, 4, 4)) * 0.5

    def nested(p, x):
        cell = js.mark("cell", lambda h, w: (jnp.tanh(h @ w), None))

        @js.mark("outer")
        def outer(h, ws):
            return jax.lax.scan(cell, h, ws)[0]

        return jax.lax.scan(lambda h, ws: (outer(h, ws), None), x, p)[0]

    def nested_by_hand(edit):
        h = x
        for i in range(3):
            for j in range(2):
                h = edit(i, j, jnp.tanh(h @ w2[i, j]))
        return h

    v = jax.random.normal(jax.random.key(7), (3, 2, 4))
    g = js.edit(nested, w2, x)
    shape = jax.ShapeDtypeStruct((3, 2, 2, 4), jnp.float32)
    g.insert_after("outer[:]/cell[:]", lambda out, v: (out[0] + v, None), inputs={"v": shape})
    g.insert_after("outer[1]/cell[0]", lambda out: (out[0] * 0, None))
    want = nested_by_hand(lambda i, j, h: (h + v[i, j]) * (0 if (i, j) == (1, 0) else 1))
    close(g.build()(x, v=jnp.broadcast_to(v[:, :, None, :], (3, 2, 2, 4))), want)


def test_call_time_inputs_cannot_take_the_models_own_keywords(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X)
    for taken in ("rngs", "mutable", "x"):  # `x` is the model's own argument
        with pytest.raises(js.SliceError, match="already taken"):
            g.insert_after("embed", lambda h, v: h + v, inputs=(taken,))


def test_a_patch_takes_the_shape_of_the_output_it_replaces():
    def model(p, x):
        up = js.mark("up", lambda h: h @ p["up"])
        down = js.mark("down", lambda h: h @ p["down"])
        return x + down(jnp.tanh(up(x)))

    p = {"up": jnp.ones((4, 8)) / 8, "down": jnp.ones((8, 4)) / 8}
    x = jnp.ones((3, 4))
    patched = js.edit(model, p, x).replace("down", lambda h, new: new, inputs=("new",)).build()
    new = jnp.arange(12.0).reshape(3, 4)
    close(patched(x, new=new), x + new)


def test_a_scanned_row_of_parameters_is_no_input_of_the_call():
    w = jax.random.normal(jax.random.key(8), (N, 4, 4)) * 0.5
    x = jnp.ones((2, 4))

    def stack(p, x):
        step = js.mark("step", lambda h, w: (jnp.tanh(h @ w), None))
        return jax.lax.scan(step, x, p)[0]

    class Inputs(js.Interpreter):
        def boundary(self, name, side, value):
            if side == "input":
                self.emit(name, value)  # the carry only, not the row of `p`
            return value

    _, seen = Inputs().build(stack, w, x)(w, x)
    h, rows = x, []
    for k in range(N):
        rows.append(h)
        h = jnp.tanh(h @ w[k])
    close(seen["step[:]"], jnp.stack(rows))
    # A replacement receives the same: the carry only.
    doubled = js.edit(stack, w, x).replace("step[:]", lambda h: (2 * h, None)).build()
    close(doubled(x), x * 2**N)


def test_an_edit_at_every_iteration_equals_flax_intercept_methods(scanned):
    model, variables = scanned
    edited = js.edit(model, variables, X).replace("layers[:]/mlp", jnp.sin).build()

    def sin_mlp(next_fun, args, kwargs, context):
        # Flax calls the interceptor for the one traced iteration of nn.scan's body.
        if context.module.name == "mlp" and context.method_name == "__call__":
            return jnp.sin(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(sin_mlp):
        want = model.apply(variables, X)
    close(edited(X), want)


# --------------------------------------------------------------------------- node names in loops


def test_a_node_at_every_iteration_is_listed_under_the_loop(scanned):
    """A node at ``layers[:]/mlp`` is ``layers[:]/half``: one iteration's value is
    ``layers[2]/half``, every iteration's ``layers[:]/half``, as Flax records the twin's
    mlp outputs (halved); the listed name also takes it out again."""
    model, variables = scanned
    g = js.edit(model, variables, X).insert_after("layers[:]/mlp", lambda m: m / 2, name="half")
    listed = [b.name for b in g.boundaries()]
    assert listed[listed.index("layers[:]/mlp") + 1] == "layers[:]/half"
    assert not any(n.startswith("half") for n in listed)
    p = dict(variables["params"])
    stacked = p.pop("layers")
    for k in range(N):
        p[f"layers_{k}"] = jax.tree_util.tree_map(lambda a, k=k: a[k], stacked)
    _, seen = Twin(mlp_edit=lambda k, m: m / 2).apply(
        {"params": p}, X, capture_intermediates=True, mutable=["intermediates"]
    )
    mlps = [seen["intermediates"][f"layers_{k}"]["mlp"]["__call__"][0] / 2 for k in range(N)]
    close(g.slice(end="layers[2]/half")(X), mlps[2])
    close(g.slice(end="layers[:]/half")(X), jnp.stack(mlps))
    g.remove("layers[:]/half")
    close(g.build()(X), model.apply(variables, X))


def test_a_node_in_a_loop_cannot_take_a_name_listed_there(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X)
    with pytest.raises(js.SliceError, match="attn"):  # it would be a second layers[:]/attn
        g.insert_after("layers[:]/mlp", lambda m: m, name="attn")
    g.insert_after("embed", lambda m: m, name="attn")  # at the top level: no clash


def test_nodes_in_nested_plain_scans_are_listed_in_their_loop():
    w = jax.random.normal(jax.random.key(4), (3, 2, 4, 4)) * 0.5
    x = jnp.ones((2, 4))

    def nested(p, x):
        cell = js.mark("cell", lambda h, w: (jnp.tanh(h @ w), None))

        @js.mark("outer")
        def outer(h, ws):
            return jax.lax.scan(cell, h, ws)[0]

        return jax.lax.scan(lambda h, ws: (outer(h, ws), None), x, p)[0]

    g = js.edit(nested, w, x).insert_after(
        "outer[:]/cell[:]", lambda o: (2 * o[0], None), name="dbl"
    )
    g.insert_after("outer[:]", lambda h: h + 1, name="plus")
    assert [b.name for b in g.boundaries()] == [
        "outer[:]",
        "outer[:]/cell[:]",
        "outer[:]/dbl[:]",
        "plus[:]",
    ]
    h = x
    for i in range(2):
        for j in range(2):
            h = 2 * jnp.tanh(h @ w[i, j])
        h = h + 1
    want = 2 * jnp.tanh(h @ w[2, 0])  # iteration 0 of the inner loop in outer iteration 2
    close(g.slice(end="outer[2]/dbl[0]")(x)[0], want)


# --------------------------------------------------------------------------- previews


def test_at_previews_the_iterations_an_edit_touches_from_the_flax_model(scanned):
    """`editor.at` counts, names and numbers the calls an edit would touch, as the model
    itself has them: one per layer of the `nn.scan` (the leading axis of its stacked
    parameters), each receiving what Flax records for that layer's mlp; nothing changes."""
    model, variables = scanned
    layers = jax.tree_util.tree_leaves(variables["params"]["layers"])[0].shape[0]
    _, seen = Twin().apply(
        {"params": _split_layers(variables)},
        X,
        capture_intermediates=True,
        mutable=["intermediates"],
    )
    g = js.edit(model, variables, X)
    every = g.at("layers[:]/mlp")
    assert every.count == layers
    assert every.names == tuple(f"layers[{k}]/mlp" for k in range(layers))
    assert every.iterations == tuple((k,) for k in range(layers))
    mlp = seen["intermediates"]["layers_0"]["mlp"]["__call__"][0]
    assert (every.value.shape, every.value.dtype) == (mlp.shape, mlp.dtype)
    last = g.at("layers[-1]/mlp:input")
    assert (last.count, last.names, last.iterations) == (
        1,
        (f"layers[{layers - 1}]/mlp",),
        ((layers - 1,),),
    )
    assert last.side == "input"
    top = g.at("head")
    assert (top.count, top.names, top.iterations) == (1, ("head",), ((),))
    close(g.build()(X), model.apply(variables, X))  # a preview edits nothing


def test_at_previews_a_node_inserted_at_every_iteration(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X).insert_after("layers[:]/mlp", lambda m: m / 2, name="half")
    node = g.at("half")
    assert node.count == N
    assert node.names == tuple(f"layers[{k}]/half" for k in range(N))
    # The listed names pick the iterations the preview shows: row k is layer k's mlp, halved.
    _, seen = Twin(mlp_edit=lambda k, m: m / 2).apply(
        {"params": _split_layers(variables)},
        X,
        capture_intermediates=True,
        mutable=["intermediates"],
    )
    close(
        g.slice(end=node.names[3])(X), seen["intermediates"]["layers_3"]["mlp"]["__call__"][0] / 2
    )


def test_at_refuses_names_as_edits_do(scanned):
    model, variables = scanned
    g = js.edit(model, variables, X)
    with pytest.raises(js.UnknownBoundaryError):
        g.at("layers[:]/nothing")
    with pytest.raises(js.SliceError):
        g.at(f"layers[{N}]/mlp")  # past the last layer


def _split_layers(variables):
    p = dict(variables["params"])
    stacked = p.pop("layers")
    for k in range(N):
        p[f"layers_{k}"] = jax.tree_util.tree_map(lambda a, k=k: a[k], stacked)
    return p


def test_edits_in_the_loop_apply_at_a_new_batch_size(scanned):
    """The edited model traced again at another batch size meets the same edits: one
    iteration's replacement and every iteration's insertion, as the twin has them."""
    model, variables = scanned
    g = js.edit(model, variables, X).replace("layers[2]/mlp", lambda h: h * 0)
    g.insert_after("layers[:]/attn", lambda a: a + 1.0, name="shift")
    x7 = jnp.asarray(np.random.default_rng(1).normal(size=(7, 4)), jnp.float32)

    class ShiftTwin(nn.Module):  # the twin with attn's output shifted in every layer
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(D, name="embed")(x)
            for k in range(N):
                with_shift = _ShiftBlock(k == 2, name=f"layers_{k}")
                x = with_shift(x)
            return nn.Dense(3, name="head")(x)

    want = ShiftTwin().apply({"params": _split_layers(variables)}, x7)
    close(g.build()(x7), want)


class _ShiftBlock(nn.Module):
    zero_mlp: bool

    @nn.compact
    def __call__(self, x):
        a = nn.Dense(D, name="attn")(x) + 1.0
        m = nn.Dense(D, name="mlp")(jnp.tanh(a))
        return x + (m * 0 if self.zero_mlp else m)
