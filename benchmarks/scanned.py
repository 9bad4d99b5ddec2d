"""Rows 10, 11 and 12: per-iteration boundaries inside a scanned layer stack.

The model is a stack of pre-LayerNorm transformer blocks (self-attention and a gelu MLP,
each with a residual) run by ``nn.scan`` as one module named ``layers``: 24 blocks on
batch 8 x 64 tokens x width 128 (``--quick``: 12 blocks), so the forward
is almost all blocks. Its twin `Unrolled` calls the same blocks in a Python loop
(``layers_0``, ``layers_1``...) with the same weights, unstacked; its
``capture_intermediates`` is both the reference of row 11 and the check of every slice,
done before anything is timed.

* 10: a slice ending at ``layers[e]`` (iterations 0..e) and one starting at ``layers[s]``
  (iterations s..n-1, fed the block's input) against the jitted full forward. The exact
  part of the figure is the number of loop iterations each compiled program runs, read
  from the programs (``sub.jaxpr`` and ``jax.make_jaxpr``), printed beside the times.
* 11: ``js.intermediates(names=["layers[:]"])`` (every block's output, stacked), warm,
  against capturing the same 24 block outputs of the unrolled twin under one ``jax.jit``
  (a ``capture_intermediates`` filter that keeps only the blocks, so both sides return
  the same arrays); capturing everything (``capture_intermediates=True``) and the plain
  jitted scanned forward are printed beside it.
* 12: XLA compile time of a slice's program against the full scanned model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from _common import Config, Log, meets, row
from _timing import Op, check_close, compare, compiled_cost, paired

import jaxslice as js

HEADS = 4


class Block(nn.Module):
    """A pre-LN transformer block, with ``nn.scan``'s signature: (carry, x) -> (carry, y).

    `after_down`, if given, is applied to the MLP's output (inside the block: an edit
    written by hand, for the edit rows)."""

    after_down: Callable[[Any], Any] | None = None

    @nn.compact
    def __call__(self, x, _):
        width = x.shape[-1]
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(h, h)
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(4 * width, name="up")(h)
        h = nn.Dense(width, name="down")(nn.gelu(h))
        return x + (h if self.after_down is None else self.after_down(h)), None


class Scanned(nn.Module):
    """The blocks as one ``nn.scan`` (stacked parameters), named ``layers``."""

    depth: int
    after_down: Callable[[Any], Any] | None = None

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth
        )
        x, _ = stack(self.after_down, name="layers")(x, None)
        return x


class Unrolled(nn.Module):
    """The same blocks called in a Python loop, named ``layers_0``..``layers_{depth-1}``."""

    depth: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x, _ = Block(name=f"layers_{i}")(x, None)
        return x


def _blocks(module: nn.Module, method: str) -> bool:
    """capture_intermediates filter: the blocks' outputs only (what js.intermediates returns)."""
    return isinstance(module, Block) and method == "__call__"


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    """The jaxprs among an equation's parameters (a scan's body, a jit's program...)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr's Jaxpr
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def scan_iterations(jaxpr: Any) -> int:
    """Loop iterations a program runs: the lengths of its scans, nested ones multiplied."""
    total = 0
    for eqn in jaxpr.eqns:
        inner = sum(scan_iterations(sub) for sub in _sub_jaxprs(eqn.params))
        if eqn.primitive.name == "scan":
            total += eqn.params["length"] * max(inner, 1)
        else:
            total += inner
    return total


def _jaxpr_of(x: Any) -> Any:
    return getattr(x, "jaxpr", x)  # a ClosedJaxpr's Jaxpr


@dataclasses.dataclass
class Subjects:
    depth: int
    model: Scanned
    variables: Any
    x: Any
    full: Callable[..., Any]  # jax.jit(model.apply)
    unrolled: Unrolled
    unrolled_vars: Any
    capture: Callable[..., Any]  # the twin's blocks under capture_intermediates, jitted
    block_outs: list[Any]  # block i's output, from the twin
    full_iterations: int  # block iterations the full model runs
    head: Any  # js.slice(end=f"layers[{cfg.scan_end}]")
    tail: Any  # js.slice(start=f"layers[{cfg.scan_start}]", end=None)...
    tail_input: Any  # ...and its input: the previous block's output


def _unstacked(variables: Any, depth: int) -> Any:
    stacked = variables["params"]["layers"]
    return {
        "params": {f"layers_{i}": jax.tree.map(lambda p, i=i: p[i], stacked) for i in range(depth)}
    }


def subjects(cfg: Config, log: Log) -> Subjects:
    depth = cfg.scan_depth
    log(f"   variables of a {depth}-block scanned stack")
    x = jax.random.normal(jax.random.key(0), cfg.scan_shape)
    model = Scanned(depth)
    variables = jax.jit(model.init)(jax.random.key(1), x)
    unrolled = Unrolled(depth)
    unrolled_vars = _unstacked(variables, depth)
    capture = jax.jit(
        lambda v, a: unrolled.apply(v, a, capture_intermediates=_blocks, mutable=["intermediates"])
    )
    full = jax.jit(model.apply)
    out, state = capture(unrolled_vars, x)
    check_close(full(variables, x), out, "scanned model vs its unrolled twin", 1e-3)
    block_outs = [state["intermediates"][f"layers_{i}"]["__call__"][0][0] for i in range(depth)]
    iterations = scan_iterations(_jaxpr_of(jax.make_jaxpr(model.apply)(variables, x)))
    e, st = cfg.scan_end, cfg.scan_start
    head = js.slice(model, variables, x, end=f"layers[{e}]")
    tail = js.slice(model, variables, x, start=f"layers[{st}]", end=None)
    tail_input = block_outs[st - 1]
    check_close(head(x)[0], block_outs[e], f"slice(end=layers[{e}]) vs the twin's block {e}")
    check_close(tail(tail_input), out, f"slice(start=layers[{st}]) vs the twin", 1e-3)
    return Subjects(
        depth, model, variables, x, full, unrolled, unrolled_vars, capture, block_outs,
        iterations, head, tail, tail_input,
    )  # fmt: skip


def _iterations_note(sub: Any, s: Subjects) -> tuple[int, str]:
    n = scan_iterations(_jaxpr_of(sub.jaxpr))
    return n, f"runs {n}/{s.full_iterations} block iterations"


def forward_rows(s: Subjects, cfg: Config) -> list[dict[str, Any]]:
    """Row 10: a slice of the first iterations, and one of the last, vs the full forward."""
    e, st, n = cfg.scan_end, cfg.scan_start, s.depth
    model = f"scan of {n} blocks"
    cases = (
        (f"10. forward: input->layers[{e}] / full forward ({model})", s.head, s.x, e + 1),
        (f"10. forward: layers[{st}]->output / full forward ({model})", s.tail,
         s.tail_input, n - st),
    )  # fmt: skip
    rows = []
    for label, sub, inp, runs in cases:
        res = compare(
            lambda sub=sub, inp=inp: sub(inp),
            lambda: s.full(s.variables, s.x),
            cfg.rounds,
            cfg.round_s,
        )
        # the slice's program alone (no jaxslice dispatch), jitted like the reference
        f_jit = jax.jit(lambda v, a, sub=sub: sub.apply(v, a))
        jitted = compare(
            lambda f_jit=f_jit, sub=sub, inp=inp: f_jit(sub.variables, inp),
            lambda: s.full(s.variables, s.x),
            cfg.rounds,
            cfg.round_s,
        )
        iterations, what = _iterations_note(sub, s)
        limit = runs / n + 0.05
        note = f"({what}; jit(sub.apply) / full {jitted['ratio']:.3f})"
        rows.append(
            row(
                label,
                res,
                f"<= {limit:.3f}",
                res["ratio"] <= limit,
                note,
                iterations=[iterations, s.full_iterations],
                jitted_apply=jitted,
            )
        )
    return rows


def intermediates_row(s: Subjects, cfg: Config) -> dict[str, Any]:
    """Row 11: every block's output from the scanned model vs capturing the unrolled twin's."""
    names = ["layers[:]"]
    ours = lambda: js.intermediates(s.model, s.variables, s.x, names=names)  # noqa: E731
    stacked = ours()["layers[:]"]  # the first call builds; the timed ones are warm
    check_close(stacked[0], jnp.stack(s.block_outs), "js.intermediates(layers[:]) vs twin", 1e-3)
    ref = lambda: s.capture(s.unrolled_vars, s.x)  # noqa: E731
    res = compare(ours, ref, cfg.rounds, cfg.round_s)
    everything = jax.jit(
        lambda v, a: s.unrolled.apply(v, a, capture_intermediates=True, mutable=["intermediates"])
    )
    vs_all = compare(ours, lambda: everything(s.unrolled_vars, s.x), cfg.rounds, cfg.round_s)
    vs_fwd = compare(ours, lambda: s.full(s.variables, s.x), cfg.rounds, cfg.round_s)
    note = (
        f"(/ capture_intermediates=True {vs_all['ratio']:.3f}; "
        f"/ jitted scanned forward {vs_fwd['ratio']:.3f})"
    )
    label = f"11. js.intermediates(layers[:]) / capture_intermediates, unrolled ({s.depth} blocks)"
    return row(
        label,
        res,
        "<= 1.1",
        res["ratio"] <= 1.1,
        note,
        versus_capture_all=vs_all,
        versus_scanned_forward=vs_fwd,
    )


def _rows_twin(s: Subjects, lo: int, hi: int) -> Callable[..., Any]:
    """Hand-written twin of a slice running blocks lo..hi-1: a scan of that length over the
    stacked parameters' rows lo:hi, cut inside the program (as a slice gets them whole)."""
    twin = Scanned(hi - lo)
    return lambda v, a: twin.apply(jax.tree.map(lambda p: p[lo:hi], v), a)


def compile_rows(s: Subjects, cfg: Config) -> list[dict[str, Any]]:
    """Row 12: XLA compile time of a slice's program / the full scanned model's.

    Only ``Lowered.compile()`` is timed: each repetition first lowers (untimed, `Op.setup`)
    a new ``jax.jit`` of a new function, so that the compile is never served from JAX's
    in-memory caches (a jitted function keeps its executable), and neither side reuses the
    other's work. Tracing a slice is its build (rows 3 and 4) and lowering is a small cost
    on both sides; the compile is what depends on the program. Beside it: the slice against
    a hand-written twin (`_rows_twin`), and both programs' HLO instruction counts (exact).
    """
    e, st, n = cfg.scan_end, cfg.scan_start, s.depth
    v, x = s.variables, s.x
    cases = (
        (f"end=layers[{e}]", s.head, x, _rows_twin(s, 0, e + 1)),
        (f"start=layers[{st}]", s.tail, s.tail_input, _rows_twin(s, st, n)),
    )
    full_fn = lambda v_, a: s.model.apply(v_, a)  # noqa: E731
    full_hlo = compiled_cost(jax.jit(full_fn), v, x).get("hlo_instructions")
    cache = jax.config.jax_compilation_cache_dir
    warning = f"; persistent compilation cache {cache}: times may be cache reads" if cache else ""

    def compile_of(fn: Callable[..., Any], inp: Any) -> Op:
        # lowered untimed, by a new jit of a new function each time: its own trace and compile
        return Op(
            lambda lowered: lowered.compile(),
            lambda: jax.jit(lambda v_, a: fn(v_, a)).lower(v, inp),
        )

    rows = []
    for spec, sub, inp, twin in cases:
        sub_fn = lambda v_, a, sub=sub: sub.apply(v_, a)  # noqa: E731
        res = paired(compile_of(sub_fn, inp), compile_of(full_fn, x), cfg.reps, count_calls=False)
        hlo = [compiled_cost(jax.jit(f), v, inp).get("hlo_instructions") for f in (sub_fn, twin)]
        label = f"12. XLA compile: slice({spec}) / full model (scan of {n} blocks)"
        parts = ["compile only", f"HLO instructions slice/twin/full {hlo[0]}/{hlo[1]}/{full_hlo}"]
        extra: dict[str, Any] = {"hlo_instructions": [*hlo, full_hlo]}
        if not cfg.quick:  # --quick keeps the exact counts, skips this timing
            vs_twin = paired(compile_of(sub_fn, inp), compile_of(twin, inp), cfg.reps, False)
            parts.insert(1, f"/ hand-written twin {vs_twin['ratio']:.3f}")
            extra["versus_twin"] = vs_twin
        note = f"({'; '.join(parts)}{warning})"
        rows.append(row(label, res, "<= 1.0", meets(res["ratio"], "<= 1.0"), note, **extra))
    return rows


def run(cfg: Config, log: Log) -> dict[str, Any]:
    s = subjects(cfg, log)
    log("10. forward of slices of a scanned stack vs the full forward")
    rows = forward_rows(s, cfg)
    log("11. js.intermediates(layers[:]) vs capture_intermediates of the unrolled twin")
    rows.append(intermediates_row(s, cfg))
    log("12. compile time of slices of a scanned stack")
    rows += compile_rows(s, cfg)
    return {"rows": rows}
