"""Checks and oracles for the jaxslice tests, all independent of jaxslice.

Oracles come from outside jaxslice: Flax's own ``capture_intermediates`` and
``intercept_methods`` (`captured` and `record_calls` record every module call's arguments
and result), eager ``nn.apply`` of submodules, and hand-written reference math in the test
files. Also here: pytree comparisons, counting a jaxpr's equations and JAX's compilations,
seeded random inputs and variables, and Keras on its JAX backend (or a skip).

Test files import these by name (``from helpers.oracles import random_input``); the
``tests/`` folder is on ``sys.path`` (``pythonpath`` in pyproject.toml).
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


def random_input(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)
