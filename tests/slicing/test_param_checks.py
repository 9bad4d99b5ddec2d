"""Linen's parameter shape check while jaxslice traces: JAX's own initializers are
checked from their shape argument (no trace of the initializer), with the same error
Flax raises; other initializers keep Flax's own check. Oracle: `model.apply` itself."""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.core import scope

import jaxslice as js


def _custom_init(key, shape, dtype=jnp.float32):  # not one of JAX's initializers
    return jnp.full(shape, 0.5, dtype)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="dense")(x)
        return nn.Dense(2, kernel_init=_custom_init, name="custom")(h)


X = jnp.ones((3, 5))


@pytest.mark.parametrize("layer", ["dense", "custom"])
def test_a_parameter_of_the_wrong_shape_is_the_error_flax_raises(layer):
    model = Net()
    variables = model.init(jax.random.key(0), X)
    params = dict(variables["params"])
    params[layer] = {**params[layer], "kernel": jnp.ones((7, 7))}
    bad = {"params": params}
    with pytest.raises(flax.errors.ScopeParamShapeError) as flax_error:
        model.apply(bad, X)  # the oracle
    with pytest.raises(js.SliceError, match="kernel") as ours:
        js.slice(model, bad, X)
    assert isinstance(ours.value.__cause__, flax.errors.ScopeParamShapeError)
    assert str(ours.value.__cause__) == str(flax_error.value)


def test_the_check_is_restored_after_tracing():
    original = scope.Scope.__dict__["param"]
    model = Net()
    variables = model.init(jax.random.key(0), X)
    sub = js.slice(model, variables, X, end="dense")
    assert scope.Scope.__dict__["param"] is original
    p = variables["params"]["dense"]
    assert jnp.allclose(sub(X), X @ p["kernel"] + p["bias"])


def test_jax_initializers_are_not_traced_to_check_shapes(monkeypatch):
    calls = []
    real = jax.eval_shape
    monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: calls.append(a) or real(*a, **k))
    model = Net()
    variables = model.init(jax.random.key(0), X)
    calls.clear()
    js.slice(model, variables, jnp.ones((4, 5)))
    # Only the custom initializer's kernel is checked by Flax (its bias uses `zeros`).
    assert len(calls) == 1
