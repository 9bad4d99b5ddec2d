"""Slices on many hosts: two JAX processes, one CPU device each, gloo collectives.

Each process runs `_distributed_worker.py`: `jax.distributed.initialize` on a local
coordinator, a batch sharded across both processes as one global `jax.Array`, a sliced
feature extractor and `js.intermediates` on it, and one data-parallel SGD step of a
sliced head (gradients averaged over the global batch by `jit`), merged back with
`sub.merge`. The oracle is computed inside each process alone with the full batch,
through Flax (`capture_intermediates`, `model.apply`). Both processes must agree with it
and with each other.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

WORKER = Path(__file__).with_name("_distributed_worker.py")
TIMEOUT_S = 90
TOLERANCE = 1e-5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # the repository
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device per process
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _run_workers(tmp_path: Path) -> list[dict]:
    codes, report = _start_and_wait(tmp_path)
    if codes != [0, 0] and "Failed to start RPC server" in report:  # the port was taken
        codes, report = _start_and_wait(tmp_path)
    assert codes is not None, f"the workers ran past {TIMEOUT_S} s\n{report}"
    assert codes == [0, 0], f"exit codes {codes}\n{report}"
    return [json.loads((tmp_path / f"worker{i}.json").read_text("utf-8")) for i in range(2)]


def _start_and_wait(tmp_path: Path) -> tuple[list[int | None] | None, str]:
    """Runs both workers on a free port: their exit codes (None on timeout) and output."""
    port = _free_port()
    logs = [open(tmp_path / f"worker{i}.log", "w+", encoding="utf-8") for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(tmp_path / f"worker{i}.json")],
            env=_worker_env(),
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        codes = _wait(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, _report(logs)


def _wait(procs: list[subprocess.Popen]) -> list[int | None] | None:
    """The exit codes, or None on timeout; stops waiting as soon as one worker fails
    (the other would wait for its peer until the coordinator's own timeout)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.05)
    return None


def _report(logs: list) -> str:
    parts = []
    for i, log in enumerate(logs):
        log.seek(0)
        parts.append(f"--- worker {i} output (last 4000 characters):\n{log.read()[-4000:]}")
        log.close()
    return "\n".join(parts)


@pytest.mark.skipif(
    not hasattr(jax.config, "jax_cpu_collectives_implementation"),
    reason="this jaxlib has no CPU collectives (gloo), so CPU processes cannot share arrays",
)
@pytest.mark.skipif(sys.platform == "win32", reason="jax.distributed on CPU needs Linux or macOS")
def test_a_slice_runs_and_trains_data_parallel_across_two_processes(tmp_path):
    results = _run_workers(tmp_path)
    for r in results:
        assert r["process_count"] == 2 and r["devices"] == 2, r
        assert r["features_sharded"], "the features lost the batch sharding"
        assert r["features_error"] <= TOLERANCE, r
        assert r["intermediates_error"] <= TOLERANCE, r
        assert r["loss_error"] <= TOLERANCE, r
        assert r["params_error"] <= TOLERANCE, r
        assert r["untouched_same"], "merge changed parameters outside the slice"
        assert r["variables_kept"], "sub.variables or merge copied the model's global arrays"
        assert r["head_replicated"], "the trained head is not replicated across processes"
    first, second = results
    assert first["features_digest"] == second["features_digest"]
    assert first["head_digest"] == second["head_digest"]
