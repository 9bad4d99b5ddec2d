"""Differential fuzzing of `js.edit` on random scanned models (linen, NNX, plain JAX).

The models, their unrolled twins and the twins' value DAG come from the scan fuzzer
(`helpers.fuzz_scan`). Random edits are drawn over the model's calls: a function inserted
after a call's output, a call replaced by a function of its input, or bypassed (output :=
input), in one iteration (``layers[2]/attn``), in every iteration (``layers[:]/attn``) or
at a top-level call; some take a call-time input (at a stacked name one row per
iteration), some insertions are removed again. The oracle writes the same edits into the
twin by hand: while the twin computes, each edited value is passed through the same
functions (`helpers.fuzz_scan.EDITS`, by value id; rows of a call-time input by
iteration). The edited model's output, and its `jax.vmap` over the call-time inputs, must
equal the twin's.

Some models take a positional Python flag too (`True`/`False` or an int, at a random
place among the inputs, ``model(x, train)``), which the trace fixes: the model (a
subclass of the generated one, or a wrapper of the plain function) scales its first input
by a factor the flag picks in Python, so a flag that became a tracer would fail. The
oracle runs the twin on the input scaled by hand.
"""

from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxslice as js

from helpers import fuzz_scan as fz
from helpers.fuzzing import large_fuzz_seeds


def _editable(o: fz.Oracle) -> list[str]:
    """Concrete call names whose output is one value (what a function edit receives)."""
    return [n for n, c in o.g.calls.items() if isinstance(c.out, str)]


def _square(o: fz.Oracle, name: str) -> bool:
    """A call with one input value shaped like its output (it can be bypassed)."""
    c = o.g.calls[name]
    return len(c.ins) == 1 and np.shape(o.values[c.ins[0]]) == np.shape(o.values[c.out])


def _draw(o: fz.Oracle, rng: random.Random) -> list[dict[str, Any]]:
    """One to three edits: an insertion after a call's output, a replacement by a function
    of its input or a bypass (output := input), where (one iteration, every iteration, or
    top level), a scale and a shift, maybe a call-time input, an insertion maybe removed
    again."""
    names = _editable(o)
    square = [n for n in names if _square(o, n)]
    edits = []
    for i in range(rng.randint(1, 3)):
        op = rng.choice(["insert", "insert", "replace", "bypass"]) if square else "insert"
        name = rng.choice(names if op == "insert" else square)
        listed = fz.listed_name(name)
        stacked = listed != name and rng.random() < 0.5
        edits.append(
            {
                "op": op,
                "at": listed if stacked else name,
                "scale": rng.uniform(0.5, 1.5),
                "shift": rng.uniform(-0.5, 0.5),
                "call_time": op != "bypass" and rng.random() < 0.4,
                "removed": op == "insert" and rng.random() < 0.2,
                "node": f"edit{i}",
            }
        )
    for i, e in enumerate(edits):  # a later replacement or bypass of the same call
        later = edits[i + 1 :]  # (and iterations) takes the place of an earlier one
        e["superseded"] = e["op"] != "insert" and any(
            f["op"] != "insert" and f["at"] == e["at"] for f in later
        )
    return edits


def _iterations(o: fz.Oracle, at: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(concrete name, index of each [:] of `at`)`` of every call an edit site names."""
    listed, index = o.resolve(at)
    free = [j for j, k in enumerate(index) if k == ":"]
    return [(name, tuple(o.resolve(name)[1][j] for j in free)) for name, _ in o.concrete(at)]


def _value_shape(o: fz.Oracle, name: str) -> tuple[int, ...]:
    return tuple(np.shape(o.values[o.g.calls[name].out]))


def _call_inputs(o: fz.Oracle, edits: list[dict[str, Any]], rng: np.random.Generator) -> dict:
    """A value for each call-time input: the value's shape, with one row per iteration of
    each ``[:]`` of the site."""
    values = {}
    for e in edits:
        if e["call_time"]:
            sites = _iterations(o, e["at"])
            lead = tuple(len({idx[j] for _, idx in sites}) for j in range(len(sites[0][1])))
            shape = (*lead, *_value_shape(o, sites[0][0]))
            values[f"v{e['node']}"] = jnp.asarray(rng.normal(size=shape), jnp.float32)
    return values


def _twin_output(o: fz.Oracle, edits: list[dict[str, Any]], call: dict[str, Any]) -> Any:
    fz.EDITS.clear()
    try:
        for e in edits:
            if e["removed"] or e["superseded"]:
                continue
            for name, idx in _iterations(o, e["at"]):
                v = call.get(f"v{e['node']}")
                row = v[idx] if v is not None else 0.0
                given = o.g.calls[name].ins[0] if e["op"] != "insert" else None

                def edit(h, e=e, row=row, given=given):
                    if e["op"] == "bypass":
                        return fz._TWIN.values[given]
                    if e["op"] == "replace":  # a function of the call's input instead
                        h = jnp.tanh(fz._TWIN.values[given])
                    return h * e["scale"] + e["shift"] + row

                order = (-name.count("/"), e["op"] == "insert")
                fz.EDITS.setdefault(o.g.calls[name].out, []).append((order, edit))
        # Calls that return the same value (a block whose output is its last layer's)
        # return innermost first, so their edits apply in that order; at one call, its
        # replacements and bypasses (the later wins) come before what is inserted after
        # it; otherwise edits apply in the order they were made.
        for key, found in fz.EDITS.items():
            fz.EDITS[key] = [f for _, f in sorted(found, key=lambda item: item[0])]
        values = o.m.twin(o.m.inputs)
    finally:
        fz.EDITS.clear()
    return jax.tree_util.tree_map(lambda v: values[v], o.g.out)


# --------------------------------------------------------------------------- flags


def _factor(flag: Any) -> float:
    """What a positional flag scales the model's input by, decided in Python (a flag
    that became a tracer fails here)."""
    if isinstance(flag, bool):
        return -1.0 if flag else 1.0
    return {2: 2.0, 3: 0.5}[flag]


def _unflagged(args: tuple[Any, ...], at: int) -> list[Any]:
    """The generated model's inputs from a flagged call's: the flag out, the first input
    scaled by it."""
    inputs = list(args)
    flag = inputs.pop(at)
    inputs[0] = inputs[0] * _factor(flag)
    return inputs


class LFlagged(fz.LModel):
    """The generated linen model, called with a positional flag at `at`."""

    at: int = 0

    def __call__(self, *args):
        return super().__call__(*_unflagged(args, self.at))


class NFlagged(fz.NModel):
    """The generated NNX model, called with a positional flag at `at` (the same weights:
    made from the same seed)."""

    def __init__(self, spec: Any, rngs: nnx.Rngs, at: int):
        super().__init__(spec, rngs)
        self.at = at

    def __call__(self, *args):
        return super().__call__(*_unflagged(args, self.at))


def draw_flag(kind: str, seed: int) -> tuple[Any, int] | None:
    """``(flag, position among the inputs)`` for about half of the models, else None."""
    rng = random.Random(seed * 45 + len(kind))
    if rng.random() < 0.5:
        return None
    return rng.choice([True, False, 2, 3]), rng.randint(0, 1)


def _editor(m: Any, flag: tuple[Any, int] | None) -> tuple[Any, list[Any]]:
    """The editor of the model (taking `flag`, where drawn) and the inputs it is called
    with."""
    if flag is None:
        inputs = list(m.inputs)
        target = m.fn if m.kind == "plain" else m.model
    else:
        value, at = flag
        at = min(at, len(m.inputs))
        inputs = [*m.inputs[:at], value, *m.inputs[at:]]
        if m.kind == "linen":
            target = LFlagged(m.spec, at=at)
        elif m.kind == "nnx":
            target = NFlagged(m.spec, nnx.Rngs(m.spec.seed), at)
        else:
            target = lambda p, *args: m.fn(p, *_unflagged(args, at))  # noqa: E731
    if m.kind == "nnx":
        return js.edit(target, *inputs), inputs
    return js.edit(target, m.variables, *inputs), inputs


def check_edits(kind: str, seed: int) -> None:
    m = fz.generate(kind, seed)
    o = fz.Oracle(m)
    rng = random.Random(seed * 31 + len(kind))
    edits = _draw(o, rng)
    flag = draw_flag(kind, seed)
    g, args = _editor(m, flag)
    if flag is not None:  # the twin runs on the input scaled as the flag says
        m.inputs = [m.inputs[0] * _factor(flag[0]), *m.inputs[1:]]
    for e in edits:
        inputs = (f"v{e['node']}",) if e["call_time"] else ()

        def f(h, *v, e=e):
            return h * e["scale"] + e["shift"] + (v[0] if v else 0.0)

        def g_of_input(*args, e=e):  # the call's arguments, then the call-time input
            v = args[-1] if e["call_time"] else 0.0
            return jnp.tanh(args[0]) * e["scale"] + e["shift"] + v

        if e["op"] == "insert":
            g.insert_after(e["at"], f, name=e["node"], inputs=inputs)
        elif e["op"] == "replace":
            g.replace(e["at"], g_of_input, inputs=inputs)
        else:
            g.remove(e["at"])
    for e in edits:
        if e["removed"]:
            g.remove(e["node"])  # the insertion taken out again
    live = [e for e in edits if not (e["removed"] or e["superseded"])]
    call = _call_inputs(o, live, np.random.default_rng(seed))
    edited = g.build()
    what = f"edits {edits}, flag {flag}"
    fz.close(edited(*args, **call), _twin_output(o, edits, call), what)
    if call:  # a sweep over two sets of call-time inputs, one vmapped call
        both = jax.tree_util.tree_map(lambda a: jnp.stack([a, 2 * a]), call)
        swept = jax.vmap(lambda c: edited(*args, **c))(both)
        second = _twin_output(o, edits, jax.tree_util.tree_map(lambda a: 2 * a, call))
        fz.close(jax.tree_util.tree_map(lambda a: a[1], swept), second, f"vmapped {edits}")


def test_default_seeds_take_positional_flags():
    """Every kind of model is edited with a positional bool and with an int among the
    default seeds."""
    flags = {(kind, type(f[0])) for kind, seed in fz.SMALL if (f := draw_flag(kind, seed))}
    assert flags >= {(k, t) for k in ("linen", "nnx", "plain") for t in (bool, int)}, flags


@pytest.mark.parametrize(("kind", "seed"), fz.SMALL)
def test_fuzz_edits(kind, seed):
    try:
        check_edits(kind, seed)
    except Exception as error:
        raise AssertionError(fz._explain(kind, seed, error)) from error


@pytest.mark.fuzz_large
def test_fuzz_edits_large(request):
    failures = []
    for seed in large_fuzz_seeds(request.config, 60):
        for kind in ("linen", "nnx", "plain"):
            try:
                check_edits(kind, seed)
            except Exception as error:
                failures.append(fz._explain(kind, seed, error))
    assert not failures, f"{len(failures)} failed:\n" + "\n\n".join(failures[:5])
