"""The grammar of boundary names: parsing them, and the templates of calls in loops.

Grammar: ``path[.method][@k][:input|:output]``, where a module name holding one of
``\\ / @ : [`` has it escaped by a backslash (``a\\:input``). Names are exact strings, never prefixes
or patterns. A name called more than once needs ``@k`` (call order, from 0). Without a
port, a start means the module's input and an end means its output.

A call inside a scan body has one iteration slot per enclosing scan, written after the
name of the outermost call it is nested in: ``layers[2]/attn`` (iteration 2, ``[-1]``
the last) or ``layers[:]/attn`` (every iteration, stacked). A call's template name holds
one slot per enclosing loop (`iteration_slot`); `selection.py` parses a user's name once
(`selection.Name`) and resolves it against a graph into a `selection.Selection`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .graph import Call
from .markers import INPUT, OUTPUT

PORTS = (INPUT, OUTPUT)
_SPEC = re.compile(r"((?:\\.|\[[^\]]*\]|[^\\@:\[])*)(?:@(\d+))?(?::(input|output))?")
_INDEX = re.compile(r"(\\.)|\[([^\]]*)\]")
STACKED = ":"


def parse(spec: str) -> tuple[str, int | None, str | None]:
    r"""Splits ``name@k:port`` into its parts.

    A module whose own name holds ``@``, ``:``, ``/`` or ``[`` is written with those
    characters escaped by a backslash (as `js.boundaries` lists it).

    >>> parse("block1/conv@1:input")
    ('block1/conv', 1, 'input')
    >>> parse("head")
    ('head', None, None)
    >>> parse("a\\:input:output")
    ('a\\:input', None, 'output')
    """
    match = _SPEC.fullmatch(spec)
    if match is None:
        return spec, None, None
    base, index, port = match.groups()
    return base, int(index) if index is not None else None, port


def iteration_slot(depth: int) -> str:
    """The iteration slot of the scan at `depth` in a call's template name."""
    return f"[\x00{depth}]"


_SLOT = re.compile(r"\[\x00(\d+)\]")


def shown(template: str) -> str:
    """A template name as listed: every iteration slot as ``[:]``."""
    return _SLOT.sub("[:]", template)


def fill(template: str, path: Sequence[Any]) -> str:
    """A template name with the slot of depth d holding ``path[d]`` (an int or ``":"``)."""
    return _SLOT.sub(lambda m: f"[{path[int(m.group(1))]}]", template)


def unslotted(template: str) -> str:
    """A template name without its iteration slots (the name the body's code uses)."""
    return _SLOT.sub("", template)


def slot_depths(template: str) -> list[int]:
    """The depth of each slot of a template name, in the order they are written."""
    return [int(d) for d in _SLOT.findall(template)]


def split_name(name: str) -> tuple[str, ...]:
    r"""A boundary name's module path, the inverse of `join_name`: split at each ``/``
    that is not escaped, the escapes removed.

    >>> split_name("p\\/q/dense")
    ('p/q', 'dense')
    """
    parts = [""]
    for token in re.findall(r"\\.|/|[^\\/]+", name):
        if token == "/":
            parts.append("")
        else:
            parts[-1] += token[1:] if token.startswith("\\") else token
    return tuple(parts)


def node_place(template: str) -> tuple[str, str]:
    """Where a node inserted at a call in a scan body is listed, as the template name of
    its parent and the iteration slot its own name takes.

    A node is listed at the top of the loop body it runs in: under the call at the top of
    the innermost body the call is inside (at ``layers[:]/block/mlp``: ``layers[:]/node``,
    no slot of its own), or, at that top call itself, beside it, with the loop's slot (at
    ``mlp[:]``: ``node[:]``; at ``outer[:]/mlp[:]``: ``outer[:]/node[:]``).

    >>> [shown(t) for t in node_place(f"layers{iteration_slot(0)}/block/mlp")]
    ['layers[:]', '']
    >>> [shown(t) for t in node_place(f"outer{iteration_slot(0)}/mlp{iteration_slot(1)}")]
    ['outer[:]', '[:]']
    """
    last = list(_SLOT.finditer(template))[-1]
    if template[last.end() :]:
        return template[: last.end()], ""
    head = template[: last.start()]
    seps = [m.start() for m in re.finditer(r"\\.|/", head) if m.group() == "/"]
    return head[: seps[-1]] if seps else "", last.group()


def split_indices(base: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A name's text around its iteration slots, and what each slot holds.

    >>> split_indices("layers[2]/attn")
    (('layers', '/attn'), ('2',))
    >>> split_indices("head")
    (('head',), ())
    """
    parts, indices, at = [], [], 0
    for m in _INDEX.finditer(base):
        if m.group(1) is None:
            parts.append(base[at : m.start()])
            indices.append(m.group(2).strip())
            at = m.end()
    parts.append(base[at:])
    return tuple(parts), tuple(indices)


def lifted_template(call: Call) -> str | None:
    """The template name of the loop around `call` as a whole, when that loop is a
    module lifted inside another scan's body (``outer[:]/inner`` for linen's
    ``nn.scan(Inner)`` called in each iteration of ``nn.scan(Cell)``): the module the
    inner loop's body calls, under the module path that its variables are keyed by,
    with its own iteration slot last. None for other calls (a top-level lifted module
    is a call of the traced graph itself)."""
    loop, template = call.loop, call.template
    if loop is None or loop.parent is None or template is None or not call.is_module:
        return None
    last = iteration_slot(loop.depth)
    if not template.endswith(last) or unslotted(template) != call.record.name:
        return None
    return template[: -len(last)]
