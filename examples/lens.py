"""Mechanistic interpretability with one `js.lens`: cache, logit lens, patching, steering.

The tour a TransformerLens tutorial takes, on the small byte-level transformer of
``transformer_layers.py`` (its blocks one ``nn.scan`` named ``layers``), trained here on
the source code of a few Python standard-library modules (no download). Everything below
goes through one ``js.lens(model, variables, x)``: a model whose interventions are
call-time arguments, compiled once per kind of call and input shape, with the loop kept
as one scan.

1. the activation cache: ``lens(x, read=True)`` returns every module call's output,
   the layers' stacked on a leading axis (``layers[:]``);
2. the logit lens: the model's own head (``js.slice(..., start="head")``), vmapped over
   the stacked residual streams, turns each layer's output into next-byte predictions;
3. activation patching over layers x positions: two prompts that differ in one byte,
   prompt B's residual stream at layer k, position p set to prompt A's
   (``set={"layers[k]": (a_row, position_mask)}``); the iteration index is data, so the
   whole heatmap compiles once; drawn to a PNG with matplotlib (a table without it);
4. steering in one line: ``lens(x, add={"layers[k]": v})``, and how the next-byte
   distribution moves;
5. attribution patching: one ``jax.grad`` with respect to an ``add`` at ``layers[:]``
   estimates every (layer, position) patch at once; its correlation with step 3.

Every result is checked against a forward pass written by hand (the blocks applied one
at a time with Flax's own ``apply`` on each row of the stacked parameters).

Run it with ``python examples/lens.py`` (``--quick`` for a smoke run; ``--out DIR`` for
where the heatmap goes, a temporary directory by default).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from transformer_layers import (
    Block,
    Config,
    Head,
    next_byte_loss,
    pretrained,
    windows,
)

import jaxslice as js

# Two prompts that differ in one byte: the quote that opens the string. The metric is how
# much more the model expects a double quote than a single one next, at the last position.
PROMPT_A = 'raise ValueError("bad option'
PROMPT_B = "raise ValueError('bad option"
DOUBLE, SINGLE = ord('"'), ord("'")
TOL = {"atol": 2e-4, "rtol": 2e-4}


@jax.jit
def metric(logits):
    """logit('"') - logit("'") at the last position of the one prompt in the batch."""
    return logits[0, -1, DOUBLE] - logits[0, -1, SINGLE]


@contextlib.contextmanager
def counting_compiles():
    """The XLA compilations that happen inside the block, in a list."""
    seen = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# --------------------------------------------------------------------------- by hand


def row(variables, k):
    """Layer k's parameters: row k of the stacked ones."""
    return jax.tree.map(lambda a: a[k], variables["params"]["layers"])


@functools.partial(jax.jit, static_argnums=0)
def forward_by_hand(cfg: Config, variables, tokens):
    """Every layer's output (stacked) and the logits, running one block at a time."""
    p = variables["params"]
    h = p["embed"]["embedding"][tokens] + p["pos"][: tokens.shape[1]]
    resid = []
    for k in range(cfg.n_layers):
        h, _ = Block(cfg).apply({"params": row(variables, k)}, h, None)
        resid.append(h)
    return jnp.stack(resid), Head().apply({"params": p["head"]}, h)


@functools.partial(jax.jit, static_argnums=0)
def rest_by_hand(cfg: Config, variables, k, h):
    """The model after layer k, by hand: layers k+1.. and the head, from layer k's output
    (`k` is traced: every block runs, and its result is kept only after layer k)."""
    for j in range(cfg.n_layers):
        out, _ = Block(cfg).apply({"params": row(variables, j)}, h, None)
        h = jnp.where(j > k, out, h)
    return Head().apply({"params": variables["params"]["head"]}, h)


@functools.partial(jax.jit, static_argnums=0)
def grad_by_hand(cfg: Config, variables, k, h):
    """d metric / d h at layer k's output h, through the forward written by hand."""
    return jax.grad(lambda h: metric(rest_by_hand(cfg, variables, k, h)))(h)


@jax.jit
def head_by_hand(variables, h):
    return Head().apply({"params": variables["params"]["head"]}, h)


# --------------------------------------------------------------------------- the heatmap


def draw_heatmap(effect, labels, where: int, path: Path) -> bool:
    """Draws the patching heatmap to `path`; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n_layers, n_pos = effect.shape
    fig, ax = plt.subplots(figsize=(0.32 * n_pos + 2, 0.45 * n_layers + 1.6))
    lim = max(float(np.abs(effect).max()), 1e-6)
    im = ax.imshow(effect, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(n_pos), labels, fontfamily="monospace")
    ax.set_yticks(range(n_layers), [f"layers[{k}]" for k in range(n_layers)])
    ax.axvline(where, color="k", lw=0.5, ls=":")
    ax.set_xlabel("position patched (prompt B's bytes)")
    ax.set_title("activation patching: share of A's metric restored in B's run")
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(effect, labels, where: int) -> None:
    """The heatmap as text, from the position where the prompts differ on."""
    print("   " + " " * 10 + "".join(f"{c!r:>6}" for c in labels[where:]))
    for k, values in enumerate(effect):
        print(f"   layers[{k}] " + "".join(f"{v:6.2f}" for v in values[where:]))


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test mode: few steps")
    parser.add_argument("--steps", type=int, default=None, help="default 300 (20 with --quick)")
    parser.add_argument("--out", type=Path, default=None, help="where the heatmap PNG goes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (20 if args.quick else 300)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="jaxslice-lens-"))
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    cfg = Config()
    T, L = cfg.context, cfg.n_layers

    model, variables, train, (x_eval, y_eval), (first, last) = pretrained(
        cfg, steps, args.seed, rng
    )
    logits_eval = jax.jit(model.apply)(variables, x_eval)
    model_loss = float(next_byte_loss(logits_eval, y_eval))
    print(f"model: {L} scanned layers, {steps} steps, train loss {first:.3f} -> {last:.3f}")

    prompts = jnp.asarray([[ord(c) for c in s] for s in (PROMPT_A, PROMPT_B)])
    a, b = prompts[:1], prompts[1:]  # batches of one
    n = prompts.shape[1]
    (where,) = np.flatnonzero(prompts[0] != prompts[1])

    # The one lens, made on one prompt: the shape the interventions below are given at.
    # Calls at another input shape (the reads of steps 2 and 4) trace the model again.
    lens = js.lens(model, variables, b)

    # 1. The activation cache: every module call's output, layers stacked.
    out_a, cache_a = lens(a, read=True)
    out_b, cache_b = lens(b, read=True)
    print(f"\n1. lens(x, read=True) caches {len(cache_a)} values, e.g.")
    for name in ("embed", "layers[:]/attn", "layers[:]/up", "layers[:]", "head"):
        print(f"   {name:16s} {tuple(cache_a[name].shape)}")
    resid_a, logits_a = forward_by_hand(cfg, variables, a)
    resid_b, logits_b = forward_by_hand(cfg, variables, b)
    np.testing.assert_allclose(cache_a["layers[:]"], resid_a, **TOL)
    np.testing.assert_allclose(cache_b["layers[:]"], resid_b, **TOL)
    np.testing.assert_allclose(out_a, logits_a, **TOL)
    np.testing.assert_allclose(cache_b["head"], logits_b, **TOL)
    m_a, m_b = float(metric(logits_a)), float(metric(logits_b))
    print(f"   metric logit('\"') - logit(\"'\") after A: {m_a:.3f}, after B: {m_b:.3f}")

    # 2. The logit lens: the model's head read on every layer's residual stream.
    _, held = lens(x_eval, read=["layers[:]"])
    head = js.slice(model, variables, x_eval, start="head")
    lens_logits = jax.vmap(head)(held["layers[:]"])  # (L, batch, T, vocab)
    lens_loss = [float(next_byte_loss(z, y_eval)) for z in lens_logits]
    np.testing.assert_allclose(lens_logits[-1], logits_eval, **TOL)
    by_hand = head_by_hand(variables, held["layers[:]"][1])
    np.testing.assert_allclose(lens_logits[1], by_hand, **TOL)
    print("\n2. logit lens, held-out loss of the head on each layer's output:")
    print("   " + ", ".join(f"layers[{k}] {v:.3f}" for k, v in enumerate(lens_loss)))
    print(f"   (the model's own: {model_loss:.3f})")

    # 3. Activation patching over layers x positions: B's run with A's residual stream at
    #    layer k, position p. The layer and the mask are data: one compiled program.
    positions = jnp.eye(n, dtype=bool)[:, None, :, None]  # (n, 1, n, 1): position p
    masks = list(positions)
    a_rows = list(cache_a["layers[:]"])  # A's residual stream after each layer, (1, n, d)

    def patching_sweep():
        return np.array(
            [
                [float(metric(lens(b, set={f"layers[{k}]": (a_rows[k], m)}))) for m in masks]
                for k in range(L)
            ]
        )

    start = time.perf_counter()
    with counting_compiles() as compiled_cold:
        patched = patching_sweep()  # compiles once, on its first call
    cold = time.perf_counter() - start
    start = time.perf_counter()
    with counting_compiles() as compiled_warm:
        again = patching_sweep()
    warm = time.perf_counter() - start
    np.testing.assert_array_equal(patched, again)
    # One compilation (the lens's program for this kind of call), whatever k and the mask.
    assert not compiled_warm and len(compiled_cold) <= 1, (compiled_cold, compiled_warm)
    print(
        f"\n3. activation patching, {L} layers x {n} positions = {L * n} lens calls: "
        f"first sweep {cold:.2f} s ({len(compiled_cold)} XLA compilation), again "
        f"{warm:.2f} s (none): {cold / warm:.1f}x"
    )
    # Checked by hand: nothing before the differing byte changes B's run (causal
    # attention); every position at layer k gives A's logits; a few cells by hand.
    np.testing.assert_allclose(patched[:, :where], m_b, **TOL)
    every_position = jnp.ones((1, n, 1), bool)  # the shapes of the sweep: no new compile
    for k in range(L):
        everywhere = lens(b, set={f"layers[{k}]": (a_rows[k], every_position)})
        np.testing.assert_allclose(everywhere, logits_a, **TOL)
    for k, p in [(0, where), (L - 1, n - 1), (L // 2, int(rng.integers(where, n)))]:
        h = resid_b[k].at[:, p].set(resid_a[k][:, p])
        np.testing.assert_allclose(
            patched[k, p], float(metric(rest_by_hand(cfg, variables, k, h))), **TOL
        )
    # One layer as a `sweep`: the positions are a run axis, and layers before k run once.
    k = L // 2
    runs = {
        f"layers[{k}]": (
            jnp.broadcast_to(a_rows[k], (n, 1, n, cfg.d_model)),
            positions,
        )
    }
    swept = jax.vmap(metric)(lens.sweep(b, set=runs))
    np.testing.assert_allclose(swept, patched[k], **TOL)
    share = (patched - m_b) / (m_a - m_b) if abs(m_a - m_b) > 1e-6 else patched - m_b
    labels = [chr(int(c)) for c in prompts[1]]
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "patching.png"
    if draw_heatmap(share, labels, int(where), png):
        print(f"   heatmap (share of A's metric restored) written to {png}")
    else:
        print("   matplotlib is not installed; the share of A's metric restored:")
        print_table(share, labels, int(where))
    print(
        f"   lens.sweep over the {n} positions at layers[{k}] gives the same row "
        f"(layers before {k} run once)"
    )

    # 4. Steering in one line: add v after layer k. v: the mean residual difference
    #    between windows of the text that end in a double quote and those in a single one.
    starts = rng.integers(0, len(train) - T - 1, 4096)
    ends_in = {q: [s for s in starts if train[s + T - 1] == q][:32] for q in (DOUBLE, SINGLE)}

    def mean_last(starts_):
        _, c = lens(windows(train, starts_, T)[0], read=["layers[:]"])  # as in step 2
        return c["layers[:]"][k, :, -1].mean(0)

    v = mean_last(ends_in[DOUBLE]) - mean_last(ends_in[SINGLE])  # (d_model,): every position
    np.testing.assert_allclose(lens(b, add={f"layers[{k}]": 0 * v}), logits_b, **TOL)
    steered = lens(b, add={f"layers[{k}]": v})
    np.testing.assert_allclose(steered, rest_by_hand(cfg, variables, k, resid_b[k] + v), **TOL)
    print(f"\n4. steering B's run after layers[{k}] by s x v: next-byte distribution")
    p0 = jax.nn.softmax(logits_b[0, -1])
    for s in (0.0, 1.0, 2.0):
        logits = lens(b, add={f"layers[{k}]": s * v})  # the one line
        p = jax.nn.softmax(logits[0, -1])
        top = ", ".join(f"{chr(int(t))!r} {float(p[t]):.2f}" for t in jnp.argsort(-p)[:4])
        tv = 0.5 * float(jnp.abs(p - p0).sum())
        print(f"   {s:.0f} x v: {top}  (total variation from unsteered {tv:.2f})")

    # 5. Attribution patching: one backward pass gives d metric / d(residual) at every
    #    layer and position; times (A - B) it estimates every patch of step 3 at once.
    zeros = jnp.zeros(lens.sites["layers[:]"].stacked.shape)  # (L, 1, n, d_model)
    grads = jax.grad(lambda add: metric(lens(b, add={"layers[:]": add})))(zeros)
    for k in range(L):  # each layer's gradient against the hand-written forward's
        np.testing.assert_allclose(grads[k], grad_by_hand(cfg, variables, k, resid_b[k]), **TOL)
    estimate = np.asarray(((resid_a - resid_b) * grads).sum(-1)[:, 0])  # (L, n)
    effect = patched - m_b
    r = float(np.corrcoef(estimate[:, where:].ravel(), effect[:, where:].ravel())[0, 1])
    print(
        f"\n5. attribution patching (one jax.grad through the lens) against activation "
        f"patching,\n   {L} layers x {n - where} positions from the differing byte on: "
        f"correlation {r:.2f}"
    )
    worst = np.unravel_index(np.argmax(np.abs(effect)), effect.shape)
    print(
        f"   largest patch: layers[{worst[0]}], position {worst[1]} "
        f"({labels[worst[1]]!r}): metric {m_b:+.3f} -> {m_b + effect[worst]:+.3f}, "
        f"estimate {m_b + estimate[worst]:+.3f}"
    )
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
