"""Printing the ratio table and its details, and writing the JSON record of a run."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import jax
from _common import Config

import jaxslice as js

_OK = {True: "yes", False: "NO", None: ""}


def header(cfg: Config) -> str:
    import flax

    return (
        f"jaxslice {js.__version__}, jax {jax.__version__}, flax {flax.__version__}, "
        f"{jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPUs. "
        f"Compiled rows: {cfg.arch} on {cfg.size}x{cfg.size}x3, batch {cfg.batch}, "
        f"{cfg.rounds} rounds of ~{cfg.round_s}s (calls alternated); builds: {cfg.build_arch}, "
        f"{cfg.reps} reps (alternated, fresh model each); scanned rows: {cfg.scan_depth} "
        f"transformer blocks in one nn.scan on {'x'.join(map(str, cfg.scan_shape))} "
        f"(batch x tokens x width); cold rows: {cfg.cold_arch} on {cfg.cold_size}x"
        f"{cfg.cold_size}x3, batch 1, {cfg.cold_rounds} fresh processes per side "
        "(alternated); medians."
    )


def _ms(v: Any) -> str:
    return f"{v:.2f}ms" if isinstance(v, (int, float)) else ""


def _cells(r: dict[str, Any]) -> list[str]:
    """jaxslice, reference, ratio, [min, max], best: the timing columns of a row."""
    if "ratio" not in r:
        value = _ms(r["subject_ms"]) if "subject_ms" in r else str(r["subject"])
        return [value, "", "", "", ""]
    spread = f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]" if "ratio_min" in r else ""
    best = f"{r['best_ratio']:.3f}" if "best_ratio" in r else ""
    return [_ms(r["subject_ms"]), _ms(r.get("reference_ms")), f"{r['ratio']:.3f}", spread, best]


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    w = max(len(r["measure"]) for r in rows)
    widths = (10, 10, 7, 15, 6, 17)
    names = ("jaxslice", "reference", "ratio", "[min, max]", "best", "target")
    head = (
        f"{'measure':<{w}}  "
        + "  ".join(n.rjust(k) for n, k in zip(names, widths, strict=True))
        + "  met?"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['measure']:<{w}}  skipped ({r['skipped']})")
            continue
        cells = [*_cells(r), r["target"]]
        line = "  ".join(c.rjust(k) for c, k in zip(cells, widths, strict=True))
        print(f"{r['measure']:<{w}}  {line}  {_OK[r['ok']]:<4} {r.get('note', '')}".rstrip())


def _program(c: dict[str, Any]) -> str:
    s, h = c["subject"], c["reference"]
    if "error" in s or "error" in h:
        return f"cost analysis unavailable ({s.get('error') or h.get('error')})"
    return (
        f"flops {s['flops']:.4g} / {h['flops']:.4g}, bytes {s['bytes_accessed']:.4g} / "
        f"{h['bytes_accessed']:.4g}, HLO instructions {s['hlo_instructions']} / "
        f"{h['hlo_instructions']} -> {'identical' if c['identical'] else 'DIFFERENT'}"
    )


def print_programs(rows: Sequence[dict[str, Any]]) -> None:
    compiled = [r for r in rows if "compiled" in r]
    if compiled:
        print("\ncompiled XLA programs, jaxslice / hand-written (noise-free):")
    for r in compiled:
        print(f"  {r['measure']}: {_program(r['compiled'])}")


def print_flops(rows: Sequence[dict[str, Any]]) -> None:
    flops = [r for r in rows if "flops" in r]
    if flops:
        print(
            "\nFLOPs: js.intermediates / hand-written prefix / full model / capture_intermediates:"
        )
    for r in flops:
        f = r["flops"]
        keys = ("intermediates_flops", "handwritten_prefix_flops", "full_flops", "capture_flops")
        print(f"  {r['measure']}: " + " / ".join(f"{f[k] or float('nan'):.4g}" for k in keys))


_SCALING = (
    ("arch", "arch", "{}"),
    ("mode", "mode", "{}"),
    ("eqns", "equations", "{}"),
    ("make_jaxpr", "make_jaxpr_ms", "{:.0f}ms"),
    ("slice build", "build_ms", "{:.0f}ms"),
    ("trace", "trace_ms", "{:.0f}ms"),
    ("analysis", "analysis_ms", "{:.1f}ms"),
    ("us/eqn", "us_per_eqn", "{:.1f}"),
)


def print_scaling(table: Sequence[dict[str, Any]]) -> None:
    if not table:
        return
    print("\nslice(start=stage3) builds vs equations (abstract inputs; medians; from build_info):")
    cells = [[f.format(e[k]) if k in e else "n/a" for _, k, f in _SCALING] for e in table]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(_SCALING)]
    for line in [[h for h, _, _ in _SCALING], *cells]:
        print("  " + "  ".join(v.rjust(wd) for v, wd in zip(line, widths, strict=True)))


def print_retrace(retrace: dict[str, Any] | None) -> None:
    if not retrace:
        return
    print(f"\nmodel traces per call (the slice was built with {retrace['traces_at_build']}):")
    for c in retrace["calls"]:
        print(f"  {c['call']:<52} {c['model_traces']}{'   (seen shape)' if c['seen'] else ''}")


def write_json(path: str, cfg: Config, results: dict[str, Any], total_s: float) -> None:
    record = {
        "jaxslice": js.__version__,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(jax.devices()[0]),
        "cpus": os.cpu_count(),
        "config": dataclasses.asdict(cfg),
        **results,
        "total_s": total_s,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)
