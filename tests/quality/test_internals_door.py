"""Only jaxslice/_compat.py may import JAX internals (STYLE: one small door)."""

import ast
import pathlib

import jaxslice

BANNED = ("jax._src", "jax.core", "jax.extend", "jax.interpreters")
PACKAGE = pathlib.Path(jaxslice.__file__).parent


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_only_compat_imports_jax_internals():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        bad = [n for n in _imports(path) if n.startswith(BANNED)]
        if bad:
            offenders[str(path.relative_to(PACKAGE))] = bad
    assert offenders == {}


def test_compat_does_import_internals():
    # The scan above must be able to see such imports at all.
    assert any(n.startswith(BANNED) for n in _imports(PACKAGE / "_compat.py"))


def test_public_names_are_exported():
    for name in jaxslice.__all__:
        assert hasattr(jaxslice, name), name
