"""The compiled search of `js.coverage.generate`: one program per criterion and layer
(pair) that moves a chunk of inputs by projected signed-gradient steps on the
criterion's search loss until each covers its requirement with its seed.

The loss reads the neuron values the tracker observes over the requirement's layers
(`Criterion.span` of them from its group on); where the observed value is an activation
whose gradient vanishes (a ReLU that is off), it also reads the layer's output before
the activation. A row stops moving once it covers its requirement, by the criterion's
own definition (`Criterion.holds`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat
from ..observe import neurons, scaled


def values_of(tracker: Any, layer_outputs: Any, crit: Any, group: int, before: bool) -> Any:
    """A function of (v, r, x) giving the neuron values of the group's layers that the
    criterion reads, and the values before the activation (the same values where the
    tracker observes layer outputs, or without `before`). `layer_outputs` is what
    `Tracker.run_layers` hands its step, run with the same `before`."""
    layers = range(group, group + crit.span)
    granularity = tracker.granularity

    def reduce(out: Any) -> Any:
        return neurons(scaled(out) if crit.needs_scaled else out, granularity)

    def values(v: Any, r: Any, x: Any) -> tuple[list[Any], list[Any]]:
        outs, raws = layer_outputs(v, r, x) if before else (layer_outputs(v, r, x), None)
        picked = [reduce(outs[k]) for k in layers]
        if raws is None:
            return picked, picked
        return picked, [neurons(raws[k], granularity) for k in layers]

    return values


def moving_parts(x: Any, moving: list[bool]) -> tuple[list[Any], Any]:
    """The input leaves `x` the search moves (`moving` marks them), and a function that
    puts moved ones back among the others, as the model's inputs."""
    movable = [a for a, m in zip(x, moving, strict=True) if m]

    def rejoin(moved: list[Any]) -> list[Any]:
        it = iter(moved)
        return [next(it) if m else a for a, m in zip(x, moving, strict=True)]

    return movable, rejoin


def make_search(tracker: Any, crit: Any, group: int, moving: list[bool]) -> Any:
    """The `make_step` of the search for `Tracker.run_layers` (with ``before=True``)."""

    def make(layer_outputs: Any) -> Any:
        values = values_of(tracker, layer_outputs, crit, group, True)

        def step(v, r, x0, n1, n2, eps, low, high, steps):
            start, _ = values(v, r, x0)
            movable, inputs = moving_parts(x0, moving)

            def loss(xf: list[Any]) -> tuple[Any, Any]:
                now, before = values(v, r, inputs(xf))
                return jnp.sum(crit.search_loss(start, now, before, n1, n2)), now

            def body(i, carry):
                xf, best, done = carry
                (_, now), grads = jax.value_and_grad(loss, has_aux=True)(xf)
                new = ~done & crit.holds(start, now, n1, n2)
                best = [_where(new, x, b) for x, b in zip(xf, best, strict=True)]
                done = done | new
                # Long steps first, then short ones: 5·eps/steps falling to eps/(5·steps).
                size = eps / steps * (5 * (1 - i / steps) + 0.2)
                moved = [
                    _project(x - size * jnp.sign(g), x_0, eps, low, high)
                    for x, g, x_0 in zip(xf, grads, movable, strict=True)
                ]
                xf = [_where(done, x, m) for x, m in zip(xf, moved, strict=True)]
                return xf, best, done

            done = jnp.zeros(n1.shape, bool)
            xf, best, done = jax.lax.fori_loop(0, steps, body, (movable, movable, done))
            _, now = loss(xf)
            new = ~done & crit.holds(start, now, n1, n2)
            best = [_where(new, x, b) for x, b in zip(xf, best, strict=True)]
            return inputs(best), done | new

        return step

    return make


def _where(mask: Any, a: Any, b: Any) -> Any:
    return jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)


def _project(x: Any, x0: Any, eps: Any, low: Any, high: Any) -> Any:
    return jnp.clip(jnp.clip(x, x0 - eps, x0 + eps), low, high)


_compat.register_frames_exclusion(__file__)
