"""Resolving boundary names to calls and ports.

Grammar: ``path[.method][@k][:input|:output]``, where a module name holding one of
``\\ / @ : [`` has it escaped by a backslash (``a\\:input``). Names are exact strings, never prefixes
or patterns. A name called more than once needs ``@k`` (call order, from 0). Without a
port, a start means the module's input and an end means its output.

A call inside a scan body has one iteration slot per enclosing scan, written after the
name of the outermost call it is nested in: ``layers[2]/attn`` (iteration 2, ``[-1]``
the last) or ``layers[:]/attn`` (every iteration, stacked). Such a name is a `LoopRef`
here; `loops.py` writes the iterations out, and the new graph knows it as an alias.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
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
)
from .graph import Call, Graph
from .markers import INPUT, OUTPUT

PORTS = (INPUT, OUTPUT)
_SPEC = re.compile(r"((?:\\.|\[[^\]]*\]|[^\\@:\[])*)(?:@(\d+))?(?::(input|output))?")
_INDEX = re.compile(r"(\\.)|\[([^\]]*)\]")
STACKED = ":"


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


def iteration_slot(depth: int) -> str:
    """The iteration slot of the scan at `depth` in a call's template name."""
    return f"[\x00{depth}]"


_SLOT = re.compile(r"\[\x00(\d+)\]")


def shown(template: str) -> str:
    """A template name as listed: every iteration slot as ``[:]``."""
    return _SLOT.sub("[:]", template)


def fill(template: str, path: Sequence[Any]) -> str:
    """A template name with the slot of depth d holding ``path[d]`` (an int or ``":"``)."""
    return _SLOT.sub(lambda m: f"[{path[int(m.group(1))]}]", template)


def unslotted(template: str) -> str:
    """A template name without its iteration slots (the name the body's code uses)."""
    return _SLOT.sub("", template)


def slot_depths(template: str) -> list[int]:
    """The depth of each slot of a template name, in the order they are written."""
    return [int(d) for d in _SLOT.findall(template)]


def split_name(name: str) -> tuple[str, ...]:
    r"""A boundary name's module path, the inverse of `join_name`: split at each ``/``
    that is not escaped, the escapes removed.

    >>> split_name("p\\/q/dense")
    ('p/q', 'dense')
    """
    parts = [""]
    for token in re.findall(r"\\.|/|[^\\/]+", name):
        if token == "/":
            parts.append("")
        else:
            parts[-1] += token[1:] if token.startswith("\\") else token
    return tuple(parts)


def node_place(template: str) -> tuple[str, str]:
    """Where a node inserted at a call in a scan body is listed, as the template name of
    its parent and the iteration slot its own name takes.

    A node is listed at the top of the loop body it runs in: under the call at the top of
    the innermost body the call is inside (at ``layers[:]/block/mlp``: ``layers[:]/node``,
    no slot of its own), or, at that top call itself, beside it, with the loop's slot (at
    ``mlp[:]``: ``node[:]``; at ``outer[:]/mlp[:]``: ``outer[:]/node[:]``).

    >>> [shown(t) for t in node_place(f"layers{iteration_slot(0)}/block/mlp")]
    ['layers[:]', '']
    >>> [shown(t) for t in node_place(f"outer{iteration_slot(0)}/mlp{iteration_slot(1)}")]
    ['outer[:]', '[:]']
    """
    last = list(_SLOT.finditer(template))[-1]
    if template[last.end() :]:
        return template[: last.end()], ""
    head = template[: last.start()]
    seps = [m.start() for m in re.finditer(r"\\.|/", head) if m.group() == "/"]
    return head[: seps[-1]] if seps else "", last.group()


def split_indices(base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A name's text around its iteration slots, and what each slot holds.

    >>> split_indices("layers[2]/attn")
    (('layers', '/attn'), ('2',))
    >>> split_indices("head")
    (('head',), ())
    """
    parts, indices, at = [], [], 0
    for m in _INDEX.finditer(base):
        if m.group(1) is None:
            parts.append(base[at : m.start()])
            indices.append(m.group(2).strip())
            at = m.end()
    parts.append(base[at:])
    return tuple(parts), tuple(indices)


@dataclasses.dataclass(frozen=True)
class LoopRef:
    """A name of one iteration (or of all, stacked) of a call inside scan bodies."""

    spec: str
    call: Call  # the call as listed in the traced graph (its template)
    path: tuple[int | str, ...]  # per enclosing scan, outermost first: an iteration or ":"
    side: str
    # The loop around `call` as a whole (a lifted module inside another scan's body,
    # ``outer[2]/inner``): `path` then has no slot for that loop.
    whole: bool = False

    @property
    def sites(self) -> list[Any]:
        """The loops whose iterations `path` picks, outermost first."""
        chain = self.call.loop.chain()
        return chain[:-1] if self.whole else chain

    @property
    def key(self) -> tuple[int, tuple[int | str, ...]]:
        """How the iteration's call is known in the expanded graph (`CallRecord.key`)."""
        return (id(self.call.record), self.path)


class Resolver:
    """Looks names up in one graph."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.by_name: dict[str, list[Call]] = {}
        self.by_parts: dict[tuple[str, ...], list[Call]] = {}
        self.by_whole: dict[tuple[str, ...], list[Call]] = {}  # see `lifted_template`
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

    def resolve(self, spec: Any, default_port: str) -> tuple[Call, str]:
        """The call a name refers to, and its port (`default_port` when none is given)."""
        if not isinstance(spec, str):
            raise BoundaryNameTypeError(spec=spec, kind=type(spec).__name__)
        base, index, port = parse(spec)
        call = self.graph.aliases.get((base, index)) or self._listed(spec, base, index)
        return call, port or default_port

    def _listed(self, spec: str, base: str, index: int | None) -> Call:
        """The call of a name as the graph lists it (outside loops)."""
        if split_indices(base)[1] and base not in self.by_name:
            self.loop_ref(spec, OUTPUT)  # a clear error if the name is wrong
            raise UnreachableIterationError(spec=spec)
        self._check_literal(spec, base)
        call = self._pick(spec, base, index)
        if call.loop is not None:
            raise self._in_loop(spec, call)
        return call

    def loop_ref(self, spec: Any, default_port: str) -> LoopRef | None:
        """The iteration(s) a name with iteration slots picks; None for other names."""
        if not isinstance(spec, str):
            return None
        base, index, port = parse(spec)
        parts, given = split_indices(base)
        if not given:
            return None
        calls = self.by_parts.get(parts)
        whole = not calls and parts in self.by_whole
        calls = self.by_whole[parts] if whole else calls
        if not calls:
            raise UnknownBoundaryError(name=spec, hint=self._hint(base))
        call = self._pick_among(spec, calls, index)
        path = self._iterations(spec, call, given, whole)
        side = port or default_port
        if STACKED in path and side == INPUT and default_port == INPUT:
            example = spec.replace("[:]", "[0]")
            raise StackedStartError(spec=spec, example=example)
        return LoopRef(spec, call, path, side, whole)

    def _pick_among(self, spec: str, calls: list[Call], index: int | None) -> Call:
        if index is None:
            return self._only_call(calls[0].name, calls)
        if index >= len(calls):
            raise CallIndexPerIterationError(
                name=calls[0].name, count=len(calls), spec=spec, last=len(calls) - 1
            )
        return calls[index]

    def _iterations(
        self, spec: str, call: Call, given: tuple[str, ...], whole: bool = False
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
        for site in sites:
            if site.length is None:
                raise self._in_loop(spec, call)
        path: list[Any] = [None] * len(depths)
        for text, depth in zip(given, depths, strict=True):
            path[depth] = _iteration(spec, text, sites[depth])
        return tuple(path)

    def check_wholes(self, specs: list[Any], refs: list[LoopRef]) -> None:
        """A lifted module as a whole cannot be named with one of its own iterations (the
        loop is written out in pieces, so it is no longer one call)."""
        split = {id(ref.call.loop.chain()[0].eqn): ref for ref in refs}
        for spec in specs:
            loop = self._lifted_loop(spec)
            ref = split.get(id(loop.eqn)) if loop is not None else None
            if ref is not None:
                base = parse(spec)[0]
                first, last = f"{base}[0]:input", f"{base}[-1]:output"
                raise MixedLoopNamesError(whole=spec, one=ref.spec, first=first, last=last)

    def _lifted_loop(self, spec: Any) -> Any:
        """The loop a name of a lifted module as a whole stands for, or None."""
        try:
            whole, _ = self.resolve(spec, OUTPUT)
        except SliceError:  # not a name of a call (None, or wrong: reported when planning)
            return None
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
        return BoundaryInLoopError(name=spec, primitive=loop.primitive, outer=hint)

    def _hint(self, base: str) -> str:
        in_scan = self._in_scan_hint(base)
        if in_scan:
            return in_scan
        names = self.all_names()
        close = difflib.get_close_matches(base, names, n=3, cutoff=0.5) or _same_leaf(base, names)
        shown = self._spelled_out(parse(c)[0] for c in close)
        return f" Did you mean {', '.join(repr(c) for c in shown)}?" if shown else ""

    def _in_scan_hint(self, base: str) -> str:
        """For a call of a scan body named without its iteration: how to name one."""
        calls = next(
            (cs for cs in self.by_parts.values() if unslotted(cs[0].template) == base), None
        )
        if calls is None:
            return ""
        call = calls[0]
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


def lifted_template(call: Call) -> str | None:
    """The template name of the loop around `call` as a whole, when that loop is a
    module lifted inside another scan's body (``outer[:]/inner`` for linen's
    ``nn.scan(Inner)`` called in each iteration of ``nn.scan(Cell)``): the module the
    inner loop's body calls, under the module path that its variables are keyed by,
    with its own iteration slot last. None for other calls (a top-level lifted module
    is a call of the traced graph itself)."""
    loop, template = call.loop, call.template
    if loop is None or loop.parent is None or template is None or not call.is_module:
        return None
    last = iteration_slot(loop.depth)
    if not template.endswith(last) or unslotted(template) != call.record.name:
        return None
    return template[: -len(last)]


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
