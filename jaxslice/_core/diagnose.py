"""Why a slice cannot be made: the checks that turn analysis results into errors.

Each check reads the results of the pure analyses (`analysis.py`) for a planned slice
and raises a `SliceError` whose message names the boundaries involved and a fix. A fix
that suggests new starts is verified first: following it must give a working slice.
A suggested start is a `Selection` made from the graph's own calls (the model's inputs
as `ports.model_inputs`), planned as it is; its `spec` is what the message shows.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

import jax

from .._errors import (
    DuplicateStartKeywordError,
    EndNotConnectedError,
    MissingInputError,
    SameValueStartsError,
    UnusedStartError,
)
from .._trees import describe_aval
from . import analysis
from .graph import Call, Graph
from .markers import INPUT, OUTPUT
from .ports import Argument, arguments_of, flat_ports, model_inputs, port_value_tree
from .selection import Selection


def check_inputs(
    graph: Graph, arguments: Sequence[Argument], works: Callable[[list[Any]], bool]
) -> None:
    """Starts must be distinct values with distinct keyword names."""
    keywords = [a.keyword for a in arguments if a.keyword is not None]
    if len(keywords) != len(set(keywords)):
        raise DuplicateStartKeywordError(keywords=keywords)
    seen: dict[int, tuple[Argument, int]] = {}
    for arg in arguments:
        for leaf, vid in enumerate(arg.slot_ids):
            if vid is None:
                continue
            if vid in seen:
                raise _same_value(graph, arguments, seen[vid], (arg, leaf), vid, works)
            seen[vid] = (arg, leaf)


def _same_value(
    graph: Graph,
    arguments: Sequence[Argument],
    a: tuple[Argument, int],
    b: tuple[Argument, int],
    vid: int,
    works: Callable,
) -> SameValueStartsError:
    """The error for one value taken by two starts, with a fix that works where one is
    found: the port of the module that makes the value, or for a model input, the model's
    inputs taken once (None added to the starts, or a start that takes nothing but them
    left out)."""
    producer = landmarks(graph).get(vid)
    only_inputs, how = None, "producer"
    if producer is not None and producer[1] == OUTPUT:
        made = f"the output of {producer[0].qualname!r}"
        suggestion = [_as_start(*producer)]
    elif vid in graph.input_ids:
        made = "an input of the model"
        how, suggestion, only_inputs = _input_taken_twice(graph, arguments, a[0], b[0])
    else:
        made, suggestion = "computed in the model", None
    fix = suggestion if suggestion is not None and works(suggestion) else None
    return SameValueStartsError.of(
        first=_leaf_label(*a),
        second=_leaf_label(*b),
        aval=describe_aval(graph.avals[vid]),
        made=made,
        starts=_specs(fix) if fix is not None else None,
        how=how,
        only_inputs=only_inputs,
    )


def _input_taken_twice(
    graph: Graph, arguments: Sequence[Argument], a: Argument, b: Argument
) -> tuple[str, list[Selection], str | None]:
    """``(kind of fix, starts, the start that takes only model inputs)`` for a model input
    that arguments `a` and `b` both take: without None among the starts, None added (the
    model's inputs are then taken once); with it, the named start left out, which took
    nothing but the model's inputs (or None given once, where it was given twice)."""
    ports = list({arg.port.spec: arg.port for arg in arguments}.values())
    if all(p.spec is not None for p in ports):
        return "add_none", [*ports, model_inputs(graph)], None
    named = a.port.spec if a.port.spec is not None else b.port.spec
    if named is None:
        return "once", ports, None
    return "drop", [p for p in ports if p.spec != named], repr(named)


def _leaf_label(arg: Argument, leaf: int) -> str:
    many = sum(1 for i in arg.slot_ids if i is not None) > 1
    return f"{arg.describe()}" + (f" (leaf {leaf})" if many else "")


def check_connected(
    graph: Graph,
    arguments: Sequence[Argument],
    result: analysis.Cut,
    starts: tuple[Selection, ...],
    ends: Any,
    params: Container[int] = frozenset(),
) -> None:
    """Every end depends on a start, and every start is used by an end (`params`: values
    that are parameters, which no port takes or yields as an input)."""
    input_ids = {i for a in arguments for i in a.input_ids}
    for port in flat_ports(ends):
        ids = _value_ids(graph, port, params)
        if ids and not graph.cut(input_ids, ids).used_starts:
            raise _not_dependent(port, starts)
    _check_used(arguments, result, starts, ends)


def _value_ids(graph: Graph, port: Selection, params: Container[int]) -> list[int]:
    """The array values an end port yields."""
    if port.side == INPUT:
        return [i for a in arguments_of(graph, port, params) for i in a.input_ids]
    slots = jax.tree_util.tree_leaves(port_value_tree(graph, port))
    return [s.id for s in slots if s.id is not None]


def _check_used(
    arguments: Sequence[Argument], result: analysis.Cut, starts: tuple[Selection, ...], ends: Any
) -> None:
    """Every start feeds some end."""
    unused = [p for p in starts if not _start_ids(arguments, p) & result.used_starts]
    if unused:
        end_labels = ", ".join(p.label for p in flat_ports(ends))
        raise UnusedStartError(start=_start_label(unused[0]), ends=end_labels)


def _start_ids(arguments: Sequence[Argument], port: Selection) -> set[int]:
    return {i for a in arguments if a.port is port for i in a.input_ids}


def _start_label(port: Selection) -> str:
    """A start as the user wrote it: ``'block:input'``, or ``None (the model's inputs)``."""
    return f"None ({port.label})" if port.spec is None else port.label


def _not_dependent(port: Selection, starts: tuple[Selection, ...]) -> EndNotConnectedError:
    labels = ", ".join(map(_start_label, starts))
    before = port.spec is not None and port.call.stop <= min(p.call.start for p in starts)
    return EndNotConnectedError.of(port.label, labels, before)


def landmarks(graph: Graph) -> dict[int, tuple[Call, str]]:
    """For each value a boundary names, the port to suggest as a start for it.

    An output port names a value before an input port does, and among outputs the call
    that returns it first: a module that only passes on a value it received (a parent
    collecting its blocks' results into a tuple) runs after the value was made, so
    starting there would start too late.
    """
    found: dict[int, tuple[Call, str]] = {}
    calls = [c for c in graph.calls if c.loop is None]
    for call in sorted(calls, key=lambda c: (c.stop, c.out_seq)):
        for s in call.out_slots:
            if s.id is not None:
                found.setdefault(s.id, (call, OUTPUT))
    for call in calls:  # inputs only where no output names the value
        for s in call.in_slots:
            if s.id is not None:
                found.setdefault(s.id, (call, INPUT))
    return found


def raise_missing(
    graph: Graph,
    input_ids: Sequence[int],
    output_ids: Sequence[int],
    starts: tuple[Selection, ...] | None,
    ends: list[Selection],
    works: Callable[[list[Selection]], bool],
    params: Container[int] = frozenset(),
) -> None:
    """Raises `MissingInputError` naming the values to add to `start`.

    The fix it suggests (the current starts plus those values) is offered only if
    ``works(starts)`` says a slice from there can be made.
    """
    marks = landmarks(graph)
    found = graph.frontier(input_ids, output_ids, marks.__contains__)
    labels = _missing_labels(graph, found, marks)
    what = [_describe(label, avals) for label, (_, avals) in labels.items()]
    fixes = _fixes(graph, starts, [where for where, _ in labels.values()], marks, found, params)
    fix = next((c for c in fixes if works(c)), None)
    raise MissingInputError.of(
        start=_labels(starts) if starts else "the model's inputs",
        end=_labels(ends),
        values=what,
        starts=_specs(fix) if fix is not None else None,
        ends=_narrower_ends(graph, input_ids, output_ids, ends, marks),
    )


def _narrower_ends(
    graph: Graph,
    input_ids: Sequence[int],
    output_ids: Sequence[int],
    ends: list[Selection],
    marks: dict,
) -> list[str] | None:
    """For a slice to the model's whole output of which only some values need what is
    missing (an extra output, such as a cache of earlier layers' values): the boundaries
    whose outputs give the other values (``[]`` where none names them); else None."""
    if len(ends) != 1 or ends[0].spec is not None:
        return None
    ok = [v for v in output_ids if not graph.cut(input_ids, [v]).missing]
    if not ok or len(ok) == len(output_ids):
        return None
    named = [marks[v][0].qualname for v in ok if marks.get(v, (None, INPUT))[1] == OUTPUT]
    return list(dict.fromkeys(named))


def _labels(ports: Sequence[Selection]) -> str:
    return ", ".join(p.label for p in ports)


def _fixes(
    graph: Graph,
    starts: tuple[Selection, ...] | None,
    additions: list[Selection],
    marks: dict,
    found: list[int],
    params: Container[int],
) -> list[list[Selection]]:
    """Candidate starts: the current ones plus the missing values' ports, and the same
    without current starts whose inputs those ports already provide (a block's input that
    is part of the previous block's output)."""
    current = list(starts or ())
    kept = _not_provided(graph, current, _provided(found, marks), params)
    candidates = [current + additions, kept + additions]
    if current and _derived_only(graph, found):
        candidates.insert(0, [*current, model_inputs(graph)])
    return _unique(candidates)


def _provided(found: list[int], marks: dict) -> set[int]:
    """The values the ports of the missing values would give."""
    return {s.id for v in found if v in marks for s in _port_slots(*marks[v])}


def _not_provided(
    graph: Graph, ports: list[Selection], provided: set[int], params: Container[int]
) -> list[Selection]:
    return [p for p in ports if not _start_values(graph, p, params) <= provided]


def _specs(ports: list[Selection]) -> list[Any]:
    return [p.spec for p in ports]


def _unique(candidates: list[list[Selection]]) -> list[list[Selection]]:
    written = [_specs(c) for c in candidates]
    return [c for i, c in enumerate(candidates) if written[i] not in written[:i]]


def _derived_only(graph: Graph, found: list[int]) -> bool:
    """Whether the missing values are all the model's inputs or derived from them outside
    any module (positions, masks): the model's inputs as one more start then suffice."""
    return set(found) <= graph.derived_from_inputs() | set(graph.input_ids)


def _port_slots(call: Call, side: str) -> list[Any]:
    return call.out_slots if side == OUTPUT else call.in_slots


def _start_values(graph: Graph, port: Selection, params: Container[int]) -> set[int]:
    return {i for a in arguments_of(graph, port, params) for i in a.input_ids}


def _missing_labels(
    graph: Graph, found: list[int], marks: dict
) -> dict[str | None, tuple[Selection, list[Any]]]:
    """``{port label: (its start, shapes)}`` of the missing values (None: the model's own
    input)."""
    inputs = set(graph.input_ids)
    labels: dict[str | None, tuple[Selection, list[Any]]] = {}
    for v in found:
        if v in marks:
            call, side = marks[v]
            label = call.qualname if side == OUTPUT else f"{call.qualname}:input"
            labels.setdefault(label, (_as_start(call, side), []))[1].append(graph.avals[v])
        elif v in inputs:
            labels.setdefault(None, (model_inputs(graph), []))
    return labels


def _describe(label: str | None, avals: list[Any]) -> str:
    if label is None:
        return "the model's own input"
    name, port = (label[: -len(":input")], "input") if label.endswith(":input") else (label, "")
    shapes = ", ".join(describe_aval(a) for a in avals)
    return f"the {port or 'output'} of {name!r} ({shapes})"


def _as_start(call: Call, side: str) -> Selection:
    """The start at a call's side, written ``name:output`` or ``name:input``."""
    return Selection(f"{call.qualname}:{side}", call, side)
