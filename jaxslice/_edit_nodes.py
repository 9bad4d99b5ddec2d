"""What an edit adds, and where: new nodes, edit sites, edit records and their replay.

An edit is an immutable record (`Edit`): what it does (insert, replace, remove), where
(`Selection`: a boundary, an iteration of one inside scans or all of them, or a node inserted
before) and the new `Node` (a function of the value there, of the node's own variables and
of call-time inputs). `Tables` replays a tuple of records into what happens at each
boundary of the edited model; the edited model (`_edited.py`) reads only the tables.

Nodes are functions, or modules: a linen module is initialised here (once per iteration
when it is inserted at every iteration of a loop, each row from its own key); modules of
libraries whose modules hold their variables (NNX, Equinox) come from their adapter.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax

from ._core.markers import OUTPUT
from ._core.names import STACKED, fill, node_place, shown, split_name, unslotted
from ._core.selection import Name, Resolver, Selection
from ._errors import (
    CallInputLikeError,
    CallInputNamesError,
    CallInputRowsError,
    LinenNodeStateError,
    NodeKeyError,
    NotANodeError,
    UnstackedNodeError,
)
from .adapters._base import NewModule


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    fn: Callable[..., Any]  # fn(node_variables, *args, *call_inputs) -> output
    module: Any  # the linen module, or None for a plain function
    variables: Any  # its own variables ({collection: ...} for linen), or None
    inputs: tuple[str, ...] = ()  # names of its call-time inputs
    samples: tuple[Any, ...] = ()  # their shapes and dtypes (`jax.ShapeDtypeStruct`s)
    site: Selection | None = None  # where it was put
    # What of the node, besides its variables, decides the edited program (an NNX
    # module's graph definition: its mode); None where nothing can change.
    structure_of: Callable[[], Any] | None = None

    @property
    def structure(self) -> Any:
        return self.structure_of() if self.structure_of is not None else None

    @property
    def stacked(self) -> tuple[int, ...]:
        """Loop lengths its variables and call-time inputs are stacked over: one per
        ``[:]`` of the name it was put at, outermost first."""
        return self.site.lengths if self.site is not None else ()

    @property
    def depths(self) -> tuple[int, ...]:
        """Which enclosing loops those are (their depths)."""
        return self.site.depths if self.site is not None else ()

    @property
    def when(self) -> tuple[tuple[int, int], ...]:
        """The only iterations it runs in, ``(depth, k)``; empty for all of them."""
        return self.site.when if self.site is not None else ()

    @property
    def template(self) -> str:
        """Its name in the edited model, with the loops' iteration slots (see
        `node_template`)."""
        return self.name if self.site is None else node_template(self.site, self.name)

    @property
    def path(self) -> tuple[str, ...]:
        """The module path it is marked under in the edited model."""
        return split_name(unslotted(self.template))

    @property
    def listed(self) -> str:
        """Its name as the edited model's boundaries list it (``layers[:]/node``)."""
        return shown(self.template)

    @property
    def module_type(self) -> str:
        if self.module is not None:
            return type(self.module).__name__
        return getattr(self.fn, "__name__", "function")


def node_template(site: Selection, name: str) -> str:
    """The name of a node `name` put at `site`, in the edited model, with the loops'
    iteration slots: at the top of the loop body it runs in (``layers[:]/name`` for a
    node at ``layers[:]/mlp``, as `names.node_place` says), or of the model outside loops."""
    if not site.path:
        return name
    parent, slot = node_place(site.call.template)
    own = name + slot  # (a node's name holds no character a name escapes)
    return f"{parent}/{own}" if parent else own


def meeting(at: Selection) -> Selection:
    """The record the running model meets an edit at `at` by (`BoundaryEvent.where`): in
    every iteration (a loop body runs once for all of them, `at.when` picks its
    iterations), or, for an inserted node, the node's own (`node_where`)."""
    if at.node is not None:
        return node_where(at.node, at.side)
    return dataclasses.replace(at.every(), whole=False)


def node_where(name: str, side: str) -> Selection:
    """The record of one side of an inserted node, as the edited model runs it."""
    return Selection(None, None, side, node=name)


@dataclasses.dataclass(frozen=True)
class Edit:
    op: str  # "insert", "replace" or "remove"
    at: Selection  # a call (its iterations, inside loops) or an inserted node, and a side
    node: Node | None = None


@dataclasses.dataclass
class Tables:
    """The edits replayed: what happens at each boundary of the edited model, by the
    record the running model meets it by (`meeting`). `after` holds the nodes inserted
    at each record (a call's or a node's side); `changed` holds, per call (its output's
    record) and in the order they were made, its replacements (a node) and bypasses
    (None), each for the iterations `when` names (all if empty): a later one wins where
    both apply."""

    after: dict[Selection, list[Node]] = dataclasses.field(default_factory=dict)
    changed: dict[Selection, list[tuple[tuple[tuple[int, int], ...], Node | None]]] = (
        dataclasses.field(default_factory=dict)
    )
    inserted: dict[str, Node] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, edits: tuple[Edit, ...]) -> Tables:
        t = cls()
        for e in edits:
            getattr(t, f"_{e.op}")(e)
        return t

    def _insert(self, e: Edit) -> None:
        self.after.setdefault(meeting(e.at), []).append(e.node)
        self.inserted[e.node.name] = e.node

    def _replace(self, e: Edit) -> None:
        at = e.at.node
        if at is not None:
            old = self.inserted[at]
            self.inserted[at] = e.node
            for nodes in self.after.values():
                nodes[:] = [e.node if n is old else n for n in nodes]
            return
        self._change(e.at, e.node)

    def _remove(self, e: Edit) -> None:
        at = e.at.node
        if at is None:
            self._change(e.at, None)
            return
        node = self.inserted.pop(at)
        following = self.after.pop(node_where(at, OUTPUT), [])
        for nodes in self.after.values():
            if node in nodes:
                i = nodes.index(node)
                nodes[i : i + 1] = following

    def _change(self, site: Selection, node: Node | None) -> None:
        """A replacement (or bypass) of a call; one made before for the same iterations
        is superseded (and its variables leave the edited model)."""
        changes = self.changed.setdefault(meeting(site), [])
        changes[:] = [c for c in changes if c[0] != site.when]
        changes.append((site.when, node))

    def moved(self, resolver: Any) -> Tables:
        """The same tables for another graph of the model (traced again at new shapes):
        each call's record is that call's in the graph of `resolver` (`Resolver.same`)."""
        return Tables(
            {resolver.same(w): nodes for w, nodes in self.after.items()},
            {resolver.same(w): changes for w, changes in self.changed.items()},
            self.inserted,
        )

    def node_named(self, name: str) -> Node | None:
        """The inserted node of that name, or listed under that name (``layers[:]/n``)."""
        found = self.inserted.get(name)
        return found or next((n for n in self.inserted.values() if n.listed == name), None)

    def nodes(self) -> list[Node]:
        replacing = [n for changes in self.changed.values() for _, n in changes if n]
        return list(self.inserted.values()) + replacing

    def call_inputs(self) -> dict[str, tuple[Node, Any]]:
        """``{name: (node, sample)}`` of every call-time input of the edited model."""
        return {
            name: (node, sample)
            for node in self.nodes()
            for name, sample in zip(node.inputs, node.samples, strict=True)
        }


@dataclasses.dataclass(frozen=True)
class Preview:
    """What an edit at one name would touch, before anything changes (`Editor.at`).

    Attributes:
      where: the record the name resolves to (`selection.Selection`).
      names: the name of each call the edit touches: one per iteration the name picks
        inside loops (``layers[0]/mlp``, ``layers[1]/mlp``, ... for ``layers[:]/mlp``).
      iterations: for each of them, its iteration in each enclosing loop, outermost
        first (``()`` outside loops; ``":"`` for every iteration of a `while`).
      value: the shapes and dtypes (`jax.ShapeDtypeStruct`s) of the value there, one
        iteration's: what an inserted node receives.
    """

    where: Selection
    names: tuple[str, ...]
    iterations: tuple[tuple[int, ...], ...]
    value: Any

    @classmethod
    def of(cls, where: Selection, value: Any) -> Preview:
        lengths = [
            range(s.length) if k == STACKED and s.length else (k,)  # a `while`: ":"
            for s, k in zip(where.sites, where.path, strict=True)
        ]
        paths = list(itertools.product(*lengths))
        if where.node is None:
            names = [dataclasses.replace(where, path=p).name for p in paths]
        else:  # an inserted node, at the top of the loop body it runs in
            names = [fill(node_template(where, where.node), p) for p in paths]
        return cls(where, tuple(names), tuple(paths), value)

    @property
    def count(self) -> int | None:
        """How many calls (iterations) the edit touches; None where a loop's count is
        known only when it runs (a `while`: its one name and iteration hold ``[:]``)."""
        uncounted = any(k == STACKED for p in self.iterations for k in p)
        return None if uncounted else len(self.names)

    @property
    def side(self) -> str:
        return self.where.side

    def __repr__(self) -> str:
        few = len(self.names) <= 4
        names = ", ".join(self.names) if few else f"{self.names[0]}, ..., {self.names[-1]}"
        count = "every iteration's" if self.count is None else f"{self.count}"
        return f"Preview({self.where.spec!r}: {count} call(s) at their {self.side}: {names})"


def site_of(spec: Any, resolver: Resolver, tables: Tables) -> Selection:
    """Where `spec` (a name, parsed or not) points: a boundary (an iteration of one
    inside scans, or all of them) or an inserted node, and the side (the output unless
    ``:input``), as a record of the model's graph (`resolver`)."""
    name = Name.of(spec) if isinstance(spec, str) else spec
    if isinstance(name, Name):
        node = tables.node_named(name.base)
        if node is not None:
            side = name.port or OUTPUT
            return dataclasses.replace(node.site, spec=name.spec, side=side, node=node.name)
    return resolver.select(name, OUTPUT, uncounted=True)  # a `while` body's calls at [:]


def is_linen(obj: Any) -> bool:
    from .adapters._linen import LinenAdapter

    return LinenAdapter.accepts(obj)


def new_node(
    adapter: Any, obj: Any, key: Any, name: str, site: Selection, args: tuple[Any, ...]
) -> Node:
    """A node named `name` calling `obj` at `site`, which receives values like `args`
    (one iteration's): a module of the model's library (its adapter's `edit_node`), a
    linen module, or a function."""
    zeros = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape, a.dtype), args)
    found = adapter.edit_node(obj, name, zeros)
    if found is None and is_linen(obj):
        found = NewModule(_linen_apply(obj), init=lambda k: dict(obj.init(k, *zeros)))
    if found is None:
        if not callable(obj):
            raise NotANodeError(kind=type(obj).__name__)
        return Node(name, lambda v, *a: obj(*a), None, None)
    if found.init is None:
        check_rows(name, found.variables, site)
        variables = found.variables
    elif key is None:
        raise NodeKeyError(kind=type(obj).__name__)
    else:
        variables = init_rows(found.init, key, site.lengths)
    return Node(name, found.fn, obj, variables, structure_of=found.structure)


def _linen_apply(module: Any) -> Callable[..., Any]:
    """A linen node's call on its variables. It gets no mutable collections or random
    keys, so one that updates state or draws random numbers (BatchNorm or Dropout in
    training mode) is named, rather than reported as the model breaking after it."""
    from flax import errors

    def apply(variables: Any, *args: Any) -> Any:
        try:
            return module.apply(variables, *args)
        except (errors.ModifyScopeVariableError, errors.InvalidRngError) as error:
            why = (
                "random keys"
                if isinstance(error, errors.InvalidRngError)
                else "to update its state"
            )
            raise LinenNodeStateError(kind=type(module).__name__, what=why) from None

    return apply


def init_rows(init: Callable[[Any], Any], key: Any, lengths: tuple[int, ...]) -> Any:
    """``init(key)``, or, inside loops (`lengths`), one row per iteration, each row from
    its own key, stacked on leading axes like the model's own scanned variables."""
    if not lengths:
        return init(key)
    keys = jax.random.split(key, math.prod(lengths))
    keys = keys.reshape(*lengths, *keys.shape[1:])
    for _ in lengths:
        init = jax.vmap(init)
    return init(keys)


def check_rows(name: str, variables: Any, site: Selection) -> None:
    """A module inserted at ``[:]`` holds one row of variables per iteration."""
    if not site.lengths:
        return
    lead = len(site.lengths)
    bad = [
        list(jax.numpy.shape(x))
        for x in jax.tree_util.tree_leaves(variables)
        if tuple(jax.numpy.shape(x)[:lead]) != site.lengths
    ]
    if bad:
        raise UnstackedNodeError(
            name=name, site=site.name, lengths=list(site.lengths), shapes=bad[:3]
        )


def call_input_specs(
    inputs: Any, like: Any, site: Selection
) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """Names and shapes of a node's call-time inputs (with the loops' leading axes); one
    given by name only is shaped like the value `like` (one iteration's)."""
    if isinstance(inputs, str):
        inputs = (inputs,)
    given = dict(inputs) if isinstance(inputs, Mapping) else dict.fromkeys(inputs)
    bad = [n for n in given if not (isinstance(n, str) and n.isidentifier())]
    if bad:
        raise CallInputNamesError(names=bad)
    samples = []
    for name, sample in given.items():
        if sample is None:
            if not hasattr(like, "shape"):
                raise CallInputLikeError(name=name, site=site.name)
            sample = jax.ShapeDtypeStruct((*site.lengths, *like.shape), like.dtype)
        sample = jax.ShapeDtypeStruct(jax.numpy.shape(sample), jax.numpy.result_type(sample))
        if tuple(sample.shape[: len(site.lengths)]) != site.lengths:
            raise CallInputRowsError(
                name=name, site=site.name, lengths=list(site.lengths), shape=list(sample.shape)
            )
        samples.append(sample)
    return tuple(given), tuple(samples)


def describe_shapes(tree: Any) -> str:
    return str(jax.tree_util.tree_map(lambda x: f"{x.dtype}{list(x.shape)}", tree))


def same_shapes(a: Any, b: Any) -> bool:
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    return all(x.shape == y.shape and x.dtype == y.dtype for x, y in pairs)
