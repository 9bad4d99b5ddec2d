"""Editing a model at its boundaries: insert, replace and remove nodes.

An `Editor` never touches the model or its variables. It builds an *edited model*
(`_edited.py`): a plain function ``edited(variables, *inputs, **call_inputs)`` that
evaluates the original model's traced program (re-traced per input shape) with hooks
that apply the edits, and that marks every original module call again under its own
name, plus each inserted node under its name. The edited model is then sliced like any
other, so `build` and `slice` return slices, and inserted nodes are boundaries like the
rest. For NNX and Equinox models `build` wraps that slice in a module of their library
(the adapter's `edited_view`).

Variables of the edited model are the model's plus, for each new module, its own under
its node name (``variables["params"][name]`` for linen; ``{"model": ..., "nodes": ...}``
for NNX and Equinox, whose modules hold their variables). A replacing module takes the
replaced call's name, and the replaced module's own variables leave the edited model (its
dead equations read their original values, and are dropped from slices).

An `Editor` holds an immutable tuple of edit records (`_edit_nodes.Edit`). An edit builds
the next tuple and checks the edited model with it; only if that works does the editor
take it (and return itself, so edits chain). A failed edit changes nothing, so there is
nothing to roll back; `copy` gives an independent editor to branch from.

Edits inside scanned stacks: an edit at ``layers[:]/mlp`` changes every iteration, and
the loop stays one scan (the evaluator keeps scans, `_core.evaluate`); a module inserted
there gets one set of variables per iteration, stacked on a new leading axis like the
model's own (each row initialised from its own key). An edit at ``layers[3]/mlp``
changes iteration 3 only, inside the same scan: an element-wise edit is selected by the
iteration index, a module runs under a `lax.cond` on it, so the edited model compiles
about as fast as the model.

Call-time inputs (``inputs=("delta",)``) make a node a function of values given when the
edited model is called, as keyword arguments (``edited(x, delta=v)``): the edited model is
an ordinary JAX function of them, so `jax.vmap` sweeps a patch and `jax.grad` gives
attribution at that site. At a stacked name, row k of a call-time input (or of a node's
variables) is what iteration k sees.

Sharp edges: `insert_after` acts on a module's output, or on its input with the
``:input`` port; `replace` and `remove` act on whole calls. The mode (keywords such as
``train=False``, and `rngs`) is the one the editor was made with. A node inserted at one
iteration runs in a branch of the loop body, so it is no boundary of the edited model;
a node at ``[:]`` is, listed at the top of the loop body it runs in (``layers[:]/name``
for one at ``layers[:]/mlp``, `_edit_nodes.node_template`). Node names hold none of the
characters boundary names use (`NOT_IN_NAMES`). Arguments without arrays (a positional
``train`` flag) stay fixed while the editor probes shapes, as a trace fixes them. An
Equinox edited model is traced for the structure it was edited with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from . import _compat
from ._core.markers import INPUT, OUTPUT
from ._core.names import shown
from ._core.program import SliceProgram
from ._core.selection import Name, Resolver, Selection, resolver_of
from ._core.trace import Traced, trace
from ._edit_nodes import (
    Edit,
    Node,
    Preview,
    Tables,
    call_input_specs,
    describe_shapes,
    meeting,
    new_node,
    node_template,
    same_shapes,
    site_of,
)
from ._edited import Built, EditedAdapter, EditedModel, EditPlan, probe_shapes
from ._edited_sliced import Edited
from ._errors import (
    CallInputNameTakenError,
    EditBreaksModelError,
    NodeNameError,
    NodeNameTakenError,
    NotEvaluatedError,
    PortSuffixError,
    RemoveMismatchError,
    SharedModuleReplaceError,
    SliceError,
)
from ._slice import view
from ._table import BoundaryTable, describe
from ._trees import joined_key
from ._view import DrawsInline
from .adapters import adapter_for

# Keywords the edited model's `apply` takes itself: no call-time input may be named so.
RESERVED = frozenset({"rngs", "mutable", "variables"})
# What boundary names use to separate path parts, iterations, call indices and ports.
NOT_IN_NAMES = frozenset("/[]@:\\")


@dataclasses.dataclass(frozen=True)
class _Base:
    """What every editor of one model shares (never changed by an edit)."""

    program: SliceProgram
    resolver: Resolver
    taken: frozenset[str]

    @property
    def split(self) -> Any:
        return self.program.base.traced.split


class Editor(DrawsInline):
    """A graph-editing session over a model (a tuple of edit records); see `js.edit`.

    In a notebook it shows as its drawing (`to_dot`).
    """

    def __init__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        program = SliceProgram.build(target, args, kwargs, adapter=adapter_for(target))
        self._target = target
        self._variables = program.adapter.split(target, args, kwargs).variables
        # A model that holds its variables (NNX) is read live, its values keyed by
        # joined paths (see `EditPlan`).
        flat, _ = program.adapter.flatten_variables(self._variables)
        live = program.adapter.holds_variables
        self._paths = {joined_key(p): p for p, _ in flat} if live else {}
        graph = program.base.traced.graph
        taken = {c.qualname for c in graph.calls} | {c.name for c in graph.calls}
        taken |= program.adapter.variable_names(self._variables)
        self._base = _Base(program, resolver_of(graph), frozenset(taken))
        self._edits: tuple[Edit, ...] = ()
        self._tables = Tables()
        self._known: dict[Selection, Any] | None = None

    def _commit(self, edit: Edit, probe: str | None) -> Editor:
        """Adds `edit`: the editor's state is replaced at once, only if the edit works."""
        new = self._with(edit, probe)
        self._edits, self._tables, self._known = new._edits, new._tables, new._known
        return self

    def copy(self) -> Editor:
        """An independent editor with the same edits (later edits to either stay apart)."""
        new = object.__new__(Editor)
        new.__dict__.update(self.__dict__)
        return new

    def _with(self, edit: Edit, probe: str | None) -> Editor:
        """A new editor with `edit` added; `probe` names the edit for error messages."""
        new = self.copy()
        new._edits = self._edits + (edit,)
        new._tables = Tables.of(new._edits)
        new._known = None
        if probe is not None:
            try:
                new._known = new._probe()
            except SliceError:
                raise
            except Exception as error:
                raise EditBreaksModelError(what=probe, error=error) from error
        return new

    # ------------------------------------------------------------------ edits

    def insert_after(
        self,
        at: str,
        fn_or_module: Any,
        /,
        *,
        key: Any = None,
        name: str | None = None,
        inputs: Any = (),
    ) -> Editor:
        """Inserts a function or a module after a boundary's output (or input).

        Everything that read the boundary's output reads the node's output instead. With
        the ``:input`` port (``"block:input"``) the node transforms what the module
        receives. A module of the model's library brings its variables, trainable under
        the node's name: a linen module (or a function of Haiku modules) is initialised
        with `key` on the value it receives; an NNX module, an `eqx.Module` or a Keras
        layer comes with its own. At a name inside scans, ``layers[3]/mlp`` changes
        iteration 3 only and ``layers[:]/mlp`` every iteration; a module inserted at
        ``[:]`` gets variables stacked per iteration (linen and Haiku: one row per
        iteration from its own key; NNX, Equinox: give it stacked, e.g. by `nnx.vmap`).

        Args:
          at: the boundary (or an inserted node) whose value the node receives.
          fn_or_module: a function ``f(value, *call_inputs)`` or a module (see above).
          key: a PRNG key, to initialise a linen module (or Haiku modules).
          name: the node's name (a boundary name from now on); generated if omitted.
          inputs: names of call-time inputs the node also receives, given as keywords
            when the edited model is called (``edited(x, delta=v)``). Each is shaped like
            the value at `at` (with a leading axis per ``[:]``), unless given as a dict
            ``{name: example array or jax.ShapeDtypeStruct}``.

        Returns:
          The editor, so edits chain.
        """
        site = self._site(at)
        name = self._fresh_name(fn_or_module, site) if name is None else name
        self._check_new_name(name, site)
        value = self._value_at(site, site.side)
        node = self._new_node(fn_or_module, key, name, (value,), site, inputs, value)
        edit = Edit("insert", site, node)
        return self._commit(edit, f"Inserting {name!r} after {site.name!r}:{site.side}")

    def replace(
        self, at: str, fn_or_module: Any, /, *, key: Any = None, inputs: Any = ()
    ) -> Editor:
        """Replaces a module call (or an inserted node) by a function or a module.

        The replacement receives the call's array arguments that are not parameters (and
        the call-time `inputs`, as for `insert_after`, shaped like the call's output
        unless given). A replacing module's variables are initialised with `key` where
        they need it, and live under the replaced call's name (inside scans, under a new
        node name: the replaced call's variables are rows the other iterations keep).
        Replacements and bypasses of one call apply in the order they are made.

        Returns:
          The editor, so edits chain.
        """
        site = self._whole_call("replace", at)
        sample = self._value_at(site, INPUT)
        inserted = site.node is not None
        sample = (sample,) if inserted or not isinstance(sample, tuple) else sample
        if inserted:
            name = site.node
        elif site.path:  # inside loops: its variables are rows of the loop's, kept
            name = self._fresh_name(fn_or_module, site)
        else:
            name = site.call.name
        out = self._value_at(site, OUTPUT)  # what call-time inputs are shaped like
        node = self._new_node(fn_or_module, key, name, sample, site, inputs, out)
        self._check_replaceable(site, node)
        return self._commit(Edit("replace", site, node), f"Replacing {site.name!r}")

    def remove(self, at: str, /) -> Editor:
        """Bypasses a module call, or takes an inserted node out again.

        A module call's output becomes its input. An inserted node's edit is undone: what
        it received goes on to what read it, and its variables leave the edited model.

        Raises:
          SliceError: if a call's input and output differ in structure, shape or dtype.

        Returns:
          The editor, so edits chain.
        """
        site = self._whole_call("remove", at)
        if site.node is None:
            inp, out = self._value_at(site, INPUT), self._value_at(site, OUTPUT)
            if not same_shapes(inp, out):
                raise RemoveMismatchError(
                    name=site.name, inp=describe_shapes(inp), out=describe_shapes(out)
                )
        return self._commit(Edit("remove", site), None)

    def at(self, at: str, /) -> Preview:
        """What an edit at `at` would touch, before anything changes: the calls (one
        per iteration the name picks inside loops), their names and iterations, and the
        value an inserted node would receive there. The editor is left as it was.

        >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
        >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
        >>> x = jnp.ones((3, 5))
        >>> g = js.edit(model, model.init(jax.random.key(0), x), x)
        >>> g.at("layers_0")
        Preview('layers_0': 1 call(s) at their output: layers_0)
        >>> g.at("layers_0").value
        ShapeDtypeStruct(shape=(3, 4), dtype=float32)
        """
        site = self._site(at)
        return Preview.of(site, self._value_at(site, site.side))

    # ------------------------------------------------------------------ results

    @property
    def variables(self) -> Any:
        """The edited model's variables: the model's, plus those of new modules.

        For linen models and plain functions, the model's variables with each new
        module's under its node name; for NNX and Equinox models ``{"model": ...,
        "nodes": {name: ...}}`` (an NNX model's values keyed by ``/``-joined paths).
        """
        return self._plan().edited_variables()

    def build(self) -> Any:
        """The whole edited model, as the same kind of object a slice of the model is.

        For linen models and plain functions an `Edited` (a `js.Sliced`, trainable and
        jit-compiled, with `export`, and ``merge(variables, trained)`` and
        ``nodes(trained)`` to write trained variables back to the model and keep the new
        modules' apart); for NNX models an `nnx.Module` holding the model and the new
        nodes (sharing their variables); for Keras models a `keras.Model` sharing the
        model's and the inserted layers' variables.
        """
        program = SliceProgram(self._trace(), None, None)
        edited = Edited(program, self._plan())
        nodes = {n.name: n.module for n in self._tables.nodes() if n.variables is not None}
        built = Built(edited, program, nodes)
        view = self._base.program.adapter.edited_view(self._target, built)
        return edited if view is None else view

    def slice(self, start: Any = None, end: Any = None) -> Any:
        """A slice of the edited model, a `js.Sliced` over `variables` (inserted nodes are
        boundaries too)."""
        return view(SliceProgram(self._trace(), start, end))

    def boundaries(self) -> BoundaryTable:
        """`js.boundaries` of the edited model."""
        return describe(self._trace())

    def to_networkx(self, depth: int | None = None) -> Any:
        """The edited model's module DAG; new and replaced nodes have ``in_slice`` set."""
        from .render import slice_graph

        dag = slice_graph(SliceProgram(self._trace(), None, None), depth, whole=True)
        edited = set(self._tables.inserted) | {w.name for w in self._tables.changed}
        for name, attrs in dag.nodes(data=True):
            if not name.startswith("<"):
                attrs["in_slice"] = name in edited
        for attrs in dag.graph.get("containers", {}).values():
            attrs["in_slice"] = True
        return dag

    def _drawing_program(self) -> SliceProgram:
        return self._base.program  # the model before editing: close enough to pick a depth

    def to_dot(self, depth: int | None = None, annotations: dict[str, Any] | None = None) -> str:
        """DOT source of the edited model with the edited nodes highlighted."""
        from .render import to_dot

        return to_dot(self.to_networkx(depth), annotations=annotations, title="jaxslice edit")

    def render(
        self, path: Any, depth: int | None = None, annotations: dict[str, Any] | None = None
    ) -> str:
        """Renders `to_dot` with Graphviz's `dot` (format from the file suffix)."""
        from .render import render_dot

        return render_dot(self.to_dot(depth, annotations), path)

    # ------------------------------------------------------------------ internals

    def _plan(self) -> EditPlan:
        """The edits as they stand, with what the edited model evaluates them on."""
        program = self._base.program
        return EditPlan(program, self._target, self._tables, self._variables, self._paths)

    def _trace(self) -> Traced:
        split = self._base.split
        plan = self._plan()
        args = (plan.edited_variables(), *split.args)
        samples = {
            n: jax.numpy.zeros(sample.shape, sample.dtype)
            for n, (_, sample) in self._tables.call_inputs().items()
        }
        kwargs = {**split.kwargs, **samples, **self._collections()}
        adapter = EditedAdapter(self._base.program.adapter)
        return trace(EditedModel(plan, None), args, kwargs, adapter=adapter)

    def _collections(self) -> dict[str, Any]:
        """The random keys and `mutable` the editor was made with, for models that take
        them (linen, Keras, Haiku): the edited model is traced with them too."""
        program = self._base.program
        if not program.adapter.has_collections:
            return {}
        # The collections the model updates in this mode (linen widens `mutable` to them
        # while tracing), so that the edited model holds and can return them too.
        updated = program.base.plan.updated_collections
        mutable = program.base.traced.split.mutable or (sorted(updated) if updated else False)
        return {"rngs": program.base.traced.split.rngs, "mutable": mutable}

    def _site(self, spec: Any) -> Selection:
        """The record `spec` (a name, parsed or not) picks in the model's graph."""
        return site_of(spec, self._base.resolver, self._tables)

    def _whole_call(self, op: str, spec: str) -> Selection:
        name = Name.of(spec) if isinstance(spec, str) else spec
        site = self._site(name)
        if name.port is not None:
            raise PortSuffixError.of(op, spec)
        return site

    def _value_at(self, site: Selection, port: str) -> Any:
        """Shapes and dtypes of the value at a site (one iteration's, inside scans)."""
        found = self._shapes().get(meeting(dataclasses.replace(site, side=port)))
        if found is None:
            raise NotEvaluatedError(name=site.name, port=port)
        return found

    def _check_replaceable(self, site: Selection, node: Node) -> None:
        """A module with variables takes the name of the call it replaces: refused for one
        call of a module called several times (both would have that name)."""
        if site.node is not None or site.path or node.variables is None:
            return
        call = site.call
        if call.count > 1:
            raise SharedModuleReplaceError(name=call.name, count=call.count)

    def _new_node(
        self,
        fn_or_module: Any,
        key: Any,
        name: str,
        args: tuple[Any, ...],
        site: Selection,
        inputs: Any,
        like: Any,
    ) -> Node:
        """A node for `site` that receives `args`: its function, variables (stacked per
        iteration at ``[:]``) and call-time inputs (shaped `like` unless given), checked
        against those the edited model already takes."""
        names, samples = call_input_specs(inputs, like, site)
        taken = self._tables.call_inputs()
        keywords = set(self._base.split.kwargs) | set(self._base.split.mode) | RESERVED
        keywords |= self._base.program.adapter.accepted_keywords(self._target) or set()
        clash = [n for n in names if n in taken or n in keywords]
        if clash:
            raise CallInputNameTakenError(names=clash)
        adapter = self._base.program.adapter
        lead = len(site.lengths)  # a module is made for one iteration's values
        rows = tuple(jax.ShapeDtypeStruct(s.shape[lead:], s.dtype) for s in samples)
        node = new_node(adapter, fn_or_module, key, name, site, (*args, *rows))
        return dataclasses.replace(node, inputs=names, samples=samples, site=site)

    def _fresh_name(self, fn_or_module: Any, site: Selection) -> str:
        own = self._base.program.adapter.node_name(fn_or_module)  # a Keras layer's name
        if own and not any(c in NOT_IN_NAMES for c in own) and not self._is_taken(own, site):
            return own
        base = getattr(fn_or_module, "__name__", None) or type(fn_or_module).__name__
        base = "fn" if base == "<lambda>" else base
        base = "".join(c for c in base if c not in NOT_IN_NAMES) or "node"
        i = 0
        while self._is_taken(f"{base}_{i}", site):
            i += 1
        return f"{base}_{i}"

    def _check_new_name(self, name: str, site: Selection) -> None:
        if not isinstance(name, str) or not name or any(c in NOT_IN_NAMES for c in name):
            raise NodeNameError(name=name)
        if self._is_taken(name, site):
            raise NodeNameTakenError(name=name)

    def _is_taken(self, name: str, site: Selection) -> bool:
        """Whether a node named `name` at `site` would share a name with a boundary, a
        variable or another node, as named or as listed (``layers[:]/name`` in a loop)."""
        taken = self._base.taken
        listed = shown(node_template(site, name))
        return name in taken or listed in taken or name in self._tables.inserted

    def _shapes(self) -> dict[Selection, Any]:
        """Shapes at every boundary of the edited model as it stands (probed once)."""
        if self._known is None:
            self._known = self._probe()
        return self._known

    def _probe(self) -> dict[Selection, Any]:
        """Shapes at every boundary of the edited model, from one abstract evaluation."""
        split, collections = self._base.split, self._collections()
        return probe_shapes(self._plan(), split, collections, self.variables)


def edit(target: Any, *args: Any, **kwargs: Any) -> Editor:
    """A graph-editing session: insert, replace and remove nodes at module boundaries.

    Args:
      target, *args, **kwargs: as for `js.slice` (any model kind: linen, NNX, Equinox,
        Keras, Haiku, plain functions); keywords fix the mode.

    Returns:
      An `Editor` with ``insert_after(at, fn_or_module, *, key=None, name=None,
      inputs=())``, ``replace(at, fn_or_module, *, key=None, inputs=())`` and
      ``remove(at)`` (each returns the editor, so edits chain; ``at(name)`` shows what
      an edit there would touch, and changes nothing; a failed edit changes
      nothing; names may pick iterations of scans, ``layers[3]/mlp``, or all of them,
      ``layers[:]/mlp``), ``copy()``, ``build()`` (the edited model, as the same kind of
      object a slice of the model is), ``slice(start=..., end=...)``, ``variables`` and
      ``boundaries()``. The original model and variables never change (an NNX edited
      model shares the model's variables, so training it trains the model).

    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxslice as js
    >>> model = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
    >>> x = jnp.ones((3, 5))
    >>> variables = model.init(jax.random.key(0), x)
    >>> g = js.edit(model, variables, x).insert_after("layers_0", lambda z: 2 * z, name="double")
    >>> p = variables["params"]
    >>> by_hand = jax.nn.relu(2 * (x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"]))
    >>> by_hand = by_hand @ p["layers_2"]["kernel"] + p["layers_2"]["bias"]
    >>> bool(jnp.allclose(g.build()(x), by_hand, atol=1e-6))
    True
    >>> [b.name for b in g.boundaries()]
    ['layers_0', 'double', 'layers_2']
    """
    return Editor(target, args, kwargs)


_compat.register_frames_exclusion(__file__)
