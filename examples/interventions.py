"""Interventions on a scanned transformer with `js.edit`: patch, steer, splice, adapt.

The model is the small byte-level transformer of ``transformer_layers.py`` (its blocks
one ``nn.scan`` named ``layers``), trained here on the source code of a few Python
standard-library modules (no download). Every intervention is an edit of that one model,
compiled as one program, with the loop kept as one scan:

1. activation patching of every layer in one call: a call-time input at ``layers[:]``
   (one row per layer) replaces prompt B's residual stream by prompt A's after layer k;
   ``jax.vmap`` over k runs all layers' patches at once. Checked against the unpatched
   runs (a zero mask gives B's logits, patching every position gives A's);
2. a steering vector added after one layer (``insert_after("layers[k]", ...)`` with a
   call-time input), with the change in the next-byte distribution printed;
3. a sparse autoencoder trained on cached ``layers[k]`` outputs (``js.intermediates``)
   and spliced in place of the residual stream, reporting the loss it adds (as SAE work
   does), beside zero-ablating that layer's output;
4. low-rank residual adapters inserted at ``layers[:]/down`` (one per layer, stacked like
   the model's own parameters), fine-tuned on another module's source, then removed:
   the model's own weights never change.

Run it with ``python examples/interventions.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm
from transformer_layers import (
    FINETUNE_MODULE,
    Config,
    fit,
    next_byte_loss,
    pretrained,
    random_windows,
    source_bytes,
    windows,
)

import jaxslice as js

L1 = 1e-2  # the sparse autoencoder's sparsity penalty


class SparseAutoencoder(nn.Module):
    """ReLU dictionary of `features` directions: ``decode(relu(encode(x - b) ))``."""

    features: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        b = self.param("b_dec", nn.initializers.zeros, (d,))
        codes = nn.relu(nn.Dense(self.features, name="encode")(x - b))
        return nn.Dense(d, name="decode")(codes) + b, codes


class LowRankAdapter(nn.Module):
    """``h + up(down(h))``, rank `rank`; `up` starts at zero, so it starts as the identity."""

    rank: int = 4

    @nn.compact
    def __call__(self, h):
        down = nn.Dense(self.rank, use_bias=False, name="down")(h)
        up = nn.Dense(h.shape[-1], use_bias=False, kernel_init=nn.initializers.zeros, name="up")
        return h + up(down)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test mode: few steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps, sae_steps, ft_steps = (20, 30, 20) if args.quick else (300, 400, 150)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    cfg = Config()
    T, L, d = cfg.context, cfg.n_layers, cfg.d_model

    model, variables, train, (x_eval, y_eval), (first, last) = pretrained(
        cfg, steps, args.seed, rng
    )
    predict = jax.jit(model.apply)
    clean_loss = float(next_byte_loss(predict(variables, x_eval), y_eval))
    print(f"model: {L} scanned layers, trained {steps} steps, held-out loss {clean_loss:.3f}")

    # 1. Activation patching of every layer, one vmapped call. Prompts A and B differ in
    #    one byte; a call-time input at layers[:] holds A's residual after each layer, and
    #    a mask (one row per layer, per position) says where B's run takes it.
    a, b = 'raise ValueError("bad option', "raise ValueError('bad option"
    prompts = jnp.asarray([[ord(c) for c in s.rjust(T)] for s in (a, b)])
    resid_a = js.intermediates(model, variables, prompts[:1], names=["layers[:]"])["layers[:]"][0]
    patch = js.edit(model, variables, prompts[1:]).insert_after(
        "layers[:]",
        lambda out, new, mask: (jnp.where(mask[None, :, None], new, out[0]), out[1]),
        inputs={
            "new": jax.ShapeDtypeStruct((L, 1, T, d), jnp.float32),
            "mask": jax.ShapeDtypeStruct((L, T), jnp.bool_),
        },
        name="patch",
    )
    patched = patch.build()
    logits_a, logits_b = predict(variables, prompts)[:, -1]
    no_mask = jnp.zeros((L, T), bool)
    np.testing.assert_allclose(
        patched(prompts[1:], new=resid_a, mask=no_mask)[0, -1], logits_b, atol=1e-4
    )
    everywhere = no_mask.at[0].set(True)  # after layer 0, all of A: the rest is A's run
    np.testing.assert_allclose(
        patched(prompts[1:], new=resid_a, mask=everywhere)[0, -1], logits_a, atol=1e-4
    )
    last_position = jax.vmap(lambda k: no_mask.at[k, -1].set(True))(jnp.arange(L))
    sweep = jax.jit(jax.vmap(lambda m: patched(prompts[1:], new=resid_a, mask=m)[0, -1]))
    outs = sweep(last_position)  # (L, vocab): every layer's patch in one program
    share = 1 - jnp.linalg.norm(outs - logits_a, axis=-1) / jnp.linalg.norm(logits_b - logits_a)
    print("\n1. patching A's last position into B after layer k (share of B->A logit change):")
    print("   " + "  ".join(f"layers[{k}] {float(s):.2f}" for k, s in enumerate(share)))

    # 2. A steering vector after one layer: the mean residual difference between
    #    windows of the text that follow a double quote and those that follow a single one.
    k = L // 2
    starts = rng.integers(0, len(train) - T - 1, 4096)
    after_double = [s for s in starts if train[s + T - 1] == ord('"')][:64]
    after_single = [s for s in starts if train[s + T - 1] == ord("'")][:64]

    def at_k(xs):
        """The residual stream after layer k (a block returns ``(x, None)``)."""
        return js.intermediates(model, variables, xs, names=[f"layers[{k}]"])[f"layers[{k}]"][0]

    def mean_last(starts_):
        return at_k(windows(train, starts_, T)[0])[:, -1].mean(0)

    v = mean_last(after_double) - mean_last(after_single)  # (d_model,): added everywhere
    steer = js.edit(model, variables, prompts[1:]).insert_after(
        f"layers[{k}]",
        lambda out, v: (out[0] + v, out[1]),
        inputs={"v": jax.ShapeDtypeStruct((d,), jnp.float32)},
    )
    steered = steer.build()
    print(f"\n2. steering after layers[{k}] by a multiple of v: next-byte distribution after B")
    for scale in (0.0, 1.0, 2.0):
        p = jax.nn.softmax(steered(prompts[1:], v=scale * v)[0, -1])
        top = jnp.argsort(-p)[:4]
        shown = ", ".join(f"{chr(int(t))!r} {float(p[t]):.2f}" for t in top)
        print(f"   {scale:.0f} x v: {shown}")

    # 3. A sparse autoencoder on cached layers[k] outputs, spliced into the model.
    x_sae, _ = random_windows(train, 64 if args.quick else 512, T, rng)
    acts = at_k(x_sae).reshape(-1, d)
    sae = SparseAutoencoder(8 * d)
    sae_vars = sae.init(jax.random.key(1), acts[:1])
    tx = optax.adam(1e-3)

    @jax.jit
    def sae_step(params, opt_state, batch):
        def loss(p):
            recon, codes = sae.apply(p, batch)
            return jnp.mean((recon - batch) ** 2) + L1 * jnp.mean(jnp.abs(codes).sum(-1))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = tx.init(sae_vars)
    for _ in tqdm(range(sae_steps), desc="train SAE", unit="step", leave=False, disable=None):
        batch = acts[rng.integers(0, len(acts), 256)]
        sae_vars, opt_state, _ = sae_step(sae_vars, opt_state, batch)
    splice = js.edit(model, variables, x_eval).insert_after(
        f"layers[{k}]", lambda out: (sae.apply(sae_vars, out[0])[0], out[1]), name="sae"
    )
    spliced_loss = float(next_byte_loss(splice.build()(x_eval), y_eval))
    ablate = js.edit(model, variables, x_eval).insert_after(
        f"layers[{k}]", lambda out: (jnp.zeros_like(out[0]), out[1])
    )
    ablated_loss = float(next_byte_loss(ablate.build()(x_eval), y_eval))
    codes = sae.apply(sae_vars, at_k(x_eval).reshape(-1, d))[1]
    print(
        f"\n3. SAE ({8 * d} features, {float((codes > 0).sum(-1).mean()):.1f} active per token) "
        f"spliced after layers[{k}]: held-out loss {clean_loss:.3f} -> {spliced_loss:.3f} "
        f"(+{spliced_loss - clean_loss:.3f}; zero-ablating that layer's output: {ablated_loss:.3f})"
    )

    # 4. Low-rank adapters in every layer, fine-tuned, then removed.
    ft = source_bytes([FINETUNE_MODULE])
    ft_train, ft_eval = ft[: int(0.9 * len(ft))], ft[int(0.9 * len(ft)) :]
    x_ft_eval, y_ft_eval = windows(ft_eval, np.linspace(0, len(ft_eval) - T - 2, 32).astype(int), T)
    g = js.edit(model, variables, x_eval).insert_after(
        "layers[:]/down", LowRankAdapter(), key=jax.random.key(2), name="adapter"
    )
    adapted = g.build()
    full = adapted.variables
    rows = full["params"]["adapter"]
    print(
        "\n4. adapters at layers[:]/down: variables stacked per layer "
        f"{jax.tree_util.tree_map(lambda x: tuple(x.shape), rows)}"
    )

    def adapter_logits(adapter_params, x):
        return adapted.apply({"params": {**full["params"], "adapter": adapter_params}}, x)

    before = float(next_byte_loss(adapter_logits(rows, x_ft_eval), y_ft_eval))
    rows, first, last = fit(
        adapter_logits,
        rows,
        lambda: random_windows(ft_train, 32, T, rng),
        ft_steps,
        3e-3,
        "adapters",
    )
    after = float(next_byte_loss(adapter_logits(rows, x_ft_eval), y_ft_eval))
    print(
        f"   fine-tuned only the adapters on {FINETUNE_MODULE} ({ft_steps} steps): held-out "
        f"{FINETUNE_MODULE} loss {before:.3f} -> {after:.3f}"
    )
    g.remove("adapter")
    np.testing.assert_allclose(g.build()(x_eval), predict(variables, x_eval), atol=1e-5)
    own = jax.tree_util.tree_leaves(variables)
    assert all(x is y for x, y in zip(jax.tree_util.tree_leaves(g.variables), own, strict=True))
    print("   adapters removed: the model computes exactly what it did; its weights never changed")
    if not args.quick:
        assert after < before, (before, after)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
