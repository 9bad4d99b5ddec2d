"""What `js.slice` returns for a Keras model: `KerasSlice`, a `keras.Model` that shares
the model's variables, as ``keras.Model(inputs, layer.output)`` shares its layers.

``sub(x)`` and ``sub.predict(x)`` run the slice's compiled program on the values the
model's own `keras.Variable`s hold (read through ``v.value``, so inside Keras's
`StatelessScope`, as ``fit`` uses it, the scoped values are used). Its
``trainable_variables`` / ``non_trainable_variables`` are those variables themselves
(not copies), so ``sub.compile(...)``, ``sub.fit(...)`` train the model's own layers.
A call in training mode (``sub(x, training=True)``, and so ``fit``) assigns the new
non-trainable values (moving statistics, seed states) to those variables, as Keras's
layers do. ``sub.variables`` stays jaxslice's nested dict of current values (as for
`js.Sliced`); Keras's flat list is ``sub.weights``. An explicit ``training=`` is a mode
keyword (traced once per mode). The underlying `js.Sliced` is ``sub.sliced``.

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
from typing import Any

import jax
import keras
import numpy as np

from .._errors import KerasNotSavableError, SliceError
from .._trees import nest, path_names
from .._view import ProgramView
from ._base import ENTRY_POINTS


def _spec(x: Any) -> dict[str, Any]:
    return {"shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype)}


def _is_spec(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == {"shape", "dtype"}


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda s: np.zeros(s["shape"], s["dtype"]), tree, is_leaf=_is_spec)


@dataclasses.dataclass(frozen=True)
class _Model:
    """What a `KerasSlice` runs (`sliced`) and the model's variables by key and layers
    by path (as `_keras.variable_keys` and `_keras.layer_paths` find them)."""

    sliced: Any
    variables: dict[tuple[str, ...], Any]
    layers: dict[tuple[str, ...], Any]


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
        **kwargs: Any,
    ):
        """`variables`: the model's `keras.Variable`s by key (``(group, *layer path,
        name)``, as the slice's variables are nested); `layers`: its layers by path."""
        super().__init__(**{"name": "jaxslice_slice", **kwargs})
        # Not a list, dict or tuple, which Keras's saving would walk for layers to save.
        object.__setattr__(self, "_js", _Model(sliced, variables, layers))
        object.__setattr__(self, "_held", None)
        self.built = True

    def _held_keys(self) -> list[tuple[str, ...]]:
        """The keys of the model's variables that Keras sees as this model's: those the
        slice reads, and those it reads or updates in training mode (a Dropout's seed
        state, which inference does not read), so that ``fit`` carries their updates."""
        return self._training()[0]

    def _training(self) -> tuple[list[tuple[str, ...]], bool]:
        """(`_held_keys`, whether training mode updates state), found by tracing the
        training mode once, the first time Keras (or a training call) asks."""
        if self._held is None:
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
            object.__setattr__(self, "_held", (list(dict.fromkeys(keys)), updates))
        return self._held

    # -- jaxslice's side
    def _slice_program(self) -> Any:
        return self.sliced._slice_program()

    @property
    def sliced(self) -> Any:
        """The `js.Sliced` this model runs (``apply``, ``export``, ...)."""
        return self._js.sliced

    @property
    def variables(self) -> Any:  # jaxslice's nested dict, as `js.Sliced.variables`
        return self.sliced.variables

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
        by_key = self._js.variables
        return [by_key[k] for k in self._held_keys()]

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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # jaxslice's own keywords (updated state, keys) return what `js.Sliced` returns,
        # which Keras's call machinery would not pass through.
        if "mutable" in kwargs or "rngs" in kwargs:
            return self.sliced(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def call(self, inputs: Any, *more: Any, training: Any = None, **kwargs: Any) -> Any:
        sliced, by_key = self._js.sliced, self._js.variables
        args = (*(tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)), *more)
        if training is not None:  # a mode keyword, traced once per mode
            kwargs["training"] = training
        # The held variables' `value`s now: inside `fit`'s StatelessScope, the scoped ones.
        if not (isinstance(training, (bool, np.bool_)) and training and self._training()[1]):
            return sliced.apply(sliced.variables, *args, **kwargs)
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
        return f"KerasSlice({self._slice_program().summary()})"

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
        model = keras.saving.deserialize_keras_object(config["model"])
        inputs, keywords = _zeros(config["inputs"]), _zeros(config["keyword_inputs"])
        extra = {} if config["mutable"] is False else {"mutable": config["mutable"]}
        sub = ENTRY_POINTS["slice"](
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
