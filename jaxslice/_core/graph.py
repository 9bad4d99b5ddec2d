"""jaxslice's own view of a traced program (the data the pipeline passes along).

Model: values are integer ids (nodes) and equations are edges from the values they read
to the values they write, in program order. The graph is flat: call-like equations (jit,
remat, custom_jvp/vjp) whose bodies contain module calls are inlined, each inlining with
fresh ids, so a boundary inside a jitted function is an ordinary value here. Loops and
conditionals stay single equations; module calls inside their bodies are listed with
`loop` set. `loops.py` writes chosen iterations of scans out, so that the calls in them
become ordinary calls of a new graph.

Constants (closed-over arrays and literals) are values with a known value. The program's
invars are split into variables (the model's parameters and state, each with its key path),
random keys, and inputs.

A `Call` is one module call: its name, call index, the value ids of its input and output
leaves, and the equation span it covers. `build.py` makes a graph from a traced jaxpr.

A graph is frozen once built (`Graph.freeze`): traced graphs are shared through the
trace cache, so its fields are never assigned again and its lists become tuples; what
is computed from a graph is remembered on it (`Graph.memo`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import numpy as np

from .. import _compat
from . import analysis
from .markers import INPUT, Origin


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
class LoopSite:
    """A loop (or conditional) equation whose body holds boundaries.

    `eqn` is the equation as it appears in the traced jaxpr, or in the body of the loop
    `parent` (the same object for every iteration of that parent).
    """

    eqn: Any
    primitive: str
    length: int | None  # iterations of a scan; None where there is no static count
    parent: LoopSite | None = None
    rule: Any = None  # its `jaxprs.LoopRule`; None for a conditional (no iterations)

    def chain(self) -> list[LoopSite]:
        """The loops around a boundary, outermost first, ending with this one."""
        return [*self.parent.chain(), self] if self.parent is not None else [self]

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1


@dataclasses.dataclass(eq=False)
class Call:
    """One module call (a boundary occurrence) in the flat program."""

    name: str
    index: int
    module_type: str
    method: str
    origin: Origin
    in_tree: Any
    in_slots: list[Slot]
    out_tree: Any
    out_slots: list[Slot]
    start: int  # index of the first equation of the call
    stop: int  # index one past its last equation
    loop: LoopSite | None = None  # the innermost loop around the call, if any
    count: int = 1  # how many calls share `name`
    path: tuple[str, ...] = ()
    # Order of the call's first input marker and last output marker among all markers;
    # orders events that share an equation position. None for name-scope regions.
    in_seq: float = float("inf")
    out_seq: float = float("-inf")
    record: Any = None  # the `CallRecord` of a marked call
    # For a call in a scan body: its name with one iteration slot per enclosing scan
    # (see `names.iteration_slot`); `name` shows each slot as ``[:]``.
    template: str | None = None
    # For a call in a loop body: per side, ``{leaf: aval}`` of one iteration's values.
    loop_avals: tuple[dict[int, Any], dict[int, Any]] = dataclasses.field(
        default_factory=lambda: ({}, {})
    )

    @property
    def is_module(self) -> bool:
        """A module of a model library: its path is how its variables are keyed."""
        return self.origin is Origin.MODULE

    @property
    def is_scope(self) -> bool:
        """A `jax.named_scope` region (found from the name stack, not from markers)."""
        return self.origin is Origin.SCOPE

    def named_in(self, scope: Call) -> bool:
        """Whether this call's name places it inside a scope region (``grp/lin`` in
        ``grp``): so it is, also where their spans are the same."""
        return self.name.startswith(scope.name + "/")

    @property
    def qualname(self) -> str:
        return self.name if self.count == 1 else f"{self.name}@{self.index}"

    def port_tree(self, side: str) -> Any:
        """The call's pytree on one side, with `Slot` leaves."""
        if side == INPUT:
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
    # Holds no boundary: inlined only so that a slice can drop the part of it that its
    # outputs do not need (a jitted function with several results, say).
    opaque: bool = False


@dataclasses.dataclass(eq=False)
class Graph:
    """A traced program, flattened."""

    avals: list[Any] = dataclasses.field(default_factory=list)
    consts: dict[int, Any] = dataclasses.field(default_factory=dict)
    eqns: list[Eqn] = dataclasses.field(default_factory=list)
    variable_ids: list[int] = dataclasses.field(default_factory=list)
    variable_paths: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    # Variables that held a Python number when traced: the program computes with it.
    number_variables: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
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
    # For a partial graph: how many calls of each boundary had returned when it stopped.
    reached: dict[str, int] = dataclasses.field(default_factory=dict)
    build_seconds: float = 0.0  # time `build` took
    producer: dict[int, int] = dataclasses.field(default_factory=dict)
    # What the graph was built from: ``(closed jaxpr, signature, name_scopes)``, so that
    # loops can be written out (`loops.expand`) and the result built again.
    source: Any = None
    # Names that resolve to a call directly: per-iteration names in an expanded graph.
    aliases: dict[tuple[str, int | None], Call] = dataclasses.field(default_factory=dict)
    # In a graph with loops written out in pieces: state stacked over a loop's iterations,
    # ``{state position: build.StackedState}`` (which value has which pieces' rows new).
    stacked_state: dict[int, Any] = dataclasses.field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"a built Graph is frozen (assigning {name!r})")
        object.__setattr__(self, name, value)

    def freeze(self, **fields: Any) -> Graph:
        """Ends building: sets the last `fields` (``partial=True``, ...), makes every
        list a tuple, forgets what was remembered while building, and refuses
        assignments from now on. Returns the graph."""
        for name, value in fields.items():
            setattr(self, name, value)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        self.__dict__["_memos"] = {}
        self.__dict__["_frozen"] = True
        return self

    def memo(self, name: str, make: Callable[[], Any]) -> Any:
        """`make()`, remembered on the graph under `name` (the one memo of a graph)."""
        memos = self.__dict__.setdefault("_memos", {})
        if name not in memos:
            memos.setdefault(name, make())  # two threads making it keep the first one
        return memos[name]

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
        return self.memo("free_ids", lambda: frozenset((*self.variable_ids, *self.rng_ids)))

    @property
    def edges(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The equations as ``(ins, outs)`` pairs, the form `analysis` works on."""
        return self.memo("edges", lambda: [(e.ins, e.outs) for e in self.eqns])

    def cut(self, starts: Collection[int], outputs: Sequence[int]) -> analysis.Cut:
        """`analysis.cut` over this graph: what computes `outputs` from `starts`."""
        return analysis.cut(self.edges, self.producer, starts, self.is_free, outputs)

    def frontier(
        self, starts: Collection[int], outputs: Sequence[int], is_landmark: Callable[[int], bool]
    ) -> list[int]:
        """`analysis.frontier` over this graph: the values missing from `starts`."""
        return analysis.frontier(
            self.edges, self.producer, starts, self.is_free, outputs, is_landmark
        )

    def derived_from_inputs(self) -> frozenset[int]:
        """Values the model computes from its own inputs outside every module call and
        loop (positions, masks): a slice that also starts at the model's inputs computes
        them again instead of taking them."""
        return self.memo("derived", self._derived_from_inputs)

    def _derived_from_inputs(self) -> frozenset[int]:
        calls = [c for c in self.calls if c.loop is None and not c.is_scope]
        owner = innermost(calls, len(self.eqns))
        eqns = [
            i
            for i, e in enumerate(self.eqns)
            if owner[i] is None and not _compat.is_loop(e.jax_eqn)
        ]
        found = analysis.computable(self.edges, self.input_ids, self.is_free, eqns)
        return frozenset(found - set(self.input_ids))

    def model_input_call(self) -> Call:
        """The model's own inputs as a pseudo call (used for `start=None`)."""
        return Call(
            name="<inputs>",
            index=0,
            module_type="",
            method="",
            origin=Origin.MARK,
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


def _is_jax_value(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
