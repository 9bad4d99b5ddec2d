"""Recording module calls in a traced program (stage 1 of the pipeline).

While a target is traced, every module call is wrapped by `call_marked`: each array leaf
of the call's arguments and of its result is recorded with a marker equation
(`_compat.bind_marker`) whose payload names the call's `CallRecord`, the side and the
leaf. The call itself receives and returns exactly the objects it would without jaxslice
(same values, same containers, same identities), and nothing downstream reads the
markers, so they never change what is computed and are absent from re-emitted programs.

A `CallRecord` holds what the jaxpr cannot: the module path, method, type, the pytree
structure of both sides and the order of the call's keywords. It travels inside the
marker equations themselves, so it lives exactly as long as the traced program (also in
JAX's jit caches). Call order and call indices are *not* taken from the order of the
Python calls, but from where the markers end up in the final program, so a function
traced twice (by `jax.checkpoint`, say) or reused from JAX's jit cache still yields one
boundary per call that actually happens.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .. import _compat
from .._trees import is_array, join_name

INPUT = "input"
OUTPUT = "output"
PLACEHOLDER = -1  # leaf index of the marker written for a side without array leaves


class Origin(enum.Enum):
    """How a boundary is known."""

    MODULE = "module"  # a module of a model library; its path is how its variables are keyed
    MARK = "mark"  # a `js.mark`ed function, named by its `jax.named_scope` path
    NODE = "node"  # a node of an edited model, named by its path
    SCOPE = "scope"  # a `jax.named_scope` region of a plain function


@dataclasses.dataclass(eq=False)
class CallRecord:
    """What is known about one traced module call besides its values."""

    origin: Origin
    path: tuple[str, ...]  # module path; for `js.mark`, the mark's own name
    method: str
    module_type: str
    in_tree: Any = None
    in_is_array: tuple[bool, ...] = ()
    # The call's keywords in the order it passed them: `in_tree` cannot keep it, as JAX
    # flattens a dict with its keys sorted (``block(x, mask=m, bias=b)`` as bias, mask).
    in_keywords: tuple[str, ...] = ()
    out_tree: Any = None
    out_is_array: tuple[bool, ...] = ()
    out_statics: dict[int, Any] = dataclasses.field(default_factory=dict)
    # Set on the copies the loop expander (`loop_expander.py`) makes for one iteration of a loop (or all of them,
    # stacked): the boundary's full name (``layers[2]/attn``) and what identifies it.
    display: str | None = None
    key: Any = None
    # The `jax.named_scope` path the model library itself opens around the call (Haiku's
    # `named_call` of local module names, without its ``~``): under a target that lists
    # scope regions, the region of that name is this call, not a second boundary.
    scope: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        """``path`` or ``path.method``, as boundary names are written."""
        if self.display is not None:
            return self.display
        if self.origin is Origin.MARK:
            return "/".join(self.path)  # the mark's own name, as the user wrote it
        name = join_name(self.path)
        return name if self.method == "__call__" else f"{name}.{self.method}"


@dataclasses.dataclass(frozen=True)
class Marker:
    """The payload of one marker equation."""

    record: CallRecord
    side: str
    leaf: int


_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxslice_marking", default=False)
# The boundary being traced when the model raised (innermost first), for error messages.
_FAILED_IN: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "jaxslice_failed_in", default=None
)


class StopTracing(BaseException):
    """Raised once every end of a slice has been computed, to skip the rest of the model.

    A BaseException, so model code that catches ``Exception`` does not swallow it.
    Adapters may attach the model's state at that point (``state``).
    """

    state: Any = None


class StopRule:
    """Stops a trace when the calls an early-ending slice needs have all returned.

    `needs` maps a boundary name (``path`` or ``path.method``) to how many of its calls
    must have returned. Only module calls made by the top-level trace count: a call inside
    a jitted function or a loop body cannot end the trace there.
    """

    def __init__(self, needs: dict[str, int]):
        self.needs = dict(needs)
        self.seen: dict[str, int] = {}
        self.top: Any = None

    def returned(self, record: CallRecord) -> None:
        if record.origin is not Origin.MODULE:
            return
        name = record.name
        self.seen[name] = self.seen.get(name, 0) + 1
        if name not in self.needs or self.top is None or _compat.current_trace() is not self.top:
            return
        if all(self.seen.get(n, 0) >= k for n, k in self.needs.items()):
            raise StopTracing()


_STOP: contextvars.ContextVar[StopRule | None] = contextvars.ContextVar(
    "jaxslice_stop", default=None
)
# The program of the slice (or edited model) being traced as a target, whose runs mark
# its calls again (`remarks`); None while a model is traced.
_REMARK: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxslice_remark", default=None)


@contextlib.contextmanager
def marking(rule: StopRule | None = None, remark: Any = None) -> Iterator[list[str]]:
    """Turns marking on for one trace; `rule` may end it early; `remark` is the program
    of a slice traced as a target (see `remarks`).

    Yields the list in which the boundaries being traced when the model raised are
    recorded (innermost first).
    """
    if rule is not None:
        rule.top = _compat.current_trace()
    failed: list[str] = []
    tokens = (_ACTIVE.set(True), _STOP.set(rule), _FAILED_IN.set(failed), _REMARK.set(remark))
    try:
        with _compat.marking_context():
            yield failed
    finally:
        _REMARK.reset(tokens[3])
        _FAILED_IN.reset(tokens[2])
        _STOP.reset(tokens[1])
        _ACTIVE.reset(tokens[0])


def remarks(program: Any) -> bool:
    """Whether `program` is the one of the slice being traced as a target: its runs then
    mark the calls it computes again, so that the trace sees them as boundaries. Only
    that program does: a slice that a model merely calls stays one opaque computation."""
    return program is not None and _REMARK.get() is program and _ACTIVE.get()


# Every marked trace runs with a JAX flag that is part of JAX's trace context
# (`_compat.marking_context`), so `jax.jit`'s caches keep jaxslice's traces apart from
# the model's own: a jitted function the user traced before (`nn.jit` with a static
# `self`, a jitted helper around a `js.mark`ed function) is traced again with markers,
# and a plain call after a slice never reuses a marked trace. The cost is tracing JAX's
# own jitted helpers once more per process and shape.


def is_marking() -> bool:
    return _ACTIVE.get()


def new_record(
    *,
    origin: Origin,
    path: tuple[str, ...],
    method: str,
    module_type: str,
    scope: tuple[str, ...] | None = None,
) -> CallRecord:
    """A fresh record for a call that is marked by hand (see `mark_side`)."""
    return CallRecord(origin, tuple(path), method, module_type, scope=scope)


def mark_side(record: CallRecord, side: str, tree: Any) -> None:
    """Marks one side of a call; `tree` is ``(args, kwargs)`` for the input side."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_arr = tuple(is_array(leaf) for leaf in leaves)
    if side == INPUT:
        record.in_tree, record.in_is_array = treedef, is_arr
        record.in_keywords = tuple(tree[1])
    else:
        record.out_tree, record.out_is_array = treedef, is_arr
        record.out_statics = {
            i: x for i, (x, a) in enumerate(zip(leaves, is_arr, strict=True)) if not a
        }
    for i, leaf in enumerate(leaves):
        if is_arr[i]:
            _compat.bind_marker(leaf, Marker(record, side, i), side)
    if not any(is_arr):
        # Keep the call's position in the program visible even without array values.
        _compat.bind_marker(np.zeros((), np.bool_), Marker(record, side, PLACEHOLDER), side)


def call_marked(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    record: CallRecord,
) -> Any:
    """Calls ``fn(*args, **kwargs)``, recording the call's inputs and output in `record`."""
    if not _ACTIVE.get():
        return fn(*args, **kwargs)
    mark_side(record, INPUT, (args, kwargs))
    try:
        out = fn(*args, **kwargs)
    except Exception:
        failed = _FAILED_IN.get()
        if failed is not None:
            failed.append(record.name)
        raise
    mark_side(record, OUTPUT, out)
    rule = _STOP.get()
    if rule is not None:
        rule.returned(record)
    return out
