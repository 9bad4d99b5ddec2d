"""Scanned layer stacks: per-iteration boundaries, only the needed iterations, stacked
parameters kept whole.

Oracles come from outside jaxslice: an *unrolled twin* of each scanned linen model (the
same blocks applied in a Python loop, with the scanned model's stacked weights split per
layer) read with Flax's `capture_intermediates`; eager calls of an NNX model's layers;
hand-written loops for plain `lax.scan`s; `jax.grad` of the full model for gradients.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.models import (
    SCAN_LAYERS,
    SCAN_WIDTH,
    ScanBlock,
    ScannedModel,
    ScanUnrolled,
    eager_rows,
    nnx_scanned,
    scan_unrolled_params,
)
from helpers.oracles import count_primitive, iter_eqns

N = SCAN_LAYERS
D = SCAN_WIDTH


Block, Scanned = ScanBlock, ScannedModel  # the shared stack of `N` blocks of width `D`


Unrolled = ScanUnrolled


X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.float32)


@pytest.fixture(scope="module")
def scanned():
    model = Scanned()
    variables = model.init(jax.random.key(0), X)
    return model, variables


unrolled_params = scan_unrolled_params


def captured(variables):
    """Every intermediate of the unrolled twin: ``{name: output}``."""
    _, state = Unrolled().apply(unrolled_params(variables), X, capture_intermediates=True)
    inter = state["intermediates"]
    out = {"embed": inter["embed"]["__call__"][0]}
    for k in range(N):
        layer = inter[f"layers_{k}"]
        out[f"layers[{k}]"] = layer["__call__"][0][0]
        out[f"layers[{k}]/attn"] = layer["attn"]["__call__"][0]
        out[f"layers[{k}]/mlp"] = layer["mlp"]["__call__"][0]
    out["logits"] = inter["__call__"][0]
    return out


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def scans_in(jaxpr):
    """The lengths of the scans a program runs."""
    return [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


# --------------------------------------------------------------------------- linen nn.scan


def test_table_lists_each_body_call_once_with_its_iterations(scanned):
    model, variables = scanned
    table = js.boundaries(model, variables, X)
    rows = {b.name: b for b in table}
    assert list(rows) == ["embed", "layers", "layers[:]", "layers[:]/attn", "layers[:]/mlp", "head"]
    assert rows["layers[:]/attn"].iterations == N and rows["layers"].iterations is None
    assert "layers[:]/attn  (x5)" in str(table)


@pytest.mark.parametrize("k", [0, 2, -1])
def test_per_iteration_ends_equal_the_unrolled_model(scanned, k):
    model, variables = scanned
    want = captured(variables)
    i = k % N
    for name in (f"layers[{k}]/attn", f"layers[{k}]/mlp"):
        got = js.slice(model, variables, X, end=name)(X)
        close(got, want[name.replace(f"[{k}]", f"[{i}]")])
    y, none = js.slice(model, variables, X, end=f"layers[{k}]")(X)
    assert none is None
    close(y, want[f"layers[{i}]"])


def test_stacked_ends_equal_every_iteration(scanned):
    model, variables = scanned
    want = captured(variables)
    got = js.intermediates(model, variables, X, names=["layers[:]/attn", "layers[:]", "head"])
    close(got["layers[:]/attn"], jnp.stack([want[f"layers[{k}]/attn"] for k in range(N)]))
    close(got["layers[:]"][0], jnp.stack([want[f"layers[{k}]"] for k in range(N)]))
    close(got["head"], want["logits"])


def test_a_slice_runs_only_the_iterations_it_needs(scanned):
    model, variables = scanned
    head = js.slice(model, variables, X, end="layers[2]")
    assert scans_in(head.jaxpr) == [3]  # iterations 0-2, one scan
    tail = js.slice(model, variables, X, start="layers[3]", end=None)
    assert scans_in(tail.jaxpr) == [2]  # iterations 3-4
    mid = js.slice(model, variables, X, start="layers[1]", end="layers[2]/attn")
    # iteration 1 as a scan, then iteration 2 written out up to `attn`
    assert scans_in(mid.jaxpr) == [1]
    want = captured(variables)
    close(tail(want["layers[2]"]), want["logits"])
    close(mid(want["layers[0]"]), want["layers[2]/attn"])
    # The stacked parameters stay whole.
    kernel = variables["params"]["layers"]["attn"]["kernel"]
    assert tail.variables["params"]["layers"]["attn"]["kernel"] is kernel


def test_start_inside_an_iteration_needs_what_the_rest_of_it_reads(scanned):
    model, variables = scanned
    with pytest.raises(js.MissingInputError) as info:
        js.slice(model, variables, X, start="layers[2]/mlp", end=None)
    assert "'layers[2]:input'" in str(info.value)
    sub = js.slice(model, variables, X, start=["layers[2]/mlp", "layers[2]:input"], end=None)
    want = captured(variables)
    close(sub(jnp.tanh(want["layers[2]/attn"]), want["layers[1]"]), want["logits"])


def test_gradients_equal_the_full_model_and_unused_rows_get_zero(scanned):
    model, variables = scanned
    sub = js.slice(model, variables, X, end="layers[2]/attn")

    def loss_sub(v):
        return (sub.apply(v, X) ** 2).sum()

    def loss_twin(p):  # the same value read from the full (unrolled) model
        _, state = Unrolled().apply(p, X, capture_intermediates=True)
        return (state["intermediates"]["layers_2"]["attn"]["__call__"][0] ** 2).sum()

    got = jax.grad(loss_sub)(sub.variables)["params"]
    want = jax.grad(loss_twin)(unrolled_params(variables))["params"]
    for leaf in ("kernel", "bias"):
        for mod in ("attn", "mlp"):
            rows = got["layers"][mod][leaf]
            for k in range(N):
                expect = want[f"layers_{k}"][mod][leaf]
                close(rows[k], expect)  # zero for layers after 2 and for mlp of layer 2
    assert float(jnp.abs(got["layers"]["attn"]["kernel"][3:]).sum()) == 0.0
    close(got["embed"]["kernel"], want["embed"]["kernel"])


def test_merge_writes_trained_rows_back_exactly(scanned):
    model, variables = scanned
    tail = js.slice(model, variables, X, start="layers[3]", end=None)
    want = captured(variables)
    feats = want["layers[2]"]
    grads = jax.grad(lambda v: (tail.apply(v, feats) ** 2).sum())(tail.variables)
    trained = jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, tail.variables, grads)
    merged = tail.merge(variables, trained)
    # Hand-made update: only rows 3 and 4 of the stacked weights, and the head.
    stacked = variables["params"]["layers"]
    g = grads["params"]["layers"]
    for mod in ("attn", "mlp"):
        for leaf in ("kernel", "bias"):
            old, new = stacked[mod][leaf], merged["params"]["layers"][mod][leaf]
            np.testing.assert_array_equal(np.asarray(new[:3]), np.asarray(old[:3]))
            close(new[3:], old[3:] - 0.1 * g[mod][leaf][3:])
    assert merged["params"]["embed"]["kernel"] is variables["params"]["embed"]["kernel"]
    # The merged model computes what the trained tail computes.
    close(model.apply(merged, X), tail.apply(trained, feats))


def test_new_batch_size_reuses_the_names(scanned):
    model, variables = scanned
    x4 = jnp.concatenate([X, X])
    sub = js.slice(model, variables, X, end="layers[1]/mlp")
    got = sub(x4)
    close(got[:2], captured(variables)["layers[1]/mlp"])
    close(got[2:], got[:2])


# --------------------------------------------------------------------------- NNX


def NScanned(rngs):  # noqa: N802 - the model's constructor
    return nnx_scanned(rngs)


def nnx_layers(model):
    """The stacked layers as N eager NNX modules (the oracle)."""
    return eager_rows(model.layers)


def test_nnx_scan_calls_are_boundaries_under_attribute_paths():
    model = NScanned(nnx.Rngs(0))
    names = [b.name for b in js.boundaries(model, X)]
    assert names == ["embed", "layers", "layers[:]", "layers[:]/attn", "layers[:]/mlp", "head"]
    layers = nnx_layers(model)
    h = [model.embed(X)]
    for layer in layers:
        h.append(layer(h[-1]))
    close(js.slice(model, X, end="layers[1]")(X), h[2])
    close(js.slice(model, X, end="layers[3]/attn")(X), layers[3].attn(h[3]))
    tail = js.slice(model, X, start="layers[-2]", end=None)
    close(tail(h[3]), model(X))
    got = js.intermediates(model, X, names=["layers[:]"])
    close(got["layers[:]"], jnp.stack(h[1:]))


def test_nnx_slice_shares_the_stacked_variables():
    model = NScanned(nnx.Rngs(1))
    tail = js.slice(model, X, start="layers[3]", end=None)
    h3 = js.slice(model, X, end="layers[2]")(X)
    grads = nnx.grad(lambda s: (s(h3) ** 2).sum())(tail)
    parts = [(i, part) for i, part in enumerate(tail.parts)]
    at = next(i for i, part in parts if part is model.layers or part is model.layers.attn)
    found = grads["parts"][at]
    kernel = (found["attn"] if tail.parts[at] is model.layers else found)["kernel"][...]
    assert float(jnp.abs(kernel[:3]).sum()) == 0.0 and float(jnp.abs(kernel[3:]).sum()) > 0
    before = model(X)
    model.layers.attn.kernel[...] = model.layers.attn.kernel[...].at[4].add(0.5)
    close(tail(h3), model(X))  # the slice reads the model's variables as they are now
    assert not np.allclose(np.asarray(before), np.asarray(model(X)))


# --------------------------------------------------------------------------- plain JAX


def plain_stack(params, x):
    @js.mark("block")
    def block(h, w):
        return jnp.tanh(h @ w)

    def body(h, w):
        h = block(h, w)
        return h, h.sum(axis=-1)

    h, sums = jax.lax.scan(body, x, params["w"])
    return h


def test_lax_scan_around_marked_code():
    w = jax.random.normal(jax.random.key(2), (N, 4, 4)) * 0.5
    p = {"w": w}
    hs = [X]
    for k in range(N):
        hs.append(jnp.tanh(hs[-1] @ w[k]))
    close(js.slice(plain_stack, p, X, end="block[2]")(X), hs[3])
    # The row of the stacked weights is a parameter, not one of the block's inputs.
    close(js.slice(plain_stack, p, X, end="block[2]:input")(X), hs[2])
    tail = js.slice(plain_stack, p, X, start="block[3]:input", end=None)
    close(tail(hs[3]), hs[N])
    got = js.intermediates(plain_stack, p, X, names=["block[:]"])["block[:]"]
    close(got, jnp.stack(hs[1:]))


def test_reverse_scan_and_fori_loop_iterations_are_rows():
    w = jax.random.normal(jax.random.key(3), (N, 4, 4)) * 0.5

    def backwards(p, x):
        step = js.mark("step", lambda h, w: (jnp.tanh(h @ w), None))
        return jax.lax.scan(step, x, p, reverse=True)[0]

    h = X
    rows = {}
    for k in reversed(range(N)):
        h = jnp.tanh(h @ w[k])
        rows[k] = h
    for k in (0, 1, N - 1):
        close(js.slice(backwards, w, X, end=f"step[{k}]")(X)[0], rows[k])
    close(js.slice(backwards, w, X, start="step[1]:output", end=None)((rows[1], None)), rows[0])

    def counted(p, x):
        double = js.mark("double", lambda h: h * p)
        return jax.lax.fori_loop(0, 4, lambda i, h: double(h), x)

    close(js.slice(counted, 1.5, X, end="double[2]")(X), X * 1.5**3)


def test_nested_scans_nest_their_iterations():
    w = jax.random.normal(jax.random.key(4), (3, 2, 4, 4)) * 0.5

    def nested(p, x):
        inner_cell = js.mark("cell", lambda h, w: (jnp.tanh(h @ w), None))

        @js.mark("outer")
        def outer(h, ws):
            return jax.lax.scan(inner_cell, h, ws)[0]

        return jax.lax.scan(lambda h, ws: (outer(h, ws), None), x, p)[0]

    names = [b.name for b in js.boundaries(nested, w, X)]
    assert names == ["outer[:]", "outer[:]/cell[:]"]
    h, seen = X, {}
    for i in range(3):
        for j in range(2):
            h = jnp.tanh(h @ w[i, j])
            seen[i, j] = h
    close(js.slice(nested, w, X, end="outer[1]/cell[0]")(X)[0], seen[1, 0])
    close(js.slice(nested, w, X, end="outer[-1]/cell[-1]")(X)[0], seen[2, 1])
    got = js.intermediates(nested, w, X, names=["outer[:]/cell[1]", "outer[:]/cell[:]"])
    close(got["outer[:]/cell[1]"][0], jnp.stack([seen[i, 1] for i in range(3)]))
    want = jnp.stack([jnp.stack([seen[i, j] for j in range(2)]) for i in range(3)])
    close(got["outer[:]/cell[:]"][0], want)


def test_boundaries_in_a_cond_branch_are_refused_clearly():
    branch = js.mark("branch", lambda h: h * 2)

    def model(p, x):
        return jax.lax.cond(x.sum() > p, branch, lambda h: h, x)

    with pytest.raises(js.BoundaryInLoopError, match="cond"):
        js.slice(model, 0.0, X, end="branch")


# --------------------------------------------------------------------------- transformer starts


class TBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask, pos):
        h = nn.Dense(D, name="attn")(x + pos)
        h = jnp.where(mask[..., None], h, 0.0)
        return x + nn.Dense(D, name="mlp")(jnp.tanh(h)), None


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        mask = tokens > 0
        pos = jnp.arange(tokens.shape[1])[None, :, None] * 0.1
        x = nn.Embed(10, D, name="embed")(tokens)
        stack = nn.scan(
            TBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=N,
        )
        x, _ = stack(name="layers")(x, mask, pos)
        return nn.Dense(10, name="head")(x)


TOKENS = jnp.array([[1, 2, 0, 3], [4, 0, 5, 6]])


def tiny_lm_layers(variables, tokens):
    """Each layer's output, by hand."""
    p = variables["params"]
    mask, pos = tokens > 0, jnp.arange(tokens.shape[1])[None, :, None] * 0.1
    x = p["embed"]["embedding"][tokens]
    outs = []
    for k in range(N):
        row = jax.tree_util.tree_map(lambda a, k=k: a[k], p["layers"])
        h = (x + pos) @ row["attn"]["kernel"] + row["attn"]["bias"]
        h = jnp.where(mask[..., None], h, 0.0)
        x = x + jnp.tanh(h) @ row["mlp"]["kernel"] + row["mlp"]["bias"]
        outs.append(x)
    return outs


def test_a_block_start_takes_its_call_arguments_and_the_lifted_module_its_callers():
    model = TinyLM()
    variables = model.init(jax.random.key(5), TOKENS)
    outs = tiny_lm_layers(variables, TOKENS)
    mask, pos = TOKENS > 0, jnp.arange(4)[None, :, None] * 0.1
    tail = js.slice(model, variables, TOKENS, start="layers[2]", end="layers[3]")
    y, _ = tail(outs[1], mask, pos)  # the block is called as block(x, mask, pos)
    close(y, outs[3])
    whole = js.slice(model, variables, TOKENS, start="layers", end="layers")
    y, none = whole(variables["params"]["embed"]["embedding"][TOKENS], mask, pos)
    assert none is None
    close(y, outs[-1])


def test_the_model_inputs_as_a_second_start_recompute_positions_and_masks():
    model = TinyLM()
    variables = model.init(jax.random.key(6), TOKENS)
    outs = tiny_lm_layers(variables, TOKENS)
    sub = js.slice(model, variables, TOKENS, start=["layers[2]", None], end=None)
    close(sub(outs[1], TOKENS), model.apply(variables, TOKENS))
    # Only derived values missing: the error suggests the model's inputs as a start.
    with pytest.raises(js.MissingInputError) as info:
        js.slice(model, variables, TOKENS, start="layers[2]:output", end=None)
    assert "start=['layers[2]:output', None]" in str(info.value)
    fixed = js.slice(model, variables, TOKENS, start=["layers[2]:output", None], end=None)
    close(fixed((outs[2], None), TOKENS), model.apply(variables, TOKENS))


class PosTBlock(nn.Module):
    @nn.compact
    def __call__(self, x, pos):
        h = nn.Dense(D, name="attn")(x + pos[..., None])
        return x + nn.Dense(D, name="mlp")(jnp.tanh(h)), None


class PosLM(nn.Module):
    """Every layer is passed the model's own position input (Griffin's `segment_pos`)."""

    @nn.compact
    def __call__(self, tokens, pos):
        x = nn.Embed(10, D, name="embed")(tokens)
        stack = nn.scan(
            PosTBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast,),
            length=N,
        )
        x, _ = stack(name="layers")(x, pos)
        return nn.Dense(10, name="head")(x)


def test_the_model_inputs_as_a_second_start_give_an_input_every_layer_is_passed():
    model, pos = PosLM(), jnp.array([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    variables = model.init(jax.random.key(7), TOKENS, pos)
    p = variables["params"]
    x = p["embed"]["embedding"][TOKENS]
    for k in range(2):  # layers 0 and 1, by hand
        row = jax.tree_util.tree_map(lambda a, k=k: a[k], p["layers"])
        x = PosTBlock().apply({"params": row}, x, pos)[0]
    sub = js.slice(model, variables, TOKENS, pos, start=["layers[2]", None], end=None)
    close(sub(x, TOKENS, pos), model.apply(variables, TOKENS, pos))


# --------------------------------------------------------------------------- other views


def test_interpreter_keeps_the_scan_and_stacks_what_its_body_emits(scanned):
    model, variables = scanned
    want = captured(variables)

    class Record(js.Interpreter):
        def boundary(self, name, side, value):
            if side == "output":
                self.emit(name, value)
            return value

    fn = Record().build(model, variables, X)
    out, seen = fn(variables, X)
    close(out, want["logits"])
    for k in range(N):
        close(seen["layers[:]/attn"][k], want[f"layers[{k}]/attn"])
        close(seen["layers[:]"][0][k], want[f"layers[{k}]"])
    # One loop in the program, run N times: nothing is written out.
    jaxpr = jax.make_jaxpr(fn)(variables, X)
    scans = [e for e in iter_eqns(jaxpr) if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [N]
    assert count_primitive(jaxpr, "dot_general") == 4


def test_an_unrolling_interpreter_hooks_every_iteration_by_name(scanned):
    model, variables = scanned
    want = captured(variables)

    class Record(js.Interpreter):
        unroll = True

        def boundary(self, name, side, value):
            if side == "output":
                self.emit(name, value)
            return value

    out, seen = Record().build(model, variables, X)(variables, X)
    close(out, want["logits"])
    for k in range(N):
        close(seen[f"layers[{k}]/attn"], want[f"layers[{k}]/attn"])
        close(seen[f"layers[{k}]"][0], want[f"layers[{k}]"])


def test_interpreter_replaces_a_value_in_every_iteration(scanned):
    model, variables = scanned

    class ZeroMlp(js.Interpreter):
        def boundary(self, name, side, value):
            return jnp.zeros_like(value) if name == "layers[:]/mlp" else value

    out, _ = ZeroMlp().build(model, variables, X)(variables, X)
    # Oracle: with every mlp output zero, each block is the identity on its carry.
    p = variables["params"]
    h = X @ p["embed"]["kernel"] + p["embed"]["bias"]
    close(out, h @ p["head"]["kernel"] + p["head"]["bias"])


def test_statistics_and_coverage_take_per_iteration_names(scanned):
    from jaxslice.observe import ActivationStats

    model, variables = scanned
    want = captured(variables)
    stats = ActivationStats(model, variables, X, names=["layers[:]/attn", "layers[2]/mlp"])
    stats.update(X)
    got = stats.result()
    stacked = jnp.stack([want[f"layers[{k}]/attn"] for k in range(N)])
    np.testing.assert_allclose(got["layers[:]/attn"]["max"], float(stacked.max()), rtol=1e-5)
    np.testing.assert_allclose(
        got["layers[2]/mlp"]["mean"], float(want["layers[2]/mlp"].mean()), rtol=1e-4, atol=1e-6
    )
    tracker = js.coverage.Tracker(model, variables, X, layers=["layers[3]/attn", "embed"])
    assert tracker.layers == ["embed", "layers[3]/attn"]  # in call order


class AttnBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))  # a constant inside the body
        return x + nn.MultiHeadDotProductAttention(2, name="attn")(x, x, mask=mask), None


class AttnStack(nn.Module):
    unrolled: bool = False

    @nn.compact
    def __call__(self, x):
        if self.unrolled:
            for k in range(3):
                x, _ = AttnBlock(name=f"layers_{k}")(x)
            return x
        stack = nn.scan(
            AttnBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        return stack(name="layers")(x, None)[0]


def test_attention_with_a_constant_mask_in_a_scan_body():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 4)), jnp.float32)
    model = AttnStack()
    variables = model.init(jax.random.key(7), x)
    names = [b.name for b in js.boundaries(model, variables, x)]
    assert "layers/attn" not in names  # no call outside the loop but the loop itself
    assert "layers[:]/attn" in names
    p = dict(variables["params"])
    stacked = p.pop("layers")
    for k in range(3):
        p[f"layers_{k}"] = jax.tree_util.tree_map(lambda a, k=k: a[k], stacked)
    _, state = AttnStack(unrolled=True).apply({"params": p}, x, capture_intermediates=True)
    want = state["intermediates"]["layers_1"]["attn"]["__call__"][0]
    close(js.slice(model, variables, x, end="layers[1]/attn")(x), want)
