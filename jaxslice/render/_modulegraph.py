"""The module-level DAG of a traced program.

Nodes are module calls (at most `depth` path components deep; a call with visible calls
nested in it becomes a container, not a node) plus ``<inputs>`` and ``<output>``. An edge
A -> B means a value that A computes reaches B, possibly through equations that belong to
no node (residual adds, activations between modules), which are looked through. Each
edge carries the shapes and dtypes of the values on it.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from .._graph import Call, Graph, describe_aval, innermost

INPUTS = "<inputs>"
OUTPUT = "<output>"


def _depth(call: Call) -> int:
    return len(call.name.split("/"))


def _parts(call: Call) -> tuple[str, ...]:
    return tuple(call.name.split(".")[0].split("/"))


def _contains(outer: Call, inner: Call) -> bool:
    """Whether `inner` runs inside `outer` (a submodule, or a method of the same module)."""
    if outer is inner or not (outer.start <= inner.start and inner.stop <= outer.stop):
        return False
    marked = all(
        abs(x) != float("inf") for x in (outer.in_seq, outer.out_seq, inner.in_seq, inner.out_seq)
    )
    if marked and not (outer.in_seq <= inner.in_seq and inner.out_seq <= outer.out_seq):
        return False
    po, pi = _parts(outer), _parts(inner)
    return pi[: len(po)] == po and (
        len(pi) > len(po) or "." in inner.name and "." not in outer.name
    )


def _short(aval: Any) -> str:
    return describe_aval(aval)


def module_graph(
    graph: Graph,
    *,
    depth: int | None = None,
    parameters: dict[str, int] | None = None,
    in_slice: set[int] | None = None,
) -> nx.DiGraph:
    """The module-level DAG of `graph` (see the module docstring).

    Args:
      depth: the deepest path level shown as nodes; deeper calls fold into their parent.
      parameters: parameter count per call name, stored on the nodes.
      in_slice: equation indices of a slice; nodes get ``in_slice`` set accordingly.

    Node attributes: ``label``, ``module_type``, ``params``, ``inputs``, ``outputs``,
    ``parent`` (the containing call or None), ``in_slice``. Edge attribute: ``shapes``.
    """
    calls = [c for c in graph.calls if c.loop is None and (depth is None or _depth(c) <= depth)]
    parents: dict[str, str | None] = {}
    nodes: list[Call] = []
    containers: set[str] = set()
    for c in calls:
        outer = [p for p in calls if _contains(p, c)]
        innermost = min(
            outer, key=lambda p: (p.stop - p.start, -p.in_seq, -len(_parts(p))), default=None
        )
        parents[c.qualname] = innermost.qualname if innermost is not None else None
        if any(_contains(c, d) for d in calls):
            containers.add(c.qualname)
        else:
            nodes.append(c)
    dag = nx.DiGraph()
    parameters = parameters or {}
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
    for c in calls:
        ins = [
            graph.avals[s.id] for s in c.in_slots if s.id is not None and not graph.is_free(s.id)
        ]
        outs = [graph.avals[s.id] for s in c.out_slots if s.id is not None]
        attrs = dict(
            label=c.qualname,
            module_type=c.module_type,
            params=parameters.get(c.qualname, 0),
            inputs=", ".join(_short(a) for a in ins),
            outputs=", ".join(_short(a) for a in outs),
            parent=parents[c.qualname],
            in_slice=in_slice is None or any(i in in_slice for i in range(c.start, c.stop)),
            container=c.qualname in containers,
        )
        if c.qualname in containers:
            dag.graph.setdefault("containers", {})[c.qualname] = attrs
        else:
            dag.add_node(c.qualname, **attrs)
    container_calls = [c for c in calls if c.qualname in containers]
    _add_edges(graph, dag, nodes, container_calls, parents)
    return dag


def _add_edges(
    graph: Graph,
    dag: nx.DiGraph,
    nodes: list[Call],
    containers: list[Call],
    parents: dict[str, str | None],
) -> None:
    # Glue equations inside a container (a residual add, say) take their source from the
    # container's own nodes when they have one, so edges follow the module structure.
    box = [c.qualname if c is not None else None for c in innermost(containers, len(graph.eqns))]
    ancestors: dict[str, set[str]] = {}
    for c in nodes:
        chain, p = set(), parents.get(c.qualname)
        while p is not None:
            chain.add(p)
            p = parents.get(p)
        ancestors[c.qualname] = chain
    owner = [c.qualname if c is not None else None for c in innermost(nodes, len(graph.eqns))]
    first = {c.qualname: c.start for c in nodes}
    src: dict[int, frozenset[str]] = {v: frozenset([INPUTS]) for v in graph.input_ids}
    starts: dict[int, list[Call]] = {}
    stops: dict[int, list[Call]] = {}
    for c in nodes:
        starts.setdefault(c.start, []).append(c)
        stops.setdefault(c.stop, []).append(c)

    def connect(values: list[int], target: str) -> None:
        for v in values:
            for s in src.get(v, ()):
                if s != target:
                    if not dag.has_edge(s, target):
                        dag.add_edge(s, target, shapes=[])
                    shape = _short(graph.avals[v])
                    if shape not in dag.edges[s, target]["shapes"]:
                        dag.edges[s, target]["shapes"].append(shape)

    for pos in range(len(graph.eqns) + 1):
        for c in sorted(stops.get(pos, ()), key=lambda c: c.out_seq):
            if c.start == pos and c.stop == pos:
                connect([s.id for s in c.in_slots if s.id is not None], c.qualname)
            for s in c.out_slots:
                if s.id is not None and not graph.is_free(s.id):
                    src[s.id] = frozenset([c.qualname])
        for c in starts.get(pos, ()):
            if c.stop != pos:
                connect([s.id for s in c.in_slots if s.id is not None], c.qualname)
        if pos == len(graph.eqns):
            break
        eqn = graph.eqns[pos]
        name = owner[pos]
        if name is not None:
            connect([v for v in eqn.ins if graph.producer.get(v, -1) < first[name]], name)
            new = frozenset([name])
        else:
            new = frozenset().union(*(src.get(v, frozenset()) for v in eqn.ins))
            inside = frozenset(n for n in new if box[pos] in ancestors.get(n, ()))
            if box[pos] is not None and inside:
                new = inside
        for v in eqn.outs:
            src[v] = new
    connect([s.id for s in graph.out_slots if s.id is not None], OUTPUT)
