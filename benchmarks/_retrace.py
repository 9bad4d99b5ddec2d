"""Row 8: calls at an already-seen batch size must not trace the model again.

`_models.TRACES` counts runs of `ResNet.__call__`, which happen only while JAX traces the
model; a count is exact, so this is the one row that fails the run without ``--strict``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _common import value_row
from _models import TRACES

import jaxslice as js


def _cases(model: Any, variables: Any, x: Any, feats: Any, tracker: Any) -> list[tuple]:
    """(label, batch size already seen?, call) in the order they run."""
    sub = js.slice(model, variables, x, start="stage3")
    half_x, half = x[: max(1, x.shape[0] // 2)], feats[: max(1, feats.shape[0] // 2)]
    train = lambda: sub.apply(sub.variables, feats, train=True, mutable=["batch_stats"])
    copies = lambda: sub.apply(jax.tree_util.tree_map(jnp.copy, sub.variables), feats)
    f_sub = jax.jit(lambda v, a: sub.apply(v, a))
    inter = lambda a: js.intermediates(model, variables, a, names=["stage2"])
    cover = lambda a: (tracker.update(a), tracker.result())
    return [
        ("slice(start=stage3): batch B (as sliced), 1st call", False, lambda: sub(feats)),
        ("slice: batch B, 2nd call", True, lambda: sub(feats)),
        ("slice: batch B/2, 1st call", False, lambda: sub(half)),
        ("slice: batch B/2, 2nd call", True, lambda: sub(half)),
        ("slice: batch B again", True, lambda: sub(feats)),
        ("slice: train=True mutable, 1st call", False, train),
        ("slice: train=True mutable, 2nd call", True, train),
        ("slice: new variables (copies), batch B", True, copies),
        ("jit(sub.apply): batch B/2, 1st call", True, lambda: f_sub(sub.variables, half)),
        ("jit(sub.apply): batch B/2, 2nd call", True, lambda: f_sub(sub.variables, half)),
        ("js.intermediates(stage2): batch B", False, lambda: inter(x)),
        ("js.intermediates(stage2): batch B, again", True, lambda: inter(x)),
        ("js.intermediates(stage2): batch B/2, 1st call", False, lambda: inter(half_x)),
        ("js.intermediates(stage2): batch B/2, 2nd call", True, lambda: inter(half_x)),
        ("tracker.update: batch B (seen)", True, lambda: cover(x)),
        ("tracker.update: batch B/2, 1st call", False, lambda: cover(half_x)),
        ("tracker.update: batch B/2, 2nd call", True, lambda: cover(half_x)),
    ]


def _traces(fn: Callable[[], Any]) -> int:
    before = TRACES["model"]
    jax.block_until_ready(fn())
    return TRACES["model"] - before


def count(model: Any, variables: Any, x: Any, feats: Any, tracker: Any) -> dict[str, Any]:
    """Model traces while building a slice, then per call of each case."""
    before = TRACES["model"]
    cases = _cases(model, variables, x, feats, tracker)
    at_build = TRACES["model"] - before
    calls = [{"call": c, "seen": seen, "model_traces": _traces(fn)} for c, seen, fn in cases]
    return {"traces_at_build": at_build, "calls": calls}


def row_of(retrace: dict[str, Any]) -> dict[str, Any]:
    seen = sum(c["model_traces"] for c in retrace["calls"] if c["seen"])
    label = "8. calls at an already-seen batch size: model traces"
    return value_row(label, seen, "0", seen == 0)
