"""`SliceError` and the public categories every jaxslice error belongs to.

An error builds its message from facts: ``UnknownBoundaryError(name="layer_1", hint="")``
formats its class's `TEMPLATE` with them and keeps them in ``error.facts``. The specific
errors (the other modules of this package) subclass these categories, so
``except js.InputMismatchError`` catches every input an error is about.
"""

from __future__ import annotations

import pickle
from typing import Any, ClassVar


class SliceError(Exception):
    """Base class of every error jaxslice raises on bad input.

    A subclass sets `TEMPLATE`; its errors are made from the facts the template names,
    which stay readable as ``error.facts``. A plain message is accepted too.

    >>> import jaxslice as js
    >>> issubclass(js.UnknownBoundaryError, js.SliceError)
    True
    >>> error = js.AmbiguousBoundaryError(name="shared", count=2, choices="'shared@0', 'shared@1'")
    >>> print(error)
    'shared' is called 2 times, so the bare name is ambiguous.
    Pick one call: 'shared@0', 'shared@1'.
    >>> error.facts["count"]
    2
    >>> str(js.SliceError("anything"))
    'anything'
    """

    TEMPLATE: ClassVar[str] = ""

    def __init__(self, message: str | None = None, /, **facts: Any) -> None:
        if message is None:
            message = type(self).TEMPLATE.format(**facts)
        super().__init__(message)
        self.facts: dict[str, Any] = facts

    def __reduce__(self) -> Any:
        # Unpickling calls the class with the message and then restores `facts`; a fact
        # that does not pickle travels as its repr.
        state = dict(self.__dict__)
        state["facts"] = {k: v if _pickles(v) else repr(v) for k, v in self.facts.items()}
        return type(self), tuple(self.args[:1]), state


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


class UnsupportedTargetError(SliceError):
    """The target is neither a Flax module nor a callable.

    Reproducer: ``js.boundaries(42, x)``.
    """

    TEMPLATE = (
        "jaxslice cannot trace a target of type {kind}.\n"
        "Pass one of:\n"
        "  1. a Flax linen module:  js.slice(model, variables, x, end=...)\n"
        "  2. a Flax NNX module:    js.slice(model, x, end=...)\n"
        "  3. a plain function whose first argument holds the parameters:\n"
        "     js.slice(fn, params, x, end=...)"
    )


class UnknownBoundaryError(SliceError):
    """A boundary name matches no module call.

    Reproducer: ``js.slice(model, variables, x, end="layer_1")`` when the module is
    named ``layer1``; the message lists the closest existing names.
    """

    TEMPLATE = (
        "No boundary named {name!r}.{hint}\n"
        "Names are module paths exactly as parameters are keyed (e.g. 'block1/conv'), "
        "never prefixes. `print(js.boundaries(...))` lists them all."
    )


class AmbiguousBoundaryError(SliceError):
    """A bare name matches a module that is called several times.

    Reproducer: ``js.slice(model, variables, x, end="shared")`` when ``shared`` is called
    twice; use ``shared@0`` or ``shared@1``.
    """

    TEMPLATE = (
        "{name!r} is called {count} times, so the bare name is ambiguous.\n"
        "Pick one call: {choices}."
    )


class BoundaryInLoopError(SliceError):
    """A boundary inside a loop without a static number of iterations (``while_loop``) or
    inside a conditional branch (``cond``, ``switch``) was asked for.

    Reproducer: a module called inside ``jax.lax.while_loop``; slice at the loop as a
    whole. (Calls inside a ``scan`` are named per iteration: ``name[k]``.)
    """

    TEMPLATE = (
        "{name!r} is called inside the body of a `{primitive}`, which has no fixed number "
        "of iterations (a `cond` branch may not run at all), so it names no single value "
        "a slice could start or end at.\n"
        "Slice at a module that contains the whole `{primitive}`{outer}, or write the loop "
        "as a `jax.lax.scan` (or a `fori_loop` with static bounds), whose iterations are "
        "named `name[k]`."
    )


class MissingInputError(SliceError):
    """The requested outputs need a value that is neither a start input nor a parameter.

    Reproducer: a U-Net whose decoder reads a skip connection from an encoder block
    that runs before ``start``.
    """

    TEMPLATE = (
        "The slice from {start} to {end} needs {what}, which {verb} computed before the "
        "start of the slice and is not one of its inputs.\n{fix}{narrower}"
    )
    FIX = "Add it to `start`, for example: start={starts!r}"
    NO_FIX = (
        "No boundary marks that value where a slice could start from it. Start at an "
        "earlier boundary that everything the slice needs derives from (or at None, the "
        "model's inputs), or mark the value with `js.mark`."
    )
    NARROWER = (
        "\nOnly part of the model's output needs it (an extra output, such as a cache of "
        "earlier layers' values): end the slice at the part you need instead{example}, or "
        "slice the model in a mode that does not return the rest (a keyword such as "
        "`return_cache=False`)."
    )

    @classmethod
    def of(
        cls,
        start: str,
        end: str,
        values: list[str],
        starts: list[Any] | None,
        ends: list[str] | None = None,
    ) -> MissingInputError:
        """The error for the described `values` a slice from `start` to `end` lacks;
        `starts` is a verified fix (None: no boundary marks them); `ends`, for a slice to
        the model's output of which only part needs them, the boundaries giving the rest
        (None: not so)."""
        example = ""
        if ends:
            example = f", for example end={ends[0] if len(ends) == 1 else ends!r}"
        return cls(
            start=start,
            end=end,
            values=values,
            starts=starts,
            ends=ends,
            what=" and ".join(values) or "a value computed before the start",
            verb="are" if len(values) > 1 else "is",
            fix=cls.FIX.format(starts=starts) if starts else cls.NO_FIX,
            narrower="" if ends is None else cls.NARROWER.format(example=example),
        )


class DisconnectedError(SliceError):
    """An end (or a start) is not connected to the rest of the slice.

    Reproducer: ``start="head", end="stem"``, where ``stem`` runs before ``head``.
    """

    ORDER = (
        "\nCheck the order of `start` and `end`: `print(js.boundaries(...))` lists the "
        "module calls in the order they run."
    )
    TEMPLATE = "{what}" + ORDER


class InputMismatchError(SliceError):
    """A slice was called with inputs of the wrong structure, shape or dtype.

    Reproducer: calling a slice traced for ``float32[8, 16]`` with ``float32[8, 17]``.
    """


class InvalidSpecError(SliceError):
    """`start`, `end` or `names` is not of a supported form.

    Reproducer: ``js.slice(model, variables, x, end=3)``.
    """


class ModelTraceError(SliceError):
    """The model itself refused to run with the arguments jaxslice traced it with.

    Reproducer: ``sub.apply(variables, x, train=True)`` on a model with dropout, without
    ``rngs={"dropout": key}``. The model's own error is chained as ``__cause__``.
    """

    TEMPLATE = "Tracing the model{mode} failed{where}: {kind}: {error}{hint}"


class AttributeMutationError(SliceError):
    """An NNX model changed a Python attribute while it was being traced.

    Reproducer: a module whose ``__call__`` does ``self.calls += 1`` on a plain int.
    """

    TEMPLATE = (
        "The model changed its Python attributes while it ran ({detail}). A slice re-runs only "
        "part of the model and cannot replay such changes, so its results would drift from the "
        "model's.\nKeep values that change in `nnx.Variable`s (e.g. `self.calls = "
        "nnx.Variable(jnp.array(0))`), which jaxslice tracks as state."
    )


class VariablesMismatchError(SliceError):
    """Variables passed to a slice do not match the variables the slice uses.

    Reproducer: ``sub.apply(full_variables, x)`` with extra entries; pass
    ``sub.variables`` (or the result of training them) instead.
    """
