"""Where a `js.lens` acts: its sites, made once from names, and the names a call gives.

A site is one array leaf of one call side (every iteration of the scans around it), found
from a name once, when the lens is made: ``layers[:]/attn`` (a call's output),
``block:input`` (its input), ``name#k`` (leaf k of the value there; the first array leaf
without ``#k``). A name given at call time is resolved once too (`Sites.pick`): a site,
or one iteration of a site inside a scan (``layers[3]``), kept as the site and the
iterations it picks.

Sharp edge: inputs of other shapes trace the model again, and the new trace can have
other scan lengths (a scan over a sequence axis) or other calls (a Python loop over one).
So names are resolved per trace: `Sites.at` carries the lens's sites into another trace,
where ``layers[-1]``, the rows of a ``[:]`` value and the sites that exist are that
trace's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat
from ._core.markers import OUTPUT
from ._core.names import STACKED
from ._core.selection import Name, Resolver, Selection
from ._errors import (
    BoundaryInLoopError,
    LensLeafError,
    LensNotASiteError,
    LensSiteNotAtCallError,
    LensSitesSpecError,
    SliceError,
)


@dataclasses.dataclass(frozen=True)
class Site:
    """One array value the lens can change or read.

    Attributes:
      name: its every-iteration name (``layers[:]/attn``, ``head``, ``block:input#1``).
      where: the record of the call side (`Selection`, every iteration inside loops).
      leaf: which array leaf of the value there.
      value: the leaf's shape and dtype in one iteration.
      lengths: the lengths of the scans around it, outermost first (a leading axis each
        in stacked values); empty outside loops.
    """

    name: str
    where: Selection
    leaf: int
    value: jax.ShapeDtypeStruct
    lengths: tuple[int, ...]

    def __repr__(self) -> str:
        shape = ", ".join(map(str, self.stacked.shape))
        return f"Site({self.name!r}, {self.value.dtype}[{shape}])"

    @property
    def stacked(self) -> jax.ShapeDtypeStruct:
        """Every iteration's value, stacked (what a read of `name` returns)."""
        return jax.ShapeDtypeStruct((*self.lengths, *self.value.shape), self.value.dtype)


class Picked:
    """Where a name given at call time acts: its site, and the iteration in each loop
    around it (None: every iteration)."""

    __slots__ = ("site", "rows", "indices")

    def __init__(self, site: Site, rows: tuple[int | None, ...]):
        self.site, self.rows = site, rows
        # the iterations picked, as the arrays a call passes (made once per name)
        self.indices = [jnp.int32(k) for k in rows if k is not None]


class Sites:
    """A lens's sites (`by_name`, in call order) in one trace of the model, and the names
    given to it, resolved against that trace.

    A lens has one `Sites` per trace (per input signature): its own (`made`), and one for
    each call with inputs of other shapes (`at`), with that trace's records, values and
    scan lengths, so that ``layers[-1]`` and a ``[:]`` value's rows are this call's.

    Args:
      resolver: the resolver of the graph these sites are in.
      by_name: the sites, in call order.
      made: the lens's own sites when these are another trace's (None for the lens's own).
    """

    def __init__(self, resolver: Resolver, by_name: dict[str, Site], made: Sites | None = None):
        self.resolver = resolver
        self.by_name = by_name
        self.by_where = {(s.where, s.leaf): s for s in by_name.values()}
        self.made = made
        self.picked: dict[str, Picked] = {}

    @classmethod
    def of(cls, resolver: Resolver, specs: Any, seen: dict[Selection, list[Any]]) -> Sites:
        """The sites `specs` names (None: every call's output the hooks see), with `seen`
        the array leaves the hooks see at each call side (`_lens_run.probe`)."""
        explicit = specs is not None
        if explicit:
            specs = _site_specs(specs)
        else:
            specs = [where.name for where in seen if where.side == OUTPUT]
        by_name: dict[str, Site] = {}
        for spec in specs:
            site = _site(resolver, spec, explicit, seen)
            if site is not None:
                by_name.setdefault(site.name, site)
        return cls(resolver, by_name)

    def at(self, resolver: Resolver, seen: dict[Selection, list[Any]]) -> Sites:
        """These sites in another trace of the model (inputs of other shapes): their records,
        values and loop lengths there. A site the model computes no value at there (a call
        made once per step of an input axis) is left out."""
        by_name = {}
        for name, site in self.by_name.items():
            try:
                where = resolver.same(site.where)
            except SliceError:  # not called in this trace
                continue
            leaves = seen.get(where) or []
            if site.leaf < len(leaves):
                by_name[name] = Site(name, where, site.leaf, leaves[site.leaf], where.lengths)
        return Sites(resolver, by_name, self)

    def pick(self, spec: Any) -> Picked:
        """The site and iterations a name given at call time picks in this trace (resolved
        once: a negative or out-of-range iteration against this trace's loop lengths)."""
        found = self.picked.get(spec)
        if found is not None:
            return found
        if not isinstance(spec, str):
            raise LensNotASiteError(spec=spec, why="not a string.", sites=self.listed())
        base, leaf = _split_leaf(spec)
        try:
            where = self.resolver.select(Name.of(base), OUTPUT)
            why = "a boundary the lens was not made with."
        except SliceError as error:
            where, why = None, _first_line(error)
        site = None if where is None else self.by_where.get((where.every(), leaf or 0))
        if site is None:
            if self.made is not None and self._made_with(spec):
                raise LensSiteNotAtCallError(spec=spec, why=why)
            raise LensNotASiteError(spec=spec, why=why, sites=self.listed())
        rows = tuple(None if k == STACKED else int(k) for k in where.path)
        found = self.picked[spec] = Picked(site, rows)
        return found

    def _made_with(self, spec: str) -> bool:
        """Whether `spec` names a site (or an iteration of one) in the trace the lens was
        made with."""
        try:
            self.made.pick(spec)
        except SliceError:
            return False
        return True

    def listed(self) -> str:
        """The sites' names, for messages (the first 12)."""
        names = list(self.by_name)
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        return shown or "(none)"


def _site(resolver: Resolver, spec: str, explicit: bool, seen: dict[Selection, Any]) -> Site | None:
    """The site `spec` names; None for one the hooks cannot reach, unless the user named it
    (`explicit`: then an error says why)."""
    base, leaf = _split_leaf(spec)
    try:
        where = resolver.select(Name.of(base), OUTPUT, uncounted=True)
    except BoundaryInLoopError:
        reason = (
            "it is called in a branch of a cond (or a loop) that the lens cannot reach; "
            "name a call around it"
        )
        raise LensSitesSpecError(spec=spec, reason=reason) from None
    if any(k != STACKED for k in where.path):
        raise LensSitesSpecError(spec=spec, reason="a site names every iteration of a loop ([:])")
    leaves = seen.get(where)
    stacks = counted(where)
    if not stacks or not leaves:
        if not explicit:
            return None
        reason = (
            "only loops with a fixed number of iterations (scans) have sites"
            if not stacks
            else "the model computes no array there that hooks can see (a call in a "
            "branch of a cond, or one without array values)"
        )
        raise LensSitesSpecError(spec=spec, reason=reason)
    k = 0 if leaf is None else leaf
    if k >= len(leaves):
        raise LensLeafError(spec=spec, reason=f"the value there has {len(leaves)} array leaves")
    shown = where.name if where.side == OUTPUT else f"{where.name}:input"
    if leaf is not None:
        shown = f"{shown}#{leaf}"
    return Site(shown, where, k, leaves[k], where.lengths)


def _first_line(error: SliceError) -> str:
    """The first line of an error's message, as a sentence (for another error's)."""
    why = str(error).split("\n")[0].rstrip()
    return why if why.endswith((".", "?", "!")) else f"{why}."


def counted(where: Selection) -> bool:
    """Whether every loop around `where` is a scan (whose iterations can be stacked)."""
    return all(s.length is not None for s in where.sites) and not where.whole


def _split_leaf(spec: str) -> tuple[str, int | None]:
    """``name#k`` split into the name and k (None without ``#k``)."""
    base, hash_, leaf = spec.rpartition("#")
    if not hash_:
        return spec, None
    if not leaf.isdigit():
        raise LensLeafError(spec=spec, reason="the part after '#' must be a leaf number")
    return base, int(leaf)


def _site_specs(sites: Any) -> list[str]:
    if isinstance(sites, str):
        return [sites]
    if not isinstance(sites, Sequence) or not all(isinstance(s, str) for s in sites):
        raise LensSitesSpecError(spec=sites, reason="sites takes None or a list of names")
    return list(sites)


_compat.register_frames_exclusion(__file__)
