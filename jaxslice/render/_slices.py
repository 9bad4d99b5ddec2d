"""The module graph of a slice's model, with the slice's region marked."""

from __future__ import annotations

from typing import Any

from .._table import describe
from ._modulegraph import fitting_depth, module_graph


def slice_graph(program: Any, depth: int | None, whole: bool) -> Any:
    """The module DAG of the model a `SliceProgram` slices (traced in full if needed).

    Args:
      program: the slice's engine.
      depth: the deepest module path level shown.
      whole: mark every node as part of the slice (an edited model drawn whole).
    """
    entry = program.full_entry()
    traced = entry.traced
    params = {b.name: b.param_count for b in describe(traced)}
    in_slice = None if whole else set(entry.plan.cut.eqns)
    return module_graph(traced.graph, depth=depth, parameters=params, in_slice=in_slice)


def drawing_depth(program: Any, max_calls: int) -> int | None:
    """The deepest level at which the drawing of a `SliceProgram`'s model shows at most
    `max_calls` module calls (None: all of them)."""
    return fitting_depth(program.full_entry().traced.graph, max_calls)
