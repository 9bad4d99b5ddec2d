"""The activation applied to a layer's output: what ``position="activation"`` observes.

An activation function is rarely one equation: GELU is a polynomial, a tanh and three
products, swish is ``h * sigmoid(h)``, and a model may write ``relu(2 * h)``. So the
activation of a value ``h`` is the elementwise computation that the code calling the
layer applies to ``h`` alone, taken whole: the equations after ``h`` that map values of
``h``'s shape, computed from ``h`` and from fixed values (constants, and variables: a
PReLU's slope), to one value of that shape. The equations must be the caller's own, or
those of a module that does nothing else (a Keras ``Activation`` layer, an Equinox
``Lambda``: its equations read no variables); another module's equations (a BatchNorm
after the layer) are not the layer's activation. Values drawn from random keys (a
functional dropout's mask) are not fixed. The activation is the one value of that
computation that anything outside it reads; where it hands on several (a gate and its
complement), it is the first equation of it that reads ``h``, if that gives a value of
``h``'s dtype; where nothing follows, ``h`` itself.
"""

from __future__ import annotations

import heapq
from typing import Any

import jax.numpy as jnp

from .graph import Call, Graph

# Primitives that keep a value's shape but mix its elements: never part of an activation.
_MIXING = frozenset({
    "dot_general", "conv_general_dilated", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "rev", "transpose", "gather", "scatter", "scatter-add",
    "scatter_add", "dynamic_slice", "dynamic_update_slice", "reduce_window",
    "reduce_window_sum", "select_and_scatter_add", "scan", "while", "cond", "fft",
    "psum", "all_gather", "all_to_all", "ppermute",
})  # fmt: skip


def activation_of(graph: Graph, call: Call, vid: int) -> int:
    """The value the activation applied to `vid` (the output of `call`) makes of it, or
    `vid` where none follows (see the module's docstring)."""
    readers = _readers(graph)
    inside = _elementwise_after(graph, call, vid)
    outputs = {s.id for s in graph.out_slots}
    computed = [out for e in sorted(inside) for out in graph.eqns[e].outs]
    exits = [v for v in computed if v in outputs or not inside.issuperset(readers.get(v, ()))]
    if len(exits) == 1 and jnp.issubdtype(graph.avals[exits[0]].dtype, jnp.inexact):
        return exits[0]
    return _first_step(graph, inside, vid)


def _first_step(graph: Graph, inside: set[int], vid: int) -> int:
    """Where the computation hands several values on (or none): the value of its first
    equation that reads `vid`, if of `vid`'s dtype; else `vid`."""
    first = min((e for e in inside if vid in graph.eqns[e].ins), default=None)
    found = vid if first is None else graph.eqns[first].outs[0]
    return found if graph.avals[found].dtype == graph.avals[vid].dtype else vid


def _elementwise_after(graph: Graph, call: Call, vid: int) -> set[int]:
    """The equations of the elementwise computation applied to `vid`, grown in program
    order from its readers: an equation in the caller's own code joins alone, one in a
    module the value goes into only with the whole module."""
    readers = _readers(graph)
    region, inside, decided = {vid}, set(), set()
    fixed: dict[int, bool] = {}
    todo = list(readers.get(vid, ()))
    heapq.heapify(todo)
    while todo:
        e = heapq.heappop(todo)
        if e in decided:
            continue
        outer = _outer_call(graph, call, e)
        eqns = range(outer.start, outer.stop) if outer is not None else range(e, e + 1)
        decided.update(eqns)
        joined = _joined(graph, eqns, region, graph.avals[vid].shape, fixed, outer is None)
        for k in joined or ():
            inside.add(k)
            region.update(graph.eqns[k].outs)
            for v in graph.eqns[k].outs:
                for r in readers.get(v, ()):
                    heapq.heappush(todo, r)
    return inside


def _joined(
    graph: Graph, eqns: range, region: set[int], shape: Any, fixed: dict[int, bool], own: bool
) -> list[int] | None:
    """The equations among `eqns` (all of a module's, or one of the caller's) that compute
    from the region, if every one of them maps it elementwise to a value of its `shape`
    (from values of the region and fixed ones; variables only in the caller's `own`
    code); else None. Equations that compute from fixed values alone are constants (a
    module's `0` for its relu)."""
    joined, computed = [], set(region)
    for k in eqns:
        eqn = graph.eqns[k]
        reads = [v in computed for v in eqn.ins]
        if not any(reads):
            continue
        if not (
            len(eqn.outs) == 1
            and getattr(graph.avals[eqn.outs[0]], "shape", None) == shape
            and eqn.primitive not in _MIXING
            and all(
                r or _is_fixed(graph, v, fixed, own) for r, v in zip(reads, eqn.ins, strict=True)
            )
        ):
            return None
        joined.append(k)
        computed.add(eqn.outs[0])
    return joined


def _readers(graph: Graph) -> dict[int, list[int]]:
    """``{value: the indices of the equations that read it}``, made once per graph."""

    def make() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, eqn in enumerate(graph.eqns):
            for v in dict.fromkeys(eqn.ins):
                out.setdefault(v, []).append(i)
        return out

    return graph.memo("readers", make)


def _outer_call(graph: Graph, call: Call, e: int) -> Call | None:
    """The outermost call holding equation `e` that does not hold `call` (a module the
    layer's output goes into), or None where `e` is the caller's own code."""
    holding = [
        c
        for c in graph.calls
        if c.start <= e < c.stop and not (c.start <= call.start and call.stop <= c.stop)
    ]
    return min(holding, key=lambda c: (c.start, -c.stop), default=None)


def _is_fixed(graph: Graph, v: int, memo: dict[int, bool], variables: bool) -> bool:
    """Whether `v` is a constant (or, with `variables`, a variable) or computed from such
    values alone (a random key's values are not)."""
    if v in graph.consts:
        return True
    if v in graph.variable_set:
        return variables
    key = v if variables else ~v
    if key not in memo:
        memo[key] = False  # (a cycle cannot happen; this only stops a deep recursion twice)
        producer = graph.producer.get(v)
        memo[key] = producer is not None and all(
            _is_fixed(graph, u, memo, variables) for u in graph.eqns[producer].ins
        )
    return memo[key]
