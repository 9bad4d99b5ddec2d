"""Copies of what keeps state across batches: a coverage tracker or `ActivationStats`
copied (`copy.copy`, `copy.deepcopy`) branches off, the copy and the original each going
on from what was seen before the copy; a lens copies as itself. None of them pickles:
that is a `js.SliceError` saying what to save.

Oracles: the pair criteria's NumPy brute force (`helpers.coverage_reference`) and NumPy
statistics, both over layer outputs from Flax's ``capture_intermediates``.
"""

from __future__ import annotations

import copy
import pickle

import jax
import numpy as np
import pytest

import jaxslice as js

from helpers.coverage_reference import Spec, assert_result, ref_result
from helpers.models import CoverageMLP
from helpers.oracles import captured, random_variables

C = js.coverage
LAYERS = ["fc1", "fc2", "head"]


@pytest.fixture(scope="module")
def mlp():
    model = CoverageMLP()
    a, b, c = (jax.random.normal(jax.random.key(k), (8, 4)) for k in range(3))
    return model, random_variables(model, a), (a, b, c)


def _outputs(model, variables, *batches):
    """Each layer's outputs over `batches`, from Flax (not from jaxslice)."""
    x = np.concatenate([np.asarray(b) for b in batches])
    return {k: np.asarray(v[0]) for k, v in captured(model, variables, x).items()}


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_copied_tracker_branches_off(mlp, how):
    model, variables, (a, b, c) = mlp
    specs = [Spec("SignSign"), Spec("ValueValue", ratio=2.0)]
    crits = [C.SignSign(), C.ValueValue(ratio=2.0)]  # their update donates its state
    tracker = C.Tracker(model, variables, a, criteria=crits, layers=LAYERS)
    tracker.update(a)
    branch = how(tracker)
    branch.update(b)
    tracker.update(c)
    expect = lambda *seen: ref_result(specs, LAYERS, _outputs(model, variables, *seen))  # noqa: E731
    assert_result(branch.result(), expect(a, b))
    assert_result(tracker.result(), expect(a, c))
    branch.reset()  # the original keeps what it saw
    assert_result(tracker.result(), expect(a, c))


def test_copied_activation_stats_branch_off(mlp):
    model, variables, (a, b, c) = mlp
    stats = js.ActivationStats(model, variables, a, names=LAYERS, per="channel")
    stats.update(a)
    branch = copy.deepcopy(stats)
    branch.update(b)
    stats.update(c)
    for got, seen in ((branch.result(), (a, b)), (stats.result(), (a, c))):
        outs = _outputs(model, variables, *seen)
        for name in LAYERS:
            want = outs[name].astype(np.float64)
            np.testing.assert_allclose(got[name]["mean"], want.mean(0), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[name]["std"], want.std(0), rtol=1e-4, atol=1e-6)
            np.testing.assert_array_equal(got[name]["max"], want.max(0).astype(np.float32))
            assert got[name]["count"] == len(want)


def test_a_lens_copies_as_itself(mlp):
    model, variables, (a, _, _) = mlp
    lens = js.lens(model, variables, a)
    assert copy.copy(lens) is lens
    assert copy.deepcopy({"lens": lens})["lens"] is lens


def _cloudpickle_dumps(obj):
    return pytest.importorskip("cloudpickle").dumps(obj)


@pytest.mark.parametrize("dumps", [pickle.dumps, _cloudpickle_dumps], ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("kind", ["Tracker", "ActivationStats", "lens"])
def test_pickling_an_observer_or_a_lens_says_what_to_save(mlp, kind, dumps):
    model, variables, (a, _, _) = mlp
    made = {
        "Tracker": lambda: C.Tracker(model, variables, a, criteria=[C.NC()]),
        "ActivationStats": lambda: js.ActivationStats(model, variables, a),
        "lens": lambda: js.lens(model, variables, a),
    }[kind]()
    with pytest.raises(js.SliceError, match="cannot be pickled") as info:
        dumps(made)
    assert ("result()" if kind != "lens" else "variables") in str(info.value)
