"""jaxslice's own view of a traced program.

Model: values are integer ids (nodes) and equations are edges from the values they read
to the values they write, in program order. The graph is flat: call-like equations (jit,
remat, custom_jvp/vjp) whose bodies contain module calls are inlined, each inlining with
fresh ids, so a boundary inside a jitted function is an ordinary value here. Loops and
conditionals stay single equations; module calls inside their bodies are listed with
`loop` set, and cannot be sliced at.

Constants (closed-over arrays and literals) are values with a known value. The program's
invars are split into variables (the model's parameters and state, each with its key path),
random keys, and inputs.

A `Call` is one module call: its name, call index, the value ids of its input and output
leaves, and the equation span it covers. Calls come from marker equations (linen, NNX and
`js.mark`) or, for plain functions, from `jax.named_scope` regions.

Sharp edge: a region found only through the name stack cannot tell two back-to-back calls
of the same scope apart; `js.mark` can.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import _compat, _markers


@dataclasses.dataclass(eq=False)
class Eqn:
    """One equation of the flat program."""

    jax_eqn: Any
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    scopes: tuple[str, ...]

    @property
    def primitive(self) -> str:
        return _compat.primitive_name(self.jax_eqn)


class Slot:
    """Stands for one leaf of a call's pytree: a value id, or a fixed non-array value."""

    __slots__ = ("id", "static")

    def __init__(self, id: int | None, static: Any = None):
        self.id = id
        self.static = static

    def __repr__(self) -> str:
        return f"Slot({self.id})" if self.id is not None else f"Slot(static={self.static!r})"


@dataclasses.dataclass(eq=False)
class Call:
    """One module call (a boundary occurrence) in the flat program."""

    name: str
    index: int
    module_type: str
    method: str
    kind: str
    in_tree: Any
    in_slots: list[Slot]
    out_tree: Any
    out_slots: list[Slot]
    start: int  # index of the first equation of the call
    stop: int  # index one past its last equation
    loop: str | None = None  # primitive of the enclosing loop, if inside one
    count: int = 1  # how many calls share `name`
    path: tuple[str, ...] = ()
    # Order of the call's first input marker and last output marker among all markers;
    # orders events that share an equation position. None for name-scope regions.
    in_seq: float = float("inf")
    out_seq: float = float("-inf")

    @property
    def qualname(self) -> str:
        return self.name if self.count == 1 else f"{self.name}@{self.index}"

    def port_tree(self, side: str) -> Any:
        """The call's pytree on one side, with `Slot` leaves."""
        if side == _markers.INPUT:
            return jax.tree_util.tree_unflatten(self.in_tree, self.in_slots)
        return jax.tree_util.tree_unflatten(self.out_tree, self.out_slots)


@dataclasses.dataclass(eq=False)
class Region:
    """An inlined call-like equation (jit, remat, custom_jvp/vjp): the equation itself, with
    the ids of its operands and results, and the span of equations it was inlined into.

    A slice that needs the region but starts and ends outside it runs the original
    equation instead of its inlined body, which keeps custom derivative rules, remat
    policies and jit boundaries.
    """

    eqn: Eqn
    start: int
    stop: int


@dataclasses.dataclass(eq=False)
class Graph:
    """A traced program, flattened."""

    avals: list[Any] = dataclasses.field(default_factory=list)
    consts: dict[int, Any] = dataclasses.field(default_factory=dict)
    eqns: list[Eqn] = dataclasses.field(default_factory=list)
    variable_ids: list[int] = dataclasses.field(default_factory=list)
    variable_paths: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    rng_ids: list[int] = dataclasses.field(default_factory=list)
    input_ids: list[int] = dataclasses.field(default_factory=list)
    input_tree: Any = None  # treedef of (args, kwargs) with all leaves
    input_slots: list[Slot] = dataclasses.field(default_factory=list)
    out_slots: list[Slot] = dataclasses.field(default_factory=list)
    out_tree: Any = None
    state_paths: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    state_ids: list[int] = dataclasses.field(default_factory=list)
    calls: list[Call] = dataclasses.field(default_factory=list)
    regions: list[Region] = dataclasses.field(default_factory=list)
    partial: bool = False  # traced only up to a slice's ends (no model output)
    producer: dict[int, int] = dataclasses.field(default_factory=dict)

    def new_value(self, aval: Any) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def new_const(self, value: Any) -> int:
        vid = self.new_value(jax.typeof(value) if _is_jax_value(value) else None)
        self.consts[vid] = value
        return vid

    @property
    def variable_set(self) -> frozenset[int]:
        return frozenset(self.variable_ids)

    def is_free(self, vid: int) -> bool:
        """Values a slice never has to compute: constants, variables and random keys."""
        return vid in self.consts or vid in self._free

    @property
    def _free(self) -> frozenset[int]:
        cached = self.__dict__.get("_free_cache")
        if cached is None:
            cached = frozenset(self.variable_ids) | frozenset(self.rng_ids)
            self.__dict__["_free_cache"] = cached
        return cached

    def model_input_call(self) -> Call:
        """The model's own inputs as a pseudo call (used for `start=None`)."""
        return Call(
            name="<inputs>",
            index=0,
            module_type="",
            method="",
            kind="model",
            in_tree=self.input_tree,
            in_slots=self.input_slots,
            out_tree=self.input_tree,
            out_slots=self.input_slots,
            start=0,
            stop=0,
        )


def innermost(calls: Sequence[Call], num_eqns: int) -> list[Call | None]:
    """For each equation position, the innermost of `calls` whose span holds it.

    Calls are visited outer to inner (by start, then longer span first, then call order),
    so an inner call's span overwrites its parent's.
    """
    owner: list[Call | None] = [None] * num_eqns
    for call in sorted(calls, key=lambda c: (c.start, -c.stop, c.in_seq)):
        for i in range(call.start, call.stop):
            owner[i] = call
    return owner


def describe_aval(aval: Any) -> str:
    """``float32[8, 16]``: how jaxslice prints a shape and dtype everywhere."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return str(aval)
    return f"{dtype}{list(shape)}"


def _is_jax_value(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


# --------------------------------------------------------------------------- building


@dataclasses.dataclass
class _Occurrence:
    record_id: int
    side: str
    leaf: int
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
        hit = self._marker_memo.get(key)
        if hit is None:
            hit = any(
                _compat.marker_key(e) is not None
                or (self.scopes and bool(_compat.eqn_scopes(e)))
                or any(self.has_marker(s) for s in _compat.subjaxprs(e))
                for e in jaxpr.eqns
            )
            self._marker_memo[key] = hit
        return hit

    def read(self, env: dict[Any, int], atom: Any) -> int:
        if _compat.is_literal(atom):
            return self.g.new_const(_compat.literal_value(atom))
        return env[atom]

    def walk(self, jaxpr: Any, env: dict[Any, int], prefix: tuple[str, ...]) -> None:
        g = self.g
        for eqn in jaxpr.eqns:
            scopes = prefix + _compat.eqn_scopes(eqn)
            key = _compat.marker_key(eqn)
            if key is not None:
                rid, side, leaf = _markers.parse_key(key)
                vid = None if leaf == _markers.PLACEHOLDER else self.read(env, eqn.invars[0])
                self.occurrences.append(
                    _Occurrence(rid, side, leaf, vid, len(g.eqns), scopes, None)
                )
                continue
            body = _compat.call_body(eqn) if self.has_marker_eqn(eqn) else None
            if body is not None:
                self.inline(eqn, body, env, scopes)
                continue
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

    def has_marker_eqn(self, eqn: Any) -> bool:
        return any(self.has_marker(s) for s in _compat.subjaxprs(eqn))

    def inline(
        self,
        eqn: Any,
        body: tuple[Any, Sequence[Any]],
        env: dict[Any, int],
        scopes: tuple[str, ...],
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
        self.g.regions.append(
            Region(Eqn(eqn, tuple(ins), tuple(outs), scopes), start, len(self.g.eqns))
        )

    def collect_loop_markers(self, eqn: Any, scopes: tuple[str, ...], pos: int, loop: str) -> None:
        for sub in _compat.subjaxprs(eqn):
            for inner in sub.eqns:
                key = _compat.marker_key(inner)
                inner_scopes = scopes + _compat.eqn_scopes(inner)
                if self.scopes:
                    for k in range(len(scopes), len(inner_scopes)):
                        self.loop_scopes.setdefault(inner_scopes[: k + 1], (pos, loop))
                if key is not None:
                    rid, side, leaf = _markers.parse_key(key)
                    self.occurrences.append(
                        _Occurrence(rid, side, leaf, None, pos, inner_scopes, loop)
                    )
                elif self.has_marker_eqn(inner):
                    self.collect_loop_markers(inner, inner_scopes, pos, loop)


def build(
    closed_jaxpr: Any,
    *,
    variable_paths: Sequence[tuple[Any, ...]],
    num_rngs: int,
    input_tree: Any,
    input_is_array: Sequence[bool],
    input_statics: Sequence[Any],
    out_tree: Any,
    out_statics: dict[int, Any],
    state_paths: Sequence[tuple[Any, ...]] = (),
    name_scopes: bool = False,
) -> Graph:
    """Flattens a traced program whose invars are (variables, rngs, array inputs)."""
    b = _Builder(scopes=name_scopes)
    g = b.g
    jaxpr, consts = _compat.open_jaxpr(closed_jaxpr)
    env: dict[Any, int] = {}
    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = g.new_const(c)
    invars = list(jaxpr.invars)
    nv = len(variable_paths)
    for i, v in enumerate(invars):
        env[v] = g.new_value(_compat.aval_of(v))
        if i < nv:
            g.variable_ids.append(env[v])
        elif i < nv + num_rngs:
            g.rng_ids.append(env[v])
        else:
            g.input_ids.append(env[v])
    g.variable_paths = list(variable_paths)
    g.input_tree = input_tree
    ids = iter(g.input_ids)
    statics = iter(input_statics)
    g.input_slots = [
        Slot(next(ids)) if arr else Slot(None, next(statics)) for arr in input_is_array
    ]
    b.walk(jaxpr, env, ())
    g.out_tree = out_tree
    outs = iter(jaxpr.outvars)
    g.out_slots = []
    for i in range(out_tree.num_leaves):
        if i in out_statics:
            g.out_slots.append(Slot(None, out_statics[i]))
        else:
            g.out_slots.append(Slot(b.read(env, next(outs))))
    g.state_paths = list(state_paths)
    g.state_ids = [b.read(env, v) for v in outs]
    assert len(g.state_ids) == len(g.state_paths)
    g.calls = _whole_loops(g, _calls_from_markers(b.occurrences))
    if name_scopes:
        marked = {c.name for c in g.calls}
        g.calls += [c for c in _calls_from_scopes(g) if c.name not in marked]
        known = {c.name for c in g.calls}
        for scope, (pos, loop) in b.loop_scopes.items():
            name = "/".join(scope)
            if name not in known:
                known.add(name)
                empty = jax.tree_util.tree_structure(((), {}))
                g.calls.append(
                    Call(
                        name,
                        0,
                        "named_scope",
                        "",
                        "scope",
                        empty,
                        [],
                        empty,
                        [],
                        pos,
                        pos + 1,
                        loop,
                        path=scope,
                    )
                )
        # Same span: marked calls in marker order, then scope regions outer first.
        g.calls.sort(
            key=lambda c: (
                c.start,
                -c.stop,
                c.kind == "scope",
                len(c.path) if c.kind == "scope" else 0,
            )
        )
    _number_calls(g.calls)
    return g


def _calls_from_markers(occurrences: list[_Occurrence]) -> list[Call]:
    """Groups marker occurrences into calls: inputs, then the body, then outputs."""
    calls: list[Call] = []
    open_by_record: dict[
        int, tuple[Call, _markers.CallRecord, dict[int, int | None], dict[int, int | None]]
    ] = {}
    pending: list[
        tuple[Call, _markers.CallRecord, dict[int, int | None], dict[int, int | None]]
    ] = []
    for seq, occ in enumerate(occurrences):
        record = _markers.lookup(occ.record_id)
        if record is None:
            continue
        state = open_by_record.get(occ.record_id)
        if occ.side == _markers.INPUT:
            if state is None or state[3] or occ.leaf in state[2]:
                name = _call_name(record, occ.scopes)
                call = Call(
                    name=name,
                    index=0,
                    module_type=record.module_type,
                    method=record.method,
                    kind=record.kind,
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
                state = (call, record, {}, {})
                open_by_record[occ.record_id] = state
                calls.append(call)
                pending.append(state)
            state[2][occ.leaf] = occ.vid
        else:
            if state is None:  # an output without its input: the input was dead code
                continue
            state[3][occ.leaf] = occ.vid
            state[0].stop = occ.pos
            state[0].out_seq = seq
    for state in pending:
        _finish(*state)
    return calls


def _whole_loops(g: Graph, calls: list[Call]) -> list[Call]:
    """A lifted module (linen `nn.scan`, say) as a whole: the loop equation's own ports.

    Inside the loop body each call is one iteration; the outermost module of a loop that
    is called nowhere else *is* the loop (its outer call is the lifted transform), so it
    gets a boundary whose inputs are the loop's non-constant operands and whose output is
    the tuple of the loop's results. Calls nested in it stay per-iteration (not sliceable).
    """
    outside = {c.name for c in calls if c.loop is None}
    out: list[Call] = []
    seen_loops: dict[int, list[Call]] = {}
    for c in calls:
        if c.loop is None or c.kind not in ("linen", "nnx") or c.name in outside:
            out.append(c)
            continue
        siblings = seen_loops.setdefault(c.start, [])
        if any(c.path[: len(o.path)] == o.path for o in siblings):
            out.append(c)
            continue
        eqn = g.eqns[c.start]
        n_in, n_out = len(eqn.ins), len(eqn.outs)
        whole = dataclasses.replace(
            c,
            loop=None,
            in_tree=jax.tree_util.tree_structure((tuple(range(n_in)), {})),
            in_slots=[Slot(v) for v in eqn.ins],
            out_tree=jax.tree_util.tree_structure(tuple(range(n_out)))
            if n_out != 1
            else jax.tree_util.tree_structure(0),
            out_slots=[Slot(v) for v in eqn.outs],
            start=c.start,
            stop=c.start + 1,
            module_type=f"{c.module_type} ({eqn.primitive})",
        )
        siblings.append(whole)
        out.append(whole)
    return out


def _finish(
    call: Call, record: _markers.CallRecord, ins: dict[int, int | None], outs: dict[int, int | None]
) -> None:
    call.in_slots = [
        Slot(ins.get(i)) if arr else Slot(None) for i, arr in enumerate(record.in_is_array)
    ]
    call.out_slots = [
        Slot(outs.get(i)) if arr else Slot(None, record.out_statics.get(i))
        for i, arr in enumerate(record.out_is_array)
    ]


def _call_name(record: _markers.CallRecord, scopes: tuple[str, ...]) -> str:
    if record.kind == "mark":
        return "/".join(scopes) if scopes else "/".join(record.path)
    name = "/".join(record.path)
    if record.method != "__call__":
        name = f"{name}.{record.method}"
    return name


def _calls_from_scopes(g: Graph) -> list[Call]:
    """Regions of consecutive equations that share a `jax.named_scope` prefix."""
    runs: list[tuple[tuple[str, ...], int, int]] = []
    open_runs: dict[tuple[str, ...], int] = {}
    for pos, eqn in enumerate(g.eqns):
        prefixes = [eqn.scopes[: k + 1] for k in range(len(eqn.scopes))]  # outer first
        for p in list(open_runs):
            if p not in prefixes:
                runs.append((p, open_runs.pop(p), pos))
        for p in prefixes:
            open_runs.setdefault(p, pos)
    runs += [(p, s, len(g.eqns)) for p, s in open_runs.items()]
    runs.sort(key=lambda r: (r[1], -r[2], len(r[0])))
    consumers_after = _last_reader(g)
    out_ids = {s.id for s in g.out_slots if s.id is not None}
    calls = []
    for scope, start, stop in runs:
        produced: list[int] = []
        reads: list[int] = []
        seen: set[int] = set()
        produced_set: set[int] = set()
        for eqn in g.eqns[start:stop]:
            for v in eqn.ins:
                if v not in produced_set and v not in seen and not g.is_free(v):
                    seen.add(v)
                    reads.append(v)
            for v in eqn.outs:
                produced_set.add(v)
                produced.append(v)
        outs = [v for v in produced if v in out_ids or consumers_after.get(v, -1) >= stop]
        in_slots = [Slot(v) for v in reads]
        out_slots = [Slot(v) for v in outs]
        in_tree = jax.tree_util.tree_structure((tuple(range(len(reads))), {}))
        out_tree = jax.tree_util.tree_structure(outs[0] if len(outs) == 1 else tuple(outs))
        calls.append(
            Call(
                name="/".join(scope),
                index=0,
                module_type="named_scope",
                method="",
                kind="scope",
                in_tree=in_tree,
                in_slots=in_slots,
                out_tree=out_tree,
                out_slots=out_slots,
                start=start,
                stop=stop,
                path=scope,
            )
        )
    return calls


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
