"""Errors of the variables a slice is given: their paths, shapes and dtypes, and arrays
that no longer exist."""

from __future__ import annotations

from .base import SliceError, VariablesMismatchError


class VariableShapeError(VariablesMismatchError):
    """A variable has another shape or dtype than the one the slice was traced with."""

    TEMPLATE = (
        "The variable {path} is {got}, but the slice was traced with {want}. Pass variables "
        "of the model the slice was made from (its `sub.variables`, or the result of training "
        "them); to use other shapes, slice the model again with them."
    )


class ModelChangedError(VariablesMismatchError):
    """A model that holds its variables (NNX) changed their shapes since it was sliced."""

    TEMPLATE = (
        "The model changed since it was sliced or observed: {change}, and what was made "
        "from it was traced for the old shapes.\n"
        "Slice (or make the tracker, statistics or lens) again from the model as it is "
        "now; new values of the same shapes are read at each call without this."
    )


class NumberVariableError(VariablesMismatchError):
    """A variable that held a Python number when traced holds something else now."""

    TEMPLATE = (
        "The variable {path} held the Python number {traced} when this was traced, so it "
        "computes with that number (as `jax.jit` does with a static argument); it is "
        "{now} now. Hold an array there instead (e.g. `jnp.asarray({traced})`, or "
        "`nnx.Param(jnp.asarray({traced}))`) so that each call reads its value and training "
        "updates it, or slice (or make the lens, edit or tracker) again."
    )


class VariablesStructureError(VariablesMismatchError):
    """The variables passed lack paths the slice reads, or hold arrays it does not use."""

    TEMPLATE = (
        "The variables passed do not match the slice's variables ({problems}).\n"
        "Pass `sub.variables`, or variables of the same structure (for example the result "
        "of training them)."
    )

    @classmethod
    def of(cls, missing: str, extra: str, note: str = "") -> VariablesStructureError:
        """The error for the `missing` and `extra` paths (as text, either may be empty);
        `note` says why some are missing."""
        problems = [f"missing: {missing}"] if missing else []
        problems += [note] if missing and note else []
        problems += [f"not used by the slice: {extra}"] if extra else []
        return cls(missing=missing, extra=extra, note=note, problems="; ".join(problems))


class MissingEntriesError(VariablesMismatchError):
    """`extract` was given variables without entries the slice reads."""

    TEMPLATE = "These variables lack entries the slice reads: {paths}."


class MergeUnknownError(VariablesMismatchError):
    """`merge` was given slice variables at paths the model's variables do not have."""

    TEMPLATE = (
        "Cannot merge: the model's variables have no entry at {paths}.\n"
        "Pass the model's full variables first and the slice's variables second: "
        "`sub.merge(variables, new_sub_variables)`."
    )


class MissingModelVariablesError(VariablesMismatchError):
    """An interpreter was given variables without entries the model reads."""

    TEMPLATE = (
        "The variables passed lack entries the model reads: {paths}. Pass the model's full "
        "variables (for NNX, `nnx.state(model)`)."
    )


class DeletedArrayError(SliceError):
    """A variable or input was donated to a jitted function or deleted."""

    TEMPLATE = (
        "The {kind} at {path} ({aval}) has been deleted: it was donated to a jitted function "
        "(`donate_argnums`, an optimizer step that donates its state) or `.delete()`d. Pass "
        "live arrays: use the arrays that call returned, or copy them before donating "
        "(`jax.tree.map(jnp.copy, sub.variables)`)."
    )
