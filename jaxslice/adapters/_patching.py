"""Marking the calls of a model's submodules by wrapping ``__call__`` on their classes.

Used by the model kinds whose modules are plain Python objects called directly (Flax NNX,
Equinox, Keras), where no library hook sees every call. While a trace needs it, each
class's ``__call__`` is replaced by a wrapper that marks a call only when its ``self`` is
one of the modules of the model traced *in the current context*: a context variable holds
the trace's naming (``id(module)`` to the module's path, and the trace's own finder of
the paths of copies), so other threads, other models and the same classes used outside
the trace pass straight through, and traces that overlap never name each other's
modules: the shared wrappers hold nothing of any one trace. Patching is reference-counted
under a lock (`_shared`), so concurrent traces share the wrappers, and each class gets its
own ``__call__`` back (or none, if it inherited it) when the last trace ends, also when
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

#: the naming of the trace in this context: ``(id -> path, finder of copies' paths)``
_NAMING: contextvars.ContextVar[tuple[dict[int, tuple[str, ...]], PathOf] | None] = (
    contextvars.ContextVar("jaxslice_module_paths", default=None)
)
_IN_CALL: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "jaxslice_module_in_call", default=frozenset()
)


def _no_path(module: Any) -> None:
    return None


def _wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        naming = _NAMING.get()
        path = None if naming is None else (naming[0].get(id(self)) or naming[1](self))
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


def _wrap_call(cls: type) -> Callable[[], None]:
    """Wraps a class's ``__call__``; returns what gives it back (or none, if inherited)."""
    original = cls.__dict__.get("__call__")
    cls.__call__ = _wrapper(original if original is not None else cls.__call__)
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
    context only; `classes` are the classes whose ``__call__`` to wrap. `path_of` finds
    the path of a copy of one of them (it belongs to this trace, like `paths`)."""
    wrapped = {("__call__", cls): functools.partial(_wrap_call, cls) for cls in classes}
    with SHARED.held(wrapped):
        token = _NAMING.set((paths, path_of))
        try:
            yield
        finally:
            _NAMING.reset(token)
