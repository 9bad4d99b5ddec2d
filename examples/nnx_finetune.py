"""Fine-tune the head of a Flax NNX model through a slice that shares its parameters.

Transfer learning with jaxslice and Flax NNX, on scikit-learn's bundled 8x8 digits (no
download):

1. pre-train a small NNX CNN (``backbone`` blocks, then ``head``) on digits 0-4;
2. slice the backbone (model input -> the input of ``head``) and compute the features of
   digits 5-9 once: they are cached and never recomputed;
3. slice the head (``start="head"``): the slice is an ``nnx.Module`` holding the model's
   own ``head``, so fine-tuning it with ``nnx.Optimizer(sub, optax.adam(...),
   wrt=nnx.Param)`` on the cached features trains the ORIGINAL model;
4. check that the original model's accuracy on held-out digits 5-9 went up, and that the
   backbone's parameters and batch statistics are bit for bit what they were.

Run it with ``python examples/nnx_finetune.py`` (``--quick`` for a smoke run of a few
seconds).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaxslice as js


class ConvBlock(nnx.Module):
    """3x3 convolution, BatchNorm, ReLU and 2x2 average pooling."""

    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.bn(self.conv(x)))
        return nnx.avg_pool(x, (2, 2), strides=(2, 2))


class DigitsNet(nnx.Module):
    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
        self.backbone = nnx.List([ConvBlock(1, 16, rngs=rngs), ConvBlock(16, 32, rngs=rngs)])
        self.head = nnx.Linear(2 * 2 * 32, num_classes, rngs=rngs)

    def __call__(self, x):
        for block in self.backbone:
            x = block(x)  # 8x8x1 -> 4x4x16 -> 2x2x32
        return self.head(x.reshape(x.shape[0], -1))


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    old_tr, new_tr, old_te, new_te = y_tr < 5, y_tr >= 5, y_te < 5, y_te >= 5
    return (
        (x_tr[old_tr], y_tr[old_tr], x_te[old_te], y_te[old_te]),
        (x_tr[new_tr], y_tr[new_tr], x_te[new_te], y_te[new_te]),
    )


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits, labels) -> float:
    return float(np.mean(np.argmax(np.asarray(logits), -1) == labels))


@nnx.jit
def train_step(module, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: cross_entropy(m(x), y))(module)
    opt.update(module, grads)
    return loss


@nnx.jit
def predict(model, x):
    return model(x)


def pretrain(model, x, y, steps: int, batch_size: int, rng: np.random.Generator) -> None:
    """Ordinary NNX training of the whole model on digits 0-4 (BatchNorm in train mode)."""
    model.train()
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    bar = tqdm(range(steps), desc="pretrain 0-4", unit="step", leave=False)
    for _ in bar:
        idx = rng.choice(len(x), batch_size, replace=False)
        loss = train_step(model, opt, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    model.eval()


def snapshot(module, *filters) -> dict:
    return {p: np.array(v[...]) for p, v in nnx.to_flat_state(nnx.state(module, *filters))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test mode: few steps")
    parser.add_argument(
        "--pretrain-steps", type=int, default=None, help="default 400 (40 with --quick)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="fine-tuning steps, default 200 (20 with --quick)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    pre_steps = (
        args.pretrain_steps if args.pretrain_steps is not None else (40 if args.quick else 400)
    )
    steps = args.steps if args.steps is not None else (20 if args.quick else 200)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)

    (x_old, y_old, x_old_te, y_old_te), (x_new, y_new, x_new_te, y_new_te) = load_data(args.seed)
    print(
        f"digits 0-4: {len(x_old)} train / {len(x_old_te)} test; "
        f"digits 5-9: {len(x_new)} train / {len(x_new_te)} test"
    )

    # 1. Pre-train the whole model on digits 0-4, then switch it to eval mode.
    model = DigitsNet(rngs=nnx.Rngs(args.seed))
    pretrain(model, x_old, y_old, pre_steps, args.batch_size, rng)
    x_old_te, x_new_te = jnp.asarray(x_old_te), jnp.asarray(x_new_te)
    acc_old = accuracy(predict(model, x_old_te), y_old_te)
    acc_new = accuracy(predict(model, x_new_te), y_new_te)
    print(f"pre-trained model: held-out accuracy 0-4 = {acc_old:.3f}, 5-9 = {acc_new:.3f}")

    print(js.boundaries(model, x_new_te))

    # 2. The frozen backbone as a slice; its features of digits 5-9 are computed once.
    #    (The sample input fixes the shapes: here all of digits 5-9, train and test.)
    x_all = jnp.asarray(np.concatenate([x_new, np.asarray(x_new_te)]))
    backbone = js.slice(model, x_all, end="head:input")
    feats = backbone(x_all)
    f_new, f_new_te = feats[: len(x_new)], feats[len(x_new) :]
    print(f"cached backbone features: train {f_new.shape}, test {f_new_te.shape}")
    assert np.allclose(model.head(f_new_te), predict(model, x_new_te), atol=1e-5)

    # 3. The head as a slice: an nnx.Module that holds the model's own `head`.
    head = js.slice(model, jnp.asarray(x_new), start="head")
    assert all(
        any(v is w for _, w in nnx.iter_graph(model.head))
        for _, v in nnx.iter_graph(head)
        if isinstance(v, nnx.Variable)
    ), "the slice holds the model's own variables"
    n_params = sum(v.size for v in jax.tree_util.tree_leaves(nnx.state(head, nnx.Param)))
    print(f"head slice: {type(head).__name__} with {n_params} parameters (the model's own `head`)")

    backbone_before = snapshot(model.backbone)  # parameters and batch statistics
    head_before = snapshot(model.head, nnx.Param)

    # Fine-tune the slice on cached features of digits 5-9 (full batch: the features are small).
    opt = nnx.Optimizer(head, optax.adam(1e-2), wrt=nnx.Param)
    y_new_j = jnp.asarray(y_new)
    t_ft = time.perf_counter()
    bar = tqdm(range(steps), desc="fine-tune head on 5-9", unit="step", leave=False)
    for _ in bar:
        loss = train_step(head, opt, f_new, y_new_j)
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    print(
        f"fine-tuned the head slice: {steps} steps in {time.perf_counter() - t_ft:.2f} s, final loss {float(loss):.3f}"
    )

    # 4. The ORIGINAL model changed through the slice: evaluate it on raw images.
    acc_old2 = accuracy(predict(model, x_old_te), y_old_te)
    acc_new2 = accuracy(predict(model, x_new_te), y_new_te)
    print(
        f"original model after fine-tuning the slice: held-out 5-9 = {acc_new:.3f} -> {acc_new2:.3f}"
    )
    print(
        f"  (held-out 0-4 = {acc_old:.3f} -> {acc_old2:.3f}: the head now favours 5-9, as trained)"
    )

    backbone_after = snapshot(model.backbone)
    unchanged = all(np.array_equal(backbone_before[k], backbone_after[k]) for k in backbone_before)
    head_after = snapshot(model.head, nnx.Param)
    changed = all(not np.array_equal(head_before[k], head_after[k]) for k in head_before)
    print(
        f"backbone parameters and statistics unchanged: {unchanged}; head parameters changed: {changed}"
    )
    if not (unchanged and changed and acc_new2 > acc_new):
        raise SystemExit("unexpected result: see above")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
