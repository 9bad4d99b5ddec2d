"""jaxslice's performance table (SPEC "Performance"), reproduced in one run on CPU.

Every figure is a ratio against a reference measured in the same process, so the machine's
speed cancels out; absolute times are printed for information only.

  1. sliced forward (jit) / hand-written truncated model (jit)              <= 1.05
  2. js.intermediates of an early feature / full forward with
     capture_intermediates                             <= FLOP share of the feature + 0.1
  3. building a slice (trace + analysis, no compile) / one jax.make_jaxpr   <= 1.5
  4. building a slice that ends early (stage2) / one full jax.make_jaxpr    < 1.0
  5. analysis alone (graph building + planning) on ResNet-18 ... ResNet-152-shaped
     models: linear in the number of equations, < 0.1 s on ResNet-152
  6. fine-tune step of a slice / hand-written equivalent step               <= 1.05
  7. coverage (NC + KMNC on every layer) per batch / plain jitted forward   <= 1.5
     (and the speed-up over a naive per-neuron Python loop, for information)
  8. a second call with an already-seen batch size                          no retrace
  9. (optional) torchvision's create_feature_extractor build beside jaxslice's

Models: linen ResNets shaped like torchvision's (7x7 stem, max-pool, four stages of basic
or bottleneck blocks, widths 64..512; stages are modules named ``stage1``..``stage4``).
The compiled measurements (1, 2, 6, 7) run a ResNet-50 on 64x64 inputs, batch 8 (with
``--quick``: a ResNet-10, one basic block per stage, on 32x32, batch 4) so that a CPU run
stays short (~4 min; ~40 s quick); their variables are filled with numpy
(``init_variables``: a jitted ``init`` alone takes seconds). Building and analysis
(3, 4, 5) use abstract variables from ``jax.eval_shape(model.init, ...)`` and
``jax.ShapeDtypeStruct`` inputs, since tracing cost does not depend on data or spatial
size (ResNet-50 for 3 and 4, ResNet-18 with ``--quick``).

Private names read here, for measurement only: ``_trace.trace``, ``_graph.build`` (timed
by wrapping it), ``_plan.plan``, ``_names.Resolver``, ``Tracker._state`` (to block on the
result of ``update``) and ``Sliced._base.traced.graph.partial`` (did a build stop early).

Timing method (from the earlier benchmarks/bench_slices.py, folded in here):

* Compiled pairs (``compare``): rounds that alternate subject and reference call by call
  (which goes first alternates too), each call ending in ``block_until_ready``, so both
  see the same machine load. A round's ratio is median subject call / median reference
  call; the reported ratio is the median over rounds, with the spread of the per-round
  ratios and "best" = fastest call / fastest call (load only adds time). The compiled
  XLA programs are also compared (flops, bytes accessed, HLO instruction count): equal
  programs mean a timing ratio away from 1 is noise.
* Builds (``paired``): repetitions alternate subject and reference, each repetition on a
  *fresh* model instance (a ``tag`` field that changes nothing, so the instance is not
  equal to an earlier one). This keeps every build honest: jaxslice remembers per-model
  call counts from full traces (``jaxslice._trace._CALL_COUNTS``, keyed by the model,
  input shapes and mode) and uses them to end traces early; a new tag is a new key, so a
  "cold" build never benefits from an earlier one. The reference ``jax.make_jaxpr`` gets
  fresh instances too. JAX's own caches (jitted helpers such as ``jnp.mean`` inside the
  model) are warm for both after the warm-up repetitions. One-shot timings run with the
  cyclic GC off after a `gc.collect()` (see `no_gc`), and their Python function-call
  counts (cProfile) are compared as a noise-free check, like the XLA costs above.
* Linear growth (row 5) is judged on Python call counts per equation, which do not
  depend on machine load; times are printed beside them.

Writes benchmarks/results.json (gitignored). Exit status 1 only when a retrace count
(noise-free) misses its target, or with ``--strict`` when any target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxslice as js
from jaxslice import _graph, _names, _plan, _trace

# ============================================================================ models

TRACES = {"model": 0}  # counted in ResNet.__call__, which runs only while it is traced

ARCHS: dict[str, tuple[tuple[int, ...], bool]] = {
    "resnet10": ((1, 1, 1, 1), False),  # for --quick's compiled rows only (short compiles)
    "resnet18": ((2, 2, 2, 2), False),
    "resnet34": ((3, 4, 6, 3), False),
    "resnet50": ((3, 4, 6, 3), True),
    "resnet101": ((3, 4, 23, 3), True),
    "resnet152": ((3, 8, 36, 3), True),
}


def _norm(train: bool, name: str) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, name=name)


class Basic(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False, name="conv1")(x)
        y = nn.relu(_norm(train, "bn1")(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False, name="conv2")(y)
        y = _norm(train, "bn2")(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), strides=self.strides, use_bias=False, name="proj")(x)
            x = _norm(train, "proj_bn")(x)
        return nn.relu(x + y)


class Bottleneck(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.features, (1, 1), use_bias=False, name="conv1")(x)
        y = nn.relu(_norm(train, "bn1")(y))
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False, name="conv2")(y)
        y = nn.relu(_norm(train, "bn2")(y))
        y = nn.Conv(self.features * 4, (1, 1), use_bias=False, name="conv3")(y)
        y = _norm(train, "bn3")(y)
        if x.shape != y.shape:
            x = nn.Conv(
                self.features * 4, (1, 1), strides=self.strides, use_bias=False, name="proj"
            )(x)
            x = _norm(train, "proj_bn")(x)
        return nn.relu(x + y)


class Stage(nn.Module):
    features: int
    blocks: int
    strides: int
    bottleneck: bool

    @nn.compact
    def __call__(self, x, train: bool = False):
        block = Bottleneck if self.bottleneck else Basic
        for i in range(self.blocks):
            x = block(self.features, self.strides if i == 0 else 1, name=f"block{i}")(x, train)
        return x


def _stem(x, train):  # called inside a compact method: the layers belong to the caller
    x = nn.Conv(64, (7, 7), strides=2, use_bias=False, name="stem")(x)
    x = nn.relu(_norm(train, "stem_bn")(x))
    return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


def _stage(i: int, stage_sizes: Sequence[int], bottleneck: bool) -> Stage:
    return Stage(64 * 2**i, stage_sizes[i], 1 if i == 0 else 2, bottleneck, name=f"stage{i + 1}")


def _head(x, num_classes):
    return nn.Dense(num_classes, name="head")(jnp.mean(x, axis=(1, 2)))


class ResNet(nn.Module):
    """The full model. `tag` changes nothing; a new tag makes an instance unequal to others."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
    num_classes: int = 1000
    tag: int = 0

    @nn.compact
    def __call__(self, x, train: bool = False):
        TRACES["model"] += 1
        x = _stem(x, train)
        for i in range(len(self.stage_sizes)):
            x = _stage(i, self.stage_sizes, self.bottleneck)(x, train)
        return _head(x, self.num_classes)


class Prefix(nn.Module):
    """Hand-written truncated model: stem and stages 1..upto, same names as ResNet."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
    upto: int = 2

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = _stem(x, train)
        for i in range(self.upto):
            x = _stage(i, self.stage_sizes, self.bottleneck)(x, train)
        return x


class Suffix(nn.Module):
    """Hand-written tail: stages from..4 and the head, taking stage `from`'s input."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
    num_classes: int = 1000
    start: int = 3

    @nn.compact
    def __call__(self, x, train: bool = False):
        for i in range(self.start - 1, len(self.stage_sizes)):
            x = _stage(i, self.stage_sizes, self.bottleneck)(x, train)
        return _head(x, self.num_classes)


def resnet(arch: str, tag: int = 0, num_classes: int = 1000) -> ResNet:
    sizes, bottleneck = ARCHS[arch]
    return ResNet(sizes, bottleneck, num_classes, tag)


def init_variables(model: nn.Module, x: Any, seed: int = 0) -> Any:
    """Variables with the shapes of ``model.init``, filled with numpy (fast: a jitted or
    eager ``init`` of a ResNet-50 takes seconds on CPU). Kernels ~ N(0, 1/fan_in), BN
    scale 1, biases and running means 0, running variances 1."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(
        model.init, jax.random.key(seed), jax.ShapeDtypeStruct(x.shape, x.dtype)
    )

    def fill(path: Any, s: Any) -> Any:
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "kernel":
            fan_in = int(np.prod(s.shape[:-1]))
            value = rng.standard_normal(s.shape, np.float32) / np.sqrt(fan_in)
        elif name in ("scale", "var"):
            value = np.ones(s.shape, np.float32)
        else:
            value = np.zeros(s.shape, np.float32)
        return jnp.asarray(value, s.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


# ============================================================================ timing

_TAGS = iter(range(1, 10**9))


def fresh_tag() -> int:
    return next(_TAGS)


def _once(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def compare(
    subject: Callable[[], Any], reference: Callable[[], Any], rounds: int, round_s: float
) -> dict[str, Any]:
    """Interleaved timing of two zero-argument callables (steady state, after warm-up)."""
    for _ in range(2):  # warm-up: compiles and caches
        _once(subject)
        _once(reference)
    pair = statistics.median(_once(subject) + _once(reference) for _ in range(3))
    number = max(1, min(500, int(round_s / max(pair, 1e-6))))
    ts, tr, ratios = [], [], []
    best_s, best_r = math.inf, math.inf
    for r in range(rounds):
        a, b = [], []
        for i in range(number):
            if (i + r) % 2 == 0:
                b.append(_once(subject))
                a.append(_once(reference))
            else:
                a.append(_once(reference))
                b.append(_once(subject))
        ts.append(statistics.median(b))
        tr.append(statistics.median(a))
        ratios.append(ts[-1] / tr[-1])
        best_s, best_r = min(best_s, *b), min(best_r, *a)
    return {
        "subject_ms": statistics.median(ts) * 1e3,
        "reference_ms": statistics.median(tr) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "best_ratio": best_s / best_r,
        "rounds": rounds,
        "calls_per_round": number,
    }


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Collects garbage, then keeps the cyclic GC off for a timed one-shot operation (as
    `timeit` does). A full collection costs ~0.1 s here once the process holds a few
    traced ResNets, and lands at random inside a trace or a make_jaxpr: it made single
    build timings swing by that much, for jaxslice and the reference alike."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def paired(
    subject: Callable[..., Any],
    reference: Callable[[], Any],
    reps: int,
    warmup: int = 1,
    setup: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """One-shot operations (builds), alternated rep by rep; `subject`/`reference` are
    factories called once per rep (each makes its own fresh model). `setup`, if given,
    runs untimed before each subject call and its result is passed to it. Each call is
    timed with the GC off (`no_gc`); the Python-call counts of one more call of each are
    compared too (cProfile's count: noise-free)."""

    def run_subject() -> float:
        arg = setup() if setup is not None else None
        with no_gc():
            t = time.perf_counter()
            subject(arg) if setup is not None else subject()
            return time.perf_counter() - t

    def run_reference() -> float:
        with no_gc():
            t = time.perf_counter()
            reference()
            return time.perf_counter() - t

    for _ in range(warmup):
        run_subject()
        run_reference()
    s, r = [], []
    for i in range(reps):
        if i % 2 == 0:
            s.append(run_subject())
            r.append(run_reference())
        else:
            r.append(run_reference())
            s.append(run_subject())
    ratios = [a / b for a, b in zip(s, r, strict=True)]
    arg = setup() if setup is not None else None
    subject_calls = python_calls(lambda: subject(arg) if setup is not None else subject())
    reference_calls = python_calls(reference)
    return {
        "subject_ms": statistics.median(s) * 1e3,
        "reference_ms": statistics.median(r) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "best_ratio": min(s) / min(r),
        "rounds": reps,
        "calls_per_round": 1,
        "python_calls": [subject_calls, reference_calls],
        "python_calls_ratio": subject_calls / reference_calls,
    }


_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=", re.M)


def compiled_cost(fn: Any, *args: Any) -> dict[str, Any]:
    """XLA's cost analysis and instruction count of a jitted function's compiled program."""
    try:
        compiled = fn.lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
        return {
            "flops": float(cost.get("flops", float("nan"))),
            "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
            "hlo_instructions": len(_HLO_INSTR.findall(compiled.as_text())),
        }
    except Exception as e:  # best effort (backend-dependent)
        return {"error": f"{type(e).__name__}: {e}"}


def cost_pair(subject: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    ok = "error" not in subject and "error" not in reference
    return {
        "subject": subject,
        "reference": reference,
        "identical": (subject == reference) if ok else None,
    }


def close(a: Any, b: Any, atol: float = 1e-4) -> bool:
    return all(
        bool(jnp.allclose(x, y, atol=atol, rtol=1e-4))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


@contextlib.contextmanager
def timing(module: Any, name: str, sink: list[float]) -> Iterator[None]:
    """Times every call of `module.name` into `sink` (a wrapper; restored afterwards)."""
    original = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, original)


def row(
    measure: str, res: dict[str, Any], target: str, ok: bool | None, **extra: Any
) -> dict[str, Any]:
    return {"measure": measure, **res, "target": target, "ok": ok, **extra}


# ============================================================================ benchmarks


class Config:
    def __init__(self, quick: bool, rounds: int | None, round_s: float | None, reps: int | None):
        self.quick = quick
        self.arch = "resnet10" if quick else "resnet50"  # compiled measurements
        self.size = 32 if quick else 64
        self.batch = 4 if quick else 8
        self.build_arch = "resnet18" if quick else "resnet50"  # build measurements
        self.scaling_archs = (
            ["resnet18", "resnet34"] if quick else [a for a in ARCHS if a != "resnet10"]
        )
        self.rounds = rounds or (3 if quick else 11)
        self.round_s = round_s if round_s is not None else (0.02 if quick else 0.2)
        self.reps = reps or (3 if quick else 9)
        self.naive_batches = 1 if quick else 2


def make_step(apply: Callable[..., Any], tx: optax.GradientTransformation) -> Callable[..., Any]:
    """A jitted fine-tune step: loss, grad, adam update; BatchNorm in train mode."""

    @jax.jit
    def step(variables, opt_state, x, y):
        def loss_fn(params):
            logits, upd = apply(
                {**variables, "params": params}, x, train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd

        (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        return (
            {**variables, **upd, "params": optax.apply_updates(variables["params"], updates)},
            opt_state,
            loss,
        )

    return step


def bench_compiled(
    cfg: Config, log: Callable[[str], None]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows 1, 2, 6, 7, 8 and dispatch: compiled programs on real data."""
    rows: list[dict[str, Any]] = []
    sizes, bottleneck = ARCHS[cfg.arch]
    kx, ky = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(kx, (cfg.batch, cfg.size, cfg.size, 3))
    y = jax.random.randint(ky, (cfg.batch,), 0, 1000)
    model = resnet(cfg.arch)
    log(f"   variables of {cfg.arch}")
    variables = init_variables(model, x)
    full = jax.jit(lambda v, a: model.apply(v, a))

    # ---- 1. sliced forward / hand-written truncated model
    log("1. forward of slices vs hand-written truncated models")
    features = js.slice(model, variables, x, end="stage2")
    tail = js.slice(model, variables, x, start="stage3")
    trunk = Prefix(sizes, bottleneck, upto=2)
    tail_hw = Suffix(sizes, bottleneck, start=3)
    feats = features(x)
    assert close(feats, trunk.apply(features.variables, x)), "features slice != hand-written trunk"
    assert close(tail(feats), tail_hw.apply(tail.variables, feats), atol=1e-3), (
        "tail slice != hand-written tail"
    )
    assert close(tail(feats), full(variables, x), atol=1e-3), "tail slice != full model"
    for label, sub, hw, inp in (
        ("1. forward jit: input->stage2 / hand-written", features, trunk, x),
        ("1. forward jit: stage3->output / hand-written", tail, tail_hw, feats),
    ):
        f_sub = jax.jit(lambda v, a, sub=sub: sub.apply(v, a))
        f_hw = jax.jit(lambda v, a, hw=hw: hw.apply(v, a))
        v = sub.variables
        res = compare(
            lambda f=f_sub, v=v, a=inp: f(v, a),
            lambda f=f_hw, v=v, a=inp: f(v, a),
            cfg.rounds,
            cfg.round_s,
        )
        cost = cost_pair(compiled_cost(f_sub, v, inp), compiled_cost(f_hw, v, inp))
        rows.append(row(label, res, "<= 1.05", res["ratio"] <= 1.05, compiled=cost))

    # dispatch: calling a slice directly (its own jit + Python glue) vs a jitted twin
    head = js.slice(model, variables, x, start="head")
    head_hw = jax.jit(lambda v, a: nn.Dense(1000).apply({"params": v["params"]["head"]}, a))
    pooled = jnp.mean(js.slice(model, variables, x, end="stage4")(x), axis=(1, 2))
    res = compare(
        lambda: head(pooled), lambda: head_hw(head.variables, pooled), cfg.rounds, cfg.round_s
    )
    res["overhead_us"] = (res["subject_ms"] - res["reference_ms"]) * 1e3
    rows.append(row("   dispatch: sub(x) / jitted twin (head only)", res, "info", None))

    # ---- 2. js.intermediates of an early feature / capture_intermediates of everything
    log("2. js.intermediates vs capture_intermediates")
    capture = jax.jit(
        lambda v, a: model.apply(v, a, capture_intermediates=True, mutable=["intermediates"])
    )
    full_cost = compiled_cost(full, variables, x)
    for upto in (1, 2):
        name = f"stage{upto}"
        prefix = Prefix(sizes, bottleneck, upto=upto)
        prefix_fn = jax.jit(lambda v, a, p=prefix: p.apply(v, a))
        prefix_cost = compiled_cost(prefix_fn, variables, x)
        share = prefix_cost.get("flops", math.nan) / full_cost.get("flops", math.nan)
        got = js.intermediates(model, variables, x, names=[name])[name]
        ref = capture(variables, x)[1]["intermediates"][name]["__call__"][0]
        assert close(got, ref, atol=1e-3), f"js.intermediates({name}) != capture_intermediates"
        inter_fn = jax.jit(lambda v, a, n=name: js.intermediates(model, v, a, names=[n]))
        inter_cost = compiled_cost(inter_fn, variables, x)
        res = compare(
            lambda n=name: js.intermediates(model, variables, x, names=[n]),
            lambda: capture(variables, x),
            cfg.rounds,
            cfg.round_s,
        )
        limit = share + 0.1
        # the ideal: a hand-written jitted prefix (how far from "computes only the prefix")
        ideal = compare(
            lambda n=name: js.intermediates(model, variables, x, names=[n]),
            lambda f=prefix_fn: f(variables, x),
            cfg.rounds,
            cfg.round_s,
        )
        rows.append(
            row(
                f"2. js.intermediates({name}) / capture_intermediates",
                res,
                f"<= {limit:.3f}",
                res["ratio"] <= limit,
                flop_share=share,
                versus_handwritten_prefix=ideal,
                compiled={
                    "intermediates_flops": inter_cost.get("flops"),
                    "handwritten_prefix_flops": prefix_cost.get("flops"),
                    "full_flops": full_cost.get("flops"),
                    "capture_flops": compiled_cost(capture, variables, x).get("flops"),
                },
            )
        )

    # ---- 6. fine-tune step of the tail slice / hand-written step
    log("6. fine-tune steps")
    tx = optax.adam(1e-3)
    step_sub, step_hw = make_step(tail.apply, tx), make_step(tail_hw.apply, tx)
    state = {k: (tail.variables, tx.init(tail.variables["params"])) for k in ("sub", "hw")}
    out_sub, out_hw = step_sub(*state["sub"], feats, y), step_hw(*state["hw"], feats, y)
    assert close(out_sub[2], out_hw[2], atol=1e-3), "fine-tune losses differ"

    def advance(key: str, step: Callable[..., Any]) -> Callable[[], Any]:
        def call() -> Any:
            v, o, loss = step(*state[key], feats, y)
            state[key] = (v, o)
            return loss

        return call

    res = compare(advance("sub", step_sub), advance("hw", step_hw), cfg.rounds, cfg.round_s)
    cost = cost_pair(
        compiled_cost(step_sub, *state["sub"], feats, y),
        compiled_cost(step_hw, *state["hw"], feats, y),
    )
    rows.append(
        row(
            "6. fine-tune step jit: stage3->output / hand-written",
            res,
            "<= 1.05",
            res["ratio"] <= 1.05,
            compiled=cost,
        )
    )

    # ---- 7. coverage
    log("7. coverage tracker (NC + KMNC, every layer)")
    batches = [jax.random.normal(k, x.shape) for k in jax.random.split(jax.random.key(1), 3)]
    t0 = time.perf_counter()
    tracker = js.coverage.Tracker(
        model, variables, x, criteria=[js.coverage.NC(0.5), js.coverage.KMNC(10)]
    )
    tracker_build_s = time.perf_counter() - t0
    tracker.profile(batches)
    n_neurons = sum(tracker.sizes)
    # update() returns nothing; block on the tracker's state (private attribute) so
    # that each timed call includes its compiled computation.
    res = compare(
        lambda: (tracker.update(x), tracker._state)[1],
        lambda: full(variables, x),
        cfg.rounds,
        cfg.round_s,
    )
    rows.append(
        row(
            f"7. coverage update ({len(tracker.layers)} layers, {n_neurons} neurons) / forward",
            res,
            "<= 1.5",
            res["ratio"] <= 1.5,
            layers=len(tracker.layers),
            neurons=n_neurons,
            tracker_build_s=tracker_build_s,
        )
    )

    # naive per-neuron loop (numpy) on the captured layer outputs, same profile
    log("7. naive per-neuron coverage loop")
    profile = tracker.profile_stats
    test = [
        jax.random.normal(k, x.shape)
        for k in jax.random.split(jax.random.key(2), cfg.naive_batches)
    ]
    naive_state = {
        n: (np.zeros(s, bool), np.zeros((s, 10), bool))
        for n, s in zip(tracker.layers, tracker.sizes, strict=True)
    }
    js.intermediates(model, variables, x, names=tracker.layers)  # compile the capture first
    naive_times, capture_times = [], []
    for b in test:
        t0 = time.perf_counter()
        outs = jax.block_until_ready(js.intermediates(model, variables, b, names=tracker.layers))
        t1 = time.perf_counter()
        naive_update(outs, profile, naive_state, threshold=0.5, k=10)
        naive_times.append(time.perf_counter() - t0)
        capture_times.append(t1 - t0)
    tracker.reset()
    for b in test:
        tracker.update(b)
    result = tracker.result()
    naive = naive_result(naive_state)
    speedup = statistics.median(naive_times) / res["subject_ms"] * 1e3
    rows.append(
        {
            "measure": "7. naive per-neuron numpy loop / coverage update",
            "subject_ms": statistics.median(naive_times) * 1e3,
            "reference_ms": res["subject_ms"],
            "ratio": speedup,
            "target": "info (speed-up)",
            "ok": None,
            "naive_capture_ms": statistics.median(capture_times) * 1e3,
            "naive_loop_only_speedup": (
                statistics.median(naive_times) - statistics.median(capture_times)
            )
            / res["subject_ms"]
            * 1e3,
            "naive_batches": len(test),
            "tracker": {k: result[k]["total"] for k in ("NC", "KMNC")},
            "naive": naive,
            "same_numbers": all(abs(result[k]["total"] - naive[k]) <= 1e-3 for k in ("NC", "KMNC")),
        }
    )

    # ---- 8. retraces
    log("8. retrace counts")
    retrace = retraces(model, variables, x, feats, tracker)
    seen = sum(c["model_traces"] for c in retrace["calls"] if c["seen"])
    rows.append(
        {
            "measure": "8. calls at an already-seen batch size: model traces",
            "subject": seen,
            "target": "0",
            "ok": seen == 0,
        }
    )
    return rows, retrace


def naive_update(
    outs: dict[str, Any], profile: dict[str, Any], state: dict[str, Any], threshold: float, k: int
) -> None:
    """NC and KMNC the slow way: a Python loop over every neuron of every layer, numpy inside."""
    for name, out in outs.items():
        o = np.asarray(out, np.float32)
        b = o.shape[0]
        flat = o.reshape(b, -1)
        lo_in, hi_in = flat.min(axis=1), flat.max(axis=1)
        low, high = np.asarray(profile[name]["low"]), np.asarray(profile[name]["high"])
        nc, kmnc = state[name]
        channels = o.shape[-1] if o.ndim > 1 else 1
        for n in range(channels):
            col = o[..., n] if o.ndim > 1 else o
            v = col.reshape(b, -1).mean(axis=1)  # channel value per input
            span = hi_in - lo_in
            scaled = np.where(
                (span > 0)[:, None],
                (col.reshape(b, -1) - lo_in[:, None]) / np.where(span > 0, span, 1)[:, None],
                0,
            )
            if np.any(scaled.mean(axis=1) > threshold):
                nc[n] = True
            lo, hi = low[n], high[n]
            inside = (v >= lo) & (v <= hi)
            if hi > lo:
                idx = np.clip(np.floor((v - lo) / (hi - lo) * k), 0, k - 1).astype(int)
            else:
                idx = np.full(b, k - 1)
            kmnc[n, idx[inside]] = True


def naive_result(state: dict[str, Any]) -> dict[str, float]:
    nc = sum(int(s[0].sum()) for s in state.values()) / sum(s[0].size for s in state.values())
    kmnc = sum(int(s[1].sum()) for s in state.values()) / sum(s[1].size for s in state.values())
    return {"NC": nc, "KMNC": kmnc}


def retraces(model: ResNet, variables: Any, x: Any, feats: Any, tracker: Any) -> dict[str, Any]:
    TRACES["model"] = 0
    sub = js.slice(model, variables, x, start="stage3")
    after_build = TRACES["model"]
    half_x = x[: max(1, x.shape[0] // 2)]
    half = feats[: max(1, feats.shape[0] // 2)]
    calls = []

    def count(label: str, seen: bool, fn: Callable[[], Any]) -> None:
        before = TRACES["model"]
        jax.block_until_ready(fn())
        calls.append({"call": label, "seen": seen, "model_traces": TRACES["model"] - before})

    count("slice(start=stage3): batch B (as sliced), 1st call", False, lambda: sub(feats))
    count("slice: batch B, 2nd call", True, lambda: sub(feats))
    count("slice: batch B/2, 1st call", False, lambda: sub(half))
    count("slice: batch B/2, 2nd call", True, lambda: sub(half))
    count("slice: batch B again", True, lambda: sub(feats))
    train = lambda: sub.apply(sub.variables, feats, train=True, mutable=["batch_stats"])  # noqa: E731
    count("slice: train=True mutable, 1st call", False, train)
    count("slice: train=True mutable, 2nd call", True, train)
    count(
        "slice: new variables (copies), batch B",
        True,
        lambda: sub.apply(jax.tree_util.tree_map(jnp.copy, sub.variables), feats),
    )
    f_sub = jax.jit(lambda v, a: sub.apply(v, a))
    count("jit(sub.apply): batch B/2, 1st call", True, lambda: f_sub(sub.variables, half))
    count("jit(sub.apply): batch B/2, 2nd call", True, lambda: f_sub(sub.variables, half))
    inter = lambda a: js.intermediates(model, variables, a, names=["stage2"])  # noqa: E731
    count("js.intermediates(stage2): batch B", False, lambda: inter(x))
    count("js.intermediates(stage2): batch B, again", True, lambda: inter(x))
    count("js.intermediates(stage2): batch B/2, 1st call", False, lambda: inter(half_x))
    count("js.intermediates(stage2): batch B/2, 2nd call", True, lambda: inter(half_x))
    count("tracker.update: batch B (seen)", True, lambda: (tracker.update(x), tracker._state)[1])
    count(
        "tracker.update: batch B/2, 1st call",
        False,
        lambda: (tracker.update(half_x), tracker._state)[1],
    )
    count(
        "tracker.update: batch B/2, 2nd call",
        True,
        lambda: (tracker.update(half_x), tracker._state)[1],
    )
    return {"traces_at_build": after_build, "calls": calls}


def abstract_model(arch: str, size: int = 64) -> tuple[Any, Any]:
    x = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    variables = jax.eval_shape(resnet(arch).init, jax.random.key(0), x)
    return variables, x


def bench_builds(cfg: Config, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Rows 3 and 4: building slices vs one make_jaxpr, each rep on a fresh model."""
    rows: list[dict[str, Any]] = []
    arch = cfg.build_arch
    v, x = abstract_model(arch)

    def make_jaxpr() -> Any:
        return jax.make_jaxpr(resnet(arch, fresh_tag()).apply)(v, x)

    log(f"3. build slice start=stage3 ({arch})")
    res = paired(
        lambda: js.slice(resnet(arch, fresh_tag()), v, x, start="stage3"), make_jaxpr, cfg.reps
    )
    rows.append(
        row(
            f"3. build slice(start=stage3) / make_jaxpr ({arch})",
            res,
            "<= 1.5",
            res["ratio"] <= 1.5,
        )
    )

    log(f"4. build slices ending at stage2 ({arch})")
    res = paired(
        lambda: js.slice(resnet(arch, fresh_tag()), v, x, end="stage2"), make_jaxpr, cfg.reps
    )
    rows.append(
        row("4a. build end=stage2, cold (full trace) / make_jaxpr", res, "info (full trace)", None)
    )

    def warm_model() -> ResNet:
        m = resnet(arch, fresh_tag())
        js.boundaries(m, v, x)  # a full trace: jaxslice now knows stage2 is called once
        return m

    res = paired(lambda m: js.slice(m, v, x, end="stage2"), make_jaxpr, cfg.reps, setup=warm_model)
    rows.append(
        row(
            "4b. build end=stage2 after js.boundaries / make_jaxpr",
            res,
            "< 1.0",
            res["ratio"] < 1.0,
        )
    )
    res = paired(
        lambda: js.slice(resnet(arch, fresh_tag()), v, x, end="stage2@0"), make_jaxpr, cfg.reps
    )
    rows.append(
        row("4c. build end='stage2@0', cold / make_jaxpr", res, "< 1.0", res["ratio"] < 1.0)
    )
    # Whether each really stopped early (a partial graph: traced only up to the end);
    # `_base.traced.graph.partial` is private, read here for the report only.
    partial = lambda sub: bool(sub._base.traced.graph.partial)  # noqa: E731
    rows[-3]["traced_partially"] = partial(js.slice(resnet(arch, fresh_tag()), v, x, end="stage2"))
    rows[-2]["traced_partially"] = partial(js.slice(warm_model(), v, x, end="stage2"))
    rows[-1]["traced_partially"] = partial(
        js.slice(resnet(arch, fresh_tag()), v, x, end="stage2@0")
    )
    return rows


def python_calls(fn: Callable[[], Any]) -> int:
    """How many Python function calls `fn` makes (cProfile's count): a noise-free measure
    of the work done, to check how it grows with model size."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    return pstats.Stats(prof).total_calls  # type: ignore[attr-defined]


def build_calls(fn: Callable[[], Any]) -> int:
    """Python calls made inside `_graph.build` while `fn` runs."""
    counts: list[int] = []
    original = _graph.build

    def counted(*args: Any, **kwargs: Any) -> Any:
        out: list[Any] = []
        counts.append(python_calls(lambda: out.append(original(*args, **kwargs))))
        return out[0]

    _graph.build = counted
    try:
        fn()
    finally:
        _graph.build = original
    return sum(counts)


TRAIN = {"train": True, "mutable": ["batch_stats"]}  # the mode a fine-tune slice runs in


def bench_scaling(
    cfg: Config, log: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Row 5: graph building and planning vs the number of equations, eval and train mode.

    "Analysis" is what jaxslice adds after JAX has traced the model: graph building
    (`_graph.build`, timed by wrapping it while `_trace.trace` runs) and the slice's
    construction from the graph (`js.Sliced(traced, "stage3", None)`: Resolver, plan,
    re-emission, variable pruning). Plan and Resolver are also timed alone
    (`_plan.plan(graph, _names.Resolver(graph), "stage3", None)`). `trace - make_jaxpr`
    is the difference of medians (marking + graph building; noisy). Train mode is the
    mode of a fine-tune slice (`train=True, mutable=["batch_stats"]`), whose plan also
    picks the updated state that belongs to the slice.
    """
    table = []
    reps = max(3, cfg.reps // 2)
    for arch in cfg.scaling_archs:
        log(f"5. analysis on {arch}")
        v, x = abstract_model(arch, 32)
        entry: dict[str, Any] = {"arch": arch}
        for mode, kwargs in (("eval", {}), ("train", TRAIN)):
            builds: list[float] = []
            traces, jaxprs = [], []
            tr = closed = None
            for i in range(reps + 1):  # the first rep is a warm-up
                order = ("trace", "jaxpr") if i % 2 == 0 else ("jaxpr", "trace")
                for what in order:
                    m = resnet(arch, fresh_tag())
                    with no_gc():
                        t0 = time.perf_counter()
                        if what == "trace":
                            with timing(_graph, "build", builds):
                                tr = _trace.trace(m, (v, x), dict(kwargs))
                            (traces if i else []).append(time.perf_counter() - t0)
                        else:
                            closed = jax.make_jaxpr(
                                lambda v_, x_, m=m, kw=kwargs: m.apply(v_, x_, **kw)
                            )(v, x)
                            (jaxprs if i else []).append(time.perf_counter() - t0)
            builds = builds[1:]
            assert tr is not None and closed is not None
            graph = tr.graph
            plans, slices_ = [], []
            mutable = tr.split.mutable
            offset = tr.adapter.state_owner_offset
            for _ in range(reps):
                with no_gc():
                    t0 = time.perf_counter()
                    _plan.plan(graph, _names.Resolver(graph), "stage3", None, mutable, offset)
                    t1 = time.perf_counter()
                    js.Sliced(tr, "stage3", None)
                    slices_.append(time.perf_counter() - t1)
                    plans.append(t1 - t0)
            p = mode[0]  # column prefix: e(val) / t(rain)
            entry.update(
                {
                    f"{p}_graph_eqns": len(graph.eqns),
                    f"{p}_state": len(graph.state_paths),
                    f"{p}_make_jaxpr_ms": statistics.median(jaxprs) * 1e3,
                    f"{p}_trace_ms": statistics.median(traces) * 1e3,
                    f"{p}_build_ms": statistics.median(builds) * 1e3,
                    f"{p}_plan_ms": statistics.median(plans) * 1e3,
                    f"{p}_sliced_ms": statistics.median(slices_) * 1e3,
                    f"{p}_sliced_pycalls": python_calls(
                        lambda tr=tr: js.Sliced(tr, "stage3", None)
                    ),
                    f"{p}_build_pycalls": build_calls(
                        lambda a=arch, v=v, x=x, kw=kwargs: _trace.trace(
                            resnet(a, fresh_tag()), (v, x), dict(kw)
                        )
                    ),
                }
            )
            entry[f"{p}_trace_overhead_ms"] = entry[f"{p}_trace_ms"] - entry[f"{p}_make_jaxpr_ms"]
            entry[f"{p}_analysis_ms"] = entry[f"{p}_build_ms"] + entry[f"{p}_sliced_ms"]
            entry[f"{p}_us_per_eqn"] = entry[f"{p}_analysis_ms"] * 1e3 / len(graph.eqns)
            entry[f"{p}_pycalls_per_eqn"] = entry[f"{p}_sliced_pycalls"] / len(graph.eqns)
        entry["calls"] = len(tr.graph.calls)
        table.append(entry)

    rows = []
    last = table[-1]
    for p, mode in (("e", "eval"), ("t", "train")):
        xs = [math.log(e[f"{p}_graph_eqns"]) for e in table]
        time_slope = _slope(xs, [math.log(e[f"{p}_analysis_ms"]) for e in table])
        call_slope = _slope(xs, [math.log(e[f"{p}_sliced_pycalls"]) for e in table])
        build_slope = _slope(xs, [math.log(e[f"{p}_build_pycalls"]) for e in table])
        rows.append(
            {
                "measure": f"5. analysis on {last['arch']} ({mode}, {last[f'{p}_graph_eqns']} eqns): build + Sliced()",
                "subject_ms": last[f"{p}_analysis_ms"],
                "target": "< 100 ms",
                "ok": last[f"{p}_analysis_ms"] < 100,
            }
        )
        rows.append(
            {
                "measure": f"5. linear? ({mode}) log-log slope vs eqns: Python calls in Sliced() [time]",
                "subject": f"{call_slope:.2f} [{time_slope:.2f}]",
                "target": "1 (calls <= 1.15)",
                "ok": call_slope <= 1.15,
                "call_slope": call_slope,
                "build_call_slope": build_slope,
                "time_slope": time_slope,
            }
        )
    return rows, table


def _slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True)) / sum(
        (a - mx) ** 2 for a in xs
    )


def bench_torchvision(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """Row 9 (optional): torchvision's feature-extractor build, if torch is installed."""
    try:
        import torch  # noqa: F401
        from torchvision.models import resnet50
        from torchvision.models.feature_extraction import create_feature_extractor
    except Exception as e:  # not a dependency; never installed by this script
        return {
            "measure": "9. torchvision create_feature_extractor(layer2) build",
            "skipped": f"{type(e).__name__}: {e}",
        }
    log("9. torchvision create_feature_extractor")
    tv = resnet50()
    v, x = abstract_model("resnet50")
    res = paired(
        lambda: js.slice(resnet("resnet50", fresh_tag()), v, x, end="stage2@0"),
        lambda: create_feature_extractor(tv, return_nodes=["layer2"]),
        cfg.reps,
    )
    return row("9. jaxslice build end='stage2@0' / torchvision extractor build", res, "info", None)


# ============================================================================ output


def _fmt_ms(v: Any) -> str:
    return f"{v:.2f}ms" if isinstance(v, (int, float)) else ""


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    w = max(len(r["measure"]) for r in rows)
    head = f"{'measure':<{w}}  {'jaxslice':>10}  {'reference':>10}  {'ratio':>7}  {'[min, max]':>15}  {'best':>6}  {'target':>17}  met?"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['measure']:<{w}}  skipped ({r['skipped']})")
            continue
        ok = {True: "yes", False: "NO", None: ""}[r.get("ok")]
        if "ratio" in r:
            spread = f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]" if "ratio_min" in r else ""
            best = f"{r['best_ratio']:.3f}" if "best_ratio" in r else ""
            extra = f"  ({r['overhead_us']:+.0f} us/call)" if "overhead_us" in r else ""
            if "flop_share" in r:
                extra += f"  (FLOP share {r['flop_share']:.3f})"
            if "python_calls_ratio" in r:
                extra += f"  (Python calls ratio {r['python_calls_ratio']:.2f})"
            if "traced_partially" in r:
                extra += f"  (stopped early: {r['traced_partially']})"
            if "same_numbers" in r:
                extra += (
                    f"  (loop alone: {r['naive_loop_only_speedup']:.1f}x; same NC/KMNC: {r['same_numbers']},"
                    f" tracker {r['tracker']['NC']:.4f}/{r['tracker']['KMNC']:.4f},"
                    f" naive {r['naive']['NC']:.4f}/{r['naive']['KMNC']:.4f})"
                )
            print(
                f"{r['measure']:<{w}}  {_fmt_ms(r['subject_ms']):>10}  {_fmt_ms(r.get('reference_ms')):>10}  "
                f"{r['ratio']:>7.3f}  {spread:>15}  {best:>6}  {r['target']:>17}  {ok}{extra}"
            )
        else:
            value = _fmt_ms(r["subject_ms"]) if "subject_ms" in r else str(r["subject"])
            print(
                f"{r['measure']:<{w}}  {value:>10}  {'':>10}  {'':>7}  {'':>15}  {'':>6}  {r['target']:>17}  {ok}"
            )


def print_details(
    rows: Sequence[dict[str, Any]], scaling: list[dict[str, Any]], retrace: dict[str, Any]
) -> None:
    compiled = [r for r in rows if "compiled" in r and "subject" in r["compiled"]]
    if compiled:
        print("\ncompiled XLA programs, jaxslice / hand-written (noise-free):")
        for r in compiled:
            c = r["compiled"]
            s, h = c["subject"], c["reference"]
            if "error" in s or "error" in h:
                print(
                    f"  {r['measure']}: cost analysis unavailable ({s.get('error') or h.get('error')})"
                )
                continue
            print(
                f"  {r['measure']}: flops {s['flops']:.4g} / {h['flops']:.4g}, bytes {s['bytes_accessed']:.4g} / "
                f"{h['bytes_accessed']:.4g}, HLO instructions {s['hlo_instructions']} / {h['hlo_instructions']}"
                f" -> {'identical' if c['identical'] else 'DIFFERENT'}"
            )
    inter = [r for r in rows if "flop_share" in r]
    if inter:
        print(
            "\nFLOPs (XLA cost analysis): js.intermediates program / hand-written prefix / full model / capture_intermediates:"
        )
        for r in inter:
            c = r["compiled"]
            v = r["versus_handwritten_prefix"]
            print(
                f"  {r['measure']}: {c['intermediates_flops']:.4g} / {c['handwritten_prefix_flops']:.4g} / "
                f"{c['full_flops']:.4g} / {c['capture_flops']:.4g}  (share {r['flop_share']:.3f}); "
                f"time js.intermediates / jitted hand-written prefix: {v['ratio']:.3f} "
                f"({v['subject_ms']:.2f} / {v['reference_ms']:.2f} ms)"
            )
    if scaling:
        print("\nanalysis vs equations (abstract inputs; medians; slice start='stage3'):")

        def cell(e: dict[str, Any], key: str, fmt: str | None, p: str) -> str:
            if fmt is None:  # graph-build calls per equation
                return f"{e[key] / e[p + '_graph_eqns']:.0f}"
            return fmt.format(e[key])

        for p, mode in (("e", "eval"), ("t", "train, mutable batch_stats")):
            cols = [
                ("arch", "arch", "{}"),
                ("eqns", f"{p}_graph_eqns", "{}"),
                ("calls", "calls", "{}"),
                ("state", f"{p}_state", "{}"),
                ("make_jaxpr", f"{p}_make_jaxpr_ms", "{:.0f}ms"),
                ("trace", f"{p}_trace_ms", "{:.0f}ms"),
                ("build", f"{p}_build_ms", "{:.1f}ms"),
                ("plan", f"{p}_plan_ms", "{:.1f}ms"),
                ("Sliced()", f"{p}_sliced_ms", "{:.1f}ms"),
                ("analysis", f"{p}_analysis_ms", "{:.1f}ms"),
                ("us/eqn", f"{p}_us_per_eqn", "{:.0f}"),
                ("build calls/eqn", f"{p}_build_pycalls", None),
                ("Sliced() calls/eqn", f"{p}_pycalls_per_eqn", "{:.0f}"),
            ]
            cells = [[cell(e, k, f, p) for _, k, f in cols] for e in scaling]
            widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
            print(f"  {mode}:")
            print("  " + "  ".join(h.rjust(wd) for (h, _, _), wd in zip(cols, widths, strict=True)))
            for c in cells:
                print("  " + "  ".join(v.rjust(wd) for v, wd in zip(c, widths, strict=True)))
        print(
            "  analysis = graph build + Sliced() (Resolver, plan, emit, pruning); state = updated-state entries;\n"
            "  calls/eqn = Python function calls per graph equation (cProfile's count: noise-free, constant\n"
            "  when the work grows linearly)"
        )
    if retrace:
        print(
            f"\nmodel traces per call (slice start='stage3' built with {retrace['traces_at_build']} trace(s)):"
        )
        for c in retrace["calls"]:
            print(
                f"  {c['call']:<52} {c['model_traces']}{'' if not c['seen'] else '   (seen shape)'}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="jaxslice performance table (ratios from one run)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: ResNet-10/18 shapes, few rounds (< ~1 min)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds per compiled pair (11; 3 quick)",
    )
    parser.add_argument(
        "--round-seconds",
        type=float,
        default=None,
        help="time per round and side (0.2 s; 0.02 quick)",
    )
    parser.add_argument(
        "--reps", type=int, default=None, help="repetitions per build measurement (9; 3 quick)"
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated parts: compiled,builds,scaling,torch"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when any target is missed (timing too)"
    )
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json")
    )
    args = parser.parse_args(argv)
    cfg = Config(args.quick, args.rounds, args.round_seconds, args.reps)
    parts = set((args.only or "compiled,builds,scaling,torch").split(","))

    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    retrace: dict[str, Any] = {}
    scaling: list[dict[str, Any]] = []
    if "builds" in parts:
        rows += bench_builds(cfg, log)
    if "scaling" in parts:
        r, scaling = bench_scaling(cfg, log)
        rows += r
    if "compiled" in parts:
        r, retrace = bench_compiled(cfg, log)
        rows += r
    if "torch" in parts:
        rows.append(bench_torchvision(cfg, log))
    rows.sort(key=lambda r: r["measure"][:3])
    total = time.perf_counter() - start

    print(
        f"\njaxslice {js.__version__}, jax {jax.__version__}, flax {_flax_version()}, "
        f"{jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPUs. "
        f"Compiled rows: {cfg.arch} on {cfg.size}x{cfg.size}x3, batch {cfg.batch}, {cfg.rounds} rounds of "
        f"~{cfg.round_s}s (calls alternated); builds: {cfg.build_arch}, {cfg.reps} reps (alternated, fresh "
        "model each); medians.\n"
    )
    print_table(rows)
    print_details(rows, scaling, retrace)
    print(f"\ntotal {total:.1f}s")
    result = {
        "jaxslice": js.__version__,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(jax.devices()[0]),
        "cpus": os.cpu_count(),
        "quick": cfg.quick,
        "config": {k: v for k, v in vars(cfg).items()},
        "rows": rows,
        "scaling": scaling,
        "retrace": retrace,
        "total_s": total,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"wrote {args.out}")
    failed = [r for r in rows if r.get("ok") is False and (args.strict or "8." in r["measure"])]
    return 1 if failed else 0


def _flax_version() -> str:
    import flax

    return flax.__version__


if __name__ == "__main__":
    sys.exit(main())
