"""Resolving boundary names to calls and ports.

Grammar: ``path[.method][@k][:input|:output]``. Names are exact strings, never prefixes
or patterns. A name called more than once needs ``@k`` (call order, from 0). Without a
port, a start means the module's input and an end means its output.
"""

from __future__ import annotations

import difflib
from typing import Any

from ._errors import (
    AmbiguousBoundaryError,
    BoundaryInLoopError,
    InvalidSpecError,
    UnknownBoundaryError,
)
from ._graph import Call, Graph
from ._markers import INPUT, OUTPUT

PORTS = (INPUT, OUTPUT)


def parse(spec: str) -> tuple[str, int | None, str | None]:
    """Splits ``name@k:port`` into its parts.

    >>> parse("block1/conv@1:input")
    ('block1/conv', 1, 'input')
    >>> parse("head")
    ('head', None, None)
    """
    port = None
    base = spec
    head, sep, tail = spec.rpartition(":")
    if sep and tail in PORTS:
        base, port = head, tail
    index = None
    head, sep, tail = base.rpartition("@")
    if sep and tail.isdigit():
        base, index = head, int(tail)
    return base, index, port


class Resolver:
    """Looks names up in one graph."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.by_name: dict[str, list[Call]] = {}
        for call in graph.calls:
            self.by_name.setdefault(call.name, []).append(call)

    def all_names(self) -> list[str]:
        names = []
        for name, calls in self.by_name.items():
            names.append(name)
            if len(calls) > 1:
                names += [f"{name}@{c.index}" for c in calls]
        return names

    def resolve(self, spec: Any, default_port: str) -> tuple[Call, str]:
        if not isinstance(spec, str):
            raise InvalidSpecError(
                f"A boundary is named by a string such as 'block1/conv', got {spec!r} "
                f"({type(spec).__name__})."
            )
        base, index, port = parse(spec)
        calls = self.by_name.get(base)
        if not calls:
            raise UnknownBoundaryError(
                UnknownBoundaryError.TEMPLATE.format(name=spec, hint=self._hint(base))
            )
        if index is None:
            if len(calls) > 1:
                choices = ", ".join(repr(f"{base}@{c.index}") for c in calls)
                raise AmbiguousBoundaryError(
                    AmbiguousBoundaryError.TEMPLATE.format(
                        name=base, count=len(calls), choices=choices
                    )
                )
            call = calls[0]
        else:
            if index >= len(calls):
                raise UnknownBoundaryError(
                    f"{base!r} is called {len(calls)} time(s), so {spec!r} does not exist; "
                    f"valid calls are {base}@0 to {base}@{len(calls) - 1}."
                )
            call = calls[index]
        if call.loop is not None:
            outer = [
                c.qualname
                for c in self.graph.calls
                if c.loop is None and c.start <= call.start < c.stop
            ]
            hint = f", such as {outer[-1]!r}" if outer else ""
            raise BoundaryInLoopError(
                BoundaryInLoopError.TEMPLATE.format(name=spec, primitive=call.loop, outer=hint)
            )
        return call, port or default_port

    def _hint(self, base: str) -> str:
        names = self.all_names()
        close = difflib.get_close_matches(base, names, n=3, cutoff=0.5)
        if not close:
            # Users often type a leaf name ("conv") for a nested path ("block1/conv").
            close = [n for n in names if n.rsplit("/", 1)[-1] == base.rsplit("/", 1)[-1]][:3]
        bases = []
        for c in close:
            base = parse(c)[0]
            if base not in bases:
                bases.append(base)
        shown = []
        for base in bases:
            calls = self.by_name.get(base, [])
            shown += [base] if len(calls) == 1 else [f"{base}@{c.index}" for c in calls]
        return f" Did you mean {', '.join(repr(c) for c in shown)}?" if shown else ""
