"""A slice's calls through `jax.jit`: one jitted function per mode and `mutable`.

`SliceProgram.apply_checked` looks up the compiled entry for a call's signature and
checks every argument. Run on each call, that costs more than the slice itself for a
small model, so `JitCalls` puts it under one `jax.jit` per mode and `mutable`: jit's own
cache is keyed by the structure, shapes and dtypes of the variables and inputs, so
jaxslice's lookup and checks run when that function traces, and a call whose leaves
differ in any way traces, and is checked, again. A repeated call costs what a jitted
function costs.

Which path a call takes is decided before it runs, from facts, never by trying:

- from its inputs, on every call: every leaf must be an array (`jax.Array`, NumPy's
  arrays and scalars). A call with strings, objects or Python numbers (which `jax.jit`
  would turn into arrays where the trace fixed them) takes the checked path, and later
  calls with arrays are jitted again. Calls with random keys (`rngs`), keyword inputs,
  ``strict=False`` or a mode value that does not hash are never jitted here.
- from the kind of call (its key: mode, `mutable`, the model's structure), once, at its
  first call: the entry that call looks up, and the variables it is given. Outputs that
  hold constants of the trace (`Entry.static_outputs`, which `jax.jit` would return as
  arrays) or variables with leaves that are not arrays send that kind down the checked
  path for good; any other kind gets its jitted function. The decision is stored with
  the key (`JitCalls.paths`). Should a later trace of a jitted kind (another batch size)
  return a constant, it comes back as an array, as from any jitted function.

A jitted call that fails is reported as jaxslice reports errors: the checked path runs
with the same arguments and raises jaxslice's own error (a wrong shape) without JAX's
frames; where it finds nothing wrong, JAX's error stands. A failure never sends a call,
or a kind of call, down another path.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import jax
import numpy as np

from .._caches import LRU
from .._errors import SliceError
from .._trees import hashable, is_array, is_traced_leaf
from .checks import check_alive, mode_value

#: the types of the leaves `jax.jit` takes as they are (`is_array`) seen so far, for the
#: quick test ``type(x) in _ARRAY_TYPES`` (JAX's array type is known only once one exists)
_ARRAY_TYPES = {np.ndarray}
CHECKED = "checked"  # the path of the kinds of calls `jax.jit` does not take


class JitCalls:
    """The jitted calls of one `SliceProgram`, which it holds weakly (the program holds
    this object)."""

    def __init__(self, program: Any, maxsize: int):
        self._program = weakref.ref(program)
        #: key -> the path of that kind of call, decided at its first call: its jitted
        #: function, or `CHECKED`
        self.paths = LRU(maxsize)
        # Without a structure key, the target (which a program never swaps) decides the
        # program: the usual call's key is a constant.
        fixed = program.adapter.structure_key(program.target) is None
        self._usual_key = (None,) if fixed else None
        #: with that constant key, the usual call's jitted function once decided (None
        #: before, and where that kind is checked); `call` runs it directly
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
        it has one, else through `apply_checked`."""
        program = self._program()
        modes = {k: v for k, v in kwargs.items() if k not in program.keywords}
        if any(map(is_traced_leaf, modes.values())):  # an array mode (`train=jnp.asarray(True)`)
            program.check_mode(modes)  # an unknown keyword is named as such, not as a mode
            kwargs = {**kwargs, **{k: mode_value(k, v) for k, v in modes.items()}}
        key = self._key(program, kwargs, rngs, mutable, strict) if _arrays(inputs) else None
        path = CHECKED if key is None else self.paths.peek(key)
        if path is None:
            path = self._decide(key, variables, inputs, kwargs, mutable)
        if path is CHECKED:
            return program.apply_checked(variables, inputs, kwargs, rngs, mutable, strict)
        try:
            return path(variables, inputs)
        except (TypeError, SliceError, RuntimeError) as error:
            failed = error  # reported outside the handler: jaxslice's error is not chained
        raise self._reported(failed, variables, inputs, kwargs, mutable)

    def call(self, variables: Any, inputs: tuple[Any, ...]) -> Any:
        """``apply(variables, inputs, {})``, the usual call (``sub(x)``), by the shortest
        path: one attribute read (with a structure key, one dict read) and the jitted
        function."""
        jitted = self.usual
        for x in inputs:  # as `_arrays`, with the quick test inline (this is every call)
            if type(x) not in _ARRAY_TYPES and not _arrays(x):
                return self.apply(variables, inputs, {})
        if jitted is None:
            if self._usual_key is not None:  # not decided yet, or checked
                return self.apply(variables, inputs, {})
            program = self._program()
            jitted = self.paths.peek(_hashed((program.adapter.structure_key(program.target),)))
            if jitted is None or jitted is CHECKED:
                return self.apply(variables, inputs, {})
        try:
            return jitted(variables, inputs)
        except (TypeError, SliceError, RuntimeError) as error:
            failed = error
        raise self._reported(failed, variables, inputs, {})

    def _decide(self, key: Any, variables: Any, inputs: Any, kwargs: Any, mutable: Any) -> Any:
        """The path of the calls of `key`, decided from its first call: the entry it looks
        up (which checks the inputs: a bad call raises here and decides nothing) and the
        variables it is given."""
        entry, _ = self._program().lookup(inputs, kwargs, None, mutable)
        if entry.static_outputs or not _arrays(variables):
            path = CHECKED
        else:
            traced = functools.partial(_jitted_apply, self._program, dict(kwargs), mutable)
            path = jax.jit(traced)
            if key == self._usual_key:
                self.usual = path
        self.paths.put(key, path)
        return path

    def _reported(
        self, error: Exception, variables: Any, inputs: Any, kwargs: Any, mutable: Any = False
    ) -> Exception:
        """The error of a failed jitted call as jaxslice reports it: an array deleted
        since (`check_alive`), or the error the checked path raises for these arguments;
        `error` itself where neither finds one."""
        if isinstance(error, RuntimeError):
            check_alive(variables, inputs)
        else:
            self._program().apply_checked(variables, inputs, kwargs, None, mutable)
        return error

    @staticmethod
    def _key(program: Any, kwargs: dict[str, Any], rngs: Any, mutable: Any, strict: bool) -> Any:
        """The key of the jitted function for a call, or None where calls of this kind are
        not jitted: random keys (`jax.jit` would take Python numbers as keys), keyword
        inputs, ``strict=False``, a mode value or structure key that does not hash."""
        if rngs is not None or not strict or not program.keywords.isdisjoint(kwargs):
            return None
        structure = program.adapter.structure_key(program.target)
        if mutable is False and not kwargs:
            return _hashed((structure,))  # the usual call's key (`call`)
        collections = tuple(mutable) if isinstance(mutable, list) else mutable
        # Each mode with its type (``train=1`` and ``train=True`` are equal), as itself.
        modes = tuple((k, type(v), v) for k, v in kwargs.items())
        return _hashed((modes, collections, structure))


def _hashed(key: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """`key`, or None where it does not hash (such calls are not jitted: the jitted
    function of a mode is made for that mode's value)."""
    return key if hashable(key) is key else None


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
