"""Errors of naming boundaries: `start`, `end` and `names`, iterations of loops, and
slices whose ends do not connect."""

from __future__ import annotations

from typing import Any

from .base import (
    AmbiguousBoundaryError,
    BoundaryInLoopError,
    DisconnectedError,
    InvalidSpecError,
    SliceError,
    UnknownBoundaryError,
)

# --------------------------------------------------------------------------- specs


class BoundaryNameTypeError(InvalidSpecError):
    """A boundary was named by something other than a string."""

    TEMPLATE = "A boundary is named by a string such as 'block1/conv', got {spec!r} ({kind})."


class StartSpecError(InvalidSpecError):
    """`start` is neither None, a name nor a non-empty list of names."""

    TEMPLATE = (
        "`start` must be None (the model's inputs), a boundary name or a non-empty list of "
        "names, got {start!r}."
    )


class EndSpecError(InvalidSpecError):
    """`end` is neither a name, a list or dict of names nor None."""

    TEMPLATE = (
        "`end` must be a boundary name, a list of names, a dict of names or None, got {end!r}."
    )


class EmptyEndError(InvalidSpecError):
    """`end` (or `names`) is an empty container."""

    TEMPLATE = "`end` (or `names`) is empty ({end!r}); name at least one boundary."


class NamesSpecError(InvalidSpecError):
    """`names` of `js.intermediates` is not a non-empty list of strings or None."""

    TEMPLATE = (
        "`names` must be a non-empty list of boundary names (strings), None for every "
        'boundary outside loops, or "all" for every boundary, inside scans too; got '
        "{names!r}."
    )


class NoActivationError(InvalidSpecError):
    """An activation was asked of a call that does not return a single array."""

    TEMPLATE = "{name!r} does not return a single array, so it has no activation."


class MarkNameError(InvalidSpecError):
    """`js.mark` was given an empty or non-string name."""

    TEMPLATE = "js.mark needs a non-empty string name, got {name!r}."


# --------------------------------------------------------------------------- calls


class CallIndexError(UnknownBoundaryError):
    """``name@k`` names a call past the last call of a module."""

    TEMPLATE = (
        "{name!r} is called {count} time(s), so {spec!r} does not exist; valid calls are "
        "{name}@0 to {name}@{last}."
    )


class CallIndexPerIterationError(UnknownBoundaryError):
    """``name[k]@j`` names a call past the last call of a module in one iteration."""

    TEMPLATE = (
        "{name!r} is called {count} time(s) per iteration, so {spec!r} does not exist; valid "
        "calls are @0 to @{last}."
    )


class LiteralNameError(AmbiguousBoundaryError):
    """A name is both a port or call of one module and, literally, another module's name."""

    TEMPLATE = (
        "{spec!r} could name a port or call of {base!r} or the module named {spec!r} itself. "
        "Write {literal!r} for that module (the name grammar's characters escaped with a "
        "backslash, as `js.boundaries` lists it), or add the call index for {base!r} "
        "(e.g. {indexed!r})."
    )


# --------------------------------------------------------------------------- loops


class IterationIndexError(UnknownBoundaryError):
    """``name[k]`` picks an iteration a scan does not run."""

    TEMPLATE = (
        "{spec!r}: {index!r} is not an iteration of a `{primitive}`, which runs {length} "
        "times. Use an integer from 0 to {last} (negative counts from the end: -1 is the "
        "last) or ':' for every iteration, stacked."
    )


class IterationSlotsError(InvalidSpecError):
    """A name gives another number of iterations than there are scans around the call."""

    TEMPLATE = (
        "{spec!r} gives {given} iteration(s), but {name!r} is inside {count} nested scan(s); "
        "write one [k] per scan, where `js.boundaries` lists [:]."
    )


class StackedStartError(InvalidSpecError):
    """Every iteration stacked (``name[:]``) was asked for as a start."""

    TEMPLATE = (
        "{spec!r} stacks the values of every iteration, so it can end a slice (or be read with "
        "js.intermediates) but not start one. Start at one iteration, e.g. {example!r}."
    )


class UnreachableIterationError(BoundaryInLoopError):
    """A function that cannot reach inside scans was given the name of an iteration."""

    TEMPLATE = (
        "{spec!r} names one iteration of a call inside a scan, which this function cannot "
        "reach; slice at it with js.slice or read it with js.intermediates."
    )


class ScopeInScanError(BoundaryInLoopError):
    """A `jax.named_scope` region inside a scan body was asked for."""

    TEMPLATE = (
        "{name!r} is a `jax.named_scope` region inside a scan body, which is not a boundary per "
        "iteration. Wrap that code in `js.mark(name)` to name each iteration (`name[k]`), or "
        "slice at the enclosing module{outer}."
    )


class WhileIterationError(BoundaryInLoopError):
    """A call in a ``while_loop`` body was asked for bare, by one iteration, or by a slice."""

    TEMPLATE = (
        "{name!r} is called inside the body of a `while`, which has no fixed number of "
        "iterations, so it names no single value a slice could start or end at.\n"
        "Slice at a module that contains the whole `while`{outer}. To edit the call in every "
        "iteration, or to see it in every iteration from a `js.Interpreter` hook, name it "
        "{every!r}. Or write the loop as a `jax.lax.scan` (or a `fori_loop` with static "
        "bounds), whose iterations are named `name[k]`."
    )


class MixedLoopNamesError(SliceError):
    """One slice names a scanned module both as a whole and by one of its iterations."""

    TEMPLATE = (
        "{whole!r} is a scanned module as a whole and {one!r} one of its iterations; one slice "
        "cannot name both. Name the loop's ends by iteration instead: {first!r} for its input "
        "and {last!r} for its result."
    )


class LoopNotWholeError(SliceError):
    """A loop named as a whole does not pass its operands and results to its body's call."""

    TEMPLATE = (
        "{name!r} names a loop as a whole, but the call its body makes does not take the "
        "loop's operands and return its results as they are, so the loop's ports cannot be "
        "told. Name its iterations instead ({name}[0]:input and {name}[-1]:output), or "
        "the module around the loop."
    )


class LostIterationsError(SliceError):
    """Named iterations were not found once their loop was written out."""

    TEMPLATE = (
        "The iteration(s) {names} could not be found again once their loop was written out "
        "(a call whose values the loop body does not use, say). Slice at an enclosing call."
    )


class GivenAndComputedError(SliceError):
    """A start value is computed by a loop together with other values the slice needs."""

    TEMPLATE = (
        "The slice is given a value that the model computes in one loop together with other "
        "values the slice needs, from that value ({primitive} results {given} and {others}): "
        "it cannot take the one and compute the others from the model's own. Start at a "
        "boundary before the loop, or do not ask for the values the loop computes with it."
    )


class StateGapsError(SliceError):
    """A slice runs iterations of a loop that updates stacked state, with gaps between."""

    TEMPLATE = (
        "The slice runs some iterations of a loop but not those between them ({ran} of its "
        "pieces), so the state {path} that the loop updates, stacked over its iterations, "
        "cannot be returned as one array with only those rows new. Make one slice per run of "
        "consecutive iterations, or slice the model in a mode that updates no state (e.g. "
        "train=False)."
    )


# --------------------------------------------------------------------------- starts and ends


class DuplicateStartKeywordError(InvalidSpecError):
    """Two starts take a keyword argument of the same name."""

    TEMPLATE = (
        "Two start boundaries take a keyword argument of the same name ({keywords}); name one "
        "of them by its `:output` port instead."
    )


class SameValueStartsError(InvalidSpecError):
    """Two starts are one value of the traced model."""

    TEMPLATE = (
        "{first} and {second} are one value of the traced model ({aval}, {made}), so a slice "
        "cannot take them as separate inputs (one would be silently ignored). {cause} {fix}"
    )
    # Why one value reaches two starts, by what the value is.
    CAUSES = {
        "given": (
            "This happens when two starts are passed the same array (a mask or positions "
            "every block takes), or a module is called with a container that already holds "
            "another of its arguments (for example `block(x, act)` where `act` holds `x`)."
        ),
        "inputs": (
            "{start} takes nothing but the model's own inputs, which the start None takes "
            "too (with None among the starts, a named start's arguments that are the "
            "model's inputs come from None, and those derived from them are computed again)."
        ),
    }
    FIXES = {
        "producer": "Start at the module that produces it instead: start={starts!r}.",
        "add_none": "Add None to `start`, so that the model's inputs are taken once: "
        "start={starts!r}.",
        "drop": "Leave {start} out: start={starts!r}.",
        "once": "Give None once: start={starts!r}.",
    }
    NO_FIX = "Start at an earlier boundary (or None, the model's inputs) instead."

    @classmethod
    def of(
        cls,
        first: str,
        second: str,
        aval: str,
        made: str,
        starts: list[Any] | None,
        how: str = "producer",
        only_inputs: str | None = None,
    ) -> SameValueStartsError:
        """The error for starts `first` and `second`; `starts` is a verified fix of kind
        `how` (a key of `FIXES`); `only_inputs` names a start that takes nothing but the
        model's inputs while None is a start too."""
        shown = None if starts == [None] else starts
        fix = cls.FIXES[how].format(starts=shown, start=only_inputs) if starts else cls.NO_FIX
        cause = cls.CAUSES["inputs" if only_inputs else "given"].format(start=only_inputs)
        return cls(
            first=first, second=second, aval=aval, made=made, starts=starts, cause=cause, fix=fix
        )


class EndNotConnectedError(DisconnectedError):
    """An end does not depend on the starts."""

    TEMPLATE = "{end} does not depend on the start {starts}.{order}" + DisconnectedError.ORDER

    @classmethod
    def of(cls, end: str, starts: str, before: bool) -> EndNotConnectedError:
        """The error for `end`, which runs `before` every start or not."""
        order = f" ({end} runs before the start.)" if before else ""
        return cls(end=end, starts=starts, before=before, order=order)


class UnusedStartError(DisconnectedError):
    """A start feeds none of the ends."""

    TEMPLATE = (
        "The start {start} is not used by {ends}; remove it from `start`." + DisconnectedError.ORDER
    )
