"""From `start`/`end` to a `Plan` (stage 3): which values go in, which come out, and
which equations and variables are needed in between.

A short orchestrator over the pure analyses (`analysis.py`): resolve the ports, cut
the program, add the slice's own state updates and side effects, fold inlined regions
back. Anything that makes the slice impossible is reported by `diagnose.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Container, Sequence
from typing import Any

import jax

from .. import _compat
from .._errors import GivenAndComputedError, SliceError, StateGapsError
from .._trees import key_name, path_str
from . import analysis, diagnose
from .graph import Graph
from .jaxprs import loop_rule
from .markers import OUTPUT
from .ports import (
    Argument,
    arguments_of,
    flat_ports,
    map_ports,
    model_inputs,
    port_value_tree,
    resolve_ends,
    resolve_starts,
)
from .selection import Selection, resolver_of
from .state_chain import Chain, update_chain


@dataclasses.dataclass(frozen=True)
class StateRules:
    """How a model kind's updated state maps to modules (an adapter's answers)."""

    owner: Callable[[tuple[Any, ...]], tuple[str, ...]]  # state path -> module path
    includes_variables: bool = False  # returned state lists unchanged variables too (NNX)


@dataclasses.dataclass(frozen=True)
class Plan:
    starts: tuple[Selection, ...] | None  # None: the model's inputs
    ends: Any  # a Selection, a tuple or a dict of them
    arguments: tuple[Argument, ...]
    input_ids: tuple[int, ...]
    output_trees: Any  # same nesting as `ends`, each a pytree of Slots
    output_ids: tuple[int, ...]
    cut: analysis.Cut
    variable_ids: tuple[int, ...]
    variable_paths: tuple[tuple[Any, ...], ...]
    rng_ids: tuple[int, ...]
    state_paths: tuple[tuple[Any, ...], ...] = ()  # updated state the slice returns
    state_ids: tuple[int, ...] = ()
    to_run: tuple[Any, ...] = ()  # the equations to run (`Eqn`s), regions folded back
    updated_collections: tuple[str, ...] = ()  # collections the slice changes in this mode
    state_collections: tuple[str, ...] = ()  # collections the slice has state in
    # ``(value, path)``: a state entry's value between two calls of its module that the
    # slice reads from the variables at `path` (its first call runs, the one before not)
    state_reads: tuple[tuple[int, tuple[Any, ...]], ...] = ()


def plan(
    graph: Graph, start: Any, end: Any, mutable: Any = False, rules: StateRules | None = None
) -> Plan:
    """Plans the slice of `graph` from `start` to `end` (see `js.slice`), their names
    parsed (`ports.parsed`) and resolved here, once, by the graph's resolver."""
    resolver = resolver_of(graph)
    starts = resolve_starts(graph, resolver, start)
    p = _frame(graph, starts, resolve_ends(graph, resolver, end))
    if p.cut.missing:
        works = lambda found: _plannable(graph, found, p.ends)  # noqa: E731
        ends = flat_ports(p.ends)
        diagnose.raise_missing(
            graph, p.input_ids, p.output_ids, p.starts, ends, works, parameters(graph)
        )
    whole = p.starts is None and isinstance(p.ends, Selection) and p.ends.spec is None
    own = slice_state(graph, p.cut, p.input_ids, whole, rules) if graph.state_paths else []
    state = _wanted(own, mutable)
    return _finish(
        graph,
        dataclasses.replace(
            p,
            state_paths=tuple(q for q, _, _ in state),
            state_ids=tuple(v for _, v, _ in state),
            state_reads=tuple((r, q) for q, _, r in state if r is not None),
            updated_collections=_collections(q for q, v, _ in own if v not in graph.variable_set),
            state_collections=_collections(q for q, _, _ in own),
        ),
    )


def _frame(
    graph: Graph, starts: tuple[Selection, ...] | None, ends: Any, suggest: bool = True
) -> Plan:
    """The arguments and cut of a slice between these records, checked for connectivity.

    With `suggest`, errors offer fixes that were checked to work (without, they don't:
    that check is itself a call with ``suggest=False``).
    """
    start_ports = starts or (model_inputs(graph),)
    params = parameters(graph)
    fixed = _recomputed(graph, start_ports)
    arguments = tuple(a for p in start_ports for a in _taken(graph, p, fixed, params))
    works = (lambda found: _plannable(graph, found, ends)) if suggest else (lambda found: False)
    diagnose.check_inputs(graph, arguments, works)
    output_trees = map_ports(lambda p: end_tree(graph, p, params), ends)
    output_ids = tuple(s.id for s in _slots(output_trees) if s.id is not None)
    input_ids = tuple(i for a in arguments for i in a.input_ids)
    result = graph.cut(input_ids, output_ids)
    if starts is not None:
        diagnose.check_connected(graph, arguments, result, starts, ends, params)
    return Plan(starts, ends, arguments, input_ids, output_trees, output_ids, result, (), (), ())


def parameters(graph: Graph) -> frozenset[int]:
    """Values a port never takes or yields as an input: the variables, and what the
    model computes from them alone (the row of a stacked parameter that a scan body
    passes to a call, ``w * 2``). A slice computes those from its own variables."""
    found = analysis.parameter_values(graph.edges, graph.variable_ids, graph.is_free)
    return frozenset(found)


def end_tree(graph: Graph, port: Selection, params: frozenset[int]) -> Any:
    """`ports.port_value_tree` without `params`: an input port as an end yields its
    array arguments that are not parameters, as a start takes them."""
    if port.side == OUTPUT:
        return port_value_tree(graph, port)
    found = arguments_of(graph, port, params, call_order=False)
    trees = [a.slot_tree() for a in found]
    return trees[0] if len(trees) == 1 else tuple(trees)


def _recomputed(graph: Graph, ports: tuple[Selection, ...]) -> frozenset[int]:
    """With the model's inputs among several starts, the values of the other starts that
    are those inputs (a position array every block is passed) are taken once, as the
    model's inputs, and those that derive from them outside any module (positions,
    masks) are computed by the slice instead of taken."""
    if len(ports) < 2 or all(p.spec is not None for p in ports):
        return frozenset()
    return graph.derived_from_inputs() | frozenset(graph.input_ids)


def _taken(
    graph: Graph, port: Selection, fixed: frozenset[int], params: frozenset[int]
) -> list[Any]:
    """The arguments a start port contributes: all but parameters and, for a named port,
    the values the slice takes as the model's inputs or computes again (`fixed`). A start
    the user names is never dropped whole for values the slice would compute: made only
    of values derived from the model's inputs, it takes them; made only of the model's
    inputs themselves, it takes them too (and `diagnose.check_inputs` refuses them as
    given twice)."""
    if port.spec is None or not fixed:
        return arguments_of(graph, port, params)
    inputs = fixed & frozenset(graph.input_ids)
    for skipped in (fixed, inputs):
        found = arguments_of(graph, port, skipped | params)
        if any(a.input_ids for a in found):
            return found
    return arguments_of(graph, port, params)


def _plannable(graph: Graph, starts: list[Selection], ends: Any) -> bool:
    """Whether a slice from `starts` to `ends` can be made (a suggested fix works)."""
    try:
        return not _frame(graph, tuple(starts), ends, suggest=False).cut.missing
    except SliceError:
        return False


def _slots(output_trees: Any) -> list[Any]:
    return [s for tree in flat_ports(output_trees) for s in jax.tree_util.tree_leaves(tree)]


def _collections(paths: Any) -> tuple[str, ...]:
    return tuple(sorted({str(key_name(p[0])) for p in paths}))


def _wanted(own: list[tuple[tuple[Any, ...], int, Any]], mutable: Any) -> list[Any]:
    if not mutable:
        return []
    if mutable is True:
        return own
    wanted = {mutable} if isinstance(mutable, str) else set(mutable)
    return [e for e in own if str(key_name(e[0][0])) in wanted]


def _finish(graph: Graph, p: Plan) -> Plan:
    """Adds state, effects and folded regions to the cut, then the variables it reads
    (the state it reads between two calls of a module too, `Plan.state_reads`)."""
    outputs = p.output_ids + p.state_ids
    starts = p.input_ids + tuple(r for r, _ in p.state_reads)
    result = graph.cut(starts, outputs) if p.state_ids else p.cut
    has_effects = lambda i: _compat.has_effects(graph.eqns[i].jax_eqn)  # noqa: E731
    result = analysis.effects_inside(graph.edges, result, starts, graph.is_free, has_effects)
    result, steps = _fold(graph, result, starts, outputs)
    to_run = tuple(_step_eqn(graph, step) for step in steps)
    _check_given(to_run, starts, outputs)
    used = result.used_free
    variables = [(v, q) for v, q in zip(graph.variable_ids, graph.variable_paths, strict=True)]
    variables = [(v, q) for v, q in variables if v in used] + list(p.state_reads)
    return dataclasses.replace(
        p,
        cut=result,
        to_run=to_run,
        variable_ids=tuple(v for v, _ in variables),
        variable_paths=tuple(q for _, q in variables),
        rng_ids=tuple(v for v in graph.rng_ids if v in used),
    )


def _check_given(to_run: Sequence[Any], given: Sequence[int], outputs: Sequence[int]) -> None:
    """A start value that a needed equation also computes replaces that result; the
    equation's other results the slice needs must not be computed from it."""
    given_set = set(given)
    needed = {v for e in to_run for v in e.ins} | set(outputs)
    for e in to_run:
        mine = _positions(e.outs, lambda v: v in given_set)
        others = _positions(e.outs, lambda v: v not in given_set and v in needed)
        if mine and others and results_depend(e.jax_eqn, mine, others):
            raise GivenAndComputedError(primitive=e.primitive, given=mine, others=others)


def _positions(values: Sequence[int], keep: Callable[[int], bool]) -> list[int]:
    return [k for k, v in enumerate(values) if keep(v)]


def _fold(graph: Graph, result: analysis.Cut, starts: Any, outputs: Any) -> Any:
    spans = [analysis.Span(r.start, r.stop, r.eqn.ins, r.eqn.outs) for r in graph.regions]
    return analysis.fold(
        graph.edges,
        graph.producer,
        spans,
        result,
        starts,
        graph.is_free,
        outputs,
        graph.consts.__contains__,
    )


def _step_eqn(graph: Graph, step: tuple[str, int]) -> Any:
    kind, i = step
    return graph.eqns[i] if kind == "eqn" else graph.regions[i].eqn


def slice_state(
    graph: Graph,
    result: analysis.Cut,
    input_ids: Sequence[int],
    whole: bool,
    rules: StateRules | None,
) -> list[tuple[tuple[Any, ...], int, int | None]]:
    """The updated state entries that belong to the slice, as ``(path, value, read)``.

    An entry belongs to the slice when the module that owns it (the longest module path
    that prefixes the entry's path) has a call with equations in the slice, and its new
    value can be computed from the slice's inputs. An entry the model changes also
    belongs when its module is called inside a call the slice runs whole, as running
    that call changes it. State of the top-level module itself belongs only to a slice
    of the whole model (from its inputs to its output). State of modules outside the
    slice is not returned, so merging it back leaves them untouched.

    State of a module called several times that update it (a shared block in train
    mode) is the value after the last of those calls the slice runs, not the model's
    final value, and the first call the slice runs reads the entry as it stands in the
    variables: `read` is then the value that call reads in the model (after an earlier
    call the slice does not run), which the slice takes from the variables instead.
    So a slice up to ``blk@0`` returns the state after that call, and running it, merging,
    then a slice from ``blk@1`` gives the model's own final state.

    State stacked over the iterations of a loop the slice runs in pieces belongs when
    the slice runs some of its rows: it is the whole stacked array, with the rows of
    the pieces the slice runs new and the others as they were (`_stacked_rows`).
    """
    if rules is None:
        return []
    computable = analysis.computable(graph.edges, input_ids, graph.is_free)
    taking = _participating_modules(graph, result, computable)
    chains = {} if whole else _chains(graph, rules, taking)
    found = []
    for k, path in enumerate(graph.state_paths):
        vid, read = _value_in_slice(graph, k, rules, taking, result, chains.get(k), whole)
        if vid is not None:
            found.append((path, vid, _taken_read(graph, read, computable)))
    reads = [r for _, _, r in found if r is not None]
    if reads:
        computable = analysis.computable(graph.edges, [*input_ids, *reads], graph.is_free)
    variables = graph.variable_set
    return [e for e in found if _returned(e[1], variables, computable, rules)]


def _value_in_slice(
    graph: Graph,
    k: int,
    rules: StateRules,
    taking: _Taking,
    result: analysis.Cut,
    chain: Chain | None,
    whole: bool,
) -> tuple[int | None, int | None]:
    """``(value, read)`` of state entry `k` in a slice (see `slice_state`); value None
    where the entry does not belong to the slice."""
    path, vid = graph.state_paths[k], graph.state_ids[k]
    owner = analysis.owner(rules.owner(path), taking.modules)
    if k in graph.stacked_state:
        return _stacked_rows(graph.stacked_state[k], owner, result, taking.calls, path), None
    if chain is not None:
        read, after = chain.in_slice({id(c) for c in taking.calls})
        return after, read
    belongs = whole if owner is None else taking.runs(owner, vid in graph.variable_set)
    return (vid if belongs else None), None


def _taken_read(graph: Graph, read: int | None, computable: set[int]) -> int | None:
    """`read`, where the slice must take it from the variables (it cannot compute it)."""
    given = read is None or read in computable or graph.is_free(read)
    return None if given else read


def _returned(vid: int, variables: frozenset[int], computable: set[int], rules: StateRules) -> bool:
    """Whether a state value that belongs to a slice is returned: not where there is
    nothing to write back, or its value comes from outside the slice."""
    unchanged = vid in variables
    return not (unchanged and rules.includes_variables) and (unchanged or vid in computable)


def _chains(graph: Graph, rules: StateRules, taking: _Taking) -> dict[int, Chain]:
    """`state_chain.Chain`s of the state entries (by position) of modules called more
    than once outside loops, where one can be told; the stored value of an entry read
    between two calls must be a variable, so that the slice can read it instead."""
    calls: dict[Any, list[Any]] = {}
    for c in graph.calls:
        if c.is_module and c.loop is None:
            calls.setdefault(c.path, []).append(c)
    stored = dict(zip(graph.variable_paths, graph.variable_ids, strict=True))
    chains = {}
    for k, (path, vid) in enumerate(zip(graph.state_paths, graph.state_ids, strict=True)):
        owner = analysis.owner(rules.owner(path), taking.modules)
        mine = calls.get(owner, [])
        if k in graph.stacked_state or len(mine) < 2 or path not in stored:
            continue
        chain = update_chain(graph, mine, vid, stored[path])
        if chain is not None and chain.steps:
            chains[k] = chain
    return chains


def _stacked_rows(
    entry: Any, owner: Any, result: analysis.Cut, active: Sequence[Any], path: Any
) -> int | None:
    """The value of a stacked state entry with the rows of the pieces the slice runs
    new, or None where it runs none.

    A piece that is a scan runs when the slice computes it; an iteration written out
    runs for the entry when the entry's module is called in it and that call takes part
    in the slice (a slice that ends inside an iteration, before that module, leaves the
    iteration's row as it was).
    """
    eqns = set(result.eqns)
    ran = [i for i, piece in enumerate(entry.pieces) if _piece_runs(piece, owner, eqns, active)]
    if not ran:
        return None
    found = entry.rows.get((ran[0], ran[-1]))
    if found is None or len(ran) != ran[-1] - ran[0] + 1:
        raise StateGapsError(ran=ran, path=path_str(path))
    return found


def _piece_runs(piece: tuple[int, int, bool], owner: Any, eqns: set[int], active: Any) -> bool:
    start, stop, written = piece
    if not any(i in eqns for i in range(start, stop)):
        return False
    return not written or any(
        c.path == owner and start <= c.start and c.stop <= stop for c in active
    )


@dataclasses.dataclass
class _Taking:
    """The module calls that take part in a slice, by path and as calls."""

    participating: set[Any]  # paths of calls with equations in the cut
    nested: set[Any]  # paths of calls inside a call the slice runs whole
    modules: set[Any]  # paths of all module calls
    calls: list[Any]  # the calls that are either

    @classmethod
    def of(cls, calls: list[Any], taking: list[Any], nested: list[Any]) -> _Taking:
        paths = lambda found: {c.path for c in found}  # noqa: E731
        return cls(paths(taking), paths(nested), paths(calls), [*taking, *nested])

    def runs(self, owner: Any, unchanged: bool) -> bool:
        """Whether state of `owner` changes in the slice (as far as calls tell)."""
        return owner in self.participating or (owner in self.nested and not unchanged)


def _participating_modules(
    graph: Graph, result: analysis.Cut, computable: Container[int]
) -> _Taking:
    """Paths of the modules with a call that has equations in the cut, of those called
    inside a call the slice runs whole, and of all modules.

    A call runs whole when its inputs are computable from the slice's inputs and the cut
    computes its outputs. The calls inside it run too, also those whose own equations
    feed nothing but state (the averages a batch norm keeps in submodules of its own, a
    block's statistics of a value it then drops).
    """
    calls = [c for c in graph.calls if c.is_module and c.loop is None]
    spans = [(c.start, c.stop) for c in calls]
    taking_part = analysis.spans_with(spans, set(result.eqns), len(graph.eqns))
    made = {v for i in result.eqns for v in graph.eqns[i].outs}
    taking = list(itertools.compress(calls, taking_part))
    whole = [c for c in taking if _runs_whole(c, made, computable)]
    nested = list(itertools.compress(calls, _inside(calls, whole, len(graph.eqns))))
    return _Taking.of(calls, taking, nested)


def _runs_whole(call: Any, made: set[int], computable: Container[int]) -> bool:
    """Whether the slice computes a call's outputs (or they pass its inputs through)
    from inputs it can compute."""
    if not _ids_within(call.in_slots, computable):
        return False
    passed = {s.id for s in call.in_slots}
    outs = [s.id for s in call.out_slots if s.id is not None]
    return bool(outs) and all(v in made or v in passed for v in outs)


def _ids_within(slots: Any, values: Container[int]) -> bool:
    """Whether a call side has array values, all of them among `values`."""
    ids = [s.id for s in slots if s.id is not None]
    return bool(ids) and all(v in values for v in ids)


def _inside(calls: list[Any], outer: list[Any], size: int) -> list[bool]:
    """For each call with equations, whether it starts inside one of the `outer` spans
    (call spans nest, so it then ends inside it too); linear overall."""
    depth = [0] * (size + 1)
    for c in outer:
        depth[c.start] += 1
        depth[c.stop] -= 1
    for i in range(size):
        depth[i + 1] += depth[i]
    return [c.start < c.stop and depth[c.start] > 0 for c in calls]


def results_depend(eqn: Any, given: Sequence[int], others: Sequence[int]) -> bool:
    """Whether results `others` of a loop (or any equation) are computed, in the same
    iteration, from the values of its results `given` (True where it cannot be told)."""
    body = _body_of(eqn)
    if body is None:
        return True
    tainted = {body.outvars[k] for k in given} - {None}
    for inner in body.eqns:
        if _reads(inner, tainted):
            tainted.update(inner.outvars)
    return any(_reads_var(body.outvars[k], tainted) for k in others)


def _body_of(eqn: Any) -> Any:
    """The body of a loop (its results are the body's, one to one) or of a call-like
    equation, or None."""
    rule = loop_rule(eqn)
    if rule is not None:
        return rule.body(eqn)
    inner = _compat.call_body(eqn)
    return inner[0] if inner is not None else None


def _reads(eqn: Any, values: set[Any]) -> bool:
    return any(_reads_var(a, values) for a in eqn.invars)


def _reads_var(atom: Any, values: set[Any]) -> bool:
    return not _compat.is_literal(atom) and atom in values
