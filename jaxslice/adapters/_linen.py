"""Flax linen: `model.apply(variables, *inputs, **kwargs)`.

Every submodule method call is marked through `flax.linen.intercept_methods`, the public
hook linen offers for exactly this. The interceptor passes the call's own arguments
through untouched. Calls of the top-level module itself are the model's inputs and
outputs, not boundaries; `setup` is not a call that computes anything.
"""

from __future__ import annotations

from typing import Any

import jax

from .. import _markers
from ._base import Adapter, Split, count_by_prefix, keywords_of, split_kwargs

_SKIPPED_METHODS = frozenset({"setup"})


def is_linen(target: Any) -> bool:
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover - flax is a dependency, but stay importable
        return False
    return isinstance(target, nn.Module)


def _interceptor(next_fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any], context: Any) -> Any:
    module = context.module
    scope = getattr(module, "scope", None)
    path = tuple(scope.path) if scope is not None else ()
    if not path or context.method_name in _SKIPPED_METHODS:
        return next_fun(*args, **kwargs)
    return _markers.call_marked(
        next_fun,
        args,
        kwargs,
        kind="linen",
        path=tuple(str(p) for p in path),
        method=context.method_name,
        module_type=type(module).__name__,
    )


class LinenAdapter(Adapter):
    kind = "linen"

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        if not args:
            from .._errors import UnsupportedTargetError

            raise UnsupportedTargetError(
                "A linen module is sliced with its variables and sample inputs: "
                "js.slice(model, variables, x, end=...). No variables were given; create them "
                "with `variables = model.init(jax.random.key(0), x)`."
            )
        kwargs = dict(kwargs)
        rngs = kwargs.pop("rngs", None)
        mutable = kwargs.pop("mutable", False)
        inputs, mode = split_kwargs(kwargs)
        return Split(
            variables=args[0],
            rngs=rngs,
            args=tuple(args[1:]),
            kwargs=inputs,
            mode=mode,
            mutable=mutable,
        )

    def call(
        self,
        target: Any,
        variables: Any,
        rngs: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        mutable: Any,
    ) -> tuple[Any, Any]:
        import flax.linen as nn

        extra = {} if rngs is None else {"rngs": rngs}
        # Every collection is traced as mutable, whatever the caller asked: modules outside
        # a slice may update state in this mode, and only the slice's own updates matter
        # (the plan returns those asked for, and rejects unasked ones as linen would).
        with nn.intercept_methods(_interceptor):
            return target.apply(variables, *args, **extra, mutable=True, **kwargs)

    def accepted_keywords(self, target: Any) -> set[str] | None:
        method = getattr(type(target), "__call__", None)  # noqa: B004 - the function, not a test
        names = keywords_of(method) if method is not None else None
        return None if names is None else (names - {"self"}) | {"method", "capture_intermediates"}

    def own_parameter_modules(self, variables: Any) -> set[tuple[str, ...]] | None:
        params = variables.get("params", {}) if hasattr(variables, "get") else {}
        return {
            tuple(str(getattr(k, "key", k)) for k in path[:-1])
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        }

    def parameter_counts(self, variables: Any) -> dict[str, int]:
        params = variables.get("params", {}) if hasattr(variables, "get") else {}
        flat = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            flat[keys] = int(getattr(leaf, "size", 1))
        return count_by_prefix(flat)
