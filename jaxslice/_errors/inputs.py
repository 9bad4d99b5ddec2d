"""Errors of calling a slice: its inputs, keywords and modes."""

from __future__ import annotations

from typing import Any

from .base import InputMismatchError, SliceError


class PositionalInputCountError(InputMismatchError):
    """A slice was called with another number of positional inputs than it takes."""

    TEMPLATE = "This slice takes {expected} positional input(s) (its inputs: {inputs}), got {got}."


class MissingKeywordInputError(InputMismatchError):
    """A slice that takes a keyword input was called without it."""

    TEMPLATE = "Missing keyword input {keyword!r} ({input})."


class FixedArgumentChangedError(InputMismatchError):
    """A positional argument without arrays, fixed by the trace, was given another value."""

    TEMPLATE = (
        "The model's positional argument {position} holds no arrays, so the trace fixed it to "
        "{fixed!r}; this call passes {given!r}. Slice the model again with that value (a "
        "slice takes the model's array arguments; non-array ones are part of its trace)."
    )


class InputStructureError(InputMismatchError):
    """An input has another pytree structure than the one the slice was traced with."""

    TEMPLATE = (
        "Input {input} has structure {tree}, but the slice was traced with {traced}. Pass a "
        "value of the same pytree structure."
    )


class NotAnArrayInputError(InputMismatchError):
    """An input leaf is not an array (a `jax.ShapeDtypeStruct`, say)."""

    TEMPLATE = (
        "Input {input} got {kind} {value!r}, which is not an array; pass a JAX or NumPy "
        "array (a `jax.ShapeDtypeStruct` is for tracing with `jax.eval_shape` or "
        "`jax.export`, not for calling a slice)."
    )


class InputShapesChangedError(InputMismatchError):
    """A slice's inputs changed in more than their batch size."""

    TEMPLATE = (
        "The slice's inputs were traced as ({traced}) but got ({got}).\n"
        "A slice with a `start` accepts a new batch size (the leading axis) but not other "
        "changes of shape or dtype. For other shapes, slice again with sample inputs of that "
        "shape, or use start=None."
    )

    @classmethod
    def of(cls, expected: tuple[Any, ...], got: tuple[Any, ...]) -> InputShapesChangedError:
        """The error for inputs of avals `got` to a slice traced with `expected`."""
        return cls(traced=_avals(expected), got=_avals(got))


def _avals(avals: tuple[Any, ...]) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)


class NewBatchTraceError(InputMismatchError):
    """The model failed when traced again at a slice's new batch size."""

    TEMPLATE = (
        "The slice was called at a new batch size, so jaxslice traced the model again with "
        "its inputs' batch axis (the axis of the old batch size) resized, and the model "
        "failed: {error}\nSlice again with sample inputs of the new batch size."
    )


class UnknownKeywordsError(SliceError):
    """A call passed keyword arguments the model does not accept."""

    TEMPLATE = (
        "The model does not accept the keyword argument(s) {unknown}; it accepts {accepted}. "
        "Mode keywords such as `train=True` are passed to the model."
    )


class NoCollectionsError(SliceError):
    """`rngs` or `mutable` was passed to a slice of a plain function."""

    TEMPLATE = (
        "A plain function takes random keys and state as ordinary inputs; `rngs` and "
        "`mutable` apply to Flax models only."
    )


class TracedModeError(SliceError):
    """A mode keyword (``train=``) was a traced value."""

    TEMPLATE = (
        "The mode keyword {name}= is a traced value (inside `jax.jit`, `jax.grad` or "
        "`jax.vmap`); a mode decides which program runs, so it must be a Python value. Mark "
        "it static (`jax.jit(f, static_argnames=...)`) or pass a Python bool."
    )


class UnaskedUpdatesError(SliceError):
    """A slice that updates state in its mode was called without `mutable`."""

    TEMPLATE = (
        "In this mode the slice updates {names}; pass mutable={names} to get the updates "
        "(as `(outputs, updates)`), as linen's `apply` requires."
    )


class NoStateError(SliceError):
    """`mutable` asked for state the slice does not have."""

    TEMPLATE = (
        "mutable={wanted}, but the slice has no state there (it has {have}). Pass "
        "mutable=False, or collections the slice's modules use (e.g. ['batch_stats'])."
    )


class HookStructureError(SliceError):
    """A boundary hook returned a value of another pytree structure than it received."""

    TEMPLATE = (
        "The boundary hook for {name!r} ({side}) returned a value of structure {got}; it must "
        "keep the structure {want}."
    )
