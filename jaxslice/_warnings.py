"""Warnings jaxslice gives about input it accepts but that is likely a mistake.

Like the errors (`_errors`), each warning class formats its message from the facts a
call site passes (`TEMPLATE`).
"""

from __future__ import annotations


class SingleArgumentWarning(UserWarning):
    """A plain function that takes one argument was given one: jaxslice passes a plain
    function its parameters first (``fn(params, *inputs)``), so that argument is taken
    as the parameters, and the function has no inputs.

    Reproducer: ``js.slice(lambda t: model(t), tokens)``.
    """

    TEMPLATE = (
        "{name} takes one argument, and a plain function's first argument holds its "
        "parameters (`fn(params, *inputs)`), so the argument given is taken as the "
        "parameters: its arrays count as parameters, not inputs, and a slice of it takes "
        "no inputs. If it is the model's input, take the parameters first and pass them "
        "(None where there are none): js.slice(lambda params, t: model(t), None, tokens), "
        "or pass the model itself where it is a kind jaxslice knows: js.slice(model, ...)."
    )

    @classmethod
    def of(cls, name: str) -> SingleArgumentWarning:
        return cls(cls.TEMPLATE.format(name=name))
