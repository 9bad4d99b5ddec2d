"""`js.boundaries`: the module calls of a model, as a printable table."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from . import _compat, _plan, _trace
from ._graph import Call, Graph, describe_aval
from ._markers import INPUT


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One module call that a slice can start or end at.

    Attributes:
      name: the name to use in `start`/`end` (``path``, ``path.method``, ``path@k``).
      module_type: the module's class (or the marked function's name).
      call_index: which call of that module this is, from 0.
      num_calls: how many times the module is called.
      inputs: shapes and dtypes of the call's array arguments (parameters excluded).
      outputs: shapes and dtypes of its output leaves.
      param_count: number of parameter values the module (with its submodules) holds.
      loop: the loop or conditional primitive the call is inside, or None.
    """

    name: str
    module_type: str
    call_index: int
    num_calls: int
    inputs: tuple[jax.ShapeDtypeStruct, ...]
    outputs: tuple[jax.ShapeDtypeStruct, ...]
    param_count: int
    loop: str | None = None


class BoundaryTable(list):
    """A list of `Boundary` that prints as a table."""

    def __str__(self) -> str:
        rows = [("name", "type", "call", "inputs", "outputs", "params")]
        for b in self:
            rows.append(
                (
                    b.name + (f"  [in {b.loop}]" if b.loop else ""),
                    b.module_type,
                    f"{b.call_index}/{b.num_calls}",
                    _fmt(b.inputs),
                    _fmt(b.outputs),
                    f"{b.param_count:,}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def names(self) -> list[str]:
        return [b.name for b in self]


def _fmt(avals: tuple[jax.ShapeDtypeStruct, ...]) -> str:
    if not avals:
        return "-"
    return ", ".join(describe_aval(a) for a in avals)


def _avals(graph: Graph, ids: list[int]) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(graph.avals[i].shape, graph.avals[i].dtype) for i in ids)


def describe(traced: _trace.Traced) -> BoundaryTable:
    graph = traced.graph
    table = BoundaryTable()
    for call in graph.calls:
        table.append(_describe_call(traced, call))
    return table


def _describe_call(traced: _trace.Traced, call: Call) -> Boundary:
    graph = traced.graph
    if call.loop is None:
        in_ids = [
            i
            for a in _plan.arguments_of(graph, _plan.Port(call.name, call, INPUT))
            for i in a.input_ids
        ]
        out_ids = [s.id for s in call.out_slots if s.id is not None]
        inputs, outputs = _avals(graph, in_ids), _avals(graph, out_ids)
    else:
        inputs = outputs = ()
    if call.kind in ("linen", "nnx"):
        params = traced.param_counts.get("/".join(call.path), 0)
    else:
        params = _span_params(traced, call)
    return Boundary(
        name=call.qualname,
        module_type=call.module_type,
        call_index=call.index,
        num_calls=call.count,
        inputs=inputs,
        outputs=outputs,
        param_count=params,
        loop=call.loop,
    )


def _is_parameter(path: tuple[Any, ...], linen_style: bool) -> bool:
    if not linen_style:
        return True
    first = path[0] if path else None
    return getattr(first, "key", first) == "params"


def _span_params(traced: _trace.Traced, call: Call) -> int:
    graph = traced.graph
    tree = traced.split.variables
    linen_style = isinstance(tree, Mapping) and "params" in tree
    variables = {
        v
        for v, p in zip(graph.variable_ids, graph.variable_paths, strict=True)
        if _is_parameter(p, linen_style)
    }
    used = {v for e in graph.eqns[call.start : call.stop] for v in e.ins if v in variables}
    return sum(int(getattr(graph.avals[v], "size", 0)) for v in used)


def boundaries(target: Any, *args: Any, **kwargs: Any) -> BoundaryTable:
    """Every module call of a model, in the order the calls run.

    Args:
      target, *args, **kwargs: as for `js.slice` (``model, variables, *inputs`` for linen,
        ``fn, params, *inputs`` for plain functions).

    Returns:
      A `BoundaryTable` (a list of `Boundary`); ``print`` it for a table of names, module
      types, call indices, input/output shapes and dtypes and parameter counts.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> print(js.boundaries(model, variables, jnp.ones((1, 3))))
    name      type   call  inputs         outputs        params
    --------  -----  ----  -------------  -------------  ------
    layers_0  Dense  0/1   float32[1, 3]  float32[1, 8]  32
    layers_2  Dense  0/1   float32[1, 8]  float32[1, 2]  18
    """
    return describe(_trace.trace(target, args, kwargs))


_compat.register_frames_exclusion(__file__)
