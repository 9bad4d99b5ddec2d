"""Compiled observation of a model's layers over streams of batches.

`Observer` runs a model up to chosen layers in one compiled step per input shape and
feeds their outputs to an accumulator; `ActivationStats` (and `js.coverage`) build on it.
"""

from ._activations import ActivationStats as ActivationStats
from ._activations import StatsResult as StatsResult
from ._moments import Moments as Moments
from ._observer import GRANULARITIES as GRANULARITIES
from ._observer import Observer as Observer
from ._observer import neuron_count as neuron_count
from ._observer import neurons as neurons
from ._observer import scaled as scaled

__all__ = [
    "GRANULARITIES",
    "ActivationStats",
    "Moments",
    "Observer",
    "StatsResult",
    "neuron_count",
    "neurons",
    "scaled",
]
