"""Per-iteration boundaries of scans: writing out the iterations a slice names.

A call inside a `scan` body runs once per iteration. A name such as ``layers[2]/attn``
(one iteration) or ``layers[:]/attn`` (every iteration, stacked) is resolved against the
traced graph, where that call is listed once with its loop (a `names.LoopRef`). `expand`
then traces the program again, evaluating its equations one by one, with each loop that
a name points into split into pieces:

* the iterations before and after a named one run as `lax.scan`s over row ranges of the
  stacked operands, so stacked parameters stay whole arrays of the program, and the rows
  a slice does not use get zero gradient;
* a named iteration is written out equation by equation, its markers bound again as the
  iteration's own calls (``layers[2]``, ``layers[2]/attn``, ...), so they are ordinary
  calls of the new graph;
* a named whole iteration of the body's outermost call whose ports are the loop's carry
  and constants (a transformer block) is marked on the carry between two pieces instead,
  so that the pieces around it stay single scans;
* a stacked name is an extra stacked result of every piece, concatenated and marked once
  after the loop.

Loops inside pieces lose their markers, so the re-emitted program holds none. The new
program is built into a graph like any other (`build.build`); the calls it adds are
found there by `CallRecord.key`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _compat
from .._caches import LRU
from .._errors import SliceError
from .build import BoundaryIndex, body_ports, build
from .graph import Graph
from .markers import INPUT, OUTPUT, PLACEHOLDER, CallRecord, Marker
from .names import STACKED, LoopRef, Resolver, fill, parse
from .ports import flat_ports

# --------------------------------------------------------------------------- requests


@dataclasses.dataclass
class _Body:
    """What to do inside one loop body (or the top-level program)."""

    loops: dict[int, _Loop] = dataclasses.field(default_factory=dict)  # by id of the eqn
    targets: set[tuple[int, str]] = dataclasses.field(default_factory=set)  # (record, side)


@dataclasses.dataclass
class _Loop:
    """What to do with one loop equation: iterations to write out, values to stack."""

    splits: dict[int, _Body] = dataclasses.field(default_factory=dict)
    stacked: _Body | None = None


def request(refs: Sequence[LoopRef]) -> _Body:
    """The loops to split, and how, for these names."""
    root = _Body()
    for ref in refs:
        body = root
        for site, index in zip(ref.call.loop.chain(), ref.path, strict=True):
            loop = body.loops.setdefault(id(site.eqn), _Loop())
            if index == STACKED:
                loop.stacked = loop.stacked or _Body()
                body = loop.stacked
            else:
                body = loop.splits.setdefault(index, _Body())
        body.targets.add((id(ref.call.record), ref.side))
    return root


def _merged(a: _Body | None, b: _Body | None) -> _Body:
    """Both requests for one body."""
    if a is None or b is None:
        return a or b or _Body()
    loops = dict(a.loops)
    for key, loop in b.loops.items():
        mine = loops.get(key)
        loops[key] = loop if mine is None else _merged_loop(mine, loop)
    return _Body(loops, a.targets | b.targets)


def _merged_loop(a: _Loop, b: _Loop) -> _Loop:
    splits = dict(a.splits)
    for k, body in b.splits.items():
        splits[k] = _merged(splits.get(k), body)
    stacked = _merged(a.stacked, b.stacked) if a.stacked or b.stacked else None
    return _Loop(splits, stacked)


def _relative_targets(body: _Body, prefix: tuple[Any, ...] = ()) -> set[tuple[int, tuple]]:
    """``(record, path below this body)`` of every name a stacked body holds."""
    found = {(rid, prefix) for rid, _ in body.targets}
    for loop in body.loops.values():
        for k, sub in loop.splits.items():
            found |= _relative_targets(sub, (*prefix, k))
        if loop.stacked is not None:
            found |= _relative_targets(loop.stacked, (*prefix, STACKED))
    return found


# --------------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class _Frame:
    """Collects, for one loop with a stacked name, the values to stack per iteration."""

    depth: int  # paths below this loop start here
    targets: set[tuple[int, tuple]]
    store: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
    records: dict[int, CallRecord] = dataclasses.field(default_factory=dict)

    def fresh(self) -> _Frame:
        return _Frame(self.depth, self.targets, {}, self.records)


@dataclasses.dataclass(frozen=True)
class _Ctx:
    rebind: bool  # markers are bound again: the top-level trace, iterations written out in it
    path: tuple[Any, ...]  # the iteration of each enclosing scan (":" inside a piece)
    frames: tuple[_Frame, ...]


class _Expander:
    def __init__(self, templates: dict[int, str]):
        self.templates = templates
        self.renamed: dict[Any, CallRecord] = {}
        self.markers = BoundaryIndex()
        self._edges: dict[int, dict[int, Any]] = {}
        self.free: set[int] = set()  # see `_Run.free`

    # ------------------------------------------------------------------ equations

    def run(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], body: _Body, ctx: _Ctx
    ) -> list[Any]:
        env: dict[Any, Any] = {}
        _write(env, jaxpr.constvars, consts)
        _write(env, jaxpr.invars, args)
        for eqn in jaxpr.eqns:
            ins = [_read(env, a) for a in eqn.invars]
            _write(env, eqn.outvars, self.eqn(eqn, ins, body, ctx))
        return [_read(env, a) for a in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list[Any], body: _Body, ctx: _Ctx) -> list[Any]:
        marker = _compat.marker_payload(eqn)
        if marker is not None and ctx.path:
            self.emit(marker.record, ctx.path, marker.side, marker.leaf, ins[0], ctx)
            return [ins[0]]
        loop = body.loops.get(id(eqn))
        if loop is not None:
            return self.loop(eqn, ins, loop, ctx)
        if marker is None and self._looks_inside(eqn, body, ctx):
            return self._inside(eqn, ins, body, ctx)
        return _compat.bind_eqn(eqn, ins)

    def _looks_inside(self, eqn: Any, body: _Body, ctx: _Ctx) -> bool:
        """Inside a loop written out, every equation with markers; at the top level, those
        holding a loop to split."""
        return self.markers.inside(eqn) and (bool(ctx.path) or self._holds(eqn, body))

    def _inside(self, eqn: Any, ins: list[Any], body: _Body, ctx: _Ctx) -> list[Any]:
        inner = _compat.call_body(eqn)
        if inner is not None:  # jit, remat, ...: its markers belong to this iteration
            return self.run(inner[0], inner[1], ins, body, ctx)
        if _compat.loop_primitive(eqn) == "scan":  # a scan not named: one piece, no markers
            return self.loop(eqn, ins, _Loop(), ctx)
        return _compat.bind_eqn(eqn, ins)

    def _holds(self, eqn: Any, body: _Body) -> bool:
        """Whether a loop to split is inside `eqn` (a jit around the model, say)."""
        return any(_finds(j, body.loops.keys()) for j in _compat.subjaxprs(eqn))

    # ------------------------------------------------------------------ markers

    def emit(
        self, record: CallRecord, path: tuple[Any, ...], side: str, leaf: int, value: Any, ctx: _Ctx
    ) -> None:
        """One marker of an iteration's call (or of a stacked one): kept for the loops that
        stack it, and bound again under the iteration's name where markers are bound."""
        rid = id(record)
        for frame in ctx.frames:
            rel = path[frame.depth :]
            if (rid, rel) in frame.targets:
                frame.store[(rid, rel, side, leaf)] = value
                frame.records[rid] = record
        if ctx.rebind:
            _compat.bind_marker(value, Marker(self.record(record, path), side, leaf), side)

    def record(self, record: CallRecord, path: tuple[Any, ...], sides: Any = None) -> CallRecord:
        """The copy of `record` for the iteration(s) `path` (one object per call)."""
        key = (id(record), path)
        found = self.renamed.get(key)
        if found is None:
            template = self.templates.get(id(record))
            if template is not None:
                display = fill(template, path)
            else:
                display = record.name + "".join(f"[{k}]" for k in path)
            found = dataclasses.replace(record, display=display, key=key)
            if sides is not None:
                found = _with_sides(found, sides)
            self.renamed[key] = found
        return found

    # ------------------------------------------------------------------ loops

    def loop(self, eqn: Any, ins: list[Any], req: _Loop, ctx: _Ctx) -> list[Any]:
        run = _Run.of(eqn, ins, req, ctx, self.free)
        edges = self.edges(run.parts, req, ctx)
        pieces = _pieces(run.parts.length, req.splits, edges, run.parts.reverse)
        done = {}
        for piece in reversed(pieces) if run.parts.reverse else pieces:
            done[piece[0]] = self._piece(run, piece, req, edges, ctx)
        rows = [done[a] for a, _, _ in pieces]
        if run.frame is not None:
            self._emit_stacked(run, [store for _, store in rows], ctx)
        num_ys = len(run.parts.jaxpr.outvars) - run.parts.num_carry
        return [*run.carry, *(_concat([r[0][i] for r in rows]) for i in range(num_ys))]

    def _piece(
        self, run: _Run, piece: tuple[int, int, bool], req: _Loop, edges: dict, ctx: _Ctx
    ) -> tuple[list[Any], dict[Any, Any]]:
        """Runs one piece (updating the carry); returns its stacked results and values."""
        a, b, written = piece
        first, last = (b - 1, a) if run.parts.reverse else (a, b - 1)
        self._edge(edges.get(first), INPUT, run, ctx)
        if written:
            ys, store = self.iteration(run, a, _merged(req.splits.get(a), req.stacked), ctx)
        else:
            ys, store = self.scan_rows(run, (a, b), req.stacked, ctx)
        self._edge(edges.get(last), OUTPUT, run, ctx)
        return ys, store

    def iteration(
        self, run: _Run, k: int, body: _Body, ctx: _Ctx
    ) -> tuple[list[Any], dict[Any, Any]]:
        """Iteration `k` written out in the current trace."""
        x_k = [jax.lax.index_in_dim(x, k, keepdims=False) for x in run.xs]
        local = run.frame.fresh() if run.frame is not None else None
        frames = ctx.frames + ((local,) if local is not None else ())
        sub = _Ctx(ctx.rebind, (*ctx.path, k), frames)
        parts = run.parts
        outs = self.run(parts.jaxpr, parts.consts, [*run.consts, *run.carry, *x_k], body, sub)
        run.carry = outs[: parts.num_carry]
        store = {key: run.one_row(v) for key, v in (local.store if local else {}).items()}
        return [y[None] for y in outs[parts.num_carry :]], store

    def scan_rows(
        self, run: _Run, rows: tuple[int, int], body: _Body | None, ctx: _Ctx
    ) -> tuple[list[Any], dict[Any, Any]]:
        """Iterations ``a:b`` as one scan; stacked names as extra results."""
        a, b = rows
        parts, frame = run.parts, run.frame
        nk = parts.num_carry
        keys: list[Any] = []  # values stacked by the scan
        consts: dict[Any, int | None] = {}  # values that are the loop's constants
        # The row index is carried (not scanned over), so that each stacked operand is read
        # with one dynamic slice per iteration, as the scan itself reads its own operands.
        first, move = (b - 1, -1) if parts.reverse else (a, 1)

        def step(state: tuple[list[Any], Any], _: Any) -> Any:
            c, i = state
            x = [_row(v, i) for v in run.xs]
            local = frame.fresh() if frame is not None else None
            sub = _Ctx(False, (*ctx.path, STACKED), (local,) if local is not None else ())
            outs = self.run(parts.jaxpr, parts.consts, [*run.consts, *c, *x], body or _Body(), sub)
            found = local.store if local is not None else {}
            consts.update((k, run.const_index(v)) for k, v in found.items())
            keys[:] = [k for k in found if consts[k] is None]
            extra = [found[key] for key in keys]
            return (list(outs[:nk]), i + move), (list(outs[nk:]), extra)

        start = (list(run.carry), jax.numpy.int32(first))
        (carry, _), (ys, extra) = jax.lax.scan(
            step, start, None, length=b - a, reverse=parts.reverse, unroll=_unroll(parts, b - a)
        )
        run.carry = list(carry)
        store = {k: _Const(j) for k, j in consts.items() if j is not None}
        store.update(zip(keys, extra, strict=True))
        return list(ys), store

    def _emit_stacked(self, run: _Run, stores: list[dict[Any, Any]], ctx: _Ctx) -> None:
        """Each stacked name's values of all pieces, in row order, as one call. A value
        that is one of the loop's constants in every iteration is that constant (a
        parameter stays a parameter, as in one iteration's port)."""
        keys = list(stores[0]) if stores else []
        calls = list(dict.fromkeys(key[:2] for key in keys))  # (record, path), in order
        keys.sort(key=lambda key: (calls.index(key[:2]), key[2] != INPUT, key[3]))
        for key in keys:
            rid, rel, side, leaf = key
            first = stores[0][key]
            if isinstance(first, _Const):
                value = run.consts[first.index]
            else:
                value = _concat([store[key] for store in stores])
            self.emit(run.frame.records[rid], (*ctx.path, STACKED, *rel), side, leaf, value, ctx)

    # ------------------------------------------------------------------ carry boundaries

    def edges(self, parts: Any, req: _Loop, ctx: _Ctx) -> dict[int, Any]:
        """Iterations named only as a whole call whose ports are the carry: ``{k: edge}``."""
        if not ctx.rebind:
            return {}
        found = {}
        maps = self._edge_maps(parts)
        for k, body in req.splits.items():
            rid = _only_record(body)
            if rid in maps:
                record, ports = maps[rid]
                sides = frozenset(side for _, side in body.targets)
                found[k] = _Edge(self.record(record, (*ctx.path, k), sides), ports, sides)
        return found

    def _edge_maps(self, parts: Any) -> dict[int, Any]:
        key = id(parts.jaxpr)
        if key not in self._edges:
            self._edges[key] = _carry_ports(parts)
        return self._edges[key]

    def _edge(self, edge: _Edge | None, side: str, run: _Run, ctx: _Ctx) -> None:
        """Marks one side of an iteration named as a whole call on the loop's carry."""
        if edge is None or side not in edge.sides:
            return
        record = edge.record
        if side == OUTPUT and INPUT not in edge.sides:
            _placeholder(record, INPUT)
        sources = {"const": run.consts, "carry": run.carry}
        leaves = edge.ports[side]
        for leaf, (kind, i) in leaves:
            _compat.bind_marker(sources[kind][i], Marker(record, side, leaf), side)
        if not leaves:
            _placeholder(record, side)


@dataclasses.dataclass(frozen=True)
class _Const:
    """A stacked name's leaf that is the loop's constant operand `index`."""

    index: int


@dataclasses.dataclass
class _Run:
    """A loop equation being run piece by piece: its operands and its carry so far."""

    parts: Any
    consts: list[Any]
    carry: list[Any]
    xs: list[Any]
    frame: _Frame | None  # collects stacked names' values, if any
    free: set[int]  # ids of the program's variables, random keys and constants

    def one_row(self, value: Any) -> Any:
        """A value of one iteration as a piece of one row (or the constant it is)."""
        const = self.const_index(value)
        return _Const(const) if const is not None else value[None]

    def const_index(self, value: Any) -> int | None:
        """Which of the loop's constant operands `value` is, if it is one that is also
        a variable or constant of the program (which no port takes as an input)."""
        if id(value) not in self.free:
            return None
        return next((j for j, c in enumerate(self.consts) if c is value), None)

    @classmethod
    def of(cls, eqn: Any, ins: list[Any], req: _Loop, ctx: _Ctx, free: set[int]) -> _Run:
        parts = _compat.scan_parts(eqn)
        nc, nk = parts.num_consts, parts.num_carry
        frame = None
        if req.stacked is not None:
            frame = _Frame(len(ctx.path) + 1, _relative_targets(req.stacked))
        return cls(parts, ins[:nc], ins[nc : nc + nk], ins[nc + nk :], frame, free)


def _unroll(parts: Any, length: int) -> Any:
    """The scan's `unroll`, at most the number of iterations a piece runs."""
    unroll = parts.unroll
    if isinstance(unroll, int) and not isinstance(unroll, bool):
        return max(1, min(unroll, length))
    return unroll


@dataclasses.dataclass(frozen=True)
class _Edge:
    record: CallRecord
    ports: dict[str, list[tuple[int, tuple[str, int]]]]
    sides: frozenset[str]


def _only_record(body: _Body) -> int | None:
    """The one call an iteration's request names, if it names one call and no loop."""
    rids = {rid for rid, _ in body.targets}
    return next(iter(rids)) if len(rids) == 1 and not body.loops else None


def results_depend(eqn: Any, given: Sequence[int], others: Sequence[int]) -> bool:
    """Whether results `others` of a loop (or any equation) are computed, in the same
    iteration, from the values of its results `given` (True where it cannot be told)."""
    body = _body_of(eqn)
    if body is None:
        return True
    tainted = {body.outvars[k] for k in given} - {None}
    for inner in body.eqns:
        if _reads(inner, tainted):
            tainted.update(inner.outvars)
    return any(_reads_var(body.outvars[k], tainted) for k in others)


def _body_of(eqn: Any) -> Any:
    """The body of a scan or of a call-like equation, or None."""
    if _compat.loop_primitive(eqn) == "scan":
        return _compat.scan_parts(eqn).jaxpr
    inner = _compat.call_body(eqn)
    return inner[0] if inner is not None else None


def _reads(eqn: Any, values: set[Any]) -> bool:
    return any(_reads_var(a, values) for a in eqn.invars)


def _reads_var(atom: Any, values: set[Any]) -> bool:
    return not _compat.is_literal(atom) and atom in values


def _placeholder(record: CallRecord, side: str) -> None:
    _compat.bind_marker(np.zeros((), np.bool_), Marker(record, side, PLACEHOLDER), side)


def _with_sides(record: CallRecord, sides: frozenset[str]) -> CallRecord:
    """A record with the sides not asked for left empty (no silent ``None`` leaves)."""
    if INPUT not in sides:
        empty = jax.tree_util.tree_structure(((), {}))
        record = dataclasses.replace(record, in_tree=empty, in_is_array=())
    if OUTPUT not in sides:
        empty = jax.tree_util.tree_structure(())
        record = dataclasses.replace(record, out_tree=empty, out_is_array=(), out_statics={})
    return record


def _carry_ports(parts: Any) -> dict[int, Any]:
    """Records called directly in a scan body, once, whose array inputs are the body's
    constants or carry and whose array outputs are its carry results.

    Returns ``{id(record): (record, {side: [(leaf, (kind, index))]})}``.
    """
    found = {}
    for rid, (record, ports) in body_ports(parts.jaxpr).items():
        sides = {side: _carry_sources(side, leaves, parts) for side, leaves in ports.items()}
        if all(sources is not None for sources in sides.values()):
            found[rid] = (record, sides)
    return found


def _carry_sources(side: str, leaves: dict[int, int], parts: Any) -> list[Any] | None:
    """``[(leaf, (kind, index))]`` for leaves that are constants or carry, else None."""
    nc, nk = parts.num_consts, parts.num_carry
    out = []
    for leaf, j in leaves.items():
        if side == OUTPUT:
            source = ("carry", j) if j < nk else None
        elif j < nc:
            source = ("const", j)
        else:
            source = ("carry", j - nc) if j < nc + nk else None
        if source is None:
            return None
        out.append((leaf, source))
    return out


def _pieces(
    length: int, splits: dict[int, Any], edges: dict[int, _Edge], reverse: bool
) -> list[tuple[int, int, bool]]:
    """Row ranges ``(a, b, written_out)`` covering ``0:length`` in ascending order."""
    cuts = {0, length}
    written = {k for k in splits if k not in edges}
    for k in written:
        cuts |= {k, k + 1}
    for k, edge in edges.items():
        cuts |= _edge_cuts(k, edge.sides, reverse)
    ordered = sorted(cuts)
    pairs = zip(ordered[:-1], ordered[1:], strict=True)
    return [(a, b, a in written and b == a + 1) for a, b in pairs]


def _edge_cuts(k: int, sides: frozenset[str], reverse: bool) -> set[int]:
    """Where pieces must end for iteration `k`'s input (before it) and output (after it)."""
    before, after = (k + 1, k) if reverse else (k, k + 1)
    return {cut for side, cut in ((INPUT, before), (OUTPUT, after)) if side in sides}


def _row(stacked: Any, i: Any) -> Any:
    """Row `i` (a traced, non-negative index) of a stacked operand."""
    return jax.lax.dynamic_index_in_dim(stacked, i, keepdims=False, allow_negative_indices=False)


def _concat(values: list[Any]) -> Any:
    return values[0] if len(values) == 1 else jax.numpy.concatenate(values, axis=0)


def _finds(jaxpr: Any, eqn_ids: Any) -> bool:
    """Whether an equation with one of `eqn_ids` is in `jaxpr` (at any depth)."""
    return any(
        id(e) in eqn_ids or any(_finds(j, eqn_ids) for j in _compat.subjaxprs(e))
        for e in jaxpr.eqns
    )


def _read(env: dict[Any, Any], atom: Any) -> Any:
    return _compat.literal_value(atom) if _compat.is_literal(atom) else env[atom]


def _write(env: dict[Any, Any], atoms: Sequence[Any], values: Sequence[Any]) -> None:
    for v, x in zip(atoms, values, strict=True):
        if not _compat.is_dropvar(v):
            env[v] = x


# --------------------------------------------------------------------------- entry


def loop_refs(graph: Graph, start: Any, end: Any) -> list[LoopRef]:
    """The names in `start` and `end` that pick iterations of calls inside scans."""
    resolver = Resolver(graph)
    specs = [(spec, INPUT) for spec in _specs(start)]
    specs += [(_name_of(spec), OUTPUT) for spec in _specs(end)]
    found = [(spec, resolver.loop_ref(spec, port)) for spec, port in specs]
    refs = [ref for _, ref in found if ref is not None]
    if refs:
        _check_wholes(graph, resolver, [spec for spec, ref in found if ref is None], refs)
    return refs


MIXED = (
    "{whole!r} is a scanned module as a whole and {one!r} one of its iterations; one slice "
    "cannot name both. Name the loop's ends by iteration instead: {first!r} for its input "
    "and {last!r} for its result."
)


def _check_wholes(graph: Graph, resolver: Resolver, specs: list[Any], refs: list[LoopRef]) -> None:
    """A lifted module as a whole cannot be named with one of its own iterations (the
    loop is written out in pieces, so it is no longer one call)."""
    split = {id(ref.call.loop.chain()[0].eqn): ref for ref in refs}
    for spec in specs:
        loop = _lifted_loop(graph, resolver, spec)
        ref = split.get(id(loop.eqn)) if loop is not None else None
        if ref is not None:
            base = parse(spec)[0]
            first, last = f"{base}[0]:input", f"{base}[-1]:output"
            raise SliceError(MIXED.format(whole=spec, one=ref.spec, first=first, last=last))


def _lifted_loop(graph: Graph, resolver: Resolver, spec: Any) -> Any:
    """The loop a name of a lifted module as a whole stands for, or None."""
    try:
        whole, _ = resolver.resolve(spec, OUTPUT)
    except SliceError:  # not a name of a call (None, or wrong: reported when planning)
        return None
    if whole.loop is not None or whole.record is None:
        return None
    body = next((c for c in graph.calls if c.record is whole.record and c.loop), None)
    return body.loop.chain()[0] if body is not None else None


def _specs(spec: Any) -> list[Any]:
    """The names of a `start` or `end` (one, a list, a tuple or a dict of them)."""
    return flat_ports(tuple(spec) if isinstance(spec, list) else spec)


def _name_of(spec: Any) -> Any:
    return getattr(spec, "name", spec) if not isinstance(spec, str) else spec


def written_out(graph: Graph) -> Graph:
    """The graph with every iteration of every scan that holds boundaries written out, so
    that each iteration's calls are ordinary calls (what an interpreter walks)."""
    refs = [ref for call in graph.calls for ref in _every_iteration(call)]
    return expanded(graph, refs) if refs else graph


def _every_iteration(call: Any) -> list[LoopRef]:
    """A name for each iteration of a call inside scans (none for other calls)."""
    sites = call.loop.chain() if call.template is not None else []
    if not sites or any(site.length is None for site in sites):
        return []
    paths = itertools.product(*(range(site.length) for site in sites))
    return [LoopRef(f"{fill(call.template, p)}@{call.index}", call, p, INPUT) for p in paths]


#: expanded graphs kept per traced graph (one per set of names)
MAX_EXPANSIONS = 8


def expanded(graph: Graph, refs: Sequence[LoopRef]) -> Graph:
    """`expand`, remembered per graph and names."""
    key = tuple((ref.spec, ref.key, ref.side) for ref in refs)
    cache = graph.__dict__.get("_expanded")
    if cache is None:
        cache = graph.__dict__.setdefault("_expanded", LRU(MAX_EXPANSIONS))
    found = cache.get(key)
    if found is None:
        found = expand(graph, refs)
        cache.put(key, found)
    return found


def expand(graph: Graph, refs: Sequence[LoopRef]) -> Graph:
    """A graph of the same program with the loops `refs` point into written out; each
    name in `refs` is an alias of its call there."""
    closed, signature, name_scopes = graph.source
    templates = {id(c.record): c.template for c in graph.calls if c.template is not None}
    expander = _Expander(templates)
    root = request(refs)
    jaxpr, consts = _compat.open_jaxpr(closed)

    num_free = len(signature.variable_paths) + signature.num_rngs

    def program(*args: Any) -> list[Any]:
        expander.free = {id(x) for x in (*args[:num_free], *consts)}
        return expander.run(jaxpr, consts, args, root, _Ctx(True, (), ()))

    avals = [_spec(v) for v in jaxpr.invars]
    expanded, _ = _compat.make_jaxpr(program, *avals)
    new = build(expanded, signature, name_scopes=name_scopes)
    new.partial = graph.partial
    new.aliases = _aliases(new, refs)
    return new


def _aliases(graph: Graph, refs: Sequence[LoopRef]) -> dict[tuple[str, int | None], Any]:
    """Each name of `refs` (without its port) -> its call in the expanded `graph`."""
    by_key = {_key(c): c for c in graph.calls}
    lost = [ref.spec for ref in refs if ref.key not in by_key]
    if lost:
        raise SliceError(LOST.format(names=lost))
    return {parse(ref.spec)[:2]: by_key[ref.key] for ref in refs}


def _key(call: Any) -> Any:
    """How a call written out by `expand` is known (None for other calls)."""
    return getattr(call.record, "key", None)


LOST = (
    "The iteration(s) {names} could not be found again once their loop was written out "
    "(a call whose values the loop body does not use, say). Slice at an enclosing call."
)


def _spec(var: Any) -> Any:
    aval = _compat.aval_of(var)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


_compat.register_frames_exclusion(__file__)
