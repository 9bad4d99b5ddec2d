"""Rows 10, 11 and 12: per-iteration boundaries inside a scanned layer stack.

The model is a stack of pre-LayerNorm transformer blocks (self-attention and a gelu MLP,
each with a residual) run by ``nn.scan`` as one module named ``layers``: 24 blocks on
batch 8 x 64 tokens x width 128 (``--quick``: 12 blocks on 4 x 32 x 64), so the forward
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
from _timing import Op, check_close, compare, paired

import jaxslice as js

HEADS = 4


class Block(nn.Module):
    """A pre-LN transformer block, with ``nn.scan``'s signature: (carry, x) -> (carry, y)."""

    @nn.compact
    def __call__(self, x, _):
        width = x.shape[-1]
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(h, h)
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(4 * width, name="up")(h)
        return x + nn.Dense(width, name="down")(nn.gelu(h)), None


class Scanned(nn.Module):
    """The blocks as one ``nn.scan`` (stacked parameters), named ``layers``."""

    depth: int

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth
        )
        x, _ = stack(name="layers")(x, None)
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
    full_iterations: int


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
    return Subjects(
        depth, model, variables, x, full, unrolled, unrolled_vars, capture, block_outs, iterations
    )


def _iterations_note(sub: Any, s: Subjects) -> tuple[int, str]:
    n = scan_iterations(_jaxpr_of(sub.jaxpr))
    return n, f"runs {n}/{s.full_iterations} block iterations"


def forward_rows(s: Subjects, cfg: Config) -> list[dict[str, Any]]:
    """Row 10: a slice of the first iterations, and one of the last, vs the full forward."""
    e, st, n = cfg.scan_end, cfg.scan_start, s.depth
    head = js.slice(s.model, s.variables, s.x, end=f"layers[{e}]")
    tail = js.slice(s.model, s.variables, s.x, start=f"layers[{st}]", end=None)
    feats = s.block_outs[st - 1]  # layers[st]'s input: the previous block's output
    check_close(head(s.x)[0], s.block_outs[e], f"slice(end=layers[{e}]) vs the twin's block")
    check_close(tail(feats), s.full(s.variables, s.x), f"slice(start=layers[{st}]) vs full", 1e-3)
    model = f"{n}-block scan"
    cases = (
        (f"10. forward: input->layers[{e}] / jitted full forward ({model})", head, s.x, e + 1),
        (f"10. forward: layers[{st}]->output / jitted full forward ({model})", tail, feats, n - st),
    )
    rows = []
    for label, sub, inp, runs in cases:
        res = compare(lambda sub=sub, inp=inp: sub(inp), lambda: s.full(s.variables, s.x),
                      cfg.rounds, cfg.round_s)
        # the slice's program alone (no jaxslice dispatch), jitted like the reference
        f_jit = jax.jit(lambda v, a, sub=sub: sub.apply(v, a))
        jitted = compare(lambda f_jit=f_jit, sub=sub, inp=inp: f_jit(sub.variables, inp),
                         lambda: s.full(s.variables, s.x), cfg.rounds, cfg.round_s)
        iterations, what = _iterations_note(sub, s)
        limit = runs / n + 0.05
        note = f"({what}; jit(sub.apply) / full {jitted['ratio']:.3f})"
        rows.append(
            row(label, res, f"<= {limit:.3f}", res["ratio"] <= limit, note,
                iterations=[iterations, s.full_iterations], jitted_apply=jitted)
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
    label = (
        f"11. js.intermediates(layers[:]) / unrolled twin's capture_intermediates "
        f"(blocks; {s.depth}-block)"
    )
    return row(label, res, "<= 1.1", res["ratio"] <= 1.1, note,
               versus_capture_all=vs_all, versus_scanned_forward=vs_fwd)


def compile_rows(s: Subjects, cfg: Config) -> list[dict[str, Any]]:
    """Row 12: XLA compile time of a slice's program / the full scanned model's.

    Only ``Lowered.compile()`` is timed: each repetition first lowers (untimed, `Op.setup`)
    a new ``jax.jit`` of a new lambda, so that the compile is never served from JAX's
    in-memory caches (a jitted function keeps its executable), and the subject's lowering
    does not benefit from the reference's or the other way round. Tracing a slice is its
    build (rows 3 and 4), and lowering both sides is a small, similar cost; the compile is
    what grows with the program, and what a smaller program should save.
    """
    e, st = cfg.scan_end, cfg.scan_start
    v, x = s.variables, s.x
    tail_input = s.block_outs[st - 1]
    cases = (
        (f"end=layers[{e}]", js.slice(s.model, v, x, end=f"layers[{e}]"), x),
        (f"start=layers[{st}]", js.slice(s.model, v, x, start=f"layers[{st}]", end=None), tail_input),
    )

    def lower_full() -> Any:
        return jax.jit(lambda v_, a: s.model.apply(v_, a)).lower(v, x)

    rows = []
    cache = jax.config.jax_compilation_cache_dir
    warning = f"; persistent compilation cache {cache}: times may be cache reads" if cache else ""
    for spec, sub, inp in cases:

        def lower_sub(sub: Any = sub, inp: Any = inp) -> Any:
            return jax.jit(lambda v_, a: sub.apply(v_, a)).lower(sub.variables, inp)

        compile_ = lambda lowered: lowered.compile()  # noqa: E731
        res = paired(Op(compile_, lower_sub), Op(compile_, lower_full), cfg.reps, count_calls=False)
        label = f"12. XLA compile: slice({spec}) / full model ({s.depth}-block scan)"
        note = f"(compile only; best {res['best_ratio']:.3f}{warning})"
        rows.append(row(label, res, "<= 1.0", meets(res["ratio"], "<= 1.0"), note))
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
