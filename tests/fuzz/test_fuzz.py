"""Differential fuzzing of linen slicing (in the spirit of NNSmith).

A seeded generator builds random, valid linen models: a small DAG of blocks (Dense,
Conv on an image input, BatchNorm, LayerNorm, identity modules, deterministic dropout,
modules returning tuples, modules taking a keyword argument, a shared module called
several times, a module with methods other than ``__call__``, nested blocks written in
``compact`` or ``setup`` style, some under ``nn.remat``/``nn.jit``, ``jax.checkpoint``
and ``jax.jit`` regions between blocks, residual adds, concatenations, skips from
earlier blocks) with one or more outputs (an array, a tuple or a dict). Extended models
(``generate(seed, extra=True)``; old seeds give the same plain models as before) add
running averages that update ``batch_stats`` only ``if train and not
self.is_mutable_collection("params")`` (the model is applied, and sliced, with
``mutable=["batch_stats"]``), modules returning ``(h, aux)`` whose aux values the parent
collects into a tuple output (``return h, (aux1, aux2)``, also from nested blocks), and
blocks called with containers of earlier activations (``block(x, {"skip": e})``,
``block(x, ctx={"skip": e})``, ``block((x, e))``).

The oracle never asks jaxslice anything. The generated model records, while Flax runs it
(jitted), every value it computes under an id of the generator's own value DAG: which
values each value is computed from, which values each module call receives and
returns. Flax's ``capture_intermediates`` gives every call's output independently. From
that DAG alone the tests decide whether a ``(start, end)`` pair is a valid slice (the
start's values cut every path from the model's inputs to the end, and every end
depends on the start) and what it must return. Then:

1. every boundary's output (and input, through ``name:input``) from slices of the whole
   model equals the recorded value; random valid ``(start, end)`` pairs, fed the
   start's recorded values, reproduce the end's recorded value and own exactly the
   variables of the modules between start and end (the original arrays);
   (and, called with a doubled batch, the doubled result);
2. ``slice(a, b)(slice(None, a)(x)) == slice(None, b)(x)``;
3. pairs that are not valid slices (the end does not depend on the start, or needs a
   value from before the start that is not given) raise `js.SliceError`, never return.
   Borderline pairs (a start that is not needed, the same value given twice) may raise
   or return, but never a wrong value;
4. stateful models: every slice holding state, applied with ``mutable=["batch_stats"]``,
   returns the new state ``model.apply`` returned for its own modules; without
   ``mutable`` a slice whose output needs an update raises, and with ``mutable=True``
   the model takes its no-update branch, as in ``model.apply``;
5. threads: random valid slices, the boundary list and ``js.intermediates`` built and
   called from 4 threads at once give bit-identical results to one thread;
6. array fields and array modes: a model wrapped by a module whose NumPy or JAX array
   fields scale its inputs and shift its outputs (constants of the trace), twice with
   other values, then with a NumPy field changed in place, gives every boundary, the
   whole model and random valid slices as the recording of the model on the scaled
   inputs does, in both modes given as one-element arrays (``train=np.asarray(True)``).

A few models run by default. The large run (hundreds of models) runs only when
selected: ``pytest -m fuzz_large tests/fuzz/test_fuzz.py`` (or ``JAXSLICE_FUZZ_LARGE=1``);
``JAXSLICE_FUZZ_N`` sets how many seeds, ``JAXSLICE_FUZZ_SEED0`` the first seed,
``JAXSLICE_FUZZ_SEEDS=3,17`` replays chosen seeds and ``JAXSLICE_FUZZ_EXTRA`` picks plain
(``0``), extended (``1``) or both (``both``, the default) models per seed; every tenth
seed also runs the thread check, and every tenth from 5 on (returning an array or a
tuple) the array-field check. A failing model's seed is in the failure message;
``describe(generate(seed, extra))`` prints its source-like description.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import os
import random
import threading
import time
import traceback
from typing import Any

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.fuzzing import ancestors, flat_ends, large_fuzz_seeds, pair_verdict, prefixed
from helpers.models import Identity
from helpers.oracles import (
    assert_trees_all_close,
    assert_trees_equal,
    expected_variable_paths,
    leaf_paths,
    random_variables,
)

B = 2  # batch
HW = 4  # image height and width
IMG_IN_CHANNELS = 3
ATOL = RTOL = 1e-4

# --------------------------------------------------------------------------- model specs
#
# A graph spec is a list of ops over a local environment of values: the graph's inputs
# first, then each op's outputs in order. Op kinds:
#   module ops (each call is a boundary):
#     dense, conv, bn (BatchNorm, eval), ln (LayerNorm), ident (returns its input),
#     dropout (deterministic: returns its input), pair (returns a tuple), merge (two
#     arguments, the second maybe by keyword), block (a nested graph), shared (a call
#     of a shared instance), method (``coder.encode``/``coder.decode``)
#   glue ops (plain jnp, no boundary): add, mul, act, concat, pool, region (a two-output
#     function under jax.checkpoint or jax.jit)


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str
    ins: tuple[int, ...]
    name: str | None = None  # module name (module ops)
    variant: int = 0
    keyword: bool = False  # merge: second argument by keyword
    sub: Any = None  # block: its GraphSpec
    ref: str | None = None  # shared/method: the instance's name
    method: str = "__call__"


@dataclasses.dataclass(frozen=True)
class Instance:
    """A module instance called by several ops."""

    name: str
    kind: str  # "dense", "block" or "coder"
    sub: Any = None  # block: its GraphSpec


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    features: int
    n_in: int
    ops: tuple[Op, ...]
    out: tuple[int, ...]
    out_form: str  # "single", "tuple" or "dict"
    style: str  # "compact" or "setup"
    instances: tuple[Instance, ...] = ()
    transform: str = "none"  # nested blocks: "none", "remat" (nn.remat) or "jit" (nn.jit)
    # Extended models (`generate(seed, extra=True)`) only:
    pack: str = "none"  # nested blocks: arguments in a container, see `_pack`
    n_aux: int = 0  # out_form "aux": the last n_aux outputs, collected in a tuple
    out_kinds: tuple[str, ...] = ()  # "vec", "aux", ... of each output
    # (seed, extra) of the model: blocks of different models are never equal, so nn.jit
    # never replays another model's trace (the recording needs its Python body to run).
    tag: Any = None


# --------------------------------------------------------------------------- recording
#
# While the oracle runs the model, `_REC` holds a Recorder; otherwise (init, jaxslice's
# traces) it is None and the model computes exactly the same thing without recording.


@dataclasses.dataclass
class CallRec:
    base: str  # path, or path.method
    index: int  # call index among calls of `base`
    args: list[int]  # value ids of the positional arguments
    kwargs: dict[str, int]  # value ids of keyword arguments
    out: Any = None  # value id, or tuple of ids
    parent: Any = None  # the call this one happens inside (a CallRec), if any


class Recorder:
    def __init__(self) -> None:
        self.values: dict[int, Any] = {}
        self.parents: dict[int, tuple[int, ...]] = {}
        self.model_inputs: list[int] = []
        self.calls: list[CallRec] = []
        self.counts: dict[str, int] = {}
        self.arg_stack: list[Any] = []
        self.result_stack: list[Any] = []
        self.model_out: Any = None
        self.opaque = 0  # > 0 inside a block under nn.remat or nn.jit
        self.producer: dict[int, str] = {}  # value id -> path of the leaf module computing it
        self.updating: set[str] = set()  # paths of the modules that update state (train mode)
        self.open: list[CallRec] = []  # the calls running now, outermost first

    def new(self, value: Any, parents: tuple[int, ...]) -> int:
        """A new value of the DAG. Values computed inside nn.remat/nn.jit are tracers of
        an inner trace that cannot leave it: they join the DAG without a value."""
        vid = len(self.parents)
        self.parents[vid] = tuple(parents)
        if not self.opaque:
            self.values[vid] = value
        return vid


_REC: Recorder | None = None


@contextlib.contextmanager
def recording(rec: Recorder):
    global _REC
    previous, _REC = _REC, rec
    try:
        yield
    finally:
        _REC = previous


class V:
    """A value of the model with its id in the generator's DAG (None when not recording)."""

    __slots__ = ("id", "value")

    def __init__(self, id: int | None, value: Any):
        self.id = id
        self.value = value


def _glue(value: Any, parents: list[V]) -> V:
    if _REC is None:
        return V(None, value)
    return V(_REC.new(value, tuple(p.id for p in parents)), value)


def _invoke(
    module: nn.Module, base: str, method: str, args: list[Any], kwargs: dict[str, Any], how: str
) -> Any:
    """Calls a submodule method; returns its result as a V or a (nested) tuple of Vs.
    Arguments are Vs or containers of Vs.

    `how` says what the generator knows about the result: "new" (a new value computed
    from all the arguments), "same" (the first argument itself) or "custom" (the callee
    records its own values and leaves the result's ids on the result stack).
    """
    fn = getattr(module, method)
    raw_args = [_values(a) for a in args]
    raw_kwargs = {k: _values(v) for k, v in kwargs.items()}
    rec = _REC
    if rec is None:
        return jax.tree_util.tree_map(lambda o: V(None, o), fn(*raw_args, **raw_kwargs))
    k = rec.counts.get(base, 0)
    rec.counts[base] = k + 1
    if isinstance(module, RunningAvg) and module.train:
        rec.updating.add(base)
    call = CallRec(base, k, [_ids(a) for a in args], {n: _ids(v) for n, v in kwargs.items()})
    call.parent = rec.open[-1] if rec.open else None
    rec.calls.append(call)
    if how in ("custom", "transformed"):
        rec.arg_stack.append((call.args, call.kwargs))
    rec.open.append(call)
    try:
        out = fn(*raw_args, **raw_kwargs)
    finally:
        rec.open.pop()
    if how == "new":
        ids = rec.new(out, tuple(jax.tree_util.tree_leaves((call.args, call.kwargs))))
        rec.producer[ids] = base
    elif how == "same":
        ids = call.args[0]
    else:
        ids = rec.result_stack.pop()
        if how == "transformed":  # the block's results, as values of the outer trace
            ids = jax.tree_util.tree_map(lambda i, o: rec.new(o, (i,)), ids, out)
    call.out = ids
    return jax.tree_util.tree_map(V, ids, out)


def _values(tree: Any) -> Any:
    """The plain values of a V, or of a container of Vs."""
    return jax.tree_util.tree_map(lambda v: v.value, tree, is_leaf=_is_v)


def _ids(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda v: v.id, tree, is_leaf=_is_v)


def _custom_args(values: tuple[Any, ...]) -> list[Any]:
    """The callee's arguments as Vs (containers of Vs for container arguments)."""
    if _REC is None:
        return [jax.tree_util.tree_map(lambda v: V(None, v), t) for t in values]
    ids, kw = _REC.arg_stack.pop()
    ids = list(ids) + list(kw.values())
    return [jax.tree_util.tree_map(V, i, v) for i, v in zip(ids, values, strict=True)]


def _custom_return(result: Any) -> Any:
    """Leaves the result's ids for `_invoke` and returns the plain values (a V, or a
    tuple of Vs, possibly nested)."""
    if _REC is not None:
        _REC.result_stack.append(_ids(result))
    return _values(result)


def _path(module: nn.Module) -> tuple[str, ...]:
    return tuple(str(p) for p in module.scope.path)


def _join(module: nn.Module, name: str, method: str = "__call__") -> str:
    base = "/".join(_path(module) + (name,))
    return base if method == "__call__" else f"{base}.{method}"


# --------------------------------------------------------------------------- modules


class Pair(nn.Module):
    """Returns a tuple: (a(x), sin(b(x))), or (x, a(x)) when `passthrough`."""

    features: int
    passthrough: bool = False

    @nn.compact
    def __call__(self, x):
        (x,) = _custom_args((x,))
        a = _invoke(nn.Dense(self.features, name="a"), _join(self, "a"), "__call__", [x], {}, "new")
        if self.passthrough:
            return _custom_return((x, a))
        b = _invoke(nn.Dense(self.features, name="b"), _join(self, "b"), "__call__", [x], {}, "new")
        return _custom_return((a, _glue(jnp.sin(b.value), [b])))


class Merge(nn.Module):
    """fc(concat(x, other)); `other` may come by keyword."""

    features: int

    @nn.compact
    def __call__(self, x, other):
        x, other = _custom_args((x, other))
        cat = _glue(jnp.concatenate([x.value, other.value], axis=-1), [x, other])
        out = _invoke(
            nn.Dense(self.features, name="fc"), _join(self, "fc"), "__call__", [cat], {}, "new"
        )
        return _custom_return(out)


class Coder(nn.Module):
    """A module with methods other than ``__call__`` (setup style)."""

    features: int

    def setup(self):
        self.enc = nn.Dense(self.features)
        self.dec = nn.Dense(self.features)

    def encode(self, x):
        (x,) = _custom_args((x,))
        h = _invoke(self.enc, _join(self, "enc"), "__call__", [x], {}, "new")
        return _custom_return(_glue(jnp.tanh(h.value), [h]))

    def decode(self, z):
        (z,) = _custom_args((z,))
        return _custom_return(_invoke(self.dec, _join(self, "dec"), "__call__", [z], {}, "new"))

    def __call__(self, x):
        (x,) = _custom_args((x,))
        base = "/".join(_path(self))
        h = _invoke(self, f"{base}.encode", "encode", [x], {}, "custom")
        return _custom_return(_invoke(self, f"{base}.decode", "decode", [h], {}, "custom"))


class RunningAvg(nn.Module):
    """Keeps a running mean of its input in ``batch_stats``. In train mode, and only when
    params are immutable (so not during init), it centres by the batch mean and updates
    the running mean; otherwise it centres by the running mean and updates nothing."""

    train: bool = True

    @nn.compact
    def __call__(self, x):
        axes = tuple(range(x.ndim - 1))
        mean = self.variable("batch_stats", "mean", lambda: jnp.zeros(x.shape[-1], x.dtype))
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        if self.train and not self.is_mutable_collection("params"):
            m = x.mean(axes)
            mean.value = 0.9 * mean.value + 0.1 * m
            return (x - m) * scale + mean.value
        return (x - mean.value) * scale


class AuxHead(nn.Module):
    """Returns ``(h, aux)``: h = fc(x), aux a per-example summary of h (shape (batch,))."""

    features: int

    @nn.compact
    def __call__(self, x):
        (x,) = _custom_args((x,))
        h = _invoke(
            nn.Dense(self.features, name="fc"), _join(self, "fc"), "__call__", [x], {}, "new"
        )
        aux = _glue(jnp.sum(jnp.tanh(h.value) ** 2, axis=-1), [h])
        return _custom_return((h, aux))


def _make(op_or_inst: Any, features: int, name: str | None) -> nn.Module:
    kind = op_or_inst.kind
    kw = {} if name is None else {"name": name}
    if kind == "dense":
        return nn.Dense(features, **kw)
    if kind == "conv":
        return nn.Conv(features, (3, 3), **kw)
    if kind == "bn":
        return nn.BatchNorm(use_running_average=True, **kw)
    if kind == "ln":
        return nn.LayerNorm(**kw)
    if kind == "ident":
        return Identity(**kw)
    if kind == "dropout":
        return nn.Dropout(0.5, deterministic=True, **kw)
    if kind == "pair":
        return Pair(features, passthrough=bool(op_or_inst.variant), **kw)
    if kind == "merge":
        return Merge(features, **kw)
    if kind == "block":
        return block_module(op_or_inst.sub, name)
    if kind == "coder":
        return Coder(features, **kw)
    if kind == "avg":
        return RunningAvg(train=not op_or_inst.variant, **kw)
    if kind == "aux":
        return AuxHead(features, **kw)
    raise AssertionError(kind)


_HOW = {
    "dense": "new",
    "conv": "new",
    "bn": "new",
    "ln": "new",
    "ident": "same",
    "dropout": "same",
    "pair": "custom",
    "merge": "custom",
    "block": "custom",
    "coder": "custom",
    "avg": "new",
    "aux": "custom",
}


def _how(item: Any) -> str:
    if item.kind == "block" and item.sub.transform != "none":
        return "transformed"
    return _HOW[item.kind]


def _region_fn(a: Any, b: Any) -> tuple[Any, Any]:
    """A two-output function run under jax.checkpoint or jax.jit: the first result
    depends on `a` only, the second on both."""
    return jnp.tanh(a) * 2.0, a * jnp.cos(b)


_REGIONS = {0: jax.checkpoint(_region_fn), 1: jax.jit(_region_fn)}


def _run_graph(self: nn.Module, spec: GraphSpec, inputs: list[V], get: Any) -> Any:
    env: list[Any] = list(inputs)
    instances = {i.name: i for i in spec.instances}
    for op in spec.ops:
        ins = [env[i] for i in op.ins]
        kind = op.kind
        if kind == "add":
            env.append(_glue(ins[0].value + ins[1].value, ins))
        elif kind == "mul":
            env.append(_glue(ins[0].value * jnp.tanh(ins[1].value), ins))
        elif kind == "act":
            fn = (jnp.tanh, jax.nn.relu, jnp.sin)[op.variant]
            env.append(_glue(fn(ins[0].value), ins))
        elif kind == "concat":
            env.append(_glue(jnp.concatenate([ins[0].value, ins[1].value], axis=-1), ins))
        elif kind == "pool":
            env.append(_glue(jnp.mean(ins[0].value, axis=(1, 2)), ins))
        elif kind == "region":
            first, second = _REGIONS[op.variant](ins[0].value, ins[1].value)
            env += [_glue(first, ins[:1]), _glue(second, ins)]
        elif kind in ("shared", "method"):
            inst = instances[op.ref]
            how = _how(inst)
            out = _invoke(get(inst), _join(self, inst.name, op.method), op.method, ins, {}, how)
            env.extend(jax.tree_util.tree_leaves(out, is_leaf=_is_v))
        else:
            args, kwargs = ins, {}
            if kind == "merge" and op.keyword:
                args, kwargs = ins[:1], {"other": ins[1]}
            if kind == "block" and op.sub.pack != "none":
                args, kwargs = _pack(op.sub.pack, ins)
            out = _invoke(get(op), _join(self, op.name), "__call__", args, kwargs, _how(op))
            env.extend(jax.tree_util.tree_leaves(out, is_leaf=_is_v))
    outs = [env[i] for i in spec.out]
    if spec.out_form == "single":
        return outs[0]
    if spec.out_form == "tuple":
        return tuple(outs)
    if spec.out_form == "aux":  # (main, (aux, ...)): the aux values collected in a tuple
        main, aux = outs[: len(outs) - spec.n_aux], outs[len(outs) - spec.n_aux :]
        return (main[0] if len(main) == 1 else tuple(main), tuple(aux))
    return {f"out{i}": o for i, o in enumerate(outs)}


def _pack(pack: str, ins: list[V]) -> tuple[list[Any], dict[str, Any]]:
    """A block's arguments in a container: ``block(x, {"skip": e})`` ("dict"),
    ``block(x, ctx={"skip": e})`` ("kwdict") or ``block((x, e))`` ("tuple"). The callee
    sees its inputs in the containers' leaf order, which is `ins` order (keys sort so)."""
    ctx = {("skip" if j == 0 else f"skip{j}"): v for j, v in enumerate(ins[1:])}
    if pack == "dict":
        return [ins[0], ctx], {}
    if pack == "kwdict":
        return [ins[0]], {"ctx": ctx}
    return [tuple(ins)], {}


def _is_v(x: Any) -> bool:
    return isinstance(x, V)


def _enter(self: nn.Module, xs: tuple[Any, ...], kw: dict[str, Any]) -> list[V]:
    """The block's inputs as a flat list of Vs (container arguments flattened)."""
    rec = _REC
    if rec is not None and not _path(self):  # the model itself
        ids = [rec.new(x, ()) for x in xs]
        rec.model_inputs = ids
        return [V(i, x) for i, x in zip(ids, xs, strict=True)]
    if rec is not None and self.spec.transform != "none":
        rec.opaque += 1
    args = _custom_args(tuple(xs) + tuple(kw.values()))
    return jax.tree_util.tree_leaves(args, is_leaf=_is_v)


def _leave(self: nn.Module, result: Any) -> Any:
    if not _path(self):
        if _REC is not None:
            _REC.model_out = jax.tree_util.tree_map(lambda r: r.id, result, is_leaf=_is_v)
        return jax.tree_util.tree_map(lambda r: r.value, result, is_leaf=_is_v)
    if isinstance(result, dict):
        raise AssertionError("nested blocks return an array or a tuple")
    if _REC is not None and self.spec.transform != "none":
        _REC.opaque -= 1
    return _custom_return(result)


class CompactBlock(nn.Module):
    spec: GraphSpec

    @nn.compact
    def __call__(self, *xs, **kw):
        made: dict[str, nn.Module] = {}

        def get(item: Any) -> nn.Module:
            name = item.name if isinstance(item, Instance) else item.name
            if name not in made:
                made[name] = _make(item, self.spec.features, name)
            return made[name]

        return _leave(self, _run_graph(self, self.spec, _enter(self, xs, kw), get))


class SetupBlock(nn.Module):
    spec: GraphSpec

    def setup(self):
        for op in self.spec.ops:
            if op.name is not None:
                setattr(self, op.name, _make(op, self.spec.features, None))
        for inst in self.spec.instances:
            setattr(self, inst.name, _make(inst, self.spec.features, None))

    def __call__(self, *xs, **kw):
        get = lambda item: getattr(self, item.name)  # noqa: E731
        return _leave(self, _run_graph(self, self.spec, _enter(self, xs, kw), get))


_TRANSFORMED = {
    ("compact", "remat"): nn.remat(CompactBlock),
    ("setup", "remat"): nn.remat(SetupBlock),
    ("compact", "jit"): nn.jit(CompactBlock),
    ("setup", "jit"): nn.jit(SetupBlock),
}


def block_module(spec: GraphSpec, name: str | None = None) -> nn.Module:
    cls = CompactBlock if spec.style == "compact" else SetupBlock
    if spec.transform != "none":
        cls = _TRANSFORMED[spec.style, spec.transform]
    return cls(spec) if name is None else cls(spec, name=name)


# --------------------------------------------------------------------------- generator


class _Gen:
    def __init__(self, rng: random.Random, features: int, extra: bool = False, tag: Any = None):
        self.rng = rng
        self.d = features
        self.tag = tag
        # Extended models add running averages updated under `is_mutable_collection`,
        # modules returning `(h, aux)` with the aux values collected into a tuple output,
        # and blocks taking their inputs in containers. Without `extra`, the generator
        # draws exactly what it always drew, so old seeds give the same models.
        self.extra = extra

    def pick(self, kinds: list[str], allowed: set[str]) -> int | None:
        """A value index of an allowed kind, biased towards recent values."""
        cands = [i for i, k in enumerate(kinds) if k in allowed]
        if not cands:
            return None
        if self.rng.random() < 0.6:
            return cands[-1]
        if self.rng.random() < 0.5:
            return cands[max(0, len(cands) - 3) + self.rng.randrange(min(3, len(cands)))]
        return self.rng.choice(cands)

    def graph(
        self, in_kinds: list[str], n_ops: int, depth: int, top: bool, stateless: bool = False
    ) -> GraphSpec:
        """`stateless`: no running averages (the body of a shared block: a second call
        would read the state the first call wrote, which the value DAG does not see)."""
        rng = self.rng
        kinds = list(in_kinds)
        ops: list[Op] = []
        instances: list[Instance] = []
        style = rng.choice(["compact", "setup"])
        counter = [0]

        def fresh(prefix: str) -> str:
            counter[0] += 1
            return f"{prefix}{counter[0]}"

        def emit(op: Op, out_kinds: list[str]) -> None:
            ops.append(op)
            kinds.extend(out_kinds)

        # An image input goes through a conv and a pooling into the vector stream.
        if "img3" in kinds:
            i = kinds.index("img3")
            emit(Op("conv", (i,), name=fresh("conv")), ["img"])
            if rng.random() < 0.5:
                emit(Op("bn", (len(kinds) - 1,), name=fresh("bn")), ["img"])
            if rng.random() < 0.4:
                emit(Op("conv", (len(kinds) - 1,), name=fresh("conv")), ["img"])
            emit(Op("pool", (len(kinds) - 1,)), ["vec"])
            if "vec" in kinds[:-1]:
                emit(Op("add", (kinds.index("vec"), len(kinds) - 1)), ["vec"])

        shared: Instance | None = None
        if rng.random() < 0.5:
            what = rng.choice(["dense", "block", "coder"] if depth < 2 else ["dense", "coder"])
            sub = (
                self.graph(["vec"], rng.randint(1, 3), depth + 1, False, stateless=True)
                if what == "block"
                else None
            )
            if sub is not None and (len(sub.out) != 1):
                sub = dataclasses.replace(
                    sub, out=sub.out[:1], out_form="single", n_aux=0, out_kinds=sub.out_kinds[:1]
                )
            shared = Instance(fresh("shared") if what != "coder" else fresh("coder"), what, sub)
        used_shared = 0

        weights = {
            "dense": 5,
            "conv": 2,
            "bn": 1,
            "ln": 1,
            "ident": 2,
            "dropout": 1,
            "pair": 2,
            "merge": 2,
            "block": 2 if depth < 2 else 0,
            "shared": 4 if shared else 0,
            "add": 3,
            "mul": 1,
            "act": 3,
            "concat": 1,
            "pool": 1,
            "region": 1,
        }
        if self.extra:
            weights.update({"avg": 0 if stateless else 2, "aux": 2})
            weights["block"] = 3 if depth < 2 else 0
        for _ in range(n_ops):
            kind = rng.choices(list(weights), weights=list(weights.values()))[0]
            vec = self.pick(kinds, {"vec"})
            if kind == "dense":
                i = self.pick(kinds, {"vec", "wide"})
                emit(Op("dense", (i,), name=fresh("dense")), ["vec"])
            elif kind == "conv":
                i = self.pick(kinds, {"img", "img3"})
                if i is not None:
                    emit(Op("conv", (i,), name=fresh("conv")), ["img"])
            elif kind == "bn":
                i = self.pick(kinds, {"vec", "img"})
                emit(Op("bn", (i,), name=fresh("bn")), [kinds[i]])
            elif kind in ("ln", "dropout"):
                emit(Op(kind, (vec,), name=fresh(kind)), ["vec"])
            elif kind == "ident":
                i = self.pick(kinds, {"vec", "wide", "img"})
                emit(Op("ident", (i,), name=fresh("ident")), [kinds[i]])
            elif kind == "pair":
                emit(
                    Op("pair", (vec,), name=fresh("pair"), variant=int(rng.random() < 0.3)),
                    ["vec", "vec"],
                )
            elif kind == "merge":
                a, b = self.pick(kinds, {"vec", "wide"}), self.pick(kinds, {"vec", "wide"})
                if rng.random() < 0.85 and a == b:
                    b = self.pick(kinds, {"vec", "wide"})
                emit(Op("merge", (a, b), name=fresh("merge"), keyword=rng.random() < 0.4), ["vec"])
            elif kind == "block":
                n_in = 1 if rng.random() < (0.35 if self.extra else 0.6) else 2
                pack = "none"
                if self.extra and n_in == 2:
                    n_in = rng.choice([2, 2, 3])
                    pack = rng.choice(["none", "dict", "kwdict", "tuple"])
                ins = [vec] + [self.pick(kinds, {"vec"}) for _ in range(n_in - 1)]
                sub = self.graph(["vec"] * n_in, rng.randint(1, 4), depth + 1, False, stateless)
                sub = dataclasses.replace(sub, pack=pack)
                emit(Op("block", tuple(ins), name=fresh("block"), sub=sub), list(sub.out_kinds))
            elif kind == "avg":
                i = self.pick(kinds, {"vec", "img"})
                variant = int(rng.random() < 0.3)  # 1: eval mode (reads the running mean)
                emit(Op("avg", (i,), name=fresh("avg"), variant=variant), [kinds[i]])
            elif kind == "aux":
                emit(Op("aux", (vec,), name=fresh("aux")), ["vec", "aux"])
            elif kind == "shared" and shared is not None:
                used_shared += 1
                if shared.kind == "coder":
                    method = rng.choice(["encode", "decode", "__call__"])
                    emit(Op("method", (vec,), ref=shared.name, method=method), ["vec"])
                else:
                    emit(Op("shared", (vec,), ref=shared.name), ["vec"])
            elif kind == "add":
                i = self.pick(kinds, {"vec", "img"})
                j = self.rng.choice([n for n, k in enumerate(kinds) if k == kinds[i]])
                emit(Op("add", (i, j)), [kinds[i]])
            elif kind == "mul":
                j = self.rng.choice([n for n, k in enumerate(kinds) if k == "vec"])
                emit(Op("mul", (vec, j)), ["vec"])
            elif kind == "act":
                i = self.pick(kinds, {"vec", "wide", "img"})
                emit(Op("act", (i,), variant=rng.randrange(3)), [kinds[i]])
            elif kind == "concat":
                j = self.rng.choice([n for n, k in enumerate(kinds) if k == "vec"])
                emit(Op("concat", (vec, j)), ["wide"])
            elif kind == "pool":
                i = self.pick(kinds, {"img"})
                if i is not None:
                    emit(Op("pool", (i,)), ["vec"])
            elif kind == "region":
                j = self.rng.choice([n for n, k in enumerate(kinds) if k == "vec"])
                emit(Op("region", (vec, j), variant=rng.randrange(2)), ["vec", "vec"])
        if top and not any(op.name or op.ref for op in ops):  # at least one boundary
            emit(Op("dense", (self.pick(kinds, {"vec"}),), name=fresh("dense")), ["vec"])
        if shared is not None and used_shared:
            if used_shared == 1:  # a shared module is called at least twice
                ref = next(op for op in ops if op.ref == shared.name)
                emit(dataclasses.replace(ref, ins=(self.pick(kinds, {"vec"}),)), ["vec"])
            instances.append(shared)
        # Outputs: the last vector value, maybe with others.
        vecs = [i for i, k in enumerate(kinds) if k == "vec"]
        out = [vecs[-1]]
        n_out = rng.choice([1, 1, 2, 3] if top else [1, 1, 2])
        others = [i for i in range(len(kinds)) if i != vecs[-1] and (top or kinds[i] == "vec")]
        rng.shuffle(others)
        out += others[: n_out - 1]
        if top and rng.random() < 0.1:
            out.append(rng.choice(out))  # the same value twice in the output
        if len(out) == 1:
            form = "single" if (not top or rng.random() < 0.7) else rng.choice(["tuple", "dict"])
        else:
            form = "tuple" if not top else rng.choice(["tuple", "dict"])
        n_aux = 0
        auxs = [i for i, k in enumerate(kinds) if k == "aux"]
        if self.extra and auxs and rng.random() < 0.8:
            # The aux values of `(h, aux)` calls, collected: `return h, (aux1, aux2)`.
            chosen = sorted(rng.sample(auxs, rng.randint(1, min(3, len(auxs)))))
            out, form, n_aux = out + chosen, "aux", len(chosen)
        transform = "none"
        if not top and rng.random() < 0.25:
            # Under nn.remat/nn.jit the results must be computed inside (an input passed
            # straight through would be forwarded by JAX, a different DAG).
            transform = rng.choice(["remat", "jit"])
            for i in list(out):
                emit(Op("act", (i,), variant=0), [kinds[i]])
            out = list(range(len(kinds) - len(out), len(kinds)))
        return GraphSpec(
            self.d,
            len(in_kinds),
            tuple(ops),
            tuple(out),
            form,
            style,
            tuple(instances),
            transform,
            n_aux=n_aux,
            out_kinds=tuple(kinds[i] for i in out),
            tag=self.tag,
        )


@dataclasses.dataclass
class Generated:
    seed: int
    spec: GraphSpec
    model: nn.Module
    inputs: tuple[Any, ...]
    extra: bool = False

    @property
    def stateful(self) -> bool:
        """Whether running the model updates state (a running average in train mode): it
        is then applied, and sliced, with ``mutable=["batch_stats"]``."""

        def walk(spec: GraphSpec) -> bool:
            return any(
                (op.kind == "avg" and not op.variant) or (op.sub is not None and walk(op.sub))
                for op in spec.ops
            ) or any(i.sub is not None and walk(i.sub) for i in spec.instances)

        return walk(self.spec)


def generate(seed: int, extra: bool = False) -> Generated:
    rng = random.Random(seed)
    d = rng.randint(4, 8)
    in_kinds = rng.choice([["vec"], ["vec"], ["vec", "img3"], ["img3"]])
    spec = _Gen(rng, d, extra, (seed, extra)).graph(in_kinds, rng.randint(4, 10), 0, True)
    nrng = np.random.default_rng(seed)
    shapes = {"vec": (B, d), "img3": (B, HW, HW, IMG_IN_CHANNELS)}
    inputs = tuple(jnp.asarray(nrng.normal(size=shapes[k]), jnp.float32) for k in in_kinds)
    return Generated(seed, spec, block_module(spec), inputs, extra)


def describe(g: Generated) -> str:
    """The model as text, for failure messages and bug reports."""

    def graph(spec: GraphSpec, indent: str) -> list[str]:
        lines = [
            f"{indent}[{spec.style}, transform={spec.transform}, features={spec.features}, inputs v0..v{spec.n_in - 1}]"
        ]
        for inst in spec.instances:
            lines.append(f"{indent}instance {inst.name} = {inst.kind}")
            if inst.sub is not None:
                lines += graph(inst.sub, indent + "    ")
        n = spec.n_in
        for op in spec.ops:
            n_out = (
                len(op.sub.out)
                if op.kind == "block"
                else 2
                if op.kind in ("pair", "region", "aux")
                else 1
            )
            outs = ", ".join(f"v{n + i}" for i in range(n_out))
            args = ", ".join(f"v{i}" for i in op.ins)
            if op.kind == "merge" and op.keyword:
                args = f"v{op.ins[0]}, other=v{op.ins[1]}"
            if op.kind == "block" and op.sub.pack != "none":
                ctx = ", ".join(f"'skip{j or ''}': v{i}" for j, i in enumerate(op.ins[1:]))
                args = {
                    "dict": f"v{op.ins[0]}, {{{ctx}}}",
                    "kwdict": f"v{op.ins[0]}, ctx={{{ctx}}}",
                    "tuple": f"({args})",
                }[op.sub.pack]
            what = op.name or op.ref or ""
            extra = f".{op.method}" if op.kind == "method" else ""
            variant = f"/{op.variant}" if op.kind in ("act", "pair", "region", "avg") else ""
            lines.append(f"{indent}{outs} = {op.kind}{variant} {what}{extra}({args})")
            if op.sub is not None:
                lines += graph(op.sub, indent + "    ")
            n += n_out
        returned = ", ".join(f"v{i}" for i in spec.out)
        if spec.out_form == "aux":
            k = len(spec.out) - spec.n_aux
            main, aux = spec.out[:k], spec.out[k:]
            returned = f"({', '.join(f'v{i}' for i in main)}), ({', '.join(f'v{i}' for i in aux)},)"
        lines.append(f"{indent}return {spec.out_form} {returned}")
        return lines

    head = f"seed {g.seed}" + (" (extended)" if g.extra else "")
    return "\n".join([head] + graph(g.spec, "  "))


# --------------------------------------------------------------------------- the oracle


@dataclasses.dataclass
class Port:
    spec: str | None  # the name as given to jaxslice (None: the model's inputs/output)
    call: CallRec | None
    side: str  # "input" or "output"


@dataclasses.dataclass
class Oracle:
    g: Generated
    variables: Any
    rec: Recorder
    values: dict[int, Any]
    captured: dict[str, tuple[Any, ...]]
    model_out: Any
    names: list[str]  # boundary names, in call order
    by_name: dict[str, CallRec]
    new_state: Any = None  # stateful models: the batch_stats `model.apply` returned
    deferred: list[str] = dataclasses.field(default_factory=list)  # failures raised at the end

    @property
    def mode(self) -> dict[str, Any]:
        """Keyword arguments of every jaxslice call (as of every `model.apply`)."""
        return {"mutable": ["batch_stats"]} if self.g.stateful else {}

    # ---- ports

    def port(self, spec: str | None, default_side: str) -> Port:
        if spec is None:
            return Port(None, None, default_side)
        name, _, side = spec.partition(":")
        return Port(spec, self.by_name[name], side or default_side)

    def leaves(self, p: Port) -> list[int]:
        if p.call is None:
            if p.side == "input":
                return list(self.rec.model_inputs)
            return jax.tree_util.tree_leaves(self.rec.model_out)
        if p.side == "input":
            return jax.tree_util.tree_leaves(list(p.call.args) + list(p.call.kwargs.values()))
        return list(jax.tree_util.tree_leaves(p.call.out))

    def known(self, p: Port) -> bool:
        """Whether the port's values are known: inputs of calls inside nn.remat/nn.jit are
        not (outputs are, from capture_intermediates)."""
        return p.side == "output" or all(i in self.values for i in self.leaves(p))

    def value_of(self, p: Port) -> Any:
        """What a slice ending at `p` returns."""
        if p.call is None:
            return self.model_out
        if p.side == "output":
            if not all(i in self.values for i in self.leaves(p)):
                return self.captured[p.call.base][p.call.index]
            return jax.tree_util.tree_map(lambda i: self.values[i], p.call.out)
        # The call's arguments (each a value or a container of values), keyword arguments
        # last; a call with one argument: that argument.
        args = [self.tree(a) for a in list(p.call.args) + list(p.call.kwargs.values())]
        return args[0] if len(args) == 1 else tuple(args)

    def tree(self, ids: Any) -> Any:
        """A tree of value ids, as values."""
        return jax.tree_util.tree_map(lambda i: self.values[i], ids)

    def start_inputs(self, start: Any) -> tuple[list[Any], dict[str, Any]]:
        if start is None:
            return list(self.g.inputs), {}
        return self.inputs_for(
            [self.port(s, "input") for s in (start if isinstance(start, list) else [start])]
        )

    def inputs_for(self, ports: list[Port]) -> tuple[list[Any], dict[str, Any]]:
        """What a slice starting at `ports` is called with."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in ports:
            if p.call is None:
                args += list(self.g.inputs)
            elif p.side == "output":
                args.append(self.value_of(p))
            else:
                args += [self.tree(a) for a in p.call.args]
                kwargs.update({k: self.tree(a) for k, a in p.call.kwargs.items()})
        return args, kwargs

    def ends_value(self, end: Any) -> Any:
        if isinstance(end, list):
            return tuple(self.value_of(self.port(e, "output")) for e in end)
        if isinstance(end, dict):
            return {k: self.value_of(self.port(e, "output")) for k, e in end.items()}
        return self.value_of(self.port(end, "output"))

    # ---- validity, from the generator's DAG only

    def ancestors(self, ids: list[int]) -> set[int]:
        return ancestors(self.rec.parents, ids)

    def classify(self, start: Any, end: Any) -> str:
        """What the DAG says about a slice from `start` to `end`.

        "valid"; "missing": an end needs a model input through a path that avoids every
        start value; "disconnected": an end does not depend on any start value (or a
        start is unused as well); "unused": the ends are fine but a start port is not
        needed (an error or the right value will do); "clash": otherwise valid or
        unused, but two starts take keyword arguments of the same name or the starts
        give the same value twice, which the slice cannot tell apart (an error or the
        right value will do); "both": invalid for several reasons (any error will do).
        """
        if start is None:
            return "valid"
        starts = [self.port(s, "input") for s in (start if isinstance(start, list) else [start])]
        ends = [self.port(e, "output") for e in flat_ends(end)]
        given = {v for p in starts for v in self.leaves(p)}
        used: set[int] = set()
        missing = disconnected = False
        for e in ends:
            hit: set[int] = set()
            seen: set[int] = set()
            stack = self.leaves(e)
            while stack:
                v = stack.pop()
                if v in seen:
                    continue
                seen.add(v)
                if v in given:
                    hit.add(v)
                elif not self.rec.parents[v]:
                    missing = True  # a model input that is not given
                else:
                    stack.extend(self.rec.parents[v])
            disconnected |= not hit
            used |= hit
        unused = any(not (set(self.leaves(p)) & used) for p in starts)
        keywords = [
            k for p in starts if p.call is not None and p.side == "input" for k in p.call.kwargs
        ]
        ids = [v for p in starts for v in self.leaves(p)]
        clash = len(keywords) != len(set(keywords)) or len(ids) != len(set(ids))
        return pair_verdict(missing, disconnected, unused, clash)

    def _closure(self, start: Any, end: Any) -> tuple[set[int], set[int]]:
        """``(values the slice computes, values it is given)``."""
        if start is None:
            given = set(self.rec.model_inputs)
        else:
            given = {
                v
                for s in (start if isinstance(start, list) else [start])
                for v in self.leaves(self.port(s, "input"))
            }
        seen: set[int] = set()
        stack = [v for e in flat_ends(end) for v in self.leaves(self.port(e, "output"))]
        while stack:
            v = stack.pop()
            if v in seen or v in given:
                continue
            seen.add(v)
            stack.extend(self.rec.parents[v])
        return seen, given

    def expected_variables(self, start: Any, end: Any) -> set[tuple[str, ...]]:
        """Leaf paths a slice holds: every variable of the modules it needs, and the
        statistics of modules that update them inside a call the slice runs whole (a
        block's call runs all of it, also a batch norm whose result nothing reads)."""
        seen, given = self._closure(start, end)
        needed = {self.rec.producer[v] for v in seen if v in self.rec.producer}
        updating = (self._run_inside(seen | given) & self.rec.updating) - needed
        stats = expected_variable_paths(self.variables, updating)
        return expected_variable_paths(self.variables, needed) | {
            p for p in stats if p[0] == "batch_stats"
        }

    def updating_modules(self, start: Any, end: Any) -> set[str]:
        """The modules that update state (train mode) among those the slice runs."""
        seen, given = self._closure(start, end)
        needed = {self.rec.producer[v] for v in seen if v in self.rec.producer}
        return (needed | self._run_inside(seen | given)) & self.rec.updating

    def _run_inside(self, within: set[int]) -> set[str]:
        """Modules called inside a call whose arguments and results are all `within`."""
        whole = {id(c) for c in self.rec.calls if _runs_whole(c, within)}
        found = set()
        for c in self.rec.calls:
            outer = c.parent
            while outer is not None and id(outer) not in whole:
                outer = outer.parent
            if outer is not None:
                found.add(c.base.split(".")[0])
        return found

    # ---- running slices

    def slice(self, start: Any, end: Any) -> Any:
        return js.slice(
            self.g.model, self.variables, *self.g.inputs, start=start, end=end, **self.mode
        )

    def call(self, sub: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls a slice. A slice of a stateful model that holds state is applied with
        ``mutable=["batch_stats"]``, and its updates must be the new state `model.apply`
        returned for the slice's own modules. (A slice without state is called without
        `mutable`: jaxslice refuses one there, where linen's `apply` returns ``(out, {})``;
        `check_state` holds the whole model to linen's convention.)"""
        if not self.g.stateful or "batch_stats" not in (sub.variables or {}):
            return sub(*args, **kwargs)
        out, updates = sub.apply(sub.variables, *args, mutable=["batch_stats"], **kwargs)
        new = leaf_paths({"batch_stats": self.new_state})
        want = {p: new[p] for p in leaf_paths(sub.variables) if p[0] == "batch_stats"}
        got = leaf_paths(updates)
        assert set(got) == set(want), f"updates {sorted(got)} != {sorted(want)}"
        assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
        return out

    def expect_slice(self, start: Any, end: Any, stats: Stats) -> Any:
        sub = self.slice(start, end)
        args, kwargs = self.start_inputs(start)
        got = self.call(sub, *args, **kwargs)
        stats.slices += 1
        assert_trees_all_close(got, self.ends_value(end), atol=ATOL, rtol=RTOL)
        got, want = set(leaf_paths(sub.variables)), self.expected_variables(start, end)
        if got != want:  # reported after the model's other checks have run
            self.deferred.append(
                f"start={start!r} end={end!r}: sub.variables has extra {sorted(got - want)} "
                f"and lacks {sorted(want - got)}"
            )
        else:
            original = leaf_paths(self.variables)
            for path, leaf in leaf_paths(sub.variables).items():
                assert leaf is original[path], f"{path} is a copy, not the original leaf"
        return sub


def _runs_whole(call: CallRec, within: set[int]) -> bool:
    outs = [i for i in jax.tree_util.tree_leaves(call.out) if i is not None]
    ins = [i for i in jax.tree_util.tree_leaves((call.args, call.kwargs)) if i is not None]
    return bool(outs) and set(outs) <= within and set(ins) <= within


def build_oracle(g: Generated) -> Oracle:
    variables = random_variables(g.model, *g.inputs, seed=g.seed)
    rec = Recorder()
    mutable = ["intermediates"] + (["batch_stats"] if g.stateful else [])

    def run(variables, *xs):
        with recording(rec):
            out, state = g.model.apply(
                variables, *xs, capture_intermediates=lambda m, n: True, mutable=mutable
            )
        return out, state["intermediates"], state.get("batch_stats"), rec.values

    model_out, inter, new_state, values = jax.jit(run)(variables, *g.inputs)
    captured: dict[str, tuple[Any, ...]] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        for key, value in node.items():
            if isinstance(value, tuple):
                if path and key != "setup":  # not the model's own outputs, nor setup
                    base = "/".join(path)
                    captured[base if key == "__call__" else f"{base}.{key}"] = value
            else:
                walk(value, path + (key,))

    walk(inter, ())
    counts = rec.counts
    names, by_name = [], {}
    for c in rec.calls:
        name = c.base if counts[c.base] == 1 else f"{c.base}@{c.index}"
        names.append(name)
        by_name[name] = c
    return Oracle(g, variables, rec, values, captured, model_out, names, by_name, new_state)


# --------------------------------------------------------------------------- checks


@dataclasses.dataclass
class Stats:
    models: int = 0
    slices: int = 0  # slices built and run against the oracle
    errors: int = 0  # invalid slices checked to raise
    maybe: int = 0  # "unused"/"clash" pairs: either an error or the right value


@dataclasses.dataclass
class Budget:
    single_ends: int = 3
    pairs: int = 6
    compositions: int = 2
    invalid: int = 4
    new_batch: int = 1  # valid pairs also called with a doubled batch


def check_recording(o: Oracle) -> None:
    """The generator's own recording agrees with Flax (a check of the oracle itself)."""
    for c in o.rec.calls:
        if all(i in o.values for i in jax.tree_util.tree_leaves(c.out)):
            recorded = jax.tree_util.tree_map(lambda i: o.values[i], c.out)
            assert_trees_all_close(o.captured[c.base][c.index], recorded, atol=0, rtol=0)
    assert set(o.captured) == {c.base for c in o.rec.calls}
    assert_trees_all_close(
        o.model_out, jax.tree_util.tree_map(lambda i: o.values[i], o.rec.model_out), atol=0, rtol=0
    )


def check_boundaries(o: Oracle) -> None:
    bs = js.boundaries(o.g.model, o.variables, *o.g.inputs, **o.mode)
    assert [b.name for b in bs] == o.names
    for b in bs:
        c = o.by_name[b.name]
        assert b.num_calls == o.rec.counts[c.base]
        assert b.call_index == c.index
        assert b.loop is None


def check_all_boundaries(o: Oracle, rng: random.Random, budget: Budget, stats: Stats) -> None:
    """Every boundary's output and input from the model's inputs, all at once, plus a few
    one-end slices, against ``capture_intermediates`` and the recording."""
    outs = o.call(o.slice(None, {n: n for n in o.names}), *o.g.inputs)
    stats.slices += 1
    expected = {n: o.captured[o.by_name[n].base][o.by_name[n].index] for n in o.names}
    assert_trees_all_close(outs, expected, atol=ATOL, rtol=RTOL)
    ins = {f"{n}:input": f"{n}:input" for n in o.names if o.known(o.port(f"{n}:input", "input"))}
    outs = o.call(o.slice(None, ins), *o.g.inputs)
    stats.slices += 1
    assert_trees_all_close(outs, o.ends_value(ins), atol=ATOL, rtol=RTOL)
    # The model's whole output, and a few single ends.
    o.expect_slice(None, None, stats)
    for name in rng.sample(o.names, min(budget.single_ends, len(o.names))):
        end = rng.choice([name, f"{name}:output", f"{name}:input"])
        if o.known(o.port(end, "output")):
            o.expect_slice(None, end, stats)


def _port_specs(o: Oracle) -> tuple[list[Any], list[Any]]:
    starts: list[Any] = [None]
    ends: list[Any] = [None]
    for n in o.names:
        if o.known(o.port(n, "input")):
            starts += [n, f"{n}:input"]
            ends += [f"{n}:input"]
        starts += [f"{n}:output"]
        ends += [n, f"{n}:output"]
    return starts, ends


def _random_end(o: Oracle, rng: random.Random, ends: list[Any]) -> Any:
    r = rng.random()
    if r < 0.7:
        return rng.choice(ends)
    named = [e for e in ends if e is not None]
    picks = rng.sample(named, min(len(named), rng.randint(1, 3)))
    if r < 0.85:
        return picks
    return {f"k{i}": p for i, p in enumerate(picks)}


def _random_start(o: Oracle, rng: random.Random, end: Any, starts: list[Any], related: bool) -> Any:
    """A start (or list of starts); `related`: only ports the end depends on."""
    if related:
        anc = o.ancestors([v for e in flat_ends(end) for v in o.leaves(o.port(e, "output"))])
        pool = [s for s in starts if set(o.leaves(o.port(s, "input"))) & anc]
    else:
        pool = starts
    if not pool:
        return None
    k = 1 if rng.random() < 0.6 else rng.randint(2, 3)
    picks = [rng.choice(pool) for _ in range(k)]
    return picks[0] if k == 1 else picks


def sample_pairs(
    o: Oracle, rng: random.Random, want: dict[str, int], tries: int = 400
) -> dict[str, list[Any]]:
    """Random (start, end) pairs sorted by what the DAG says about them."""
    starts, ends = _port_specs(o)
    found: dict[str, list[Any]] = {
        k: [] for k in ("valid", "missing", "disconnected", "both", "unused", "clash")
    }
    seen = set()
    for _ in range(tries):
        if all(len(found[k]) >= n for k, n in want.items()):
            break
        end = _random_end(o, rng, ends)
        start = _random_start(o, rng, end, starts, related=rng.random() < 0.8)
        if start is None:
            continue
        key = repr((start, end))
        if key in seen:
            continue
        seen.add(key)
        kind = o.classify(start, end)
        if len(found[kind]) < want.get(kind, 0):
            found[kind].append((start, end))
    return found


def check_random_pairs(o: Oracle, rng: random.Random, budget: Budget, stats: Stats) -> None:
    """Valid pairs reproduce the recording; invalid ones raise; "unused" ones do either."""
    found = sample_pairs(
        o,
        rng,
        {
            "valid": budget.pairs,
            "missing": budget.invalid,
            "disconnected": budget.invalid,
            "both": 1,
            "unused": 1,
            "clash": 1,
        },
    )
    for i, (start, end) in enumerate(found["valid"]):
        try:
            sub = o.expect_slice(start, end, stats)
            if i < budget.new_batch:
                check_new_batch(o, sub, start, end, stats)
        except Exception as e:
            raise AssertionError(f"valid slice start={start!r} end={end!r} failed: {e!r}") from e
    for kind in ("missing", "disconnected", "both"):
        for start, end in found[kind]:
            check_invalid(o, start, end, kind, stats)
    for start, end in found["unused"] + found["clash"]:
        try:
            o.expect_slice(start, end, stats)
        except js.SliceError:
            pass
        stats.maybe += 1


EXPECTED_ERROR = {
    "missing": js.MissingInputError,
    "disconnected": js.DisconnectedError,
    "both": js.SliceError,
}


def check_new_batch(o: Oracle, sub: Any, start: Any, end: Any, stats: Stats) -> None:
    """A slice takes a new batch size without re-slicing. Every generated model works per
    example, so inputs ``[x; reversed x]`` give outputs ``[y; reversed y]``."""
    args, kwargs = o.start_inputs(start)
    double = lambda t: jax.tree_util.tree_map(lambda a: np.concatenate([a, a[::-1]]), t)  # noqa: E731
    got = o.call(sub, *double(args), **double(kwargs))
    stats.slices += 1
    assert_trees_all_close(got, double(o.ends_value(end)), atol=ATOL, rtol=RTOL)


def check_invalid(o: Oracle, start: Any, end: Any, kind: str, stats: Stats) -> None:
    try:
        sub = o.slice(start, end)
    except js.SliceError as e:
        stats.errors += 1
        assert isinstance(e, EXPECTED_ERROR[kind]), (
            f"start={start!r} end={end!r} ({kind}) raised {type(e).__name__}: {e}"
        )
        return
    args, kwargs = o.inputs_for(
        [o.port(s, "input") for s in (start if isinstance(start, list) else [start])]
    )
    try:
        got = o.call(sub, *args, **kwargs)
    except js.SliceError:
        got = "<raised only when called>"
    raise AssertionError(
        f"invalid slice ({kind}) start={start!r} end={end!r} returned instead of raising; "
        f"got {jax.tree_util.tree_map(np.asarray, got)!r}, expected {o.ends_value(end)!r}"
    )


def check_composition(o: Oracle, rng: random.Random, budget: Budget, stats: Stats) -> None:
    """slice(a, b) ∘ slice(None, a) == slice(None, b), a before b, cut at a's input or output."""
    _, ends = _port_specs(o)
    done = 0
    for _ in range(50):
        if done >= budget.compositions:
            return
        b = rng.choice(ends)
        anc = o.ancestors([v for v in o.leaves(o.port(b, "output"))])
        cands = []
        for n in o.names:
            c = o.by_name[n]
            for side in ("input", "output"):
                p = Port(n, c, side)
                if (
                    o.known(p)
                    and set(o.leaves(p)) & anc
                    and o.classify(n if side == "input" else f"{n}:output", b) == "valid"
                ):
                    cands.append((n, side))
        if not cands:
            continue
        a, side = rng.choice(cands)
        if side == "input":
            first = o.slice(None, f"{a}:input")
            second = o.slice(a, b)
            mid = o.call(first, *o.g.inputs)
            c = o.by_name[a]
            n_pos = len(c.args)
            flat = list(mid) if len(c.args) + len(c.kwargs) > 1 else [mid]
            args, kwargs = flat[:n_pos], dict(zip(c.kwargs, flat[n_pos:], strict=True))
        else:
            first = o.slice(None, a)
            second = o.slice(f"{a}:output", b)
            args, kwargs = [o.call(first, *o.g.inputs)], {}
        whole = o.slice(None, b)
        composed = o.call(second, *args, **kwargs)
        direct = o.call(whole, *o.g.inputs)
        stats.slices += 3
        assert_trees_all_close(composed, direct, atol=ATOL, rtol=RTOL)
        assert_trees_all_close(direct, o.ends_value(b), atol=ATOL, rtol=RTOL)
        done += 1


def check_reversed(o: Oracle, stats: Stats) -> None:
    """The last call's input to the first call's output, and the model's output from the
    last call: whatever the DAG says is invalid must raise."""
    for start, end in (
        (o.names[-1], o.names[0]),
        (o.names[-1], None),
        (f"{o.names[-1]}:output", None),
    ):
        if not o.known(o.port(start, "input")):
            continue
        kind = o.classify(start, end)
        if kind in EXPECTED_ERROR:
            check_invalid(o, start, end, kind, stats)


def check_state(o: Oracle, stats: Stats) -> None:
    """A stateful model is traced with exactly the `mutable` asked for: without it, a
    slice of the whole model whose output needs a state update fails as `model.apply`
    does (a `js.SliceError`, when slicing or when called), and with ``mutable=True``
    (params mutable too) the model takes its no-update branch. (A running average whose
    result the output does not need is not part of the slice: it is not computed.)"""
    if not o.g.stateful:
        return
    with pytest.raises(flax.errors.ModifyScopeVariableError):
        o.g.model.apply(o.variables, *o.g.inputs)  # the oracle: linen raises
    updating = o.updating_modules(None, None)
    try:
        got = js.slice(o.g.model, o.variables, *o.g.inputs)(*o.g.inputs)
    except js.SliceError:
        assert updating, "raised, but the slice updates no state"
    else:
        if updating:
            raise AssertionError(
                f"a slice updating {sorted(updating)} without "
                "mutable=['batch_stats'] returned instead of raising as model.apply does; "
                f"got {jax.tree_util.tree_map(np.asarray, got)!r}"
            )
        assert_trees_all_close(got, o.model_out, atol=ATOL, rtol=RTOL)
    want, want_vars = o.g.model.apply(o.variables, *o.g.inputs, mutable=True)
    sub = js.slice(o.g.model, o.variables, *o.g.inputs, mutable=True)
    expected = o.expected_variables(None, None)
    if not expected:
        # A slice that holds no state at all: asking for its state is a clear error
        # (tests/slicing/test_trainable.py), where linen would return an empty dict.
        with pytest.raises(js.SliceError, match="no state"):
            sub.apply(sub.variables, *o.g.inputs, mutable=True)
        return
    got, got_vars = sub.apply(sub.variables, *o.g.inputs, mutable=True)
    stats.slices += 1
    assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
    # All the slice's own variables come back (unchanged: nothing updates with params
    # mutable), as `model.apply` returns all of the model's.
    want_vars = leaf_paths(want_vars)
    got_vars = leaf_paths(got_vars)
    assert set(got_vars) == expected
    assert_trees_all_close(got_vars, {p: want_vars[p] for p in got_vars}, atol=0, rtol=0)


THREADS = 4


def check_threads(o: Oracle, rng: random.Random, n_pairs: int, stats: Stats) -> None:
    """The model listed, its intermediates taken, and random valid slices built and
    called from THREADS threads at once (jaxslice's caches emptied first, so they trace
    and compile concurrently) give bit-identical results to one thread, which match the
    oracle."""
    pairs = [(None, None)] + sample_pairs(o, rng, {"valid": n_pairs})["valid"]
    target = (o.g.model, o.variables, *o.g.inputs)

    def listing() -> list[Any]:
        return [dataclasses.astuple(b) for b in js.boundaries(*target, **o.mode)]

    def features() -> Any:
        return jax.tree_util.tree_map(np.asarray, js.intermediates(*target, **o.mode))

    def job(k: int) -> Any:
        start, end = pairs[k]
        args, kwargs = o.start_inputs(start)
        return jax.tree_util.tree_map(np.asarray, o.call(o.slice(start, end), *args, **kwargs))

    single = [job(k) for k in range(len(pairs))]
    for (_, end), got in zip(pairs, single, strict=True):
        assert_trees_all_close(got, o.ends_value(end), atol=ATOL, rtol=RTOL)
    listed, feats = listing(), features()
    captured = {n: o.captured[o.by_name[n].base][o.by_name[n].index] for n in o.names}
    assert_trees_all_close(feats[0] if o.g.stateful else feats, captured, atol=ATOL, rtol=RTOL)
    js.clear_caches()
    barrier = threading.Barrier(THREADS)

    def worker(i: int) -> tuple[dict[int, Any], list[Any], Any]:
        barrier.wait(timeout=120)
        # Each thread builds two of the slices: every slice is built by two threads at once.
        outs = {k: job(k) for k in ((i + j) % len(pairs) for j in range(2))}
        return outs, listing(), features()

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(worker, i) for i in range(THREADS)]
        results = [f.result(timeout=300) for f in futures]
    for i, (outs, got_listed, got_feats) in enumerate(results):
        assert got_listed == listed, f"thread {i}: js.boundaries differs"
        assert_trees_equal(got_feats, feats)
        for k, got in outs.items():
            try:
                assert_trees_equal(got, single[k])
            except AssertionError as e:
                start, end = pairs[k]
                raise AssertionError(f"thread {i}, start={start!r} end={end!r}: {e}") from e
            stats.slices += 1


def check_model(seed: int, budget: Budget, stats: Stats, extra: bool = False) -> Oracle:
    g = generate(seed, extra)
    o = build_oracle(g)
    rng = random.Random(seed * 7919 + 1)
    check_recording(o)
    check_boundaries(o)
    check_all_boundaries(o, rng, budget, stats)
    check_random_pairs(o, rng, budget, stats)
    check_composition(o, rng, budget, stats)
    check_reversed(o, stats)
    check_state(o, stats)
    if o.deferred:
        raise AssertionError(
            f"{len(o.deferred)} slice(s) own the wrong variables:\n" + "\n".join(o.deferred[:5])
        )
    stats.models += 1
    return o


def _explain(seed: int, error: BaseException, extra: bool = False) -> str:
    return f"{describe(generate(seed, extra))}\n{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- tests

# Seeds 12, 100, 141 and 161 together cover every feature of the generator (see
# `test_default_seeds_cover_every_feature`); 0, 1, 2 and 24 are small plain models.
SMALL_SEEDS = [0, 1, 2, 12, 24, 100, 141, 161]


# Extended models (`generate(seed, extra=True)`): 1 and 402 together cover every extended
# feature (see `test_default_seeds_cover_every_feature`).
EXTRA_SEEDS = [1, 402]
# Models sliced from several threads at once: 377 (extended) has state, container
# arguments and nested aux outputs.
THREAD_SEEDS = [(377, True)]


@pytest.mark.parametrize("seed", SMALL_SEEDS)
def test_fuzz_model(seed):
    stats = Stats()
    try:
        check_model(seed, Budget(), stats)
    except Exception as e:
        raise AssertionError(_explain(seed, e)) from e
    assert stats.models == 1 and stats.slices > 0


@pytest.mark.parametrize("seed", EXTRA_SEEDS)
def test_fuzz_extended_model(seed):
    """Running averages updated under `is_mutable_collection` (against `model.apply(...,
    mutable=["batch_stats"])`), `(h, aux)` modules with the aux values collected into a
    tuple output, and blocks called with containers of earlier activations."""
    stats = Stats()
    try:
        check_model(seed, Budget(), stats, extra=True)
    except Exception as e:
        raise AssertionError(_explain(seed, e, extra=True)) from e
    assert stats.models == 1 and stats.slices > 0


class _Config:
    """A mutable setting the wrapper reads, hashed by identity as config objects are."""

    def __init__(self, scale: float):
        self.scale = scale


class _JittedWrapper(nn.Module):
    """A generated model called from a method jitted with a static ``self`` (as the
    gemma library writes its models), scaled by a setting read from a config object."""

    net: nn.Module
    config: _Config

    @functools.partial(nn.jit, static_argnames=("self",))
    def __call__(self, *inputs):
        return jax.tree_util.tree_map(lambda v: v * self.config.scale, self.net(*inputs))


# Models whose outputs are arrays or tuples (a nested generated block returns no dict).
@pytest.mark.parametrize("seed", [0, 12, 24])
def test_fuzz_jitted_wrapper_traced_before_and_changed_between_slices(seed):
    """Every boundary of a generated model inside a jitted wrapper that JAX traced,
    compiled and differentiated before jaxslice saw it equals Flax's recorded value; after
    the wrapper's config changes, a new slice computes what the wrapper's `apply` does."""
    g = generate(seed)
    o = build_oracle(g)
    config = _Config(1.0)
    wrapper = _JittedWrapper(g.model, config)
    variables = {col: {"net": tree} for col, tree in o.variables.items()}
    apply = functools.partial(wrapper.apply, **o.mode)
    jax.make_jaxpr(apply)(variables, *g.inputs)
    jax.jit(apply)(variables, *g.inputs)
    jax.grad(lambda v: sum(jnp.sum(x) for x in jax.tree.leaves(apply(v, *g.inputs))))(variables)
    names = [f"net/{n}" for n in o.names]
    got = js.intermediates(wrapper, variables, *g.inputs, names=names, **o.mode)
    want = {f"net/{n}": o.captured[o.by_name[n].base][o.by_name[n].index] for n in o.names}
    assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
    config.scale = -1.5
    sub = js.slice(wrapper, variables, *g.inputs, **o.mode)
    assert_trees_all_close(sub(*g.inputs), apply(variables, *g.inputs), atol=ATOL, rtol=RTOL)


class _ArrayFields(nn.Module):
    """A generated model between array fields, which its trace fixes as constants: each
    input scaled by an array of `scales` (over its last axis), every output shifted by
    `shift`, twice as much in train mode (a Python branch on the mode keyword)."""

    net: nn.Module
    scales: tuple[Any, ...]
    shift: Any

    @nn.compact
    def __call__(self, *inputs, train=False):
        xs = [x * jnp.asarray(s) for x, s in zip(inputs, self.scales, strict=True)]
        shift = jnp.asarray(self.shift) * (2.0 if train else 1.0)
        return jax.tree_util.tree_map(lambda o: o + shift, self.net(*xs))


_TAGS = itertools.count()


def _retagged(spec: GraphSpec, tag: Any) -> GraphSpec:
    """`spec` with every (nested) block spec under a new tag."""
    ops = tuple(
        op if op.sub is None else dataclasses.replace(op, sub=_retagged(op.sub, tag))
        for op in spec.ops
    )
    instances = tuple(
        i if i.sub is None else dataclasses.replace(i, sub=_retagged(i.sub, tag))
        for i in spec.instances
    )
    return dataclasses.replace(spec, ops=ops, instances=instances, tag=tag)


def array_fields(g: Generated, net: nn.Module, rng: np.random.Generator, array: Any) -> Any:
    """`net` (`g`'s model, see `wrapped_net`) wrapped with random array fields, NumPy or
    JAX (`array`)."""
    scales = tuple(array(rng.uniform(0.5, 1.5, x.shape[-1]).astype(np.float32)) for x in g.inputs)
    return _ArrayFields(net, scales, array(np.float32(rng.normal())))


def wrapped_net(g: Generated) -> nn.Module:
    """`g`'s model under a tag of its own: an nn.jit block that jaxslice traced before at
    the top level would be replayed with the names of that earlier trace, not `net/...`."""
    return block_module(_retagged(g.spec, (g.seed, g.extra, "wrapped", next(_TAGS))))


def check_array_fields(g: Generated, wrapper: _ArrayFields, flag: Any, stats: Stats) -> None:
    """A wrapped generated model against Flax: every boundary from the wrapper's inputs,
    the whole model and random valid slices inside it, each applied in both modes with
    the mode given as a one-element array (`flag`). The oracle is the generator's
    recording of the model run on the scaled inputs, and the wrapper's own `apply`."""
    scaled = tuple(x * np.asarray(s) for x, s in zip(g.inputs, wrapper.scales, strict=True))
    # The recording runs a model of its own (a new tag), so that no nn.jit block replays
    # a trace of the same model recorded before instead of running its Python body.
    spec = _retagged(g.spec, (g.seed, g.extra, "array fields", next(_TAGS)))
    o = build_oracle(dataclasses.replace(g, spec=spec, model=block_module(spec), inputs=scaled))
    variables = {col: {"net": tree} for col, tree in o.variables.items()}
    target = (wrapper, variables, *g.inputs)
    ends = {n: f"net/{n}" for n in o.names}
    want = {n: o.captured[o.by_name[n].base][o.by_name[n].index] for n in o.names}
    assert_trees_all_close(js.slice(*target, end=ends)(*g.inputs), want, atol=ATOL, rtol=RTOL)
    sub = js.slice(*target)
    for train in (False, True):
        got = sub.apply(sub.variables, *g.inputs, train=flag(train))
        want = wrapper.apply(variables, *g.inputs, train=train)
        assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
    stats.slices += 2
    found = sample_pairs(o, random.Random(g.seed), {"valid": 3})["valid"]
    for start, end in found:
        if isinstance(start, list) and None in start:
            continue  # the wrapper's inputs are not the model's: checked from None above
        sub = js.slice(*target, start=prefixed(start, "net/"), end=prefixed(end, "net/"))
        args, kwargs = o.start_inputs(start) if start is not None else (list(g.inputs), {})
        for train in (False, True):
            want = o.ends_value(end)
            if end is None:
                shift = np.asarray(wrapper.shift) * (2.0 if train else 1.0)
                want = jax.tree_util.tree_map(lambda v, shift=shift: v + shift, want)
            got = sub.apply(sub.variables, *args, train=flag(train), **kwargs)
            assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
            stats.slices += 1


# Models whose outputs are arrays or tuples (a nested generated block returns no dict).
@pytest.mark.parametrize(
    ("seed", "array", "flag"),
    [(0, np.asarray, jnp.asarray), (12, jnp.asarray, np.asarray), (24, np.asarray, np.bool_)],
    ids=["numpy-fields", "jax-fields", "numpy-fields-np-bool"],
)
def test_fuzz_array_fields_and_array_modes(seed, array, flag):
    """Two wrappers of one generated model that differ only in the values of their array
    fields, sliced one after the other, each compute with their own arrays; a NumPy field
    changed in place is seen by a new slice; modes given as arrays mean their values."""
    g = generate(seed)
    rng = np.random.default_rng(seed)
    stats = Stats()
    try:
        net = wrapped_net(g)  # one model: the wrappers differ only in their arrays
        for wrapper in (array_fields(g, net, rng, array), array_fields(g, net, rng, array)):
            check_array_fields(g, wrapper, flag, stats)
        if array is np.asarray:  # changed in place: the same object, other values
            wrapper.scales[0][...] *= -1.5
            variables = random_variables(net, *g.inputs, seed=g.seed)
            variables = {col: {"net": tree} for col, tree in variables.items()}
            got = js.slice(wrapper, variables, *g.inputs)(*g.inputs)
            want = wrapper.apply(variables, *g.inputs)
            assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
    except Exception as e:
        raise AssertionError(_explain(seed, e)) from e
    assert stats.slices > 0


@pytest.mark.parametrize(("seed", "extra"), THREAD_SEEDS)
def test_fuzz_threads(seed, extra):
    """A generated model sliced, listed and called from several threads at once."""
    stats = Stats()
    try:
        o = build_oracle(generate(seed, extra))
        check_threads(o, random.Random(seed), 3, stats)
    except Exception as e:
        raise AssertionError(_explain(seed, e, extra)) from e
    assert stats.slices > 0


def features(g: Generated) -> set[str]:
    """What a generated model exercises."""
    out = {"inputs:" + "+".join("image" if x.ndim == 4 else "vector" for x in g.inputs)}
    if g.stateful:
        out.add("stateful model")

    def walk(spec: GraphSpec, depth: int) -> None:
        out.update({spec.style, "returns:" + spec.out_form, f"depth:{depth}"})
        if spec.transform != "none":
            out.add("transform:" + spec.transform)
            if any(op.kind == "avg" for op in spec.ops):
                out.add("avg under transform")
        if depth and spec.out_form == "aux":
            out.add("block returns:aux")
        if spec.pack != "none":
            out.add(f"pack:{spec.pack}")
            if spec.n_in > 2:
                out.add("pack:3in")
        if len(set(spec.out)) < len(spec.out):
            out.add("returns a value twice")
        for op in spec.ops:
            out.add(op.kind)
            if op.keyword:
                out.add("keyword argument")
            if op.kind == "method":
                out.add("method:" + op.method)
            if op.kind == "pair":
                out.add("pair:passthrough" if op.variant else "pair:computed")
            if op.kind == "block":
                out.add(f"block:{len(op.ins)}in:{len(op.sub.out)}out")
            if op.kind == "region":
                out.add("region:" + ("checkpoint", "jit")[op.variant])
            if op.kind == "avg":
                out.add("avg:eval" if op.variant else "avg:train")
            if op.sub is not None:
                walk(op.sub, depth + 1)
        for inst in spec.instances:
            out.add("shared instance:" + inst.kind)
            if inst.sub is not None:
                walk(inst.sub, depth + 1)

    walk(g.spec, 0)
    return out


ALL_FEATURES = {
    "inputs:vector",
    "inputs:image",
    "inputs:vector+image",
    "compact",
    "setup",
    "returns:single",
    "returns:tuple",
    "returns:dict",
    "depth:1",
    "depth:2",
    "dense",
    "conv",
    "bn",
    "ln",
    "ident",
    "dropout",
    "pair",
    "merge",
    "block",
    "shared",
    "method",
    "add",
    "mul",
    "act",
    "concat",
    "pool",
    "keyword argument",
    "method:__call__",
    "method:encode",
    "method:decode",
    "pair:passthrough",
    "pair:computed",
    "block:1in:1out",
    "block:2in:1out",
    "block:1in:2out",
    "block:2in:2out",
    "shared instance:dense",
    "shared instance:block",
    "shared instance:coder",
    "transform:remat",
    "transform:jit",
    "region:checkpoint",
    "region:jit",
    "returns a value twice",
}


EXTRA_FEATURES = {
    "avg",
    "avg:train",
    "avg:eval",
    "avg under transform",
    "stateful model",
    "aux",
    "returns:aux",
    "block returns:aux",
    "pack:dict",
    "pack:kwdict",
    "pack:tuple",
    "pack:3in",
}


def test_default_seeds_cover_every_feature():
    """The CI sample is not a narrow one: its models exercise every op kind, both module
    styles, nesting, sharing, methods, keyword arguments and every output form; the
    extended ones state, aux outputs and container arguments."""
    covered = set().union(*(features(generate(s)) for s in SMALL_SEEDS))
    assert ALL_FEATURES <= covered, ALL_FEATURES - covered
    covered = set().union(*(features(generate(s, extra=True)) for s in EXTRA_SEEDS))
    assert EXTRA_FEATURES <= covered, EXTRA_FEATURES - covered
    assert not EXTRA_FEATURES & set().union(*(features(generate(s)) for s in range(50)))


def test_generator_is_deterministic():
    for extra in (False, True):
        a, b = generate(12345, extra), generate(12345, extra)
        assert a.spec == b.spec
        assert_trees_all_close(a.inputs, b.inputs, atol=0, rtol=0)


@pytest.mark.fuzz_large
def test_fuzz_large(request):
    seeds = large_fuzz_seeds(request.config, 300)
    # Each seed as a plain model, an extended one, or both (JAXSLICE_FUZZ_EXTRA=0, 1, both).
    which = os.environ.get("JAXSLICE_FUZZ_EXTRA", "both")
    kinds = {"0": [False], "1": [True]}.get(which, [False, True])
    models = [(seed, extra) for seed in seeds for extra in kinds]
    stats = Stats()
    failures: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    for i, (seed, extra) in enumerate(models):
        try:
            o = check_model(seed, Budget(pairs=8, invalid=4, compositions=2), stats, extra)
            if seed % 10 == 0:  # every tenth seed from several threads too
                check_threads(o, random.Random(seed), 3, stats)
            wrappable = o.g.spec.out_form in ("single", "tuple") and not o.g.stateful
            if seed % 10 == 5 and wrappable:  # array fields
                rng = np.random.default_rng(seed)
                wrapper = array_fields(o.g, wrapped_net(o.g), rng, np.asarray)
                check_array_fields(o.g, wrapper, jnp.asarray, stats)
        except Exception as e:
            failures.append(
                (
                    f"{seed}{' (extended)' if extra else ''}",
                    _explain(seed, e, extra)
                    + "\n"
                    + "".join(traceback.format_tb(e.__traceback__)[-3:]),
                )
            )
        if i % 25 == 24:
            jax.clear_caches()
    summary = (
        f"fuzz_large: {len(models)} models, {stats.models} passed, {stats.slices} slices checked, "
        f"{stats.errors} invalid slices raised, {stats.maybe} error-or-value pairs, "
        f"{len(failures)} failing models, {time.perf_counter() - t0:.0f}s"
    )
    print(summary)
    if failures:
        shown = "\n\n".join(f"--- seed {s}\n{m}" for s, m in failures[:10])
        raise AssertionError(f"{summary}\nfailing seeds: {[s for s, _ in failures]}\n\n{shown}")
