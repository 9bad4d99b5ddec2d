"""Feature extraction and head fine-tuning for an Equinox model, through slices.

On scikit-learn's bundled 8x8 digits (no download):

1. train a small Equinox CNN (``features`` convolutions, then ``head``) on digits 0-4;
2. slice its feature extractor (model input -> the output of ``features``) on one
   example, batch it with ``jax.vmap`` and check it against Equinox's own calls of the
   submodules; the features of digits 5-9 are computed once and cached;
3. slice the head (``start="head"``): the slice is an ``eqx.Module`` holding the model's
   own ``head``, so it trains with ``eqx.filter_value_and_grad`` and optax like any
   Equinox model; ``sub.merge(model, trained)`` writes it back;
4. check that the merged model is better on held-out digits 5-9 and that every other
   leaf of the model is the very same array as before.

Run it with ``python examples/equinox_features.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxslice as js


class DigitsNet(eqx.Module):
    features: eqx.nn.Sequential
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.features = eqx.nn.Sequential(
            [
                eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.AvgPool2d(2, 2),  # 8x8 -> 4x4
                eqx.nn.Conv2d(16, 32, 3, padding=1, key=k2),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.AvgPool2d(2, 2),  # 4x4 -> 2x2
                eqx.nn.Lambda(jnp.ravel),
            ]
        )
        self.head = eqx.nn.Linear(2 * 2 * 32, 10, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:  # one image, (1, 8, 8)
        return self.head(self.features(x))


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # (n, 1, 8, 8)
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)


def train(module, x, y, steps: int, lr: float = 1e-2):
    """Adam on every inexact array of `module` (a model or a slice), full batch."""
    params, static = eqx.partition(module, eqx.is_inexact_array)
    tx = optax.adam(lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss(p):
            logits = jax.vmap(eqx.combine(p, static))(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for _ in range(steps):
        params, opt_state, value = step(params, opt_state)
    return eqx.combine(params, static), float(value)


def accuracy(model, x, y) -> float:
    return float(jnp.mean(jnp.argmax(jax.vmap(model)(x), -1) == y))


def main(quick: bool = False) -> None:
    began = time.perf_counter()
    x_train, x_test, y_train, y_test = load_data()
    old, new = y_train < 5, y_train >= 5
    steps = 60 if quick else 300

    model = DigitsNet(jax.random.key(0))
    model, loss = train(model, x_train[old], y_train[old], steps)
    print(f"pre-trained on digits 0-4: loss {loss:.3f}")
    print(js.boundaries(model, x_train[0]))

    # A feature extractor, sliced on one example and batched with jax.vmap.
    extractor = js.slice(model, x_train[0], end="features")
    feats = jax.vmap(extractor)(x_train[new])
    eager = jax.vmap(model.features)(x_train[new])
    np.testing.assert_allclose(feats, eager, rtol=1e-5, atol=1e-5)
    print(f"features of {len(feats)} images of 5-9: {feats.shape[1:]}, equal to Equinox's own")

    # The head alone, as an eqx.Module holding the model's own `head`.
    head = js.slice(model, x_train[0], start="head")
    test_new = y_test >= 5
    before = accuracy(model, x_test[test_new], y_test[test_new])
    trained, loss = train(head, feats, y_train[new], steps)
    tuned = head.merge(model, trained)
    after = accuracy(tuned, x_test[test_new], y_test[test_new])
    print(f"head fine-tuned on cached features: loss {loss:.3f}")
    print(f"accuracy on held-out 5-9: {before:.2f} -> {after:.2f}")
    assert after > before + 0.2, (before, after)

    same = jax.tree.leaves(eqx.filter(tuned.features, eqx.is_array))
    original = jax.tree.leaves(eqx.filter(model.features, eqx.is_array))
    assert all(a is b for a, b in zip(same, original, strict=True))
    print(
        f"the feature extractor's arrays are the same objects; {time.perf_counter() - began:.1f} s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    main(parser.parse_args().quick)
