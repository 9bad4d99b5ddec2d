"""`js.ActivationStats`: streaming statistics of boundary outputs, for sparsity studies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _compat
from .._errors import ChoiceError
from .._table import PrintsAsTable
from ._moments import Moments
from ._observer import Observer, Observing, serialised

PER = ("tensor", "channel")
STATS = ("mean", "std", "min", "max", "zero_fraction")


class StatsResult(PrintsAsTable, dict):
    """``{name: {"mean", "std", "min", "max", "zero_fraction", "count"}}``; prints as a
    table (and shows as one in notebooks), one row per boundary, figures to 4 digits.

    With ``per="channel"`` the values are per-channel arrays, and the table sums each
    boundary up over its channels: the mean, zero fraction, min and max of all its
    values, their standard deviation (pooled exactly from the channels'), and the number
    of channels; ``count`` is the number of values per channel.
    """

    def _table_rows(self) -> list[tuple[str, ...]]:
        per_channel = any(np.ndim(s["mean"]) for s in self.values())
        header = ("name", *(k.replace("_", " ") for k in STATS), "count")
        rows = [header + (("channels",) if per_channel else ())]
        return rows + [_row(name, stats, per_channel) for name, stats in self.items()]


def _row(name: str, stats: dict[str, Any], per_channel: bool) -> tuple[str, ...]:
    if not per_channel:
        return (name, *_cells(stats, stats["count"]))
    return (name, *_cells(_over_channels(stats), stats["count"]), f"{np.size(stats['mean']):,}")


def _cells(figures: dict[str, Any], count: float) -> list[str]:
    return [f"{figures[k]:.4g}" for k in STATS] + [f"{int(count):,}"]


def _over_channels(stats: dict[str, Any]) -> dict[str, float]:
    """A boundary's figures over all its channels (each channel has the same count)."""
    means = np.asarray(stats["mean"], np.float64)
    mean = means.mean()
    variance = np.mean(np.asarray(stats["std"], np.float64) ** 2 + (means - mean) ** 2)
    return {
        "mean": float(mean),
        "std": float(np.sqrt(variance)),
        "min": float(np.min(stats["min"])),
        "max": float(np.max(stats["max"])),
        "zero_fraction": float(np.mean(stats["zero_fraction"])),
    }


class ActivationStats(Observing):
    """Mean, std, min, max and fraction of exact zeros of chosen boundaries' outputs.

    Statistics stream over batches in one compiled call per batch shape and merge
    exactly (Chan et al.), so two batches give the same result as their concatenation.

    Args:
      target, *args, **kwargs: the model and sample inputs, as for `js.slice`.
      names: boundaries to observe (default: every module with parameters of its own
        outside loops whose output is batched like the inputs); a layer returning
        several arrays is observed at its first.
      per: ``"tensor"`` (one figure per boundary, over all elements) or ``"channel"``
        (one per channel of the last axis).
      position: ``"output"``, or ``"activation"`` for the activation applied to it.

    A copy (`copy.copy` or `copy.deepcopy`) observes the same model with its own copy of
    the statistics so far; it cannot be pickled (its `result()` can).

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(4)])
    >>> x = jax.random.normal(jax.random.key(0), (16, 3))
    >>> stats = js.ActivationStats(model, model.init(jax.random.key(1), x), x, position="activation")
    >>> stats.update(x)
    >>> 0.0 <= stats.result()["layers_0"]["zero_fraction"] <= 1.0
    True
    """

    STATE = ("_acc",)

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
            raise ChoiceError(option="per", choices=PER, value=per)
        self.per = per
        self._observer = Observer(target, args, kwargs, names, position)
        self.names = self._observer.layers
        self.reset()

    @serialised
    def reset(self) -> None:
        # per channel: the last axis, or one channel where there is none but the batch
        shape = lambda s: () if self.per == "tensor" else (s[-1] if len(s) > 1 else 1,)  # noqa: E731
        self._acc = [Moments.empty(shape(s)) for s in self._observer.shapes]

    @serialised
    def update(self, batch: Any) -> None:
        """Adds a batch (an array, or a tuple of the model's inputs); an empty one adds
        nothing."""
        if self._observer.batch_size(batch) == 0:
            return
        self._acc = self._observer.run(0, batch, self._step, self._acc)

    def _step(self, outputs: Any) -> Any:
        per = self.per

        def step(v: Any, r: Any, x: Any, acc: list[Moments]) -> list[Moments]:
            outs = outputs(v, r, x)
            flat = [
                o.reshape(-1)
                if per == "tensor"
                else o.reshape(-1, o.shape[-1] if o.ndim > 1 else 1)
                for o in outs
            ]
            return [m.merge(Moments.of(f)) for m, f in zip(acc, flat, strict=True)]

        return step

    @serialised
    def result(self) -> StatsResult:
        """``{name: {"mean", "std", "min", "max", "zero_fraction", "count"}}`` (a dict that
        prints as a table); with ``per="channel"`` the values are NumPy arrays."""
        out = StatsResult()
        # On the host: a few small arrays, where eager JAX would compile each operation.
        conv = float if self.per == "tensor" else (lambda a: a)
        for name, acc in zip(self.names, self._acc, strict=True):
            m = Moments(*(np.asarray(a, np.float32) for a in acc))
            count = float(m.count)
            out[name] = {
                "mean": conv(m.mean),
                "std": conv(np.sqrt(m.m2 / m.count) if count else np.zeros_like(m.m2)),
                "min": conv(m.low),
                "max": conv(m.high),
                "zero_fraction": conv(m.zeros / m.count if count else np.zeros_like(m.zeros)),
                "count": count,
            }
        return out


_compat.register_frames_exclusion(__file__)
