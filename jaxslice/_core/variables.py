"""A slice's variables: finding the leaves a plan reads in the variables a call passes.

A plan names the variables it reads by pytree path (`Plan.variable_paths`). A call may
pass the slice's own variables (`sub.variables`, or the result of training them) or,
with ``strict=False``, any tree holding those paths. Where the paths sit among a tree's
leaves is found once per tree structure (`leaf_index`), so a repeated call only picks
leaves by position. `extract` and `merge` move between a slice's variables and the
model's full ones. All of these are pure functions: the index is cached by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._errors import MergeUnknownError, MissingEntriesError, VariablesStructureError
from .._trees import abstract, is_traced_leaf, path_str, prune, tree_key
from .checks import check_leaves


def leaf_index(
    paths: list[Any], variables: Any, own: set[Any], strict: bool, why: Callable[[], str]
) -> list[int]:
    """The position among ``tree_leaves(variables)`` of each of `paths`.

    Args:
      paths: the paths a plan reads.
      variables: the tree a call passes.
      own: the paths of the slice's own variables.
      strict: whether array leaves other than the slice's own are refused.
      why: called for a note on why paths the slice's own variables lack are missing.

    Raises:
      VariablesMismatchError: `variables` lacks some of `paths`, or has array leaves that
        are not the slice's own.
    """
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    position = {p: i for i, (p, x) in enumerate(flat) if is_traced_leaf(x)}
    missing = [p for p in paths if p not in position]
    extra = [p for p in position if p not in own] if strict else []
    if missing or extra:
        raise _structure_error(missing, extra, own, why)
    return [position[p] for p in paths]


def _structure_error(
    missing: list, extra: list, own: set, why: Callable[[], str]
) -> VariablesStructureError:
    note = why() if any(p not in own for p in missing) else ""  # reads more than it has
    return VariablesStructureError.of(paths_str(missing), paths_str(extra), note)


def call_differs(base: Any, now: Any) -> str:
    """What differs between the call a slice was made for and this one (for messages)."""
    what = []
    if base.mode != now.mode:
        what.append(f"mode {now.mode} where the slice was made with {base.mode}")
    if tree_key(base.mutable) != tree_key(now.mutable):
        what.append(f"mutable={now.mutable!r} where the slice was made with {base.mutable!r}")
    differs = " and ".join(what) or "a call that differs from the one the slice was made for"
    return (
        f"(this call has {differs}, and reads variables that `sub.variables` lacks; slice "
        "again with the mode and `mutable` you call it with)"
    )


def extract(full_variables: Any, paths: list[Any], avals: tuple[Any, ...]) -> Any:
    """The part of a model's full variables at `paths` (checked against `avals`)."""
    flat = dict(jax.tree_util.tree_flatten_with_path(full_variables)[0])
    missing = [p for p in paths if p not in flat]
    if missing:
        raise MissingEntriesError(paths=paths_str(missing))
    check_leaves(paths, [flat[p] for p in paths], avals)
    return prune(full_variables, set(paths))


def merge(full_variables: Any, new_variables: Any) -> Any:
    """`full_variables` with the leaves at `new_variables`' paths replaced by its leaves,
    which have the shapes and dtypes of those they replace."""
    updates = dict(jax.tree_util.tree_flatten_with_path(new_variables)[0])
    flat, treedef = jax.tree_util.tree_flatten_with_path(full_variables)
    known = dict(flat)
    unknown = [p for p in updates if p not in known]
    if unknown:
        raise MergeUnknownError(paths=paths_str(unknown))
    checked = [p for p in updates if is_traced_leaf(known[p]) or is_traced_leaf(updates[p])]
    check_leaves(checked, [updates[p] for p in checked], [abstract(known[p]) for p in checked])
    return jax.tree_util.tree_unflatten(treedef, [updates.get(p, x) for p, x in flat])


def paths_str(paths: list[Any]) -> str:
    """The first eight paths, as text."""
    return ", ".join(path_str(p) for p in paths[:8])
