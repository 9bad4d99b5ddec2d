"""Drawings shown inline in Jupyter: `to_dot` rendered to SVG in a MIME bundle.

IPython asks an object for ``_repr_mimebundle_(include, exclude)`` before any other
``_repr_*_`` method and shows the richest type the front end supports from the dict it
gets. A drawing's bundle is ``{"image/svg+xml": svg, "text/plain": repr}``.

Sharp edges: a repr that raises shows a traceback in the notebook, so nothing here
raises. Without Graphviz's `dot` (or when it fails or runs out of time) the bundle is
the text, plus a short HTML note that says why and how to install `dot`. Big models: the
drawing shows at most `MAX_CALLS` module calls, collapsing deeper levels into their
parent module (as ``to_dot(depth=...)`` does) until it fits, and `dot` gets `TIMEOUT_S`
seconds; ``render(path)`` draws any depth to a file.
"""

from __future__ import annotations

import html
from collections.abc import Container
from typing import Any

from ._dot import dot_svg
from ._slices import drawing_depth

SVG, HTML, TEXT = "image/svg+xml", "text/html", "text/plain"
MAX_CALLS = 100
TIMEOUT_S = 30.0

NOTE = '<p><b>No drawing</b>: {reason}</p>\n<pre style="white-space: pre-wrap">{text}</pre>'


def _wanted(mime: str, include: Container[str] | None, exclude: Container[str] | None) -> bool:
    """Whether the front end asked for `mime` (IPython treats empty filters as none)."""
    return (not include or mime in include) and not (exclude and mime in exclude)


def _text(obj: Any) -> str:
    try:
        return repr(obj)
    except Exception:
        return f"<{type(obj).__name__}>"


def _svg_or_note(drawing: Any, program: Any, text: str) -> dict[str, str]:
    """``{SVG: the drawing}``, or ``{HTML: why there is none}``."""
    try:
        depth = None if program is None else drawing_depth(program, MAX_CALLS)
        return {SVG: dot_svg(drawing.to_dot(depth), timeout=TIMEOUT_S)}
    except Exception as error:  # no `dot`, or it failed: say so instead of raising
        return {HTML: NOTE.format(reason=html.escape(str(error)), text=html.escape(text))}


def drawing_bundle(
    drawing: Any,
    program: Any = None,
    include: Container[str] | None = None,
    exclude: Container[str] | None = None,
) -> dict[str, str]:
    """The MIME bundle of an object with ``to_dot(depth)``, for ``_repr_mimebundle_``.

    Args:
      drawing: the object.
      program: the `SliceProgram` whose model it draws (for the depth that fits
        `MAX_CALLS`), or None to draw every level.
      include, exclude: the MIME types the front end wants and refuses (None: any).

    Returns:
      ``{"image/svg+xml": ..., "text/plain": ...}``; without a drawing, ``text/html``
      (a note on why, then the text) instead of the SVG. Never raises.
    """
    text = _text(drawing)
    bundle = {TEXT: text}
    if _wanted(SVG, include, exclude):
        bundle.update(_svg_or_note(drawing, program, text))
    return {mime: data for mime, data in bundle.items() if _wanted(mime, include, exclude)}
