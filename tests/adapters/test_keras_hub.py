"""A keras-hub BertBackbone (Keras 3, JAX backend, small random config, no presets).

Oracles come from Keras itself: functional sub-models ending at a layer's output and
the backbone's own call.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import import_keras

keras = import_keras()
keras_hub = pytest.importorskip("keras_hub")

LAYERS = ["transformer_layer_0", "transformer_layer_1"]


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def bert():
    keras.utils.set_random_seed(0)
    bb = keras_hub.models.BertBackbone(
        vocabulary_size=100,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 100, (2, 8)).astype("int32"),
        "segment_ids": rng.integers(0, 2, (2, 8)).astype("int32"),
        "padding_mask": np.array([[1] * 8, [1] * 5 + [0] * 3], dtype="int32"),
    }
    return bb, x


def sub_model(bb, name):
    return keras.Model(bb.inputs, bb.get_layer(name).output)


def test_boundaries_list_the_transformer_layers(bert):
    bb, x = bert
    table = js.boundaries(bb, x)
    names = table.names()
    for n in LAYERS:
        assert n in names
    assert names.index("embeddings_dropout") < names.index(LAYERS[0]) < names.index(LAYERS[1])
    assert names.index(LAYERS[1]) < names.index("pooled_dense")
    types = {b.name: b.module_type for b in table}
    assert types[LAYERS[0]] == "TransformerEncoder"
    assert "transformer_layer_0/self_attention_layer" in names


def test_intermediates_equal_keras_sub_models(bert):
    bb, x = bert
    acts = js.intermediates(bb, x, names=LAYERS)
    for n in LAYERS:
        close(acts[n], sub_model(bb, n)(x))
    close(acts[LAYERS[1]], bb(x)["sequence_output"])


@pytest.mark.parametrize("name", LAYERS)
def test_prefix_slice_equals_keras_sub_model(bert, name):
    bb, x = bert
    close(js.slice(bb, x, end=name)(x), sub_model(bb, name)(x))


def test_slice_from_a_layer_input_to_the_output_reproduces_the_backbone(bert):
    bb, x = bert
    h, mask = js.intermediates(bb, x, names=["transformer_layer_1:input"])[
        "transformer_layer_1:input"
    ]
    close(h, sub_model(bb, LAYERS[0])(x))
    close(mask, x["padding_mask"])
    tail = js.slice(bb, x, start=LAYERS[1])
    got, want = tail(h, padding_mask=mask), bb(x)
    assert sorted(got) == sorted(want)
    for k in want:
        close(got[k], want[k])
    assert sorted(tail.variables["trainable"]) == ["pooled_dense", LAYERS[1]]


def test_one_layer_slice_equals_the_layer_called_by_keras(bert):
    bb, x = bert
    h = sub_model(bb, "embeddings_dropout")(x)
    mask = np.array([[1] * 3 + [0] * 5, [1] * 8], dtype="int32")  # not the traced mask
    one = js.slice(bb, x, start=LAYERS[0], end=LAYERS[0])
    close(one(h, padding_mask=mask), bb.get_layer(LAYERS[0])(h, padding_mask=mask))


def test_a_tail_from_a_transformer_layer_predicts_from_a_list_or_a_dict(bert):
    bb, x = bert
    h = sub_model(bb, LAYERS[0])(x)
    tail = js.slice(bb, x, start=LAYERS[1])
    assert tail.input_names == [LAYERS[1], "padding_mask"]
    want = bb(x)
    for inputs in ([h, x["padding_mask"]], {LAYERS[1]: h, "padding_mask": x["padding_mask"]}):
        got = tail.predict(inputs, verbose=0)
        for k in want:
            close(got[k], want[k])
