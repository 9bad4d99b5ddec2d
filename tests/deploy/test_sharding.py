"""Slices of sharded models: a batch sharded over 4 CPU devices, parameters replicated.

XLA fixes the number of host devices when JAX starts, so the check runs in a fresh
interpreter with ``--xla_force_host_platform_device_count=4``. The expected values come
from the full model run unsharded (``model.apply`` with Flax's ``capture_intermediates``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

MARKER = "JAXSLICE-SHARDING-OK"

CODE = textwrap.dedent(
    f"""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxslice as js

    assert len(jax.devices()) == 4, jax.devices()


    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = nn.Dense(8, name="fc1")(x)
            h = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(h)
            h = nn.relu(h)
            h = nn.Dense(6, name="fc2")(h)
            return nn.Dense(3, name="head")(jnp.tanh(h))


    model = Net()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    variables = jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.uniform(0.5, 1.5, s.shape), s.dtype), shapes
    )

    # Unsharded oracle: the full model, with every module's output recorded.
    out_ref, state = model.apply(
        variables, x, capture_intermediates=True, mutable=["intermediates"]
    )
    h_ref = state["intermediates"]["fc2"]["__call__"][0]  # the head slice's input (fc2:output)
    bs_ref = model.apply(
        variables, x, train=True, mutable=["batch_stats"]
    )[1]["batch_stats"]

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    sv = jax.device_put(variables, replicated)
    sx = jax.device_put(x, batch)
    sh = jax.device_put(h_ref, batch)


    def check_batch_sharded(out, what):
        assert isinstance(out, jax.Array), (what, type(out))
        rows = sorted(int(s.data.shape[0]) for s in out.addressable_shards)
        assert rows == [2, 2, 2, 2], (what, rows, out.sharding)
        spec = getattr(out.sharding, "spec", None)
        if spec is not None:
            assert spec[0] == "data", (what, out.sharding)
        devices = {{s.device for s in out.addressable_shards}}
        assert devices == set(jax.devices()), (what, devices)


    def check_variables(sub, modules):
        original = dict(jax.tree_util.tree_flatten_with_path(sv)[0])
        got = jax.tree_util.tree_flatten_with_path(sub.variables)[0]
        assert {{p[1].key for p, _ in got}} == modules, (modules, got)
        for p, leaf in got:
            assert leaf is original[p], p  # the very same (sharded) arrays
            assert leaf.sharding == replicated, (p, leaf.sharding)
            assert leaf.sharding.is_equivalent_to(original[p].sharding, leaf.ndim)


    # The whole model, sharded input.
    whole = js.slice(model, sv, sx, train=False)
    check_variables(whole, {{"fc1", "bn", "fc2", "head"}})
    out = jax.jit(whole)(sx)
    check_batch_sharded(out, "jit(whole)")
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    out = whole(sx)
    check_batch_sharded(out, "whole")
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)

    # A head slice on sharded head inputs, sharded params passed explicitly under jit.
    head = js.slice(model, sv, sx, start="fc2:output", train=False)
    check_variables(head, {{"head"}})
    out = jax.jit(lambda v, h: head.apply(v, h))(head.variables, sh)
    check_batch_sharded(out, "jit(head.apply)")
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)

    # A feature extractor up to fc2, in train mode: state updates match the full model.
    body = js.slice(model, sv, sx, end="fc2", train=False)
    check_variables(body, {{"fc1", "bn", "fc2"}})
    feats, updates = jax.jit(
        lambda v, x: body.apply(v, x, train=True, mutable=["batch_stats"])
    )(body.variables, sx)
    check_batch_sharded(feats, "jit(body.apply train)")
    for k in ("mean", "var"):
        np.testing.assert_allclose(
            np.asarray(updates["batch_stats"]["bn"][k]),
            np.asarray(bs_ref["bn"][k]),
            rtol=1e-5,
            atol=1e-5,
        )

    # Gradients w.r.t. the replicated params, through the sharded batch.
    def loss(params):
        return jnp.sum(head.apply({{"params": params}}, sh) ** 2)

    def loss_ref(params):
        out = model.apply({{**variables, "params": params}}, x)
        return jnp.sum(out ** 2)

    g = jax.jit(jax.grad(loss))(head.variables["params"])
    g_ref = jax.grad(loss_ref)(variables["params"])["head"]
    for k in ("kernel", "bias"):
        np.testing.assert_allclose(
            np.asarray(g["head"][k]), np.asarray(g_ref[k]), rtol=1e-4, atol=1e-5
        )

    print("{MARKER}")
    """
)


def test_sharded_slice_in_subprocess():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120
    )
    report = f"returncode {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert MARKER in proc.stdout, report
