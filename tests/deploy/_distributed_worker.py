"""One process of the two-process check in `test_distributed.py` (not a test module).

Run as ``python tests/deploy/_distributed_worker.py PROCESS_ID PORT OUT_JSON``. Both processes
build the same small linen model with the same variables and the same global batch; each
holds half of the batch. They slice the model, run the feature extractor on the global
batch (a `jax.Array` sharded over both processes' CPU devices, all-gathered over gloo),
and take one data-parallel SGD step of the sliced head, whose variables `merge` writes
back. Each process also computes the same values alone, on its own device with the full
batch, through Flax (`capture_intermediates` and `model.apply`), and writes the largest
differences, and a digest of what it computed, as JSON to OUT_JSON.

Importing this module does nothing (pytest imports it when it runs doctests).
"""

from __future__ import annotations

import json
import sys

BATCH, FEATURES, CLASSES = 8, 6, 3
LEARNING_RATE = 0.1


def _model():
    import flax.linen as nn
    import jax.numpy as jnp

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(16, name="stem")(x))
            h = jnp.tanh(nn.Dense(FEATURES, name="body")(h))
            return nn.Dense(CLASSES, name="head")(h)

    return Net()


def _data():
    """The global batch and labels, identical in every process (NumPy, seeded)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 5)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)
    return x, labels


def _loss(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def run(process_id: int, port: int) -> dict:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    try:
        return _check(process_id)
    finally:
        jax.distributed.shutdown()


def _check(process_id: int) -> dict:
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxslice as js

    assert jax.process_count() == 2 and len(jax.devices()) == 2, jax.devices()
    model = _model()
    x, labels = _data()
    # The same variables in both processes: init is deterministic for a fixed key.
    variables = model.init(jax.random.key(0), x[:2])

    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch_sharding = NamedSharding(mesh, P("data"))
    half = BATCH // 2
    mine = slice(process_id * half, (process_id + 1) * half)
    gx = jax.make_array_from_process_local_data(batch_sharding, x[mine], (BATCH, 5))
    glabels = jax.make_array_from_process_local_data(batch_sharding, labels[mine], (BATCH,))
    replicated = NamedSharding(mesh, P())
    gvariables = jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), variables
    )

    # The oracle, on this process's own device, with the full batch.
    _, state = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    want_features = np.asarray(state["intermediates"]["body"]["__call__"][0])

    features = js.slice(model, gvariables, x[:2], end="body")
    head = js.slice(model, gvariables, x[:2], start="body:output")  # tanh + head
    got = features(gx)
    is_sharded = got.sharding.spec == P("data") if hasattr(got.sharding, "spec") else False
    got_features = _host(got)
    # js.intermediates on the global batch too (one compiled call, nothing past `body`).
    inter = js.intermediates(model, gvariables, gx, names=["body"])["body"]

    tx = optax.sgd(LEARNING_RATE)

    @jax.jit
    def step(v, opt_state, feats, labels):
        loss, grads = jax.value_and_grad(lambda v: _loss(head.apply(v, feats), labels))(v)
        updates, opt_state = tx.update(grads, opt_state, v)
        return optax.apply_updates(v, updates), opt_state, loss

    head_vars = head.variables
    new_head, _, loss = step(head_vars, tx.init(head_vars), got, glabels)
    merged = head.merge(gvariables, new_head)
    merged_params = jax.tree.map(_host, merged["params"])

    # The same step on one process: the full model's head on the full batch.
    def ref_loss(params):
        return _loss(model.apply({"params": params}, x), labels)

    params = variables["params"]
    ref_loss_value, grads = jax.value_and_grad(ref_loss)(params)
    # Only the head trains; the rest of the model keeps its parameters.
    ref_head = optax.apply_updates(
        params["head"], jax.tree.map(lambda g: -LEARNING_RATE * g, grads["head"])
    )
    ref_params = {**params, "head": ref_head}

    return {
        "process_id": process_id,
        "process_count": jax.process_count(),
        "devices": len(jax.devices()),
        "features_sharded": bool(is_sharded),
        "features_error": float(np.max(np.abs(got_features - want_features))),
        "intermediates_error": float(np.max(np.abs(_host(inter) - want_features))),
        # The slice's variables are the model's global arrays, and merge keeps the
        # leaves it does not replace as the very same objects.
        "variables_kept": features.variables["params"]["stem"]["kernel"]
        is gvariables["params"]["stem"]["kernel"]
        and merged["params"]["stem"]["kernel"] is gvariables["params"]["stem"]["kernel"],
        "head_replicated": bool(merged["params"]["head"]["kernel"].is_fully_replicated),
        "loss_error": float(abs(float(_host(loss)) - float(ref_loss_value))),
        "params_error": _max_error(merged_params, ref_params),
        "untouched_same": all(
            np.array_equal(np.asarray(merged_params[k][n]), np.asarray(params[k][n]))
            for k in ("stem", "body")
            for n in ("kernel", "bias")
        ),
        "features_digest": np.round(got_features, 5).tolist(),
        "head_digest": np.round(merged_params["head"]["kernel"], 5).tolist(),
    }


def _host(a):
    """A global array's value as NumPy, in every process."""
    import numpy as np
    from jax.experimental import multihost_utils

    if a.is_fully_replicated:
        return np.asarray(a.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def _max_error(a, b) -> float:
    import jax
    import numpy as np

    errors = jax.tree.map(lambda p, q: float(np.max(np.abs(np.asarray(p) - np.asarray(q)))), a, b)
    return max(jax.tree.leaves(errors))


if __name__ == "__main__":
    pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    result = run(pid, port)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
