"""Changes of global state that overlapping users share, made once and undone once.

Some traces need the process changed while they run: linen's parameter check replaced
by a quicker one, a higher recursion limit for very deep models, the ``__call__`` of a
model's module classes wrapped to mark calls. Traces in other threads may overlap, so
each change is reference-counted under one lock: the first user makes it, the last one
undoes it (also when a trace fails), and users in between share it.

>>> import sys
>>> from jaxslice._shared import SharedChanges
>>> changes = SharedChanges()
>>> def raise_limit():
...     saved = sys.getrecursionlimit()
...     sys.setrecursionlimit(saved + 100)
...     return lambda: sys.setrecursionlimit(saved)
>>> before = sys.getrecursionlimit()
>>> with changes.held({"limit": raise_limit}):
...     with changes.held({"limit": raise_limit}):  # shared: raised once
...         sys.getrecursionlimit() - before
100
>>> sys.getrecursionlimit() == before
True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

#: makes a change and returns what undoes it
Change = Callable[[], Callable[[], Any]]


class SharedChanges:
    """Reference-counted changes, each under a key: `held` makes those not yet made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Hashable, list[Any]] = {}  # key -> [undo, users]

    @contextlib.contextmanager
    def held(self, changes: Mapping[Hashable, Change]) -> Iterator[None]:
        """Inside the block, every change in `changes` is in effect (made by the first
        user of its key, undone when the last one leaves)."""
        acquired = []
        try:
            with self._lock:
                for key, change in changes.items():
                    entry = self._held.get(key)
                    if entry is None:
                        entry = self._held[key] = [change(), 0]
                    entry[1] += 1
                    acquired.append(key)
            yield
        finally:
            with self._lock:
                for key in acquired:
                    entry = self._held[key]
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._held[key]
                        entry[0]()


#: the changes of every trace in this process
SHARED = SharedChanges()
