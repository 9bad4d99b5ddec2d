"""Pytree helpers used across jaxslice: leaves, key paths, pruning and nesting.

Key paths are tuples of JAX key entries (`DictKey`, `SequenceKey`, `GetAttrKey`, ...) or,
for NNX states, of plain strings and ints. Everything that turns a path into names or
text goes through `key_name`, `path_names` and `path_str`, so the conversions agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np


def is_array(x: Any) -> bool:
    """A concrete or traced array (not a Python scalar)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_traced_leaf(x: Any) -> bool:
    """A leaf that becomes an input of a traced program: an array or a `ShapeDtypeStruct`."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def abstract(x: Any) -> Any:
    """A leaf's shape, dtype and weak type (for signatures); other leaves stand for
    themselves."""
    if is_traced_leaf(x):
        return jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype, weak_type=is_weak(x))
    return x


def is_weak(x: Any) -> bool:
    """Whether an array is weakly typed (made from a Python scalar: it takes the dtype of
    what it meets, so a program traced with it computes in other dtypes)."""
    return bool(getattr(x, "weak_type", False))


def abstract_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(abstract, tree)


def shape_key(x: Any) -> Any:
    """A hashable stand-in for a leaf in a cache key: ``(shape, dtype, weak type)``, a
    Python number with its type (``1``, ``1.0`` and ``True`` trace different programs),
    or the leaf."""
    if is_traced_leaf(x):
        return tuple(jax.numpy.shape(x)), x.dtype, is_weak(x)
    if isinstance(x, (bool, int, float, complex)):
        return type(x), x
    return hashable(x)


def hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return ("<unhashable>", type(x).__name__, repr(x))


def tree_key(tree: Any) -> Any:
    """A hashable key of a pytree's structure, leaf shapes and dtypes and static leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(shape_key(x) for x in leaves)


def key_name(entry: Any) -> Any:
    """The name or index a key entry stands for (``DictKey("w") -> "w"``)."""
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def path_names(path: Sequence[Any]) -> tuple[str, ...]:
    """A key path as strings: ``(DictKey("params"), DictKey("dense")) -> ("params", "dense")``."""
    return tuple(str(key_name(k)) for k in path)


_KEY_TYPES = (
    jax.tree_util.DictKey,
    jax.tree_util.SequenceKey,
    jax.tree_util.GetAttrKey,
    jax.tree_util.FlattenedIndexKey,
)


def path_str(path: Sequence[Any]) -> str:
    """A key path for messages, as JAX writes it (``['params']['dense']['kernel']``) or,
    for NNX state paths, ``dense/kernel``; ``<root>`` for the empty path."""
    if all(isinstance(k, _KEY_TYPES) for k in path):
        return jax.tree_util.keystr(tuple(path)) or "<root>"
    return "/".join(path_names(path)) or "<root>"


def describe_aval(aval: Any) -> str:
    """``float32[8, 16]``: how jaxslice prints a shape and dtype everywhere."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return str(aval)
    return f"{dtype}{list(shape)}"


_SPECIAL = ("\\", "/", "@", ":", "[")


def escape_name(part: str) -> str:
    r"""One module name as it appears in a boundary name, with the characters that
    separate path parts, call indices and ports escaped by a backslash.

    >>> escape_name("a:input"), escape_name("block")
    ('a\\:input', 'block')
    """
    for ch in _SPECIAL:
        part = part.replace(ch, "\\" + ch)
    return part


def join_name(parts: Sequence[str]) -> str:
    r"""A module path as a boundary name: escaped parts joined by ``/``.

    >>> join_name(("p/q", "dense"))
    'p\\/q/dense'
    """
    return "/".join(escape_name(str(p)) for p in parts)


_EMPTY = object()


def joined_key(path: Sequence[Any]) -> str:
    """A variable path as one string key, as an edited NNX model keys its variables.

    >>> joined_key(("blocks", 0, "linear", "kernel"))
    'blocks/0/linear/kernel'
    """
    return "/".join(map(str, path))


def prune(tree: Any, keep: set[tuple[Any, ...]], path: tuple[Any, ...] = ()) -> Any:
    """The part of `tree` whose leaves are at `keep` paths, keeping its nesting.

    Mappings lose the keys they no longer need; other containers keep their shape, with
    None where a subtree is not needed.

    >>> from jax.tree_util import DictKey, SequenceKey
    >>> prune({"a": {"w": 1, "b": 2}, "c": [3, 4]}, {(DictKey("c"), SequenceKey(1))})
    {'c': [None, 4]}
    """
    out = _prune(tree, keep, path)
    return None if out is _EMPTY else out


def _prune(node: Any, keep: set[tuple[Any, ...]], path: tuple[Any, ...]) -> Any:
    if path in keep:
        return node
    children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1:  # a leaf that is not kept
        return _EMPTY
    kept = [_prune(child, keep, path + p) for p, child in children]
    if all(k is _EMPTY for k in kept):
        return _EMPTY
    if isinstance(node, Mapping):
        return _rebuild_mapping(node, children, kept)
    return jax.tree_util.tree_unflatten(treedef, [None if k is _EMPTY else k for k in kept])


def _rebuild_mapping(node: Mapping[Any, Any], children: list[Any], kept: list[Any]) -> Any:
    items = {p[0].key: k for (p, _), k in zip(children, kept, strict=True) if k is not _EMPTY}
    try:
        return type(node)(items)
    except TypeError:
        return items


def nest(paths: Sequence[tuple[Any, ...]], values: Sequence[Any]) -> dict[Any, Any]:
    """Nested dicts from key paths, as linen returns updated collections.

    >>> from jax.tree_util import DictKey
    >>> nest([(DictKey("a"), DictKey("b"))], [1])
    {'a': {'b': 1}}
    """
    out: dict[Any, Any] = {}
    for path, value in zip(paths, values, strict=True):
        node = out
        keys = [key_name(k) for k in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return out
