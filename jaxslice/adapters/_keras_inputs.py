"""Keras's calling convention for the inputs of a Keras slice or edited model.

A Keras model takes its inputs as one value, ``model(x)``, ``model.fit(x, y)``: one
array, a list in input order or a dict keyed by input name. A slice's inputs are its
arguments (`_core.ports.Argument`): each start's positional arrays, then its keyword
ones, as the start's call received them. `from_keras` maps one Keras value onto them:

* a value with the structure of the slice's only argument is that argument
  (``sub(x)``; ``sub([a, b])`` for a start that is a layer taking a list, or the
  inputs of a model called with a list);
* a list or tuple gives the slice's input arrays in order (`input_names`' order), or
  one value per argument;
* a dict gives them by name (keys it has besides those are ignored, as a functional
  model ignores them).

Names (`input_names`): a keyword argument is named by its keyword (``padding_mask``);
a start's positional argument by the start as written (``"block"``; ``"block/1"`` for
the second of several); the model's own inputs by the names of its `keras.Input`s (or
the keys of the dict it was called with). An argument that is a structure of several
arrays names each as ``name/key``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax

from .._errors import KerasInputNamesError
from .._trees import joined_key, path_names


def input_names(arguments: list[Any], model: Any) -> list[str]:
    """One name per input array of a slice with these arguments, in order."""
    per_port = Counter(a.port for a in arguments if a.keyword is None)
    names: list[str] = []
    for arg in arguments:
        example = jax.tree_util.tree_unflatten(arg.tree, [0] * arg.tree.num_leaves)
        paths = [path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(example)[0]]
        if arg.keyword is not None:
            base = arg.keyword
        elif arg.port.spec is None:  # the model's own inputs
            names += _model_input_names(model, example, paths)
            continue
        elif per_port[arg.port] > 1:
            base = f"{arg.port.spec}/{arg.position}"
        else:
            base = str(arg.port.spec)
        names += [joined_key((base, *p)) for p in paths]
    return names


def _model_input_names(model: Any, example: Any, paths: list[tuple[str, ...]]) -> list[str]:
    """The names of the model's inputs, given as `example`: the keys of a dict (as
    Keras's models with dict inputs name them), else the names of a functional model's
    `keras.Input`s in Keras's flat order, else ``inputs``, ``inputs/0``, ..."""
    if isinstance(example, Mapping):
        return [joined_key(p) for p in paths]
    own = getattr(model, "inputs", None)
    if isinstance(own, (list, tuple)) and len(own) == len(paths):
        return [str(getattr(x, "name", "")) for x in own]
    return [joined_key(("inputs", *p)) for p in paths]


def from_keras(
    inputs: Any, arguments: list[Any], names: list[str]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a slice with these `arguments` for one Keras `inputs` value.

    A value that fits none of Keras's forms is passed on as the first argument, for
    the slice to say what it takes."""
    values = _argument_values(inputs, arguments, names)
    if values is None:
        return (inputs,), {}
    args = tuple(v for a, v in zip(arguments, values, strict=True) if a.keyword is None)
    kwargs = {a.keyword: v for a, v in zip(arguments, values, strict=True) if a.keyword}
    return args, kwargs


def _argument_values(inputs: Any, arguments: list[Any], names: list[str]) -> list[Any] | None:
    """The value of each argument in one Keras `inputs` value, or None if it fits none
    of Keras's forms."""
    if len(arguments) == 1 and jax.tree_util.tree_structure(inputs) == arguments[0].tree:
        return [inputs]
    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        if missing:
            raise KerasInputNamesError(names=names, given=list(inputs), missing=missing)
        return _by_argument(arguments, [inputs[n] for n in names])
    if isinstance(inputs, (list, tuple)) and len(inputs) in (len(names), len(arguments)):
        by_leaf = len(inputs) == len(names)
        return _by_argument(arguments, list(inputs)) if by_leaf else list(inputs)
    return _by_argument(arguments, [inputs]) if len(names) == 1 else None


def _by_argument(arguments: list[Any], leaves: list[Any]) -> list[Any]:
    """The input arrays, in order, put together into the slice's arguments."""
    values, i = [], 0
    for arg in arguments:
        n = arg.tree.num_leaves
        values.append(jax.tree_util.tree_unflatten(arg.tree, leaves[i : i + n]))
        i += n
    return values
