"""Runs the Python code blocks of markdown files (README.md, the docs pages) in order.

Each file's ```python blocks run in order as one script, in a fresh namespace of its
own.

A ```text block that directly follows a ```python block is that block's expected
output: it must equal what the block prints (trailing spaces ignored). Output that
differs between JAX versions (a printed jaxpr) goes in an untagged block, which is not
compared. Within a file, checking stops at the first block that fails; every file is
checked, and the exit status is non-zero if any failed. A file with no fenced code blocks
at all (a page of prose or tables) is skipped; a file with code blocks but no ```python
block fails.

Usage: python .ci/check_readme.py [README.md] [docs/*.md ...]
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import traceback

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str, int, bool]]:
    """``(language, code, line, adjacent)`` for each fenced block; `adjacent` is true when
    only blank lines separate it from the block before."""
    out, last_end = [], None
    for m in FENCE.finditer(text):
        adjacent = last_end is not None and not text[last_end : m.start()].strip()
        out.append((m[1], m[2], text.count("\n", 0, m.start()) + 1, adjacent))
        last_end = m.end()
    return out


def normalise(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.strip("\n").splitlines())


def main(path: str) -> int:
    text = open(path, encoding="utf-8").read()
    found = blocks(text)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    ran = checked = 0
    for i, (lang, code, line, _) in enumerate(found):
        if lang != "python":
            continue
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{path}:{line}", "exec"), namespace)
        except Exception:
            traceback.print_exc()
            print(f"FAILED: the python block at {path}:{line}", file=sys.stderr)
            return 1
        ran += 1
        following = found[i + 1] if i + 1 < len(found) else None
        if following and following[0] == "text" and following[3]:
            expected, got = normalise(following[1]), normalise(out.getvalue())
            if expected != got:
                print(
                    f"FAILED: output of the block at {path}:{line} differs from {path}:{following[2]}",
                    file=sys.stderr,
                )
                print("--- expected\n" + expected + "\n--- got\n" + got, file=sys.stderr)
                return 1
            checked += 1
    if not ran:
        if not found:
            print(f"{path}: no code blocks, skipped")
            return 0
        print(f"FAILED: no python blocks in {path}", file=sys.stderr)
        return 1
    print(f"{path}: {ran} python blocks ran, {checked} outputs matched")
    return 0


def main_all(paths: list[str]) -> int:
    failed = [path for path in paths if main(path) != 0]
    if failed:
        print("FAILED: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main_all(sys.argv[1:] or ["README.md"]))
