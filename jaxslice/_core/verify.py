"""Checking a bare name after a trace stopped early at it.

A trace may end as soon as the first call of each end has returned, which makes slicing
up to an early feature cost a fraction of tracing the whole model. But a bare name
(``block``) is only a valid end when the model calls that module once, which the rest
of the model decides. When no complete trace of the model at this signature has
counted its calls (`trace.unverified_names`), a `Verification` traces the whole model
in a background thread, overlapping with the slice's compilation (XLA releases the
GIL), and resolves each such name in the complete graph. The slice waits for it on its
first use, after dispatching the computation and before any value comes out, and
raises what the check found: `AmbiguousBoundaryError` for a name called more than once
(with the calls to choose from), or the model's own error if the rest of it cannot be
traced. The complete graph is cached, so later slices of the model stop early at once.
"""

from __future__ import annotations

import threading
from typing import Any

from .markers import OUTPUT
from .names import Resolver
from .trace import Traced, stop_specs, trace_split, unverified_names


class Verification:
    """Resolves `names` in a complete trace of the model, in a background thread."""

    def __init__(self, traced: Traced, names: tuple[str, ...]):
        self.names = names
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._check, args=(traced,), name="jaxslice-verify", daemon=True
        )
        self._thread.start()

    def _check(self, traced: Traced) -> None:
        try:
            complete = trace_split(traced.adapter, traced.target, traced.split)
            resolver = Resolver(complete.graph)
            for name in self.names:
                resolver.resolve(name, OUTPUT)
        except BaseException as error:  # reported to the slice's first use
            self.error = error

    def wait(self) -> None:
        """Returns once the check is done; raises what it found."""
        self._thread.join()
        if self.error is not None:
            raise self.error


def start(traced: Traced, start: Any, end: Any) -> Verification | None:
    """A background check of the bare names a trace stopped at without knowing they are
    called once, or None when there is nothing to check."""
    if not traced.graph.partial:
        return None
    names = unverified_names(traced.adapter, traced.target, traced.split, stop_specs(start, end))
    return Verification(traced, names) if names else None
