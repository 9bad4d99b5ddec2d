"""The compiled search of `js.coverage.generate`: one program per criterion and layer
(pair) that moves a chunk of inputs by projected signed-gradient steps on hinge losses
until each covers its requirement with its seed.

The losses read the neuron values the tracker observes: flip n1 and keep every other
sign of layer k (or keep them all and change n1's value by the ratio), flip or change
the value of n2; NC raises the neuron's scaled value past the threshold. Where the
observed value is an activation whose gradient vanishes (a ReLU that is off), they also
read the layer's output before the activation. A row stops moving once it covers its
requirement, by the criterion's own definition (`holds`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat
from ..observe import neurons, scaled
from ._criteria import NC, SIGN, PairCriterion


def values_of(tracker: Any, outputs: Any, crit: Any, group: int, pre: bool) -> Any:
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


def make_search(tracker: Any, crit: Any, group: int, moving: list[bool], pre: bool) -> Any:
    def make(outputs: Any) -> Any:
        values = values_of(tracker, outputs, crit, group, pre)

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
                return holds(crit, start, now, n1, n2)

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


def holds(crit: Any, start: list[Any], now: list[Any], n1: Any, n2: Any) -> Any:
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


_compat.register_frames_exclusion(__file__)
