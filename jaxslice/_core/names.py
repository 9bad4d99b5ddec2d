"""Resolving boundary names to calls and ports.

Grammar: ``path[.method][@k][:input|:output]``, where a module name holding one of
``\\ / @ : [`` has it escaped by a backslash (``a\\:input``). Names are exact strings, never prefixes
or patterns. A name called more than once needs ``@k`` (call order, from 0). Without a
port, a start means the module's input and an end means its output.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

from .._errors import (
    AmbiguousBoundaryError,
    BoundaryInLoopError,
    InvalidSpecError,
    UnknownBoundaryError,
)
from .graph import Call, Graph
from .markers import INPUT, OUTPUT

PORTS = (INPUT, OUTPUT)
LITERAL = (
    "{spec!r} could name a port or call of {base!r} or the module named {spec!r} itself. "
    "Write {literal!r} for that module (the name grammar's characters escaped with a "
    "backslash, as `js.boundaries` lists it), or add the call index for {base!r} "
    "(e.g. {indexed!r})."
)


_SPEC = re.compile(r"((?:\\.|[^\\@:])*)(?:@(\d+))?(?::(input|output))?")


def parse(spec: str) -> tuple[str, int | None, str | None]:
    r"""Splits ``name@k:port`` into its parts.

    A module whose own name holds ``@``, ``:``, ``/`` or ``[`` is written with those
    characters escaped by a backslash (as `js.boundaries` lists it).

    >>> parse("block1/conv@1:input")
    ('block1/conv', 1, 'input')
    >>> parse("head")
    ('head', None, None)
    >>> parse("a\\:input:output")
    ('a\\:input', None, 'output')
    """
    match = _SPEC.fullmatch(spec)
    if match is None:
        return spec, None, None
    base, index, port = match.groups()
    return base, int(index) if index is not None else None, port


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
        """The call a name refers to, and its port (`default_port` when none is given)."""
        if not isinstance(spec, str):
            raise InvalidSpecError(
                f"A boundary is named by a string such as 'block1/conv', got {spec!r} "
                f"({type(spec).__name__})."
            )
        base, index, port = parse(spec)
        self._check_literal(spec, base)
        call = self._pick(spec, base, index)
        if call.loop is not None:
            raise self._in_loop(spec, call)
        return call, port or default_port

    def _check_literal(self, spec: str, base: str) -> None:
        """A name that is also, written literally, a module's own name is ambiguous."""
        literal = spec.replace(":", "\\:").replace("@", "\\@")
        if (
            literal != spec
            and "\\" not in spec
            and literal in self.by_name
            and base in self.by_name
        ):
            indexed = base + "@0" + spec[len(base) :]
            raise AmbiguousBoundaryError(
                LITERAL.format(spec=spec, literal=literal, base=base, indexed=indexed)
            )

    def _pick(self, spec: str, base: str, index: int | None) -> Call:
        calls = self.by_name.get(base)
        if not calls:
            raise UnknownBoundaryError(
                UnknownBoundaryError.TEMPLATE.format(name=spec, hint=self._hint(base))
            )
        if index is None:
            return self._only_call(base, calls)
        if index >= len(calls):
            raise UnknownBoundaryError(
                f"{base!r} is called {len(calls)} time(s), so {spec!r} does not exist; "
                f"valid calls are {base}@0 to {base}@{len(calls) - 1}."
            )
        return calls[index]

    def _only_call(self, base: str, calls: list[Call]) -> Call:
        """The call a name without ``@k`` picks: it must be called once."""
        if len(calls) > 1:
            choices = ", ".join(repr(name) for name in self._calls_of(base))
            raise AmbiguousBoundaryError(
                AmbiguousBoundaryError.TEMPLATE.format(name=base, count=len(calls), choices=choices)
            )
        return calls[0]

    def _in_loop(self, spec: str, call: Call) -> BoundaryInLoopError:
        outer = [
            c.qualname
            for c in self.graph.calls
            if c.loop is None and c.start <= call.start < c.stop
        ]
        hint = f", such as {outer[-1]!r}" if outer else ""
        return BoundaryInLoopError(
            BoundaryInLoopError.TEMPLATE.format(name=spec, primitive=call.loop, outer=hint)
        )

    def _hint(self, base: str) -> str:
        names = self.all_names()
        close = difflib.get_close_matches(base, names, n=3, cutoff=0.5) or _same_leaf(base, names)
        shown = self._spelled_out(parse(c)[0] for c in close)
        return f" Did you mean {', '.join(repr(c) for c in shown)}?" if shown else ""

    def _spelled_out(self, bases: Iterable[str]) -> list[str]:
        """The names of every call of each of `bases` (once each), in order."""
        return [name for base in dict.fromkeys(bases) for name in self._calls_of(base)]

    def _calls_of(self, base: str) -> list[str]:
        """Every name that picks one call of `base` (just `base` when called once)."""
        calls = self.by_name.get(base, [])
        return [base] if len(calls) == 1 else [f"{base}@{c.index}" for c in calls]


def _same_leaf(base: str, names: list[str]) -> list[str]:
    """Up to three names whose last path component is `base`'s.

    Users often type a leaf name ("conv") for a nested path ("block1/conv").
    """
    leaf = base.rsplit("/", 1)[-1]
    return [n for n in names if n.rsplit("/", 1)[-1] == leaf][:3]
