"""`Tracker`: structural coverage of chosen layers over a test set, compiled.

Neurons: a layer's output of shape (batch, ..., C) gives, per input, C neuron values
(``granularity="channel"``: the mean over all axes but batch and the last) or one value
per element (``"element"``). ``position="activation"`` observes the activation function
applied to a layer's output, taken whole (GELU's several equations, ``h * sigmoid(h)``),
instead of the output itself.

Everything per batch (the model up to the last chosen layer, the neuron reduction and
every criterion's update) is one jit-compiled function; state is OR-ed or merged, so
batches can come in any order and any size. A stacked layer's iterations (``layers[:]/mlp``)
come out of the model's loop as one array, and stay one through the step: neuron values,
the profile and the state of every criterion that updates each layer on its own
(`Criterion.per_layer`, all but the pair criteria) are computed vmapped over the
iterations, so the step does not grow with the number of iterations. A batch of a size the update (or the
profile) was not compiled for is padded, on the host, to the smallest size it was
compiled for that holds it (with copies of its last input, which the criteria and the
statistics mask out: a padding row covers and counts nothing), so a smaller last batch
compiles nothing; a batch larger than any before compiles for its size. Only where the
model, as it runs at that call, keeps the rows of a batch apart (`Observer.rows_apart`,
read from the traced equations): one that mixes them (BatchNorm in training mode,
centring over the batch) runs each batch at its own size. (With a
criterion of the user's own that does not mask rows, `Criterion.masks_rows`, the update
gets every batch as it comes.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._errors import (
    CapacityError,
    ChoiceError,
    CriteriaSpecError,
    NaNProfileError,
    NoBatchesError,
    ProfileNeededError,
    RepeatedCriteriaError,
    ScalarLayersError,
)
from .._trees import is_traced_leaf
from ..observe import GRANULARITIES, Moments, Observer, neuron_count, neurons, scaled
from ..observe._observer import Observing, serialised
from ..observe._units import layer_units, over_units, per_iteration, to_layers, to_units
from ._criteria import KMNC, NBC, NC, SNAC, TKNC, Criterion
from ._result import CoverageResult, coverage_of, result_names

_PROFILE, _UPDATE = 0, 1


class Tracker(Observing):
    """Structural test coverage of a network over the batches it is updated with.

    Args:
      target, *args, **kwargs: the model and sample inputs, as for `js.slice`
        (``model, variables, x`` for linen, ``fn, params, x`` for plain functions,
        ``model, x`` for NNX). Keywords such as ``train=False`` fix the mode.
      criteria: criterion objects; default NC(0.5), KMNC(10), NBC, SNAC, TKNC(2).
      layers: boundary names to observe (taken in call order); default every module with
        parameters of its own outside loops whose output is batched like the inputs.
        Iterations of a scanned stack are named as for slices: ``layers[2]/mlp`` is
        one, and ``layers[:]/mlp`` is one layer per iteration (``layers[0]/mlp``,
        ``layers[1]/mlp``, ..., in call order among the others), observed from the one
        loop as the model runs it. A layer returning several arrays is observed at its
        first.
      granularity: ``"channel"`` (the last axis: channels-last) or ``"element"``.
      position: ``"output"`` (the layer's output) or ``"activation"``.

    Raises:
      SliceError: unknown layers (with suggestions), layers that output a scalar, bad
        options, criteria used before `profile` when they need one, batches that do not
        fit the model.

    A copy (`copy.copy` or `copy.deepcopy`) tracks the same model with its own copy of
    what was covered and seen (the profile too), so it can branch off: updating one
    leaves the other as it was. The model, its traced program and the compiled steps are
    shared, not copied. A tracker cannot be pickled; its `result()` can.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])
    >>> x = jax.random.normal(jax.random.key(0), (16, 3))
    >>> variables = model.init(jax.random.key(1), x)
    >>> t = js.coverage.Tracker(model, variables, x, criteria=[js.coverage.NC(0.0), js.coverage.KMNC(4)])
    >>> t.profile([x])
    >>> t.update(x)
    >>> r = t.result()
    >>> sorted(r), sorted(r["NC"]["layers"])
    (['KMNC', 'NC'], ['layers_0', 'layers_2'])
    """

    STATE = ("_state", "_profile")

    def __init__(
        self,
        target: Any,
        *args: Any,
        criteria: Sequence[Criterion] | None = None,
        layers: Sequence[str] | None = None,
        granularity: str = "channel",
        position: str = "output",
        **kwargs: Any,
    ):
        if granularity not in GRANULARITIES:
            raise ChoiceError(option="granularity", choices=GRANULARITIES, value=granularity)
        self.criteria = _checked_criteria(criteria)
        self.granularity = granularity
        self.position = position
        # What `run_layers` needs to observe the layers' outputs beside their activations.
        self._source = (target, args, kwargs, layers)
        self._observer = Observer(target, args, kwargs, layers, position)
        self._search_observer: Observer | None = None  # made by the first `run_layers(before=True)`
        self._rows = per_iteration(self._observer)
        # The profile and the update handle a stacked layer's iterations as one array (a
        # unit): the profile, and the state of a criterion that updates each layer on its
        # own (`Criterion.per_layer`), are kept per unit, a stack's iterations stacked.
        self._units = layer_units(self._observer, self._rows)
        self.layers = [name for name, _, _ in self._rows]
        shapes = [self._observer.shapes[i][len(row) :] for _, i, row in self._rows]
        self.sizes = _neuron_counts(self.layers, shapes, granularity)
        self._names = result_names(self.criteria)
        self._groups = _groups(self.criteria)  # what is updated together, in one state
        self._profile: list[Moments] | None = None  # per unit
        # The batch sizes each step was compiled for; a batch of a new size is padded to
        # the smallest of them that holds it (the update's only where every criterion
        # masks rows), where the model keeps the rows apart (`_compiled_size`).
        self._pads = {_PROFILE: True, _UPDATE: all(c.masks_rows for c in self.criteria)}
        self._compiled: dict[int, set[int]] = {_PROFILE: set(), _UPDATE: set()}
        self.reset()

    # ------------------------------------------------------------------ public

    @serialised
    def reset(self) -> None:
        """Forgets every covered neuron (the profile is kept)."""
        self._state = []
        for family, crits in self._grouped():
            if family:
                self._state.append(family.init(crits, self.sizes))
            elif crits[0].per_layer:  # kept per unit
                self._state.append(to_units(self._units, crits[0].init(self.sizes)))
            else:
                self._state.append(crits[0].init(self.sizes))
        self._seen = 0

    @property
    @serialised
    def profile_stats(self) -> dict[str, dict[str, Any]] | None:
        """Per-layer neuron statistics of the profile: low, high, mean, std (or None)."""
        if self._profile is None:
            return None
        return {
            name: {"low": m.low, "high": m.high, "mean": m.mean, "std": m.std}
            for name, m in zip(self.layers, self._per_layer(self._profile), strict=True)
        }

    @serialised
    def profile(self, batches: Iterable[Any]) -> None:
        """Streams training batches to record each neuron's [low, high], mean and std
        (merged with the profile so far; empty batches are skipped).

        Raises:
          NoBatchesError: no batch, or only empty ones.
          NaNProfileError: a range came out NaN where a criterion reads the ranges (the
            tracker keeps the profile it had before the call).
        """
        acc = self._profile
        if acc is None:
            acc = to_units(self._units, [Moments.empty((n,)) for n in self.sizes])
        seen = False
        for batch in batches:
            n = self.batch_size(batch)
            if n == 0:
                continue  # an empty batch has no range
            batch = self._compiled_size(_PROFILE, batch, n)
            acc = self._observer.run(_PROFILE, batch, self._profile_step, acc, np.int32(n))
            seen = True
        if not seen:
            raise NoBatchesError()
        # One read of the ranges per call (not per batch): NaN bounds cover nothing.
        needing = self._profile_readers()
        bad = [
            f"{k} of {m.low.size} neurons of {name!r}"
            for name, m in zip(self.layers, self._per_layer(acc), strict=True)
            if (k := int(np.count_nonzero(np.isnan(m.low) | np.isnan(m.high))))
        ]
        if bad and needing:
            raise NaNProfileError(neurons=", ".join(bad), names=", ".join(needing))
        self._profile = acc

    @serialised
    def update(self, batch: Any) -> None:
        """Adds a batch of test inputs (an array, or a tuple of the model's inputs)."""
        self._check_profile()
        n = self.batch_size(batch)
        if n == 0:
            return  # nothing seen: an empty batch covers nothing
        for crit in self.criteria:
            limit = getattr(crit, "capacity", None)
            if limit is not None and self._seen + n > limit:
                raise CapacityError(
                    criterion=crit.name,
                    capacity=limit,
                    seen=self._seen,
                    batch=n,
                    kind=type(crit).__name__,
                    suggested=2 * (self._seen + n),
                )
        batch = self._compiled_size(_UPDATE, batch, n)
        state, profile = self._state, self._profile
        # The state is donated: the update writes the history of the pair criteria in place.
        self._state = self._observer.run(
            _UPDATE, batch, self._update_step, state, profile, np.int32(n), donate=(0,)
        )
        self._seen += n

    @serialised
    def result(self) -> CoverageResult:
        """Coverage per criterion: the total over all neurons, and per layer."""
        self._check_profile()
        states = zip(self._names, self.criteria, self.states, strict=True)
        return CoverageResult(
            (name, coverage_of(crit, state, self.layers)) for name, crit, state in states
        )

    def __repr__(self) -> str:
        return f"Tracker(criteria={self._names}, layers={self.layers})"

    # ------------------------------------------------------------------ for generation
    # What `generate` (and other tools that search or check inputs against a tracker)
    # read: the criteria's result names and states, the inputs of a batch, and the
    # tracker's layers run, compiled, on a batch.

    @property
    def names(self) -> list[str]:
        """The criteria's result names (the keys of `result`), in the order of `criteria`."""
        return list(self._names)

    @property
    @serialised
    def states(self) -> tuple[Any, ...]:
        """Each criterion's current state (what its `update` returns), in the order of
        `criteria`; valid until the next `update`, which reuses its memory."""
        out: list[Any] = [None] * len(self.criteria)
        for (family, members), state in zip(self._groups, self._state, strict=True):
            crits = [self.criteria[i] for i in members]
            if family:
                own = family.states(crits, state)
            else:
                own = [self._per_layer(state) if crits[0].per_layer else state]
            for i, part in zip(members, own, strict=True):
                out[i] = part
        return tuple(out)

    def batch_size(self, batch: Any) -> int:
        """How many inputs `batch` holds.

        Raises:
          InputMismatchError: a batch that does not fit the model's sample inputs.
        """
        return self._observer.batch_size(batch)

    def inputs(self, batch: Any) -> tuple[Any, ...]:
        """`batch` as the model's positional inputs (an array is one input), checked.

        Raises:
          InputMismatchError: a batch that does not fit the model's sample inputs.
        """
        return self._observer.inputs(batch)

    def run_layers(
        self,
        key: Any,
        batch: Any,
        make_step: Any,
        *state: Any,
        before: bool = False,
        donate: tuple[int, ...] = (),
    ) -> Any:
        """Applies ``make_step(layer_outputs)``, compiled once per `key` and batch shape,
        to `batch` and `state`; ``layer_outputs(v, r, x)`` gives each layer's output (a
        stacked layer's iterations one by one, as in `layers`). With `before`, it gives
        ``(outputs, before)``: ``before`` are the layers' outputs before their activation
        at ``position="activation"``, and None at ``"output"`` (nothing is before).

        The step is ``step(v, r, x, *state)`` for the model's variable, random-key and
        input leaves, as `make_step` returns it; the parts of `state` at the positions
        `donate` are donated to it (their memory is reused for its results).
        """
        observer = self._observer
        if before and self.position != "output":
            if self._search_observer is None:
                target, args, kwargs, layers = self._source
                self._search_observer = Observer(
                    target, args, kwargs, layers, self.position, also_outputs=True
                )
            observer = self._search_observer
        rows = self._rows
        # The search observer gives every layer's output after all the activations.
        outputs_at = len(self._observer.layers) if observer is self._search_observer else None

        def make(outputs: Any) -> Any:
            def per_layer(outs: list[Any], offset: int) -> list[Any]:
                return [outs[offset + i][row] if row else outs[offset + i] for _, i, row in rows]

            def layer_outputs(v: Any, r: Any, x: Any) -> Any:
                outs = outputs(v, r, x)
                if not before:
                    return per_layer(outs, 0)
                raw = None if outputs_at is None else per_layer(outs, outputs_at)
                return per_layer(outs, 0), raw

            return make_step(layer_outputs)

        return observer.run(key, batch, make, *state, donate=donate)

    # ------------------------------------------------------------------ steps

    def _compiled_size(self, step: int, batch: Any, n: int) -> Any:
        """`batch` (of `n` inputs) padded to the smallest size `step` was compiled for that
        holds it (as it is where none does, or where the step does not pad). A model
        that mixes the rows of a batch as it runs now (BatchNorm in training mode,
        centring over the batch: `Observer.rows_apart`) would give the real rows other
        values with padding rows among them, so its batches run at their own size."""
        sizes = self._compiled[step]
        size = min((s for s in sizes if s >= n), default=n) if self._pads[step] and n else n
        if size != n:
            padded = _padded(self.inputs(batch), self._observer.batched, n, size)
            if self._observer.rows_apart(padded):
                return padded
            size = n
        sizes.add(size)
        return batch

    def _grouped(self) -> list[tuple[Any, list[Criterion]]]:
        return [(family, [self.criteria[i] for i in members]) for family, members in self._groups]

    def _per_layer(self, per_unit: list[Any]) -> list[Any]:
        """Entries kept per unit (the profile, a `per_layer` criterion's state) as NumPy
        arrays per layer."""
        return to_layers(self._units, jax.tree_util.tree_map(np.asarray, per_unit))

    def _check_profile(self) -> None:
        needing = self._profile_readers()
        if needing and self._profile is None:
            raise ProfileNeededError(names=", ".join(needing))

    def _profile_readers(self) -> list[str]:
        """The result names of the criteria that read the profile's ranges."""
        return [name for name, c in zip(self._names, self.criteria, strict=True) if c.needs_profile]

    def _profile_step(self, outputs: Any) -> Any:
        """The profile's step; `outputs` gives the observed outputs, the profile is per unit."""
        granularity, units = self.granularity, self._units

        def step(v: Any, r: Any, x: Any, acc: list[Moments], n: Any) -> list[Moments]:
            arrays = [u.array(outputs(v, r, x)) for u in units]
            valid = jnp.arange(units[0].batch(arrays[0])) < n  # the batch's inputs; then padding

            def merged(out: Any, m: Moments) -> Moments:
                return m.merge(Moments.of(neurons(out, granularity), valid))

            return over_units(merged, units, arrays, acc)

        return step

    def _update_step(self, outputs: Any) -> Any:
        """The update's step; `outputs` gives the observed outputs, the profile is per unit."""
        granularity, units = self.granularity, self._units
        groups = self._grouped()
        need_scaled = any(c.needs_scaled for c in self.criteria)

        def step(v: Any, r: Any, x: Any, state: list[Any], profile: Any, n: Any) -> list[Any]:
            outs = outputs(v, r, x)
            arrays = [u.array(outs) for u in units]
            values = over_units(lambda o: neurons(o, granularity), units, arrays)
            sc = None
            if need_scaled:
                sc = over_units(lambda o: neurons(scaled(o), granularity), units, arrays)
            valid = jnp.arange(units[0].batch(arrays[0])) < n  # the batch's inputs; then padding
            batch = _Batch(units, values, sc, profile, valid)
            return [
                _updated(family, crits, s, batch)
                for (family, crits), s in zip(groups, state, strict=True)
            ]

        return step


class _Batch:
    """What a batch gives the criteria in the update's step: neuron values, scaled values
    (or None) and the profile (or None), per unit and, when asked for, per layer."""

    def __init__(self, units: list[Any], values: list[Any], sc: Any, profile: Any, valid: Any):
        self.units, self.valid = units, valid
        self.per_unit = (values, sc, profile)
        self._per_layer: tuple[Any, ...] | None = None

    def per_layer(self) -> tuple[Any, ...]:
        """(values, scaled, profile) with one entry per layer (made once, when asked for)."""
        if self._per_layer is None:
            self._per_layer = tuple(
                None if part is None else to_layers(self.units, part) for part in self.per_unit
            )
        return self._per_layer


def _updated(family: Any, crits: list[Criterion], state: Any, batch: _Batch) -> Any:
    """One group's state after a batch: a criterion that updates each layer on its own
    updates a stacked layer's iterations together (vmapped, its state kept per unit);
    the others see every layer."""
    if family is not None:
        return family.update(crits, state, *batch.per_layer(), batch.valid)
    crit = crits[0]
    rows = (batch.valid,) if crit.masks_rows else ()
    if not crit.per_layer:
        return crit.update(state, *batch.per_layer(), *rows)

    listed = lambda a: None if a is None else [a]  # noqa: E731

    def one(s: Any, v: Any, c: Any, p: Any) -> Any:
        return crit.update([s], [v], listed(c), listed(p), *rows)[0]

    nothing = [None] * len(batch.units)
    values, sc, profile = (nothing if part is None else part for part in batch.per_unit)
    return over_units(one, batch.units, state, values, sc, profile)


def _groups(criteria: list[Criterion]) -> list[tuple[Any, list[int]]]:
    """(family, indices) of the criteria updated together: a family's members at the
    place of its first one; a criterion without a family alone (None)."""
    groups: list[tuple[Any, list[int]]] = []
    members: dict[Any, list[int]] = {}
    for i, crit in enumerate(criteria):
        if crit.family is None:
            groups.append((None, [i]))
        elif crit.family in members:
            members[crit.family].append(i)
        else:
            members[crit.family] = [i]
            groups.append((crit.family, members[crit.family]))
    return groups


def _padded(inputs: tuple[Any, ...], batched: list[bool], n: int, size: int) -> tuple[Any, ...]:
    """`inputs` (a batch of `n`) with `size - n` copies of the last input after them, on
    the host, in the leaves that have a batch axis (`batched`, per array leaf): a copy is
    an input the model takes, and a new size compiles nothing."""
    flags = iter(batched)

    def pad(x: Any) -> Any:
        if not is_traced_leaf(x) or not next(flags):
            return x
        x = np.asarray(x)
        return np.concatenate([x, np.repeat(x[-1:], size - n, axis=0)])

    return jax.tree_util.tree_map(pad, inputs)


def _checked_criteria(criteria: Sequence[Criterion] | None) -> list[Criterion]:
    """`criteria` as a list (by default NC(0.5), KMNC(10), NBC, SNAC and TKNC(2)), checked."""
    if criteria is None:
        return [NC(0.5), KMNC(10), NBC(), SNAC(), TKNC(2)]
    if isinstance(criteria, Criterion) or not isinstance(criteria, Iterable):
        raise CriteriaSpecError(criteria=criteria)  # one criterion: a list of it is meant
    criteria = list(criteria)
    bad = [c for c in criteria if not isinstance(c, Criterion)]
    if not criteria or bad:
        raise CriteriaSpecError(criteria=bad or criteria)
    repeated = [c for i, c in enumerate(criteria) if c in criteria[:i]]
    if repeated:
        raise RepeatedCriteriaError(names=", ".join(map(repr, dict.fromkeys(repeated))))
    return criteria


def _neuron_counts(layers: list[str], shapes: list[tuple[int, ...]], granularity: str) -> list[int]:
    """Each layer's number of neurons, from its output shape alone (nothing is compiled)."""
    scalars = [name for name, shape in zip(layers, shapes, strict=True) if not shape]
    if scalars:
        raise ScalarLayersError(names=", ".join(map(repr, scalars)))
    return [neuron_count(shape, granularity) for shape in shapes]


_compat.register_frames_exclusion(__file__)
