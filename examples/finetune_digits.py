"""Fine-tune the last block of a CNN on cached features, then write it back.

The transfer-learning round trip with jaxslice, on scikit-learn's bundled 8x8 digits
(no download):

1. train a small Flax linen CNN on digits 0-4 (BatchNorm in train mode, optax adam);
2. slice the backbone (the model's input up to the input of ``block``) and compute its
   features once — they are cached and never recomputed;
3. slice ``block`` + ``head`` (``start="block"``) and fine-tune only that slice on the
   cached features of digits 5-9 (its BatchNorm in train mode, ``mutable=["batch_stats"]``);
4. merge the fine-tuned variables back into the full model with ``sub.merge`` and check
   that the full model now predicts what the fine-tuned slice predicts, and that every
   variable outside the slice is the very same array object as before;
5. save the merged variables with ``flax.serialization`` and load them back.

Run it with ``python examples/finetune_digits.py`` (``--quick`` for a smoke run of a few
seconds, ``--steps N`` to set the number of fine-tuning steps).
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaxslice as js


class Block(nn.Module):
    """A conv + BatchNorm layer, global pooling and a dense layer: the part we fine-tune."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(32, (3, 3), use_bias=False, name="conv")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.relu(nn.Dense(64, name="dense")(x))


class DigitsCNN(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Conv(16, (3, 3), name="conv1")(x))  # 8x8x16
        x = nn.Conv(32, (3, 3), use_bias=False, name="conv2")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn2")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))  # 4x4x32
        x = Block(name="block")(x, train)
        return nn.Dense(self.num_classes, name="head")(x)


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    old_tr, new_tr = y_tr < 5, y_tr >= 5
    old_te, new_te = y_te < 5, y_te >= 5
    return (x_tr[old_tr], y_tr[old_tr], x_te[old_te], y_te[old_te]), (
        x_tr[new_tr],
        y_tr[new_tr],
        x_te[new_te],
        y_te[new_te],
    )


def batches(rng: np.random.Generator, n: int, batch_size: int):
    """Endless shuffled minibatch indices (fixed size, so jit compiles once)."""
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            yield perm[i : i + batch_size]


def accuracy(logits, labels) -> float:
    return float(jnp.mean(jnp.argmax(logits, -1) == labels))


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def pretrain(model, variables, x, y, steps: int, batch_size: int, rng):
    """Ordinary linen training of the whole model on digits 0-4."""
    tx = optax.adam(3e-3)
    params, batch_stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, batch_stats, opt_state, xb, yb):
        def loss_fn(p):
            logits, upd = model.apply(
                {"params": p, "batch_stats": batch_stats}, xb, train=True, mutable=["batch_stats"]
            )
            return cross_entropy(logits, yb), upd["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    it = batches(rng, len(x), batch_size)
    for _ in tqdm(range(steps), desc="pretrain 0-4", unit="step", leave=False):
        idx = next(it)
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state, x[idx], y[idx])
    return {"params": params, "batch_stats": batch_stats}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=None, help="fine-tuning steps (default 300; 30 with --quick)"
    )
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=None,
        help="pre-training steps (default 300; 30 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke-test mode: few steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (30 if args.quick else 300)
    pre_steps = (
        args.pretrain_steps if args.pretrain_steps is not None else (30 if args.quick else 300)
    )
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)

    (x_old, y_old, x_old_te, y_old_te), (x_new, y_new, x_new_te, y_new_te) = load_data(args.seed)
    print(
        f"digits 0-4: {len(x_old)} train / {len(x_old_te)} test; digits 5-9: {len(x_new)} train / {len(x_new_te)} test"
    )

    # 1. Pre-train the whole model on digits 0-4.
    model = DigitsCNN()
    sample = jnp.asarray(x_old[: args.batch_size])
    variables = model.init(jax.random.key(args.seed), sample)
    variables = pretrain(model, variables, x_old, y_old, pre_steps, args.batch_size, rng)
    # All held-out data in one array (one shape, so one compile): 0-4 first, then 5-9.
    x_te = jnp.asarray(np.concatenate([x_old_te, x_new_te]))
    n_old = len(x_old_te)
    predict = jax.jit(lambda v, x: model.apply(v, x))
    logits = predict(variables, x_te)
    print(
        f"pre-trained: accuracy on held-out 0-4 = {accuracy(logits[:n_old], y_old_te):.3f}, "
        f"on held-out 5-9 = {accuracy(logits[n_old:], y_new_te):.3f}"
    )

    # 2. Two slices of the same model: the frozen backbone (model input -> block's input)
    #    and the part to fine-tune (block's input -> model output).
    backbone = js.slice(model, variables, sample, end="block:input")
    tail = js.slice(model, variables, sample, start="block")
    print(backbone)
    print(tail)
    print("tail variables:", {c: sorted(v) for c, v in tail.variables.items()})

    # Cached features: the backbone runs once per example, never again during fine-tuning.
    # (A slice takes any batch size; each new one is traced once, like jax.jit.)
    feats = np.asarray(backbone(jnp.asarray(np.concatenate([x_new, x_new_te]))))
    feats_new, feats_new_te = feats[: len(x_new)], feats[len(x_new) :]
    print(f"cached features: train {feats_new.shape}, test {feats_new_te.shape}")

    # 3. Fine-tune only the tail on digits 5-9 (labels 5-9 of the 10-way head).
    tx = optax.adam(3e-3)
    # `tail.variables` are the model's own arrays. The step donates its inputs (their
    # buffers are reused for the outputs), so train a copy: donating the originals would
    # delete the model's parameters too.
    sub_vars = jax.tree.map(jnp.copy, tail.variables)
    opt_state = tx.init(sub_vars["params"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def finetune_step(sub_vars, opt_state, fb, yb):
        def loss_fn(params):
            logits, upd = tail.apply(
                {**sub_vars, "params": params}, fb, train=True, mutable=["batch_stats"]
            )
            return cross_entropy(logits, yb), upd

        (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(sub_vars["params"])
        updates, opt_state = tx.update(grads, opt_state, sub_vars["params"])
        params = optax.apply_updates(sub_vars["params"], updates)
        return {**sub_vars, **upd, "params": params}, opt_state, loss

    eval_tail = jax.jit(lambda v, f: tail.apply(v, f))
    tail_logits = eval_tail(sub_vars, feats_new_te)
    # The tail on cached features is the full model (eval mode).
    assert np.allclose(tail_logits, logits[n_old:], atol=1e-5)
    before = accuracy(tail_logits, y_new_te)
    it = batches(rng, len(feats_new), args.batch_size)
    t_ft = time.perf_counter()
    bar = tqdm(range(steps), desc="fine-tune 5-9", unit="step")
    for i in bar:
        idx = next(it)
        sub_vars, opt_state, loss = finetune_step(sub_vars, opt_state, feats_new[idx], y_new[idx])
        if i % 10 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{float(loss):.3f}")
    bar.close()
    t_ft = time.perf_counter() - t_ft
    tail_logits = eval_tail(sub_vars, feats_new_te)
    after = accuracy(tail_logits, y_new_te)
    print(
        f"fine-tuned tail ({steps} steps, {t_ft:.2f}s): accuracy on held-out 5-9 {before:.3f} -> {after:.3f}"
    )

    # 4. Write the fine-tuned variables (params and batch_stats) back into the full model.
    merged = tail.merge(variables, sub_vars)
    merged_logits = predict(merged, x_te)
    full_logits = merged_logits[n_old:]
    agreement = float(jnp.mean(jnp.argmax(full_logits, -1) == jnp.argmax(tail_logits, -1)))
    max_diff = float(jnp.max(jnp.abs(full_logits - tail_logits)))
    print(
        f"full model with merged variables vs fine-tuned tail: prediction agreement {agreement:.3f}, "
        f"max |logit diff| {max_diff:.2e}"
    )
    assert agreement == 1.0 and max_diff < 1e-4, (agreement, max_diff)

    in_slice = {p for p, _ in jax.tree_util.tree_flatten_with_path(tail.variables)[0]}
    old_leaves = dict(jax.tree_util.tree_flatten_with_path(variables)[0])
    outside = [
        (p, x) for p, x in jax.tree_util.tree_flatten_with_path(merged)[0] if p not in in_slice
    ]
    same = sum(x is old_leaves[p] for p, x in outside)
    replaced = sum(
        x is not old_leaves[p]
        for p, x in jax.tree_util.tree_flatten_with_path(merged)[0]
        if p in in_slice
    )
    print(
        f"variables outside the slice: {same}/{len(outside)} are the very same objects; "
        f"{replaced}/{len(in_slice)} slice entries replaced"
    )
    assert same == len(outside) and replaced == len(in_slice)
    print(
        f"merged full model: accuracy on held-out 0-4 = {accuracy(merged_logits[:n_old], y_old_te):.3f} "
        f"(the shared head forgets 0-4), on held-out 5-9 = {accuracy(full_logits, y_new_te):.3f}"
    )

    # 5. Save and restore the merged variables.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "digits_finetuned.msgpack")
        with open(path, "wb") as f:
            f.write(serialization.to_bytes(merged))
        print(f"saved {path} ({os.path.getsize(path):,} bytes)")
        with open(path, "rb") as f:
            restored = serialization.from_bytes(variables, f.read())
        same_values = all(
            np.array_equal(a, b)
            for a, b in zip(
                jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(restored), strict=True
            )
        )
        same_preds = bool(
            jnp.all(jnp.argmax(predict(restored, x_te), -1) == jnp.argmax(merged_logits, -1))
        )
        print(f"restored: identical values {same_values}, identical predictions {same_preds}")
        assert same_values and same_preds
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
