"""A layer of an NNX model replaced by one of another width is refused with
`ModelChangedError`, also where the old width was the sample's batch size and the new
one the new batch's (only the batch axis may change size)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

import jaxslice as js


class _One(nnx.Module):
    def __init__(self, rngs, width=4):
        self.a = nnx.Linear(3, width, rngs=rngs)

    def __call__(self, x):
        return self.a(x)


def _stats(model, x):
    return js.ActivationStats(model, x, names=["a"], per="channel")


def _tracker(criteria):
    return lambda model, x: js.coverage.Tracker(model, x, criteria=criteria, layers=["a"])


OBSERVERS = {
    "ActivationStats per channel": _stats,
    "ActivationStats per tensor": lambda m, x: js.ActivationStats(m, x, names=["a"]),
    "Tracker NC": _tracker([js.coverage.NC(0.0)]),
    "Tracker TKNC": _tracker([js.coverage.TKNC(1)]),
    "Tracker SignSign": _tracker([js.coverage.SignSign()]),
}


@pytest.mark.parametrize("make", list(OBSERVERS.values()), ids=list(OBSERVERS))
@pytest.mark.parametrize(("new_width", "new_batch"), [(2, 2), (8, 8)])
def test_a_layer_as_wide_as_the_new_batch_is_a_changed_model(make, new_width, new_batch):
    model = _One(nnx.Rngs(0))  # width 4, the sample's batch size
    x = jnp.ones((4, 3))
    observer = make(model, x)
    observer.update(x)
    before = observer.result()
    model.a = nnx.Linear(3, new_width, rngs=nnx.Rngs(1))
    with pytest.raises(js.VariablesMismatchError, match="layer 'a' outputs") as info:
        observer.update(jnp.ones((new_batch, 3)))
    assert "again from the model as it is now" in str(info.value)
    assert repr(observer.result()) == repr(before)  # the state is kept


def test_a_new_batch_size_alone_is_not_a_changed_model():
    model = _One(nnx.Rngs(0))
    x = jnp.ones((4, 3))
    stats = _stats(model, x)
    stats.update(x)
    stats.update(jnp.ones((2, 3)))
    stats.update(jnp.ones((8, 3)))
    assert stats.result()["a"]["count"] == 14
