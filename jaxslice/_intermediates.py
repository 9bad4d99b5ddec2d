"""`js.intermediates`: values at chosen boundaries from one compiled call.

It is a slice from the model's inputs to a dict of ends, so only what the requested values
need is computed (nothing past the last one). Programs are kept in a bounded cache,
keyed by the names and by the key of traced programs (`trace.traced_key`: the model,
the paths, shapes and dtypes of variables, the inputs, the mode, `mutable` and the
structure of `rngs`).
"""

from __future__ import annotations

from typing import Any

from . import _compat
from ._caches import LRU
from ._core.ports import parsed
from ._core.program import SliceProgram
from ._core.trace import trace_split, traced_key
from ._errors import NamesSpecError
from ._lens import Lens
from ._trees import nest
from .adapters import Adapter, Split, adapter_for

_PROGRAMS = LRU(maxsize=16)
ALL = "all"  # every call's output, loops included


def _names(names: Any) -> Any:
    if names is None or (isinstance(names, str) and names == ALL):
        return names
    try:
        found = None if isinstance(names, str) else tuple(names)
    except TypeError:
        found = None
    if not found or not all(isinstance(n, str) for n in found):
        shown = list(found) if found is not None else names
        raise NamesSpecError(names=shown)
    return found


def intermediates(target: Any, *args: Any, names: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Values at the named boundaries, from one compiled call of the model.

    Args:
      target, *args, **kwargs: as for `js.slice` (``model, variables, *inputs`` for linen,
        ``fn, params, *inputs`` for plain functions, ``model, *inputs`` for NNX).
      names: boundary names (``name``, ``name@k``, ``name:input``); None for the output of
        every module call outside loops; ``"all"`` for every call's output, inside scans
        too (``layers[:]/mlp``, every iteration's stacked on a leading axis), from one
        pass that keeps each scan one loop (calls inside a `while_loop` or a `cond` branch
        are left out: they have no value per iteration to stack; an NNX model's state is
        not updated by this pass).

    Returns:
      ``{name: value}`` in the order of `names` (or of the calls). For a linen model
      called with ``mutable=[...]`` (train mode with batch statistics, say),
      ``({name: value}, updated_state)`` as linen's ``apply`` returns; without it, a
      call that updates state raises, as in linen. An NNX model's state is updated in
      place, as calling the model does.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> feats = js.intermediates(model, variables, jnp.ones((5, 3)), names=["layers_0"])
    >>> feats["layers_0"].shape
    (5, 8)
    """
    names = _names(names)
    adapter = adapter_for(target)
    split = adapter.split(target, args, kwargs)
    if names == ALL:
        return _every_value(adapter, target, args, kwargs, split)
    traced = traced_key(adapter, target, split)
    key = None if traced is None else (names, traced)
    program = _PROGRAMS.get(key) if key is not None else None
    if program is None or (adapter.holds_variables and program.target is not target):
        program = _program(adapter, target, split, names)
        if key is not None:
            _PROGRAMS.put(key, program)
    values, state = program.apply_full(split)
    if not split.mutable or program.adapter.holds_variables:
        return values
    return values, nest([p for p, _ in state], [v for _, v in state])


def _every_value(
    adapter: Adapter, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], split: Split
) -> dict[str, Any]:
    """``names="all"``: a lens (`_lens.Lens`) with no interventions reads them all."""
    if split.mutable and not adapter.holds_variables:
        raise NamesSpecError(names="all, with mutable (name the boundaries instead)")
    traced = traced_key(adapter, target, split)
    key = None if traced is None else (ALL, traced)
    found = _PROGRAMS.get(key) if key is not None else None
    if found is None or (adapter.holds_variables and found.target is not target):
        found = Lens(target, args, kwargs, sites=(), keep_variables=False)
        if key is not None:
            _PROGRAMS.put(key, found)
    # The variables given at this call (a model that holds them is read live).
    variables = None if adapter.holds_variables else split.variables
    return found.whole_values(variables, split.args, {**split.kwargs, **split.mode})


def _program(adapter: Adapter, target: Any, split: Split, names: Any) -> Any:
    # Each name parsed once: the trace stops after them, and the slice ends at them.
    ends = parsed({n: n for n in names}) if names is not None else None
    traced = trace_split(adapter, target, split, list(ends.values()) if ends is not None else None)
    if ends is None:
        ends = {c.qualname: c.qualname for c in traced.graph.calls if c.loop is None}
    return SliceProgram(traced, None, ends)


_compat.register_frames_exclusion(__file__)
