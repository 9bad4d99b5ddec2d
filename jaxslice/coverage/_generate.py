"""`js.coverage.generate`: inputs near seeds that cover what a tracker has not seen covered.

For each seed, one requirement the tracker has not seen covered is picked (a pair
(n1, n2) of adjacent layers for the Sun et al. criteria, a neuron for NC). A projected
gradient search then looks for an input within L∞ distance `eps` of the seed (and inside
`bounds`) that, together with the seed, covers it. The losses are hinges on the neuron
values the tracker observes: flip n1 and keep every other sign of layer k (or keep them
all and change n1's value by the ratio), and flip or change the value of n2; NC raises
the neuron's scaled value past the threshold. Where the observed value is an activation
whose gradient vanishes (a ReLU that is off), the loss also reads the layer's output
before the activation, so the search can turn it on.

One program per criterion and layer (pair) runs every step for a chunk of seeds at once
(`jax.lax.fori_loop` inside one `jax.jit`); each row stops moving once it covers its
requirement. Every input is then checked once more with the criterion's own definition,
on the values the tracker itself computes, before it is returned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._errors import InvalidSpecError
from ..observe import Observer, neurons, scaled
from ._criteria import NC, SIGN, Criterion, PairCriterion

_CHUNK = 64  # searches per run of the compiled search
_TRIES = 4  # searches per seed, each for another requirement
_SAMPLED = 8192  # the most requirements considered per call


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

    Each seed gets up to four uncovered requirements of `criterion`, the ones whose sign
    changes need the smallest moves from it first (a requirement is tried from several
    seeds only once every one has been tried), and for each a projected gradient search of `steps` signed steps of size ``2.5 * eps / steps`` from the seed, kept
    within L∞ distance `eps` of it and inside `bounds`. A pair requirement is covered by
    the pair (seed, new input), so the seeds should be inputs the tracker has seen:
    ``tracker.update(result.inputs)`` then raises its coverage.

    Args:
      tracker: a `js.coverage.Tracker`.
      seeds: a batch of the model's inputs, as for `tracker.update`.
      criterion: one of the tracker's criteria (the object, its result name, or its
        class): `NC`, `SignSign`, `ValueSign`, `SignValue` or `ValueValue`.
      eps: the L∞ budget, a positive number.
      steps: gradient steps per search.
      bounds: ``(low, high)`` every input value stays within (numbers or arrays that
        broadcast to one input), e.g. ``(0.0, 1.0)`` for images; None for none.
      max_inputs: the most inputs returned (None: as many as are found).
      key: a `jax.random` key or an int, for picking requirements (default 0).

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
    crit_index = _criterion_index(tracker, criterion)
    crit = tracker.criteria[crit_index]
    eps = _positive_number("eps", eps)
    steps = _positive_int("steps", steps)
    if max_inputs is not None:
        max_inputs = _positive_int("max_inputs", max_inputs)
    observer = _observer(tracker)
    args = tracker._observer._inputs(seeds)
    count = tracker._observer.batch_size(seeds)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    leaves = [np.asarray(x) for x in leaves]
    moving = [bool(jnp.issubdtype(x.dtype, jnp.floating)) for x in leaves]
    if not any(moving):
        raise InvalidSpecError(
            "`generate` moves floating-point inputs, and the seeds have none "
            f"({', '.join(str(x.dtype) for x in leaves)})."
        )
    low, high = _bounds(bounds, leaves, moving)

    requirements = _uncovered(tracker, crit_index)
    rng = np.random.default_rng(_seed_of(key))
    plan = _plan(tracker, crit, seeds, count, requirements, rng) if requirements else []

    size = min(_CHUNK, len(plan))  # one compiled search per criterion and layer (pair)
    found_rows: list[tuple[int, tuple[Any, ...], list[np.ndarray]]] = []
    for group in sorted({req[0] for _, req in plan}):
        attempts = [(s, req) for s, req in plan if req[0] == group]
        for start in range(0, len(attempts), _CHUNK):
            chunk = attempts[start : start + _CHUNK]
            found_rows += _search(
                tracker, observer, crit, crit_index, group, chunk, size, leaves, treedef,
                moving, (eps, steps, low, high),
            )  # fmt: skip
    found_rows.sort(key=lambda row: row[0])
    if max_inputs is not None:
        found_rows = found_rows[:max_inputs]
    return _result(tracker, crit, found_rows, leaves, treedef, len(plan))


# --------------------------------------------------------------------------- arguments


def _criterion_index(tracker: Any, criterion: Any) -> int:
    names = tracker._names
    if isinstance(criterion, str):
        picks = [i for i, name in enumerate(names) if name == criterion]
    elif isinstance(criterion, type):
        picks = [i for i, c in enumerate(tracker.criteria) if type(c) is criterion]
    else:
        picks = [i for i, c in enumerate(tracker.criteria) if c is criterion]
    if len(picks) != 1:
        how = "several" if picks else "no"
        raise InvalidSpecError(
            f"The tracker has {how} criteria matching {criterion!r}; name one of {names} "
            "(or pass the criterion object)."
        )
    crit = tracker.criteria[picks[0]]
    if not isinstance(crit, (NC, PairCriterion)):
        raise InvalidSpecError(
            f"`generate` searches inputs for NC, SignSign, ValueSign, SignValue and "
            f"ValueValue, not {crit.name}."
        )
    return picks[0]


def _positive_number(name: str, value: Any) -> float:
    ok = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(value) or value <= 0:
        raise InvalidSpecError(f"`{name}` must be a positive finite number, got {value!r}.")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok or value < 1:
        raise InvalidSpecError(f"`{name}` must be a positive integer, got {value!r}.")
    return int(value)


def _bounds(bounds: Any, leaves: list[np.ndarray], moving: list[bool]) -> tuple[Any, Any]:
    """(low, high) as float arrays that broadcast to one input; ±inf without bounds."""
    if bounds is None:
        return np.float32(-np.inf), np.float32(np.inf)
    if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2):
        raise InvalidSpecError(f"`bounds` must be (low, high) or None, got {bounds!r}.")
    low, high = (np.asarray(b, np.float32) for b in bounds)
    if np.any(np.isnan(low)) or np.any(np.isnan(high)) or np.any(low >= high):
        raise InvalidSpecError(f"`bounds` must have low < high everywhere, got {bounds!r}.")
    for x, move in zip(leaves, moving, strict=True):
        if not move:
            continue
        try:
            inside = (x >= low) & (x <= high)
        except ValueError:
            raise InvalidSpecError(
                f"`bounds` of shapes {low.shape} and {high.shape} do not broadcast to the "
                f"seeds' shape {x.shape}."
            ) from None
        if not inside.all():
            raise InvalidSpecError(
                f"Some seeds lie outside `bounds` {bounds!r}; clip them first, e.g. "
                "np.clip(seeds, low, high)."
            )
    return low, high


def _seed_of(key: Any) -> Any:
    if key is None:
        return 0
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key)
    try:
        data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        return [int(v) for v in np.asarray(data).ravel()]
    except (AttributeError, TypeError):
        raise InvalidSpecError(f"`key` must be a jax.random key or an int, got {key!r}.") from None


def _observer(tracker: Any) -> Observer:
    """An observer of the tracker's layers that, for activations, also gives the outputs
    before them (made once per tracker)."""
    if tracker.position == "output":
        return tracker._observer
    if getattr(tracker, "_search_observer", None) is None:
        target, args, kwargs, layers = tracker._source
        tracker._search_observer = Observer(
            target, args, kwargs, layers, tracker.position, also_outputs=True
        )
    return tracker._search_observer


def _uncovered(tracker: Any, crit_index: int) -> list[tuple[int, int, int]]:
    """(group, n1, n2) of every requirement not covered yet (n2 = -1 for NC), where a
    group is a layer pair (pair criteria) or a layer (NC)."""
    crit, state = tracker.criteria[crit_index], tracker._state[crit_index]
    flags = state[0] if isinstance(crit, PairCriterion) else state
    out = []
    for group, covered in enumerate(flags):
        for idx in np.argwhere(~np.asarray(covered)):
            out.append((group, int(idx[0]), int(idx[1]) if idx.size > 1 else -1))
    return out


def _seed_values(tracker: Any, seeds: Any) -> list[np.ndarray]:
    """The neuron values of every layer for the seeds, as the tracker computes them
    (before NC's scaling)."""

    def make(outputs: Any) -> Any:
        layer_outputs = tracker._layer_outputs(outputs)
        return lambda v, r, x: [neurons(o, tracker.granularity) for o in layer_outputs(v, r, x)]

    return [np.asarray(v) for v in tracker._observer.run(("generate-values",), seeds, make)]


def _plan(tracker, crit, seeds, count, requirements, rng) -> list[tuple[int, Any]]:
    """(seed, requirement) searches, up to `_TRIES` per seed, the most promising first: a
    requirement whose sign changes need the smallest moves from that seed (a neuron
    near 0, relative to its layer's values), ties (and NC's requirements) in random
    order. Each round tries a requirement once; with fewer requirements than searches,
    later rounds try them again from other seeds."""
    reqs = np.array(requirements)
    if len(reqs) > _SAMPLED:  # a random subset keeps the (seeds x requirements) table small
        reqs = reqs[rng.choice(len(reqs), _SAMPLED, replace=False)]
    score = _scores(crit, _seed_values(tracker, seeds), reqs, rng)
    best = min(len(reqs), 4 * _TRIES)  # each seed's most promising requirements
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


def _scores(crit: Any, values: list[np.ndarray], reqs: np.ndarray, rng: Any) -> np.ndarray:
    """(seeds, requirements): how far, relative to its layer's values, each neuron that
    must change sign is from 0 for each seed, summed (lower is more promising), plus a
    little noise that breaks ties at random."""
    score = rng.uniform(0, 1e-3, size=(len(values[0]), len(reqs)))
    scale = [np.mean(np.abs(v), axis=1, keepdims=True) + 1e-6 for v in values]
    group, n1, n2 = reqs[:, 0], reqs[:, 1], reqs[:, 2]
    for layer, kind, n in ((0, "first", n1), (1, "second", n2)):
        if isinstance(crit, NC) or getattr(crit, kind) != SIGN:
            continue
        at = group + layer
        for k in np.unique(at):
            cols = np.flatnonzero(at == k)
            score[:, cols] += np.abs(values[k][:, n[cols]]) / scale[k]
    return score


# --------------------------------------------------------------------------- search


def _search(
    tracker, observer, crit, crit_index, group, chunk, size, leaves, treedef, moving, budget
):
    """Runs the compiled search for one chunk of (seed, requirement) and returns the
    rows that pass the final check: (seed index, requirement, input leaves)."""
    eps, steps, low, high = budget
    pad = [chunk[0]] * (size - len(chunk))
    rows = np.array([s for s, _ in chunk + pad])
    n1 = np.array([req[1] for _, req in chunk + pad], np.int32)
    n2 = np.array([max(req[2], 0) for _, req in chunk + pad], np.int32)
    seed = [x[rows] for x in leaves]
    batch = jax.tree_util.tree_unflatten(treedef, seed)
    make = _make_search(tracker, crit, group, moving, observer is not tracker._observer)
    run_key = ("generate", crit_index, group)
    best, hit = observer.run(
        run_key, batch, make, n1, n2, np.float32(eps * (1 - 2**-20)), low, high, steps
    )
    best = [np.asarray(b) for b in best]
    keep = np.asarray(hit)[: len(chunk)]
    checked = _checked(tracker, crit, group, treedef, seed, best, n1, n2, eps, low, high)
    ok = keep & checked[: len(chunk)]
    return [
        (int(rows[i]), _requirement(tracker, crit, group, n1[i], n2[i]), [b[i] for b in best])
        for i in np.flatnonzero(ok)
    ]


def _values_of(tracker: Any, outputs: Any, crit: Any, group: int, pre: bool) -> Any:
    """A function of (v, r, x) giving the neuron values of the group's layers (values a
    criterion reads, and, with `pre`, the values before the activation)."""
    rows = tracker._rows
    layers = [group, group + 1] if isinstance(crit, PairCriterion) else [group]
    observed = len(tracker._observer.layers)
    granularity = tracker.granularity
    reduce = (lambda o: neurons(scaled(o), granularity)) if isinstance(crit, NC) else None

    def values(v: Any, r: Any, x: Any) -> tuple[list[Any], list[Any]]:
        outs = outputs(v, r, x)
        picked, before = [], []
        for k in layers:
            _, i, row = rows[k]
            act = outs[i][row] if row else outs[i]
            picked.append(reduce(act) if reduce else neurons(act, granularity))
            if pre:  # the layer's output before its activation
                raw = outs[observed + i][row] if row else outs[observed + i]
                before.append(neurons(raw, granularity))
            else:
                before.append(picked[-1])
        return picked, before

    return values


def _make_search(tracker: Any, crit: Any, group: int, moving: list[bool], pre: bool) -> Any:
    def make(outputs: Any) -> Any:
        values = _values_of(tracker, outputs, crit, group, pre)

        def step(v, r, x0, n1, n2, eps, low, high, steps):
            start, _ = values(v, r, x0)
            movable = [x for x, m in zip(x0, moving, strict=True) if m]

            def inputs(xf: list[Any]) -> list[Any]:
                it = iter(xf)
                return [next(it) if m else x for x, m in zip(x0, moving, strict=True)]

            def loss(xf: list[Any]) -> tuple[Any, Any]:
                now, before = values(v, r, inputs(xf))
                return jnp.sum(_loss(crit, start, now, before, n1, n2)), now

            def covers(now: list[Any]) -> Any:
                return _holds(crit, start, now, n1, n2)

            size = 2.5 * eps / steps

            def body(_, carry):
                xf, best, done = carry
                (_, now), grads = jax.value_and_grad(loss, has_aux=True)(xf)
                new = ~done & covers(now)
                best = [_where(new, x, b) for x, b in zip(xf, best, strict=True)]
                done = done | new
                moved = [
                    _project(x - size * jnp.sign(g), x_0, eps, low, high)
                    for x, g, x_0 in zip(xf, grads, movable, strict=True)
                ]
                xf = [_where(done, x, m) for x, m in zip(xf, moved, strict=True)]
                return xf, best, done

            done = jnp.zeros(n1.shape, bool)
            xf, best, done = jax.lax.fori_loop(0, steps, body, (movable, movable, done))
            _, now = loss(xf)
            new = ~done & covers(now)
            best = [_where(new, x, b) for x, b in zip(xf, best, strict=True)]
            return inputs(best), done | new

        return step

    return make


def _where(mask: Any, a: Any, b: Any) -> Any:
    return jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)


def _project(x: Any, x0: Any, eps: Any, low: Any, high: Any) -> Any:
    return jnp.clip(jnp.clip(x, x0 - eps, x0 + eps), low, high)


def _pick(values: Any, n: Any) -> Any:
    return jnp.take_along_axis(values, n[:, None], axis=1)[:, 0]


def _holds(crit: Any, start: list[Any], now: list[Any], n1: Any, n2: Any) -> Any:
    """Per row: whether (seed, input) cover the row's requirement, by the criterion's
    own definition."""
    if isinstance(crit, NC):
        return _pick(now[0], n1) > crit.threshold
    return crit.covers(start[0], now[0], start[1], now[1], n1, n2)


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


def _loss(crit: Any, start: list[Any], now: list[Any], before: list[Any], n1: Any, n2: Any) -> Any:
    """Per row: a hinge loss that is zero (up to margins) where the requirement holds."""
    scale = [jnp.mean(jnp.abs(s), axis=1, keepdims=True) + 1e-6 for s in start]
    if isinstance(crit, NC):
        return jax.nn.relu(crit.threshold + 0.02 - _pick(now[0], n1))
    (a0, b0), (a, b), (pa, pb) = start, now, before
    m1, m2 = 0.02 * scale[0], 0.02 * scale[1]
    target = jax.nn.one_hot(n1, a0.shape[1], dtype=bool)
    active = a0 > 0
    if crit.first == SIGN:
        active = jnp.where(target, ~active, active)  # flip n1, keep the rest
    first = jnp.sum(_sign_loss(a, pa, active, m1), axis=1) / scale[0][:, 0]
    if crit.first != SIGN:
        change = _value_loss(_pick(a, n1), _pick(a0, n1), crit.ratio, m1[:, 0])
        first = first + change / scale[0][:, 0]
    b_n, b0_n, pb_n = _pick(b, n2), _pick(b0, n2), _pick(pb, n2)
    if crit.second == SIGN:
        second = _sign_loss(b_n, pb_n, ~(b0_n > 0), m2[:, 0])
    else:
        second = _value_loss(b_n, b0_n, crit.ratio, m2[:, 0])
    return first + second / scale[1][:, 0]


# --------------------------------------------------------------------------- checks


def _checked(tracker, crit, group, treedef, seed, best, n1, n2, eps, low, high) -> np.ndarray:
    """Per row: the requirement holds on the values the tracker computes (seed and input
    in one batch), within the budget and the bounds."""
    both = [np.concatenate([s, b]) for s, b in zip(seed, best, strict=True)]
    batch = jax.tree_util.tree_unflatten(treedef, both)

    def make(outputs: Any) -> Any:
        values = _values_of(tracker, outputs, crit, group, False)
        return lambda v, r, x: values(v, r, x)[0]

    now = tracker._observer.run(("generate-check", type(crit).__name__, group), batch, make)
    half = len(n1)
    start = [np.asarray(x)[:half] for x in now]
    found = [np.asarray(x)[half:] for x in now]
    ok = np.array(_holds(crit, start, found, jnp.asarray(n1), jnp.asarray(n2)))
    for s, b in zip(seed, best, strict=True):
        if jnp.issubdtype(s.dtype, jnp.floating):
            flat = np.abs(b.astype(np.float64) - s).reshape(len(s), -1)
            ok &= flat.max(axis=1) <= eps
            ok &= ((b >= low) & (b <= high)).reshape(len(s), -1).all(axis=1)
    return ok


def _requirement(tracker: Any, crit: Any, group: int, n1: int, n2: int) -> tuple[Any, ...]:
    if isinstance(crit, NC):
        return (tracker.layers[group], int(n1))
    return (f"{tracker.layers[group]} -> {tracker.layers[group + 1]}", int(n1), int(n2))


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
