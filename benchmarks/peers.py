"""The lens rows' patching sweep and steering, beside TransformerLens and nnsight.

Usage: python benchmarks/peers.py [--quick] [--torch-threads N] [--rounds N]

Runs only where `torch` and `transformer_lens` (a version with ``HookedTransformer``, before
4.0) and/or `nnsight` import; neither is a dependency of jaxslice, and without them the
script says so and exits 0. Each library gets the model of rows 27-30 of `lens.py` in its
own terms: a ``HookedTransformer`` of the same shapes (pre-LN blocks, 4 heads, MLP 4x
wide, no causal mask, random weights) run from its residual stream (``start_at_layer=0,
stop_at_layer=depth``: the embedding output in, the last block's output out, as the
jaxslice model), and nnsight wrapping that same model. For each library:

* steering at one layer (a vector added to block 2's output) / its own plain forward;
* a patching sweep over every layer (the clean run's block outputs read once, then one
  run per layer with block k's output at the last token replaced by the clean one) / as
  many plain forwards (the clean run and one per layer);
* the lines a user writes for both (the snippets timed, printed).

Every library's results are first checked against its own hand-written patched forward
(the blocks called in a loop, the change written into it): jaxslice's against `lens.py`'s
JAX one, the others' against the same loop in torch. Times of one library are ratios to
that library's own plain forward; across libraries, only those ratios compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _timing import check_close, compare
from lens import (
    STEER_AT,
    Sizes,
    _body,
    _position,
    _whole,
    _zero,
    edited_by_hand,
    stack,
    steer,
    sweep_layers,
    user_lines,
)

import jaxslice as js

LAYER = int(STEER_AT[len("layers[") : -1])  # the steered block


def _importable(name: str) -> str | None:
    """None when `name` imports, else why not."""
    try:
        importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken install
        return f"{type(e).__name__}: {e}"
    return None


def _hooked_transformer() -> Any:
    """TransformerLens's HookedTransformer class, or a reason why it is not there."""
    try:
        from transformer_lens import HookedTransformer
    except Exception as e:  # ImportError: TransformerLens 4 removed it
        return f"{type(e).__name__}: {e}"
    return HookedTransformer


# ------------------------------------------------------------------ the snippets timed


def tl_steer(model, x, v, span):
    return model.run_with_hooks(x, **span, fwd_hooks=[("blocks.2.hook_resid_post", lambda h, hook: h + v)])  # fmt: skip


def tl_sweep(model, clean, corrupt, span):
    _, cache = model.run_with_cache(clean, **span, names_filter=lambda name: "resid_post" in name)  # fmt: skip

    def patch(h, hook):
        h[:, -1] = cache[hook.name][:, -1]
        return h

    return [model.run_with_hooks(corrupt, **span, fwd_hooks=[(f"blocks.{k}.hook_resid_post", patch)]) for k in range(model.cfg.n_layers)]  # fmt: skip


def nn_steer(net, x, v, span):
    with net.trace(x, **span):
        net.blocks[2].output = net.blocks[2].output + v
        out = net.output.save()
    return out


def nn_sweep(net, clean, corrupt, span, depth):
    hs, outs = [], []
    with net.trace(clean, **span):
        for k in range(depth):
            hs.append(net.blocks[k].output.save())
    for k in range(depth):
        with net.trace(corrupt, **span):
            net.blocks[k].output[:, -1] = hs[k][:, -1]
            outs.append(net.output.save())
    return outs


# ------------------------------------------------------------------ torch side


def torch_by_hand(blocks: Any, x: Any, k: int, change: Callable[[Any], Any]) -> Any:
    """The blocks called one by one, block k's output h replaced by `change(h)`."""
    h = x
    for i, block in enumerate(blocks):
        h = block(h)
        if i == k:
            h = change(h)
    return h


def torch_model(sz: Sizes, seed: int) -> Any:
    from transformer_lens import HookedTransformerConfig

    _, tokens, width = sz.shape
    cfg = HookedTransformerConfig(
        n_layers=sz.depth,
        d_model=width,
        n_ctx=tokens,
        d_head=width // 4,
        n_heads=4,
        d_mlp=4 * width,
        d_vocab=16,  # unused: the runs start at the residual stream
        act_fn="gelu",
        normalization_type="LN",
        attention_dir="bidirectional",
        seed=seed,
    )
    model = _hooked_transformer()(cfg)
    model.eval()
    return model


def _close(a: Any, b: Any, what: str) -> None:
    check_close(jnp.asarray(np.asarray(a)), jnp.asarray(np.asarray(b)), what, 1e-4)


def torch_rows(lib: str, sz: Sizes, log: Any) -> dict[str, Any]:
    import torch

    log(f"{lib}: a HookedTransformer of {sz.depth} blocks, width {sz.shape[-1]}")
    torch.manual_seed(0)
    model = torch_model(sz, 0)
    clean, corrupt = torch.randn(*sz.shape), torch.randn(*sz.shape)
    v = torch.randn(sz.shape[-1])
    span = {"start_at_layer": 0, "stop_at_layer": sz.depth}
    last = lambda value: lambda h: torch.cat([h[:, :-1], value[:, -1:]], 1)  # noqa: E731
    with torch.no_grad():
        blocks = list(model.blocks)
        plain = lambda: model(corrupt, **span)  # noqa: E731
        _close(plain(), torch_by_hand(blocks, corrupt, -1, None), f"{lib}: plain forward")
        clean_blocks = [torch_by_hand(blocks[: k + 1], clean, -1, None) for k in range(sz.depth)]
        if lib == "TransformerLens":
            steering = lambda: tl_steer(model, corrupt, v, span)  # noqa: E731
            sweep = lambda: tl_sweep(model, clean, corrupt, span)  # noqa: E731
            lines = [_body(tl_steer), _body(tl_sweep)]
        else:
            from nnsight import NNsight

            net = NNsight(model)
            steering = lambda: nn_steer(net, corrupt, v, span)  # noqa: E731
            sweep = lambda: nn_sweep(net, clean, corrupt, span, sz.depth)  # noqa: E731
            lines = [_body(nn_steer), _body(nn_sweep)]
        want = torch_by_hand(blocks, corrupt, LAYER, lambda h: h + v)
        _close(steering(), want, f"{lib}: steering vs by hand")
        outs = sweep()
        for k in sorted({0, sz.depth // 2, sz.depth - 1}):
            want = torch_by_hand(blocks, corrupt, k, last(clean_blocks[k]))
            _close(outs[k], want, f"{lib}: patch at block {k} vs by hand")
        log(f"{lib}: steering / plain forward")
        steer_res = compare(steering, plain, sz.rounds, sz.round_s)
        log(f"{lib}: patching sweep / {sz.depth + 1} plain forwards")
        plains = lambda: [plain() for _ in range(sz.depth + 1)]  # noqa: E731
        sweep_res = _whole(sweep, plains, sz.rounds)
    return {"steer": steer_res, "sweep": sweep_res, "lines": lines}


# ------------------------------------------------------------------ jaxslice side


def jaxslice_rows(sz: Sizes, log: Any) -> dict[str, Any]:
    """jaxslice's steering and sweep on the model of `lens.py`, checked against its
    hand-written forward (`lens.edited_by_hand`) and timed as the peers are."""
    s = stack(sz.depth, sz.shape, log)
    lens = js.lens(s.model, s.variables, s.clean)
    where = _position(s)
    v = jax.random.normal(jax.random.key(2), (s.clean.shape[-1],))
    nowhere, mask = jnp.zeros(s.clean.shape, bool), jnp.broadcast_to(where, s.clean.shape)
    want = edited_by_hand(s.variables, s.corrupt, LAYER, s.corrupt, nowhere, v)[0]
    check_close(steer(lens, s.corrupt, v), want, "jaxslice: steering vs by hand", 1e-3)
    outs = sweep_layers(lens, s.clean, s.corrupt, where)
    for k in sorted({0, sz.depth // 2, sz.depth - 1}):
        want = edited_by_hand(s.variables, s.corrupt, k, s.blocks[k], mask, _zero(s))[0]
        check_close(outs[k], want, f"jaxslice: patch at layers[{k}] vs by hand", 1e-3)
    plain = lambda: s.full(s.variables, s.corrupt)  # noqa: E731
    log("jaxslice: steering / plain forward")
    steer_res = compare(lambda: steer(lens, s.corrupt, v), plain, sz.rounds, sz.round_s)
    log(f"jaxslice: patching sweep / {sz.depth + 1} plain forwards")
    plains = lambda: [plain() for _ in range(sz.depth + 1)]  # noqa: E731
    sweep_res = _whole(lambda: sweep_layers(lens, s.clean, s.corrupt, where), plains, sz.rounds)
    lines = list(user_lines().values())
    return {"steer": steer_res, "sweep": sweep_res, "lines": lines}


# ------------------------------------------------------------------ report


def print_results(results: dict[str, dict[str, Any]], sz: Sizes) -> None:
    n = sz.depth
    head = (
        f"{'library':<16} {'forward':>10} {'steering':>10} {'/ forward':>9} "
        f"{'sweep':>11} {f'/ {n + 1} fwd':>9}  lines (steering; sweep)"
    )
    print(head)
    print("-" * len(head))
    for lib, r in results.items():
        if "skipped" in r:
            print(f"{lib:<16} skipped ({r['skipped']})")
            continue
        st, sw = r["steer"], r["sweep"]
        lines = f"{len(r['lines'][0])}; {len(r['lines'][1])}"
        print(
            f"{lib:<16} {st['reference_ms']:>8.2f}ms {st['subject_ms']:>8.2f}ms "
            f"{st['ratio']:>9.3f} {sw['subject_ms']:>9.1f}ms {sw['ratio']:>9.3f}  {lines}"
        )
    for lib, r in results.items():
        if "lines" not in r:
            continue
        print(f"\n{lib}:")
        for what, lines in zip(("steering", "patching sweep"), r["lines"], strict=True):
            print(f"  {what} ({len(lines)} lines):")
            for line in lines:
                print(f"    {line}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the lens rows beside TransformerLens and nnsight")
    p.add_argument("--quick", action="store_true", help="smoke run: a small model")
    p.add_argument("--torch-threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--rounds", type=int, default=0, help="alternated rounds (0: lens.py's)")
    args = p.parse_args(argv)
    torch_missing = _importable("torch")
    tl = torch_missing or (None if not isinstance(found := _hooked_transformer(), str) else found)
    nn = torch_missing or _importable("nnsight")
    if tl and nn:
        print(
            "peers.py: neither TransformerLens (with HookedTransformer, < 4.0) nor nnsight is "
            f"importable here; nothing measured. ({tl}; {nn})\n"
            'Install them beside torch to run it: pip install torch "transformer_lens<4" nnsight'
        )
        return 0
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sz = Sizes.make(args.quick)
    if args.rounds:
        sz = dataclasses.replace(sz, rounds=args.rounds)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    results: dict[str, dict[str, Any]] = {"jaxslice": jaxslice_rows(sz, log)}
    for lib, missing in (("TransformerLens", tl), ("nnsight", nn)):
        results[lib] = {"skipped": missing} if missing else torch_rows(lib, sz, log)
    b, t, w = sz.shape
    print(
        f"\njaxslice {js.__version__}, jax {jax.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), CPU. {sz.depth} blocks of width {w} on "
        f"{b}x{t} tokens; {sz.rounds} rounds, alternated; medians.\n"
    )
    print_results(results, sz)
    print(f"\ntotal {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
