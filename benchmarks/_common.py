"""What every group of rows shares: the run's configuration and the shape of a row.

A row is a dict: ``measure`` (its label, numbered as in SPEC "Performance"), the timing
summary (``subject_ms``, ``reference_ms``, ``ratio``...) or a plain ``subject`` value,
``target`` (text), ``ok`` (True, False, or None for information and "n/a"), and ``note``,
a short remark printed after the row. Anything else goes to the JSON file only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and repetitions; ``--quick`` shrinks everything for a CI smoke run."""

    quick: bool
    arch: str  # the compiled rows' model (real data)
    size: int  # its input's height and width
    batch: int
    build_arch: str  # rows 3, 4 and 9 (abstract inputs)
    scaling_archs: tuple[str, ...]  # row 5
    rounds: int  # compiled pairs: alternating rounds...
    round_s: float  # ...of about this many seconds per side
    reps: int  # one-shot pairs (builds): alternated repetitions
    naive_batches: int
    scan_depth: int = 24  # rows 10-12: blocks in the scanned stack...
    scan_shape: tuple[int, int, int] = (8, 64, 128)  # ...its input: batch, tokens, width
    scan_end: int = 2  # slice(end=f"layers[{scan_end}]")
    scan_start: int = 20  # slice(start=f"layers[{scan_start}]")
    cold_arch: str = "resnet50"  # rows 13-17: first builds in fresh processes...
    cold_size: int = 224  # ...of this model on one image of this size...
    cold_end: tuple[int, int] = (2, 3)  # ...ending at block layer{stage}_{block}
    cold_rounds: int = 5  # processes per side (alternated)
    call_rounds: int = 11  # row 16: rounds of alternated batches of calls

    @classmethod
    def make(cls, quick: bool) -> Config:
        if quick:
            scan = {"scan_depth": 12, "scan_end": 2, "scan_start": 8}
            cold = {"cold_arch": "resnet18", "cold_size": 64, "cold_end": (2, 1)}
            archs = ("resnet18", "resnet34")
            small = {**scan, **cold, "cold_rounds": 1, "call_rounds": 3}
            return cls(True, "resnet10", 32, 4, "resnet18", archs, 3, 0.02, 3, 1, **small)
        scaling = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
        return cls(False, "resnet50", 64, 8, "resnet50", scaling, 11, 0.2, 9, 2)


def row(
    measure: str, res: dict[str, Any], target: str, ok: bool | None, note: str = "", **extra: Any
) -> dict[str, Any]:
    return {"measure": measure, **res, "target": target, "ok": ok, "note": note, **extra}


def value_row(measure: str, value: Any, target: str, ok: bool | None, note: str = "", **extra: Any):
    """A row with one value (a count, a slope, a time) rather than a timed pair."""
    return {"measure": measure, "subject": value, "target": target, "ok": ok, "note": note, **extra}


def meets(value: float, target: str) -> bool | None:
    """Whether `value` meets a target written ``"<= 1.5"`` or ``"< 1.0"`` (None for "info")."""
    op, _, limit = target.partition(" ")
    if op == "<=":
        return value <= float(limit)
    if op == "<":
        return value < float(limit)
    return None
