"""The module-level DAG of a traced program.

Nodes are module calls (at most `depth` path components deep; a call with visible calls
nested in it becomes a container, not a node) plus ``<inputs>`` and ``<output>``. An edge
A -> B means a value that A computes reaches B, possibly through equations that belong to
no node (residual adds, activations between modules), which are looked through. Each
edge carries the shapes and dtypes of the values on it.

Edges come from one walk over the equations in program order (`_EdgeBuilder`) that keeps,
for every value, the set of nodes it was computed from. Calls inside loop bodies
(``Call.loop`` set) are left out of the DAG; `place` (``dag.graph["place"]``) says which
drawn node or container shows any boundary name, theirs included, so an annotation of a
call the drawing leaves out goes on the call drawn around it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import networkx as nx

from .._core.graph import Call, Graph, innermost
from .._core.markers import OUTPUT as OUTPUT_SIDE
from .._core.names import split_indices
from .._core.selection import Name, resolver_of
from .._errors import BoundaryNameTypeError
from .._trees import describe_aval

INPUTS = "<inputs>"
OUTPUT = "<output>"


# --------------------------------------------------------------------------- nesting of calls


def _depth(call: Call) -> int:
    return len(call.name.split("/"))


def _parts(call: Call) -> tuple[str, ...]:
    return tuple(call.name.split(".")[0].split("/"))


def _is_marked(call: Call) -> bool:
    """Whether the call has marker orders (name-scope regions have none)."""
    return not (math.isinf(call.in_seq) or math.isinf(call.out_seq))


def _within_span(outer: Call, inner: Call) -> bool:
    return outer.start <= inner.start and inner.stop <= outer.stop


def _within_markers(outer: Call, inner: Call) -> bool:
    """Marker orders separate calls that share an equation span (empty calls, say)."""
    if not (_is_marked(outer) and _is_marked(inner)):
        return True
    return outer.in_seq <= inner.in_seq and inner.out_seq <= outer.out_seq


def _within_path(outer: Call, inner: Call) -> bool:
    """A submodule of `outer`, or a method (``ae.encode``) of the module `outer` calls."""
    po, pi = _parts(outer), _parts(inner)
    if pi[: len(po)] != po:
        return False
    return len(pi) > len(po) or ("." in inner.name and "." not in outer.name)


def _contains(outer: Call, inner: Call) -> bool:
    """Whether `inner` runs inside `outer` (a submodule, or a method of the same module)."""
    return (
        outer is not inner
        and _within_span(outer, inner)
        and _within_markers(outer, inner)
        and _within_path(outer, inner)
    )


def _tightness(call: Call) -> tuple[int, float, int]:
    """Sort key: the innermost of several enclosing calls sorts first."""
    return (call.stop - call.start, -call.in_seq, -len(_parts(call)))


def _parent(call: Call, calls: Sequence[Call]) -> str | None:
    """The qualified name of the innermost call around `call`, or None at the top."""
    outer = [p for p in calls if _contains(p, call)]
    if not outer:
        return None
    return min(outer, key=_tightness).qualname


def _has_nested(call: Call, calls: Sequence[Call]) -> bool:
    return any(_contains(call, other) for other in calls)


def _shown(call: Call, depth: int | None) -> bool:
    """Calls inside loop bodies, and deeper than `depth`, are not in the DAG."""
    return call.loop is None and (depth is None or _depth(call) <= depth)


def fitting_depth(graph: Graph, max_calls: int) -> int | None:
    """The deepest `depth` at which the DAG shows at most `max_calls` calls (nodes and
    clusters): None when every call fits, else at least 1 (a model with more top-level
    calls than that shows them all). Cheap: it counts calls by path depth, where laying
    the DAG out costs time quadratic in the calls shown.
    """
    depths = sorted(_depth(c) for c in graph.calls if c.loop is None)
    if len(depths) <= max_calls:
        return None
    return max(1, depths[max_calls] - 1)


@dataclasses.dataclass
class _Layout:
    """The calls shown, the call around each (by qualified name) and the containers."""

    calls: list[Call]
    parents: dict[str, str | None]
    containers: set[str]

    @classmethod
    def of(cls, graph: Graph, depth: int | None) -> _Layout:
        calls = [c for c in graph.calls if _shown(c, depth)]
        return cls(
            calls=calls,
            parents={c.qualname: _parent(c, calls) for c in calls},
            containers={c.qualname for c in calls if _has_nested(c, calls)},
        )

    def nodes(self) -> list[Call]:
        return [c for c in self.calls if c.qualname not in self.containers]

    def boxes(self) -> list[Call]:
        return [c for c in self.calls if c.qualname in self.containers]


# --------------------------------------------------------------------------- nodes


def _ids(slots: Iterable[Any]) -> list[int]:
    """The value ids of `slots`, skipping static (non-array) ones."""
    return [s.id for s in slots if s.id is not None]


def _computed(graph: Graph, slots: Iterable[Any]) -> list[int]:
    """The value ids of `slots` that the program computes (not constants, variables or keys)."""
    return [v for v in _ids(slots) if not graph.is_free(v)]


def _describe(graph: Graph, ids: Iterable[int]) -> str:
    return ", ".join(describe_aval(graph.avals[v]) for v in ids)


def _overlaps(call: Call, in_slice: set[int] | None) -> bool:
    """Whether any equation of `call` is in the slice (everything is without a slice)."""
    return in_slice is None or any(i in in_slice for i in range(call.start, call.stop))


def _add_terminals(dag: nx.DiGraph) -> None:
    for name in [INPUTS, OUTPUT]:
        dag.add_node(
            name,
            label=name,
            module_type="",
            params=0,
            inputs="",
            outputs="",
            parent=None,
            in_slice=True,
        )


def _call_attrs(
    graph: Graph, call: Call, layout: _Layout, params: int, in_slice: set[int] | None
) -> dict[str, Any]:
    return dict(
        label=call.qualname,
        module_type=call.module_type,
        params=params,
        inputs=_describe(graph, _computed(graph, call.in_slots)),
        outputs=_describe(graph, _ids(call.out_slots)),
        parent=layout.parents[call.qualname],
        in_slice=_overlaps(call, in_slice),
        container=call.qualname in layout.containers,
    )


def _add_call(dag: nx.DiGraph, attrs: dict[str, Any]) -> None:
    """A node for a call, or an entry in ``dag.graph["containers"]`` for a container."""
    if attrs["container"]:
        dag.graph.setdefault("containers", {})[attrs["label"]] = attrs
    else:
        dag.add_node(attrs["label"], **attrs)


def module_graph(
    graph: Graph,
    *,
    depth: int | None = None,
    parameters: dict[str, int] | None = None,
    in_slice: set[int] | None = None,
) -> nx.DiGraph:
    """The module-level DAG of `graph` (see the module docstring).

    Args:
      graph: the traced program.
      depth: the deepest path level shown as nodes; deeper calls fold into their parent.
      parameters: parameter count per call name, stored on the nodes.
      in_slice: equation indices of a slice; nodes get ``in_slice`` set accordingly.

    Returns:
      A `networkx.DiGraph`. Node attributes: ``label``, ``module_type``, ``params``,
      ``inputs``, ``outputs``, ``parent`` (the containing call or None), ``in_slice``.
      Edge attribute: ``shapes``. Containers are not nodes; their attributes are in
      ``dag.graph["containers"]``, keyed by name (the key is absent when there are none).
      ``dag.graph["place"]`` maps a boundary name to the `Place` that draws it (raising
      `UnknownBoundaryError` for a name of no boundary).

    >>> import jax.numpy as jnp, jaxslice as js
    >>> double = js.mark("double", lambda x: 2 * x)
    >>> dag = js.slice(lambda params, x: jnp.sin(double(x)), {}, jnp.ones(3)).to_networkx()
    >>> sorted(dag.edges)
    [('<inputs>', 'double'), ('double', '<output>')]
    >>> dag.edges["double", "<output>"]["shapes"]
    ['float32[3]']
    """
    layout = _Layout.of(graph, depth)
    dag = nx.DiGraph()
    _add_terminals(dag)
    parameters = parameters or {}
    for c in layout.calls:
        _add_call(dag, _call_attrs(graph, c, layout, parameters.get(c.qualname, 0), in_slice))
    _EdgeBuilder(graph, dag, layout).build()
    dag.graph["place"] = _Placer(graph, layout)
    return dag


# --------------------------------------------------------------------------- annotations


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a drawing shows a boundary: the node or container `at` (None when no drawn
    call holds it), and, for a name that picks more than `at` itself, the `inner` call it
    picks, as listed (``layers[:]/mlp``, ``b/fc1``, ``fc:input``), and the `iteration`
    of its loops (``[2]``; empty outside loops)."""

    at: str | None
    inner: str = ""
    iteration: str = ""


def _unlooped_parts(call: Call) -> tuple[str, ...]:
    """`_parts` of a call's name without its iteration slots (``layers[:]/mlp``: layers, mlp)."""
    return tuple("".join(split_indices(call.name.split(".")[0])[0]).split("/"))


class _Placer:
    """`place`: the `Place` of a boundary name, resolved as every name is (so a wrong
    one is an `UnknownBoundaryError` with suggestions). A call the drawing leaves out (in
    a loop body, or deeper than `depth`) is shown by the innermost drawn call around it."""

    def __init__(self, graph: Graph, layout: _Layout) -> None:
        self.resolver = resolver_of(graph)
        self.calls = layout.calls
        self.drawn = {c.qualname for c in layout.calls}

    def __deepcopy__(self, memo: dict[int, Any]) -> _Placer:
        return self  # never changes: a deep copy of the DAG shares it, not the traced graph

    def __call__(self, name: Any) -> Place:
        if not isinstance(name, str):
            raise BoundaryNameTypeError(spec=name, kind=type(name).__name__)
        parsed = Name.of(name)
        where = self.resolver.select(parsed, OUTPUT_SIDE, uncounted=True)
        call = where.call
        if call is None:  # a node an edit inserted: drawn under its own name
            return Place(where.node)
        at = call.qualname if call.qualname in self.drawn else self._around(call)
        if where.path:
            port = f":{parsed.port}" if parsed.port else ""
            iteration = "".join(f"[{k}]" for k in where.path)
            return Place(at, call.qualname + port, iteration)
        if at == call.qualname and parsed.port is None:
            return Place(at)
        return Place(at, name)

    def _around(self, call: Call) -> str | None:
        """The innermost drawn call that `call` runs inside, or None."""
        parts = _unlooped_parts(call)
        outer = [
            p
            for p in self.calls
            if _within_span(p, call)
            and _within_markers(p, call)
            and parts[: len(_parts(p))] == _parts(p)
        ]
        return min(outer, key=_tightness).qualname if outer else None


# --------------------------------------------------------------------------- edges


def _names(owners: Sequence[Call | None]) -> list[str | None]:
    return [c.qualname if c is not None else None for c in owners]


def _ancestors(name: str, parents: dict[str, str | None]) -> set[str]:
    """The qualified names of the containers around the call `name`."""
    chain, p = set(), parents.get(name)
    while p is not None:
        chain.add(p)
        p = parents.get(p)
    return chain


def _group(calls: Sequence[Call], key: Callable[[Call], int]) -> dict[int, list[Call]]:
    groups: dict[int, list[Call]] = {}
    for c in calls:
        groups.setdefault(key(c), []).append(c)
    return groups


class _EdgeBuilder:
    """Adds the edges of the DAG in one walk over the equations, in program order.

    `src` maps each value id to the nodes it was computed from. A node's equations make
    values from the node itself; glue equations (owned by no node) pass their operands'
    sources through, so a residual add reports the modules feeding it. A node connects
    from the sources of the values it reads that were made before it started.
    """

    def __init__(self, graph: Graph, dag: nx.DiGraph, layout: _Layout) -> None:
        n = len(graph.eqns)
        self.graph, self.dag = graph, dag
        nodes = layout.nodes()
        self.owner = _names(innermost(nodes, n))
        # Glue equations inside a container (a residual add, say) take their source from
        # the container's own nodes when they have one, so edges follow the module structure.
        self.box = _names(innermost(layout.boxes(), n))
        self.ancestors = {c.qualname: _ancestors(c.qualname, layout.parents) for c in nodes}
        self.first = {c.qualname: c.start for c in nodes}
        self.starts = _group(nodes, lambda c: c.start)
        self.stops = _group(nodes, lambda c: c.stop)
        self.src: dict[int, frozenset[str]] = {v: frozenset([INPUTS]) for v in graph.input_ids}

    def build(self) -> None:
        n = len(self.graph.eqns)
        for pos in range(n):
            self._boundaries(pos)
            self._equation(pos)
        self._boundaries(n)
        self._connect(_ids(self.graph.out_slots), OUTPUT)

    def _boundaries(self, pos: int) -> None:
        """Calls ending at `pos` publish their outputs; calls starting there read inputs."""
        for c in sorted(self.stops.get(pos, ()), key=lambda c: c.out_seq):
            self._finish(c)
        for c in self.starts.get(pos, ()):
            if c.stop != pos:
                self._connect(_ids(c.in_slots), c.qualname)

    def _finish(self, call: Call) -> None:
        if call.start == call.stop:  # no equations of its own: it reads its inputs here
            self._connect(_ids(call.in_slots), call.qualname)
        for v in _computed(self.graph, call.out_slots):
            self.src[v] = frozenset([call.qualname])

    def _equation(self, pos: int) -> None:
        eqn = self.graph.eqns[pos]
        name = self.owner[pos]
        if name is None:
            made_from = self._glue_sources(eqn.ins, self.box[pos])
        else:
            self._connect(self._from_before(eqn.ins, name), name)
            made_from = frozenset([name])
        for v in eqn.outs:
            self.src[v] = made_from

    def _from_before(self, ins: Iterable[int], name: str) -> list[int]:
        """The operands made before node `name` started: its inputs from elsewhere."""
        return [v for v in ins if self.graph.producer.get(v, -1) < self.first[name]]

    def _glue_sources(self, ins: Iterable[int], box: str | None) -> frozenset[str]:
        """The nodes a glue equation's result comes from, preferring those inside `box`."""
        sources = frozenset().union(*(self.src.get(v, frozenset()) for v in ins))
        if box is None:
            return sources
        return self._inside(sources, box) or sources

    def _inside(self, names: frozenset[str], box: str) -> frozenset[str]:
        return frozenset(n for n in names if box in self.ancestors.get(n, ()))

    def _connect(self, values: Iterable[int], target: str) -> None:
        for v in values:
            for s in self.src.get(v, ()):
                if s != target:
                    self._add_shape(s, target, describe_aval(self.graph.avals[v]))

    def _add_shape(self, source: str, target: str, shape: str) -> None:
        if not self.dag.has_edge(source, target):
            self.dag.add_edge(source, target, shapes=[])
        shapes = self.dag.edges[source, target]["shapes"]
        if shape not in shapes:
            shapes.append(shape)
