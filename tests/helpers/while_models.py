"""Models whose module calls run inside a `while_loop` body (a number of iterations known
only when the loop runs), each with an eager twin that unrolls the loop in Python: the
oracle of what every iteration sees.

* `plain_model`: a plain function; `loop/step` (a `js.mark`) halves and mixes the carry
  until its largest entry is at most 1 (the number of iterations depends on the input);
* `LinenLoop`: `cell` (a `Dense`) in the body of `nn.while_loop`, `head` after it;
* `NNXLoop`: the same with `nnx.while_loop` and `nnx.Linear`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxslice as js

D = 3
X = jnp.asarray([[4.0, -2.0, 1.0], [0.5, 3.0, -6.0]], jnp.float32)
STEPS = 3  # iterations of the linen and NNX loops

step = js.mark("step", lambda c, w: 0.5 * (c @ w))


def plain_model(p: Any, x: Any) -> Any:
    with jax.named_scope("loop"):
        c = jax.lax.while_loop(lambda c: jnp.abs(c).max() > 1.0, lambda c: step(c, p["w"]), x)
    return jnp.tanh(c) + p["b"]


PLAIN_PARAMS = {"w": jnp.eye(D) + 0.1, "b": jnp.full((D,), 0.25)}


def plain_steps(p: Any, x: Any, edit: Any = lambda h: h) -> list[Any]:
    """The plain model's loop run eagerly with `edit` after each step: each step's output."""
    seen, c = [], x
    while float(jnp.abs(c).max()) > 1.0:
        c = edit(0.5 * (c @ p["w"]))
        seen.append(c)
    return seen


class LinenLoop(nn.Module):
    @nn.compact
    def __call__(self, x, n):
        cell = nn.Dense(D, name="cell")
        if self.is_initializing():  # the loop body cannot make parameters
            cell(x)

        def body(mdl, c):
            return c[0] + 1, jnp.tanh(cell(c[1]))

        _, h = nn.while_loop(lambda mdl, c: c[0] < n, body, self, (0, x))
        return nn.Dense(2, name="head")(h)


class NNXLoop(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.cell = nnx.Linear(D, D, rngs=rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x, n):
        def body(c):
            return c[0] + 1, jnp.tanh(self.cell(c[1]))

        _, h = nnx.while_loop(lambda c: c[0] < n, body, (0, x))
        return self.head(h)


def dense(params: Any, h: Any) -> Any:
    return h @ params["kernel"] + params["bias"]


def linen_loop() -> tuple[LinenLoop, Any]:
    model = LinenLoop()
    return model, model.init(jax.random.key(0), X, jnp.int32(STEPS))
