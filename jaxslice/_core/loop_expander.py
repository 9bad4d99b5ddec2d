"""The evaluator `loops.expand` traces with: a program again, its named loops in pieces.

`Expander` gives `jaxprs.Evaluator` its rules for markers, loops and call-like
equations: it runs a jaxpr's equations one by one in the current trace, following a
`loop_requests.Body` (`Ctx.body`). A loop it names is run piece by piece
(`Expander.in_pieces`): the ranges of rows between named iterations as `lax.scan`s, each
named iteration written out equation by equation under its own path, with the markers of
its calls bound again as that iteration's calls (`Expander.record` makes one renamed
`CallRecord` per call and path). Values that stacked names take are collected per piece
(`loop_rows.Frame`) and marked once after the loop, each leaf as one value
(`loop_rows.Run.whole`); calls named as whole iterations of the body's outermost call
are marked on the loop's carry between pieces (`loop_requests.Edge`).

Sharp edge: stacked values computed from parameters alone come from one more scan that
reads parameters alone (`Expander._parameter_stack`); a loop with side effects, or a
carry of random keys, does not get one, and such values are concatenated from the
pieces instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .. import _compat
from .._errors import LoopNotWholeError
from .build import RowMark, boundary_finder
from .jaxprs import Env, Evaluator, Finder, LoopRule, ScanRule, carried_scan, row
from .lifted import body_ports
from .loop_requests import Body, Edge, Loop, carry_ports, merged, only_record, pieces
from .loop_rows import Derived, Fixed, Frame, Run, Stack, concat
from .markers import INPUT, OUTPUT, PLACEHOLDER, CallRecord, Marker
from .names import STACKED, fill, iteration_slot, slot_depths


@dataclasses.dataclass(frozen=True)
class Ctx:
    """Where the equations being run are: in which trace, iteration and stacking loops,
    and what the request names in them."""

    rebind: bool  # markers are bound again: the top-level trace, iterations written out in it
    path: tuple[Any, ...]  # the iteration of each enclosing scan (":" inside a piece)
    frames: tuple[Frame, ...]
    body: Body


class Expander(Evaluator):
    """Runs jaxprs in the current trace with the loops a request names split into pieces,
    keeping the stacked results of loops whose pieces are marked (`stacks`)."""

    def __init__(self, templates: dict[int, str], state_rows: bool = False):
        self.templates = templates
        self.state_rows = state_rows  # mark the pieces of loops at the top level
        self.stacks: dict[int, Stack] = {}  # by id of a loop's stacked result
        self.rows_of: dict[int, tuple[Any, Stack]] = {}  # by id of one row of an outer loop
        self.loops = 0  # loops marked so far
        self.renamed: dict[Any, CallRecord] = {}
        self.markers = boundary_finder()
        self._edges: dict[int, dict[int, Any]] = {}
        self.fixed = Fixed()  # see `loop_rows.Fixed`

    # ------------------------------------------------------------------ equations

    def eqn(self, eqn: Any, ins: list[Any], env: Env, ctx: Ctx) -> list[Any]:
        outs = super().eqn(eqn, ins, env, ctx)
        self.fixed.note(eqn.invars, ins, outs)
        return outs

    def call_side(self, markers: Any, env: Env, ctx: Ctx) -> None:
        """Inside a loop, each marker is the iteration's (`emit`); elsewhere it is bound
        again as it is."""
        for m in markers:
            ins = env.reads(m.invars)
            if ctx.path:
                marker = _compat.marker_payload(m)
                self.emit(marker.record, ctx.path, marker.side, marker.leaf, ins[0], ctx)
                outs = [ins[0]]
            else:
                outs = _compat.bind_eqn(m, ins)
            self.fixed.note(m.invars, ins, outs)
            env.write(m.outvars, outs)

    def loop(self, eqn: Any, rule: LoopRule, ins: list[Any], env: Env, ctx: Ctx) -> list[Any]:
        """A loop the request names (as a whole call, or by its iterations) runs in
        pieces; so does one holding markers inside a loop written out (one piece). Only
        loops with counted iterations (scans) are split; others run as they are."""
        if not isinstance(rule, ScanRule):
            return self.other(eqn, ins, env, ctx)
        whole = ctx.body.wholes.get(id(eqn))
        if whole is not None:
            return self.whole(eqn, rule, ins, whole, ctx)
        loop = ctx.body.loops.get(id(eqn))
        if loop is not None:
            return self.in_pieces(eqn, rule, ins, loop, ctx)
        if self._looks_inside(eqn, ctx):  # a scan not named: one piece, no markers
            return self.in_pieces(eqn, rule, ins, Loop(), ctx)
        return self.other(eqn, ins, env, ctx)

    def call(self, eqn: Any, body: Any, ins: list[Any], env: Env, ctx: Ctx) -> list[Any]:
        """jit, remat, ...: inline where its markers belong to an iteration written out,
        or where it holds a loop to split."""
        if self._looks_inside(eqn, ctx):
            return self.run(body[0], body[1], ins, ctx)
        return self.other(eqn, ins, env, ctx)

    def _looks_inside(self, eqn: Any, ctx: Ctx) -> bool:
        """Inside a loop written out, every equation with markers; at the top level, those
        holding a loop to split."""
        return self.markers.inside(eqn) and (bool(ctx.path) or self._holds(eqn, ctx.body))

    def _holds(self, eqn: Any, body: Body) -> bool:
        """Whether a loop to split is inside `eqn` (a jit around the model, say)."""
        return Finder(lambda e: id(e) in body.loops).inside(eqn)

    def whole(
        self, eqn: Any, rule: ScanRule, ins: list[Any], record: CallRecord, ctx: Ctx
    ) -> list[Any]:
        """A loop named as a whole call (``outer[2]/inner``): the call its body makes
        once per iteration, marked on the loop's own operands and results, which are
        what that call's caller passes and gets back."""
        ports = body_ports(rule.body(eqn)).get(id(record))
        if ports is None or not ports[1][INPUT]:
            raise LoopNotWholeError(name=self.record(record, ctx.path).name)
        for leaf, j in ports[1][INPUT].items():
            self.emit(record, ctx.path, INPUT, leaf, ins[j], ctx)
        outs = self.in_pieces(eqn, rule, ins, ctx.body.loops.get(id(eqn)) or Loop(), ctx)
        for leaf, j in ports[1][OUTPUT].items():
            self.emit(record, ctx.path, OUTPUT, leaf, outs[j], ctx)
        return outs

    # ------------------------------------------------------------------ markers

    def emit(
        self, record: CallRecord, path: tuple[Any, ...], side: str, leaf: int, value: Any, ctx: Ctx
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
            if template is not None and len(slot_depths(template)) > len(path):
                template = _without_last_slot(template)  # the loop as a whole
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

    def in_pieces(self, eqn: Any, rule: ScanRule, ins: list[Any], req: Loop, ctx: Ctx) -> list[Any]:
        run = Run.of(eqn, rule.parts(eqn), ins, req, len(ctx.path), self.fixed)
        edges = self.edges(run.parts, req, ctx)
        cut = pieces(run.parts.length, req.splits, edges, run.parts.reverse)
        token = self._token(ctx)
        numbered = list(enumerate(cut))
        done = {}
        for i, piece in reversed(numbered) if run.parts.reverse else numbered:
            _span_mark(token, "start", i, piece[2])
            done[piece[0]] = self._piece(run, piece, req, edges, ctx)
            _span_mark(token, "stop", i, piece[2])
        rows = [done[a] for a, _, _ in cut]
        if run.frame is not None:
            self._emit_stacked(run, [store for _, store in rows], cut, req, ctx)
        num_ys = len(run.parts.jaxpr.outvars) - run.parts.num_carry
        ys = [concat([r[0][i] for r in rows]) for i in range(num_ys)]
        if token is not None:
            self._keep_stacks(token, cut, [r[0] for r in rows], ys)
        return [*run.carry, *ys]

    def _token(self, ctx: Ctx) -> int | None:
        """A number for a loop whose pieces are marked (one run in the program's own
        trace, not in a piece's scan), or None."""
        if not self.state_rows or not ctx.rebind:
            return None
        self.loops += 1
        return self.loops

    def _keep_stacks(
        self, token: int, cut: list[tuple[int, int, bool]], results: list[list[Any]], ys: list[Any]
    ) -> None:
        """Keeps each stacked result `ys[i]` of loop `token` as the `Stack` of the pieces'
        stacked results ``results[piece][i]`` (for `loop_rows.mark_state_rows`)."""
        ranges = [(a, b) for a, b, _ in cut]
        for i, y in enumerate(ys):
            parts = [r[i] for r in results]
            subs = [self._sub_stack(part) for part in parts]
            self.stacks[id(y)] = Stack(y, token, ranges, parts, subs)

    def _piece(
        self, run: Run, piece: tuple[int, int, bool], req: Loop, edges: dict, ctx: Ctx
    ) -> tuple[list[Any], dict[Any, Any]]:
        """Runs one piece (updating the carry); returns its stacked results and values."""
        a, b, written = piece
        first, last = (b - 1, a) if run.parts.reverse else (a, b - 1)
        self._edge(edges.get(first), INPUT, run, ctx)
        if written:
            ys, store = self.iteration(run, a, merged(req.splits.get(a), req.stacked), ctx)
        else:
            ys, store = self.scan_rows(run, (a, b), req.stacked, ctx)
        self._edge(edges.get(last), OUTPUT, run, ctx)
        return ys, store

    def iteration(self, run: Run, k: int, body: Body, ctx: Ctx) -> tuple[list[Any], dict[Any, Any]]:
        """Iteration `k` written out in the current trace."""
        x_k = run.rows([jax.lax.index_in_dim(x, k, keepdims=False) for x in run.xs])
        local = run.frame.fresh() if run.frame is not None else None
        frames = ctx.frames + ((local,) if local is not None else ())
        sub = Ctx(ctx.rebind, (*ctx.path, k), frames, body)
        parts = run.parts
        outs = self.run(parts.jaxpr, parts.consts, [*run.consts, *run.carry, *x_k], sub)
        run.carry = outs[: parts.num_carry]
        store = {key: run.one_row(v, x_k) for key, v in (local.store if local else {}).items()}
        ys = [y[None] for y in outs[parts.num_carry :]]
        for y, one in zip(outs[parts.num_carry :], ys, strict=True):
            if id(y) in self.stacks:  # an inner loop's stacked result, as one row
                self.rows_of[id(one)] = (one, self.stacks[id(y)])
        return ys, store

    def _sub_stack(self, part: Any) -> Stack | None:
        """The inner loop's stacked result that a written-out iteration's row is."""
        found = self.rows_of.get(id(part))
        return found[1] if found is not None and found[0] is part else None

    def scan_rows(
        self, run: Run, rows: tuple[int, int], body: Body | None, ctx: Ctx
    ) -> tuple[list[Any], dict[Any, Any]]:
        """Iterations ``a:b`` as one scan; stacked names as extra results."""
        a, b = rows
        parts, frame = run.parts, run.frame
        nk = parts.num_carry
        keys: list[Any] = []  # values stacked by the scan
        fixed: dict[Any, Any] = {}  # values that are the loop's constants or xs (`Run.kind`)
        params: set[Any] = set()  # values computed from parameters alone
        # The row index is carried (not scanned over), so that each stacked operand is read
        # with one dynamic slice per iteration, as the scan itself reads its own operands.

        def step(c: list[Any], i: Any, _: Any) -> Any:
            x = run.rows([row(v, i) for v in run.xs])
            local = frame.fresh() if frame is not None else None
            frames = (local,) if local is not None else ()
            sub = Ctx(False, (*ctx.path, STACKED), frames, body or Body())
            outs = self.run(parts.jaxpr, parts.consts, [*run.consts, *c, *x], sub)
            found = local.store if local is not None else {}
            fixed.update((k, run.kind(v, x)) for k, v in found.items())
            keys[:] = [k for k in found if fixed[k] is None]
            params.update(k for k in keys if self.fixed.is_param(found[k]))
            extra = [found[key] for key in keys]
            return outs[:nk], (list(outs[nk:]), extra)

        unroll = _unroll(parts, b - a)
        carry, (ys, extra) = carried_scan(
            step, run.carry, None, rows=rows, reverse=parts.reverse, unroll=unroll
        )
        run.carry = list(carry)
        store = {k: kind for k, kind in fixed.items() if kind is not None}
        store.update(
            (k, Derived(e) if k in params else e) for k, e in zip(keys, extra, strict=True)
        )
        return list(ys), store

    def _emit_stacked(
        self, run: Run, stores: list[dict[Any, Any]], cut: Any, req: Loop, ctx: Ctx
    ) -> None:
        """Each stacked name's values of all pieces, in row order, as one call.

        A parameter stays a parameter, as in one iteration's port: a value that is one
        of the loop's constants in every iteration is that constant, one that is the row
        of a stacked parameter is that parameter, and one computed from parameters alone
        comes from a loop that reads parameters alone (`_parameter_stack`).
        """
        keys = list(stores[0]) if stores else []
        calls = list(dict.fromkeys(key[:2] for key in keys))  # (record, path), in order
        keys.sort(key=lambda key: (calls.index(key[:2]), key[2] != INPUT, key[3]))
        derived = [k for k in keys if all(isinstance(s[k], Derived) for s in stores)]
        params = self._parameter_stack(run, req, ctx) if derived else {}
        ranges = [(a, b) for a, b, _ in cut]
        for key in keys:
            rid, rel, side, leaf = key
            value = run.whole([store[key] for store in stores], ranges, params.get(key))
            self.emit(run.frame.records[rid], (*ctx.path, STACKED, *rel), side, leaf, value, ctx)

    def _parameter_stack(self, run: Run, req: Loop, ctx: Ctx) -> dict[Any, Any]:
        """The stacked values of every iteration that the body computes from parameters
        alone, from one more scan over all iterations in which every other operand is
        zero, so that the scan reads parameters alone (it is dead code in a slice, which
        never takes such a value as an input). Empty for a loop with side effects, which
        would run twice, or a carry of random keys."""
        if _compat.has_effects(run.eqn):
            return {}
        keep = run.fixed.holds
        consts = [c if keep(c) else _zeros(c) for c in run.consts]
        xs = [x if keep(x) else _zeros(x) for x in run.xs]
        carry = [_zeros(c) for c in run.carry]
        if any(v is None for v in (*consts, *carry, *xs)):
            return {}
        alone = dataclasses.replace(run, consts=consts, carry=carry, xs=xs)
        _, store = self.scan_rows(alone, (0, run.parts.length), req.stacked, ctx)
        return {k: v.value for k, v in store.items() if isinstance(v, Derived)}

    # ------------------------------------------------------------------ carry boundaries

    def edges(self, parts: Any, req: Loop, ctx: Ctx) -> dict[int, Any]:
        """Iterations named only as a whole call whose ports are the carry: ``{k: edge}``."""
        if not ctx.rebind:
            return {}
        found = {}
        maps = self._edge_maps(parts)
        for k, body in req.splits.items():
            rid = only_record(body)
            if rid in maps:
                record, ports = maps[rid]
                sides = frozenset(side for _, side in body.targets)
                found[k] = Edge(self.record(record, (*ctx.path, k), sides), ports, sides)
        return found

    def _edge_maps(self, parts: Any) -> dict[int, Any]:
        key = id(parts.jaxpr)
        if key not in self._edges:
            self._edges[key] = carry_ports(parts)
        return self._edges[key]

    def _edge(self, edge: Edge | None, side: str, run: Run, ctx: Ctx) -> None:
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


def _span_mark(token: int | None, kind: str, piece: int, written: bool) -> None:
    """Where the equations of piece `piece` of loop `token` start or stop."""
    if token is not None:
        payload = RowMark(token, kind, piece, written=written)
        _compat.bind_marker(np.zeros((), np.bool_), payload, kind)


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


def _without_last_slot(template: str) -> str:
    """A call's template name without the slot of its innermost loop (that loop as a
    whole, as `names.lifted_template` names it)."""
    last = iteration_slot(max(slot_depths(template)))
    return template[: -len(last)] if template.endswith(last) else template


def _zeros(value: Any) -> np.ndarray | None:
    """A constant of zeros shaped like `value`; None for a value of random keys."""
    dtype = getattr(value, "dtype", None)
    return np.zeros(np.shape(value), dtype) if isinstance(dtype, np.dtype) else None


def _unroll(parts: Any, length: int) -> Any:
    """The scan's `unroll`, at most the number of iterations a piece runs."""
    unroll = parts.unroll
    if isinstance(unroll, int) and not isinstance(unroll, bool):
        return max(1, min(unroll, length))
    return unroll


_compat.register_frames_exclusion(__file__)
