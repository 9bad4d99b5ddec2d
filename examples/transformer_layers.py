"""Look inside a scanned transformer, one layer at a time: logit lens, patching, fine-tuning.

Per-iteration boundaries of scanned layer stacks, on a small byte-level decoder-only
transformer trained on the source code of a few Python standard-library modules (read with
``inspect.getsource``: no download). Its blocks are one ``nn.scan`` (linen) or an
``nnx.vmap``-made stack run by ``nnx.scan`` (NNX), so their parameters are stacked arrays
and the model runs one loop; jaxslice still names every iteration: ``layers[2]``,
``layers[-1]``, ``layers[2]/attn``, and ``layers[:]`` for every iteration stacked.

1. train the linen model (and the same architecture in NNX) for a few hundred steps;
2. logit lens: one ``js.intermediates(..., names=["layers[:]"])`` call gives the residual
   stream after every layer, and the model's own head (final LayerNorm + unembedding,
   sliced with ``start="head"``) turns each into next-byte predictions; the last layer's
   lens loss is the model's loss;
3. activation patching: ``end="layers[k]"`` and ``start="layers[k]:output"`` cut the model
   after layer k; the residual of prompt A at the last position is patched into the run of
   prompt B, and the tail shows how much of A's prediction that carries;
4. fine-tuning the last two layers on another module's source: features at ``layers[-3]``
   are computed once, the slice ``start="layers[-2]"`` is trained with optax (its stacked
   parameters stay whole; the rows of the earlier layers get zero gradient) and merged back
   with ``sub.merge``;
5. the NNX model: logit lens and per-layer slices checked against running the stacked
   layers by hand.

Run it with ``python examples/transformer_layers.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jaxslice as js

PRETRAIN_MODULES = ("json.decoder", "json.encoder", "textwrap", "argparse")
FINETUNE_MODULE = "difflib"
VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    context: int = 64


# --------------------------------------------------------------------------- linen model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual.

    Written for ``nn.scan``: it takes and returns ``(carry, per-step value)``."""

    cfg: Config

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(self.cfg.n_heads, name="attn")(h, h, mask=mask)
        h = nn.Dense(4 * self.cfg.d_model, name="up")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(self.cfg.d_model, name="down")(nn.gelu(h)), None


class Head(nn.Module):
    """Final LayerNorm and unembedding."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(VOCAB, name="unembed")(nn.LayerNorm(name="ln_f")(x))


class CharLM(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.context, cfg.d_model))
        x = nn.Embed(VOCAB, cfg.d_model, name="embed")(tokens) + pos[: tokens.shape[1]]
        layers = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=cfg.n_layers,
        )
        x, _ = layers(cfg, name="layers")(x, None)
        return Head(name="head")(x)


# --------------------------------------------------------------------------- NNX model


class NNXBlock(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.n_heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class NNXHead(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.unembed = nnx.Linear(d, VOCAB, rngs=rngs)

    def __call__(self, x):
        return self.unembed(self.ln_f(x))


class NNXCharLM(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.context, cfg.d_model)))

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            return NNXBlock(cfg, rngs=rngs)

        self.layers = make_layers(rngs)  # one NNXBlock whose parameters are stacked
        self.head = NNXHead(cfg.d_model, rngs=rngs)
        self.n_layers = cfg.n_layers

    def embed_tokens(self, tokens):
        return self.embed(tokens) + self.pos[...][: tokens.shape[1]]

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run_layers(layer, x):
            return layer(x)

        return self.head(run_layers(self.layers, self.embed_tokens(tokens)))


@nnx.jit
def nnx_predict(model: NNXCharLM, tokens):
    return model(tokens)


@nnx.jit
def nnx_layers_by_hand(model: NNXCharLM, tokens):
    """Every layer's output, running row k of the stacked parameters as an ordinary block."""
    graphdef, state = nnx.split(model.layers)
    x, outs = model.embed_tokens(tokens), []
    for k in range(model.n_layers):
        x = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k], state))(x)
        outs.append(x)
    return jnp.stack(outs)


@nnx.jit
def nnx_head(model: NNXCharLM, x):
    return model.head(x)


# --------------------------------------------------------------------------- data, training


def source_bytes(module_names) -> np.ndarray:
    text = "\n\n".join(inspect.getsource(importlib.import_module(n)) for n in module_names)
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def windows(data: np.ndarray, starts, t: int):
    """Inputs and next-byte targets of the windows starting at `starts`."""
    idx = np.asarray(starts)[:, None] + np.arange(t + 1)
    chunk = data[idx]
    return jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])


def random_windows(data, n: int, t: int, rng: np.random.Generator):
    return windows(data, rng.integers(0, len(data) - t - 1, n), t)


@jax.jit
def next_byte_loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_step(apply_fn, tx):
    """One optax step on ``apply_fn(variables, x)``: (variables, opt_state, loss)."""

    @jax.jit
    def step(variables, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda v: next_byte_loss(apply_fn(v, x), y))(variables)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state, loss

    return step


def fit(apply_fn, variables, batches, steps: int, lr: float, desc: str):
    """Adam on `variables`; `batches()` gives (x, y). Returns (variables, first, last loss)."""
    tx = optax.adam(lr)
    step = make_step(apply_fn, tx)
    opt_state = tx.init(variables)
    losses = []
    bar = tqdm(range(steps), desc=desc, unit="step", leave=False, disable=None)
    for _ in bar:
        variables, opt_state, loss = step(variables, opt_state, *batches())
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return variables, float(np.mean(losses[:5])), float(np.mean(losses[-5:]))


def pretrained(cfg: Config, steps: int, seed: int, rng: np.random.Generator):
    """A `CharLM` trained `steps` steps on the source of `PRETRAIN_MODULES` (the first 90%
    of it). Returns (model, variables, training bytes, held-out (x, y) windows, (first,
    last loss))."""
    t = cfg.context
    data = source_bytes(PRETRAIN_MODULES)
    train, held_out = data[: int(0.9 * len(data))], data[int(0.9 * len(data)) :]
    x_eval, y_eval = windows(held_out, np.linspace(0, len(held_out) - t - 2, 32).astype(int), t)
    model = CharLM(cfg)
    variables = jax.jit(model.init)(jax.random.key(seed), x_eval[:1])
    variables, first, last = fit(
        model.apply, variables, lambda: random_windows(train, 32, t, rng), steps, 3e-3, "train"
    )
    return model, variables, train, (x_eval, y_eval), (first, last)


# One loss per layer, for logits stacked on a leading layer axis (the logit lens).
per_layer_loss = jax.jit(jax.vmap(next_byte_loss, in_axes=(0, None)))


@nnx.jit
def nnx_train_step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: next_byte_loss(m(x), y))(model)
    opt.update(model, grads)
    return loss


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test mode: few steps")
    parser.add_argument("--steps", type=int, default=None, help="default 250 (20 with --quick)")
    parser.add_argument(
        "--finetune-steps", type=int, default=None, help="default 100 (20 with --quick)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (20 if args.quick else 250)
    ft_steps = (
        args.finetune_steps if args.finetune_steps is not None else (20 if args.quick else 100)
    )
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    cfg = Config()
    T, L = cfg.context, cfg.n_layers

    data = source_bytes(PRETRAIN_MODULES)
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]
    print(
        f"pre-training text: {len(data):,} bytes of {', '.join(PRETRAIN_MODULES)} "
        f"(last 10% held out)"
    )
    x_eval, y_eval = windows(held_out, np.linspace(0, len(held_out) - T - 2, 32).astype(int), T)

    # 1. Train the linen model: the blocks are one nn.scan, their parameters stacked.
    model = CharLM(cfg)
    predict = jax.jit(model.apply)
    variables = jax.jit(model.init)(jax.random.key(args.seed), x_eval[:1])
    variables, first, last = fit(
        model.apply,
        variables,
        lambda: random_windows(train, args.batch_size, T, rng),
        steps,
        3e-3,
        "train linen",
    )
    model_loss = float(next_byte_loss(predict(variables, x_eval), y_eval))
    print(
        f"linen model: {steps} steps, train loss {first:.3f} -> {last:.3f}, held-out {model_loss:.3f}"
    )
    print(js.boundaries(model, variables, x_eval))

    # 2. Logit lens: every layer's residual stream from one call, read out with the head.
    inter = js.intermediates(model, variables, x_eval, names=["layers[0]:input", "layers[:]"])
    resid, _ = inter["layers[:]"]  # a Block returns (x, None): stacked, (L, batch, T, d_model)
    assert resid.shape == (L, *x_eval.shape, cfg.d_model), resid.shape
    head = js.slice(model, variables, x_eval, start="head")
    lens = [float(next_byte_loss(head(inter["layers[0]:input"]), y_eval))]
    lens_logits = head(resid.reshape(L * len(x_eval), T, -1)).reshape(L, *x_eval.shape, -1)
    lens += [float(v) for v in per_layer_loss(lens_logits, y_eval)]
    np.testing.assert_allclose(lens[-1], model_loss, rtol=1e-5)

    # 3. Activation patching: cut after layer k, patch A's last position into B's run.
    #    The prompts differ in one byte (the kind of quote that opens a string).
    suffix_a, suffix_b = (
        '        raise ValueError("invalid option',
        "        raise ValueError('invalid option",
    )
    end = split + int(np.flatnonzero(held_out[T:] == ord("\n"))[0]) + T + 1
    prefix = data[end - (T - len(suffix_a)) : end]
    prompts = jnp.asarray(
        np.stack(
            [
                np.concatenate([prefix, np.frombuffer(s.encode(), np.uint8)])
                for s in (suffix_a, suffix_b)
            ]
        )
    )
    (where,) = np.flatnonzero(prompts[0] != prompts[1]) - T  # position counted from the end
    full = predict(variables, prompts)
    logits_a, logits_b = full[0, -1], full[1, -1]
    recovered = []
    for k in range(L):
        before = js.slice(model, variables, prompts, end=f"layers[{k}]")
        after = js.slice(model, variables, prompts, start=f"layers[{k}]:output")
        h, extra = before(prompts)  # the block's output (x, None), for A and B
        np.testing.assert_allclose(after((h, extra)), full, atol=1e-4)  # no patch: the model
        patched = h.at[1, -1].set(h[0, -1])  # B's run with A's residual at the last position
        out = after((patched[1:], extra))[0, -1]
        if k == L - 1:  # after the last layer, only the head is left: A's logits exactly
            np.testing.assert_allclose(out, logits_a, atol=1e-4)
        recovered.append(
            1 - float(jnp.linalg.norm(out - logits_a) / jnp.linalg.norm(logits_b - logits_a))
        )
    print("\nlogit lens: held-out loss of the head applied to each layer's output;")
    print(
        f"patching: prompts A and B differ at position {where} ({suffix_a.strip()!r} vs "
        f"{suffix_b.strip()!r}); share of the\n"
        "change from B's to A's last-position logits made by patching A's last position into B"
    )
    print("  after      lens loss  patched")
    print(f"  embedding  {lens[0]:9.3f}        -")
    for k in range(L):
        print(f"  layers[{k}]  {lens[k + 1]:9.3f}  {recovered[k]:7.2f}")
    print(f"  (the model's own held-out loss: {model_loss:.3f})")
    top = lambda z: repr(chr(int(jnp.argmax(z))))
    print(f"  next byte after prompt A: {top(logits_a)}, after prompt B: {top(logits_b)}")

    # 4. Fine-tune the last two layers on another module's source, from cached features.
    ft = source_bytes([FINETUNE_MODULE])
    ft_split = int(0.9 * len(ft))
    n_windows = 64 if args.quick else 512
    x_ft, y_ft = random_windows(ft[:ft_split], n_windows, T, rng)
    x_ft_eval, y_ft_eval = windows(
        ft[ft_split:], np.linspace(0, len(ft) - ft_split - T - 2, 32).astype(int), T
    )
    x_both = jnp.concatenate([x_ft, x_ft_eval])
    base = js.slice(model, variables, x_both, end="layers[-3]")
    feats, _ = base(x_both)  # computed once: the first L - 2 layers never run again
    f_train, f_eval = feats[:n_windows], feats[n_windows:]
    tail = js.slice(model, variables, x_both, start="layers[-2]")  # input: layers[-3]'s output
    kernel = tail.variables["params"]["layers"]["up"]["kernel"]
    print(
        f"\nslice start='layers[-2]': its variables hold the stacked parameters whole "
        f"(layers/up/kernel {tuple(kernel.shape)}); the rows of layers 0..{L - 3} get zero gradient"
    )
    eval_before = float(next_byte_loss(predict(variables, x_ft_eval), y_ft_eval))

    def ft_batch():
        idx = rng.choice(n_windows, args.batch_size, replace=False)
        return f_train[idx], y_ft[idx]

    trained, first, last = fit(tail.apply, tail.variables, ft_batch, ft_steps, 1e-3, "fine-tune")
    new = tail.merge(variables, trained)
    eval_after = float(next_byte_loss(predict(new, x_ft_eval), y_ft_eval))
    print(
        f"fine-tuned layers[-2:] + head on cached layers[-3] features of {FINETUNE_MODULE}: "
        f"{ft_steps} steps, train loss {first:.3f} -> {last:.3f}; "
        f"held-out {FINETUNE_MODULE} loss of the full model {eval_before:.3f} -> {eval_after:.3f}"
    )
    np.testing.assert_allclose(
        predict(new, x_ft_eval), tail.apply(trained, f_eval), atol=1e-4, rtol=1e-4
    )
    old_layers = jax.tree_util.tree_leaves_with_path(variables["params"]["layers"])
    new_layers = dict(jax.tree_util.tree_leaves_with_path(new["params"]["layers"]))
    frozen = all(np.array_equal(a[: L - 2], new_layers[p][: L - 2]) for p, a in old_layers)
    tuned = all(not np.array_equal(a[L - 2 :], new_layers[p][L - 2 :]) for p, a in old_layers)
    embed_kept = new["params"]["embed"]["embedding"] is variables["params"]["embed"]["embedding"]
    print(
        f"stacked rows of layers 0..{L - 3} unchanged: {frozen}; rows {L - 2}..{L - 1} "
        f"changed: {tuned}; embedding untouched: {embed_kept}"
    )
    assert frozen and tuned and embed_kept
    assert last < first and eval_after < eval_before, (first, last, eval_before, eval_after)

    # 5. The same architecture in NNX (nnx.vmap-made stack, nnx.scan over it).
    nnx_model = NNXCharLM(cfg, rngs=nnx.Rngs(args.seed))
    opt = nnx.Optimizer(nnx_model, optax.adam(3e-3), wrt=nnx.Param)
    bar = tqdm(range(steps), desc="train NNX", unit="step", leave=False, disable=None)
    for _ in bar:
        loss = nnx_train_step(nnx_model, opt, *random_windows(train, args.batch_size, T, rng))
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    logits = nnx_predict(nnx_model, x_eval)
    nnx_loss = float(next_byte_loss(logits, y_eval))
    resid = js.intermediates(nnx_model, x_eval, names=["layers[:]"])["layers[:]"]  # (L, ...)
    lens_logits = nnx_head(nnx_model, resid.reshape(L * len(x_eval), T, -1))
    nnx_lens = [float(v) for v in per_layer_loss(lens_logits.reshape(L, *x_eval.shape, -1), y_eval)]
    np.testing.assert_allclose(nnx_lens[-1], nnx_loss, rtol=1e-5)
    # Each layer's slice against the stacked layers run by hand, row by row.
    by_hand = nnx_layers_by_hand(nnx_model, x_eval)
    np.testing.assert_allclose(resid, by_hand, atol=1e-4)
    for k in range(L):
        upto = js.slice(nnx_model, x_eval, end=f"layers[{k}]")  # an nnx.Module
        np.testing.assert_allclose(upto(x_eval), by_hand[k], atol=1e-4)
    rest = js.slice(nnx_model, x_eval, start="layers[-2]")  # input: layers[-3]'s output
    np.testing.assert_allclose(rest(resid[L - 3]), logits, atol=1e-4)
    print(
        f"\nNNX model: held-out loss {nnx_loss:.3f}; logit lens per layer "
        + ", ".join(f"{v:.3f}" for v in nnx_lens)
        + "\n  layers[k] slices match the stacked layers run by hand; "
        + "start='layers[-2]' continues from layers[-3]'s output to the model's logits"
    )
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
