"""One measurement of the cold group, run by `cold.py` in a fresh interpreter.

Usage: python _cold_child.py CASE JSON_ARGS. Imports and the model's setup are untimed;
only the measured operation runs between two `time.perf_counter` calls. Variables come
from a file the parent wrote (as from a checkpoint), so nothing is traced before the
timed operation. Prints one JSON object on the last line of stdout.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
from typing import Any

CASE, ARGS = sys.argv[1], json.loads(sys.argv[2])


def _imports() -> dict[str, Any]:
    """Warms the OS's file cache; reports whether torchvision's side can run."""
    import flax.linen  # noqa: F401
    import jax  # noqa: F401

    import jaxslice  # noqa: F401

    try:
        import torch  # noqa: F401
        import torchvision.models.feature_extraction  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return {"torch": False, "error": f"{type(e).__name__}: {e}"}
    return {"torch": True}


def _torchvision() -> dict[str, Any]:
    import torchvision.models
    from torchvision.models.feature_extraction import create_feature_extractor

    model = getattr(torchvision.models, ARGS["arch"])()
    t = time.perf_counter()
    create_feature_extractor(model, return_nodes=[ARGS["node"]])
    return {"seconds": time.perf_counter() - t}


def _setup() -> tuple[Any, Any, Any]:
    """The torch-named model, its variables (loaded, put on the device) and an input."""
    import jax
    import numpy as np
    from _models import torch_named

    with open(ARGS["variables"], "rb") as f:
        variables = jax.device_put(pickle.load(f))
    size = ARGS["size"]
    x = np.random.default_rng(0).standard_normal((1, size, size, 3), np.float32)
    return torch_named(ARGS["arch"]), variables, jax.device_put(x)


def _summary(out: Any) -> dict[str, Any]:
    """Shape and a checksum of a feature map, to compare both sides' results."""
    import numpy as np

    a = np.asarray(out, np.float64)
    return {"shape": list(a.shape), "abs_sum": float(np.abs(a).sum())}


def _slice(suffix: str = "") -> dict[str, Any]:
    """The first slice in the process, then a second one of the same model and shapes
    (each end with `suffix`)."""
    from builds import build_info

    import jaxslice as js

    model, variables, x = _setup()
    t = time.perf_counter()
    sub = js.slice(model, variables, x, end=ARGS["end"] + suffix)
    first = time.perf_counter() - t
    t = time.perf_counter()
    js.slice(model, variables, x, end=ARGS["end2"] + suffix)
    repeat = time.perf_counter() - t
    return {"seconds": first, "repeat_seconds": repeat, "build_info": build_info(sub)}


def _truncated_jaxpr() -> dict[str, Any]:
    """A cold `jax.make_jaxpr` of the hand-written truncated model: what tracing just the
    layers a slice keeps costs, with nothing of jaxslice."""
    import jax

    _, variables, x = _setup()
    prefix, own = _truncated(variables)
    t = time.perf_counter()
    jax.make_jaxpr(prefix.apply)(own, x)
    return {"seconds": time.perf_counter() - t}


def _make_jaxpr() -> dict[str, Any]:
    import jax

    model, variables, x = _setup()
    t = time.perf_counter()
    jax.make_jaxpr(lambda v, a: model.apply(v, a))(variables, x)
    return {"seconds": time.perf_counter() - t}


def _first_map() -> dict[str, Any]:
    import jax

    import jaxslice as js

    model, variables, x = _setup()
    t = time.perf_counter()
    out = jax.block_until_ready(js.slice(model, variables, x, end=ARGS["end"])(x))
    return {"seconds": time.perf_counter() - t, **_summary(out)}


def _kept(name: str, upto: tuple[int, int]) -> bool:
    """Whether the truncated model up to block `upto` has the top-level module `name`."""
    if not name.startswith("layer"):
        return name in ("conv1", "bn1")
    stage, block = map(int, name[len("layer") :].split("_"))
    return (stage, block) <= upto


def _truncated(variables: Any) -> tuple[Any, Any]:
    """The hand-written model up to block `upto`, and the variables it uses."""
    from _models import torch_named

    upto = tuple(ARGS["upto"])
    prefix = torch_named(ARGS["arch"], upto)
    own = {c: {k: v for k, v in d.items() if _kept(k, upto)} for c, d in variables.items()}
    return prefix, own


def _jit_first_map() -> dict[str, Any]:
    import jax

    _, variables, x = _setup()
    prefix, own = _truncated(variables)
    t = time.perf_counter()
    out = jax.block_until_ready(jax.jit(prefix.apply)(own, x))
    return {"seconds": time.perf_counter() - t, **_summary(out)}


def _tracker() -> dict[str, Any]:
    import jaxslice as js

    model, variables, x = _setup()
    criteria = [js.coverage.NC(0.5), js.coverage.KMNC(10)]
    t = time.perf_counter()
    tracker = js.coverage.Tracker(model, variables, x, criteria=criteria)
    seconds = time.perf_counter() - t
    t = time.perf_counter()  # then its first numbers: what construction may have deferred
    tracker.profile([x])
    tracker.update(x)
    tracker.result()
    first_use = time.perf_counter() - t
    layers = list(tracker.layers)
    return {
        "seconds": seconds,
        "use_seconds": first_use,
        "layers": layers,
        "neurons": sum(tracker.sizes),
    }


def _intermediates() -> dict[str, Any]:
    import jax

    import jaxslice as js

    model, variables, x = _setup()
    t = time.perf_counter()
    jax.block_until_ready(js.intermediates(model, variables, x, names=ARGS["layers"]))
    return {"seconds": time.perf_counter() - t}


def _batch(fn: Any, x: Any, n: int) -> float:
    """Seconds per call over `n` calls dispatched back to back, blocking on the last."""
    import jax

    t = time.perf_counter()
    for _ in range(n):
        out = fn(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def _mlp_calls() -> dict[str, Any]:
    """Warm per-call cost of `sub(x)` and of a plain jitted function, alternated batch by
    batch (which side goes first alternates too); per round, the median batch per side."""
    import jax
    import numpy as np
    from _models import Mlp

    import jaxslice as js

    x = jax.device_put(np.random.default_rng(0).standard_normal((8, 32), np.float32))
    variables = Mlp().init(jax.random.key(0), x)
    sub = js.slice(Mlp(), variables, x, end="fc2")
    own = {"params": {k: variables["params"][k] for k in ("fc1", "fc2")}}
    plain = jax.jit(Mlp(upto=2).apply)
    ref = lambda a: plain(own, a)
    if not np.allclose(sub(x), ref(x), atol=1e-5):
        raise AssertionError("sub(x) differs from the hand-written function")
    n, k = ARGS["calls"], ARGS["batches"]
    _batch(sub, x, n), _batch(ref, x, n)  # warm-up
    subject, reference = [], []
    for r in range(ARGS["rounds"]):
        s, p = [], []
        for i in range(k):
            pair = [(s, sub), (p, ref)]
            for out, fn in pair if (r + i) % 2 == 0 else pair[::-1]:
                out.append(_batch(fn, x, n))
        subject.append([statistics.median(s)])
        reference.append([statistics.median(p)])
    return {"subject": subject, "reference": reference, "calls": n * k}


CASES = {
    "imports": _imports,
    "torchvision": _torchvision,
    "slice": _slice,
    "slice_at0": lambda: _slice("@0"),
    "make_jaxpr": _make_jaxpr,
    "truncated_jaxpr": _truncated_jaxpr,
    "first_map": _first_map,
    "jit_first_map": _jit_first_map,
    "tracker": _tracker,
    "intermediates": _intermediates,
    "mlp_calls": _mlp_calls,
}

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(CASES[CASE]()))
