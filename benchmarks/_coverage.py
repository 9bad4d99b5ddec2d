"""Row 7: coverage (NC + KMNC on every layer) per batch, against a plain jitted forward.

The tracker's `update` returns nothing and runs asynchronously; each timed call ends with
the public `result()`, which blocks on it (and adds a small host-side cost, timed apart).
For information, the same numbers are computed the slow way: a per-neuron Python loop with
numpy on the captured layer outputs, with the tracker's profile.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
from _common import Config, row
from _timing import compare, once

import jaxslice as js

THRESHOLD, SECTIONS = 0.5, 10  # NC's threshold and KMNC's k


def _scaled(flat: np.ndarray, col: np.ndarray) -> np.ndarray:
    """`col` (one channel, per input) min-max scaled by its input's whole layer output."""
    lo, hi = flat.min(axis=1)[:, None], flat.max(axis=1)[:, None]
    span = hi - lo
    return np.where(span > 0, (col - lo) / np.where(span > 0, span, 1), 0)


def _kmnc_sections(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    if hi <= lo:
        return np.full(v.shape, SECTIONS - 1)
    return np.clip(np.floor((v - lo) / (hi - lo) * SECTIONS), 0, SECTIONS - 1).astype(int)


def naive_update(outs: dict[str, Any], profile: dict[str, Any], state: dict[str, Any]) -> None:
    """NC and KMNC with a Python loop over every neuron (channel) of every layer."""
    for name, out in outs.items():
        o = np.asarray(out, np.float32).reshape(out.shape[0], -1, out.shape[-1])
        flat = o.reshape(o.shape[0], -1)
        nc, kmnc = state[name]
        for n in range(o.shape[-1]):
            col = o[..., n]
            nc[n] |= bool(np.any(_scaled(flat, col).mean(axis=1) > THRESHOLD))
            v, lo, hi = col.mean(axis=1), profile[name]["low"][n], profile[name]["high"][n]
            inside = (v >= lo) & (v <= hi)
            kmnc[n, _kmnc_sections(v, lo, hi)[inside]] = True


def naive_result(state: dict[str, Any]) -> dict[str, float]:
    parts = list(state.values())
    return {
        c: sum(int(p[i].sum()) for p in parts) / sum(p[i].size for p in parts)
        for i, c in enumerate(("NC", "KMNC"))
    }


def _naive_ms(
    capture: Any, batches: list[Any], tracker: Any
) -> tuple[float, float, dict[str, float]]:
    """Median ms per batch of capture + naive loop and of the capture alone; the naive
    NC/KMNC totals after all batches (with the tracker's profile)."""
    profile = {
        k: {s: np.asarray(v) for s, v in d.items()} for k, d in tracker.profile_stats.items()
    }
    sizes = dict(zip(tracker.layers, tracker.sizes, strict=True))
    state = {n: (np.zeros(s, bool), np.zeros((s, SECTIONS), bool)) for n, s in sizes.items()}
    once(lambda: capture(batches[0]))  # compile the capture first
    totals, captures = [], []
    for b in batches:
        t0 = time.perf_counter()
        outs = jax.block_until_ready(capture(b))
        captures.append(time.perf_counter() - t0)
        naive_update(outs, profile, state)
        totals.append(time.perf_counter() - t0)
    ms = lambda ts: statistics.median(ts) * 1e3
    return ms(totals), ms(captures), naive_result(state)


def _naive_row(
    model: Any, variables: Any, x: Any, tracker: Any, update_ms: float, n: int
) -> dict[str, Any]:
    """Row 7's companion: the naive loop's time per batch over the tracker's, same numbers."""
    batches = [jax.random.normal(k, x.shape) for k in jax.random.split(jax.random.key(2), n)]
    capture = lambda b: js.intermediates(model, variables, b, names=tracker.layers)
    naive_ms, capture_ms, naive = _naive_ms(capture, batches, tracker)
    tracker.reset()
    for b in batches:
        tracker.update(b)
    ours = {k: tracker.result()[k]["total"] for k in naive}
    same = all(abs(ours[k] - naive[k]) <= 1e-3 for k in naive)
    loop_only = (naive_ms - capture_ms) / update_ms
    res = {"subject_ms": naive_ms, "reference_ms": update_ms, "ratio": naive_ms / update_ms}
    pair = lambda d: f"{d['NC']:.4f}/{d['KMNC']:.4f}"
    note = f"(loop alone {loop_only:.1f}x; same NC/KMNC: {same}: {pair(ours)} vs {pair(naive)})"
    extra = {"tracker": ours, "naive": naive, "naive_capture_ms": capture_ms}
    label = "7. naive per-neuron numpy loop / coverage update"
    return row(label, res, "info (speed-up)", None, note, loop_only_speedup=loop_only, **extra)


def rows(
    model: Any, variables: Any, x: Any, full: Any, cfg: Config
) -> tuple[Any, list[dict[str, Any]]]:
    """The tracker (row 8 reuses it) and row 7."""
    t0 = time.perf_counter()
    criteria = [js.coverage.NC(THRESHOLD), js.coverage.KMNC(SECTIONS)]
    tracker = js.coverage.Tracker(model, variables, x, criteria=criteria)
    build_s = time.perf_counter() - t0
    tracker.profile([jax.random.normal(k, x.shape) for k in jax.random.split(jax.random.key(1), 3)])
    update = lambda: (tracker.update(x), tracker.result())
    res = compare(update, lambda: full(variables, x), cfg.rounds, cfg.round_s)
    result_ms = statistics.median(once(tracker.result) for _ in range(5)) * 1e3
    layers, neurons = len(tracker.layers), sum(tracker.sizes)
    label = f"7. coverage update + result() ({layers} layers, {neurons} neurons) / forward"
    note = f"(result() alone {result_ms:.2f} ms; tracker built in {build_s:.1f} s)"
    extra = {"layers": layers, "neurons": neurons, "result_ms": result_ms}
    cov = row(label, res, "<= 1.5", res["ratio"] <= 1.5, note, **extra)
    naive = _naive_row(model, variables, x, tracker, res["subject_ms"], cfg.naive_batches)
    return tracker, [cov, naive]
