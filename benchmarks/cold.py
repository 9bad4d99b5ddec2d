"""Rows 13-17: cold costs, which the other groups never see (they warm up before timing).

Every cold figure is one operation timed in a fresh interpreter (`_cold_child.py`): it
imports jax, flax and jaxslice, loads the model's variables from a file this process wrote
(as from a checkpoint, so nothing is traced beforehand) and times exactly the measured
operation with `time.perf_counter`. JAX's persistent compilation cache is off in those
processes. The processes of both sides of a ratio alternate (even rounds run the subject
first, odd rounds the reference first) and a ratio is the median of the per-round ratios.
The model is a ResNet with torchvision's module names (`_models.TorchNamedResNet`: the
block torchvision calls ``layer2.3`` is ``layer2_3``), batch 1.

  13. cold js.slice(end="layer2_3") / torchvision create_feature_extractor build   <= 0.8
      (for information: 13b, the same / a cold jax.make_jaxpr of the whole model;
      13c, a cold js.slice(end="layer2_3@0"), which stops tracing at that call, and
      13d, a cold jax.make_jaxpr of the hand-written truncated model (the floor of any
      build that traces the kept layers), each / torchvision's build)
  14. a second js.slice of the same model and shapes (another end) / torchvision  <= 0.1
      (14b, for information: the same after 13c's early stop, "layer2_2@0")
  15. first feature map (build + compile + first call) / jax.jit of the hand-written
      truncated model, first call                                                 <= 1.0
  16. sub(x) per call / a plain jitted function, tiny MLP, warm (batches of calls
      alternated in one process)                                                  <= 1.1
  17. first coverage.Tracker (NC, KMNC) / first js.intermediates of its layers    <= 1.2
      (17b: the tracker's construction plus its first profile, update and result, for
      information: work a tracker defers to its first use is counted there)

Row 16 times batches of 500 calls dispatched back to back (blocking on the last), so a
call's Python overhead is what it measures. `--quick` runs one round on a ResNet-18 at
64x64 (ending at ``layer2_1``). The torchvision side runs only when torch and torchvision
import in a fresh process of this interpreter; otherwise rows 13 and 14 are skipped with
the line "skipped: pip install torch torchvision (CPU wheels)". Missed targets fail the
run only with ``--strict``; a crashed process or differing feature maps always do.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Any

import jax
import numpy as np
from _common import Config, Log, meets, row
from _models import init_variables, torch_named
from _timing import summarise

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cold_child.py")
INSTALL = "pip install torch torchvision (CPU wheels)"


def child(case: str, **args: Any) -> dict[str, Any]:
    """Runs one case of `_cold_child.py` in a fresh interpreter; its JSON result."""
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    cmd = [sys.executable, CHILD, case, json.dumps(args)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    if p.returncode != 0:
        raise RuntimeError(
            f"cold process {case!r} failed (exit {p.returncode}):\n{p.stderr[-4000:]}"
        )
    return json.loads(p.stdout.strip().splitlines()[-1])


def write_variables(cfg: Config, path: str) -> None:
    """The cold model's variables as numpy arrays, for the processes to load."""
    x = jax.ShapeDtypeStruct((1, cfg.cold_size, cfg.cold_size, 3), np.float32)
    variables = init_variables(torch_named(cfg.cold_arch), x)
    with open(path, "wb") as f:
        pickle.dump(jax.tree_util.tree_map(np.asarray, variables), f)


def rounds(cfg: Config, log: Log, args: dict[str, Any], torch: bool) -> dict[str, list[Any]]:
    """Each case's results over `cfg.cold_rounds` rounds, the sides of each group
    alternated. Round 0 runs the tracker first: its layers are what intermediates gets."""
    against_torch = ["slice_at0", "truncated_jaxpr", "torchvision"] if torch else []
    groups = [
        ["slice", "make_jaxpr", *against_torch],
        ["first_map", "jit_first_map"],
        ["tracker", "intermediates"],
    ]
    got: dict[str, list[Any]] = defaultdict(list)
    for r in range(cfg.cold_rounds):
        log(f"13-17. cold builds in fresh processes, round {r + 1} of {cfg.cold_rounds}")
        for group in groups:
            for case in group if r % 2 == 0 else group[::-1]:
                extra = {"layers": got["tracker"][0]["layers"]} if case == "intermediates" else {}
                got[case].append(child(case, **args, **extra))
    return got


def pair(subject: list[float], reference: list[float]) -> dict[str, Any]:
    """Timing summary of per-process seconds (one pair per round), plus the raw times."""
    res = summarise([[s] for s in subject], [[r] for r in reference])
    return {**res, "subject_s": subject, "reference_s": reference}


def ratio_row(label: str, res: dict[str, Any], target: str, note: str = "") -> dict[str, Any]:
    return row(label, res, target, meets(res["ratio"], target), note)


def secs(results: list[dict[str, Any]], key: str = "seconds") -> list[float]:
    return [r[key] for r in results]


def slice_note(results: list[dict[str, Any]]) -> str:
    """How the cold builds split (from the public build_info), where jaxslice has it."""
    infos = [r["build_info"] for r in results]
    if any(i is None or i.get("trace_seconds") is None for i in infos):
        return "(build_info n/a)"
    trace = np.median([i["trace_seconds"] for i in infos]) * 1e3
    analysis = np.median([i["analysis_seconds"] for i in infos]) * 1e3
    early = all(i["stopped_early"] for i in infos)
    return f"(trace {trace:.0f} ms + analysis {analysis:.1f} ms; stopped early: {early})"


def check_same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Both sides computed the same feature map (shape and checksum), every round."""
    for x, y in zip(a, b, strict=True):
        if x["shape"] != y["shape"] or not np.isclose(x["abs_sum"], y["abs_sum"], rtol=1e-4):
            raise AssertionError(f"first feature maps differ: {x} vs {y}")


def build_rows(got: dict[str, list[Any]], names: dict[str, str], torch: Any) -> list[dict]:
    """Rows 13 to 14b; all but 13b are skipped without torchvision."""
    end, end2, tv = names["end"], names["end2"], names["tv"]
    labels = {
        "13": f"13. cold js.slice(end='{end}') / torchvision extractor build ({tv})",
        "13c": f"13c. cold js.slice(end='{end}@0') (stops tracing there) / torchvision build",
        "13d": "13d. cold jax.make_jaxpr of the hand-written truncated model / torchvision",
        "14": f"14. repeat js.slice(end='{end2}'), model traced / torchvision build",
        "14b": f"14b. repeat js.slice(end='{end2}@0') after 13c / torchvision build",
    }
    first = secs(got["slice"])
    cold_jaxpr = pair(first, secs(got["make_jaxpr"]))
    label13b = "13b. the same cold js.slice / cold jax.make_jaxpr of the whole model"
    row13b = ratio_row(label13b, cold_jaxpr, "info", slice_note(got["slice"]))
    if torch is not True:
        skipped = f"{INSTALL}; {torch}"
        rows = [{"measure": label, "skipped": skipped} for label in labels.values()]
        return [rows[0], row13b, *rows[1:]]
    reference = secs(got["torchvision"])
    subjects = {
        "13": (first, "<= 0.8", slice_note(got["slice"])),
        "13c": (secs(got["slice_at0"]), "info", slice_note(got["slice_at0"])),
        "13d": (secs(got["truncated_jaxpr"]), "info", ""),
        "14": (secs(got["slice"], "repeat_seconds"), "<= 0.1", ""),
        "14b": (secs(got["slice_at0"], "repeat_seconds"), "info", ""),
    }
    rows = [
        ratio_row(labels[k], pair(subject, reference), target, note)
        for k, (subject, target, note) in subjects.items()
    ]
    return [rows[0], row13b, *rows[1:]]


def call_row(res: dict[str, Any]) -> dict[str, Any]:
    """Row 16 from the calls process's per-round medians."""
    timing = summarise(res["subject"], res["reference"])
    extra_us = (timing["subject_ms"] - timing["reference_ms"]) * 1e3
    note = f"(+{extra_us:.1f} us per call; {res['calls']} calls per side per round)"
    label = "16. sub(x) per call / plain jitted function (tiny MLP, warm)"
    return ratio_row(label, timing, "<= 1.1", note)


def run(cfg: Config, log: Log) -> dict[str, Any]:
    stage, block = cfg.cold_end
    names = {
        "end": f"layer{stage}_{block}",
        "end2": f"layer{stage}_{block - 1}",
        "tv": f"{cfg.cold_arch}, {cfg.cold_size}x{cfg.cold_size}, batch 1",
    }
    log("13-17. cold: imports (warms the file cache; is torchvision there?)")
    found = child("imports")
    torch = True if found["torch"] else found["error"]
    if torch is not True:
        log(f"13-14. skipped: {INSTALL}")
    with tempfile.TemporaryDirectory() as tmp:
        args = {"arch": cfg.cold_arch, "size": cfg.cold_size, "end": names["end"]}
        args.update(end2=names["end2"], upto=list(cfg.cold_end), node=f"layer{stage}.{block}")
        args["variables"] = os.path.join(tmp, "variables.pkl")
        write_variables(cfg, args["variables"])
        got = rounds(cfg, log, args, torch is True)
    check_same(got["first_map"], got["jit_first_map"])
    log("16. sub(x) per call vs a plain jitted function (tiny MLP)")
    calls = child("mlp_calls", rounds=cfg.call_rounds, batches=5, calls=500)
    layers = len(got["tracker"][0]["layers"])
    tracker_total = [r["seconds"] + r["use_seconds"] for r in got["tracker"]]
    rows = build_rows(got, names, torch) + [
        ratio_row(
            "15. first feature map: js.slice + sub(x) / jax.jit(hand-written), first call",
            pair(secs(got["first_map"]), secs(got["jit_first_map"])),
            "<= 1.0",
        ),
        call_row(calls),
        ratio_row(
            f"17. first coverage.Tracker(NC, KMNC; {layers} layers) / first js.intermediates",
            pair(secs(got["tracker"]), secs(got["intermediates"])),
            "<= 1.2",
        ),
        ratio_row(
            "17b. the same Tracker + profile([x]) + update(x) + result() / first intermediates",
            pair(tracker_total, secs(got["intermediates"])),
            "info",
        ),
    ]
    return {"rows": rows}
