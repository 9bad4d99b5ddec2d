"""Which parts of a model a slice holds, for the kinds whose slice is itself a module.

An NNX or Equinox slice holds the model's own submodules, not copies of their arrays: the
outermost modules whose calls the slice runs, and the modules that own the variables it
reads. Variables no submodule owns (held by the root itself) are held one by one.
Module and variable paths are tuples of keys, compared as strings.
"""

from __future__ import annotations

from typing import Any

from .._core.graph import innermost
from .._trees import path_names


def held_paths(
    modules: list[tuple[Any, ...]], program: Any
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """``(module paths, loose variable paths)`` a slice of `program` must hold.

    Args:
      modules: the paths of every module of the model (the root is ``()``).
      program: the slice's `SliceProgram`.
    """
    plan = program.base.plan
    by_str = {_order(path): path for path in modules}
    wanted = {by_str[path] for path in running_modules(program) if path in by_str}
    owned = [p for p in modules if p]
    loose = []
    for path in set(plan.variable_paths) | set(plan.state_paths):
        owner = _owner(path, owned)
        if owner is None:
            loose.append(path)
        else:
            wanted.add(owner)
    return _outermost(wanted), sorted(loose, key=_order)


def _owner(path: tuple[Any, ...], modules: list[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """The innermost of `modules` whose path prefixes `path`."""
    return max((m for m in modules if path[: len(m)] == m), key=len, default=None)


def _order(path: tuple[Any, ...]) -> tuple[str, ...]:
    return path_names(path)


def _outermost(paths: set[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The non-empty paths not nested in another of them, sorted."""
    parts = sorted((p for p in paths if p), key=_order)
    return [p for p in parts if not any(q != p and p[: len(q)] == q for q in parts)]


def running_modules(program: Any) -> set[tuple[str, ...]]:
    """Paths of the module calls a slice runs in.

    The innermost module call around each equation of the slice runs it (and may read
    flags such as `deterministic`). A call without equations in this mode (dropout in
    eval mode) counts when the slice passes through it, so switching modes reaches it.
    """
    plan, graph = program.base.plan, program.base.traced.graph
    calls = [c for c in graph.calls if c.loop is None]
    owner = innermost(calls, len(graph.eqns))
    found = {owner[i].path for i in plan.cut.eqns if owner[i] is not None}
    made = _values(graph, plan.cut.eqns, "outs") | set(plan.input_ids)
    read = _values(graph, plan.cut.eqns, "ins") | set(plan.output_ids)
    empty = [c for c in calls if c.start == c.stop]
    return found | {c.path for c in empty if _ids(c.in_slots) & made and _ids(c.out_slots) & read}


def _values(graph: Any, eqns: Any, side: str) -> set[int]:
    """The values equations `eqns` read (``"ins"``) or write (``"outs"``)."""
    return {v for i in eqns for v in getattr(graph.eqns[i], side)}


def _ids(slots: Any) -> set[int]:
    return {s.id for s in slots if s.id is not None}
