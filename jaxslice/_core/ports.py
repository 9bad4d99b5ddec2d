"""Ports: the values a start or an end of a slice stands for.

A port is one side (input or output) of a call: a `selection.Selection`, which
`resolve_starts` and `resolve_ends` make from the parsed names (`parsed`), or take as
given where a caller resolved it before (an observer's layers). As an end, an
output port yields the call's whole result pytree and an input port its array arguments.
As a start, an output port is one argument of the slice (the module's whole result); an
input port contributes each of the call's arguments that holds an array that is not a
variable, positionally or by keyword as the call received it (`start=None` means the
model's own inputs, the same way). A leaf of an argument that is a variable, a constant
or a non-array is fixed by the trace and ignored when the slice is called.

A call's arguments are listed as the call was written: positional ones first, then its
keywords in the order it passed them (`keyword_order`), not in the sorted order in which
JAX flattens them. An input port as an end keeps JAX's order, as its value always had.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Container, Iterable
from typing import Any

import jax

from .._errors import EmptyEndError, EndSpecError, NoActivationError, StartSpecError
from .activations import activation_of
from .graph import Call, Graph, Slot
from .markers import INPUT, OUTPUT
from .selection import Name, Resolver, Selection, resolver_of


@dataclasses.dataclass(frozen=True)
class Argument:
    """One argument of a slice call."""

    port: Selection
    keyword: str | None  # set for keyword arguments
    position: int | None  # position in the call's positional arguments
    tree: Any  # treedef of the argument as traced
    slot_ids: tuple[int | None, ...]  # per leaf: the value it feeds, or None if fixed

    @property
    def input_ids(self) -> list[int]:
        return [i for i in self.slot_ids if i is not None]

    def slot_tree(self) -> Any:
        """The argument as a pytree of `Slot`s (``Slot(None)`` for fixed leaves)."""
        return jax.tree_util.tree_unflatten(self.tree, [Slot(i) for i in self.slot_ids])

    def describe(self) -> str:
        if self.keyword is not None:
            where = f"keyword {self.keyword!r}"
        else:
            where = f"argument {self.position}" if self.position is not None else "output"
        return f"{self.port.label} {where}"


@dataclasses.dataclass(frozen=True)
class ActivationOf:
    """An end at the activation applied to a module's output (used by coverage)."""

    name: Any  # a boundary name (a `selection.Name` once parsed)


def array_ids(slots: Iterable[Slot]) -> list[int]:
    """The value ids of the slots that hold arrays (static leaves have none), in order."""
    return [s.id for s in slots if s.id is not None]


def single_output_id(call: Call) -> int | None:
    """The value id of a call's output when that output is one array, else None."""
    slots = call.out_slots
    return slots[0].id if len(slots) == 1 else None


def _fed_id(graph: Graph, slot: Slot, fixed: Container[int]) -> int | None:
    """The value an argument leaf feeds, or None if the trace fixes it (static or free)
    or the slice computes it (`fixed`)."""
    if slot.id is None or graph.is_free(slot.id) or slot.id in fixed:
        return None
    return slot.id


def _argument(
    graph: Graph,
    port: Selection,
    value: Any,
    fixed: Container[int],
    keyword: str | None = None,
    position: int | None = None,
) -> Argument:
    leaves, tree = jax.tree_util.tree_flatten(value)
    ids = tuple(_fed_id(graph, s, fixed) for s in leaves)
    return Argument(port, keyword, position, tree, ids)


def keyword_order(call: Call, keywords: Iterable[str]) -> list[str]:
    """A call's `keywords` in the order the call passed them.

    JAX flattens ``block(x, mask=m, bias=b)``'s keywords sorted (``bias, mask``); the
    call's record keeps the order they were written in. A keyword the record does not
    know (a call without one: the model's inputs, a scope) keeps its place after those.
    """
    passed = getattr(call.record, "in_keywords", ())
    rank = {k: i for i, k in enumerate(passed)}
    return sorted(keywords, key=lambda k: rank.get(k, len(rank)))


def input_leaf_order(call: Call) -> list[int]:
    """The leaf indices of a call's input tree, its keywords in the order it passed them."""
    tree = call.in_tree
    args, kwargs = jax.tree_util.tree_unflatten(tree, list(range(tree.num_leaves)))
    ordered = [kwargs[k] for k in keyword_order(call, kwargs)]
    return jax.tree_util.tree_leaves((args, ordered))


def arguments_of(
    graph: Graph, port: Selection, fixed: Container[int] = frozenset(), *, call_order: bool = True
) -> list[Argument]:
    """The slice arguments a start port contributes (values in `fixed` are not taken).

    Keyword arguments come in the order the call passed them, or with ``call_order=False``
    in JAX's (sorted) order.
    """
    if port.side == OUTPUT:
        return [_argument(graph, port, port.call.port_tree(OUTPUT), fixed)]
    args, kwargs = port.call.port_tree(INPUT)
    keywords = keyword_order(port.call, kwargs) if call_order else list(kwargs)
    found = [_argument(graph, port, a, fixed, position=i) for i, a in enumerate(args)]
    found += [_argument(graph, port, kwargs[k], fixed, keyword=k) for k in keywords]
    # An input argument whose leaves are all fixed by the trace is not an argument.
    return [a for a in found if a.input_ids]


def port_value_tree(graph: Graph, port: Selection) -> Any:
    """The pytree (of Slots) that a port yields when it is an end.

    An input port yields its array arguments in JAX's order (keywords sorted), as it
    always has: positional arguments, then keywords by name.
    """
    if port.side == OUTPUT:
        return port.call.port_tree(OUTPUT)
    trees = [a.slot_tree() for a in arguments_of(graph, port, call_order=False)]
    return trees[0] if len(trees) == 1 else tuple(trees)


def parsed(spec: Any) -> Any:
    """A `start` or `end` (one name, an activation, None, or a list, tuple or dict of
    them) with each name parsed once into a `selection.Name`; anything else (a record
    resolved before, a `Selection`, too) is kept as given, to be refused when it is
    resolved if it is no name."""
    if isinstance(spec, str):
        return Name.of(spec)
    if isinstance(spec, ActivationOf) and isinstance(spec.name, str):
        return ActivationOf(Name.of(spec.name))
    if isinstance(spec, (list, tuple)):
        return type(spec)(_parsed_item(s) for s in spec)
    if isinstance(spec, dict):
        return {k: _parsed_item(s) for k, s in spec.items()}
    return spec


def _parsed_item(spec: Any) -> Any:
    return spec if isinstance(spec, (list, tuple, dict)) else parsed(spec)


def written(spec: Any) -> Any:
    """A parsed `start` or `end` as the user wrote it (for messages)."""
    if isinstance(spec, Name | Selection):
        return spec.spec
    if isinstance(spec, ActivationOf) and isinstance(spec.name, Name | Selection):
        return ActivationOf(spec.name.spec)
    if isinstance(spec, (list, tuple)):
        return type(spec)(s if isinstance(s, (list, tuple, dict)) else written(s) for s in spec)
    if isinstance(spec, dict):
        return {k: s if isinstance(s, (list, tuple, dict)) else written(s) for k, s in spec.items()}
    return spec


def adopted(graph: Graph, spec: Any) -> Any:
    """A parsed `start` or `end` with each record in it (a `Selection`, as an observer
    resolves its layers once) made `graph`'s (`Resolver.adopt`): a record resolved on
    another trace of the model is the same call's in this one."""
    if isinstance(spec, Selection):
        return resolver_of(graph).adopt(spec)
    if isinstance(spec, ActivationOf) and isinstance(spec.name, Selection):
        return ActivationOf(resolver_of(graph).adopt(spec.name))
    if isinstance(spec, (list, tuple)):
        return type(spec)(adopted(graph, s) for s in spec)
    if isinstance(spec, dict):
        return {k: adopted(graph, s) for k, s in spec.items()}
    return spec


def spec_items(spec: Any) -> list[Any]:
    """The names of a `start` or `end` as a user gives them (one, a list, a tuple or a
    dict of them, None for none), in order: how every reader of a specification lists it
    before resolving it."""
    if spec is None:
        return []
    return flat_ports(_as_container(spec))


def _as_container(spec: Any) -> Any:
    """A user's container of names (a list, a tuple or a dict, subclasses too) as a plain
    tuple or dict, the containers `flat_ports` and `map_ports` take apart."""
    if isinstance(spec, (list, tuple)):
        return tuple(spec)
    return dict(spec) if isinstance(spec, dict) else spec


def flat_ports(ends: Any) -> list[Any]:
    """The items of resolved ends, or of the trees they yield (one item, a plain tuple or
    a plain dict of them), in order.

    Only a plain tuple or dict is a container of ends (`resolve_ends` makes the user's one
    so). An end's own tree may be a tuple or dict subclass (a NamedTuple, a HF
    ``ModelOutput``): that is one item, kept whole, so its type survives `map_ports`.
    (A plain tuple or dict as one end's tree comes out the same either way.)
    """
    if type(ends) is tuple:
        return list(ends)
    if type(ends) is dict:
        return list(ends.values())
    return [ends]


def map_ports(fn: Callable[[Any], Any], ends: Any) -> Any:
    """`fn` of each item of ends (see `flat_ports`), in a container like theirs."""
    if type(ends) is tuple:
        return tuple(fn(p) for p in ends)
    if type(ends) is dict:
        return {k: fn(p) for k, p in ends.items()}
    return fn(ends)


def resolve_starts(graph: Graph, resolver: Resolver, start: Any) -> tuple[Selection, ...] | None:
    """The ports of a `start` specification (None: the model's inputs)."""
    if start is None:
        return None
    specs = [start] if isinstance(start, Name | Selection) else start
    if not isinstance(specs, (list, tuple)) or not specs:
        raise StartSpecError(start=written(start))
    return tuple(_start_port(graph, resolver, spec) for spec in specs)


def model_inputs(graph: Graph) -> Selection:
    """The model's own inputs as a start (``start=None``)."""
    return Selection(None, graph.model_input_call(), INPUT)


def _start_port(graph: Graph, resolver: Resolver, spec: Any) -> Selection:
    if spec is None:
        return model_inputs(graph)
    return resolver.select(spec, INPUT)


# What `end` may be: one end (a name, a record resolved before, an activation or None)
# or a container of them.
_END_TYPES = (Name, Selection, ActivationOf, type(None), list, tuple, dict)


def resolve_ends(graph: Graph, resolver: Resolver, end: Any) -> Any:
    """A `Selection`, a tuple or a dict of them, as `end` was given."""
    _check_end(end)
    return map_ports(functools.partial(_end_port, graph, resolver), _as_container(end))


def _check_end(end: Any) -> None:
    if not isinstance(end, _END_TYPES):
        raise EndSpecError(end=end)
    if isinstance(end, (list, tuple, dict)) and not end:
        raise EmptyEndError(end=end)


def _end_port(graph: Graph, resolver: Resolver, spec: Any) -> Selection:
    if isinstance(spec, ActivationOf):
        return _activation_port(graph, resolver, spec)
    if spec is None:
        out_call = dataclasses.replace(
            graph.model_input_call(),
            name="<output>",
            out_tree=graph.out_tree,
            out_slots=graph.out_slots,
            stop=len(graph.eqns),
        )
        return Selection(None, out_call, OUTPUT)
    return resolver.select(spec, OUTPUT)


def _activation_port(graph: Graph, resolver: Resolver, spec: ActivationOf) -> Selection:
    call = resolver.select(spec.name, OUTPUT).call
    vid = single_output_id(call)
    if vid is None:
        raise NoActivationError(name=spec.name.spec)
    act = activation_of(graph, call, vid)
    synthetic = dataclasses.replace(
        call, out_tree=jax.tree_util.tree_structure(0), out_slots=[Slot(act)]
    )
    return Selection(spec.name.spec, synthetic, OUTPUT)
