"""From a traced jaxpr to a `Graph` (stage 2 of the pipeline).

The jaxpr's invars are (variables, random keys, array inputs), in that order. Equations
are copied into the flat graph with fresh value ids; call-like equations (jit, remat,
custom_jvp/vjp) whose bodies hold boundaries are inlined and remembered as `Region`s.
Loops and conditionals stay single equations: the module calls inside their bodies are
listed with `loop` set.

Boundaries come from marker equations (grouped into calls: a call's input markers, its
body, then its output markers) and, for targets that ask for it, from `jax.named_scope`
regions: runs of consecutive equations sharing a scope prefix. Sharp edge: a region found
only through the name stack cannot tell two back-to-back calls of one scope apart;
`js.mark` can.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat
from .graph import Call, Eqn, Graph, Region, Slot
from .markers import INPUT, PLACEHOLDER, CallRecord, Marker, Origin


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


@dataclasses.dataclass
class _Occurrence:
    marker: Marker
    vid: int | None
    pos: int
    scopes: tuple[str, ...]
    loop: str | None


class _Builder:
    def __init__(self, scopes: bool = False) -> None:
        self.g = Graph()
        self.occurrences: list[_Occurrence] = []
        self._marker_memo: dict[int, bool] = {}
        # With name-scope boundaries, a jit or remat body whose equations carry scopes is
        # inlined too, so the regions inside it are found.
        self.scopes = scopes
        # Scope regions inside loop bodies: listed, but not sliceable (one per iteration).
        self.loop_scopes: dict[tuple[str, ...], tuple[int, str]] = {}

    def has_marker(self, jaxpr: Any) -> bool:
        """Whether `jaxpr` holds boundaries: markers (or, with scopes, scoped equations)."""
        key = id(jaxpr)
        if key not in self._marker_memo:
            self._marker_memo[key] = any(self._eqn_has_boundary(e) for e in jaxpr.eqns)
        return self._marker_memo[key]

    def _eqn_has_boundary(self, eqn: Any) -> bool:
        if _compat.marker_payload(eqn) is not None:
            return True
        return (self.scopes and bool(_compat.eqn_scopes(eqn))) or self.has_marker_eqn(eqn)

    def has_marker_eqn(self, eqn: Any) -> bool:
        return any(self.has_marker(s) for s in _compat.subjaxprs(eqn))

    def read(self, env: dict[Any, int], atom: Any) -> int:
        if _compat.is_literal(atom):
            return self.g.new_const(_compat.literal_value(atom))
        return env[atom]

    def walk(self, jaxpr: Any, env: dict[Any, int], prefix: tuple[str, ...]) -> None:
        for eqn in jaxpr.eqns:
            scopes = prefix + _compat.eqn_scopes(eqn)
            marker = _compat.marker_payload(eqn)
            if marker is not None:
                self._occur(marker, env, eqn, scopes)
                continue
            body = _compat.call_body(eqn) if self.has_marker_eqn(eqn) else None
            if body is not None:
                self.inline(eqn, body, env, scopes)
            else:
                self.copy(eqn, env, scopes)

    def _occur(self, marker: Marker, env: dict[Any, int], eqn: Any, scopes: tuple) -> None:
        vid = None if marker.leaf == PLACEHOLDER else self.read(env, eqn.invars[0])
        self.occurrences.append(_Occurrence(marker, vid, len(self.g.eqns), scopes, None))

    def copy(self, eqn: Any, env: dict[Any, int], scopes: tuple[str, ...]) -> None:
        g = self.g
        ins = tuple(self.read(env, a) for a in eqn.invars)
        outs = []
        for v in eqn.outvars:
            vid = g.new_value(_compat.aval_of(v))
            if not _compat.is_dropvar(v):
                env[v] = vid
            outs.append(vid)
        idx = len(g.eqns)
        g.eqns.append(Eqn(eqn, ins, tuple(outs), scopes))
        for vid in outs:
            g.producer[vid] = idx
        if self.has_marker_eqn(eqn):
            self.collect_loop_markers(eqn, scopes, idx, _compat.primitive_name(eqn))

    def inline(
        self, eqn: Any, body: tuple[Any, Sequence[Any]], env: dict[Any, int], scopes: tuple
    ) -> None:
        jaxpr, consts = body
        inner: dict[Any, int] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            inner[v] = self.g.new_const(c)
        ins = []
        for v, a in zip(jaxpr.invars, eqn.invars, strict=True):
            inner[v] = self.read(env, a)
            ins.append(inner[v])
        start = len(self.g.eqns)
        self.walk(jaxpr, inner, scopes)
        outs = [self.read(inner, atom) for atom in jaxpr.outvars]
        for outer, vid in zip(eqn.outvars, outs, strict=True):
            if not _compat.is_dropvar(outer):
                env[outer] = vid
        region_eqn = Eqn(eqn, tuple(ins), tuple(outs), scopes)
        self.g.regions.append(Region(region_eqn, start, len(self.g.eqns)))

    def collect_loop_markers(self, eqn: Any, scopes: tuple[str, ...], pos: int, loop: str) -> None:
        for sub in _compat.subjaxprs(eqn):
            for inner in sub.eqns:
                inner_scopes = scopes + _compat.eqn_scopes(inner)
                self._note_loop_scopes(scopes, inner_scopes, pos, loop)
                marker = _compat.marker_payload(inner)
                if marker is not None:
                    self.occurrences.append(_Occurrence(marker, None, pos, inner_scopes, loop))
                elif self.has_marker_eqn(inner):
                    self.collect_loop_markers(inner, inner_scopes, pos, loop)

    def _note_loop_scopes(self, outer: tuple, inner: tuple, pos: int, loop: str) -> None:
        if self.scopes:
            for k in range(len(outer), len(inner)):
                self.loop_scopes.setdefault(inner[: k + 1], (pos, loop))


def build(closed_jaxpr: Any, signature: Signature, *, name_scopes: bool = False) -> Graph:
    """Flattens a traced program whose invars are (variables, rngs, array inputs)."""
    b = _Builder(scopes=name_scopes)
    jaxpr, consts = _compat.open_jaxpr(closed_jaxpr)
    env: dict[Any, int] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = b.g.new_const(c)
    _bind_invars(b.g, jaxpr.invars, env, signature)
    b.walk(jaxpr, env, ())
    _bind_outvars(b, jaxpr.outvars, env, signature)
    g = b.g
    g.calls = _whole_loops(g, _calls_from_markers(b.occurrences))
    if name_scopes:
        g.calls = _with_scope_calls(g, b.loop_scopes)
    _number_calls(g.calls)
    return g


def _bind_invars(g: Graph, invars: Sequence[Any], env: dict[Any, int], sig: Signature) -> None:
    nv, nr = len(sig.variable_paths), sig.num_rngs
    ids = []
    for v in invars:
        env[v] = g.new_value(_compat.aval_of(v))
        ids.append(env[v])
    g.variable_ids, g.rng_ids, g.input_ids = ids[:nv], ids[nv : nv + nr], ids[nv + nr :]
    g.variable_paths = list(sig.variable_paths)
    g.input_tree = sig.input_tree
    values, statics = iter(g.input_ids), iter(sig.input_statics)
    g.input_slots = [
        Slot(next(values)) if arr else Slot(None, next(statics)) for arr in sig.input_is_array
    ]


def _bind_outvars(b: _Builder, outvars: Sequence[Any], env: dict[Any, int], sig: Signature) -> None:
    g, outs = b.g, iter(outvars)
    g.out_tree = sig.out_tree
    g.out_slots = [
        Slot(None, sig.out_statics[i]) if i in sig.out_statics else Slot(b.read(env, next(outs)))
        for i in range(sig.out_tree.num_leaves)
    ]
    g.state_paths = list(sig.state_paths)
    g.state_ids = [b.read(env, v) for v in outs]
    if len(g.state_ids) != len(g.state_paths):
        raise AssertionError("the traced program returned state of an unexpected size")


# --------------------------------------------------------------------------- calls


@dataclasses.dataclass
class _Open:
    """A call whose markers are being collected."""

    call: Call
    record: CallRecord
    ins: dict[int, int | None] = dataclasses.field(default_factory=dict)
    outs: dict[int, int | None] = dataclasses.field(default_factory=dict)

    def finish(self) -> None:
        record = self.record
        self.call.in_slots = [
            Slot(self.ins.get(i)) if arr else Slot(None)
            for i, arr in enumerate(record.in_is_array)
        ]
        self.call.out_slots = [
            Slot(self.outs.get(i)) if arr else Slot(None, record.out_statics.get(i))
            for i, arr in enumerate(record.out_is_array)
        ]


def _calls_from_markers(occurrences: list[_Occurrence]) -> list[Call]:
    """Groups marker occurrences into calls: inputs, then the body, then outputs.

    One record may yield several calls (a function traced twice, by `jax.checkpoint`
    say): a new call starts when an input marker follows the record's outputs or repeats
    a leaf already seen.
    """
    opened: list[_Open] = []
    current: dict[int, _Open] = {}
    for seq, occ in enumerate(occurrences):
        key = id(occ.marker.record)
        state = current.get(key)
        if occ.marker.side == INPUT:
            if state is None or state.outs or occ.marker.leaf in state.ins:
                state = current[key] = _Open(_new_call(occ, seq), occ.marker.record)
                opened.append(state)
            state.ins[occ.marker.leaf] = occ.vid
        elif state is not None:  # an output without its input: the input was dead code
            state.outs[occ.marker.leaf] = occ.vid
            state.call.stop, state.call.out_seq = occ.pos, seq
    for state in opened:
        state.finish()
    return [state.call for state in opened]


def _new_call(occ: _Occurrence, seq: int) -> Call:
    record = occ.marker.record
    return Call(
        name=_call_name(record, occ.scopes),
        index=0,
        module_type=record.module_type,
        method=record.method,
        origin=record.origin,
        in_tree=record.in_tree,
        in_slots=[],
        out_tree=record.out_tree,
        out_slots=[],
        start=occ.pos,
        stop=occ.pos,
        loop=occ.loop,
        path=record.path,
        in_seq=seq,
    )


def _call_name(record: CallRecord, scopes: tuple[str, ...]) -> str:
    if record.origin is Origin.MARK and scopes:
        return "/".join(scopes)
    return record.name


def _whole_loops(g: Graph, calls: list[Call]) -> list[Call]:
    """A lifted module (linen `nn.scan`, say) as a whole: the loop equation's own ports.

    Inside the loop body each call is one iteration; the outermost module of a loop that
    is called nowhere else *is* the loop (its outer call is the lifted transform), so it
    gets a boundary whose inputs are the loop's non-constant operands and whose output is
    the tuple of the loop's results. Calls nested in it stay per-iteration (not sliceable).
    """
    outside = {c.name for c in calls if c.loop is None}
    wholes: dict[int, list[Call]] = {}
    out: list[Call] = []
    for c in calls:
        siblings = wholes.setdefault(c.start, [])
        lifted = c.loop is not None and c.is_module and c.name not in outside
        if lifted and not any(c.path[: len(o.path)] == o.path for o in siblings):
            c = _loop_as_call(g, c)
            siblings.append(c)
        out.append(c)
    return out


def _loop_as_call(g: Graph, c: Call) -> Call:
    eqn = g.eqns[c.start]
    n_in, n_out = len(eqn.ins), len(eqn.outs)
    out_tree = jax.tree_util.tree_structure(tuple(range(n_out)) if n_out != 1 else 0)
    return dataclasses.replace(
        c,
        loop=None,
        in_tree=jax.tree_util.tree_structure((tuple(range(n_in)), {})),
        in_slots=[Slot(v) for v in eqn.ins],
        out_tree=out_tree,
        out_slots=[Slot(v) for v in eqn.outs],
        start=c.start,
        stop=c.start + 1,
        module_type=f"{c.module_type} ({eqn.primitive})",
    )


def _with_scope_calls(g: Graph, loop_scopes: dict[tuple[str, ...], tuple[int, str]]) -> list[Call]:
    """The marked calls plus `jax.named_scope` regions no marked call already names."""
    calls = list(g.calls)
    known = {c.name for c in calls}
    for call in _calls_from_scopes(g):
        if call.name not in known:
            calls.append(call)
    known = {c.name for c in calls}
    for scope, (pos, loop) in loop_scopes.items():
        if "/".join(scope) not in known:
            known.add("/".join(scope))
            calls.append(_scope_call(scope, pos, pos + 1, [], [], loop))
    # Same span: marked calls in marker order, then scope regions outer first.
    calls.sort(key=lambda c: (c.start, -c.stop, c.is_scope, len(c.path) if c.is_scope else 0))
    return calls


def _scope_call(
    scope: tuple[str, ...], start: int, stop: int, reads: list[int], outs: list[int], loop: Any
) -> Call:
    out_tree = jax.tree_util.tree_structure(outs[0] if len(outs) == 1 else tuple(outs))
    return Call(
        name="/".join(scope),
        index=0,
        module_type="named_scope",
        method="",
        origin=Origin.SCOPE,
        in_tree=jax.tree_util.tree_structure((tuple(range(len(reads))), {})),
        in_slots=[Slot(v) for v in reads],
        out_tree=out_tree,
        out_slots=[Slot(v) for v in outs],
        start=start,
        stop=stop,
        loop=loop,
        path=scope,
    )


def _scope_runs(g: Graph) -> list[tuple[tuple[str, ...], int, int]]:
    """``(scope, start, stop)`` of each run of equations sharing a scope prefix."""
    runs: list[tuple[tuple[str, ...], int, int]] = []
    open_runs: dict[tuple[str, ...], int] = {}
    for pos, eqn in enumerate(g.eqns):
        prefixes = [eqn.scopes[: k + 1] for k in range(len(eqn.scopes))]  # outer first
        for p in [p for p in open_runs if p not in prefixes]:
            runs.append((p, open_runs.pop(p), pos))
        for p in prefixes:
            open_runs.setdefault(p, pos)
    runs += [(p, s, len(g.eqns)) for p, s in open_runs.items()]
    runs.sort(key=lambda r: (r[1], -r[2], len(r[0])))
    return runs


def _calls_from_scopes(g: Graph) -> list[Call]:
    """Regions of consecutive equations that share a `jax.named_scope` prefix.

    A region reads the values it uses but does not make (free values aside), and returns
    those it makes that the model's output or a later equation reads.
    """
    last_read = _last_reader(g)
    out_ids = {s.id for s in g.out_slots if s.id is not None}
    calls = []
    for scope, start, stop in _scope_runs(g):
        reads, made = _region_values(g, start, stop)
        outs = [v for v in made if v in out_ids or last_read.get(v, -1) >= stop]
        calls.append(_scope_call(scope, start, stop, reads, outs, None))
    return calls


def _region_values(g: Graph, start: int, stop: int) -> tuple[list[int], list[int]]:
    """The values equations ``start:stop`` read from outside (in order), and those they make."""
    made: dict[int, None] = {}
    reads: dict[int, None] = {}
    for eqn in g.eqns[start:stop]:
        for v in eqn.ins:
            if v not in made and not g.is_free(v):
                reads.setdefault(v)
        made.update(dict.fromkeys(eqn.outs))
    return list(reads), list(made)


def _last_reader(g: Graph) -> dict[int, int]:
    last: dict[int, int] = {}
    for pos, eqn in enumerate(g.eqns):
        for v in eqn.ins:
            last[v] = pos
    return last


def _number_calls(calls: list[Call]) -> None:
    counts: dict[str, int] = {}
    for c in calls:
        c.index = counts.get(c.name, 0)
        counts[c.name] = c.index + 1
    for c in calls:
        c.count = counts[c.name]
