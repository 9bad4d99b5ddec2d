"""Re-emitting part of a graph as an ordinary JAX function.

The function reads a fixed list of value ids from its arguments, evaluates the chosen
equations in program order by binding each primitive again (`_compat.bind_eqn`, as
`jax.core.eval_jaxpr` does), and returns the requested values. Marker equations are not
in the graph's equation list, so they never appear in the result. Because evaluation
happens at trace time, wrapping the function in `jax.jit` compiles exactly the chosen
equations and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import _compat
from ._graph import Graph


def emit(
    graph: Graph,
    eqn_indices: Sequence[int],
    arg_ids: Sequence[Sequence[int]],
    output_ids: Sequence[int],
) -> Callable[..., list[Any]]:
    """A function ``f(*groups) -> outputs``; ``groups[k]`` holds values for ``arg_ids[k]``."""
    eqns = [graph.eqns[i] for i in eqn_indices]
    needed = {v for e in eqns for v in e.ins} | set(output_ids)
    consts = {v: graph.consts[v] for v in needed if v in graph.consts}
    arg_ids = [tuple(ids) for ids in arg_ids]
    output_ids = tuple(output_ids)

    def run(*groups: Sequence[Any]) -> list[Any]:
        env: dict[int, Any] = dict(consts)
        for ids, values in zip(arg_ids, groups, strict=True):
            env.update(zip(ids, values, strict=True))
        for eqn in eqns:
            outs = _compat.bind_eqn(eqn.jax_eqn, [env[v] for v in eqn.ins])
            env.update(zip(eqn.outs, outs, strict=True))
        return [env[v] for v in output_ids]

    return run


_compat.register_frames_exclusion(__file__)
