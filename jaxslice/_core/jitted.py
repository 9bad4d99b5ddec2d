"""A slice's calls through `jax.jit`: one jitted function per mode and `mutable`.

`SliceProgram.apply_checked` looks up the compiled entry for a call's signature and
checks every argument. Run on each call, that costs more than the slice itself for a
small model, so `JitCalls` puts it under one `jax.jit` per mode and `mutable`: jit's own
cache is keyed by the structure, shapes and dtypes of the variables and inputs, so
jaxslice's lookup and checks run when that function traces, and a call whose leaves
differ in any way traces, and is checked, again. A repeated call costs what a jitted
function costs.

Which calls take the jitted path is decided before the call, from the inputs: every leaf
must be an array (`jax.Array`, NumPy's arrays and scalars); a call with strings, objects or
Python numbers (which `jax.jit` would turn into arrays where the trace fixed them) goes
through `apply_checked`, and later calls with arrays are jitted again. Random keys
(`rngs`), keyword inputs and ``strict=False`` are never jitted here. Two things only
`jax.jit`'s own trace can tell, so they are learnt at the first trace of a kind of call
and that kind stays on the checked path from then on: variables with leaves that are not
arrays, and outputs that hold constants of the trace (`NotJittable`). jaxslice's own errors
raised while jit traces (a wrong shape) are raised again by `apply_checked`, without JAX's
frames.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import jax
import numpy as np

from .._caches import LRU
from .._errors import SliceError
from .._trees import is_array, is_traced_leaf
from .checks import check_alive, mode_value

#: errors after which a call is redone with `apply_checked`: jaxslice's own (raised again
#: without JAX's frames), `NotJittable`, and those of variables `jax.jit` cannot take
_REDO = (TypeError, SliceError)
#: the types of the leaves `jax.jit` takes as they are (`is_array`) seen so far, for the
#: quick test ``type(x) in _ARRAY_TYPES`` (JAX's array type is known only once one exists)
_ARRAY_TYPES = {np.ndarray}
_CHECKED = object()  # calls of this key go through `apply_checked`


class NotJittable(SliceError):
    """The outputs of this call hold constants of the trace (`Entry.static_outputs`)."""


class JitCalls:
    """The jitted calls of one `SliceProgram`, which it holds weakly (the program holds
    this object)."""

    def __init__(self, program: Any, maxsize: int):
        self._program = weakref.ref(program)
        self._jits = LRU(maxsize)  # key -> jitted `apply_checked`, or `_CHECKED`
        # Without a structure key, the target (which a program never swaps) decides the
        # program: the usual call's key is a constant.
        fixed = program.adapter.structure_key(program.target) is None
        self._usual_key = (None,) if fixed else None
        #: with that constant key, the usual call's jitted function once made (None
        #: before, and after calls of that kind left `jax.jit`); `Sliced` calls it directly
        self.usual = None

    def apply(
        self,
        variables: Any,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        rngs: Any = None,
        mutable: Any = False,
        strict: bool = True,
    ) -> Any:
        """`SliceProgram.apply`: through the jitted function of this kind of call where
        there is one, else (and to raise any error) through `apply_checked`."""
        program = self._program()
        modes = {k: v for k, v in kwargs.items() if k not in program.keywords}
        if any(map(is_traced_leaf, modes.values())):  # an array mode (`train=jnp.asarray(True)`)
            program.check_mode(modes)  # an unknown keyword is named as such, not as a mode
            kwargs = {**kwargs, **{k: mode_value(k, v) for k, v in modes.items()}}
        key = self._key(program, kwargs, rngs, mutable, strict) if _arrays(inputs) else None
        try:
            jitted = self._jits.peek(key) or self._new_jitted(key, kwargs, mutable)
        except TypeError:  # an unhashable mode value or structure key
            jitted = _CHECKED
        if jitted is _CHECKED:
            return program.apply_checked(variables, inputs, kwargs, rngs, mutable, strict)
        try:
            return jitted(variables, inputs)
        except _REDO:
            pass  # outside the handler, so that an error raised again is not chained
        except RuntimeError:
            check_alive(variables, inputs)
            raise
        return self._redo(key, variables, inputs, kwargs, rngs, mutable, strict)

    def call(self, variables: Any, inputs: tuple[Any, ...]) -> Any:
        """``apply(variables, inputs, {})``, the usual call (``sub(x)``), by the shortest
        path: one attribute read (with a structure key, one dict read) and the jitted
        function."""
        jitted, key = self.usual, self._usual_key
        for x in inputs:  # as `_arrays`, with the quick test inline (this is every call)
            if type(x) not in _ARRAY_TYPES and not _arrays(x):
                return self.apply(variables, inputs, {})
        if jitted is None:
            if key is None:  # as `_key`
                program = self._program()
                key = (program.adapter.structure_key(program.target),)
            try:
                jitted = self._jits.peek(key)
            except TypeError:  # an unhashable structure key
                jitted = None
            if jitted is None or jitted is _CHECKED:
                return self.apply(variables, inputs, {})
        try:
            return jitted(variables, inputs)
        except _REDO:
            pass
        except RuntimeError:
            check_alive(variables, inputs)
            raise
        return self._redo(key, variables, inputs, {})

    def _redo(self, key: Any, variables: Any, inputs: Any, kwargs: Any, *rest: Any) -> Any:
        """`apply_checked` after the jitted function failed: it raises the error as jaxslice
        does, or, if the arguments are fine but not for `jax.jit`, calls of this key are
        not jitted from now on."""
        out = self._program().apply_checked(variables, inputs, kwargs, *rest)
        self._jits.put(key, _CHECKED)
        if self._is_usual(key):
            self.usual = None
        return out

    def _is_usual(self, key: Any) -> bool:
        return self._usual_key is not None and key == self._usual_key

    @staticmethod
    def _key(program: Any, kwargs: dict[str, Any], rngs: Any, mutable: Any, strict: bool) -> Any:
        """The key of the jitted function for a call, or None where calls of this kind are
        not jitted: random keys (`jax.jit` would take Python numbers as keys), keyword
        inputs, ``strict=False``."""
        if rngs is not None or not strict or not program.keywords.isdisjoint(kwargs):
            return None
        structure = program.adapter.structure_key(program.target)
        if mutable is False and not kwargs:
            return (structure,)  # the usual call's key (`call`)
        collections = tuple(mutable) if isinstance(mutable, list) else mutable
        # Each mode with its type (``train=1`` and ``train=True`` are equal), as itself: a
        # value that does not hash goes through `apply_checked`.
        modes = tuple((k, type(v), v) for k, v in kwargs.items())
        return modes, collections, structure

    def _new_jitted(self, key: Any, kwargs: dict[str, Any], mutable: Any) -> Any:
        """`apply_checked` under `jax.jit` for calls of this key (`_CHECKED` for None)."""
        if key is None:
            return _CHECKED
        traced = functools.partial(_jitted_apply, self._program, dict(kwargs), mutable)
        jitted = jax.jit(traced)
        self._jits.put(key, jitted)
        if self._is_usual(key):
            self.usual = jitted
        return jitted


def _arrays(tree: Any) -> bool:
    """Whether every leaf of `tree` is an array `jax.jit` takes as it is."""
    if is_array(tree):
        _ARRAY_TYPES.add(type(tree))
        return True
    return all(map(is_array, jax.tree_util.tree_leaves(tree)))


def _jitted_apply(ref: Any, mode: dict[str, Any], mutable: Any, variables: Any, inputs: Any) -> Any:
    """`SliceProgram.apply` as `jax.jit` traces it: for each new structure, shape and dtype
    of the variables and inputs, the lookup and every check run again."""
    return ref().apply_checked(variables, inputs, mode, None, mutable, jitting=True)
