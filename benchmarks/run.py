"""jaxslice's performance table (SPEC "Performance"), reproduced in one run.

Usage: python benchmarks/run.py [--quick] [--strict] [--only GROUP[,GROUP]] [--json PATH]

Every figure is a ratio against a reference measured in the same process, so the machine's
speed cancels out; absolute times are printed for information only. Both sides of a ratio
alternate (call by call for compiled programs, repetition by repetition for builds) and
the ratio is a median over rounds (see `_timing`). Where exact numbers exist they are
printed beside the times: XLA's cost analysis of both compiled programs, Python call
counts of both builds, and model trace counts.

Groups (``--only``), each a module here:
  compiled  1. sliced forward (jit) / hand-written truncated model           <= 1.05
            2. js.intermediates of an early feature / capture_intermediates  <= FLOP share + 0.1
            6. fine-tune step of a slice / hand-written step                 <= 1.05
            7. coverage (NC + KMNC, every layer) per batch / plain forward   <= 1.5
            8. a second call with an already-seen batch size                 no retrace
  builds    3. building a slice (trace + analysis) / one jax.make_jaxpr      <= 1.5
            4. building a slice that ends early (stage2) / one make_jaxpr    < 1.0
            5. analysis alone: < 0.1 s on ResNet-152, linear in equations
  torch     9. torchvision's create_feature_extractor build (skipped without torch)
  scanned  10. forward of slices of a scanned stack (nn.scan over 24 blocks) / full forward:
               input->layers[2]                                            <= 3/24 + 0.05
               layers[20]->output                                          <= 4/24 + 0.05
           11. js.intermediates("layers[:]") / capture_intermediates, unrolled  <= 1.1
           12. XLA compile of those two slices / of the full scanned model   <= 1.0
  cold     first builds, each timed in a fresh process (processes of both sides alternated;
           ResNet-50 with torchvision's module names, 224x224, batch 1; see `cold`):
           13. js.slice(end="layer2_3") / torchvision create_feature_extractor   <= 0.8
               (13b-d for information: / whole-model make_jaxpr; "layer2_3@0"; the
               hand-truncated model's make_jaxpr, each / torchvision)
           14. a repeat slice of the traced model / torchvision build            <= 0.1
               (14b for information: the same after "layer2_3@0")
           15. first feature map (build, compile, call) / jax.jit hand-written    <= 1.0
           16. sub(x) per call / a plain jitted function, tiny MLP, warm         <= 1.1
           17. first coverage.Tracker / first js.intermediates of its layers     <= 1.2
           (13, 13c, 13d, 14 and 14b are skipped without torch and torchvision)
  edits    on the scanned stack of rows 10-12 (see `edits`):
           18. edited model (every iteration) / the same edit by hand            <= 1.05
           19. XLA compile of an edit at one iteration / of the unedited model    <= 1.2
           20. XLA compile of a module inserted at every iteration / unedited     <= 1.2
           21. a vmapped sweep of 64 call-time patches / 64 separate calls        <= 0.3
           22. first run of a js.Interpreter (b: ActivationStats, c: Tracker) on
               per-iteration names / the model's first jitted call                 <= 1.5
               (d: a new ActivationStats: construction, first update, result())
  coverage Sun et al.'s pair criteria on the digits CNN of examples/coverage_digits.py
           (see `coverage_pairs`):
           23. js.coverage.generate's inputs / as many random perturbations of the same
               seeds in the same L-inf budget: pairs each adds to the test split's
               (SignSign; ValueSign)                                              >= 2
               (v: ValueSign inputs found / searches, against 5x the rate before
               `generate` planned by reach)                                        >= 5x
           24. update + result() of the four pair criteria at batch 64, test split seen
               / the jitted forward at batch 64                                   <= 3
           25. peak memory of a 512 x 512 layer-pair update at batch 64 (capacity 4096,
               ~4000 seen; XLA's memory analysis)                                 <= 75 MiB
               (and the time per update, for information)
           26. update + result() at a batch size not seen before (after batch 64) /
               at batch 64, the four pair criteria of row 24                      <= 1.5
  lens     interventions with js.lens (issue 40; see `lens`): a GPT-2-small-shaped
           scanned stack (12 blocks, width 768, batch 4 x 64) and the stack of rows 10-12:
           27. first 12-layer patching sweep (build, compiles) / the same sweep warm <= 1.5
           28. lens with every site inert / the plain jitted model                 <= 1.05
           29. patching sweep (clean read + 12 set calls) / 13 plain forwards      <= 1.0
           30. first lens(x, read=True), fresh lens / the first jitted call        <= 1.2
           31. lens.sweep of 64 patches at layers[12] of 24 / 64 lens calls        <= 0.6
           32. attribution at every layer (one grad) / grad w.r.t. the input       <= 1.1
           33. lines a user writes: steering at one layer; a patching sweep        1; <= 6
           34. first feature map in a fresh process / jax.jit hand-written         <= 1.05
  cache    JAX's persistent compilation cache (see `cache`): a second process's first
           call / the first process's, every compile a cache hit (exact):
           35a-d. a slice, an edited model, js.intermediates, a lens

Only the public API of jaxslice is used. The exit status is 1 when a retrace count (exact)
misses its target or a slice computes a wrong result, and, with ``--strict``, when any
target is missed. Results go to ``--json`` (default benchmarks/results.json, gitignored).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import _report
from _common import Config

GROUPS = {
    "compiled": "compiled",
    "builds": "builds",
    "torch": "torchvision_row",
    "scanned": "scanned",
    "cold": "cold",
    "edits": "edits",
    "coverage": "coverage_pairs",
    "lens": "lens",
    "cache": "cache",
}
# rows whose check is noise-free (they fail the run even without --strict): 8 counts
# retraces, 35 the persistent cache's hits
EXACT = ("8.", "35")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description="jaxslice performance table (ratios from one run)")
    p.add_argument("--quick", action="store_true", help="CI smoke run: small models, few rounds")
    p.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated: {', '.join(GROUPS)}")
    p.add_argument("--json", default=os.path.join(here, "results.json"), help="results file")
    args = p.parse_args(argv)
    unknown = set(args.only.split(",")) - set(GROUPS)
    if unknown:
        p.error(f"unknown group(s) {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    return args


def run_groups(names: Sequence[str], cfg: Config, start: float) -> dict[str, Any]:
    """Each group's rows, concatenated, and its other sections (scaling, retrace)."""

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {"rows": []}
    for name in names:
        out = importlib.import_module(GROUPS[name]).run(cfg, log)
        results["rows"] += out.pop("rows")
        results.update(out)
    results["rows"].sort(key=row_number)
    return results


def row_number(r: dict[str, Any]) -> int:
    """A row's number ("4" of "4a. ..."): rows sort by it, and keep their order within it."""
    return int(re.match(r"\d*", r["measure"]).group() or 0)


def failed(rows: Sequence[dict[str, Any]], strict: bool) -> list[str]:
    missed = [r for r in rows if r.get("ok") is False]
    return [r["measure"] for r in missed if strict or r["measure"].startswith(EXACT)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    cfg = Config.make(args.quick)
    start = time.perf_counter()
    results = run_groups([g for g in GROUPS if g in args.only.split(",")], cfg, start)
    total = time.perf_counter() - start
    print(f"\n{_report.header(cfg)}\n")
    _report.print_table(results["rows"])
    _report.print_programs(results["rows"])
    _report.print_flops(results["rows"])
    _report.print_scaling(results.get("scaling", []))
    _report.print_retrace(results.get("retrace"))
    print(f"\ntotal {total:.1f}s")
    _report.write_json(args.json, cfg, results, total)
    print(f"wrote {args.json}")
    missed = failed(results["rows"], args.strict)
    for m in missed:
        print(f"FAILED: {m}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
