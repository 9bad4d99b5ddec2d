"""The result of slicing an NNX model: an `nnx.Module` that shares the model's variables.

`SlicedModule` holds the original submodules the slice needs (and, for variables the root
module owns directly, the original `nnx.Variable`s), so its parameters, batch statistics
and RNG state *are* the model's: training the slice trains the model, and
``sub.train()``/``sub.eval()`` switch those submodules. What to compute comes from a
`Sliced` engine that traces the whole model and caches one compiled program per input
signature and per graph definition of the model (so a changed flag re-traces, and an
unchanged one does not). Each call reads the current variable values, runs only the
sliced program and writes back the state it updated (batch statistics, RNG counters).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from . import _compat
from ._errors import SliceError
from ._graph import innermost
from ._sliced import Sliced, _assemble
from .adapters._nnx import get_value, set_value


class _Static:
    """Data an NNX graph must treat as static: compared and hashed by identity."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"<jaxslice slice {self.start!r} -> {self.end!r}>"


def _held(root: Any, engine: Sliced) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The module paths (and loose variable paths) a slice must hold."""
    plan = engine._base.plan
    graph = engine._base.traced.graph
    modules = {
        tuple(path): node for path, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)
    }
    by_str = {tuple(str(p) for p in path): path for path in modules}
    wanted: set[tuple[Any, ...]] = set()
    # The innermost module call around each equation of the slice runs in it (and may
    # read flags such as `deterministic`), so the slice holds that module.
    calls = [c for c in graph.calls if c.loop is None]
    owner = innermost(calls, len(graph.eqns))
    for i in plan.cut.eqns:
        if owner[i] is not None and owner[i].path in by_str:
            wanted.add(by_str[owner[i].path])
    # A call without equations in this mode (dropout in eval mode) is held when the slice
    # passes through it, so switching modes later reaches it.
    made = {v for i in plan.cut.eqns for v in graph.eqns[i].outs} | set(plan.input_ids)
    read = {v for i in plan.cut.eqns for v in graph.eqns[i].ins} | set(plan.output_ids)
    for call in calls:
        if call.start == call.stop and call.path in by_str:
            ins = {s.id for s in call.in_slots if s.id is not None}
            outs = {s.id for s in call.out_slots if s.id is not None}
            if ins & made and outs & read:
                wanted.add(by_str[call.path])
    loose = []
    for path in set(plan.variable_paths) | set(plan.state_paths):
        owner = max((m for m in modules if m and path[: len(m)] == m), key=len, default=None)
        if owner is None:
            loose.append(path)
        else:
            wanted.add(owner)
    parts = sorted((p for p in wanted if p), key=lambda p: tuple(map(str, p)))
    parts = [p for p in parts if not any(q != p and p[: len(q)] == q for q in parts)]
    return parts, sorted(loose, key=lambda p: tuple(map(str, p)))


class SlicedModule(nnx.Module):
    """A slice of an NNX model, itself an `nnx.Module` sharing the model's variables.

    Create one with ``js.slice(model, *inputs, start=..., end=...)``. Calling it runs
    only the slice; `nnx.jit`, `nnx.grad` and ``nnx.Optimizer(sub, tx, wrt=nnx.Param)``
    work on it as on any module, and training it updates the original model.
    """

    def __init__(self, root: Any, engine: Sliced):
        part_paths, loose_paths = _held(root, engine)
        nodes = dict(nnx.iter_graph(root))
        self.parts = nnx.List([nodes[p] for p in part_paths])
        self.loose = nnx.List([nodes[p] for p in loose_paths])
        self._jaxslice = _Static(
            engine=engine,
            root=root,
            part_paths=part_paths,
            loose_paths=loose_paths,
            start=engine.start,
            end=engine.end,
        )

    @property
    def start(self) -> Any:
        return self._jaxslice.start

    @property
    def end(self) -> Any:
        return self._jaxslice.end

    @property
    def jaxpr(self) -> Any:
        """The re-emitted program for the shapes and mode it was sliced with."""
        return self._jaxslice.engine.jaxpr

    def to_networkx(self, depth: int | None = None) -> Any:
        """The model's module-level DAG with this slice marked; see `js.Sliced.to_networkx`."""
        return self._jaxslice.engine.to_networkx(depth)

    def to_dot(self, depth: int | None = None, annotations: dict[str, Any] | None = None) -> str:
        """DOT source with this slice highlighted; see `js.Sliced.to_dot`."""
        return self._jaxslice.engine.to_dot(depth, annotations)

    def render(
        self, path: Any, depth: int | None = None, annotations: dict[str, Any] | None = None
    ) -> str:
        """Renders `to_dot` with Graphviz's `dot`; see `js.Sliced.render`."""
        return self._jaxslice.engine.render(path, depth, annotations)

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

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        engine = self._jaxslice.engine
        entry, leaves = engine._lookup(inputs, kwargs, None, True)
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
        outs = entry.jitted(values, [], leaves)
        n = len(entry.plan.output_ids)
        for path, value in zip(entry.plan.state_paths, outs[n:], strict=True):
            set_value(variables[path], value)
        return _assemble(entry.plan.output_trees, outs[:n])


_compat.register_frames_exclusion(__file__)
