"""The jaxpr toolkit: one evaluator, values by variable, deep searches of nested bodies,
the loop rules, and the scan that carries its own iteration index.

`Evaluator` runs a jaxpr again in the current trace, equation by equation, each by the
rule for its kind (a call side's markers, a loop, a call-like body, anything else), found
through one table (`Evaluator.KINDS`). jaxslice's two clients override those rules:
`evaluate._Rules` (hooks shown every module call of a traced graph, loops kept as loops)
and `loop_expander.Expander` (a model's named loops run in pieces). Graph building
(`build`) walks the same bodies.

* `LOOP_RULES` holds, per loop primitive (`scan`, `while`), a `LoopRule`: everything the
  core knows of that kind of loop (its body, its operands' layout, its number of
  iterations when that is static, how to run it again with its body evaluated by a
  client's rules and the iteration index carried along). A conditional (`cond`) has none:
  its branches run as they are.

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
import jax.numpy as jnp

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


# --------------------------------------------------------------------------- loop rules

#: ``step(jaxpr, consts, args, row, free) -> (outs, leaving)``: one iteration's body,
#: evaluated by a client's rules; `row` is the iteration index (a traced int32), `free`
#: which of `args` are the program's variables, `leaving` what must leave the loop.
Step = Callable[[Any, Sequence[Any], list[Any], Any, list[bool]], tuple[list[Any], Any]]


class LoopRule:
    """What jaxslice knows of one loop primitive; one instance per primitive, in
    `LOOP_RULES`.

    A loop whose body holds boundaries stays a loop of its kind, its body evaluated once
    (while it is traced) by the client's rules, with the iteration index carried along.
    The calls in its body are named per iteration (one slot per enclosing loop,
    ``layers[:]/mlp``); where `counted`, the number of iterations is static, so each
    iteration can also be named on its own (``layers[3]/mlp``) and written out.
    """

    counted = False

    def body(self, eqn: Any) -> Any:
        """The jaxpr that runs once per iteration."""
        raise NotImplementedError

    def length(self, eqn: Any) -> int | None:
        """The number of iterations, where it is static."""
        return None

    def run(
        self, eqn: Any, ins: list[Any], free: Sequence[bool], step: Step, skip: int = 0
    ) -> tuple[list[Any], Any]:
        """The loop run again on `ins` with `step` as its body; returns its results and
        what `step` let leave the loop (None if it never ran): stacked over the
        iterations where they are counted, else the last iteration's. Where counted, the
        first `skip` iterations may run the body as it is (no `step`: what leaves the loop
        is zeros there), as a loop of their own."""
        raise NotImplementedError


class ScanRule(LoopRule):
    """``lax.scan``: operands ``consts + carry + xs``, results ``carry + ys``; the values
    that leave the loop are stacked over its iterations (row k from iteration k)."""

    counted = True

    def parts(self, eqn: Any) -> _compat.ScanParts:
        return _compat.scan_parts(eqn)

    def body(self, eqn: Any) -> Any:
        return self.parts(eqn).jaxpr

    def length(self, eqn: Any) -> int | None:
        return self.parts(eqn).length

    def run(
        self, eqn: Any, ins: list[Any], free: Sequence[bool], step: Step, skip: int = 0
    ) -> tuple[list[Any], Any]:
        parts = self.parts(eqn)
        n, nc, nk = parts.length, parts.num_consts, parts.num_carry
        if n == 0:
            return _compat.bind_eqn(eqn, ins), None
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], list(ins[nc + nk :])
        # A row of a stacked variable is a variable of the iteration; the carry is not.
        body_free = [*free[:nc], *[False] * nk, *free[nc + nk :]]
        skip = 0 if parts.reverse else min(max(skip, 0), n)
        ys_before = None
        if skip:  # the first iterations as the model runs them, a loop of their own

            def plain(c: list[Any], i: Any, x: list[Any]) -> Any:
                outs = Evaluator().run(parts.jaxpr, parts.consts, [*consts, *c, *x], None)
                return outs[:nk], outs[nk:]

            before = [x[:skip] for x in xs]
            carry, ys_before = carried_scan(
                plain, carry, before, rows=(0, skip), reverse=False, unroll=parts.unroll
            )
            xs = [x[skip:] for x in xs]

        def one(c: list[Any], i: Any, x: list[Any]) -> Any:
            outs, leaving = step(parts.jaxpr, parts.consts, [*consts, *c, *x], i, body_free)
            return outs[:nk], (outs[nk:], leaving)

        carry, (ys, leaving) = carried_scan(
            one, carry, xs, rows=(skip, n), reverse=parts.reverse, unroll=parts.unroll
        )
        if ys_before is not None:
            ys = [jnp.concatenate([a, b]) for a, b in zip(ys_before, ys, strict=True)]
            leaving = jax.tree_util.tree_map(
                lambda v: jnp.concatenate([jnp.zeros((skip, *v.shape[1:]), v.dtype), v]), leaving
            )
        return [*carry, *ys], leaving


class WhileRule(LoopRule):
    """``lax.while_loop`` (and ``fori_loop`` with traced bounds): operands ``cond consts +
    body consts + carry``, results the carry. The number of iterations is known only when
    the loop runs, so its iterations are not named one by one, and the values that leave
    the loop are the last iteration's (zeros where it ran none)."""

    def body(self, eqn: Any) -> Any:
        return _compat.open_jaxpr(_compat.while_parts(eqn)[1])[0]

    def run(
        self, eqn: Any, ins: list[Any], free: Sequence[bool], step: Step, skip: int = 0
    ) -> tuple[list[Any], Any]:
        cond, body, nc, nb = _compat.while_parts(eqn)
        cond_jaxpr, cond_consts = _compat.open_jaxpr(cond)
        jaxpr, consts = _compat.open_jaxpr(body)
        cond_ins, body_ins, init = ins[:nc], ins[nc : nc + nb], list(ins[nc + nb :])
        body_free = [*free[nc : nc + nb], *[False] * len(init)]

        def one(carry: list[Any], i: Any) -> Any:
            return step(jaxpr, consts, [*body_ins, *carry], i, body_free)

        # The step is traced once, here (its hooks run once); the loop runs what it traced,
        # with the values leaving the loop in its carry.
        traced, shapes = _compat.make_jaxpr(one, init, jnp.int32(0))
        once, once_consts = _compat.open_jaxpr(traced)
        tree = jax.tree_util.tree_structure(shapes)
        again = Evaluator()

        def test(state: Any) -> Any:
            return again.run(cond_jaxpr, cond_consts, [*cond_ins, *state[0]], None)[0]

        def iteration(state: Any) -> Any:
            carry, i, _ = state
            flat = again.run(once, once_consts, [*carry, i], None)
            outs, leaving = jax.tree_util.tree_unflatten(tree, flat)
            return list(outs), i + 1, leaving

        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1])
        carry, _, leaving = jax.lax.while_loop(test, iteration, (init, jnp.int32(0), zeros))
        return list(carry), leaving


LOOP_RULES: dict[str, LoopRule] = {"scan": ScanRule(), "while": WhileRule()}


def loop_rule(eqn: Any) -> LoopRule | None:
    """The rule of a loop equation, or None for any other equation."""
    return LOOP_RULES.get(_compat.primitive_name(eqn))


# --------------------------------------------------------------------------- the evaluator


class Evaluator:
    """Runs jaxprs again in the current trace: one walk, a rule per kind of equation.

    `run` walks a jaxpr in program order and hands each equation to the rule for its
    kind; a subclass overrides the rules where it changes what an equation means:

    * `call_side`: the markers of one side of one module call, together (jaxslice binds
      them one after another);
    * `loop`: a loop with a rule in `LOOP_RULES` (where loops are kept as loops, or split
      into pieces);
    * `call`: a call-like equation whose one body runs once (jit, remat, custom_jvp/vjp);
    * `other`: every other equation (``cond`` and the primitives).

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

    #: the kinds of equations with a rule of their own: ``(find, rule)``, where
    #: ``find(eqn)`` is what the rule is given (a loop's `LoopRule`, a call's body) or None
    KINDS: tuple[tuple[Callable[[Any], Any], str], ...] = (
        (loop_rule, "loop"),
        (_compat.call_body, "call"),
    )

    def eqn(self, eqn: Any, ins: list[Any], env: Env, ctx: Any) -> list[Any]:
        """One equation that is not a marker, by the rule for its kind."""
        for find, rule in self.KINDS:
            found = find(eqn)
            if found is not None:
                return getattr(self, rule)(eqn, found, ins, env, ctx)
        return self.other(eqn, ins, env, ctx)

    def call_side(self, markers: Sequence[Any], env: Env, ctx: Any) -> None:
        """The marker equations of one call side: bound again as they are."""
        for m in markers:
            env.write(m.outvars, _compat.bind_eqn(m, env.reads(m.invars)))

    def loop(self, eqn: Any, rule: LoopRule, ins: list[Any], env: Env, ctx: Any) -> list[Any]:
        """`rule` is the loop's entry in `LOOP_RULES`."""
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
