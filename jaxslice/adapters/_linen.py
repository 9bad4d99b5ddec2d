"""Flax linen: `model.apply(variables, *inputs, **kwargs)`.

Every submodule method call is marked through `flax.linen.intercept_methods`, the public
hook linen offers for exactly this. The interceptor passes the call's own arguments
through untouched. Calls of the top-level module itself are the model's inputs and
outputs, not boundaries; `setup` is not a call that computes anything.

The model is traced with exactly the `mutable` asked for, since a model may branch on
``self.is_mutable_collection(...)``. Only when the model then updates a collection that
was not asked for (a module outside the slice updating batch statistics, say) is it
traced again with every collection it holds, except ``params``, mutable; the planner
then returns only what was asked for and rejects unasked updates inside the slice, as
linen's ``apply`` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import _compat
from .._core.markers import Origin, call_marked, new_record
from .._errors import LinenNoVariablesError
from .._trees import key_name, path_names
from ._base import (
    Adapter,
    CollectionNodes,
    Split,
    count_by_prefix,
    keywords_of,
    leaf_sizes,
    split_kwargs,
)

_SKIPPED_METHODS = frozenset({"setup"})

RNG_HINT = (
    "\nThe model draws random numbers in this mode: pass the keys it needs, e.g. "
    "`sub.apply(sub.variables, x, train=True, rngs={'dropout': key})` (or `rngs=` to "
    "js.slice)."
)


def _module_path(module: Any) -> tuple[str, ...]:
    """A module's path: its scope's path, where its variables are keyed.

    A module that uses another module's scope (`nn.share_scope`: gemma's feed-forward
    layers and their einsums, a LoRA wrapper around a Dense) is named by where it sits
    in the module tree instead (its parent's path and its own name), so the two calls
    are two boundaries a user can tell apart, not one module called twice.
    """
    scope = getattr(module, "scope", None)
    path = tuple(str(p) for p in scope.path) if scope is not None else ()
    name, parent = getattr(module, "name", None), getattr(module, "parent", None)
    if not path or name is None or name == path[-1] or getattr(parent, "scope", None) is None:
        return path
    return (*_module_path(parent), str(name))


class _Interceptor:
    """Marks the submodule calls of one call of the model (`nn.intercept_methods`).

    A bound submodule applied on its own, ``self.head.apply({"params": ...}, h)`` (how
    HF Flax models apply a tied output layer), runs in a scope of its own whose path is
    ``()``. It is named by where it is called: the path of the call under way and its own
    name (``head`` in the model's own call, ``block/head`` in block's), and its own
    submodules below that. Its scope's root is not the model's, which is how it differs
    from the model's own methods (path ``()`` too). A lifted transform's scope keeps its
    path; its modules keep the place of the call they run in.
    """

    def __init__(self) -> None:
        # id of a root scope -> (the scope, the path its modules' paths are under)
        self.roots: dict[int, tuple[Any, tuple[str, ...]]] = {}
        self.under_way: list[tuple[tuple[str, ...], tuple[str, ...]]] = []  # (path, root's)

    def path(self, module: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """A module's path in the model, and the path its scope's root sits at."""
        own = _module_path(module)
        scope = getattr(module, "scope", None)
        if scope is None:
            return own, ()
        root = scope.root
        found = self.roots.get(id(root))
        if found is None:
            where, above = self.under_way[-1] if self.under_way else ((), ())
            name = getattr(module, "name", None)
            applied = not own and name is not None and bool(self.under_way)
            found = self.roots[id(root)] = (root, (*where, str(name)) if applied else above)
        return (*found[1], *own), found[1]

    def intercept(
        self, next_fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        if context.method_name in _SKIPPED_METHODS:
            return next_fun(*args, **kwargs)
        module = context.module
        path, above = self.path(module)
        self.under_way.append((path, above))
        try:
            if not path:  # the model's own call
                return next_fun(*args, **kwargs)
            record = new_record(
                origin=Origin.MODULE,
                path=path,
                method=context.method_name,
                module_type=type(module).__name__,
            )
            return call_marked(next_fun, args, kwargs, record)
        finally:
            self.under_way.pop()


def _params(variables: Any) -> Any:
    return variables.get("params", {}) if isinstance(variables, Mapping) else {}


class LinenAdapter(CollectionNodes, Adapter):
    has_collections = True
    model_class = ("flax.linen", "Module")

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        if not args:
            raise LinenNoVariablesError()
        kwargs = dict(kwargs)
        rngs = kwargs.pop("rngs", None)
        mutable = kwargs.pop("mutable", False)
        inputs, mode = split_kwargs(kwargs)
        return Split(args[0], rngs, tuple(args[1:]), inputs, mode, mutable)

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        import flax.linen as nn

        extra = {} if call.rngs is None else {"rngs": call.rngs}
        # A bound method, not the instance: Python calls it without a C stack frame per
        # nested module (a model 150 modules deep stays within the recursion limits).
        with nn.intercept_methods(_Interceptor().intercept), _compat.quick_param_checks():
            result = target.apply(
                call.variables, *call.args, **extra, mutable=call.mutable, **call.kwargs
            )
        return result if call.mutable else (result, None)

    def can_stop_early(self, split: Split) -> bool:
        return not split.mutable  # updated state is returned only at the end

    def wider_mutable(self, split: Split, error: BaseException | None) -> Any:
        import flax.errors

        if not isinstance(error, flax.errors.ModifyScopeVariableError):
            return None
        asked = split.mutable
        if asked is True:
            return None
        asked = [asked] if isinstance(asked, str) else list(asked or [])
        held = [str(c) for c in split.variables if c != "params"]
        wider = sorted(set(asked) | set(held))
        return None if wider == sorted(asked) else wider

    def error_hint(self, error: BaseException) -> str:
        import flax.errors

        return RNG_HINT if isinstance(error, flax.errors.InvalidRngError) else ""

    def state_owner(self, path: tuple[Any, ...]) -> tuple[str, ...]:
        return path_names(path)[1:]  # after the collection name

    def accepted_keywords(self, target: Any) -> set[str] | None:
        method = getattr(type(target), "__call__", None)  # noqa: B004 - the function, not a test
        names = keywords_of(method) if method is not None else None
        return None if names is None else (names - {"self"}) | {"method", "capture_intermediates"}

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        return {path[:-1] for path in leaf_sizes(_params(variables))}

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        return count_by_prefix(leaf_sizes(_params(variables)))

    def variable_names(self, variables: Any) -> set[str]:
        params = _params(variables)
        return {str(key_name(k)) for k in params} if isinstance(params, Mapping) else set()
