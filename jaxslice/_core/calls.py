"""Marker occurrences grouped into calls (part of stage 2, `build.py`).

`build.py` records every marker equation it meets as an `Occurrence`, in program order;
`calls_from_markers` groups them into `Call`s: a call's input markers, its body, then its
output markers. A call in a loop body is one iteration of it: its name carries one
iteration slot per enclosing loop (`index_names`). `number_calls` gives calls that share
a name their call indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .graph import Call, LoopSite, Slot
from .markers import INPUT, PLACEHOLDER, CallRecord, Marker, Origin
from .names import iteration_slot, shown


@dataclasses.dataclass
class Occurrence:
    """One marker equation met while flattening: at position `pos`, seeing value `vid`."""

    marker: Marker
    vid: int | None
    pos: int
    scopes: tuple[str, ...]
    loop: LoopSite | None
    template: str | None = None  # the call's name with iteration slots (in loop bodies)
    aval: Any = None  # in a loop body, the value's shape and dtype in one iteration


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

    def add_input(self, occ: Occurrence) -> None:
        self.ins[occ.marker.leaf] = occ.vid
        self._note(occ, 0)

    def add_output(self, occ: Occurrence, seq: int) -> None:
        self.outs[occ.marker.leaf] = occ.vid
        self.call.stop, self.call.out_seq = occ.pos, seq
        self._note(occ, 1)

    def _note(self, occ: Occurrence, side: int) -> None:
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
        self.call.in_slots = leaf_slots(self.ins, record.in_is_array, {})
        self.call.out_slots = leaf_slots(self.outs, record.out_is_array, record.out_statics)
        return self.call


def leaf_slots(
    ids: dict[int, int | None], is_array: Sequence[bool], statics: dict[int, Any]
) -> list[Slot]:
    """Per leaf, the value its marker saw (arrays) or its static value (others)."""
    return [
        Slot(ids.get(i)) if arr else Slot(None, statics.get(i)) for i, arr in enumerate(is_array)
    ]


def calls_from_markers(occurrences: list[Occurrence]) -> list[Call]:
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


def _new_call(occ: Occurrence, seq: int) -> Call:
    record = occ.marker.record
    name = call_name(record, occ.scopes) if occ.template is None else shown(occ.template)
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
        template=occ.template if occ.loop is not None and occ.loop.rule is not None else None,
    )


def call_name(record: CallRecord, scopes: tuple[str, ...]) -> str:
    """The name a call goes by: a `js.mark` without a name of its own takes its scope's."""
    if record.origin is Origin.MARK and scopes and record.display is None:
        return "/".join(scopes)
    return record.name


def index_names(found: list[Occurrence], depth: int) -> None:
    """Gives the calls of a loop body one iteration slot: after the name of the outermost
    call they are nested in (``layers`` -> ``layers[:]``, ``layers/attn`` ->
    ``layers[:]/attn``)."""
    names = {o.template for o in found if o.template is not None}
    for o in found:
        if o.template is None:
            continue
        top = min((n for n in names if o.template.startswith(n + "/")), key=len, default=None)
        top = o.template if top is None else top
        o.template = top + iteration_slot(depth) + o.template[len(top) :]


def number_calls(calls: list[Call]) -> None:
    """Sets each call's `index` (its order among the calls of its name) and `count`."""
    counts: dict[str, int] = {}
    for c in calls:
        c.index = counts.get(c.name, 0)
        counts[c.name] = c.index + 1
    for c in calls:
        c.count = counts[c.name]
