"""Re-emitting part of a graph as an ordinary JAX function.

The function reads a fixed list of value ids from its arguments, evaluates the chosen
equations in program order by binding each primitive again (`_compat.bind_eqn`, as
`jax.core.eval_jaxpr` does), and returns the requested values. Marker equations are not
in the graph's equation list, so they never appear in the result. Because evaluation
happens at trace time, wrapping the function in `jax.jit` compiles exactly the chosen
equations and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _compat
from ._graph import Graph, Slot, innermost


def emit(
    graph: Graph,
    eqns: Sequence[Any],
    arg_ids: Sequence[Sequence[int]],
    output_ids: Sequence[int],
) -> Callable[..., list[Any]]:
    """A function ``f(*groups) -> outputs``; ``groups[k]`` holds values for ``arg_ids[k]``."""
    eqns = list(eqns)
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


# --------------------------------------------------------------------------- Interpreter


@dataclasses.dataclass(frozen=True)
class Equation:
    """What an `Interpreter.equation` hook learns about one equation.

    Attributes:
      primitive: the primitive's name (``"dot_general"``, ``"max"``, ...).
      params: the primitive's parameters.
      index: the equation's position in the flat program.
      scopes: the `jax.named_scope` names active at it.
      boundary: the innermost module call it belongs to (a qualified name), or None.
      source: ``file:line`` of the model code that produced it, when known.
    """

    primitive: str
    params: dict[str, Any]
    index: int
    scopes: tuple[str, ...]
    boundary: str | None
    source: str | None


class Interpreter:
    """Base class for custom interpreters over a model's traced program.

    Subclass it and override `boundary` and/or `equation`. `build` turns a model into an
    ordinary JAX function ``fn(variables, *inputs) -> (output, emitted)`` that evaluates
    the model equation by equation and calls the hooks; each hook may return replacement
    values. Hooks run while the function is traced (once per input shape, since `build`
    compiles with `jax.jit`), so they cost nothing at run time beyond what they compute.
    Values passed to `emit` come back in the ``emitted`` dict.

    Set ``recurse = True`` for equation hooks to see inside call-like equations (``jit``,
    ``custom_jvp``, ``remat``) that hold no boundary; they are then evaluated through their
    bodies (with ordinary, not custom, derivatives). Loop bodies stay opaque.

    >>> import jax, jax.numpy as jnp, jaxslice as js
    >>> class CountReLU(js.Interpreter):
    ...     def equation(self, eqn, inputs, outputs):
    ...         if eqn.primitive == "max":
    ...             self.emit(f"zeros/{eqn.index}", jnp.mean(outputs[0] == 0))
    ...         return outputs
    >>> fn = CountReLU().build(lambda p, x: jnp.maximum(x @ p, 0), jnp.eye(2), jnp.ones((1, 2)))
    >>> out, emitted = fn(-jnp.eye(2), jnp.ones((1, 2)))
    >>> [float(v) for v in emitted.values()]
    [1.0]
    """

    recurse: bool = False

    def boundary(self, name: str, side: str, value: Any) -> Any:
        """Called for each module call's input (``side="input"``) and output.

        Args:
          name: the call's qualified name (``block1/conv``, ``shared@1``).
          side: ``"input"`` (the call's array arguments: one argument, or a tuple of them)
            or ``"output"`` (the call's result pytree).
          value: the values (tracers while compiling).

        Returns:
          `value`, or a replacement of the same structure. A replaced output is what every
          later equation reads; a replaced input is what the module's own equations read.
        """
        return value

    def equation(self, eqn: Equation, inputs: list[Any], outputs: list[Any]) -> list[Any]:
        """Called after each equation; returns its outputs or replacements."""
        return outputs

    def emit(self, key: Any, value: Any) -> None:
        """Returns `value` from the built function under `key` (valid inside hooks)."""
        if self._emitted is None:
            raise RuntimeError("Interpreter.emit can only be called from a hook.")
        self._emitted[key] = value

    _emitted: dict[Any, Any] | None = None
    _current_call: Any = None  # the graph call whose hook is running (for subclasses in jaxslice)

    def build(self, target: Any, *args: Any, jit: bool = True, **kwargs: Any) -> Callable[..., Any]:
        """An ordinary JAX function running `target` through this interpreter.

        Args:
          target, *args, **kwargs: as for `js.slice` (``model, variables, *inputs`` for
            linen, ``fn, params, *inputs`` for plain functions, ``model, *inputs`` for NNX).
          jit: compile the function with `jax.jit` (hooks then run once per shape).

        Returns:
          ``fn(variables, *inputs) -> (output, emitted)``. For NNX models `variables` is
          ``nnx.state(model)``.
        """
        from . import _trace
        from ._sliced import Sliced

        engine = Sliced(_trace.trace(target, args, kwargs), None, None)
        interpreter = self

        def call(variables: Any, *inputs: Any, rngs: Any = None, **kw: Any) -> Any:
            adapter = engine._base.traced.adapter
            mutable = adapter.kind == "nnx"
            entry, leaves = engine._lookup(inputs, kw, rngs, mutable)
            values = variable_values(entry.traced, variables)
            rng_leaves = [x for x in jax.tree_util.tree_leaves(rngs)] if rngs is not None else []
            return _run(entry.traced.graph, interpreter, values, rng_leaves, leaves)

        return jax.jit(call) if jit else call


def variable_values(traced: Any, variables: Any) -> list[Any]:
    """Values for `traced.graph.variable_ids`, looked up by path in `variables`."""
    graph = traced.graph
    if traced.adapter.kind == "nnx":
        from .adapters._nnx import flat_state, get_value

        flat = {p: get_value(v) for p, v in flat_state(variables)}
    else:
        flat = dict(jax.tree_util.tree_flatten_with_path(variables)[0])
    missing = [p for p in graph.variable_paths if p not in flat]
    if missing:
        from ._errors import VariablesMismatchError

        raise VariablesMismatchError(
            "The variables passed lack entries the model reads: "
            + ", ".join(str(p) for p in missing[:6])
            + ". Pass the model's full variables (for NNX, `nnx.state(model)`)."
        )
    return [flat[p] for p in graph.variable_paths]


def _events(graph: Graph) -> dict[int, list[tuple[float, str, Any]]]:
    from ._markers import INPUT, OUTPUT

    events: dict[int, list[tuple[float, str, Any]]] = {}
    for call in graph.calls:
        if call.loop is not None:
            continue
        in_key = call.in_seq if call.kind != "scope" else 1e18
        out_key = call.out_seq if call.kind != "scope" else -1e18
        events.setdefault(call.start, []).append((in_key, INPUT, call))
        events.setdefault(call.stop, []).append((out_key, OUTPUT, call))
    for evs in events.values():
        evs.sort(key=lambda e: e[0])
    return events


def _owner(graph: Graph) -> list[str | None]:
    calls = innermost([c for c in graph.calls if c.loop is None], len(graph.eqns))
    return [c.qualname if c is not None else None for c in calls]


def _source(eqn: Any) -> str | None:
    return _compat.source_line(eqn)


def _run(
    graph: Graph,
    interp: Interpreter,
    var_values: list[Any],
    rng_values: list[Any],
    inputs: list[Any],
) -> Any:
    from . import _plan
    from ._markers import INPUT
    from ._sliced import _assemble

    env: dict[int, Any] = dict(graph.consts)
    env.update(zip(graph.variable_ids, var_values, strict=True))
    env.update(zip(graph.rng_ids, rng_values, strict=False))
    env.update(zip(graph.input_ids, inputs, strict=True))
    overlays: list[tuple[int, dict[int, Any]]] = []
    events = _events(graph)
    owner = _owner(graph)

    def read(v: int, pos: int) -> Any:
        for stop, values in reversed(overlays):
            if stop > pos and v in values:
                return values[v]
        return env[v]

    interp._emitted = {}
    try:
        for pos in range(len(graph.eqns) + 1):
            overlays[:] = [o for o in overlays if o[0] > pos]
            for _, side, call in events.get(pos, ()):
                port = _plan.Port(call.qualname, call, side)
                tree = _plan.port_value_tree(graph, port)
                slots = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Slot))
                value = _assemble(tree, [read(s.id, pos) for s in slots if s.id is not None])
                interp._current_call = call
                new = interp.boundary(call.qualname, side, value)
                if new is value:
                    continue
                new_leaves, new_tree = jax.tree_util.tree_flatten(new)
                if new_tree != jax.tree_util.tree_structure(value):
                    from ._errors import SliceError

                    raise SliceError(
                        f"The boundary hook for {call.qualname!r} ({side}) returned a value of structure "
                        f"{new_tree}; it must keep the structure {jax.tree_util.tree_structure(value)}."
                    )
                ids = [s.id for s in slots if s.id is not None]
                if side == INPUT:
                    overlays.append((call.stop, dict(zip(ids, new_leaves, strict=True))))
                else:
                    env.update(zip(ids, new_leaves, strict=True))
            if pos == len(graph.eqns):
                break
            eqn = graph.eqns[pos]
            ins = [read(v, pos) for v in eqn.ins]
            body = _compat.call_body(eqn.jax_eqn) if interp.recurse else None
            if body is not None:
                outs = _eval_body(body, ins, interp, pos, eqn.scopes, owner[pos])
            else:
                outs = _compat.bind_eqn(eqn.jax_eqn, ins)
            info = Equation(
                _compat.primitive_name(eqn.jax_eqn),
                dict(eqn.jax_eqn.params),
                pos,
                eqn.scopes,
                owner[pos],
                _source(eqn.jax_eqn),
            )
            outs = list(interp.equation(info, ins, outs))
            env.update(zip(eqn.outs, outs, strict=True))
        out_tree = jax.tree_util.tree_unflatten(graph.out_tree, graph.out_slots)
        output = _assemble(out_tree, [env[s.id] for s in graph.out_slots if s.id is not None])
        return output, dict(interp._emitted)
    finally:
        interp._emitted = None


def _eval_body(
    body: Any,
    ins: list[Any],
    interp: Interpreter,
    pos: int,
    scopes: tuple[str, ...],
    owner: str | None,
) -> list[Any]:
    jaxpr, consts = body
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, ins, strict=True))

    def read(a: Any) -> Any:
        return _compat.literal_value(a) if _compat.is_literal(a) else env[a]

    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        sub = _compat.call_body(eqn)
        outs = (
            _eval_body(sub, args, interp, pos, scopes, owner)
            if sub is not None
            else _compat.bind_eqn(eqn, args)
        )
        info = Equation(
            _compat.primitive_name(eqn),
            dict(eqn.params),
            pos,
            scopes + _compat.eqn_scopes(eqn),
            owner,
            _source(eqn),
        )
        outs = list(interp.equation(info, args, outs))
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not _compat.is_dropvar(v):
                env[v] = o
    return [read(a) for a in jaxpr.outvars]
