"""The boundary table: one `Boundary` row per module call of a traced model.

`describe` reads a traced model's graph: each call's array inputs and outputs (none for
calls inside loops, which cannot be sliced at) and the parameters it holds (by module
path for modules, by the parameter values its equations read otherwise).

Every table jaxslice shows (this one, coverage results, activation statistics) is a list
of rows of cells, header first, written once by its class (`PrintsAsTable`) and laid out
by one of two printers: `format_rows` (aligned text, for `print`) and `html_rows` (an
HTML ``<table>``, for notebooks). Both show the same cells.
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ._core.graph import Call, Graph
from ._core.markers import INPUT
from ._core.ports import arguments_of, array_ids, input_leaf_order
from ._core.selection import Selection
from ._trees import describe_aval, join_name


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One module call that a slice can start or end at.

    Attributes:
      name: the name to use in `start`/`end` (``path``, ``path.method``, ``path@k``).
      module_type: the module's class (or the marked function's name).
      call_index: which call of that module this is, from 0.
      num_calls: how many times the module is called.
      inputs: shapes and dtypes of the call's array arguments (parameters excluded):
        positional ones first, then keywords in the order the call passed them.
      outputs: shapes and dtypes of its output leaves.
      param_count: number of parameter values the module (with its submodules) holds.
      loop: the loop or conditional primitive the call is inside, or None.
      iterations: for a call inside scans, how many times it runs (the product of their
        lengths); its name has one ``[:]`` per scan, to be replaced by an iteration.
    """

    name: str
    module_type: str
    call_index: int
    num_calls: int
    inputs: tuple[jax.ShapeDtypeStruct, ...]
    outputs: tuple[jax.ShapeDtypeStruct, ...]
    param_count: int
    loop: str | None = None
    iterations: int | None = None


class PrintsAsTable:
    """Mixin for results that print as a table and show as one in notebooks.

    A subclass lists its rows of cells, header first, in `_table_rows`; `str` lays them
    out as text (`format_rows`) and Jupyter shows them as HTML (`html_rows`).
    """

    def _table_rows(self) -> list[Sequence[str]]:
        raise NotImplementedError

    def __str__(self) -> str:
        return format_rows(self._table_rows())

    def _repr_html_(self) -> str | None:
        # A notebook shows a traceback for a repr that raises; without HTML it prints text.
        try:
            return html_rows(self._table_rows())
        except Exception:
            return None


class BoundaryTable(PrintsAsTable, list):
    """A list of `Boundary` that prints as a table (and shows as one in notebooks)."""

    def _table_rows(self) -> list[Sequence[str]]:
        header = ("name", "type", "call", "inputs", "outputs", "params")
        return [header, *(_cells(b) for b in self)]

    def names(self) -> list[str]:
        return [b.name for b in self]


def format_rows(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as left-aligned columns, with a rule under the first (header) row.

    >>> print(format_rows([("a", "bb"), ("ccc", "d")]))
    a    bb
    ---  --
    ccc  d
    """
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    rule = ["-" * w for w in widths]
    return "\n".join(_aligned(row, widths) for row in [rows[0], rule, *rows[1:]])


def _aligned(row: Sequence[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()


# A number as the tables write them: ``1,234``, ``0.8333``, ``-1e-05``, ``inf``, ``nan``.
_NUMBER = re.compile(r"[-+]?(\d[\d,]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?%?|[-+]?(inf|nan)")
_BLANK = ("", "-")


def _is_numeric(column: Sequence[str]) -> bool:
    """Whether every cell of a column that is not blank is a number (and one is)."""
    filled = [c for c in column if c not in _BLANK]
    return bool(filled) and all(_NUMBER.fullmatch(c) for c in filled)


def _html_row(tag: str, row: Sequence[str], numeric: Sequence[bool]) -> str:
    # Explicit alignment both ways: notebook styles right-align every cell by default.
    aligns = ("right" if n else "left" for n in numeric)
    cells = (
        f'<{tag} style="text-align: {a}">{html.escape(c)}</{tag}>'
        for c, a in zip(row, aligns, strict=True)
    )
    return "<tr>" + "".join(cells) + "</tr>"


def html_rows(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as an HTML table: the first row is the header, numbers align right.

    Cells are escaped; a column is numeric when all its filled body cells are numbers.

    >>> print(html_rows([("name",), ("a<b",)]))
    <table>
    <thead><tr><th style="text-align: left">name</th></tr></thead>
    <tbody>
    <tr><td style="text-align: left">a&lt;b</td></tr>
    </tbody>
    </table>
    >>> "right" in html_rows([("n",), ("1,024",)])
    True
    """
    columns = list(zip(*rows[1:], strict=True)) or [()] * len(rows[0])
    numeric = [_is_numeric(column) for column in columns]
    body = [_html_row("td", row, numeric) for row in rows[1:]]
    head = f"<thead>{_html_row('th', rows[0], numeric)}</thead>"
    return "\n".join(["<table>", head, "<tbody>", *body, "</tbody>", "</table>"])


def _cells(b: Boundary) -> tuple[str, ...]:
    """One table row."""
    if b.iterations is not None:
        name = f"{b.name}  (x{b.iterations})"
    else:
        name = f"{b.name}  [in {b.loop}]" if b.loop else b.name
    counts = f"{b.call_index}/{b.num_calls}"
    return (name, b.module_type, counts, _fmt(b.inputs), _fmt(b.outputs), f"{b.param_count:,}")


def _fmt(avals: tuple[jax.ShapeDtypeStruct, ...]) -> str:
    if not avals:
        return "-"
    return ", ".join(describe_aval(a) for a in avals)


def _avals(graph: Graph, ids: list[int]) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(graph.avals[i].shape, graph.avals[i].dtype) for i in ids)


def describe(traced: Any) -> BoundaryTable:
    """The boundary table of a traced model: one row per call, in call order."""
    return BoundaryTable(_describe_call(traced, call) for call in traced.graph.calls)


def _describe_call(traced: Any, call: Call) -> Boundary:
    inputs, outputs = _port_avals(traced.graph, call)
    if call.is_module:
        params = traced.param_counts.get(join_name(call.path), 0)
    else:
        params = _span_params(traced, call)
    return Boundary(
        name=call.qualname,
        module_type=call.module_type,
        call_index=call.index,
        num_calls=call.count,
        inputs=inputs,
        outputs=outputs,
        param_count=params,
        loop=call.loop.primitive if call.loop is not None else None,
        iterations=_iterations(call),
    )


def _iterations(call: Call) -> int | None:
    """How many times a call inside scans runs; None outside them (or in other loops)."""
    if call.loop is None or call.template is None:
        return None
    lengths = [site.length for site in call.loop.chain()]
    if any(n is None for n in lengths):
        return None
    total = 1
    for n in lengths:
        total *= n
    return total


def _port_avals(graph: Graph, call: Call) -> tuple[tuple[jax.ShapeDtypeStruct, ...], ...]:
    """The avals of a call's array inputs and outputs (for a call inside a loop, of one
    iteration; its input's parameters are not told apart from its other arguments)."""
    if call.loop is not None:
        ins, outs = call.loop_avals
        return _ordered_avals(ins, input_leaf_order(call)), _ordered_avals(outs, sorted(outs))
    arguments = arguments_of(graph, Selection(call.name, call, INPUT))
    in_ids = [i for a in arguments for i in a.input_ids]
    return _avals(graph, in_ids), _avals(graph, array_ids(call.out_slots))


def _ordered_avals(avals: dict[int, Any], order: list[int]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The avals of the leaves in `avals` (``{leaf: aval}``), in the order of `order`."""
    return tuple(jax.ShapeDtypeStruct(avals[k].shape, avals[k].dtype) for k in order if k in avals)


def _is_parameter(path: tuple[Any, ...], linen_style: bool) -> bool:
    if not linen_style:
        return True
    first = path[0] if path else None
    return getattr(first, "key", first) == "params"


def _span_params(traced: Any, call: Call) -> int:
    """How many parameter values the equations of a call's span read."""
    graph = traced.graph
    params = _parameter_ids(graph, traced.split.variables)
    used = {v for e in graph.eqns[call.start : call.stop] for v in e.ins if v in params}
    return sum(int(getattr(graph.avals[v], "size", 0)) for v in used)


def _parameter_ids(graph: Graph, variables: Any) -> set[int]:
    """The variables that are parameters: all of them, or with linen-style variables only
    those of the ``"params"`` collection."""
    linen_style = isinstance(variables, Mapping) and "params" in variables
    paths = zip(graph.variable_ids, graph.variable_paths, strict=True)
    return {v for v, path in paths if _is_parameter(path, linen_style)}
