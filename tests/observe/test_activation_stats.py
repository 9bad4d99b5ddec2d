"""`js.ActivationStats`: streaming statistics of boundary outputs.

The oracle is NumPy over the outputs Flax's ``capture_intermediates`` records for all
inputs at once (with ``relu`` applied by hand for ``position="activation"``); for a Keras
model, over those of a functional Keras sub-model sharing its layers.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import CoverageCNN
from helpers.oracles import captured, import_keras, random_input, random_variables

CNN = CoverageCNN


MODEL = CNN()
X = random_input(0, (2, 5, 5, 2))
VARIABLES = random_variables(MODEL, X, seed=0)
BATCHES = [random_input(s, (4, 5, 5, 2)) for s in (1, 2, 3)]
ALL = jnp.concatenate(BATCHES)


def capture(x):
    """Flax's capture_intermediates: {module path: output}."""
    return {k: np.asarray(v[0], np.float64) for k, v in captured(MODEL, VARIABLES, x).items() if k}


CAPTURED = capture(ALL)


def numpy_stats(values, per):
    flat = values.reshape(-1) if per == "tensor" else values.reshape(-1, values.shape[-1])
    return {
        "mean": flat.mean(0),
        "std": flat.std(0),
        "min": flat.min(0),
        "max": flat.max(0),
        "zero_fraction": (flat == 0).mean(0),
        "count": float(flat.shape[0]),
    }


def assert_stats(got, want):
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == {"mean", "std", "min", "max", "zero_fraction", "count"}
        for key, value in want[name].items():
            np.testing.assert_allclose(
                np.asarray(got[name][key]), value, rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}"
            )


@pytest.mark.parametrize("per", ["tensor", "channel"])
def test_output_statistics_stream_over_batches(per):
    names = ["conv1", "conv2", "head"]
    stats = js.ActivationStats(MODEL, VARIABLES, X, names=names, per=per)
    for b in BATCHES:
        stats.update(b)
    got = stats.result()
    assert list(got) == names
    assert_stats(got, {n: numpy_stats(CAPTURED[n], per) for n in names})
    if per == "tensor":
        assert all(isinstance(got[n][k], float) for n in names for k in got[n])
    else:
        assert np.shape(got["conv2"]["mean"]) == (4,)


def test_a_keras_model_is_read_as_it_trains():
    """Statistics made before the model trains follow its variables: an update reads the
    model's `keras.Variable`s then, as its slices do."""
    keras = import_keras()
    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    h = keras.layers.Dense(6, activation="relu", name="fc1")(inp)
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(h))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    names = ["fc1", "head"]
    stats = js.ActivationStats(model, x[:2], names=names)
    sub = keras.Model(model.inputs[0], [model.get_layer(n).output for n in names])
    values = lambda: zip(names, sub(x), strict=True)  # noqa: E731
    before = {n: numpy_stats(np.asarray(o, np.float64), "tensor") for n, o in values()}
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, rng.normal(size=(16, 2)).astype(np.float32), epochs=10, verbose=0)
    stats.update(x[:8])
    stats.update(x[8:])
    after = {n: numpy_stats(np.asarray(o, np.float64), "tensor") for n, o in values()}
    assert abs(after["head"]["mean"] - before["head"]["mean"]) > 1e-3  # the training moved it
    assert_stats(stats.result(), after)


def test_activation_position_streaming_equals_one_batch():
    stats = js.ActivationStats(MODEL, VARIABLES, X, per="channel", position="activation")
    assert stats.names == ["conv1", "conv2", "head"]  # modules with parameters
    for b in BATCHES:
        stats.update(b)
    streamed = stats.result()
    want = {
        "conv1": numpy_stats(np.maximum(CAPTURED["conv1"], 0), "channel"),
        "conv2": numpy_stats(np.maximum(CAPTURED["conv2"], 0), "channel"),
        "head": numpy_stats(CAPTURED["head"], "channel"),  # nothing follows the head
    }
    assert_stats(streamed, want)
    assert (streamed["conv1"]["zero_fraction"] > 0).any()
    assert (np.asarray(streamed["conv1"]["min"]) >= 0).all()
    stats.reset()
    stats.update(ALL)
    assert_stats(
        stats.result(), {n: {k: np.asarray(v) for k, v in r.items()} for n, r in streamed.items()}
    )
    stats.reset()
    for b in reversed(BATCHES):
        stats.update(b)
    assert_stats(
        stats.result(), {n: {k: np.asarray(v) for k, v in r.items()} for n, r in streamed.items()}
    )


def test_errors():
    with pytest.raises(js.SliceError, match="per"):
        js.ActivationStats(MODEL, VARIABLES, X, per="bogus")
    with pytest.raises(js.SliceError, match="position"):
        js.ActivationStats(MODEL, VARIABLES, X, position="bogus")
    with pytest.raises(js.SliceError, match="conv1"):
        js.ActivationStats(MODEL, VARIABLES, X, names=["conv_1"])
    stats = js.ActivationStats(MODEL, VARIABLES, X, names=["conv1"])
    with pytest.raises(js.SliceError):
        stats.update(jnp.ones((2, 5, 5, 3)))
