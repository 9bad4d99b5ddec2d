"""Structural test coverage of a small CNN on scikit-learn's bundled 8x8 digits.

1. train a LeNet-style Flax linen model (conv/pool/conv/pool/dense/dense) for a few seconds;
2. build a `js.coverage.Tracker` over its layers (default: every module with parameters
   of its own) with six criteria: DeepXplore neuron coverage NC(0.5), DeepGauge KMNC(10),
   NBC, SNAC and TKNC(2), and Sun et al.'s sign-sign coverage between adjacent layers;
3. profile every neuron's range on the training split (KMNC, NBC and SNAC need it);
4. feed the test split batch by batch and print how coverage grows with the number of
   test inputs seen, then the final per-layer table.

Part 2, Sun et al.'s (2019) MC/DC-style criteria between adjacent layers:

5. sign-sign, value-sign, sign-value and value-value coverage of the test split;
6. `js.coverage.generate`: inputs within L∞ distance `--eps` of the test inputs (and inside
   [0, 1], as the images are) found by projected gradient search to cover sign-sign and
   value-sign requirements the test split leaves uncovered, against as many random
   perturbations of the same seeds with the same budget (uniform in [-eps, eps], clipped);
7. a plot of coverage against the number of inputs (the test split, then generated or
   random inputs), written with matplotlib to ``--plot``.

Run it with ``python examples/coverage_digits.py`` (``--quick`` for a smoke run;
``--steps N`` sets the number of training steps).
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


def part1(model, variables, x_tr, x_te) -> None:
    """NC, KMNC, NBC, SNAC, TKNC and sign-sign coverage as the test split is fed."""
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


# --------------------------------------------------------------------------- part 2

PAIRS = ("SignSign", "ValueSign", "SignValue", "ValueValue")
GENERATED = ("SignSign", "ValueSign")  # the criteria `generate` raises below
BATCH = 20  # every update has this many inputs: a tracker compiles its step per batch size


def pair_tracker(model, variables, sample):
    """A tracker of the four Sun et al. criteria between adjacent layers (ratio 2)."""
    criteria = [C.SignSign(), C.ValueSign(), C.SignValue(), C.ValueValue()]
    return C.Tracker(model, variables, sample, criteria=criteria)


def feed(tracker, inputs, seen: int, curve: list | None = None) -> int:
    """Updates `tracker` with `inputs` in batches of exactly `BATCH` (so the compiled step
    is reused) and returns the number of inputs seen after them. The last batch is padded
    with copies of its last input: a copy covers nothing that input does not cover already
    (two equal inputs change no neuron). `curve` gets (inputs seen, result) per batch."""
    for start in range(0, len(inputs), BATCH):
        chunk = np.asarray(inputs[start : start + BATCH])
        real = len(chunk)
        if real < BATCH:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], BATCH - real, axis=0)])
        tracker.update(chunk)
        seen += real
        if curve is not None:
            curve.append((seen, tracker.result()))
    return seen


def perturb(seeds, eps: float, rng: np.random.Generator, bounds=(0.0, 1.0)):
    """Random inputs with the same L∞ budget: seeds + uniform noise in [-eps, eps], clipped."""
    noise = rng.uniform(-eps, eps, size=np.shape(seeds)).astype(np.float32)
    return np.clip(np.asarray(seeds) + noise, *bounds).astype(np.float32)


def generated_vs_random(tracker, x_te, name: str, eps: float, steps: int, seed: int = 0):
    """For criterion `name`, from a tracker that has seen the test split `x_te` (and only
    it): its coverage with `generate`'s inputs added, then, replayed from the test split,
    with as many random perturbations of the same seeds instead. The tracker holds the
    test split alone again at the end. Returns a dict of results, curves, what `generate`
    found and the seconds it took."""
    out = {"test": tracker.result(), "generated_curve": [], "random_curve": []}
    t = time.perf_counter()
    found = C.generate(tracker, x_te, name, eps=eps, steps=steps, bounds=(0.0, 1.0), key=seed)
    out["generate_s"] = time.perf_counter() - t
    out["found"] = found
    feed(tracker, found.inputs, len(x_te), out["generated_curve"])
    out["generated"] = tracker.result()

    tracker.reset()
    feed(tracker, x_te, 0)
    randoms = perturb(found.seeds, eps, np.random.default_rng(seed))
    feed(tracker, randoms, len(x_te), out["random_curve"])
    out["random"] = tracker.result()
    tracker.reset()
    feed(tracker, x_te, 0)
    return out


def plot(test_curve: list, runs: dict, path: str, eps: float) -> None:
    """Coverage against the number of inputs, one panel per generated criterion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items(), strict=True):
        test = [(0, 0.0)] + [(n, r[name]["total"]) for n, r in test_curve]
        last = test[-1]
        ax.plot(*np.transpose(test), color="black", label="test split")
        for key, style, label in (
            ("generated_curve", "-", "+ generate"),
            ("random_curve", "--", "+ random perturbations"),
        ):
            pts = [last] + [(n, r[name]["total"]) for n, r in run[key]]
            ax.plot(*np.transpose(pts), style, label=label)
        ax.axvline(last[0], color="grey", linewidth=0.5)
        ax.set_title(f"{name} (eps {eps})")
        ax.set_xlabel("inputs")
        ax.set_ylabel("coverage")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def part2(model, variables, x_tr, x_te, args) -> None:
    """The four pair criteria on the test split; generated inputs against random ones."""
    try:  # only for the plot, at the end; checked first so that a missing one fails fast
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "Part 2 plots coverage with matplotlib, which is not installed: "
            "pip install matplotlib (or pip install -e '.[examples]')."
        ) from None

    print("\n=== part 2: Sun et al.'s criteria between adjacent layers ===\n")
    t = time.perf_counter()
    tracker = pair_tracker(model, variables, x_tr[:1])
    test_curve: list = []
    feed(tracker, x_te, 0, test_curve)
    test = tracker.result()
    print(f"the test split ({len(x_te)} inputs, {time.perf_counter() - t:.1f}s):")
    print(test)
    print()
    runs = {}
    for name in GENERATED:
        runs[name] = run = generated_vs_random(tracker, x_te, name, args.eps, args.search_steps)
        found = run["found"]
        print(
            f"{name}: generate found {len(found)} inputs in {found.attempted} searches from "
            f"{len(x_te)} seeds in {run['generate_s']:.1f}s"
        )

    print(f"\ncoverage after adding inputs within L∞ {args.eps} of the test inputs (in [0, 1]):")
    print(
        f"{'criterion':<10}  {'test set':>8}  {'+ generated':>11}  {'+ random':>8}  {'inputs':>6}"
    )
    for name, run in runs.items():
        cells = [run[k][name]["total"] for k in ("test", "generated", "random")]
        print(
            f"{name:<10}  {cells[0]:>8.4f}  {cells[1]:>11.4f}  {cells[2]:>8.4f}  "
            f"{len(run['found']):>6}"
        )

    print("\nsummary (Sun et al., Table style): coverage of the test set, and after generation")
    print(f"{'criterion':<10}  {'test set':>8}  {'+ generated':>11}")
    for name in PAIRS:
        after = f"{runs[name]['generated'][name]['total']:.4f}" if name in runs else "-"
        print(f"{name:<10}  {test[name]['total']:>8.4f}  {after:>11}")

    plot(test_curve, runs, args.plot, args.eps)
    print(f"\nwrote {args.plot} (part 2 took {time.perf_counter() - t:.1f}s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps (default 400, quick 40)"
    )
    parser.add_argument("--eps", type=float, default=0.2, help="L∞ budget of part 2's inputs")
    parser.add_argument(
        "--search-steps", type=int, default=50, help="gradient steps per search (part 2)"
    )
    parser.add_argument(
        "--plot", default="coverage_digits.png", help="where part 2 writes its plot"
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

    part1(model, variables, x_tr, x_te)
    print(f"\npart 1 done in {time.perf_counter() - t0:.1f}s")
    part2(model, variables, x_tr, x_te, args)
    print(f"\ndone in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
