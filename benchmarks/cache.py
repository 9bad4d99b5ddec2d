"""Row 35: a second process's first call, with JAX's persistent compilation cache.

Usage: python benchmarks/cache.py [--quick]

Each case builds something on the scanned stack of rows 10-12 (`scanned.Scanned`: 24
pre-LN transformer blocks in one ``nn.scan`` on batch 8 x 64 tokens x width 128;
``--quick``: 12 blocks) and calls it once, timed in a fresh interpreter with
`time.perf_counter` (imports and loading the variables from a file are untimed):

  35a. js.slice(end="layers[2]") and its first call
  35b. js.edit(...).insert_after("layers[:]/down", scale, inputs=("s",)).build() and its
       first call, with the scale as a call-time input
  35c. js.intermediates(names=["layers[:]"])
  35d. js.lens(...) called with every block's MLP output scaled (a call-time argument)

Per round and case, a first process runs with an empty cache directory, then a second one
with the directory the first left (``JAX_COMPILATION_CACHE_DIR``, and
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`` so that short compiles are written too).
A row's ratio is the second process's first call / the first process's (median over
rounds). Its check is exact: every XLA compilation of the second process's timed call is a
hit of the persistent cache and nothing is written, counted with `jax.monitoring` (the
events ``/jax/compilation_cache/cache_hits`` and ``.../cache_misses``, the latter recorded
when an entry is written). The note gives the share of the first call that XLA
compilation took, and what the second call still spends (tracing, jaxslice's analysis,
lowering, the cache read). Every process checks its result against the model's own
``apply`` (the unedited model for 35a and 35c, the edit written into the model by hand
for 35b and 35d) after the timed call. The second process loads other variables and inputs than
the first (another seed, the same shapes): they are arguments of the compiled programs,
not constants, so its programs are the first's.

Run as a group of run.py (``run``) or alone; alone, the exit status is 1 when a row's
check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import Config, Log, row
from _models import init_variables
from _timing import check_close, summarise
from edits import SCALE, _scaled
from scanned import Scanned, Unrolled, _blocks, _unstacked

import jaxslice as js

TARGET = "every compile hit"
#: the `jax.monitoring` events a process counts, and the durations it sums
EVENTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "compiles",
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "writes",
}
DURATIONS = {"/jax/core/compile/backend_compile_duration": "compile_s"}


def child(case: str, args: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    """Runs one case in a fresh interpreter with the persistent cache at `cache_dir`."""
    env = {
        **os.environ,
        "JAX_ENABLE_COMPILATION_CACHE": "true",
        "JAX_COMPILATION_CACHE_DIR": cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, json.dumps(args)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"process {case!r} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def write_inputs(cfg: Config, seed: int, path: str) -> None:
    """The stack's variables (seeded, filled by NumPy) and an input, for a process to load."""
    x = np.random.default_rng(seed).standard_normal(cfg.scan_shape, np.float32)
    variables = init_variables(Scanned(cfg.scan_depth), x, seed)
    with open(path, "wb") as f:
        pickle.dump((jax.tree_util.tree_map(np.asarray, variables), x), f)


def rounds(cfg: Config, log: Log, cases: list[str]) -> dict[str, list[tuple[dict, dict]]]:
    """Per case, one (first process, second process) pair of results per round."""
    got: dict[str, list[tuple[dict, dict]]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(cfg.cold_rounds):
            log(f"35. persistent compilation cache, round {r + 1} of {cfg.cold_rounds}")
            # the second process loads other values (another seed) of the same shapes
            args = [{"depth": cfg.scan_depth, "end": cfg.scan_end} for _ in range(2)]
            for i, a in enumerate(args):
                a["inputs"] = os.path.join(tmp, f"inputs{r}-{i}.pkl")
                write_inputs(cfg, 2 * r + i, a["inputs"])
            for case in cases:
                cache_dir = os.path.join(tmp, f"cache-{case}-{r}")
                os.mkdir(cache_dir)
                first = child(case, args[0], cache_dir)
                entries = sorted(os.listdir(cache_dir))
                second = child(case, args[1], cache_dir)
                if sorted(os.listdir(cache_dir)) != entries:
                    second["new_entries"] = True
                got[case].append((first, second))
    return got


def _all_hit(second: dict[str, Any]) -> bool:
    return (
        second["compiles"] > 0
        and second["hits"] == second["compiles"]
        and second["writes"] == 0
        and not second.get("new_entries")
    )


def _median(results: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def case_row(label: str, pairs: list[tuple[dict, dict]]) -> dict[str, Any]:
    """A case's row: second process / first, with the hit check and the split in the note."""
    first, second = [p[0] for p in pairs], [p[1] for p in pairs]
    timing = summarise([[s["seconds"]] for s in second], [[f["seconds"]] for f in first])
    share = statistics.median(f["compile_s"] / f["seconds"] for f in first)
    hits = [f"{s['hits']}/{s['compiles']}" for s in second]
    note = (
        f"(first: XLA compile {share:.0%} of it; second: compiles from the cache "
        f"{', '.join(hits)}, {sum(s['writes'] for s in second)} written, "
        f"cache reads {_median(second, 'compile_s') * 1e3:.0f} ms, the rest "
        f"{(_median(second, 'seconds') - _median(second, 'compile_s')) * 1e3:.0f} ms)"
    )
    ok = all(_all_hit(s) for s in second)
    return row(label, timing, TARGET, ok, note, first=first, second=second)


LABELS = {
    "slice": "35a. js.slice(end='layers[{end}]') + first call, 2nd process / 1st",
    "edit": "35b. js.edit(...).build() + first call (call-time input), 2nd process / 1st",
    "intermediates": "35c. first js.intermediates(names=['layers[:]']), 2nd process / 1st",
    "lens": "35d. js.lens(...) + first call (every block's MLP output scaled), 2nd process / 1st",
}


def run(cfg: Config, log: Log) -> dict[str, Any]:
    got = rounds(cfg, log, list(LABELS))
    rows = [case_row(LABELS[case].format(end=cfg.scan_end), pairs) for case, pairs in got.items()]
    return {"rows": rows}


# ---- the measured processes (``cache.py --child CASE ARGS``) ----


class Counter:
    """Counts `jax.monitoring` events (`EVENTS`) and sums durations (`DURATIONS`)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys([*EVENTS.values(), *DURATIONS.values()], 0)
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **_: Any) -> None:
        if event in EVENTS:
            self.counts[EVENTS[event]] += 1

    def _duration(self, event: str, seconds: float, **_: Any) -> None:
        if event in DURATIONS:
            self.counts[DURATIONS[event]] += seconds

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        return {k: v - before[k] for k, v in self.counts.items()}


def _rows(variables: Any, lo: int, hi: int) -> Any:
    """The stacked parameters' rows lo:hi: a shorter stack of the same blocks."""
    return jax.tree_util.tree_map(lambda p: p[lo:hi], variables)


def _slice(model: Any, variables: Any, x: Any, args: dict[str, Any]) -> tuple[Any, Any]:
    """Timed: the slice up to block `end` and its first call. Expected: a stack of the
    first end + 1 blocks, the model's own apply on those rows."""
    end = args["end"]
    got = lambda: js.slice(model, variables, x, end=f"layers[{end}]")(x)[0]  # noqa: E731
    return got, lambda v, a: Scanned(end + 1).apply(_rows(v, 0, end + 1), a)


def _edit(model: Any, variables: Any, x: Any, args: dict[str, Any]) -> tuple[Any, Any]:
    """Timed: every block's MLP output scaled by a call-time input, built and called.
    Expected: the same edit written into the block (`edits._scaled`), the model's apply."""
    scale = np.full((args["depth"], *x.shape), SCALE, np.float32)  # row k: block k's

    def got() -> Any:
        editor = js.edit(model, variables, x)
        edited = editor.insert_after("layers[:]/down", lambda h, s: s * h, inputs=("s",))
        return edited.build()(x, s=scale)

    return got, Scanned(args["depth"], _scaled).apply


def _intermediates(model: Any, variables: Any, x: Any, args: dict[str, Any]) -> tuple[Any, Any]:
    """Timed: every block's output, stacked. Expected: the unrolled twin's blocks'
    outputs under capture_intermediates (`scanned.Unrolled`), stacked."""
    depth = args["depth"]
    got = lambda: js.intermediates(model, variables, x, names=["layers[:]"])["layers[:]"][0]  # noqa: E731

    def want(v: Any, a: Any) -> Any:
        _, state = Unrolled(depth).apply(
            _unstacked(v, depth), a, capture_intermediates=_blocks, mutable=["intermediates"]
        )
        blocks = state["intermediates"]
        return jnp.stack([blocks[f"layers_{i}"]["__call__"][0][0] for i in range(depth)])

    return got, want


def _lens(model: Any, variables: Any, x: Any, args: dict[str, Any]) -> tuple[Any, Any]:
    """Timed: a lens built and called with every block's MLP output scaled (a call-time
    argument). Expected: as for `_edit`, the edit written into the block."""

    def got() -> Any:
        return js.lens(model, variables, x)(x, scale={"layers[:]/down": SCALE})

    return got, Scanned(args["depth"], _scaled).apply


#: case -> (model, variables, input, args) -> (the timed call, and a function of the
#: variables and the input computing the expected result, which runs jitted)
CHILD_CASES: dict[str, Callable[..., tuple[Any, Any]]] = {
    "slice": _slice,
    "edit": _edit,
    "intermediates": _intermediates,
    "lens": _lens,
}


def measure(case: str, args: dict[str, Any]) -> dict[str, Any]:
    """One process's measurement: the case's build and first call, timed, with the
    persistent cache's events counted over exactly that call; then the result check."""
    counter = Counter()
    with open(args["inputs"], "rb") as f:
        variables, x = jax.device_put(pickle.load(f))
    got, want = CHILD_CASES[case](Scanned(args["depth"]), variables, x, args)
    before = dict(counter.counts)
    t = time.perf_counter()
    out = jax.block_until_ready(got())
    seconds = time.perf_counter() - t
    counts = counter.since(before)
    expected = jax.jit(want)(variables, x)
    check_close(out, expected, f"{case} in a fresh process vs the model's own apply", 1e-3)
    return {"seconds": seconds, **counts}


def _header(cfg: Config) -> str:
    import flax

    shape = "x".join(map(str, cfg.scan_shape))
    return (
        f"jaxslice {js.__version__}, jax {jax.__version__}, flax {flax.__version__}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs. Scan of {cfg.scan_depth} "
        f"transformer blocks on {shape} (batch x tokens x width); {cfg.cold_rounds} "
        "round(s) of two fresh processes per case (an empty cache directory, then the same "
        "directory); medians."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a second process's first call, with JAX's cache")
    p.add_argument("--quick", action="store_true", help="smaller stack, one round")
    p.add_argument("--child", nargs=2, metavar=("CASE", "ARGS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        case, child_args = args.child
        print(json.dumps(measure(case, json.loads(child_args))))
        return 0
    import _report

    cfg = Config.make(args.quick)
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr)  # noqa: E731
    rows = run(cfg, log)["rows"]
    print(f"\n{_header(cfg)}\n")
    _report.print_table(rows)
    for r in rows:
        for name in ("first", "second"):
            times = ", ".join(f"{x['seconds'] * 1e3:.0f}" for x in r[name])
            compiles = ", ".join(f"{x['compile_s'] * 1e3:.0f}" for x in r[name])
            print(f"  {r['measure'][:4]} {name} process: call {times} ms, XLA {compiles} ms")
    failed = [r["measure"] for r in rows if not r["ok"]]
    for m in failed:
        print(f"FAILED: {m}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
