"""Streaming statistics that merge exactly across batches.

Moments are kept as (count, mean, M2) and merged with Chan et al.'s parallel update, so
updating with two batches equals updating with their concatenation (up to rounding) and
the order of batches does not matter. Minima, maxima and counts of zeros merge exactly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np


class Moments(NamedTuple):
    count: Any  # scalar: number of samples merged
    mean: Any
    m2: Any  # sum of squared deviations from the mean
    low: Any
    high: Any
    zeros: Any  # number of samples exactly equal to 0

    @staticmethod
    def empty(shape: tuple[int, ...]) -> Moments:
        # Host arrays: an eager `jnp.zeros` compiles once per shape, and a compiled step
        # takes these as they are.
        return Moments(
            np.zeros((), np.float32),
            np.zeros(shape, np.float32),
            np.zeros(shape, np.float32),
            np.full(shape, np.inf, np.float32),
            np.full(shape, -np.inf, np.float32),
            np.zeros(shape, np.float32),
        )

    @staticmethod
    def of(samples: Any, valid: Any = None) -> Moments:
        """Moments of `samples` over axis 0; with `valid`, a (rows,) mask, of the rows it
        marks (the others pad a batch to a compiled size and count for nothing)."""
        x = samples.astype(jnp.float32)
        if valid is None:
            n = jnp.asarray(x.shape[0], jnp.float32)
            mean = jnp.mean(x, axis=0)
            return Moments(
                n,
                mean,
                jnp.sum((x - mean) ** 2, axis=0),
                jnp.min(x, axis=0),
                jnp.max(x, axis=0),
                jnp.sum(x == 0, axis=0).astype(jnp.float32),
            )
        keep = valid.reshape((-1,) + (1,) * (x.ndim - 1))
        n = jnp.sum(valid, dtype=jnp.float32)
        mean = jnp.sum(jnp.where(keep, x, 0.0), axis=0) / jnp.maximum(n, 1.0)
        return Moments(
            n,
            mean,
            jnp.sum(jnp.where(keep, x - mean, 0.0) ** 2, axis=0),
            jnp.min(jnp.where(keep, x, jnp.inf), axis=0),
            jnp.max(jnp.where(keep, x, -jnp.inf), axis=0),
            jnp.sum((x == 0) & keep, axis=0).astype(jnp.float32),
        )

    def merge(self, other: Moments) -> Moments:
        n = self.count + other.count
        safe = jnp.where(n > 0, n, 1.0)
        delta = other.mean - self.mean
        mean = self.mean + delta * other.count / safe
        # (0 where either side is empty: a huge mean squared would overflow, and inf · 0
        # is NaN)
        both = (self.count > 0) & (other.count > 0)
        m2 = self.m2 + other.m2 + jnp.where(both, delta**2 * self.count * other.count / safe, 0.0)
        return Moments(
            n,
            mean,
            m2,
            jnp.minimum(self.low, other.low),
            jnp.maximum(self.high, other.high),
            self.zeros + other.zeros,
        )

    @property
    def std(self) -> Any:
        return jnp.sqrt(self.m2 / jnp.where(self.count > 0, self.count, 1.0))
