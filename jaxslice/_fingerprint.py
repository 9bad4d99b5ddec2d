"""What a model computes, as a hashable key: the part of jaxslice's trace cache keys that
comes from the model object rather than its arguments.

`jax.jit` keys its cache by the function object, so a model that reads a mutable config
object (or a class attribute) is served the program traced before the change. A new
`js.slice` must not be: each call traces the model as it is *now*, as calling it eagerly
would. `model_key` therefore describes the model by value:

- numbers, strings and flags by type and value (``1``, ``1.0`` and ``True`` differ);
- arrays (and NNX variables) by shape, dtype and weak type, never by contents;
- containers, dataclasses (linen modules, Equinox modules, configs) and plain objects by
  their fields, recursively, whatever their ``__hash__`` says (a linen module hashes a
  config object by identity);
- functions by identity plus the values they close over;
- objects whose class defines value equality (``__eq__`` and ``__hash__``), by themselves;
- the data attributes of every user-defined module class of the model libraries in use
  (`classes_key`), since a module built inside ``@nn.compact`` is no field of anything.

Anything else (an object without fields that hashes by identity, a graph too large to
walk) makes the model uncacheable: `model_key` returns None and the model is traced
every time. Globals a model reads are not looked at, as `jax.jit` does not.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
from collections.abc import Hashable, Iterator
from typing import Any

from ._trees import is_traced_leaf

# Attributes of Flax NNX objects that hold its own bookkeeping, not the user's values.
_INTERNAL = ("_pytree__", "_object__", "_graph_node__")
# Beyond this many objects a model is not walked (it is traced every time instead).
_BUDGET = 50_000
# Base classes of modules whose user-defined subclasses may hold class-level settings.
_MODULE_BASES = (
    ("flax.linen", "Module"),
    ("flax.nnx", "Module"),
    ("equinox", "Module"),
    ("haiku", "Module"),
)
_LIBRARIES = ("flax", "equinox", "haiku", "keras", "jax", "optax", "penzai")


class Unkeyable(Exception):
    """Raised inside `value_key` for a value that cannot be described by value."""


def model_key(target: Any) -> Hashable | None:
    """A key that changes whenever what `target` computes can change, or None."""
    try:
        return value_key(target), classes_key()
    except (Unkeyable, RecursionError):
        return None


def value_key(value: Any) -> Hashable:
    """`value` described by value (see the module docstring); raises `Unkeyable`."""
    return _Walk().key(value)


class _Walk:
    def __init__(self) -> None:
        self.budget = _BUDGET
        self.open: dict[int, int] = {}  # objects being walked -> their order (cycles)

    def key(self, x: Any) -> Hashable:
        self.budget -= 1
        if self.budget < 0:
            raise Unkeyable("too large")
        if x is None or isinstance(x, (bool, int, float, complex, str, bytes, enum.Enum)):
            return type(x), x
        if is_traced_leaf(x):
            return _array_key(x)
        if isinstance(x, (type, types.ModuleType, types.BuiltinFunctionType)):
            return x
        if id(x) in self.open:
            return ("<cycle>", self.open[id(x)])
        self.open[id(x)] = len(self.open)
        try:
            return type(x), self._children(x)
        finally:
            del self.open[id(x)]

    def _children(self, x: Any) -> Hashable:
        for kinds, parts in _PARTS:
            if isinstance(x, kinds):
                return tuple(self.key(p) for p in parts(x))
        if isinstance(x, types.FunctionType):
            cells = tuple(self.key(_cell(c)) for c in x.__closure__ or ())
            return x, cells, self.key(x.__defaults__), self.key(x.__kwdefaults__)
        if not dataclasses.is_dataclass(x) and _hashes_by_value(x):
            return x
        return tuple((name, self.key(v)) for name, v in _attributes(x))


# The parts that say what a container or a wrapped callable holds, in order.
_PARTS: tuple[tuple[Any, Any], ...] = (
    ((tuple, list), lambda x: x),
    (dict, lambda x: x.items()),
    ((set, frozenset), lambda x: sorted(x, key=repr)),
    (types.MethodType, lambda x: (x.__func__, x.__self__)),
    (functools.partial, lambda x: (x.func, x.args, x.keywords)),
)


def _array_key(x: Any) -> Hashable:
    return tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _attributes(x: Any) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of what an object holds: a dataclass's fields, or a plain object's
    attributes (raises `Unkeyable` for an object that has neither)."""
    if dataclasses.is_dataclass(x):
        return ((f.name, getattr(x, f.name, None)) for f in _fields(x))
    attributes = getattr(x, "__dict__", None)
    if attributes is None:
        raise Unkeyable(type(x).__name__)
    return ((name, v) for name, v in attributes.items() if not name.startswith(_INTERNAL))


def _fields(x: Any) -> list[dataclasses.Field[Any]]:
    # linen's `parent` and `scope` are where a module sits, not what it computes.
    return [f for f in dataclasses.fields(x) if f.name not in ("parent", "scope")]


def _hashes_by_value(x: Any) -> bool:
    """Whether `x`'s class (or a base other than `object`) defines ``__eq__`` and
    ``__hash__``: its author says equal objects compute the same."""
    cls = type(x)
    if cls.__hash__ is None or cls.__hash__ is object.__hash__ or cls.__eq__ is object.__eq__:
        return False
    try:
        hash(x)
    except TypeError:
        return False
    return True


def classes_key() -> Hashable:
    """The class-level data attributes of every user-defined subclass of the module
    classes of the model libraries imported now (``factor = 2.0`` in a class body,
    changed later with ``Block.factor = 3.0``)."""
    found = []
    for module_name, class_name in _MODULE_BASES:
        base = getattr(sys.modules.get(module_name), class_name, None)
        if base is None:
            continue
        for cls in _subclasses(base):
            if cls.__module__.split(".")[0] in _LIBRARIES:
                continue
            settings = tuple(
                (name, _setting_key(v)) for name, v in vars(cls).items() if _is_setting(name, v)
            )
            if settings:
                found.append((cls, settings))
    return tuple(found)


def _subclasses(base: type) -> list[type]:
    found, stack = [], [base]
    while stack:
        for cls in stack.pop().__subclasses__():
            found.append(cls)
            stack.append(cls)
    return found


def _is_setting(name: str, value: Any) -> bool:
    if name.startswith("__") or isinstance(value, (staticmethod, classmethod, property, type)):
        return False
    return not (callable(value) or hasattr(value, "__get__"))


def _setting_key(value: Any) -> Hashable:
    try:
        return value_key(value)
    except Unkeyable:
        return ("<object>", id(value))
