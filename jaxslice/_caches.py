"""One cache policy for all of jaxslice: bounded, thread-safe LRU maps.

Every cache jaxslice keeps (call counts of full traces, compiled entries of a slice,
`js.intermediates` programs) is an `LRU`. Each registers itself, so `clear_caches`
empties all of them at once. A key must say everything that changes what it maps to
(see the callers); a cache never decides correctness, only speed.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

_ALL: weakref.WeakSet[LRU] = weakref.WeakSet()
_MISSING = object()


class LRU:
    """A bounded map that forgets its least recently used entries.

    >>> cache = LRU(maxsize=2)
    >>> cache.get_or_make("a", lambda: 1), cache.get_or_make("b", lambda: 2)
    (1, 2)
    >>> cache.get_or_make("c", lambda: 3); cache.get("a") is None
    3
    True
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        _ALL.add(self)

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def peek(self, key: Hashable) -> Any:
        """The value at `key`, or None, without marking it used and without the lock (a
        dict read is atomic): for lookups on every call of a compiled slice."""
        return self._data.get(key)

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value at `key`, made (outside the lock) and stored if missing."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            value = make()
            self.put(key, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


def clear_caches() -> None:
    """Empties every cache jaxslice keeps (compiled slices, traces, call counts).

    Slices and observers stay usable: they trace and compile again on their next call.
    JAX's own caches are separate; `jax.clear_caches()` empties those (and does not
    touch jaxslice's).
    """
    for cache in list(_ALL):
        cache.clear()
