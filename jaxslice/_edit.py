"""Editing a model at its boundaries: insert, replace and remove nodes.

An `Editor` never touches the model or its variables. It builds an *edited model*: a
plain function ``edited(variables, *inputs)`` that evaluates the original model's traced
program (re-traced per input shape) through an interpreter whose boundary hook applies
the edits, and that marks every original module call again under its own name, plus each
inserted node under its name. The edited model is then sliced like any other, so
`build` and `slice` return ordinary `js.Sliced` objects, and inserted nodes are
boundaries like the rest.

Variables of the edited model are the model's plus, for each new module, its own
collections under its node name: ``variables["params"][name]`` for linen models,
``variables[name]`` for plain functions whose parameters are a dict. A replacing module
takes the replaced call's name, and the replaced module's own variables leave the edited
model (its dead equations read their original values, and are dropped from slices).

An `Editor` holds an immutable tuple of edit records. An edit builds the next tuple and
checks the edited model with it; only if that works does the editor take it (and return
itself, so edits chain). A failed edit changes nothing, so there is nothing to roll back;
`copy` gives an independent editor to branch from.

Sharp edges: `insert_after` acts on a module's output, or on its input with the
``:input`` port; `replace` and `remove` act on whole calls. The mode (keywords such as
``train=False``) is fixed when the editor is made; NNX models are not supported (assign
new submodules to the model instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from . import _compat
from ._core.emit import BoundaryEvent, Equation
from ._core.emit import evaluate as evaluate_graph
from ._core.markers import INPUT, OUTPUT, Origin, is_marking, mark_side, new_record
from ._core.names import Resolver, parse
from ._core.program import SliceProgram
from ._core.trace import Traced, trace
from ._core.view import DrawsInline
from ._errors import InvalidSpecError, SliceError, UnsupportedTargetError
from ._slice import view
from ._table import BoundaryTable, describe
from ._trees import prune
from .adapters import adapter_for
from .adapters._plain import PlainAdapter

REMOVE_MISMATCH = (
    "Cannot remove {name!r}: removing bypasses a module (its output becomes its input), so "
    "its input and output must have the same structure, shapes and dtypes, but\n"
    "  input:  {inp}\n  output: {out}\n"
    "Use `replace({name!r}, fn)` with a function that maps one to the other instead."
)
BREAKS_MODEL = (
    "{what} breaks the model after it: {error}\n"
    "The new node must return what the rest of the model reads (same structure, shapes and "
    "dtypes), unless nothing reads that value afterwards (a new head, say)."
)
WHOLE_CALLS = (
    "{op}({name!r}) acts on a whole module call, so it takes no port suffix; use "
    "{op}({base!r}). To change only what a module receives, use "
    "insert_after({base_input!r}, fn)."
)


@dataclasses.dataclass(frozen=True)
class _Node:
    name: str
    fn: Callable[..., Any]  # fn(node_variables, *args) -> output
    module: Any  # the linen module, or None for a plain function
    variables: Any  # its own variables ({collection: ...} for linen), or None

    @property
    def module_type(self) -> str:
        if self.module is not None:
            return type(self.module).__name__
        return getattr(self.fn, "__name__", "function")


@dataclasses.dataclass(frozen=True)
class _Edit:
    op: str  # "insert", "replace" or "remove"
    at: str  # the call's qualified name or an inserted node's name
    port: str  # the side an insertion acts on
    node: _Node | None = None


@dataclasses.dataclass
class _Tables:
    """The edits replayed: what happens at each boundary of the edited model."""

    after: dict[tuple[str, str], list[_Node]] = dataclasses.field(default_factory=dict)
    replaced: dict[str, _Node] = dataclasses.field(default_factory=dict)
    removed: set[str] = dataclasses.field(default_factory=set)
    inserted: dict[str, _Node] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, edits: tuple[_Edit, ...]) -> _Tables:
        t = cls()
        for e in edits:
            getattr(t, f"_{e.op}")(e)
        return t

    def _insert(self, e: _Edit) -> None:
        self.after.setdefault((e.at, e.port), []).append(e.node)
        self.inserted[e.node.name] = e.node

    def _replace(self, e: _Edit) -> None:
        if e.at in self.inserted:
            old = self.inserted[e.at]
            self.inserted[e.at] = e.node
            for nodes in self.after.values():
                nodes[:] = [e.node if n is old else n for n in nodes]
            return
        self.removed.discard(e.at)
        self.replaced[e.at] = e.node

    def _remove(self, e: _Edit) -> None:
        if e.at not in self.inserted:
            self.replaced.pop(e.at, None)
            self.removed.add(e.at)
            return
        node = self.inserted.pop(e.at)
        following = self.after.pop((e.at, OUTPUT), [])
        for nodes in self.after.values():
            if node in nodes:
                i = nodes.index(node)
                nodes[i : i + 1] = following

    def nodes(self) -> list[_Node]:
        return list(self.inserted.values()) + list(self.replaced.values())


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
        refusal = adapter_for(target).edit_refusal()
        if refusal is not None:
            raise UnsupportedTargetError(refusal)
        program = SliceProgram.build(target, args, kwargs, None, None)
        self._variables = program.adapter.split(target, args, kwargs).variables
        graph = program.base.traced.graph
        taken = {c.qualname for c in graph.calls} | {c.name for c in graph.calls}
        taken |= program.adapter.variable_names(self._variables)
        self._base = _Base(program, Resolver(graph), frozenset(taken))
        self._edits: tuple[_Edit, ...] = ()
        self._tables = _Tables()
        self._known: dict[tuple[str, str], Any] | None = None

    def _commit(self, edit: _Edit, probe: str | None) -> Editor:
        """Adds `edit`: the editor's state is replaced at once, only if the edit works."""
        new = self._with(edit, probe)
        self._edits, self._tables, self._known = new._edits, new._tables, new._known
        return self

    def copy(self) -> Editor:
        """An independent editor with the same edits (later edits to either stay apart)."""
        new = object.__new__(Editor)
        new.__dict__.update(self.__dict__)
        return new

    def _with(self, edit: _Edit, probe: str | None) -> Editor:
        """A new editor with `edit` added; `probe` names the edit for error messages."""
        new = self.copy()
        new._edits = self._edits + (edit,)
        new._tables = _Tables.of(new._edits)
        new._known = None
        if probe is not None:
            try:
                new._known = new._probe()
            except SliceError:
                raise
            except Exception as error:
                raise SliceError(BREAKS_MODEL.format(what=probe, error=error)) from error
        return new

    # ------------------------------------------------------------------ edits

    def insert_after(
        self, at: str, fn_or_module: Any, /, *, key: Any = None, name: str | None = None
    ) -> Editor:
        """Inserts a function or linen module after a boundary's output (or input).

        Everything that read the boundary's output reads the node's output instead. With
        the ``:input`` port (``"block:input"``) the node transforms what the module
        receives. A linen module's variables are initialised with `key` (on the value it
        receives) and become trainable variables under the node's name.

        Args:
          at: the boundary (or an inserted node) whose value the node receives.
          fn_or_module: a function ``f(value)`` or a linen module.
          key: a PRNG key, needed for a linen module.
          name: the node's name (a boundary name from now on); generated if omitted.

        Returns:
          The editor, so edits chain.
        """
        target, port = self._resolve(at)
        name = self._fresh_name(fn_or_module) if name is None else name
        self._check_new_name(name)
        node = _new_node(fn_or_module, key, name, (self._shapes()[(target, port)],))
        edit = _Edit("insert", target, port, node)
        return self._commit(edit, f"Inserting {name!r} after {target!r}:{port}")

    def replace(self, at: str, fn_or_module: Any, /, *, key: Any = None) -> Editor:
        """Replaces a module call (or an inserted node) by a function or linen module.

        The replacement receives the call's array arguments. A replacing linen module's
        variables are initialised with `key` and live under the replaced call's name.

        Returns:
          The editor, so edits chain.
        """
        target = self._whole_call("replace", at)
        sample = self._shapes()[(target, INPUT)]
        inserted = target in self._tables.inserted
        sample = (sample,) if inserted or not isinstance(sample, tuple) else sample
        name = target if inserted else self._base.resolver.resolve(target, OUTPUT)[0].name
        self._check_replaceable(target, fn_or_module)
        node = _new_node(fn_or_module, key, name, sample)
        return self._commit(_Edit("replace", target, OUTPUT, node), f"Replacing {target!r}")

    def remove(self, at: str, /) -> Editor:
        """Bypasses a module call or an inserted node: its output becomes its input.

        Raises:
          SliceError: if the input and output differ in structure, shape or dtype.

        Returns:
          The editor, so edits chain.
        """
        target = self._whole_call("remove", at)
        values = self._shapes()
        inp, out = values[(target, INPUT)], values[(target, OUTPUT)]
        if not _same_shapes(inp, out):
            raise SliceError(
                REMOVE_MISMATCH.format(name=target, inp=_describe(inp), out=_describe(out))
            )
        return self._commit(_Edit("remove", target, OUTPUT), None)

    # ------------------------------------------------------------------ results

    @property
    def variables(self) -> Any:
        """The edited model's variables: the model's, plus those of new modules."""
        base = self._variables
        nodes = [n for n in self._tables.nodes() if n.variables is not None]
        if not nodes:
            return base
        if not isinstance(base, Mapping):
            raise InvalidSpecError(
                "New modules bring variables, but the model's variables are not a dict, so "
                "there is no place for them. Use a dict of parameters, or insert plain functions."
            )
        kept = {
            p for p, _ in jax.tree_util.tree_flatten_with_path(base)[0] if self._owner(p) is None
        }
        out = prune(base, kept) or {}
        out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in out.items()}
        for node in nodes:
            self._base.program.adapter.with_node(out, node.name, node.variables)
        return out

    def build(self) -> Any:
        """The whole edited model as a `js.Sliced` (trainable, jit-compiled)."""
        return self.slice()

    def slice(self, start: Any = None, end: Any = None) -> Any:
        """A slice of the edited model; inserted nodes are boundaries too."""
        return view(SliceProgram(self._trace(), start, end))

    def boundaries(self) -> BoundaryTable:
        """`js.boundaries` of the edited model."""
        return describe(self._trace())

    def to_networkx(self, depth: int | None = None) -> Any:
        """The edited model's module DAG; new and replaced nodes have ``in_slice`` set."""
        from .render import slice_graph

        dag = slice_graph(SliceProgram(self._trace(), None, None), depth, whole=True)
        edited = set(self._tables.inserted) | set(self._tables.replaced)
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

    def _trace(self) -> Traced:
        split = self._base.split
        args = (self.variables, *split.args)
        return trace(_EditedModel(self, None), args, dict(split.kwargs), adapter=_EDITED)

    def _owner(self, path: tuple[Any, ...]) -> _Node | None:
        """The new node whose variables live at `path`, if any."""
        name = self._base.program.adapter.node_of(path)
        nodes = self._tables.nodes()
        return next((n for n in nodes if n.variables is not None and name == n.name), None)

    def _resolve(self, spec: str) -> tuple[str, str]:
        """The qualified name and port of a boundary or an inserted node."""
        if isinstance(spec, str):
            base, _, port = parse(spec)
            if base in self._tables.inserted:
                return base, port or OUTPUT
        call, port = self._base.resolver.resolve(spec, OUTPUT)
        return call.qualname, port

    def _whole_call(self, op: str, spec: str) -> str:
        target, port = self._resolve(spec)
        if isinstance(spec, str) and parse(spec)[2] is not None:
            base = spec.rpartition(":")[0]
            raise InvalidSpecError(
                WHOLE_CALLS.format(op=op, name=spec, base=base, base_input=f"{base}:input")
            )
        return target

    def _check_replaceable(self, target: str, fn_or_module: Any) -> None:
        if target in self._tables.inserted:
            return
        call, _ = self._base.resolver.resolve(target, OUTPUT)
        if call.count > 1 and _is_linen(fn_or_module):
            raise InvalidSpecError(
                f"{call.name!r} is a module called {call.count} times; replacing one call by a "
                "module with its own variables would give two modules one name. Replace it with "
                "a function, or insert the new module with `insert_after` and remove the call."
            )

    def _fresh_name(self, fn_or_module: Any) -> str:
        base = (
            type(fn_or_module).__name__
            if _is_linen(fn_or_module)
            else getattr(fn_or_module, "__name__", "fn")
        )
        base = "fn" if base == "<lambda>" else base
        i = 0
        while f"{base}_{i}" in self._base.taken or f"{base}_{i}" in self._tables.inserted:
            i += 1
        return f"{base}_{i}"

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or "@" in name or ":" in name:
            raise InvalidSpecError(
                f"A node name must be a non-empty string without '@' or ':', got {name!r}."
            )
        if name in self._base.taken or name in self._tables.inserted:
            raise InvalidSpecError(
                f"{name!r} is already taken by a boundary or a variable; pick another `name=`."
            )

    def _shapes(self) -> dict[tuple[str, str], Any]:
        """Shapes at every boundary of the edited model as it stands (probed once)."""
        if self._known is None:
            self._known = self._probe()
        return self._known

    def _probe(self) -> dict[tuple[str, str], Any]:
        """Shapes at every boundary of the edited model, from one abstract evaluation."""
        seen: dict[tuple[str, str], Any] = {}

        def record(name: str, side: str, value: Any) -> None:
            seen[(name, side)] = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), value
            )

        split = self._base.split
        jax.eval_shape(_EditedModel(self, record), self.variables, *split.args, **split.kwargs)
        return seen


# The edited model's boundaries are exactly the calls it marks: linen name stacks would
# add regions named after classes ("Model/block").
_EDITED = PlainAdapter(name_scopes=False)


def _is_linen(obj: Any) -> bool:
    from .adapters._linen import LinenAdapter

    return LinenAdapter.accepts(obj)


def _new_node(fn_or_module: Any, key: Any, name: str, args: tuple[Any, ...]) -> _Node:
    if _is_linen(fn_or_module):
        if key is None:
            raise InvalidSpecError(
                f"The module {type(fn_or_module).__name__} needs `key=` to initialise its "
                "variables, e.g. key=jax.random.key(0)."
            )
        zeros = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape, a.dtype), args)
        module = fn_or_module
        variables = dict(module.init(key, *zeros))
        return _Node(name, lambda v, *a: module.apply(v, *a), module, variables)
    if callable(fn_or_module):
        f = fn_or_module
        return _Node(name, lambda v, *a: f(*a), None, None)
    raise InvalidSpecError(
        f"Expected a function or a linen module, got {type(fn_or_module).__name__}."
    )


def _describe(tree: Any) -> str:
    return str(jax.tree_util.tree_map(lambda x: f"{x.dtype}{list(x.shape)}", tree))


def _same_shapes(a: Any, b: Any) -> bool:
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    return all(x.shape == y.shape and x.dtype == y.dtype for x, y in pairs)


class _EditedModel:
    """The edited model as a plain function ``fn(variables, *inputs)``."""

    def __init__(self, editor: Editor, observe: Callable[[str, str, Any], None] | None):
        self.editor = editor
        self.observe = observe
        self.__name__ = "edited"

    def __call__(self, variables: Any, *inputs: Any, **kwargs: Any) -> Any:
        editor = self.editor
        program = editor._base.program
        entry, leaves = program.lookup(inputs, kwargs, None, False)
        # Variables of the original model, except those a new module now owns: replaced
        # modules' equations still read their original values (they are dead code).
        flat = jax.tree_util.tree_flatten_with_path
        given = {p: x for p, x in flat(variables)[0] if editor._owner(p) is None}
        merged = {**dict(flat(editor._variables)[0]), **given}
        values = [merged[p] for p in entry.traced.graph.variable_paths]
        hooks = _EditHooks(editor, variables, self.observe)
        return evaluate_graph(entry.traced.graph, hooks, values, [], leaves)


class _EditHooks:
    """Applies an editor's edits at the boundaries of the original model's program."""

    recurse = False

    def __init__(self, editor: Editor, variables: Any, observe: Any):
        self.tables = editor._tables
        self.adapter = editor._base.program.adapter
        self.variables = variables
        self.observe = observe or (lambda name, side, value: None)
        self.inputs: dict[str, Any] = {}
        self.records: dict[int, Any] = {}

    def equation(self, eqn: Equation, inputs: list[Any], outputs: list[Any]) -> list[Any]:
        return outputs

    def on_boundary(self, event: BoundaryEvent) -> Any:
        name, value = event.name, event.value
        if event.side == INPUT:
            value = self._after(name, INPUT, value)
            self.inputs[name] = value
            self._remark(event, value)
            self.observe(name, INPUT, value)
            return value
        value = self._output(name, value)
        self._remark(event, value)
        self.observe(name, OUTPUT, value)
        return self._after(name, OUTPUT, value)

    def _output(self, name: str, value: Any) -> Any:
        if name in self.tables.removed:
            return self.inputs[name]
        node = self.tables.replaced.get(name)
        if node is None:
            return value
        args = self.inputs[name]
        return node.fn(self._node_variables(node), *(args if isinstance(args, tuple) else (args,)))

    def _node_variables(self, node: _Node) -> Any:
        if node.variables is None:
            return None
        return self.adapter.node_variables(self.variables, node.name, node.variables)

    def _call_node(self, node: _Node, value: Any) -> Any:
        record = new_record(
            origin=Origin.NODE,
            path=tuple(node.name.split("/")),
            method="__call__",
            module_type=node.module_type,
        )
        self.observe(node.name, INPUT, value)
        if is_marking():
            mark_side(record, INPUT, ((value,), {}))
        out = node.fn(self._node_variables(node), value)
        if is_marking():
            mark_side(record, OUTPUT, out)
        self.observe(node.name, OUTPUT, out)
        return self._after(node.name, OUTPUT, out)

    def _after(self, name: str, port: str, value: Any) -> Any:
        for node in list(self.tables.after.get((name, port), ())):
            value = self._call_node(node, value)
        return value

    def _remark(self, event: BoundaryEvent, value: Any) -> None:
        """Marks the original call again in the edited model's trace, under its name."""
        if not is_marking():
            return
        call = event.call
        if event.side == INPUT:
            self.records[id(call)] = new_record(
                origin=Origin.NODE,
                path=call.path,
                method="__call__",
                module_type=call.module_type,
            )
            args = value if isinstance(value, tuple) else (value,)
            mark_side(self.records[id(call)], INPUT, (args, {}))
        else:
            mark_side(self.records[id(call)], OUTPUT, value)


def edit(target: Any, *args: Any, **kwargs: Any) -> Editor:
    """A graph-editing session: insert, replace and remove nodes at module boundaries.

    Args:
      target, *args, **kwargs: as for `js.slice` (linen models and plain functions).

    Returns:
      An `Editor` with ``insert_after(at, fn_or_module, *, key=None, name=None)``,
      ``replace(at, fn_or_module, *, key=None)`` and ``remove(at)`` (each returns the
      editor, so edits chain; a failed edit changes nothing), ``copy()``, ``build()`` and ``slice(start=..., end=...)`` (each a `js.Sliced`),
      ``variables`` and ``boundaries()``. The original model and variables never change.

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
