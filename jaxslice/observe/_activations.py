"""`js.ActivationStats`: streaming statistics of boundary outputs, for sparsity studies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from .. import _compat
from .._errors import InvalidSpecError
from ._moments import Moments
from ._observer import Observer

PER = ("tensor", "channel")


class ActivationStats:
    """Mean, std, min, max and fraction of exact zeros of chosen boundaries' outputs.

    Statistics stream over batches in one compiled call per batch shape and merge
    exactly (Chan et al.), so two batches give the same result as their concatenation.

    Args:
      target, *args, **kwargs: the model and sample inputs, as for `js.slice`.
      names: boundaries to observe (default: every module with parameters of its own).
      per: ``"tensor"`` (one figure per boundary, over all elements) or ``"channel"``
        (one per channel of the last axis).
      position: ``"output"``, or ``"activation"`` for the activation applied to it.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])
    >>> x = jax.random.normal(jax.random.key(0), (16, 3))
    >>> stats = js.ActivationStats(model, model.init(jax.random.key(1), x), x, position="activation")
    >>> stats.update(x)
    >>> 0.0 <= stats.result()["layers_0"]["zero_fraction"] <= 1.0
    True
    """

    def __init__(
        self,
        target: Any,
        *args: Any,
        names: Sequence[str] | None = None,
        per: str = "tensor",
        position: str = "output",
        **kwargs: Any,
    ):
        if per not in PER:
            raise InvalidSpecError(f"per must be one of {PER}, got {per!r}.")
        self.per = per
        self._observer = Observer(target, args, kwargs, names, position)
        self.names = self._observer.layers
        self.reset()

    def reset(self) -> None:
        shape = lambda s: () if self.per == "tensor" else (s[-1] if s else 1,)  # noqa: E731
        self._acc = [Moments.empty(shape(s)) for s in self._observer.shapes]

    def update(self, batch: Any) -> None:
        """Adds a batch (an array, or a tuple of the model's inputs)."""
        self._acc = self._observer.run(0, batch, self._step, self._acc)

    def _step(self, outputs: Any) -> Any:
        per = self.per

        def step(v: Any, r: Any, x: Any, acc: list[Moments]) -> list[Moments]:
            outs = outputs(v, r, x)
            flat = [
                o.reshape(-1) if per == "tensor" else o.reshape(-1, o.shape[-1] if o.ndim else 1)
                for o in outs
            ]
            return [m.merge(Moments.of(f)) for m, f in zip(acc, flat, strict=True)]

        return step

    def result(self) -> dict[str, dict[str, Any]]:
        """``{name: {"mean", "std", "min", "max", "zero_fraction", "count"}}``."""
        out = {}
        for name, m in zip(self.names, self._acc, strict=True):
            count = float(m.count)
            conv = float if self.per == "tensor" else (lambda a: a)
            out[name] = {
                "mean": conv(m.mean),
                "std": conv(m.std),
                "min": conv(m.low),
                "max": conv(m.high),
                "zero_fraction": conv(m.zeros / count) if count else conv(jnp.zeros_like(m.zeros)),
                "count": count,
            }
        return out


_compat.register_frames_exclusion(__file__)
