"""Compiled observation of chosen layers over streams of batches.

An `Observer` turns a model and a list of layers into one jit-compiled step per input
shape: it runs the slice from the model's inputs to those layers (nothing past the last
one), reduces each layer's output to neuron values and hands them to an accumulator
function, which returns the new accumulator state. Coverage tracking and activation
statistics are both built on it.

Batches are the model's inputs (an array, or a tuple of them); their non-batch shapes and
dtypes must be those of the sample inputs. Variables are taken when the observer is made,
except where the model holds them: an NNX model's are read from it at each batch (its
state is not written back), and a Keras model's from its own `keras.Variable`s, as its
slices read them, so an observer follows the model as it trains.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._core.markers import OUTPUT
from .._core.names import STACKED
from .._core.ports import ActivationOf, single_output_id
from .._core.program import SliceProgram
from .._core.selection import Name, Selection, resolver_of
from .._core.trace import Traced, trace
from .._errors import (
    BatchMismatchError,
    ChoiceError,
    LayersSpecError,
    ModelChangedError,
    NoLayersError,
    ObserverNotPicklableError,
)
from .._table import describe
from .._trees import abstract, is_traced_leaf
from ..adapters import adapter_for

GRANULARITIES = ("channel", "element")
POSITIONS = ("output", "activation")

# The slice end that observes a layer (its record), by position.
_END_AT = {"output": lambda where: where, "activation": ActivationOf}


def default_layers(traced: Traced) -> list[str]:
    """Calls of modules that hold parameters themselves (for plain functions, whose
    parameters have no owner, calls with parameters and no such call nested in them),
    whose output is a single array."""
    graph = traced.graph
    rows = zip(graph.calls, describe(traced), strict=True)
    calls = [c for c, b in rows if c.loop is None and b.param_count > 0]
    own = traced.adapter.own_parameter_modules(traced.split.variables)
    return [c.qualname for c in _owning(calls, own) if _single_array(graph, c)]


def _owning(calls: list[Any], own: Any) -> list[Any]:
    """Those of `calls` that hold parameters themselves: calls of the modules in `own`,
    or, without owners (None), the calls that have none of `calls` nested in them."""
    if own is None:
        return _innermost(calls)
    return [c for c in calls if c.path in own and c.method == "__call__"]


def _innermost(calls: list[Any]) -> list[Any]:
    """The calls with none of `calls` strictly inside them."""
    return [c for c in calls if not any(_strictly_inside(d, c) for d in calls)]


def _strictly_inside(inner: Any, outer: Any) -> bool:
    """Whether `inner`'s span lies within `outer`'s and is not the same span."""
    within = outer.start <= inner.start and inner.stop <= outer.stop
    return within and (inner.start, inner.stop) != (outer.start, outer.stop)


def _single_array(graph: Any, call: Any) -> bool:
    vid = single_output_id(call)
    return vid is not None and len(graph.avals[vid].shape) >= 1


def _array_leaves(tree: Any) -> list[Any]:
    """The leaves of `tree` that the trace takes as array inputs."""
    return [x for x in jax.tree_util.tree_leaves(tree) if is_traced_leaf(x)]


def _matches(x: Any, sample: Any) -> bool:
    """Whether a batch leaf has the sample leaf's rank, non-batch shape and dtype."""
    same_shape = jnp.ndim(x) == len(sample.shape) and tuple(jnp.shape(x)[1:]) == tuple(
        sample.shape[1:]
    )
    return same_shape and jnp.result_type(x) == sample.dtype


def _describe_leaves(leaves: Sequence[Any]) -> str:
    return ", ".join(f"{jnp.result_type(x)}{list(jnp.shape(x))}" for x in leaves)


def neurons(x: Any, granularity: str) -> Any:
    """(batch, neurons) values of a layer output: channel means, or every element."""
    x = x.astype(jnp.float32)
    if x.ndim == 1:
        return x[:, None]
    if granularity == "channel":
        return jnp.mean(x, axis=tuple(range(1, x.ndim - 1))) if x.ndim > 2 else x
    return x.reshape(x.shape[0], -1)


def neuron_count(shape: Sequence[int], granularity: str) -> int:
    """How many neurons `neurons` makes of a layer output of `shape` (batch first, at
    least one axis), worked out from the shape alone so that nothing is computed."""
    if len(shape) == 1:
        return 1
    return int(shape[-1]) if granularity == "channel" else math.prod(shape[1:])


def scaled(x: Any) -> Any:
    """Each input's layer output min-max scaled to [0, 1] over all its elements (0 if constant)."""
    x = x.astype(jnp.float32)
    flat = x.reshape(x.shape[0], -1)
    lo = jnp.min(flat, axis=1).reshape((-1,) + (1,) * (x.ndim - 1))
    hi = jnp.max(flat, axis=1).reshape((-1,) + (1,) * (x.ndim - 1))
    span = hi - lo
    return jnp.where(span > 0, (x - lo) / jnp.where(span > 0, span, 1.0), 0.0)


def _leading_size(leaves: Sequence[Any]) -> int:
    """The batch size of input leaves: the first one's leading axis (1 for a scalar)."""
    return int(jnp.shape(leaves[0])[0]) if leaves and jnp.ndim(leaves[0]) else 1


def serialised(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of an object whose state its `_observer`'s runs update (a coverage
    tracker, activation statistics), run one call at a time across threads: two updates
    at once would each read the state and the later write would drop the other's batch,
    or read state that the other's compiled step has donated."""

    @functools.wraps(method)
    def one_at_a_time(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._observer.lock:
            return method(self, *args, **kwargs)

    return one_at_a_time


class Observing:
    """Base of the objects that keep state which an `Observer`'s runs update (a coverage
    tracker, activation statistics): the attributes named in `STATE`.

    A copy (`copy.copy` or `copy.deepcopy`) observes the same model through the same
    observer (its traced model and compiled steps are shared, not made again, and so is
    its lock) with state of its own, copied to the host: the state an update donates
    can then not be the original's. Pickling raises `ObserverNotPicklableError`.
    """

    STATE: tuple[str, ...] = ()
    _observer: Observer

    def __copy__(self) -> Any:
        with self._observer.lock:
            new = object.__new__(type(self))
            new.__dict__.update(self.__dict__)
            for name in self.STATE:
                copied = jax.tree_util.tree_map(np.array, getattr(self, name))
                setattr(new, name, copied)
            return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.__copy__()

    def __reduce__(self) -> Any:
        raise ObserverNotPicklableError(kind=type(self).__name__)


class Observer:
    """Runs a model up to chosen layers, compiled, and feeds their outputs to a function."""

    def __init__(
        self,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        layers: Sequence[str] | None,
        position: str = "output",
        also_outputs: bool = False,
    ):
        """`also_outputs`: at ``position="activation"``, observe each layer's output too
        (after all the activations, in the same order)."""
        #: held by the methods of whatever keeps state that this observer's runs update
        #: (`serialised`)
        self.lock = threading.RLock()
        if position not in POSITIONS:
            raise ChoiceError(option="position", choices=POSITIONS, value=position)
        traced = trace(target, args, kwargs, adapter=adapter_for(target))
        self.target = target
        chosen = default_layers(traced) if layers is None else layers
        #: the layers as given (in call order) and each one's record, resolved once
        self.layers, self.records = _ordered_layers(traced, chosen)
        pairs = list(zip(self.layers, self.records, strict=True))
        ends: dict[Any, Any] = {n: _END_AT[position](where) for n, where in pairs}
        if also_outputs and position != "output":
            ends.update({(n, "output"): where for n, where in pairs})
        self.count = len(ends)
        split = traced.split
        self.program = program = SliceProgram(traced, None, ends)
        # Where the model holds its variables' values (Keras), they are read from it at
        # each batch (`Adapter.variables_view`); else the model's arrays are kept, taken
        # before the program drops them.
        self.variables_view = program.adapter.variables_view(program.target, program.variables)
        self.variables = split.variables if self.variables_view is None else None
        self.rngs = split.rngs
        self.sample = [abstract(x) for x in _array_leaves((split.args, split.kwargs))]
        base = self.program.base
        self.shapes = [tuple(base.traced.graph.avals[i].shape) for i in base.plan.output_ids]

    def batch_size(self, batch: Any) -> int:
        """How many inputs `batch` holds (checked as `inputs` does)."""
        return _leading_size(_array_leaves(self.inputs(batch)))

    def inputs(self, batch: Any) -> tuple[Any, ...]:
        """`batch` as the model's positional inputs (an array is one input), checked
        against the sample inputs' non-batch shapes and dtypes."""
        args = batch if isinstance(batch, tuple) else (batch,)
        leaves = _array_leaves(args)
        if len(leaves) != len(self.sample) or not all(map(_matches, leaves, self.sample)):
            raise BatchMismatchError(
                sample=_describe_leaves(self.sample), got=_describe_leaves(leaves)
            )
        return args

    def run(
        self,
        key: int,
        batch: Any,
        make_step: Callable[[Callable[..., list[Any]]], Callable[..., Any]],
        *state: Any,
        donate: tuple[int, ...] = (),
    ) -> Any:
        """Applies the compiled step ``make_step(layer_outputs_fn)`` to a batch and `state`,
        compiled once per `key` and input shape; the parts of `state` at the positions
        `donate` are donated to it (the same for every call with one key)."""
        args = self.inputs(batch)
        mutable = self.program.base.traced.split.mutable
        entry, leaves = self.program.lookup(args, {}, self.rngs, mutable)
        view = self.variables_view
        variables = self.variables if view is None else view()
        var_leaves = self.program.model_variable_leaves(entry, variables)
        rng_leaves = self.program.rng_leaves(entry, self.rngs)
        steps = entry.__dict__.setdefault("observer_steps", {})
        step = steps.get(key)
        if step is None:
            n = self.count
            self._check_outputs(entry, self.batch_size(batch))

            def outputs(v: list[Any], r: list[Any], x: list[Any], _fn: Any = entry.fn) -> list[Any]:
                return _fn(v, r, x)[:n]

            donated = tuple(3 + i for i in donate)  # after the variable, key and input leaves
            step = steps[key] = jax.jit(make_step(outputs), donate_argnums=donated)
        return step(var_leaves, rng_leaves, leaves, *state)

    def _check_outputs(self, entry: Any, batch: int) -> None:
        """The layers' outputs at a new input shape have the shapes the observer was
        made for, but for the batch size (the leading axis, or the old batch size's
        axis where iterations come first): state sized for the old ones (a tracker's
        neurons, per-channel statistics) cannot take others (a model that holds its
        variables can change them between calls: an NNX layer replaced by a wider one)."""
        sample = _leading_size(self.sample)
        avals = entry.avals(entry.plan.output_ids[: self.count])
        for name, was, now in zip(self.layers, self.shapes, avals, strict=False):
            fits = len(was) == len(now.shape) and all(  # the leading axis may be anything
                k == 0 or a == b or (a == sample and b == batch)
                for k, (a, b) in enumerate(zip(was, now.shape, strict=True))
            )
            if not fits:
                raise ModelChangedError(
                    change=f"layer {name!r} outputs {now.dtype}{list(now.shape)} at batch "
                    f"{batch} where it gave {list(was)} at batch {sample}"
                )


_compat.register_frames_exclusion(__file__)


def _ordered_layers(traced: Traced, layers: Any) -> tuple[list[str], list[Selection]]:
    """`layers` checked, without repeats, in call order, and the record of each (its
    `Selection`, each name parsed and resolved once). Unknown and ambiguous names raise."""
    if isinstance(layers, str) or not all(isinstance(n, str) for n in layers):
        raise LayersSpecError(layers=layers)
    resolver = resolver_of(traced.graph)
    records = {name: resolver.select(Name.of(name), OUTPUT) for name in dict.fromkeys(layers)}
    if not records:
        raise NoLayersError()
    ordered = sorted(records.items(), key=lambda item: _call_order(item[1]))
    return [name for name, _ in ordered], [where for _, where in ordered]


def _call_order(where: Selection) -> tuple[Any, ...]:
    """A key that sorts records in call order: an iteration of a call inside a scan by
    the loop, then the iteration, then the call within the body; a stacked ``[:]``
    before the loop's single iterations."""
    iterations = tuple(-1 if k == STACKED else k for k in where.path)
    return (where.call.start, iterations, where.call.in_seq)


def per_iteration(observer: Observer) -> list[tuple[str, int, tuple[int, ...]]]:
    """The observer's layers with every stacked record (``layers[:]/mlp``) written out as
    one layer per iteration (``layers[0]/mlp``, ..., named by `Selection.end_name`), all
    in call order, each record once (a name given as is): ``(name, index of the observed
    output, index of the iteration's row in it)``."""
    rows: dict[Selection, tuple[str, tuple[Any, ...], int, tuple[int, ...]]] = {}
    for index, (name, where) in enumerate(zip(observer.layers, observer.records, strict=True)):
        stacked = where.depths
        if not stacked:
            rows.setdefault(where, (name, _call_order(where), index, ()))
            continue
        for picked in itertools.product(*(range(n) for n in where.lengths)):
            path = list(where.path)
            for d, k in zip(stacked, picked, strict=True):
                path[d] = k
            one = dataclasses.replace(where, path=tuple(path))
            rows.setdefault(one, (one.end_name, _call_order(one), index, picked))
    ordered = sorted(rows.values(), key=lambda row: row[1])
    return [(name, index, picked) for name, _, index, picked in ordered]


@dataclasses.dataclass(frozen=True)
class Unit:
    """Layers of `per_iteration`'s rows that a step handles together: every iteration of
    a stacked output (``row`` None; its `depth` leading axes flattened into one, which a
    function is vmapped over), or one layer (its ``row`` of the output, ``()`` for all of
    it). `positions`: where its layers are among the rows, in the order of the iterations."""

    index: int
    positions: tuple[int, ...]
    row: tuple[int, ...] | None
    depth: int = 0

    def array(self, outs: list[Any]) -> Any:
        """The unit's part of the observed outputs `outs`: (iterations, batch, ...) for a
        stack, (batch, ...) for one layer."""
        out = outs[self.index]
        if self.row is None:
            return out.reshape((-1, *out.shape[self.depth :]))
        return out[self.row] if self.row else out

    def batch(self, array: Any) -> int:
        """The number of batch rows of `array`, the unit's part of an observed output."""
        return array.shape[0 if self.row is not None else 1]


def layer_units(observer: Observer, rows: list[tuple[str, int, tuple[int, ...]]]) -> list[Unit]:
    """`rows` (as `per_iteration` gives them) as units: one per stacked output whose
    iterations are all rows, one per other row."""
    position = {(index, row): p for p, (_, index, row) in enumerate(rows)}
    units = []
    for index, where in enumerate(observer.records):
        picked = itertools.product(*(range(n) for n in where.lengths)) if where.depths else ()
        positions = [position.get((index, row)) for row in picked]
        if positions and None not in positions:
            units.append(Unit(index, tuple(positions), None, len(where.depths)))
    stacked = {p for unit in units for p in unit.positions}
    alone = [Unit(i, (p,), row) for p, (_, i, row) in enumerate(rows) if p not in stacked]
    return units + alone


def over_units(fn: Callable[..., Any], units: list[Unit], *per_unit: list[Any]) -> list[Any]:
    """``fn(*args)`` for each unit, vmapped over a stack's iterations: `per_unit` are lists
    with an entry (a pytree, or None) per unit, a stack's with the iterations first."""
    return [
        fn(*args) if u.row is not None else jax.vmap(fn)(*args)
        for u, *args in zip(units, *per_unit, strict=True)
    ]


def to_units(units: list[Unit], per_layer: list[Any]) -> list[Any]:
    """Entries (pytrees of arrays) per row as entries per unit, a stack's iterations
    stacked on the host (NumPy: nothing compiles)."""
    stack = lambda *arrays: np.stack(arrays)  # noqa: E731
    return [
        per_layer[u.positions[0]]
        if u.row is not None
        else jax.tree_util.tree_map(stack, *(per_layer[p] for p in u.positions))
        for u in units
    ]


def to_layers(units: list[Unit], per_unit: list[Any]) -> list[Any]:
    """Entries per unit (a stack's with the iterations first) as one entry per row."""
    out: list[Any] = [None] * sum(len(u.positions) for u in units)
    for u, entry in zip(units, per_unit, strict=True):
        if u.row is not None:
            out[u.positions[0]] = entry
            continue
        for k, p in enumerate(u.positions):
            out[p] = jax.tree_util.tree_map(lambda a, k=k: a[k], entry)
    return out
