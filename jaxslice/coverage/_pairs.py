"""The adjacent-layer criteria of Sun et al. (2019): `SignSign`, `ValueSign`, `SignValue`
and `ValueValue`, vectorised over neurons and inputs.

A requirement is a pair of neurons (n1 in layer k, n2 in layer k+1), covered by some two
distinct inputs seen so far. The state keeps the neuron values of every input seen (up to a
capacity), so results do not depend on how inputs are batched; an update compares the new
inputs with the earlier ones block by block (see `PairCriterion`). For `generate`, each
criterion also gives its open requirements, its exact check for one (seed, input) pair and
a hinge loss that a gradient search lowers.

Reference: Sun, Huang, Kroening et al., "Structural test coverage criteria for deep neural
networks", ACM TECS 2019 (sign-sign, value-sign, sign-value and value-value coverage).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import RatioError, RatioRangeError
from ._criteria import Criterion, check_int, is_number, pick

SIGN, VALUE = "sign", "value"

# How many earlier inputs one step of a pair update compares a batch with, and the most
# (input pair x neuron pair) products one step of it forms. Together they bound the
# memory of an update whatever the capacity and layer widths (a 512 x 512 layer pair at a
# batch of 64 stays far below 1 GiB) and make its time grow with the inputs seen so far,
# not with the capacity.
_BLOCK = 512
_PRODUCTS = 2**25
# Layer pairs whose packed product for a block of `_PACKED` earlier inputs has up to
# `_DENSE` words take every input pair of a block at once (`_packed_cover`).
_PACKED = 64
_DENSE = 2**22


def sign_change(a: Any, b: Any) -> Any:
    """sc: whether each neuron's sign (φ > 0; 0 and NaN are inactive) differs."""
    return (a > 0) != (b > 0)


def value_change(a: Any, b: Any, ratio: float) -> Any:
    """vc_r: the same sign, different values, and the larger magnitude at least `ratio`
    times the smaller (a NaN never changes value)."""
    return ((a > 0) == (b > 0)) & _far_apart(a, b, ratio)


def _far_apart(a: Any, b: Any, ratio: float) -> Any:
    """vc_r without its sign part: different values, the larger magnitude at least
    `ratio` times the smaller."""
    big = jnp.maximum(jnp.abs(a), jnp.abs(b))
    small = jnp.minimum(jnp.abs(a), jnp.abs(b))
    return (a != b) & (big >= ratio * small)


def _check_ratio(name: str, ratio: Any) -> float:
    """`ratio` as a float: a finite number >= 1 that float32, in which the criteria
    compare values, holds (a larger one would be inf there, and inf · 0 NaN)."""
    if not is_number(ratio, (int, float, np.integer, np.floating)) or not (
        math.isfinite(ratio) and ratio >= 1
    ):
        raise RatioError(name=name, ratio=ratio)
    with np.errstate(over="ignore"):
        if np.isinf(np.float32(ratio)):
            raise RatioRangeError(name=name, ratio=ratio, largest=str(np.finfo(np.float32).max))
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
    values of every input seen (up to `capacity`), and how many were seen. A tracker
    updates its pair criteria together (`PairFamily`): they share one history and one pass
    over the input pairs.
    """

    first: str
    second: str
    masks_rows = True

    def __init__(self, ratio: float = 2.0, capacity: int = 4096):
        self.ratio = _check_ratio(type(self).__name__, ratio)
        self.capacity = check_int(f"{type(self).__name__} capacity", capacity)

    def keys(self, layers):
        return [f"{a} -> {b}" for a, b in zip(layers[:-1], layers[1:], strict=True)]

    def init(self, sizes):
        return PairFamily.states([self], PairFamily.init([self], sizes))[0]

    @property
    def family(self) -> Any:  # type: ignore[override]
        return PairFamily

    def condition(self, which: str) -> tuple[str, float | None]:
        """The `first` or `second` condition with its ratio (None for a sign change)."""
        kind = getattr(self, which)
        return (kind, None) if kind == SIGN else (kind, self.ratio)

    def changes(self, kind: str, a: Any, b: Any) -> Any:
        """The per-neuron condition `kind` (sign or value change) between values a and b."""
        return sign_change(a, b) if kind == SIGN else value_change(a, b, self.ratio)

    # ------------------------------------------------------------------ generation

    span = 2

    @property
    def sign_changes(self) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(k for k, kind in enumerate((self.first, self.second)) if kind == SIGN)

    def moves(self, a, layer):
        """A sign change: to 0 (`-a`); a value change: shrinking to a/ratio or growing to
        ratio·a, same sign."""
        kind, ratio = self.condition(("first", "second")[layer])
        return [-a] if kind == SIGN else [-(1 - 1 / ratio) * a, (ratio - 1) * a]

    def open_requirements(self, state):
        return [
            (group, int(n1), int(n2))
            for group, covered in enumerate(state[0])
            for n1, n2 in np.argwhere(~np.asarray(covered))
        ]

    def holds(self, start, now, n1, n2):
        """The criterion's definition for one pair of inputs per row: the seed's layer
        values (a1, a2) and the input's (b1, b2), each (rows, neurons)."""
        (a1, a2), (b1, b2) = start, now
        flips = jnp.sum(sign_change(a1, b1), axis=1)
        alone = flips == (1 if self.first == SIGN else 0)
        first = self.changes(self.first, pick(a1, n1), pick(b1, n1))
        return alone & first & self.changes(self.second, pick(a2, n2), pick(b2, n2))

    def search_loss(self, start, now, before, n1, n2):
        """Flip n1 and keep every other sign of layer k (or keep them all and change n1's
        value by the ratio); flip or change the value of n2. Each part is relative to its
        layer's mean magnitude at the seed."""
        scale = [jnp.mean(jnp.abs(s), axis=1, keepdims=True) + 1e-6 for s in start]
        (a0, b0), (a, b), (pa, pb) = start, now, before
        m1, m2 = 0.02 * scale[0], 0.02 * scale[1]
        target = jax.nn.one_hot(n1, a0.shape[1], dtype=bool)
        active = a0 > 0
        if self.first == SIGN:
            active = jnp.where(target, ~active, active)  # flip n1, keep the rest
        first = jnp.sum(_sign_loss(a, pa, active, m1), axis=1) / scale[0][:, 0]
        if self.first != SIGN:
            change = _value_loss(pick(a, n1), pick(a0, n1), self.ratio, m1[:, 0])
            first = first + change / scale[0][:, 0]
        b_n, b0_n, pb_n = pick(b, n2), pick(b0, n2), pick(pb, n2)
        if self.second == SIGN:
            second = _sign_loss(b_n, pb_n, ~(b0_n > 0), m2[:, 0])
        else:
            second = _value_loss(b_n, b0_n, self.ratio, m2[:, 0])
        return first + second / scale[1][:, 0]

    # ------------------------------------------------------------------ update

    def update(self, state, values, scaled, profile, valid=None):
        """This criterion alone (a tracker updates its pair criteria together)."""
        covered, history, count = state
        new = PairFamily.update([self], ([covered], history, count), values, None, None, valid)
        return PairFamily.states([self], new)[0]

    def counts(self, state):
        # On the host: one read of each matrix rather than a dispatched sum per matrix.
        return [(int(np.count_nonzero(np.asarray(c))), c.size) for c in state[0]]


class PairFamily:
    """The pair criteria of a tracker, updated together (`Criterion.family`).

    They share one history of every input's neuron values (rows for the largest
    capacity) and one pass over the input pairs: block by block of earlier inputs, the
    Hamming distances between layer-k sign patterns (one matrix product) say which input
    pairs can cover anything (one sign change in layer k, or none); each distinct
    condition (a sign change, a value change at a ratio) is computed once per layer, and
    one product per layer pair gives every criterion's neuron pairs at once: its block of
    (first conditions) x (second conditions). For small layers every input pair of a
    block takes part, 32 earlier inputs packed into the bits of a word, so that a sign
    change is one XOR and the product one AND per 32 input pairs; wide layers form
    float products only for the input pairs that can cover, a bounded number at a time.

    The joint state is ``(covered, history, count)``: per criterion, one boolean
    (|L_k|, |L_k+1|) matrix per adjacent pair of layers; per layer, the values of the
    inputs seen; how many were seen.
    """

    @staticmethod
    def init(criteria: list[PairCriterion], sizes: list[int]) -> Any:
        shapes = list(zip(sizes[:-1], sizes[1:], strict=True))
        covered = [[np.zeros(shape, bool) for shape in shapes] for _ in criteria]
        # Rows for whole blocks of either size (a block read past the end would be moved).
        capacity = max(c.capacity for c in criteria)
        block = _BLOCK if capacity > _BLOCK else _BLOCK // 4
        rows = -(-capacity // block) * block
        history = [np.zeros((rows, n), np.float32) for n in sizes]
        return covered, history, np.zeros((), np.int32)

    @staticmethod
    def states(criteria: list[PairCriterion], state: Any) -> list[Any]:
        """Each criterion's state, ``(covered, history, count)``, from the joint one."""
        covered, history, count = state
        return [(cov, history, count) for cov in covered]

    @staticmethod
    def update(criteria, state, values, scaled, profile, valid) -> Any:
        """The joint state after a batch (see `Criterion.update`; `valid` marks the
        batch's inputs, its first rows, or is None: every row)."""
        covered, history, count = state
        b = values[0].shape[0]
        valid = jnp.ones((b,), bool) if valid is None else valid
        seen = jnp.sum(valid, dtype=count.dtype)
        # Input i goes to row count + i of the history; padding rows go nowhere.
        rows = jnp.where(valid, count + jnp.arange(b, dtype=count.dtype), history[0].shape[0])
        history = [
            jnp.asarray(h).at[rows].set(v.astype(h.dtype), mode="drop")
            for h, v in zip(history, values, strict=True)
        ]
        covered = _cover(criteria, covered, values, history, count, valid, seen)
        return covered, history, count + seen


def _change(condition: tuple[str, float | None], a: Any, b: Any) -> Any:
    kind, ratio = condition
    return sign_change(a, b) if kind == SIGN else value_change(a, b, ratio)


def _packed(x: Any, axis: int) -> Any:
    """Booleans `x` with 32 consecutive entries along `axis` (a multiple of 32 long) packed
    into the bits of one uint32 word: the axis becomes one of words."""
    shape = x.shape[:axis] + (x.shape[axis] // 32, 32) + x.shape[axis + 1 :]
    bits = jnp.arange(32, dtype=jnp.uint32).reshape((32,) + (1,) * (x.ndim - axis - 1))
    return jnp.sum(x.reshape(shape).astype(jnp.uint32) << bits, axis=axis + 1, dtype=jnp.uint32)


def _any_products(f: Any, g: Any) -> Any:
    """(N1, N2): for packed rows f (R, N1) and g (R, N2) of 32 input pairs each, whether
    some input pair holds both f[., n1] and g[., n2]: one AND tests 32 pairs."""
    return jnp.any((f[:, :, None] & g[:, None, :]) != 0, axis=0)


def _cover(criteria, covered, new, old, count, valid, seen) -> list[list[Any]]:
    """`covered` (per criterion, one matrix per adjacent pair of layers) with the pairs
    each new input (row count + i of the history, for the rows `valid` marks) covers with
    every input before it: small layer pairs together (`_packed_cover`), wide ones one by
    one (`_gathered_cover`)."""
    conds = firsts, seconds = _conditions(criteria, "first"), _conditions(criteria, "second")
    b, sizes = new[0].shape[0], [v.shape[1] for v in new]
    shapes = list(zip(sizes[:-1], sizes[1:], strict=True))
    # The packed product's words for a block of earlier inputs (a bound on its memory).
    words = [b * _PACKED // 32 * n1 * len(firsts) * n2 * len(seconds) for n1, n2 in shapes]
    small = [k for k, w in enumerate(words) if w <= _DENSE]
    bigs = dict(zip(small, _packed_cover(conds, small, new, old, count, valid, seen), strict=True))
    for k in sorted(set(range(len(shapes))) - set(small)):
        bigs[k] = _gathered_cover(conds, new[k : k + 2], old[k : k + 2], count, valid, seen)
    out = []
    for crit, covs in zip(criteria, covered, strict=True):
        f, g = firsts.index(crit.condition("first")), seconds.index(crit.condition("second"))
        out.append([
            cov | bigs[k][f * n1 : (f + 1) * n1, g * n2 : (g + 1) * n2]
            for k, (cov, (n1, n2)) in enumerate(zip(covs, shapes, strict=True))
        ])  # fmt: skip
    return out


def _conditions(criteria: list[PairCriterion], which: str) -> list[tuple[str, float | None]]:
    return sorted({c.condition(which) for c in criteria}, key=str)


def _distance(first: tuple[str, float | None]) -> int:
    """The Hamming distance in layer k that a first condition allows: one sign change
    (n1's own) for a sign change, none for a value change."""
    return 1 if first[0] == SIGN else 0


def _hamming(signs: Any, old: Any) -> Any:
    """(b, rows): how many neurons differ in sign between each new input (its signs as
    0/1) and each earlier one (values)."""
    old_signs = (old > 0).astype(jnp.float32)
    same = _count_products(signs.T, old_signs.T)  # neurons active in both
    return jnp.sum(signs, axis=1)[:, None] + jnp.sum(old_signs, axis=1)[None, :] - 2 * same


def _packed_cover(conds, pairs, new, old, count, valid, seen) -> list[Any]:
    """For the layer pairs `pairs` (k: layers k and k+1), whether some new input and some
    earlier one cover each (first condition, n1) x (second condition, n2): blocks of
    earlier inputs, every input pair of a block at once, with 32 earlier inputs packed
    into the bits of a word. Packed, a sign change of a layer's neurons is one XOR per
    word, and the neuron-pair product tests 32 input pairs with one AND. A layer's
    conditions serve both layer pairs it is in."""
    firsts, seconds = conds
    b = new[0].shape[0]
    block = min(old[0].shape[0], _PACKED)
    position = count + jnp.arange(b)[:, None]  # where each new input sits in the history
    signs = [(v > 0).astype(jnp.float32) for v in new]
    active = [jnp.where(v > 0, ~jnp.uint32(0), jnp.uint32(0))[:, None] for v in new]
    layers = sorted(set(pairs) | {k + 1 for k in pairs})

    def one_block(blk: Any, bigs: list[Any]) -> list[Any]:
        start = blk * block
        olds = {k: jax.lax.dynamic_slice_in_dim(old[k], start, block) for k in layers}
        earlier = (start + jnp.arange(block)[None, :] < position) & valid[:, None]
        memo: dict[Any, Any] = {}

        def changes(k: int, c: tuple[str, float | None]) -> Any:
            """(b, words, neurons): condition c of each new input with earlier ones (a
            value change: no sign change, packed, and far enough apart)."""
            if (k, c) not in memo:
                memo[k, c] = (
                    _packed(olds[k] > 0, 0)[None] ^ active[k]
                    if c[0] == SIGN
                    else ~changes(k, (SIGN, None))
                    & _packed(_far_apart(new[k][:, None], olds[k][None], c[1]), 1)
                )
            return memo[k, c]

        out = []
        for k, big in zip(pairs, bigs, strict=True):
            flips = _hamming(signs[k], olds[k])
            f = [
                changes(k, c) & _packed(earlier & (flips == _distance(c)), 1)[..., None]
                for c in firsts
            ]
            g = [changes(k + 1, c) for c in seconds]
            f, g = jnp.concatenate(f, axis=-1), jnp.concatenate(g, axis=-1)
            out.append(big | _any_products(f.reshape(-1, f.shape[-1]), g.reshape(-1, g.shape[-1])))
        return out

    zeros = [
        jnp.zeros((new[k].shape[1] * len(firsts), new[k + 1].shape[1] * len(seconds)), bool)
        for k in pairs
    ]
    return jax.lax.fori_loop(0, -(-(count + seen) // block), one_block, zeros)


def _gathered_cover(conds, new, old, count, valid, seen) -> Any:
    """For one wide layer pair: blocks of earlier inputs; the Hamming distances pick the
    input pairs that can cover (one sign change in layer k, or none), and the neuron-pair
    products are formed for those only, `chunk` at a time."""
    (firsts, seconds), (new1, new2), (old1, old2) = conds, new, old
    wants = sorted({_distance(c) for c in firsts})
    b, (rows, n1), n2 = new1.shape[0], old1.shape, new2.shape[1]
    w1, w2 = n1 * len(firsts), n2 * len(seconds)  # the product's rows and columns
    block = min(rows, _BLOCK)
    chunk = max(1, min(b * block, 4096, _PRODUCTS // (w1 * w2)))
    padded = -(-(b * block) // chunk) * chunk
    signs = (new1 > 0).astype(jnp.float32)
    position = count + jnp.arange(b)[:, None]  # where each new input sits in the history

    def one_block(blk: Any, big: Any) -> Any:
        start = blk * block
        o1 = jax.lax.dynamic_slice_in_dim(old1, start, block)
        o2 = jax.lax.dynamic_slice_in_dim(old2, start, block)
        flips = _hamming(signs, o1)
        earlier = (start + jnp.arange(block)[None, :] < position) & valid[:, None]
        near = earlier & functools.reduce(jnp.logical_or, [flips == w for w in wants])
        near, flips = near.ravel(), flips.ravel()
        found = jnp.sum(near)
        index = jnp.nonzero(near, size=padded, fill_value=0)[0]

        def one_chunk(t: Any, big: Any) -> Any:
            ids = jax.lax.dynamic_slice_in_dim(index, t * chunk, chunk)
            live = t * chunk + jnp.arange(chunk) < found
            i, j, alone = ids // block, ids % block, flips[ids][:, None]
            f = [_change(c, new1[i], o1[j]) & (alone == _distance(c)) for c in firsts]
            f = jnp.concatenate(f, axis=-1) & live[:, None]
            g = jnp.concatenate([_change(c, new2[i], o2[j]) for c in seconds], axis=-1)
            return big | (_count_products(f, g) > 0)

        return jax.lax.fori_loop(0, -(-found // chunk), one_chunk, big)

    return jax.lax.fori_loop(0, -(-(count + seen) // block), one_block, jnp.zeros((w1, w2), bool))


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
    blocks (small layers: every input pair of a block at once, 32 to a machine word;
    wide ones: only the input pairs that can cover, a bounded number at a time), so its
    time grows with the inputs seen.

    Args:
{args}      capacity: the most inputs whose values are kept.

    Reference: Sun, Huang, Kroening, Sharp, Hill and Ashmore, "Structural test coverage
    criteria for deep neural networks", ACM TECS 18(5s), 2019.
    """

_RATIO_ARG = (
    "      ratio: r >= 1, how many times larger one magnitude must be than the other (at\n"
    "        most float32's largest, 3.4028235e+38: values are compared in float32).\n"
)


class SignSign(PairCriterion):
    first, second = SIGN, SIGN
    __doc__ = _PAIRS_DOC.format(
        title="Sign-sign",
        rule="sc(n1), no other neuron of layer k changes sign, and sc(n2)",
        arxiv="",
        args="",
    )

    def __init__(self, capacity: int = 4096):
        self.capacity = check_int("SignSign capacity", capacity)  # no ratio: nothing reads it


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


def _sign_loss(a: Any, before: Any, active: Any, margin: Any) -> Any:
    """Hinge towards φ > 0 (`active`) or φ <= 0; turning a neuron on also pushes the
    value before its activation up while φ is still off (a ReLU that is off has no
    gradient)."""
    on = jax.nn.relu(margin - a) + jax.lax.stop_gradient(a <= 0) * jax.nn.relu(margin - before)
    off = jnp.where(a == 0, 0.0, jax.nn.relu(a + margin))
    return jnp.where(active, on, off)


def _value_loss(a: Any, a0: Any, ratio: float, margin: Any) -> Any:
    """Hinge towards a value change from `a0`: growing past ratio·|a0| or shrinking
    below |a0|/ratio with the same sign, whichever is nearer."""
    positive = a0 > 0
    grow = jnp.where(
        positive, jax.nn.relu(ratio * a0 + margin - a), jax.nn.relu(a - ratio * a0 + margin)
    )
    inner = jnp.minimum(margin, jnp.abs(a0) / (4 * ratio))
    shrink_pos = jax.nn.relu(a - a0 / ratio + inner) + jax.nn.relu(inner - a)
    shrink_neg = jax.nn.relu(a0 / ratio + inner - a) + jax.nn.relu(a + inner)
    shrink = jnp.where(positive, shrink_pos, jnp.where(a0 < 0, shrink_neg, jnp.inf))
    return jnp.minimum(grow, shrink)
