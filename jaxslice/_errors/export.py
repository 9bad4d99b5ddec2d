"""Errors of exporting a slice (`jax.export`) and of pickling or copying one."""

from __future__ import annotations

from .base import SliceError


class FixedLeavesExportError(SliceError):
    """A slice whose inputs hold leaves fixed by the trace was exported."""

    TEMPLATE = (
        "The slice's input {arg} holds leaves fixed by the trace (non-arrays or parameters), "
        "which an exported function cannot take; export a slice whose inputs are arrays, e.g. "
        "start at an ':output' port."
    )


class ExportRngsError(SliceError):
    """A slice that draws random numbers in its mode was exported."""

    TEMPLATE = (
        "In its mode {mode} this slice draws random numbers (it reads the keys passed as "
        "`rngs`), and `sub.export()` makes a program that takes no random keys. Slice the model "
        "in a mode that draws none (e.g. train=False), or export your own function that takes "
        "the key, for example: jax.export.export(jax.jit(lambda v, x, key: sub.apply(v, x, "
        "rngs={rngs})))(...)."
    )


class ExportUpdatesError(SliceError):
    """A slice that updates state in its mode was exported."""

    TEMPLATE = (
        "In its mode {mode} this slice updates {names}, and `sub.export()` makes a program that "
        "returns only the slice's outputs, so those updates would be lost. To export a feature "
        "extractor, slice the model in evaluation mode (e.g. train=False). To export the "
        "updates too, export your own function, for example: jax.export.export(jax.jit("
        "lambda v, x: sub.apply(v, x, mutable={names})))(...)."
    )


class SliceNotPicklableError(SliceError):
    """A slice was pickled or copied."""

    TEMPLATE = (
        "A slice holds compiled programs and cannot be pickled or copied. Save "
        "`sub.variables` (e.g. with `flax.serialization` or orbax) and the recipe (model, "
        "start, end, sample input shapes), and slice again after loading."
    )
