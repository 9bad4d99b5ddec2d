"""`Tracker`: structural coverage of chosen layers over a test set, compiled.

Neurons: a layer's output of shape (batch, ..., C) gives, per input, C neuron values
(``granularity="channel"``: the mean over all axes but batch and the last) or one value
per element (``"element"``). ``position="activation"`` observes the activation function
applied to a layer's output (the first equation that maps it elementwise, e.g. ``relu``)
instead of the output itself.

Everything per batch (the model up to the last chosen layer, the neuron reduction and
every criterion's update) is one jit-compiled function; state is OR-ed or merged, so
batches can come in any order and any size.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any

from .. import _compat
from .._errors import (
    CapacityError,
    ChoiceError,
    CriteriaSpecError,
    NoBatchesError,
    ProfileNeededError,
    ScalarLayersError,
    UnknownCriterionError,
)
from .._table import PrintsAsTable
from ..observe import GRANULARITIES, Moments, Observer, neuron_count, neurons, scaled
from ..observe._observer import per_iteration
from ._criteria import KMNC, NBC, NC, SNAC, TKNC, Criterion

_PROFILE, _UPDATE = 0, 1


class CoverageResult(PrintsAsTable, dict):
    """``{criterion: {"total": float, "layers": {key: float}}}``; prints as a table (and
    shows as one in notebooks), figures to 4 decimals."""

    def _table_rows(self) -> list[tuple[str, ...]]:
        rows = [("criterion", "layer", "coverage")]
        for crit, res in self.items():
            rows.append((crit, "(total)", f"{res['total']:.4f}"))
            rows += [("", key, f"{value:.4f}") for key, value in res["layers"].items()]
        return rows

    def annotations(self, *criteria: str) -> dict[str, str]:
        """``{boundary: text}`` for drawing (``to_dot(annotations=...)``): each layer's
        figure per criterion, e.g. ``"NC 0.83"``; a pair criterion's figure goes on the
        second layer of the pair, e.g. ``"SignSign fc1→ 0.25"``. Several criteria share
        a node's line. Default: every criterion of the result.

        Raises:
          InvalidSpecError: a criterion the result does not have.
        """
        unknown = [c for c in criteria if c not in self]
        if unknown:
            raise UnknownCriterionError(name=unknown[0], known=sorted(self))
        notes: dict[str, list[str]] = {}
        for crit in criteria or list(self):
            for key, value in self[crit]["layers"].items():
                first, arrow, layer = key.rpartition(" -> ")
                label = f"{crit} {first}→ {value:.2f}" if arrow else f"{crit} {value:.2f}"
                notes.setdefault(layer, []).append(label)
        return {layer: "; ".join(labels) for layer, labels in notes.items()}


class Tracker:
    """Structural test coverage of a network over the batches it is updated with.

    Args:
      target, *args, **kwargs: the model and sample inputs, as for `js.slice`
        (``model, variables, x`` for linen, ``fn, params, x`` for plain functions,
        ``model, x`` for NNX). Keywords such as ``train=False`` fix the mode.
      criteria: criterion objects; default NC(0.5), KMNC(10), NBC, SNAC, TKNC(2).
      layers: boundary names to observe (taken in call order); default every module with
        parameters of its own. Iterations of a scanned stack are named as for slices:
        ``layers[2]/mlp`` is one, and ``layers[:]/mlp`` is one layer per iteration
        (``layers[0]/mlp``, ``layers[1]/mlp``, ..., in call order among the others),
        observed from the one loop as the model runs it.
      granularity: ``"channel"`` or ``"element"``.
      position: ``"output"`` (the layer's output) or ``"activation"``.

    Raises:
      SliceError: unknown layers (with suggestions), layers that output a scalar, bad
        options, criteria used before `profile` when they need one, batches that do not
        fit the model.

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
        # What `generate` needs to observe the layers' outputs beside their activations.
        self._source = (target, args, kwargs, layers)
        self._observer = Observer(target, args, kwargs, layers, position)
        self._rows = per_iteration(self._observer)
        self.layers = [name for name, _, _ in self._rows]
        shapes = [self._observer.shapes[i][len(row) :] for _, i, row in self._rows]
        self.sizes = _neuron_counts(self.layers, shapes, granularity)
        self._names = _names(self.criteria)
        self._profile: list[Moments] | None = None
        self.reset()

    # ------------------------------------------------------------------ public

    def reset(self) -> None:
        """Forgets every covered neuron (the profile is kept)."""
        self._state = [c.init(self.sizes) for c in self.criteria]
        self._seen = 0

    @property
    def profile_stats(self) -> dict[str, dict[str, Any]] | None:
        """Per-layer neuron statistics of the profile: low, high, mean, std (or None)."""
        if self._profile is None:
            return None
        return {
            name: {"low": m.low, "high": m.high, "mean": m.mean, "std": m.std}
            for name, m in zip(self.layers, self._profile, strict=True)
        }

    def profile(self, batches: Iterable[Any]) -> None:
        """Streams training batches to record each neuron's [low, high], mean and std."""
        acc = [Moments.empty((n,)) for n in self.sizes] if self._profile is None else self._profile
        seen = False
        for batch in batches:
            acc = self._observer.run(_PROFILE, batch, self._profile_step, acc)
            seen = True
        if not seen:
            raise NoBatchesError()
        self._profile = acc

    def update(self, batch: Any) -> None:
        """Adds a batch of test inputs (an array, or a tuple of the model's inputs)."""
        self._check_profile()
        n = self._observer.batch_size(batch)
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
        self._state = self._observer.run(
            _UPDATE, batch, self._update_step, self._state, self._profile
        )
        self._seen += n

    def result(self) -> CoverageResult:
        """Coverage per criterion: the total over all neurons, and per layer."""
        self._check_profile()
        states = zip(self._names, self.criteria, self._state, strict=True)
        return CoverageResult(
            (name, _coverage(crit, state, self.layers)) for name, crit, state in states
        )

    def __repr__(self) -> str:
        return f"Tracker(criteria={self._names}, layers={self.layers})"

    # ------------------------------------------------------------------ steps

    def _check_profile(self) -> None:
        needing = [n for n, c in zip(self._names, self.criteria, strict=True) if c.needs_profile]
        if needing and self._profile is None:
            raise ProfileNeededError(names=", ".join(needing))

    def _layer_outputs(self, outputs: Any) -> Any:
        """`outputs` (the observed outputs) as one output per layer, stacked ones split."""
        rows = self._rows

        def layer_outputs(v: Any, r: Any, x: Any) -> list[Any]:
            outs = outputs(v, r, x)
            return [outs[i][row] if row else outs[i] for _, i, row in rows]

        return layer_outputs

    def _profile_step(self, outputs: Any) -> Any:
        granularity = self.granularity
        outputs = self._layer_outputs(outputs)

        def step(v: Any, r: Any, x: Any, acc: list[Moments]) -> list[Moments]:
            outs = outputs(v, r, x)
            return [
                m.merge(Moments.of(neurons(o, granularity))) for m, o in zip(acc, outs, strict=True)
            ]

        return step

    def _update_step(self, outputs: Any) -> Any:
        granularity = self.granularity
        criteria = self.criteria
        need_scaled = any(c.needs_scaled for c in criteria)
        outputs = self._layer_outputs(outputs)

        def step(v: Any, r: Any, x: Any, state: list[Any], profile: Any) -> list[Any]:
            outs = outputs(v, r, x)
            values = [neurons(o, granularity) for o in outs]
            sc = [neurons(scaled(o), granularity) for o in outs] if need_scaled else None
            return [c.update(s, values, sc, profile) for c, s in zip(criteria, state, strict=True)]

        return step


def _checked_criteria(criteria: Sequence[Criterion] | None) -> list[Criterion]:
    """`criteria` as a list (by default NC(0.5), KMNC(10), NBC, SNAC and TKNC(2)), checked."""
    if criteria is None:
        return [NC(0.5), KMNC(10), NBC(), SNAC(), TKNC(2)]
    criteria = list(criteria)
    bad = [c for c in criteria if not isinstance(c, Criterion)]
    if not criteria or bad:
        raise CriteriaSpecError(criteria=bad or criteria)
    return criteria


def _neuron_counts(layers: list[str], shapes: list[tuple[int, ...]], granularity: str) -> list[int]:
    """Each layer's number of neurons, from its output shape alone (nothing is compiled)."""
    scalars = [name for name, shape in zip(layers, shapes, strict=True) if not shape]
    if scalars:
        raise ScalarLayersError(names=", ".join(map(repr, scalars)))
    return [neuron_count(shape, granularity) for shape in shapes]


def _coverage(crit: Criterion, state: Any, layers: list[str]) -> dict[str, Any]:
    """One criterion's coverage: over all its neurons, and per result key."""
    counts = [(int(c), int(n)) for c, n in crit.counts(state)]
    covered = sum(c for c, _ in counts)
    total = sum(n for _, n in counts)
    keys = crit.keys(layers)
    per_key = {k: _fraction(c, n) for k, (c, n) in zip(keys, counts, strict=True)}
    return {"total": _fraction(covered, total), "layers": per_key}


def _fraction(covered: int, total: int) -> float:
    return covered / total if total else 0.0


def _names(criteria: list[Criterion]) -> list[str]:
    """The criteria's names, with their settings for names that several criteria share."""
    counts = collections.Counter(c.name for c in criteria)
    return [_with_settings(c) if counts[c.name] > 1 else c.name for c in criteria]


def _with_settings(crit: Criterion) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in vars(crit).items())
    return f"{crit.name}({settings})"


_compat.register_frames_exclusion(__file__)
