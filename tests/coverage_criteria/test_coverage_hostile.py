"""A coverage tracker used carelessly: criteria given oddly, NumPy scalars as settings, and
a model whose rows affect each other (BatchNorm in training mode), whose batches must not
be padded. Oracles: the model's own train-mode outputs from Flax's
``capture_intermediates``, and NumPy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

import jaxslice as js

from helpers.oracles import random_variables

C = js.coverage
X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)


def test_numpy_scalars_are_settings_like_python_numbers():
    assert C.NC(np.float32(0.25)) == C.NC(0.25)
    assert C.KMNC(np.int64(4)) == C.KMNC(4)
    assert C.TKNC(np.int32(2)) == C.TKNC(2)
    assert C.SignSign(capacity=np.int64(64)) == C.SignSign(capacity=64)
    assert C.KMNC(np.int64(4)).k.__class__ is int
    with pytest.raises(js.InvalidSpecError):
        C.KMNC(np.float32(4.0))
    with pytest.raises(js.InvalidSpecError):
        C.NC(np.bool_(True))


def test_one_criterion_or_a_repeated_one_is_refused():
    model = nn.Dense(3)
    variables = random_variables(model, X)
    with pytest.raises(js.InvalidSpecError, match="list of criteria"):
        C.Tracker(model, variables, X, criteria=C.NC())
    with pytest.raises(js.InvalidSpecError, match=r"NC\(threshold=0.2\) more than once"):
        C.Tracker(model, variables, X, criteria=[C.NC(0.2), C.KMNC(2), C.NC(0.2)])


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        h = nn.Dense(6, name="fc")(x)
        h = nn.BatchNorm(use_running_average=not train, name="bn")(h)
        return nn.Dense(3, name="head")(nn.relu(h))


def test_a_model_that_normalises_by_the_batch_is_run_at_each_batch_size():
    model = Normed()
    variables = random_variables(model, X, False)
    small = 3 * np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)

    def bn(x):  # the model's own output of bn on exactly this batch, in training mode
        _, state = model.apply(
            variables, x, True, mutable=["batch_stats", "intermediates"],
            capture_intermediates=True,
        )  # fmt: skip
        return np.asarray(state["intermediates"]["bn"]["__call__"][0])

    tracker = C.Tracker(
        model, variables, X, True, layers=["bn"], criteria=[C.NBC()], mutable=["batch_stats"]
    )
    tracker.profile([X, small])  # a batch of 8, then one of 5 (not padded to 8)
    low = np.minimum(bn(X).min(0), bn(small).min(0))
    high = np.maximum(bn(X).max(0), bn(small).max(0))
    np.testing.assert_allclose(tracker.profile_stats["bn"]["low"], low, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tracker.profile_stats["bn"]["high"], high, rtol=1e-5, atol=1e-6)
    # update: the batch of 5 covers what its own values cross, as a new tracker finds
    tracker.update(X)
    tracker.update(small)
    fresh = C.Tracker(
        model, variables, X, True, layers=["bn"], criteria=[C.NBC()], mutable=["batch_stats"]
    )
    fresh.profile([X, small])
    fresh.update(small)
    fresh.update(X)
    assert tracker.result()["NBC"]["total"] == fresh.result()["NBC"]["total"]
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(np.array_equal, tracker.states, fresh.states)
    )


@pytest.fixture(scope="module")
def pairs():
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(6)])
    variables = random_variables(model, X)
    tracker = C.Tracker(model, variables, X, criteria=[C.SignSign()])
    tracker.update(X)
    return model, tracker


def test_generate_with_no_seeds_finds_nothing(pairs):
    _, tracker = pairs
    found = C.generate(tracker, X[:0], "SignSign")
    assert len(found) == 0 and found.attempted == 0


def test_generate_takes_a_negative_int_key_and_refuses_bad_bounds_or_trackers(pairs):
    model, tracker = pairs
    a = C.generate(tracker, X[:4], "SignSign", eps=0.5, steps=5, key=-1)
    b = C.generate(tracker, X[:4], "SignSign", eps=0.5, steps=5, key=-1)
    np.testing.assert_array_equal(np.asarray(a.inputs), np.asarray(b.inputs))  # one seed
    with pytest.raises(js.InvalidSpecError, match="bounds"):
        C.generate(tracker, X, "SignSign", bounds=("a", "b"))
    with pytest.raises(js.InvalidSpecError, match="Tracker"):
        C.generate(model, X, "SignSign")


class Masked(nn.Module):
    """x (batch, 4) and a mask on a's 6 features: per feature (6,), with no batch axis,
    or per input (batch, 6)."""

    @nn.compact
    def __call__(self, x, mask):
        return nn.Dense(3, name="b")(nn.Dense(6, name="a")(x) * mask)


def _top1_of_a(variables, x):
    """TKNC(1) of layer `a` over `x`, by hand: the neurons that are some input's largest."""
    a = np.asarray(nn.Dense(6).apply({"params": variables["params"]["a"]}, x))
    top = np.zeros(6, bool)
    top[np.argmax(a, axis=1)] = True
    return top


def test_an_input_without_a_batch_axis_is_not_padded_and_sizes_must_agree():
    model = Masked()
    mask = (np.arange(6) % 2).astype(np.float32)
    variables = random_variables(model, X, mask)
    tracker = C.Tracker(model, variables, X, mask, layers=["a"], criteria=[C.TKNC(1)])
    tracker.update((X, mask))
    tracker.update((X[:6], mask))  # padded to 8 inside; the mask is not padded
    np.testing.assert_array_equal(np.asarray(tracker.states[0][0]), _top1_of_a(variables, X))
    with pytest.raises(js.InputMismatchError, match="keep the sample's shape"):
        tracker.update((X, mask[:4]))


class Sum(nn.Module):
    @nn.compact
    def __call__(self, a, b):
        return nn.Dense(3, name="d")(a) + b


def test_inputs_of_different_batch_sizes_are_refused():
    model = Sum()
    b = np.ones((8, 3), np.float32)
    variables = random_variables(model, X, b)
    tracker = C.Tracker(model, variables, X, b, criteria=[C.NC()])
    with pytest.raises(js.InputMismatchError, match="share one batch size"):
        tracker.update((X[:1], b))  # the model would broadcast: 8 rows, not 1


def test_array_keyword_inputs_say_how_to_pass_them():
    model = Masked()
    mask = np.ones((8, 6), np.float32)
    variables = random_variables(model, X, mask)  # positionally: the same variables
    for make in (
        lambda: C.Tracker(model, variables, X, mask=mask),
        lambda: js.ActivationStats(model, variables, X, mask=mask),
    ):
        with pytest.raises(js.InputMismatchError, match="'mask'.*positionally"):
            make()
    # The way the error suggests: a function that passes the mask on (oracle: by hand).
    tracker = C.Tracker(
        lambda v, x, m: model.apply(v, x, mask=m), variables, X, mask, criteria=[C.TKNC(1)]
    )
    tracker.update((X[:5], mask[:5]))
    np.testing.assert_array_equal(np.asarray(tracker.states[0][0]), _top1_of_a(variables, X[:5]))
