"""Errors of the tools built on slices: observers (`js.observe`), coverage
(`js.coverage`, its criteria and `generate`) and drawing with Graphviz."""

from __future__ import annotations

from .base import InputMismatchError, InvalidSpecError, SliceError

# --------------------------------------------------------------------------- observers


class ChoiceError(InvalidSpecError):
    """An option (`per`, `position`, `granularity`) is not one of its choices."""

    TEMPLATE = "{option} must be one of {choices}, got {value!r}."


class LayersSpecError(InvalidSpecError):
    """`layers` is neither a list of boundary names nor None."""

    TEMPLATE = "`layers` must be a list of boundary names or None, got {layers!r}."


class NoLayersError(InvalidSpecError):
    """No `layers` were named and the model has no module with parameters."""

    TEMPLATE = "No layers to observe: the model has no module with parameters; name `layers`."


class BatchMismatchError(InputMismatchError):
    """A batch does not hold the model's inputs with the sample's non-batch shapes."""

    TEMPLATE = (
        "A batch must hold the model's inputs with the sample's non-batch shapes and dtypes "
        "({sample}); got ({got}). The inputs whose leading axis had the sample's batch size "
        "share one batch size; the others keep the sample's shape."
    )


# --------------------------------------------------------------------------- coverage


class PositiveIntegerError(InvalidSpecError):
    """A criterion's count (``KMNC(k)``, ``TKNC(k)``, `capacity`) is not a positive integer."""

    TEMPLATE = "{name} must be a positive integer, got {value!r}."


class RatioError(InvalidSpecError):
    """A pair criterion's `ratio` is not a finite number >= 1."""

    TEMPLATE = "{name} ratio must be a finite number >= 1, got {ratio!r}."


class RatioRangeError(RatioError):
    """A pair criterion's `ratio` is larger than float32, the criteria's arithmetic, holds."""

    TEMPLATE = (
        "{name} ratio {ratio!r} is larger than float32 holds: neuron values are compared "
        "in float32, where it would be inf (and inf * 0 is NaN, so no value change from 0 "
        "would count). Give a ratio of at most {largest}."
    )


class ThresholdError(InvalidSpecError):
    """NC's threshold is not a number in [0, 1)."""

    TEMPLATE = "NC threshold must be a number in [0, 1), got {threshold!r}."


class CriteriaSpecError(InvalidSpecError):
    """`criteria` is empty or holds something other than criteria."""

    TEMPLATE = (
        "`criteria` must be a non-empty list of criteria such as js.coverage.NC(0.5), got "
        "{criteria!r}."
    )


class LayerBatchAxisError(InputMismatchError):
    """A layer to observe has no batch axis where the observers read it."""

    TEMPLATE = (
        "Layer {name!r} outputs {shape} for the sample batch of {batch} inputs, so its axis "
        "{axis} is not the batch axis, where the observers read each input's values from.\n"
        "{fix}"
    )


class ObservedKeywordInputsError(InputMismatchError):
    """An observer was made with array keyword inputs, which its batches cannot carry."""

    TEMPLATE = (
        "The model was given the array keyword inputs {names}, and an observer's batches "
        "are the model's positional inputs (an array, or a tuple of them). Pass them "
        "positionally, or observe a function that passes them on, e.g. "
        "`js.coverage.Tracker(lambda v, x, m: model.apply(v, x, {first}=m), variables, x, m)`, "
        "whose batches are then `(x, m)`."
    )


class ComplexOutputError(InvalidSpecError):
    """Layers to observe output complex values."""

    TEMPLATE = (
        "These layers output complex values, and statistics and coverage are of real ones: "
        "{names}. Observe the layer that takes their magnitude or real part, or leave them "
        "out of the layers named."
    )


class RepeatedCriteriaError(InvalidSpecError):
    """`criteria` holds one criterion more than once."""

    TEMPLATE = (
        "`criteria` holds {names} more than once; criteria with equal settings measure the "
        "same thing (and would share one result name), so give each once."
    )


class NoArrayOutputError(InvalidSpecError):
    """Layers to observe return no array."""

    TEMPLATE = (
        "These layers return no array (only Python values), so there is nothing to observe: "
        "{names}. Leave them out of the layers named, or name the layer that computes what "
        "they return."
    )


class ScalarLayersError(InvalidSpecError):
    """Coverage was asked of layers that output a scalar."""

    TEMPLATE = (
        "Coverage takes neurons from a batched output, and {names} output a scalar.\n"
        "Observe a layer whose output is batched (e.g. the layer that feeds it), or leave it out "
        "of `layers`."
    )


class UnknownCriterionError(InvalidSpecError):
    """A coverage result was asked for a criterion it does not have."""

    TEMPLATE = "No criterion {name!r} in this result; it has {known}."


class NoBatchesError(InvalidSpecError):
    """`profile` was given no batches."""

    TEMPLATE = (
        "`profile` got no batches (or only empty ones); pass an iterable of training batches."
    )


class ObserverNotPicklableError(SliceError):
    """A coverage tracker or activation statistics were pickled."""

    TEMPLATE = (
        "This {kind} holds a traced model and compiled steps, so it cannot be pickled. Save what "
        "it measured instead (`result()` gives a dict, which pickles); to branch one off, "
        "`copy.copy` gives a {kind} of the same model with its own copy of the state."
    )


class NaNProfileError(SliceError):
    """A profile gave NaN ranges: a profiling input, or the model on it, gave NaN."""

    TEMPLATE = (
        "The profile's ranges are NaN for {neurons} (a profiling input, or the model on "
        "it, gave NaN); with NaN bounds {names} would never cover those neurons, whatever "
        "the test inputs.\nDrop the inputs that give NaN (e.g. keep "
        "`x[np.isfinite(x).reshape(len(x), -1).all(axis=1)]`) and profile again; the "
        "tracker keeps the profile it had before this call."
    )


class ProfileNeededError(SliceError):
    """Criteria that need a profile were used before `tracker.profile`."""

    TEMPLATE = (
        "{names} need a profile of the neurons' ranges on training data before use.\n"
        "Call `tracker.profile(train_batches)` first (any iterable of batches)."
    )


class CapacityError(SliceError):
    """A pair criterion was given more inputs than its `capacity`."""

    TEMPLATE = (
        "{criterion} keeps the activation pattern of every input and holds at most "
        "{capacity}; {seen} were seen and this batch has {batch}. Make it with a larger "
        "`capacity` (e.g. {kind}(capacity={suggested}))."
    )


# --------------------------------------------------------------------------- generate


class AmbiguousCriterionError(InvalidSpecError):
    """`generate` was given a criterion name the tracker has none or several of."""

    TEMPLATE = (
        "The tracker has {how} criteria matching {criterion!r}; name one of {names} (or pass "
        "the criterion object)."
    )


class UngeneratableCriterionError(InvalidSpecError):
    """`generate` was asked to search inputs for a criterion it does not search for."""

    TEMPLATE = (
        "`generate` searches inputs for NC, SignSign, ValueSign, SignValue and ValueValue, not "
        "{name}."
    )


class PositiveNumberError(InvalidSpecError):
    """A `generate` option is not a positive finite number."""

    TEMPLATE = "`{name}` must be a positive finite number, got {value!r}."


class PositiveCountError(InvalidSpecError):
    """A `generate` option is not a positive integer."""

    TEMPLATE = "`{name}` must be a positive integer, got {value!r}."


class NoFloatSeedsError(InvalidSpecError):
    """`generate` was given seeds without floating-point inputs."""

    TEMPLATE = "`generate` moves floating-point inputs, and the seeds have none ({dtypes})."


class BoundsSpecError(InvalidSpecError):
    """`bounds` is neither ``(low, high)`` nor None."""

    TEMPLATE = "`bounds` must be (low, high) or None, got {bounds!r}."


class BoundsOrderError(InvalidSpecError):
    """`bounds` has low >= high somewhere."""

    TEMPLATE = "`bounds` must have low < high everywhere, got {bounds!r}."


class BoundsShapeError(InvalidSpecError):
    """`bounds` do not broadcast to the seeds' shape."""

    TEMPLATE = "`bounds` of shapes {low} and {high} do not broadcast to the seeds' shape {shape}."


class SeedsOutOfBoundsError(InvalidSpecError):
    """Some seeds lie outside `bounds`."""

    TEMPLATE = (
        "Some seeds lie outside `bounds` {bounds!r}; clip them first, e.g. "
        "np.clip(seeds, low, high)."
    )


class NotATrackerError(InvalidSpecError):
    """`generate` was given something other than a coverage tracker."""

    TEMPLATE = (
        "`generate` searches for inputs against a coverage tracker, got {kind}: make one "
        "with `js.coverage.Tracker(model, ..., criteria=[...])`, update it with the seeds, "
        "and pass it."
    )


class KeySpecError(InvalidSpecError):
    """`key` is neither a `jax.random` key nor an int."""

    TEMPLATE = "`key` must be a jax.random key or an int, got {key!r}."


# --------------------------------------------------------------------------- Graphviz


class DotNotFoundError(SliceError):
    """Rendering needs Graphviz's `dot` program, which is not on PATH."""

    TEMPLATE = (
        "Rendering needs Graphviz's `dot` program, which was not found on PATH. Install it with "
        "`apt-get install graphviz` (Debian/Ubuntu), `brew install graphviz` (macOS) or "
        "`conda install graphviz`. `to_dot()` gives the DOT source without it."
    )


class DotFailedError(SliceError):
    """Graphviz's `dot` failed to render a file."""

    TEMPLATE = "`dot` failed to render {path!r}: {stderr}"


class DotSvgFailedError(SliceError):
    """Graphviz's `dot` failed to draw SVG."""

    TEMPLATE = "`dot` failed to draw SVG: {stderr}"


class DotTimeoutError(SliceError):
    """Graphviz's `dot` took longer than the timeout to lay a graph out."""

    TEMPLATE = (
        "`dot` took more than {seconds:g} s to lay the graph out. Draw fewer levels with "
        "`to_dot(depth=1)`, or render to a file with `render(path)`."
    )
