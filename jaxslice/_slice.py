"""`js.slice` and the `Sliceable` mixin."""

from __future__ import annotations

from typing import Any

from . import _compat
from ._core.program import SliceProgram
from ._sliced import Sliced
from .adapters import adapter_for


def slice(target: Any, *args: Any, start: Any = None, end: Any = None, **kwargs: Any) -> Any:  # noqa: A001
    """The sub-network between named boundaries, as a compiled, trainable function.

    Args:
      target: a Flax linen module, a Flax NNX module, or a plain function
        ``fn(variables, *inputs)``.
      *args: what the target is called with: ``variables, *inputs`` for linen and plain
        functions, ``*inputs`` for NNX. The sample inputs fix dtypes and non-batch shapes.
      start: where the slice begins: ``None`` (the model's inputs), a boundary name, or a
        list of names (and ``None``). A name means the module's input (the slice includes
        that module); ``name:output`` means its output.
      end: where it ends: ``None`` (the model's output), a name (the module's output;
        ``name:input`` for its input), a list of names (a tuple of values) or a dict
        ``{key: name}`` (a dict of values).
      **kwargs: keyword arguments of the model call; those without arrays select the mode
        (e.g. ``train=False``), ``rngs`` are random keys.

    Returns:
      For linen and plain functions a `js.Sliced`: ``sub(*inputs)`` runs the slice with
      ``sub.variables``; each start contributes its module's array arguments (an
      ``:output`` port, the whole output). For NNX a `js.SlicedModule`, an `nnx.Module`
      that shares the model's variables. For Haiku a `HaikuSliced`, applied as the
      transform's own ``apply`` is (``sub.apply(params, [state,] rng, *inputs)``).

    Raises:
      SliceError: for unknown or ambiguous names, a slice that needs a value before its
        start, an end that does not depend on the start, or a target that cannot be traced.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    >>> x = jnp.ones((4, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> head = js.slice(model, variables, x, start="layers_2")
    >>> head(jnp.ones((4, 8))).shape
    (4, 2)
    >>> sorted(head.variables["params"])
    ['layers_2']
    """
    program = SliceProgram.build(target, args, kwargs, start, end, adapter=adapter_for(target))
    return view(program, target)


def view(program: SliceProgram, target: Any = None) -> Any:
    """What users get for a program of `target` (by default, the program's own): the
    adapter's own kind of slice, or a `Sliced`."""
    target = program.target if target is None else target
    custom = program.adapter.slice_view(target, program)
    if custom is not None:
        return custom
    sliced = Sliced(program)
    wrapped = program.adapter.sliced_view(target, sliced)
    return sliced if wrapped is None else wrapped


class Sliceable:
    """Mixin giving a module a ``.slice(...)`` method: ``net.slice(...) == js.slice(net, ...)``.

    >>> import flax.linen as nn, jaxslice as js
    >>> class Net(js.Sliceable, nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(2, name="head")(nn.Dense(4, name="body")(x))
    """

    def slice(self, *args: Any, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        return slice(self, *args, start=start, end=end, **kwargs)


_compat.register_frames_exclusion(__file__)
