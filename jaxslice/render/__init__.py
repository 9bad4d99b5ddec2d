"""Views of a traced model: a module-level networkx DAG, Graphviz DOT rendering, and
inline drawings for notebooks."""

from ._dot import dot_svg as dot_svg
from ._dot import render_dot as render_dot
from ._dot import to_dot as to_dot
from ._inline import drawing_bundle as drawing_bundle
from ._modulegraph import module_graph as module_graph
from ._slices import slice_graph as slice_graph

__all__ = ["dot_svg", "drawing_bundle", "module_graph", "render_dot", "slice_graph", "to_dot"]
