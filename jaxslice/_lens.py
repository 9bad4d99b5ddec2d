"""`js.lens`: one compiled model for a whole family of interventions.

A `Lens` runs the model through the one evaluator (`_core.evaluate`) with a hook at each
of its *sites* (array values at named boundaries). What happens at a site is given when
the lens is called, as plain arrays: ``add`` a vector, ``scale`` (0 ablates), ``set`` a
value (where a mask says), and ``read`` (the cache). Which iteration of a scanned stack
an intervention acts on (``layers[3]``) is a traced index, so a sweep over layers,
positions or heads is one compiled program: the lens compiles once per *structure* of
its call (which sites get which kind of intervention, the shapes of what is given, what
is read) and input shape, never per iteration or per value.

Sites are array leaves. A name without a leaf suffix addresses the first array leaf of
the value there (the hidden state of a block that returns ``(h, aux)``); ``name#k``
addresses leaf k (in `jax.tree_util` order). Given values broadcast against the site's
value with NumPy's rules; at an every-iteration name (``layers[:]``) against the stacked
value (a leading axis per loop), so a vector of shape ``(d,)`` is added in every layer
and one of shape ``(L, 1, 1, d)`` gives each layer its own.

A loop stays one loop (hooks run once, on one iteration's values, selecting their
iteration by its traced index). `sweep` runs a batch of interventions that all act at or
after iteration k of a scan: the iterations before k run once, as a scan of their own,
and only the rest runs per intervention (vmapped, or on CPU a few at a time in one
`lax.map`, out of which XLA lifts the shared iterations).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from . import _compat
from ._core.checks import values_at
from ._core.evaluate import evaluate as evaluate_graph
from ._core.markers import OUTPUT
from ._core.program import SliceProgram
from ._core.selection import resolver_of
from ._core.variables import merge as merge_variables
from ._errors import (
    LensBatchSizeError,
    LensKindError,
    LensNotPicklableError,
    LensSitesSpecError,
    LensSweepAxisError,
    LensSweepEmptyError,
)
from ._interpreter import variable_values
from ._lens_run import LensHooks, first_row, intervention, placed, probe
from ._lens_sites import Site, Sites, counted
from ._trees import nest
from .adapters import adapter_for

KINDS = ("scale", "add", "set")  # applied at a site in this order
_LIVE = object()  # stands for the variables a model holds, read at each call
_WHOLE = object()  # a read of every call's whole output (`whole_values`)


class Lens:
    """A model with interventions and reads at its sites as call-time arguments.

    Make one with `js.lens`. Calling it runs the model; the keywords `add`, `scale` and
    `set` change values at sites, and `read` returns values. Each takes site names (or
    one iteration of a site inside a scan, ``layers[3]``) and arrays:

    * ``add={name: v}``: ``h + v``; ``scale={name: s}``: ``h * s`` (0 ablates);
    * ``set={name: v}``: ``v`` in place of ``h``; ``set={name: (v, mask)}``: ``v`` where
      the boolean `mask` is true;
    * ``read=True`` (every site), a name or a list of names: returns ``(output, cache)`` with
      ``cache[name]`` the value there after the interventions (stacked over the
      iterations at a ``[:]`` name), shaped so that it can be given to `set`.

    Values broadcast against the site's value with NumPy's rules (at a ``[:]`` name
    against the stacked value); `scale` and `add` compute in the dtype the value and the
    site's promote to and cast back to the site's (0.5 halves an integer site), and a
    complex value at a real site is an error. At one site, `scale` applies first, then `add`, then
    `set`. The lens is an ordinary JAX function of the given arrays: ``jax.grad`` with
    respect to an `add` gives attribution at every site at once, ``jax.vmap`` a batch of
    patches.

    The program is compiled once per input shape and *structure* of a call: which sites
    get which kinds of intervention, the shapes of the values given, what is read. The
    iteration a name picks (``layers[3]``) is data, so a sweep over layers compiles once.

    Attributes:
      sites: ``{name: Site}``, the sites in call order, with the shapes of the inputs
        the lens was made with. A call with inputs of other shapes resolves its names
        against its own trace: ``layers[-1]`` is its last iteration, a ``[:]`` value has a
        row per iteration of its scans, and only the sites it names must exist there.
    """

    def __init__(
        self,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        sites: Any,
        *,
        keep_variables: bool = True,
    ):
        """`keep_variables`: whether calls without variables use the model's given here
        (`js.intermediates`, which passes them at each call, keeps only their shapes)."""
        adapter = adapter_for(target)
        if adapter.holds_values:  # traced with the state a call updates (`_write_back`)
            kwargs = {"mutable": True, **kwargs}
        self._program = program = SliceProgram.build(target, args, kwargs, adapter=adapter)
        self._target = target
        self._adapter = adapter
        self._rngs = program.base.traced.split.rngs
        # The lens runs the whole graph, so it reads every variable the model has, not
        # only those its output needs (a program keeps those alone); a model that holds
        # their values (Keras) is read at each call.
        given = None if adapter.holds_variables else adapter.split(target, args, kwargs).variables
        self._view = None if given is None else adapter.variables_view(target, given)
        if self._view is not None:
            given = None
        self._variables = given if keep_variables else None
        graph = program.base.traced.graph
        own = _LIVE if adapter.holds_variables or self._view is not None else given
        seen = probe(graph, self._values_of(program.base, own, self._rngs))
        self._sites = Sites.of(resolver_of(graph), sites, seen)
        self.sites: dict[str, Site] = self._sites.by_name
        #: every call's output the hooks see (in counted loops), for `whole_values`
        self._outputs = [w for w in seen if w.side == OUTPUT and counted(w)]

    # ------------------------------------------------------------------ calls

    def __call__(
        self,
        *inputs: Any,
        add: Mapping[str, Any] | None = None,
        scale: Mapping[str, Any] | None = None,
        set: Mapping[str, Any] | None = None,  # noqa: A002 (the word users expect)
        read: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Runs the model on `inputs` (and keyword inputs, or a new mode such as
        ``train=True``; for linen and Haiku, this call's random keys as ``rngs=``) with
        the interventions given (see `Lens`). On a model that holds its state (NNX,
        Keras), a call updates it as the model's own call does (batch statistics, the
        random stream); a sweep, and a call inside a JAX transformation, do not.

        Returns:
          The model's output; with `read`, ``(output, cache)``.
        """
        return self.apply(self._own(), *inputs, add=add, scale=scale, set=set, read=read, **kwargs)

    def apply(
        self,
        variables: Any,
        *inputs: Any,
        add: Mapping[str, Any] | None = None,
        scale: Mapping[str, Any] | None = None,
        set: Mapping[str, Any] | None = None,  # noqa: A002
        read: Any = None,
        **kwargs: Any,
    ) -> Any:
        """`__call__` with the given variables (of the structure of `variables`)."""
        given = {"scale": scale, "add": add, "set": set}
        out, cache = self._call(variables, inputs, kwargs, given, read, None)
        return out if read is None or read is False else (out, cache)

    def sweep(
        self,
        *inputs: Any,
        add: Mapping[str, Any] | None = None,
        scale: Mapping[str, Any] | None = None,
        set: Mapping[str, Any] | None = None,  # noqa: A002
        read: Any = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """A batch of interventions in one call: every value given (and mask) has a
        leading axis, one entry per run, of the same length n; returns the n outputs
        stacked (and with `read`, the caches stacked).

        Unlike ``jax.vmap`` over `__call__`, a sweep whose interventions and reads all
        sit at or after iteration k of a scan runs the iterations before k once, for
        all n runs: a sweep of patches at ``layers[12]`` of 24 runs 12 + n x 12
        iterations, not n x 24. That k is part of what the sweep is compiled for (sweeps
        at another first iteration compile again).

        Args:
          batch_size: how many runs go through the model at once, a non-negative int
            (one compiled loop over chunks of that many, `jax.lax.map`; 0: all of them);
            default: all of them on an accelerator, 4 on CPU, where a batch n times
            larger runs slower per input than n small ones.

        Raises:
          LensBatchSizeError: `batch_size` is not a non-negative int (a bool is not one).
        """
        given = {"scale": scale, "add": add, "set": set}
        if not any(given.values()):
            raise LensSweepEmptyError()
        if batch_size is None:
            batch_size = 4 if jax.default_backend() == "cpu" else 0
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise LensBatchSizeError(got=repr(batch_size))
        out, cache = self._call(self._own(), inputs, kwargs, given, read, batch_size or -1)
        return out if read is None or read is False else (out, cache)

    def __repr__(self) -> str:
        return f"Lens({type(self._target).__name__}: {len(self.sites)} sites)"

    # A lens keeps no state of its own between calls (as a jitted function keeps none):
    # a copy is the lens itself. It holds a traced model, so it cannot be pickled.
    def __copy__(self) -> Lens:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Lens:
        return self

    def __reduce__(self) -> Any:
        raise LensNotPicklableError()

    @property
    def target(self) -> Any:
        """The model the lens runs."""
        return self._target

    @property
    def variables(self) -> Any:
        """The model's variables in the form `apply` takes (read from the model where it
        holds them: a Keras model's); None for an NNX model, whose calls read its state
        live (give `apply` ``nnx.state(model)``)."""
        if self._view is not None:
            return self._view()
        return self._variables

    def _own(self) -> Any:
        """What a call without variables runs with: the model's own (`_LIVE`: read from
        a model that holds them, at this call)."""
        return _LIVE if self._adapter.holds_variables or self._view is not None else self.variables

    def _values_of(self, entry: Any, variables: Any, rngs: Any) -> tuple[list[Any], list[Any]]:
        """The graph's variable and random-key values."""
        graph = entry.traced.graph
        if variables is _LIVE and self._view is not None:
            variables = self._view()
        if variables is _LIVE:  # another shape now: the model changed since the lens was made
            values = values_at(graph, self._adapter.live_variables(self._target), live=True)
        else:
            values = variable_values(self._program, graph, variables)
        return values, self._program.rng_leaves(entry, rngs)

    def _call(
        self,
        variables: Any,
        inputs: Any,
        kwargs: dict[str, Any],
        given: dict[str, Any],
        read: Any,
        sweep: Any,
    ) -> Any:
        """Runs the model with the interventions `given` and the reads `read` (`_WHOLE`:
        every call's whole output), their names resolved against the trace of these
        inputs (`_sites_at`)."""
        program = self._program
        mutable = program.base.traced.split.mutable
        # Random keys for this call (linen's `rngs=`, Haiku's key), else those the lens
        # was made with.
        kwargs = dict(kwargs)
        rngs = kwargs.pop("rngs", self._rngs) if self._adapter.has_collections else self._rngs
        entry, leaves = program.lookup(tuple(inputs), kwargs, rngs, mutable)
        values, rng_leaves = self._values_of(entry, variables, rngs)
        statics, arrays, reads, sites = (), [], None, None
        if read is not _WHOLE:  # names resolved against this entry's trace
            sites = self._sites_at(entry, (values, rng_leaves))
            reads = _reads(read, sites)
            statics, arrays = self._normalised(given, sites, sweep)
        # A call on the state a model holds (NNX, Keras) updates it as the model's call does:
        # new batch statistics, the next random draw. A sweep's runs are alternatives,
        # not a sequence: it changes nothing.
        writes = variables is _LIVE and sweep is None and bool(entry.plan.state_paths)
        run = entry.__dict__.get("lens_run")
        if run is None:  # one jitted function per traced entry (input signature)
            run = functools.partial(self._evaluate, entry)
            run = entry.__dict__["lens_run"] = jax.jit(run, static_argnums=(0,))
        static = (sites, statics, reads, sweep, writes)
        out, cache, state = run(static, values, rng_leaves, leaves, arrays)
        # Inside a JAX transformation the new state is traced: the model keeps its own.
        if state and not _compat.tracing():
            self._write_back(entry.plan.state_paths, state)
        return out, cache

    def _write_back(self, paths: Sequence[Any], state: list[Any]) -> None:
        """Stores the state a call updated in the model: an NNX model's variables, a
        Keras model's own `keras.Variable`s (those whose value changed)."""
        if self._adapter.holds_variables:
            self._adapter.write_back(self._target, list(zip(paths, state, strict=True)))
        else:
            self._adapter.assign(self._target, merge_variables(self._view(), nest(paths, state)))

    def whole_values(self, variables: Any, inputs: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every call's output (whole pytrees), loops included (stacked, ``name[:]``),
        in call order, with `variables` (None: the model's own): `js.intermediates`
        with ``names="all"``."""
        variables = self._own() if variables is None else variables
        _, cache = self._call(variables, inputs, kwargs, {}, _WHOLE, None)
        return {w.name: cache[w.name] for w in self._outputs}

    def _sites_at(self, entry: Any, values: Any) -> Sites:
        """The sites in this entry's trace, with the shapes and scan lengths of its inputs,
        which the names a call gives are resolved against (probed once per entry)."""
        if entry is self._program.base:
            return self._sites
        found = entry.__dict__.get("lens_sites")
        if found is None:
            graph = entry.traced.graph
            found = self._sites.at(resolver_of(graph), probe(graph, values))
            entry.__dict__["lens_sites"] = found
        return found

    def _normalised(
        self, given: dict[str, Any], sites: Sites, sweep: Any
    ) -> tuple[tuple[Any, ...], list[Any]]:
        """The interventions as their static parts (`Intervention`) and arrays, checked
        against the sites (`sites`: this call's trace's; in a sweep, after a leading axis
        of one length)."""
        statics, arrays, runs = [], [], set()
        for kind in KINDS:
            entries = given.get(kind)
            if entries is None:
                continue
            if not isinstance(entries, Mapping):
                raise LensKindError(kind=kind, got=type(entries).__name__)
            for spec, value in entries.items():
                picked = sites.pick(spec)
                static, parts = intervention(kind, spec, value, picked.site, picked, sweep)
                statics.append(static)
                arrays.append(parts)
                runs.update(x.shape[0] for x in parts[:2] if sweep and x is not None)
        if len(runs) > 1:
            raise LensSweepAxisError(spec=sorted(runs), kind="all values", shape=None)
        return tuple(statics), arrays

    # ------------------------------------------------------------------ the program

    def _evaluate(
        self, entry: Any, static: Any, values: Any, rngs: Any, inputs: Any, arrays: Any
    ) -> tuple[Any, dict[str, Any]]:
        sites, statics, reads, sweep, writes = static
        graph = entry.traced.graph
        if reads is None:  # every call's whole output (`whole_values`)
            emitted, state = self._every_output(graph, values, rngs, inputs)
            return None, emitted, _updated(entry, state) if writes else []
        wanted, first = {}, {}
        for spec in reads:
            picked = sites.pick(spec)
            wanted.setdefault((picked.site.where, picked.site.leaf), picked.site.name)
            first_row(first, picked.site.where, picked.rows)
        for one in statics if sweep else ():
            first_row(first, sites.by_name[one.site].where, one.fixed)

        def run(arrays: Any) -> Any:
            here = placed(sites.by_name, statics, arrays)
            hooks = LensHooks(here, wanted, first if sweep else {})
            return evaluate_graph(
                graph, hooks, values, rngs, inputs, with_state=True
            ), hooks.emitted

        if sweep:
            (out, _), emitted = _swept(run, arrays, sweep)
        else:
            (out, state), emitted = run(arrays)
        cache = {spec: _read(sites.pick(spec), emitted, sweep) for spec in reads}
        return out, cache, _updated(entry, state) if writes else []

    def _every_output(self, graph: Any, values: Any, rngs: Any, inputs: Any) -> tuple[Any, Any]:
        """Every call's whole output (in counted loops, stacked), from one evaluation,
        and the values of `graph.state_ids`."""
        resolver = resolver_of(graph)
        whole = {resolver.same(w): w.name for w in self._outputs}
        hooks = LensHooks({}, {}, {}, whole)
        _, state = evaluate_graph(graph, hooks, values, rngs, inputs, with_state=True)
        return {name: hooks.emitted[name] for name in whole.values()}, state


def _updated(entry: Any, state: list[Any]) -> list[Any]:
    """Of the values of `graph.state_ids`, the state the model updates
    (`Plan.state_paths`), as a slice of the whole model writes back."""
    at = {path: k for k, path in enumerate(entry.traced.graph.state_paths)}
    return [state[at[path]] for path in entry.plan.state_paths]


def _reads(read: Any, sites: Sites) -> tuple[str, ...]:
    """The names a call reads (`read`: True for every site this call has, a name, or a
    list of names)."""
    if read is None or read is False:
        return ()
    if read is True:
        return tuple(sites.by_name)
    if isinstance(read, str):
        read = [read]
    if not isinstance(read, Sequence) or not all(isinstance(r, str) for r in read):
        raise LensSitesSpecError(spec=read, reason="read takes True, a name or a list of names")
    for spec in read:  # a wrong name fails here, not while the program is traced
        sites.pick(spec)
    return tuple(read)


def _read(picked: Any, emitted: dict[str, Any], sweep: Any) -> Any:
    """What a read returns: its site's value, at the iterations it picks (`picked`)."""
    index = tuple(slice(None) if k is None else k for k in picked.rows)
    stacked = emitted[picked.site.name]
    if not index:
        return stacked
    return stacked[(slice(None), *index)] if sweep else stacked[index]


def _swept(run: Any, arrays: list[Any], batch_size: int) -> Any:
    """`run` over the leading axis of the values and masks in `arrays` (the iterations
    they pick are shared): vmapped at once (`batch_size` -1, or at least the number of
    runs), or in chunks of `batch_size` (`jax.lax.map`)."""
    runs = arrays[0][0].shape[0]
    if batch_size < 0 or batch_size >= runs:
        axes = [(0, None if mask is None else 0, None) for _, mask, _ in arrays]
        return jax.vmap(run, in_axes=(axes,))(arrays)
    rows = [picked for _, _, picked in arrays]

    def one(given: list[Any]) -> Any:
        return run([(v, m, r) for (v, m), r in zip(given, rows, strict=True)])

    return jax.lax.map(one, [(v, m) for v, m, _ in arrays], batch_size=batch_size)


def lens(target: Any, *args: Any, sites: Any = None, **kwargs: Any) -> Lens:
    """A model whose interventions at `sites` are call-time arguments, compiled once.

    Args:
      target, *args, **kwargs: as for `js.slice` (any model kind); keywords fix the mode.
      sites: boundary names (``"layers[:]"``, ``"layers[:]/attn:input"``, ``"head"``;
        ``name#k`` for array leaf k of the value there), or None for every call's output,
        inside scans too (``layers[:]/mlp``).

    Returns:
      A `Lens`: ``lens(*inputs, add=..., scale=..., set=..., read=...)``.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> x = jnp.ones((3, 5))
    >>> variables = model.init(jax.random.key(0), x)
    >>> lens = js.lens(model, variables, x)
    >>> list(lens.sites)
    ['layers_0', 'layers_2']
    >>> out = lens(x, scale={"layers_0": 0.0})   # ablate the first layer's output
    >>> bool(jnp.allclose(out, model.layers[2].apply(
    ...     {"params": variables["params"]["layers_2"]}, jnp.zeros((3, 4)))))
    True
    """
    return Lens(target, args, kwargs, sites)


_compat.register_frames_exclusion(__file__)
