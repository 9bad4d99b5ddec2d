"""Structural coverage criteria for neural networks, vectorised over neurons and inputs.

Notation: a layer's neurons n have values φ(x, n) for an input x (see `Tracker` for how
a layer output becomes neuron values). A profile gives [low_n, high_n], the minimum and
maximum of φ(·, n) over the profiling data. Every criterion keeps a boolean state that
is OR-ed over inputs, so accumulation is incremental and independent of batch order and
batch boundaries: updating with two batches equals updating with their concatenation.

A criterion also says what `generate` needs to search inputs for it: its open
requirements, the exact check of one, and a search loss (`Criterion`'s generation
methods). The adjacent-layer criteria of Sun et al. live in `_pairs`.

References:
  Pei et al., "DeepXplore", SOSP 2017 (NC).
  Ma et al., "DeepGauge", ASE 2018 (KMNC, NBC, SNAC, TKNC).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import PositiveIntegerError, ThresholdError, UngeneratableCriterionError
from ..observe import Moments


class Criterion:
    """Base class of coverage criteria. Subclasses define the state and its update.

    A criterion is a value: its class and its settings (the attributes its constructor
    sets) say everything it does, so two criteria of one class with equal settings are
    equal (and hash alike), whichever object a tracker holds.

    >>> import jaxslice as js
    >>> js.coverage.NC(0.5) == js.coverage.NC(threshold=0.5) != js.coverage.NC(0.3)
    True
    >>> js.coverage.KMNC(4)
    KMNC(k=4)
    """

    #: whether `Tracker.profile` must run first (the criterion reads [low_n, high_n])
    needs_profile: bool = False
    #: whether the update reads DeepXplore-scaled neuron values
    needs_scaled: bool = False
    #: whether `update` takes `valid`, the mask of a batch's rows that are inputs: a
    #: tracker whose criteria all do pads a batch of a new size to a size it has compiled
    #: for (the padding rows must cover nothing) instead of compiling for it
    masks_rows: bool = False
    #: whether `update` treats each layer on its own (a layer's new state depends only
    #: on its own state, values and profile): a tracker then updates a stacked layer's
    #: iterations as one array, the update vmapped over them, instead of one by one
    per_layer: bool = False
    #: criteria that share work: a tracker updates its criteria of one (not None) family
    #: together, with the family's ``init(criteria, sizes)``, ``update(criteria, state,
    #: values, scaled, profile, valid)`` and ``states(criteria, state)`` (each
    #: criterion's own state, from the family's)
    family: Any = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        try:
            return bool(vars(self) == vars(other))
        except (TypeError, ValueError):  # settings that do not compare as one value
            return self is other

    def __hash__(self) -> int:
        try:
            return hash((type(self), tuple(sorted(vars(self).items()))))
        except TypeError:  # unhashable settings: equal criteria still hash alike
            return hash(type(self))

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self.name}({settings})"

    def keys(self, layers: list[str]) -> list[str]:
        """The result keys (one per layer, or per pair of layers)."""
        return list(layers)

    def init(self, sizes: list[int]) -> Any:
        """The empty state for layers of `sizes` neurons. Host (numpy) arrays keep making a
        tracker free of compiles; the compiled update takes them as they are."""
        raise NotImplementedError

    def update(
        self,
        state: Any,
        values: list[Any],
        scaled: list[Any] | None,
        profile: list[Moments] | None,
        valid: Any = None,
    ) -> Any:
        """The state after a batch: `values` (and `scaled`) hold (batch, neurons) per layer.
        `valid` (only where `masks_rows`): a (batch,) mask, True for the rows that are
        inputs, which come first; None when every row is one."""
        raise NotImplementedError

    def counts(self, state: Any) -> list[tuple[Any, int]]:
        """(covered, total) per key."""
        raise NotImplementedError

    # Generation. `generate` searches inputs for a criterion that defines these; the
    # others say that they cannot be searched for (UngeneratableCriterionError).
    # A requirement is (group, n1, n2): a neuron n1 of layer `group` (n2 = -1), or a pair
    # of neurons n1 of layer `group` and n2 of the next (``span = 2``).

    #: how many adjacent layers one requirement spans, from its group on
    span: int = 1
    #: which of those layers (0, 1) have a neuron that must change sign
    sign_changes: tuple[int, ...] = ()

    def moves(self, a: Any, layer: int) -> list[Any]:
        """The changes (each like `a`, signed) any one of which gives neuron values `a`
        of the span's `layer` (0 or 1) the change a requirement asks of them; `generate`
        tries first the requirements whose moves are smallest against how far the
        seed's neurons can move. None planned: []. By default a sign change for the
        layers in `sign_changes`: `-a`, to 0."""
        return [-a] if layer in self.sign_changes else []

    def open_requirements(self, state: Any) -> list[tuple[int, int, int]]:
        """(group, n1, n2) of every requirement `state` has not covered yet.

        Raises:
          UngeneratableCriterionError: `generate` cannot search inputs for this criterion.
        """
        raise UngeneratableCriterionError(name=self.name)

    def holds(self, start: list[Any], now: list[Any], n1: Any, n2: Any) -> Any:
        """Per row: whether a seed and an input, with neuron values `start` and `now`
        (one (rows, neurons) array per layer of the span), cover the requirement
        (n1[row], n2[row]), by the criterion's definition."""
        raise UngeneratableCriterionError(name=self.name)

    def search_loss(
        self, start: list[Any], now: list[Any], before: list[Any], n1: Any, n2: Any
    ) -> Any:
        """Per row: a loss, zero (up to margins) where `holds`, that a gradient search
        lowers; `before` are the values before the activation (gradients of a ReLU that
        is off vanish)."""
        raise UngeneratableCriterionError(name=self.name)


def covered(cond: Any, valid: Any) -> Any:
    """Whether `cond` holds for some row (input) among those `valid` marks (every row
    without a mask), over axis 0."""
    if valid is not None:
        cond = cond & valid.reshape((-1,) + (1,) * (cond.ndim - 1))
    return jnp.any(cond, axis=0)


class _Flags(Criterion):
    """A criterion whose state is one boolean array per key (one flag per neuron by
    default), each flag set once some input covers it."""

    masks_rows = True
    per_layer = True

    def init(self, sizes: list[int]) -> Any:
        return [np.zeros((n,), bool) for n in sizes]

    def counts(self, state):
        return [(np.count_nonzero(s), np.size(s)) for s in state]


def pick(values: Any, n: Any) -> Any:
    """values[row, n[row]] for each row of a (rows, neurons) array."""
    return jnp.take_along_axis(values, n[:, None], axis=1)[:, 0]


def is_number(x: Any, types: type | tuple[type, ...]) -> bool:
    """Whether `x` is an instance of `types` (bools, although ints, are not numbers here)."""
    return isinstance(x, types) and not isinstance(x, bool)


def check_int(name: str, k: Any) -> int:
    """`k` as a Python int (NumPy integers taken too), if it is a positive integer."""
    if not is_number(k, (int, np.integer)) or k < 1:
        raise PositiveIntegerError(name=name, value=k)
    return int(k)


class NC(_Flags):
    """Neuron coverage (DeepXplore).

    For each input, the layer's whole output is min-max scaled to [0, 1] over all its
    elements; a neuron's value is then its scaled element (``granularity="element"``) or
    the mean of its channel's scaled elements (``"channel"``). A neuron is covered when,
    for some input, that value is strictly greater than `threshold`.

    Edge cases: an input whose layer output is constant (max = min) scales to 0 and covers
    nothing there; a value exactly equal to the threshold does not cover.

    Args:
      threshold: t in [0, 1).
    """

    needs_scaled = True

    def __init__(self, threshold: float = 0.5):
        if (
            not is_number(threshold, (int, float, np.integer, np.floating))
            or not 0 <= threshold < 1
        ):
            raise ThresholdError(threshold=threshold)
        self.threshold = float(threshold)

    def update(self, state, values, scaled, profile, valid=None):
        return [s | covered(v > self.threshold, valid) for s, v in zip(state, scaled, strict=True)]

    def open_requirements(self, state):
        return [
            (group, int(n), -1)
            for group, s in enumerate(state)
            for n in np.flatnonzero(~np.asarray(s))
        ]

    def holds(self, start, now, n1, n2):
        return pick(now[0], n1) > self.threshold

    def search_loss(self, start, now, before, n1, n2):
        return jax.nn.relu(self.threshold + 0.02 - pick(now[0], n1))


# How far past a profile bound a value must lie to count as beyond it, relative to the
# neuron's larger bound magnitude. XLA rounds a layer's values a few ulps differently at
# different batch sizes (measured up to 1.4e-6 of the neuron's scale, on small CNNs and
# MLPs), so without it the profiling inputs fed again at another batch size would cross
# their own bounds (NBC, SNAC) or fall out of every section (KMNC).
BOUND_TOLERANCE = 2.0**-17


def _bounds(p: Moments) -> tuple[Any, Any]:
    """[low_n, high_n] of the profile `p`, each widened by the tolerance (none at an
    infinite bound)."""
    scale = jnp.maximum(jnp.abs(p.low), jnp.abs(p.high))
    tol = jnp.where(jnp.isfinite(scale), BOUND_TOLERANCE * scale, 0.0)
    return p.low - tol, p.high + tol


def _kmnc_sections(v: Any, p: Moments, k: int) -> Any:
    """One-hot (B, N, k) of the section each value falls in (all False outside the range,
    within the tolerance: a value just past a bound falls in its end section)."""
    outer_low, outer_high = _bounds(p)
    inside = (v >= outer_low) & (v <= outer_high)
    low, high = p.low, p.high
    width = high - low
    idx = jnp.where(width > 0, jnp.floor((v - low) / jnp.where(width > 0, width, 1.0) * k), k - 1)
    idx = jnp.clip(idx, 0, k - 1).astype(jnp.int32)
    return jax.nn.one_hot(idx, k, dtype=bool) & inside[..., None]


class KMNC(_Flags):
    """k-multisection neuron coverage (DeepGauge).

    [low_n, high_n] is split into k sections of equal width; a neuron's section is covered
    when some input's value falls in it. A value equal to high_n falls in the last section;
    values outside [low_n, high_n] cover no section, except that a value past a bound by
    at most 2^-17 · max(|low_n|, |high_n|) counts in that end's section (see `NBC`). A
    zero-range neuron (low_n = high_n) has its single value counted in the last section.
    KMNC = covered sections / (k·|N|).

    Args:
      k: the number of sections.
    """

    needs_profile = True

    def __init__(self, k: int = 10):
        self.k = check_int("KMNC k", k)

    def init(self, sizes):
        return [np.zeros((n, self.k), bool) for n in sizes]

    def update(self, state, values, scaled, profile, valid=None):
        return [
            s | covered(_kmnc_sections(v, p, self.k), valid)
            for s, v, p in zip(state, values, profile, strict=True)
        ]


class NBC(Criterion):
    """Neuron boundary coverage (DeepGauge).

    NBC = (|{n: some φ > high_n}| + |{n: some φ < low_n}|) / (2|N|). Values at a bound do
    not count, nor values past it by at most 2^-17 · max(|low_n|, |high_n|): XLA rounds a
    layer's values a few ulps differently at different batch sizes, and the profiling
    inputs fed again must not cross their own bounds.
    """

    needs_profile = True
    masks_rows = True
    per_layer = True

    def init(self, sizes):
        return [(np.zeros((n,), bool), np.zeros((n,), bool)) for n in sizes]

    def update(self, state, values, scaled, profile, valid=None):
        out = []
        for (up, lo), v, p in zip(state, values, profile, strict=True):
            low, high = _bounds(p)
            out.append((up | covered(v > high, valid), lo | covered(v < low, valid)))
        return out

    def counts(self, state):
        return [(np.count_nonzero(up) + np.count_nonzero(lo), 2 * np.size(up)) for up, lo in state]


class SNAC(_Flags):
    """Strong neuron activation coverage (DeepGauge): |{n: some φ > high_n}| / |N|, past
    high_n by more than 2^-17 · max(|low_n|, |high_n|) (see `NBC`)."""

    needs_profile = True

    def update(self, state, values, scaled, profile, valid=None):
        return [
            s | covered(v > _bounds(p)[1], valid)
            for s, v, p in zip(state, values, profile, strict=True)
        ]


class TKNC(_Flags):
    """Top-k neuron coverage (DeepGauge).

    A neuron is covered when, for some input, it is among the k largest values of its
    layer. Ties are inclusive: every neuron whose value equals the k-th largest counts, so
    one input may cover more than k neurons. With k ≥ |layer| every neuron is covered by
    any input.

    Args:
      k: how many top neurons per layer and input.
    """

    def __init__(self, k: int = 2):
        self.k = check_int("TKNC k", k)

    def update(self, state, values, scaled, profile, valid=None):
        out = []
        for s, v in zip(state, values, strict=True):
            k = min(self.k, v.shape[1])
            kth = jax.lax.top_k(v, k)[0][:, -1:]
            out.append(s | covered(v >= kth, valid))
        return out
