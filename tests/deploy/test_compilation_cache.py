"""JAX's persistent compilation cache serves a slice's program to a second process.

Two fresh interpreters share one cache directory (``JAX_COMPILATION_CACHE_DIR``, with
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`` so that a small program is written).
Each slices a small linen model, calls the slice once and reports, through
`jax.monitoring`, how many of that call's XLA compilations were cache hits and how many
were written. The second process's variables have other values (another seed, the same
shapes): a slice takes its variables as arguments, so they are no part of the program or
of its cache key. Each process checks its result against the same layers written in
NumPy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(jax.config, "jax_compilation_cache_dir")
    or not hasattr(jax.config, "jax_persistent_cache_min_compile_time_secs")
    or not hasattr(jax.monitoring, "register_event_listener"),
    reason="this JAX has no persistent compilation cache options or monitoring events",
)

# One process: slice, first call, the cache's events during both, and the NumPy oracle.
CHILD = """
import json, sys

import flax.linen as nn
import jax
import numpy as np

import jaxslice as js

EVENTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "compiles",
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "writes",  # recorded when an entry is written
}
seen = dict.fromkeys(EVENTS.values(), 0)


def count(event, **_):
    if event in EVENTS:
        seen[EVENTS[event]] += 1


jax.monitoring.register_event_listener(count)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="hidden")(x))
        return nn.Dense(3, name="head")(h)


rng = np.random.default_rng(int(sys.argv[1]))
x = rng.standard_normal((4, 8), np.float32)
shapes = jax.eval_shape(lambda a: Mlp().init(jax.random.key(0), a), x)
variables = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), shapes)
before = dict(seen)
got = np.asarray(js.slice(Mlp(), variables, x, end="hidden")(x))
hidden = variables["params"]["hidden"]
want = x @ hidden["kernel"] + hidden["bias"]
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
print(json.dumps({k: seen[k] - before[k] for k in seen}))
"""


def _process(seed: int, cache_dir: Path) -> dict[str, int]:
    """Runs CHILD in a fresh interpreter with the persistent cache at `cache_dir`."""
    root = str(Path(__file__).resolve().parents[2])  # the repository
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        "JAX_ENABLE_COMPILATION_CACHE": "true",
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    cmd = [sys.executable, "-c", CHILD, str(seed)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_a_slices_program_from_the_cache(tmp_path: Path) -> None:
    first = _process(0, tmp_path)
    assert first["compiles"] >= 1 and first["hits"] == 0
    assert first["writes"] == first["compiles"]
    written = sorted(os.listdir(tmp_path))
    assert written

    second = _process(1, tmp_path)  # other variable values, the same shapes
    assert second == {"compiles": first["compiles"], "hits": first["compiles"], "writes": 0}
    assert sorted(os.listdir(tmp_path)) == written
