"""The result of slicing an NNX model: an `nnx.Module` that shares the model's variables.

`SlicedModule` holds the original submodules the slice needs (and, for variables the root
module owns directly, the original `nnx.Variable`s), so its parameters, batch statistics
and RNG state *are* the model's: training the slice trains the model, and
``sub.train()``/``sub.eval()`` switch those submodules. What to compute comes from the engine
(`Any`), which caches one compiled program per input signature and per graph
definition of the model (so a changed flag or submodule re-traces, and an unchanged one
does not). Each call reads the current variable values, runs only the
sliced program and writes back the state it updated (batch statistics, RNG counters).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from .. import _compat
from .._core.graph import innermost
from .._core.view import ProgramView
from .._errors import SliceError
from ._nnx_state import get_value, set_value

NOT_COPYABLE = (
    "An NNX slice shares the model's variables and holds compiled programs, so it cannot "
    "be pickled or deep-copied. Save the model's state instead (`nnx.state(model)`, e.g. "
    "with orbax) and the recipe (start, end, sample input shapes); after loading the "
    "model, slice it again."
)


class _Static:
    """Data an NNX graph must treat as static: compared and hashed by identity."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"<jaxslice slice {self.program.start!r} -> {self.program.end!r}>"


def _held(root: Any, program: Any) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The module paths (and loose variable paths) a slice must hold."""
    plan = program.base.plan
    modules = [tuple(p) for p, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)]
    by_str = {_order(path): path for path in modules}
    wanted = {by_str[path] for path in _running_modules(program) if path in by_str}
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
    return tuple(map(str, path))


def _outermost(paths: set[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The non-empty paths not nested in another of them, sorted."""
    parts = sorted((p for p in paths if p), key=_order)
    return [p for p in parts if not any(q != p and p[: len(q)] == q for q in parts)]


def _running_modules(program: Any) -> set[tuple[str, ...]]:
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


class SlicedModule(ProgramView, nnx.Module):
    """A slice of an NNX model, itself an `nnx.Module` sharing the model's variables.

    Create one with ``js.slice(model, *inputs, start=..., end=...)``. Calling it runs
    only the slice; `nnx.jit`, `nnx.grad` and ``nnx.Optimizer(sub, tx, wrt=nnx.Param)``
    work on it as on any module, and training it updates the original model.
    """

    def __init__(self, root: Any, program: Any):
        part_paths, loose_paths = _held(root, program)
        nodes = dict(nnx.iter_graph(root))
        self.parts = nnx.List([nodes[p] for p in part_paths])
        self.loose = nnx.List([nodes[p] for p in loose_paths])
        self._jaxslice = _Static(
            program=program,
            root=root,
            part_paths=part_paths,
            loose_paths=loose_paths,
        )

    def _slice_program(self) -> Any:
        return self._jaxslice.program

    def _variables_by_path(self) -> dict[tuple[Any, ...], Any]:
        meta = self._jaxslice
        found: dict[tuple[Any, ...], Any] = {}
        for prefix, module in zip(meta.part_paths, self.parts, strict=True):
            for path, node in nnx.iter_graph(module):
                if isinstance(node, nnx.Variable):
                    found.setdefault(prefix + tuple(path), node)
        for path, var in zip(meta.loose_paths, self.loose, strict=True):
            found[path] = var
        return found

    def __reduce__(self) -> Any:
        raise SliceError(NOT_COPYABLE)

    def __deepcopy__(self, memo: Any) -> Any:
        raise SliceError(NOT_COPYABLE)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        program = self._jaxslice.program
        entry, leaves = program.lookup(inputs, kwargs, None, True)
        variables = self._variables_by_path()
        missing = [
            p for p in entry.plan.variable_paths + entry.plan.state_paths if p not in variables
        ]
        if missing:
            raise SliceError(
                "In this mode the slice reads variables it does not hold: "
                + ", ".join("/".join(map(str, p)) for p in missing[:6])
                + ". Slice the model again after switching it to this mode."
            )
        values = [get_value(variables[p]) for p in entry.plan.variable_paths]
        result, state = program.run(entry, values, [], leaves, True)
        for path, value in state:
            set_value(variables[path], value)
        return result


_compat.register_frames_exclusion(__file__)
