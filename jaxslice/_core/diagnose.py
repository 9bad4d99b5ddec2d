"""Why a slice cannot be made: the checks that turn analysis results into errors.

Each check reads the results of the pure analyses (`analysis.py`) for a planned slice
and raises a `SliceError` whose message names the boundaries involved and a fix. A fix
that suggests new starts is verified first: following it must give a working slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._errors import DisconnectedError, InvalidSpecError, MissingInputError
from .._trees import describe_aval
from . import analysis
from .graph import Call, Graph
from .markers import INPUT, OUTPUT
from .ports import Argument, Port, flat_ports, port_value_tree


def check_inputs(arguments: Sequence[Argument]) -> None:
    """Starts must be distinct values with distinct keyword names."""
    keywords = [a.keyword for a in arguments if a.keyword is not None]
    if len(keywords) != len(set(keywords)):
        raise InvalidSpecError(
            f"Two start boundaries take a keyword argument of the same name ({keywords}); "
            "name one of them by its `:output` port instead."
        )
    first: dict[int, Argument] = {}
    for arg in arguments:
        for vid in arg.input_ids:
            other = first.setdefault(vid, arg)
            if other is not arg or arg.input_ids.count(vid) > 1:
                raise InvalidSpecError(_same_value_message(other, arg))


SAME_VALUE = (
    "{where} the same value in the traced model, so a slice cannot take them as separate "
    "inputs (one would be silently ignored). Start at one of them, or at the module that "
    "produces that value (its ':output')."
)
RECEIVES_TWICE = (
    "{label} receives the same value twice: its argument {a} and its argument {b} hold one "
    "array of the traced model (for example `block(x, act)` where `act` holds `x`), so a "
    "slice cannot take them as separate inputs. Start at the module that produces that "
    "value instead ('{producer}:output'), or at an earlier boundary."
)


def _same_value_message(a: Argument, b: Argument) -> str:
    if a is not b:
        return SAME_VALUE.format(where=f"{a.port.label} and {b.port.label} are")
    return SAME_VALUE.format(where=f"{a.port.label} receives it twice and is")


def check_connected(
    graph: Graph,
    arguments: Sequence[Argument],
    result: analysis.Cut,
    starts: tuple[Port, ...],
    ends: Any,
) -> None:
    """Every end depends on a start, and every start is used by an end."""
    input_ids = {i for a in arguments for i in a.input_ids}
    for port in flat_ports(ends):
        ids = [s.id for s in jax.tree_util.tree_leaves(port_value_tree(graph, port))]
        ids = [i for i in ids if i is not None]
        if ids and not graph.cut(input_ids, ids).used_starts:
            what = _not_dependent(port, starts)
            raise DisconnectedError(DisconnectedError.TEMPLATE.format(what=what))
    unused = [p for p in starts if not _start_ids(arguments, p) & result.used_starts]
    if unused:
        end_labels = ", ".join(p.label for p in flat_ports(ends))
        what = f"The start {unused[0].label} is not used by {end_labels}; remove it from `start`."
        raise DisconnectedError(DisconnectedError.TEMPLATE.format(what=what))


def _start_ids(arguments: Sequence[Argument], port: Port) -> set[int]:
    return {i for a in arguments if a.port is port for i in a.input_ids}


def _not_dependent(port: Port, starts: tuple[Port, ...]) -> str:
    labels = ", ".join(p.label for p in starts)
    order = ""
    if port.spec is not None and port.call.stop <= min(p.call.start for p in starts):
        order = f" ({port.label} runs before the start.)"
    return f"{port.label} does not depend on the start {labels}.{order}"


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
    starts: tuple[Port, ...] | None,
    ends: list[Port],
    works: Callable[[list[Any]], bool],
) -> None:
    """Raises `MissingInputError` naming the values to add to `start`.

    The fix it suggests (the current starts plus those values) is offered only if
    ``works(starts)`` says a slice from there can be made.
    """
    marks = landmarks(graph)
    labels = _missing_labels(
        graph, graph.frontier(input_ids, output_ids, marks.__contains__), marks
    )
    what = [_describe(label, avals) for label, avals in labels.items()]
    fix = ([p.spec for p in starts] if starts else []) + [_as_start(label) for label in labels]
    fix_text = MissingInputError.FIX.format(starts=fix) if works(fix) else MissingInputError.NO_FIX
    raise MissingInputError(
        MissingInputError.TEMPLATE.format(
            start=", ".join(p.label for p in starts) if starts else "the model's inputs",
            end=", ".join(p.label for p in ends),
            what=" and ".join(what) or "a value computed before the start",
            fix=fix_text,
        )
    )


def _missing_labels(graph: Graph, found: list[int], marks: dict) -> dict[str | None, list[Any]]:
    """``{port label: shapes}`` of the missing values (None: the model's own input)."""
    model_inputs = set(graph.input_ids)
    labels: dict[str | None, list[Any]] = {}
    for v in found:
        if v in marks:
            call, side = marks[v]
            label = call.qualname if side == OUTPUT else f"{call.qualname}:input"
            labels.setdefault(label, []).append(graph.avals[v])
        elif v in model_inputs:
            labels.setdefault(None, [])
    return labels


def _describe(label: str | None, avals: list[Any]) -> str:
    if label is None:
        return "the model's own input"
    name, _, port = label.partition(":")
    shapes = ", ".join(describe_aval(a) for a in avals)
    return f"the {port or 'output'} of {name!r} ({shapes})"


def _as_start(label: str | None) -> str | None:
    if label is None or label.endswith(":input"):
        return label
    return f"{label}:output"
