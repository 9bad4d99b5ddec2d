"""A stacked layer's iterations as one unit: the observers' rows and units.

A tracker names each iteration of a stacked layer (``layers[:]/mlp``) as a layer of its
own (`per_iteration`), but handles a stack's iterations together, as the one array the
model's loop gives (`layer_units`): functions are vmapped over the iterations
(`over_units`), and entries move between per-layer and per-unit form (`to_units`,
`to_layers`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._core.selection import Selection
from ._observer import Observer, call_order


def per_iteration(observer: Observer) -> list[tuple[str, int, tuple[int, ...]]]:
    """The observer's layers with every stacked record (``layers[:]/mlp``) written out as
    one layer per iteration (``layers[0]/mlp``, ..., named by `Selection.end_name`), all
    in call order, each record once (a name given as is): ``(name, index of the observed
    output, index of the iteration's row in it)``."""
    rows: dict[Selection, tuple[str, tuple[Any, ...], int, tuple[int, ...]]] = {}
    for index, (name, where) in enumerate(zip(observer.layers, observer.records, strict=True)):
        stacked = where.depths
        if not stacked:
            rows.setdefault(where, (name, call_order(where), index, ()))
            continue
        for picked in itertools.product(*(range(n) for n in where.lengths)):
            path = list(where.path)
            for d, k in zip(stacked, picked, strict=True):
                path[d] = k
            one = dataclasses.replace(where, path=tuple(path))
            rows.setdefault(one, (one.end_name, call_order(one), index, picked))
    ordered = sorted(rows.values(), key=lambda row: row[1])
    return [(name, index, picked) for name, _, index, picked in ordered]


@dataclasses.dataclass(frozen=True)
class Unit:
    """Layers of `per_iteration`'s rows that a step handles together: every iteration of
    a stacked output (``row`` None; its `depth` leading axes flattened into one, which a
    function is vmapped over), or one layer (its ``row`` of the output, ``()`` for all of
    it). `positions`: where its layers are among the rows, in the order of the iterations."""

    index: int
    positions: tuple[int, ...]
    row: tuple[int, ...] | None
    depth: int = 0

    def array(self, outs: list[Any]) -> Any:
        """The unit's part of the observed outputs `outs`: (iterations, batch, ...) for a
        stack, (batch, ...) for one layer."""
        out = outs[self.index]
        if self.row is None:
            return out.reshape((-1, *out.shape[self.depth :]))
        return out[self.row] if self.row else out

    def batch(self, array: Any) -> int:
        """The number of batch rows of `array`, the unit's part of an observed output."""
        return array.shape[0 if self.row is not None else 1]


def layer_units(observer: Observer, rows: list[tuple[str, int, tuple[int, ...]]]) -> list[Unit]:
    """`rows` (as `per_iteration` gives them) as units: one per stacked output whose
    iterations are all rows, one per other row."""
    position = {(index, row): p for p, (_, index, row) in enumerate(rows)}
    units = []
    for index, where in enumerate(observer.records):
        picked = itertools.product(*(range(n) for n in where.lengths)) if where.depths else ()
        positions = [position.get((index, row)) for row in picked]
        if positions and None not in positions:
            units.append(Unit(index, tuple(positions), None, len(where.depths)))
    stacked = {p for unit in units for p in unit.positions}
    alone = [Unit(i, (p,), row) for p, (_, i, row) in enumerate(rows) if p not in stacked]
    return units + alone


def over_units(fn: Callable[..., Any], units: list[Unit], *per_unit: list[Any]) -> list[Any]:
    """``fn(*args)`` for each unit, vmapped over a stack's iterations: `per_unit` are lists
    with an entry (a pytree, or None) per unit, a stack's with the iterations first."""
    return [
        fn(*args) if u.row is not None else jax.vmap(fn)(*args)
        for u, *args in zip(units, *per_unit, strict=True)
    ]


def to_units(units: list[Unit], per_layer: list[Any]) -> list[Any]:
    """Entries (pytrees of arrays) per row as entries per unit, a stack's iterations
    stacked on the host (NumPy: nothing compiles)."""
    stack = lambda *arrays: np.stack(arrays)  # noqa: E731
    return [
        per_layer[u.positions[0]]
        if u.row is not None
        else jax.tree_util.tree_map(stack, *(per_layer[p] for p in u.positions))
        for u in units
    ]


def to_layers(units: list[Unit], per_unit: list[Any]) -> list[Any]:
    """Entries per unit (a stack's with the iterations first) as one entry per row."""
    out: list[Any] = [None] * sum(len(u.positions) for u in units)
    for u, entry in zip(units, per_unit, strict=True):
        if u.row is not None:
            out[u.positions[0]] = entry
            continue
        for k, p in enumerate(u.positions):
            out[p] = jax.tree_util.tree_map(lambda a, k=k: a[k], entry)
    return out
