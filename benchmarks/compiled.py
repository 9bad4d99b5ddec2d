"""Rows 1, 2, 6, 7 and 8: compiled programs on real data, against hand-written twins.

A ResNet-50 on 64x64 inputs, batch 8 (``--quick``: a ResNet-10 on 32x32, batch 4). Slices
are checked against their hand-written twins before anything is timed; beside each timing
the compiled XLA programs are compared (identical programs: any ratio away from 1 is noise).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import _coverage
import _retrace
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from _common import Config, Log, row
from _models import ARCHS, Prefix, Suffix, init_variables, resnet
from _timing import check_close, compare, compiled_cost, cost_pair

import jaxslice as js


@dataclasses.dataclass
class Subjects:
    """The model, its data, and the two slices that rows 1 and 6 time (with their twins)."""

    model: Any
    variables: Any
    x: Any
    y: Any
    full: Callable[..., Any]  # the jitted full forward
    features: Any  # js.slice(end="stage2") and its twin `trunk`
    trunk: nn.Module
    tail: Any  # js.slice(start="stage3") and its twin `tail_hw`
    tail_hw: nn.Module
    feats: Any  # stage2's output: the tail's input


def subjects(cfg: Config, log: Log) -> Subjects:
    sizes, bottleneck = ARCHS[cfg.arch]
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (cfg.batch, cfg.size, cfg.size, 3))
    y = jax.random.randint(ky, (cfg.batch,), 0, 1000)
    model = resnet(cfg.arch)
    log(f"   variables of {cfg.arch}")
    variables = init_variables(model, x)
    features = js.slice(model, variables, x, end="stage2")
    tail = js.slice(model, variables, x, start="stage3")
    full = jax.jit(lambda v, a: model.apply(v, a))
    trunk, tail_hw = Prefix(sizes, bottleneck, upto=2), Suffix(sizes, bottleneck, start=3)
    s = Subjects(model, variables, x, y, full, features, trunk, tail, tail_hw, features(x))
    check_close(s.feats, s.trunk.apply(features.variables, x), "features slice vs trunk")
    check_close(tail(s.feats), s.tail_hw.apply(tail.variables, s.feats), "tail vs twin", 1e-3)
    check_close(tail(s.feats), full(variables, x), "tail slice vs full model", 1e-3)
    return s


def _timed_pair(f_sub: Any, f_ref: Any, args: tuple[Any, ...], cfg: Config) -> dict[str, Any]:
    res = compare(lambda: f_sub(*args), lambda: f_ref(*args), cfg.rounds, cfg.round_s)
    res["compiled"] = cost_pair(compiled_cost(f_sub, *args), compiled_cost(f_ref, *args))
    return res


def _program_note(res: dict[str, Any]) -> str:
    same = res["compiled"]["identical"]
    return "" if same is None else f"(XLA programs {'identical' if same else 'DIFFERENT'})"


def forward_rows(s: Subjects, cfg: Config) -> list[dict[str, Any]]:
    """Row 1: jitted slices vs jitted hand-written truncated models."""
    rows = []
    for label, sub, twin, inp in (
        ("1. forward jit: input->stage2 / hand-written", s.features, s.trunk, s.x),
        ("1. forward jit: stage3->output / hand-written", s.tail, s.tail_hw, s.feats),
    ):
        f_sub = jax.jit(lambda v, a, sub=sub: sub.apply(v, a))
        f_twin = jax.jit(lambda v, a, twin=twin: twin.apply(v, a))
        res = _timed_pair(f_sub, f_twin, (sub.variables, inp), cfg)
        rows.append(row(label, res, "<= 1.05", res["ratio"] <= 1.05, _program_note(res)))
    return rows


def dispatch_row(s: Subjects, cfg: Config) -> dict[str, Any]:
    """Calling a slice directly (its own jit + Python glue) vs a jitted twin, head only."""
    head = js.slice(s.model, s.variables, s.x, start="head")
    twin = jax.jit(lambda v, a: nn.Dense(1000).apply({"params": v["params"]["head"]}, a))
    pooled = jnp.mean(js.slice(s.model, s.variables, s.x, end="stage4")(s.x), axis=(1, 2))
    res = compare(
        lambda: head(pooled), lambda: twin(head.variables, pooled), cfg.rounds, cfg.round_s
    )
    overhead = (res["subject_ms"] - res["reference_ms"]) * 1e3
    label = "1. dispatch: calling a slice / jitted twin (head only)"
    return row(label, res, "info", None, f"({overhead:+.0f} us/call)", overhead_us=overhead)


def _intermediates_row(
    s: Subjects, cfg: Config, upto: int, capture: Any, flops: dict[str, Any]
) -> dict[str, Any]:
    name = f"stage{upto}"
    twin = Prefix(*ARCHS[cfg.arch], upto=upto)
    prefix = jax.jit(lambda v, a: twin.apply(v, a))
    ours = lambda: js.intermediates(s.model, s.variables, s.x, names=[name])
    ref = capture(s.variables, s.x)[1]["intermediates"][name]["__call__"][0]
    check_close(ours()[name], ref, f"js.intermediates({name}) vs capture_intermediates", 1e-3)
    ours_jit = jax.jit(lambda v, a: js.intermediates(s.model, v, a, names=[name]))
    flops = {
        "intermediates_flops": compiled_cost(ours_jit, s.variables, s.x).get("flops"),
        "handwritten_prefix_flops": compiled_cost(prefix, s.variables, s.x).get("flops"),
        **flops,
    }
    share = (flops["handwritten_prefix_flops"] or math.nan) / (flops["full_flops"] or math.nan)
    res = compare(ours, lambda: capture(s.variables, s.x), cfg.rounds, cfg.round_s)
    ideal = compare(ours, lambda: prefix(s.variables, s.x), cfg.rounds, cfg.round_s)
    note = f"(FLOP share {share:.3f}; / jitted hand-written prefix {ideal['ratio']:.3f})"
    label = f"2. js.intermediates({name}) / capture_intermediates"
    limit = share + 0.1
    extra = {"flop_share": share, "versus_handwritten_prefix": ideal, "flops": flops}
    return row(label, res, f"<= {limit:.3f}", res["ratio"] <= limit, note, **extra)


def intermediates_rows(s: Subjects, cfg: Config) -> list[dict[str, Any]]:
    """Row 2: an early feature through js.intermediates vs capturing every intermediate."""
    capture = jax.jit(
        lambda v, a: s.model.apply(v, a, capture_intermediates=True, mutable=["intermediates"])
    )
    flops = {
        "full_flops": compiled_cost(s.full, s.variables, s.x).get("flops"),
        "capture_flops": compiled_cost(capture, s.variables, s.x).get("flops"),
    }
    return [_intermediates_row(s, cfg, upto, capture, flops) for upto in (1, 2)]


def make_step(apply: Callable[..., Any], tx: optax.GradientTransformation) -> Callable[..., Any]:
    """A jitted fine-tune step: loss, grad, adam update; BatchNorm in train mode."""

    def loss_fn(params, variables, x, y):
        v = {**variables, "params": params}
        logits, upd = apply(v, x, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

    @jax.jit
    def step(variables, opt_state, x, y):
        params = variables["params"]
        (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, variables, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return {**variables, **upd, "params": optax.apply_updates(params, updates)}, opt_state, loss

    return step


def finetune_row(s: Subjects, cfg: Config) -> dict[str, Any]:
    """Row 6: a training step of the tail slice vs the same step of its twin."""
    tx = optax.adam(1e-3)
    steps = {"sub": make_step(s.tail.apply, tx), "hw": make_step(s.tail_hw.apply, tx)}
    state = {k: (s.tail.variables, tx.init(s.tail.variables["params"])) for k in steps}
    losses = [steps[k](*state[k], s.feats, s.y)[2] for k in steps]
    check_close(losses[0], losses[1], "fine-tune losses", 1e-3)

    def advance(key: str) -> Callable[[], Any]:
        def call() -> Any:
            variables, opt_state, loss = steps[key](*state[key], s.feats, s.y)
            state[key] = (variables, opt_state)
            return loss

        return call

    res = compare(advance("sub"), advance("hw"), cfg.rounds, cfg.round_s)
    costs = [compiled_cost(steps[k], *state[k], s.feats, s.y) for k in steps]
    res["compiled"] = cost_pair(*costs)
    label = "6. fine-tune step jit: stage3->output / hand-written"
    return row(label, res, "<= 1.05", res["ratio"] <= 1.05, _program_note(res))


def run(cfg: Config, log: Log) -> dict[str, Any]:
    s = subjects(cfg, log)
    log("1. forward of slices vs hand-written truncated models")
    rows = forward_rows(s, cfg) + [dispatch_row(s, cfg)]
    log("2. js.intermediates vs capture_intermediates")
    rows += intermediates_rows(s, cfg)
    log("6. fine-tune steps")
    rows.append(finetune_row(s, cfg))
    log("7. coverage tracker (NC + KMNC, every layer)")
    tracker, cov_rows = _coverage.rows(s.model, s.variables, s.x, s.full, cfg)
    log("8. retrace counts")
    retrace = _retrace.count(s.model, s.variables, s.x, s.feats, tracker)
    return {"rows": rows + cov_rows + [_retrace.row_of(retrace)], "retrace": retrace}
