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

Sharp edges: edits apply to module outputs; the mode (keywords such as ``train=False``)
is fixed when the editor is made; NNX models are not supported (assign new submodules to
the model instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from . import _compat, _markers, _trace
from ._errors import InvalidSpecError, SliceError, UnsupportedTargetError
from ._interpret import Interpreter, _run
from ._markers import INPUT, OUTPUT
from ._names import Resolver
from ._sliced import Sliced, prune

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


@dataclasses.dataclass
class _Node:
    name: str
    fn: Callable[..., Any]  # fn(node_variables, *args) -> output
    module: Any  # the linen module, or None for a plain function
    variables: Any  # its own variables: {collection: ...} for linen, a pytree otherwise


def _describe(tree: Any) -> str:
    return str(jax.tree_util.tree_map(lambda x: f"{x.dtype}{list(x.shape)}", tree))


def _is_linen(obj: Any) -> bool:
    from .adapters._linen import is_linen

    return is_linen(obj)


class Editor:
    """A graph-editing session over a model; see `js.edit`."""

    def __init__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        traced = _trace.trace(target, args, kwargs)
        if traced.adapter.kind == "nnx":
            raise UnsupportedTargetError(
                "js.edit does not support Flax NNX models: edit an NNX model by assigning new "
                "submodules to it (e.g. `model.head = nnx.Sequential(model.head, adapter)`), "
                "then slice it with js.slice."
            )
        self._linen = traced.adapter.kind == "linen"
        self._traced = traced
        self._engine = Sliced(traced, None, None)
        self._split = traced.split
        self._resolver = Resolver(traced.graph)
        self._after: dict[str, list[_Node]] = {}
        self._replaced: dict[str, _Node] = {}
        self._removed: set[str] = set()
        self._inserted: dict[str, _Node] = {}
        self._known: dict[tuple[str, str], Any] | None = None  # see `_shapes`
        self._taken = {c.qualname for c in traced.graph.calls} | {
            c.name for c in traced.graph.calls
        }
        variables = self._split.variables
        if isinstance(variables, Mapping):
            pool = variables.get("params", {}) if self._linen else variables
            self._taken |= {str(k) for k in pool} if isinstance(pool, Mapping) else set()

    # ------------------------------------------------------------------ edits

    def insert_after(
        self, at: str, fn_or_module: Any, /, *, key: Any = None, name: str | None = None
    ) -> Editor:
        """Inserts a function or linen module after a boundary's output.

        Everything that read the boundary's output reads the node's output instead. A
        linen module's variables are initialised with `key` (on the boundary's output) and
        become trainable variables under the node's name.

        Args:
          at: the boundary (or an inserted node) whose output the node receives.
          fn_or_module: a function ``f(value)`` or a linen module.
          key: a PRNG key, needed for a linen module.
          name: the node's name (a boundary name from now on); generated if omitted.

        Returns:
          The editor, so edits chain.
        """
        target = self._resolve(at)
        if name is None:
            base = (
                type(fn_or_module).__name__
                if _is_linen(fn_or_module)
                else getattr(fn_or_module, "__name__", "fn")
            )
            name = self._fresh_name("fn" if base == "<lambda>" else base)
        self._check_new_name(name)
        node = self._new_node(fn_or_module, key, name, (self._shapes()[(target, OUTPUT)],))
        self._after.setdefault(target, []).append(node)
        self._inserted[name] = node
        try:
            self._known = self._probe()
        except Exception as error:
            self._after[target].remove(node)
            del self._inserted[name]
            raise SliceError(
                BREAKS_MODEL.format(what=f"Inserting {name!r} after {target!r}", error=error)
            ) from error
        return self

    def replace(self, at: str, fn_or_module: Any, /, *, key: Any = None) -> Editor:
        """Replaces a module call (or an inserted node) by a function or linen module.

        The replacement receives the call's array arguments. A replacing linen module's
        variables are initialised with `key` and live under the replaced call's name.

        Returns:
          The editor, so edits chain.
        """
        target = self._resolve(at)
        sample = self._shapes()[(target, INPUT)]
        # An inserted node takes one argument; a module call takes its array arguments.
        sample = (sample,) if target in self._inserted or not isinstance(sample, tuple) else sample
        if target in self._inserted:
            old = self._inserted[target]
            new = self._new_node(fn_or_module, key, target, sample)
            self._swap(old, new)
            try:
                self._known = self._probe()
            except Exception as error:
                self._swap(new, old)
                raise SliceError(
                    BREAKS_MODEL.format(what=f"Replacing {target!r}", error=error)
                ) from error
            return self
        call, _ = self._resolver.resolve(target, OUTPUT)
        if call.count > 1 and _is_linen(fn_or_module):
            raise InvalidSpecError(
                f"{call.name!r} is a module called {call.count} times; replacing one call by a module with "
                "its own variables would give two modules one name. Replace it with a function, or "
                "insert the new module with `insert_after` and remove the call."
            )
        previous = self._replaced.get(target)
        was_removed = target in self._removed
        self._removed.discard(target)
        self._replaced[target] = self._new_node(fn_or_module, key, call.name, sample)
        try:
            self._known = self._probe()
        except Exception as error:
            if previous is None:
                del self._replaced[target]
            else:
                self._replaced[target] = previous
            if was_removed:
                self._removed.add(target)
            raise SliceError(
                BREAKS_MODEL.format(what=f"Replacing {target!r}", error=error)
            ) from error
        return self

    def remove(self, at: str, /) -> Editor:
        """Bypasses a module call or an inserted node: its output becomes its input.

        Raises:
          SliceError: if the input and output differ in structure, shape or dtype.

        Returns:
          The editor, so edits chain.
        """
        target = self._resolve(at)
        values = self._shapes()
        inp, out = values[(target, INPUT)], values[(target, OUTPUT)]
        same = jax.tree_util.tree_structure(inp) == jax.tree_util.tree_structure(out) and all(
            a.shape == b.shape and a.dtype == b.dtype
            for a, b in zip(
                jax.tree_util.tree_leaves(inp), jax.tree_util.tree_leaves(out), strict=True
            )
        )
        if not same:
            raise SliceError(
                REMOVE_MISMATCH.format(name=target, inp=_describe(inp), out=_describe(out))
            )
        self._known = None  # the bypass changes what follows
        if target in self._inserted:
            node = self._inserted.pop(target)
            following = self._after.pop(target, [])
            for nodes in self._after.values():
                if node in nodes:
                    i = nodes.index(node)
                    nodes[i : i + 1] = following
            return self
        self._replaced.pop(target, None)
        self._removed.add(target)
        return self

    # ------------------------------------------------------------------ results

    @property
    def variables(self) -> Any:
        """The edited model's variables: the model's, plus those of new modules."""
        base = self._split.variables
        nodes = self._nodes()
        if not any(n.variables is not None for n in nodes):
            return base
        if not isinstance(base, Mapping):
            raise InvalidSpecError(
                "New modules bring variables, but the model's variables are not a dict, so there is "
                "no place for them. Use a dict of parameters, or insert plain functions."
            )
        shadowed = {
            p
            for p, _ in jax.tree_util.tree_flatten_with_path(base)[0]
            if self._owner(p) is not None
        }
        kept = set(p for p, _ in jax.tree_util.tree_flatten_with_path(base)[0]) - shadowed
        out = prune(base, kept) or {}
        out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in out.items()}
        for node in nodes:
            if node.variables is None:
                continue
            if self._linen:
                for collection, values in node.variables.items():
                    out.setdefault(collection, {})[node.name] = values
            else:
                out[node.name] = node.variables
        return out

    def build(self) -> Sliced:
        """The whole edited model as a `js.Sliced` (trainable, jit-compiled)."""
        return self.slice()

    def slice(self, start: Any = None, end: Any = None) -> Sliced:
        """A slice of the edited model; inserted nodes are boundaries too."""
        return Sliced(self._trace(), start, end)

    def boundaries(self) -> Any:
        """`js.boundaries` of the edited model."""
        from ._listing import describe

        return describe(self._trace())

    def to_networkx(self, depth: int | None = None) -> Any:
        """The edited model's module DAG; new and replaced nodes have ``in_slice`` set."""
        dag = self.build()._dag(depth, whole=True)
        edited = set(self._inserted) | set(self._replaced)
        for name, attrs in dag.nodes(data=True):
            if not name.startswith("<"):
                attrs["in_slice"] = name in edited
        for attrs in dag.graph.get("containers", {}).values():
            attrs["in_slice"] = True
        return dag

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

    def _trace(self) -> _trace.Traced:
        fn = _EditedModel(self, None)
        return _trace.trace(fn, (self.variables, *self._split.args), dict(self._split.kwargs))

    def _nodes(self) -> list[_Node]:
        return list(self._inserted.values()) + list(self._replaced.values())

    def _owner(self, path: tuple[Any, ...]) -> _Node | None:
        """The new node whose variables live at `path`, if any."""
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        name_at = keys[1] if self._linen and len(keys) > 1 else (keys[0] if keys else None)
        for node in self._nodes():
            if node.variables is not None and str(name_at) == node.name:
                return node
        return None

    def _resolve(self, name: str) -> str:
        if isinstance(name, str) and name in self._inserted:
            return name
        call, _ = self._resolver.resolve(name, OUTPUT)
        return call.qualname

    def _fresh_name(self, base: str) -> str:
        i = 0
        while f"{base}_{i}" in self._taken or f"{base}_{i}" in self._inserted:
            i += 1
        return f"{base}_{i}"

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name or "@" in name or ":" in name:
            raise InvalidSpecError(
                f"A node name must be a non-empty string without '@' or ':', got {name!r}."
            )
        if name in self._taken or name in self._inserted:
            raise InvalidSpecError(
                f"{name!r} is already taken by a boundary or a variable; pick another `name=`."
            )

    def _swap(self, old: _Node, new: _Node) -> None:
        self._inserted[old.name] = new
        for nodes in self._after.values():
            for i, n in enumerate(nodes):
                if n is old:
                    nodes[i] = new

    def _new_node(self, fn_or_module: Any, key: Any, name: str, args: tuple[Any, ...]) -> _Node:
        if _is_linen(fn_or_module):
            if key is None:
                raise InvalidSpecError(
                    f"The module {type(fn_or_module).__name__} needs `key=` to initialise its variables, "
                    "e.g. key=jax.random.key(0)."
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

    def _shapes(self) -> dict[tuple[str, str], Any]:
        """Shapes at every boundary of the edited model as it stands (probed once per edit)."""
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

        jax.eval_shape(
            _EditedModel(self, record), self.variables, *self._split.args, **self._split.kwargs
        )
        return seen


class _EditedModel:
    """The edited model as a plain function ``fn(variables, *inputs)``."""

    def __init__(self, editor: Editor, observe: Callable[[str, str, Any], None] | None):
        self.editor = editor
        self.observe = observe
        self.__name__ = "edited"
        # Linen name stacks would add regions named after classes ("Model/block"): the
        # edited model's boundaries are exactly the marked calls.
        self._jaxslice_name_scopes = False

    def __call__(self, variables: Any, *inputs: Any, **kwargs: Any) -> Any:
        editor = self.editor
        entry, leaves = editor._engine._lookup(inputs, kwargs, None, False)
        # Variables of the original model, except those a new module now owns: replaced
        # modules' equations still read their original values (they are dead code).
        given = {
            p: x
            for p, x in jax.tree_util.tree_flatten_with_path(variables)[0]
            if editor._owner(p) is None
        }
        original = dict(jax.tree_util.tree_flatten_with_path(editor._split.variables)[0])
        merged = {**original, **given}
        values = [merged[p] for p in entry.traced.graph.variable_paths]
        interp = _EditInterpreter(editor, variables, self.observe)
        return _run(entry.traced.graph, interp, values, [], leaves)[0]


class _EditInterpreter(Interpreter):
    def __init__(
        self, editor: Editor, variables: Any, observe: Callable[[str, str, Any], None] | None
    ):
        self.editor = editor
        self.variables = variables
        self.observe = observe
        self.inputs: dict[str, Any] = {}
        self.records: dict[int, Any] = {}

    def _node_variables(self, node: _Node) -> Any:
        if node.variables is None:
            return None
        if self.editor._linen:
            return {c: self.variables[c][node.name] for c in node.variables}
        return self.variables[node.name]

    def _see(self, name: str, side: str, value: Any) -> None:
        if self.observe is not None:
            self.observe(name, side, value)

    def _call_node(self, node: _Node, value: Any) -> Any:
        args = (value,)  # an inserted node receives the output it follows, whatever its structure
        node_vars = self._node_variables(node)
        self._see(node.name, INPUT, value)
        out = _markers.call_marked(
            lambda *a: node.fn(node_vars, *a),
            args,
            {},
            kind="edit",
            path=tuple(node.name.split("/")),
            method="__call__",
            module_type=type(node.module).__name__
            if node.module is not None
            else getattr(node.fn, "__name__", "function"),
        )
        self._see(node.name, OUTPUT, out)
        return self._after(node.name, out)

    def _after(self, name: str, value: Any) -> Any:
        for node in list(self.editor._after.get(name, ())):
            value = self._call_node(node, value)
        return value

    def _remark(self, side: str, value: Any) -> None:
        """Marks the original call again in the edited model's trace, under its name."""
        if not _markers.is_marking():
            return
        call = self._current_call
        if side == INPUT:
            self.records[id(call)] = _markers.new_record(
                kind="edit",
                path=tuple(call.name.split("/")),
                method="__call__",
                module_type=call.module_type,
            )
            _markers.mark_side(
                self.records[id(call)], INPUT, (value if isinstance(value, tuple) else (value,), {})
            )
        else:
            _markers.mark_side(self.records[id(call)], OUTPUT, value)

    def boundary(self, name: str, side: str, value: Any) -> Any:
        if side == INPUT:
            self.inputs[name] = value
            self._remark(INPUT, value)
            self._see(name, INPUT, value)
            return value
        if name in self.editor._removed:
            value = self.inputs[name]
        elif name in self.editor._replaced:
            node = self.editor._replaced[name]
            args = self.inputs[name]
            value = node.fn(
                self._node_variables(node), *(args if isinstance(args, tuple) else (args,))
            )
        self._remark(OUTPUT, value)
        self._see(name, OUTPUT, value)
        return self._after(name, value)


def edit(target: Any, *args: Any, **kwargs: Any) -> Editor:
    """A graph-editing session: insert, replace and remove nodes at module boundaries.

    Args:
      target, *args, **kwargs: as for `js.slice` (linen models and plain functions).

    Returns:
      An `Editor` with ``insert_after(at, fn_or_module, *, key=None, name=None)``,
      ``replace(at, fn_or_module, *, key=None)`` and ``remove(at)`` (each returns the
      editor), ``build()`` and ``slice(start=..., end=...)`` (each a `js.Sliced`),
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
