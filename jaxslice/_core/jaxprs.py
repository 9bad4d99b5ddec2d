"""The jaxpr toolkit jaxslice's evaluators share: values by variable, deep searches of
nested bodies, and the scan that carries its own iteration index.

Two evaluators run jaxprs again in the current trace: `evaluate` (a traced graph, with
hooks at its boundaries) and `loop_expander` (a model's jaxpr, its named loops in
pieces). Graph building (`build`) walks the same bodies. Each keeps its own rules for the
equations it changes meaning of; what is here is what they did alike:

* `Env` holds one jaxpr's values (literals read as themselves, dropped outputs not kept);
* `Finder` answers "is an equation like this inside these bodies, at any depth?", once
  per jaxpr;
* `carried_scan` builds a `lax.scan` whose step also sees the row it runs (a scan's own
  counter is invisible to its body), and `row` reads a row of a stacked operand with one
  dynamic slice, as the scan reads its own operands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from .. import _compat


class Env:
    """The values of one jaxpr's variables while it is evaluated."""

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}

    def read(self, atom: Any) -> Any:
        return _compat.literal_value(atom) if _compat.is_literal(atom) else self.values[atom]

    def reads(self, atoms: Iterable[Any]) -> list[Any]:
        return [self.read(a) for a in atoms]

    def write(self, atoms: Sequence[Any], values: Sequence[Any]) -> None:
        for v, x in zip(atoms, values, strict=True):
            if not _compat.is_dropvar(v):
                self.values[v] = x


class Finder:
    """Whether equations satisfying `wanted` are in a jaxpr or an equation's bodies, at
    any depth; remembered per jaxpr (the traced jaxprs outlive the search)."""

    def __init__(self, wanted: Callable[[Any], bool]) -> None:
        self.wanted = wanted
        self._memo: dict[int, bool] = {}

    def in_jaxpr(self, jaxpr: Any) -> bool:
        key = id(jaxpr)
        found = self._memo.get(key)
        if found is None:
            found = any(self.wanted(e) or self.inside(e) for e in jaxpr.eqns)
            self._memo[key] = found
        return found

    def inside(self, eqn: Any) -> bool:
        """Whether the bodies an equation holds hold such an equation."""
        return any(self.in_jaxpr(j) for j in _compat.subjaxprs(eqn))


def carried_scan(
    step: Callable[[list[Any], Any, Any], tuple[list[Any], Any]],
    carry: Sequence[Any],
    xs: Any,
    *,
    rows: tuple[int, int],
    reverse: bool,
    unroll: Any,
) -> tuple[list[Any], Any]:
    """``lax.scan`` over iterations ``rows[0]:rows[1]``, with ``step(carry, row, x)`` given
    the row it runs as a traced int32 (counting down in a reverse scan, which visits the
    rows last to first); returns the final carry and the stacked results."""
    a, b = rows
    first, move = (b - 1, -1) if reverse else (a, 1)

    def body(state: tuple[list[Any], Any], x: Any) -> Any:
        c, i = state
        c, y = step(c, i, x)
        return (list(c), i + move), y

    start = (list(carry), jax.numpy.int32(first))
    (out, _), ys = jax.lax.scan(body, start, xs, length=b - a, reverse=reverse, unroll=unroll)
    return list(out), ys


def row(stacked: Any, i: Any) -> Any:
    """Row `i` (a non-negative index, static or traced) of a stacked array, as one
    ``dynamic_slice`` and ``squeeze`` (``lax.dynamic_index_in_dim`` would wrap them in a
    nested ``jit`` equation, one per operand per iteration, for XLA to inline)."""
    one = jax.lax.dynamic_slice_in_dim(stacked, i, 1, 0, allow_negative_indices=False)
    return jax.lax.squeeze(one, (0,))
