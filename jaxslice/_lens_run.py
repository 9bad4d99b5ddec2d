"""What one call of a `js.lens` runs: its interventions checked and placed, and the
hooks that apply them and read values while the one evaluator runs the model.

An intervention is split into a static part (`Intervention`: its kind, site, which
loops it picks one iteration of, how many leading axes its value has; in a sweep, the
iterations themselves) that the compiled program is specialised on, and arrays (the
value, a mask, the picked iterations as traced indices) that it takes as arguments. So
one program serves every iteration, value and mask of the same structure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from ._core.evaluate import BoundaryEvent, Hooks
from ._core.evaluate import evaluate as evaluate_graph
from ._core.jaxprs import row
from ._core.selection import Selection
from ._errors import (
    LensComplexValueError,
    LensKindError,
    LensSweepAxisError,
    LensValueShapeError,
)


@dataclasses.dataclass(frozen=True)
class Intervention:
    """The static part of one intervention (hashable: the program is compiled for it).

    Attributes:
      kind: ``"scale"``, ``"add"`` or ``"set"``.
      site: the name of its site (a key of `Lens.sites`).
      every: per loop around the site, whether it acts in every iteration (else in the
        one its traced index picks).
      extra: how many leading (iteration) axes its value has beyond the site's value.
      mask_extra: the same for a `set` mask; None without one.
      fixed: in a sweep, the iteration picked in each loop (None: every one); None
        outside sweeps, where the picked iterations are data.
    """

    kind: str
    site: str
    every: tuple[bool, ...]
    extra: int
    mask_extra: int | None
    fixed: tuple[int | None, ...] | None


def intervention(
    kind: str, spec: str, value: Any, site: Any, picked: Any, sweep: Any
) -> tuple[Intervention, tuple[Any, Any, list[Any]]]:
    """One given intervention at `site` in the iterations `picked.rows` (with
    `picked.indices`, those that are one iteration as int32 arrays), checked: its static
    part and its arrays ``(value, mask, picked iterations)``."""
    rows = picked.rows
    value, mask = _value_and_mask(kind, value)
    every = tuple(k is None for k in rows)
    want = tuple(n for n, e in zip(site.lengths, every, strict=True) if e)
    target = (*want, *site.value.shape)
    _check_value(spec, kind, value, target, site, sweep)
    if _complex(value.dtype) and not _complex(site.value.dtype):
        raise LensComplexValueError(
            kind=kind, spec=spec, dtype=value.dtype, site_dtype=site.value.dtype
        )
    leading = len(site.value.shape) + (1 if sweep else 0)
    extra = max(value.ndim - leading, 0)
    mask_extra = None
    if mask is not None:
        _check_value(spec, "set mask", mask, target, site, sweep)
        mask_extra = max(mask.ndim - leading, 0)
    # A sweep is compiled for its iterations (its first one decides what runs once);
    # a call takes them as data.
    static = Intervention(kind, site.name, every, extra, mask_extra, rows if sweep else None)
    # `h * s` and `h + v` are computed in the dtype the two promote to and cast back to the
    # site's (`_apply`): 0.5 scales an integer site by a half, not by int(0.5). The value
    # is passed in that dtype (an int given at a float site as a float).
    promoted = jnp.result_type(site.value.dtype, value)
    value = value if value.dtype == promoted else value.astype(promoted)
    return static, (value, mask, picked.indices)


def _complex(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def _value_and_mask(kind: str, value: Any) -> tuple[Any, Any]:
    """The value given, as an array, and the boolean mask of a ``(value, mask)`` pair
    given to `set` (None without one)."""
    pair = kind == "set" and isinstance(value, tuple)
    if pair and len(value) != 2:
        raise LensKindError(kind=kind, got=f"a tuple of {len(value)}")
    try:
        if not pair:
            return jnp.asarray(value), None
        return jnp.asarray(value[0]), jnp.asarray(value[1], bool)
    except (TypeError, ValueError) as error:
        raise LensKindError(kind=kind, got=f"{type(value).__name__} ({error})") from None


def _check_value(
    spec: str, kind: str, x: Any, target: tuple[int, ...], site: Any, sweep: Any
) -> None:
    """`x` broadcasts to `target` (after its leading run axis, in a sweep)."""
    if sweep and x.ndim == 0:
        raise LensSweepAxisError(spec=spec, kind=kind, shape=())
    shape = tuple(x.shape[1:] if sweep else x.shape)
    try:
        to = np.broadcast_shapes(shape, target)
    except ValueError:
        to = None
    if to != target:
        raise LensValueShapeError(spec=spec, kind=kind, shape=shape, target=target, site=site.name)


def placed(
    sites: dict[str, Any], statics: Any, arrays: Any
) -> dict[tuple[Selection, int], list[Any]]:
    """The interventions by the record and leaf the running model meets them at (`sites`:
    the sites of the graph it runs), in the order given."""
    here: dict[tuple[Selection, int], list[Any]] = {}
    for one, parts in zip(statics, arrays, strict=True):
        site = sites[one.site]
        here.setdefault((site.where, site.leaf), []).append((one, parts))
    return here


def first_row(first: dict[int, Any], where: Selection, rows: tuple[Any, ...]) -> None:
    """Notes, per outermost scan, the first iteration something happens in (`rows`: the
    iteration picked in each loop around `where`, None for all of them)."""
    if where.call.loop is None or not rows:
        return
    loop = where.call.loop.chain()[0]
    k = rows[0] if rows[0] is not None else 0
    old = first.get(id(loop.eqn))
    first[id(loop.eqn)] = (loop.eqn, k if old is None else min(old[1], k))


class LensHooks(Hooks):
    """Applies the interventions at their sites and emits the reads (stacked over the
    iterations of the loops around them)."""

    def __init__(
        self,
        here: dict[Any, list[Any]],
        wanted: dict[Any, str],
        first: dict[int, Any],
        whole: dict[Selection, str] | None = None,
    ):
        self.here = here
        self.wanted = wanted
        self.first = first
        self.whole = whole or {}
        self.emitted: dict[str, Any] = {}
        self._sides = {where for where, _ in [*here, *wanted]}

    def skipped_rows(self, eqn: Any, path: tuple[Any, ...]) -> int:
        found = self.first.get(id(eqn))
        return 0 if path or found is None else found[1]

    def on_boundary(self, event: BoundaryEvent) -> Any:
        where = event.where
        name = self.whole.get(where)
        if name is not None:
            self.emitted[name] = event.value
        if where not in self._sides:
            return event.value
        leaves, treedef = jax.tree_util.tree_flatten(event.value)
        positions = [i for i, x in enumerate(leaves) if hasattr(x, "shape")]
        changed = False
        for k, i in enumerate(positions):
            acts = self.here.get((where, k))
            if acts:
                leaves[i] = _apply(leaves[i], acts, event.rows)
                changed = True
            name = self.wanted.get((where, k))
            if name is not None:
                self.emitted[name] = leaves[i]
        return jax.tree_util.tree_unflatten(treedef, leaves) if changed else event.value

    def open_loop(self) -> Any:
        outer, self.emitted = self.emitted, {}
        return outer

    def close_loop(self, token: Any) -> dict[Any, Any]:
        inner, self.emitted = self.emitted, token
        return inner

    def leave_loop(self, values: dict[Any, Any]) -> None:
        self.emitted.update(values)


def _apply(h: Any, acts: list[Any], rows: tuple[Any, ...]) -> Any:
    """One site's interventions, in the order given (kinds in `KINDS` order), in the
    iteration `rows` (traced indices, one per loop around the site)."""
    for one, (value, mask, picked) in acts:
        kind, every, extra, mask_extra = one.kind, one.every, one.extra, one.mask_extra
        # The rows of the loops an intervention picks one iteration of.
        fixed = iter(picked)
        here = jnp.bool_(True)
        for e, r in zip(every, rows, strict=True):
            if not e:
                here = here & (r == next(fixed))
        value = _row(value, every, rows, extra)
        if kind == "scale":
            new = h * value
        elif kind == "add":
            new = h + value
        else:
            new = jnp.broadcast_to(value, h.shape)
            if mask is not None:
                new = jnp.where(_row(mask, every, rows, mask_extra), new, h)
        new = new.astype(h.dtype)
        h = new if all(every) else jnp.where(here, new, h)
    return h


def _row(value: Any, every: tuple[bool, ...], rows: tuple[Any, ...], extra: int) -> Any:
    """A value given at an every-iteration name, at this iteration: its leading axes (one
    per loop it names every iteration of, where the value has them) indexed by `rows`."""
    if not extra:
        return value
    stacked_rows = [r for e, r in zip(every, rows, strict=True) if e]
    lead = stacked_rows[len(stacked_rows) - extra :] if extra <= len(stacked_rows) else []
    for r in lead:
        size = value.shape[0]
        value = value[0] if size == 1 else row(value, r)
    return value


class _Recorder(Hooks):
    """Records the array leaves of every call side the hooks see (one iteration's)."""

    def __init__(self) -> None:
        self.seen: dict[Selection, list[jax.ShapeDtypeStruct]] = {}

    def on_boundary(self, event: BoundaryEvent) -> Any:
        arrays = [x for x in jax.tree_util.tree_leaves(event.value) if hasattr(x, "shape")]
        leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]
        self.seen.setdefault(event.where, leaves)
        return event.value


def probe(graph: Any, values: tuple[list[Any], list[Any]]) -> Any:
    """What the hooks see at every call side, from one abstract evaluation."""
    recorder = _Recorder()
    ids = graph.input_ids
    leaves = [jax.ShapeDtypeStruct(graph.avals[i].shape, graph.avals[i].dtype) for i in ids]
    jax.eval_shape(lambda v, r, x: evaluate_graph(graph, recorder, v, r, x), *values, leaves)
    return recorder.seen


_compat.register_frames_exclusion(__file__)
