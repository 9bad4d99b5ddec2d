"""Per-iteration boundaries of scans: writing out the iterations a slice names.

A call inside a `scan` body runs once per iteration. A name such as ``layers[2]/attn``
(one iteration) or ``layers[:]/attn`` (every iteration, stacked) is resolved against the
traced graph, where that call is listed once with its loop (a `selection.Selection`
whose path picks the iterations). `expand` then traces the program again, evaluating
its equations one by one, with each loop that a name points into split into pieces:

* the iterations before and after a named one run as `lax.scan`s over row ranges of the
  stacked operands, so stacked parameters stay whole arrays of the program, and the rows
  a slice does not use get zero gradient;
* a named iteration is written out equation by equation, its markers bound again as the
  iteration's own calls (``layers[2]``, ``layers[2]/attn``, ...), so they are ordinary
  calls of the new graph;
* a named whole iteration of the body's outermost call whose ports are the loop's carry
  and constants (a transformer block) is marked on the carry between two pieces instead,
  so that the pieces around it stay single scans;
* a stacked name is an extra stacked result of every piece, concatenated and marked once
  after the loop;
* a stacked result of a loop that the program returns as updated state (the statistics
  of a `BatchNorm` in every layer) is also given as the old value with only some pieces'
  rows new, one value per range of pieces, so that a slice that runs those pieces
  returns their rows and the others' as they were (`plan.slice_state` picks the range).

Loops inside pieces lose their markers, so the re-emitted program holds none. The new
program is built into a graph like any other (`build.build`); the calls it adds are
found there by `CallRecord.key`.

The work is split by job: `loop_requests` turns the names into what to do with each loop
and cuts a loop's rows into pieces, `loop_expander` is the evaluator that runs the
program again with those loops in pieces, and `loop_rows` keeps the books of a loop run
in pieces (its operands, what each stacked value is, the stacked state's rows). This
module is the entry: the names that point into loops, and the expanded graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax

from .. import _compat
from .._caches import LRU
from .._errors import LostIterationsError
from .build import build
from .graph import Graph
from .loop_expander import Ctx, Expander
from .loop_requests import request
from .loop_rows import Fixed, mark_state_rows
from .markers import INPUT, OUTPUT
from .ports import ActivationOf, spec_items
from .selection import Name, Selection, resolver_of

#: a name that picks iterations (None for one made here), and its record
Looped = tuple[Name | None, Selection]


def loop_selections(graph: Graph, start: Any, end: Any) -> list[Looped]:
    """The names in `start` and `end` (parsed, `ports.parsed`, or records of `graph`
    resolved before) that pick iterations of calls inside scans, each with its record in
    `graph` (a record comes with no name: it is found in the expanded graph by its key)."""
    resolver = resolver_of(graph)
    names = [(name, INPUT) for name in spec_items(start)]
    names += [(_named(name), OUTPUT) for name in spec_items(end)]
    found = [(name, resolver.in_loops(name, side)) for name, side in names]
    looped = [(_name_of(name), where) for name, where in found if where is not None]
    if looped:
        resolver.check_wholes(
            [name for name, where in found if where is None], [w for _, w in looped]
        )
    return looped


def _named(end: Any) -> Any:
    """What an end names: the boundary of an activation, else the end itself."""
    return end.name if isinstance(end, ActivationOf) else end


def _name_of(name: Any) -> Name | None:
    """The name `expand` makes an alias of (None for a record)."""
    return name if isinstance(name, Name) else None


def written_out(graph: Graph) -> Graph:
    """The graph with every iteration of every scan that holds boundaries written out, so
    that each iteration's calls are ordinary calls (what an interpreter walks)."""
    looped = [(None, where) for call in graph.calls for where in _every_iteration(call)]
    return expanded(graph, looped, state_rows=False) if looped else graph


def _every_iteration(call: Any) -> list[Selection]:
    """A record of each iteration of a call inside scans (none for other calls)."""
    sites = call.loop.chain() if call.template is not None else []
    if not sites or any(site.length is None for site in sites):
        return []
    paths = itertools.product(*(range(site.length) for site in sites))
    return [Selection(None, call, INPUT, p) for p in paths]


#: expanded graphs kept per traced graph (one per set of names)
MAX_EXPANSIONS = 8


def expanded(graph: Graph, looped: Sequence[Looped], state_rows: bool = True) -> Graph:
    """`expand`, remembered per graph and names."""
    key = (tuple((name, where.key, where.side) for name, where in looped), state_rows)
    cache = graph.memo("expanded", lambda: LRU(MAX_EXPANSIONS))
    found = cache.get(key)
    if found is None:
        found = expand(graph, looped, state_rows)
        cache.put(key, found)
    return found


def expand(graph: Graph, looped: Sequence[Looped], state_rows: bool = True) -> Graph:
    """A graph of the same program with the loops the records of `looped` point into
    written out; each name of `looped` is an alias of its call there. With `state_rows`,
    the stacked state the split loops update is also given with only some pieces' rows
    new (`Graph.stacked_state`)."""
    closed, signature, name_scopes = graph.source
    templates = {id(c.record): c.template for c in graph.calls if c.template is not None}
    expander = Expander(templates, state_rows and bool(signature.state_paths))
    root = request([where for _, where in looped])
    jaxpr, consts = _compat.open_jaxpr(closed)

    num_vars = len(signature.variable_paths)
    num_free = num_vars + signature.num_rngs

    def program(*args: Any) -> list[Any]:
        expander.fixed = Fixed((*args[:num_free], *consts), args[:num_vars])
        outs = expander.run(jaxpr, consts, args, Ctx(True, (), (), root))
        mark_state_rows(expander.stacks, outs, signature, args)
        return outs

    avals = [_spec(v) for v in jaxpr.invars]
    expanded, _ = _compat.make_jaxpr(program, *avals)
    new = build(expanded, signature, name_scopes=name_scopes)
    return new.freeze(partial=graph.partial, aliases=_aliases(new, looped))


def _aliases(graph: Graph, looped: Sequence[Looped]) -> dict[tuple[str, int | None], Any]:
    """Each name of `looped` (without its port) -> the call its record picks in the
    expanded `graph`, found by the record's key (`Selection.key`, `CallRecord.key`)."""
    by_key = {_key(c): c for c in graph.calls}
    lost = [where.spec or where.name for _, where in looped if where.key not in by_key]
    if lost:
        raise LostIterationsError(names=lost)
    return {(n.base, n.index): by_key[w.key] for n, w in looped if n is not None}


def _key(call: Any) -> Any:
    """How a call written out by `expand` is known (None for other calls)."""
    return getattr(call.record, "key", None)


def _spec(var: Any) -> Any:
    aval = _compat.aval_of(var)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


_compat.register_frames_exclusion(__file__)
