"""Marking the calls of a model's submodules by wrapping ``__call__`` on their classes.

Used by the model kinds whose modules are plain Python objects called directly (Flax NNX,
Equinox, Keras), where no library hook sees every call. While a trace needs it, each
class's ``__call__`` is replaced by a wrapper that marks a call only when its ``self`` is
one of the modules of the model traced *in the current context*: a context variable maps
``id(module)`` to the module's path, so other threads, other models and the same classes
used outside the trace pass straight through. Patching is reference-counted under a
lock (`_shared`), so concurrent traces share the wrappers, and each class gets its own
``__call__`` back (or none, if it inherited it) when the last trace ends, also when
tracing fails.

A call of a module from inside its own ``__call__`` (a ``super().__call__`` chain, or a
module that calls itself) is not marked again.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._core.markers import Origin, call_marked, new_record
from .._shared import SHARED

#: Finds the path of a module the id map does not know (a copy a transform made), or None.
PathOf = Callable[[Any], "tuple[str, ...] | None"]

_PATHS: contextvars.ContextVar[dict[int, tuple[str, ...]] | None] = contextvars.ContextVar(
    "jaxslice_module_paths", default=None
)
_IN_CALL: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "jaxslice_module_in_call", default=frozenset()
)


def _no_path(module: Any) -> None:
    return None


def _wrapper(original: Callable[..., Any], path_of: PathOf) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        paths = _PATHS.get()
        path = None if paths is None else (paths.get(id(self)) or path_of(self))
        busy = _IN_CALL.get()
        if not path or id(self) in busy:  # the root, a foreign module, or a super() call
            return original(self, *args, **kwargs)
        token = _IN_CALL.set(busy | {id(self)})
        try:
            record = new_record(
                origin=Origin.MODULE, path=path, method="__call__", module_type=type(self).__name__
            )
            return call_marked(functools.partial(original, self), args, kwargs, record)
        finally:
            _IN_CALL.reset(token)

    return __call__


def _wrap_call(cls: type, path_of: PathOf) -> Callable[[], None]:
    """Wraps a class's ``__call__``; returns what gives it back (or none, if inherited)."""
    original = cls.__dict__.get("__call__")
    cls.__call__ = _wrapper(original if original is not None else cls.__call__, path_of)
    if original is None:
        return lambda: delattr(cls, "__call__")
    return lambda: setattr(cls, "__call__", original)


def callable_classes(modules: Iterable[Any]) -> set[type]:
    """The classes of `modules` that define a ``__call__`` to wrap."""
    classes = {type(node) for node in modules}
    return {cls for cls in classes if callable(getattr(cls, "__call__", None))}  # noqa: B004


@contextlib.contextmanager
def marked_calls(
    paths: dict[int, tuple[str, ...]], classes: Iterable[type], path_of: PathOf = _no_path
) -> Iterator[None]:
    """Marks calls of the modules in `paths` (``id -> path``) inside the block, in this
    context only; `classes` are the classes whose ``__call__`` to wrap."""
    wrapped = {("__call__", cls): functools.partial(_wrap_call, cls, path_of) for cls in classes}
    with SHARED.held(wrapped):
        token = _PATHS.set(paths)
        try:
            yield
        finally:
            _PATHS.reset(token)
