"""New input shapes without re-slicing, cached per shape like `jax.jit`.

With ``start=None`` any new input shape works; with a start, any new batch size (leading
axis) does, and other shape or dtype changes are an `InputMismatchError`. A second call at
a shape already seen neither traces the model again nor compiles anything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import (
    assert_trees_all_close,
    captured,
    count_compiles,
    random_input,
    record_calls,
)

# --------------------------------------------------------------------------- linen


def test_prefix_slice_accepts_any_new_input_shape(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, end="stage1")
    for shape in [(5, 8, 8, 3), (1, 6, 4, 3)]:
        x = random_input(sum(shape), shape)
        (expected,) = captured(resnet.model, resnet.variables, x)["stage1"]
        assert_trees_all_close(sub(x), expected)


def test_whole_model_slice_accepts_any_new_input_shape(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x)
    x = random_input(1, (4, 6, 6, 3))
    assert_trees_all_close(sub(x), resnet.apply(resnet.variables, x))


@pytest.mark.parametrize("batch", [1])
def test_slice_with_start_accepts_a_new_batch_size(resnet, batch):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage2", end="head")
    x = random_input(batch, (batch, 8, 8, 3))
    calls = record_calls(resnet.model, resnet.variables, x)
    (feat,) = calls["stage2"][0][0]
    assert feat.shape[0] == batch
    assert_trees_all_close(sub(feat), calls["head"][0][2])
    assert_trees_all_close(jax.jit(lambda a: sub(a))(feat), calls["head"][0][2])


def test_slice_from_output_port_accepts_a_new_batch_size(tuple_zoo):
    z = tuple_zoo
    sub = js.slice(z.model, z.variables, z.x, start="pair:output", end="head")
    x = random_input(9, (7, 4))
    calls = record_calls(z.model, z.variables, x)
    assert_trees_all_close(sub(calls["pair"][0][2]), calls["head"][0][2])


def test_slice_from_two_argument_module_accepts_a_new_batch_size(skip_zoo):
    z = skip_zoo
    sub = js.slice(z.model, z.variables, z.x, start="dec", end=None)
    x = random_input(8, (6, 4))
    calls = record_calls(z.model, z.variables, x)
    assert_trees_all_close(sub(*calls["dec"][0][0]), z.apply(z.variables, x))


def test_slice_with_start_rejects_other_shape_changes(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage2", end="stage2")
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((2, 6, 6, 4), jnp.float32))  # spatial size
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((2, 8, 8, 5), jnp.float32))  # channels
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((8, 8, 4), jnp.float32))  # rank
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((3, 6, 6, 4), jnp.float32))  # batch and spatial together


def test_slice_with_start_rejects_dtype_changes(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="head")
    with pytest.raises(js.InputMismatchError, match="float16"):
        sub(jnp.ones((2, 8), jnp.float16))
    with pytest.raises(js.InputMismatchError, match="int32"):
        sub(jnp.ones((2, 8), jnp.int32))


def test_two_starts_with_different_new_batch_sizes_are_rejected(skip_zoo):
    z = skip_zoo
    sub = js.slice(z.model, z.variables, z.x, start="dec", end="dec")
    with pytest.raises(js.InputMismatchError):
        sub(jnp.ones((3, 4), jnp.float32), jnp.ones((5, 4), jnp.float32))


# --------------------------------------------------------------------------- retracing


class TraceCounter:
    def __init__(self):
        self.model_traces = 0
        self.mark_traces = 0


def _counting_model(counter: TraceCounter):
    @js.mark("body")
    def body(p, x):
        counter.mark_traces += 1
        return jnp.tanh(x @ p["w"])

    def model(params, x):
        counter.model_traces += 1  # runs once per trace: the model is never run eagerly here
        return body(params, x).sum(axis=-1)

    return model


PARAMS = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), jnp.float32)}


def _ref(x):
    return np.tanh(np.asarray(x, np.float64) @ np.asarray(PARAMS["w"], np.float64)).sum(axis=-1)


@pytest.mark.parametrize("start", [None, "body"])
def test_second_call_at_a_seen_shape_does_not_retrace(start):
    counter = TraceCounter()
    sub = js.slice(
        _counting_model(counter), PARAMS, jnp.ones((2, 3), jnp.float32), start=start, end=None
    )
    built = counter.model_traces, counter.mark_traces
    assert built[0] >= 1 and built[1] >= 1

    x2 = random_input(0, (2, 3))
    assert_trees_all_close(sub(x2), _ref(x2).astype(np.float32))
    # The shape it was sliced with is already known: no trace of the model at all.
    assert (counter.model_traces, counter.mark_traces) == built

    x5 = random_input(1, (5, 3))
    assert_trees_all_close(sub(x5), _ref(x5).astype(np.float32))
    after_new = counter.model_traces, counter.mark_traces
    assert after_new[0] > built[0]  # a new batch size traces the model once more

    with count_compiles() as jax_counts:
        out = sub(random_input(2, (5, 3)))
        sub(random_input(3, (2, 3)))
    assert_trees_all_close(out, _ref(random_input(2, (5, 3))).astype(np.float32))
    assert (counter.model_traces, counter.mark_traces) == after_new
    assert jax_counts.traces == 0, "a seen shape must not be traced again"
    assert jax_counts.compiles == 0, "a seen shape must not be compiled again"


def test_each_new_shape_is_traced_once():
    counter = TraceCounter()
    sub = js.slice(_counting_model(counter), PARAMS, jnp.ones((2, 3), jnp.float32))
    base = counter.model_traces
    for batch in (3, 4, 3, 4, 2, 3):
        sub(jnp.ones((batch, 3), jnp.float32))
    assert counter.model_traces - base == 2  # batch sizes 3 and 4, once each


def test_slice_with_start_new_batch_is_cached():
    counter = TraceCounter()
    sub = js.slice(
        _counting_model(counter), PARAMS, jnp.ones((2, 3), jnp.float32), start="body", end="body"
    )
    x = random_input(4, (6, 3))
    first = sub(x)
    traces = counter.model_traces
    with count_compiles() as jax_counts:
        second = sub(x)
    assert counter.model_traces == traces
    assert jax_counts.traces == 0 and jax_counts.compiles == 0
    assert_trees_all_close(second, first, atol=0, rtol=0)
    expected = np.tanh(np.asarray(x, np.float64) @ np.asarray(PARAMS["w"], np.float64))
    assert_trees_all_close(first, expected.astype(np.float32))
