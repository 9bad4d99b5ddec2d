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
    shape = graph.avals[vid].shape
    region, decided = {vid}, set()
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
        # A module that does nothing but map the region elementwise joins whole.
        joined, new = True, set()
        for i in eqns:
            eqn = graph.eqns[i]
            computed = region | new
            reads = [v in computed for v in eqn.ins]
            if not any(reads):
                continue  # a module's constant (its `0` for a relu), or nothing of h's
            ok = (
                len(eqn.outs) == 1
                and getattr(graph.avals[eqn.outs[0]], "shape", None) == shape
                and eqn.primitive not in _MIXING
                and all(
                    r or _is_fixed(graph, v, fixed, outer is None)
                    for r, v in zip(reads, eqn.ins, strict=True)
                )
            )
            if not ok:
                joined = False
                break
            new.add(eqn.outs[0])
        if not joined:
            continue
        region |= new
        for v in new:
            for r in readers.get(v, ()):
                if r not in decided:
                    heapq.heappush(todo, r)
    outputs = {s.id for s in graph.out_slots}
    inside = {graph.producer[v] for v in region if v != vid}
    exits = [
        v
        for v in region - {vid}
        if v in outputs or any(r not in inside for r in readers.get(v, ()))
    ]
    if len(exits) == 1 and jnp.issubdtype(graph.avals[exits[0]].dtype, jnp.inexact):
        return exits[0]
    # Several values handed on: the first equation of the computation that reads `vid`.
    first = min((i for i in inside if vid in graph.eqns[i].ins), default=None)
    if first is not None and graph.avals[graph.eqns[first].outs[0]].dtype == graph.avals[vid].dtype:
        return graph.eqns[first].outs[0]
    return vid


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
