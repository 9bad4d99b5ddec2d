"""Graphviz DOT source for a module graph, and rendering it with the `dot` program."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any

import networkx as nx

from .._errors import SliceError
from ._modulegraph import INPUTS, OUTPUT

NO_DOT = (
    "Rendering needs Graphviz's `dot` program, which was not found on PATH. Install it with "
    "`apt-get install graphviz` (Debian/Ubuntu), `brew install graphviz` (macOS) or "
    "`conda install graphviz`. `to_dot()` gives the DOT source without it."
)

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


def to_dot(
    dag: nx.DiGraph, *, annotations: dict[str, Any] | None = None, title: str = "jaxslice"
) -> str:
    """DOT source: a cluster per containing module, a box per module call, shape-labelled edges.

    Nodes of the slice region are filled blue, the rest grey; `annotations` adds a line
    (e.g. a coverage figure) to the named nodes or clusters.
    """
    annotations = annotations or {}
    containers: dict[str, dict[str, Any]] = dag.graph.get("containers", {})
    children: dict[str | None, list[tuple[str, bool]]] = {}
    for name, attrs in dag.nodes(data=True):
        children.setdefault(attrs.get("parent"), []).append((name, False))
    for name, attrs in containers.items():
        children.setdefault(attrs.get("parent"), []).append((name, True))

    lines = [
        f"digraph {_q(title)} {{",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8];',
    ]

    def node_line(name: str, attrs: dict[str, Any], indent: str) -> str:
        if name in (INPUTS, OUTPUT):
            return f"{indent}{_q(name)} [shape=oval, fillcolor=white];"
        lines = [
            name,
            attrs["module_type"]
            + (f" ({attrs['params']:,} params)" if attrs.get("params") else ""),
        ]
        if name in annotations:
            lines.append(_fmt(annotations[name]))
        color = _IN if attrs.get("in_slice", True) else _OUT
        font = "black" if attrs.get("in_slice", True) else "gray40"
        return (
            f'{indent}{_q(name)} [label={_label(*lines)}, fillcolor="{color}", fontcolor={font}];'
        )

    def emit(parent: str | None, indent: str) -> None:
        for name, is_container in children.get(parent, []):
            if is_container:
                attrs = containers[name]
                label = f"{name} ({attrs['module_type']})"
                if name in annotations:
                    label += f" {_fmt(annotations[name])}"
                style = "rounded" if attrs.get("in_slice", True) else "rounded,dashed"
                lines.append(f"{indent}subgraph {_q('cluster_' + name)} {{")
                lines.append(
                    f"{indent}  label={_q(label)}; style={_q(style)}; fontname=Helvetica; fontsize=10;"
                )
                emit(name, indent + "  ")
                lines.append(f"{indent}}}")
            else:
                lines.append(node_line(name, dag.nodes[name], indent))

    emit(None, "  ")
    for a, b, attrs in dag.edges(data=True):
        inside = dag.nodes[a].get("in_slice", True) and dag.nodes[b].get("in_slice", True)
        style = "" if inside else ", color=gray60, fontcolor=gray50"
        lines.append(
            f"  {_q(a)} -> {_q(b)} [label={_q(', '.join(attrs.get('shapes', [])))}{style}];"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_dot(source: str, path: str | os.PathLike[str], *, format: str | None = None) -> str:
    """Writes `source` rendered by `dot` to `path` (format from the suffix: svg, png, pdf)."""
    exe = shutil.which("dot")
    if exe is None:
        raise SliceError(NO_DOT)
    path = os.fspath(path)
    fmt = format or (os.path.splitext(path)[1].lstrip(".") or "svg")
    with tempfile.NamedTemporaryFile("w", suffix=".dot", delete=False) as f:
        f.write(source)
        src = f.name
    try:
        done = subprocess.run([exe, f"-T{fmt}", src, "-o", path], capture_output=True, text=True)
    finally:
        os.unlink(src)
    if done.returncode != 0:
        raise SliceError(f"`dot` failed to render {path!r}: {done.stderr.strip()}")
    return path
