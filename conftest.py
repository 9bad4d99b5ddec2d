"""pytest's doctest collection over the package (``--doctest-modules`` on ``jaxslice/``).

The README's test command installs only ``.[test]``, so the optional model libraries
(Keras, Haiku, Equinox) may be missing. A jaxslice module that imports one at its top
(the Keras slice class subclasses ``keras.Model``) is then left out of collection, and a
docstring example that imports one is skipped, naming the library. Everything else is
collected and run. Keras, when installed, is imported on its JAX backend (the only one
jaxslice serves) unless the environment already chose one.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")

PACKAGE = pathlib.Path(__file__).parent / "jaxslice"


def _imported(source: str, path: pathlib.Path | None = None, seen=None) -> set[str]:
    """The top-level package names the statements of `source` import (not nested ones).

    With `path` (a module of the package), a relative import at the top is followed into
    the module it names, so a module that imports Keras through a sibling counts too.
    """
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return set()
    seen = set() if seen is None else seen
    names = set()
    for node in body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and path is not None:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            parts = node.module.split(".") if node.module else []
            for target in (
                base.joinpath(*parts).with_suffix(".py"),
                base.joinpath(*parts, "__init__.py"),
            ):
                if target.is_file() and target not in seen:
                    seen.add(target)
                    names |= _imported(target.read_text(), target, seen)
    return names


def _missing(names: set[str]) -> list[str]:
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def pytest_ignore_collect(collection_path: pathlib.Path, config) -> bool | None:
    if collection_path.suffix != ".py" or PACKAGE not in collection_path.parents:
        return None
    return True if _missing(_imported(collection_path.read_text(), collection_path)) else None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        examples = getattr(getattr(item, "dtest", None), "examples", None)
        if not examples:
            continue
        missing = _missing(set().union(*(_imported(e.source) for e in examples)))
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)}"))
