"""From `start`/`end` specifications to a plan: which values go in, which come out, and
which equations and variables are needed in between.

The inputs of a slice are "arguments": an output port is one argument (the module's whole
result pytree); an input port contributes each of the call's arguments that holds an array
that is not a variable, positionally or by keyword as the call received it (`start=None`
means the model's own inputs, the same way). A leaf of an argument that is a variable, a
constant or a non-array is fixed by the trace and ignored when the slice is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from . import _compat, _cut
from ._errors import DisconnectedError, InvalidSpecError, MissingInputError
from ._graph import Call, Graph, Slot, describe_aval
from ._markers import INPUT, OUTPUT
from ._names import Resolver


@dataclasses.dataclass(frozen=True)
class Port:
    spec: str | None  # as the user wrote it; None for the model's inputs or outputs
    call: Call
    side: str

    @property
    def label(self) -> str:
        if self.spec is None:
            return "the model's inputs" if self.side == INPUT else "the model's output"
        return repr(f"{self.call.qualname}:{self.side}")


@dataclasses.dataclass(frozen=True)
class Argument:
    """One argument of a slice call."""

    port: Port
    keyword: str | None  # set for keyword arguments
    position: int | None  # position in the call's positional arguments
    tree: Any  # treedef of the argument as traced
    slot_ids: tuple[int | None, ...]  # per leaf: the value it feeds, or None if fixed

    @property
    def input_ids(self) -> list[int]:
        return [i for i in self.slot_ids if i is not None]


@dataclasses.dataclass(frozen=True)
class Plan:
    starts: tuple[Port, ...] | None  # None: the model's inputs
    ends: Any  # a Port, a tuple of Ports or a dict of Ports
    arguments: tuple[Argument, ...]
    input_ids: tuple[int, ...]
    output_trees: Any  # same nesting as `ends`, each a pytree of Slots
    output_ids: tuple[int, ...]
    cut: _cut.Cut
    variable_ids: tuple[int, ...]
    variable_paths: tuple[tuple[Any, ...], ...]
    rng_ids: tuple[int, ...]
    state_paths: tuple[tuple[Any, ...], ...] = ()  # updated state the slice returns
    state_ids: tuple[int, ...] = ()
    program: tuple[Any, ...] = ()  # the equations to run (`Eqn`s), regions folded back
    updated_collections: tuple[str, ...] = ()  # collections the slice changes in this mode
    state_collections: tuple[str, ...] = ()  # collections the slice has state in


def _is_input(graph: Graph, slot: Slot) -> bool:
    return slot.id is not None and not graph.is_free(slot.id)


def arguments_of(graph: Graph, port: Port) -> list[Argument]:
    call, side = port.call, port.side
    if side == OUTPUT:
        slots = call.out_slots
        ids = tuple(s.id if _is_input(graph, s) else None for s in slots)
        return [Argument(port, None, None, call.out_tree, ids)]
    args, kwargs = call.port_tree(INPUT)
    out = []
    for i, arg in enumerate(args):
        leaves, tree = jax.tree_util.tree_flatten(arg)
        ids = tuple(s.id if _is_input(graph, s) else None for s in leaves)
        if any(x is not None for x in ids):
            out.append(Argument(port, None, i, tree, ids))
    for key, arg in kwargs.items():
        leaves, tree = jax.tree_util.tree_flatten(arg)
        ids = tuple(s.id if _is_input(graph, s) else None for s in leaves)
        if any(x is not None for x in ids):
            out.append(Argument(port, key, None, tree, ids))
    return out


def _normalise_starts(start: Any) -> list[Any] | None:
    if start is None:
        return None
    if isinstance(start, str):
        return [start]
    if isinstance(start, (list, tuple)) and start:
        return list(start)
    raise InvalidSpecError(
        f"`start` must be None (the model's inputs), a boundary name or a non-empty list of "
        f"names, got {start!r}."
    )


@dataclasses.dataclass(frozen=True)
class ActivationOf:
    """An end at the activation applied to a module's output (used by coverage)."""

    name: str


def activation_of(graph: Graph, vid: int) -> int:
    """The value an activation function makes of `vid`, or `vid` if none follows.

    The activation is the first equation that reads `vid` and nothing else computed
    (constants aside) and writes one value of the same shape: ``relu``, ``tanh``, ...
    """
    aval = graph.avals[vid]
    start = graph.producer.get(vid, -1) + 1
    for eqn in graph.eqns[start:]:
        if vid not in eqn.ins:
            continue
        others = [v for v in eqn.ins if v != vid]
        if len(eqn.outs) == 1 and all(graph.is_free(v) for v in others):
            out = graph.avals[eqn.outs[0]]
            if (
                getattr(out, "shape", None) == aval.shape
                and getattr(out, "dtype", None) == aval.dtype
            ):
                return eqn.outs[0]
        return vid
    return vid


def resolve_ends(resolver: Resolver, graph: Graph, end: Any) -> Any:
    def one(spec: Any) -> Port:
        if isinstance(spec, ActivationOf):
            call, _ = resolver.resolve(spec.name, OUTPUT)
            ids = [s.id for s in call.out_slots]
            if len(ids) != 1 or ids[0] is None:
                raise InvalidSpecError(
                    f"{spec.name!r} does not return a single array, so it has no activation."
                )
            act = activation_of(graph, ids[0])
            synthetic = dataclasses.replace(
                call, out_tree=jax.tree_util.tree_structure(0), out_slots=[Slot(act)]
            )
            return Port(spec.name, synthetic, OUTPUT)
        if spec is None:
            out_call = dataclasses.replace(
                graph.model_input_call(),
                name="<output>",
                out_tree=graph.out_tree,
                out_slots=graph.out_slots,
                stop=len(graph.eqns),
            )
            return Port(None, out_call, OUTPUT)
        call, side = resolver.resolve(spec, OUTPUT)
        return Port(spec, call, side)

    if end is None or isinstance(end, (str, ActivationOf)):
        return one(end)
    if isinstance(end, (list, tuple)):
        if not end:
            raise InvalidSpecError("`end` is an empty list; name at least one boundary.")
        return tuple(one(e) for e in end)
    if isinstance(end, dict):
        if not end:
            raise InvalidSpecError("`end` is an empty dict; map at least one key to a boundary.")
        return {k: one(v) for k, v in end.items()}
    raise InvalidSpecError(
        f"`end` must be a boundary name, a list of names, a dict of names or None, got {end!r}."
    )


def port_value_tree(graph: Graph, port: Port) -> Any:
    """The pytree (of Slots) that a port yields when it is an end."""
    if port.side == OUTPUT:
        return port.call.port_tree(OUTPUT)
    args = arguments_of(graph, port)
    trees = []
    for a in args:
        trees.append(
            jax.tree_util.tree_unflatten(
                a.tree, [Slot(i) if i is not None else Slot(None) for i in a.slot_ids]
            )
        )
    if len(trees) == 1:
        return trees[0]
    return tuple(trees)


def plan(
    graph: Graph,
    resolver: Resolver,
    start: Any,
    end: Any,
    mutable: Any = False,
    owner_offset: int = 1,
) -> Plan:
    specs = _normalise_starts(start)
    if specs is None:
        starts = None
        arguments = arguments_of(graph, Port(None, graph.model_input_call(), INPUT))
    else:
        ports = []
        for spec in specs:
            if spec is None:
                ports.append(Port(None, graph.model_input_call(), INPUT))
            else:
                call, side = resolver.resolve(spec, INPUT)
                ports.append(Port(spec, call, side))
        starts = tuple(ports)
        arguments = [a for p in ports for a in arguments_of(graph, p)]
    keywords = [a.keyword for a in arguments if a.keyword is not None]
    if len(keywords) != len(set(keywords)):
        raise InvalidSpecError(
            f"Two start boundaries take a keyword argument of the same name ({keywords}); "
            "name one of them by its `:output` port instead."
        )
    _check_distinct_inputs(arguments)
    ends = resolve_ends(resolver, graph, end)
    end_ports = _flat_ports(ends)
    output_trees = _map_ports(lambda p: port_value_tree(graph, p), ends)
    output_ids: tuple[int, ...] = tuple(
        s.id
        for tree in _flat_ports(output_trees)
        for s in jax.tree_util.tree_leaves(tree)
        if s.id is not None
    )
    input_ids = tuple(i for a in arguments for i in a.input_ids)
    program = [(e.ins, e.outs) for e in graph.eqns]
    result = _cut.cut(program, graph.producer, set(input_ids), graph.is_free, output_ids)
    if starts is not None:
        _check_connected(graph, program, arguments, result, starts, ends)
    if result.missing:
        _raise_missing(graph, program, input_ids, output_ids, starts, end_ports)
    state_pairs: list[tuple[tuple[Any, ...], int]] = []
    updated: tuple[str, ...] = ()
    collections: tuple[str, ...] = ()
    if graph.state_paths:
        whole = starts is None and isinstance(ends, Port) and ends.spec is None
        own = _slice_state(
            graph, program, result, set(input_ids), output_ids, True, owner_offset, whole
        )
        variables = graph.variable_set
        collections = tuple(sorted({_key(p[0]) for p, _ in own}))
        updated = tuple(sorted({_key(p[0]) for p, v in own if v not in variables}))
        if mutable:
            wanted = (
                None
                if mutable is True
                else ({mutable} if isinstance(mutable, str) else set(mutable))
            )
            state_pairs = [(p, v) for p, v in own if wanted is None or _key(p[0]) in wanted]
        if state_pairs:
            result = _cut.cut(
                program,
                graph.producer,
                set(input_ids),
                graph.is_free,
                output_ids + tuple(v for _, v in state_pairs),
            )
    result = _keep_effects(graph, result, set(input_ids))
    result, program_eqns = _fold_regions(
        graph, program, result, set(input_ids), output_ids + tuple(v for _, v in state_pairs)
    )
    used = result.used_free
    var_pairs = [
        (v, p) for v, p in zip(graph.variable_ids, graph.variable_paths, strict=True) if v in used
    ]
    return Plan(
        starts=starts,
        ends=ends,
        arguments=tuple(arguments),
        input_ids=input_ids,
        output_trees=output_trees,
        output_ids=output_ids,
        cut=result,
        variable_ids=tuple(v for v, _ in var_pairs),
        variable_paths=tuple(p for _, p in var_pairs),
        rng_ids=tuple(v for v in graph.rng_ids if v in used),
        state_paths=tuple(p for p, _ in state_pairs),
        state_ids=tuple(v for _, v in state_pairs),
        updated_collections=updated,
        state_collections=collections,
        program=tuple(program_eqns),
    )


def _keep_effects(graph: Graph, result: _cut.Cut, starts: set[int]) -> _cut.Cut:
    """Adds side-effecting equations (``jax.debug.print``, callbacks) that sit inside the
    slice, so a slice runs them as the model does, although no output needs them."""
    if not result.eqns:
        return result
    first, last = result.eqns[0], result.eqns[-1]
    needed = set(result.eqns)
    available = set(starts) | {v for i in needed for v in graph.eqns[i].outs}
    extra = [
        i
        for i in range(first, last + 1)
        if i not in needed
        and _compat.has_effects(graph.eqns[i].jax_eqn)
        and all(v in available or graph.is_free(v) for v in graph.eqns[i].ins)
    ]
    if not extra:
        return result
    used_free = set(result.used_free) | {
        v for i in extra for v in graph.eqns[i].ins if graph.is_free(v)
    }
    return dataclasses.replace(
        result, eqns=tuple(sorted(needed | set(extra))), used_free=frozenset(used_free)
    )


def _fold_regions(
    graph: Graph, program: Any, result: _cut.Cut, starts: set[int], outputs: tuple[int, ...]
) -> tuple[_cut.Cut, list[Any]]:
    """Runs inlined regions the slice needs whole as their original equation."""
    needed = set(result.eqns)
    inside_values = lambda r: {v for e in graph.eqns[r.start : r.stop] for v in e.outs}  # noqa: E731
    chosen: list[Any] = []
    for region in sorted(graph.regions, key=lambda r: (r.start, -r.stop)):
        if chosen and region.start < chosen[-1].stop:
            continue  # nested in a region already folded
        if region.start == region.stop or not any(
            i in needed for i in range(region.start, region.stop)
        ):
            continue
        internal = inside_values(region) - set(region.eqn.outs)
        if internal & starts or internal & set(outputs):
            continue  # the slice starts or ends inside the region
        read = {
            v for i in range(region.start, region.stop) if i in needed for v in graph.eqns[i].ins
        }
        if any(v not in read and v not in graph.consts for v in region.eqn.ins):
            continue  # the region would read more than the slice needs (dead code inside it)
        chosen.append(region)
    if not chosen:
        return result, [graph.eqns[i] for i in result.eqns]
    extra = tuple(v for r in chosen for v in r.eqn.ins)
    full = _cut.cut(program, graph.producer, starts, graph.is_free, outputs + extra)
    if full.missing:
        # Some region operand is not computable from the start: keep those regions inlined.
        ok = []
        for r in chosen:
            if not _cut.cut(program, graph.producer, starts, graph.is_free, r.eqn.ins).missing:
                ok.append(r)
        chosen = ok
        extra = tuple(v for r in chosen for v in r.eqn.ins)
        full = _cut.cut(program, graph.producer, starts, graph.is_free, outputs + extra)
    folded = set()
    for r in chosen:
        folded.update(range(r.start, r.stop))
    at = {r.start: r for r in chosen}
    eqns: list[Any] = []
    placed: set[int] = set()
    for i in sorted(set(full.eqns) | set(at)):
        if i in at and at[i].start not in placed:
            eqns.append(at[i].eqn)
            placed.add(i)
        if i not in folded:
            eqns.append(graph.eqns[i])
    return full, eqns


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry))))


def _slice_state(
    graph: Graph,
    program: Any,
    result: _cut.Cut,
    input_ids: set[int],
    output_ids: tuple[int, ...],
    mutable: Any,
    offset: int,
    whole: bool = False,
) -> list[tuple[tuple[Any, ...], int]]:
    """The updated state entries that belong to the slice.

    An entry belongs to the slice when the module that owns it (the longest module path
    that prefixes the entry's path) has a call with equations in the slice, and its new
    value can be computed from the slice's inputs. State of the top-level module itself
    belongs only to a slice of the whole model (from its inputs to its output). State of
    modules outside the slice is not returned, so merging it back leaves them untouched.
    """
    wanted = None if mutable is True else ({mutable} if isinstance(mutable, str) else set(mutable))
    # How many equations of the cut come before each position: a call takes part in the
    # slice when its span holds one of them (a constant-time test per call).
    before = [0] * (len(graph.eqns) + 1)
    in_cut = set(result.eqns)
    for i in range(len(graph.eqns)):
        before[i + 1] = before[i] + (i in in_cut)
    module_calls: dict[tuple[str, ...], list[Call]] = {}
    for call in graph.calls:
        if call.kind in ("linen", "nnx") and call.loop is None:
            module_calls.setdefault(call.path, []).append(call)
    participating = {
        path
        for path, calls in module_calls.items()
        if any(before[c.stop] > before[c.start] for c in calls)
    }
    computable = _cut.computable(program, input_ids, graph.is_free)
    chosen = []
    variable_set = graph.variable_set
    for path, vid in zip(graph.state_paths, graph.state_ids, strict=True):
        keys = tuple(_key(k) for k in path)
        if not keys or (wanted is not None and keys[0] not in wanted):
            continue
        rest = keys[offset:]
        # The owner: the longest module path that prefixes the entry's path.
        owner = next((rest[:n] for n in range(len(rest), 0, -1) if rest[:n] in module_calls), None)
        if (owner is None and not whole) or (owner is not None and owner not in participating):
            continue
        if offset == 0 and vid in variable_set:
            continue  # unchanged: nothing to write back (NNX)
        if vid not in variable_set and vid not in computable:
            continue  # its final value comes from a call outside the slice
        chosen.append((path, vid))
    return chosen


def _check_distinct_inputs(arguments: Sequence[Argument]) -> None:
    """Two inputs that are one value of the model cannot be fed different values."""
    first: dict[int, Argument] = {}
    for arg in arguments:
        for vid in arg.input_ids:
            other = first.setdefault(vid, arg)
            if other is not arg or arg.input_ids.count(vid) > 1:
                a, b = other.port.label, arg.port.label
                where = f"{a} and {b} are" if a != b else f"{a} receives it twice and is"
                raise InvalidSpecError(
                    f"{where} the same value in the traced model, so a slice cannot take them as "
                    "separate inputs (one would be silently ignored). Start at one of them, or at "
                    "the module that produces that value (its ':output')."
                )


def _flat_ports(ends: Any) -> list[Any]:
    """The items of an end specification (a single item, a tuple or a dict), in order."""
    if isinstance(ends, tuple):
        return list(ends)
    if isinstance(ends, dict):
        return list(ends.values())
    return [ends]


def _map_ports(fn: Any, ends: Any) -> Any:
    if isinstance(ends, tuple):
        return tuple(fn(p) for p in ends)
    if isinstance(ends, dict):
        return {k: fn(p) for k, p in ends.items()}
    return fn(ends)


def _check_connected(
    graph: Graph,
    program: Any,
    arguments: Sequence[Argument],
    result: _cut.Cut,
    starts: tuple[Port, ...],
    ends: Any,
) -> None:
    start_labels = ", ".join(p.label for p in starts)
    first_start = min(p.call.start for p in starts)
    input_ids = {i for a in arguments for i in a.input_ids}
    for port in _flat_ports(ends):
        tree = port_value_tree(graph, port)
        ids = [s.id for s in jax.tree_util.tree_leaves(tree) if s.id is not None]
        if (
            not ids
            or ids
            and _cut.cut(program, graph.producer, input_ids, graph.is_free, ids).used_starts
        ):
            continue
        order = ""
        if port.spec is not None and port.call.stop <= first_start:
            order = f" ({port.label} runs before the start.)"
        raise DisconnectedError(
            DisconnectedError.TEMPLATE.format(
                what=f"{port.label} does not depend on the start {start_labels}.{order}"
            )
        )
    end_labels = ", ".join(p.label for p in _flat_ports(ends))
    for port in starts:
        ids = {i for a in arguments if a.port is port for i in a.input_ids}
        if not ids & result.used_starts:
            raise DisconnectedError(
                DisconnectedError.TEMPLATE.format(
                    what=f"The start {port.label} is not used by {end_labels}; remove it from `start`."
                )
            )


def _raise_missing(
    graph: Graph,
    program: Any,
    input_ids: Sequence[int],
    output_ids: Sequence[int],
    starts: tuple[Port, ...] | None,
    ends: list[Port],
) -> None:
    landmarks: dict[int, tuple[Call, str]] = {}
    for call in graph.calls:
        if call.loop is not None:
            continue
        for s in call.out_slots:
            if s.id is not None:
                landmarks.setdefault(s.id, (call, OUTPUT))
    for call in graph.calls:  # inputs only where no output names the value
        if call.loop is not None:
            continue
        for s in call.in_slots:
            if s.id is not None:
                landmarks.setdefault(s.id, (call, INPUT))
    found = _cut.frontier(
        program, graph.producer, set(input_ids), graph.is_free, output_ids, landmarks.__contains__
    )
    model_inputs = set(graph.input_ids)
    names: list[str] = []
    for v in found:
        if v in landmarks:
            call, side = landmarks[v]
            label = call.qualname if side == OUTPUT else f"{call.qualname}:input"
        elif v in model_inputs:
            label = None
        else:
            continue
        if label not in names:
            names.append(label)
    current = [p.spec for p in starts] if starts else []
    what = []
    additions: list[str | None] = []
    for n in names:
        if n is None:
            what.append("the model's own input")
            additions.append(None)
            continue
        call_name, _, port = n.partition(":")
        avals = [
            graph.avals[v]
            for v in found
            if v in landmarks and landmarks[v][0].qualname == call_name
        ]
        shapes = ", ".join(_short(a) for a in avals)
        what.append(f"the {port or 'output'} of {call_name!r} ({shapes})")
        additions.append(n if port else f"{n}:output")
    if not what:
        what = ["a value computed before the start"]
    raise MissingInputError(
        MissingInputError.TEMPLATE.format(
            start=", ".join(p.label for p in starts) if starts else "the model's inputs",
            end=", ".join(p.label for p in ends),
            what=" and ".join(what),
            fix=current + additions,
        )
    )


def _short(aval: Any) -> str:
    return describe_aval(aval)
