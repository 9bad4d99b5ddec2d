"""Rows 23-25: Sun et al.'s pair criteria (SignSign, ValueSign, SignValue, ValueValue).

Rows 23 and 24 use the digits CNN of ``examples/coverage_digits.py`` (its model, data,
training and part 2's helpers, loaded from the file): trained for 400 steps (``--quick``:
40), on the 540 test inputs (``--quick``: the first 100).

* 23. `js.coverage.generate`'s inputs (L∞ eps 0.2 of the test inputs, inside [0, 1]) against
  as many random perturbations of the same seeds with the same budget: the coverage each
  adds to that of the test split, in one run (one tracker, reset and replayed).
* 23v. ValueSign's success rate: inputs found / searches, against 5 times the rate the
  search had before it planned by reach (18 of 2,160 on this model; ``--quick``: 9 of
  400, both measured with that version on the same model and budget).
* 24. one update + `result()` of the four criteria at batch 64 once the test split was
  seen, against the jitted forward at the same batch. An update adds its inputs to the
  history, so each round replays the test split first (untimed) and times one update.
* 26. one update + `result()` at a batch size the tracker has not seen (37, 38, ...: a
  new one each round), after it has run batches of 64, against one at batch 64; the test
  split replayed (untimed) before each. The tracker pads the batch to 64 inside: no
  compile.
* 25. a plain Dense(512) -> relu -> Dense(512) model (one 512 x 512 layer pair), the four
  criteria with capacity 4096 and ~4000 inputs seen: the peak memory of an update at batch
  64, from XLA's memory analysis of the same criteria updates compiled on their own, as
  the tracker compiles them (together, by their family, the state donated; arguments +
  outputs + temporaries - aliased; the tracker's own compiled step is not public), with the growth of the process's peak RSS over one real update beside it
  (VmHWM reset through /proc/self/clear_refs; Linux only, and memory reused from
  allocator pools does not show there); and the time per update.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from _common import Config, Log, meets, row, value_row
from _timing import once, summarise

import jaxslice as js

EPS, SEARCH_STEPS = 0.2, 50
# ValueSign inputs found / searches before `generate` planned by reach (full; --quick)
VALUE_SIGN_BEFORE = {False: (18, 2160), True: (9, 400)}
BATCH = 64  # rows 24 and 25
WIDTH, CAPACITY = 512, 4096  # row 25


def example() -> Any:
    """examples/coverage_digits.py as a module (it is not a package)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, os.pardir, "examples", "coverage_digits.py")
    spec = importlib.util.spec_from_file_location("coverage_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# --------------------------------------------------------------------------- row 23


def _pairs(result: Any, name: str, total: int) -> int:
    return round(result[name]["total"] * total)


def generation_rows(ex: Any, tracker: Any, x_te: Any, quick: bool) -> list[dict[str, Any]]:
    total = sum(a * b for a, b in zip(tracker.sizes[:-1], tracker.sizes[1:], strict=True))
    rows = []
    tracker.reset()
    ex.feed(tracker, x_te, 0)
    for name in ex.GENERATED:
        run = ex.generated_vs_random(tracker, x_te, name, EPS, SEARCH_STEPS)
        base = _pairs(run["test"], name, total)
        gen = _pairs(run["generated"], name, total) - base
        rand = _pairs(run["random"], name, total) - base
        ratio = gen / rand if rand else (math.inf if gen else math.nan)
        found = run["found"]
        note = (
            f"(+{gen} vs +{rand} of {total} pairs over the test split's {base}; "
            f"{len(found)} inputs from {found.attempted} searches in {run['generate_s']:.1f}s)"
        )
        label = f"23. {name}: new pairs, generated / random inputs (eps {EPS}, same seeds, count)"
        extra = {"generated_pairs": gen, "random_pairs": rand, "inputs": len(found)}
        value = round(ratio, 2) if math.isfinite(ratio) else str(ratio)  # JSON has no inf
        rows.append(value_row(label, value, ">= 2", ratio >= 2, note, **extra))
        if name == "ValueSign":
            found_before, tried_before = VALUE_SIGN_BEFORE[quick]
            rate, target = len(found) / found.attempted, 5 * found_before / tried_before
            rows.append(value_row(
                f"23v. ValueSign: inputs found / searches (eps {EPS}, {SEARCH_STEPS} steps)",
                round(rate, 4), f">= {target:.4f}", rate >= target,
                f"({len(found)} of {found.attempted}; {rate * tried_before / found_before:.1f}x "
                f"the {found_before} of {tried_before} before)",
            ))  # fmt: skip
    return rows


# --------------------------------------------------------------------------- row 24


def update_row(ex: Any, tracker: Any, model: Any, variables: Any, x_te: Any, x_new: Any, cfg):
    """One update + result() after the test split (replayed untimed before each), against
    the jitted forward; alternated round by round, which one goes first."""
    forward = jax.jit(lambda v, a: model.apply(v, a))

    def update() -> float:
        tracker.reset()
        ex.feed(tracker, x_te, 0)
        tracker.result()  # the replay is done before the clock starts
        return once(lambda: (tracker.update(x_new), tracker.result()))

    def forwards() -> list[float]:
        return [once(lambda: forward(variables, x_new)) for _ in range(20)]

    update(), forwards()  # compiles both at batch 64
    subject, reference = [], []
    for r in range(cfg.rounds):
        if r % 2:
            reference.append(forwards())
            subject.append([update()])
        else:
            subject.append([update()])
            reference.append(forwards())
    res = summarise(subject, reference)
    result_ms = statistics.median(once(tracker.result) for _ in range(5)) * 1e3
    label = f"24. update + result(), 4 pair criteria ({len(x_te)} seen, batch {BATCH}) / forward"
    note = f"(result() alone {result_ms:.2f} ms; {tracker.sizes} neurons per layer)"
    return row(label, res, "<= 3", meets(res["ratio"], "<= 3"), note, result_ms=result_ms)


# --------------------------------------------------------------------------- row 26


def new_size_row(ex: Any, tracker: Any, x_te: Any, x_new: Any, cfg: Config) -> dict[str, Any]:
    """An update + result() at a size never seen before against one at batch 64 (each
    after the test split's replay, untimed), alternated round by round."""

    def timed(batch: Any) -> float:
        tracker.reset()
        ex.feed(tracker, x_te, 0)
        tracker.result()
        return once(lambda: (tracker.update(batch), tracker.result()))

    sizes = [BATCH - 27 + r for r in range(cfg.rounds)]  # 37, 38, ...: new every round
    subject, reference = [], []
    for r, size in enumerate(sizes):
        sides = [
            lambda size=size: subject.append([timed(x_new[:size])]),
            lambda: reference.append([timed(x_new)]),
        ]
        for side in sides if r % 2 == 0 else sides[::-1]:
            side()
    res = summarise(subject, reference)
    label = f"26. update + result() at a new batch size ({sizes[0]}, ...) / at batch {BATCH}"
    note = f"(4 pair criteria, after batches of {BATCH}; {len(x_te)} seen)"
    return row(label, res, "<= 1.5", meets(res["ratio"], "<= 1.5"), note, sizes=sizes)


# --------------------------------------------------------------------------- row 25


def _criteria() -> list[Any]:
    C = js.coverage
    return [
        C.SignSign(capacity=CAPACITY),
        C.ValueSign(capacity=CAPACITY),
        C.SignValue(capacity=CAPACITY),
        C.ValueValue(capacity=CAPACITY),
    ]


def xla_peak_bytes(model: Any, variables: Any, x: Any, layers: list[str]) -> dict[str, Any]:
    """XLA's memory analysis of the four criteria's update at batch `len(x)` with the
    layers' values computed by `js.intermediates`, compiled alone from public pieces as a
    tracker compiles it: the four updated together by their family (one history), the
    state donated."""
    criteria = _criteria()
    family = criteria[0].family
    state = family.init(criteria, [WIDTH, WIDTH])

    def step(state: Any, v: Any, a: Any) -> Any:
        outs = js.intermediates(model, v, a, names=layers)
        values = [js.observe.neurons(outs[n], "channel") for n in layers]
        return family.update(criteria, state, values, None, None, None)

    try:
        compiled = jax.jit(step, donate_argnums=0).lower(state, variables, x).compile()
        mem = compiled.memory_analysis()
        parts = {
            k: int(getattr(mem, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp", "generated_code")
        }
    except Exception as e:  # best effort: backend-dependent
        return {"error": f"{type(e).__name__}: {e}"}
    parts["peak"] = parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
    return parts


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_growth_mib(fn: Any) -> float | None:
    """How far the process's peak RSS rose above its RSS during `fn()` (Linux: VmHWM
    reset by writing 5 to /proc/self/clear_refs); None where that is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    return None if before is None or peak is None else max(0, peak - before) / 1024


def memory_rows(cfg: Config, log: Log) -> list[dict[str, Any]]:
    model = nn.Sequential([nn.Dense(WIDTH), nn.relu, nn.Dense(WIDTH)])
    keys = jax.random.split(jax.random.key(3), 70)
    x = jax.random.normal(keys[0], (BATCH, 64))
    variables = model.init(jax.random.key(4), x)
    tracker = js.coverage.Tracker(model, variables, x, criteria=_criteria())
    assert tracker.sizes == [WIDTH, WIDTH], tracker.sizes
    log(f"   XLA memory analysis of the update ({tracker.layers})")
    xla = xla_peak_bytes(model, variables, x, tracker.layers)
    timed_n = 4
    fill = (CAPACITY - 2 * BATCH) // BATCH - timed_n  # leaves room for timed_n + 1 more
    log(f"   filling the history with {fill * BATCH} inputs")
    for k in keys[1 : 1 + fill]:
        tracker.update(jax.random.normal(k, (BATCH, 64)))
    tracker.result()
    seen = fill * BATCH
    batches = [jax.random.normal(k, (BATCH, 64)) for k in keys[1 + fill : 2 + fill + timed_n]]
    times = [once(lambda b=b: (tracker.update(b), tracker.result())) for b in batches[:timed_n]]
    rss = rss_growth_mib(lambda: (tracker.update(batches[-1]), tracker.result()))
    span = f"{seen}-{seen + timed_n * BATCH}"
    update_ms = statistics.median(times) * 1e3
    rss_note = "n/a" if rss is None else f"{rss:.0f} MiB, a lower bound"
    label = f"25. peak memory (MiB), {WIDTH}x{WIDTH} layer-pair update, batch {BATCH}, 4 criteria"
    if "error" in xla:
        mem = value_row(label, "n/a", "<= 75", None, f"({xla['error']}; RSS growth {rss_note})")
    else:
        mib = xla["peak"] / 2**20
        note = (
            f"(XLA: arguments {xla['argument'] / 2**20:.0f} + outputs {xla['output'] / 2**20:.0f}"
            f" + temporaries {xla['temp'] / 2**20:.0f} MiB; peak RSS growth over one update at "
            f"{seen + timed_n * BATCH} seen: {rss_note})"
        )
        mem = value_row(label, round(mib, 1), "<= 75", meets(mib, "<= 75"), note, xla=xla)
    extra = {"update_ms_all": [t * 1e3 for t in times], "rss_growth_mib": rss}
    timing = row(
        f"25. time per update of that layer pair (history {span} inputs)",
        {"subject_ms": update_ms},
        "info",
        None,
        f"(capacity {CAPACITY}; update + result())",
        **extra,
    )
    return [mem, timing]


def run(cfg: Config, log: Log) -> dict[str, Any]:
    ex = example()
    t0 = time.perf_counter()
    x_tr, x_te, y_tr, _ = ex.load_data()
    if cfg.quick:
        x_te = x_te[:100]
    steps = 40 if cfg.quick else 400
    log(f"23. digits CNN: training {steps} steps")
    model = ex.LeNet()
    variables, _ = ex.train(model, x_tr, y_tr, steps)
    tracker = ex.pair_tracker(model, variables, x_tr[:1])
    log("23. generate vs random perturbations (SignSign, ValueSign)")
    rows = generation_rows(ex, tracker, x_te, cfg.quick)
    log("24. pair criteria update / forward, batch 64")
    rows.append(update_row(ex, tracker, model, variables, x_te, x_tr[:BATCH], cfg))
    log("26. pair criteria update at a new batch size / at batch 64")
    rows.append(new_size_row(ex, tracker, x_te, np.asarray(x_tr[:BATCH]), cfg))
    log(f"   (rows 23-24 took {time.perf_counter() - t0:.1f}s)")
    log("25. memory of a 512x512 layer-pair update")
    rows += memory_rows(cfg, log)
    return {"rows": rows}
