"""Keras 3 on JAX: ``js.slice(model, *inputs, ...)`` for a `keras.Layer` or `keras.Model`.

The model is called as `stateless_call` calls it, with its variables replaced by traced
values (`keras.StatelessScope`), but through ``__call__``, so ``training=True`` reaches
every layer through Keras's call context as in ``model(x, training=True)``. They
are grouped as Keras groups them, ``{"trainable": ..., "non_trainable": ...}``, each
nested by layer path and variable name (``{"block": {"a": {"kernel": ...}}}``), the
same paths the boundaries have. Like linen's collections: `sub.variables` holds the
slice's part, ``mutable=["non_trainable"]`` returns updated moving statistics and
random-seed states (a slice that updates them without it is an error, as linen's
``apply`` raises), and ``training=True`` is a mode keyword. ``sub.merge(model, trained)``
assigns trained values to the model's own variables.

Unlike linen's, the values are the model's: a slice holds the model's `keras.Variable`s
the slice reads (found by path when it is made, `variables_view`), and ``sub.variables``
and ``sub(x)`` read their current values, as a functional sub-model sharing the layers
does. So what ``merge``, ``model.fit`` or ``variable.assign`` write is what the slice
computes with next: moving statistics accumulate and Dropout's seed states advance
across the steps of a train loop that merges its updates.

Boundaries are layers only: each layer call is marked explicitly by wrapping
``__call__`` on the layers' classes while the model is traced
(`_patching.marked_calls`), so einsums and other operations inside a layer are not
boundaries, and a start takes the layer's call arguments as the call passed them
(``layer(x, padding_mask=m)``: ``x``, then the keyword ``padding_mask``). Names are
layer names joined by ``/`` from the model down (``block/a``); the model's own call is
no boundary. Sharp edge: Keras returns the new non-trainable state only at the end of a
call, so traces never stop early.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from .._errors import (
    KerasBackendError,
    KerasNodeModeError,
    KerasNodeStateError,
    KerasNotBuiltError,
    KerasRngsError,
)
from .._trees import nest, path_names
from ._base import (
    Adapter,
    CollectionNodes,
    NewModule,
    Split,
    count_by_prefix,
    keywords_of,
    split_kwargs,
)
from ._patching import callable_classes, marked_calls

GROUPS = ("trainable", "non_trainable")


def _children(layer: Any) -> list[Any]:
    """The layers directly inside `layer` (Keras tracks them as they are assigned)."""
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is not None:
        return list(flatten(include_self=False, recursive=False))
    return list(getattr(layer, "layers", []))  # pragma: no cover - other Keras 3 releases


def trainable_flags(model: Any) -> tuple[bool, ...]:
    """The `trainable` flag of `model` and of every layer inside it, in Keras's order."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        return tuple(layer.trainable for layer in flatten())
    return tuple(layer.trainable for _, layer in layer_paths(model).values())  # pragma: no cover


def layer_paths(model: Any) -> dict[int, tuple[tuple[str, ...], Any]]:
    """``id(layer) -> (path, layer)`` for every layer inside `model` (first path of a
    layer reachable twice); the model itself has the path ``()``."""
    found: dict[int, tuple[tuple[str, ...], Any]] = {}
    stack = [((), model)]
    while stack:
        path, layer = stack.pop()
        if id(layer) in found:
            continue
        found[id(layer)] = (path, layer)
        stack += [((*path, child.name), child) for child in reversed(_children(layer))]
    return found


def variable_keys(model: Any) -> dict[int, tuple[str, ...]]:
    """``id(variable) -> (group, *layer path, name)`` for every variable of `model`,
    keyed under the innermost layer that holds it."""
    keys: dict[int, tuple[str, ...]] = {}
    taken: set[tuple[str, ...]] = set()
    layers = sorted(layer_paths(model).values(), key=lambda item: -len(item[0]))
    for path, layer in layers:  # innermost first: a variable belongs to its own layer
        for v in layer.variables:
            if id(v) not in keys:
                keys[id(v)] = _unique(
                    (GROUPS[0] if v.trainable else GROUPS[1], *path), v.name, taken
                )
    return keys


def _unique(prefix: tuple[str, ...], name: str, taken: set[tuple[str, ...]]) -> tuple[str, ...]:
    """``prefix + (name,)``, or with ``_1``, ``_2``, ... added to a name already taken
    (two variables of one layer with the same name must not share a key)."""
    key, k = (*prefix, name), 0
    while key in taken:
        k += 1
        key = (*prefix, f"{name}_{k}")
    taken.add(key)
    return key


def _nested(pairs: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """The nested dict of `(key path, value)` pairs, both groups always present."""
    return {group: {} for group in GROUPS} | nest([k for k, _ in pairs], [v for _, v in pairs])


def _training_state(layer: Any) -> str | None:
    """The first layer in `layer` (itself or one it holds) whose call takes `training`
    and that has state such a call updates (a BatchNormalization's moving statistics, a
    Dropout's seed state), by class name; None where there is none."""
    for sub in layer._flatten_layers(include_self=True):
        leaf = not list(sub._flatten_layers(include_self=False))
        takes = "training" in (keywords_of(type(sub).call) or ())
        if takes and leaf and sub.non_trainable_variables:
            return type(sub).__name__
    return None


def _weights(variables: Any) -> dict[tuple[str, ...], int]:
    """Sizes of the variables Keras counts as weights: floating point, so not the
    integer states of random-seed generators (a `Dropout` has no parameters)."""
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {
        path_names(p): math.prod(jax.numpy.shape(x))
        for p, x in flat
        if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
    }


def _read(tree: dict[str, Any], key: tuple[str, ...]) -> Any:
    for part in key:
        tree = tree[part]
    return tree


def _has(tree: Any, key: tuple[str, ...]) -> bool:
    for part in key:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def keys_as_in(keys: dict[int, tuple[str, ...]], variables: Any) -> dict[int, tuple[str, ...]]:
    """`keys` (`variable_keys`) with each variable in the group `variables` hold it in.

    Setting a layer's ``trainable`` moves its variables to Keras's other list, and so to
    the other group of `variable_keys`, but not in variables split before (a slice's,
    which keep the layout it was made with)."""
    other = dict(zip(GROUPS, reversed(GROUPS), strict=True))
    out = {}
    for i, key in keys.items():
        moved = (other[key[0]], *key[1:])
        out[i] = moved if not _has(variables, key) and _has(variables, moved) else key
    return out


def held_variables(target: Any, variables: Any) -> tuple[list[Any], Any]:
    """The model's own `keras.Variable`s behind the leaves of `variables` (a slice's, as
    `split` makes them), in leaf order, and the treedef of `variables`."""
    keys = variable_keys(target)
    by_key = {keys[id(v)]: v for v in target.variables}
    flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
    return [by_key[path_names(path)] for path, _ in flat], treedef


class KerasAdapter(CollectionNodes, Adapter):
    has_collections = True
    state_includes_variables = True  # stateless_call returns every non-trainable variable
    holds_values = True
    # A Keras layer's Python attributes (a Dropout's rate, say) may change between calls
    # and are no part of a cheap key, so every slice traces the model as it is now.
    caches_traces = False
    model_class = ("keras", "Layer")

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        import keras

        if keras.backend.backend() != "jax":
            raise KerasBackendError(backend=keras.backend.backend())
        kwargs = dict(kwargs)
        mutable = kwargs.pop("mutable", False)
        inputs, mode = split_kwargs(kwargs)
        variables = self.model_variables(target)
        if not target.variables:
            raise KerasNotBuiltError()
        return Split(variables, None, tuple(args), inputs, mode, mutable)

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        import keras

        if call.rngs is not None:
            raise KerasRngsError()
        keys = keys_as_in(variable_keys(target), call.variables)
        mapping = [(v, _read(call.variables, keys[id(v)])) for v in target.variables]
        found = layer_paths(target)
        paths = {i: path for i, (path, _) in found.items() if path}
        classes = callable_classes(layer for path, layer in found.values() if path)
        # What `stateless_call` does, but through `__call__`, so that `training=` reaches
        # sublayers through Keras's call context as in `model(x, training=True)`, also
        # when the model's `call` does not take or pass on `training`.
        with marked_calls(paths, classes), keras.StatelessScope(state_mapping=mapping) as scope:
            out = target(*call.args, **call.kwargs)
        pairs = [(v, scope.get_current_value(v)) for v in target.non_trainable_variables]
        return out, _nested([(keys[id(v)], value) for v, value in pairs])

    def structure_key(self, target: Any) -> Any:
        """The layers' ``trainable`` flags: a frozen layer computes otherwise (a frozen
        `BatchNormalization` keeps its moving statistics in training mode), as a Keras
        model traces its training step again when they change."""
        return trainable_flags(target)

    def accepted_keywords(self, target: Any) -> set[str] | None:
        names = keywords_of(type(target).call)
        return None if names is None else names - {"self"}

    def model_variables(self, value: Any) -> Any:
        import keras

        if not isinstance(value, keras.Layer):
            return None
        keys = variable_keys(value)
        return _nested([(keys[id(v)], v.value) for v in value.variables])

    def variables_view(self, target: Any, variables: Any) -> Any:
        """A slice reads the model's own `keras.Variable`s, found by path once here and
        read at each use, as a Keras sub-model that shares the layers reads them."""
        held, treedef = held_variables(target, variables)
        return lambda: jax.tree_util.tree_unflatten(treedef, [v.value for v in held])

    def sliced_view(self, target: Any, sliced: Any) -> Any:
        """A `keras.Model` sharing the model's variables (`_keras_model.KerasSlice`)."""
        from ._keras_model import KerasSlice

        keys = variable_keys(target)
        by_key = {keys[id(v)]: v for v in target.variables}
        layers = {path: layer for path, layer in layer_paths(target).values()}
        return KerasSlice(sliced, by_key, layers, target)

    def assign(self, model: Any, variables: Any) -> None:
        keys = keys_as_in(variable_keys(model), variables)
        for v in model.variables:
            value = _read(variables, keys[id(v)])
            if value is not v.value:
                v.assign(value)

    def state_owner(self, path: tuple[Any, ...]) -> tuple[str, ...]:
        return path_names(path)[1:-1]  # after the group, before the variable's name

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        return {path[1:-1] for path in _weights(variables)}

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        return count_by_prefix({path[1:]: size for path, size in _weights(variables).items()})

    def edit_node(self, obj: Any, name: str, args: tuple[Any, ...]) -> NewModule | None:
        """A Keras layer, built on the values it receives; its variables sit under the
        node's name in each group (``{"trainable": {name: {"kernel": ...}}}``)."""
        import keras

        if not isinstance(obj, keras.Layer):
            return None
        if not obj.built:
            obj(*args)  # builds its variables for these shapes, as a first call does
        if moded := _training_state(obj):
            raise KerasNodeModeError(kind=moded)
        keys = variable_keys(obj)
        kind = type(obj).__name__

        def fn(values: Any, *a: Any) -> Any:
            trainable = [_read(values, keys[id(v)]) for v in obj.trainable_variables]
            fixed = [_read(values, keys[id(v)]) for v in obj.non_trainable_variables]
            out, updated = obj.stateless_call(trainable, fixed, *a)
            if any(new is not old for new, old in zip(updated, fixed, strict=True)):
                raise KerasNodeStateError(kind=kind)
            return out

        variables = _nested([(keys[id(v)], v.value) for v in obj.variables])
        return NewModule(fn, variables=variables)

    def edited_view(self, target: Any, edited: Any) -> Any:
        """A `keras.Model` sharing the model's and the inserted layers' variables
        (`_keras_edit.KerasEdited`), each found by its key in the edited model's
        variables: an inserted layer's under its node name."""
        from ._keras_edit import KerasEdited

        layout = edited.sliced.variables
        keys = keys_as_in(variable_keys(target), layout)
        variables = {keys[id(v)]: v for v in target.variables}
        layers = {path: layer for path, layer in layer_paths(target).values()}
        for name, layer in edited.nodes.items():  # after the model's: a replacing layer wins
            moved = {i: (k[0], name, *k[1:]) for i, k in variable_keys(layer).items()}
            node_keys = keys_as_in(moved, layout)
            variables.update({node_keys[id(v)]: v for v in layer.variables})
            layers.update({(name, *path): sub for path, sub in layer_paths(layer).values()})
        return KerasEdited(edited.sliced, variables, layers, target, edited.nodes)

    def node_name(self, obj: Any) -> str | None:
        import keras

        return obj.name if isinstance(obj, keras.Layer) else None

    def variable_names(self, variables: Any) -> set[str]:
        return {str(k) for group in variables.values() for k in group}
