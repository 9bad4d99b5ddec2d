"""The result of slicing an NNX model: an `nnx.Module` that shares the model's variables.

`SlicedModule` holds the original submodules the slice needs (and, for variables the root
module owns directly, the original `nnx.Variable`s), so its parameters, batch statistics
and RNG state *are* the model's: training the slice trains the model, and
``sub.train()``/``sub.eval()`` switch those submodules. What to compute comes from the engine
(`Any`), which caches one compiled program per input signature and per graph
definition of the model (so a changed flag or submodule re-traces, and an unchanged one
does not). Each call reads the current variable values, runs only the
sliced program and writes back the state it updated (batch statistics, RNG counters).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from .. import _compat
from .._errors import NNXModeVariablesError, NNXSliceExportStateError, NNXSliceNotCopyableError
from .._view import ProgramView
from ._nnx_state import get_value, set_value
from ._parts import held_paths


class _Static:
    """Data an NNX graph must treat as static: compared and hashed by identity."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"<jaxslice slice {self.program.start!r} -> {self.program.end!r}>"


def _held(root: Any, program: Any) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The module paths (and loose variable paths) a slice must hold."""
    modules = [tuple(p) for p, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)]
    return held_paths(modules, program)


class SlicedModule(ProgramView, nnx.Module):
    """A slice of an NNX model, itself an `nnx.Module` sharing the model's variables.

    Create one with ``js.slice(model, *inputs, start=..., end=...)``. Calling it runs
    only the slice; `nnx.jit`, `nnx.grad` and ``nnx.Optimizer(sub, tx, wrt=nnx.Param)``
    work on it as on any module, and training it updates the original model.
    """

    def __init__(self, root: Any, program: Any):
        part_paths, loose_paths = _held(root, program)
        nodes = dict(nnx.iter_graph(root))
        self.parts = nnx.List([nodes[p] for p in part_paths])
        self.loose = nnx.List([nodes[p] for p in loose_paths])
        self._jaxslice = _Static(
            program=program,
            root=root,
            part_paths=part_paths,
            loose_paths=loose_paths,
        )

    def _slice_program(self) -> Any:
        return self._jaxslice.program

    def _variables_by_path(self) -> dict[tuple[Any, ...], Any]:
        meta = self._jaxslice
        found: dict[tuple[Any, ...], Any] = {}
        for prefix, module in zip(meta.part_paths, self.parts, strict=True):
            for path, node in nnx.iter_graph(module):
                if isinstance(node, nnx.Variable):
                    found.setdefault(prefix + tuple(path), node)
        for path, var in zip(meta.loose_paths, self.loose, strict=True):
            found[path] = var
        return found

    def __reduce__(self) -> Any:
        raise NNXSliceNotCopyableError()

    def __deepcopy__(self, memo: Any) -> Any:
        raise NNXSliceNotCopyableError()

    def export(self, *, batch: str | None = "b", platforms: Any = None) -> Any:
        """The slice as a `jax.export.Exported` with a symbolic batch size, in its current
        mode, with the current values of its variables built in.

        Args:
          batch: the name of a symbolic leading (batch) dimension for every input that
            has axes, or None to export at the traced shapes.
          platforms: as for `jax.export.export` (default: the current platform).

        Raises:
          SliceError: if the slice updates state in its current mode (train mode with
            batch statistics or dropout): call ``sub.eval()`` first.
        """
        program = self._jaxslice.program

        def run(*inputs: Any, **kw: Any) -> Any:
            entry, _ = program.lookup(inputs, kw, None, True)
            if entry.plan.state_paths:  # written back by a call: not a pure function
                names = sorted({"/".join(map(str, p)) for p in entry.plan.state_paths})
                raise NNXSliceExportStateError(names=names[:6])
            return self(*inputs, **kw)

        dim = jax.export.symbolic_shape(batch)[0] if batch is not None else None
        args, kwargs = program.input_specs(dim)
        return jax.export.export(jax.jit(run), platforms=platforms)(*args, **kwargs)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        program = self._jaxslice.program
        entry, leaves = program.lookup(inputs, kwargs, None, True)
        variables = self._variables_by_path()
        missing = [
            p for p in entry.plan.variable_paths + entry.plan.state_paths if p not in variables
        ]
        if missing:
            paths = ", ".join("/".join(map(str, p)) for p in missing[:6])
            raise NNXModeVariablesError(paths=paths)
        values = [get_value(variables[p]) for p in entry.plan.variable_paths]
        result, state = program.run(entry, values, [], leaves, True)
        for path, value in state:
            set_value(variables[path], value)
        return result


_compat.register_frames_exclusion(__file__)
