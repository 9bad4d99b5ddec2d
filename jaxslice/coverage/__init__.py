"""Structural test coverage of neural networks: `js.coverage.Tracker` and its criteria.

>>> import jaxslice as js
>>> [c.__name__ for c in (js.coverage.NC, js.coverage.KMNC, js.coverage.SignSign)]
['NC', 'KMNC', 'SignSign']
"""

from ._criteria import KMNC as KMNC
from ._criteria import NBC as NBC
from ._criteria import NC as NC
from ._criteria import SNAC as SNAC
from ._criteria import TKNC as TKNC
from ._criteria import Criterion as Criterion
from ._generate import Generated as Generated
from ._generate import generate as generate
from ._pairs import SignSign as SignSign
from ._pairs import SignValue as SignValue
from ._pairs import ValueSign as ValueSign
from ._pairs import ValueValue as ValueValue
from ._result import CoverageResult as CoverageResult
from ._tracker import Tracker as Tracker

__all__ = [
    "KMNC",
    "NBC",
    "NC",
    "SNAC",
    "TKNC",
    "CoverageResult",
    "Criterion",
    "Generated",
    "SignSign",
    "SignValue",
    "ValueSign",
    "ValueValue",
    "Tracker",
    "generate",
]
