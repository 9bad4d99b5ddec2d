"""Recording module calls in a traced program.

While a target is traced, every module call is wrapped by `call_marked`: each array leaf
of the call's arguments and of its result is recorded with a marker equation
(`_compat.bind_marker`) that names the call and the leaf. The call itself receives and
returns exactly the objects it would without jaxslice (same values, same containers, same
identities), and nothing downstream reads the markers, so they never change what is
computed and are simply absent from re-emitted programs.

A `CallRecord` holds what the jaxpr cannot: the module path, method, type and the pytree
structure of both sides. Records live in a process-wide table keyed by an integer id; a
marker's key is ``"<id>/<side>/<leaf>"``. Call order and call indices are *not* taken
from the order of the Python calls, but from where the markers end up in the final
program, so a function traced twice (by `jax.checkpoint`, say) or reused from JAX's jit
cache still yields one boundary per call that actually happens.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from . import _compat

INPUT = "input"
OUTPUT = "output"
PLACEHOLDER = -1  # leaf index of the marker written for a side without array leaves


@dataclasses.dataclass(eq=False)
class CallRecord:
    """What is known about one traced module call besides its values."""

    id: int
    kind: str  # "linen", "nnx" or "mark"
    path: tuple[str, ...]  # module path; for `js.mark`, the mark's own name
    method: str
    module_type: str
    in_tree: Any = None
    in_is_array: tuple[bool, ...] = ()
    out_tree: Any = None
    out_is_array: tuple[bool, ...] = ()
    out_statics: dict[int, Any] = dataclasses.field(default_factory=dict)


# Records are needed while a trace is turned into a graph, and again when JAX reuses a
# cached trace of a jitted function (its markers name old records), so they are kept, but
# only the newest `_MAX_RECORDS`: a marker whose record is gone is ignored.
_RECORDS: collections.OrderedDict[int, CallRecord] = collections.OrderedDict()
_MAX_RECORDS = 50_000
_IDS = itertools.count()
_LOCK = threading.Lock()
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxslice_marking", default=False)


class StopTracing(BaseException):
    """Raised once every end of a slice has been computed, to skip the rest of the model.

    A BaseException, so model code that catches ``Exception`` does not swallow it.
    Adapters may attach the model's state at that point (``state``).
    """

    state: Any = None


class StopRule:
    """Stops a trace when the calls an early-ending slice needs have all returned.

    `needs` maps a boundary name (``path`` or ``path.method``) to how many of its calls
    must have returned. Only calls made by the top-level trace count: a call inside a
    jitted function or a loop body cannot end the trace there.
    """

    def __init__(self, needs: dict[str, int]):
        self.needs = dict(needs)
        self.seen: dict[str, int] = {}
        self.top: Any = None
        self.stopped = False

    def returned(self, record: CallRecord) -> None:
        if record.kind not in ("linen", "nnx"):
            return
        name = "/".join(record.path) + ("" if record.method == "__call__" else f".{record.method}")
        self.seen[name] = self.seen.get(name, 0) + 1
        if name not in self.needs or self.top is None or _compat.current_trace() is not self.top:
            return
        if all(self.seen.get(n, 0) >= k for n, k in self.needs.items()):
            self.stopped = True
            raise StopTracing()


_STOP: contextvars.ContextVar[StopRule | None] = contextvars.ContextVar(
    "jaxslice_stop", default=None
)


@contextlib.contextmanager
def stopping(rule: StopRule | None) -> Iterator[None]:
    """Lets `rule` end the trace early (it records the trace it starts in)."""
    if rule is not None:
        rule.top = _compat.current_trace()
    token = _STOP.set(rule)
    try:
        yield
    finally:
        _STOP.reset(token)


def lookup(record_id: int) -> CallRecord | None:
    return _RECORDS.get(record_id)


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """Turns marking on for the duration of one trace."""
    token = _ACTIVE.set(True)
    try:
        with _compat.marking_context():
            yield
    finally:
        _ACTIVE.reset(token)


def is_marking() -> bool:
    return _ACTIVE.get()


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def parse_key(key: str) -> tuple[int, str, int]:
    rid, side, leaf = key.split("/")
    return int(rid), side, int(leaf)


def new_record(*, kind: str, path: tuple[str, ...], method: str, module_type: str) -> CallRecord:
    """A fresh record for a call that is marked by hand (see `mark_side`)."""
    with _LOCK:
        rid = next(_IDS)
    record = CallRecord(rid, kind, tuple(path), method, module_type)
    _RECORDS[rid] = record
    while len(_RECORDS) > _MAX_RECORDS:
        _RECORDS.popitem(last=False)
    return record


def mark_side(record: CallRecord, side: str, tree: Any) -> None:
    """Marks one side of a call; `tree` is ``(args, kwargs)`` for the input side."""
    treedef, is_arr = _mark_side(record, side, tree)
    if side == INPUT:
        record.in_tree, record.in_is_array = treedef, is_arr
    else:
        record.out_tree, record.out_is_array = treedef, is_arr


def _mark_side(record: CallRecord, side: str, tree: Any) -> tuple[Any, tuple[bool, ...]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_arr = tuple(is_array(leaf) for leaf in leaves)
    if side == OUTPUT:
        record.out_statics = {
            i: leaf for i, (leaf, a) in enumerate(zip(leaves, is_arr, strict=True)) if not a
        }
    for i, (leaf, arr) in enumerate(zip(leaves, is_arr, strict=True)):
        if arr:
            _compat.bind_marker(leaf, f"{record.id}/{side}/{i}")
    if not any(is_arr):
        # Keep the call's position in the program visible even without array values.
        _compat.bind_marker(np.zeros((), np.bool_), f"{record.id}/{side}/{PLACEHOLDER}")
    return treedef, is_arr


def call_marked(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    kind: str,
    path: tuple[str, ...],
    method: str,
    module_type: str,
) -> Any:
    """Calls ``fn(*args, **kwargs)``, recording the call's inputs and output."""
    if not _ACTIVE.get():
        return fn(*args, **kwargs)
    record = new_record(kind=kind, path=path, method=method, module_type=module_type)
    record.in_tree, record.in_is_array = _mark_side(record, INPUT, (args, kwargs))
    out = fn(*args, **kwargs)
    record.out_tree, record.out_is_array = _mark_side(record, OUTPUT, out)
    rule = _STOP.get()
    if rule is not None:
        rule.returned(record)
    return out
