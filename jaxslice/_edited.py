"""The edited model: a model's traced program evaluated with the edits applied.

`EditPlan` is a snapshot of an editor (the model's program, the replayed edit tables and
where the variables live), so an edited model never changes after it is built. The edited
model is a plain function ``fn(variables, *inputs, **call_inputs)`` (`EditedModel`) that
evaluates the model's program through `_core.evaluate` with hooks (`EditHooks`) that
apply the edits at each boundary and mark every call again under its name, so that it
can be traced and sliced like any plain function. `Edited` (`_edited_sliced.py`) is
what `build` returns for linen models and plain functions: a `js.Sliced` of it. The
edited model marks the model's calls again under the names the model lists (a method's
``ae.encode``, a mark's scope path), and each inserted node under its own (at the top
of the loop body it runs in: ``layers[:]/node``).

Variables, by where a kind keeps a new module's variables:

* nested (linen, plain functions): the model's variables with each new module's under its
  node name (`Adapter.with_node`);
* separate (NNX, Equinox: modules hold their variables): ``{"model": ..., "nodes":
  {name: ...}}``; for a model that holds its variables (NNX) the model's values are keyed
  by their ``/``-joined paths and read live from the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat
from ._core.checks import check_mutable, values_at
from ._core.evaluate import BoundaryEvent, Hooks
from ._core.evaluate import evaluate as evaluate_graph
from ._core.jaxprs import row
from ._core.markers import INPUT, OUTPUT, Origin, is_marking, mark_side, new_record
from ._core.names import split_name, unslotted
from ._core.program import SliceProgram
from ._core.selection import Selection, resolver_of
from ._core.variables import merge as merge_variables
from ._edit_nodes import Node, Tables, describe_shapes, node_where, same_shapes
from ._errors import (
    CallInputDtypeError,
    CallInputsRejectedError,
    MissingCallInputsError,
    NoPlaceForVariablesError,
    UnknownCallKeywordsError,
)
from ._trees import is_traced_leaf, joined_key, nest, prune
from .adapters._base import Adapter, Split
from .adapters._plain import PlainAdapter


@dataclasses.dataclass(frozen=True)
class EditPlan:
    """What an edited model evaluates: the model's program and the edits, replayed."""

    program: SliceProgram  # the model's, before editing
    target: Any
    tables: Tables
    variables: Any  # the model's own, as its adapter splits them
    paths: dict[str, tuple[Any, ...]]  # for a model that holds its variables: key -> path

    @property
    def live(self) -> bool:
        """Whether the model holds its variables (read from it at each call)."""
        return self.program.adapter.holds_variables

    @property
    def separate(self) -> bool:
        """Whether new modules' variables are kept apart from the model's."""
        return self.live or self.program.adapter.separate_nodes

    def structure(self) -> Any:
        """What decides the edited program besides its arguments: the model's structure
        (an NNX model's graph definition: its modes) and the new modules' modes."""
        return (
            self.program.adapter.structure_key(self.target),
            tuple(n.structure for n in self.tables.nodes()),
        )

    def edited_variables(self) -> Any:
        """The edited model's variables: the model's, plus those of new modules."""
        nodes = [n for n in self.tables.nodes() if n.variables is not None]
        adapter = self.program.adapter
        if self.separate:
            model = self.variables
            if self.live:
                live = adapter.live_variables(self.target)
                model = {joined_key(p): v for p, v in live.items()}
            return {"model": model, "nodes": {n.name: n.variables for n in nodes}}
        return self._nested_variables(nodes) if nodes else self.variables

    def _nested_variables(self, nodes: list[Node]) -> Any:
        """Linen's and plain functions' layout: the model's variables (less those new
        modules replace) with each new module's under its node name."""
        base = self.variables
        if not isinstance(base, Mapping):
            raise NoPlaceForVariablesError()
        flat = jax.tree_util.tree_flatten_with_path(base)[0]
        out = prune(base, {p for p, _ in flat if self.owner(p) is None}) or {}
        out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in out.items()}
        for node in nodes:
            self.program.adapter.with_node(out, node.name, node.variables)
        return out

    def model_entries(self, trained: Any) -> Any:
        """The model's own entries of `trained` (the edited model's variables, or a part
        of them): those of no new module, in the same nesting (None for none)."""
        flat = jax.tree_util.tree_flatten_with_path(trained)[0]
        return prune(trained, {p for p, _ in flat if self.owner(p) is None})

    def node_entries(self, trained: Any) -> dict[str, Any]:
        """Each new module's variables by node name, in its own layout (linen: what its
        `init` returns), with `trained`'s values where it has them, the edited model's
        elsewhere."""
        full = merge_variables(self.edited_variables(), trained)
        adapter = self.program.adapter
        return {
            n.name: adapter.node_variables(full, n.name, n.variables)
            for n in self.tables.nodes()
            if n.variables is not None
        }

    def model_values(self, variables: Any) -> dict[Any, Any]:
        """The model's variable values by path, from the edited model's `variables`.

        Variables a new module now owns are taken from the model as it was: replaced
        modules' equations still read them (they are dead code)."""
        if self.live:
            return {self.paths[k]: v for k, v in variables["model"].items()}
        if self.separate:
            return self.program.adapter.flat_values(variables["model"])
        flat = jax.tree_util.tree_flatten_with_path
        owned = {p: x for p, x in flat(variables)[0] if self.owner(p) is None}
        return {**dict(flat(self.variables)[0]), **owned}

    def node_values(self, variables: Any, node: Node) -> Any:
        if node.variables is None:
            return None
        if self.separate:
            return variables["nodes"][node.name]
        return self.program.adapter.node_variables(variables, node.name, node.variables)

    def tables_on(self, graph: Any) -> Tables:
        """The edit tables for `graph`: the model's graph they were made on, or another
        trace of the model (new shapes), the records moved to its calls."""
        if graph is self.program.base.traced.graph:
            return self.tables
        return self.tables.moved(resolver_of(graph))

    def owner(self, path: tuple[Any, ...]) -> Node | None:
        """The new node whose variables live at `path` of nested variables, if any."""
        if self.separate:
            return None
        name = self.program.adapter.node_of(path)
        nodes = self.tables.nodes()
        return next((n for n in nodes if n.variables is not None and name == n.name), None)


class EditedAdapter(PlainAdapter):
    """The edited model as a plain function. Its boundaries are exactly the calls it marks
    (linen name stacks would add regions named after classes, "Model/block"), its
    programs are keyed by the model's structure too (an NNX model's mode), and it takes
    `rngs` and `mutable` as the model does (linen, Keras, Haiku)."""

    def __init__(self, model: Adapter) -> None:
        super().__init__(name_scopes=False)
        self.model = model
        self.has_collections = model.has_collections
        self.always_returns_state = model.always_returns_state

    def split(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
        kwargs = dict(kwargs)
        rngs, mutable = kwargs.pop("rngs", None), kwargs.pop("mutable", False)
        split = super().split(target, args, kwargs)
        return dataclasses.replace(split, rngs=rngs, mutable=mutable)

    def call(self, target: Any, call: Split) -> tuple[Any, Any]:
        kwargs = {"rngs": call.rngs, "mutable": call.mutable} if self.has_collections else {}
        result = target(call.variables, *call.args, **kwargs, **call.kwargs)
        return result if call.mutable else (result, None)

    def wider_mutable(self, split: Split, error: BaseException | None) -> Any:
        return self.model.wider_mutable(split, error)  # the edited variables hold the model's

    def structure_key(self, target: Any) -> Any:
        # The edited model itself (one per traced edit) with what can change under it.
        return (target, target.plan.structure())

    def variables_view(self, target: Any, variables: Any) -> Any:
        """Where the model's slices read its variables when used (Keras), so does the
        edited model: the model's current values, with the new nodes' beside them."""
        plan = target.plan
        live = self.model.variables_view(plan.target, plan.variables)
        if live is None:
            return None
        paths = {p for p, _ in jax.tree_util.tree_flatten_with_path(variables)[0]}
        return lambda: prune(dataclasses.replace(plan, variables=live()).edited_variables(), paths)


@dataclasses.dataclass(frozen=True)
class Built:
    """What an adapter's `edited_view` is given: the edited model's `js.Sliced` (over
    ``{"model": ..., "nodes": ...}`` for models that hold their variables) and the new
    modules by node name."""

    sliced: Any
    program: SliceProgram
    nodes: dict[str, Any]


class EditedModel:
    """The edited model as a plain function ``fn(variables, *inputs, **call_inputs)``."""

    def __init__(self, plan: EditPlan, observe: Callable[[Selection, Any], None] | None):
        self.plan = plan
        self.observe = observe
        self.__name__ = "edited"

    def __call__(
        self, variables: Any, *inputs: Any, rngs: Any = None, mutable: Any = False, **kwargs: Any
    ) -> Any:
        plan = self.plan
        program = plan.program
        given = take_call_inputs(plan, kwargs)
        entry, leaves = program.lookup(inputs, kwargs, rngs, True if plan.live else mutable)
        if not plan.live:  # state the model updates must be asked for, as its `apply` says
            check_mutable(entry.plan, mutable, program.adapter)
        graph = entry.traced.graph
        merged = plan.model_values(variables)
        values = values_at(graph, merged, live=plan.live)
        keys = [x for x in jax.tree_util.tree_leaves(rngs) if is_traced_leaf(x)]
        hooks = EditHooks(plan, plan.tables_on(graph), variables, given, self.observe)
        if not (plan.live or mutable):
            return evaluate_graph(graph, hooks, values, keys, leaves)
        out, state = evaluate_graph(graph, hooks, values, keys, leaves, with_state=True)
        if mutable:  # the updated collections, as the model's own `apply` returns them
            return out, nest(graph.state_paths, state)
        # A model that holds its variables returns what it updated, to be written back.
        pairs = zip(graph.state_paths, state, strict=True)
        return out, {joined_key(p): x for p, x in pairs if x is not merged.get(p)}


def probe_shapes(
    plan: EditPlan, split: Split, collections: dict[str, Any], variables: Any
) -> dict[Selection, Any]:
    """Shapes and dtypes at every boundary of the edited model (one iteration's inside
    loops), from one abstract evaluation, by the record the running model meets each by,
    in the graph the editor resolved its names on (a trace with `mutable` may be another
    graph of the model). `collections`: the random keys and `mutable`, which stay as
    they are; so do the model's arguments that are not arrays (a positional ``train``
    flag), as a trace fixes them."""
    resolver = resolver_of(plan.program.base.traced.graph)
    seen: dict[Selection, Any] = {}

    def record(where: Selection, value: Any) -> None:
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), value)
        seen[resolver.same(where)] = shapes

    samples = {n: sample for n, (_, sample) in plan.tables.call_inputs().items()}
    model = EditedModel(plan, record)
    flat, tree = jax.tree_util.tree_flatten((split.args, {**split.kwargs, **samples}))
    arrays = [x for x in flat if is_traced_leaf(x)]

    def probe(variables: Any, arrays: list[Any]) -> Any:
        given = iter(arrays)
        leaves = [next(given) if is_traced_leaf(x) else x for x in flat]
        args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
        return model(variables, *args, **collections, **kwargs)

    jax.eval_shape(probe, variables, arrays)
    return seen


def take_call_inputs(plan: EditPlan, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Takes the call-time inputs out of a call's keywords (the rest are the model's),
    checked: none missing or unknown, each of its dtype and its loops' leading axes."""
    expected = plan.tables.call_inputs()
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in expected}
    accepted = plan.program.adapter.accepted_keywords(plan.program.target)
    extra = [k for k in kwargs if accepted is not None and k not in accepted]
    if extra and expected:
        raise UnknownCallKeywordsError.of(expected, extra=extra)
    check_call_inputs(expected, given)
    return given


def check_call_inputs(expected: dict[str, tuple[Node, Any]], given: dict[str, Any]) -> None:
    """Every call-time input given, each with its dtype and its loops' leading axes."""
    missing = [n for n in expected if n not in given]
    if missing:
        raise MissingCallInputsError.of(expected, missing=missing)
    for name, value in given.items():
        node, sample = expected[name]
        shape, dtype = jax.numpy.shape(value), jax.numpy.result_type(value)
        lead = len(node.stacked)
        if dtype != sample.dtype or tuple(shape[:lead]) != node.stacked or len(shape) < lead:
            need = (
                f"{sample.dtype} with leading axes {list(node.stacked)}" if lead else sample.dtype
            )
            like, got = f"{sample.dtype}{list(sample.shape)}", f"{dtype}{list(shape)}"
            raise CallInputDtypeError.of(expected, name=name, need=need, like=like, got=got)


class EditHooks(Hooks):
    """Applies an editor's edits at the boundaries of the original model's program: an
    edit applies at an event whose record (`BoundaryEvent.where`) is the edit's record
    in `tables` (`_edit_nodes.meeting`)."""

    def __init__(
        self,
        plan: EditPlan,
        tables: Tables,
        variables: Any,
        call_values: dict[str, Any],
        observe: Any,
    ):
        self.plan = plan
        self.tables = tables
        self.variables = variables
        self.call_values = call_values
        self.observe = observe or (lambda where, value: None)
        self.inputs: dict[Any, Any] = {}
        self.records: dict[int, Any] = {}

    def on_boundary(self, event: BoundaryEvent) -> Any:
        where, value = event.where, event.value
        if event.side == INPUT:
            value = self._after(where, event, value)
            self.inputs[event.call] = value
            self._remark(event, value)
            self.observe(where, value)
            return value
        value = self._output(where, event, value)
        self._remark(event, value)
        self.observe(where, value)
        return self._after(where, event, value)

    def _output(self, where: Selection, event: BoundaryEvent, value: Any) -> Any:
        """A call's output with its replacements and bypasses applied in the order they
        were made (one at one iteration only in that iteration): a later one wins."""
        args = self.inputs[event.call]
        call_args = args if isinstance(args, tuple) else (args,)
        for when, node in self.tables.changed.get(where, ()):
            if node is None:
                value = _only(event, when, lambda: args, value)
            else:
                run = functools.partial(self._run, node, event, call_args, value)
                value = _only(event, when, run, value)
        return value

    def _run(self, node: Node, event: BoundaryEvent, args: tuple[Any, ...], like: Any) -> Any:
        """The node's function on `args` and its call-time inputs, with the rows of its
        stacked variables and inputs that this iteration reads."""
        rows = [event.rows[d] for d in node.depths]
        variables = self.plan.node_values(self.variables, node)
        if variables is not None:
            variables = _rows(variables, rows)
        extra = [_rows(self.call_values[n], rows) for n in node.inputs]
        if not extra:
            return node.fn(variables, *args)
        try:
            out = node.fn(variables, *args, *extra)
        except Exception as error:
            raise _bad_call_inputs(node, extra, error) from error
        if not same_shapes(_shapes_of(like), _shapes_of(out)):  # broadcast by a wrong input
            raise _bad_call_inputs(
                node, extra, f"it returned {describe_shapes(out)} for {describe_shapes(like)}"
            )
        return out

    def _call_node(self, node: Node, event: BoundaryEvent, value: Any) -> Any:
        """An inserted node (and the nodes inserted after it) on `value`."""

        def run() -> Any:
            # A node that runs in one iteration only (a branch of the body) is no boundary.
            remark = is_marking() and not node.when
            record = new_record(
                origin=Origin.NODE,
                path=node.path,
                method="__call__",
                module_type=node.module_type,
            )
            self.observe(node_where(node.name, INPUT), value)
            if remark:
                mark_side(record, INPUT, ((value,), {}))
            out = self._run(node, event, (value,), value)
            if remark:
                mark_side(record, OUTPUT, out)
            output = node_where(node.name, OUTPUT)
            self.observe(output, out)
            for after in list(self.tables.after.get(output, ())):
                out = self._call_node(after, event, out)
            return out

        return _only(event, node.when, run, value)

    def _after(self, where: Selection, event: BoundaryEvent, value: Any) -> Any:
        for node in list(self.tables.after.get(where, ())):
            value = self._call_node(node, event, value)
        return value

    def _remark(self, event: BoundaryEvent, value: Any) -> None:
        """Marks the original call again in the edited model's trace, under its name."""
        if not is_marking():
            return
        call = event.call
        if event.side == INPUT:
            # Under the name the model lists: with its method (``ae.encode``), and for a
            # `js.mark`, its scope path (``grp/lin``), iteration slots left out.
            marked = call.origin is Origin.MARK
            self.records[id(call)] = new_record(
                origin=Origin.NODE,
                path=split_name(unslotted(call.template or call.name)) if marked else call.path,
                method=call.method or "__call__",  # (a scope region has none)
                module_type=call.module_type,
            )
            args = value if isinstance(value, tuple) else (value,)
            mark_side(self.records[id(call)], INPUT, (args, {}))
        else:
            mark_side(self.records[id(call)], OUTPUT, value)


def _only(event: BoundaryEvent, when: Any, compute: Callable[[], Any], otherwise: Any) -> Any:
    """``compute()``, or, for an edit at one iteration (`when`), ``compute()`` in that
    iteration and `otherwise` in the others, inside the loop, so the loop stays one scan.

    An edit that only maps values element by element (a patch, a steering vector, a
    mask) runs in every iteration and is selected (`jnp.where`), which keeps the loop
    body one fused program; anything heavier (a module) runs under `lax.cond`, only in
    its iteration (XLA compiles a conditional's branches apart: about 1.3x the model's
    compile time for a 24-layer stack, against 1.1x with a select)."""
    if not when:
        return compute()
    hit = functools.reduce(jnp.logical_and, [event.rows[d] == k for d, k in when])
    if not _compat.is_cheap(jax.make_jaxpr(compute)()):
        return jax.lax.cond(hit, compute, lambda: otherwise)
    return jax.tree_util.tree_map(lambda new, old: jnp.where(hit, new, old), compute(), otherwise)


def _rows(tree: Any, rows: Sequence[Any]) -> Any:
    """Row ``rows[0]``, then ``rows[1]``, ... of every leaf (a static or traced index)."""
    for r in rows:
        tree = jax.tree_util.tree_map(lambda x, r=r: row(x, r), tree)
    return tree


def _shapes_of(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype), tree)


def _bad_call_inputs(node: Node, values: list[Any], error: Any) -> CallInputsRejectedError:
    given, examples = (
        ", ".join(f"{n}: {describe_shapes(t)}" for n, t in zip(node.inputs, trees, strict=True))
        for trees in (values, node.samples)
    )
    return CallInputsRejectedError(node=node.name, given=given, error=error, examples=examples)


_compat.register_frames_exclusion(__file__)
