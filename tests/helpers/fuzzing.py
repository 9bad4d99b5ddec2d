"""What the differential fuzzers share: the seeds of a large run, the verdict on a
(start, end) pair, the ancestors of nodes in a generator's DAG and names under a
wrapper's prefix."""

from __future__ import annotations

import os
from typing import Any

import pytest


def ancestors(parents: Any, start: Any) -> set[Any]:
    """The nodes of a generator's DAG that `start` is computed from, `start` included
    (``parents[v]``: the nodes `v` is computed from)."""
    seen: set[Any] = set()
    stack = list(start)
    while stack:
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            stack.extend(parents[v])
    return seen


def flat_ends(end: Any) -> list[Any]:
    """The items of an `end` given as a list, a dict or one end."""
    if isinstance(end, list):
        return list(end)
    if isinstance(end, dict):
        return list(end.values())
    return [end]


def prefixed(spec: Any, prefix: str) -> Any:
    """A `start` or `end` (a name, None, a list or a dict of them) with every name under
    `prefix` (``"dense3" -> "net/dense3"``), for a generated model wrapped in another
    module; None (the model's inputs or output) stays None."""
    if isinstance(spec, list):
        return [prefixed(s, prefix) for s in spec]
    if isinstance(spec, dict):
        return {k: prefixed(s, prefix) for k, s in spec.items()}
    return None if spec is None else f"{prefix}{spec}"


def large_fuzz_seeds(config: Any, default_count: int) -> list[int]:
    """The seeds of a large fuzz run, which runs only when selected (``-m fuzz_large`` or
    ``JAXSLICE_FUZZ_LARGE=1``; the test is skipped otherwise): ``JAXSLICE_FUZZ_SEEDS=3,17``,
    or ``JAXSLICE_FUZZ_N`` seeds (default `default_count`) from ``JAXSLICE_FUZZ_SEED0``."""
    expr = config.getoption("markexpr") or ""
    selected = "fuzz_large" in expr and "not fuzz_large" not in expr
    if os.environ.get("JAXSLICE_FUZZ_LARGE") != "1" and not selected:
        pytest.skip("the large fuzz run: select it with `-m fuzz_large` or JAXSLICE_FUZZ_LARGE=1")
    if os.environ.get("JAXSLICE_FUZZ_SEEDS"):
        return [int(s) for s in os.environ["JAXSLICE_FUZZ_SEEDS"].split(",")]
    first = int(os.environ.get("JAXSLICE_FUZZ_SEED0", "1000"))
    return list(range(first, first + int(os.environ.get("JAXSLICE_FUZZ_N", str(default_count)))))


def pair_verdict(missing: bool, disconnected: bool, unused: bool, clash: bool) -> str:
    """What a fuzz oracle expects of a (start, end) pair, from what its value graph says:
    ``"valid"``, one reason to refuse it (``"missing"``, ``"disconnected"``), a borderline
    case (``"unused"`` start, ``"clash"``: one value given twice) or ``"both"``."""
    if missing and (disconnected or unused or clash):
        return "both"
    if disconnected:
        return "both" if clash else "disconnected"
    if missing:
        return "missing"
    if clash:
        return "clash"
    if unused:
        return "unused"
    return "valid"
