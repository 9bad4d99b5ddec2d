"""Timing helpers: ratios of a subject to a reference measured side by side.

The machine's speed and load cancel out of a ratio only when both sides see the same
conditions, so every helper alternates the two sides (and which one goes first) and
reports medians over rounds, the spread of the per-round ratios, and "best" = fastest
subject / fastest reference (load only ever adds time).

* `compare`: steady-state calls of compiled callables (after warm-up), each call ending in
  `block_until_ready`; a round's ratio is median subject call / median reference call.
* `paired`: one-shot operations such as builds; each side is an `Op` whose untimed `setup`
  makes what the timed `run` consumes (a fresh model), timed with the cyclic GC off. The
  Python function-call counts (cProfile) of one more run of each are compared too.
* `compiled_cost`: XLA's own account of a compiled program. Equal programs mean that a
  timing ratio away from 1 is noise; unlike times, these numbers are exact.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import math
import pstats
import re
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def once(fn: Callable[[], Any]) -> float:
    """Seconds for one call of `fn`, its result included (blocked on)."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def alternate(
    a: Callable[[], float], b: Callable[[], float], n: int, offset: int = 0
) -> tuple[list[float], list[float]]:
    """`n` results of each timer, alternating which one runs first."""
    ta: list[float] = []
    tb: list[float] = []
    for i in range(n):
        if (i + offset) % 2 == 0:
            ta.append(a())
            tb.append(b())
        else:
            tb.append(b())
            ta.append(a())
    return ta, tb


def summarise(subject: list[list[float]], reference: list[list[float]]) -> dict[str, Any]:
    """Medians and ratios over rounds; each round is a list of call times per side."""
    ms = [statistics.median(r) for r in subject]
    mr = [statistics.median(r) for r in reference]
    ratios = [a / b for a, b in zip(ms, mr, strict=True)]
    return {
        "subject_ms": statistics.median(ms) * 1e3,
        "reference_ms": statistics.median(mr) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "best_ratio": min(map(min, subject)) / min(map(min, reference)),
        "rounds": len(subject),
        "calls_per_round": len(subject[0]),
    }


def _calls_per_round(subject: Callable[[], Any], reference: Callable[[], Any], s: float) -> int:
    for _ in range(2):  # warm-up: compiles and fills caches
        once(subject)
        once(reference)
    pair = statistics.median(once(subject) + once(reference) for _ in range(3))
    return max(1, min(500, int(s / max(pair, 1e-6))))


def compare(
    subject: Callable[[], Any], reference: Callable[[], Any], rounds: int, round_s: float
) -> dict[str, Any]:
    """Steady-state timing of two zero-argument callables, alternated call by call."""
    n = _calls_per_round(subject, reference, round_s)
    runs = [alternate(lambda: once(subject), lambda: once(reference), n, r) for r in range(rounds)]
    return summarise([s for s, _ in runs], [r for _, r in runs])


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Collects garbage, then keeps the cyclic GC off (as `timeit` does). A full collection
    costs ~0.1 s once the process holds a few traced ResNets and lands at random inside a
    trace: it made single build timings swing by that much, on both sides."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _nothing() -> None:
    return None


class Op(NamedTuple):
    """A one-shot operation: `run(setup())`, where only `run` is timed."""

    run: Callable[[Any], Any]
    setup: Callable[[], Any] = _nothing


def timed(op: Op, keep: Callable[[Any], None] | None = None) -> float:
    """Seconds for one `op.run`, with the GC off; `keep` receives its result."""
    arg = op.setup()
    with no_gc():
        t = time.perf_counter()
        out = op.run(arg)
        seconds = time.perf_counter() - t
    if keep is not None:
        keep(out)
    return seconds


def python_calls(op: Op) -> int:
    """Python function calls made by one `op.run` (cProfile's count): noise-free work."""
    arg = op.setup()
    prof = cProfile.Profile()
    prof.enable()
    try:
        op.run(arg)
    finally:
        prof.disable()
    return pstats.Stats(prof).total_calls  # type: ignore[attr-defined]


def paired(
    subject: Op,
    reference: Op,
    reps: int,
    inspect: Callable[[Any], Any] | None = None,
    count_calls: bool = True,
) -> dict[str, Any]:
    """One-shot operations alternated rep by rep, after one warm-up rep of each.
    `inspect` maps each timed subject result to what goes in ``"subject_info"``."""
    infos: list[Any] = []
    keep = (lambda out: infos.append(inspect(out))) if inspect else None
    timed(subject)
    timed(reference)
    s, r = alternate(lambda: timed(subject, keep), lambda: timed(reference), reps)
    res = summarise([[t] for t in s], [[t] for t in r])
    if inspect is not None:
        res["subject_info"] = infos
    if count_calls:
        calls = [python_calls(subject), python_calls(reference)]
        res.update(python_calls=calls, python_calls_ratio=calls[0] / calls[1])
    return res


_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=", re.M)


def compiled_cost(fn: Any, *args: Any) -> dict[str, Any]:
    """XLA's cost analysis and instruction count of a jitted function's compiled program."""
    try:
        compiled = fn.lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
        return {
            "flops": float(cost.get("flops", math.nan)),
            "bytes_accessed": float(cost.get("bytes accessed", math.nan)),
            "hlo_instructions": len(_HLO_INSTR.findall(compiled.as_text())),
        }
    except Exception as e:  # best effort: backend-dependent
        return {"error": f"{type(e).__name__}: {e}"}


def cost_pair(subject: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    ok = "error" not in subject and "error" not in reference
    return {
        "subject": subject,
        "reference": reference,
        "identical": subject == reference if ok else None,
    }


def check_close(a: Any, b: Any, what: str, atol: float = 1e-4) -> None:
    """Raises when two trees of arrays differ: a wrong result makes every timing moot."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb) or not all(
        bool(jnp.allclose(x, y, atol=atol, rtol=1e-4)) for x, y in zip(la, lb, strict=True)
    ):
        raise AssertionError(f"results differ: {what}")
