"""Graphviz DOT source for a module graph, and rendering it with the `dot` program.

Annotations are keyed by boundary name, so they can name calls the drawing leaves out:
each goes on the node or cluster that draws its call or, failing that, on the innermost
one drawn around it (the module graph's `place`), as a line that names the call it
belongs to (``layers[:]/mlp: [0] NC 0.83 | [1] NC 1.00``, iterations of one call on one
line). A name of no boundary is refused, never dropped.
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import tempfile
from typing import Any

import networkx as nx

from .._errors import (
    DotFailedError,
    DotNotFoundError,
    DotSvgFailedError,
    DotTimeoutError,
    UnknownBoundaryError,
)
from ._modulegraph import INPUTS, OUTPUT, Place

_IN, _OUT = "#dbe9ff", "#f2f2f2"
_PER_LINE = 4  # iterations of one call listed per line of a label


def _esc(text: Any) -> str:
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _q(text: Any) -> str:
    return '"' + _esc(text) + '"'


def _label(*lines: Any) -> str:
    """A quoted DOT label of several lines, each escaped, joined by DOT's line break."""
    return '"' + "\\n".join(_esc(line) for line in lines) + '"'


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _in_slice(attrs: dict[str, Any]) -> bool:
    return attrs.get("in_slice", True)


def _type_line(attrs: dict[str, Any]) -> str:
    """``Dense (36 params)``: the module type and, when it has any, its parameter count."""
    params = attrs.get("params")
    return attrs["module_type"] + (f" ({params:,} params)" if params else "")


def _header(title: str) -> list[str]:
    return [
        f"digraph {_q(title)} {{",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8];',
    ]


def _edge_line(dag: nx.DiGraph, a: str, b: str, attrs: dict[str, Any]) -> str:
    """An edge labelled with its shapes; grey unless both ends are in the slice."""
    inside = _in_slice(dag.nodes[a]) and _in_slice(dag.nodes[b])
    style = "" if inside else ", color=gray60, fontcolor=gray50"
    return f"  {_q(a)} -> {_q(b)} [label={_q(', '.join(attrs.get('shapes', [])))}{style}];"


def _drawn_only(dag: nx.DiGraph) -> Any:
    """`place` for a DAG built without one (by hand): its own node and container names."""
    names = [n for n in dag.nodes if n not in (INPUTS, OUTPUT)]
    names += list(dag.graph.get("containers", {}))

    def place(name: Any) -> Place:
        if name in names:
            return Place(name)
        close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownBoundaryError(name=name, hint=hint)

    return place


def _inner_lines(inner: str, notes: list[tuple[str, str]]) -> list[str]:
    """``inner: [0] a | [1] b``: the notes of one call drawn inside another, iterations
    of its loops `_PER_LINE` to a line."""
    entries = [f"{iteration} {text}".strip() for iteration, text in notes]
    lines = [" | ".join(entries[i : i + _PER_LINE]) for i in range(0, len(entries), _PER_LINE)]
    return [f"{inner}: {lines[0]}", *lines[1:]]


def placed_notes(
    dag: nx.DiGraph, annotations: dict[str, Any]
) -> dict[str | None, tuple[list[str], list[str]]]:
    """Per drawn node or cluster (None: no drawn call), its own annotations and the lines
    of the calls drawn inside it (`_inner_lines`, one call a line).

    Raises:
      UnknownBoundaryError: a key that names no boundary of the model (with suggestions).
    """
    place = dag.graph.get("place") or _drawn_only(dag)
    grouped: dict[str | None, dict[str, list[tuple[str, str]]]] = {}
    for name, value in annotations.items():
        where = place(name)
        inner = grouped.setdefault(where.at, {}).setdefault(where.inner, [])
        inner.append((where.iteration, _fmt(value)))
    return {
        at: (
            [text for _, text in inners.pop("", [])],
            [line for inner, notes in inners.items() for line in _inner_lines(inner, notes)],
        )
        for at, inners in grouped.items()
    }


class _Clusters:
    """Writes the nodes of a module graph nested in one cluster per container."""

    def __init__(
        self, dag: nx.DiGraph, notes: dict[str | None, tuple[list[str], list[str]]]
    ) -> None:
        self.dag = dag
        self.notes = notes
        self.containers: dict[str, dict[str, Any]] = dag.graph.get("containers", {})
        members = [(n, a, False) for n, a in dag.nodes(data=True)]
        members += [(n, a, True) for n, a in self.containers.items()]
        self.children: dict[str | None, list[tuple[str, bool]]] = {}
        for name, attrs, is_container in members:
            self.children.setdefault(attrs.get("parent"), []).append((name, is_container))

    def lines(self, parent: str | None = None, indent: str = "  ") -> list[str]:
        """The DOT lines of the nodes and clusters directly inside `parent`."""
        lines = []
        for name, is_container in self.children.get(parent, []):
            if is_container:
                lines += self._cluster(name, indent)
            else:
                lines.append(self._node(name, indent))
        return lines

    def _cluster(self, name: str, indent: str) -> list[str]:
        attrs = self.containers[name]
        own, inner = self.notes.get(name, ([], []))
        label = _label(" ".join([f"{name} ({attrs['module_type']})", *own]), *inner)
        style = "rounded" if _in_slice(attrs) else "rounded,dashed"
        return [
            f"{indent}subgraph {_q('cluster_' + name)} {{",
            f"{indent}  label={label}; style={_q(style)}; fontname=Helvetica; fontsize=10;",
            *self.lines(name, indent + "  "),
            f"{indent}}}",
        ]

    def _node(self, name: str, indent: str) -> str:
        if name in (INPUTS, OUTPUT):
            return f"{indent}{_q(name)} [shape=oval, fillcolor=white];"
        attrs = self.dag.nodes[name]
        own, inner = self.notes.get(name, ([], []))
        label = _label(name, _type_line(attrs), *own, *inner)
        color, font = (_IN, "black") if _in_slice(attrs) else (_OUT, "gray40")
        return f'{indent}{_q(name)} [label={label}, fillcolor="{color}", fontcolor={font}];'


def to_dot(
    dag: nx.DiGraph, *, annotations: dict[str, Any] | None = None, title: str = "jaxslice"
) -> str:
    r"""DOT source: a cluster per containing module, a box per module call, shape-labelled edges.

    Nodes of the slice region are filled blue, the rest grey.

    Args:
      dag: a module graph, as `module_graph` builds it.
      annotations: ``{boundary name: value}``, each drawn as an extra line (e.g. a
        coverage figure) on the node or cluster of the boundary, or, for a call the
        drawing leaves out (inside a loop body, or deeper than the drawn depth), on the
        innermost one drawn around it, as ``name: value`` (``layers[:]/mlp: [0] value |
        [1] value`` for iterations of a scan).
      title: the name of the DOT graph.

    Returns:
      The DOT source, ending in a newline.

    Raises:
      UnknownBoundaryError: an annotation names no boundary of the model.

    >>> import networkx as nx
    >>> from jaxslice.render import to_dot
    >>> dag = nx.DiGraph()
    >>> dag.add_node("fc", module_type="Dense", params=12)
    >>> dag.add_edge("fc", "<output>", shapes=["float32[2, 3]"])
    >>> print(to_dot(dag, annotations={"fc": 0.25}))
    digraph "jaxslice" {
      rankdir=TB;
      node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];
      edge [fontname="Helvetica", fontsize=8];
      "fc" [label="fc\nDense (12 params)\n0.25", fillcolor="#dbe9ff", fontcolor=black];
      "<output>" [shape=oval, fillcolor=white];
      "fc" -> "<output>" [label="float32[2, 3]"];
    }
    <BLANKLINE>
    """
    notes = placed_notes(dag, annotations or {})
    lines = _header(title) + _Clusters(dag, notes).lines()
    lines += [_edge_line(dag, a, b, attrs) for a, b, attrs in dag.edges(data=True)]
    if None in notes:  # calls no drawn node holds: a note under the whole drawing
        own, inner = notes[None]
        lines.append(f"  label={_label(*own, *inner)}; labelloc=b;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_program() -> str:
    exe = shutil.which("dot")
    if exe is None:
        raise DotNotFoundError()
    return exe


def _format_of(path: str, format: str | None) -> str:
    """`format` when given, else the suffix of `path`, else svg."""
    return format or os.path.splitext(path)[1].lstrip(".") or "svg"


def render_dot(source: str, path: str | os.PathLike[str], *, format: str | None = None) -> str:
    """Writes `source` rendered by Graphviz's `dot` program to `path`.

    Args:
      source: DOT source, as `to_dot` gives it.
      path: the file to write.
      format: a `dot` output format (svg, png, pdf, ...); by default the suffix of `path`,
        or svg when it has none.

    Returns:
      `path`, as a string.

    Raises:
      SliceError: when `dot` is not on PATH (with how to install it), or fails.
    """
    exe = _dot_program()
    path = os.fspath(path)
    with tempfile.NamedTemporaryFile("w", suffix=".dot", delete=False) as f:
        f.write(source)
        src = f.name
    try:
        done = subprocess.run(
            [exe, f"-T{_format_of(path, format)}", src, "-o", path],
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(src)
    if done.returncode != 0:
        raise DotFailedError(path=path, stderr=done.stderr.strip())
    return path


def dot_svg(source: str, *, timeout: float | None = None) -> str:
    """`source` rendered to SVG by Graphviz's `dot` program, as text (nothing is written).

    Args:
      source: DOT source, as `to_dot` gives it.
      timeout: seconds `dot` may take; None waits for it.

    Raises:
      SliceError: when `dot` is not on PATH (with how to install it), fails, or takes
        longer than `timeout`.
    """
    exe = _dot_program()
    try:
        done = subprocess.run(
            [exe, "-Tsvg"],
            input=source,
            capture_output=True,
            encoding="utf-8",
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:
        raise DotTimeoutError(seconds=timeout) from error
    if done.returncode != 0:
        raise DotSvgFailedError(stderr=done.stderr.strip())
    return done.stdout
