"""A Keras slice is a `keras.Model` sharing the model's variables. Oracles: Keras's own
functional sub-models (``keras.Model(inp, layer.output)``) of a twin with equal weights."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import import_keras

X = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")


@pytest.fixture(scope="module")
def keras():
    return import_keras()


def make(keras):
    keras.utils.set_random_seed(4)
    inp = keras.Input((4,))
    h = keras.layers.Dense(5, activation="tanh", name="a")(inp)
    h = keras.layers.Dense(3, name="b")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="c")(h))


def test_fit_trains_the_models_own_layers_as_a_functional_sub_model(keras):
    model, twin = make(keras), make(keras)
    sub = js.slice(model, X, end="b")
    assert isinstance(sub, keras.Model)
    assert {id(v) for v in sub.trainable_variables} == {
        id(v) for name in "ab" for v in model.get_layer(name).trainable_variables
    }
    oracle = keras.Model(twin.input, twin.get_layer("b").output)
    np.testing.assert_allclose(sub.predict(X, verbose=0), oracle.predict(X, verbose=0), atol=1e-5)
    for m in (sub, oracle):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.fit(X, Y, epochs=2, batch_size=4, shuffle=False, verbose=0)
    for mine, theirs in zip(model.weights, twin.weights, strict=True):
        np.testing.assert_allclose(mine.value, theirs.value, rtol=1e-5, atol=1e-5)
    assert not np.allclose(model.get_layer("c").kernel.value, 0)
    np.testing.assert_allclose(
        sub.evaluate(X, Y, verbose=0), oracle.evaluate(X, Y, verbose=0), rtol=1e-5
    )
    np.testing.assert_allclose(sub(X), oracle(X), atol=1e-5)


# Keras's own weight files convert variables through `np.array(v)`, which NumPy 2 warns
# about for Keras's variables (saving the model itself warns the same way).
KERAS_NUMPY_WARNING = "ignore:__array__ implementation:DeprecationWarning"


@pytest.mark.filterwarnings(KERAS_NUMPY_WARNING)
def test_save_weights_round_trip_writes_the_shared_variables(keras, tmp_path):
    model = make(keras)
    sub = js.slice(model, X, end="b")
    path = str(tmp_path / "s.weights.h5")
    sub.save_weights(path)
    kernels = [model.get_layer(name).kernel for name in "abc"]
    saved = [np.asarray(k.value) for k in kernels]
    for k in kernels:
        k.assign(np.zeros(k.shape, "float32"))
    sub.load_weights(path)
    np.testing.assert_array_equal(kernels[0].value, saved[0])
    np.testing.assert_array_equal(kernels[1].value, saved[1])
    np.testing.assert_array_equal(kernels[2].value, 0)  # not in the slice: not in its file
    # Another slice made the same way, of a twin with other weights, loads the same file.
    keras.utils.set_random_seed(9)
    other = js.slice(keras.models.clone_model(model), X, end="b")
    other.load_weights(path)
    np.testing.assert_allclose(other.predict(X, verbose=0), sub.predict(X, verbose=0), atol=1e-6)


def make_bn(keras, seed=4):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, name="a")(inp)
    h = keras.layers.BatchNormalization(momentum=0.5, name="bn")(h)
    h = keras.layers.Dropout(0.3, name="drop")(h)
    h = keras.layers.Dense(3, name="b")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="c")(h))


def test_fit_in_training_mode_updates_moving_statistics_and_seeds_as_keras_does(keras):
    model, twin = make_bn(keras), make_bn(keras)
    sub = js.slice(model, X, end="b")
    oracle = keras.Model(twin.input, twin.get_layer("b").output)
    for m in (sub, oracle):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.fit(X, Y, epochs=2, batch_size=4, shuffle=False, verbose=0)
    moving = model.get_layer("bn").moving_mean
    assert not np.allclose(moving.value, 0)  # the statistics moved
    for mine, theirs in zip(model.variables, twin.variables, strict=True):
        assert mine.name == theirs.name
        np.testing.assert_allclose(mine.value, theirs.value, rtol=1e-5, atol=1e-5)
    # An eager call in training mode assigns as a Keras layer call does.
    np.testing.assert_allclose(sub(X, training=True), oracle(X, training=True), atol=1e-5)
    np.testing.assert_allclose(moving.value, twin.get_layer("bn").moving_mean.value, atol=1e-6)
    # Inference mode leaves them alone.
    before = np.asarray(moving.value)
    sub(X, training=False)
    np.testing.assert_array_equal(moving.value, before)


@pytest.mark.filterwarnings(KERAS_NUMPY_WARNING)
def test_keras_file_round_trip_rebuilds_and_reslices_the_model(keras, tmp_path):
    model, twin = make_bn(keras), make_bn(keras, seed=11)
    sub = js.slice(model, X, start="bn", end="b")
    sub.compile(optimizer="sgd", loss="mse")
    sub.fit(np.ones((8, 6), "float32"), np.zeros((8, 3), "float32"), epochs=1, verbose=0)
    path = str(tmp_path / "s.keras")
    sub.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, js.KerasSlice) and loaded is not sub
    assert (loaded.start, loaded.end, loaded.name) == ("bn", "b", sub.name)
    assert [(v.name, v.shape) for v in loaded.weights] == [(v.name, v.shape) for v in sub.weights]
    h = np.random.default_rng(3).normal(size=(5, 6)).astype("float32")
    # Oracle: Keras's own functional sub-model of a twin given the saved layers' weights.
    for name in ("bn", "b"):
        twin.get_layer(name).set_weights(model.get_layer(name).get_weights())
    oracle = keras.Model(twin.get_layer("bn").input, twin.get_layer("b").output)
    np.testing.assert_allclose(
        loaded.predict(h, verbose=0), oracle.predict(h, verbose=0), atol=1e-5
    )
    assert loaded.optimizer is not None  # compiled as saved


def test_keras_file_of_a_model_without_config_is_refused_clearly(keras):
    class Net(keras.Model):  # subclassed, with a constructor argument and no get_config
        def __init__(self, width):
            super().__init__()
            self.a, self.b = keras.layers.Dense(width, name="a"), keras.layers.Dense(2, name="b")

        def call(self, x):
            return self.b(self.a(x))

    net = Net(3)
    net(X)
    sub = js.slice(net, X, end="a")
    np.testing.assert_allclose(sub(X), net.a(X), atol=1e-6)
    with pytest.raises(js.SliceError, match="get_config.*save_weights"):
        sub.get_config()


@pytest.mark.filterwarnings(KERAS_NUMPY_WARNING)
def test_keras_file_loads_in_a_new_process_once_the_class_is_named(keras, tmp_path):
    model = make(keras)
    sub = js.slice(model, X, start="b")
    path = tmp_path / "head.keras"
    sub.save(str(path))
    h = np.random.default_rng(5).normal(size=(3, 5)).astype("float32")
    np.save(tmp_path / "h.npy", h)
    code = (
        "import os, sys, numpy as np\n"
        "os.environ['KERAS_BACKEND'] = 'jax'\n"
        "import keras, jaxslice as js\n"
        "sub = keras.saving.load_model(sys.argv[1], custom_objects={'KerasSlice': js.KerasSlice})\n"
        "np.save(sys.argv[2], np.asarray(sub.predict(np.load(sys.argv[3]), verbose=0)))\n"
    )
    out = tmp_path / "out.npy"
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, str(path), str(out), str(tmp_path / "h.npy")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    oracle = keras.Model(model.get_layer("b").input, model.get_layer("c").output)
    np.testing.assert_allclose(np.load(out), oracle.predict(h, verbose=0), atol=1e-5)


def test_keras_slice_without_keras_names_the_install_command():
    # Runs without Keras too: a fresh process where `import keras` fails.
    code = (
        "import sys; sys.modules['keras'] = None\n"
        "import jaxslice as js\n"
        "try:\n"
        "    js.KerasSlice\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ImportError: js.KerasSlice is a keras.Model" in run.stdout
    assert "pip install keras" in run.stdout


def test_a_slice_follows_the_layers_trainable_flags_as_a_functional_sub_model(keras):
    model, twin = make_bn(keras), make_bn(keras)
    sub = js.slice(model, X, end="b")
    sub.predict(X, verbose=0)  # compiled before the flags change
    oracle = keras.Model(twin.input, twin.get_layer("b").output)
    frozen = [np.asarray(v.value) for v in model.get_layer("bn").variables]
    for m in (model, twin):
        m.get_layer("a").trainable = False
        m.get_layer("bn").trainable = False  # a frozen BatchNormalization keeps its statistics
    assert [id(v) for v in sub.trainable_variables] == [id(v) for v in model.get_layer("b").weights]
    assert [v.path for v in sub.trainable_variables] == [v.path for v in oracle.trainable_variables]
    for m in (sub, oracle):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        # The sample's batch size (the slice's compiled program), then a new one.
        m.fit(X, Y, epochs=2, batch_size=16, shuffle=False, verbose=0)
        m.fit(X, Y, epochs=1, batch_size=4, shuffle=False, verbose=0)
    for mine, theirs in zip(model.variables, twin.variables, strict=True):
        np.testing.assert_allclose(mine.value, theirs.value, rtol=1e-5, atol=1e-5)
    for before, v in zip(frozen, model.get_layer("bn").variables, strict=True):
        np.testing.assert_array_equal(v.value, before)
    np.testing.assert_allclose(
        sub.predict(X[:5], verbose=0), oracle.predict(X[:5], verbose=0), atol=1e-5
    )
    # And back: trainable again (Keras asks for `compile` after a change of the flags).
    for m in (model, twin):
        m.get_layer("a").trainable = True
        m.get_layer("bn").trainable = True
    for m in (sub, oracle):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.fit(X, Y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    assert not np.allclose(model.get_layer("bn").moving_mean.value, frozen[2])
    for mine, theirs in zip(model.variables, twin.variables, strict=True):
        np.testing.assert_allclose(mine.value, theirs.value, rtol=1e-5, atol=1e-5)


def test_a_failed_predict_or_fit_leaves_the_model_and_the_slice_usable(keras):
    model = make(keras)
    sub = js.slice(model, X, end="b")
    sub.compile(optimizer="sgd", loss="mse")
    sub.fit(X, Y, epochs=1, verbose=0)
    want = np.asarray(model(X))
    wrong = np.ones((4, 5), "float32")  # 5 features where the model takes 4
    with pytest.raises(js.InputMismatchError):
        sub.predict(wrong, verbose=0)
    np.testing.assert_allclose(model(X), want, atol=1e-6)
    with pytest.raises(js.InputMismatchError):
        sub.fit(wrong, Y[:4], verbose=0)
    with pytest.raises(js.InputMismatchError):
        sub.train_on_batch(wrong, Y[:4])
    np.testing.assert_allclose(model(X), want, atol=1e-6)
    # A new slice, and the slice itself, still work (oracle: Keras's functional sub-model).
    oracle = keras.Model(model.input, model.get_layer("b").output)
    np.testing.assert_allclose(js.slice(model, X, end="b")(X), oracle(X), atol=1e-6)
    sub.fit(X, Y, epochs=1, verbose=0)
    np.testing.assert_allclose(sub.predict(X, verbose=0), oracle.predict(X, verbose=0), atol=1e-6)
