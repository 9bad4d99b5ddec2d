"""Thread safety: slicing, listing and calling from several threads at once.

SPEC, "Reliability rules": slicing, listing and calling from several threads at once
gives the same results as one thread, for every model kind. NNX marking wraps the
submodule classes' ``__call__`` while a trace runs (reference-counted, per context), so
threads tracing models of the same classes at the same moment share the wrappers and
must each see only their own model's calls; the classes are restored afterwards.

Every test computes single-thread results first (each thread's work, run one after the
other), checks those against eager oracles (the layers called by hand, Flax's own
``capture_intermediates``, NumPy math), empties jaxslice's caches so the threads trace
and compile concurrently, then runs the same work from 4 threads released together by a
barrier (a few rounds each) and requires bit-identical results.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.oracles import assert_trees_all_close, assert_trees_equal

N_THREADS = 4
ROUNDS = 2
DEPTH = 6
D = 4  # features
TIMEOUT = 120  # seconds: a deadlock fails instead of hanging the suite

# (start layer, end layer): slices from layer s's input to layer e's output. Thread i,
# round r uses PAIRS[(i + r) % len(PAIRS)], so threads build different slices at once.
PAIRS = [(0, 5), (1, 3), (2, 2), (3, 5), (0, 1), (4, 4)]

# The classes' own __call__, before any test patches them.
LINEAR_CALL = nnx.Linear.__call__
LINEAR_DICT_CALL = nnx.Linear.__dict__.get("__call__")


def rand(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def batch_of(i: int) -> int:
    """Two batch sizes: threads with the same one share cache entries, the others do not."""
    return 2 + i % 2


# --------------------------------------------------------------------------- models


class NNXNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(DEPTH)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


NNX_NET_CALL = NNXNet.__dict__["__call__"]


class Failing(nnx.Module):
    """Uses nnx.Linear too, and raises in the middle of its trace."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.a = nnx.Linear(D, D, rngs=rngs)
        self.b = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        h = self.a(x)
        raise ValueError("deliberate failure inside the model")
        return self.b(h)  # pragma: no cover


FAILING_CALL = Failing.__dict__["__call__"]


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for k in range(DEPTH):
            x = jnp.tanh(nn.Dense(D, name=f"layers_{k}")(x))
        return x


def _dense(p, x):
    return x @ p["w"] + p["b"]


PLAIN_LAYERS = [js.mark(f"layer{k}", _dense) for k in range(DEPTH)]


def plain_net(params, x):
    for layer, p in zip(PLAIN_LAYERS, params, strict=True):
        x = jnp.tanh(layer(p, x))
    return x


def plain_params(seed: int) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": jnp.asarray(rng.normal(size=(D, D)) / 2, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(D,)) / 2, jnp.float32),
        }
        for _ in range(DEPTH)
    ]


# --------------------------------------------------------------------------- model kinds
#
# A kind says how an instance is called by jaxslice (`args`), what its boundaries are
# called, and what each layer computes eagerly (`eager`: every layer's output, computed
# outside jaxslice).


class Kind:
    names: list[str]
    module_type: str

    def make(self, seed: int) -> Any:
        raise NotImplementedError

    def args(self, inst: Any, x: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def eager(self, inst: Any, x: Any) -> list[np.ndarray]:
        raise NotImplementedError

    def call_whole(self, inst: Any, x: Any) -> Any:
        """The model called normally (not through jaxslice)."""
        raise NotImplementedError


class NNXKind(Kind):
    names = [f"layers/{k}" for k in range(DEPTH)]
    module_type = "Linear"

    def make(self, seed):
        return NNXNet(rngs=nnx.Rngs(seed))

    def args(self, inst, x):
        return (inst, x)

    def eager(self, inst, x):
        outs, h = [], x
        for layer in inst.layers:
            out = layer(h)
            outs.append(np.asarray(out))
            h = jnp.tanh(out)
        return outs

    def call_whole(self, inst, x):
        return inst(x)


class LinenKind(Kind):
    names = [f"layers_{k}" for k in range(DEPTH)]
    module_type = "Dense"

    def make(self, seed):
        model = LinenNet()
        return model, model.init(jax.random.key(seed), jnp.ones((1, D)))

    def args(self, inst, x):
        model, variables = inst
        return (model, variables, x)

    def eager(self, inst, x):
        model, variables = inst
        # Flax's own capture_intermediates, checked against the Dense layers applied by hand.
        _, state = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
        outs, h = [], x
        for k, name in enumerate(self.names):
            out = nn.Dense(D).apply({"params": variables["params"][name]}, h)
            np.testing.assert_allclose(
                out, state["intermediates"][name]["__call__"][0], atol=1e-6, err_msg=f"layer {k}"
            )
            outs.append(np.asarray(out))
            h = jnp.tanh(out)
        return outs

    def call_whole(self, inst, x):
        model, variables = inst
        return model.apply(variables, x)


class PlainKind(Kind):
    names = [f"layer{k}" for k in range(DEPTH)]
    module_type = "_dense"

    def make(self, seed):
        return plain_params(seed)

    def args(self, inst, x):
        return (plain_net, inst, x)

    def eager(self, inst, x):
        outs, h = [], np.asarray(x, np.float64)
        for p in inst:
            out = h @ np.asarray(p["w"], np.float64) + np.asarray(p["b"], np.float64)
            outs.append(out.astype(np.float32))
            h = np.tanh(out)
        return outs

    def call_whole(self, inst, x):
        return plain_net(inst, x)


KINDS = {"nnx": NNXKind(), "linen": LinenKind(), "plain": PlainKind()}


# --------------------------------------------------------------------------- the work


def table(bs: list[js.Boundary]) -> list[tuple[Any, ...]]:
    """Everything a boundary row says, as plain comparable values."""
    return [
        (
            b.name,
            b.module_type,
            b.call_index,
            b.num_calls,
            tuple((tuple(s.shape), str(s.dtype)) for s in b.inputs),
            tuple((tuple(s.shape), str(s.dtype)) for s in b.outputs),
            b.param_count,
            b.loop,
        )
        for b in bs
    ]


def slice_input(kind: Kind, eager: list[np.ndarray], x: Any, s: int) -> Any:
    """What a slice starting at layer `s`'s input is called with (computed eagerly)."""
    return x if s == 0 else jnp.asarray(np.tanh(eager[s - 1]), jnp.float32)


def some_names(kind: Kind) -> list[str]:
    """The boundaries that odd rounds ask `js.intermediates` for (out of order)."""
    return [kind.names[4], kind.names[1]]


def work(kind: Kind, inst: Any, x: Any, eager: list[np.ndarray], i: int, r: int) -> dict:
    """One round of thread `i`: list, take intermediates, slice, call the slice and the model."""
    s, e = PAIRS[(i + r) % len(PAIRS)]
    args = kind.args(inst, x)
    names = None if r % 2 == 0 else some_names(kind)
    sub = js.slice(*args, start=kind.names[s], end=kind.names[e])
    inter = js.intermediates(*args, names=names)
    return {
        "boundaries": table(js.boundaries(*args)),
        "order": list(inter),
        "intermediates": {k: np.asarray(v) for k, v in inter.items()},
        "slice": np.asarray(sub(slice_input(kind, eager, x, s))),
        "whole": np.asarray(kind.call_whole(inst, x)),
    }


META = ("boundaries", "order")  # compared with ==; the rest are arrays


def assert_same(got: dict, want: dict, *, exact: bool, where: Any) -> None:
    for key in META:
        assert got[key] == want[key], (where, key)
    arrays = lambda d: {k: v for k, v in d.items() if k not in META}  # noqa: E731
    if exact:
        assert_trees_equal(arrays(got), arrays(want))
    else:
        assert_trees_all_close(arrays(got), arrays(want))


def expected(kind: Kind, eager: list[np.ndarray], x: Any, i: int, r: int) -> dict:
    """What `work` must return, from the eager oracle alone."""
    s, e = PAIRS[(i + r) % len(PAIRS)]
    n = x.shape[0]
    row = lambda k: (  # noqa: E731
        kind.names[k],
        kind.module_type,
        0,
        1,
        (((n, D), "float32"),),
        (((n, D), "float32"),),
        D * D + D,
        None,
    )
    inter = dict(zip(kind.names, eager, strict=True))
    if r % 2:
        inter = {name: inter[name] for name in some_names(kind)}
    return {
        "boundaries": [row(k) for k in range(DEPTH)],
        "order": list(inter),
        "intermediates": inter,
        "slice": eager[e],
        "whole": np.tanh(eager[-1]),
    }


def run_threads(fn: Callable[[int, int], Any], n: int = N_THREADS) -> list[list[Any]]:
    """`fn(i, r)` for rounds r of `n` threads i released together by a barrier."""
    barrier = threading.Barrier(n)

    def worker(i: int) -> list[Any]:
        barrier.wait(timeout=TIMEOUT)
        return [fn(i, r) for r in range(ROUNDS)]

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(worker, i) for i in range(n)]
        return [f.result(timeout=TIMEOUT) for f in futures]


def check_against_one_thread(
    kinds: list[Kind], insts: list[Any], xs: list[Any], *, odd: Callable[[int], Any] | None = None
) -> None:
    """Thread i works on insts[i] (of kinds[i]) with xs[i]. Its results alone, one thread
    after the other, equal the eager oracle; then, jaxslice's caches emptied so that the
    threads trace and compile concurrently, the threaded results equal those bit for bit.
    `odd(r)`, when given, is what one more thread does in each round (checking its own
    results), at the same time as the others."""
    eagers = [k.eager(inst, x) for k, inst, x in zip(kinds, insts, xs, strict=True)]
    single = [
        [work(kinds[i], insts[i], xs[i], eagers[i], i, r) for r in range(ROUNDS)]
        for i in range(len(kinds))
    ]
    for i in range(len(kinds)):
        for r in range(ROUNDS):
            want = expected(kinds[i], eagers[i], xs[i], i, r)
            assert_same(single[i][r], want, exact=False, where=(i, r))
    js.clear_caches()

    def fn(i: int, r: int) -> Any:
        if i == len(kinds):
            return odd(r)
        return work(kinds[i], insts[i], xs[i], eagers[i], i, r)

    threaded = run_threads(fn, len(kinds) + (odd is not None))
    for i in range(len(kinds)):
        for r in range(ROUNDS):
            assert_same(threaded[i][r], single[i][r], exact=True, where=(i, r))


def assert_nnx_unpatched(*models: NNXNet) -> None:
    assert nnx.Linear.__call__ is LINEAR_CALL
    assert nnx.Linear.__dict__.get("__call__") is LINEAR_DICT_CALL
    assert NNXNet.__dict__["__call__"] is NNX_NET_CALL
    assert NNXNet.__call__ is NNX_NET_CALL
    for model in models:
        assert type(model).__call__ is NNX_NET_CALL
        for layer in model.layers:
            assert type(layer).__call__ is nnx.Linear.__call__
            assert type(layer).__call__ is LINEAR_CALL


def arrays_of(kind_name: str, inst: Any) -> list[np.ndarray]:
    """Copies of an instance's parameter arrays."""
    tree = {"nnx": lambda: nnx.state(inst), "linen": lambda: inst[1], "plain": lambda: inst}
    return [np.array(a) for a in jax.tree_util.tree_leaves(tree[kind_name]())]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind_name", ["nnx", "linen", "plain"])
def test_separate_instances_from_threads(kind_name):
    """4 threads, each with its own instance of one class (its own parameters and input),
    slicing, listing and calling at once: the same results as one thread."""
    kind = KINDS[kind_name]
    insts = [kind.make(seed) for seed in range(N_THREADS)]
    xs = [rand(100 + i, (batch_of(i), D)) for i in range(N_THREADS)]
    check_against_one_thread([kind] * N_THREADS, insts, xs)
    if kind_name == "nnx":
        assert_nnx_unpatched(*insts)


@pytest.mark.parametrize("kind_name", ["nnx", "linen"])
def test_one_shared_instance_from_threads(kind_name):
    """4 threads on one model instance (different inputs): the same results as one thread."""
    kind = KINDS[kind_name]
    inst = kind.make(7)
    xs = [rand(200 + i, (batch_of(i), D)) for i in range(N_THREADS)]
    before = arrays_of(kind_name, inst)
    check_against_one_thread([kind] * N_THREADS, [inst] * N_THREADS, xs)
    assert_trees_equal(arrays_of(kind_name, inst), before)  # the model is left as it was
    if kind_name == "nnx":
        assert_nnx_unpatched(inst)


def test_every_kind_at_once():
    """NNX, linen and plain models sliced at the same moment; the NNX threads also call
    their models eagerly while other threads' traces have nnx.Linear patched."""
    kinds = [KINDS["nnx"], KINDS["linen"], KINDS["plain"], KINDS["nnx"]]
    insts = [k.make(30 + i) for i, k in enumerate(kinds)]
    xs = [rand(300 + i, (batch_of(i), D)) for i in range(N_THREADS)]
    check_against_one_thread(kinds, insts, xs)
    assert_nnx_unpatched(insts[0], insts[3])


def test_failing_trace_in_one_thread():
    """One thread's model raises in the middle of its trace (with nnx.Linear patched) while
    three others slice: theirs are unaffected, it gets a SliceError each time, and the
    classes are restored afterwards."""
    kinds = [KINDS["nnx"]] * (N_THREADS - 1)
    insts = [k.make(40 + i) for i, k in enumerate(kinds)]
    xs = [rand(400 + i, (batch_of(i), D)) for i in range(N_THREADS - 1)]
    failing = Failing(rngs=nnx.Rngs(0))
    x = rand(499, (2, D))

    def odd(r: int) -> None:
        with pytest.raises(js.SliceError) as info:
            js.slice(failing, x, end="b")
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(js.SliceError):
            js.boundaries(failing, x)

    check_against_one_thread(kinds, insts, xs, odd=odd)
    assert_nnx_unpatched(*insts)
    assert Failing.__dict__["__call__"] is FAILING_CALL


def test_one_lens_from_threads():
    """4 threads call one `js.lens` at once, each steering a different layer and reading
    it: the same results as one thread, which equal the layers computed by hand."""
    model = LinenNet()
    x = rand(600, (3, D))
    variables = model.init(jax.random.key(0), x)
    p = variables["params"]
    vectors = [rand(700 + i, (D,)) for i in range(N_THREADS)]

    def by_hand(k: int, v: Any) -> tuple[Any, Any]:
        h, steered = x, None
        for j in range(DEPTH):
            z = h @ p[f"layers_{j}"]["kernel"] + p[f"layers_{j}"]["bias"]
            if j == k:
                z = steered = z + v
            h = jnp.tanh(z)
        return h, steered

    def work_of(lens: js.Lens) -> Callable[[int, int], Any]:
        def fn(i: int, r: int) -> Any:
            name = f"layers_{(i + r) % DEPTH}"
            out, cache = lens(x, add={name: vectors[i]}, read=[name])
            return {"out": np.asarray(out), "read": np.asarray(cache[name])}

        return fn

    single_fn = work_of(js.lens(model, variables, x))
    single = [[single_fn(i, r) for r in range(ROUNDS)] for i in range(N_THREADS)]
    for i in range(N_THREADS):
        for r in range(ROUNDS):
            out, steered = by_hand((i + r) % DEPTH, vectors[i])
            assert_trees_all_close(single[i][r], {"out": out, "read": steered}, atol=1e-5)
    threaded = run_threads(work_of(js.lens(model, variables, x)))  # compiled concurrently
    for i in range(N_THREADS):
        for r in range(ROUNDS):
            assert_trees_equal(threaded[i][r], single[i][r])


def test_one_tracker_and_one_stats_from_threads():
    """4 threads update one coverage tracker (its pair criteria's state is donated to
    each update) and one `ActivationStats` at once, each with its own batches: no batch
    is lost and no donated state is read. The coverage equals one thread's over the same
    batches (it does not depend on their order), the history holds every input, and the
    statistics equal NumPy's over the layers computed by hand."""
    model = LinenNet()
    x = rand(800, (3, D))
    variables = model.init(jax.random.key(0), x)
    p = variables["params"]
    batches = [
        [rand(900 + 10 * i + r, (3 + i, D)) for r in range(ROUNDS)] for i in range(N_THREADS)
    ]
    crits = lambda: [js.coverage.NC(0.5), js.coverage.NBC(), js.coverage.SignSign()]  # noqa: E731

    def fresh() -> tuple[Any, Any]:
        tracker = js.coverage.Tracker(model, variables, x, criteria=crits())
        tracker.profile([x])
        return tracker, js.ActivationStats(model, variables, x)

    tracker, stats = fresh()
    for i in range(N_THREADS):
        for b in batches[i]:
            tracker.update(b)
    single = tracker.result()
    js.clear_caches()
    tracker, stats = fresh()

    def fn(i: int, r: int) -> None:
        tracker.update(batches[i][r])
        stats.update(batches[i][r])

    run_threads(fn)
    assert tracker.result() == single
    seen = sum(len(b) for per_thread in batches for b in per_thread)
    assert int(tracker.states[2][2]) == seen  # SignSign's history: every input once
    inputs = np.concatenate([np.asarray(b) for per_thread in batches for b in per_thread])
    h, result = inputs, stats.result()
    for k in range(DEPTH):
        z = h @ np.asarray(p[f"layers_{k}"]["kernel"]) + np.asarray(p[f"layers_{k}"]["bias"])
        got = result[f"layers_{k}"]
        assert got["count"] == z.size
        np.testing.assert_allclose([got["min"], got["max"]], [z.min(), z.max()], rtol=1e-5)
        np.testing.assert_allclose(got["mean"], z.mean(), rtol=1e-4, atol=1e-5)
        h = np.tanh(z)
