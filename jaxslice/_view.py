"""What every user-facing view of a `SliceProgram` offers, written once.

`js.Sliced` and the NNX slice module are different kinds of object (a plain class and
an `nnx.Module`), but both describe one slice: its `start` and `end`, how it was built,
its re-emitted program, which variables it shares with the rest of the model, and its
drawing. A view only says where its program is (`_slice_program`).
"""

from __future__ import annotations

from typing import Any

from ._trees import path_str


class DrawsInline:
    """Mixin for objects with ``to_dot(depth)``: notebooks show them as that drawing.

    A subclass says which `SliceProgram`'s model it draws in `_drawing_program` (None:
    every level is drawn, however many calls it has).
    """

    def _drawing_program(self) -> Any:
        return None

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None, **kwargs: Any
    ) -> dict[str, str]:
        """SVG of `to_dot` and the text repr; the text and a note when `dot` is missing."""
        from .render import drawing_bundle

        return drawing_bundle(self, self._drawing_program(), include, exclude)


class RunsProgram:
    """Mixin for objects that run one `SliceProgram` when called: slices and edited
    models. Passed back to jaxslice as a target, such an object is traced as it is
    called, and its program marks the calls it computes again (`Adapter.program_of`), so
    its boundaries are the model's calls in it (and an edit's new nodes)."""

    def _slice_program(self) -> Any:
        raise NotImplementedError


def program_of(obj: Any) -> Any:
    """The `SliceProgram` that `obj` runs where it is a `RunsProgram`, else None."""
    return obj._slice_program() if isinstance(obj, RunsProgram) else None


class ProgramView(RunsProgram, DrawsInline):
    """Mixin for objects that are views of one `SliceProgram`."""

    def _drawing_program(self) -> Any:
        return self._slice_program()

    @property
    def start(self) -> Any:
        """The `start` the slice was made with."""
        return self._slice_program().start

    @property
    def end(self) -> Any:
        """The `end` the slice was made with."""
        return self._slice_program().end

    @property
    def build_info(self) -> Any:
        """How the slice was built: a `js.BuildInfo`."""
        return self._slice_program().build_info

    @property
    def jaxpr(self) -> Any:
        """The re-emitted program (a closed jaxpr) for the shapes it was sliced with."""
        return self._slice_program().jaxpr

    @property
    def shared_variables(self) -> list[str]:
        """Paths of the variables the slice reads that the model also reads outside it
        (tied weights): the slice's gradients cover its own use only, and writing them
        back changes every use. (A slice whose trace stopped at its ends traces the rest
        of the model once to find out.)"""
        return [path_str(p) for p in self._slice_program().shared_paths()]

    def to_networkx(self, depth: int | None = None) -> Any:
        """The module-level DAG of the model, nodes marked ``in_slice`` (a networkx DiGraph).

        Args:
          depth: the deepest module path level shown; deeper calls fold into their parent.
        """
        from .render import slice_graph

        return slice_graph(self._slice_program(), depth, whole=False)

    def to_dot(self, depth: int | None = None, annotations: dict[str, Any] | None = None) -> str:
        """Graphviz DOT source of the model with this slice's region highlighted.

        Args:
          depth: the deepest module path level drawn (clusters collapse below it).
          annotations: ``{boundary name: value}`` drawn on the nodes (e.g. coverage).
        """
        from .render import to_dot

        return to_dot(self.to_networkx(depth), annotations=annotations)

    def render(
        self, path: Any, depth: int | None = None, annotations: dict[str, Any] | None = None
    ) -> str:
        """Renders `to_dot` to an SVG/PNG/PDF file with Graphviz's `dot` (by suffix)."""
        from .render import render_dot

        return render_dot(self.to_dot(depth, annotations), path)
