"""What a tracker's `result` gives: each criterion's coverage over all its neurons and per
layer (or pair of layers), under a name that tells apart criteria of one class, as a dict
that prints as a table and annotates a drawing of the model."""

from __future__ import annotations

import collections
from typing import Any

from .. import _compat
from .._errors import UnknownCriterionError
from .._table import PrintsAsTable
from ._criteria import Criterion


class CoverageResult(PrintsAsTable, dict):
    """``{criterion: {"total": float, "layers": {key: float}}}``; prints as a table (and
    shows as one in notebooks), figures to 4 decimals."""

    def _table_rows(self) -> list[tuple[str, ...]]:
        rows = [("criterion", "layer", "coverage")]
        for crit, res in self.items():
            rows.append((crit, "(total)", f"{res['total']:.4f}"))
            rows += [("", key, f"{value:.4f}") for key, value in res["layers"].items()]
        return rows

    def annotations(self, *criteria: str) -> dict[str, str]:
        """``{boundary: text}`` for drawing (``to_dot(annotations=...)``): each layer's
        figure per criterion, e.g. ``"NC 0.83"``; a pair criterion's figure goes on the
        second layer of the pair, e.g. ``"SignSign fc1→ 0.25"``. Several criteria share
        a node's line. Default: every criterion of the result. Keys are the tracker's
        layer names; `to_dot` draws one it has no node for (an iteration of a scan,
        ``layers[0]/mlp``, or a call below its `depth`) on the node drawn around it.

        Raises:
          InvalidSpecError: a criterion the result does not have.
        """
        unknown = [c for c in criteria if c not in self]
        if unknown:
            raise UnknownCriterionError(name=unknown[0], known=sorted(self))
        notes: dict[str, list[str]] = {}
        for crit in criteria or list(self):
            for key, value in self[crit]["layers"].items():
                first, arrow, layer = key.rpartition(" -> ")
                label = f"{crit} {first}→ {value:.2f}" if arrow else f"{crit} {value:.2f}"
                notes.setdefault(layer, []).append(label)
        return {layer: "; ".join(labels) for layer, labels in notes.items()}


def coverage_of(crit: Criterion, state: Any, layers: list[str]) -> dict[str, Any]:
    """One criterion's coverage: over all its neurons, and per result key."""
    counts = [(int(c), int(n)) for c, n in crit.counts(state)]
    covered = sum(c for c, _ in counts)
    total = sum(n for _, n in counts)
    keys = crit.keys(layers)
    per_key = {k: _fraction(c, n) for k, (c, n) in zip(keys, counts, strict=True)}
    return {"total": _fraction(covered, total), "layers": per_key}


def _fraction(covered: int, total: int) -> float:
    return covered / total if total else 0.0


def result_names(criteria: list[Criterion]) -> list[str]:
    """The criteria's names, with their settings for names that several criteria share."""
    counts = collections.Counter(c.name for c in criteria)
    return [_with_settings(c) if counts[c.name] > 1 else c.name for c in criteria]


def _with_settings(crit: Criterion) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in vars(crit).items())
    return f"{crit.name}({settings})"


_compat.register_frames_exclusion(__file__)
