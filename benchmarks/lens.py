"""Rows 27 to 34: interventions with `js.lens` at interactive speed (issue 40).

Usage: python benchmarks/lens.py [--quick] [--strict] [--json PATH]

Two models, both `scanned.Scanned` (pre-LN transformer blocks in one ``nn.scan`` named
``layers``; the input is the embedding output): a GPT-2-small-shaped stack, 12 blocks of
width 768 (4 heads) on batch 4 x 64 tokens, for the rows about one forward (``--quick``: 4
blocks of width 64 on 2 x 16), and the 24-block stack of rows 10-12 (batch 8 x 64 x 128;
``--quick``: 12 blocks) for the sweep and attribution rows. Every timed case is first
checked against the same intervention written by hand: the blocks called in a Python loop
(`by_hand`), with the change applied to block k's output there.

  27. first 12-layer patching sweep from cleared caches (js.lens, the clean read, 12
      patched calls: build and compiles included) / the same sweep warm          <= 1.5
  28. lens with every site inert (add 0 at layers[:], scale 1 at layers[:]/down) / the
      plain jitted model, warm (28b, for information: steering at one layer)      <= 1.05
  29. a 12-layer patching sweep (the clean read + 12 calls with set at layers[k], one
      token position) / 13 plain jitted forwards, warm                             <= 1.0
  30. lens(x, read=True) on a fresh lens (build, compile, call; every site, inside the
      loop too) / the plain model's first jitted call                              <= 1.2
  31. lens.sweep of 64 patches at layers[12] of 24 / 64 separate lens calls, warm  <= 0.6
  32. attribution at every layer in one backward pass (jax.grad w.r.t. an add at
      layers[:], jitted) / jax.grad of the plain model's metric w.r.t. its input  <= 1.1
  33. lines a user writes (the snippets timed above, printed): steering at one layer;
      a 12-layer patching sweep                                                    1; <= 6
  34. first feature map in a fresh process: js.slice(ResNet, end=<bare name>) + its first
      call / jax.jit of the hand-written truncated model, first call (the cold group's
      processes, `cold.child`; median of 5 rounds, --quick 1)                      <= 1.05

Steady-state pairs alternate call by call (`_timing.compare`); the sweeps of rows 27 and
29 are long, so there each side is one whole sweep and the sides alternate sweep by
sweep; first calls (27, 30) start from cleared caches (`js.clear_caches`,
`jax.clear_caches`) and alternate with their references (`_timing.paired`). Ratios are
medians over rounds. Missed targets fail the run only with ``--strict``; a wrong result
always does. ``--quick`` is a smoke run: on its small model compiles and the Python work
of a call dominate, so its ratios say nothing about the targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from _common import Config, Log, meets, row, value_row
from _models import init_variables
from _timing import Op, alternate, check_close, compare, once, paired, summarise
from scanned import Block, Scanned

import jaxslice as js


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The GPT-2-shaped model of rows 27-30 and the repetitions of this group."""

    depth: int = 12
    shape: tuple[int, int, int] = (4, 64, 768)  # batch, tokens, width
    rounds: int = 5  # alternated rounds of the warm pairs
    reps: int = 3  # alternated repetitions of the first-call pairs
    runs: int = 64  # row 31: patches in one sweep
    round_s: float = 0.5  # compare(): seconds per side per round
    # rows 31-32: blocks and input of their stack (None: the scanned rows' stack, cfg's)
    deep: tuple[int, tuple[int, int, int]] | None = None

    @classmethod
    def make(cls, quick: bool) -> Sizes:
        return cls(4, (2, 16, 64), 3, 1, 8, 0.05, (4, (2, 16, 64))) if quick else cls()


STEER_AT = "layers[2]"  # the steering row's site


# The snippets a user writes (row 33 prints and counts their lines; the rows time them).


def steer(lens, x, v):
    return lens(x, add={"layers[2]": v})


def patching_sweep(model, variables, clean, corrupt, where):
    lens = js.lens(model, variables, clean)
    return lens, sweep_layers(lens, clean, corrupt, where)


def sweep_layers(lens, clean, corrupt, where):
    h = lens(clean, read=["layers[:]"])[1]["layers[:]"]
    return [lens(corrupt, set={f"layers[{k}]": (h[k], where)}) for k in range(len(h))]


def _body(fn: Callable[..., Any]) -> list[str]:
    """The lines of a snippet function's body as a user would write them: dedented,
    without its `def` line, blank lines, ``# fmt: skip`` marks and a closing
    ``return name`` (which only hands a result out of the function)."""
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()[1:]
    lines = [line.removesuffix("  # fmt: skip").rstrip() for line in lines if line.strip()]
    if lines and re.fullmatch(r"return \w+", lines[-1].strip()):
        lines.pop()
    return textwrap.dedent("\n".join(lines)).splitlines()


def user_lines() -> dict[str, list[str]]:
    """Row 33's snippets, as a user would write them: the lens made, then the calls."""
    sweep = [_body(patching_sweep)[0], *_body(sweep_layers)]
    return {"steering at one layer": _body(steer), "a 12-layer patching sweep": sweep}


# Hand-written references: the blocks in a Python loop, the change at block k's output.


def by_hand(variables: Any, x: Any, edit: Callable[[int, Any], Any] | None = None) -> Any:
    """The stack's forward with its blocks called one by one; `edit(k, h)` replaces block
    k's output h (None: the plain forward). Returns the output and every block's output."""
    stacked = variables["params"]["layers"]
    depth = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    h, outs = x, []
    for k in range(depth):
        params = jax.tree.map(lambda p, k=k: p[k], stacked)
        h, _ = Block().apply({"params": params}, h, None)
        h = h if edit is None else edit(k, h)
        outs.append(h)
    return h, jnp.stack(outs)


@jax.jit
def edited_by_hand(variables: Any, x: Any, k: Any, value: Any, mask: Any, add: Any) -> Any:
    """`by_hand` with block k's output h changed to ``where(mask, value, h + add)`` (k is
    traced: one compile serves every layer; k = -1 changes nothing)."""
    change = lambda i, h: jnp.where(i == k, jnp.where(mask, value, h + add), h)  # noqa: E731
    return by_hand(variables, x, change)


@dataclasses.dataclass
class Stack:
    """A scanned stack, its variables, inputs and references."""

    depth: int
    model: Scanned
    variables: Any
    clean: Any
    corrupt: Any
    full: Callable[..., Any]  # jax.jit(model.apply)
    blocks: Any  # the clean input's block outputs, stacked (by hand)


def stack(depth: int, shape: Sequence[int], log: Log) -> Stack:
    log(f"   a {depth}-block stack on {'x'.join(map(str, shape))} (batch x tokens x width)")
    clean = jax.random.normal(jax.random.key(0), tuple(shape))
    corrupt = jax.random.normal(jax.random.key(1), tuple(shape))
    model = Scanned(depth)
    variables = init_variables(model, clean)
    full = jax.jit(model.apply)
    unchanged = (-1, clean, jnp.zeros(clean.shape, bool), jnp.zeros(clean.shape[-1]))
    out, blocks = edited_by_hand(variables, clean, *unchanged)
    check_close(full(variables, clean), out, "scanned model vs its blocks by hand", 1e-3)
    return Stack(depth, model, variables, clean, corrupt, full, blocks)


def _first(setup_free: Callable[[], Any]) -> Op:
    """Something run once from cleared caches (the clearing untimed)."""

    def setup() -> None:
        js.clear_caches()
        jax.clear_caches()

    return Op(lambda _: jax.block_until_ready(setup_free()), setup)


def _zero(s: Stack) -> Any:
    """A feature vector of zeros (`edited_by_hand`'s `add` when it adds nothing)."""
    return jnp.zeros(s.clean.shape[-1])


def _position(s: Stack) -> Any:
    """The patch mask: the last token, every batch row and feature."""
    return (jnp.arange(s.clean.shape[1]) == s.clean.shape[1] - 1)[None, :, None]


def sweep_rows(s: Stack, sz: Sizes, log: Log) -> list[dict[str, Any]]:
    """Rows 27 and 29: the patching sweep, first and warm, and against plain forwards."""
    where = _position(s)
    lens, outs = patching_sweep(s.model, s.variables, s.clean, s.corrupt, where)
    mask = jnp.broadcast_to(where, s.clean.shape)
    for k in sorted({0, s.depth // 2, s.depth - 1}):
        want = edited_by_hand(s.variables, s.corrupt, k, s.blocks[k], mask, _zero(s))[0]
        check_close(outs[k], want, f"patch at layers[{k}] vs by hand", 1e-3)
    made: dict[str, Any] = {"lens": lens}

    def first_sweep() -> Any:
        made["lens"], out = patching_sweep(s.model, s.variables, s.clean, s.corrupt, where)
        return out

    log(f"27. first {s.depth}-layer patching sweep / the same sweep warm")
    warm = Op(
        lambda _: jax.block_until_ready(sweep_layers(made["lens"], s.clean, s.corrupt, where))
    )
    res = paired(_first(first_sweep), warm, sz.reps, count_calls=False)
    label = f"27. first {s.depth}-layer patching sweep (js.lens + compiles) / the same sweep warm"
    rows = [row(label, res, "<= 1.5", meets(res["ratio"], "<= 1.5"), "(build included)")]

    log(f"29. {s.depth}-layer patching sweep / {s.depth + 1} plain jitted forwards")
    lens = made["lens"]
    plain = lambda: [s.full(s.variables, a) for a in [s.clean] + [s.corrupt] * s.depth]  # noqa: E731
    res = _whole(lambda: sweep_layers(lens, s.clean, s.corrupt, where), plain, sz.rounds)
    label = (
        f"29. patching sweep: clean read + {s.depth} set calls / {s.depth + 1} plain jitted "
        "forwards, warm"
    )
    rows.append(row(label, res, "<= 1.0", meets(res["ratio"], "<= 1.0")))
    return rows


def _whole(subject: Callable[[], Any], reference: Callable[[], Any], rounds: int) -> dict:
    """Long operations timed whole, one of each side per round, alternated (after one
    untimed run of each)."""
    once(subject), once(reference)
    s, r = alternate(lambda: once(subject), lambda: once(reference), rounds)
    return summarise([[t] for t in s], [[t] for t in r])


def call_rows(s: Stack, sz: Sizes, log: Log) -> list[dict[str, Any]]:
    """Rows 28 and 28b: a lens call with inert interventions, and steering, / plain."""
    lens = js.lens(s.model, s.variables, s.clean)
    width = s.clean.shape[-1]
    zeros = jnp.zeros(width)
    inert = lambda: lens(s.clean, add={"layers[:]": zeros}, scale={"layers[:]/down": 1.0})  # noqa: E731
    check_close(inert(), s.full(s.variables, s.clean), "inert lens vs the plain model", 1e-3)
    v = jax.random.normal(jax.random.key(2), (width,))
    k = int(STEER_AT[len("layers[") : -1])
    nowhere = jnp.zeros(s.clean.shape, bool)
    want = edited_by_hand(s.variables, s.clean, k, s.clean, nowhere, v)[0]
    check_close(steer(lens, s.clean, v), want, f"steering at {STEER_AT} vs by hand", 1e-3)
    plain = lambda: s.full(s.variables, s.clean)  # noqa: E731

    log("28. lens with every site inert / the plain jitted model")
    res = compare(inert, plain, sz.rounds, sz.round_s)
    label = "28. lens, inert add at layers[:] and scale at layers[:]/down / plain jitted model"
    rows = [row(label, res, "<= 1.05", meets(res["ratio"], "<= 1.05"))]
    res = compare(lambda: steer(lens, s.clean, v), plain, sz.rounds, sz.round_s)
    label = f"28b. steering: lens(x, add={{'{STEER_AT}': v}}) / plain jitted model"
    rows.append(row(label, res, "info", None))
    return rows


def read_row(s: Stack, sz: Sizes, log: Log) -> dict[str, Any]:
    """Row 30: caching every site on a fresh lens / the model's first jitted call."""
    out, cache = js.lens(s.model, s.variables, s.clean)(s.clean, read=True)
    check_close(out, s.blocks[-1], "read=True output vs by hand", 1e-3)
    check_close(cache["layers[:]"], s.blocks, "read=True's layers[:] vs by hand", 1e-3)
    sites = len(cache)

    log("30. first lens(x, read=True) / the model's first jitted call")
    subject = _first(lambda: js.lens(s.model, s.variables, s.clean)(s.clean, read=True))
    reference = _first(lambda: jax.jit(lambda a, b: s.model.apply(a, b))(s.variables, s.clean))
    res = paired(subject, reference, sz.reps, count_calls=False)
    label = f"30. first lens(x, read=True), fresh lens ({sites} sites) / first jitted call"
    return row(label, res, "<= 1.2", meets(res["ratio"], "<= 1.2"), "(build included)")


def batch_rows(s: Stack, sz: Sizes, log: Log) -> list[dict[str, Any]]:
    """Rows 31 and 32 on the 24-block stack: a sweep at its middle, attribution."""
    n, k = sz.runs, s.depth // 2
    lens = js.lens(s.model, s.variables, s.clean)
    site = f"layers[{k}]"
    patches = jax.random.normal(jax.random.key(3), (n, *s.clean.shape))
    swept = lens.sweep(s.clean, set={site: patches})
    everywhere = jnp.ones(s.clean.shape, bool)
    for i in (0, n - 1):
        want = edited_by_hand(s.variables, s.clean, k, patches[i], everywhere, _zero(s))[0]
        check_close(swept[i], want, f"sweep run {i} at {site} vs by hand", 1e-3)

    log(f"31. lens.sweep of {n} patches at {site} of {s.depth} / {n} separate calls")
    res = compare(
        lambda: lens.sweep(s.clean, set={site: patches}),
        lambda: [lens(s.clean, set={site: p}) for p in patches],
        sz.rounds,
        sz.round_s,
    )
    label = f"31. lens.sweep of {n} patches at {site} of {s.depth} / {n} lens calls, warm"
    rows = [row(label, res, "<= 0.6", meets(res["ratio"], "<= 0.6"))]

    log(f"32. attribution at all {s.depth} layers / jax.grad w.r.t. the input")
    metric = lambda out: jnp.sum(out[:, -1] ** 2)  # noqa: E731
    zeros = jnp.zeros(lens.sites["layers[:]"].stacked.shape)
    # variables and input are arguments: closed over, XLA would fold what precedes the add
    ours = jax.jit(jax.grad(lambda a, v, x: metric(lens.apply(v, x, add={"layers[:]": a}))))
    plain = jax.jit(jax.grad(lambda x, v: metric(s.model.apply(v, x))))
    added = lambda a, v, x: by_hand(v, x, lambda i, h: h + a[i])[0]  # noqa: E731
    want = jax.jit(jax.grad(lambda a, v, x: metric(added(a, v, x))))(zeros, s.variables, s.clean)
    got = ours(zeros, s.variables, s.clean)
    check_close(got, want, "attribution at layers[:] vs grad by hand", 1e-3)
    res = compare(
        lambda: ours(zeros, s.variables, s.clean),
        lambda: plain(s.clean, s.variables),
        sz.rounds,
        sz.round_s,
    )
    label = f"32. attribution, grad w.r.t. add at layers[:] ({s.depth}) / grad w.r.t. input"
    rows.append(row(label, res, "<= 1.1", meets(res["ratio"], "<= 1.1")))
    return rows


def lines_row() -> dict[str, Any]:
    """Row 33: the lines of the snippets the rows above time."""
    counts = [len(lines) for lines in user_lines().values()]
    ok = counts[0] <= 1 and counts[1] <= 6
    label = "33. lines a user writes: steering at one layer; a 12-layer patching sweep"
    note = "(the snippets: python benchmarks/lens.py prints them)"
    return value_row(label, f"{counts[0]}; {counts[1]}", "1; <= 6", ok, note)


def cold_row(cfg: Config, log: Log) -> dict[str, Any]:
    """Row 34: the cold group's first feature map (its row 15), with this group's target."""
    import cold

    stage, block = cfg.cold_end
    end = f"layer{stage}_{block}"
    subject, reference = [], []
    with tempfile.TemporaryDirectory() as tmp:
        args = {"arch": cfg.cold_arch, "size": cfg.cold_size, "end": end, "upto": [stage, block]}
        args["variables"] = os.path.join(tmp, "variables.pkl")
        cold.write_variables(cfg, args["variables"])
        for r in range(cfg.cold_rounds):
            log(f"34. first feature map in fresh processes, round {r + 1} of {cfg.cold_rounds}")
            cases = [("first_map", subject), ("jit_first_map", reference)]
            for case, into in cases if r % 2 == 0 else cases[::-1]:
                into.append(cold.child(case, **args))
    cold.check_same(subject, reference)
    res = cold.pair(cold.secs(subject), cold.secs(reference))
    label = (
        f"34. first feature map, fresh process: js.slice(end='{end}') + call / jax.jit "
        f"hand-written, first call ({cfg.cold_arch}, {cfg.cold_size}x{cfg.cold_size})"
    )
    return cold.ratio_row(label, res, "<= 1.05")


def run(cfg: Config, log: Log) -> dict[str, Any]:
    sz = Sizes.make(cfg.quick)
    gpt = stack(sz.depth, sz.shape, log)
    rows = sweep_rows(gpt, sz, log)
    rows += call_rows(gpt, sz, log)
    rows.append(read_row(gpt, sz, log))
    depth, shape = sz.deep or (cfg.scan_depth, cfg.scan_shape)
    same = (depth, tuple(shape)) == (sz.depth, sz.shape)  # --quick: one small stack
    rows += batch_rows(gpt if same else stack(depth, shape, log), sz, log)
    rows.append(lines_row())
    rows.append(cold_row(cfg, log))
    return {"rows": rows}


def header(cfg: Config) -> str:
    sz = Sizes.make(cfg.quick)
    b, t, w = sz.shape
    depth, (sb, st, sw) = sz.deep or (cfg.scan_depth, cfg.scan_shape)
    return (
        f"jaxslice {js.__version__}, jax {jax.__version__}, "
        f"{jax.devices()[0].platform.upper()}. Rows 27-30: {sz.depth} blocks of width {w} "
        f"on {b}x{t} tokens; rows 31-32: {depth} blocks of width {sw} on {sb}x{st}; "
        f"{sz.rounds} rounds (warm pairs), {sz.reps} reps (first calls), alternated; medians."
    )


def print_snippets() -> None:
    print("\nrow 33, the lines counted (as timed above; `lens` made once per model):")
    for what, lines in user_lines().items():
        print(f"  {what} ({len(lines)}):")
        for line in lines:
            print(f"    {line}")


def main(argv: Sequence[str] | None = None) -> int:
    import _report

    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description="js.lens rows (ratios from one run)")
    p.add_argument("--quick", action="store_true", help="smoke run: small models, few rounds")
    p.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    p.add_argument("--json", default=os.path.join(here, "results_lens.json"), help="results")
    args = p.parse_args(argv)
    cfg = Config.make(args.quick)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    results = run(cfg, log)
    total = time.perf_counter() - start
    print(f"\n{header(cfg)}\n")
    _report.print_table(results["rows"])
    print_snippets()
    print(f"\ntotal {total:.1f}s")
    _report.write_json(args.json, cfg, results, total)
    missed = [r["measure"] for r in results["rows"] if r.get("ok") is False]
    for m in missed:
        print(f"missed: {m}", file=sys.stderr)
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
