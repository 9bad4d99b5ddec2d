"""Two models of shared submodule classes traced at the same moment in two threads.

SPEC, "Reliability rules": slicing, listing and calling from several threads at once
gives the same results as one thread, for every model kind. The ``__call__`` wrappers of
the shared classes are shared by overlapping traces, so each trace's naming (which module
has which path, and how a rebuilt copy finds its path) must come from its own context.
Events inside model A's ``__call__`` force the interleaving: model B is traced from
start to end while model A's trace is paused halfway. The oracles are a serial run and
the model's own submodule called by hand.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

eqx = pytest.importorskip("equinox")


def _models(inside: threading.Event, resume: threading.Event):
    class Block(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return jax.nn.relu(self.lin(x))

    class Gate(eqx.Module):
        def __call__(self, x):
            if not inside.is_set():  # the first trace of A waits here for B's trace
                inside.set()
                resume.wait(30)
            return x

    class A(eqx.Module):
        gate: Gate
        body: Block

        def __call__(self, x):
            return self.body(self.gate(x))

    class B(eqx.Module):
        enc: Block

        def __call__(self, x):  # calls a copy of `enc` rebuilt by filter_jit
            return eqx.filter_jit(lambda m, v: m(v))(self.enc, x)

    keys = jax.random.split(jax.random.key(0), 2)
    a = A(Gate(), Block(eqx.nn.Linear(3, 3, key=keys[0])))
    b = B(Block(eqx.nn.Linear(3, 3, key=keys[1])))
    return a, b


def test_equinox_traces_overlapping_in_two_threads_keep_their_own_names():
    inside, resume = threading.Event(), threading.Event()
    a, b = _models(inside, resume)
    x = jnp.array([1.0, -2.0, 3.0])
    js.clear_caches()
    got = {}

    def trace_a():
        got["a"] = js.boundaries(a, x).names()

    thread = threading.Thread(target=trace_a)
    thread.start()
    try:
        assert inside.wait(30)
        got["b"] = js.boundaries(b, x).names()
        # the graph B's trace left in the cache is B's own
        got["b_enc"] = js.slice(b, x, end="enc")(x)
    finally:
        resume.set()
        thread.join()

    js.clear_caches()
    serial_a, serial_b = js.boundaries(a, x).names(), js.boundaries(b, x).names()
    assert serial_b == ["enc", "enc/lin"]
    assert got["a"] == serial_a
    assert got["b"] == serial_b
    np.testing.assert_allclose(np.asarray(got["b_enc"]), np.asarray(b.enc(x)), rtol=1e-6)
