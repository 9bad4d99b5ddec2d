"""Whether a traced program keeps the rows of a batch apart.

A tracker pads a batch to a size it has compiled for, with copies of its last input,
which is exact only where each output row depends on its own input row alone: a model
that mixes the rows of a batch (a batch norm in training mode, centring over the batch,
in-batch attention or contrast, a sort over the batch) would give the real rows other
values. `rows_apart` decides this from the traced equations, without running anything.

Each value gets where its rows are: ``None`` (it does not depend on the batched inputs:
parameters, constants, `iota`), an axis ``d`` (element ``[..., i, ...]`` at axis ``d``
depends on input row ``i`` alone), or `MIX` (anything else). Rules follow the batch
axis through elementwise operations, broadcasts, reshapes and transposes, reductions and
contractions over other axes, slices and pads that leave the batch axis whole, gathers
that index per row, convolutions over their batch dimension, calls, loops and
conditionals; an equation a rule does not know (a scatter, a collective, a custom
primitive) mixes whatever batched value it takes, and any equation that reads a random
key gives `MIX` (the bits drawn for row ``i`` depend on how many rows are drawn). The
analysis is conservative: `MIX` where a rule cannot tell.

Sharp edge: a model that reads its batch size as a number (``h / x.shape[0]``) has that
number as a constant of its trace, which no rule can see; such code mixes the rows
through the constant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import _compat

MIX = -1  # the rows of a value are mixed (or it depends on the batch size)

_Rule = Callable[[Any, list[Any], list[Any], list[Any]], list[Any]]


def join(a: Any, b: Any) -> Any:
    """Where the rows of a value are that is either `a` or `b` (a loop's carry)."""
    if a is None or a == b:
        return b
    return a if b is None else MIX


def rows_apart(eqns: Sequence[Any], avals: Any, inputs: dict[int, Any], outputs: Sequence[Any]):
    """Whether each of `outputs`, ``(id, batch axis)`` pairs, has its rows on that axis
    (or does not depend on the batch), after `eqns`, a graph's equations (with `ins`,
    `outs` ids and the `jax_eqn`) in program order; `inputs` maps the ids of the batched
    inputs to their batch axis, `avals` gives each id's abstract value."""
    where: dict[int, Any] = dict(inputs)
    for e in eqns:
        ins = [where.get(i) for i in e.ins]
        outs = axes_of(e.jax_eqn, ins, [avals[i] for i in e.ins], [avals[i] for i in e.outs])
        where.update(zip(e.outs, outs, strict=True))
    return all(where.get(i) in (None, axis) for i, axis in outputs)


def jaxpr_axes(closed: Any, axes: Sequence[Any]) -> list[Any]:
    """Where the rows of a jaxpr's outputs are, given its inputs' (`axes`)."""
    jaxpr, _ = _compat.open_jaxpr(closed)
    where: dict[Any, Any] = dict(zip(jaxpr.invars, axes, strict=True))

    def at(v: Any) -> Any:
        return None if _compat.is_literal(v) else where.get(v)

    for e in jaxpr.eqns:
        ins = [at(v) for v in e.invars]
        avals = [_compat.aval_of(v) for v in e.invars]
        outs = axes_of(e, ins, avals, [v.aval for v in e.outvars])
        where.update(zip(e.outvars, outs, strict=True))
    return [at(v) for v in jaxpr.outvars]


def axes_of(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """Where the rows of an equation's results are, given its operands' (`ins`)."""
    if any(_is_key(a) for a in avals + outs):
        return [MIX] * len(outs)  # random bits: row i's depend on how many are drawn
    body = _compat.call_body(eqn)
    if body is not None:
        return jaxpr_axes(body[0], ins)
    rule = _rules().get(eqn.primitive)
    if rule is not None:
        return rule(eqn, ins, avals, outs)
    if all(a is None for a in ins) and next(_compat.subjaxprs(eqn), None) is None:
        return [None] * len(outs)  # computes on parameters and constants alone
    return [MIX] * len(outs)


def _is_key(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


# --------------------------------------------------------------------------- rules


def _elementwise(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """Each result element from the operands' elements at its place (size-1 axes
    broadcast): batched operands must have the result's rank and whole batch axis."""
    out, axis = outs[0], None
    for a, aval in zip(ins, avals, strict=True):
        if a is None:
            continue
        whole = a != MIX and aval.ndim == out.ndim and aval.shape[a] == out.shape[a]
        if not whole or axis not in (None, a):
            return [MIX] * len(outs)
        axis = a
    return [axis] * len(outs)


def _each(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """Results that are the operands, one to one (an optimization barrier)."""
    return list(ins)


def _moved(axis: Any, f: Callable[[int], Any]) -> Any:
    return axis if axis is None or axis == MIX else f(axis)


def _broadcast(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    dims = eqn.params["broadcast_dimensions"]

    def to(a: int) -> Any:
        return dims[a] if avals[0].shape[a] == outs[0].shape[dims[a]] else MIX

    return [_moved(ins[0], to)] + [MIX] * (len(outs) - 1)


def _reshape(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """A reshape keeps the rows where the sizes before the batch axis multiply to the
    same and the batch axis keeps its size: flat positions then map row to row."""
    old, new = avals[0].shape, outs[0].shape

    def to(a: int) -> Any:
        before = _size(old[:a])
        found = [e for e in range(len(new)) if _size(new[:e]) == before and new[e] == old[a]]
        return found[0] if found and eqn.params.get("dimensions") is None else MIX

    return [_moved(ins[0], to)]


def _size(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def _transpose(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    return [_moved(ins[0], list(eqn.params["permutation"]).index)]


def _dropping(dims: Sequence[int]) -> Callable[[int], Any]:
    """The batch axis after `dims` are removed (mixed if it is one of them)."""
    return lambda a: MIX if a in dims else a - sum(d < a for d in dims)


def _squeeze(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    return [_moved(ins[0], _dropping(eqn.params["dimensions"]))]


def _reduce(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """A reduction (`reduce_sum`, `argmax`, ..., the generic `reduce` over its operands
    then initial values): over other axes than the batch axis."""
    dims = eqn.params["axes"] if "axes" in eqn.params else eqn.params["dimensions"]
    operands = ins[: len(outs)]
    if any(a is not None for a in ins[len(outs) :]):
        return [MIX] * len(outs)
    axis = _common(operands)
    return [_moved(axis, _dropping(dims))] * len(outs)


def _common(axes: Sequence[Any]) -> Any:
    """The one batch axis of `axes` (None where none is batched, MIX where they differ)."""
    found = {a for a in axes if a is not None}
    return found.pop() if len(found) == 1 else None if not found else MIX


def _along(param: str) -> _Rule:
    """An operation along one axis (a cumulative sum, a sort, a split): the rows stay
    apart where that axis is not the batch axis."""

    def rule(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
        along = eqn.params.get(param, avals[0].ndim - 1)  # `top_k`: the last axis
        axis = _common(ins)
        return [MIX if axis == along else axis] * len(outs)

    return rule


def _reversed(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    return [_moved(ins[0], lambda a: MIX if a in eqn.params["dimensions"] else a)]


def _concatenate(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    axis = _common(ins)
    return [MIX if axis == eqn.params["dimension"] else axis]


def _pad(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    config = eqn.params["padding_config"]
    if ins[1] is not None:
        return [MIX]
    return [_moved(ins[0], lambda a: a if tuple(config[a]) == (0, 0, 0) else MIX)]


def _slice(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    strides = eqn.params["strides"]

    def to(a: int) -> Any:
        whole = (
            eqn.params["start_indices"][a] == 0
            and eqn.params["limit_indices"][a] == avals[0].shape[a]
        )
        return a if whole and (strides is None or strides[a] == 1) else MIX

    return [_moved(ins[0], to)]


def _dynamic_slice(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    if any(a is not None for a in ins[1:]):
        return [MIX]  # a start that depends on the batch
    sizes = eqn.params["slice_sizes"]
    return [_moved(ins[0], lambda a: a if sizes[a] == avals[0].shape[a] else MIX)]


def _dynamic_update(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """An update that replaces some rows would give them other values at another size."""
    axis = _common(ins[:2])
    if any(a is not None for a in ins[2:]):
        return [MIX]
    return [_moved(axis, lambda a: a if avals[1].shape[a] == avals[0].shape[a] else MIX)]


def _dot(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """A contraction keeps the rows apart where the batch axis is one of its batch
    dimensions on both sides, or a free dimension of the one batched side."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    left, right = ins
    if MIX in ins:
        return [MIX]
    if left is not None and right is not None:
        paired = left in lb and right in rb and lb.index(left) == rb.index(right)
        return [lb.index(left) if paired else MIX]
    lfree = _free(avals[0].ndim, lc, lb)
    sides = [(left, lc, lb, lfree, len(lb))]
    sides.append((right, rc, rb, _free(avals[1].ndim, rc, rb), len(lb) + len(lfree)))
    for a, contracted, batch, free, offset in sides:
        if a is not None:
            return [_placed(a, contracted, batch, free, offset)]
    return [None]


def _free(ndim: int, contracted: Any, batch: Any) -> list[int]:
    """The free dimensions of one side of a contraction (those of its result's, in order)."""
    return [d for d in range(ndim) if d not in contracted and d not in batch]


def _placed(a: int, contracted: Any, batch: Any, free: list[int], offset: int) -> Any:
    if a in contracted:
        return MIX
    return list(batch).index(a) if a in batch else offset + free.index(a)


def _conv(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    spec = eqn.params["dimension_numbers"]
    if ins[1] is not None or eqn.params["batch_group_count"] != 1:
        return [MIX]
    return [_moved(ins[0], lambda a: spec.out_spec[0] if a == spec.lhs_spec[0] else MIX)]


def _window(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """Pooling (`reduce_window*`, the generic one over its operands then initial
    values): a window one row high, with no stride, padding or dilation on the batch."""
    n = len(outs)
    if any(a is not None for a in ins[n:]):
        return [MIX] * n

    def to(a: int) -> Any:
        ones = (eqn.params["window_dimensions"], eqn.params["window_strides"])
        ones += (eqn.params["base_dilation"], eqn.params["window_dilation"])
        alone = all(p[a] == 1 for p in ones) and tuple(eqn.params["padding"][a]) == (0, 0)
        return a if alone else MIX

    return [_moved(_common(ins[:n]), to)] * n


def _gather(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """A gather keeps the rows apart where it indexes each row on its own: indices
    batched on a batch axis of theirs (not the index vector's), into an operand that
    does not depend on the batch or pairs its rows with them (`operand_batching_dims`),
    or an operand batched on an axis taken whole by indices that do not depend on it."""
    dn = eqn.params["dimension_numbers"]
    (a, b), (operand, indices) = ins, avals
    batch_out = [d for d in range(outs[0].ndim) if d not in dn.offset_dims]
    paired = tuple(getattr(dn, "operand_batching_dims", ()))
    if b == indices.ndim - 1:
        return [MIX]
    if a is None:
        return [_moved(b, batch_out.__getitem__)]
    if a in paired:
        pairs = tuple(dn.start_indices_batching_dims)
        return [batch_out[b] if b == pairs[paired.index(a)] else MIX]
    kept = [d for d in range(operand.ndim) if d not in dn.collapsed_slice_dims + paired]
    offsets = dict(zip(kept, dn.offset_dims, strict=True))  # (MIX is no axis: mixed)
    whole = b is None and a not in dn.start_index_map
    return [
        offsets.get(a, MIX) if whole and eqn.params["slice_sizes"][a] == operand.shape[a] else MIX
    ]


def _scan(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """A scan over another axis than the batch's, its carry's batch axis found by
    iterating the body to a fixed point."""
    parts = _compat.scan_parts(eqn)
    nc, ncarry = parts.num_consts, parts.num_carry
    consts, carry, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
    if any(a in (0, MIX) for a in xs):
        return [MIX] * len(outs)  # scanned over the batch
    xs = [_moved(a, lambda d: d - 1) for a in xs]
    carry, ys = _fixed_point(lambda c: jaxpr_axes(parts.jaxpr, consts + c + xs), carry)
    return carry + [_moved(a, lambda d: d + 1) for a in ys]


def _fixed_point(body: Callable[[list[Any]], list[Any]], carry: list[Any]) -> Any:
    """``(carry, rest)``: a loop body's carry axes joined over iterations until they
    stay, and the body's other results then (each axis changes at most twice)."""
    while True:
        out = body(carry)
        joined = [join(c, o) for c, o in zip(carry, out, strict=False)]
        if joined == carry:
            return carry, out[len(carry) :]
        carry = joined


def _while(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """A while loop whose condition does not depend on the batch (else every row would
    run as long as the slowest)."""
    cond, body, cn, bn = _compat.while_parts(eqn)
    cond_consts, body_consts, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
    carry, _ = _fixed_point(lambda c: jaxpr_axes(body, body_consts + c), carry)
    if jaxpr_axes(cond, cond_consts + carry) != [None]:
        return [MIX] * len(outs)
    return carry


def _cond(eqn: Any, ins: list[Any], avals: list[Any], outs: list[Any]) -> list[Any]:
    """A conditional whose branch does not depend on the batch: any branch's axes."""
    if ins[0] is not None:
        return [MIX] * len(outs)
    found: list[Any] = [None] * len(outs)
    for branch in eqn.params["branches"]:
        found = [join(a, b) for a, b in zip(found, jaxpr_axes(branch, ins[1:]), strict=True)]
    return found


@functools.cache
def _rules() -> dict[Any, _Rule]:
    """The rules by primitive (those this JAX release has), made when first asked for."""
    elementwise = """abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
        cbrt ceil clamp clz complex conj convert_element_type copy cos cosh digamma div eq
        erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igamma_grad_a igammac imag
        integer_pow is_finite le lgamma log log1p logistic lt max min mul mulhi ne neg
        nextafter not or polygamma population_count pow real reduce_precision rem round
        rsqrt select_n sharding_constraint shift_left shift_right_arithmetic
        shift_right_logical sign sin sinh sqrt square sub tan tanh xor zeta
        regularized_incomplete_beta"""
    named: dict[str, _Rule] = dict.fromkeys(elementwise.split(), _elementwise)
    reductions = "argmax argmin reduce reduce_and reduce_max reduce_min reduce_or reduce_prod"
    named.update(dict.fromkeys((reductions + " reduce_sum reduce_xor").split(), _reduce))
    named.update(dict.fromkeys("cumsum cumprod cummax cummin cumlogsumexp".split(), _along("axis")))
    windows = "reduce_window reduce_window_sum reduce_window_max reduce_window_min"
    named.update(dict.fromkeys(windows.split(), _window))
    named.update(
        optimization_barrier=_each,
        broadcast_in_dim=_broadcast,
        reshape=_reshape,
        transpose=_transpose,
        squeeze=_squeeze,
        sort=_along("dimension"),
        split=_along("axis"),
        top_k=_along("axis"),
        rev=_reversed,
        concatenate=_concatenate,
        pad=_pad,
        slice=_slice,
        dynamic_slice=_dynamic_slice,
        dynamic_update_slice=_dynamic_update,
        dot_general=_dot,
        conv_general_dilated=_conv,
        gather=_gather,
        scan=_scan,
        cond=_cond,
    )
    named.update(device_put=_each, stop_gradient=_elementwise)
    named["while"] = _while
    prims = ((getattr(jax.lax, f"{name}_p", None), rule) for name, rule in named.items())
    rules = {p: rule for p, rule in prims if p is not None}
    # `checkpoint_name` (jaxslice's markers too) returns its operand; its primitive is
    # not public, so it is taken from a trace of it.
    named_value = jax.make_jaxpr(lambda x: checkpoint_name(x, "x"))(0.0).eqns[0].primitive
    return rules | {named_value: _elementwise}
