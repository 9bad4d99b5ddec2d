"""`js.intermediates`: values at chosen boundaries from one compiled call.

It is a slice from the model's inputs to a dict of ends, so only what the requested values
need is computed (nothing past the last one), and its compiled programs are kept per
model, names and mode in a small cache, re-traced per input shape like `jax.jit`.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

from . import _compat, _trace
from ._errors import InvalidSpecError
from ._sliced import Sliced

_CACHE: collections.OrderedDict[Any, tuple[Any, Any]] = collections.OrderedDict()
# Entries keep compiled programs and abstract shapes, not the model's variables (linen and
# plain functions); an NNX entry holds its model, so the cache stays small.
_CACHE_SIZE = 8


def _cache_key(target: Any, names: Any, kwargs: dict[str, Any]) -> Any:
    try:
        mode = tuple(sorted((k, v) for k, v in kwargs.items() if k != "rngs"))
        hash(mode)
    except TypeError:
        return None
    return id(target), tuple(names) if names is not None else None, mode, "rngs" in kwargs


def intermediates(target: Any, *args: Any, names: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Values at the named boundaries, from one compiled call of the model.

    Args:
      target, *args, **kwargs: as for `js.slice` (``model, variables, *inputs`` for linen,
        ``fn, params, *inputs`` for plain functions, ``model, *inputs`` for NNX).
      names: boundary names (``name``, ``name@k``, ``name:input``); None for the output of
        every module call outside loops.

    Returns:
      ``{name: value}`` in the order of `names` (or of the calls).

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> feats = js.intermediates(model, variables, jnp.ones((5, 3)), names=["layers_0"])
    >>> feats["layers_0"].shape
    (5, 8)
    """
    if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
        raise InvalidSpecError(f"`names` must be a list of boundary names or None, got {names!r}.")
    key = _cache_key(target, names, kwargs)
    hit = _CACHE.get(key) if key is not None else None
    if hit is not None and hit[0]() is target:
        engine = hit[1]
        _CACHE.move_to_end(key)
    else:
        traced = _trace.trace(
            target, args, kwargs, stop_at=list(names) if names is not None else None
        )
        if names is None:
            names = [c.qualname for c in traced.graph.calls if c.loop is None]
        engine = Sliced(traced, None, {n: n for n in names})
        if traced.adapter.kind != "nnx":
            engine._forget_values()
        if traced.adapter.kind == "nnx":
            from ._nnx_module import SlicedModule

            engine = SlicedModule(target, engine)
        if key is not None:
            try:
                ref = weakref.ref(target)
            except TypeError:
                ref = None
            if ref is not None:
                _CACHE[key] = (ref, engine)
                while len(_CACHE) > _CACHE_SIZE:
                    _CACHE.popitem(last=False)
    if isinstance(engine, Sliced):
        split = engine._base.traced.adapter.split(target, args, kwargs)
        return engine._apply_full(split.variables, split.args, split.kwargs, split.rngs)
    call_kwargs = {k: v for k, v in kwargs.items()}
    return engine(*args, **call_kwargs)


_compat.register_frames_exclusion(__file__)
