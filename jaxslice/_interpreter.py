"""`js.Interpreter`: custom interpreters over a model's traced program.

A thin view over the engine: `build` traces the model once (`SliceProgram` of the whole
model, re-traced per input shape) and runs its graph through `_core.evaluate.evaluate`,
which calls the hooks at every boundary and equation and keeps scans as scans.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from . import _compat
from ._core.checks import values_at
from ._core.evaluate import BoundaryEvent, Equation, Hooks
from ._core.evaluate import evaluate as evaluate_graph
from ._core.loops import written_out
from ._core.program import SliceProgram
from .adapters import adapter_for

__all__ = ["Equation", "Interpreter"]


class Interpreter(Hooks):
    """Base class for custom interpreters over a model's traced program.

    Subclass it and override `boundary` and/or `equation`. `build` turns a model into an
    ordinary JAX function ``fn(variables, *inputs) -> (output, emitted)`` that evaluates
    the model equation by equation and calls the hooks; each hook may return replacement
    values. Hooks run while the function is traced (once per input shape, since `build`
    compiles with `jax.jit`), so they cost nothing at run time beyond what they compute.
    Values passed to `emit` come back in the ``emitted`` dict.

    Set ``recurse = True`` for equation hooks to see inside call-like equations (``jit``,
    ``custom_jvp``, ``remat``) that hold no boundary; they are then evaluated through their
    bodies (with ordinary, not custom, derivatives).

    A `scan` whose body holds boundaries stays one scan: the hooks run once, inside the
    loop, on one iteration's values, and see its calls by their per-iteration names with
    ``[:]`` (``layers[:]/mlp``); a value emitted there comes back stacked over the
    iterations (row k from iteration k). Equation hooks see the body's equations once, with
    the loop's `index`. So observing a 24-layer scanned stack compiles about as fast as the
    model. A `while_loop` whose body holds boundaries stays one `while_loop` the same way;
    its number of iterations is known only when it runs, so its calls have only their
    every-iteration names (``loop/step[:]``) and a value emitted there comes back as the
    last iteration's (zeros if the loop ran no iteration). Set ``unroll = True`` to have every iteration written out instead, each named by
    its index (``layers[3]/mlp``) and hooked on its own (compile time then grows with the
    number of iterations).

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
    unroll: bool = False
    _emitted: dict[Any, Any] | None = None

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

    def on_boundary(self, event: BoundaryEvent) -> Any:
        """The engine's hook; calls `boundary` with the event's name, side and value."""
        return self.boundary(event.name, event.side, event.value)

    def emit(self, key: Any, value: Any) -> None:
        """Returns `value` from the built function under `key` (valid inside hooks)."""
        if self._emitted is None:
            raise RuntimeError("Interpreter.emit can only be called from a hook.")
        self._emitted[key] = value

    def open_loop(self) -> Any:
        """The engine's hook: values emitted in a loop body are kept apart."""
        outer, self._emitted = self._emitted, {}
        return outer

    def close_loop(self, token: Any) -> dict[Any, Any]:
        """The engine's hook: what the loop body emitted leaves the loop."""
        inner, self._emitted = self._emitted, token
        return inner

    def leave_loop(self, values: dict[Any, Any]) -> None:
        """The engine's hook: values emitted in a loop body, stacked over its iterations."""
        if self._emitted is not None:
            self._emitted.update(values)

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
        program = SliceProgram.build(target, args, kwargs, adapter=adapter_for(target))

        def call(variables: Any, *inputs: Any, rngs: Any = None, **kw: Any) -> Any:
            mutable = program.base.traced.split.mutable
            entry, leaves = program.lookup(inputs, kw, rngs, mutable)
            graph = written_out(entry.traced.graph) if self.unroll else entry.traced.graph
            values = variable_values(program, graph, variables)
            rng_leaves = list(jax.tree_util.tree_leaves(rngs)) if rngs is not None else []
            return self.evaluate(graph, values, rng_leaves, leaves)

        return jax.jit(call) if jit else call

    def evaluate(self, graph: Any, values: list[Any], rngs: list[Any], inputs: list[Any]) -> Any:
        """Runs a traced graph through the hooks: ``(output, emitted)``."""
        self._emitted = {}
        try:
            output = evaluate_graph(graph, self, values, rngs, inputs)
            return output, dict(self._emitted)
        finally:
            self._emitted = None


def variable_values(program: SliceProgram, graph: Any, variables: Any) -> list[Any]:
    """Values for `graph.variable_ids`, looked up by path in `variables`."""
    return values_at(graph, program.adapter.flat_values(variables))


_compat.register_frames_exclusion(__file__)
