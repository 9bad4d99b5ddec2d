"""Shared helpers and the model zoo for the jaxslice test suite.

Oracles come from outside jaxslice: Flax's own ``capture_intermediates`` and
``intercept_methods`` (to record every module call's arguments and result), eager
``nn.apply`` of submodules, and hand-written reference math in the test files.

Every zoo model is tiny and built once per test session; JAX compilation dominates the
suite's run time, so tests share these fixtures instead of re-creating models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ATOL = 1e-5
RTOL = 1e-5


# --------------------------------------------------------------------------- assertions


def assert_trees_all_close(
    actual: Any, expected: Any, *, atol: float = ATOL, rtol: float = RTOL
) -> None:
    """Checks that two pytrees have the same structure, then the same leaves within tolerance.

    Structure is compared first (a tuple is not a list, a dict's keys must match), so a
    slice returning the right numbers in the wrong container fails here.
    """
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"tree structures differ:\n  actual:   {a_tree}\n  expected: {e_tree}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        a_arr, e_arr = np.asarray(a), np.asarray(e)
        assert a_arr.shape == e_arr.shape, f"leaf {i}: shape {a_arr.shape} != {e_arr.shape}"
        assert a_arr.dtype == e_arr.dtype, f"leaf {i}: dtype {a_arr.dtype} != {e_arr.dtype}"
        np.testing.assert_allclose(a_arr, e_arr, atol=atol, rtol=rtol, err_msg=f"leaf {i}")


def assert_trees_equal(actual: Any, expected: Any) -> None:
    """Like `assert_trees_all_close` but bit for bit."""
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, f"tree structures differ:\n  actual:   {a_tree}\n  expected: {e_tree}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        a_arr, e_arr = np.asarray(a), np.asarray(e)
        assert a_arr.dtype == e_arr.dtype, f"leaf {i}: dtype {a_arr.dtype} != {e_arr.dtype}"
        np.testing.assert_array_equal(a_arr, e_arr, err_msg=f"leaf {i}")


def leaf_paths(tree: Any) -> dict[tuple[str, ...], Any]:
    """``{("params", "stem", "kernel"): leaf, ...}`` for every leaf of a nested mapping."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = leaf
    return out


def expected_variable_paths(variables: Any, modules: set[str]) -> set[tuple[str, ...]]:
    """Leaf paths of `variables` (any collection) that belong to one of `modules`.

    `modules` are '/'-joined module paths; a leaf belongs to a module when the module's
    path is a prefix of the leaf's path below the collection key.
    """
    keep = set()
    for path in leaf_paths(variables):
        below = path[1:]
        for m in modules:
            parts = tuple(m.split("/"))
            if below[: len(parts)] == parts:
                keep.add(path)
    return keep


def assert_variables_are_subset_of(sub_variables: Any, variables: Any, modules: set[str]) -> None:
    """`sub_variables` holds exactly the leaves of `modules`, as the very same objects."""
    got = leaf_paths(sub_variables)
    original = leaf_paths(variables)
    assert set(got) == expected_variable_paths(variables, modules)
    for path, leaf in got.items():
        assert leaf is original[path], f"{path} is a copy, not the original leaf"


# --------------------------------------------------------------------------- jaxpr helpers


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr, including those of nested sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                # Duck-typed (Jaxpr or ClosedJaxpr): tests use public names only.
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    yield from iter_eqns(sub)


def count_primitive(jaxpr: Any, name: str) -> int:
    return sum(1 for e in iter_eqns(jaxpr) if e.primitive.name == name)


def count_eqns(jaxpr: Any) -> int:
    return sum(1 for _ in iter_eqns(jaxpr))


# --------------------------------------------------------------------------- compile counting

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCount:
    traces: int = 0
    compiles: int = 0


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCount]:
    """Counts JAX traces and XLA compilations that happen inside the block."""
    counts = CompileCount()

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == _TRACE_EVENT:
            counts.traces += 1
        elif event == _COMPILE_EVENT:
            counts.compiles += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# --------------------------------------------------------------------------- oracles


def call_name(module: nn.Module, method: str) -> str:
    path = "/".join(str(p) for p in module.scope.path)
    return path if method == "__call__" else f"{path}.{method}"


def record_calls(
    model: nn.Module, variables: Any, *args: Any, jit: bool = True, **kwargs: Any
) -> dict[str, list[Any]]:
    """Every submodule method call of ``model.apply`` with its arguments and result.

    Uses Flax's public `nn.intercept_methods`, independently of jaxslice. Returns
    ``{name: [(args, kwargs, output), ...]}`` in call order, named as jaxslice names
    boundaries (``path`` or ``path.method``). With ``jit`` (the default, for speed) the
    whole recording is one compiled call, so every recorded leaf must be an array.
    """

    def run(variables: Any, *args: Any) -> dict[str, list[Any]]:
        calls: dict[str, list[Any]] = {}

        def interceptor(next_fun, call_args, call_kwargs, context):
            out = next_fun(*call_args, **call_kwargs)
            module = context.module
            if module.scope is not None and module.scope.path and context.method_name != "setup":
                calls.setdefault(call_name(module, context.method_name), []).append(
                    (call_args, call_kwargs, out)
                )
            return out

        with nn.intercept_methods(interceptor):
            model.apply(variables, *args, **kwargs)
        return calls

    if not jit:
        return run(variables, *args)
    return _cached_jit(("record", model, tuple(sorted(kwargs.items()))), run)(variables, *args)


_JITTED: dict[Any, Any] = {}


def _cached_jit(key: Any, fn: Any) -> Any:
    """One `jax.jit` per model and oracle, so equal shapes hit JAX's compilation cache."""
    key = tuple(id(k) if isinstance(k, nn.Module) else k for k in key)
    if key not in _JITTED:
        _JITTED[key] = jax.jit(fn)
    return _JITTED[key]


def captured(model: nn.Module, variables: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Flax's ``capture_intermediates`` for every method, flattened to ``{name: (out, ...)}``."""

    def run(variables: Any, *args: Any) -> Any:
        _, state = model.apply(
            variables,
            *args,
            capture_intermediates=lambda m, name: True,
            mutable=["intermediates"],
            **kwargs,
        )
        return state["intermediates"]

    flat = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        for key, value in node.items():
            if isinstance(value, tuple):  # a method's recorded outputs
                name = "/".join(path)
                flat[name if key == "__call__" else f"{name}.{key}"] = value
            else:
                walk(value, path + (key,))

    walk(_cached_jit(("captured", model, tuple(sorted(kwargs.items()))), run)(variables, *args), ())
    return flat


@dataclasses.dataclass
class Zoo:
    """One zoo model with its variables, a sample input and its recorded calls."""

    model: nn.Module
    variables: Any
    x: Any
    calls: dict[str, list[Any]]
    intermediates: dict[str, Any]

    def args_of(self, name: str, k: int = 0) -> tuple[Any, ...]:
        """The positional arguments of the k-th call of `name`, as Flax saw them."""
        return self.calls[name][k][0]

    def out_of(self, name: str, k: int = 0) -> Any:
        return self.calls[name][k][2]

    def apply(self, variables: Any, *args: Any) -> Any:
        """``model.apply``, compiled once per model (eager applies dispatch op by op)."""
        return _cached_jit(("apply", self.model), self.model.apply)(variables, *args)


def make_zoo(model: nn.Module, x: Any, *, seed: int = 0) -> Zoo:
    variables = random_variables(model, x, seed=seed)
    return Zoo(
        model, variables, x, record_calls(model, variables, x), captured(model, variables, x)
    )


def random_variables(model: nn.Module, *args: Any, seed: int = 0) -> Any:
    """Seeded random variables in the structure ``model.init`` gives, without running init.

    ``model.init`` compiles JAX's random number generators, which takes seconds on CPU;
    filling the shapes from `jax.eval_shape` with NumPy's generator costs nothing. Running
    statistics get non-trivial values (variances in [0.5, 1.5]), so BatchNorm in eval
    mode is not an identity.
    """
    # Arguments are closed over, so Python values (None, ints) stay what they are.
    shapes = jax.eval_shape(lambda key: model.init(key, *args), jax.random.key(0))
    rng = np.random.default_rng(seed)

    def fill(path: Any, s: jax.ShapeDtypeStruct) -> jax.Array:
        name = getattr(path[-1], "key", None)
        if name == "var":
            value = rng.uniform(0.5, 1.5, s.shape)
        elif name == "kernel":
            value = rng.normal(0.0, 1.0 / np.sqrt(max(1, int(np.prod(s.shape[:-1])))), s.shape)
        elif name == "scale":
            value = 1.0 + rng.normal(0.0, 0.2, s.shape)
        else:
            value = rng.normal(0.0, 0.5, s.shape)
        return jnp.asarray(value, s.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def import_keras() -> Any:
    """Keras on the JAX backend (chosen before its first import), or a skip."""
    import sys

    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras was imported with the {keras.backend.backend()!r} backend")
    return keras


def keras_block_model(keras: Any) -> Any:
    """A small functional Keras model: stem, BatchNormalization, relu, a layer with
    sublayers (``block``: a(x) -> tanh -> b, plus a residual add) and a head."""

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.a = keras.layers.Dense(6, name="a")
            self.b = keras.layers.Dense(6, name="b")

        def call(self, x):
            return self.b(keras.ops.tanh(self.a(x))) + x

    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, name="stem")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Activation("relu", name="act")(h)
    h = Block(name="block")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


def random_input(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# --------------------------------------------------------------------------- zoo models


class ResBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a (projected) residual add."""

    features: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.features, (3, 3), name="conv1")(x)
        y = nn.BatchNorm(use_running_average=True, name="bn1")(y)
        y = nn.relu(y)
        y = nn.Conv(self.features, (3, 3), name="conv2")(y)
        y = nn.BatchNorm(use_running_average=True, name="bn2")(y)
        if x.shape[-1] != self.features:
            x = nn.Conv(self.features, (1, 1), name="proj")(x)
        return nn.relu(x + y)


class TinyResNet(nn.Module):
    """A ResNet-style CNN in eval mode with named stages."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), name="stem")(x)
        x = nn.relu(x)
        x = ResBlock(4, name="stage1")(x)
        x = ResBlock(8, name="stage2")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(3, name="head")(x)


RESNET_NAMES = [
    "stem",
    "stage1",
    "stage1/conv1",
    "stage1/bn1",
    "stage1/conv2",
    "stage1/bn2",
    "stage2",
    "stage2/conv1",
    "stage2/bn1",
    "stage2/conv2",
    "stage2/bn2",
    "stage2/proj",
    "head",
]


class Identity(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


class WithIdentity(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        h = Identity(name="ident")(h)
        return nn.Dense(2, name="head")(jnp.tanh(h))


class Pair(nn.Module):
    """Returns a tuple of two differently transformed copies of its input."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="a")(x), jnp.sin(nn.Dense(4, name="b")(x))


class WithTuple(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        a, b = Pair(name="pair")(h)
        return nn.Dense(2, name="head")(a * b + a)


class WithUnused(nn.Module):
    """``probe``'s output is never used by the model's result."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        _ = nn.Dense(5, name="probe")(h)
        return nn.Dense(2, name="head")(nn.relu(h))


class WithShared(nn.Module):
    """``shared`` is applied twice with the same parameters."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, name="stem")(x)
        shared = nn.Dense(4, name="shared")
        h = shared(h)
        h = shared(jnp.tanh(h))
        return nn.Dense(2, name="head")(h)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, h, skip):
        return nn.Dense(4, name="fc")(jnp.concatenate([h, skip], axis=-1))


class WithSkip(nn.Module):
    """A U-Net-like skip: ``dec`` reads ``enc1``'s output, bypassing ``enc2``."""

    @nn.compact
    def __call__(self, x):
        e1 = nn.Dense(4, name="enc1")(x)
        e2 = nn.Dense(4, name="enc2")(nn.relu(e1))
        d = Decoder(name="dec")(jnp.tanh(e2), e1)
        return nn.Dense(2, name="head")(d)


class AutoEncoder(nn.Module):
    """A submodule with methods other than ``__call__``."""

    def setup(self):
        self.enc = nn.Dense(3)
        self.dec = nn.Dense(4)

    def encode(self, x):
        return jnp.tanh(self.enc(x))

    def decode(self, z):
        return self.dec(z)

    def __call__(self, x):
        return self.decode(self.encode(x))


class WithMethod(nn.Module):
    @nn.compact
    def __call__(self, x):
        ae = AutoEncoder(name="ae")
        z = ae.encode(x)
        y = ae.decode(z * 2.0)
        return nn.Dense(2, name="head")(y)


def _dense_input(seed: int, shape=(2, 4)) -> jax.Array:
    return random_input(seed, shape)


@pytest.fixture(scope="session")
def resnet() -> Zoo:
    return make_zoo(TinyResNet(), random_input(100, (2, 8, 8, 3)))


@pytest.fixture(scope="session")
def identity_zoo() -> Zoo:
    return make_zoo(WithIdentity(), _dense_input(1), seed=1)


@pytest.fixture(scope="session")
def tuple_zoo() -> Zoo:
    return make_zoo(WithTuple(), _dense_input(2), seed=2)


@pytest.fixture(scope="session")
def unused_zoo() -> Zoo:
    return make_zoo(WithUnused(), _dense_input(3), seed=3)


@pytest.fixture(scope="session")
def shared_zoo() -> Zoo:
    return make_zoo(WithShared(), _dense_input(4), seed=4)


@pytest.fixture(scope="session")
def skip_zoo() -> Zoo:
    return make_zoo(WithSkip(), _dense_input(5), seed=5)


@pytest.fixture(scope="session")
def method_zoo() -> Zoo:
    return make_zoo(WithMethod(), _dense_input(6), seed=6)


def flat_ends(end: Any) -> list[Any]:
    """The items of an `end` given as a list, a dict or one end."""
    if isinstance(end, list):
        return list(end)
    if isinstance(end, dict):
        return list(end.values())
    return [end]


def large_fuzz_seeds(config: Any, default_count: int) -> list[int]:
    """The seeds of a large fuzz run, which runs only when selected (``-m fuzz_large`` or
    ``JAXSLICE_FUZZ_LARGE=1``; the test is skipped otherwise): ``JAXSLICE_FUZZ_SEEDS=3,17``,
    or ``JAXSLICE_FUZZ_N`` seeds (default `default_count`) from ``JAXSLICE_FUZZ_SEED0``."""
    expr = config.getoption("markexpr") or ""
    selected = "fuzz_large" in expr and "not fuzz_large" not in expr
    if os.environ.get("JAXSLICE_FUZZ_LARGE") != "1" and not selected:
        pytest.skip("the large fuzz run: select it with `-m fuzz_large` or JAXSLICE_FUZZ_LARGE=1")
    if os.environ.get("JAXSLICE_FUZZ_SEEDS"):
        return [int(s) for s in os.environ["JAXSLICE_FUZZ_SEEDS"].split(",")]
    first = int(os.environ.get("JAXSLICE_FUZZ_SEED0", "1000"))
    return list(range(first, first + int(os.environ.get("JAXSLICE_FUZZ_N", str(default_count)))))


def pair_verdict(missing: bool, disconnected: bool, unused: bool, clash: bool) -> str:
    """What a fuzz oracle expects of a (start, end) pair, from what its value graph says:
    ``"valid"``, one reason to refuse it (``"missing"``, ``"disconnected"``), a borderline
    case (``"unused"`` start, ``"clash"``: one value given twice) or ``"both"``."""
    if missing and (disconnected or unused or clash):
        return "both"
    if disconnected:
        return "both" if clash else "disconnected"
    if missing:
        return "missing"
    if clash:
        return "clash"
    if unused:
        return "unused"
    return "valid"


# --------------------------------------------------------------------------- coverage models
#
# Small models whose layers the coverage and statistics tests observe.


class CoverageMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(6, name="fc1")(x))
        x = jnp.tanh(nn.Dense(5, name="fc2")(x))
        return nn.Dense(3, name="head")(x)


class CoverageCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3), name="conv1")(x))
        x = nn.relu(nn.Conv(4, (3, 3), strides=2, name="conv2")(x))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(3, name="head")(x)


# --------------------------------------------------------------------------- scanned stacks
#
# Small stacks of scanned layers (5 layers of width 6 by default), shared by the scan,
# interpreter and editing tests: a linen `nn.scan` and an NNX stack made by `nnx.vmap`
# and run by `nnx.scan`, with the same block (``x + mlp(tanh(attn(x)))``).

SCAN_LAYERS = 5
SCAN_WIDTH = 6


class ScanBlock(nn.Module):
    """``(x, _) -> (x + mlp(tanh(attn(x))), None)``: `nn.scan`'s signature."""

    @nn.compact
    def __call__(self, x, _=None):
        a = nn.Dense(SCAN_WIDTH, name="attn")(x)
        return x + nn.Dense(SCAN_WIDTH, name="mlp")(jnp.tanh(a)), None


class ScannedModel(nn.Module):
    """``embed``, `ScanBlock` scanned `SCAN_LAYERS` times as ``layers``, ``head``."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(SCAN_WIDTH, name="embed")(x)
        stack = nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=SCAN_LAYERS
        )
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(3, name="head")(x)


class ScanUnrolled(nn.Module):
    """`ScannedModel` with its blocks applied in a Python loop: the oracle's twin, read
    with Flax's `capture_intermediates` (weights from `scan_unrolled_params`)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(SCAN_WIDTH, name="embed")(x)
        for k in range(SCAN_LAYERS):
            x, _ = ScanBlock(name=f"layers_{k}")(x)
        return nn.Dense(3, name="head")(x)


def scan_unrolled_params(variables: Any) -> Any:
    """A `ScannedModel`'s stacked weights, split per layer for `ScanUnrolled`."""
    p = dict(variables["params"])
    stacked = p.pop("layers")
    for k in range(SCAN_LAYERS):
        p[f"layers_{k}"] = jax.tree_util.tree_map(lambda a, k=k: a[k], stacked)
    return {"params": p}


def nnx_scanned(rngs: Any, layers: int = SCAN_LAYERS) -> Any:
    """The same model in NNX: ``embed``, `layers` stacked blocks (``nnx.vmap``) run by
    ``nnx.scan``, ``head``."""
    from flax import nnx

    class NBlock(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.Linear(SCAN_WIDTH, SCAN_WIDTH, rngs=rngs)
            self.mlp = nnx.Linear(SCAN_WIDTH, SCAN_WIDTH, rngs=rngs)

        def __call__(self, x):
            return x + self.mlp(jnp.tanh(self.attn(x)))

    class NScanned(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NBlock(rngs)

            self.embed = nnx.Linear(4, SCAN_WIDTH, rngs=rngs)
            self.layers = make(rngs)
            self.head = nnx.Linear(SCAN_WIDTH, 3, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(layer, h):
                return layer(h)

            return self.head(body(self.layers, self.embed(x)))

    return NScanned(rngs)


def eager_rows(stacked: Any) -> list[Any]:
    """An NNX module with stacked variables as one eager module per row (an oracle)."""
    from flax import nnx

    graphdef, state = nnx.split(stacked)
    n = jax.tree_util.tree_leaves(state)[0].shape[0]
    return [
        nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, k=k: a[k], state)) for k in range(n)
    ]
