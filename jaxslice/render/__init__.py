"""Views of a traced model: a module-level networkx DAG and Graphviz DOT rendering."""

from ._dot import render_dot as render_dot
from ._dot import to_dot as to_dot
from ._modulegraph import module_graph as module_graph
from ._slices import slice_graph as slice_graph

__all__ = ["module_graph", "render_dot", "slice_graph", "to_dot"]
