"""Linen's lifted transforms seen from their caller (part of stage 2, `build.py`).

`nn.scan` and `nn.vmap` call a module inside a JAX transform: its markers sit in a scan
body (one call per iteration, ``layers[:]``) or see values stacked along an axis that
the transform moves afterwards. `with_lifted_calls` adds what the caller sees: the loop
equation as one call with the loop's ports, and `vmap`'s results after the axis move.
`body_ports` tells which loop operands and results a call in a scan body reads and
returns (`loops.py` uses it too).

Sharp edge: this is pattern matching on the equations the transforms emit (axis
permutations around the loop made by Flax's code, as the source line JAX records says,
and by `vmap`); a port it cannot match keeps the value seen inside the transform.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat
from .calls import leaf_slots
from .graph import Call, Graph, Slot
from .markers import INPUT, OUTPUT, PLACEHOLDER, CallRecord
from .names import iteration_slot
from .ports import array_ids


def with_lifted_calls(g: Graph, calls: list[Call]) -> list[Call]:
    """`calls` plus each lifted scan as a whole (`_whole_loops`), with the results of calls
    lifted by `vmap` taken after its axis move (`_vmapped_results`)."""
    readers = _readers(g)
    return _vmapped_results(g, _whole_loops(g, calls, readers), readers)


# --------------------------------------------------------------------------- whole loops


def _whole_loops(g: Graph, calls: list[Call], readers: dict[int, list[int]]) -> list[Call]:
    """Adds a lifted module (linen `nn.scan`, say) as a whole: the loop equation's own ports.

    Inside a scan body each call is one iteration (``layers[:]``); the outermost module
    of a loop that is called nowhere else *is* the loop (its outer call is the lifted
    transform), so it also gets a boundary under its bare name, with the ports its caller
    sees (`_loop_as_call`). A body that calls several modules side by side (the blocks
    of an `hk.layer_stack`, say) is no one module's loop: none of them gets the loop.
    """
    outside = {c.name for c in calls if c.loop is None}
    tops = [c for c in calls if _is_lifted(c, outside)]
    per_loop = collections.Counter(id(c.loop) for c in tops)
    lifted = {id(c) for c in tops if per_loop[id(c.loop)] == 1}
    out: list[Call] = []
    for c in calls:
        if id(c) in lifted:
            out.append(_loop_as_call(g, readers, c))
        out.append(c)
    return out


def _is_lifted(c: Call, outside: set[str]) -> bool:
    """Whether `c` is the module a top-level scan's body calls, called nowhere else (a
    loop without counted iterations, a `while`, is no lifted module)."""
    loop = c.loop
    if loop is None or loop.parent is not None or not c.is_module or c.template is None:
        return False
    own = c.template == c.record.name + iteration_slot(0) and c.record.name not in outside
    return own and loop.rule.counted


def _loop_as_call(g: Graph, readers: dict[int, list[int]], c: Call) -> Call:
    """The loop equation at `c.start` as one call, with the ports its caller sees.

    A lifted transform moves axes around the loop (``nn.scan(..., in_axes=1)`` transposes
    the scanned operand before the loop and the stacked result after it), so an operand
    that is a permutation of another value, made only for the loop, is taken before that
    permutation, and a result that only a permutation reads, after it.
    """
    pos = c.start
    eqn = g.eqns[pos]
    ins, starts = zip(*(_unmoved_operand(g, readers, v, pos) for v in eqn.ins), strict=True)
    outs, stops = zip(*(_unmoved_result(g, readers, v, pos) for v in eqn.outs), strict=True)
    ports = _caller_ports(eqn.jax_eqn, c.loop.rule, c.record)
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
    """Whether the equation at `pos` is an axis permutation a lifted transform made: one
    Flax's own code emitted (``nn.scan(..., in_axes=1)``), not the model's (a batch-major
    RNN's ``jnp.swapaxes(x, 0, 1)`` before its loop is the caller's own operand)."""
    eqn = g.eqns[pos]
    if not _compat.is_axis_permutation(eqn.jax_eqn) or g.is_free(eqn.ins[0]):
        return False
    line = _compat.source_line(eqn.jax_eqn)
    return line is not None and line.startswith(_flax_dir())


@functools.cache
def _flax_dir() -> str:
    import flax

    return os.path.dirname(flax.__file__) + os.sep


def _call_trees(
    record: CallRecord, ins: Sequence[int], outs: Sequence[int], in_at: dict, out_at: dict
) -> dict[str, Any]:
    """A lifted call's ports: its own arguments and result, as the caller sees them."""
    return {
        "in_tree": record.in_tree,
        "in_slots": leaf_slots({k: ins[j] for k, j in in_at.items()}, record.in_is_array, {}),
        "out_tree": record.out_tree,
        "out_slots": leaf_slots(
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


def _caller_ports(eqn: Any, rule: Any, record: CallRecord) -> tuple[dict, dict] | None:
    """For a call made once per iteration directly in a scan body: ``({input leaf: loop
    operand}, {output leaf: loop result})``, or None where a leaf is not one of them."""
    found = body_ports(rule.body(eqn)).get(id(record))
    return None if found is None else (found[1][INPUT], found[1][OUTPUT])


# --------------------------------------------------------------------------- body ports


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


# --------------------------------------------------------------------------- vmap


def _vmapped_results(g: Graph, calls: list[Call], readers: dict[int, list[int]]) -> list[Call]:
    """A module lifted by `vmap` (linen `nn.vmap`) returns what its caller receives.

    Inside the transform its result is stacked along a leading axis, which `jax.vmap`
    then moves to `out_axes`; an output that only that move reads is taken after it.
    A call nested in another with the same output keeps the stacked value. Returns
    new calls in place of those outside loops, in the order of `calls`.
    """
    moved: set[int] = set()
    replaced: dict[int, Call] = {}  # id(call) -> the call as its caller sees it
    for c in sorted((c for c in calls if c.loop is None), key=lambda c: (c.start, c.in_seq)):
        slots, stop = [], c.stop
        for s in c.out_slots:
            pos = _vmap_move(g, readers, s.id)
            if pos is None or s.id in moved:
                slots.append(s)
                continue
            moved.add(s.id)
            slots.append(Slot(g.eqns[pos].outs[0], s.static))
            stop = max(stop, pos + 1)
        replaced[id(c)] = dataclasses.replace(c, out_slots=slots, stop=stop)
    return [replaced.get(id(c), c) for c in calls]


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
    readers: dict[int, list[int]] = {}
    for pos, eqn in enumerate(g.eqns):
        for v in eqn.ins:
            readers.setdefault(v, []).append(pos)
    for v in array_ids(g.out_slots):
        readers.setdefault(v, []).append(-1)
    return readers
