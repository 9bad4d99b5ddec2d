"""`js.lens` on a linen scanned stack (`nn.scan` of a block returning ``(h, aux)``).

The oracle is `forward`, the same model written by hand in JAX from the model's own
parameters, with a Python loop over the layers and a hook at every place the lens has a
site: an intervention is written into that hook by hand (``h + v`` in layer 2), and a
read is the value the hook saw. Reads are also checked against `js.intermediates`,
attribution against `jax.grad` of the hand-written forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import (
    assert_trees_all_close,
    iter_eqns,
    random_input,
    random_variables,
)

D, L, B, T = 8, 5, 2, 3


class Block(nn.Module):
    """``h = x + attn(x); h = h + mlp(tanh(h))``, returning ``(h, sum(h))``."""

    @nn.compact
    def __call__(self, x, _):
        h = x + nn.Dense(D, name="attn")(x)
        h = h + nn.Dense(D, name="mlp")(jnp.tanh(h))
        return h, jnp.sum(h, axis=-1)


class LM(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="embed")(x)
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
        x, aux = stack(name="layers")(x, None)
        return nn.Dense(3, name="head")(x), aux


MODEL = LM()
X = random_input(0, (B, T, 4))
X2 = random_input(1, (B, T, 4))
VARIABLES = random_variables(MODEL, X, seed=3)
SITES = [
    "embed",
    "layers[:]",
    "layers[:]#1",
    "layers[:]/attn",
    "layers[:]/attn:input",
    "layers[:]/mlp",
    "head",
]


def no_hook(name: str, k: int | None, value: Any) -> Any:
    return value


def forward(variables: Any, x: Any, hook: Any = no_hook) -> Any:
    """`LM` by hand; ``hook(site, layer, value)`` may change the value at each site
    (``layer`` is None outside the stack)."""
    p = variables["params"]

    def dense(q: Any, h: Any) -> Any:
        return h @ q["kernel"] + q["bias"]

    h = hook("embed", None, dense(p["embed"], x))
    auxes = []
    for k in range(L):
        q = jax.tree_util.tree_map(lambda a, k=k: a[k], p["layers"])
        attn_in = hook("layers[:]/attn:input", k, h)
        a = hook("layers[:]/attn", k, dense(q["attn"], attn_in))
        h2 = h + a  # the residual takes the block's input, not attn's (patched) input
        m = hook("layers[:]/mlp", k, dense(q["mlp"], jnp.tanh(h2)))
        h3 = h2 + m
        aux = jnp.sum(h3, axis=-1)
        h = hook("layers[:]", k, h3)
        auxes.append(hook("layers[:]#1", k, aux))
    return hook("head", None, dense(p["head"], h)), jnp.stack(auxes)


def at(site: str, layer: int | None, change: Any) -> Any:
    """A hook that changes the value of `site` in `layer` (None: every layer, where
    ``change`` takes ``(k, value)``)."""

    def hook(name: str, k: int | None, value: Any) -> Any:
        if name != site:
            return value
        if layer is None:
            return change(k, value)
        return change(value) if k == layer else value

    return hook


def recorded(x: Any, hook: Any = no_hook) -> tuple[Any, dict[str, Any]]:
    """The hand-written forward's output and the value at every site after `hook`
    (stacked over the layers inside the stack)."""
    seen: dict[str, list[Any]] = {}

    def record(name: str, k: int | None, value: Any) -> Any:
        value = hook(name, k, value)
        seen.setdefault(name, []).append(value)
        return value

    out = forward(VARIABLES, x, record)
    return out, {n: v[0] if "[:]" not in n else jnp.stack(v) for n, v in seen.items()}


@pytest.fixture(scope="module")
def lens() -> js.Lens:
    return js.lens(MODEL, VARIABLES, X, sites=SITES)


def vector(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return random_input(100 + seed, shape)


def test_the_hand_written_forward_is_the_model():
    assert_trees_all_close(forward(VARIABLES, X), MODEL.apply(VARIABLES, X))


def test_lens_sites_have_one_iterations_shapes(lens):
    assert list(lens.sites) == SITES
    assert lens.sites["layers[:]"].value.shape == (B, T, D)
    assert lens.sites["layers[:]"].lengths == (L,)
    assert lens.sites["layers[:]"].stacked.shape == (L, B, T, D)
    assert lens.sites["layers[:]#1"].stacked.shape == (L, B, T)
    assert lens.sites["head"].lengths == ()


def test_every_call_is_a_site_by_default():
    every = js.lens(MODEL, VARIABLES, X)
    assert {"embed", "layers[:]", "layers[:]/attn", "layers[:]/mlp", "head"} <= set(every.sites)
    assert_trees_all_close(every(X), MODEL.apply(VARIABLES, X))


def test_a_plain_call_is_the_model(lens):
    assert_trees_all_close(lens(X), MODEL.apply(VARIABLES, X))
    assert_trees_all_close(lens(X2), MODEL.apply(VARIABLES, X2))


@pytest.mark.parametrize("k", [0, 2, -1])
def test_add_at_one_iteration(lens, k):
    v = vector(0, (D,))
    want = forward(VARIABLES, X, at("layers[:]", k % L, lambda h: h + v))
    assert_trees_all_close(lens(X, add={f"layers[{k}]": v}), want)


def test_add_a_vector_at_every_iteration(lens):
    v = vector(1, (D,))
    want = forward(VARIABLES, X, at("layers[:]", None, lambda k, h: h + v))
    assert_trees_all_close(lens(X, add={"layers[:]": v}), want)


def test_add_per_layer_rows_at_every_iteration(lens):
    rows = vector(2, (L, 1, 1, D))
    want = forward(VARIABLES, X, at("layers[:]", None, lambda k, h: h + rows[k]))
    assert_trees_all_close(lens(X, add={"layers[:]": rows}), want)


def test_scale_zero_ablates_attention_in_every_layer(lens):
    want = forward(VARIABLES, X, at("layers[:]/attn", None, lambda k, a: 0.0 * a))
    got = lens(X, scale={"layers[:]/attn": 0.0})
    assert_trees_all_close(got, want)
    assert not np.allclose(got[0], lens(X)[0])


def test_scale_at_the_input_of_a_call_leaves_the_residual_alone(lens):
    want = forward(VARIABLES, X, at("layers[:]/attn:input", 3, lambda h: 0.5 * h))
    assert_trees_all_close(lens(X, scale={"layers[3]/attn:input": 0.5}), want)


def test_set_replaces_one_iterations_value(lens):
    other = recorded(X2)[1]["layers[:]"][2]
    want = forward(VARIABLES, X, at("layers[:]", 2, lambda h: other))
    assert_trees_all_close(lens(X, set={"layers[2]": other}), want)


def test_set_with_a_mask_patches_positions(lens):
    other = recorded(X2)[1]["layers[:]"][1]
    mask = jnp.array([True, False, True])[None, :, None]  # positions 0 and 2
    want = forward(VARIABLES, X, at("layers[:]", 1, lambda h: jnp.where(mask, other, h)))
    got = lens(X, set={"layers[1]": (other, mask)})
    assert_trees_all_close(got, want)
    assert not np.allclose(got[0], lens(X, set={"layers[1]": other})[0])


def test_scale_then_add_then_set_at_one_site(lens):
    v, s = vector(3, (D,)), 0.25
    mask = jnp.array([False, True, False])[None, :, None]
    other = vector(4, (B, T, D))
    by_hand = lambda h: jnp.where(mask, other, h * s + v)  # noqa: E731
    want = forward(VARIABLES, X, at("layers[:]/mlp", 4, by_hand))
    spec = "layers[4]/mlp"
    got = lens(X, set={spec: (other, mask)}, add={spec: v}, scale={spec: s})
    assert_trees_all_close(got, want)


def test_reads_are_the_intermediates_and_the_hand_written_values(lens):
    out, cache = lens(X, read=True)
    want_out, want = recorded(X)
    assert_trees_all_close(out, want_out)
    assert set(cache) == set(SITES)
    for name in SITES:
        assert_trees_all_close(cache[name], want[name])
    got = js.intermediates(
        MODEL, VARIABLES, X, names=["embed", "layers[:]", "layers[:]/attn", "layers[:]/mlp"]
    )
    assert_trees_all_close(cache["layers[:]"], got["layers[:]"][0])
    assert_trees_all_close(cache["layers[:]#1"], got["layers[:]"][1])
    for name in ("embed", "layers[:]/attn", "layers[:]/mlp"):
        assert_trees_all_close(cache[name], got[name])


def test_reads_come_after_the_interventions(lens):
    v = vector(5, (D,))
    hook = at("layers[:]/mlp", 3, lambda m: m + v)
    out, cache = lens(X, add={"layers[3]/mlp": v}, read=["layers[:]/mlp", "layers[3]", "head"])
    want_out, want = recorded(X, hook)
    assert_trees_all_close(out, want_out)
    assert set(cache) == {"layers[:]/mlp", "layers[3]", "head"}
    assert_trees_all_close(cache["layers[:]/mlp"], want["layers[:]/mlp"])
    assert_trees_all_close(cache["layers[3]"], want["layers[:]"][3])
    assert_trees_all_close(cache["head"], want["head"])


def test_a_read_can_be_set_back(lens):
    """A cache entry has the shape `set` takes: patching X's run with X2's values."""
    _, cache = lens(X2, read=["layers[:]"])
    theirs = recorded(X2)[1]["layers[:]"]
    want = forward(VARIABLES, X, at("layers[:]", None, lambda k, h: theirs[k]))
    assert_trees_all_close(lens(X, set={"layers[:]": cache["layers[:]"]}), want)
    # every layer's h from X2, so the head sees X2's (the aux of layer 0 is still X's)
    assert_trees_all_close(want[0], MODEL.apply(VARIABLES, X2)[0])


def test_the_aux_leaf_of_a_block(lens):
    v = vector(6, (B, T))
    want = forward(VARIABLES, X, at("layers[:]#1", 2, lambda aux: aux + v))
    got = lens(X, add={"layers[2]#1": v})
    assert_trees_all_close(got, want)
    assert_trees_all_close(got[0], lens(X)[0])  # h flows on unchanged
    want = forward(VARIABLES, X, at("layers[:]#1", None, lambda k, aux: 0.0 * aux))
    assert_trees_all_close(lens(X, scale={"layers[:]#1": 0.0}), want)


def test_set_at_the_input_of_a_call(lens):
    other = vector(7, (B, T, D))
    want = forward(VARIABLES, X, at("layers[:]/attn:input", 1, lambda h: other))
    assert_trees_all_close(lens(X, set={"layers[1]/attn:input": other}), want)


def test_sites_outside_the_stack(lens):
    v = vector(8, (D,))
    want = forward(VARIABLES, X, at("embed", None, lambda k, h: h + v))
    assert_trees_all_close(lens(X, add={"embed": v}), want)
    want = forward(VARIABLES, X, at("head", None, lambda k, y: 2.0 * y))
    assert_trees_all_close(lens(X, scale={"head": 2.0}), want)


def test_apply_takes_other_variables(lens):
    other = random_variables(MODEL, X, seed=9)
    v = vector(9, (D,))
    want = forward(other, X, at("layers[:]", 2, lambda h: h + v))
    assert_trees_all_close(lens.apply(other, X, add={"layers[2]": v}), want)


@contextlib.contextmanager
def compiled() -> Iterator[list[str]]:
    """The names of the functions XLA compiles inside the block (JAX's public monitoring
    event, recorded once per backend compilation on JAX 0.10 and newer)."""
    names: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_per_layer_patches_compile_once(lens):
    """The iteration index is data: a patch at each layer in turn compiles one program.

    The first call (layer 0) compiles the lens and every small eager operation it needs;
    the calls at layers 1 to L-1, with values of the same shapes and dtypes, compile
    nothing."""
    _, cache = lens(X2, read=["layers[:]"])
    wants = [
        forward(VARIABLES, X, at("layers[:]", k, lambda h, k=k: cache["layers[:]"][k]))
        for k in range(L)
    ]
    fresh = js.lens(MODEL, VARIABLES, X, sites=["layers[:]"])
    with compiled() as first:
        got = [fresh(X, set={"layers[0]": cache["layers[:]"][0]})]
    assert first, "the listener saw no compilation of the lens"
    with compiled() as rest:
        got += [fresh(X, set={f"layers[{k}]": cache["layers[:]"][k]}) for k in range(1, L)]
    assert rest == [], f"compiled again for layers 1..{L - 1}: {rest}"
    for k in range(L):
        assert_trees_all_close(got[k], wants[k])

    with compiled() as first:
        fresh(X, scale={"layers[0]": 0.5})
    with compiled() as rest:
        scaled = [fresh(X, scale={f"layers[{k}]": s}) for k, s in ((1, 0.0), (4, 2.0), (-2, 3.0))]
    assert first and rest == [], rest
    want = forward(VARIABLES, X, at("layers[:]", L - 2, lambda h: 3.0 * h))
    assert_trees_all_close(scaled[-1], want)


def scans(jaxpr: Any) -> list[Any]:
    """The scan equations of a jaxpr, in program order."""
    return [e for e in iter_eqns(jaxpr) if e.primitive.name == "scan"]


def test_a_sweep_is_separate_calls_and_by_hand(lens):
    vs = vector(10, (4, B, T, D))
    got = lens.sweep(X, add={"layers[2]": vs})
    for i in range(4):
        want = forward(VARIABLES, X, at("layers[:]", 2, lambda h, i=i: h + vs[i]))
        assert_trees_all_close(jax.tree_util.tree_map(lambda a, i=i: a[i], got), want)
        assert_trees_all_close(
            jax.tree_util.tree_map(lambda a, i=i: a[i], got), lens(X, add={"layers[2]": vs[i]})
        )


def test_a_sweep_with_reads_and_masks(lens):
    others = recorded(X2)[1]["layers[:]"][3]
    masks = jnp.eye(T, dtype=bool)[:, None, :, None]  # run i patches position i
    news = jnp.broadcast_to(others, (T, B, T, D))
    out, cache = lens.sweep(X, set={"layers[3]": (news, masks)}, read=["layers[4]", "head"])
    for i in range(T):
        hook = at("layers[:]", 3, lambda h, i=i: jnp.where(masks[i], others, h))
        want_out, want = recorded(X, hook)
        assert_trees_all_close(jax.tree_util.tree_map(lambda a, i=i: a[i], out), want_out)
        assert_trees_all_close(cache["layers[4]"][i], want["layers[:]"][4])
        assert_trees_all_close(cache["head"][i], want["head"])


def test_a_sweep_runs_the_iterations_before_its_first_once(lens):
    k, n = 3, 4
    vs = vector(11, (n, B, T, D))
    plain = jax.make_jaxpr(lambda v: lens(X, add={f"layers[{k}]": v}))(vs[0])
    swept = jax.make_jaxpr(lambda v: lens.sweep(X, add={f"layers[{k}]": v}, batch_size=n))(vs)
    assert [e.params["length"] for e in scans(plain)] == [L]
    first, rest = scans(swept)
    assert (first.params["length"], rest.params["length"]) == (k, L - k)
    # iterations 0..k-1 once, unbatched (the carry h is (B, T, D)); the rest for n runs
    assert (B, T, D) in [v.aval.shape for v in first.outvars]
    assert (n, B, T, D) in [v.aval.shape for v in rest.outvars]


def test_attribution_at_every_layer_in_one_backward_pass(lens):
    w = vector(12, (B, T, 3))

    def metric(out: Any) -> Any:
        return jnp.sum(out[0] * w) + 0.1 * jnp.sum(out[1] ** 2)

    zeros = jnp.zeros(lens.sites["layers[:]"].stacked.shape)
    got = jax.grad(lambda a: metric(lens(X, add={"layers[:]": a})))(zeros)

    def by_hand(a: Any) -> Any:
        return metric(forward(VARIABLES, X, at("layers[:]", None, lambda k, h: h + a[k])))

    want = jax.jit(jax.grad(by_hand))(zeros)
    assert_trees_all_close(got, want, atol=1e-4)
    assert float(jnp.abs(want).max()) > 0.0


def test_vmap_over_values_is_a_batch_of_calls(lens):
    vs = vector(13, (3, D))
    got = jax.vmap(lambda v: lens(X, add={"layers[1]/attn": v}))(vs)
    for i in range(3):
        want = forward(VARIABLES, X, at("layers[:]/attn", 1, lambda a, i=i: a + vs[i]))
        assert_trees_all_close(jax.tree_util.tree_map(lambda a, i=i: a[i], got), want)


def test_values_are_checked_against_the_shapes_of_each_call(lens):
    """A lens made at one input shape, called at another: values broadcast against that
    call's values (a per-layer, per-position steering array of the new shape), and a value
    of the old shape is refused."""
    x = random_input(4, (3, 7, 4))
    v = jnp.asarray(np.random.default_rng(0).normal(size=(L, 3, 7, D)), jnp.float32)
    got = lens(x, add={"layers[:]": v})
    want = forward(VARIABLES, x, at("layers[:]", None, lambda k, h: h + v[k]))
    assert_trees_all_close(got, want, atol=1e-5)
    with pytest.raises(js.InputMismatchError, match=r"\(5, 3, 7, 8\)"):
        lens(x, add={"layers[:]": jnp.zeros((L, B, T, D))})


def test_a_sweep_in_chunks_equals_separate_calls(lens):
    """`batch_size` runs a few interventions at a time (one `lax.map`, with a remainder):
    the same outputs and reads as one call per intervention."""
    vs = vector(13, (7, B, T, D))
    out, cache = lens.sweep(X, add={"layers[2]": vs}, read=["layers[3]"], batch_size=3)
    for i in range(7):
        want_out, want = lens(X, add={"layers[2]": vs[i]}, read=["layers[3]"])
        assert_trees_all_close(jax.tree_util.tree_map(lambda a, i=i: a[i], out), want_out)
        assert_trees_all_close(cache["layers[3]"][i], want["layers[3]"])
    by_hand = forward(VARIABLES, X, at("layers[:]", 2, lambda h: h + vs[5]))
    assert_trees_all_close(jax.tree_util.tree_map(lambda a: a[5], out), by_hand, atol=1e-5)
