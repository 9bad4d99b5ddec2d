"""Haiku: ``js.slice(f, params, *inputs)`` for ``f = hk.transform(...)``, and
``js.slice(f, params, state, *inputs)`` for ``hk.transform_with_state``.

Every module method call is marked through `hk.intercept_methods`, Haiku's public hook
for exactly this. A boundary's name is the module's `module_name`, exactly as Haiku keys
its parameters (``res_net18/~/block_group_1``; ``path.method`` for methods other than
``__call__``). The transformed function itself is no boundary. Modules of a lifted
function (`hk.layer_stack`, `hk.lift`) are named under the lift's name, as Haiku keys
their parameters (``stack/lin``; ``stack/lin[2]`` in a layer's scan iteration), and the
lift itself is no boundary (`_Interceptor`).

Inside, variables are held as collections, as linen's are: ``{"params": params}``,
plus ``"state"`` for a stateful function (traced with ``mutable=["state"]`` unless told
otherwise, since Haiku's ``apply`` always returns the new state). `rngs` is the one key
Haiku's ``apply`` takes (none for `hk.without_apply_rng`). What users get is a
`HaikuSliced` (``_haiku_slice.py``): that engine behind Haiku's own conventions, Haiku
dicts and ``apply(params, [state,] rng, *inputs)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Mapping
from typing import Any

from .._core.markers import Origin, call_marked, new_record
from .._errors import HaikuNoParamsError, HaikuRngKeywordError
from .._trees import path_names
from ._base import Adapter, NewModule, Split, count_by_prefix, keywords_of, split_kwargs

_SKIPPED_METHODS = frozenset({"__init__"})

RNG_HINT = (
    "\nThe function draws random numbers (`hk.next_rng_key`) in this mode, also where the "
    "slice does not: pass the key Haiku's `apply` takes, e.g. `sub(x, rngs=key)` (or "
    "`rngs=key` to js.slice)."
)
#: the arguments Haiku's ``apply`` adds in front of the function's own
_APPLY_ARGUMENTS = frozenset({"params", "param", "state", "rng"})


class _Interceptor:
    """Marks the module calls of one trace (an `hk.intercept_methods` interceptor).

    A lifted transform (`hk.layer_stack`, `hk.lift`) applies an inner transformed
    function whose modules Haiku names from that function alone (``lin``), while the
    outer params dict keys them under the lift's name (``__layer_stack_no_per_layer/lin``).
    The lift itself is a module whose call only hands the inner function its parameters:
    that call is no boundary, but its name prefixes the inner function's modules. An
    inner transform is known by its parameters: during ``apply`` they are the lift's
    result, keyed without the prefix. Sharp edge: a transparent lift whose
    iterations Haiku keys under names of their own (a ``transparency_map``) is not
    recognised, and its modules keep the inner names.
    """

    def __init__(self) -> None:
        # per lift met: (its inner params and state keys, their path and scope prefixes)
        self.lifts: list[tuple[Any, _Prefix]] = []

    def __call__(
        self, next_fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        if context.method_name in _SKIPPED_METHODS:
            return next_fun(*args, **kwargs)
        module = context.module
        outer = self._prefix()
        if _is_lift(module):
            result = next_fun(*args, **kwargs)
            self._note_lift(module, result, outer)
            return result
        own = _module_path(module.module_name)
        method = context.method_name
        # Haiku runs each method under `jax.named_call` of the module's local name (and of
        # the method's, for one other than ``__call__``).
        scope = (*outer.scope, *_scope(own), *([method] if method != "__call__" else []))
        record = new_record(
            origin=Origin.MODULE,
            path=(*outer.path, *own),
            method=method,
            module_type=type(module).__name__,
            scope=scope,
        )
        return call_marked(next_fun, args, kwargs, record)

    def _prefix(self) -> _Prefix:
        """The prefixes of the transform running now: a lift's, if its params are the
        lift's result (the last such lift met), else none."""
        if not self.lifts:  # no lift met yet: no need to read the params
            return _NO_PREFIX
        keys = _frame_keys()
        return next((p for k, p in reversed(self.lifts) if k == keys), _NO_PREFIX)

    def _note_lift(self, module: Any, result: Any, outer: _Prefix) -> None:
        params, state = result
        keys = (frozenset(params), frozenset(state))
        if params or state:  # a lift of nothing keys nothing
            lifted = _module_path(module.prefix_name) if module.prefix_name else ()
            # its inner function runs where the lift was called: in the lift's caller
            scope = _scope(_module_path(module.module_name))[:-1]
            self.lifts.append((keys, _Prefix((*outer.path, *lifted), (*outer.scope, *scope))))


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """What a transform's module names and `jax.named_call` scopes are seen under."""

    path: tuple[str, ...] = ()
    scope: tuple[str, ...] = ()


_NO_PREFIX = _Prefix()


def _is_lift(module: Any) -> bool:
    """Whether `module` is Haiku's `LiftingModule` (not exported: known by its type's name)."""
    return any(c.__name__ == "LiftingModuleType" for c in type(module).__mro__)


def _frame_keys() -> Any:
    """The module names keying the running transform's params and state."""
    import haiku as hk

    return frozenset(hk.experimental.get_params()), frozenset(hk.experimental.get_current_state())


def _scope(path: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(p for p in path if p != "~")


def haiku_interception() -> Any:
    """A context in which Haiku module calls are marked: a plain function may apply a
    transformed function (``f.apply(params, x)``), whose modules are boundaries under
    Haiku's names. Nothing to do where Haiku is not imported."""
    hk = sys.modules.get("haiku")
    return contextlib.nullcontext() if hk is None else hk.intercept_methods(_Interceptor())


def _module_path(module_name: str) -> tuple[str, ...]:
    """A Haiku module name as a path: ``"mlp/~/linear_0" -> ("mlp", "~", "linear_0")``."""
    return tuple(module_name.split("/"))


def _takes_rng(target: Any) -> bool:
    try:
        return "rng" in inspect.signature(target.apply).parameters
    except (TypeError, ValueError):  # pragma: no cover - apply is a plain function
        return True


def _param_sizes(variables: Any) -> dict[tuple[str, ...], int]:
    """``{module path + (name,): size}`` of the parameters (Haiku's flat module keys)."""
    params = variables.get("params", {}) if isinstance(variables, Mapping) else {}
    return {
        (*_module_path(str(module)), str(name)): int(getattr(value, "size", 1))
        for module, leaves in params.items()
        for name, value in leaves.items()
    }


def haiku_parameter_counts(params: Any) -> dict[str, int]:
    """Parameter counts per module path of a Haiku params dict applied by a plain
    function (``{}`` where Haiku is not imported or `params` is no such dict)."""
    if "haiku" not in sys.modules or not isinstance(params, Mapping):
        return {}
    if not all(isinstance(v, Mapping) for v in params.values()):
        return {}
    return count_by_prefix(_param_sizes({"params": params}))


class HaikuAdapter(Adapter):
    has_collections = True
    state_includes_variables = True  # apply returns every state entry, changed or not
    always_returns_state = True

    @classmethod
    def accepts(cls, target: Any) -> bool:
        hk = sys.modules.get("haiku")
        return hk is not None and isinstance(target, (hk.Transformed, hk.TransformedWithState))

    @staticmethod
    def _stateful(target: Any) -> bool:
        import haiku as hk

        return isinstance(target, hk.TransformedWithState)

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        stateful = self._stateful(target)
        given = 2 if stateful else 1
        if len(args) < given:
            raise HaikuNoParamsError.of(stateful)
        if "rng" in kwargs:
            raise HaikuRngKeywordError()
        kwargs = dict(kwargs)
        rngs = kwargs.pop("rngs", None)
        # Haiku's `apply` of a stateful transform always returns the new state.
        mutable = kwargs.pop("mutable", ["state"] if stateful else False)
        variables = {"params": args[0], "state": args[1]} if stateful else {"params": args[0]}
        inputs, mode = split_kwargs(kwargs)
        return Split(variables, rngs, tuple(args[given:]), inputs, mode, mutable)

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        import haiku as hk

        variables = call.variables
        given = [variables["params"]]
        if self._stateful(target):
            given.append(variables["state"])
        if _takes_rng(target):
            given.append(call.rngs)
        with hk.intercept_methods(_Interceptor()):
            result = target.apply(*given, *call.args, **call.kwargs)
        if not self._stateful(target):
            return result, None
        out, state = result
        return out, {"state": state}

    def sliced_view(self, target: Any, sliced: Any) -> Any:
        from ._haiku_slice import HaikuSliced

        return HaikuSliced(sliced, stateful=self._stateful(target), takes_rng=_takes_rng(target))

    def edited_view(self, target: Any, edited: Any) -> Any:
        from ._haiku_slice import HaikuEdited  # a `HaikuSliced`, as a slice of the model is

        stateful, takes_rng = self._stateful(target), _takes_rng(target)
        return HaikuEdited(edited.sliced, stateful=stateful, takes_rng=takes_rng)

    def accepted_keywords(self, target: Any) -> set[str] | None:
        names = keywords_of(target.apply)
        return None if names is None else names - _APPLY_ARGUMENTS

    def error_hint(self, error: BaseException) -> str:
        # Haiku does not export the class: it is known by its name.
        return RNG_HINT if type(error).__name__ == "MissingRNGError" else ""

    def can_stop_early(self, split: Split) -> bool:
        return "state" not in split.variables  # the new state is returned only at the end

    def state_owner(self, path: tuple[Any, ...]) -> tuple[str, ...]:
        names = path_names(path)  # ("state", module name, entry)
        return _module_path(names[1]) if len(names) > 1 else ()

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        return {path[:-1] for path in _param_sizes(variables)}

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        return count_by_prefix(_param_sizes(variables))

    def edit_node(self, obj: Any, name: str, args: tuple[Any, ...]) -> NewModule | None:
        """A function that builds Haiku modules: transformed, with its modules' parameters
        under the node's name (``adapter/linear``). A function without any is plain."""
        import haiku as hk
        import jax

        if not callable(obj) or isinstance(obj, (hk.Module, hk.Transformed)):
            return None

        def scoped(*a: Any) -> Any:
            with hk.name_scope(name):
                return obj(*a)

        node = hk.without_apply_rng(hk.transform(scoped))
        shapes = jax.eval_shape(node.init, jax.random.key(0), *args)
        if not shapes:
            return None
        return NewModule(
            lambda v, *a: node.apply(v["params"], *a),
            init=lambda key: {"params": node.init(key, *args)},
        )

    # A new node's parameters are Haiku modules named under the node: ``name/...``.
    def node_of(self, path: tuple[Any, ...]) -> str | None:
        names = path_names(path)
        return names[1].split("/")[0] if len(names) > 1 else None

    def with_node(self, variables: dict[Any, Any], name: str, node_variables: Any) -> None:
        for collection, values in node_variables.items():
            variables.setdefault(collection, {}).update(values)

    def node_variables(self, variables: Any, name: str, node_variables: Any) -> Any:
        return {c: {k: variables[c][k] for k in v} for c, v in node_variables.items()}

    def variable_names(self, variables: Any) -> set[str]:
        params = variables.get("params", {}) if isinstance(variables, Mapping) else {}
        return {str(module).split("/")[0] for module in params}
