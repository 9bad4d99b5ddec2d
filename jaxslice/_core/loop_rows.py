"""Bookkeeping for a loop run in pieces: its operands, and what each stacked value is.

A `Run` is one loop equation being run piece by piece: its constants, carry so far and
stacked operands. A stacked name's leaf, collected per piece by a `Frame`, is one of the
loop's constants (`Const`), the row of a stacked parameter (`Xs`), a value computed from
parameters alone (`Derived`), or a plain value; `Run.whole` puts the pieces back into
one value, so that a parameter stays a parameter. `Fixed` knows the values of the trace
that no port takes as an input. A `Stack` is a stacked result of a loop run in pieces,
with the rows each piece gave it; `mark_state_rows` marks updated state made of one with
only some pieces' rows new.

Values are known by identity (`id`), as the trace makes each one once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .. import _compat
from .build import ROWS, RowMark
from .loop_requests import Loop, relative_targets
from .markers import CallRecord

# --------------------------------------------------------------------------- one loop


@dataclasses.dataclass
class Frame:
    """Collects, for one loop with a stacked name, the values to stack per iteration."""

    depth: int  # paths below this loop start here
    targets: set[tuple[int, tuple]]
    store: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
    records: dict[int, CallRecord] = dataclasses.field(default_factory=dict)

    def fresh(self) -> Frame:
        return Frame(self.depth, self.targets, {}, self.records)


@dataclasses.dataclass
class Run:
    """A loop equation being run piece by piece: its operands and its carry so far."""

    parts: Any
    consts: list[Any]
    carry: list[Any]
    xs: list[Any]
    frame: Frame | None  # collects stacked names' values, if any
    fixed: Fixed  # the values no port takes as an input
    eqn: Any = None

    def rows(self, rows: list[Any]) -> list[Any]:
        """One iteration's rows of the stacked operands; those of parameters are too."""
        for x, row in zip(self.xs, rows, strict=True):
            if self.fixed.is_param(x):
                self.fixed.add(row)
        return rows

    def one_row(self, value: Any, rows: Sequence[Any]) -> Any:
        """A value of one iteration as a piece of one row (or the operand it is)."""
        kind = self.kind(value, rows)
        if kind is not None:
            return kind
        return Derived(value[None]) if self.fixed.is_param(value) else value[None]

    def kind(self, value: Any, rows: Sequence[Any]) -> Const | Xs | None:
        """Which of the loop's constants (`Const`) or rows of stacked parameters
        (`Xs`, among `rows`) `value` is, if it is a constant that is also a variable,
        constant or parameter of the program, or such a row (which no port takes as an
        input)."""
        if self.fixed.holds(value):
            const = next((j for j, c in enumerate(self.consts) if c is value), None)
            if const is not None:
                return Const(const)
        params = self.fixed.is_param
        row = next((j for j, r in enumerate(rows) if r is value and params(self.xs[j])), None)
        return Xs(row) if row is not None else None

    def piece(self, value: Any, rows: tuple[int, int]) -> Any:
        """A stacked name's leaf of one piece (the rows ``a:b``) as an array."""
        if isinstance(value, Xs):
            return jax.lax.slice_in_dim(self.xs[value.index], *rows)
        return value.value if isinstance(value, Derived) else value

    def whole(self, values: list[Any], ranges: list[tuple[int, int]], derived: Any = None) -> Any:
        """A stacked name's leaf over every piece, from its `values` in the pieces (the
        rows `ranges`): the loop's constant it is in every piece, the stacked parameter
        whose row it is in every piece, `derived` (the same leaf computed from parameters
        alone, if there is one) or else the pieces' arrays concatenated."""
        first = values[0]
        if isinstance(first, Const):
            return self.consts[first.index]
        if all(_same_row(value, first) for value in values):
            return self.xs[first.index]
        if derived is not None:
            return derived
        return concat([self.piece(v, r) for v, r in zip(values, ranges, strict=True)])

    @classmethod
    def of(cls, eqn: Any, parts: Any, ins: list[Any], req: Loop, depth: int, fixed: Fixed) -> Run:
        """The run of scan `eqn` (its `parts`) on `ins`, inside `depth` loops (its
        iteration's path)."""
        nc, nk = parts.num_consts, parts.num_carry
        frame = None
        if req.stacked is not None:
            frame = Frame(depth + 1, relative_targets(req.stacked))
        return cls(parts, ins[:nc], ins[nc : nc + nk], ins[nc + nk :], frame, fixed, eqn)


@dataclasses.dataclass(frozen=True)
class Const:
    """A stacked name's leaf that is the loop's constant operand `index`."""

    index: int


@dataclasses.dataclass(frozen=True)
class Xs:
    """A stacked name's leaf that is the row of the loop's stacked operand `index` (a
    stacked parameter)."""

    index: int


@dataclasses.dataclass(frozen=True)
class Derived:
    """A stacked name's leaf computed from parameters alone: its rows of one piece."""

    value: Any


def _same_row(value: Any, first: Any) -> bool:
    return isinstance(value, Xs) and isinstance(first, Xs) and value.index == first.index


class Fixed:
    """Values of the program's trace that no port takes as an input: its variables,
    random keys and constants (`free`), and the values computed from its variables
    alone (`params`, the rule of `analysis.parameter_values`), kept so that their ids
    stay theirs. Values are known by identity, as the trace makes each one once."""

    def __init__(self, free: Sequence[Any] = (), variables: Sequence[Any] = ()):
        self.free = {id(x) for x in free}
        self.params = {id(x): x for x in variables}

    def holds(self, value: Any) -> bool:
        return id(value) in self.free or id(value) in self.params

    def is_param(self, value: Any) -> bool:
        return id(value) in self.params

    def add(self, value: Any) -> None:
        self.params[id(value)] = value

    def note(self, atoms: Sequence[Any], ins: Sequence[Any], outs: Sequence[Any]) -> None:
        """Records `outs` as parameters when they are computed from `ins` alone, every
        one of which is fixed and one a parameter."""
        if not any(self.is_param(x) for x in ins):
            return
        if all(_compat.is_literal(a) or self.holds(x) for a, x in zip(atoms, ins, strict=True)):
            for x in outs:
                self.add(x)


def concat(values: list[Any]) -> Any:
    return values[0] if len(values) == 1 else jax.numpy.concatenate(values, axis=0)


# --------------------------------------------------------------------------- stacked state


@dataclasses.dataclass(frozen=True)
class Stack:
    """One stacked result of a loop run in pieces: the rows ``ranges[i]`` of `value`
    are the piece result ``pieces[i]``, itself the stacked result `subs[i]` of an
    inner loop run in pieces when piece i is an iteration written out."""

    value: Any
    loop: int
    ranges: list[tuple[int, int]]
    pieces: list[Any]
    subs: list[Stack | None]

    @property
    def depth(self) -> int:
        """How many nested loops' axes lead this result (1 without inner pieces)."""
        return 1 + max((sub.depth for sub in self.subs if sub is not None), default=0)

    def leaves(self, depth: int, offset: int = 0) -> list[Leaf]:
        """The innermost pieces, in row order, each with its rows of the result's
        `depth` leading axes flattened into one."""
        shape = jax.numpy.shape(self.value)
        inner = int(np.prod(shape[1:depth]))
        found = []
        for i, (a, b) in enumerate(self.ranges):
            sub = self.subs[i]
            if sub is not None:
                found += sub.leaves(depth - 1, offset + a * inner)
                continue
            value = self.pieces[i].reshape(((b - a) * inner, *shape[depth:]))
            found.append(Leaf((self.loop, i), (offset + a * inner, offset + b * inner), value))
        return found

    def mark_rows(self, old: Any, state: int) -> None:
        """Marks, for each range of innermost pieces ``(first, last)``, `old` with the
        rows of those pieces replaced by theirs (the result itself for every piece)."""
        depth = self.depth
        leaves = self.leaves(depth)
        flat = old.reshape((-1, *old.shape[depth:]))
        marks = tuple(leaf.mark for leaf in leaves)
        count = len(leaves)
        for i in range(count):
            for j in range(i, count):
                new = self.value
                if (i, j) != (0, count - 1):
                    new = _with_rows(flat, leaves[i : j + 1]).reshape(old.shape)
                _compat.bind_marker(new, RowMark(marks, ROWS, (i, j), state), ROWS)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An innermost piece of a stacked result: which piece of which loop, its rows of
    the flattened result, and its value there."""

    mark: tuple[int, int]  # (loop, piece)
    rows: tuple[int, int]
    value: Any


def _with_rows(flat: Any, leaves: list[Leaf]) -> Any:
    """`flat` with the rows of consecutive `leaves` replaced by theirs."""
    a, b = leaves[0].rows[0], leaves[-1].rows[1]
    parts = [jax.lax.slice_in_dim(flat, 0, a)] if a > 0 else []
    parts += [leaf.value for leaf in leaves]
    if b < flat.shape[0]:
        parts.append(jax.lax.slice_in_dim(flat, b, flat.shape[0]))
    return concat(parts)


def mark_state_rows(
    stacks: dict[int, Stack], outs: Sequence[Any], signature: Any, args: Any
) -> None:
    """Marks the ranges of rows of each updated state entry that is a stacked result of
    a loop written out in pieces (among `stacks`, by id of the result), and whose old
    value is the variable at its path."""
    paths = list(signature.state_paths)
    if not paths or not stacks:
        return
    old_values = dict(zip(map(tuple, signature.variable_paths), args, strict=False))
    state = outs[len(outs) - len(paths) :]
    for k, (path, value) in enumerate(zip(paths, state, strict=True)):
        stack = stacks.get(id(value))
        old = old_values.get(tuple(path))
        if stack is None or stack.value is not value or old is None:
            continue
        if jax.numpy.shape(old) == jax.numpy.shape(value):
            stack.mark_rows(old, k)


_compat.register_frames_exclusion(__file__)
