"""Structural test coverage of a small CNN on scikit-learn's bundled 8x8 digits.

1. train a LeNet-style Flax linen model (conv/pool/conv/pool/dense/dense) for a few seconds;
2. build a `js.coverage.Tracker` over its layers (default: every module with parameters
   of its own) with six criteria: DeepXplore neuron coverage NC(0.5), DeepGauge KMNC(10),
   NBC, SNAC and TKNC(2), and Sun et al.'s sign-sign coverage between adjacent layers;
3. profile every neuron's range on the training split (KMNC, NBC and SNAC need it);
4. feed the test split batch by batch and print how coverage grows with the number of
   test inputs seen, then the final per-layer table.

Run it with ``python examples/coverage_digits.py`` (``--quick`` for a smoke run of a few
seconds; ``--steps N`` sets the number of training steps).
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxslice as js

C = js.coverage


class LeNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(6, (3, 3), name="conv1")(x))  # 8x8x6
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))  # 4x4x6
        x = nn.relu(nn.Conv(16, (3, 3), name="conv2")(x))  # 4x4x16
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))  # 2x2x16
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(32, name="fc")(x))
        return nn.Dense(10, name="head")(x)


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)


def train(model, x_tr, y_tr, steps: int, batch_size: int = 64, seed: int = 0):
    # The "rbg" generator compiles much faster on CPU than the default threefry.
    variables = model.init(jax.random.key(seed, impl="rbg"), x_tr[:1])
    tx = optax.adam(3e-3)
    opt_state = tx.init(variables)

    @jax.jit
    def step(variables, opt_state, x, y):
        def loss_fn(v):
            logits = model.apply(v, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(variables)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(x_tr), batch_size, replace=False)
        variables, opt_state, loss = step(variables, opt_state, x_tr[idx], y_tr[idx])
    return variables, float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps (default 400, quick 40)"
    )
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else (40 if args.quick else 400)
    t0 = time.perf_counter()

    x_tr, x_te, y_tr, y_te = load_data()
    if args.quick:
        x_te, y_te = x_te[:100], y_te[:100]
    model = LeNet()
    variables, loss = train(model, x_tr, y_tr, steps)
    acc = float(jnp.mean(jnp.argmax(model.apply(variables, x_te), -1) == y_te))
    print(
        f"trained {steps} steps in {time.perf_counter() - t0:.1f}s: loss {loss:.3f}, test accuracy {acc:.3f}"
    )

    criteria = [C.NC(0.5), C.KMNC(10), C.NBC(), C.SNAC(), C.TKNC(2), C.SignSign()]
    tracker = C.Tracker(model, variables, x_tr[:1], criteria=criteria)
    print(f"layers: {tracker.layers} (neurons per layer: {tracker.sizes}, channel granularity)")

    # Profile on the training split, streamed in batches (sizes differ by at most one, so the
    # compiled step is traced at most twice).
    t1 = time.perf_counter()
    tracker.profile(np.array_split(x_tr, max(1, len(x_tr) // 400)))
    print(f"profiled {len(x_tr)} training inputs in {time.perf_counter() - t1:.1f}s")

    # Feed the test split ten inputs at a time; report at a few checkpoints.
    batch = 10
    checkpoints = {10, 50, 100, 200, len(x_te)}
    names = [c.name for c in criteria]
    print()
    print("inputs  " + "  ".join(f"{n:>8}" for n in names))
    for start in range(0, len(x_te), batch):
        chunk = x_te[start : start + batch]
        tracker.update(chunk)
        seen = start + len(chunk)
        if seen in checkpoints or seen == len(x_te):
            r = tracker.result()
            print(f"{seen:>6}  " + "  ".join(f"{r[n]['total']:>8.3f}" for n in names))

    print()
    print(tracker.result())
    print(f"\ndone in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
