"""Edit a trained model at its module boundaries, fine-tune the new part, then look at it.

Model surgery with ``js.edit`` on scikit-learn's bundled 8x8 digits (no download):

1. train a small Flax linen CNN briefly on all ten digits (optax adam);
2. edit it, without touching the model's code or its variables:
   - ``insert_after("block2", ResidualAdapter(...))``: a trainable bottleneck adapter
     (``h + up(relu(down(h)))``, ``up`` initialised to zero, so it starts as the identity);
   - ``insert_after("block1", FeatureNoise(...))``: a training-only node that adds Gaussian
     noise to the first block's features (its seed is a variable in its own ``noise``
     collection, so each step gets fresh noise);
3. fine-tune ONLY the adapter's parameters with optax (gradients are taken with respect to
   the adapter's subtree; every other array stays the trained model's own);
4. ``remove("noise")`` for deployment and measure the deployed edited model;
5. render the edited graph with Graphviz, the edited nodes highlighted, to SVG files.

Run it with ``python examples/edit_and_render.py`` (``--quick`` for a smoke run of a few
seconds; ``--out DIR`` chooses where the SVG files go, a temporary directory by default).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxslice as js


class ConvBlock(nn.Module):
    """3x3 convolution, relu, 2x2 average pooling."""

    features: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(self.features, (3, 3), name="conv")(x))
        return nn.avg_pool(x, (2, 2), strides=(2, 2))


class DigitsCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = ConvBlock(16, name="block1")(x)  # 4x4x16
        x = ConvBlock(32, name="block2")(x)  # 2x2x32
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64, name="features")(x))
        return nn.Dense(10, name="head")(x)


class ResidualAdapter(nn.Module):
    """A bottleneck adapter over the channel axis, the identity at initialisation."""

    bottleneck: int = 8

    @nn.compact
    def __call__(self, h):
        down = nn.Dense(self.bottleneck, name="down")(h)
        up = nn.Dense(h.shape[-1], kernel_init=nn.initializers.zeros, name="up")(nn.relu(down))
        return h + up


class FeatureNoise(nn.Module):
    """Adds N(0, sigma^2) noise; the seed is a variable, so training can feed a new one per step."""

    sigma: float = 0.1

    @nn.compact
    def __call__(self, h):
        seed = self.variable("noise", "seed", lambda: jnp.zeros((), jnp.uint32))
        if self.is_initializing():  # only the variable is needed at initialisation
            return h
        key = jax.random.key(seed.value)
        return h + self.sigma * jax.random.normal(key, h.shape, h.dtype)


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)


def batches(rng: np.random.Generator, n: int, batch_size: int):
    """Endless shuffled minibatch indices (fixed size, so jit compiles once)."""
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            yield perm[i : i + batch_size]


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits, labels) -> float:
    return float(jnp.mean(jnp.argmax(logits, -1) == labels))


def train_base(model, variables, x, y, steps, batch_size, rng):
    """Ordinary linen training of the whole model."""
    tx = optax.adam(3e-3)
    params = variables["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(
            lambda p: cross_entropy(model.apply({"params": p}, xb), yb)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    it = batches(rng, len(x), batch_size)
    for _ in range(steps):
        idx = next(it)
        params, opt_state, loss = step(params, opt_state, x[idx], y[idx])
    return {"params": params}


def with_adapter(variables, adapter):
    """The edited model's variables with the adapter's parameters replaced."""
    return {**variables, "params": {**variables["params"], "adapter": adapter}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test mode: few steps")
    parser.add_argument(
        "--base-steps",
        type=int,
        default=None,
        help="base training steps (default 80; 15 with --quick)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="adapter fine-tuning steps (default 300; 20 with --quick)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=None, help="directory for the SVG files (default: a temporary directory)"
    )
    args = parser.parse_args(argv)
    base_steps = args.base_steps if args.base_steps is not None else (15 if args.quick else 80)
    steps = args.steps if args.steps is not None else (20 if args.quick else 300)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)

    x_tr, x_te, y_tr, y_te = load_data(args.seed)
    x_te = jnp.asarray(x_te)
    print(f"digits: {len(x_tr)} train / {len(x_te)} test")

    # 1. A briefly trained CNN.
    model = DigitsCNN()
    sample = jnp.asarray(x_tr[: args.batch_size])
    variables = jax.jit(model.init)(jax.random.key(args.seed), sample)
    variables = train_base(model, variables, x_tr, y_tr, base_steps, args.batch_size, rng)
    base_logits = jax.jit(model.apply)(variables, x_te)
    base_acc = accuracy(base_logits, y_te)
    print(f"base model ({base_steps} steps): test accuracy {base_acc:.3f}")
    originals = {p: x for p, x in jax.tree_util.tree_flatten_with_path(variables)[0]}

    # 2. Edit: a trainable adapter after block2, training-only feature noise after block1.
    g = js.edit(model, variables, sample)
    g.insert_after("block2", ResidualAdapter(8), key=jax.random.key(1), name="adapter")
    g.insert_after("block1", FeatureNoise(0.1), key=jax.random.key(2), name="noise")
    print(g.boundaries())
    train_graph = g.build()
    train_vars = train_graph.variables
    print(train_graph)
    print("edited variables:", {c: sorted(v) for c, v in train_vars.items()})

    # 3. Fine-tune only the adapter: gradients with respect to its subtree, the rest frozen.
    tx = optax.adam(1e-2)
    adapter = train_vars["params"]["adapter"]
    opt_state = tx.init(adapter)

    @jax.jit
    def step(adapter, opt_state, seed, xb, yb):
        def loss_fn(adapter):
            v = with_adapter(train_vars, adapter)
            v = {**v, "noise": {"noise": {"seed": seed}}}
            return cross_entropy(train_graph.apply(v, xb), yb)

        loss, grads = jax.value_and_grad(loss_fn)(adapter)
        updates, opt_state = tx.update(grads, opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state, loss

    noisy_eval = jax.jit(lambda adapter, x: train_graph.apply(with_adapter(train_vars, adapter), x))
    before = accuracy(noisy_eval(adapter, x_te), y_te)
    it = batches(rng, len(x_tr), args.batch_size)
    t_ft = time.perf_counter()
    for i in range(steps):
        idx = next(it)
        adapter, opt_state, loss = step(adapter, opt_state, jnp.uint32(i + 1), x_tr[idx], y_tr[idx])
    t_ft = time.perf_counter() - t_ft
    after = accuracy(noisy_eval(adapter, x_te), y_te)
    n_adapter = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(adapter))
    n_all = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(train_vars["params"]))
    print(
        f"fine-tuned the adapter only ({n_adapter:,} of {n_all:,} parameters, {steps} steps, {t_ft:.2f}s): "
        f"test accuracy with training noise {before:.3f} -> {after:.3f}"
    )

    # Render the training graph: the inserted nodes are highlighted.
    out_dir = args.out or tempfile.mkdtemp(prefix="jaxslice_edit_")
    os.makedirs(out_dir, exist_ok=True)
    have_dot = shutil.which("dot") is not None
    if have_dot:
        path = g.render(
            os.path.join(out_dir, "edited_train.svg"),
            annotations={"adapter": f"{n_adapter:,} trainable"},
        )
        print(f"rendered the training graph to {path}")

    # 4. Deployment: remove the training-only node, keep the fine-tuned adapter.
    g.remove("noise")
    deployed = g.build()
    deployed_vars = with_adapter(deployed.variables, adapter)
    assert "noise" not in deployed_vars
    deployed_acc = accuracy(jax.jit(deployed.apply)(deployed_vars, x_te), y_te)
    print(
        f"deployed edited model (noise removed): test accuracy {deployed_acc:.3f} (base model {base_acc:.3f})"
    )
    print(f"deployed boundaries: {[b.name for b in g.boundaries()]}")

    # The trained model and its variables are untouched by all of this.
    same = all(x is originals[p] for p, x in jax.tree_util.tree_flatten_with_path(variables)[0])
    unchanged = bool(jnp.array_equal(jax.jit(model.apply)(variables, x_te), base_logits))
    print(
        f"original variables are the same objects: {same}; original outputs unchanged: {unchanged}"
    )
    assert same and unchanged

    # 5. See it: the deployed graph, adapter highlighted, with its accuracy drawn on it.
    if have_dot:
        path = g.render(
            os.path.join(out_dir, "edited_deploy.svg"),
            annotations={"adapter": f"test acc {deployed_acc:.3f}"},
        )
        print(f"rendered the deployed graph to {path}")
    else:
        print(
            "skipped rendering: Graphviz's `dot` is not on PATH (apt-get install graphviz); DOT source follows"
        )
        print(g.to_dot())
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
