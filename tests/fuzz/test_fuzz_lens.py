"""Differential fuzzing of `js.lens` and ``js.intermediates(names="all")`` on random
scanned models (linen, NNX, plain JAX).

The models, their unrolled twins and the twins' value DAG come from the scan fuzzer
(`helpers.fuzz_scan`). Random interventions are drawn over the calls whose output is one
value: a scale and an added vector, in one iteration (``layers[2]/attn``), in every
iteration (``layers[:]/attn``, the vector the same in every row or one row per
iteration) or at a top-level call. The oracle writes them into the twin by hand (each
value passed through them while the twin computes, `helpers.fuzz_scan.EDITS`); the
lens's output and its reads must equal the twin's. With no intervention, every call's
output (``names="all"``, stacked over iterations) must equal the twin's values.
"""

from __future__ import annotations

import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers import fuzz_scan as fz


def _target(m: Any) -> tuple[Any, list[Any]]:
    if m.kind == "nnx":
        return m.model, list(m.inputs)
    target = m.fn if m.kind == "plain" else m.model
    return target, [m.variables, *m.inputs]


def _single(o: fz.Oracle) -> list[str]:
    """Concrete names of calls whose output is one value (a site's whole value)."""
    return [n for n, c in o.g.calls.items() if isinstance(c.out, str)]


def _draw(o: fz.Oracle, rng: random.Random, nrng: np.random.Generator) -> list[dict]:
    names = _single(o)
    drawn = []
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(names)
        listed = fz.listed_name(name)
        at = listed if listed != name and rng.random() < 0.5 else name
        shape = tuple(np.shape(o.values[o.g.calls[name].out]))
        sites = o.concrete(at)
        # one row per iteration of each [:] (or one value for all of them)
        _, index = o.resolve(at)
        lead = [o.g.dims[listed][j] for j, k in enumerate(index) if k == ":"]
        rows = lead and rng.random() < 0.5
        vshape = (*lead, *shape) if rows else shape[-1:]
        drawn.append(
            {
                "at": at,
                "scale": rng.uniform(0.5, 1.5),
                "add": jnp.asarray(nrng.normal(size=vshape), jnp.float32),
                "rows": bool(rows),
                "sites": [n for n, _ in sites],
            }
        )
    return drawn


def _twin(o: fz.Oracle, drawn: list[dict]) -> dict[str, Any]:
    """The twin's values with the interventions written in (scales first, then adds, as
    the lens applies them at one site; innermost calls first where calls share a value)."""
    fz.EDITS.clear()
    try:
        found: dict[str, list[Any]] = {}
        for kind in ("scale", "add"):
            for seq, d in enumerate(drawn):
                listed, index = o.resolve(d["at"])
                free = [j for j, k in enumerate(index) if k == ":"]
                for name in d["sites"]:
                    idx = tuple(o.resolve(name)[1][j] for j in free)

                    def edit(h, d=d, idx=idx, kind=kind):
                        if kind == "scale":
                            return h * d["scale"]
                        return h + (d["add"][idx] if d["rows"] else d["add"])

                    order = (-name.count("/"), kind == "add", seq)
                    found.setdefault(o.g.calls[name].out, []).append((order, edit))
        for key, edits in found.items():
            fz.EDITS[key] = [f for _, f in sorted(edits, key=lambda item: item[0])]
        return o.m.twin(o.m.inputs)
    finally:
        fz.EDITS.clear()


def check_lens(kind: str, seed: int) -> None:
    m = fz.generate(kind, seed)
    o = fz.Oracle(m)
    target, args = _target(m)
    rng, nrng = random.Random(seed * 7 + len(kind)), np.random.default_rng(seed)

    # Every call's output, loops included, with no intervention.
    every = js.intermediates(target, *args, names="all")
    for name in _single(o):
        listed = fz.listed_name(name)
        if listed in every:
            fz.close(every[listed], o.value_of(listed, o.values), f"all: {listed}")
        elif name in every:
            fz.close(every[name], o.value_of(name, o.values), f"all: {name}")
        else:
            raise AssertionError(f"{name} ({listed}) missing from names='all': {list(every)}")

    lens = js.lens(target, *args)
    drawn = _draw(o, rng, nrng)
    scale = {d["at"]: d["scale"] for d in drawn}
    add = {d["at"]: d["add"] for d in drawn}
    if len(scale) < len(drawn):  # one name drawn twice: the dicts keep one of each
        drawn = list({d["at"]: d for d in drawn}.values())
        scale = {d["at"]: d["scale"] for d in drawn}
        add = {d["at"]: d["add"] for d in drawn}
    reads = sorted({fz.listed_name(n) for n in rng.sample(_single(o), 2)})
    out, cache = lens(*m.inputs, scale=scale, add=add, read=reads)
    values = _twin(o, drawn)
    what = f"lens {[(d['at'], d['rows']) for d in drawn]}"
    fz.close(out, jax.tree_util.tree_map(lambda v: values[v], o.g.out), what)
    for name in reads:
        fz.close(cache[name], o.value_of(name, values), f"{what}: read {name}")


@pytest.mark.parametrize(("kind", "seed"), fz.SMALL)
def test_fuzz_lens(kind, seed):
    try:
        check_lens(kind, seed)
    except Exception as error:
        raise AssertionError(fz._explain(kind, seed, error)) from error
