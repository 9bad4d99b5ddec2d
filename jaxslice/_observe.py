"""Compiled observation of chosen layers over streams of batches.

An `Observer` turns a model and a list of layers into one jit-compiled step per input
shape: it runs the slice from the model's inputs to those layers (nothing past the last
one), reduces each layer's output to neuron values and hands them to an accumulator
function, which returns the new accumulator state. Coverage tracking and activation
statistics are both built on it.

Batches are the model's inputs (an array, or a tuple of them); their non-batch shapes and
dtypes must be those of the sample inputs. Variables are taken when the observer is made
(for NNX models, read from the model at each batch; its state is not written back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat, _listing, _plan, _trace
from ._errors import InputMismatchError, InvalidSpecError
from ._names import Resolver
from ._sliced import Sliced

GRANULARITIES = ("channel", "element")
POSITIONS = ("output", "activation")


def default_layers(traced: _trace.Traced) -> list[str]:
    """Calls of modules that hold parameters themselves (for plain functions, whose
    parameters have no owner, calls with parameters and no such call nested in them),
    whose output is a single array."""
    graph = traced.graph
    own = traced.adapter.own_parameter_modules(traced.split.variables)
    table = {c.qualname: b for c, b in zip(graph.calls, _listing.describe(traced), strict=True)}
    calls = [c for c in graph.calls if c.loop is None and table[c.qualname].param_count > 0]
    layers = []
    for c in calls:
        if own is not None:
            mine = c.path in own and c.method == "__call__"
        else:
            mine = not any(
                d is not c
                and c.start <= d.start
                and d.stop <= c.stop
                and (d.start, d.stop) != (c.start, c.stop)
                for d in calls
            )
        outs = [s for s in c.out_slots if s.id is not None]
        if (
            mine
            and len(c.out_slots) == 1
            and len(outs) == 1
            and len(graph.avals[outs[0].id].shape) >= 1
        ):
            layers.append(c.qualname)
    return layers


def neurons(x: Any, granularity: str) -> Any:
    """(batch, neurons) values of a layer output: channel means, or every element."""
    x = x.astype(jnp.float32)
    if x.ndim == 1:
        return x[:, None]
    if granularity == "channel":
        return jnp.mean(x, axis=tuple(range(1, x.ndim - 1))) if x.ndim > 2 else x
    return x.reshape(x.shape[0], -1)


def scaled(x: Any) -> Any:
    """Each input's layer output min-max scaled to [0, 1] over all its elements (0 if constant)."""
    x = x.astype(jnp.float32)
    flat = x.reshape(x.shape[0], -1)
    lo = jnp.min(flat, axis=1).reshape((-1,) + (1,) * (x.ndim - 1))
    hi = jnp.max(flat, axis=1).reshape((-1,) + (1,) * (x.ndim - 1))
    span = hi - lo
    return jnp.where(span > 0, (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


class Observer:
    """Runs a model up to chosen layers, compiled, and feeds their outputs to a function."""

    def __init__(
        self,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        layers: Sequence[str] | None,
        position: str = "output",
    ):
        if position not in POSITIONS:
            raise InvalidSpecError(f"position must be one of {POSITIONS}, got {position!r}.")
        traced = _trace.trace(target, args, kwargs)
        self.target = target
        self.kind = traced.adapter.kind
        if layers is None:
            layers = default_layers(traced)
        elif isinstance(layers, str) or not all(isinstance(n, str) for n in layers):
            raise InvalidSpecError(
                f"`layers` must be a list of boundary names or None, got {layers!r}."
            )
        resolver = Resolver(traced.graph)
        order = {}
        for name in layers:
            call, _ = resolver.resolve(name, "output")  # unknown / ambiguous names raise here
            order[name] = (call.start, call.in_seq)
        layers = sorted(dict.fromkeys(layers), key=order.__getitem__)  # in call order
        if not layers:
            raise InvalidSpecError(
                "No layers to observe: the model has no module with parameters; name `layers`."
            )
        self.layers = list(layers)
        ends = {n: (_plan.ActivationOf(n) if position == "activation" else n) for n in self.layers}
        self.engine = Sliced(traced, None, ends)
        split = traced.split
        self.variables = split.variables
        self.rngs = split.rngs
        self.sample = [
            _trace.abstract(x)
            for x in jax.tree_util.tree_leaves((split.args, split.kwargs))
            if _trace.is_traced_leaf(x)
        ]
        base = self.engine._base
        self.shapes = [tuple(base.traced.graph.avals[i].shape) for i in base.plan.output_ids]
        self._steps: dict[tuple[int, int], Callable[..., Any]] = {}

    def batch_size(self, batch: Any) -> int:
        args = self._inputs(batch)
        leaves = [x for x in jax.tree_util.tree_leaves(args) if _trace.is_traced_leaf(x)]
        return int(jnp.shape(leaves[0])[0]) if leaves and jnp.ndim(leaves[0]) else 1

    def _inputs(self, batch: Any) -> tuple[Any, ...]:
        args = batch if isinstance(batch, tuple) else (batch,)
        leaves = [x for x in jax.tree_util.tree_leaves(args) if _trace.is_traced_leaf(x)]
        ok = len(leaves) == len(self.sample) and all(
            jnp.ndim(x) == len(s.shape)
            and tuple(jnp.shape(x)[1:]) == tuple(s.shape[1:])
            and jnp.result_type(x) == s.dtype
            for x, s in zip(leaves, self.sample, strict=False)
        )
        if not ok:
            fmt = lambda xs: ", ".join(f"{jnp.result_type(x)}{list(jnp.shape(x))}" for x in xs)  # noqa: E731
            raise InputMismatchError(
                f"A batch must hold the model's inputs with the sample's non-batch shapes and dtypes "
                f"({fmt(self.sample)}); got ({fmt(leaves)})."
            )
        return args

    def run(
        self,
        key: int,
        batch: Any,
        make_step: Callable[[Callable[..., list[Any]]], Callable[..., Any]],
        *state: Any,
    ) -> Any:
        """Applies the compiled step ``make_step(layer_outputs_fn)`` to a batch and `state`."""
        args = self._inputs(batch)
        mutable = self.kind == "nnx"
        entry, leaves = self.engine._lookup(args, {}, self.rngs, mutable)
        if self.kind == "nnx":
            from flax import nnx

            from ._interpret import variable_values

            by_path = dict(
                zip(
                    entry.traced.graph.variable_paths,
                    variable_values(entry.traced, nnx.state(self.target)),
                    strict=True,
                )
            )
            var_leaves = [by_path[p] for p in entry.plan.variable_paths]
        else:
            var_leaves = self.engine._variable_leaves(entry.plan, self.variables, strict=False)
        rng_leaves = self.engine._rng_leaves(entry, self.rngs)
        step = self._steps.get((key, id(entry)))
        if step is None:
            n = len(self.layers)

            def outputs(v: list[Any], r: list[Any], x: list[Any], _fn: Any = entry.fn) -> list[Any]:
                return _fn(v, r, x)[:n]

            step = jax.jit(make_step(outputs))
            self._steps[(key, id(entry))] = step
        return step(var_leaves, rng_leaves, leaves, *state)


_compat.register_frames_exclusion(__file__)
