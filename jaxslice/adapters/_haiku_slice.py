"""`HaikuSliced`: a slice of an `hk.Transformed` as Haiku users hold one.

Haiku keeps parameters and state as two flat dicts keyed by module name
(``{"mlp/~/linear_0": {"w": ..., "b": ...}}``) and calls ``apply(params, [state,] rng,
*inputs)``, in that order, for the kind of transform. A slice follows the same rules:
``sub.params`` and ``sub.state`` are Haiku dicts holding the model's own arrays, and
``sub.apply`` takes them in Haiku's order and, for a stateful transform, always returns
``(outputs, new_state)``. The engine is the `js.Sliced` of the same program
(``sub.sliced``), whose variables are the collections ``{"params": ..., "state": ...}``.
"""

from __future__ import annotations

from typing import Any

from .._errors import HaikuApplyArgumentsError, HaikuNoRngError, HaikuUnusedParamsError
from .._view import ProgramView


class HaikuSliced(ProgramView):
    """A slice of a Haiku transformed function, called as Haiku's own ``apply`` is.

    Attributes:
      params: the parameters the slice reads, as a Haiku params dict (module name ->
        parameter name -> array), the model's own arrays.
      state: the state it reads (``{}`` for a transform without state).
      sliced: the `js.Sliced` engine (linen-style variables ``{"params", "state"}``).

    >>> import jax, jax.numpy as jnp, haiku as hk, jaxslice as js
    >>> f = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([4, 2], name="mlp")(x)))
    >>> x = jnp.ones((3, 5))
    >>> params = f.init(jax.random.key(0), x)
    >>> head = js.slice(f, params, x, start="mlp/~/linear_1")
    >>> list(head.params)
    ['mlp/~/linear_1']
    >>> head.apply(head.params, jnp.ones((3, 4))).shape
    (3, 2)
    """

    def __init__(self, sliced: Any, *, stateful: bool, takes_rng: bool):
        self.sliced = sliced
        self._stateful = stateful
        self._takes_rng = takes_rng

    def _slice_program(self) -> Any:
        return self.sliced._slice_program()

    @property
    def params(self) -> dict[str, Any]:
        return self.sliced.variables.get("params", {})

    @property
    def state(self) -> dict[str, Any]:
        return self.sliced.variables.get("state", {})

    def apply(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs the slice: ``apply(params, [state,] [rng,] *inputs, **kwargs)`` in the
        argument order of the transform's own ``apply``.

        Args:
          params: parameters with the structure of ``sub.params`` (e.g. trained ones).
          *args: ``state`` first for `hk.transform_with_state`, then ``rng`` (a key or
            None) unless the transform is `hk.without_apply_rng`, then the slice's inputs,
            one per start argument (see `js.slice`).
          **kwargs: keyword inputs of the start boundaries and mode keywords (such as
            ``is_training=True``), as given to the model.

        Returns:
          The values at ``end``; for a stateful transform ``(values, new_state)``, where
          `new_state` is the given state with the slice's updates. The state passed may
          hold more than ``sub.state`` (the model's whole state, as Haiku's ``apply``
          takes it): the slice reads its part and returns all of it, updated, so
          ``out, state = sub.apply(params, state, rng, x)`` can run in a loop.

        Raises:
          VariablesMismatchError: if `params` or `state` do not have the paths, shapes
            and dtypes of ``sub.params`` and ``sub.state``.
        """
        given = int(self._stateful) + int(self._takes_rng)
        if len(args) < given:
            order = ["params", *(["state"] * self._stateful), *(["rng"] * self._takes_rng)]
            raise HaikuApplyArgumentsError(order=", ".join(order), got=len(args) + 1)
        state = args[0] if self._stateful else None
        rng = args[given - 1] if self._takes_rng else None
        inputs = args[given:]
        if not self._stateful:
            return self.sliced.apply({"params": params}, *inputs, rngs=rng, **kwargs)
        extra = sorted(set(params) - set(self.params)) if isinstance(params, dict) else []
        if extra:
            raise HaikuUnusedParamsError(extra=extra)
        # The state may hold more than the slice reads (the model's whole state, or one
        # returned by an earlier call, which has the entries the slice writes too).
        out, updates = self._slice_program().apply(
            {"params": params, "state": state}, inputs, kwargs, rng, ["state"], strict=False
        )
        new_state = {module: dict(entries) for module, entries in state.items()}
        for module, entries in updates.get("state", {}).items():
            new_state.setdefault(module, {}).update(entries)
        return out, new_state

    def __call__(self, *inputs: Any, rng: Any = None, **kwargs: Any) -> Any:
        """``sub.apply(sub.params, [sub.state,] [rng,] *inputs, **kwargs)``."""
        given = [self.state] if self._stateful else []
        if self._takes_rng:
            given.append(rng)
        elif rng is not None:
            raise HaikuNoRngError()
        return self.apply(self.params, *given, *inputs, **kwargs)

    def extract(self, params: Any, state: Any = None) -> Any:
        """The slice's part of a model's Haiku params (and, given, state): ``params`` or
        ``(params, state)``, as `merge` takes them back."""
        full = {"params": params} if state is None else {"params": params, "state": state}
        part = self.sliced.extract(full)
        if state is None:
            return part.get("params", {})
        return part.get("params", {}), part.get("state", {})

    def merge(self, params: Any, new_params: Any) -> dict[str, Any]:
        """The model's Haiku params with the slice's entries replaced by `new_params`
        (the fine-tune-then-write-back round trip); other entries are the same objects.

        Raises:
          VariablesMismatchError: if `new_params` holds a module or parameter the model
            does not have, or a leaf of another shape or dtype than the model's.
        """
        return self.sliced.merge({"params": params}, {"params": new_params})["params"]

    def merge_state(self, state: Any, new_state: Any) -> dict[str, Any]:
        """The model's Haiku state with the slice's entries replaced by `new_state` (as
        returned by `apply`)."""
        return self.sliced.merge({"state": state}, {"state": new_state})["state"]

    def export(self, **kwargs: Any) -> Any:
        """The slice as a `jax.export.Exported` (see `js.Sliced.export`); with
        ``variables_as_input=True`` it takes ``{"params": ..., "state": ...}``."""
        return self.sliced.export(**kwargs)

    def __repr__(self) -> str:
        return f"HaikuSliced({self._slice_program().summary()})"

    def __reduce__(self) -> Any:
        return self.sliced.__reduce__()


class HaikuEdited(HaikuSliced):
    """An edited `hk.Transformed`, applied as Haiku's own ``apply`` is (a `HaikuSliced`).

    ``edited.params`` holds the model's parameters and the new nodes', whose modules are
    keyed under the node's name (``adapter/linear``, as `hk.name_scope` keys them).
    `merge` and `merge_state` write trained parameters and state back to the model,
    leaving the nodes' out, and `nodes` gives the nodes' parameters apart.

    >>> import jax, jax.numpy as jnp, haiku as hk, jaxslice as js
    >>> f = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(2, name="head")(x)))
    >>> x = jnp.ones((3, 5))
    >>> params = f.init(jax.random.key(0), x)
    >>> g = js.edit(f, params, x)
    >>> edited = g.insert_after("head", lambda h: hk.Linear(2, name="lin")(h),
    ...                         key=jax.random.key(1), name="adapter").build()
    >>> sorted(edited.params)
    ['adapter/lin', 'head']
    >>> list(edited.merge(params, edited.params)), list(edited.nodes(edited.params))
    (['head'], ['adapter/lin'])
    """

    def merge(self, params: Any, new_params: Any) -> dict[str, Any]:
        """The model's Haiku params with its entries replaced from `new_params` (the
        structure of ``edited.params``, or a part of it), the nodes' left out: what the
        model needs to run as trained, without the edits. Other entries are the same
        objects.

        Raises:
          VariablesMismatchError: if the model's entries of `new_params` hold a module or
            parameter the model does not have, or a leaf of another shape or dtype.
        """
        return super().merge(params, new_params)

    def nodes(self, params: Any = None) -> dict[str, Any]:
        """The new nodes' parameters apart from the model's, as a Haiku params dict
        keyed as in ``edited.params`` (``adapter/lin``); entries `params` (default:
        ``edited.params``) lacks are taken from ``edited.params``."""
        given = self.params if params is None else params
        nodes = self.sliced.nodes({"params": given})
        return {k: v for node in nodes.values() for k, v in node.get("params", {}).items()}
