"""Selections: the one answer to "where in the model", resolved once per traced graph.

A user names a place in a model with a string: a slice's `start` and `end`, an edit's
`at`, the names given to `js.intermediates`, observers and coverage trackers. The string
is parsed once (`Name`, the grammar of `names.py`) and resolved against a traced graph by
that graph's one `Resolver` (`resolver_of`) into a `Selection`: a frozen record of

* a call: the graph's `Call` (compared by identity: two records of one call are equal);
* a side: ``"input"`` or ``"output"``;
* a loop path: per loop around the call (outermost first), the iteration it picks or
  ``":"`` for every iteration;

and, for messages only, the name as the user wrote it. Everything after the parse takes
these records: the trace's stop rule reads the parsed names (there is no graph yet), the
loop expander writes out the iterations the records pick, planning takes the records of
the starts and ends, the editor keeps one per edit, and the evaluator shows each boundary
event as one (`BoundaryEvent.where`), so an edit fires because its record *is* the
event's record. `Selection.name` is the one place a call's per-iteration name is
formatted (``layers[3]/mlp``, ``layers[:]/mlp@1``).

Sharp edge: the records of one graph are not those of another (a new input shape traces
the model again); `Resolver.same` finds a record's call in another graph of the model.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Sequence
from typing import Any

from .._errors import (
    AmbiguousBoundaryError,
    BoundaryInLoopError,
    BoundaryNameTypeError,
    CallIndexError,
    CallIndexPerIterationError,
    IterationIndexError,
    IterationSlotsError,
    LiteralNameError,
    MixedLoopNamesError,
    ScopeInScanError,
    SliceError,
    StackedStartError,
    UnknownBoundaryError,
    UnreachableIterationError,
    WhileIterationError,
)
from .graph import Call, Graph
from .markers import INPUT, OUTPUT
from .names import (
    STACKED,
    fill,
    lifted_template,
    parse,
    shown,
    slot_depths,
    split_indices,
    unslotted,
)


@dataclasses.dataclass(frozen=True)
class Name:
    """A user's boundary name, parsed once (``path@k:port``, iteration slots apart).

    >>> n = Name.of("layers[2]/attn@1:input")
    >>> n.base, n.index, n.port, n.parts, n.given
    ('layers[2]/attn', 1, 'input', ('layers', '/attn'), ('2',))
    """

    spec: str  # as written
    base: str  # without ``@k`` and the port
    index: int | None
    port: str | None
    parts: tuple[str, ...]  # the text around the iteration slots
    given: tuple[str, ...]  # what each iteration slot holds (none outside loops)

    @classmethod
    def of(cls, spec: str) -> Name:
        base, index, port = parse(spec)
        parts, given = split_indices(base)
        return cls(spec, base, index, port, parts, given)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Where in a model: a call of one graph, a side, and the iterations of its loops.

    Two records are equal when they pick the same call (by identity), side, iterations
    and node; `spec` (the name as the user wrote it, None for the model's own inputs or
    output) is kept for messages only.
    """

    spec: Any = dataclasses.field(compare=False)
    call: Call | None  # None for a node an edit inserted (`node`)
    side: str
    # Per loop around the call, outermost first: an iteration, or ``":"`` for every one.
    path: tuple[int | str, ...] = ()
    # The loop around `call` as a whole (a lifted module inside another scan's body,
    # ``outer[2]/inner``): `path` then has no slot for that loop.
    whole: bool = False
    node: str | None = None  # the name of an inserted node (the edited model's)

    @property
    def name(self) -> str:
        """The call's name with these iterations (``layers[3]/mlp``), as listed."""
        if self.node is not None:
            return self.node
        call = self.call
        if not self.path or call.template is None:
            return call.qualname
        name = fill(call.template, self.path)
        return name if call.count == 1 else f"{name}@{call.index}"

    @property
    def end_name(self) -> str:
        """`name`, with ``:input`` for a call's input side (``layers[3]/mlp:input``; an
        end is a call's output unless it says otherwise): a name that selects this record
        again as an end."""
        return self.name if self.side == OUTPUT else f"{self.name}:{self.side}"

    @property
    def label(self) -> str:
        """How messages name it (``'block:output'``)."""
        if self.spec is None:
            return "the model's inputs" if self.side == INPUT else "the model's output"
        return repr(f"{self.call.qualname}:{self.side}")

    @property
    def sites(self) -> list[Any]:
        """The loops whose iterations `path` picks, outermost first."""
        chain = self.call.loop.chain() if self.call.loop is not None else []
        return chain[:-1] if self.whole else chain

    @property
    def key(self) -> tuple[int, tuple[int | str, ...]]:
        """How the iteration's call is known in a graph with it written out
        (`CallRecord.key`)."""
        return (id(self.call.record), self.path)

    def every(self) -> Selection:
        """The record of every iteration (``[:]`` in each loop): how a loop body that
        runs once for all iterations meets this one (`BoundaryEvent.where`)."""
        return dataclasses.replace(self, path=tuple(STACKED for _ in self.path))

    @property
    def depths(self) -> tuple[int, ...]:
        """The loops with counted iterations (scans) it names every iteration of (their
        depths): an inserted node's variables and call-time inputs have a row per
        iteration of each; the iterations of a `while` share them."""
        sites = self.sites
        return tuple(d for d, k in enumerate(self.path) if k == STACKED and sites[d].length)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Their lengths."""
        sites = self.sites
        return tuple(sites[d].length for d in self.depths)

    @property
    def when(self) -> tuple[tuple[int, int], ...]:
        """``(depth, k)`` for each loop it names one iteration k of."""
        return tuple((d, k) for d, k in enumerate(self.path) if k != STACKED)


def resolver_of(graph: Graph) -> Resolver:
    """The graph's one resolver (made once, kept on the graph)."""
    return graph.memo("resolver", lambda: Resolver(graph))


class Resolver:
    """Resolves parsed names (`Name`) against one graph into `Selection`s."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.by_name: dict[str, list[Call]] = {}
        self.by_parts: dict[tuple[str, ...], list[Call]] = {}
        self.by_whole: dict[tuple[str, ...], list[Call]] = {}  # see `lifted_template`
        self.own = {id(call) for call in graph.calls}
        # The iterations written out in this graph (`loops.expand`), by `Selection.key`.
        self.by_key = {call.record.key: call for call in graph.calls if _written_out(call)}
        for call in graph.calls:
            self.by_name.setdefault(call.name, []).append(call)
            if call.template is not None:
                parts = _template_parts(call.template)
                self.by_parts.setdefault(parts, []).append(call)
                whole = lifted_template(call)
                if whole is not None:
                    self.by_whole.setdefault(_template_parts(whole), []).append(call)

    def all_names(self) -> list[str]:
        names = []
        for name, calls in self.by_name.items():
            names.append(name)
            if len(calls) > 1:
                names += [f"{name}@{c.index}" for c in calls]
        return names

    def select(self, name: Any, default_side: str, uncounted: bool = False) -> Selection:
        """The record a name picks (the side is `default_side` unless it names one). With
        `uncounted`, every iteration (``[:]``) of a loop without counted iterations (a
        `while`) is a name too: edits and hooks, which run the loop as a loop, take it.
        A record resolved before (a `Selection`) is taken as it is (`adopt`)."""
        if isinstance(name, Selection):
            return self.adopt(name)
        if not isinstance(name, Name):
            raise BoundaryNameTypeError(spec=name, kind=type(name).__name__)
        alias = self.graph.aliases.get((name.base, name.index))
        if alias is not None:  # an iteration written out in this graph
            return Selection(name.spec, alias, name.port or default_side)
        if name.given:
            found = self.in_loops(name, default_side, uncounted)
            if found is not None:
                return found
        return Selection(name.spec, self.call_of(name), name.port or default_side)

    def adopt(self, where: Selection) -> Selection:
        """A record resolved before, as this graph's: one of this graph's is kept; one of
        the graph whose loops this one writes out is the iteration's call here (found by
        `Selection.key`); one of another trace of the model is found by `same`."""
        if where.call is None or id(where.call) in self.own:
            return where
        written = self.by_key.get(where.key) if where.path else None
        if written is not None:
            return Selection(where.spec, written, where.side)
        return self.same(where)

    def call_of(self, name: Name) -> Call:
        """The call of a name as the graph lists it (outside loops)."""
        spec, base = name.spec, name.base
        if name.given and base not in self.by_name:
            self.in_loops(name, OUTPUT)  # a clear error if the name is wrong
            raise UnreachableIterationError(spec=spec)
        looped = self._in_loop_body(base)
        if base not in self.by_name and looped is not None and not _counted(looped):
            raise self._in_loop(spec, looped)  # a call in a `while` body, named bare
        self._check_literal(spec, base)
        call = self._pick(spec, base, name.index)
        if call.loop is not None:
            raise self._in_loop(spec, call)
        return call

    def in_loops(self, name: Any, default_side: str, uncounted: bool = False) -> Selection | None:
        """The iteration(s) a name with iteration slots (or a record resolved before
        that picks iterations) picks; None for other names (`uncounted` as for
        `select`)."""
        if isinstance(name, Selection):
            return self.adopt(name) if name.path else None
        if not isinstance(name, Name) or not name.given:
            return None
        spec, parts = name.spec, name.parts
        calls = self.by_parts.get(parts)
        whole = not calls and parts in self.by_whole
        calls = self.by_whole[parts] if whole else calls
        if not calls:
            raise UnknownBoundaryError(name=spec, hint=self._hint(name.base))
        call = self._pick_among(spec, calls, name.index)
        path = self._iterations(spec, call, name.given, whole, uncounted)
        side = name.port or default_side
        if STACKED in path and side == INPUT and default_side == INPUT:
            example = spec.replace("[:]", "[0]")
            raise StackedStartError(spec=spec, example=example)
        return Selection(spec, call, side, path, whole)

    def same(self, where: Selection) -> Selection:
        """The record of the same call, side and iterations in this graph (of the same
        model, traced again): the call listed under the same name and call index."""
        if where.call is None:
            return where
        calls = self.by_name.get(where.call.name, ())
        if where.call.index >= len(calls):
            raise UnknownBoundaryError(name=where.name, hint=self._hint(where.call.name))
        return dataclasses.replace(where, call=calls[where.call.index])

    def _pick_among(self, spec: str, calls: list[Call], index: int | None) -> Call:
        if index is None:
            return self._only_call(calls[0].name, calls)
        if index >= len(calls):
            raise CallIndexPerIterationError(
                name=calls[0].name, count=len(calls), spec=spec, last=len(calls) - 1
            )
        return calls[index]

    def _iterations(
        self,
        spec: str,
        call: Call,
        given: tuple[str, ...],
        whole: bool = False,
        uncounted: bool = False,
    ) -> tuple[Any, ...]:
        """The iteration picked in each enclosing scan, outermost first (all but the
        innermost for a loop as a whole)."""
        template = (lifted_template(call) if whole else call.template) or ""
        depths = slot_depths(template)
        sites = call.loop.chain() if call.loop is not None else []
        sites = sites[:-1] if whole else sites
        if len(given) != len(depths):
            raise IterationSlotsError(
                spec=spec, given=len(given), name=call.name, count=len(depths)
            )
        if any(site.rule is None for site in sites):  # a conditional's branch
            raise self._in_loop(spec, call)
        path: list[Any] = [None] * len(depths)
        for text, depth in zip(given, depths, strict=True):
            if sites[depth].length is None and not (uncounted and text == STACKED):
                raise self._in_loop(spec, call)  # no iteration of a `while` has a name
            path[depth] = _iteration(spec, text, sites[depth])
        return tuple(path)

    def check_wholes(self, names: Iterable[Any], looped: Sequence[Selection]) -> None:
        """A lifted module as a whole cannot be named with one of its own iterations (the
        loop is written out in pieces, so it is no longer one call)."""
        split = {id(where.call.loop.chain()[0].eqn): where for where in looped}
        for name in names:
            whole = self._whole_call(name)
            loop = self._lifted_loop(whole) if whole is not None else None
            where = split.get(id(loop.eqn)) if loop is not None else None
            if where is not None:
                first, last = f"{whole.name}[0]:input", f"{whole.name}[-1]:output"
                raise MixedLoopNamesError(whole=name.spec, one=where.spec, first=first, last=last)

    def _whole_call(self, name: Any) -> Call | None:
        """The call a name (or a record) outside loops picks, or None."""
        if isinstance(name, Selection):
            return self.adopt(name).call
        if not isinstance(name, Name):
            return None
        try:
            return self.call_of(name)
        except SliceError:  # not a name of a call (wrong: reported when planning)
            return None

    def _lifted_loop(self, whole: Call) -> Any:
        """The loop a call of a lifted module as a whole stands for, or None."""
        if whole.loop is not None or whole.record is None:
            return None
        body = next((c for c in self.graph.calls if c.record is whole.record and c.loop), None)
        return body.loop.chain()[0] if body is not None else None

    def _check_literal(self, spec: str, base: str) -> None:
        """A name that is also, written literally, a module's own name is ambiguous,
        unless the table lists it as a call's name (``b@1``, the second call of a module
        ``b``), where the module itself is listed escaped (``b\\@1``)."""
        literal = spec.replace(":", "\\:").replace("@", "\\@")
        listed = any(c.qualname == spec for c in self.by_name.get(base, ()))
        if (
            not listed
            and literal != spec
            and "\\" not in spec
            and literal in self.by_name
            and base in self.by_name
        ):
            indexed = base + "@0" + spec[len(base) :]
            raise LiteralNameError(spec=spec, literal=literal, base=base, indexed=indexed)

    def _pick(self, spec: str, base: str, index: int | None) -> Call:
        calls = self.by_name.get(base)
        if not calls:
            raise UnknownBoundaryError(name=spec, hint=self._hint(base))
        if index is None:
            return self._only_call(base, calls)
        if index >= len(calls):
            raise CallIndexError(name=base, count=len(calls), spec=spec, last=len(calls) - 1)
        return calls[index]

    def _only_call(self, base: str, calls: list[Call]) -> Call:
        """The call a name without ``@k`` picks: it must be called once."""
        if len(calls) > 1:
            choices = ", ".join(repr(name) for name in self._calls_of(base))
            raise AmbiguousBoundaryError(name=base, count=len(calls), choices=choices)
        return calls[0]

    def _in_loop(self, spec: str, call: Call) -> BoundaryInLoopError:
        outer = [
            c.qualname
            for c in self.graph.calls
            if c.loop is None and c.start <= call.start < c.stop
        ]
        hint = f", such as {outer[-1]!r}" if outer else ""
        loop = call.loop
        while loop is not None and loop.length is not None:
            loop = loop.parent
        if loop is None:  # a name-scope region inside a scan body
            return ScopeInScanError(name=spec, outer=hint)
        if loop.rule is not None:  # a loop without counted iterations: a `while`
            return WhileIterationError(name=spec, outer=hint, every=call.qualname)
        return BoundaryInLoopError(name=spec, primitive=loop.primitive, outer=hint)

    def _hint(self, base: str) -> str:
        in_scan = self._in_scan_hint(base)
        if in_scan:
            return in_scan
        names = self.all_names()
        close = difflib.get_close_matches(base, names, n=3, cutoff=0.5) or _same_leaf(base, names)
        shown = self._spelled_out(parse(c)[0] for c in close)
        return f" Did you mean {', '.join(repr(c) for c in shown)}?" if shown else ""

    def _in_loop_body(self, base: str) -> Call | None:
        """The call of a loop body that `base` names without its iteration slots."""
        calls = next(
            (cs for cs in self.by_parts.values() if unslotted(cs[0].template) == base), None
        )
        return calls[0] if calls is not None else None

    def _in_scan_hint(self, base: str) -> str:
        """For a call of a scan body named without its iteration: how to name one."""
        call = self._in_loop_body(base)
        if call is None:
            return ""
        length = call.loop.chain()[0].length if call.loop is not None else None
        one = call.name.replace("[:]", "[0]", 1)
        return IN_SCAN.format(listed=call.name, one=one, last=(length or 1) - 1)

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


IN_SCAN = (
    " It is called in every iteration of a scan (listed as {listed!r}): name one iteration, "
    "e.g. {one!r} (from 0 to {last}; -1 is the last), or every iteration stacked, {listed!r}."
)


def _template_parts(template: str) -> tuple[str, ...]:
    return split_indices(shown(template))[0]


def _iteration(spec: str, text: str, site: Any) -> int | str:
    if text == STACKED:
        return STACKED
    length = site.length
    try:
        k = int(text)
    except ValueError:
        k = None
    if k is None or not -length <= k < length:
        raise IterationIndexError(
            spec=spec, index=text, primitive=site.primitive, length=length, last=length - 1
        )
    return k % length


def _written_out(call: Call) -> bool:
    """Whether a call is an iteration `loops.expand` wrote out (its record has a key)."""
    return getattr(call.record, "key", None) is not None


def _counted(call: Call) -> bool:
    """Whether every loop around a call has counted iterations (no `while`)."""
    return all(site.length is not None for site in call.loop.chain())
