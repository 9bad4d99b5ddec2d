"""Observed layers in a scanned stack: named as given, each layer once, at any batch size.

`ActivationStats` and the coverage trackers resolve each layer name once; a batch of a
new size traces the model again, where the same layers are observed. A stacked name
(``layers[:]/mlp``) is tracked as one layer per iteration, named as the model lists
them, and a layer named twice (stacked and as one iteration) is tracked once.

The oracle is NumPy over the outputs Flax's ``capture_intermediates`` records for an
unrolled twin of the scanned model (the same weights, its blocks in a Python loop).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxslice as js

from helpers.models import SCAN_LAYERS, ScannedModel, ScanUnrolled, scan_unrolled_params
from helpers.oracles import captured, random_variables

MODEL = ScannedModel()
X = np.random.default_rng(0).normal(size=(7, 4)).astype("float32")
VARIABLES = random_variables(MODEL, X[:2], seed=1)


@pytest.fixture(scope="module")
def twin():
    """{unrolled module path: output} for all of `X`."""
    cap = captured(ScanUnrolled(), scan_unrolled_params(VARIABLES), X)
    return {k: np.asarray(v[0], np.float32) for k, v in cap.items() if hasattr(v[0], "shape")}


def test_stats_of_iterations_keep_the_given_names_across_batch_sizes(twin):
    names = ["head", "layers[-1]/attn", "layers[1]/mlp"]
    stats = js.ActivationStats(MODEL, VARIABLES, X[:2], names=names, per="channel")
    stats.update(X[:2])
    stats.update(X[2:])  # a new batch size: the model is traced again
    result = stats.result()
    assert list(result) == ["layers[1]/mlp", "layers[-1]/attn", "head"]  # call order
    for name, path in [
        ("layers[1]/mlp", "layers_1/mlp"),
        ("layers[-1]/attn", f"layers_{SCAN_LAYERS - 1}/attn"),
        ("head", "head"),
    ]:
        want = twin[path]
        np.testing.assert_allclose(result[name]["mean"], want.mean(0), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(result[name]["min"], want.min(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result[name]["max"], want.max(0), rtol=1e-5, atol=1e-6)
        assert result[name]["count"] == len(X)


def test_a_layer_named_stacked_and_as_one_iteration_is_tracked_once(twin):
    layers = ["layers[-1]/mlp:input", "head", "layers[:]/mlp:input"]
    t = js.coverage.Tracker(MODEL, VARIABLES, X[:2], criteria=[js.coverage.NC(0.5)], layers=layers)
    each = [f"layers[{k}]/mlp:input" for k in range(SCAN_LAYERS)]
    assert t.layers == [*each, "head"]
    t.update(X[:2])
    t.update(X[2:])
    per_layer = t.result()["NC"]["layers"]
    assert list(per_layer) == t.layers
    # NC: the fraction of neurons over 0.5 for some input, each input's layer values
    # min-max scaled to [0, 1] (neurons are channels: here the elements of each row).
    inputs = [np.tanh(twin[f"layers_{k}/attn"]) for k in range(SCAN_LAYERS)]
    for name, values in zip(t.layers, [*inputs, twin["head"]], strict=True):
        lo, hi = values.min(1, keepdims=True), values.max(1, keepdims=True)
        scaled = np.where(hi > lo, (values - lo) / np.where(hi > lo, hi - lo, 1), 0)
        assert per_layer[name] == pytest.approx(np.mean((scaled > 0.5).any(0)))
