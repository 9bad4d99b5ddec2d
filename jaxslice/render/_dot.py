"""Graphviz DOT source for a module graph, and rendering it with the `dot` program."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any

import networkx as nx

from .._errors import DotFailedError, DotNotFoundError, DotSvgFailedError, DotTimeoutError
from ._modulegraph import INPUTS, OUTPUT

_IN, _OUT = "#dbe9ff", "#f2f2f2"


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


class _Clusters:
    """Writes the nodes of a module graph nested in one cluster per container."""

    def __init__(self, dag: nx.DiGraph, annotations: dict[str, Any]) -> None:
        self.dag = dag
        self.annotations = annotations
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

    def _notes(self, name: str) -> list[str]:
        """The annotation of `name`, formatted, as a list of zero or one items."""
        return [_fmt(self.annotations[name])] if name in self.annotations else []

    def _cluster(self, name: str, indent: str) -> list[str]:
        attrs = self.containers[name]
        label = " ".join([f"{name} ({attrs['module_type']})", *self._notes(name)])
        style = "rounded" if _in_slice(attrs) else "rounded,dashed"
        return [
            f"{indent}subgraph {_q('cluster_' + name)} {{",
            f"{indent}  label={_q(label)}; style={_q(style)}; fontname=Helvetica; fontsize=10;",
            *self.lines(name, indent + "  "),
            f"{indent}}}",
        ]

    def _node(self, name: str, indent: str) -> str:
        if name in (INPUTS, OUTPUT):
            return f"{indent}{_q(name)} [shape=oval, fillcolor=white];"
        attrs = self.dag.nodes[name]
        label = _label(name, _type_line(attrs), *self._notes(name))
        color, font = (_IN, "black") if _in_slice(attrs) else (_OUT, "gray40")
        return f'{indent}{_q(name)} [label={label}, fillcolor="{color}", fontcolor={font}];'


def to_dot(
    dag: nx.DiGraph, *, annotations: dict[str, Any] | None = None, title: str = "jaxslice"
) -> str:
    r"""DOT source: a cluster per containing module, a box per module call, shape-labelled edges.

    Nodes of the slice region are filled blue, the rest grey.

    Args:
      dag: a module graph, as `module_graph` builds it.
      annotations: an extra line (e.g. a coverage figure) for the named nodes or clusters.
      title: the name of the DOT graph.

    Returns:
      The DOT source, ending in a newline.

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
    lines = _header(title) + _Clusters(dag, annotations or {}).lines()
    lines += [_edge_line(dag, a, b, attrs) for a, b, attrs in dag.edges(data=True)]
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
