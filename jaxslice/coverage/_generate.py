"""`js.coverage.generate`: inputs near seeds that cover what a tracker has not seen covered.

Seeds get up to four requirements the tracker has not seen covered (pairs (n1, n2) of
adjacent layers for the Sun et al. criteria, neurons for NC), the most promising first:
those whose neurons need the smallest changes against how far the seed can move them
(`_seed_reach`, `_scores`). For each (seed, requirement) the compiled search of
`_search` looks for an input within L∞ distance `eps` of the seed (and inside `bounds`)
that covers it together with the seed, a chunk of searches at once. Every input is then
checked once more with the criterion's own definition, on the values the tracker itself
computes, before it is returned.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._errors import (
    AmbiguousCriterionError,
    BoundsOrderError,
    BoundsShapeError,
    BoundsSpecError,
    KeySpecError,
    NoFloatSeedsError,
    NotATrackerError,
    PositiveCountError,
    PositiveNumberError,
    SeedsOutOfBoundsError,
)
from ..observe import neurons
from ._criteria import Criterion
from ._search import make_search, moving_parts, values_of

_CHUNK = 64  # searches per run of the compiled search
_TRIES = 4  # searches per seed, each for another requirement
_SAMPLED = 8192  # the most requirements considered per call
_EXACT = 64  # up to this many neurons, the plan measures each one's reach exactly
_PROJECTIONS = 64  # beyond, it estimates them from this many random projections


@dataclasses.dataclass(frozen=True, repr=False)
class Generated:
    """What `generate` found: one row per input that covers its requirement.

    Attributes:
      inputs: the new inputs, shaped like the seeds (an array, or a tuple of arrays).
      seeds: the seed each input was found from (same layout as `inputs`).
      seed_index: (M,) the position of that seed in the seeds given.
      requirements: what each input covers with its seed: ``("a -> b", n1, n2)`` for a
        pair criterion, ``("a", n)`` for NC.
      distances: (M,) the L∞ distance of each input from its seed (at most `eps`).
      attempted: how many searches ran (up to four per seed, each for another
        requirement).
    """

    inputs: Any
    seeds: Any
    seed_index: np.ndarray
    requirements: list[tuple[Any, ...]]
    distances: np.ndarray
    attempted: int

    def __len__(self) -> int:
        return len(self.requirements)

    def __repr__(self) -> str:
        far = f", max distance {float(self.distances.max()):.4g}" if len(self) else ""
        return f"Generated({len(self)} inputs from {self.attempted} searches{far})"


def generate(
    tracker: Any,
    seeds: Any,
    criterion: Criterion | str | type,
    *,
    eps: float = 0.3,
    steps: int = 50,
    bounds: tuple[Any, Any] | None = None,
    max_inputs: int | None = None,
    key: Any = None,
) -> Generated:
    """Inputs within `eps` of `seeds` that cover requirements `tracker` has not seen covered.

    Each seed gets up to four uncovered requirements of `criterion`, from the eight it
    can reach most easily: how far each neuron can move from the seed inside the budget,
    to first order, is measured before searching (exactly for up to 64 neurons, one
    backward pass each; beyond, estimated from 64 random forward-mode projections), and
    the requirements whose changes are smallest against it come first. A requirement is
    tried from several seeds only once every one planned has been tried. Each search
    takes `steps` signed gradient steps from the seed, of size ``5 * eps / steps``
    falling linearly to ``0.2 * eps / steps``, kept within L∞ distance `eps` of it and
    inside `bounds`. A pair requirement is covered by the pair (seed, new input), so the
    seeds should be inputs the tracker has seen:
    ``tracker.update(result.inputs)`` then raises its coverage.

    Args:
      tracker: a `js.coverage.Tracker`.
      seeds: a batch of the model's inputs, as for `tracker.update`.
      criterion: one of the tracker's criteria (the object or an equal one, such as
        ``NC(0.5)`` for the tracker's ``NC(0.5)``; its result name; or its class):
        `NC`, `SignSign`, `ValueSign`, `SignValue` or `ValueValue`.
      eps: the L∞ budget, a positive number.
      steps: gradient steps per search.
      bounds: ``(low, high)`` every input value stays within (numbers or arrays that
        broadcast to one input), e.g. ``(0.0, 1.0)`` for images; None for none.
      max_inputs: the most inputs returned (None: as many as are found).
      key: a `jax.random` key or an int (default 0): it breaks ties between equally
        promising requirements (all of NC's), picks the 8,192 considered when more are
        open and draws the projections that estimate the reach of many neurons.

    Returns:
      A `Generated`, each input checked with the criterion's definition against its seed
      on the values the tracker computes.

    Raises:
      InvalidSpecError: a criterion the tracker does not have or that `generate` does
        not support, bad `eps`, `steps`, `bounds` or `max_inputs`, seeds outside `bounds`
        or without floating-point inputs.
      InputMismatchError: seeds that do not fit the model.

    >>> import jax, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(6), nn.relu, nn.Dense(5), nn.Dense(3)])
    >>> x = jax.random.normal(jax.random.key(0), (8, 3))
    >>> t = js.coverage.Tracker(model, model.init(jax.random.key(1), x), x,
    ...                         criteria=[js.coverage.SignSign()])
    >>> t.update(x)
    >>> found = js.coverage.generate(t, x, "SignSign", eps=0.5)
    >>> bool((found.distances <= 0.5).all())
    True
    """
    if not all(hasattr(tracker, a) for a in ("criteria", "names", "states", "run_layers")):
        raise NotATrackerError(kind=type(tracker).__name__)
    crit_index = _criterion_index(tracker, criterion)
    crit = tracker.criteria[crit_index]
    # (group, n1, n2) not covered yet; a criterion `generate` cannot search for raises here
    requirements = crit.open_requirements(tracker.states[crit_index])
    eps = _positive_number("eps", eps)
    steps = _positive_int("steps", steps)
    if max_inputs is not None:
        max_inputs = _positive_int("max_inputs", max_inputs)
    leaves, treedef, moving = _seed_leaves(tracker, seeds)
    count = tracker.batch_size(seeds)
    low, high = _bounds(bounds, leaves, moving)

    rng = np.random.default_rng(_seed_of(key))
    plan = []
    if requirements and count:
        values, reach = _seed_reach(tracker, leaves, treedef, moving, (eps, low, high), rng)
        plan = _plan(crit, count, requirements, rng, values, reach)

    size = min(_CHUNK, len(plan))  # one compiled search per criterion and layer (pair)
    found_rows: list[tuple[int, tuple[Any, ...], list[np.ndarray]]] = []
    for group in sorted({req[0] for _, req in plan}):
        attempts = [(s, req) for s, req in plan if req[0] == group]
        for start in range(0, len(attempts), _CHUNK):
            chunk = attempts[start : start + _CHUNK]
            found_rows += _search(
                tracker, crit, crit_index, group, chunk, size, leaves, treedef, moving,
                (eps, steps, low, high),
            )  # fmt: skip
    found_rows.sort(key=lambda row: row[0])
    if max_inputs is not None:
        found_rows = found_rows[:max_inputs]
    return _result(tracker, crit, found_rows, leaves, treedef, len(plan))


# --------------------------------------------------------------------------- arguments


def _criterion_index(tracker: Any, criterion: Any) -> int:
    names = tracker.names
    if isinstance(criterion, str):
        picks = [i for i, name in enumerate(names) if name == criterion]
    elif isinstance(criterion, type):
        picks = [i for i, c in enumerate(tracker.criteria) if type(c) is criterion]
    else:  # criteria are values: the tracker's own object, or an equal one
        picks = [i for i, c in enumerate(tracker.criteria) if c == criterion]
    if len(picks) != 1:
        how = "several" if picks else "no"
        raise AmbiguousCriterionError(how=how, criterion=criterion, names=names)
    return picks[0]


def _positive_number(name: str, value: Any) -> float:
    ok = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(value) or value <= 0:
        raise PositiveNumberError(name=name, value=value)
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or value < 1:
        raise PositiveCountError(name=name, value=value)
    return int(value)


def _seed_leaves(tracker: Any, seeds: Any) -> tuple[list[np.ndarray], Any, list[bool]]:
    """The seeds' input leaves as arrays, their treedef, and per leaf whether the search
    moves it (floating-point leaves; there must be one)."""
    leaves, treedef = jax.tree_util.tree_flatten(tracker.inputs(seeds))
    leaves = [np.asarray(x) for x in leaves]
    moving = [bool(jnp.issubdtype(x.dtype, jnp.floating)) for x in leaves]
    if not any(moving):
        raise NoFloatSeedsError(dtypes=", ".join(str(x.dtype) for x in leaves))
    return leaves, treedef, moving


def _bounds(bounds: Any, leaves: list[np.ndarray], moving: list[bool]) -> tuple[Any, Any]:
    """(low, high) as float arrays that broadcast to one input; ±inf without bounds."""
    if bounds is None:
        return np.float32(-np.inf), np.float32(np.inf)
    if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2):
        raise BoundsSpecError(bounds=bounds)
    try:
        low, high = (np.asarray(b, np.float32) for b in bounds)
    except (TypeError, ValueError):  # not numbers
        raise BoundsSpecError(bounds=bounds) from None
    if np.any(np.isnan(low)) or np.any(np.isnan(high)) or np.any(low >= high):
        raise BoundsOrderError(bounds=bounds)
    _check_inside(bounds, low, high, leaves, moving)
    return low, high


def _check_inside(bounds: Any, low: Any, high: Any, leaves: list[Any], moving: list[bool]) -> None:
    """The seeds' moving leaves lie inside `bounds` (which broadcast to them)."""
    for x, move in zip(leaves, moving, strict=True):
        if not move:
            continue
        try:
            inside = (x >= low) & (x <= high)
        except ValueError:
            raise BoundsShapeError(low=low.shape, high=high.shape, shape=x.shape) from None
        if not inside.all():
            raise SeedsOutOfBoundsError(bounds=bounds)


def _seed_of(key: Any) -> Any:
    if key is None:
        return 0
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) % 2**64  # as its 64 bits (NumPy's generators take no negative seed)
    try:
        data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        return [int(v) for v in np.asarray(data).ravel()]
    except (AttributeError, TypeError):
        raise KeySpecError(key=key) from None


def _seed_reach(tracker, leaves, treedef, moving, budget, rng) -> tuple[list[Any], Any]:
    """Per layer, (seeds, neurons) arrays: the neuron values for the seeds and how far
    each can move from each seed inside the budget, to first order: ``(values, (up,
    down))``, the largest rise and the largest fall (<= 0) of its value over the box of
    moves allowed (L∞ `eps`, inside the bounds). Where the tracker observes activations,
    these are of the values before the activation, whose sign the activation keeps and
    whose gradient does not vanish where a ReLU is off.

    For a neuron with gradient J over the box [lo, hi], the rise is J·c + Σ|J|·h and
    the fall J·c - Σ|J|·h (c the box's centre, h its half-widths). For up to `_EXACT`
    neurons both are exact (one backward pass of the seeds per neuron); beyond, J·c is
    one forward-mode product and Σ|J|·h is estimated from `_PROJECTIONS` forward-mode
    products along h·u, u standard Cauchy: each gives every neuron a Cauchy value of
    scale Σ|J|·h, the median of whose magnitude is that scale (within about 20%), at a
    cost that does not grow with the neurons.

    The seeds go `_CHUNK` at a time (the last chunk padded with copies of its last
    seed), so that the memory is that of the search's chunks and the step compiles once
    whatever the number of seeds."""
    eps, low, high = budget
    centres, halves = [], []  # per moving leaf, the centre and half-width of its box
    for x, m in zip(leaves, moving, strict=True):
        if m:
            lo, hi = np.maximum(-eps, low - x), np.minimum(eps, high - x)
            centres.append(((lo + hi) / 2).astype(x.dtype))
            halves.append(((hi - lo) / 2).astype(x.dtype))
    exact = sum(tracker.sizes) <= _EXACT
    seed = int(rng.integers(2**30))  # each chunk's projections: seed + its first row

    def make(layer_outputs: Any) -> Any:
        def step(v, r, x, centres, halves, seed):
            movable, inputs = moving_parts(x, moving)

            def flat(xf: list[Any]) -> Any:
                outs, raws = layer_outputs(v, r, inputs(xf))
                picked = outs if raws is None else raws
                return jnp.concatenate([neurons(o, tracker.granularity) for o in picked], 1)

            def per_seed(parts: list[Any]) -> Any:
                return sum(jnp.sum(t.reshape(len(t), -1), axis=1) for t in parts)

            if exact:
                values, pullback = jax.vjp(flat, movable)

                def along(column: Any) -> tuple[Any, Any]:
                    # Rows are independent inputs: one cotangent gives every seed's gradient.
                    grads = pullback(jnp.broadcast_to(column, values.shape))[0]
                    shift = per_seed([g * c for g, c in zip(grads, centres, strict=True)])
                    width = per_seed([jnp.abs(g) * h for g, h in zip(grads, halves, strict=True)])
                    return shift, width

                eye = jnp.eye(values.shape[1], dtype=values.dtype)
                shift, width = (a.T for a in jax.lax.map(along, eye))
            else:
                values, shift = jax.jvp(flat, (movable,), (centres,))

                def spread(key: Any) -> Any:
                    keys = jax.random.split(key, len(movable))
                    along = [
                        h * jax.random.cauchy(k, h.shape, h.dtype)
                        for k, h in zip(keys, halves, strict=True)
                    ]
                    return jnp.abs(jax.jvp(flat, (movable,), (along,))[1])

                keys = jax.random.split(jax.random.key(seed), _PROJECTIONS)
                width = jnp.median(jax.lax.map(spread, keys), axis=0)
            cut = lambda a: jnp.split(a, np.cumsum(tracker.sizes)[:-1], axis=1)  # noqa: E731
            return cut(values), (cut(shift + width), cut(shift - width))

        return step

    count = len(leaves[0])
    size = min(_CHUNK, count)
    parts = []  # per chunk: (values, (up, down)) without its padding rows
    for start in range(0, count, size):
        rows = np.minimum(np.arange(start, start + size), count - 1)
        batch = jax.tree_util.tree_unflatten(treedef, [x[rows] for x in leaves])
        box = [c[rows] for c in centres], [h[rows] for h in halves], np.int32(seed + start)
        out = tracker.run_layers(("generate-reach", exact), batch, make, *box, before=True)
        parts.append(jax.tree_util.tree_map(lambda a, n=count - start: np.asarray(a)[:n], out))
    return jax.tree_util.tree_map(lambda *chunks: np.concatenate(chunks), *parts)


def _plan(crit, count, requirements, rng, values, reach) -> list[tuple[int, Any]]:
    """(seed, requirement) searches, up to `_TRIES` per seed, the most promising first: a
    requirement whose neurons need the smallest moves from that seed, against how far
    they can move (`_scores`), ties (and NC's requirements) in random order. Each round
    tries a requirement once; with fewer requirements than searches, later rounds try
    them again from other seeds."""
    reqs = np.array(requirements)
    if len(reqs) > _SAMPLED:  # a random subset keeps the (seeds x requirements) table small
        reqs = reqs[rng.choice(len(reqs), _SAMPLED, replace=False)]
    score = _scores(crit, values, reach, reqs, rng)
    best = min(len(reqs), 2 * _TRIES)  # each seed's most promising requirements
    cols = np.argpartition(score, best - 1, axis=1)[:, :best]
    cand = sorted(
        (score[s, r], s, int(r)) for s in range(count) for r in cols[s]
    )  # (score, seed, requirement), the best first
    tries, plan, planned = np.zeros(count, int), [], set()
    while len(plan) < count * _TRIES:
        used, before = set(), len(plan)  # each round tries a requirement once
        for _, s, r in cand:
            if r in used or tries[s] >= _TRIES or (s, r) in planned:
                continue
            used.add(r)
            planned.add((s, r))
            tries[s] += 1
            plan.append((s, tuple(int(v) for v in reqs[r])))
        if len(plan) == before:
            break
    return plan


def _scores(crit, values, reach, reqs, rng) -> np.ndarray:
    """(seeds, requirements), lower is more promising: for each neuron the requirement
    asks to change (`Criterion.moves`), its smallest move over how far it can move that
    way from the seed, to first order within the budget (`_seed_reach`), summed over
    the neurons; a move of 1 or more is out of reach to first order. A little noise
    breaks ties at random."""
    score = rng.uniform(0, 1e-3, size=(len(values[0]), len(reqs)))
    group, picked = reqs[:, 0], (reqs[:, 1], reqs[:, 2])
    for layer in range(crit.span):
        at, n = group + layer, picked[layer]
        for k in np.unique(at):
            cols = np.flatnonzero(at == k)
            moves = crit.moves(values[k][:, n[cols]], layer)
            if not moves:
                continue
            up, down = reach[0][k][:, n[cols]], reach[1][k][:, n[cols]]
            tiny = 1e-6 * (np.mean(np.abs(values[k]), axis=1, keepdims=True) + 1e-6)
            # A move of 0 still needs some room to move; no room at all ranks last.
            far = [(np.abs(m) + tiny) / np.maximum(np.where(m > 0, up, -down), 1e-30)
                   for m in moves]  # fmt: skip
            score[:, cols] += functools.reduce(np.minimum, far)
    return score


# --------------------------------------------------------------------------- search


def _search(tracker, crit, crit_index, group, chunk, size, leaves, treedef, moving, budget):
    """Runs the compiled search for one chunk of (seed, requirement) and returns the
    rows that pass the final check: (seed index, requirement, input leaves)."""
    eps, steps, low, high = budget
    pad = [chunk[0]] * (size - len(chunk))
    rows = np.array([s for s, _ in chunk + pad])
    n1 = np.array([req[1] for _, req in chunk + pad], np.int32)
    n2 = np.array([max(req[2], 0) for _, req in chunk + pad], np.int32)
    seed = [x[rows] for x in leaves]
    batch = jax.tree_util.tree_unflatten(treedef, seed)
    make = make_search(tracker, crit, group, moving)
    run_key = ("generate", crit_index, group)
    limits = (np.float32(eps * (1 - 2**-20)), low, high, steps)
    best, hit = tracker.run_layers(run_key, batch, make, n1, n2, *limits, before=True)
    best = [np.asarray(b) for b in best]
    keep = np.asarray(hit)[: len(chunk)]
    checked = _checked(tracker, crit, group, treedef, seed, best, n1, n2, eps, low, high)
    ok = keep & checked[: len(chunk)]
    return [
        (int(rows[i]), _requirement(tracker, crit, group, n1[i], n2[i]), [b[i] for b in best])
        for i in np.flatnonzero(ok)
    ]


# --------------------------------------------------------------------------- checks


def _checked(tracker, crit, group, treedef, seed, best, n1, n2, eps, low, high) -> np.ndarray:
    """Per row: the requirement holds on the values the tracker computes (seed and input
    in one batch), within the budget and the bounds."""
    both = [np.concatenate([s, b]) for s, b in zip(seed, best, strict=True)]
    batch = jax.tree_util.tree_unflatten(treedef, both)

    def make(layer_outputs: Any) -> Any:
        values = values_of(tracker, layer_outputs, crit, group, False)
        return lambda v, r, x: values(v, r, x)[0]

    now = tracker.run_layers(("generate-check", type(crit).__name__, group), batch, make)
    half = len(n1)
    start = [np.asarray(x)[:half] for x in now]
    found = [np.asarray(x)[half:] for x in now]
    ok = np.array(crit.holds(start, found, jnp.asarray(n1), jnp.asarray(n2)))
    for s, b in zip(seed, best, strict=True):
        if jnp.issubdtype(s.dtype, jnp.floating):
            flat = np.abs(b.astype(np.float64) - s).reshape(len(s), -1)
            ok &= flat.max(axis=1) <= eps
            ok &= ((b >= low) & (b <= high)).reshape(len(s), -1).all(axis=1)
    return ok


def _requirement(tracker: Any, crit: Any, group: int, n1: int, n2: int) -> tuple[Any, ...]:
    """The requirement as `Generated` shows it: the criterion's result key and its neurons."""
    key = crit.keys(tracker.layers)[group]
    return (key, int(n1)) if crit.span == 1 else (key, int(n1), int(n2))


def _result(tracker, crit, rows, leaves, treedef, searches) -> Generated:
    def stack(parts: Sequence[np.ndarray], like: np.ndarray) -> np.ndarray:
        return np.stack(parts) if parts else np.zeros((0,) + like.shape[1:], like.dtype)

    index = np.array([s for s, _, _ in rows], np.int64)
    inputs = [stack([r[2][i] for r in rows], x) for i, x in enumerate(leaves)]
    seeds = [x[index] for x in leaves]
    far = [
        np.abs(a.astype(np.float64) - s).reshape(len(a), -1).max(axis=1, initial=0.0)
        for a, s in zip(inputs, seeds, strict=True)
        if rows
    ]
    distances = np.max(np.stack(far), axis=0) if rows else np.zeros((0,))
    as_given = lambda parts: jax.tree_util.tree_unflatten(treedef, parts)  # noqa: E731
    unwrap = lambda tree: tree[0] if isinstance(tree, tuple) and len(tree) == 1 else tree  # noqa: E731
    return Generated(
        inputs=unwrap(as_given(inputs)),
        seeds=unwrap(as_given(seeds)),
        seed_index=index,
        requirements=[r[1] for r in rows],
        distances=distances,
        attempted=searches,
    )


_compat.register_frames_exclusion(__file__)
