"""Equinox: `model(*inputs)`, where the model is an `eqx.Module` (a pytree).

The model's arrays are its variables (`eqx.partition(model, eqx.is_array)`); everything
else (static fields, activation functions, flags such as ``inference``) is structure,
so it is part of every cache key. To trace, the variables are combined back into the
model and the copy is called, with each submodule call marked explicitly
(`_patching.marked_calls`): names are attribute paths joined by ``/`` (``layers/0``,
``mlp/linear``), so the layers of an ``eqx.nn.Sequential`` and two calls of
same-class layers back to back are distinct boundaries. Only ``__call__`` is marked.

A slice is itself an `eqx.Module` (`EquinoxSlice`) that holds the model's own
submodules it needs, so `eqx.filter_jit`, `eqx.filter_grad`, `eqx.partition` and optax
work on it as on any Equinox model, ``eqx.nn.inference_mode(sub)`` switches it (a new
structure is traced once), and ``sub.merge(model, trained_sub)`` puts trained parts
back, as `eqx.tree_at` would. A trace keeps the model's structure only (its arrays as
shapes), so a slice keeps alive just the parts it holds.

Stateful layers work the Equinox way: an `eqx.nn.State` is an input like any other,
and a layer's output is what it returns (``(y, state)`` for `eqx.nn.BatchNorm`).
Equinox models compute one example per call: slice with one example and batch the
slice with `jax.vmap` (or slice a wrapper module that vmaps inside, as layers with an
``axis_name`` need). A submodule rebuilt from its leaves inside the model
(``eqx.filter_jit(f)(self.body, x)``) is a new object; it keeps the path of the one
submodule with its class, structure and shapes. Sharp edge: a rebuilt copy that matches
no submodule, or several (`eqx.filter_vmap` over a stacked submodule, `eqx.combine`
inside a `lax.scan` body, two identical layers), has no name, so its calls belong to
the enclosing boundary.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax

from .._caches import LRU
from .._errors import (
    EquinoxMergeMismatchError,
    EquinoxOtherSliceError,
    EquinoxUnheldVariablesError,
    EquinoxWrappedModelError,
)
from .._trees import (
    abstract_tree,
    describe_aval,
    is_traced_leaf,
    path_names,
    path_str,
    shape_key,
    tree_key,
)
from ._base import Adapter, NewModule, Split, count_by_prefix, keywords_of, leaf_sizes, split_kwargs
from ._parts import held_paths
from ._patching import callable_classes, marked_calls

BATCH_HINT = (
    "\nEquinox models compute one example per call: if these inputs are a batch, call "
    "`jax.vmap(sub)(x)` (the slice was made with one example)."
)


def _is_module(x: Any) -> bool:
    import equinox as eqx

    return isinstance(x, eqx.Module)


def _wrapped_module(target: Any) -> Any:
    """The Equinox model a function made by `jax.vmap`/`jax.jit`/`functools.wraps` wraps."""
    seen = 0
    while seen < 16 and not _is_module(target) and hasattr(target, "__wrapped__"):
        target, seen = target.__wrapped__, seen + 1
    return target if _is_module(target) else None


def modules_of(model: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """``[(key path, module)]`` of `model` and every module inside it, outermost first."""
    found = [(path, model)]
    children = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: x is not model and _is_module(x)
    )[0]
    for key, child in children:
        if child is not model and _is_module(child):
            found += modules_of(child, path + tuple(key))
    return found


def _by_structure(found: list[tuple[tuple[Any, ...], Any]]) -> Any:
    """Finds the path of a copy of a submodule that `eqx.filter_jit` (or `eqx.combine`)
    rebuilt from its leaves inside the model: the one submodule of the same class,
    structure, shapes and dtypes. A copy that matches several (or none) has no path, so
    its calls belong to the enclosing boundary."""
    paths: dict[Any, Any] = {}
    for path, module in found:
        try:
            key = (type(module), tree_key(module))
            hash(key)
        except TypeError:
            continue
        paths[key] = None if key in paths else path_names(path)

    def path_of(module: Any) -> tuple[str, ...] | None:
        try:
            return paths.get((type(module), tree_key(module)))
        except TypeError:
            return None

    return path_of


def node_at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The node of `tree` at a key path (attributes, indices and dict keys)."""
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            tree = getattr(tree, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            tree = tree[key.idx]
        else:
            tree = tree[getattr(key, "key", key)]
    return tree


class EquinoxAdapter(Adapter):
    model_class = ("equinox", "Module")
    separate_nodes = True

    @classmethod
    def accepts(cls, target: Any) -> bool:
        return super().accepts(target) or (
            callable(target) and "equinox" in sys.modules and _wrapped_module(target) is not None
        )

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        import equinox as eqx

        if not _is_module(target):
            kind = type(_wrapped_module(target)).__name__
            raise EquinoxWrappedModelError(kind=kind)
        variables = eqx.filter(target, is_traced_leaf)  # arrays, or their shapes
        inputs, mode = split_kwargs(kwargs)
        return Split(variables=variables, rngs=None, args=tuple(args), kwargs=inputs, mode=mode)

    def skeleton(self, target: Any) -> Any:
        return abstract_tree(target)

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        import equinox as eqx

        model = eqx.combine(call.variables, target)
        found = modules_of(model)
        paths = {id(m): path_names(p) for p, m in found if p}
        path_of = _by_structure(found[1:])
        with marked_calls(paths, callable_classes(m for _, m in found), path_of):
            return model(*call.args, **call.kwargs), None

    def structure_key(self, target: Any) -> Any:
        return tree_key(target)

    def can_stop_early(self, split: Split) -> bool:
        return True

    def accepted_keywords(self, target: Any) -> set[str] | None:
        names = keywords_of(type(target).__call__)
        return None if names is None else names - {"self"}

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        return count_by_prefix(leaf_sizes(variables))

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        modules = [path_names(p) for p, _ in modules_of(variables)]
        owners = set()
        for path in leaf_sizes(variables):
            owners.add(max((m for m in modules if path[: len(m)] == m), key=len))
        return owners

    def error_hint(self, error: BaseException) -> str:
        return BATCH_HINT if isinstance(error, (TypeError, ValueError)) else ""

    def slice_view(self, target: Any, program: Any) -> Any:
        return _slice_class()(target, program)

    def edit_node(self, obj: Any, name: str, args: tuple[Any, ...]) -> NewModule | None:
        if not _is_module(obj):
            return None
        from ._equinox_edit import node_of

        fn, variables, structure = node_of(obj)
        return NewModule(fn, variables=variables, structure=structure)

    def edited_view(self, target: Any, edited: Any) -> Any:
        from ._equinox_edit import edited_class

        return edited_class()(target, edited)


class _Programs:
    """A slice's programs, one per structure of its parts (hashed by identity, so it can
    be a static field: every copy of a slice shares it)."""

    def __init__(self, program: Any, paths: tuple[tuple[Any, ...], ...], parts: Any):
        self.base = program
        self.paths = paths
        self.others = LRU(8)
        self.structure = tree_key(parts)

    def for_parts(self, parts: Any) -> Any:
        """The program for parts of this structure (traced once per new structure)."""
        key = tree_key(parts)
        if key == self.structure:
            return self.base
        program = self.others.get(key)
        if program is None:
            program = self._retraced(parts)
            self.others.put(key, program)
        return program

    def _retraced(self, parts: Any) -> Any:
        import equinox as eqx

        base = self.base
        model = eqx.tree_at(
            lambda m: [node_at(m, p) for p in self.paths],
            base.target,
            [abstract_tree(p) for p in parts],
        )
        split = base.base.traced.split
        args = abstract_tree(split.args)
        kwargs = {**abstract_tree(split.kwargs), **split.mode}
        return type(base).build(model, args, kwargs, base.start, base.end, adapter=base.adapter)


@functools.cache
def _slice_class() -> type:
    """`EquinoxSlice`, defined once Equinox is imported (jaxslice does not import it)."""
    import equinox as eqx

    from .._view import ProgramView

    class EquinoxSlice(ProgramView, eqx.Module):
        """A slice of an Equinox model, itself an `eqx.Module` holding the model's parts.

        ``sub(*inputs)`` runs only the slice. `parts` are the model's own submodules the
        slice runs (and arrays the root holds directly), at `paths` in the model.
        """

        parts: tuple[Any, ...]
        programs: _Programs = eqx.field(static=True)

        def __init__(self, model: Any, program: Any):
            modules = [p for p, _ in modules_of(model)]
            part_paths, loose_paths = held_paths(modules, program)
            paths = tuple(part_paths) + tuple(loose_paths)
            self.parts = tuple(node_at(model, p) for p in paths)
            self.programs = _Programs(program, paths, abstract_tree(self.parts))

        def _slice_program(self) -> Any:
            return self.programs.base

        @property
        def paths(self) -> tuple[str, ...]:
            """Where each of `parts` sits in the model (``layers/0``)."""
            return tuple("/".join(path_names(p)) for p in self.programs.paths)

        def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
            program = self.programs.for_parts(self.parts)
            entry, leaves = program.lookup(inputs, kwargs, None, False)
            flat = _flat_parts(self.programs.paths, self.parts)
            missing = [p for p in entry.plan.variable_paths if p not in flat]
            if missing:
                raise EquinoxUnheldVariablesError(paths=", ".join(map(path_str, missing[:6])))
            values = [flat[p] for p in entry.plan.variable_paths]
            return program.run(entry, values, [], leaves, False)

        def merge(self, model: Any, trained: Any) -> Any:
            """`model` with the parts this slice holds replaced by `trained`'s parts.

            Every other leaf of `model` is the same object; `trained` is this slice after
            training (any slice with the same parts).
            """
            paths = self.programs.paths
            if not isinstance(trained, EquinoxSlice) or trained.programs.paths != paths:
                raise EquinoxOtherSliceError(paths=", ".join(self.paths))
            _check_arrays(_flat_parts(paths, self.parts), _flat_parts(paths, trained.parts))
            return eqx.tree_at(lambda m: [node_at(m, p) for p in paths], model, list(trained.parts))

        def __repr__(self) -> str:
            return f"EquinoxSlice(start={self.start!r}, end={self.end!r}, parts={self.paths})"

    return EquinoxSlice


def _check_arrays(held: dict[tuple[Any, ...], Any], trained: dict[tuple[Any, ...], Any]) -> None:
    """Trained parts hold arrays at the same paths, of the same shapes and dtypes."""
    for path in held.keys() | trained.keys():
        a, b = held.get(path), trained.get(path)
        if shape_key(a) != shape_key(b):
            raise EquinoxMergeMismatchError(path=path_str(path), held=_aval(a), trained=_aval(b))


def _aval(x: Any) -> str:
    return describe_aval(x) if is_traced_leaf(x) else repr(x)


def _flat_parts(paths: Any, parts: Any) -> dict[tuple[Any, ...], Any]:
    """``{variable path in the model: leaf}`` of the held parts."""
    flat = {}
    for prefix, part in zip(paths, parts, strict=True):
        for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]:
            flat[prefix + tuple(path)] = leaf
    return flat
