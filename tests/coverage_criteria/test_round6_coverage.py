"""A smaller batch is padded only where the model keeps the rows of a batch apart, as it
runs at that call; a pair criterion's ratio must fit float32.

Oracles: the model called eagerly on each batch (NumPy maxima of its outputs), a fresh
tracker compiled at the batch's own size, and the NumPy pair reference."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.coverage_reference import ref_pairs
from helpers.oracles import count_compiles

C = js.coverage
W = jnp.array([[1.0, -1.0, 0.5, 2.0], [0.3, 0.7, -1.2, 0.1]])
X8 = jax.random.normal(jax.random.key(0), (8, 2))
X3 = jax.random.normal(jax.random.key(1), (3, 2)) * 2.0


def _plain(mix):
    """A plain function with marked layers ``a`` and ``b`` and `mix` between them."""

    def fn(params, x):
        h = js.mark("a")(lambda p, x: x @ p)(params, x)
        return js.mark("b")(lambda h: jnp.tanh(mix(h)))(h)

    return fn


MIXING = {
    "centring": lambda h: h - h.mean(axis=0, keepdims=True),
    "sort over the batch": lambda h: jnp.sort(h, axis=0),
    "cumulative sum over the batch": lambda h: jnp.cumsum(h, axis=0),
    "roll over the batch": lambda h: jnp.roll(h, 1, axis=0),
    "gram matrix": lambda h: (h @ h.T) @ h / 8.0,
    "softmax over the batch": lambda h: jax.nn.softmax(h, axis=0),
    "first row to all": lambda h: h * h[0],
    "while over the batch's maximum": lambda h: jax.lax.while_loop(
        lambda c: jnp.max(c) < 4.0, lambda c: c + 1.0, h
    ),
}


@pytest.mark.parametrize("mix", list(MIXING.values()), ids=list(MIXING))
def test_a_model_that_mixes_rows_profiles_a_smaller_batch_as_the_model_computes_it(mix):
    fn = _plain(mix)
    tracker = C.Tracker(fn, W, X8, criteria=[C.NBC()], layers=["b"])
    tracker.profile([X8, X3])  # compiled for 8 first; 3 would be padded to 8
    eager = [np.asarray(fn(W, x)) for x in (X8, X3)]
    stats = tracker.profile_stats["b"]
    np.testing.assert_allclose(stats["high"], np.max([e.max(0) for e in eager], 0), rtol=1e-5)
    np.testing.assert_allclose(stats["low"], np.min([e.min(0) for e in eager], 0), rtol=1e-5)


def test_centring_over_the_batch_covers_as_a_tracker_compiled_at_the_batch_size():
    fn = _plain(MIXING["centring"])
    w = jnp.array([[1.0, -1.0, 0.5]])
    x8, x3 = jnp.arange(8.0).reshape(8, 1), jnp.array([[0.0], [1.0], [2.0]])
    criteria = [C.TKNC(1), C.NC(0.5), C.SignSign()]
    tracker = C.Tracker(fn, w, x8, criteria=criteria, layers=["a", "b"])
    tracker.update(x8)  # compiles for 8
    tracker.reset()
    tracker.update(x3)  # padded to 8 with copies of x3[-1], the mean would shift
    fresh = C.Tracker(fn, w, x3, criteria=criteria, layers=["a", "b"])
    fresh.update(x3)
    assert tracker.result() == fresh.result()
    # the eager outputs: each neuron is the largest (or tied for it) of some input's
    out = np.asarray(fn(w, x3))
    assert (out == out.max(axis=1, keepdims=True)).any(axis=0).all()
    assert tracker.result()["TKNC"]["layers"]["b"] == 1.0


ROWWISE = {
    "elementwise": lambda h: jax.nn.gelu(h) * 2.0,
    "a reduction over features": lambda h: h - h.mean(axis=1, keepdims=True),
    "a sort over features": lambda h: jnp.sort(h, axis=1),
    "vmapped rows": lambda h: jax.vmap(lambda r: r * r.sum())(h),
    "a scan over another axis": lambda h: jax.lax.scan(
        lambda c, _: (jnp.tanh(c) * 1.5, None), h, None, length=3
    )[0],
    "a row mask from iota": lambda h: jnp.where(jnp.arange(h.shape[0])[:, None] >= 0, h, 0.0),
}


@pytest.mark.parametrize("rowwise", list(ROWWISE.values()), ids=list(ROWWISE))
def test_a_model_that_keeps_rows_apart_pads_a_smaller_batch_without_compiling(rowwise):
    fn = _plain(rowwise)
    tracker = C.Tracker(fn, W, X8, criteria=[C.NBC()], layers=["b"])
    tracker.profile([X8])
    with count_compiles() as counts:
        tracker.profile([X3])
    assert counts.compiles == 0
    eager = [np.asarray(fn(W, x)) for x in (X8, X3)]
    high = tracker.profile_stats["b"]["high"]
    np.testing.assert_allclose(high, np.max([e.max(0) for e in eager], 0), rtol=1e-5)


class _BatchNormed(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.a(x))


def test_a_tracker_made_in_eval_mode_follows_train_mode_and_stops_padding():
    model = _BatchNormed(nnx.Rngs(0))
    model.eval()
    x = jax.random.normal(jax.random.key(0), (8, 3))
    x3 = jax.random.normal(jax.random.key(1), (3, 3)) * 2.0
    tracker = C.Tracker(model, x, criteria=[C.NBC()], layers=["bn"])
    tracker.profile([x])  # eval mode, compiled for 8
    eval_out = np.asarray(copy.deepcopy(model)(x))
    model.train()
    tracker.profile([x3])  # training mode: BatchNorm normalises with this batch's statistics
    train_out = np.asarray(copy.deepcopy(model)(x3))
    expected = np.maximum(eval_out.max(0), train_out.max(0))
    np.testing.assert_allclose(tracker.profile_stats["bn"]["high"], expected, rtol=1e-5)


# --------------------------------------------------------------------------- ratio


def _pair_fn(p, x):
    h = js.mark("l1")(lambda p, x: x * p["s"])(p["l1"], x)
    return js.mark("l2")(lambda p, h: h * p["s"])(p["l2"], h)


PAIR_PARAMS = {"l1": {"s": jnp.ones((2,))}, "l2": {"s": jnp.ones((2,))}}
ZERO_TO_NEGATIVE = np.array([[0.0, 0.0], [-5.0, -5.0]], np.float32)


@pytest.mark.parametrize("ratio", [1e39, 1e300, 3.5e38])
@pytest.mark.parametrize("kind", [C.ValueValue, C.ValueSign, C.SignValue])
def test_a_ratio_float32_cannot_hold_is_refused(kind, ratio):
    with pytest.raises(js.InvalidSpecError, match="larger than float32 holds") as info:
        kind(ratio=ratio)
    assert "at most 3.4028235e+38" in str(info.value)


def test_the_largest_float32_ratio_counts_a_value_change_from_zero_as_the_reference():
    ratio = float(np.finfo(np.float32).max)
    tracker = C.Tracker(
        _pair_fn,
        PAIR_PARAMS,
        jnp.asarray(ZERO_TO_NEGATIVE),
        criteria=[C.ValueValue(ratio=ratio)],
        granularity="element",
    )
    tracker.update(ZERO_TO_NEGATIVE)
    values = ZERO_TO_NEGATIVE.astype(np.float64)
    expected = ref_pairs("value", "value", values, values, ratio).mean()
    assert expected == 1.0
    assert tracker.result()["ValueValue"]["total"] == expected
