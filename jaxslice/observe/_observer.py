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

import functools
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
from .._core.ports import ActivationOf, array_ids, single_output_id
from .._core.program import SliceProgram
from .._core.selection import Name, Selection, resolver_of
from .._core.trace import Traced, trace
from .._errors import (
    BatchMismatchError,
    ChoiceError,
    ComplexOutputError,
    LayerBatchAxisError,
    LayersSpecError,
    ModelChangedError,
    NoArrayOutputError,
    NoLayersError,
    ObservedKeywordInputsError,
    ObserverNotPicklableError,
)
from .._table import describe
from .._trees import abstract, is_traced_leaf
from ..adapters import adapter_for
from ._rows import rows_apart

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


def _batch_form(split: Any) -> tuple[list[Any], list[bool]]:
    """What a batch holds: the sample's positional input leaves (abstract), and which of
    them have a batch axis, those whose leading axis has the batch size (the first
    leaf's); the others (a per-feature mask) are fixed. Array keyword inputs, which a
    batch cannot carry, are refused."""
    keywords = [k for k, v in split.kwargs.items() if _array_leaves(v)]
    if keywords:
        raise ObservedKeywordInputsError(names=", ".join(map(repr, keywords)), first=keywords[0])
    sample = [abstract(x) for x in _array_leaves(split.args)]
    size = _leading_size(sample)
    return sample, [bool(x.shape) and x.shape[0] == size for x in sample]


def _first_arrays(layers: list[str], base: Any) -> tuple[list[int], list[Any]]:
    """Where each end's first array is among the program's outputs, and its aval: a
    layer whose output has several arrays (a block's ``(h, aux)``) is observed at its
    first, as a lens reads such a value. Layers without arrays, or with complex ones,
    are refused."""
    trees = base.plan.output_trees.values()
    counts = [len(array_ids(jax.tree_util.tree_leaves(t))) for t in trees]
    if 0 in counts:
        none = [n for n, c in zip(layers, counts, strict=False) if not c]
        raise NoArrayOutputError(names=", ".join(map(repr, none)))
    firsts = [sum(counts[:k]) for k in range(len(counts))]
    avals = [base.traced.graph.avals[base.plan.output_ids[i]] for i in firsts]
    complex_ = [
        n
        for n, a in zip(layers, avals, strict=False)
        if jnp.issubdtype(a.dtype, jnp.complexfloating)
    ]
    if complex_:
        raise ComplexOutputError(names=", ".join(map(repr, complex_)))
    return firsts, avals


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
        split = traced.split
        self.sample, self.batched = _batch_form(split)
        self._observe(traced, layers, position, also_outputs)
        program = self.program
        # Where the model holds its variables' values (Keras), they are read from it at
        # each batch (`Adapter.variables_view`); else the model's arrays are kept, taken
        # before the program drops them.
        self.variables_view = program.adapter.variables_view(program.target, program.variables)
        self.variables = split.variables if self.variables_view is None else None
        self.rngs = split.rngs

    def _observe(
        self, traced: Traced, layers: Sequence[str] | None, position: str, also_outputs: bool
    ) -> None:
        """The layers and the program to them: those named, or by default the modules
        with parameters whose outputs are batched like the inputs."""
        self._build(
            traced, default_layers(traced) if layers is None else layers, position, also_outputs
        )
        unbatched = self._unbatched()
        if unbatched and layers is None and len(unbatched) < len(self.layers):
            kept = [n for n in self.layers if n not in unbatched]
            self._build(traced, kept, position, also_outputs)
        elif unbatched:
            self._refuse_unbatched(unbatched[0])

    def _build(self, traced: Traced, chosen: Any, position: str, also_outputs: bool) -> None:
        """The program to the layers `chosen` and what it observes of each."""
        #: the layers as given (in call order) and each one's record, resolved once
        self.layers, self.records = _ordered_layers(traced, chosen)
        pairs = list(zip(self.layers, self.records, strict=True))
        ends: dict[Any, Any] = {n: _END_AT[position](where) for n, where in pairs}
        if also_outputs and position != "output":
            ends.update({(n, "output"): where for n, where in pairs})
        self.program = SliceProgram(traced, None, ends)
        self.firsts, avals = _first_arrays(self.layers, self.program.base)
        self.shapes = [tuple(a.shape) for a in avals]

    def rows_apart(self, batch: Any) -> bool:
        """Whether the layers' outputs at `batch`'s shape, as the model runs now (an NNX
        model's mode, read at each call), keep the rows of the batch apart: each output
        row from its own input row alone (`_rows.rows_apart`), so that rows padding a
        batch change no other. Worked out once per traced shape and mode, from the traced
        equations (nothing runs); a model that mixes rows (BatchNorm in training mode,
        centring over the batch) does not."""
        args = self.inputs(batch)
        entry, _ = self.program.lookup(args, {}, self.rngs, self.program.base.traced.split.mutable)
        apart = entry.__dict__.get("observer_rows_apart")
        if apart is None:
            size = self.batch_size(batch)
            graph, plan = entry.traced.graph, entry.plan
            inputs = {i: 0 for i in plan.input_ids if graph.avals[i].shape[:1] == (size,)}
            depths = [len(where.depths) for where in self._ends()]
            outputs = [(plan.output_ids[i], d) for i, d in zip(self.firsts, depths, strict=True)]
            apart = rows_apart(plan.to_run, graph.avals, inputs, outputs)
            entry.__dict__["observer_rows_apart"] = apart
        return apart

    def batch_size(self, batch: Any) -> int:
        """How many inputs `batch` holds (checked as `inputs` does)."""
        return _leading_size(_array_leaves(self.inputs(batch)))

    def inputs(self, batch: Any) -> tuple[Any, ...]:
        """`batch` as the model's positional inputs (an array is one input), checked
        against the sample inputs' non-batch shapes and dtypes."""
        args = batch if isinstance(batch, tuple) else (batch,)
        leaves = _array_leaves(args)
        ok = len(leaves) == len(self.sample) and all(map(_matches, leaves, self.sample))
        if ok:  # one batch size; fixed inputs as in the sample
            rows = list(zip(leaves, self.sample, self.batched, strict=True))
            sizes = {jnp.shape(x)[0] for x, _, b in rows if b}
            ok = len(sizes) <= 1 and all(
                tuple(jnp.shape(x)) == s.shape for x, s, b in rows if not b
            )
        if not ok:
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
            firsts = self.firsts
            self._check_outputs(entry, self.batch_size(batch))

            def outputs(v: list[Any], r: list[Any], x: list[Any], _fn: Any = entry.fn) -> list[Any]:
                outs = _fn(v, r, x)
                return [outs[i] for i in firsts]

            donated = tuple(3 + i for i in donate)  # after the variable, key and input leaves
            step = steps[key] = jax.jit(make_step(outputs), donate_argnums=donated)
        return step(var_leaves, rng_leaves, leaves, *state)

    def _ends(self) -> list[Selection]:
        """Each observed end's record: the layers', then again theirs for the outputs
        observed beside the activations (`also_outputs`)."""
        return self.records * (len(self.firsts) // len(self.records))

    def _unbatched(self) -> list[str]:
        """The layers whose outputs lack the sample's batch size on their batch axis (the
        first after a stack's iterations): a model that takes one example (an Equinox
        module) or a layer that splits the batch (inside `nn.vmap`) would give the values
        of other inputs than the batch's."""
        batch = _leading_size(self.sample)
        return [
            name
            for name, where, shape in zip(self.layers, self.records, self.shapes, strict=False)
            if not (len(shape) > len(where.depths) and shape[len(where.depths)] == batch)
        ]

    def _refuse_unbatched(self, name: str) -> None:
        k = self.layers.index(name)
        if type(self.program.adapter).__name__ == "EquinoxAdapter":
            fix = (
                "An Equinox module takes one example: observe a function that vmaps it, "
                "e.g. `js.coverage.Tracker(lambda m, x: jax.vmap(m)(x), model, x)`, with a "
                "batch of examples (its layers keep their names: `c1`, `mlp/linear`)."
            )
        else:
            fix = (
                "Observe layers whose outputs are batched like the model's inputs (batch "
                "first), or give a batched sample if this one is a single example."
            )
        raise LayerBatchAxisError(
            name=name,
            shape=list(self.shapes[k]),
            batch=_leading_size(self.sample),
            axis=len(self.records[k].depths),
            fix=fix,
        )

    def _check_outputs(self, entry: Any, batch: int) -> None:
        """The layers' outputs at a new input shape have the shapes the observer was
        made for, but for the batch size on their batch axis (the leading one, or the
        one after a stack's iterations), and only there: state sized for the old ones (a
        tracker's neurons, per-channel statistics) cannot take others (a model that
        holds its variables can change them between calls: an NNX layer replaced by a
        wider one, which may be as wide as a batch)."""
        sample = _leading_size(self.sample)
        avals = entry.avals([entry.plan.output_ids[i] for i in self.firsts])
        layers = self.layers * (len(self.firsts) // len(self.layers))
        rows = zip(layers, self._ends(), self.shapes, avals, strict=True)
        for name, where, was, now in rows:
            axis = len(where.depths)  # the batch axis (`_unbatched`)
            fits = len(was) == len(now.shape) and all(
                b == batch if k == axis else a == b
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
    ordered = sorted(records.items(), key=lambda item: call_order(item[1]))
    return [name for name, _ in ordered], [where for _, where in ordered]


def call_order(where: Selection) -> tuple[Any, ...]:
    """A key that sorts records in call order: an iteration of a call inside a scan by
    the loop, then the iteration, then the call within the body; a stacked ``[:]``
    before the loop's single iterations."""
    iterations = tuple(-1 if k == STACKED else k for k in where.path)
    return (where.call.start, iterations, where.call.in_seq)
