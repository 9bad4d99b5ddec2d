"""Structural coverage criteria for neural networks, vectorised over neurons and inputs.

Notation: a layer's neurons n have values φ(x, n) for an input x (see `Tracker` for how
a layer output becomes neuron values). A profile gives [low_n, high_n], the minimum and
maximum of φ(·, n) over the profiling data. Every criterion keeps a boolean state that
is OR-ed over inputs, so accumulation is incremental and independent of batch order and
batch boundaries: updating with two batches equals updating with their concatenation.

References:
  Pei et al., "DeepXplore", SOSP 2017 (NC).
  Ma et al., "DeepGauge", ASE 2018 (KMNC, NBC, SNAC, TKNC).
  Sun, Huang, Kroening et al., "Structural test coverage criteria for deep neural
  networks", ACM TECS 2019 (sign-sign coverage).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import InvalidSpecError
from ..observe import Moments


class Criterion:
    """Base class of coverage criteria. Subclasses define the state and its update."""

    #: whether `Tracker.profile` must run first (the criterion reads [low_n, high_n])
    needs_profile: bool = False
    #: whether the update reads DeepXplore-scaled neuron values
    needs_scaled: bool = False

    @property
    def name(self) -> str:
        return type(self).__name__

    def keys(self, layers: list[str]) -> list[str]:
        """The result keys (one per layer, or per pair of layers)."""
        return list(layers)

    def init(self, sizes: list[int]) -> Any:
        """The empty state for layers of `sizes` neurons. Host (numpy) arrays keep making a
        tracker free of compiles; the compiled update takes them as they are."""
        raise NotImplementedError

    def update(
        self, state: Any, values: list[Any], scaled: list[Any] | None, profile: list[Moments] | None
    ) -> Any:
        raise NotImplementedError

    def counts(self, state: Any) -> list[tuple[Any, int]]:
        """(covered, total) per key."""
        raise NotImplementedError


class _Flags(Criterion):
    """A criterion whose state is one boolean array per key (one flag per neuron by
    default), each flag set once some input covers it."""

    def init(self, sizes: list[int]) -> Any:
        return [np.zeros((n,), bool) for n in sizes]

    def counts(self, state):
        return [(jnp.sum(s), s.size) for s in state]


def _is_number(x: Any, types: type | tuple[type, ...]) -> bool:
    """Whether `x` is an instance of `types` (bools, although ints, are not numbers here)."""
    return isinstance(x, types) and not isinstance(x, bool)


def _check_int(name: str, k: Any) -> int:
    if not _is_number(k, int) or k < 1:
        raise InvalidSpecError(f"{name} must be a positive integer, got {k!r}.")
    return k


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
        if not _is_number(threshold, (int, float)) or not 0 <= threshold < 1:
            raise InvalidSpecError(f"NC threshold must be a number in [0, 1), got {threshold!r}.")
        self.threshold = float(threshold)

    def update(self, state, values, scaled, profile):
        return [s | jnp.any(v > self.threshold, axis=0) for s, v in zip(state, scaled, strict=True)]


def _kmnc_sections(v: Any, low: Any, high: Any, k: int) -> Any:
    """One-hot (B, N, k) of the section each value falls in (all False outside the range)."""
    width = high - low
    inside = (v >= low) & (v <= high)
    idx = jnp.where(width > 0, jnp.floor((v - low) / jnp.where(width > 0, width, 1.0) * k), k - 1)
    idx = jnp.clip(idx, 0, k - 1).astype(jnp.int32)
    return jax.nn.one_hot(idx, k, dtype=bool) & inside[..., None]


class KMNC(_Flags):
    """k-multisection neuron coverage (DeepGauge).

    [low_n, high_n] is split into k sections of equal width; a neuron's section is covered
    when some input's value falls in it. A value equal to high_n falls in the last section;
    values outside [low_n, high_n] cover no section. A zero-range neuron (low_n = high_n)
    has its single value counted in the last section. KMNC = covered sections / (k·|N|).

    Args:
      k: the number of sections.
    """

    needs_profile = True

    def __init__(self, k: int = 10):
        self.k = _check_int("KMNC k", k)

    def init(self, sizes):
        return [np.zeros((n, self.k), bool) for n in sizes]

    def update(self, state, values, scaled, profile):
        return [
            s | jnp.any(_kmnc_sections(v, p.low, p.high, self.k), axis=0)
            for s, v, p in zip(state, values, profile, strict=True)
        ]


class NBC(Criterion):
    """Neuron boundary coverage (DeepGauge).

    NBC = (|{n: some φ > high_n}| + |{n: some φ < low_n}|) / (2|N|). Values exactly at a
    bound do not count.
    """

    needs_profile = True

    def init(self, sizes):
        return [(np.zeros((n,), bool), np.zeros((n,), bool)) for n in sizes]

    def update(self, state, values, scaled, profile):
        return [
            (up | jnp.any(v > p.high, axis=0), lo | jnp.any(v < p.low, axis=0))
            for (up, lo), v, p in zip(state, values, profile, strict=True)
        ]

    def counts(self, state):
        return [(jnp.sum(up) + jnp.sum(lo), 2 * up.size) for up, lo in state]


class SNAC(_Flags):
    """Strong neuron activation coverage (DeepGauge): |{n: some φ > high_n}| / |N|."""

    needs_profile = True

    def update(self, state, values, scaled, profile):
        return [
            s | jnp.any(v > p.high, axis=0) for s, v, p in zip(state, values, profile, strict=True)
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
        self.k = _check_int("TKNC k", k)

    def update(self, state, values, scaled, profile):
        out = []
        for s, v in zip(state, values, strict=True):
            k = min(self.k, v.shape[1])
            kth = jax.lax.top_k(v, k)[0][:, -1:]
            out.append(s | jnp.any(v >= kth, axis=0))
        return out


class SignSign(Criterion):
    """Sign-sign coverage for adjacent layers (Sun et al., 2019), an MC/DC-style criterion.

    A neuron is activated when φ > 0. A pair (n1 in layer k, n2 in layer k+1) is covered
    by two inputs x1, x2 when n1's activation differs between them, every other neuron of
    layer k keeps its activation, and n2's activation differs. Pairs of inputs are taken
    over everything seen so far (not only within a batch), so the result does not depend
    on how inputs are batched. Coverage = covered pairs / Σ_k |L_k|·|L_k+1|; results are
    keyed ``"a -> b"`` per adjacent pair of chosen layers (in call order).

    Memory: the activation pattern of each input seen is kept, up to `capacity` inputs
    (a `SliceError` past that).

    Args:
      capacity: the most inputs whose patterns are kept.
    """

    def __init__(self, capacity: int = 4096):
        self.capacity = _check_int("SignSign capacity", capacity)

    def keys(self, layers):
        return [f"{a} -> {b}" for a, b in zip(layers[:-1], layers[1:], strict=True)]

    def init(self, sizes):
        pairs = [np.zeros((a, b), bool) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
        history = [np.zeros((self.capacity, n), bool) for n in sizes]
        return pairs, history, np.zeros((), np.int32)

    def update(self, state, values, scaled, profile):
        pairs, history, count = state
        signs = [v > 0 for v in values]
        b = signs[0].shape[0]
        # Compare each new input with every earlier one and with the new ones before it.
        valid_old = jnp.arange(self.capacity)[None, :] < count  # (1, C)
        tri = jnp.arange(b)[None, :] < jnp.arange(b)[:, None]  # (B, B): j < i
        new_pairs = []
        for k, cov in enumerate(pairs):
            s1, s2 = signs[k], signs[k + 1]
            h1, h2 = history[k], history[k + 1]
            cov = cov | _ss_cover(s1, h1, s2, h2, valid_old)
            cov = cov | _ss_cover(s1, s1, s2, s2, tri)
            new_pairs.append(cov)
        new_history = [
            jax.lax.dynamic_update_slice(h, s, (count, 0))
            for h, s in zip(history, signs, strict=True)
        ]
        return new_pairs, new_history, count + b

    def counts(self, state):
        return [(jnp.sum(c), c.size) for c in state[0]]


def _ss_cover(a1: Any, b1: Any, a2: Any, b2: Any, mask: Any) -> Any:
    """Pairs (n1, n2) covered by input pairs (i in a, j in b) with mask[i, j]."""
    x1 = a1[:, None, :] != b1[None, :, :]  # (I, J, N1): which layer-k neurons flip
    single = (jnp.sum(x1, axis=-1) == 1) & mask  # exactly one flips
    x2 = a2[:, None, :] != b2[None, :, :]  # (I, J, N2)
    w1 = (x1 & single[..., None]).astype(jnp.float32)
    hits = jnp.einsum("ijn,ijm->nm", w1, x2.astype(jnp.float32))
    return hits > 0


ALL = (NC, KMNC, NBC, SNAC, TKNC, SignSign)
