"""Rows 18 to 22: edits and observers on the scanned stack of rows 10-12.

The model is `scanned.Scanned` (pre-LN transformer blocks run by ``nn.scan``: 24 blocks,
batch 8 x 64 tokens x width 128; ``--quick``: 12 blocks). Each edited model is checked
against the same edit written by hand before anything is timed.

* 18: forward of the model edited at every iteration (``insert_after("layers[:]/down",
  f)``) / the same edit written by hand (`scanned.Block` with it inside, in the model's own
  ``nn.scan``), both jitted, warm.
* 19, 20: XLA compile time of an edit at one iteration (``layers[k]/down``), and of a
  module inserted at every iteration (a low-rank adapter with stacked variables), / the
  unedited model's. As in row 12, only ``Lowered.compile()`` is timed.
* 21: a sweep of 64 call-time patches at ``layers[k]/down`` as one `jax.vmap`ped call /
  64 separate calls of the jitted edited model, warm.
* 22: first run (build, trace, compile, call) of a `js.Interpreter` that keeps every
  block's output, of `ActivationStats` and of a coverage `Tracker` on per-iteration
  names / the model's own first jitted call; every repetition starts from cleared caches.
  22d is what a new user of `ActivationStats` waits for: construction, the first update
  and `result()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from _common import Config, Log, meets, row
from _timing import Op, check_close, compare, paired
from scanned import Scanned

import jaxslice as js
from jaxslice.observe import ActivationStats

SCALE = 0.5  # the edit of rows 18 and 20: the MLP's output scaled (a fixed intervention)


class LowRank(nn.Module):
    """The module row 20 inserts in every block: ``h + up(down(h))``, rank 8."""

    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(h.shape[-1], use_bias=False, name="b")(nn.Dense(8, name="a")(h))


def _scaled(h: Any) -> Any:
    """The edit of rows 18 and 19, written into the block by hand for row 18."""
    return SCALE * h


def _low_rank(h: Any) -> Any:
    """Row 20's adapter written into the block by hand (its variables under ``lora``)."""
    return LowRank(name="lora")(h)


def _compile_of(fn: Callable[..., Any], *args: Any) -> Op:
    """Compiling `fn` (lowered untimed, by a new jit of a new function each repetition)."""
    return Op(lambda lowered: lowered.compile(), lambda: jax.jit(lambda *a: fn(*a)).lower(*args))


def _first_call(make: Callable[[], Callable[[], Any]]) -> Op:
    """Building and running something once from cleared caches (`make` builds, untimed
    setup clears)."""

    def setup() -> None:
        js.clear_caches()
        jax.clear_caches()

    return Op(lambda _: jax.block_until_ready(make()()), setup)


class Record(js.Interpreter):
    """Keeps every block's output (stacked over the iterations)."""

    def boundary(self, name: str, side: str, value: Any) -> Any:
        if side == "output" and name == "layers[:]":
            self.emit(name, value[0])
        return value


def run(cfg: Config, log: Log) -> dict[str, Any]:
    depth, k = cfg.scan_depth, cfg.scan_depth // 2
    x = jax.random.normal(jax.random.key(0), cfg.scan_shape)
    model = Scanned(depth)
    v = jax.jit(model.init)(jax.random.key(1), x)
    rows = []

    log("18. edited forward / the same edit written by hand")
    edited = js.edit(model, v, x).insert_after("layers[:]/down", lambda h: SCALE * h).build()
    by_hand = jax.jit(Scanned(depth, _scaled).apply)
    check_close(edited(x), by_hand(v, x), "edited model vs the edit by hand", 1e-3)
    res = compare(
        lambda: edited(x).block_until_ready(),
        lambda: by_hand(v, x).block_until_ready(),
        cfg.rounds,
        cfg.round_s,
    )
    label = f"18. edited model (layers[:]/down) / the same edit by hand, scan of {depth}"
    rows.append(row(label, res, "<= 1.05", meets(res["ratio"], "<= 1.05")))

    log("19-20. compile time of edited models / the unedited model")
    one = js.edit(model, v, x).insert_after(f"layers[{k}]/down", lambda h: SCALE * h).build()
    g = js.edit(model, v, x).insert_after(
        "layers[:]/down", LowRank(), key=jax.random.key(2), name="lora"
    )
    stacked, stacked_vars = g.build(), g.variables
    for label, fn, variables in (
        (f"19. XLA compile: edit at layers[{k}] / unedited model", one.apply, one.variables),
        ("20. XLA compile: LowRank at layers[:] / unedited model", stacked.apply, stacked_vars),
    ):
        res = paired(_compile_of(fn, variables, x), _compile_of(model.apply, v, x), cfg.reps, False)
        note = "(compile only)"
        if label.startswith("20") and not cfg.quick:  # the adapter's own cost, by hand
            twin = Scanned(depth, _low_rank)
            p = {**stacked_vars["params"]}
            p["layers"] = {**p["layers"], "lora": p.pop("lora")}
            check_close(twin.apply({"params": p}, x), stacked(x), "LowRank vs by hand", 1e-3)
            by_hand = paired(
                _compile_of(twin.apply, {"params": p}, x),
                _compile_of(model.apply, v, x),
                cfg.reps,
                False,
            )
            vs = paired(
                _compile_of(fn, variables, x),
                _compile_of(twin.apply, {"params": p}, x),
                cfg.reps,
                False,
            )
            note = (
                f"(compile only; the same adapter written by hand / unedited {by_hand['ratio']:.3f},"
                f" edited / by hand {vs['ratio']:.3f})"
            )
        rows.append(row(label, res, "<= 1.2", meets(res["ratio"], "<= 1.2"), note))

    log("21. a vmapped sweep of call-time patches / separate calls")
    n = 64 if not cfg.quick else 8
    patch = js.edit(model, v, x).replace(f"layers[{k}]/down", lambda h, new: new, inputs=("new",))
    patched = patch.build()
    news = jax.random.normal(jax.random.key(3), (n, *cfg.scan_shape))
    sweep = jax.jit(jax.vmap(lambda new: patched(x, new=new)))
    one_by_one = jax.jit(lambda new: patched(x, new=new))
    check_close(sweep(news)[1], one_by_one(news[1]), "vmapped sweep vs one call", 1e-3)
    res = compare(
        lambda: sweep(news).block_until_ready(),
        lambda: [one_by_one(p) for p in news][-1].block_until_ready(),
        max(3, cfg.rounds // 3),
        cfg.round_s,
    )
    label = f"21. sweep of {n} call-time patches, vmapped / {n} separate calls"
    rows.append(row(label, res, "<= 0.3", meets(res["ratio"], "<= 0.3")))

    log("22. first run of observers over the stack / the model's first jitted call")
    reference = _first_call(lambda: lambda: jax.jit(lambda a, b: model.apply(a, b))(v, x))
    interpreted = Record().build(model, v, x)(v, x)[1]["layers[:]"]
    want = js.intermediates(model, v, x, names=["layers[:]"])["layers[:]"][0]
    check_close(interpreted, want, "Interpreter's stacked block outputs", 1e-3)

    def stats() -> Callable[[], Any]:
        s = ActivationStats(model, v, x, names=["layers[:]/down"])
        return lambda: s.update(x)

    def stats_result() -> Callable[[], Any]:
        s = js.ActivationStats(model, v, x, names=["layers[:]/down"])
        return lambda: (s.update(x), s.result())[1]

    def tracker() -> Callable[[], Any]:
        t = js.coverage.Tracker(model, v, x, layers=["layers[:]/down"], criteria=[js.coverage.NC()])
        return lambda: t.update(x)

    observers = (
        ("22. first js.Interpreter run", lambda: lambda: Record().build(model, v, x)(v, x)),
        ("22b. first ActivationStats update (layers[:]/down)", stats),
        ("22c. first coverage Tracker update (layers[:]/down)", tracker),
        ("22d. new ActivationStats: construction, first update, result()", stats_result),
    )
    for label, make in observers:
        res = paired(_first_call(make), reference, cfg.reps, count_calls=False)
        label = f"{label} / the model's first jitted call, scan of {depth}"
        rows.append(row(label, res, "<= 1.5", meets(res["ratio"], "<= 1.5")))
    return {"rows": rows}
