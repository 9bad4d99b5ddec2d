"""MkDocs hooks for the documentation site (see `hooks:` in mkdocs.yml).

The library's docstrings contain doctests and indexing such as ``v["params"]["head"]``,
which Markdown renders as text in which mkdocs-autorefs sees cross-references
(``[a][b]``). Those are not links, so their "Could not find cross-reference target"
warnings are dropped for text that comes from a docstring of jaxslice; a broken
reference written in a docs page still fails `mkdocs build --strict`.
"""

from __future__ import annotations

import logging


class _DocstringRefs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Could not find cross-reference target" in message and "jaxslice/" in message)


def on_startup(**kwargs: object) -> None:
    for name in (
        "mkdocs.plugins.mkdocs_autorefs._internal.plugin",
        "mkdocs.plugins.mkdocs_autorefs",
    ):
        logging.getLogger(name).addFilter(_DocstringRefs())
