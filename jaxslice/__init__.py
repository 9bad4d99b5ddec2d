"""jaxslice: slice, inspect and edit JAX and Flax models at the jaxpr level."""

from . import coverage as coverage
from ._activations import ActivationStats as ActivationStats
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
from ._interpret import Equation as Equation
from ._interpret import Interpreter as Interpreter
from ._listing import Boundary as Boundary
from ._listing import BoundaryTable as BoundaryTable
from ._listing import boundaries as boundaries
from ._nnx_module import SlicedModule as SlicedModule
from ._slice import Sliceable as Sliceable
from ._slice import slice as slice  # noqa: A004
from ._sliced import Sliced as Sliced
from ._version import __version__ as __version__
from .adapters._plain import mark as mark

__all__ = [
    "ActivationStats",
    "AmbiguousBoundaryError",
    "AttributeMutationError",
    "Boundary",
    "BoundaryInLoopError",
    "BoundaryTable",
    "DisconnectedError",
    "Editor",
    "Equation",
    "InputMismatchError",
    "Interpreter",
    "InvalidSpecError",
    "MissingInputError",
    "ModelTraceError",
    "SliceError",
    "Sliceable",
    "Sliced",
    "SlicedModule",
    "UnknownBoundaryError",
    "UnsupportedTargetError",
    "VariablesMismatchError",
    "__version__",
    "boundaries",
    "coverage",
    "edit",
    "intermediates",
    "mark",
    "slice",
]
