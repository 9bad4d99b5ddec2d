"""The jaxpr toolkit: one evaluator, values by variable, deep searches of nested bodies,
and the scan that carries its own iteration index.

`Evaluator` runs a jaxpr again in the current trace, equation by equation, each by the
rule for its kind (a call side's markers, a scan, a call-like body, anything else).
jaxslice's two clients override those rules: `evaluate._Rules` (hooks shown every module
call of a traced graph, loops kept as loops) and `loop_expander.Expander` (a model's
named loops run in pieces). Graph building (`build`) walks the same bodies.

* `Env` holds one jaxpr's values (literals read as themselves, dropped outputs not kept);
* `Finder` answers "is an equation like this inside these bodies, at any depth?", once
  per jaxpr;
* `carried_scan` builds a `lax.scan` whose step also sees the row it runs (a scan's own
  counter is invisible to its body), and `row` reads a row of a stacked operand with one
  dynamic slice, as the scan reads its own operands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from .. import _compat


class Env:
    """The values of one jaxpr's variables while it is evaluated."""

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}

    def read(self, atom: Any) -> Any:
        return _compat.literal_value(atom) if _compat.is_literal(atom) else self.values[atom]

    def reads(self, atoms: Iterable[Any]) -> list[Any]:
        return [self.read(a) for a in atoms]

    def write(self, atoms: Sequence[Any], values: Sequence[Any]) -> None:
        for v, x in zip(atoms, values, strict=True):
            if not _compat.is_dropvar(v):
                self.values[v] = x


class Evaluator:
    """Runs jaxprs again in the current trace: one walk, a rule per kind of equation.

    `run` walks a jaxpr in program order and hands each equation to the rule for its
    kind; a subclass overrides the rules where it changes what an equation means:

    * `call_side`: the markers of one side of one module call, together (jaxslice binds
      them one after another);
    * `scan`: a `scan` (where loops are kept as loops, or split into pieces);
    * `call`: a call-like equation whose one body runs once (jit, remat, custom_jvp/vjp);
    * `other`: every other equation (``while``, ``cond`` and the primitives).

    Each default runs the equation as it is. `ctx` is the subclass's own (where the
    equations run: an iteration, say), passed down unchanged by the walk; a rule may
    `run` a body with another.
    """

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        ctx: Any,
        env: Env | None = None,
    ) -> list[Any]:
        env = Env() if env is None else env
        env.write(jaxpr.constvars, consts)
        env.write(jaxpr.invars, args)
        eqns, i = jaxpr.eqns, 0
        while i < len(eqns):
            first = _compat.marker_payload(eqns[i])
            if first is None:
                eqn = eqns[i]
                env.write(eqn.outvars, self.eqn(eqn, env.reads(eqn.invars), env, ctx))
                i += 1
                continue
            j = i + 1
            while j < len(eqns) and _same_side(_compat.marker_payload(eqns[j]), first):
                j += 1
            self.call_side(eqns[i:j], env, ctx)
            i = j
        return env.reads(jaxpr.outvars)

    def eqn(self, eqn: Any, ins: list[Any], env: Env, ctx: Any) -> list[Any]:
        """One equation that is not a marker, by the rule for its kind."""
        if _compat.loop_primitive(eqn) == "scan":
            return self.scan(eqn, ins, env, ctx)
        body = _compat.call_body(eqn)
        if body is not None:
            return self.call(eqn, body, ins, env, ctx)
        return self.other(eqn, ins, env, ctx)

    def call_side(self, markers: Sequence[Any], env: Env, ctx: Any) -> None:
        """The marker equations of one call side: bound again as they are."""
        for m in markers:
            env.write(m.outvars, _compat.bind_eqn(m, env.reads(m.invars)))

    def scan(self, eqn: Any, ins: list[Any], env: Env, ctx: Any) -> list[Any]:
        return self.other(eqn, ins, env, ctx)

    def call(
        self, eqn: Any, body: tuple[Any, Sequence[Any]], ins: list[Any], env: Env, ctx: Any
    ) -> list[Any]:
        """`body` is the equation's (jaxpr, consts), which `run` can evaluate inline."""
        return self.other(eqn, ins, env, ctx)

    def other(self, eqn: Any, ins: list[Any], env: Env, ctx: Any) -> list[Any]:
        return _compat.bind_eqn(eqn, ins)


def _same_side(marker: Any, first: Any) -> bool:
    """Whether `marker` is of the same call side as `first` (row marks have no call)."""
    record = getattr(first, "record", None)
    return (
        record is not None
        and getattr(marker, "record", None) is record
        and marker.side == first.side
    )


class Finder:
    """Whether equations satisfying `wanted` are in a jaxpr or an equation's bodies, at
    any depth; remembered per jaxpr (the traced jaxprs outlive the search)."""

    def __init__(self, wanted: Callable[[Any], bool]) -> None:
        self.wanted = wanted
        self._memo: dict[int, bool] = {}

    def in_jaxpr(self, jaxpr: Any) -> bool:
        key = id(jaxpr)
        found = self._memo.get(key)
        if found is None:
            found = any(self.wanted(e) or self.inside(e) for e in jaxpr.eqns)
            self._memo[key] = found
        return found

    def inside(self, eqn: Any) -> bool:
        """Whether the bodies an equation holds hold such an equation."""
        return any(self.in_jaxpr(j) for j in _compat.subjaxprs(eqn))


def carried_scan(
    step: Callable[[list[Any], Any, Any], tuple[list[Any], Any]],
    carry: Sequence[Any],
    xs: Any,
    *,
    rows: tuple[int, int],
    reverse: bool,
    unroll: Any,
) -> tuple[list[Any], Any]:
    """``lax.scan`` over iterations ``rows[0]:rows[1]``, with ``step(carry, row, x)`` given
    the row it runs as a traced int32 (counting down in a reverse scan, which visits the
    rows last to first); returns the final carry and the stacked results."""
    a, b = rows
    first, move = (b - 1, -1) if reverse else (a, 1)

    def body(state: tuple[list[Any], Any], x: Any) -> Any:
        c, i = state
        c, y = step(c, i, x)
        return (list(c), i + move), y

    start = (list(carry), jax.numpy.int32(first))
    (out, _), ys = jax.lax.scan(body, start, xs, length=b - a, reverse=reverse, unroll=unroll)
    return list(out), ys


def row(stacked: Any, i: Any) -> Any:
    """Row `i` (a non-negative index, static or traced) of a stacked array, as one
    ``dynamic_slice`` and ``squeeze`` (``lax.dynamic_index_in_dim`` would wrap them in a
    nested ``jit`` equation, one per operand per iteration, for XLA to inline)."""
    one = jax.lax.dynamic_slice_in_dim(stacked, i, 1, 0, allow_negative_indices=False)
    return jax.lax.squeeze(one, (0,))
