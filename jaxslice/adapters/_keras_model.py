"""What `js.slice` returns for a Keras model: `KerasSlice`, a `keras.Model` that shares
the model's variables, as ``keras.Model(inputs, layer.output)`` shares its layers.

``sub(x)`` and ``sub.predict(x)`` run the slice's compiled program on the values the
model's own `keras.Variable`s hold (read through ``v.value``, so inside Keras's
`StatelessScope`, as ``fit`` uses it, the scoped values are used). Its
``trainable_variables`` / ``non_trainable_variables`` are those variables themselves
(not copies), so ``sub.compile(...)``, ``sub.fit(...)`` train the model's own layers;
they follow the layers' ``trainable`` flags as they are now, as a functional sub-model's
do. A call in training mode (``sub(x, training=True)``, and so ``fit``) assigns the new
non-trainable values (moving statistics, seed states) to those variables, as Keras's
layers do. ``sub.variables`` stays jaxslice's nested dict of current values (as for
`js.Sliced`); Keras's flat list is ``sub.weights``. An explicit ``training=`` is a mode
keyword (traced once per mode). The underlying `js.Sliced` is ``sub.sliced``.

Inputs follow Keras's convention (`_keras_inputs`): one value, a list in input order or
a dict keyed by input name (``sub.input_names``), so ``fit``, ``predict`` and
``evaluate`` take them as a functional model does; several positional arguments or
keyword inputs (``sub(h, padding_mask=m)``) are the slice's own arguments, as for a
`js.Sliced`. Keras's JAX trainer detaches the variables it trains from their values
while ``fit``, ``evaluate`` or ``predict`` runs; if one of those fails, the slice puts
back the values of the variables left detached, which are the model's own.

Keras's own files work through it: the slice tracks the layers that hold its variables,
so ``save_weights``/``load_weights`` save and write those layers' variables (the
model's), and ``sub.save("s.keras")`` stores the whole model's config, the slice's
``start``/``end`` and sample shapes (`get_config`) with the weights;
``keras.saving.load_model`` rebuilds the model from its config and slices it again
(`from_config`), then loads the weights. Keras is imported only here, when a Keras
model is sliced (or ``js.KerasSlice`` is asked for, which a new process loading a
``.keras`` file of a slice needs first, to register the class).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np

from .._errors import KerasNotSavableError, SliceError
from .._trees import nest, path_names
from .._view import ProgramView
from ._base import split_kwargs
from ._keras_inputs import from_keras, input_names


def _spec(x: Any) -> dict[str, Any]:
    return {"shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype)}


def _is_spec(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == {"shape", "dtype"}


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda s: np.zeros(s["shape"], s["dtype"]), tree, is_leaf=_is_spec)


@dataclasses.dataclass(frozen=True)
class _Model:
    """What a `KerasSlice` runs (`sliced`), the model's variables by key and layers by
    path (as `_keras.variable_keys` and `_keras.layer_paths` find them), the model,
    and the keys of the variables the slice reads in its own mode, nested as `treedef`."""

    sliced: Any
    variables: dict[tuple[str, ...], Any]
    layers: dict[tuple[str, ...], Any]
    model: Any
    keys: tuple[tuple[str, ...], ...]
    treedef: Any


def _restoring(method: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's `method` (``fit``, ``predict``, ...), which puts back the values of the
    variables it leaves detached when it fails.

    Keras's JAX trainer takes the values out of the variables it runs (to hold them
    once, in its own state) and puts them back at the end; a failure in between (an
    input of the wrong shape) leaves them detached. A slice's variables are the model's,
    so that would break the model and every slice of it."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = getattr(self, "optimizer", None)
        held = [*self.weights, *getattr(optimizer, "variables", []), *self.metrics_variables]
        saved = [(v, v.value) for v in held]
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self.jax_state_sync()  # what the steps that ran computed, as `fit` keeps it
            for v, value in saved:
                if getattr(v, "_value", value) is None:  # what Keras's trainer detached
                    v.assign(value)
            raise

    return run


@keras.saving.register_keras_serializable(package="jaxslice")
class KerasSlice(ProgramView, keras.Model):
    """A slice of a Keras model, itself a `keras.Model` sharing the model's variables.

    Made by `js.slice` for a `keras.Layer` or `keras.Model` on the JAX backend; see the
    module's docstring for what Keras's methods do with it.
    """

    def __init__(
        self,
        sliced: Any,
        variables: dict[tuple[str, ...], Any],
        layers: dict[tuple[str, ...], Any],
        model: Any = None,
        **kwargs: Any,
    ):
        """`variables`: the model's `keras.Variable`s by key (``(group, *layer path,
        name)``, as the slice's variables are nested), in the model's order; `layers`: its
        layers by path; `model`: the Keras model (which names its inputs)."""
        super().__init__(**{"name": "jaxslice_slice", **kwargs})
        flat, treedef = jax.tree_util.tree_flatten_with_path(sliced.variables)
        keys = tuple(path_names(p) for p, _ in flat)
        # Not a list, dict or tuple, which Keras's saving would walk for layers to save.
        object.__setattr__(self, "_js", _Model(sliced, variables, layers, model, keys, treedef))
        object.__setattr__(self, "_held", None)
        object.__setattr__(self, "_names", None)
        self.built = True

    def _held_keys(self) -> list[tuple[str, ...]]:
        """The keys of the model's variables that Keras sees as this model's: those the
        slice reads, and those it reads or updates in training mode (a Dropout's seed
        state, which inference does not read), so that ``fit`` carries their updates."""
        return self._training()[0]

    def _training(self) -> tuple[list[tuple[str, ...]], bool]:
        """(`_held_keys`, whether training mode updates state), found by tracing the
        training mode the first time Keras (or a training call) asks, and again once the
        layers' `trainable` flags changed (a frozen `BatchNormalization` keeps its moving
        statistics; the model is traced again for its new flags too)."""
        flags = tuple(layer.trainable for layer in self._js.layers.values())
        if self._held is None or self._held[0] != flags:
            flat = jax.tree_util.tree_flatten_with_path(self.sliced.variables)[0]
            keys, updates = [path_names(p) for p, _ in flat], False
            program = self._slice_program()
            mode = {**program.base.traced.split.mode, "training": True}
            try:
                args, kwargs = jax.tree.map(
                    lambda a: np.zeros(a.shape, a.dtype), program.input_specs()
                )
                entry, _ = program.lookup(tuple(args), {**kwargs, **mode}, None, ["non_trainable"])
            except SliceError:  # no training mode: a training call raises its own error
                pass
            else:
                keys += [path_names(p) for p in entry.plan.variable_paths]
                updates = bool(entry.plan.state_paths)
            object.__setattr__(self, "_held", (flags, list(dict.fromkeys(keys)), updates))
        return self._held[1:]

    # -- jaxslice's side
    def _slice_program(self) -> Any:
        return self.sliced._slice_program()

    @property
    def sliced(self) -> Any:
        """The `js.Sliced` this model runs (``apply``, ``export``, ...)."""
        return self._js.sliced

    @property
    def variables(self) -> Any:
        """jaxslice's nested dict of the current values of the variables the slice reads,
        as `js.Sliced.variables` (Keras's flat list of them is `weights`)."""
        by_key = self._js.variables
        return jax.tree_util.tree_unflatten(
            self._js.treedef, [by_key[k].value for k in self._js.keys]
        )

    @property
    def input_names(self) -> list[str]:
        """The names of the slice's input arrays, in order: the keys of a dict of inputs
        (see `_keras_inputs`)."""
        if self._names is None:
            arguments = self._slice_program().base.plan.arguments
            object.__setattr__(self, "_names", input_names(arguments, self._js.model))
        return list(self._names)

    def apply(self, variables: Any, *inputs: Any, **kwargs: Any) -> Any:
        return self.sliced.apply(variables, *inputs, **kwargs)

    def merge(self, full_variables: Any, new_variables: Any) -> Any:
        return self.sliced.merge(full_variables, new_variables)

    def extract(self, full_variables: Any) -> Any:
        return self.sliced.extract(full_variables)

    def export(self, **kwargs: Any) -> Any:
        return self.sliced.export(**kwargs)

    # -- Keras's side: the model's own variables
    @property
    def weights(self) -> list[Any]:
        held = set(self._held_keys())
        return [v for k, v in self._js.variables.items() if k in held]  # the model's order

    @property
    def trainable_variables(self) -> list[Any]:
        return [v for v in self.weights if v.trainable] if self.trainable else []

    @property
    def non_trainable_variables(self) -> list[Any]:
        held = self.weights
        return held if not self.trainable else [v for v in held if not v.trainable]

    trainable_weights = trainable_variables
    non_trainable_weights = non_trainable_variables

    @property
    def _slice_layers(self) -> list[Any]:
        """The innermost layers holding the slice's variables, each once: what Keras's
        weight files (`save_weights`, `.keras`) save and load through this model (a
        property, so that Keras's saving finds it among the attributes and nothing else
        tracks the layers twice)."""
        layers = self._js.layers
        return list(
            {id(layer): layer for k in self._held_keys() for layer in [layers[k[1:-1]]]}.values()
        )

    fit = _restoring(keras.Model.fit)
    evaluate = _restoring(keras.Model.evaluate)
    predict = _restoring(keras.Model.predict)
    train_on_batch = _restoring(keras.Model.train_on_batch)
    test_on_batch = _restoring(keras.Model.test_on_batch)
    predict_on_batch = _restoring(keras.Model.predict_on_batch)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # jaxslice's own keywords (updated state, keys) return what `js.Sliced` returns,
        # which Keras's call machinery would not pass through.
        if "mutable" in kwargs or "rngs" in kwargs:
            return self.sliced.apply(self.variables, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def call(self, inputs: Any, *more: Any, training: Any = None, **kwargs: Any) -> Any:
        sliced, by_key = self._js.sliced, self._js.variables
        if more or split_kwargs(kwargs)[0]:  # the slice's own arguments, as `js.Sliced`'s
            args = (inputs, *more)
        else:  # Keras's one value: an array, a list in input order, a dict by input name
            arguments = self._slice_program().base.plan.arguments
            args, keywords = from_keras(inputs, arguments, self.input_names)
            kwargs.update(keywords)
        if training is not None:  # a mode keyword, traced once per mode
            kwargs["training"] = training
        # The held variables' `value`s now: inside `fit`'s StatelessScope, the scoped ones.
        if not (isinstance(training, (bool, np.bool_)) and training and self._training()[1]):
            return sliced.apply(self.variables, *args, **kwargs)
        # Training mode: read what that mode reads, and assign the new moving statistics
        # and seed states to the model's variables, as Keras's layers assign them (in
        # `fit`, to the scope's).
        keys = self._held_keys()
        values = nest(keys, [by_key[k].value for k in keys])
        program = self._slice_program()
        out, state = program.apply(values, args, kwargs, None, ["non_trainable"], strict=False)
        for path, value in jax.tree_util.tree_flatten_with_path(state)[0]:
            by_key[path_names(path)].assign(value)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._slice_program().summary()})"

    # -- Keras's saving: a `.keras` file holds the model's config and how it was sliced
    def get_config(self) -> dict[str, Any]:
        program = self._slice_program()
        split = program.base.traced.split
        try:
            model = keras.saving.serialize_keras_object(program.target)
        except NotImplementedError as e:
            why = f"the model has no config ({type(program.target).__name__}.get_config: {e})"
            raise KerasNotSavableError(why=why) from None
        return {
            "name": self.name,
            "model": model,
            "start": program.start,
            "end": program.end,
            "inputs": jax.tree.map(_spec, list(split.args)),
            "keyword_inputs": jax.tree.map(_spec, dict(split.kwargs)),
            "mode": dict(split.mode),
            "mutable": split.mutable,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KerasSlice:
        # Keras rebuilds the slice the way a user makes one: through the public
        # `jaxslice.slice`, imported when this runs (the package is fully imported by
        # then). Importing `_slice` or the Keras adapter instead would close an import
        # cycle, as both make `KerasSlice`s.
        import jaxslice

        model = keras.saving.deserialize_keras_object(config["model"])
        inputs, keywords = _zeros(config["inputs"]), _zeros(config["keyword_inputs"])
        extra = {} if config["mutable"] is False else {"mutable": config["mutable"]}
        sub = jaxslice.slice(
            model,
            *inputs,
            start=config["start"],
            end=config["end"],
            **keywords,
            **config["mode"],
            **extra,
        )
        sub.name = config["name"]
        return sub
