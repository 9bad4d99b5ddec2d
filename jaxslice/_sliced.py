"""`js.Sliced`: what users hold for a slice of a linen model or a plain function.

A thin view over the engine (`_core.program.SliceProgram`): linen's calling conventions
(`apply` with `rngs` and `mutable`), the variables round trip (`variables`, `extract`,
`merge`) and drawing. Variables are passed explicitly, in the same nesting as the
model's, pruned to what the slice reads; `sub.variables` holds the original arrays (no
copies). For a model that holds variable objects its slices share (Keras,
`Adapter.variables_view`), `sub.variables` is read from them at each use, so a slice
computes with the model's current values, as a Keras sub-model sharing the layers does;
the program then keeps only their shapes.
"""

from __future__ import annotations

from typing import Any

from . import _compat
from ._core import exporting
from ._core.program import SliceProgram
from ._errors import SliceNotPicklableError
from ._view import ProgramView


class Sliced(ProgramView):
    """A sub-network between named boundaries, as a standalone jit-compiled function.

    Create one with `js.slice`. Call it as ``sub(*inputs)`` with its own variables, or
    ``sub.apply(variables, *inputs)`` with variables of the same structure as
    ``sub.variables`` (for example after training them).

    Attributes:
      variables: the model variables the slice reads, with the model's nesting and keys
        (every collection), holding the model's own arrays (not copies: copy them, e.g.
        ``jax.tree.map(jnp.copy, sub.variables)``, before passing them to a function
        that donates its arguments, or the model loses them too). For a Keras model,
        the values its variables hold when `variables` is read (after ``merge``,
        ``model.fit`` or ``variable.assign``, the new ones); ``sub(x)`` reads them too.
      start: the `start` it was sliced with; end: the `end`.
      build_info: a `BuildInfo`: time spent tracing and planning, equations, and
        whether tracing stopped early.
    """

    def __init__(self, program: SliceProgram):
        self._program = program
        # Where the model holds the variables (Keras), they are read at each use.
        self._view = program.variables_view
        self._variables = program.variables
        self._call = program.call  # the usual call (`JitCalls.call`)

    def _slice_program(self) -> SliceProgram:
        return self._program

    @property
    def variables(self) -> Any:
        view = self._view
        return self._variables if view is None else view()

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs:
            return self.apply(self.variables, *inputs, **kwargs)
        view = self._view
        return self._call(self._variables if view is None else view(), inputs)

    def apply(
        self, variables: Any, *inputs: Any, rngs: Any = None, mutable: Any = False, **kwargs: Any
    ) -> Any:
        """Runs the slice with the given variables, with linen's conventions.

        Args:
          variables: variables with the structure of ``sub.variables``.
          *inputs: the slice's inputs, one per start argument (see `js.slice`).
          rngs: random keys, as for the model's ``apply`` (``{"dropout": key}``); the
            same keys give the same random numbers as in the full model.
          mutable: collections whose updates to return, as for linen's ``apply``.
          **kwargs: keyword inputs of the start boundaries, and mode keywords (such as
            ``train=True``) passed to the model; each new mode is traced once and cached.

        Returns:
          The values at ``end`` (one pytree, a tuple or a dict, as ``end`` was given);
          with `mutable`, ``(values, updated_state)`` where the state holds only the
          slice's own entries.

        Raises:
          VariablesMismatchError: if `variables` do not have the paths, shapes and dtypes
            of ``sub.variables``.
        """
        if rngs is None and mutable is False and not kwargs:
            return self._call(variables, inputs)
        return self._program.apply(variables, inputs, kwargs, rngs, mutable)

    def extract(self, full_variables: Any) -> Any:
        """The slice's part of a model's full variables (the inverse of `merge`).

        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
        >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
        >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
        >>> head = js.slice(model, variables, jnp.ones((1, 3)), start="layers_1")
        >>> list(head.extract(variables)["params"])
        ['layers_1']
        """
        return self._program.extract(full_variables)

    def merge(self, full_variables: Any, new_variables: Any) -> Any:
        """The model's variables with the slice's entries replaced by `new_variables`.

        The fine-tune-then-write-back round trip: `new_variables` has the structure of
        ``sub.variables`` (or is a part of it, such as the updated state returned with
        `mutable`). Leaves outside it are the same objects as in `full_variables`.

        Raises:
          VariablesMismatchError: if `new_variables` holds a path the model does not have,
            or a leaf of another shape or dtype than the model's.
        """
        return self._program.merge(full_variables, new_variables)

    def export(
        self, *, batch: str | None = "b", variables_as_input: bool = False, platforms: Any = None
    ) -> Any:
        """The slice as a `jax.export.Exported`, with a symbolic batch size.

        Args:
          batch: the name of a symbolic leading (batch) dimension for every input that
            has axes (scalars keep their shape), or None to export at the traced shapes.
          variables_as_input: export ``fn(variables, *inputs)`` instead of ``fn(*inputs)``
            with ``sub.variables`` built into the program as constants.
          platforms: as for `jax.export.export` (default: the current platform).

        Returns:
          A `jax.export.Exported` of the slice in the mode it was made with; call it
          (``exported.call(x)``), or serialise it (``exported.serialize()``) to run it
          without Python.

        Raises:
          SliceError: if the slice draws random numbers or updates state in its mode
            (export it in evaluation mode), or an input holds leaves the trace fixed.

        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
        >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
        >>> variables = model.init(jax.random.key(0), jnp.ones((3, 5)))
        >>> head = js.slice(model, variables, jnp.ones((3, 5)), start="layers_2")
        >>> head.export().call(jnp.ones((7, 4))).shape
        (7, 2)
        >>> head.export(variables_as_input=True).call(head.variables, jnp.ones((2, 4))).shape
        (2, 2)
        """
        # The slice reads no random keys, but re-tracing the model at the symbolic batch
        # size runs the whole model, whose other modules may need the keys it was sliced with.
        rngs = self._program.sample_rngs

        def run(variables: Any, *inputs: Any, **kw: Any) -> Any:
            return self.apply(variables, *inputs, rngs=rngs, **kw)

        return exporting.export(
            self._program.base,
            run,
            self.variables,
            batch=batch,
            variables_as_input=variables_as_input,
            platforms=platforms,
        )

    def __repr__(self) -> str:
        return f"Sliced({self._program.summary()})"

    def __reduce__(self) -> Any:
        raise SliceNotPicklableError()


_compat.register_frames_exclusion(__file__)
