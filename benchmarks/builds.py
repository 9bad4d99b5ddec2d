"""Rows 3, 4 and 5: building slices, against one `jax.make_jaxpr` of the same model.

Builds use abstract variables and inputs (tracing does not depend on data or spatial
size), and every repetition, on either side, gets a fresh model (`_models.fresh`), so a
"cold" build never benefits from a cache filled by an earlier one. How a build splits into
tracing and analysis, its equation count, and whether its trace stopped early come from
``sub.build_info`` where the installed jaxslice has it; they read "n/a" otherwise.
Row 5 judges linear growth by the log-log slope of analysis time against equations over
ResNet-18..152 shapes, using each model's fastest build (load only adds time; an analysis
takes milliseconds, so one slow repetition would bend the line).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping
from typing import Any

import jax
from _common import Config, Log, meets, row, value_row
from _models import abstract_model, fresh
from _timing import Op, paired

import jaxslice as js

TRAIN = {"train": True, "mutable": ["batch_stats"]}  # the mode a fine-tune slice runs in
INFO_FIELDS = ("trace_seconds", "analysis_seconds", "equations", "stopped_early")
INFO_KEYS = (
    "trace_ms",
    "analysis_ms",
    "analysis_best_ms",
    "equations",
    "stopped_early",
)  # info_summary's


def build_info(sub: Any) -> dict[str, Any] | None:
    """The public ``sub.build_info`` as a dict, or None where jaxslice has none yet."""
    info = getattr(sub, "build_info", None)
    if info is None:
        return None
    get = info.get if isinstance(info, Mapping) else functools.partial(getattr, info)
    return {f: get(f, None) for f in INFO_FIELDS}


def info_summary(infos: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Medians of the build_info of the timed builds (empty when any lacks it)."""
    if not infos or any(i is None for i in infos):
        return {}
    return {
        "trace_ms": statistics.median(i["trace_seconds"] for i in infos) * 1e3,
        "analysis_ms": statistics.median(i["analysis_seconds"] for i in infos) * 1e3,
        "analysis_best_ms": min(i["analysis_seconds"] for i in infos) * 1e3,
        "equations": infos[-1]["equations"],
        "stopped_early": all(i["stopped_early"] for i in infos),
    }


def _note(res: dict[str, Any], early: bool) -> str:
    """The build's split (from build_info), its Python call ratio, and whether it stopped early."""
    parts = ["build_info n/a"]
    if "trace_ms" in res:
        parts = [f"trace {res['trace_ms']:.0f} ms + analysis {res['analysis_ms']:.1f} ms"]
        parts += [f"stopped early: {res['stopped_early']}"] if early else []
    if "python_calls" in res:
        parts.append(f"Python calls ratio {res['python_calls_ratio']:.2f}")
    return f"({'; '.join(parts)})"


def build_pair(
    arch: str, v: Any, x: Any, reps: int, setup: Any = None, calls: bool = True, **spec: Any
) -> dict[str, Any]:
    """`js.slice(model, v, x, **spec)` vs `jax.make_jaxpr` of the full model, both in the
    mode that `spec`'s non-boundary keywords select, each on a fresh model (or `setup`'s).
    `calls`: also compare Python call counts (one more build each, under cProfile)."""
    mode = {k: spec[k] for k in spec if k not in ("start", "end")}
    subject = Op(lambda m: js.slice(m, v, x, **spec), setup or functools.partial(fresh, arch))
    reference = Op(
        lambda m: jax.make_jaxpr(lambda v_, x_: m.apply(v_, x_, **mode))(v, x),
        functools.partial(fresh, arch),
    )
    res = paired(subject, reference, reps, inspect=build_info, count_calls=calls)
    res.update(info_summary(res.pop("subject_info")))
    return res


def build_rows(cfg: Config, log: Log) -> list[dict[str, Any]]:
    """Rows 3 and 4 (builds that must stop early end in '< 1.0')."""
    arch = cfg.build_arch
    v, x = abstract_model(arch)

    def warm_model() -> Any:
        m = fresh(arch)
        js.boundaries(m, v, x)  # a full trace: jaxslice may now know stage2 runs once
        return m

    cases = (
        (f"3. build slice(start=stage3) / make_jaxpr ({arch})", {"start": "stage3"}, None, "<= 1.5"),
        ("4a. build end=stage2, cold / make_jaxpr", {"end": "stage2"}, None, "info"),
        ("4b. build end=stage2 after js.boundaries / make_jaxpr", {"end": "stage2"}, warm_model, "< 1.0"),
        ("4c. build end='stage2@0', cold / make_jaxpr", {"end": "stage2@0"}, None, "< 1.0"),
    )  # fmt: skip
    rows = []
    for label, spec, setup, target in cases:
        log(label)
        res = build_pair(arch, v, x, cfg.reps, setup, **spec)
        note = _note(res, early="end" in spec)
        rows.append(row(label, res, target, meets(res["ratio"], target), note))
    return rows


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (nan with fewer than two points)."""
    if len(xs) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True))
    return num / sum((a - mx) ** 2 for a in xs)


def scaling_entry(arch: str, mode: str, reps: int) -> dict[str, Any]:
    """One line of row 5's table: a slice(start=stage3) build of `arch` in `mode`."""
    v, x = abstract_model(arch, 32)
    mode_kwargs = TRAIN if mode == "train" else {}
    res = build_pair(arch, v, x, reps, calls=False, start="stage3", **mode_kwargs)
    entry = {"arch": arch, "mode": mode, "make_jaxpr_ms": res["reference_ms"]}
    entry.update(build_ms=res["subject_ms"], **{k: res[k] for k in res if k in INFO_KEYS})
    if "analysis_ms" in entry and entry.get("equations"):
        entry["us_per_eqn"] = entry["analysis_ms"] * 1e3 / entry["equations"]
    return entry


def scaling_rows(table: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Row 5 for one mode: analysis time on the largest model, and its growth."""
    entries = [e for e in table if e["mode"] == mode]
    last = entries[-1]
    if "us_per_eqn" not in last:
        return [
            value_row(f"5. analysis on {last['arch']} ({mode})", "n/a", "< 100 ms", None),
            value_row(
                f"5. linear? ({mode}) slope of log analysis time vs log eqns",
                "n/a",
                "<= 1.25",
                None,
            ),
        ]
    xs = [math.log(e["equations"]) for e in entries]
    k = slope(xs, [math.log(e["analysis_best_ms"]) for e in entries])
    per_eqn = ", ".join(f"{e['analysis_best_ms'] * 1e3 / e['equations']:.1f}" for e in entries)
    label = f"5. analysis on {last['arch']} ({mode}, {last['equations']} eqns)"
    return [
        row(label, {"subject_ms": last["analysis_ms"]}, "< 100 ms", last["analysis_ms"] < 100),
        value_row(
            f"5. linear? ({mode}) slope of log best analysis time vs log eqns",
            f"{k:.2f}",
            "<= 1.25",
            k <= 1.25 if not math.isnan(k) else None,
            f"(best us per equation: {per_eqn})",
            slope=k,
        ),
    ]


def run(cfg: Config, log: Log) -> dict[str, Any]:
    rows = build_rows(cfg, log)
    table = []
    for arch in cfg.scaling_archs:
        for mode in ("eval", "train"):
            log(f"5. analysis on {arch} ({mode})")
            table.append(scaling_entry(arch, mode, max(3, cfg.reps // 2)))
    rows += scaling_rows(table, "eval") + scaling_rows(table, "train")
    return {"rows": rows, "scaling": table}
