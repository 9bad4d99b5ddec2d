"""The generator, the unrolled twins and the oracle of the scan fuzzer
(``tests/fuzz/test_fuzz_scan.py``, whose docstring describes them), shared with the
edit fuzzer (``tests/fuzz/test_fuzz_edits.py``).

`generate(kind, seed)` builds a random scanned model (linen, NNX or plain JAX) with its
unrolled twin and the twin's value DAG; `check_model` runs every check on one model;
`known_bug` keeps the cases of open library bugs out of the checks; `SMALL` are the
seeds run by default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers.fuzzing import ancestors, flat_ends, pair_verdict
from helpers.oracles import leaf_paths, random_variables

B = 2  # batch
D_IN = 3  # model input features
D = 4  # features inside the scan
ATOL = RTOL = 1e-4

# --------------------------------------------------------------------------- the DAG
#
# Values are string ids: "in0", "in_mask", "in_xs" (model inputs), "mask", "xs", "row3"
# (derived from the model's inputs outside every module), "embed", "head", "ys",
# "L3.v2" (block-local value v2 of iteration 3), "L1.0.cell" (nested scans),
# "P.a.3" (row 3 of a stacked parameter, given to a marked function).

_INDEX = re.compile(r"\[(-?\d+|:)\]")


def listed_name(name: str) -> str:
    """``layers[2]/attn`` -> ``layers[:]/attn``: the name `js.boundaries` lists."""
    return _INDEX.sub("[:]", name)


def split_port(spec: str) -> tuple[str, str]:
    """``layers[:]/attn:input`` -> (``layers[:]/attn``, ``input``); side "" if not given."""
    for side in ("input", "output"):
        if spec.endswith(":" + side):
            return spec[: -len(side) - 1], side
    return spec, ""


def fill(listed: str, index: list[Any]) -> str:
    it = iter(index)
    return re.sub(r"\[:\]", lambda m: f"[{next(it)}]", listed)


@dataclasses.dataclass
class Call:
    ins: tuple[str, ...]  # the value of each argument a start there takes
    out: Any  # tree of values (None where the call returns None)


@dataclasses.dataclass
class Graph:
    parents: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    inputs: list[str] = dataclasses.field(default_factory=list)
    # Values the model computes from its inputs outside every module: a slice that also
    # starts at the model's inputs (None) computes them instead of taking them.
    derived: set[str] = dataclasses.field(default_factory=set)
    producer: dict[str, str] = dataclasses.field(default_factory=dict)  # value -> variables
    calls: dict[str, Call] = dataclasses.field(default_factory=dict)  # concrete names
    dims: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # listed names
    listed: list[str] = dataclasses.field(default_factory=list)  # js.boundaries, in order
    lifted: set[str] = dataclasses.field(default_factory=set)  # whole lifted loops
    out: Any = None
    # What the stacked per-iteration outputs need when the iterations run as whole loop
    # bodies: every iteration's inputs (see `known_bug`).
    coarse: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    carries: dict[str, str] = dataclasses.field(default_factory=dict)  # y -> its iteration's carry

    def add(self, node: str, *parents: str, producer: str | None = None, derived=False) -> str:
        assert node not in self.parents, node
        self.parents[node] = tuple(parents)
        if producer:
            self.producer[node] = producer
        if derived:
            self.derived.add(node)
        return node

    def input(self, node: str) -> str:
        self.inputs.append(self.add(node))
        return node

    def call(self, name: str, ins: tuple[str, ...], out: Any, dims: tuple[int, ...]) -> None:
        assert name not in self.calls, name
        self.calls[name] = Call(tuple(ins), out)
        listed = listed_name(name)
        if listed not in self.dims:
            self.dims[listed] = dims
            self.listed.append(listed)


# --------------------------------------------------------------------------- the twin
#
# While a twin runs, `_TWIN` records every value under its id; values in `overrides`
# replace the computed ones (a slice's start values). Otherwise (the scanned models,
# jaxslice's traces) it is None and the same code computes without recording.


class _Twin:
    def __init__(self, overrides: dict[str, Any] | None):
        self.values: dict[str, Any] = {}
        self.overrides = overrides or {}
        self.k: str = ""  # the iteration running ("3", or "1.0" in nested scans)

    def put(self, node: str, value: Any) -> Any:
        if node in self.overrides:
            value = self.overrides[node]
        for edit in EDITS.get(node, ()):  # edits written into the twin (test_fuzz_edits)
            value = edit(value)
        self.values[node] = value
        return value


_TWIN: _Twin | None = None
# Functions applied to values as the twin computes them, by value id, in order: the edits
# `test_fuzz_edits` makes with `js.edit`, written into the twin by hand.
EDITS: dict[str, list[Any]] = {}


@contextlib.contextmanager
def twin_run(overrides: dict[str, Any] | None = None):
    global _TWIN
    assert _TWIN is None
    _TWIN = _Twin(overrides)
    try:
        yield _TWIN
    finally:
        _TWIN = None


def _hook(lid: str, value: Any) -> Any:
    """A block-local value: recorded as ``L{iteration}.{lid}`` while a twin runs."""
    t = _TWIN
    return value if t is None else t.put(f"L{t.k}.{lid}", value)


# --------------------------------------------------------------------------- blocks
#
# A block spec is a list of ops over local values: "x" (the carry), "m" (the broadcast
# mask), "r" (this iteration's row of xs), then each op's result. Module ops (each call a
# boundary): dense, ln, sub (a submodule with fc1, or fc1 -> tanh -> fc2), shared (one
# Dense called twice), xproj (a Dense of the xs row). Glue: act, add, mask, xs, sin.

MODULE_OPS = ("dense", "ln", "sub", "shared", "xproj")
NAMES = ("attn", "mlp", "proj", "gate", "fc", "ffn", "mix", "norm", "post", "ln")


@dataclasses.dataclass(frozen=True)
class BOp:
    kind: str
    out: str
    ins: tuple[str, ...]
    name: str = ""
    variant: int = 0  # act: 0 tanh, 1 relu; sub: number of Dense layers; shared: call


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    extras: tuple[str, ...]  # arguments after the carry: "m" and/or "r"
    ops: tuple[BOp, ...]
    carry: str
    y: str | None  # the per-iteration output, if any


def gen_block(rng: random.Random, extras: tuple[str, ...], ys: bool) -> BlockSpec:
    names = iter(rng.sample(NAMES, len(NAMES)))
    ops: list[BOp] = []
    produced = ["x"]

    def emit(kind: str, ins: tuple[str, ...], name: str = "", variant: int = 0) -> str:
        out = f"v{len(ops)}"
        ops.append(BOp(kind, out, ins, name, variant))
        produced.append(out)
        return out

    steps = [
        rng.choice(["dense", "dense", "ln", "sub", "sub", "shared", "act", "res", "res"])
        for _ in range(rng.randint(1, 4))
    ]
    if not any(s in MODULE_OPS for s in steps):
        steps.insert(rng.randint(0, len(steps)), "dense")
    if "m" in extras:
        steps.insert(rng.randint(0, len(steps)), "mask")
    if "r" in extras:
        steps.insert(rng.randint(0, len(steps)), rng.choice(["xs", "xproj"]))
    cur, shared_done = "x", False
    for step in steps:
        if step == "shared" and shared_done:
            step = "dense"
        if step == "dense":
            cur = emit("dense", (cur,), next(names))
        elif step == "ln":
            cur = emit("ln", (cur,), next(names))
        elif step == "sub":
            cur = emit("sub", (cur,), next(names), rng.randint(1, 2))
        elif step == "shared":
            shared_done = True
            a = emit("shared", (cur,), "shared", 0)
            b = emit("act", (a,), variant=0)
            cur = emit("shared", (b,), "shared", 1)
        elif step == "act":
            cur = emit("act", (cur,), variant=int(rng.random() < 0.3))
        elif step == "res":
            cur = emit("add", (cur, rng.choice(produced[:-1] or ["x"])))
        elif step == "mask":
            cur = emit("mask", (cur, "m"))
        elif step == "xs":
            cur = emit("xs", (cur, "r"))
        elif step == "xproj":
            a = emit("xproj", ("r",), "xproj")
            cur = emit("add", (cur, a))
    if cur == "x":
        cur = emit("dense", (cur,), next(names))
    carry = cur
    y = None
    if ys:
        # The carry itself may be the output too (``return h, h``, the usual RNN cell).
        modules = [o.out for o in ops if o.kind in MODULE_OPS]
        if modules and rng.random() < 0.3:
            y = rng.choice(modules)
        else:
            y = emit("sin", (rng.choice(produced),))
    return BlockSpec(tuple(extras), tuple(ops), carry, y)


def run_block(spec: BlockSpec, x: Any, extras: tuple[Any, ...], module: Any) -> tuple[Any, Any]:
    """The block's computation; `module(op)` gives the module an op calls."""
    env = {"x": x, **dict(zip(spec.extras, extras, strict=True))}
    for op in spec.ops:
        a = [env[i] for i in op.ins]
        if op.kind in MODULE_OPS:
            v = module(op)(a[0])
        elif op.kind == "act":
            v = jnp.tanh(a[0]) if op.variant == 0 else jax.nn.relu(a[0])
        elif op.kind in ("add", "xs"):
            v = a[0] + a[1]
        elif op.kind == "mask":
            v = a[0] * a[1]
        elif op.kind == "sin":
            v = jnp.sin(a[0])
        else:  # pragma: no cover
            raise AssertionError(op.kind)
        env[op.out] = _hook(op.out, v)
    return env[spec.carry], (env[spec.y] if spec.y else None)


def block_calls(spec: BlockSpec, prefix: str, node: Any, dims: tuple[int, ...], g: Graph) -> dict:
    """Adds one iteration's block values and calls to `g`; `node(lid)` names a local value,
    `prefix` the iteration's call (``layers[3]``). Returns the local -> value map."""
    env: dict[str, str] = {}
    var = listed_name(prefix).replace("[:]", "")  # layers[3] -> layers (variables path)

    def get(lid: str) -> str:
        return env.get(lid) or node(lid)

    for op in spec.ops:
        ins = [get(i) for i in op.ins]
        out = node(op.out)
        if op.kind == "sub":
            path = f"{prefix}/{op.name}"
            if op.variant == 2:
                a = g.add(node(f"{op.out}.a"), ins[0], producer=f"{var}/{op.name}/fc1")
                b = g.add(node(f"{op.out}.b"), a)
                g.add(out, b, producer=f"{var}/{op.name}/fc2")
                g.call(path, (ins[0],), out, dims)
                g.call(f"{path}/fc1", (ins[0],), a, dims)
                g.call(f"{path}/fc2", (b,), out, dims)
            else:
                g.add(out, ins[0], producer=f"{var}/{op.name}/fc1")
                g.call(path, (ins[0],), out, dims)
                g.call(f"{path}/fc1", (ins[0],), out, dims)
        elif op.kind in MODULE_OPS:
            g.add(out, ins[0], producer=f"{var}/{op.name}")
            suffix = f"@{op.variant}" if op.kind == "shared" else ""
            g.call(f"{prefix}/{op.name}{suffix}", (ins[0],), out, dims)
        else:
            g.add(out, *ins)
        env[op.out] = out
    return env


# --------------------------------------------------------------------------- linen


@dataclasses.dataclass(frozen=True)
class LSpec:
    seed: int
    n: int
    reverse: bool
    remat: bool
    mask: str  # "none", "derived" (from the model's input) or "input" (a model input)
    xs: str  # "none", "derived" or "input"
    out_ys: bool  # the model returns the stacked per-iteration outputs too
    block: BlockSpec


def order(n: int, reverse: bool) -> list[int]:
    return list(range(n - 1, -1, -1)) if reverse else list(range(n))


def _xs_matrix(seed: int, n: int) -> np.ndarray:
    return (np.random.default_rng(seed + 1).normal(size=(n, D_IN, D)) * 0.7).astype(np.float32)


def prelude(s: Any, inputs: tuple[Any, ...], put: Any) -> tuple[Any, Any, Any]:
    """The model's input, mask and xs (as the model computes them)."""
    x = put("in0", inputs[0])
    rest = list(inputs[1:])
    mask = xs = None
    if s.mask == "input":
        mask = put("in_mask", rest.pop(0))
    if s.xs == "input":
        xs = put("in_xs", rest.pop(0))
    if s.mask == "derived":
        mask = put("mask", (x[:, :1] > 0).astype(jnp.float32))
    if s.xs == "derived":
        xs = put("xs", jnp.sin(jnp.einsum("bi,kid->kbd", x, _xs_matrix(s.seed, s.n))))
    return x, mask, xs


def _no_record(node: str, value: Any) -> Any:
    return value


class LSub(nn.Module):
    two: bool
    lid: str

    @nn.compact
    def __call__(self, v):
        a = nn.Dense(D, name="fc1")(v)
        if not self.two:
            return a
        a = _hook(f"{self.lid}.a", a)
        b = _hook(f"{self.lid}.b", jnp.tanh(a))
        return nn.Dense(D, name="fc2")(b)


class LBlock(nn.Module):
    spec: BlockSpec

    @nn.compact
    def __call__(self, x, *extras):
        mods: dict[str, nn.Module] = {}

        def module(op: BOp) -> nn.Module:
            if op.name not in mods:
                if op.kind == "ln":
                    mods[op.name] = nn.LayerNorm(name=op.name)
                elif op.kind == "sub":
                    mods[op.name] = LSub(op.variant == 2, op.out, name=op.name)
                else:
                    mods[op.name] = nn.Dense(D, name=op.name)
            return mods[op.name]

        return run_block(self.spec, x, extras, module)


class LModel(nn.Module):
    """The scanned model."""

    spec: LSpec

    @nn.compact
    def __call__(self, *inputs):
        s = self.spec
        x, mask, xs = prelude(s, inputs, _no_record)
        h = nn.Dense(D, name="embed")(x)
        extras = [mask if e == "m" else xs for e in s.block.extras]
        axes = tuple(nn.broadcast if e == "m" else 0 for e in s.block.extras)
        stack = nn.scan(
            nn.remat(LBlock) if s.remat else LBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=s.n,
            reverse=s.reverse,
            **({"in_axes": axes} if axes else {}),
        )
        h, ys = stack(s.block, name="layers")(h, *extras)
        out = nn.Dense(2, name="head")(h)
        return (out, ys) if s.out_ys else out


class LTwin(nn.Module):
    """The unrolled twin: the same block in a Python loop, ``layers_0 ... layers_{n-1}``."""

    spec: LSpec

    @nn.compact
    def __call__(self, *inputs):
        s, t = self.spec, _TWIN
        x, mask, xs = prelude(s, inputs, t.put)
        h = t.put("embed", nn.Dense(D, name="embed")(x))
        ys = {}
        for k in order(s.n, s.reverse):
            t.k = str(k)
            extras = [mask if e == "m" else t.put(f"row{k}", xs[k]) for e in s.block.extras]
            h, ys[k] = LBlock(s.block, name=f"layers_{k}")(h, *extras)
        out = t.put("head", nn.Dense(2, name="head")(h))
        if s.block.y:
            stacked = t.put("ys", jnp.stack([ys[k] for k in range(s.n)]))
        return (out, stacked) if s.out_ys else out


def gen_linen(seed: int) -> LSpec:
    rng = random.Random(seed * 7 + 1)
    n = rng.randint(1, 6)
    mask = rng.choice(["none", "none", "derived", "input"])
    xs = rng.choice(["none", "none", "derived", "input"])
    extras = tuple(e for e, on in (("m", mask != "none"), ("r", xs != "none")) if on)
    if len(extras) == 2 and rng.random() < 0.5:
        extras = extras[::-1]
    ys = rng.random() < 0.4
    block = gen_block(rng, extras, ys)
    return LSpec(
        seed,
        n,
        reverse=rng.random() < 0.3,
        remat=rng.random() < 0.25,
        mask=mask,
        xs=xs,
        out_ys=ys and rng.random() < 0.6,
        block=block,
    )


def scan_graph(s: Any, nnx_style: bool = False) -> Graph:
    """The DAG of a linen (or NNX) scanned model, unrolled."""
    g = Graph()
    g.input("in0")
    mask = xs = None
    if s.mask == "input":
        mask = g.input("in_mask")
    if s.xs == "input":
        xs = g.input("in_xs")
    if s.mask == "derived":
        mask = g.add("mask", "in0", derived=True)
    if s.xs == "derived":
        xs = g.add("xs", "in0", derived=True)
    g.add("embed", "in0", producer="embed")
    g.call("embed", ("in0",), "embed", ())
    lifted_ins = ("embed", *(mask if e == "m" else xs for e in s.block.extras))
    if not nnx_style:
        g.lifted.add("layers")
    g.dims["layers"] = ()
    g.listed.append("layers")
    carry, ys = "embed", {}
    for k in order(s.n, s.reverse):
        row = g.add(f"row{k}", xs, derived=True) if xs else None
        outer = {"x": carry, "m": mask, "r": row}
        env = block_calls(
            s.block,
            f"layers[{k}]",
            lambda lid, k=k, o=outer: o.get(lid) or f"L{k}.{lid}",
            (s.n,),
            g,
        )
        nxt = env[s.block.carry]
        ys[k] = env[s.block.y] if s.block.y else None
        if ys[k]:
            g.carries[ys[k]] = nxt
        ins = (carry, *(mask if e == "m" else row for e in s.block.extras))
        if nnx_style and not s.block.y:
            out = nxt
        else:
            out = (nxt, ys[k])
        g.calls[f"layers[{k}]"] = Call(ins, out)
        carry = nxt
    # The block's own call is listed before its sub-calls.
    g.listed.insert(g.listed.index("layers") + 1, "layers[:]")
    g.dims["layers[:]"] = (s.n,)
    if s.block.y:
        g.add("ys", *(ys[k] for k in range(s.n)))
        g.coarse["ys"] = tuple(v for k in range(s.n) for v in g.calls[f"layers[{k}]"].ins)
    if not nnx_style:
        g.calls["layers"] = Call(lifted_ins, (carry, "ys" if s.block.y else None))
    g.add("head", carry, producer="head")
    g.call("head", (carry,), "head", ())
    g.out = ("head", "ys") if s.out_ys else "head"
    return g


def scan_inputs(s: Any, rng: np.random.Generator, batch: int) -> list[Any]:
    inputs = [rng.normal(size=(batch, D_IN))]
    if s.mask == "input":
        inputs.append((rng.random((batch, 1)) > 0.4).astype(np.float32))
    if s.xs == "input":
        inputs.append(rng.normal(size=(s.n, batch, D)))
    return [jnp.asarray(a, jnp.float32) for a in inputs]


class LinenModel:
    kind = "linen"

    def __init__(self, spec: LSpec):
        self.spec = spec
        self.model = LModel(spec)
        self.inputs = scan_inputs(spec, np.random.default_rng(spec.seed), B)
        self.variables = random_variables(self.model, *self.inputs, seed=spec.seed)
        self.graph = scan_graph(spec)

    def unrolled(self) -> Any:
        p = dict(self.variables["params"])
        stacked = p.pop("layers")
        for k in range(self.spec.n):
            p[f"layers_{k}"] = jax.tree_util.tree_map(lambda a, k=k: a[k], stacked)
        return {"params": p}

    def twin(self, inputs: list[Any], overrides: Any = None, params: Any = None) -> dict:
        with twin_run(overrides) as t:
            LTwin(self.spec).apply(self.unrolled() if params is None else params, *inputs)
        return t.values

    def apply(self, inputs: list[Any]) -> Any:
        return self.model.apply(self.variables, *inputs)

    def slice(self, start: Any, end: Any) -> Any:
        return js.slice(self.model, self.variables, *self.inputs, start=start, end=end)

    def intermediates(self, names: list[str]) -> dict:
        return js.intermediates(self.model, self.variables, *self.inputs, names=names)

    def boundaries(self) -> Any:
        return js.boundaries(self.model, self.variables, *self.inputs)

    def var_prefix(self, module: str) -> tuple[str, ...]:
        return ("params", *module.split("/"))

    def new_inputs(self, batch: int) -> list[Any]:
        return scan_inputs(self.spec, np.random.default_rng(self.spec.seed + 99), batch)

    def stacked(self, path: tuple[str, ...]) -> bool:
        return path[1] == "layers"

    def twin_grads(self, fn: Any, overrides: Any) -> dict[tuple[str, ...], Any]:
        """``jax.grad`` of ``fn(values)`` through the twin run with `overrides`, as leaves
        of the scanned model's variables (rows of stacked parameters stacked again)."""
        run = lambda p: fn(self.twin(self.inputs, overrides, p))  # noqa: E731
        g = leaf_paths(jax.jit(jax.grad(run))(self.unrolled()))
        out = {}
        for path in leaf_paths(self.variables):
            if path[1] == "layers":
                rows = [g[("params", f"layers_{k}", *path[2:])] for k in range(self.spec.n)]
                out[path] = jnp.stack(rows)
            else:
                out[path] = g[path]
        return out


# --------------------------------------------------------------------------- NNX


class NSub(nnx.Module):
    def __init__(self, two: bool, lid: str, rngs: nnx.Rngs):
        self.two, self.lid = two, lid
        self.fc1 = nnx.Linear(D, D, rngs=rngs)
        if two:
            self.fc2 = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, v):
        a = self.fc1(v)
        if not self.two:
            return a
        a = _hook(f"{self.lid}.a", a)
        b = _hook(f"{self.lid}.b", jnp.tanh(a))
        return self.fc2(b)


class NBlock(nnx.Module):
    def __init__(self, spec: BlockSpec, rngs: nnx.Rngs):
        self.spec = spec
        for op in spec.ops:
            if op.kind in MODULE_OPS and not hasattr(self, op.name):
                if op.kind == "ln":
                    setattr(self, op.name, nnx.LayerNorm(D, rngs=rngs))
                elif op.kind == "sub":
                    setattr(self, op.name, NSub(op.variant == 2, op.out, rngs))
                else:
                    setattr(self, op.name, nnx.Linear(D, D, rngs=rngs))

    def __call__(self, x, *extras):
        c, y = run_block(self.spec, x, extras, lambda op: getattr(self, op.name))
        return (c, y) if self.spec.y else c


class NModel(nnx.Module):
    def __init__(self, spec: LSpec, rngs: nnx.Rngs):
        self.spec = spec

        @nnx.split_rngs(splits=spec.n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r):
            return NBlock(spec.block, r)

        self.embed = nnx.Linear(D_IN, D, rngs=rngs)
        self.layers = make(rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, *inputs):
        s = self.spec
        x, mask, xs = prelude(s, inputs, _no_record)
        h = self.embed(x)
        extras = [mask if e == "m" else xs for e in s.block.extras]
        axes = tuple(None if e == "m" else 0 for e in s.block.extras)

        @nnx.scan(
            in_axes=(0, nnx.Carry, *axes),
            out_axes=(nnx.Carry, 0) if s.block.y else nnx.Carry,
            reverse=s.reverse,
        )
        def body(layer, h, *ex):
            return layer(h, *ex)

        r = body(self.layers, h, *extras)
        h, ys = r if s.block.y else (r, None)
        out = self.head(h)
        return (out, ys) if s.out_ys else out


class NNXModel:
    kind = "nnx"

    def __init__(self, spec: LSpec):
        self.spec = spec
        self.model = NModel(spec, nnx.Rngs(spec.seed))
        self.inputs = scan_inputs(spec, np.random.default_rng(spec.seed), B)
        self.graph = scan_graph(spec, nnx_style=True)
        self.variables = None

    def twin(self, inputs: list[Any], overrides: Any = None) -> dict:
        s, m = self.spec, self.model
        graphdef, state = nnx.split(m.layers)
        layers = [
            nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, k=k: a[k], state))
            for k in range(s.n)
        ]
        with twin_run(overrides) as t:
            x, mask, xs = prelude(s, inputs, t.put)
            h = t.put("embed", m.embed(x))
            ys = {}
            for k in order(s.n, s.reverse):
                t.k = str(k)
                extras = [mask if e == "m" else t.put(f"row{k}", xs[k]) for e in s.block.extras]
                r = layers[k](h, *extras)
                h, ys[k] = r if s.block.y else (r, None)
            t.put("head", m.head(h))
            if s.block.y:
                t.put("ys", jnp.stack([ys[k] for k in range(s.n)]))
        return t.values

    def new_inputs(self, batch: int) -> list[Any]:
        return scan_inputs(self.spec, np.random.default_rng(self.spec.seed + 99), batch)

    def apply(self, inputs: list[Any]) -> Any:
        return self.model(*inputs)

    def slice(self, start: Any, end: Any) -> Any:
        return js.slice(self.model, *self.inputs, start=start, end=end)

    def intermediates(self, names: list[str]) -> dict:
        return js.intermediates(self.model, *self.inputs, names=names)

    def boundaries(self) -> Any:
        return js.boundaries(self.model, *self.inputs)


# --------------------------------------------------------------------------- plain JAX


@dataclasses.dataclass(frozen=True)
class POp:
    name: str
    variant: int  # 0: tanh(h @ w), 1: h + tanh(h @ w) / 2, 2: sin(h @ w)
    twice: bool  # called twice per iteration (name@0, name@1) with two weight rows
    glue: bool  # tanh of its result before the next call


@dataclasses.dataclass(frozen=True)
class PSpec:
    seed: int
    kind: str  # "scan", "fori" or "nested"
    n: int
    m: int  # nested: inner iterations
    reverse: bool
    ys: bool  # scan: the body returns (h, sin(h)) and the model (h, ys)
    wrap: bool  # scan: the whole scan inside a marked function "stack"
    ops: tuple[POp, ...]  # scan/fori: the body's calls; nested: an optional "pre" call


def _raw(variant: int) -> Any:
    if variant == 0:
        return lambda h, w: jnp.tanh(h @ w)
    if variant == 1:
        return lambda h, w: h + jnp.tanh(h @ w) * 0.5
    return lambda h, w: jnp.sin(h @ w)


def gen_plain(seed: int) -> PSpec:
    rng = random.Random(seed * 11 + 5)
    kind = rng.choice(["scan", "scan", "fori", "nested"])
    names = rng.sample(["a", "b", "c", "cellx", "step"], 3)
    n_ops = rng.randint(1, 3) if kind != "nested" else int(rng.random() < 0.5)
    ops = tuple(
        POp(
            "pre" if kind == "nested" else names[i],
            rng.randint(0, 2),
            twice=rng.random() < 0.3 and kind != "nested",
            glue=rng.random() < 0.4,
        )
        for i in range(n_ops)
    )
    return PSpec(
        seed,
        kind,
        n=rng.randint(1, 5) if kind != "nested" else rng.randint(1, 3),
        m=rng.randint(1, 3),
        reverse=kind == "scan" and rng.random() < 0.3,
        ys=kind == "scan" and rng.random() < 0.4,
        wrap=kind == "scan" and rng.random() < 0.3,
        ops=ops,
    )


def plain_params(s: PSpec) -> dict[str, Any]:
    rng = np.random.default_rng(s.seed)
    p = {}
    for op in s.ops:
        shape = (D, D) if s.kind == "fori" else (s.n, *((2,) if op.twice else ()), D, D)
        p[op.name] = rng.normal(size=shape) / np.sqrt(D)
    if s.kind == "nested":
        p["cell"] = rng.normal(size=(s.n, s.m, D, D)) / np.sqrt(D)
    p["unused"] = rng.normal(size=(3,))  # never read: no slice holds it
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), p)


def make_plain(s: PSpec) -> Any:
    """The scanned plain function ``fn(params, x)``."""

    def run_ops(h: Any, rows: dict[str, Any]) -> Any:
        for op in s.ops:
            f = js.mark(op.name, _raw(op.variant))
            if op.twice:  # fori: the same (loop-constant) weights twice
                h = f(h, rows[op.name] if s.kind == "fori" else rows[op.name][0])
                h = f(h, rows[op.name] if s.kind == "fori" else rows[op.name][1])
            else:
                h = f(h, rows[op.name])
            if op.glue:
                h = jnp.tanh(h)
        return h

    def fn(p, x):
        if s.kind == "fori":
            return jax.lax.fori_loop(0, s.n, lambda i, h: run_ops(h, p), x)
        if s.kind == "nested":
            cell = js.mark("cell", lambda h, w: (jnp.tanh(h @ w), None))

            @js.mark("outer")
            def outer(h, ws):
                return jax.lax.scan(cell, h, ws)[0]

            def body(h, rows):
                h = run_ops(h, rows)
                return outer(h, rows["cell"]), None

            rows = {k: v for k, v in p.items() if k != "unused"}
            return jax.lax.scan(body, x, rows)[0]

        def body(h, rows):
            h = run_ops(h, rows)
            return h, (jnp.sin(h) if s.ys else None)

        def stack(h, rows):
            h, ys = jax.lax.scan(body, h, rows, reverse=s.reverse)
            return (h, ys) if s.ys else h

        rows = {k: v for k, v in p.items() if k != "unused"}
        return js.mark("stack", stack)(x, rows) if s.wrap else stack(x, rows)

    return fn


def plain_twin(s: PSpec, p: dict[str, Any], x: Any, t: _Twin) -> Any:
    """The plain model as a Python loop, recording every call's arguments and result."""
    h = t.put("in0", x)

    def run_ops(h: Any, k: str, row: Any) -> Any:
        for op in s.ops:
            f = _raw(op.variant)
            for c in range(2 if op.twice else 1):
                at = f"@{c}" if op.twice else ""
                if s.kind == "fori":
                    w = p[op.name]
                elif op.twice:
                    w = t.put(f"P.{op.name}.{k}.{c}", row(op.name)[c])
                else:
                    w = t.put(f"P.{op.name}.{k}", row(op.name))
                h = t.put(f"L{k}.{op.name}{at}", f(h, w))
            if op.glue:
                h = t.put(f"L{k}.{op.name}.g", jnp.tanh(h))
        return h

    if s.kind == "nested":
        for i in range(s.n):
            h = run_ops(h, str(i), lambda name, i=i: p[name][i])
            ws = t.put(f"P.cell.{i}", p["cell"][i])
            for j in range(s.m):
                w = t.put(f"P.cell.{i}.{j}", ws[j])
                h = t.put(f"L{i}.{j}.cell", jnp.tanh(h @ w))
        return h
    ys = {}
    for k in order(s.n, s.reverse):
        h = run_ops(h, str(k), lambda name, k=k: p[name][k])
        if s.ys:
            ys[k] = t.put(f"L{k}.y", jnp.sin(h))
    if s.ys:
        return h, t.put("ys", jnp.stack([ys[k] for k in range(s.n)]))
    return h


def plain_graph(s: PSpec) -> Graph:
    g = Graph()
    h = g.input("in0")
    pre = "stack/" if s.wrap else ""
    if s.wrap:
        g.listed.append("stack")
        g.dims["stack"] = ()

    def run_ops(h: str, k: str, index: tuple[int, ...], dims: tuple[int, ...], path: str) -> str:
        for op in s.ops:
            for c in range(2 if op.twice else 1):
                at = f"@{c}" if op.twice else ""
                out = f"L{k}.{op.name}{at}"
                if s.kind == "fori":
                    g.add(out, h, producer=op.name)
                    g.call(f"{path}{op.name}{index}{at}", (h,), out, dims)
                else:
                    # A row read outside every marked call (not inside "stack") is
                    # recomputed when the model's inputs are a start too.
                    row = f"P.{op.name}.{k}" + (f".{c}" if op.twice else "")
                    w = g.add(row, producer=op.name, derived=not s.wrap)
                    g.add(out, h, w)
                    # The row is a parameter (computed from the variables alone), not
                    # one of the call's input ports.
                    g.call(f"{path}{op.name}{index}{at}", (h,), out, dims)
                h = out
            if op.glue:
                h = g.add(f"L{k}.{op.name}.g", h)
        return h

    if s.kind == "nested":
        for i in range(s.n):
            h = run_ops(h, str(i), f"[{i}]", (s.n,), "")
            ws = g.add(f"P.cell.{i}", producer="cell", derived=True)
            start = h
            for j in range(s.m):
                w = g.add(f"P.cell.{i}.{j}", ws)
                out = g.add(f"L{i}.{j}.cell", h, w)
                g.call(f"outer[{i}]/cell[{j}]", (h,), (out, None), (s.n, s.m))
                h = out
            g.calls[f"outer[{i}]"] = Call((start,), h)
            if i == 0:  # listed: the marked function, then its inner calls
                g.listed.insert(g.listed.index("outer[:]/cell[:]"), "outer[:]")
                g.dims["outer[:]"] = (s.n,)
        g.out = h
        return g
    ys, coarse = {}, []
    for k in order(s.n, s.reverse):
        coarse += [h] + [v for v in g.parents if v.startswith("P.") and v.split(".")[2] == str(k)]
        h = run_ops(h, str(k), f"[{k}]", (s.n,), pre)
        if s.ys:
            ys[k] = g.add(f"L{k}.y", h)
            g.carries[ys[k]] = h
    if s.ys:
        g.add("ys", *(ys[k] for k in range(s.n)))
        g.coarse["ys"] = tuple(coarse)
    g.out = (h, "ys") if s.ys else h
    if s.wrap:
        g.calls["stack"] = Call(("in0",), g.out)
    return g


class PlainModel:
    kind = "plain"

    def __init__(self, spec: PSpec):
        self.spec = spec
        self.fn = make_plain(spec)
        self.variables = plain_params(spec)
        self.inputs = [
            jnp.asarray(np.random.default_rng(spec.seed).normal(size=(B, D)), jnp.float32)
        ]
        self.graph = plain_graph(spec)

    def twin(self, inputs: list[Any], overrides: Any = None, params: Any = None) -> dict:
        with twin_run(overrides) as t:
            plain_twin(self.spec, self.variables if params is None else params, inputs[0], t)
        return t.values

    def apply(self, inputs: list[Any]) -> Any:
        return self.fn(self.variables, *inputs)

    def slice(self, start: Any, end: Any) -> Any:
        return js.slice(self.fn, self.variables, *self.inputs, start=start, end=end)

    def intermediates(self, names: list[str]) -> dict:
        return js.intermediates(self.fn, self.variables, *self.inputs, names=names)

    def boundaries(self) -> Any:
        return js.boundaries(self.fn, self.variables, *self.inputs)

    def var_prefix(self, module: str) -> tuple[str, ...]:
        return tuple(module.split("/"))

    def new_inputs(self, batch: int) -> list[Any]:
        return [
            jnp.asarray(
                np.random.default_rng(self.spec.seed + 99).normal(size=(batch, D)), jnp.float32
            )
        ]

    def stacked(self, path: tuple[str, ...]) -> bool:
        return self.spec.kind != "fori"

    def twin_grads(self, fn: Any, overrides: Any) -> dict[tuple[str, ...], Any]:
        run = lambda p: fn(self.twin(self.inputs, overrides, p))  # noqa: E731
        return leaf_paths(jax.jit(jax.grad(run))(self.variables))


# --------------------------------------------------------------------------- generation


def generate(kind: str, seed: int) -> Any:
    if kind == "linen":
        return LinenModel(gen_linen(seed))
    if kind == "nnx":
        return NNXModel(gen_linen(seed))
    return PlainModel(gen_plain(seed))


def describe(m: Any) -> str:
    s = m.spec
    head = f"{m.kind} model, seed {s.seed}: " + ", ".join(
        f"{f.name}={getattr(s, f.name)!r}"
        for f in dataclasses.fields(s)
        if f.name not in ("seed", "block", "ops")
    )
    if isinstance(s, PSpec):
        return head + "\n  " + "\n  ".join(map(repr, s.ops))
    b = s.block
    lines = [f"block(x, {', '.join(b.extras)}) -> ({b.carry}, {b.y})"]
    lines += [
        f"{op.out} = {op.kind}{'/' + op.name if op.name else ''}[{op.variant}]({', '.join(op.ins)})"
        for op in b.ops
    ]
    return head + "\n  " + "\n  ".join(lines)


# --------------------------------------------------------------------------- the oracle


def _items(start: Any) -> list[Any]:
    return list(start) if isinstance(start, list) else [start]


def _stack(trees: list[Any]) -> Any:
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)


class Oracle:
    """What the DAG and the twin say about a model's slices."""

    def __init__(self, m: Any):
        self.m = m
        self.g: Graph = m.graph
        self.values = m.twin(m.inputs)
        # Concrete names of calls the random pairs may use (NNX's bare `layers` is not
        # modelled).
        self.names = list(self.g.calls)

    # ---- names

    def resolve(self, name: str) -> tuple[str, list[Any]]:
        """``layers[-1]/attn`` -> (``layers[:]/attn``, [n - 1])."""
        listed = listed_name(name)
        dims = self.g.dims[listed]
        raw = [m.group(1) for m in _INDEX.finditer(name)]
        return listed, [":" if i == ":" else int(i) % d for i, d in zip(raw, dims, strict=True)]

    def alias(self, name: str, rng: random.Random) -> str:
        """`name` with some iterations counted from the end."""
        listed, index = self.resolve(name)
        dims = self.g.dims[listed]
        return fill(
            listed, [i - d if rng.random() < 0.3 else i for i, d in zip(index, dims, strict=True)]
        )

    def concrete(self, spec: str) -> list[tuple[str, str]]:
        """(concrete call name, side) of every call a port spec names."""
        name, side = split_port(spec)
        listed, index = self.resolve(name)
        found = [[]]
        for i, d in zip(index, self.g.dims[listed], strict=True):
            found = [f + [k] for f in found for k in (range(d) if i == ":" else [i])]
        return [(fill(listed, f), side) for f in found]

    # ---- ports

    def leaves(self, spec: Any, default_side: str) -> list[str]:
        if isinstance(spec, tuple):  # ("<nodes>", [value ids])
            return list(spec[1])
        if spec is None:
            return (
                list(self.g.inputs)
                if default_side == "input"
                else jax.tree_util.tree_leaves(self.g.out)
            )
        out = []
        for name, side in self.concrete(spec):
            c = self.g.calls[name]
            out += (
                list(c.ins)
                if (side or default_side) == "input"
                else jax.tree_util.tree_leaves(c.out)
            )
        return out

    def value_of(self, spec: str | None, values: dict[str, Any]) -> Any:
        """What a slice ending at `spec` returns."""
        if spec is None:
            return jax.tree_util.tree_map(lambda v: values[v], self.g.out)
        name, side = split_port(spec)
        listed, index = self.resolve(name)
        return self._value(listed, index, side or "output", values)

    def _value(self, listed: str, index: list[Any], side: str, values: dict[str, Any]) -> Any:
        if ":" in index:
            j = index.index(":")
            parts = [
                self._value(listed, index[:j] + [k] + index[j + 1 :], side, values)
                for k in range(self.g.dims[listed][j])
            ]
            return _stack(parts)
        c = self.g.calls[fill(listed, index)]
        if side == "output":
            return jax.tree_util.tree_map(lambda v: values[v], c.out)
        args = [values[v] for v in c.ins]
        return args[0] if len(args) == 1 else tuple(args)

    def ends_value(self, end: Any, values: dict[str, Any] | None = None) -> Any:
        values = self.values if values is None else values
        if isinstance(end, list):
            return tuple(self.value_of(e, values) for e in end)
        if isinstance(end, dict):
            return {k: self.value_of(e, values) for k, e in end.items()}
        return self.value_of(end, values)

    def taken(self, start: Any) -> list[list[str]]:
        """The values each start item takes (with the model's inputs a start too, the
        other starts' inputs that are model inputs come from them, and derived ones are
        recomputed: see `beside_inputs`)."""
        items = _items(start)
        with_inputs = None in items and len(items) > 1
        out = []
        for it in items:
            if it is None:
                out.append(list(self.g.inputs))
                continue
            leaves = self.leaves(it, "input")
            if with_inputs and split_port(it)[1] != "output":
                leaves = self.beside_inputs(leaves)
            out.append(leaves)
        return out

    def beside_inputs(self, leaves: list[str]) -> list[str]:
        """What a named start's input `leaves` give beside the model's inputs: neither
        model inputs nor values derived from them; failing that, the derived ones (a start
        is never dropped whole); failing that, all of them (given twice, refused)."""
        inputs = set(self.g.inputs)
        for skipped in (inputs | self.g.derived, inputs):
            kept = [v for v in leaves if v not in skipped]
            if kept:
                return kept
        return leaves

    def start_args(self, start: Any, values: dict[str, Any] | None = None) -> list[Any]:
        """What a slice starting at `start` is called with."""
        values = self.values if values is None else values
        if start is None:
            return [values[v] for v in self.g.inputs]
        items = _items(start)
        with_inputs = None in items and len(items) > 1
        args: list[Any] = []
        for it in items:
            if it is None:
                args += [values[v] for v in self.g.inputs]
                continue
            name, side = split_port(it)
            ((concrete, _),) = self.concrete(name)
            c = self.g.calls[concrete]
            if side == "output":
                args.append(jax.tree_util.tree_map(lambda v: values[v], c.out))
            else:
                kept = set(self.beside_inputs(list(c.ins))) if with_inputs else set(c.ins)
                args += [values[v] for v in c.ins if v in kept]
        return args

    def overrides(self, start: Any, values: dict[str, Any] | None = None) -> dict[str, Any]:
        values = self.values if values is None else values
        return {v: values[v] for leaves in self.taken(start) for v in leaves}

    # ---- validity, from the DAG only

    def classify(self, start: Any, end: Any) -> str:
        """ "valid"; "missing": an end needs a model input through a path avoiding every
        start value; "disconnected": an end does not depend on any start value; "unused":
        fine, but a start is not needed; "clash": a value given twice; "both": several
        (as in tests/fuzz/test_fuzz.py)."""
        if start is None:
            return "valid"
        taken = self.taken(start)
        kind = self._classify(taken, [self.leaves(e, "output") for e in flat_ends(end)])
        # A stacked end is a value of its own, computed in the loop: a start giving one of
        # its rows may be used for it or not (an error or the right value will do).
        stacked = {
            v
            for e in flat_ends(end)
            if e is not None and "[:]" in e
            for v in self.leaves(e, "output")
        }
        if stacked & {v for t in taken for v in t}:
            return "clash" if kind in ("valid", "unused") else "both"
        return kind

    def _classify(self, taken: list[list[str]], ends: list[list[str]], coarse: bool = False) -> str:
        parents = {**self.g.parents, **self.g.coarse} if coarse else self.g.parents
        given = {v for t in taken for v in t}
        used: set[str] = set()
        missing = disconnected = False
        for leaves in ends:
            hit: set[str] = set()
            seen: set[str] = set()
            stack = list(leaves)
            while stack:
                v = stack.pop()
                if v in seen:
                    continue
                seen.add(v)
                if v in given:
                    hit.add(v)
                elif v in self.g.inputs:
                    missing = True
                else:
                    stack.extend(parents[v])
            disconnected |= not hit
            used |= hit
        unused = any(not (set(t) & used) for t in taken)
        ids = [v for t in taken for v in t]
        clash = len(ids) != len(set(ids))
        return pair_verdict(missing, disconnected, unused, clash)

    def modules_needed(self, start: Any, end: Any) -> set[str]:
        given = (
            {v for t in self.taken(start) for v in t} if start is not None else set(self.g.inputs)
        )
        seen: set[str] = set()
        stack = [v for e in flat_ends(end) for v in self.leaves(e, "output")]
        while stack:
            v = stack.pop()
            if v in seen or v in given:
                continue
            seen.add(v)
            stack.extend(self.g.parents[v])
        return {self.g.producer[v] for v in seen if v in self.g.producer}

    def ancestors(self, leaves: list[str]) -> set[str]:
        return ancestors(self.g.parents, leaves)


def refused(o: Oracle, start: Any, end: Any) -> bool:
    """A slice naming a whole lifted loop and one of its iterations is refused by design
    (a SliceError; see test_lifted_name_with_an_iteration_is_a_clear_error)."""
    specs = [s for s in _items(start) + flat_ends(end) if s is not None]
    bases = {split_port(s)[0] for s in specs}
    return any(n in bases and any(b.startswith(n + "[") for b in bases) for n in o.g.lifted)


def known_bug(o: Oracle, start: Any, end: Any) -> str | None:
    """Why a pair is kept out of the random checks: a library bug reproduced by an
    ``xfail(strict=True)`` test below. None for every other pair."""
    if getattr(o.m.spec, "kind", None) == "fori" and start is not None:
        return "fori-start"  # test_known_bug_start_inside_fori_loop
    stacked = [e for e in flat_ends(end) if e is not None and "[:]" in e]
    if stacked and start is not None and o.classify(start, end) in ("valid", "unused"):
        # A stacked end runs every iteration's whole body (test_known_bug_stacked_end...):
        # refused when the body needs a value (an xs row) that the end itself does not.
        body = [v for v in o.g.parents if v.startswith("L")]
        ends = [o.leaves(e, "output") for e in flat_ends(end)] + [body]
        if o._classify(o.taken(start), ends) in ("missing", "both"):
            return "stacked-end-whole-body"
    block = getattr(o.m.spec, "block", None)
    if block is not None and block.y == block.carry and start is not None:
        # The rows of ys before the start are given carries (``return h, h``), but the
        # iterations before the start run as one piece from the model's inputs: the
        # same limitation (or, with the model's inputs given too, a refusal).
        if needs_whole_loop(o, start, end):
            return "aliased-ys"  # test_known_bug_ys_of_an_iteration_before_the_start
    if "ys" in o.g.coarse and start is not None and o.classify(start, end) in ("valid", "unused"):
        ends = [o.leaves(e, "output") for e in flat_ends(end)]
        if o._classify(o.taken(start), ends, coarse=True) in ("missing", "both"):
            return "ys-from-whole-iterations"  # test_known_bug_ys_of_an_iteration_before_the_start
    return None


def needs_whole_loop(o: Oracle, start: Any, end: Any) -> bool:
    """Whether an end is a stacked value, or needs the stacked per-iteration outputs."""
    if any(e is not None and "[:]" in e for e in flat_ends(end)):
        return True
    given = {v for t in o.taken(start) for v in t}
    seen: set[str] = set()
    stack = [v for e in flat_ends(end) for v in o.leaves(e, "output")]
    while stack:
        v = stack.pop()
        if v in seen or v in given:
            continue
        seen.add(v)
        stack.extend(o.g.parents[v])
    return "ys" in seen


# --------------------------------------------------------------------------- checks


@dataclasses.dataclass
class Stats:
    models: int = 0
    slices: int = 0  # slices built and run against the twin
    errors: int = 0  # invalid slices checked to raise
    maybe: int = 0  # borderline pairs: an error or the right value
    grads: int = 0  # gradient checks
    known: int = 0  # pairs skipped as known library bugs


@dataclasses.dataclass
class Budget:
    singles: int = 3
    pairs: int = 6
    invalid: int = 3
    maybe: int = 2
    compositions: int = 2
    grads: int = 2
    new_batch: int = 2


def close(actual: Any, expected: Any, what: str = "") -> None:
    a_leaves, a_tree = jax.tree_util.tree_flatten(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    assert a_tree == e_tree, (
        f"{what}: tree structures differ:\n  actual:   {a_tree}\n  expected: {e_tree}"
    )
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"{what}: leaf {i}: shape {a.shape} != {e.shape}"
        np.testing.assert_allclose(a, e, atol=ATOL, rtol=RTOL, err_msg=f"{what}: leaf {i}")


def loss_of(tree: Any) -> Any:
    return sum(jnp.sum(jnp.tanh(a) + 0.1 * a * a) for a in jax.tree_util.tree_leaves(tree))


def check_twin(o: Oracle) -> None:
    """The twin computes what the scanned model computes (a check of the oracle), and
    records every value of the DAG."""
    close(o.m.apply(o.m.inputs), o.value_of(None, o.values), "the twin's output")
    assert set(o.g.parents) <= set(o.values), set(o.g.parents) - set(o.values)


def check_boundaries(o: Oracle) -> None:
    rows = o.m.boundaries()
    assert [b.name for b in rows] == o.g.listed
    for b in rows:
        dims = o.g.dims[b.name]
        want = int(np.prod(dims)) if dims else None
        assert b.iterations == want, f"{b.name}: iterations {b.iterations} != {want}"


def check_all_ends(o: Oracle, rng: random.Random, budget: Budget, stats: Stats) -> None:
    """Every call's output and input, from the model's inputs, as two dict ends; whole
    lifted loops on their own (see `known_bug`); a few single ends."""
    names = [n for n in o.names if n not in o.g.lifted]
    for side in ("", ":input"):
        ends = {f"{n}{side}": f"{n}{side}" for n in names}
        got = o.m.slice(None, ends)(*o.m.inputs)
        stats.slices += 1
        close(got, o.ends_value(ends), f"all ends{side}")
    for n in o.g.lifted:
        for end in (n, f"{n}:input"):
            if known_bug(o, None, end):
                stats.known += 1
                continue
            close(o.m.slice(None, end)(*o.m.inputs), o.ends_value(end), end)
            stats.slices += 1
    for n in rng.sample(o.names, min(budget.singles, len(o.names))):
        end = o.alias(n, rng) + rng.choice(["", ":output", ":input"])
        if known_bug(o, None, end):
            stats.known += 1
            continue
        close(o.m.slice(None, end)(*o.m.inputs), o.ends_value(end), end)
        stats.slices += 1


def stacked_names(o: Oracle) -> list[str]:
    out = []
    for listed, dims in o.g.dims.items():
        if not dims:
            continue
        out += [listed, f"{listed}:input"]
        if len(dims) > 1:  # partial stacks of nested scans
            for j in range(len(dims)):
                index = [":" if i == j else (d - 1 if j else 0) for i, d in enumerate(dims)]
                out.append(fill(listed, index))
    return out


def check_stacked(o: Oracle, stats: Stats) -> None:
    names = stacked_names(o)
    got = o.m.intermediates(names)
    stats.slices += 1
    close(got, {n: o.value_of(n, o.values) for n in names}, "stacked intermediates")


def _port_pools(o: Oracle, rng: random.Random) -> tuple[list[Any], list[Any]]:
    starts: list[Any] = [None]
    ends: list[Any] = [None]
    for n in o.names:
        a = o.alias(n, rng)
        starts += [a, f"{a}:output"]
        ends += [a, f"{a}:input"]
    ends += [s for s in stacked_names(o) if rng.random() < 0.3]
    return starts, ends


def _enclosing(o: Oracle, name: str) -> str | None:
    """The iteration call enclosing a sub-call: ``layers[2]/mlp`` -> ``layers[2]``."""
    if "/" not in name:
        return None
    parent = name.rsplit("/", 1)[0]
    return parent if parent in o.g.calls else _enclosing(o, parent)


def _random_end(rng: random.Random, ends: list[Any]) -> Any:
    r = rng.random()
    if r < 0.75:
        return rng.choice(ends)
    named = [e for e in ends if e is not None]
    picks = rng.sample(named, min(len(named), rng.randint(1, 3)))
    return picks if r < 0.9 else {f"k{i}": p for i, p in enumerate(picks)}


def _random_start(o: Oracle, rng: random.Random, end: Any, starts: list[Any]) -> Any:
    if rng.random() < 0.8:  # related: ports the end depends on
        anc = o.ancestors([v for e in flat_ends(end) for v in o.leaves(e, "output")])
        pool = [s for s in starts if s is not None and set(o.leaves(s, "input")) & anc]
    else:
        pool = [s for s in starts if s is not None]
    if not pool:
        return None
    first = rng.choice(pool)
    items = [first]
    name = split_port(first)[0]
    enclosing = _enclosing(o, o.concrete(name)[0][0])
    r = rng.random()
    if enclosing and r < 0.5:
        items.append(f"{enclosing}:input")  # the block's input for the rest of it
    if rng.random() < (0.5 if o.m.kind != "plain" else 0.2):
        items.append(None)  # the model's inputs, for masks and xs rows
    if rng.random() < 0.1:
        items.append(rng.choice(pool))
    return items[0] if len(items) == 1 else items


def sample_pairs(
    o: Oracle, rng: random.Random, want: dict[str, int], stats: Stats, tries: int = 300
) -> dict[str, list[Any]]:
    starts, ends = _port_pools(o, rng)
    found: dict[str, list[Any]] = {
        k: [] for k in ("valid", "missing", "disconnected", "both", "unused", "clash", "refused")
    }
    seen = set()
    for _ in range(tries):
        if all(len(found[k]) >= n for k, n in want.items()):
            break
        end = _random_end(rng, ends)
        start = _random_start(o, rng, end, starts)
        key = repr((start, end))
        if start is None or key in seen:
            continue
        seen.add(key)
        if refused(o, start, end):
            if len(found["refused"]) < want.get("refused", 0):
                found["refused"].append((start, end))
            continue
        if known_bug(o, start, end):
            stats.known += 1
            continue
        kind = o.classify(start, end)
        if len(found[kind]) < want.get(kind, 0):
            found[kind].append((start, end))
    return found


def check_variables(o: Oracle, sub: Any, start: Any, end: Any) -> None:
    """The slice holds exactly the variables of the modules it computes, as the model's
    own arrays (stacked parameters whole)."""
    if o.m.variables is None:
        return
    full = leaf_paths(o.m.variables)

    def paths(modules: set[str]) -> set[tuple[str, ...]]:
        prefixes = [o.m.var_prefix(mod) for mod in modules]
        return {p for p in full if any(p[: len(q)] == q for q in prefixes)}

    want = paths(o.modules_needed(start, end))
    got = leaf_paths(sub.variables)
    if start is not None and needs_whole_loop(o, start, end):
        # Stacked values are computed by whole iterations (see `known_bug`): their other
        # modules' variables may come along (e.g. those of the last carry when only the
        # stacked ys are needed).
        body = [v for v in o.g.parents if v.startswith("L")]
        coarse = paths(o.modules_needed(start, flat_ends(end) + [("<nodes>", body)]))
        assert want <= set(got) <= coarse, (
            f"sub.variables {sorted(got)}: not between {sorted(want)} and {sorted(coarse)}"
        )
        return
    assert set(got) == want, (
        f"sub.variables has extra {sorted(set(got) - want)} and lacks {sorted(want - set(got))}"
    )
    for p, leaf in got.items():
        assert leaf is full[p], f"{p} is a copy, not the model's array"


def check_perturbed(o: Oracle, sub: Any, start: Any, end: Any, stats: Stats) -> None:
    """Start values other than the twin's: the slice computes from what it is given (the
    twin run with those values in place of its own), not from anything else. Skipped
    where an end is itself a start value (whether it is passed through or computed is
    not specified)."""
    if start is None:
        return
    given = [v for t in o.taken(start) for v in t if v not in o.g.inputs]
    ends = {v for e in flat_ends(end) for v in o.leaves(e, "output")}
    if not given or ends & set(given):
        return
    if needs_whole_loop(o, start, end) and any(o.g.carries.get(y) in given for y in o.g.carries):
        # test_known_bug_ys_of_an_iteration_ignore_a_given_carry
        stats.known += 1
        return
    rng = np.random.default_rng(len(given))
    changed = {
        v: o.values[v] + jnp.asarray(rng.normal(0, 0.5, np.shape(o.values[v])), jnp.float32)
        for v in given
    }
    values = o.m.twin(o.m.inputs, {**o.overrides(start), **changed})
    got = sub(*o.start_args(start, {**o.values, **changed}))
    stats.slices += 1
    close(got, o.ends_value(end, values), f"start={start!r} end={end!r} with other start values")


def expect_slice(
    o: Oracle, start: Any, end: Any, stats: Stats, new_batch: bool = False, perturb: bool = False
) -> Any:
    sub = o.m.slice(start, end)
    got = sub(*o.start_args(start))
    stats.slices += 1
    close(got, o.ends_value(end), f"start={start!r} end={end!r}")
    check_variables(o, sub, start, end)
    if perturb:
        check_perturbed(o, sub, start, end, stats)
    # A slice with a start takes a new size of the leading axis only: not for xs or ys
    # (iterations first).
    batch_first = start is None or not {v for t in o.taken(start) for v in t} & {
        "in_xs",
        "xs",
        "ys",
    }
    if new_batch and batch_first:
        values = o.m.twin(o.m.new_inputs(2 * B))
        got = sub(*o.start_args(start, values))
        stats.slices += 1
        close(got, o.ends_value(end, values), f"start={start!r} end={end!r}, batch {2 * B}")
    return sub


EXPECTED_ERROR = {
    "missing": js.MissingInputError,
    "disconnected": js.DisconnectedError,
    "both": js.SliceError,
}


def check_invalid(o: Oracle, start: Any, end: Any, kind: str, stats: Stats) -> None:
    try:
        sub = o.m.slice(start, end)
    except js.SliceError as e:
        stats.errors += 1
        assert isinstance(e, EXPECTED_ERROR[kind]), (
            f"start={start!r} end={end!r} ({kind}) raised {type(e).__name__}: {e}"
        )
        return
    try:
        got = sub(*o.start_args(start))
    except Exception as e:  # noqa: BLE001
        got = f"<raised when called: {e!r}>"
    raise AssertionError(
        f"invalid slice ({kind}) start={start!r} end={end!r} returned instead of raising; "
        f"got {jax.tree_util.tree_map(np.asarray, got)!r}, expected {o.ends_value(end)!r}"
    )


def check_pairs(o: Oracle, rng: random.Random, budget: Budget, stats: Stats) -> list[Any]:
    found = sample_pairs(
        o,
        rng,
        {
            "valid": budget.pairs,
            "missing": budget.invalid,
            "disconnected": budget.invalid,
            "both": 1,
            "unused": budget.maybe,
            "clash": 1,
            "refused": 1,
        },
        stats,
    )
    for start, end in found["refused"]:
        with pytest.raises(js.SliceError):
            o.m.slice(start, end)
        stats.errors += 1
    for i, (start, end) in enumerate(found["valid"]):
        try:
            expect_slice(o, start, end, stats, new_batch=i < budget.new_batch, perturb=True)
        except Exception as e:
            raise AssertionError(f"valid slice start={start!r} end={end!r} failed: {e!r}") from e
    for kind in ("missing", "disconnected", "both"):
        for start, end in found[kind]:
            check_invalid(o, start, end, kind, stats)
    for start, end in found["unused"] + found["clash"]:
        try:
            expect_slice(o, start, end, stats)
        except js.SliceError:
            pass
        except Exception as e:
            raise AssertionError(
                f"borderline slice start={start!r} end={end!r} returned a wrong value: {e!r}"
            ) from e
        stats.maybe += 1
    return found["valid"]


def check_composition(o: Oracle, rng: random.Random, budget: Budget, stats: Stats) -> None:
    """slice(a, b) ∘ slice(None, a) == slice(None, b) for whole iterations `a`, cut at
    their input or output (with the model's inputs as a second start where needed)."""
    whole = [
        n
        for n in o.names
        if "[" in n and "/" not in n.split("]")[-1] and n.count("[") == 1 and n not in o.g.lifted
    ]
    _, ends = _port_pools(o, rng)
    done = 0
    for _ in range(40):
        if done >= budget.compositions or not whole:
            return
        a, b = rng.choice(whole), rng.choice(ends)
        side = rng.choice(["input", "output"])
        first_start = a if side == "input" else f"{a}:output"
        start = next(
            (s for s in (first_start, [first_start, None]) if o.classify(s, b) == "valid"), None
        )
        if start is None or refused(o, start, b) or known_bug(o, start, b):
            continue
        first = o.m.slice(None, f"{a}:input" if side == "input" else a)
        mid = first(*o.m.inputs)
        if side == "input":
            mid = list(mid) if len(o.g.calls[o.concrete(a)[0][0]].ins) > 1 else [mid]
            ins = o.g.calls[o.concrete(a)[0][0]].ins
            if isinstance(start, list):  # beside the model's inputs (`beside_inputs`)
                kept = set(o.beside_inputs(list(ins)))
                mid = [v for v, node in zip(mid, ins, strict=True) if node in kept]
        else:
            mid = [mid]
        if isinstance(start, list):
            mid += list(o.m.inputs)
        composed = o.m.slice(start, b)(*mid)
        direct = o.m.slice(None, b)(*o.m.inputs)
        stats.slices += 3
        close(composed, direct, f"composition a={a!r} ({side}) b={b!r}")
        close(direct, o.ends_value(b), f"slice(None, {b!r})")
        done += 1


def check_grads(
    o: Oracle, rng: random.Random, pairs: list[Any], budget: Budget, stats: Stats
) -> None:
    """The gradient of a loss through a slice w.r.t. ``sub.variables`` equals jax.grad
    through the twin (run with the start's values given); what the twin's gradient does
    not reach is exactly zero."""
    if o.m.variables is None:
        return
    names = [n for n in o.names if n not in o.g.lifted]
    cands = list(pairs[: budget.grads])
    if budget.grads > 1 or not cands:  # and one from the model's inputs
        cands.append((None, rng.choice(names)))
    for start, end in cands:
        sub = o.m.slice(start, end)
        args = o.start_args(start)
        got = leaf_paths(
            jax.grad(lambda v, sub=sub, args=args: loss_of(sub.apply(v, *args)))(sub.variables)
        )
        overrides = o.overrides(start) if start is not None else None
        want = o.m.twin_grads(lambda values, end=end: loss_of(o.ends_value(end, values)), overrides)
        what = f"grad start={start!r} end={end!r}"
        for path, w in want.items():
            w = np.asarray(w)
            if path not in got:
                assert not np.any(w), (
                    f"{what}: {path} gets gradient through the twin but is not in sub.variables"
                )
                continue
            g = np.asarray(got[path])
            np.testing.assert_allclose(g, w, atol=ATOL, rtol=1e-3, err_msg=f"{what}: {path}")
            if not o.m.stacked(path):
                continue
            zero = ~np.any(w.reshape(w.shape[0], -1) != 0, axis=1)
            if zero.any():
                rows = np.asarray(g.reshape(g.shape[0], -1)[zero])
                assert not np.any(rows), (
                    f"{what}: {path} rows {np.nonzero(zero)[0]} are not exactly zero"
                )
        stats.grads += 1


def check_invalid_specs(o: Oracle, rng: random.Random, budget: Budget, stats: Stats) -> None:
    """An iteration out of range (``name[n]``, ``name[-n-1]``, in any scan of a nest) and a
    stacked name as a start raise; so does an end before its start (the last iteration
    run to the first one's input), for a few of the model's per-iteration names."""
    families = [listed for listed, dims in o.g.dims.items() if dims]
    for listed in rng.sample(families, min(budget.invalid, len(families))):
        dims = o.g.dims[listed]
        j = rng.randrange(len(dims))
        for bad in (dims[j], -dims[j] - 1):
            name = fill(listed, [bad if i == j else 0 for i in range(len(dims))])
            with pytest.raises(js.SliceError):
                o.m.slice(None, name)
            stats.errors += 1
        with pytest.raises(js.SliceError):
            o.m.slice(rng.choice([listed, f"{listed}:output"]), None)
        stats.errors += 1
        if len(dims) != 1 or dims[0] < 2:
            continue
        first, last = (dims[0] - 1, 0) if o.m.spec.reverse else (0, dims[0] - 1)
        start, end = fill(listed, [last]), fill(listed, [first]) + ":input"
        if known_bug(o, start, end):
            continue
        kind = o.classify(start, end)
        assert kind in EXPECTED_ERROR, (start, end, kind)
        check_invalid(o, start, end, kind, stats)


def check_model(kind: str, seed: int, budget: Budget, stats: Stats) -> Oracle:
    m = generate(kind, seed)
    o = Oracle(m)
    rng = random.Random(seed * 7919 + len(kind))
    check_twin(o)
    check_boundaries(o)
    check_all_ends(o, rng, budget, stats)
    check_stacked(o, stats)
    valid = check_pairs(o, rng, budget, stats)
    check_composition(o, rng, budget, stats)
    check_grads(o, rng, valid, budget, stats)
    check_invalid_specs(o, rng, budget, stats)
    stats.models += 1
    return o


def _explain(kind: str, seed: int, error: BaseException) -> str:
    return f"{describe(generate(kind, seed))}\n{type(error).__name__}: {error}"


# Linen seeds 275, 243 and 66 together cover every feature of the linen generator, plain
# seeds 241 (reversed scan in a marked function, ys, a call twice per iteration), 2
# (nested scans) and 0 (fori_loop) every plain one (`test_default_seeds_cover_every_feature`);
# NNX seed 145 has a mask model input, derived xs, LayerNorm and ys.
SMALL = [
    ("linen", 275),
    ("linen", 243),
    ("linen", 66),
    ("nnx", 145),
    ("linen", 20),  # the cell returns its carry as its output too
    ("nnx", 303),  # the same, under nnx.scan
    ("plain", 241),
    ("plain", 2),
    ("plain", 0),
]
