"""From a traced jaxpr to a `Graph` (stage 2 of the pipeline).

The jaxpr's invars are (variables, random keys, array inputs), in that order. The one
evaluator (`jaxprs.Evaluator`) walks the jaxpr with this module's rules, on value ids
instead of arrays: equations are copied into the flat graph with fresh value ids;
call-like equations (jit, remat, custom_jvp/vjp) whose bodies hold boundaries are
inlined and remembered as `Region`s. So are call-like equations with several results,
so that a slice needing one result does not have to compute the others' inputs; they
are run as the original equation again whenever a slice (or an interpreter) needs them
whole. Loops and conditionals stay single equations: the module calls inside their
bodies are listed with `loop` set.

Boundaries come from marker equations, met here in program order and grouped into calls
by `calls.py` (a call's input markers, its body, then its output markers); `lifted.py`
adds what the caller of a linen lifted transform sees; and, for targets that ask for it,
`scopes.py` adds `jax.named_scope` regions: runs of consecutive equations sharing a scope
prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _compat
from .calls import Occurrence, call_name, calls_from_markers, index_names, number_calls
from .graph import Eqn, Graph, LoopSite, Region, Slot
from .jaxprs import Env, Evaluator, Finder, loop_rule
from .lifted import with_lifted_calls
from .markers import PLACEHOLDER
from .scopes import scope_prefixes, with_scope_calls


@dataclasses.dataclass(frozen=True)
class Signature:
    """How the traced program's invars and outvars map back to the target's arguments."""

    variable_paths: Sequence[tuple[Any, ...]]
    num_rngs: int
    input_tree: Any  # treedef of (args, kwargs) with all leaves
    input_is_array: Sequence[bool]
    input_statics: Sequence[Any]
    out_tree: Any
    out_statics: dict[int, Any]
    state_paths: Sequence[tuple[Any, ...]] = ()
    #: variables that held a Python number (a constant of the program), by path
    number_variables: Mapping[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)


ROWS = "rows"


@dataclasses.dataclass(frozen=True)
class RowMark:
    """The payload of a marker `loops.expand` binds for updated state stacked over the
    iterations of a loop it runs in pieces (a `BatchNorm`'s statistics in every layer).

    `kind` "start" or "stop" (on a placeholder) is where the equations of piece `piece`
    (a number, in row order) of loop `loop` start or stop; `written` says whether that
    piece is one iteration written out. `kind` ``ROWS`` is on the value of state entry
    `state` with the rows of pieces ``piece = (first, last)`` new and the others as they
    were; there, `loop` lists the pieces ``(loop, piece)`` in row order (the innermost
    ones, where an iteration written out runs an inner loop in pieces).
    """

    loop: Any
    kind: str
    piece: Any
    state: int | None = None
    written: bool = False


@dataclasses.dataclass
class StackedState:
    """An updated state entry stacked over a loop that runs in pieces."""

    pieces: list[tuple[int, int, bool]]  # per piece: its equations (start, stop), written
    rows: dict[tuple[int, int], int]  # (first, last) piece -> the value with their rows new


def boundary_finder(scopes: bool = False) -> Finder:
    """Which jaxprs and equations hold boundaries: marker equations or, with `scopes`,
    equations inside a `jax.named_scope` (at any depth; remembered per jaxpr)."""
    return Finder(
        lambda e: _compat.marker_payload(e) is not None or (scopes and bool(_compat.eqn_scopes(e)))
    )


class _Ids(Env):
    """Value ids of the graph being built, by jaxpr variable; each literal read is a new
    constant of the graph."""

    def __init__(self, g: Graph) -> None:
        super().__init__()
        self.g = g

    def read(self, atom: Any) -> int:
        if _compat.is_literal(atom):
            return self.g.new_const(_compat.literal_value(atom))
        return self.values[atom]


class _Builder(Evaluator):
    """Graph building as rules of the one evaluator, run on value ids instead of arrays
    (`ctx` is the enclosing named scopes): each equation is copied into the graph with
    fresh ids for its results, a call-like equation holding boundaries (or with several
    results) is inlined as a `Region`, and markers become `Occurrence`s."""

    def __init__(self, scopes: bool = False) -> None:
        self.g = Graph()
        self.occurrences: list[Occurrence] = []
        # With name-scope boundaries, a jit or remat body whose equations carry scopes is
        # inlined too, so the regions inside it are found.
        self.scopes = scopes
        self.boundaries = boundary_finder(scopes)
        # Scope regions inside loop bodies: listed, but not sliceable (one per iteration).
        self.loop_scopes: dict[tuple[str, ...], tuple[int, LoopSite]] = {}
        self.row_marks: list[tuple[RowMark, int, int | None]] = []  # (mark, position, value)

    def call_side(self, markers: Sequence[Any], env: _Ids, prefix: tuple[str, ...]) -> None:
        for eqn in markers:
            marker = _compat.marker_payload(eqn)
            if isinstance(marker, RowMark):
                vid = env.read(eqn.invars[0]) if marker.kind == ROWS else None
                self.row_marks.append((marker, len(self.g.eqns), vid))
                continue
            vid = None if marker.leaf == PLACEHOLDER else env.read(eqn.invars[0])
            scopes = prefix + _compat.eqn_scopes(eqn)
            self.occurrences.append(Occurrence(marker, vid, len(self.g.eqns), scopes, None))

    def call(
        self, eqn: Any, body: Any, ins: list[int], env: _Ids, prefix: tuple[str, ...]
    ) -> list[int]:
        if not (self.boundaries.inside(eqn) or len(eqn.outvars) > 1):
            return self.other(eqn, ins, env, prefix)
        scopes = prefix + _compat.eqn_scopes(eqn)
        jaxpr, consts = body
        start = len(self.g.eqns)
        outs = self.run(jaxpr, self.consts(consts), ins, scopes, _Ids(self.g))
        opaque = not self.boundaries.inside(eqn)
        region = Region(Eqn(eqn, tuple(ins), tuple(outs), scopes), start, len(self.g.eqns), opaque)
        self.g.regions.append(region)
        return outs

    def other(self, eqn: Any, ins: list[int], env: _Ids, prefix: tuple[str, ...]) -> list[int]:
        """The equation copied into the graph (a loop with the markers in its bodies)."""
        g = self.g
        scopes = prefix + _compat.eqn_scopes(eqn)
        outs = tuple(g.new_value(_compat.aval_of(v)) for v in eqn.outvars)
        idx = len(g.eqns)
        g.eqns.append(Eqn(eqn, tuple(ins), outs, scopes))
        g.producer.update(dict.fromkeys(outs, idx))
        if self.boundaries.inside(eqn):
            self.occurrences += self.loop_markers(eqn, scopes, idx, None)
        return list(outs)

    def consts(self, consts: Sequence[Any]) -> list[int]:
        """New constants of the graph for a jaxpr's constants."""
        return [self.g.new_const(c) for c in consts]

    def loop_markers(
        self, eqn: Any, scopes: tuple[str, ...], pos: int, parent: LoopSite | None
    ) -> list[Occurrence]:
        """The markers in the bodies of a loop (or conditional) equation at `pos`."""
        rule = loop_rule(eqn)  # None for a conditional
        length = rule.length(eqn) if rule is not None else None
        site = LoopSite(eqn, _compat.primitive_name(eqn), length, parent, rule)
        found: list[Occurrence] = []
        for sub in _compat.subjaxprs(eqn):
            found += self._body_markers(sub, scopes, pos, site)
        if rule is not None:
            index_names(found, site.depth)
        return found

    def _body_markers(
        self, jaxpr: Any, scopes: tuple[str, ...], pos: int, site: LoopSite
    ) -> list[Occurrence]:
        found: list[Occurrence] = []
        for inner in jaxpr.eqns:
            inner_scopes = scopes + _compat.eqn_scopes(inner)
            self._note_loop_scopes(scopes, inner_scopes, pos, site)
            marker = _compat.marker_payload(inner)
            body = _compat.call_body(inner)
            if marker is not None:
                name = call_name(marker.record, inner_scopes)
                aval = _compat.aval_of(inner.invars[0])
                found.append(Occurrence(marker, None, pos, inner_scopes, site, name, aval))
            elif not self.boundaries.inside(inner):
                continue
            elif body is not None:  # jit or remat inside the body: the same iterations
                found += self._body_markers(body[0], inner_scopes, pos, site)
            else:
                found += self.loop_markers(inner, inner_scopes, pos, site)
        return found

    def _note_loop_scopes(self, outer: tuple, inner: tuple, pos: int, loop: LoopSite) -> None:
        if self.scopes:
            for scope in scope_prefixes(inner)[len(outer) :]:
                self.loop_scopes.setdefault(scope, (pos, loop))


def build(closed_jaxpr: Any, signature: Signature, *, name_scopes: bool = False) -> Graph:
    """Flattens a traced program whose invars are (variables, rngs, array inputs)."""
    b = _Builder(scopes=name_scopes)
    jaxpr, consts = _compat.open_jaxpr(closed_jaxpr)
    const_ids = b.consts(consts)
    outs = b.run(jaxpr, const_ids, _invars(b.g, jaxpr.invars, signature), (), _Ids(b.g))
    _outvars(b.g, outs, signature)
    g = b.g
    g.source = (closed_jaxpr, signature, name_scopes)
    g.stacked_state = _stacked_state(b.row_marks)
    calls = with_lifted_calls(g, calls_from_markers(b.occurrences))
    if name_scopes:
        calls = with_scope_calls(g, calls, b.loop_scopes)
    number_calls(calls)
    g.calls = calls
    return g


def _invars(g: Graph, invars: Sequence[Any], sig: Signature) -> list[int]:
    """New values for the program's invars: (variables, random keys, array inputs)."""
    nv, nr = len(sig.variable_paths), sig.num_rngs
    ids = [g.new_value(_compat.aval_of(v)) for v in invars]
    g.variable_ids, g.rng_ids, g.input_ids = ids[:nv], ids[nv : nv + nr], ids[nv + nr :]
    g.variable_paths = list(sig.variable_paths)
    g.number_variables = dict(sig.number_variables)
    g.input_tree = sig.input_tree
    values, statics = iter(g.input_ids), iter(sig.input_statics)
    g.input_slots = [
        Slot(next(values)) if arr else Slot(None, next(statics)) for arr in sig.input_is_array
    ]
    return ids


def _outvars(g: Graph, ids: Sequence[int], sig: Signature) -> None:
    """The program's results: the output's array leaves, then the updated state."""
    outs = iter(ids)
    g.out_tree = sig.out_tree
    g.out_slots = [
        Slot(None, sig.out_statics[i]) if i in sig.out_statics else Slot(next(outs))
        for i in range(sig.out_tree.num_leaves)
    ]
    g.state_paths = list(sig.state_paths)
    g.state_ids = list(outs)
    if len(g.state_ids) != len(g.state_paths):
        raise AssertionError("the traced program returned state of an unexpected size")


def _stacked_state(marks: list[tuple[RowMark, int, int | None]]) -> dict[int, StackedState]:
    """``{state position: StackedState}`` from the marks `loops.expand` bound."""
    spans: dict[tuple[int, int], dict[str, Any]] = {}
    rows: dict[int, tuple[Any, dict[tuple[int, int], int]]] = {}
    for mark, pos, vid in marks:
        if mark.kind == ROWS:
            rows.setdefault(mark.state, (mark.loop, {}))[1][mark.piece] = vid
        else:
            spans.setdefault((mark.loop, mark.piece), {}).update(
                {mark.kind: pos, "written": mark.written}
            )
    found = {}
    for k, (leaves, values) in rows.items():
        pieces = [spans[leaf] for leaf in leaves]
        found[k] = StackedState([(p["start"], p["stop"], p["written"]) for p in pieces], values)
    return found
