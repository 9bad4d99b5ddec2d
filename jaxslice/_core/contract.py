"""What the core and the adapters share: a call's arguments sorted by role (`Split`).

The core asks a model-kind adapter (`adapters.Adapter`) every question whose answer
depends on the kind of model, but never finds one itself: whoever traces a target finds
its adapter (`adapters.adapter_for`) and passes it in. So `_core` does not import
`adapters`; the adapters import the core (its markers, this module).
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: What the core takes for a model-kind adapter: an `adapters.Adapter`, passed in.
Adapter = Any


@dataclasses.dataclass
class Split:
    """A target's call arguments, sorted by role."""

    variables: Any  # parameters and state (a pytree)
    rngs: Any  # random keys (a pytree, often None)
    args: tuple[Any, ...]  # positional model inputs
    kwargs: dict[str, Any]  # keyword model inputs that hold arrays
    mode: dict[str, Any]  # keyword arguments without arrays: they select a mode
    mutable: Any = False  # collections the call may update (linen's `mutable`)
