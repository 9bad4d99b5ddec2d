"""jaxslice: slice, inspect and edit JAX and Flax models at the jaxpr level."""

from typing import Any

from . import coverage as coverage
from ._boundaries import boundaries as boundaries
from ._caches import clear_caches as clear_caches
from ._core.program import BuildInfo as BuildInfo
from ._edit import Editor as Editor
from ._edit import edit as edit
from ._errors import AmbiguousBoundaryError as AmbiguousBoundaryError
from ._errors import AttributeMutationError as AttributeMutationError
from ._errors import BoundaryInLoopError as BoundaryInLoopError
from ._errors import DisconnectedError as DisconnectedError
from ._errors import InputMismatchError as InputMismatchError
from ._errors import InvalidSpecError as InvalidSpecError
from ._errors import MissingInputError as MissingInputError
from ._errors import ModelTraceError as ModelTraceError
from ._errors import SliceError as SliceError
from ._errors import UnknownBoundaryError as UnknownBoundaryError
from ._errors import UnsupportedTargetError as UnsupportedTargetError
from ._errors import VariablesMismatchError as VariablesMismatchError
from ._intermediates import intermediates as intermediates
from ._interpreter import Equation as Equation
from ._interpreter import Interpreter as Interpreter
from ._lens import Lens as Lens
from ._lens import lens as lens
from ._lens_sites import Site as Site
from ._slice import Sliceable as Sliceable
from ._slice import slice as slice  # noqa: A004
from ._sliced import Sliced as Sliced
from ._table import Boundary as Boundary
from ._table import BoundaryTable as BoundaryTable
from ._version import __version__ as __version__
from ._warnings import SingleArgumentWarning as SingleArgumentWarning
from .adapters._plain import mark as mark
from .observe import ActivationStats as ActivationStats


def __getattr__(name: str) -> Any:
    # `SlicedModule` is an `nnx.Module`: importing it imports Flax NNX, so it is loaded
    # only when asked for (an NNX slice, or this attribute).
    if name == "SlicedModule":
        from .adapters._nnx_module import SlicedModule

        return SlicedModule
    # `KerasSlice` is a `keras.Model`, loaded the same way (a Keras slice, or this
    # attribute, which also registers it for `keras.saving.load_model`).
    if name == "KerasSlice":
        try:
            from .adapters._keras_model import KerasSlice
        except ImportError as error:
            raise ImportError(
                "js.KerasSlice is a keras.Model, so it needs Keras 3: pip install keras "
                f"(importing it failed: {error})"
            ) from error
        return KerasSlice
    raise AttributeError(f"module 'jaxslice' has no attribute {name!r}")


__all__ = [
    "ActivationStats",
    "AmbiguousBoundaryError",
    "AttributeMutationError",
    "Boundary",
    "BuildInfo",
    "BoundaryInLoopError",
    "BoundaryTable",
    "DisconnectedError",
    "Editor",
    "Equation",
    "InputMismatchError",
    "Interpreter",
    "Lens",
    "InvalidSpecError",
    "MissingInputError",
    "ModelTraceError",
    "SingleArgumentWarning",
    "Site",
    "SliceError",
    "Sliceable",
    "Sliced",
    "SlicedModule",
    "UnknownBoundaryError",
    "UnsupportedTargetError",
    "VariablesMismatchError",
    "__version__",
    "boundaries",
    "clear_caches",
    "coverage",
    "edit",
    "intermediates",
    "lens",
    "mark",
    "slice",
]
