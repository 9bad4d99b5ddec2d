"""What an edit adds, and where: new nodes, edit sites, edit records and their replay.

An edit is an immutable record (`Edit`): what it does (insert, replace, remove), where
(`Site`: a boundary, an iteration of one inside scans or all of them, or a node inserted
before) and the new `Node` (a function of the value there, of the node's own variables and
of call-time inputs). `Tables` replays a tuple of records into what happens at each
boundary of the edited model; the edited model (`_edited.py`) reads only the tables.

Nodes are functions, or modules: a linen module is initialised here (once per iteration
when it is inserted at every iteration of a loop, each row from its own key); modules of
libraries whose modules hold their variables (NNX, Equinox) come from their adapter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax

from ._core.markers import OUTPUT
from ._core.names import STACKED, Resolver, fill, node_place, parse, shown, split_name, unslotted
from ._errors import (
    CallInputLikeError,
    CallInputNamesError,
    CallInputRowsError,
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
    site: Site | None = None  # where it was put
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
        `Site.node_template`)."""
        return self.name if self.site is None else self.site.node_template(self.name)

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


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an edit acts: a call (or inserted node) by its qualified name, and a port.

    For a call inside scans, `name` holds its iterations (``layers[3]/mlp`` or
    ``layers[:]/mlp``) and `key` the same name with ``[:]`` in every slot (how its
    edits are found while the loop body runs once for all iterations); `lengths` and
    `depths` are the lengths and depths of the loops it names with ``[:]``, `when`
    ``(depth, k)`` for each loop it names one iteration k of. A node put there is listed
    under `parent` (a template name, '' for the top level) with the iteration slot
    `slot` of its own ('' for none), as `names.node_place` says.
    """

    name: str
    port: str
    key: str
    lengths: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()
    when: tuple[tuple[int, int], ...] = ()
    parent: str = ""
    slot: str = ""

    @property
    def in_loop(self) -> bool:
        return bool(self.lengths or self.when)

    def node_template(self, name: str) -> str:
        """The name of a node `name` put here, in the edited model, with the loops'
        iteration slots: at the top of the loop body it runs in (``layers[:]/name``
        for a node at ``layers[:]/mlp``), or of the model outside loops."""
        own = name + self.slot  # (a node's name holds no character a name escapes)
        return f"{self.parent}/{own}" if self.parent else own


@dataclasses.dataclass(frozen=True)
class Edit:
    op: str  # "insert", "replace" or "remove"
    at: Site
    node: Node | None = None


@dataclasses.dataclass
class Tables:
    """The edits replayed: what happens at each boundary of the edited model, by the
    boundary's key (`Site.key`). `changed` holds, per call and in the order they were
    made, its replacements (a node) and bypasses (None), each for the iterations `when`
    names (all if empty): a later one wins where both apply."""

    after: dict[tuple[str, str], list[Node]] = dataclasses.field(default_factory=dict)
    changed: dict[str, list[tuple[tuple[tuple[int, int], ...], Node | None]]] = dataclasses.field(
        default_factory=dict
    )
    inserted: dict[str, Node] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, edits: tuple[Edit, ...]) -> Tables:
        t = cls()
        for e in edits:
            getattr(t, f"_{e.op}")(e)
        return t

    def _insert(self, e: Edit) -> None:
        self.after.setdefault((e.at.key, e.at.port), []).append(e.node)
        self.inserted[e.node.name] = e.node

    def _replace(self, e: Edit) -> None:
        at = e.at.name
        if at in self.inserted:
            old = self.inserted[at]
            self.inserted[at] = e.node
            for nodes in self.after.values():
                nodes[:] = [e.node if n is old else n for n in nodes]
            return
        self._change(e.at, e.node)

    def _remove(self, e: Edit) -> None:
        at = e.at.name
        if at not in self.inserted:
            self._change(e.at, None)
            return
        node = self.inserted.pop(at)
        following = self.after.pop((at, OUTPUT), [])
        for nodes in self.after.values():
            if node in nodes:
                i = nodes.index(node)
                nodes[i : i + 1] = following

    def _change(self, site: Site, node: Node | None) -> None:
        """A replacement (or bypass) of a call; one made before for the same iterations
        is superseded (and its variables leave the edited model)."""
        changes = self.changed.setdefault(site.key, [])
        changes[:] = [c for c in changes if c[0] != site.when]
        changes.append((site.when, node))

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


def site_of(spec: Any, resolver: Resolver, tables: Tables) -> Site:
    """Where `spec` points: a boundary (an iteration of one inside scans, or all of
    them) or an inserted node, and the port (the output unless ``:input``)."""
    if isinstance(spec, str):
        base, _, port = parse(spec)
        node = tables.node_named(base)
        if node is not None:
            name = node.name
            return dataclasses.replace(node.site, name=name, port=port or OUTPUT, key=name)
    ref = resolver.loop_ref(spec, OUTPUT)
    if ref is None:
        call, port = resolver.resolve(spec, OUTPUT)
        return Site(call.qualname, port, call.qualname)
    call, sites = ref.call, ref.call.loop.chain()
    suffix = "" if call.count == 1 else f"@{call.index}"
    stacked = fill(call.template, [STACKED] * len(ref.path)) + suffix
    depths = tuple(d for d, k in enumerate(ref.path) if k == STACKED)
    lengths = tuple(sites[d].length for d in depths)
    when = tuple((depth, k) for depth, k in enumerate(ref.path) if k != STACKED)
    name = fill(call.template, ref.path) + suffix
    parent, slot = node_place(call.template)
    return Site(name, ref.side, stacked, lengths, depths, when, parent, slot)


def is_linen(obj: Any) -> bool:
    from .adapters._linen import LinenAdapter

    return LinenAdapter.accepts(obj)


def new_node(
    adapter: Any, obj: Any, key: Any, name: str, site: Site, args: tuple[Any, ...]
) -> Node:
    """A node named `name` calling `obj` at `site`, which receives values like `args`
    (one iteration's): a module of the model's library (its adapter's `edit_node`), a
    linen module, or a function."""
    zeros = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape, a.dtype), args)
    found = adapter.edit_node(obj, name, zeros)
    if found is None and is_linen(obj):
        found = NewModule(lambda v, *a: obj.apply(v, *a), init=lambda k: dict(obj.init(k, *zeros)))
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


def check_rows(name: str, variables: Any, site: Site) -> None:
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


def call_input_specs(inputs: Any, like: Any, site: Site) -> tuple[tuple[str, ...], tuple[Any, ...]]:
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
