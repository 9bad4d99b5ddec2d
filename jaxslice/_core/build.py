"""From a traced jaxpr to a `Graph` (stage 2 of the pipeline).

The jaxpr's invars are (variables, random keys, array inputs), in that order. Equations
are copied into the flat graph with fresh value ids; call-like equations (jit, remat,
custom_jvp/vjp) whose bodies hold boundaries are inlined and remembered as `Region`s.
So are call-like equations with several results, so that a slice needing
one result does not have to compute the others' inputs; they are run as the original
equation again whenever a slice (or an interpreter) needs them whole. Loops and
conditionals stay single equations: the module calls inside their bodies are
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
from .graph import Call, Eqn, Graph, LoopSite, Region, Slot
from .markers import INPUT, OUTPUT, PLACEHOLDER, CallRecord, Marker, Origin
from .names import shown, slot, unslotted
from .ports import array_ids


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


@dataclasses.dataclass
class _Occurrence:
    marker: Marker
    vid: int | None
    pos: int
    scopes: tuple[str, ...]
    loop: LoopSite | None
    template: str | None = None  # the call's name with iteration slots (in scan bodies)
    aval: Any = None  # in a loop body, the value's shape and dtype in one iteration


class BoundaryIndex:
    """Which jaxprs and equations hold boundaries: marker equations or, with `scopes`,
    equations inside a `jax.named_scope` (at any depth; remembered per jaxpr)."""

    def __init__(self, scopes: bool = False) -> None:
        self.scopes = scopes
        self._memo: dict[int, bool] = {}

    def in_jaxpr(self, jaxpr: Any) -> bool:
        key = id(jaxpr)
        if key not in self._memo:
            self._memo[key] = any(self._is_boundary(e) for e in jaxpr.eqns)
        return self._memo[key]

    def inside(self, eqn: Any) -> bool:
        """Whether the jaxprs an equation holds (its bodies) hold boundaries."""
        return any(self.in_jaxpr(s) for s in _compat.subjaxprs(eqn))

    def _is_boundary(self, eqn: Any) -> bool:
        if _compat.marker_payload(eqn) is not None:
            return True
        return (self.scopes and bool(_compat.eqn_scopes(eqn))) or self.inside(eqn)


class _Builder:
    def __init__(self, scopes: bool = False) -> None:
        self.g = Graph()
        self.occurrences: list[_Occurrence] = []
        # With name-scope boundaries, a jit or remat body whose equations carry scopes is
        # inlined too, so the regions inside it are found.
        self.scopes = scopes
        self.boundaries = BoundaryIndex(scopes)
        # Scope regions inside loop bodies: listed, but not sliceable (one per iteration).
        self.loop_scopes: dict[tuple[str, ...], tuple[int, LoopSite]] = {}
        self.row_marks: list[tuple[RowMark, int, int | None]] = []  # (mark, position, value)

    def read(self, env: dict[Any, int], atom: Any) -> int:
        if _compat.is_literal(atom):
            return self.g.new_const(_compat.literal_value(atom))
        return env[atom]

    def walk(self, jaxpr: Any, env: dict[Any, int], prefix: tuple[str, ...]) -> None:
        for eqn in jaxpr.eqns:
            scopes = prefix + _compat.eqn_scopes(eqn)
            marker = _compat.marker_payload(eqn)
            if isinstance(marker, RowMark):
                vid = self.read(env, eqn.invars[0]) if marker.kind == ROWS else None
                self.row_marks.append((marker, len(self.g.eqns), vid))
                continue
            if marker is not None:
                self._occur(marker, env, eqn, scopes)
                continue
            inlined = self.boundaries.inside(eqn) or len(eqn.outvars) > 1
            body = _compat.call_body(eqn) if inlined else None
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
        outs = tuple(g.new_value(_compat.aval_of(v)) for v in eqn.outvars)
        _bind(env, eqn.outvars, outs)
        idx = len(g.eqns)
        g.eqns.append(Eqn(eqn, ins, outs, scopes))
        g.producer.update(dict.fromkeys(outs, idx))
        if self.boundaries.inside(eqn):
            self.occurrences += self.loop_markers(eqn, scopes, idx, None)

    def inline(
        self, eqn: Any, body: tuple[Any, Sequence[Any]], env: dict[Any, int], scopes: tuple
    ) -> None:
        jaxpr, consts = body
        inner = self.const_env(jaxpr, consts)
        ins = tuple(self.read(env, a) for a in eqn.invars)
        inner.update(zip(jaxpr.invars, ins, strict=True))
        start = len(self.g.eqns)
        self.walk(jaxpr, inner, scopes)
        outs = tuple(self.read(inner, atom) for atom in jaxpr.outvars)
        _bind(env, eqn.outvars, outs)
        opaque = not self.boundaries.inside(eqn)
        region = Region(Eqn(eqn, ins, outs, scopes), start, len(self.g.eqns), opaque)
        self.g.regions.append(region)

    def const_env(self, jaxpr: Any, consts: Sequence[Any]) -> dict[Any, int]:
        """An environment binding `jaxpr`'s constvars to new constants."""
        return {v: self.g.new_const(c) for v, c in zip(jaxpr.constvars, consts, strict=True)}

    def loop_markers(
        self, eqn: Any, scopes: tuple[str, ...], pos: int, parent: LoopSite | None
    ) -> list[_Occurrence]:
        """The markers in the bodies of a loop (or conditional) equation at `pos`."""
        primitive = _compat.loop_primitive(eqn) or _compat.primitive_name(eqn)
        length = _compat.scan_parts(eqn).length if primitive == "scan" else None
        site = LoopSite(eqn, primitive, length, parent)
        found: list[_Occurrence] = []
        for sub in _compat.subjaxprs(eqn):
            found += self._body_markers(sub, scopes, pos, site)
        if length is not None:
            index_names(found, site.depth)
        return found

    def _body_markers(
        self, jaxpr: Any, scopes: tuple[str, ...], pos: int, site: LoopSite
    ) -> list[_Occurrence]:
        found: list[_Occurrence] = []
        for inner in jaxpr.eqns:
            inner_scopes = scopes + _compat.eqn_scopes(inner)
            self._note_loop_scopes(scopes, inner_scopes, pos, site)
            marker = _compat.marker_payload(inner)
            body = _compat.call_body(inner)
            if marker is not None:
                name = _call_name(marker.record, inner_scopes)
                aval = _compat.aval_of(inner.invars[0])
                found.append(_Occurrence(marker, None, pos, inner_scopes, site, name, aval))
            elif not self.boundaries.inside(inner):
                continue
            elif body is not None:  # jit or remat inside the body: the same iterations
                found += self._body_markers(body[0], inner_scopes, pos, site)
            else:
                found += self.loop_markers(inner, inner_scopes, pos, site)
        return found

    def _note_loop_scopes(self, outer: tuple, inner: tuple, pos: int, loop: LoopSite) -> None:
        if self.scopes:
            for scope in _prefixes(inner)[len(outer) :]:
                self.loop_scopes.setdefault(scope, (pos, loop))


def _bind(env: dict[Any, int], outvars: Sequence[Any], ids: Sequence[int]) -> None:
    """Binds each of `outvars` that is not a dropped variable to its value id."""
    for v, vid in zip(outvars, ids, strict=True):
        if not _compat.is_dropvar(v):
            env[v] = vid


def _prefixes(scopes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every non-empty prefix of `scopes`, outer first."""
    return [scopes[: k + 1] for k in range(len(scopes))]


def build(closed_jaxpr: Any, signature: Signature, *, name_scopes: bool = False) -> Graph:
    """Flattens a traced program whose invars are (variables, rngs, array inputs)."""
    b = _Builder(scopes=name_scopes)
    jaxpr, consts = _compat.open_jaxpr(closed_jaxpr)
    env = b.const_env(jaxpr, consts)
    _bind_invars(b.g, jaxpr.invars, env, signature)
    b.walk(jaxpr, env, ())
    _bind_outvars(b, jaxpr.outvars, env, signature)
    g = b.g
    g.source = (closed_jaxpr, signature, name_scopes)
    g.stacked_state = _stacked_state(b.row_marks)
    g.calls = _whole_loops(g, _calls_from_markers(b.occurrences))
    _vmapped_results(g)
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


# --------------------------------------------------------------------------- calls


@dataclasses.dataclass
class _Open:
    """A call whose markers are being collected."""

    call: Call
    record: CallRecord
    ins: dict[int, int | None] = dataclasses.field(default_factory=dict)
    outs: dict[int, int | None] = dataclasses.field(default_factory=dict)

    def takes_input(self, leaf: int) -> bool:
        """Whether an input marker of `leaf` belongs to this call (and does not start a new
        one): no output has been seen and the leaf has not."""
        return not self.outs and leaf not in self.ins

    def add_input(self, occ: _Occurrence) -> None:
        self.ins[occ.marker.leaf] = occ.vid
        self._note(occ, 0)

    def add_output(self, occ: _Occurrence, seq: int) -> None:
        self.outs[occ.marker.leaf] = occ.vid
        self.call.stop, self.call.out_seq = occ.pos, seq
        self._note(occ, 1)

    def _note(self, occ: _Occurrence, side: int) -> None:
        """Keeps the per-iteration shape of a leaf seen in a loop body (for the table)."""
        if occ.aval is not None and occ.marker.leaf != PLACEHOLDER:
            self.call.loop_avals[side][occ.marker.leaf] = occ.aval

    def abandoned(self) -> bool:
        """A call that never returned and saw only some of its inputs: the leftovers of a
        trace the model's library threw away (linen's lifted transforms trace a module
        once for shapes), not a call of this program."""
        return not self.outs and len(self.ins) < max(1, sum(self.record.in_is_array))

    def is_boundary(self) -> bool:
        """Whether the call is a boundary: it returned, and a module call takes or returns
        arrays (a helper method that builds a submodule or reads a flag does neither)."""
        record = self.record
        moves_arrays = any(record.in_is_array) or any(record.out_is_array)
        return not self.abandoned() and (moves_arrays or record.origin is not Origin.MODULE)

    def finish(self) -> Call:
        record = self.record
        self.call.in_slots = _slots(self.ins, record.in_is_array, {})
        self.call.out_slots = _slots(self.outs, record.out_is_array, record.out_statics)
        return self.call


def _slots(
    ids: dict[int, int | None], is_array: Sequence[bool], statics: dict[int, Any]
) -> list[Slot]:
    """Per leaf, the value its marker saw (arrays) or its static value (others)."""
    return [
        Slot(ids.get(i)) if arr else Slot(None, statics.get(i)) for i, arr in enumerate(is_array)
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
            if state is None or not state.takes_input(occ.marker.leaf):
                state = current[key] = _Open(_new_call(occ, seq), occ.marker.record)
                opened.append(state)
            state.add_input(occ)
        elif state is not None:  # an output without its input: the input was dead code
            state.add_output(occ, seq)
    return [state.finish() for state in opened if state.is_boundary()]


def _new_call(occ: _Occurrence, seq: int) -> Call:
    record = occ.marker.record
    name = _call_name(record, occ.scopes) if occ.template is None else shown(occ.template)
    return Call(
        name=name,
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
        record=record,
        template=occ.template if occ.loop is not None and occ.loop.length is not None else None,
    )


def _call_name(record: CallRecord, scopes: tuple[str, ...]) -> str:
    if record.origin is Origin.MARK and scopes and record.display is None:
        return "/".join(scopes)
    return record.name


def _whole_loops(g: Graph, calls: list[Call]) -> list[Call]:
    """Adds a lifted module (linen `nn.scan`, say) as a whole: the loop equation's own ports.

    Inside a scan body each call is one iteration (``layers[:]``); the outermost module
    of a loop that is called nowhere else *is* the loop (its outer call is the lifted
    transform), so it also gets a boundary under its bare name, with the ports its caller
    sees (`_loop_as_call`).
    """
    outside = {c.name for c in calls if c.loop is None}
    out: list[Call] = []
    for c in calls:
        if _is_lifted(c, outside):
            out.append(_loop_as_call(g, c))
        out.append(c)
    return out


def _is_lifted(c: Call, outside: set[str]) -> bool:
    """Whether `c` is the module a top-level scan's body calls, called nowhere else."""
    loop = c.loop
    if loop is None or loop.parent is not None or not c.is_module or c.template is None:
        return False
    return c.template == c.record.name + slot(0) and c.record.name not in outside


def _loop_as_call(g: Graph, c: Call) -> Call:
    """The loop equation at `c.start` as one call, with the ports its caller sees.

    A lifted transform moves axes around the loop (``nn.scan(..., in_axes=1)`` transposes
    the scanned operand before the loop and the stacked result after it), so an operand
    that is a permutation of another value, made only for the loop, is taken before that
    permutation, and a result that only a permutation reads, after it.
    """
    pos = c.start
    eqn = g.eqns[pos]
    readers = _readers(g)
    ins, starts = zip(*(_unmoved_operand(g, readers, v, pos) for v in eqn.ins), strict=True)
    outs, stops = zip(*(_unmoved_result(g, readers, v, pos) for v in eqn.outs), strict=True)
    ports = _caller_ports(eqn.jax_eqn, c.record)
    trees = _loop_trees(ins, outs) if ports is None else _call_trees(c.record, ins, outs, *ports)
    return dataclasses.replace(
        c,
        name=c.record.name,
        loop=None,
        template=None,
        start=min(starts),
        stop=max(stops),
        module_type=f"{c.module_type} ({eqn.primitive})",
        **trees,
    )


def _call_trees(
    record: CallRecord, ins: Sequence[int], outs: Sequence[int], in_at: dict, out_at: dict
) -> dict[str, Any]:
    """A lifted call's ports: its own arguments and result, as the caller sees them."""
    return {
        "in_tree": record.in_tree,
        "in_slots": _slots({k: ins[j] for k, j in in_at.items()}, record.in_is_array, {}),
        "out_tree": record.out_tree,
        "out_slots": _slots(
            {k: outs[j] for k, j in out_at.items()}, record.out_is_array, record.out_statics
        ),
    }


def _loop_trees(ins: Sequence[int], outs: Sequence[int]) -> dict[str, Any]:
    """A lifted call's ports where its own cannot be told: the loop's operands and results."""
    out_tree = tuple(range(len(outs))) if len(outs) != 1 else 0
    return {
        "in_tree": jax.tree_util.tree_structure((tuple(range(len(ins))), {})),
        "in_slots": [Slot(v) for v in ins],
        "out_tree": jax.tree_util.tree_structure(out_tree),
        "out_slots": [Slot(v) for v in outs],
    }


def _caller_ports(eqn: Any, record: CallRecord) -> tuple[dict, dict] | None:
    """For a call made once per iteration directly in a scan body: ``({input leaf: loop
    operand}, {output leaf: loop result})``, or None where a leaf is not one of them."""
    found = body_ports(_compat.scan_parts(eqn).jaxpr).get(id(record))
    return None if found is None else (found[1][INPUT], found[1][OUTPUT])


def body_ports(body: Any) -> dict[int, tuple[CallRecord, dict[str, dict[int, int]]]]:
    """The calls made once per iteration in a loop body (directly, or inside a jit or
    remat in it) whose array leaves are the body's own parameters (inputs) and results
    (outputs).

    Returns ``{id(record): (record, {side: {leaf: position}})}``, the position of each
    input leaf among the body's invars and of each output leaf among its outvars.

    One value may be several results of a body: an RNN cell returns its new carry as
    its output too (``return c, c``), and the loop returns it once as the carry and once
    stacked. The output leaves of a call take such a value's positions in their own
    order, each a position no earlier leaf of that call took, so the caller's view of
    the loop (`_loop_as_call`) gets the carry for the one and the stacked results for
    the other.
    """
    places = {INPUT: _positions(body.invars), OUTPUT: _positions(body.outvars)}
    found: dict[int, tuple[CallRecord, dict[str, dict[int, int]]]] = {}
    refused: set[int] = set()
    _walk_ports(body, places, found, refused)
    return {k: v for k, v in found.items() if k not in refused and _complete(*v)}


def _walk_ports(jaxpr: Any, places: dict[str, dict], found: dict, refused: set[int]) -> None:
    for inner in jaxpr.eqns:
        marker = _compat.marker_payload(inner)
        if marker is None:
            sub = _compat.call_body(inner)
            if sub is not None:
                _walk_ports(sub[0], _inner_places(places, inner, sub[0]), found, refused)
            continue
        if marker.leaf == PLACEHOLDER:
            continue
        record, ports = found.setdefault(
            id(marker.record), (marker.record, {INPUT: {}, OUTPUT: {}})
        )
        taken = ports[marker.side].values() if marker.side == OUTPUT else ()
        j = _position(inner.invars[0], places[marker.side], taken)
        if j is None or marker.leaf in ports[marker.side]:
            refused.add(id(record))
        ports[marker.side][marker.leaf] = j


def _inner_places(places: dict[str, dict], eqn: Any, body: Any) -> dict[str, dict]:
    """`places` seen from inside a call-like equation's body: its parameters and results
    stand for the equation's operands and results (a body's result returned at several
    places stands for all of them, in order)."""

    def through(outer: Sequence[Any], inner: Sequence[Any], known: dict) -> dict:
        out: dict[Any, tuple[int, ...]] = {}
        for o, i in zip(outer, inner, strict=True):
            if not _compat.is_literal(i) and not _compat.is_literal(o) and o in known:
                out[i] = out.get(i, ()) + known[o]
        return out

    return {
        INPUT: through(eqn.invars, body.invars, places[INPUT]),
        OUTPUT: through(eqn.outvars, body.outvars, places[OUTPUT]),
    }


def _position(atom: Any, places: dict[Any, tuple[int, ...]], taken: Any = ()) -> int | None:
    """The first of `atom`'s positions not `taken` (its first one if all are), or None."""
    if _compat.is_literal(atom) or atom not in places:
        return None
    held = places[atom]
    return next((j for j in held if j not in taken), held[0])


def _positions(atoms: Sequence[Any]) -> dict[Any, tuple[int, ...]]:
    """The positions of each variable among `atoms`, in order."""
    out: dict[Any, tuple[int, ...]] = {}
    for j, v in enumerate(atoms):
        if not _compat.is_literal(v):
            out[v] = out.get(v, ()) + (j,)
    return out


def _complete(record: CallRecord, ports: dict[str, dict[int, int]]) -> bool:
    """Whether every array leaf of both sides has a position."""
    return len(ports[INPUT]) == sum(record.in_is_array) and len(ports[OUTPUT]) == sum(
        record.out_is_array
    )


def _vmapped_results(g: Graph) -> None:
    """A module lifted by `vmap` (linen `nn.vmap`) returns what its caller receives.

    Inside the transform its result is stacked along a leading axis, which `jax.vmap`
    then moves to `out_axes`; an output that only that move reads is taken after it.
    A call nested in another with the same output keeps the stacked value.
    """
    readers = _readers(g)
    moved: dict[int, int] = {}
    for c in sorted((c for c in g.calls if c.loop is None), key=lambda c: (c.start, c.in_seq)):
        for s in c.out_slots:
            pos = _vmap_move(g, readers, s.id)
            if pos is not None and s.id not in moved:
                moved[s.id] = pos
                s.id = g.eqns[pos].outs[0]
                c.stop = max(c.stop, pos + 1)


def _vmap_move(g: Graph, readers: dict[int, list[int]], v: int | None) -> int | None:
    """The position of the `vmap`-made axis move that alone reads `v`, if any."""
    users = readers.get(v, []) if v is not None else []
    if len(users) != 1 or users[0] < 0:
        return None
    eqn = g.eqns[users[0]]
    moves = _compat.is_axis_permutation(eqn.jax_eqn) and _compat.made_by_vmap(eqn.jax_eqn)
    return users[0] if moves else None


def _readers(g: Graph) -> dict[int, list[int]]:
    """The equations that read each value; the model's outputs count as a reader (-1)."""
    readers = g.__dict__.get("_readers")
    if readers is None:
        readers = {}
        for pos, eqn in enumerate(g.eqns):
            for v in eqn.ins:
                readers.setdefault(v, []).append(pos)
        for v in array_ids(g.out_slots):
            readers.setdefault(v, []).append(-1)
        g.__dict__["_readers"] = readers
    return readers


def _unmoved_operand(g: Graph, readers: dict, v: int, pos: int) -> tuple[int, int]:
    """``(value, first equation)`` of a loop operand as the caller passed it."""
    made = g.producer.get(v)
    if made is None or readers.get(v) != [pos] or not _moves_axes(g, made):
        return v, pos
    return g.eqns[made].ins[0], made


def _unmoved_result(g: Graph, readers: dict, v: int, pos: int) -> tuple[int, int]:
    """``(value, stop)`` of a loop result as the caller receives it."""
    users = readers.get(v, [])
    if len(users) != 1 or users[0] < 0 or not _moves_axes(g, users[0]):
        return v, pos + 1
    return g.eqns[users[0]].outs[0], users[0] + 1


def _moves_axes(g: Graph, pos: int) -> bool:
    eqn = g.eqns[pos]
    return _compat.is_axis_permutation(eqn.jax_eqn) and not g.is_free(eqn.ins[0])


def _with_scope_calls(
    g: Graph, loop_scopes: dict[tuple[str, ...], tuple[int, LoopSite]]
) -> list[Call]:
    """The marked calls plus `jax.named_scope` regions no marked call already names."""
    calls = list(g.calls)
    calls += _unnamed(_calls_from_scopes(g), calls)
    calls += _unnamed(_loop_scope_calls(loop_scopes), calls)
    calls.sort(key=_span_order)
    return calls


def _unnamed(candidates: list[Call], calls: list[Call]) -> list[Call]:
    """The candidates whose name none of `calls` has."""
    known = {c.name for c in calls} | {unslotted(c.template) for c in calls if c.template}
    known |= {"/".join(c.record.scope) for c in calls if c.record and c.record.scope}
    return [c for c in candidates if c.name not in known]


def _loop_scope_calls(loop_scopes: dict[tuple[str, ...], tuple[int, LoopSite]]) -> list[Call]:
    """One call per name of the scope regions inside loop bodies (the first with it)."""
    calls: dict[str, Call] = {}
    for scope, (pos, loop) in loop_scopes.items():
        calls.setdefault("/".join(scope), _scope_call(scope, pos, pos + 1, [], [], loop))
    return list(calls.values())


def _span_order(c: Call) -> tuple[Any, ...]:
    """Calls by span, outer first; on the same span marked calls in marker order, then
    scope regions outer first."""
    return (c.start, -c.stop, c.is_scope, len(c.path) if c.is_scope else 0)


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
    open_runs: dict[tuple[str, ...], int] = {}  # scope -> start of its run
    for pos, eqn in enumerate(g.eqns):
        prefixes = _prefixes(eqn.scopes)
        runs += _close_runs(open_runs, prefixes, pos)
        for p in prefixes:
            open_runs.setdefault(p, pos)
    runs += _close_runs(open_runs, [], len(g.eqns))
    runs.sort(key=lambda r: (r[1], -r[2], len(r[0])))
    return runs


def _close_runs(
    open_runs: dict[tuple[str, ...], int], kept: list[tuple[str, ...]], stop: int
) -> list[tuple[tuple[str, ...], int, int]]:
    """Ends at `stop` (and forgets) the open runs whose scope is not in `kept`."""
    ended = [p for p in open_runs if p not in kept]
    return [(p, open_runs.pop(p), stop) for p in ended]


def _calls_from_scopes(g: Graph) -> list[Call]:
    """Regions of consecutive equations that share a `jax.named_scope` prefix.

    A region reads the values it uses but does not make (free values aside), and returns
    those it makes that the model's output or a later equation reads.
    """
    last_read = _last_reader(g)
    calls = []
    for scope, start, stop in _scope_runs(g):
        reads, made = _region_values(g, start, stop)
        outs = [v for v in made if last_read.get(v, -1) >= stop]
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
    """The position of the last equation that reads each value; the model's output reads
    its values after every equation (at ``len(g.eqns)``)."""
    last: dict[int, int] = {}
    for pos, eqn in enumerate(g.eqns):
        last.update(dict.fromkeys(eqn.ins, pos))
    last.update(dict.fromkeys(array_ids(g.out_slots), len(g.eqns)))
    return last


# --------------------------------------------------------------------------- loop names


def index_names(found: list[_Occurrence], depth: int) -> None:
    """Gives the calls of a scan body one iteration slot: after the name of the outermost
    call they are nested in (``layers`` -> ``layers[:]``, ``layers/attn`` ->
    ``layers[:]/attn``)."""
    names = {o.template for o in found if o.template is not None}
    for o in found:
        if o.template is None:
            continue
        top = min((n for n in names if o.template.startswith(n + "/")), key=len, default=None)
        top = o.template if top is None else top
        o.template = top + slot(depth) + o.template[len(top) :]


def _number_calls(calls: list[Call]) -> None:
    counts: dict[str, int] = {}
    for c in calls:
        c.index = counts.get(c.name, 0)
        counts[c.name] = c.index + 1
    for c in calls:
        c.count = counts[c.name]
