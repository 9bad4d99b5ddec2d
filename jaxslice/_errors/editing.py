"""Errors of editing a model (`js.edit`) and of calling an edited model."""

from __future__ import annotations

from typing import Any

from .base import InputMismatchError, InvalidSpecError, SliceError

# --------------------------------------------------------------------------- edits


class RemoveMismatchError(SliceError):
    """A call was removed whose input and output differ in structure, shape or dtype."""

    TEMPLATE = (
        "Cannot remove {name!r}: removing bypasses a module (its output becomes its input), so "
        "its input and output must have the same structure, shapes and dtypes, but\n"
        "  input:  {inp}\n  output: {out}\n"
        "Use `replace({name!r}, fn)` with a function that maps one to the other instead."
    )


class EditBreaksModelError(SliceError):
    """An edit's new node returns what the rest of the model cannot read."""

    TEMPLATE = (
        "{what} breaks the model after it: {error}\n"
        "The new node must return what the rest of the model reads (same structure, shapes and "
        "dtypes), unless nothing reads that value afterwards (a new head, say)."
    )


class PortSuffixError(InvalidSpecError):
    """An edit of a whole module call was given a name with a port suffix."""

    TEMPLATE = (
        "{op}({name!r}) acts on a whole module call, so it takes no port suffix; use "
        "{op}({base!r}). To change only what a module receives, use "
        "insert_after({base_input!r}, fn)."
    )

    @classmethod
    def of(cls, op: str, name: str) -> PortSuffixError:
        """The error for edit `op` at `name` (``'block:input'``, say)."""
        base = name.rpartition(":")[0]
        return cls(op=op, name=name, base=base, base_input=f"{base}:input")


class NotEvaluatedError(SliceError):
    """An edit names a value the edited model does not evaluate."""

    TEMPLATE = (
        "{name!r} ({port}) is not evaluated in the edited model (a call inside a one "
        "iteration of a loop, or one whose loop body drops it). Edit at an enclosing call, or "
        "at every iteration with [:]."
    )


class SharedModuleReplaceError(InvalidSpecError):
    """One call of a module called several times was replaced by a module with variables."""

    TEMPLATE = (
        "{name!r} is a module called {count} times; replacing one call by a module with its "
        "own variables would give two modules one name. Replace it with a function, or insert "
        "the new module with `insert_after` and remove the call."
    )


class NodeNameError(InvalidSpecError):
    """A node name is empty, not a string, or holds one of ``/ [ ] @ : \\``."""

    TEMPLATE = (
        "A node name must be a non-empty string without any of / [ ] @ : \\ (a node's name "
        "is one part of a boundary name, where those separate path parts, iterations, call "
        "indices and ports), got {name!r}. Pick a plain name, e.g. name='adapter'."
    )


class NodeNameTakenError(InvalidSpecError):
    """A node name is already a boundary's, a variable's or another node's."""

    TEMPLATE = "{name!r} is already taken by a boundary or a variable; pick another `name=`."


class NotANodeError(InvalidSpecError):
    """What an edit inserts is neither a function nor a module of the model's library."""

    TEMPLATE = "Expected a function or a module of the model's library, got {kind}."


class NodeKeyError(InvalidSpecError):
    """A new module that initialises its variables was inserted without `key=`."""

    TEMPLATE = (
        "The module {kind} needs `key=` to initialise its variables, e.g. key=jax.random.key(0)."
    )


class UnstackedNodeError(InvalidSpecError):
    """A module inserted at every iteration (``[:]``) holds variables of one iteration."""

    TEMPLATE = (
        "{name!r} is inserted at {site!r}, in every iteration of a loop, so its variables need "
        "leading axes {lengths} (one row per iteration), as the model's own scanned layers "
        "have; it has variables of shapes {shapes}. Create it stacked, e.g. with `nnx.vmap` "
        "over split keys "
        "(`nnx.vmap(lambda k: Lora(rngs=nnx.Rngs(k)))(jax.random.split(key, n))`)."
    )


class NoPlaceForVariablesError(InvalidSpecError):
    """New modules were inserted in a model whose variables are not a dict."""

    TEMPLATE = (
        "New modules bring variables, but the model's variables are not a dict, so there is no "
        "place for them. Use a dict of parameters, or insert plain functions."
    )


# --------------------------------------------------------------------------- call-time inputs


class CallInputNamesError(InvalidSpecError):
    """Call-time inputs were named by something other than Python identifiers."""

    TEMPLATE = (
        "Call-time inputs are named by Python identifiers (they are keyword arguments of the "
        "edited model); got {names}."
    )


class CallInputNameTakenError(InvalidSpecError):
    """A call-time input name is another node's or one of the model's keywords."""

    TEMPLATE = (
        "The call-time input name(s) {names} are already taken by another node or by the "
        "model's own keyword arguments; pick other names."
    )


class CallInputLikeError(InvalidSpecError):
    """A call-time input without a shape is at a value that is not one array."""

    TEMPLATE = (
        "The call-time input {name!r} cannot take the shape of the value at {site!r}, which is "
        "not one array; give it as inputs={{{name!r}: jax.ShapeDtypeStruct(shape, dtype)}}."
    )


class CallInputRowsError(InvalidSpecError):
    """A call-time input's example at every iteration lacks the loops' leading axes."""

    TEMPLATE = (
        "The call-time input {name!r} at {site!r} needs leading axes {lengths} (one row per "
        "iteration); its example has shape {shape}."
    )


_CALL_INPUTS = (
    "The edited model takes the call-time input(s) {names} as keyword arguments: "
    "`edited(*inputs, {example})`. "
)


class _CallInputsError(InputMismatchError):
    """An edited model was called with wrong call-time inputs."""

    @classmethod
    def of(cls, expected: Any, **facts: Any) -> Any:
        """The error for a call of an edited model that takes the inputs `expected`."""
        example = ", ".join(f"{n}=..." for n in expected)
        return cls(names=list(expected), example=example, **facts)


class UnknownCallKeywordsError(_CallInputsError):
    """An edited model was called with keywords that are neither inputs nor the model's."""

    TEMPLATE = _CALL_INPUTS + "Neither call-time inputs nor keywords of the model: {extra}."


class MissingCallInputsError(_CallInputsError):
    """An edited model was called without some of its call-time inputs."""

    TEMPLATE = _CALL_INPUTS + "Missing: {missing}."


class CallInputDtypeError(_CallInputsError):
    """A call-time input has another dtype or lacks the loops' leading axes."""

    TEMPLATE = _CALL_INPUTS + "{name!r} must be {need} (like {like}); got {got}."


class CallInputsRejectedError(InputMismatchError):
    """A node failed on its call-time inputs, or broadcast them to another shape."""

    TEMPLATE = (
        "The node {node!r} cannot take its call-time input(s) ({given}, one iteration's rows "
        "where stacked): {error}. Give them the shapes and dtypes of their examples: "
        "{examples}."
    )


# --------------------------------------------------------------------------- lenses


class LensSitesSpecError(InvalidSpecError):
    """A lens was given sites (or reads) it cannot have."""

    TEMPLATE = (
        "Cannot use {spec!r} as a site of a lens: {reason}. Give names of boundaries, every "
        "iteration of a scan with [:] ('layers[:]/attn'), a leaf with '#k' ('layers[:]#0'), "
        "or None for every call's output."
    )


class LensLeafError(InvalidSpecError):
    """A lens site names an array leaf the value there does not have."""

    TEMPLATE = (
        "{spec!r} names no array leaf of the value there: {reason}. Write 'name#k' with k "
        "counting the value's array leaves in jax.tree_util order from 0."
    )


class LensNotASiteError(InvalidSpecError):
    """An intervention or read names no site of the lens."""

    TEMPLATE = (
        "{spec!r} is no site of this lens (nor one iteration of a site): {why} Its sites: "
        "{sites}. "
        "Make the lens with `sites=[...]` including it (sites=None takes every call's "
        "output), or name one iteration of a site inside a scan ('layers[3]')."
    )


class LensSiteNotAtCallError(InvalidSpecError):
    """An intervention or read names a site the model does not compute at this call."""

    TEMPLATE = (
        "{spec!r} is a site of this lens at the input shapes it was made with, but not at "
        "this call's, for which the model is traced again (other scan lengths, other calls): "
        "{why} Name a site or iteration that exists at these input shapes."
    )


class LensComplexValueError(InputMismatchError):
    """A complex value was given for a lens site whose values are real."""

    TEMPLATE = (
        "The {kind} value for {spec!r} is complex ({dtype}), but the values at that site are "
        "real ({site_dtype}), so its imaginary part would be lost. Give a real value (its "
        "real part, jnp.real(v), or its magnitude, jnp.abs(v))."
    )


class LensBatchSizeError(InputMismatchError):
    """A lens sweep was given a batch size that is not a non-negative int."""

    TEMPLATE = (
        "batch_size= takes a non-negative int, the number of runs that go through the model "
        "at once (0: all of them), or None for the default; got {got}."
    )


class LensNotPicklableError(SliceError):
    """A lens was pickled."""

    TEMPLATE = (
        "A lens holds a traced model and compiled programs, so it cannot be pickled. Save the "
        "model's variables instead (e.g. with `flax.serialization` or orbax) and make the "
        "lens again with `js.lens` after loading."
    )


class LensKindError(InputMismatchError):
    """An intervention keyword of a lens got something other than a dict of arrays."""

    TEMPLATE = (
        "{kind}= takes a dict {{site name: array}} (for set=, an array or a pair "
        "(array, boolean mask)); got {got}."
    )


class LensValueShapeError(InputMismatchError):
    """An intervention's value does not broadcast to the value at its site."""

    TEMPLATE = (
        "The {kind} value for {spec!r} has shape {shape}, which does not broadcast to the "
        "value there, {target} (site {site!r}; at a [:] name the value is stacked over the "
        "iterations, a leading axis per loop). Give an array that broadcasts to {target} with "
        "NumPy's rules: a vector (d,) acts at every position (and every iteration)."
    )


class LensSweepAxisError(InputMismatchError):
    """The values of a lens sweep do not share one leading axis."""

    TEMPLATE = (
        "A sweep takes every value with a leading axis, one entry per run, of the same "
        "length; {kind} for {spec!r} have shape(s) {shape}. Stack the runs' values on a "
        "first axis (jnp.stack), or broadcast a value shared by every run "
        "(jnp.broadcast_to(v, (n, *v.shape)))."
    )


class LensSweepEmptyError(InputMismatchError):
    """A lens sweep was given no values to sweep over."""

    TEMPLATE = (
        "A sweep runs one intervention per entry of its values' leading axis, so it needs at "
        "least one value in add=, scale= or set=. To run the model once, call the lens."
    )
