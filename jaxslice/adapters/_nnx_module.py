"""The result of slicing an NNX model: an `nnx.Module` that shares the model's variables.

`SlicedModule` holds the original submodules the slice needs (and, for variables the root
module owns directly, the original `nnx.Variable`s), so its parameters, batch statistics
and RNG state *are* the model's: training the slice trains the model, and
``sub.train()``/``sub.eval()`` switch those submodules. What to compute comes from the engine
(`Any`), which caches one compiled program per input signature and per graph
definition of the model (so a changed flag or submodule re-traces, and an unchanged one
does not). Each call reads the current variable values, runs only the
sliced program and writes back the state it updated (batch statistics, RNG counters).

Plain arrays the model holds as attributes are state as well (`nnx.state` lists them),
but they are values, not shared objects: one is changed by reassigning the attribute.
Those of the submodules the slice holds are read from those submodules at each call.
Those the root module holds itself are kept in `loose` like its variables, and an
eager call first reconciles them with the root by identity: the root's array if the
attribute was reassigned, else the slice's if a transform of the slice (`nnx.jit`)
updated it. Inside a transform the slice uses the arrays it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from .. import _compat
from .._core.checks import check_leaves, check_numbers
from .._errors import (
    NNXModeVariablesError,
    NNXSliceExportStateError,
    NNXSliceNotCopyableError,
    NNXSlicePartReplacedError,
)
from .._trees import is_array
from .._view import ProgramView
from ._nnx_state import assign, flat_state, get_value, is_variable, set_value
from ._parts import held_paths


class _Static:
    """Data an NNX graph must treat as static: compared and hashed by identity."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"<jaxslice slice {self.program.start!r} -> {self.program.end!r}>"


def _held(root: Any, program: Any) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The module paths (and loose variable paths) a slice must hold: also each variable
    that held a Python number when traced, to check at each call that it still does."""
    modules = [tuple(p) for p, node in nnx.iter_graph(root) if isinstance(node, nnx.Module)]
    parts, loose = held_paths(modules, program)
    numbers = program.base.traced.graph.number_variables
    inside = lambda p: any(p[: len(m)] == m for m in parts)  # noqa: E731
    return parts, loose + [p for p in numbers if p not in loose and not inside(p)]


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
            # the root's plain arrays by position in `loose`: the array last agreed on
            agreed={i: nodes[p] for i, p in enumerate(loose_paths) if not is_variable(nodes[p])},
        )

    def _slice_program(self) -> Any:
        return self._jaxslice.program

    def _variables_by_path(self) -> dict[tuple[Any, ...], Any]:
        meta = self._jaxslice
        found: dict[tuple[Any, ...], Any] = {}
        for prefix, module in zip(meta.part_paths, self.parts, strict=True):
            for path, node in nnx.iter_graph(module):
                if isinstance(node, nnx.Variable) or is_array(node):
                    found.setdefault(prefix + tuple(path), node)
        for path, var in zip(meta.loose_paths, self.loose, strict=True):
            found[path] = var
        return found

    def _root_arrays(self) -> dict[tuple[Any, ...], Any]:
        """The plain arrays the root holds itself, by path, reconciled with the root:
        the root's where the attribute was reassigned, else the slice's (a transform of
        the slice may have updated it). Outside transforms, both then agree."""
        meta, found = self._jaxslice, {}
        eager = not _compat.tracing()
        for i, agreed in meta.agreed.items():
            held, path = self.loose[i], meta.loose_paths[i]
            if not isinstance(held, _CONCRETE):
                continue  # an input of a transform of the slice: used as it is
            current = _at(meta.root, path)
            found[path] = value = current if current is not agreed else held
            if eager:
                self._agree(i, value, current)
        return found

    def _agree(self, i: int, value: Any, current: Any) -> None:
        """The root's plain array `i` in `loose` and on the root is `value` from now on."""
        meta = self._jaxslice
        self.loose[i] = meta.agreed[i] = value
        if value is not current:
            assign(meta.root, meta.loose_paths[i], value)

    def _write(self, path: tuple[Any, ...], leaf: Any, value: Any) -> None:
        """Writes back one updated state leaf: a variable in place, a plain array on the
        module holding it (the root's: in `loose`, and outside transforms on the root)."""
        if is_variable(leaf):
            set_value(leaf, value)
            return
        meta = self._jaxslice
        if path in meta.loose_paths:
            i = meta.loose_paths.index(path)
            if _compat.tracing():
                self.loose[i] = value
            else:
                self._agree(i, value, _at(meta.root, path))
            return
        for prefix, module in zip(meta.part_paths, self.parts, strict=True):
            if path[: len(prefix)] == prefix:
                assign(module, path[len(prefix) :], value)
                return

    def __reduce__(self) -> Any:
        raise NNXSliceNotCopyableError()

    def _check_parts(self) -> None:
        """Refuses a call after the model replaced a submodule the slice holds: the
        program is traced from the model as it is now, the variables read from the held
        submodules. Inside a transform the held ones are its copies: compared by class
        and variable shapes there."""
        meta = self._jaxslice
        eager = not _compat.tracing()
        for path, part in zip(meta.part_paths, self.parts, strict=True):
            try:
                now = _at(meta.root, path)
            except (AttributeError, KeyError, IndexError, TypeError):
                now = None
            if now is part or not eager and _alike(now, part):
                continue
            where = "/".join(map(str, path)) or "(the root)"
            raise NNXSlicePartReplacedError(path=where, old=_kind(part), new=_kind(now))

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
        self._check_parts()
        entry, leaves = program.lookup(inputs, kwargs, None, True)
        variables = {**self._variables_by_path(), **self._root_arrays()}
        missing = [
            p for p in entry.plan.variable_paths + entry.plan.state_paths if p not in variables
        ]
        if missing:
            paths = ", ".join("/".join(map(str, p)) for p in missing[:6])
            raise NNXModeVariablesError(paths=paths)
        values = [get_value(variables[p]) for p in entry.plan.variable_paths]
        check_leaves(entry.plan.variable_paths, values, entry.variable_avals, live=True)
        numbers = entry.traced.graph.number_variables
        check_numbers(numbers, {p: get_value(variables[p]) for p in numbers if p in variables})
        result, state = program.run(entry, values, [], leaves, True)
        for path, value in state:
            self._write(path, variables[path], value)
        return result


_CONCRETE = (_compat.CONCRETE_ARRAY, np.ndarray, np.generic)  # not a tracer


def _alike(a: Any, b: Any) -> bool:
    """The same class with variables of the same paths and shapes (inside a transform,
    where the held submodules are copies, and jaxslice may have tagged them)."""
    return isinstance(a, nnx.Module) and type(a) is type(b) and _shapes(a) == _shapes(b)


def _shapes(module: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, p))}: {jax.numpy.shape(get_value(v))}"
        for p, v in flat_state(nnx.state(module))
    ]


def _kind(module: Any) -> str:
    """A submodule described by its class and variable shapes."""
    if not isinstance(module, nnx.Module):
        return "nothing" if module is None else type(module).__name__
    shapes = _shapes(module)
    return f"{type(module).__name__}({', '.join(shapes[:4])}{', ...' if len(shapes) > 4 else ''})"


def _at(node: Any, path: tuple[Any, ...]) -> Any:
    """The value at `path` below `node` (attributes of modules, items of containers)."""
    for key in path:
        by_item = isinstance(node, Mapping) or not isinstance(key, str)
        node = node[key] if by_item else getattr(node, key)
    return node


_compat.register_frames_exclusion(__file__)
