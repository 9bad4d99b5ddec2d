"""What `js.edit(...).build()` returns for a Keras model: `KerasEdited`, a `keras.Model`.

Like a Keras slice (`_keras_model.KerasSlice`, whose machinery it shares), the edited
model holds the model's own `keras.Variable`s, and those of the layers an edit inserted
(each under the edit's name in `variables`, as `_keras.KerasAdapter.edit_node` puts
them): calling it, ``fit``, ``evaluate`` and ``predict`` read their current values, and
training it trains the model's layers in place together with the inserted ones. That
is how an edited Keras model is merged back: the model as trained, without the
inserted layers, is the model itself (``edited.model``), and the inserted layers, with
their trained variables, are ``edited.nodes`` (``{name: layer}``, also
``edited.get_layer(name)``). ``edited.merge(model, variables)`` writes variables trained
outside Keras (``jax.grad`` over ``edited.variables``) into both, as a slice's `merge`
writes into the model.

Keras's weight files work (``save_weights``/``load_weights`` save the layers that hold
the edited model's variables, the inserted ones under their edit's name); a ``.keras``
file does not: Keras rebuilds a model from its config, and an edit's functions have
none (`KerasEditedNotSavableError` says what to save instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._errors import KerasEditedNotSavableError, KerasEditedOtherModelError
from .._trees import path_names
from ._keras_model import KerasSlice


class KerasEdited(KerasSlice):
    """An edited Keras model: a `keras.Model` holding the model's layers and the layers
    inserted by the edits, sharing their variables.

    Made by ``js.edit(model, *inputs)....build()`` for a Keras model; see the module's
    docstring for what it holds and how it is trained and saved.
    """

    def __init__(
        self,
        sliced: Any,
        variables: dict[tuple[str, ...], Any],
        layers: dict[tuple[str, ...], Any],
        model: Any,
        nodes: dict[str, Any],
        **kwargs: Any,
    ):
        """As `KerasSlice`, with the inserted layers' variables and layers among the
        model's (under their node names), and `nodes`, the inserted layers by name."""
        super().__init__(sliced, variables, layers, model, **{"name": "jaxslice_edited", **kwargs})
        object.__setattr__(self, "_nodes", dict(nodes))

    @property
    def model(self) -> Any:
        """The Keras model that was edited: its variables are this edited model's, so
        after training it is the model as trained, without the inserted layers."""
        return self._js.model

    @property
    def nodes(self) -> dict[str, Any]:
        """The inserted Keras layers by the edit's name (their variables trained with the
        edited model's)."""
        return dict(self._nodes)

    def get_layer(self, name: str | None = None, index: int | None = None) -> Any:
        """An inserted layer by its edit's name, else the model's layer (`keras.Model`'s
        ``get_layer``)."""
        if name in self._nodes:
            return self._nodes[name]
        return self.model.get_layer(name, index)

    def merge(self, model: Any, variables: Any) -> Any:
        """Writes `variables` (nested as ``edited.variables``, e.g. trained with
        `jax.grad`) into the model's and the inserted layers' own variables, and returns
        the model, trained, without the inserted layers (``edited.nodes`` hold theirs).

        Given the model's variables as a nested dict instead (as `split` makes them), it
        returns them with the model's entries of `variables` in place, as for a linen
        edited model, and writes nothing.

        Raises:
          SliceError: if `model` is not the model that was edited, or `variables` differ
            from ``edited.variables`` in structure, shape or dtype.
        """
        if isinstance(model, Mapping):
            return self.sliced.merge(model, variables)
        if model is not self.model:
            raise KerasEditedOtherModelError(expected=repr(self.model.name), got=repr(model))
        program = self._slice_program()
        entry = program.base
        leaves = program.variable_leaves(entry, variables)  # checked as `apply` checks them
        by_key = self._js.variables
        for path, value in zip(entry.plan.variable_paths, leaves, strict=True):
            held = by_key[path_names(path)]
            if value is not held.value:
                held.assign(value)
        return model

    def export(self, **kwargs: Any) -> Any:
        """The edited model as a `jax.export.Exported` with the current values of its
        variables built in (see `js.Sliced.export`)."""
        return self.sliced.export(variables=self.variables, **kwargs)

    def get_config(self) -> dict[str, Any]:
        raise KerasEditedNotSavableError()
