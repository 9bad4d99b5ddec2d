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
  networks", ACM TECS 2019 (sign-sign, value-sign, sign-value and value-value coverage).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import PositiveIntegerError, RatioError, ThresholdError
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
        raise PositiveIntegerError(name=name, value=k)
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
            raise ThresholdError(threshold=threshold)
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


SIGN, VALUE = "sign", "value"

# How many earlier inputs one step of a pair update compares a batch with, and the most
# (input pair x neuron pair) products one step of it forms. Together they bound the
# memory of an update whatever the capacity and layer widths (a 512 x 512 layer pair at a
# batch of 64 stays far below 1 GiB) and make its time grow with the inputs seen so far,
# not with the capacity.
_BLOCK = 512
_PRODUCTS = 2**25
_DENSE = 2**25  # up to this many, every input pair of a block is taken at once


def sign_change(a: Any, b: Any) -> Any:
    """sc: whether each neuron's sign (φ > 0; 0 and NaN are inactive) differs."""
    return (a > 0) != (b > 0)


def value_change(a: Any, b: Any, ratio: float) -> Any:
    """vc_r: the same sign, different values, and the larger magnitude at least `ratio`
    times the smaller (a NaN never changes value)."""
    big = jnp.maximum(jnp.abs(a), jnp.abs(b))
    small = jnp.minimum(jnp.abs(a), jnp.abs(b))
    return ((a > 0) == (b > 0)) & (a != b) & (big >= ratio * small)


def _check_ratio(name: str, ratio: Any) -> float:
    if not _is_number(ratio, (int, float, np.integer, np.floating)) or not (
        math.isfinite(ratio) and ratio >= 1
    ):
        raise RatioError(name=name, ratio=ratio)
    return float(ratio)


def _count_products(f: Any, g: Any) -> Any:
    """(N1, N2): for how many rows both f[row, n1] and g[row, n2] hold."""
    f, g = f.astype(jnp.float32), g.astype(jnp.float32)
    return jnp.matmul(f.T, g, precision=jax.lax.Precision.HIGHEST)


class PairCriterion(Criterion):
    """A Sun et al. (2019) criterion over pairs (n1 in layer k, n2 in layer k+1).

    The first neuron's condition is a sign change with no other sign change in layer k
    (``first = "sign"``) or a value change with no sign change in layer k (``"value"``);
    the second's is a sign or a value change of n2. Pairs of inputs are taken over
    everything seen so far, each unordered pair once, so results do not depend on how
    inputs are batched.

    State: a boolean (|L_k|, |L_k+1|) matrix per adjacent pair of layers, the neuron
    values of every input seen (up to `capacity`), and how many were seen. An update
    finds, block by block of earlier inputs, the input pairs whose layer-k sign patterns
    differ in exactly the allowed number of neurons (a Hamming distance, from one matrix
    product), and only for those forms the neuron-pair products, a bounded number at a
    time.
    """

    first: str
    second: str

    def __init__(self, ratio: float = 2.0, capacity: int = 4096):
        self.ratio = _check_ratio(type(self).__name__, ratio)
        self.capacity = _check_int(f"{type(self).__name__} capacity", capacity)

    def keys(self, layers):
        return [f"{a} -> {b}" for a, b in zip(layers[:-1], layers[1:], strict=True)]

    def init(self, sizes):
        pairs = [np.zeros((a, b), bool) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
        # Rows for whole blocks of either size (a block read past the end would be moved).
        block = _BLOCK if self.capacity > _BLOCK else _BLOCK // 4
        rows = -(-self.capacity // block) * block
        history = [np.zeros((rows, n), np.float32) for n in sizes]
        return pairs, history, np.zeros((), np.int32)

    def changes(self, kind: str, a: Any, b: Any) -> Any:
        """The per-neuron condition `kind` (sign or value change) between values a and b."""
        return sign_change(a, b) if kind == SIGN else value_change(a, b, self.ratio)

    def covers(self, a1: Any, b1: Any, a2: Any, b2: Any, n1: Any, n2: Any) -> Any:
        """Per row: whether two inputs with layer values (a1, a2) and (b1, b2), each
        (rows, neurons), cover the requirement (n1[row], n2[row]): the criterion's
        definition for one pair of inputs."""
        pick = lambda v, n: jnp.take_along_axis(v, n[:, None], axis=1)[:, 0]  # noqa: E731
        flips = jnp.sum(sign_change(a1, b1), axis=1)
        alone = flips == (1 if self.first == SIGN else 0)
        first = self.changes(self.first, pick(a1, n1), pick(b1, n1))
        return alone & first & self.changes(self.second, pick(a2, n2), pick(b2, n2))

    def update(self, state, values, scaled, profile):
        pairs, history, count = state
        history = [
            jax.lax.dynamic_update_slice(h, v.astype(h.dtype), (count, 0))
            for h, v in zip(history, values, strict=True)
        ]
        new_pairs = [
            self._cover(cov, values[k], history[k], values[k + 1], history[k + 1], count)
            for k, cov in enumerate(pairs)
        ]
        return new_pairs, history, count + values[0].shape[0]

    def _cover(self, cov: Any, new1: Any, old1: Any, new2: Any, old2: Any, count: Any) -> Any:
        """`cov` with the pairs covered by each new input (row count + i of the history)
        and every input before it."""
        b, (rows, n1), n2 = new1.shape[0], old1.shape, new2.shape[1]
        # Small layers take every input pair of a (smaller) block in one product; wide
        # ones only the pairs that can cover, `chunk` at a time.
        dense = b * min(rows, _BLOCK) * n1 * n2 <= _DENSE
        block = min(rows, _BLOCK // 4 if dense else _BLOCK)
        chunk = max(1, min(b * block, 4096, _PRODUCTS // (n1 * n2)))
        padded = -(-(b * block) // chunk) * chunk
        want = 1 if self.first == SIGN else 0
        signs = (new1 > 0).astype(jnp.float32)
        active = jnp.sum(signs, axis=1)[:, None]
        position = count + jnp.arange(b)[:, None]  # where each new input sits in the history

        def one_block(blk: Any, cov: Any) -> Any:
            start = blk * block
            o1 = jax.lax.dynamic_slice_in_dim(old1, start, block)
            o2 = jax.lax.dynamic_slice_in_dim(old2, start, block)
            old_signs = (o1 > 0).astype(jnp.float32)
            same = _count_products(signs.T, old_signs.T)  # neurons active in both
            flips = active + jnp.sum(old_signs, axis=1)[None, :] - 2 * same  # Hamming distance
            earlier = start + jnp.arange(block)[None, :] < position
            chosen = earlier & (flips == want)
            if dense:  # small layers: the products of every input pair of the block at once
                f = self.changes(self.first, new1[:, None], o1[None]) & chosen[..., None]
                g = self.changes(self.second, new2[:, None], o2[None])
                return cov | (_count_products(f.reshape(-1, n1), g.reshape(-1, n2)) > 0)
            chosen = chosen.ravel()
            found = jnp.sum(chosen)
            index = jnp.nonzero(chosen, size=padded, fill_value=0)[0]

            def one_chunk(t: Any, cov: Any) -> Any:
                ids = jax.lax.dynamic_slice_in_dim(index, t * chunk, chunk)
                live = t * chunk + jnp.arange(chunk) < found
                i, j = ids // block, ids % block
                f = self.changes(self.first, new1[i], o1[j]) & live[:, None]
                g = self.changes(self.second, new2[i], o2[j])
                return cov | (_count_products(f, g) > 0)

            return jax.lax.fori_loop(0, -(-found // chunk), one_chunk, cov)

        blocks = -(-(count + b) // block)
        return jax.lax.fori_loop(0, blocks, one_block, jnp.asarray(cov))

    def counts(self, state):
        return [(jnp.sum(c), c.size) for c in state[0]]


_PAIRS_DOC = """{title} coverage for adjacent layers (Sun et al., 2019), an MC/DC-style criterion.

    For two inputs x1, x2 and a neuron n with values a = φ(x1, n), b = φ(x2, n): n
    changes sign (sc) when exactly one of a > 0, b > 0 holds (0 and NaN are inactive);
    n changes value (vc) when it does not change sign, a != b and
    max(|a|, |b|) >= ratio · min(|a|, |b|) (so 0 against a negative value is a value
    change, and NaN never is). A pair (n1 in layer k, n2 in layer k+1) is covered when
    some two distinct inputs seen so far satisfy: {rule}.

    Pairs of inputs are taken over everything seen (not only within a batch), so the
    result does not depend on how inputs are batched. Coverage = covered pairs /
    Σ_k |L_k|·|L_k+1|; results are keyed ``"a -> b"`` per adjacent pair of chosen
    layers, in call order. One input, or a single chosen layer, covers nothing.
    {arxiv}
    Memory: the neuron values of each input seen are kept, up to `capacity` inputs (a
    `SliceError` past that); an update compares the new inputs with the earlier ones in
    blocks and forms neuron-pair products only for the input pairs that can cover, a
    bounded number at a time, so its time grows with the inputs seen.

    Args:
{args}      capacity: the most inputs whose values are kept.

    Reference: Sun, Huang, Kroening, Sharp, Hill and Ashmore, "Structural test coverage
    criteria for deep neural networks", ACM TECS 18(5s), 2019.
    """

_RATIO_ARG = "      ratio: r >= 1, how many times larger one magnitude must be than the other.\n"


class SignSign(PairCriterion):
    first, second = SIGN, SIGN
    __doc__ = _PAIRS_DOC.format(
        title="Sign-sign",
        rule="sc(n1), no other neuron of layer k changes sign, and sc(n2)",
        arxiv="",
        args="",
    )

    def __init__(self, capacity: int = 4096):
        self.capacity = _check_int("SignSign capacity", capacity)  # no ratio: nothing reads it


class ValueSign(PairCriterion):
    first, second = VALUE, SIGN
    __doc__ = _PAIRS_DOC.format(
        title="Value-sign",
        rule="vc(n1), no neuron of layer k changes sign, and sc(n2)",
        arxiv="(The arXiv version of the paper calls it distance-sign.)\n",
        args=_RATIO_ARG,
    )


class SignValue(PairCriterion):
    first, second = SIGN, VALUE
    __doc__ = _PAIRS_DOC.format(
        title="Sign-value",
        rule="sc(n1), no other neuron of layer k changes sign, and vc(n2)",
        arxiv="",
        args=_RATIO_ARG,
    )


class ValueValue(PairCriterion):
    first, second = VALUE, VALUE
    __doc__ = _PAIRS_DOC.format(
        title="Value-value",
        rule="vc(n1), no neuron of layer k changes sign, and vc(n2)",
        arxiv="(The arXiv version of the paper calls it distance-value.)\n",
        args=_RATIO_ARG,
    )


PAIRS = (SignSign, ValueSign, SignValue, ValueValue)
ALL = (NC, KMNC, NBC, SNAC, TKNC, *PAIRS)
