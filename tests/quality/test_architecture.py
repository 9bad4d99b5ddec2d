"""Architecture rules for the jaxslice package, checked statically over every .py file.

Nothing here imports jaxslice (except test 4, in a subprocess): every rule is checked on
the source with `ast`, over every ``*.py`` file under ``jaxslice/`` (no file list is
hard-coded), so new modules are covered as soon as they exist. Each checker is a plain
function over a package directory, and the ``test_checker_*`` tests run it on tiny
synthetic packages written to ``tmp_path``, so the checkers are tested themselves.

The rules:

1. Only ``jaxslice/_compat.py`` touches JAX internals (``jax._src``, ``jax.core``,
   ``jax.extend``, ``jax.interpreters``): no ``import jax.core``, ``from jax import core``,
   ``from jax.extend import core``, ``import jax`` + ``jax.core.Var``,
   ``importlib.import_module("jax._src...")``, ... anywhere else.
2. No module reads another jaxslice module's private members: neither
   ``from .x import _name`` / ``from jaxslice.x import _name`` (when ``x._name`` is not
   itself a module or package: ``from . import _compat`` and ``from .._core import plan``
   import private *modules*, which is fine) nor ``alias._name`` where ``alias`` is bound to
   an imported jaxslice module (``_compat._helper``, ``plan._step``,
   ``jaxslice._core.plan._step``). Dunder names are fine. Name lookup follows Python's
   scopes, so a parameter or local variable that shadows a module alias is not a module.
   Underscore attributes of *objects* (``sliced._base``) are rule 7's. A private name that is neither a module on disk nor bound by the
   module it is imported from (``from . import _markers`` after ``_markers.py`` moved) is
   reported as a stale import.
3. No import cycles among jaxslice modules. Every import statement counts (module level,
   inside functions, under ``if TYPE_CHECKING:``), since a deferred import is still a
   dependency. The edges, for a module ``M`` (see `import_targets`):

   * ``import a.b.c`` (``as x`` or not): ``M -> a.b.c``, plus ``M -> a`` and ``M -> a.b``
     for those of the packages ``a``, ``a.b`` that are *not* ``M`` itself or one of
     ``M``'s own parent packages (importing ``a.b.c`` runs the ``__init__`` of every
     package on the way, but ``M``'s own parents have necessarily been started before
     ``M``'s body runs, so importing them runs nothing new).
   * ``from X import n`` (``X`` after resolving dots): if ``X.n`` is a module or package
     on disk, ``M -> X.n`` (Python imports the submodule: ``from . import sibling``
     imports the sibling and needs nothing from the parent's body); otherwise ``n`` is a
     member defined by ``X``'s body and ``M -> X``, *even when X is M's own parent
     package*: ``from . import helper`` / ``from jaxslice import Sliced`` in a child
     needs the parent's ``__init__`` to have run far enough to define the name, and that
     ``__init__`` importing the child is exactly the classic circular import. In both
     cases also ``M -> P`` for every package ``P`` among ``X`` and its parents that is
     not ``M`` or one of ``M``'s parents (its ``__init__`` runs).
   * ``import jaxslice`` (a parent package, named directly) counts as ``M -> jaxslice``:
     the only reason to bind a parent package is to read names its ``__init__`` defines.
   * One exception: ``import jaxslice`` (``as`` or not) *inside a function* adds no edge.
     The root is the public API, and a function importing it when called uses jaxslice
     as its users do (``jaxslice.slice(...)``): Python runs ``jaxslice/__init__`` before
     any module under it, so by the time a function of the package is called the root
     is complete. (A function called while the package is still being imported would see
     it half made; none is.) This is how a class that another library rebuilds from a
     file slices again (`KerasSlice.from_config`). ``from jaxslice import slice`` or
     ``from .. import slice`` inside a function still count, as ``import jaxslice`` at
     module level (or in a class body) does.

   So a package ``__init__`` importing its children is normal, a child importing a sibling
   with ``from . import sibling`` or ``from .sibling import f`` is normal, and a child
   reaching a sibling's names *through* the package (``from . import f``, ``import
   jaxslice; jaxslice.f``) is a cycle. Imports of modules that do not exist on disk, and
   of names neither a module on disk nor bound at the top level of the module they are
   imported from (stale imports), add no edge: they fail on import, not in a cycle. Every
   cycle is reported by ``networkx.simple_cycles``, each edge with the file and line of its
   import statement.
4. ``import jaxslice`` does not import ``flax.nnx`` (Flax's NNX is imported only when an
   NNX model is used), nor Equinox, Haiku or Keras, checked in a fresh interpreter.
5. Size: no function or method (closures included) exceeds cyclomatic complexity 12
   (radon), and no module exceeds 500 lines. There is deliberately no bound on the
   *average* complexity: it rewarded splitting linear code into one-caller helpers (JAX's
   own `partial_eval` keeps long, linear functions where the logic is linear); a module
   that grows past one job shows up in its length instead, and is split by job.
6. No import cycles among the package's *parts*. A part is one of the package's first-level
   subpackages with everything under it (``jaxslice._core``, ``jaxslice.adapters``,
   ``jaxslice.coverage``, ``jaxslice.observe``, ``jaxslice.render``, ``jaxslice._errors``,
   ...), or one of the package's own modules on its own (``jaxslice._slice``,
   ``jaxslice._view``, ..., and ``jaxslice`` itself, its ``__init__``). Part ``A`` depends
   on part ``B`` when a module of ``A`` imports a module of ``B`` by rule 3's edges (so
   deferred imports count). The parts must form a DAG: ``_core`` importing ``adapters``
   while an adapter imports ``_core.markers`` is a cycle even though no two *modules*
   import each other, and so is a lower part reaching a higher one through a registry it
   could not import (the registry itself is not seen: keep dependencies importable).
   Rule 3's one exception (``import jaxslice`` inside a function) adds no edge here either.
7. No module reads or writes another object's private attributes: ``x._name`` (an
   attribute load, store or delete, or ``getattr``/``hasattr``/``setattr``/``delattr``
   with the constant name ``"_name"``) where ``x`` is not ``self``, ``cls`` or
   ``super()``, ``_name`` is not a dunder, and no class of the module defines ``_name``
   (a method or class attribute) and the module never assigns it on ``self``/``cls``
   (``self._name = ...``, ``object.__setattr__(self, "_name", ...)``). So a class may
   read its own fields on another instance of itself (``other._key`` in ``__eq__``), but
   ``tracker._observer`` in another module is a finding: the owner offers what is needed
   as a public or package-level method or property. Module aliases (``_compat._f``) are
   rule 2's. Other libraries' private attributes that jaxslice must read are listed, each
   with its reason, in `THIRD_PARTY_PRIVATE` (or read in ``_compat.py``, which is exempt
   as for rule 1); a listed entry that no longer occurs is reported too.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import networkx as nx
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "jaxslice"
PACKAGE_DIR = REPO / PACKAGE
COMPAT = "jaxslice._compat"
JAX_INTERNALS = ("jax._src", "jax.core", "jax.extend", "jax.interpreters")

MAX_BLOCK_COMPLEXITY = 12
MAX_MODULE_LINES = 500
CYCLES_SHOWN = 40
CYCLES_COUNTED = 2000


# --------------------------------------------------------------------------- the package


@dataclasses.dataclass(frozen=True)
class Module:
    name: str  # dotted: jaxslice._core.plan; a package's __init__ is the package's name
    path: pathlib.Path
    display: str  # path shown in messages: jaxslice/_core/plan.py
    is_package: bool
    source: str
    tree: ast.Module


@dataclasses.dataclass(frozen=True)
class Package:
    """Every module of one package directory, parsed."""

    root: pathlib.Path
    name: str
    modules: dict[str, Module]

    def is_module(self, dotted: str) -> bool:
        """True when `dotted` is a module or package on disk (namespace packages too)."""
        prefix = dotted + "."
        return dotted in self.modules or any(m.startswith(prefix) for m in self.modules)

    def defines(self, dotted: str, name: str) -> bool:
        """True when module `dotted`'s top level may bind `name` (assignment, def, class,
        import; anything at all with a module ``__getattr__`` or a star import)."""
        module = self.modules.get(dotted)
        if module is None:
            return False
        star = any(
            isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)
            for n in _own_nodes(module.tree)
        )
        bound = _scope_bindings(module.tree, module)
        return star or name in bound or "__getattr__" in bound

    def owns(self, dotted: str) -> bool:
        return dotted == self.name or dotted.startswith(self.name + ".")

    def where(self, dotted: str) -> str:
        module = self.modules.get(dotted)
        return module.display if module else dotted.replace(".", "/") + "/"


def load_package(root: pathlib.Path, name: str | None = None) -> Package:
    root = pathlib.Path(root)
    name = name or root.name
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p == "__pycache__" for p in parts):
            continue
        is_package = parts[-1] == "__init__.py"
        dotted = ".".join([name, *parts[:-1]] + ([] if is_package else [path.stem]))
        display = path.relative_to(root.parent).as_posix()
        try:
            source = path.read_text(encoding="utf-8")
        except FileNotFoundError:  # removed since the listing (the tree is being edited)
            continue
        try:
            tree = ast.parse(source, filename=display)
        except SyntaxError as e:
            pytest.fail(f"{display}:{e.lineno}: cannot parse: {e.msg}")
        modules[dotted] = Module(dotted, path, display, is_package, source, tree)
    return Package(root, name, modules)


@dataclasses.dataclass(frozen=True, order=True)
class Finding:
    display: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.display}:{self.line}: {self.message}"


def report(title: str, findings: list[Finding]) -> str:
    lines = "\n".join(f"  {f}" for f in sorted(set(findings)))
    return f"{title} ({len(set(findings))}):\n{lines}"


def parents_and_self(dotted: str) -> set[str]:
    parts = dotted.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def resolve_from(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from X import ...`` statement's ``X``."""
    if node.level == 0:
        return node.module or ""
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# --------------------------------------------------------------------------- name scopes

_SCOPES = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.Lambda,
    ast.ClassDef,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)


def _own_nodes(scope: ast.AST):
    """The nodes of a scope's own code: nested functions, classes and comprehensions are
    yielded (their names bind here) but not entered."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _import_bindings(module: Module, node: ast.Import | ast.ImportFrom):
    """(local name, dotted name it refers to) for each name an import statement binds."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                yield alias.asname, alias.name
            else:
                top = alias.name.split(".")[0]
                yield top, top
    else:
        base = resolve_from(module, node)
        for alias in node.names:
            if alias.name != "*":
                yield alias.asname or alias.name, f"{base}.{alias.name}"


def _scope_bindings(scope: ast.AST, module: Module) -> dict[str, str | None]:
    """Names bound in a scope: to the dotted name they import, or None (anything else)."""
    bound: dict[str, str | None] = {}
    imported: dict[str, str | None] = {}
    outer: set[str] = set()
    if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        a = scope.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                bound[arg.arg] = None
    for node in _own_nodes(scope):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound[node.id] = None
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound[node.name] = None
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound[node.name] = None
        elif isinstance(node, ast.Global | ast.Nonlocal):
            outer.update(node.names)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imported.update(_import_bindings(module, node))
    bound.update(imported)  # an import wins over another binding of the same name
    for name in outer:
        bound.pop(name, None)
    return bound


@dataclasses.dataclass(frozen=True)
class Chain:
    """``base.a.b.c`` in the source, where ``base`` is bound by an import to ``target``."""

    line: int
    base: str
    target: str
    attrs: tuple[str, ...]


class _ChainCollector(ast.NodeVisitor):
    def __init__(self, module: Module):
        self.module = module
        self.stack = [(module.tree, _scope_bindings(module.tree, module))]
        self.chains: list[Chain] = []

    def _lookup(self, name: str) -> str | None:
        for depth, (scope, bound) in enumerate(reversed(self.stack)):
            if depth and isinstance(scope, ast.ClassDef):
                continue  # a class body's names are not visible in its methods
            if name in bound:
                return bound[name]
        return None

    def _scoped(self, node: ast.AST) -> None:
        self.stack.append((node, _scope_bindings(node, self.module)))
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = _scoped
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _scoped

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attrs, value = [], node
        while isinstance(value, ast.Attribute):
            attrs.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name):
            self.visit(value)
            return
        target = self._lookup(value.id)
        if target is not None:
            self.chains.append(Chain(node.lineno, value.id, target, tuple(reversed(attrs))))


def attribute_chains(module: Module) -> list[Chain]:
    collector = _ChainCollector(module)
    collector.visit(module.tree)
    return collector.chains


# --------------------------------------------------------------------------- 1. JAX internals


def _internal(dotted: str) -> str | None:
    """The JAX-internal module `dotted` is in or under, if any."""
    for banned in JAX_INTERNALS:
        if dotted == banned or dotted.startswith(banned + "."):
            return banned
    return None


def _import_module_call(node: ast.AST) -> str | None:
    """The constant module name of ``importlib.import_module("...")``/``__import__("...")``."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func, arg = node.func, node.args[0]
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
        return arg.value if isinstance(arg.value, str) else None
    return None


def jax_internal_uses(package: Package, allowed: str = COMPAT) -> list[Finding]:
    findings = []
    for module in package.modules.values():
        if module.name == allowed:
            continue

        def flag(line: int, what: str, reached: str, module: Module = module) -> None:
            findings.append(
                Finding(
                    module.display,
                    line,
                    f"`{what}` reaches JAX internals ({reached}); only "
                    f"{package.where(allowed)} may: add what you need there and use it from there",
                )
            )

        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if reached := _internal(alias.name):
                        flag(node.lineno, f"import {alias.name}", reached)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = node.module if alias.name == "*" else f"{node.module}.{alias.name}"
                    if reached := _internal(full):
                        flag(node.lineno, f"from {node.module} import {alias.name}", reached)
            elif (name := _import_module_call(node)) and (reached := _internal(name)):
                flag(node.lineno, f'import_module("{name}")', reached)
        for chain in attribute_chains(module):
            for i in range(len(chain.attrs)):
                if reached := _internal(".".join((chain.target, *chain.attrs[: i + 1]))):
                    flag(chain.line, ".".join((chain.base, *chain.attrs[: i + 1])), reached)
                    break
    return findings


# --------------------------------------------------------------------------- 2. private members


def _private_message(package: Package, what: str, owner: str, name: str) -> str:
    if package.defines(owner, name):
        return (
            f"`{what}` reads `{name}`, a private member of {owner} ({package.where(owner)}); "
            f"make it public there (a name without the leading underscore) or stop using it"
        )
    return (
        f"`{what}`: {owner} ({package.where(owner)}) has no module or member `{name}`; "
        f"fix the import (the module may have moved) or, if it is meant as a member, make it "
        f"public (no leading underscore)"
    )


def private_member_reads(package: Package) -> list[Finding]:
    findings = []
    for module in package.modules.values():
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = resolve_from(module, node)
            if not package.owns(base) or base == module.name:
                continue
            for alias in node.names:
                if is_private(alias.name) and not package.is_module(f"{base}.{alias.name}"):
                    what = f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                    message = _private_message(package, what, base, alias.name)
                    findings.append(Finding(module.display, node.lineno, message))
        for chain in attribute_chains(module):
            owner = chain.target
            if not (package.owns(owner) and package.is_module(owner)):
                continue
            for i, attr in enumerate(chain.attrs):
                if package.is_module(f"{owner}.{attr}"):
                    owner = f"{owner}.{attr}"
                    continue
                if is_private(attr) and owner != module.name:
                    what = ".".join((chain.base, *chain.attrs[: i + 1]))
                    message = _private_message(package, what, owner, attr)
                    findings.append(Finding(module.display, chain.line, message))
                break
    return findings


# --------------------------------------------------------------------------- 3. import cycles


def deferred_nodes(tree: ast.Module) -> set[int]:
    """The ids of the statements in a function's body (at any depth): they run when the
    function is called, not when the module is imported."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside.update(id(n) for statement in node.body for n in ast.walk(statement))
    return inside


def import_targets(
    package: Package, module: Module, node: ast.AST, deferred: bool = False
) -> set[str]:
    """The package's modules an import statement depends on (rules in the module
    docstring); `deferred`: the statement is in a function's body."""
    own = parents_and_self(module.name)

    def packages_run(dotted: str) -> set[str]:
        return {p for p in parents_and_self(dotted) if p not in own}

    targets: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if deferred and alias.name == package.name:
                continue  # the public API, read at call time (rule 3's one exception)
            if package.owns(alias.name):
                targets |= {alias.name} | packages_run(alias.name)
    elif isinstance(node, ast.ImportFrom):
        base = resolve_from(module, node)
        if package.owns(base):
            targets |= packages_run(base)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and package.is_module(sub):
                    targets.add(sub)  # a submodule: Python imports it
                elif alias.name == "*" or package.defines(base, alias.name):
                    targets.add(base)  # a member: base's body must have defined it
    return {t for t in targets if t in package.modules and t != module.name}


def import_graph(package: Package) -> nx.DiGraph:
    """Module -> module, each edge with ``lines``: where its import statements are."""
    graph = nx.DiGraph()
    graph.add_nodes_from((m.name, {"display": m.display}) for m in package.modules.values())
    for module in package.modules.values():
        deferred = deferred_nodes(module.tree)
        for node in ast.walk(module.tree):
            for target in sorted(import_targets(package, module, node, id(node) in deferred)):
                if not graph.has_edge(module.name, target):
                    graph.add_edge(module.name, target, lines=[])
                graph.edges[module.name, target]["lines"].append(node.lineno)
    return graph


def _canonical(cycle: list[str]) -> tuple[str, ...]:
    start = cycle.index(min(cycle))
    return tuple(cycle[start:] + cycle[:start])


def import_cycles(graph: nx.DiGraph, limit: int = CYCLES_COUNTED) -> list[tuple[str, ...]]:
    cycles = itertools.islice(nx.simple_cycles(graph), limit)
    return sorted({_canonical(c) for c in cycles}, key=lambda c: (len(c), c))


def describe_cycle(graph: nx.DiGraph, cycle: tuple[str, ...]) -> str:
    steps = [f"    {cycle[0]}"]
    for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        display = graph.nodes[a]["display"]
        lines = ", ".join(f"{display}:{n}" for n in sorted(set(graph.edges[a, b]["lines"])))
        steps.append(f"      -> {b}   (import at {lines})")
    return "\n".join(steps)


# --------------------------------------------------------------------------- 6. package cycles


def part_of(dotted: str) -> str:
    """The part (rule 6) a module belongs to: its first-level subpackage, or the module
    itself for the package's own modules and its ``__init__``."""
    return ".".join(dotted.split(".")[:2])


def part_graph(package: Package) -> nx.DiGraph:
    """Part -> part, each edge with ``lines``: the module imports it stands for."""
    graph = nx.DiGraph()
    graph.add_nodes_from(
        (part_of(m.name), {"display": package.where(part_of(m.name))})
        for m in package.modules.values()
    )
    modules = import_graph(package)
    for a, b, data in modules.edges(data=True):
        pa, pb = part_of(a), part_of(b)
        if pa == pb:
            continue
        if not graph.has_edge(pa, pb):
            graph.add_edge(pa, pb, lines=[])
        display = modules.nodes[a]["display"]
        graph.edges[pa, pb]["lines"] += [
            f"{display}:{n} -> {b}" for n in sorted(set(data["lines"]))
        ]
    return graph


def describe_part_cycle(graph: nx.DiGraph, cycle: tuple[str, ...]) -> str:
    steps = [f"    {cycle[0]}"]
    for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        imports = graph.edges[a, b]["lines"]
        shown = ", ".join(imports[:3]) + (
            f", ... ({len(imports)} imports)" if len(imports) > 3 else ""
        )
        steps.append(f"      -> {b}   ({shown})")
    return "\n".join(steps)


# --------------------------------------------------------------------------- 7. private attributes

#: Other libraries' private attributes jaxslice reads (rule 7): ``(file, name): why``.
THIRD_PARTY_PRIVATE = {
    ("jaxslice/adapters/_keras.py", "_flatten_layers"): (
        "Keras's own walk over a layer's sublayers, in the order it tracks them; the public "
        "`layers` exists on models only (the code falls back to it where the method is missing)"
    ),
    ("jaxslice/adapters/_plain.py", "_getframe"): (
        "Python's documented `sys._getframe`, to find the user's frame for a warning's "
        "`stacklevel` without building the whole stack (`inspect.stack` reads every file)"
    ),
    ("jaxslice/adapters/_keras_model.py", "_value"): (
        "Keras's JAX trainer detaches a variable by setting its `_value` to None while it holds "
        "the values; no public attribute tells a detached variable, which a slice puts back "
        "after a failed `fit`"
    ),
}

_ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")


def _own_private_names(module: Module) -> set[str]:
    """Private names the module's classes define or its code assigns on ``self``/``cls``."""
    own = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    own.add(stmt.name)
                elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    own |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            if _is_own(node.value):
                own.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "__setattr__"
            and len(node.args) >= 2
            and _is_own(node.args[0])
        ):
            own.add(_constant_name(node.args[1]) or "")
    return {n for n in own if is_private(n)}


def _is_own(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "super"


def _constant_name(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _attribute_uses(module: Module):
    """``(line, base node, name, source)`` for each attribute use rule 7 looks at."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.value, node.attr, ast.unparse(node)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in _ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and (name := _constant_name(node.args[1])) is not None
        ):
            yield node.lineno, node.args[0], name, ast.unparse(node)


def private_attribute_uses(
    package: Package, allowed: dict[tuple[str, str], str], exempt: str = COMPAT
) -> tuple[list[Finding], list[tuple[str, str]]]:
    """(findings, allow-list entries that matched nothing)."""
    findings, used = [], set()
    for module in package.modules.values():
        if module.name == exempt:
            continue
        own = _own_private_names(module)
        modules = {
            n
            for n, target in _scope_bindings(module.tree, module).items()
            if target and package.owns(target) and package.is_module(target)
        }
        for line, base, name, source in _attribute_uses(module):
            if not is_private(name) or name in own or _is_own(base):
                continue
            if isinstance(base, ast.Name) and base.id in modules:
                continue  # a module alias: rule 2
            if (module.display, name) in allowed:
                used.add((module.display, name))
                continue
            findings.append(
                Finding(
                    module.display,
                    line,
                    f"`{source}` uses `{name}`, a private attribute of an object no class of "
                    f"this module defines: use (or add) a public or package-level method or "
                    f"property of its owner; another library's goes in THIRD_PARTY_PRIVATE, "
                    f"with why",
                )
            )
    return findings, sorted(set(allowed) - used)


# --------------------------------------------------------------------------- 5. complexity


@dataclasses.dataclass(frozen=True)
class Block:
    display: str
    line: int
    kind: str  # function, method, class
    name: str
    complexity: int

    def __str__(self) -> str:
        return f"{self.display}:{self.line}: {self.kind} {self.name}: complexity {self.complexity}"


def complexity_blocks(package: Package) -> tuple[list[Block], list[Block]]:
    """(blocks `radon cc -a` averages over, every function/method/closure)."""
    from radon.complexity import add_inner_blocks, cc_visit
    from radon.visitors import Function

    def block(module: Module, b) -> Block:
        kind = ("method" if b.is_method else "function") if isinstance(b, Function) else "class"
        return Block(module.display, b.lineno, kind, b.fullname, b.complexity)

    averaged, functions = [], []
    for module in package.modules.values():
        blocks = cc_visit(module.source)
        averaged += [block(module, b) for b in blocks]
        functions += [block(module, b) for b in add_inner_blocks(blocks) if isinstance(b, Function)]
    return averaged, functions


def average(blocks: list[Block]) -> float:
    return sum(b.complexity for b in blocks) / len(blocks) if blocks else 0.0


def worst(blocks: list[Block], n: int = 15) -> str:
    ranked = sorted(blocks, key=lambda b: (-b.complexity, b.display, b.line))[:n]
    return "\n".join(f"  {b}" for b in ranked)


# =========================================================================== the tests


@pytest.fixture(scope="module")
def package() -> Package:
    return load_package(PACKAGE_DIR, PACKAGE)


def test_only_compat_reaches_jax_internals(package):
    assert COMPAT in package.modules, f"{PACKAGE}/_compat.py is missing"
    findings = jax_internal_uses(package)
    assert not findings, report(
        f"JAX internals ({', '.join(JAX_INTERNALS)}) used outside {package.where(COMPAT)}",
        findings,
    )


def test_no_private_member_reads_across_modules(package):
    findings = private_member_reads(package)
    assert not findings, report("private members read from another jaxslice module", findings)


def test_no_import_cycles(package):
    graph = import_graph(package)
    cycles = import_cycles(graph)
    if not cycles:
        return
    components = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    more = "at least " if len(cycles) == CYCLES_COUNTED else ""
    shown = "\n".join(describe_cycle(graph, c) for c in cycles[:CYCLES_SHOWN])
    tangles = "\n".join(f"  {', '.join(c)}" for c in sorted(components))
    pytest.fail(
        f"{more}{len(cycles)} import cycle(s) among jaxslice modules (break each by moving the "
        f"shared code into a lower module, or by importing a sibling module directly instead "
        f"of through its package; deferred imports inside functions count too).\n"
        f"Modules tangled together (strongly connected components):\n{tangles}\n"
        f"Cycles (shortest first{', first ' + str(CYCLES_SHOWN) if len(cycles) > CYCLES_SHOWN else ''}):\n"
        f"{shown}"
    )


def test_no_package_cycles(package):
    graph = part_graph(package)
    cycles = import_cycles(graph)
    shown = "\n".join(describe_part_cycle(graph, c) for c in cycles[:CYCLES_SHOWN])
    assert not cycles, (
        f"{len(cycles)} import cycle(s) among the package's parts (first-level subpackages and "
        f"top-level modules; see rule 6): a lower part must not import a higher one, not even "
        f"inside a function. Pass what it needs in, or move the shared code down.\n{shown}"
    )


def test_no_private_attributes_of_other_objects(package):
    findings, stale = private_attribute_uses(package, THIRD_PARTY_PRIVATE)
    assert not findings, report("private attributes of other objects used", findings)
    assert not stale, f"THIRD_PARTY_PRIVATE entries that no longer occur (remove them): {stale}"


_FLAX_PROBE = r"""
import json, os, sys, traceback
package_dir = os.path.realpath(sys.argv[1])
class Spy:
    stack = None
    def find_spec(self, name, path=None, target=None):
        if name == "flax.nnx" and Spy.stack is None:
            Spy.stack = [
                f"{os.path.relpath(f.filename, os.path.dirname(package_dir))}:{f.lineno}: {f.line}"
                for f in traceback.extract_stack()
                if os.path.realpath(f.filename).startswith(package_dir + os.sep)
            ]
        return None
sys.meta_path.insert(0, Spy())
import jaxslice
print(json.dumps(Spy.stack))
"""


def test_import_does_not_load_flax_nnx():
    code = "import jaxslice, sys; print('flax.nnx' in sys.modules, 'flax.linen' in sys.modules)"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"`import jaxslice` failed:\n{run.stderr[-3000:]}"
    nnx_loaded, linen_loaded = run.stdout.split()[-2:]
    if nnx_loaded == "False":
        return
    probe = subprocess.run(
        [sys.executable, "-c", _FLAX_PROBE, str(PACKAGE_DIR)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    stack = json.loads(probe.stdout.splitlines()[-1]) if probe.returncode == 0 else None
    chain = "\n".join(f"  {line}" for line in stack or ["(could not trace the import)"])
    pytest.fail(
        "`import jaxslice` imports flax.nnx (flax.linen too: "
        f"{linen_loaded}); import it lazily, only where an NNX model is handled "
        "(e.g. inside the adapter's functions). jaxslice frames on the stack when flax.nnx "
        f"was imported (innermost last):\n{chain}"
    )


MODEL_LIBRARIES = ("equinox", "haiku", "keras")


def test_import_does_not_load_other_model_libraries():
    """Equinox, Haiku and Keras are imported only when such a model is passed."""
    code = f"import jaxslice, sys; print([m for m in {MODEL_LIBRARIES!r} if m in sys.modules])"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"`import jaxslice` failed:\n{run.stderr[-3000:]}"
    assert run.stdout.split("\n")[-2] == "[]", f"`import jaxslice` imports {run.stdout}"


def test_complexity_and_size():
    pytest.importorskip("radon.complexity")
    package = load_package(PACKAGE_DIR, PACKAGE)
    _, functions = complexity_blocks(package)
    too_complex = [b for b in functions if b.complexity > MAX_BLOCK_COMPLEXITY]
    problems = []
    if too_complex:
        problems.append(
            f"{len(too_complex)} function(s) over complexity {MAX_BLOCK_COMPLEXITY}; split "
            f"them:\n{worst(too_complex, n=len(too_complex))}"
        )
    long = {
        m.display: n
        for m in package.modules.values()
        if (n := len(m.source.splitlines())) > MAX_MODULE_LINES
    }
    if long:
        problems.append(f"modules over {MAX_MODULE_LINES} lines (split by job): {long}")
    assert not problems, "\n".join(problems)


# =========================================================================== the checkers, tested


def write_tree(root: pathlib.Path, files: dict[str, str]) -> Package:
    """Writes ``{"pkg/a.py": source, ...}`` under `root`; returns the package ``pkg``."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return load_package(root / "pkg", "pkg")


def flagged(findings: list[Finding]) -> set[tuple[str, int]]:
    return {(f.display, f.line) for f in findings}


def test_checker_jax_internals(tmp_path):
    pkg = write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/_compat.py": "import jax._src.core\nfrom jax import core\n",
            "pkg/a.py": "import jax\nfrom jax import core\n",
            "pkg/b.py": "import jax.extend as je\nfrom jax.interpreters import ad\n",
            "pkg/c.py": """\
                import jax
                import jax.numpy as jnp

                def f():
                    return jax.core.Var, jnp.zeros, jax.lax.add
            """,
            "pkg/d.py": """\
                import importlib
                from jax._src import dtypes
                m = importlib.import_module("jax._src.lax")
            """,
            "pkg/e.py": "from jax import numpy as jnp, tree_util\nimport jax\njax.jit\n",
        },
    )
    findings = jax_internal_uses(pkg, allowed="pkg._compat")
    assert flagged(findings) == {
        ("pkg/a.py", 2),
        ("pkg/b.py", 1),
        ("pkg/b.py", 2),
        ("pkg/c.py", 5),
        ("pkg/d.py", 2),
        ("pkg/d.py", 3),
    }, findings
    messages = {str(f) for f in findings}
    assert "pkg/a.py:2: `from jax import core` reaches JAX internals (jax.core)" in "\n".join(
        messages
    )
    assert any("`jax.core` reaches JAX internals (jax.core)" in m for m in messages)
    assert all("pkg/_compat.py" in m for m in messages)


def test_checker_private_members(tmp_path):
    pkg = write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "_registry = {}\n__version__ = '1'\n",
            "pkg/_x.py": "_y = 1\nz = 2\n__all__ = ['z']\ndef _helper(): pass\n",
            "pkg/sub/__init__.py": "_hidden = 1\n",
            "pkg/sub/_m.py": "_deep = 1\n",
            "pkg/a.py": """\
                from ._x import _y
                from . import _x
                from ._x import __all__, z
                from .sub import _m
                from .sub import _hidden
                from . import _registry, __version__
                import pkg.sub._m
                import pkg._x as alias

                _x._helper()
                _x.z._anything
                _x.__name__
                pkg.sub._m._deep
                alias._y

                def f(_x):
                    return _x._not_a_module

                def g():
                    _m = object()
                    return _m._fine

                class C:
                    _x = None

                    def method(self):
                        return _x._from_method, self._x._own
            """,
            "pkg/sub/_m2.py": "from .. import _x\nfrom ._m import _deep\nx = _x._y\n",
            "pkg/sub/_m3.py": "from . import _gone\n",
        },
    )
    findings = private_member_reads(pkg)
    assert flagged(findings) == {
        ("pkg/a.py", 1),
        ("pkg/a.py", 5),
        ("pkg/a.py", 6),
        ("pkg/a.py", 10),
        ("pkg/a.py", 13),
        ("pkg/a.py", 14),
        ("pkg/a.py", 27),
        ("pkg/sub/_m2.py", 2),
        ("pkg/sub/_m2.py", 3),
        ("pkg/sub/_m3.py", 1),
    }, findings
    text = "\n".join(map(str, findings))
    assert (
        "pkg/a.py:1: `from ._x import _y` reads `_y`, a private member of pkg._x (pkg/_x.py)"
        in text
    )
    assert "pkg/a.py:13: `pkg.sub._m._deep` reads `_deep`, a private member of pkg.sub._m" in text
    assert "pkg/a.py:6: `from . import _registry` reads `_registry`" in text
    assert "pkg/a.py:10: `_x._helper` reads `_helper`, a private member of pkg._x" in text
    assert "pkg/a.py:27: `_x._from_method`: pkg._x (pkg/_x.py) has no module or member" in text
    assert "pkg/sub/_m3.py:1: `from . import _gone`: pkg.sub (pkg/sub/__init__.py) has no " in text


def cycles_of(tmp_path, files: dict[str, str]) -> list[tuple[str, ...]]:
    return import_cycles(import_graph(write_tree(tmp_path, files)))


def test_checker_cycle_between_two_modules(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "from .a import f\n",
    }
    pkg = write_tree(tmp_path, files)
    graph = import_graph(pkg)
    assert import_cycles(graph) == [("pkg.a", "pkg.b")]
    text = describe_cycle(graph, ("pkg.a", "pkg.b"))
    assert "-> pkg.b   (import at pkg/a.py:1)" in text
    assert "-> pkg.a   (import at pkg/b.py:1)" in text


def test_checker_cycle_rules(tmp_path):
    # A package __init__ importing its children, children importing siblings directly or
    # with `from . import sibling`, and absolute imports of siblings: no cycle.
    assert not cycles_of(
        tmp_path / "ok",
        {
            "pkg/__init__.py": "from .a import f\nfrom .b import g\nfrom . import sub\n",
            "pkg/a.py": "from . import b\nfrom .sub import m\n",
            "pkg/b.py": "import pkg.c\nfrom pkg.c import h\n",
            "pkg/c.py": "def h(): pass\nfrom . import _moved_away\n",
            "pkg/sub/__init__.py": "from . import m\n",
            "pkg/sub/m.py": "from .. import c\nfrom ..b import g\n",
        },
    )
    # A child reading a name its parent's __init__ defines (or re-exports).
    assert cycles_of(
        tmp_path / "member",
        {
            "pkg/__init__.py": "from .a import f\nVALUE = 1\n",
            "pkg/a.py": "def f():\n    from . import VALUE\n",
        },
    ) == [("pkg", "pkg.a")]
    # `import pkg` in a child: it only binds the package to read what __init__ defines.
    assert cycles_of(
        tmp_path / "plain",
        {"pkg/__init__.py": "from .a import f\n", "pkg/a.py": "import pkg\n"},
    ) == [("pkg", "pkg.a")]
    # ... but inside a function it reads the finished public API: no edge (rule 3's one
    # exception). Reading a member of the root (`from . import g`, `from pkg import g`) in
    # a function, and `import pkg` at module level or in a class body, still count.
    assert not cycles_of(
        tmp_path / "public",
        {
            "pkg/__init__.py": "from .a import f\nfrom .b import G\n",
            "pkg/a.py": "def f():\n    import pkg\n    return pkg.g\n",
            "pkg/b.py": "class G:\n    def g(self):\n        import pkg as p\n",
        },
    )
    for i, source in enumerate(
        (
            "def f():\n    from pkg import g\n",
            "def f():\n    from . import g\n",
            "class F:\n    import pkg\n",
            "def f():\n    pass\nimport pkg\n",
        )
    ):
        files = {"pkg/__init__.py": "from .a import f\ng = 1\n", "pkg/a.py": source}
        assert cycles_of(tmp_path / f"member{i}", files) == [("pkg", "pkg.a")], source
    # Importing a module inside another package runs that package's __init__.
    assert cycles_of(
        tmp_path / "init",
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.sub.m\n",
            "pkg/sub/__init__.py": "from .. import a\n",
            "pkg/sub/m.py": "",
        },
    ) == [("pkg.a", "pkg.sub")]
    # Deferred imports count, through a longer cycle.
    assert cycles_of(
        tmp_path / "deferred",
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from .b import x\n",
            "pkg/b.py": "def x():\n    from .c import y\n",
            "pkg/c.py": "def y():\n    import pkg.a as a\n",
        },
    ) == [("pkg.a", "pkg.b", "pkg.c")]


def test_checker_package_cycles(tmp_path):
    # No two modules import each other, but the parts do: core -> adapters -> core.
    files = {
        "pkg/__init__.py": "from ._slice import slice\n",
        "pkg/_view.py": "",
        "pkg/_slice.py": "from .adapters import find\nfrom . import _view\n",
        "pkg/core/__init__.py": "",
        "pkg/core/markers.py": "",
        "pkg/core/trace.py": "from ..adapters import find\n",
        "pkg/adapters/__init__.py": "from ._base import find\n",
        "pkg/adapters/_base.py": "from ..core.markers import m\nfrom .._view import v\n",
        "pkg/adapters/_keras.py": "def rebuild():\n    from .._slice import slice\n",
    }
    pkg = write_tree(tmp_path, files)
    assert not import_cycles(import_graph(pkg))
    graph = part_graph(pkg)
    assert import_cycles(graph) == [("pkg._slice", "pkg.adapters"), ("pkg.adapters", "pkg.core")]
    text = describe_part_cycle(graph, ("pkg.adapters", "pkg.core"))
    assert "-> pkg.core   (pkg/adapters/_base.py:1 -> pkg.core, " in text
    assert "pkg/adapters/_base.py:1 -> pkg.core.markers" in text
    assert "-> pkg.adapters   (pkg/core/trace.py:1 -> pkg.adapters)" in text
    assert part_of("pkg.core.trace") == "pkg.core" and part_of("pkg._slice") == "pkg._slice"
    assert part_of("pkg") == "pkg"
    # The core taking the adapter from its caller, and no rebuild from above: a DAG.
    files["pkg/core/trace.py"] = "def trace(adapter):\n    return adapter\n"
    files["pkg/adapters/_keras.py"] = ""
    assert not import_cycles(part_graph(write_tree(tmp_path / "fixed", files)))


def test_checker_private_attributes(tmp_path):
    pkg = write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/_compat.py": "def f(x):\n    return x._internal\n",
            "pkg/_x.py": "def _helper(): pass\n",
            "pkg/a.py": """\
                from . import _x

                class Tracker:
                    _limit = 3

                    def __init__(self):
                        self._seen = 0
                        object.__setattr__(self, "_frozen", 1)

                    def _own(self):
                        return super()._own() + cls._limit

                    def same(self, other):
                        return other._seen + other._frozen + other._own() + other._limit

                def read(tracker, v):
                    a = tracker._observer
                    b = getattr(tracker, "_names", None)
                    tracker._search = 1
                    c = hasattr(v, "_value") + v.__dict__ + _x._helper()
                    return a, b, c, v._value, tracker.observer._inputs
            """,
        },
    )
    findings, stale = private_attribute_uses(
        pkg, {("pkg/a.py", "_value"): "why", ("pkg/a.py", "_gone"): "why"}, exempt="pkg._compat"
    )
    assert flagged(findings) == {
        ("pkg/a.py", 17),
        ("pkg/a.py", 18),
        ("pkg/a.py", 19),
        ("pkg/a.py", 21),
    }
    text = "\n".join(map(str, findings))
    assert "pkg/a.py:17: `tracker._observer` uses `_observer`, a private attribute" in text
    assert "`getattr(tracker, '_names', None)` uses `_names`" in text
    assert "`tracker._search` uses `_search`" in text
    assert "`tracker.observer._inputs` uses `_inputs`" in text
    assert stale == [("pkg/a.py", "_gone")]


def test_checker_complexity_matches_radon_cli(tmp_path):
    pytest.importorskip("radon.complexity")
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(16))
    pkg = write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": f"def big(x):\n{branches}\n    return -1\n",
            "pkg/b.py": """\
                class K:
                    def m(self, x):
                        return 1 if x else 2

                    def n(self, x):
                        for i in x:
                            if i:
                                return i

                def outer(x):
                    def inner(y):
                        if y:
                            return y
                        return x and y
                    return inner
            """,
        },
    )
    averaged, functions = complexity_blocks(pkg)
    assert {b.name: b.complexity for b in functions if b.complexity > MAX_BLOCK_COMPLEXITY} == {
        "big": 17
    }
    assert "outer.inner" in {b.name for b in functions}
    cli = subprocess.run(
        [sys.executable, "-m", "radon", "cc", "-a", "-s", str(pkg.root)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    expected = float(re.search(r"Average complexity: \w+ \(([\d.]+)\)", cli).group(1))
    blocks = int(re.search(r"(\d+) blocks", cli).group(1))
    assert len(averaged) == blocks
    assert average(averaged) == pytest.approx(expected)
