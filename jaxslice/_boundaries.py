"""`js.boundaries`: the module calls of a model, as a printable table."""

from __future__ import annotations

from typing import Any

from . import _compat
from ._core.trace import trace
from ._table import BoundaryTable, describe
from .adapters import adapter_for


def boundaries(target: Any, *args: Any, **kwargs: Any) -> BoundaryTable:
    """Every module call of a model, in the order the calls run.

    Args:
      target, *args, **kwargs: as for `js.slice` (``model, variables, *inputs`` for linen,
        ``fn, params, *inputs`` for plain functions).

    Returns:
      A `BoundaryTable` (a list of `Boundary`); ``print`` it for a table of names, module
      types, call indices, input/output shapes and dtypes and parameter counts.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> print(js.boundaries(model, variables, jnp.ones((1, 3))))
    name      type   call  inputs         outputs        params
    --------  -----  ----  -------------  -------------  ------
    layers_0  Dense  0/1   float32[1, 3]  float32[1, 8]  32
    layers_2  Dense  0/1   float32[1, 8]  float32[1, 2]  18
    """
    return describe(trace(target, args, kwargs, adapter=adapter_for(target)))


_compat.register_frames_exclusion(__file__)
