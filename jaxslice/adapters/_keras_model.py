"""What `js.slice` returns for a Keras model: `KerasSlice`, a `keras.Model` that shares
the model's variables, as ``keras.Model(inputs, layer.output)`` shares its layers.

``sub(x)`` and ``sub.predict(x)`` run the slice's compiled program on the values the
model's own `keras.Variable`s hold (read through ``v.value``, so inside Keras's
`StatelessScope`, as ``fit`` uses it, the scoped values are used). Its
``trainable_variables`` / ``non_trainable_variables`` are those variables themselves
(not copies), so ``sub.compile(...)``, ``sub.fit(...)`` train the model's own layers.
``sub.variables`` stays jaxslice's nested dict of current values (as for `js.Sliced`);
Keras's flat list is ``sub.weights``. An explicit ``training=`` is a mode keyword (traced
once per mode). The underlying `js.Sliced` is ``sub.sliced``. Keras is imported only
here, when a Keras model is sliced.

Sharp edges: Keras's own weight files (``save_weights``/``load_weights``, ``.keras``)
do not yet reach the shared variables through a slice (save the model itself); ``fit``
in training mode of a slice whose layers update state (BatchNormalization) raises, as
calling it with ``training=True`` without ``mutable`` does.
"""

from __future__ import annotations

from typing import Any

import keras

from .._core.view import ProgramView


class KerasSlice(ProgramView, keras.Model):
    """A slice of a Keras model, itself a `keras.Model` sharing the model's variables."""

    def __init__(self, sliced: Any, held: list[Any]):
        super().__init__(name="jaxslice_slice")
        object.__setattr__(self, "_js", (sliced, tuple(held)))
        self.built = True

    # -- jaxslice's side
    def _slice_program(self) -> Any:
        return self.sliced._slice_program()

    @property
    def sliced(self) -> Any:
        """The `js.Sliced` this model runs (``apply``, ``export``, ...)."""
        return self._js[0]

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
        return list(self._js[1])

    @property
    def trainable_variables(self) -> list[Any]:
        return [v for v in self._js[1] if v.trainable] if self.trainable else []

    @property
    def non_trainable_variables(self) -> list[Any]:
        if not self.trainable:
            return list(self._js[1])
        return [v for v in self._js[1] if not v.trainable]

    trainable_weights = trainable_variables
    non_trainable_weights = non_trainable_variables

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # jaxslice's own keywords (updated state, keys) return what `js.Sliced` returns,
        # which Keras's call machinery would not pass through.
        if "mutable" in kwargs or "rngs" in kwargs:
            return self.sliced(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def call(self, inputs: Any, *more: Any, training: Any = None, **kwargs: Any) -> Any:
        sliced = self.sliced
        args = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        if training is not None:  # a mode keyword, traced once per mode
            kwargs["training"] = training
        # `sliced.variables` reads the held variables' `value`s now: inside `fit`'s
        # StatelessScope, the scoped ones.
        return sliced.apply(sliced.variables, *args, *more, **kwargs)

    def __repr__(self) -> str:
        return f"KerasSlice({self._slice_program().summary()})"
