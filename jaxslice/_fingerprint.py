"""What a model computes, as a hashable key: the part of jaxslice's trace cache keys that
comes from the model object rather than its arguments.

`jax.jit` keys its cache by the function object, so a model that reads a mutable config
object (or a class attribute) is served the program traced before the change. A new
`js.slice` must not be: each call traces the model as it is *now*, as calling it eagerly
would. `model_key` therefore describes the model by value:

- numbers, strings and flags by type and value (``1``, ``1.0`` and ``True`` differ);
- the arrays the trace takes as inputs (the variables of a model that holds them: NNX
  variables, an Equinox module's array leaves) by shape, dtype and weak type, never by
  contents; every other array the model holds (a linen module's mask or scale field, an
  array a function closes over, a NumPy attribute, a static field) is a constant of the
  trace, so it is keyed by its contents too: a digest of its bytes (SHA-1, about 65 ms
  for 100 MB on one CPU core; once per JAX array, which cannot change, and on every key
  of a NumPy array, which can change in place and is also keyed by identity, since a
  traced program may hold the array itself);
- containers, dataclasses (linen modules, Equinox modules, configs) and plain objects by
  their fields (and the values of the slots a class of the user's declares), recursively,
  whatever their ``__hash__`` says (a linen module hashes a config object by identity);
- functions by identity plus the values they close over;
- the class of every object walked, and a class held as a value, with its class-level
  settings when it is the user's (`_Walk.class_key`, once per class and key: data
  attributes by value, ``staticmethod``/``classmethod``/functions/properties by the
  identity of their functions, other callables by value), so ``Config.scale = 4.0`` or
  ``Block.act = staticmethod(jnp.tanh)`` is seen; classes of the model libraries, NumPy
  and Python's own are keyed by identity;
- objects whose class defines value equality (``__eq__`` and ``__hash__``), by themselves;
- the settings of every user-defined module class of the model libraries in use
  (`classes_key`), since a module built inside ``@nn.compact`` is no field of anything.

Anything else (an object without fields that hashes by identity, a graph too large to
walk, a constant array whose bytes cannot be read here: a tracer, an array spread over
several processes) makes the model uncacheable: `model_key` returns None and the model
is traced every time. Globals a model reads are not looked at, as `jax.jit` does not.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import sys
import types
import weakref
from collections.abc import Container, Hashable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

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
_LIBRARIES = ("flax", "equinox", "haiku", "keras", "jax", "optax", "penzai", "jaxslice")
# Classes of these packages (and of Python's standard library) are keyed by identity only.
_NOT_USERS = frozenset((*_LIBRARIES, "builtins", "numpy", "jaxlib", "ml_dtypes"))


class Unkeyable(Exception):
    """Raised inside `value_key` for a value that cannot be described by value."""


def model_key(target: Any, inputs: Container[int] = frozenset()) -> Hashable | None:
    """A key that changes whenever what `target` computes can change, or None.

    `inputs` holds the ids of the arrays the trace takes as inputs (the leaves of the
    split's variables); every other array `target` holds is keyed by its contents.
    """
    try:
        return _Walk(inputs).key(target), classes_key()
    except (Unkeyable, RecursionError):
        return None


def input_ids(leaves: Iterable[Any]) -> set[int]:
    """The ids `model_key` takes as inputs: those of the variables' `leaves`, and of the
    data under each random key among them (an NNX key variable shows its key's data as
    an attribute of its own)."""
    found = set()
    for x in leaves:
        found.add(id(x))
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            found.add(id(jax.random.key_data(x)))
    return found


def value_key(value: Any) -> Hashable:
    """`value` described by value (see the module docstring), every array in it by its
    contents; raises `Unkeyable`."""
    return _Walk().key(value)


class _Walk:
    def __init__(
        self, inputs: Container[int] = frozenset(), classes: dict[type, Hashable] | None = None
    ) -> None:
        self.budget = _BUDGET
        self.inputs = inputs
        self.open: dict[int, int] = {}  # objects being walked -> their order (cycles)
        self.classes = {} if classes is None else classes  # class -> `class_key`

    def key(self, x: Any) -> Hashable:
        self.budget -= 1
        if self.budget < 0:
            raise Unkeyable("too large")
        if x is None or isinstance(x, (bool, int, float, complex, str, bytes, enum.Enum)):
            return type(x), x
        if is_traced_leaf(x):
            if id(x) in self.inputs or isinstance(x, jax.ShapeDtypeStruct):
                return _array_key(x)
            return _array_key(x), _contents_key(x)
        if isinstance(x, type):
            return self.class_key(x)
        if isinstance(x, (types.ModuleType, types.BuiltinFunctionType)):
            return x
        if id(x) in self.open:
            return ("<cycle>", self.open[id(x)])
        self.open[id(x)] = len(self.open)
        try:
            return self.class_key(type(x)), self._children(x)
        finally:
            del self.open[id(x)]

    def class_key(self, cls: type) -> Hashable:
        """`cls`, and for a class of the user's the settings of it and of its bases of the
        user's (a setting can be changed on any of them); each class once per key."""
        known = self.classes.get(cls)
        if known is None:
            if not _is_users(cls):
                known = self.classes[cls] = cls
            else:
                self.classes[cls] = ("<class>", cls)  # a setting that leads back to it
                bases = [base for base in cls.__mro__ if _is_users(base)]
                known = self.classes[cls] = (cls, tuple(self.settings(b) for b in bases))
        return known

    def settings(self, cls: type) -> tuple[Hashable, ...]:
        """``(name, key)`` of the class-level settings in `cls`'s own body."""
        return tuple(
            (name, self._setting(v))
            for name, v in vars(cls).items()
            if not name.startswith(("__", *_INTERNAL))
        )

    def _setting(self, value: Any) -> Hashable:
        if isinstance(value, (staticmethod, classmethod)):
            return type(value), self._setting(value.__func__)
        if isinstance(value, property):
            return property, tuple(_identity(f) for f in (value.fget, value.fset, value.fdel))
        if isinstance(value, type):
            return self.class_key(value)
        if isinstance(value, types.FunctionType) or (
            hasattr(value, "__get__") and not callable(value)
        ):
            return _identity(value)  # a method, or a descriptor of a library
        try:  # data, or a callable object: by value, in a walk of its own
            return _Walk(classes=self.classes).key(value)
        except (Unkeyable, RecursionError):
            return "<object>", id(value)

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


def _contents_key(x: Any) -> Hashable:
    """A constant array's contents: the digest of its bytes, and for a NumPy array, which
    may change in place after a trace that holds it, its identity too."""
    if isinstance(x, np.ndarray):
        return id(x), _digest(x)
    if isinstance(x, np.generic):
        return _digest(x)
    return _array_digest(x)


# Digests of JAX arrays (which never change) by id, each dropped when its array is.
_DIGESTS: dict[int, tuple[Any, bytes]] = {}


def _array_digest(x: Any) -> bytes:
    known = _DIGESTS.get(id(x))
    if known is not None and known[0]() is x:
        return known[1]
    digest = _digest(x)
    key = id(x)
    try:
        _DIGESTS[key] = (weakref.ref(x, lambda _: _DIGESTS.pop(key, None)), digest)
    except TypeError:  # an array type without weak references: digested at every key
        pass
    return digest


def _digest(x: Any) -> bytes:
    """SHA-1 of an array's bytes (a random key's by its key data); `Unkeyable` for an array
    whose bytes cannot be read (a tracer, a deleted array, one spread over processes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        x = jax.random.key_data(x)
    try:
        data = np.ascontiguousarray(x)
    except (TypeError, RuntimeError) as error:  # JAX's conversion errors are TypeErrors
        raise Unkeyable(type(x).__name__) from error
    return hashlib.sha1(data.reshape(-1).view(np.uint8), usedforsecurity=False).digest()


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _attributes(x: Any) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of what an object holds: a dataclass's fields, or a plain object's
    attributes and the slots its classes of the user's declare (raises `Unkeyable` for an
    object that has none of these)."""
    if dataclasses.is_dataclass(x):
        return ((f.name, getattr(x, f.name, None)) for f in _fields(x))
    attributes = getattr(x, "__dict__", None)
    slots = [(name, getattr(x, name, _UNSET)) for name in _slot_names(type(x))]
    if attributes is None and not slots:
        raise Unkeyable(type(x).__name__)
    held = [(n, v) for n, v in (attributes or {}).items() if not n.startswith(_INTERNAL)]
    return iter(held + [(name, v) for name, v in slots if v is not _UNSET])


_UNSET = object()
# The slot names of each class (they are fixed when the class is made).
_SLOTS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _slot_names(cls: type) -> tuple[str, ...]:
    """The slots `cls` and its bases of the user's declare (private ones mangled)."""
    names = _SLOTS.get(cls)
    if names is None:
        found = []
        for base in cls.__mro__:
            declared = base.__dict__.get("__slots__", ()) if _is_users(base) else ()
            for name in (declared,) if isinstance(declared, str) else declared:
                private = name.startswith("__") and not name.endswith("__")
                found.append(f"_{base.__name__.lstrip('_')}{name}" if private else name)
        names = _SLOTS[cls] = tuple(n for n in found if n not in ("__dict__", "__weakref__"))
    return names


# Whether each class is the user's (looked up for every object walked).
_USERS: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _is_users(cls: type) -> bool:
    """Whether `cls` is defined outside the model libraries, NumPy and Python itself."""
    users = _USERS.get(cls)
    if users is None:
        top = str(getattr(cls, "__module__", None) or "builtins").split(".")[0]
        users = _USERS[cls] = top not in _NOT_USERS and top not in sys.stdlib_module_names
    return users


def _identity(value: Any) -> Hashable:
    """`value` itself where it hashes (a function, by identity), else its id."""
    try:
        hash(value)
    except TypeError:
        return "<object>", id(value)
    return value


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
    """The class-level settings (`_Walk.settings`) of every user-defined subclass of the
    module classes of the model libraries imported now (``factor = 2.0`` in a class body,
    changed later with ``Block.factor = 3.0``): a module built inside ``@nn.compact`` is
    no field of anything the walk of the model sees."""
    walk, found = _Walk(), []
    for module_name, class_name in _MODULE_BASES:
        base = getattr(sys.modules.get(module_name), class_name, None)
        if base is None:
            continue
        for cls in _subclasses(base):
            settings = walk.settings(cls) if _is_users(cls) else ()
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
