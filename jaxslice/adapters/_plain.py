"""Plain JAX functions: `fn(variables, *inputs)`.

Boundaries are calls of functions wrapped with `js.mark(name)` and `jax.named_scope`
regions, the module calls of Haiku functions it applies (named as Haiku keys their
parameters, as for an `hk.Transformed` target), and the calls of Equinox modules that its
first argument holds (named by attribute path, as for an `eqx.Module` target, so
``fn(model, x)`` that vmaps `model` keeps the names ``c1``, ``mlp/linear``). `js.mark`
also opens a `jax.named_scope` of its name, so a marked function's name is its full scope
path (marks and scopes nest alike), and profiles show the same names.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax

from .._core.markers import Origin, call_marked, new_record
from .._errors import MarkNameError, PlainNoParamsError
from .._trees import path_names
from .._warnings import SingleArgumentWarning
from ._base import Adapter, Split, count_by_prefix, keywords_of, leaf_sizes, split_kwargs
from ._equinox import modules_of
from ._haiku import haiku_interception, haiku_parameter_counts
from ._patching import callable_classes, marked_calls

F = TypeVar("F", bound=Callable[..., Any])


@overload
def mark(name: str) -> Callable[[F], F]: ...
@overload
def mark(name: str, fn: F) -> F: ...
def mark(name: str, fn: Callable[..., Any] | None = None) -> Any:
    """Marks a plain function as a module named `name`, so it can be sliced at.

    Use it as a decorator, or wrap a function in place. Outside a jaxslice trace the
    wrapped function behaves exactly like the original (inside a `jax.named_scope` of the
    same name).

    Args:
      name: the boundary name; nested marks and `jax.named_scope`s prefix it with
        their names, joined by ``/``.
      fn: the function to wrap; if omitted, `mark` returns a decorator.

    Returns:
      The wrapped function.

    >>> import jax.numpy as jnp, jaxslice as js
    >>> @js.mark("double")
    ... def double(x):
    ...     return 2 * x
    >>> def model(params, x):
    ...     return double(x) + params["b"]
    >>> [b.name for b in js.boundaries(model, {"b": jnp.ones(3)}, jnp.ones(3))]
    ['double']
    """
    if not isinstance(name, str) or not name:
        raise MarkNameError(name=name)
    if fn is None:
        return functools.partial(mark, name)

    kind = getattr(fn, "__name__", type(fn).__name__)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(name):
            record = new_record(
                origin=Origin.MARK, path=(name,), method="__call__", module_type=kind
            )
            return call_marked(fn, args, kwargs, record)

    return wrapped


class PlainAdapter(Adapter):
    """A function ``fn(variables, *inputs)``; `name_scopes` also lists `jax.named_scope`s."""

    def __init__(self, name_scopes: bool = True):
        self.name_scopes = name_scopes

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        if not args:
            raise PlainNoParamsError()
        if len(args) == 1 and _takes_one_argument(target):
            name = getattr(target, "__name__", type(target).__name__)
            warnings.warn(SingleArgumentWarning.of(repr(name)), stacklevel=_user_level())
        inputs, mode = split_kwargs(kwargs)
        return Split(variables=args[0], rngs=None, args=tuple(args[1:]), kwargs=inputs, mode=mode)

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        with haiku_interception(), _equinox_marking(call.variables):
            return target(call.variables, *call.args, **call.kwargs), None

    def accepted_keywords(self, target: Any) -> set[str] | None:
        return keywords_of(target)

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        counts = count_by_prefix(leaf_sizes(variables))
        # Haiku's flat module keys ("mlp/~/linear_0") count for each module up the path.
        for name, size in haiku_parameter_counts(variables).items():
            counts.setdefault(name, size)
        return counts


def _equinox_marking(variables: Any) -> contextlib.AbstractContextManager[None]:
    """Marks the calls of the Equinox modules in `variables`, named by their attribute
    paths in it (none for a model passed whole: its submodules are ``c1``, ``mlp/linear``,
    as when it is the target)."""
    if "equinox" not in sys.modules:  # then `variables` holds no Equinox module
        return contextlib.nullcontext()
    import equinox as eqx

    found = [(p, m) for p, m in modules_of(variables) if isinstance(m, eqx.Module)]
    paths = {id(m): path_names(p) for p, m in found if p}
    if not paths:
        return contextlib.nullcontext()
    return marked_calls(paths, callable_classes(m for _, m in found))


def _takes_one_argument(fn: Any) -> bool:
    """Whether `fn` takes exactly one positional argument (a closure over the model,
    ``lambda t: model(t)``), so it has no room for both parameters and inputs."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return False
    return sum(p.kind in kinds for p in params) == 1


def _user_level() -> int:
    """The `stacklevel` of the first frame outside jaxslice (the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
