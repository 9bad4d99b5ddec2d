"""The only door to JAX internals.

Everything jaxslice needs from JAX beyond its public API goes through this module, so a
JAX release that moves an internal breaks one file, not the library. The rest of the
package sees jaxprs through the small vocabulary defined here: atoms (variables and
literals), equations, sub-jaxprs, name-stack scopes and a way to re-bind an equation.

Each shim says which JAX versions need it and when it can go. Features are detected,
never compared by version number.

Sharp edges:
  * Boundary markers are `jax.ad_checkpoint.checkpoint_name` equations whose name starts
    with `MARKER_PREFIX`. They are identities JAX knows how to differentiate, batch and
    lower, so a marked model stays an ordinary JAX program; their outputs are never used,
    so they record a value without changing the dataflow.
  * "Call-like" primitives (jit, remat, custom_jvp/vjp calls) may be inlined by jaxslice
    when a boundary inside them is asked for. Loops and conditionals are never inlined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
from jax._src import core as _jax_core
from jax._src import source_info_util as _siu
from jax._src import traceback_util as _tbu
from jax.ad_checkpoint import checkpoint_name

from ._shared import SHARED

MARKER_PREFIX = "jaxslice:"

Var = jex_core.Var
Literal = jex_core.Literal
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn

# JAX <= 0.10 has a DropVar class for unused outputs; later releases may drop it
# (see STYLE.md, "known churn"). Detect it; remove when 0.10 is no longer supported.
_DropVar = getattr(jex_core, "DropVar", None)


def register_frames_exclusion(path: str) -> None:
    """Hides a jaxslice source file from the tracebacks JAX shows users."""
    _tbu.register_exclusion(path)


register_frames_exclusion(__file__)


# --------------------------------------------------------------------------- atoms


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def is_dropvar(atom: Any) -> bool:
    return _DropVar is not None and isinstance(atom, _DropVar)


def literal_value(atom: Any) -> Any:
    return atom.val


def aval_of(atom: Any) -> Any:
    return atom.aval


# --------------------------------------------------------------------------- jaxprs


def make_jaxpr(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """Traces `fn` to a closed jaxpr; returns it with the output pytree of shapes."""
    return jax.make_jaxpr(fn, return_shape=True)(*args)


def open_jaxpr(closed: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a closed jaxpr or a plain jaxpr (which has no consts)."""
    if isinstance(closed, ClosedJaxpr):
        return closed.jaxpr, closed.consts
    return closed, ()


def subjaxprs(eqn: Any) -> Iterator[Any]:
    """Every jaxpr held in an equation's params, found generically."""
    yield from jex_core.jaxprs_in_params(eqn.params)


# Call-like primitives: their body takes the equation's operands one-to-one and returns
# its results one-to-one, so the body can replace the equation. Each entry returns the
# body (a jaxpr or closed jaxpr). Primitives are looked up by object, not by name string.
_CALL_BODIES: dict[Any, Callable[[dict[str, Any]], Any]] = {}


def _register_call(module: str, attrs: Sequence[str], param: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:  # pragma: no cover - depends on the JAX release
        return
    for attr in attrs:
        prim = getattr(mod, attr, None)
        if prim is not None:
            _CALL_BODIES[prim] = lambda params, _p=param: params.get(_p)


# jit: `jit_p` since JAX 0.7, `pjit_p` before (and as an alias in some releases).
_register_call("jax._src.pjit", ("jit_p", "pjit_p"), "jaxpr")
_register_call("jax._src.core", ("closed_call_p", "call_p"), "call_jaxpr")
_register_call("jax._src.ad_checkpoint", ("remat_p",), "jaxpr")
_register_call("jax._src.custom_derivatives", ("custom_jvp_call_p",), "call_jaxpr")
_register_call("jax._src.custom_derivatives", ("custom_vjp_call_p",), "call_jaxpr")


def call_body(eqn: Any) -> Any | None:
    """The body of a call-like equation as (jaxpr, consts), or None if it is not one."""
    getter = _CALL_BODIES.get(eqn.primitive)
    if getter is None:
        return None
    body = getter(eqn.params)
    if body is None:
        return None
    jaxpr, consts = open_jaxpr(body)
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr, consts


def is_loop(eqn: Any) -> bool:
    """Whether an equation is a loop or a conditional: its bodies run many times, or not
    at all (what jaxslice knows of each loop is in `_core.jaxprs.LOOP_RULES`)."""
    return primitive_name(eqn) in ("scan", "while", "cond")


@dataclasses.dataclass(frozen=True)
class ScanParts:
    """A `scan`'s body and layout: operands ``consts + carry + xs``, results ``carry + ys``."""

    jaxpr: Any
    consts: Sequence[Any]
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_parts(eqn: Any) -> ScanParts:
    params = eqn.params
    jaxpr, consts = open_jaxpr(params["jaxpr"])
    return ScanParts(
        jaxpr,
        consts,
        *_scan_layout(params),
        int(params["length"]),
        bool(params["reverse"]),
        params.get("unroll", 1),
    )


def while_parts(eqn: Any) -> tuple[Any, Any, int, int]:
    """A `while`'s ``(cond, body, cond_nconsts, body_nconsts)``, bodies as closed jaxprs;
    its operands are ``cond consts + body consts + carry``, its results the carry."""
    p = eqn.params
    return p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"]


def _scan_layout(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan. JAX <= 0.10 has them as params; later
    releases describe the operands as a flat tree of ``(consts, carry, xs)`` (`ft_in`)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft_in = params["ft_in"]
    consts, carry, _ = getattr(ft_in, "elts", ft_in)  # a tuple of flat trees
    return len(consts), len(carry)  # a flat tree's length is its number of leaves


# Primitives whose cost grows with more than their operands' size: a program without
# them (nor sub-programs) is cheap enough to run in every iteration of a loop.
_CONTRACTIONS = frozenset({jax.lax.dot_general_p, jax.lax.conv_general_dilated_p})


def is_cheap(closed: Any) -> bool:
    """Whether a traced program only maps arrays element by element (and reshapes them):
    no contraction, convolution or sub-program (a loop, a jitted call)."""
    jaxpr, _ = open_jaxpr(closed)
    return not any(
        e.primitive in _CONTRACTIONS or next(subjaxprs(e), None) is not None for e in jaxpr.eqns
    )


def has_effects(eqn: Any) -> bool:
    """Whether an equation has side effects (debug callbacks, io callbacks, ...)."""
    return bool(getattr(eqn, "effects", None))


def is_axis_permutation(eqn: Any) -> bool:
    """Whether an equation only permutes the axes of one array (`jnp.moveaxis`, `.T`)."""
    return eqn.primitive is jex_core.primitives.transpose_p


def made_by_vmap(eqn: Any) -> bool:
    """Whether `jax.vmap` itself made an equation (moving a batch axis to `out_axes`), not
    code running under it: the innermost entry of its name stack is the vmap transform."""
    stack = getattr(eqn.source_info.name_stack, "stack", ())
    last = stack[-1] if stack else None
    return type(last).__name__ == "Transform" and getattr(last, "name", None) == "vmap"


def primitive_name(eqn: Any) -> str:
    return str(eqn.primitive.name)


# --------------------------------------------------------------------------- markers


class _MarkerName(str):
    """A marker's name: a string for JAX, carrying jaxslice's payload for the graph builder.

    JAX keeps equation params as they are (through `jit` caches, `grad`, `vmap` and
    `checkpoint`), so the payload lives exactly as long as the traced program that holds
    the marker, and no global table of records is needed.
    """

    __slots__ = ("payload",)


def bind_marker(value: Any, payload: Any, label: str) -> None:
    """Records `value` in the traced program with `payload`; the value itself is unchanged."""
    name = _MarkerName(MARKER_PREFIX + label)
    name.payload = payload
    checkpoint_name(value, name)


def marker_payload(eqn: Any) -> Any | None:
    """The payload of a jaxslice marker equation, or None for any other equation."""
    if eqn.primitive.name != "name" or len(eqn.invars) != 1:
        return None
    return getattr(eqn.params.get("name"), "payload", None)


def _trace_context_flag() -> Any:
    # A JAX config flag that is part of the trace context, so `jax.jit` keeps separate
    # caches for traces made while jaxslice marks: a jitted function traced before outside
    # jaxslice is traced again (with its markers) instead of being reused unmarked.
    # `bool_state(..., include_in_trace_context=...)` exists in JAX 0.4.36 through 0.12.
    from jax._src import config as _config

    try:
        return _config.bool_state(
            "jaxslice_marking",
            False,
            "Set by jaxslice while it traces a model with boundary markers.",
            include_in_trace_context=True,
        )
    except (AttributeError, TypeError):  # pragma: no cover - other JAX releases
        return None


_MARKING_FLAG = _trace_context_flag()


def _concrete_array_class() -> Any:
    # The class of arrays that hold device buffers (`jax.Array` also matches tracers).
    from jax._src import array

    return array.ArrayImpl


CONCRETE_ARRAY = _concrete_array_class()


def marking_context() -> Any:
    """Context in which JAX's trace caches are separate from unmarked traces."""
    return _MARKING_FLAG(True) if _MARKING_FLAG is not None else contextlib.nullcontext()


# --------------------------------------------------------------------------- name stacks


def eqn_scopes(eqn: Any) -> tuple[str, ...]:
    """The `jax.named_scope` names active at an equation, outermost first."""
    stack = eqn.source_info.name_stack
    out = []
    for entry in getattr(stack, "stack", ()):
        # Transform entries (jvp, vmap, ...) are not user scopes.
        if type(entry).__name__ == "Scope":
            out.append(str(entry.name))
    return tuple(out)


def source_line(eqn: Any) -> str | None:
    """``file:line`` of the user code that produced an equation, when JAX recorded it."""
    try:
        frame = _siu.user_frame(eqn.source_info.traceback)
    except Exception:  # pragma: no cover - best effort; the traceback format is internal
        return None
    return f"{frame.file_name}:{frame.start_line}" if frame is not None else None


# --------------------------------------------------------------------------- evaluation


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Applies an equation's primitive to new operands, as `jax.core.eval_jaxpr` does
    (a TypeError if operands of one holding jaxprs differ from those it was traced for)."""
    if _holds_jaxprs(eqn.primitive, eqn.params):
        _check_operands(eqn, invals)
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), _eqn_ctx(eqn):
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


# JAX checks the operands of a first-order primitive when it is bound, not those of one
# holding jaxprs (jit, custom_jvp, scan, ...): a `jit` traced for (5, 8) and bound to (5, 3)
# fails only when lowered. An edit or a hook that changes a shape is caught here.
_HOLDS_JAXPRS: dict[Any, bool] = {}


def _holds_jaxprs(primitive: Any, params: dict[str, Any]) -> bool:
    found = _HOLDS_JAXPRS.get(primitive)
    if found is None:
        found = _HOLDS_JAXPRS[primitive] = any(True for _ in jex_core.jaxprs_in_params(params))
    return found


def _check_operands(eqn: Any, invals: Sequence[Any]) -> None:
    for i, (var, value) in enumerate(zip(eqn.invars, invals, strict=True)):
        want = var.aval
        if not hasattr(want, "shape"):  # tokens
            continue
        got = jax.typeof(value)
        if got.shape != want.shape or got.dtype != want.dtype:
            raise TypeError(
                f"{primitive_name(eqn)} (from {source_line(eqn) or 'the model'}) was traced "
                f"for operand {i} of type {want.str_short()} and receives {got.str_short()}"
            )


# A jaxpr made of equations already traced, run without binding them again: renamed
# copies of the equations (`JaxprEqn.replace`, JAX >= 0.4.30) in a new closed jaxpr,
# bound as one `jit` equation marked for inlining. Where `jax.jit` traces it, the
# equations join that trace as they are, with no abstract evaluation and no Python per
# equation (`pjit`'s staging rule inlines it). Since JAX 0.12 a `Jaxpr` holds its
# consts and `ClosedJaxpr(jaxpr, consts)` builds one; before, it builds a `ClosedJaxpr`.


def new_var(aval: Any) -> Any:
    return Var(aval)


def renamed_eqn(eqn: Any, invars: Sequence[Any], outvars: Sequence[Any]) -> Any:
    """The equation with other variables (same primitive, params and source info)."""
    return eqn.replace(invars=list(invars), outvars=list(outvars))


def new_closed_jaxpr(
    constvars: Sequence[Any],
    consts: Sequence[Any],
    invars: Sequence[Any],
    outvars: Sequence[Any],
    eqns: Sequence[Any],
) -> Any:
    effects = _jax_core.join_effects(*(e.effects for e in eqns))
    # JAX 0.5 deprecated jaxprs without a DebugInfo.
    info = jex_core.DebugInfo("jit", "jaxslice", (None,) * len(invars), None)
    jaxpr = Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, info)
    return ClosedJaxpr(jaxpr, list(consts))


_JIT = jex_core.primitives.jit_p  # named `pjit_p` before JAX 0.7


@functools.cache
def _jit_params() -> dict[str, Any]:
    """The params of a `jit` of one operand, as `jax.jit` traces it."""
    return dict(jax.make_jaxpr(jax.jit(lambda x: x))(0.0).eqns[0].params)


def call_inlined(closed: Any, args: Sequence[Any]) -> list[Any]:
    """Runs `closed` on `args` as one `jit` equation that the trace calling it inlines.

    The params are those of a `jit` that `jax.jit` itself traced (the mesh, compiler
    options, ...), with the per-operand and per-result ones sized to this call.
    """
    t = _jit_params()
    n, m = len(args), len(open_jaxpr(closed)[0].outvars)
    params = {
        **t,
        "jaxpr": closed,
        "inline": _inline_now(t["inline"]),
        "name": "jaxslice",
        "in_shardings": t["in_shardings"][:1] * n,
        "in_layouts": (None,) * n,
        "donated_invars": (False,) * n,
        "out_shardings": t["out_shardings"][:1] * m,
        "out_layouts": (None,) * m,
    }
    return list(_JIT.bind(*args, **params))


def _inline_now(template: Any) -> Any:
    """The `inline` param that inlines a `jit` while it is traced: True up to JAX 0.11,
    `Inline.JAX_EARLY` since (where True means inlining when lowering)."""
    members = getattr(type(template), "__members__", {})
    return members.get("JAX_EARLY", True)


def _eqn_ctx(eqn: Any) -> Any:
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def current_trace() -> Any:
    """The innermost active trace (an opaque token), or None where it cannot be read.

    `jax._src.core.trace_ctx` exists since JAX 0.4.36 (the "stackless" core).
    """
    ctx = getattr(_jax_core, "trace_ctx", None)
    return getattr(ctx, "trace", None) if ctx is not None else None


def tracing() -> bool:
    """Whether code runs under a JAX transformation (not eagerly)."""
    return not isinstance(current_trace(), _jax_core.EvalTrace)


# --------------------------------------------------------------------------- Flax params

# While linen applies a module to existing variables, `Scope.param` checks each
# parameter's shape against `jax.eval_shape` of its initializer: one trace of the
# initializer per parameter (a ResNet-50 has 161), about half of the time a cold slice
# takes. JAX's own initializers (`jax.nn.initializers`, which Flax re-exports) return
# exactly the shape they are given, so for them the same check reads the shape argument
# instead, raising the same `ScopeParamShapeError`. Any other initializer, or a call
# with keyword arguments, goes through Flax's own check. Flax 0.12 (`Scope.param(name,
# init_fn, *init_args, unbox=True, **init_kwargs)`); the patch is absent where the
# method is not found.
_INITIALIZER_MODULES = frozenset({"jax._src.nn.initializers", "jax.nn.initializers"})


def _given_shape(init_fn: Any, init_args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The shape `init_fn` returns when it is one of JAX's initializers, else None."""
    if getattr(init_fn, "__module__", None) not in _INITIALIZER_MODULES or not init_args:
        return None
    shape = init_args[0]
    if not isinstance(shape, (tuple, list)) or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def _quick_param(original: Callable[..., Any]) -> Callable[..., Any]:
    from flax import errors
    from flax.core import meta

    def param(self: Any, name: str, init_fn: Any, *init_args: Any, unbox: bool = True, **kw: Any):
        shape = _given_shape(init_fn, init_args)
        if shape is None or kw or not self.has_variable("params", name):
            return original(self, name, init_fn, *init_args, unbox=unbox, **kw)
        self.reserve(name, "params")
        value = self.get_variable("params", name)
        value = meta.unbox(value) if unbox else value
        for leaf in jax.tree_util.tree_leaves(value):
            if tuple(jax.numpy.shape(leaf)) != shape:
                raise errors.ScopeParamShapeError(
                    name, self.path_text, jax.numpy.shape(leaf), shape
                )
        return value

    return param


def quick_param_checks() -> contextlib.AbstractContextManager[None]:
    """Inside the block, linen checks the shapes of parameters made by JAX's own
    initializers without tracing them (shared by overlapping traces, `_shared`)."""
    return SHARED.held({"linen Scope.param": _patch_param})


def _patch_param() -> Callable[[], None]:
    from flax.core import scope

    original = scope.Scope.__dict__.get("param")
    if original is None:
        return lambda: None
    scope.Scope.param = _quick_param(original)
    return lambda: setattr(scope.Scope, "param", original)
