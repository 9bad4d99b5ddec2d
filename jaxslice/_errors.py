"""Errors jaxslice raises on bad input.

Every error is a `SliceError`, so `except js.SliceError` catches anything jaxslice
rejects. Each subclass says what failed, shows the offending value in context and
suggests a fix. Long messages are templates kept here, beside their class.
"""

from __future__ import annotations


class SliceError(Exception):
    """Base class of every error jaxslice raises on bad input.

    >>> import jaxslice as js
    >>> issubclass(js.UnknownBoundaryError, js.SliceError)
    True
    """


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
        "start of the slice and is not one of its inputs.\n{fix}"
    )
    FIX = "Add it to `start`, for example: start={starts!r}"
    NO_FIX = (
        "No boundary marks that value where a slice could start from it. Start at an "
        "earlier boundary that everything the slice needs derives from (or at None, the "
        "model's inputs), or mark the value with `js.mark`."
    )


class DisconnectedError(SliceError):
    """An end (or a start) is not connected to the rest of the slice.

    Reproducer: ``start="head", end="stem"``, where ``stem`` runs before ``head``.
    """

    TEMPLATE = (
        "{what}\nCheck the order of `start` and `end`: `print(js.boundaries(...))` lists the "
        "module calls in the order they run."
    )


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

    TEMPLATE = "Tracing the model{mode} failed{where}: {error}{hint}"
    RNG_HINT = (
        "\nThe model draws random numbers in this mode: pass the keys it needs, e.g. "
        "`sub.apply(sub.variables, x, train=True, rngs={'dropout': key})` (or `rngs=` to "
        "js.slice)."
    )


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
