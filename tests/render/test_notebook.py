"""Jupyter display: tables as HTML (`_repr_html_`), slices and editors as SVG drawings
(`_repr_mimebundle_`), and the text they fall back to without Graphviz's `dot`.

IPython is not needed: these are the calls it makes. HTML is read back with the
standard library's `html.parser` and SVG with `xml.etree`; the oracles are the
`Boundary` fields, the `result()` dicts, statistics computed per tensor against the
per-channel table, and the model's own module names.
"""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import stat
import xml.etree.ElementTree as ET

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz `dot` is not installed"
)

SVG, HTML, TEXT = "image/svg+xml", "text/html", "text/plain"


# --------------------------------------------------------------------------- reading HTML


class _TableReader(html.parser.HTMLParser):
    """Collects every ``<table>`` as rows of (tag, text, style) cells; counts stray tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: list[list[list[tuple[str, str, str]]]] = []
        self.sections: list[str] = []
        self.open: list[str] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.open.append(tag)
        if tag == "table":
            self.tables.append([])
        elif tag in ("thead", "tbody"):
            self.sections.append(tag)
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("th", "td"):
            self.cell = []
            self.style = dict(attrs).get("style", "")

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open}"
        self.open.pop()
        if tag in ("th", "td"):
            self.tables[-1][-1].append((tag, "".join(self.cell), self.style))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def read_table(markup: str) -> list[list[tuple[str, str, str]]]:
    """The one table in `markup`, checked: header row of ``th``, then rows of ``td``."""
    reader = _TableReader()
    reader.feed(markup)
    reader.close()
    assert not reader.open, f"unclosed tags: {reader.open}"
    assert len(reader.tables) == 1 and reader.sections == ["thead", "tbody"]
    (rows,) = reader.tables
    assert {tag for tag, _, _ in rows[0]} == {"th"}
    assert all({tag for tag, _, _ in row} == {"td"} for row in rows[1:])
    return rows


def cells(rows: list[list[tuple[str, str, str]]]) -> list[list[str]]:
    return [[text for _, text, _ in row] for row in rows]


def aligned_right(rows: list[list[tuple[str, str, str]]], column: int) -> bool:
    styles = {re.sub(r"\s", "", row[column][2]) for row in rows}
    assert len(styles) == 1, styles  # header and body agree
    return styles == {"text-align:right"}


def read_text_table(text: str) -> list[list[str]]:
    """A printed table's cells, cut at the columns its ``---`` rule marks."""
    lines = text.splitlines()
    spans = [m.span() for m in re.finditer(r"-+", lines[1])]
    starts = [a for a, _ in spans] + [None]
    return [
        [line[a:b].strip() for a, b in zip(starts, starts[1:], strict=False)]
        for line in [lines[0], *lines[2:]]
    ]


def svg_titles(svg: str) -> set[str]:
    """The titles of an SVG drawing's nodes and clusters (edges have ``->`` in theirs)."""
    root = ET.fromstring(svg.encode())
    assert root.tag in ("svg", "{http://www.w3.org/2000/svg}svg")
    titles = {t.text for t in root.iter() if t.tag.endswith("title")}
    return {t.removeprefix("cluster_") for t in titles if t and "->" not in t}


# --------------------------------------------------------------------------- models


def _encode(params, x):
    return jnp.tanh(x @ params["w"])


def _head(params, x):
    return x @ params["v"]


ODD = "enc<1>&co"  # a boundary name that HTML must escape
encode = js.mark(ODD, _encode)
head = js.mark("head", _head)


def odd_fn(params, x):
    return head(params, encode(params, x) + 1.0)


@pytest.fixture(scope="module")
def odd():
    params = {"w": jnp.full((3, 4), 0.5), "v": jnp.ones((4, 2))}
    return odd_fn, params, jnp.ones((5, 3))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(6, name="fc1")(x))
        x = nn.relu(nn.Dense(5, name="fc2")(x))
        return nn.Dense(3, name="out")(x)


@pytest.fixture(scope="module")
def mlp():
    model = Mlp()
    x = jax.random.normal(jax.random.key(0), (16, 4))
    return model, model.init(jax.random.key(1), x), x


# --------------------------------------------------------------------------- tables


def test_boundary_table_html_has_the_text_tables_rows_and_the_boundary_fields(odd):
    table = js.boundaries(*odd)
    rows = read_table(table._repr_html_())
    assert cells(rows) == read_text_table(str(table))  # same rows, same cells
    assert cells(rows)[0] == ["name", "type", "call", "inputs", "outputs", "params"]
    assert len(rows) == len(table) + 1
    for b, (name, kind, call, ins, outs, params) in zip(table, cells(rows)[1:], strict=True):
        assert name == b.name and kind == b.module_type
        assert call == f"{b.call_index}/{b.num_calls}"
        for cell, avals in [(ins, b.inputs), (outs, b.outputs)]:
            assert cell == ", ".join(f"{a.dtype}[{', '.join(map(str, a.shape))}]" for a in avals)
        assert int(params.replace(",", "")) == b.param_count
    # The model's own sizes: w is 3x4, v is 4x2.
    assert [(r[0], r[5]) for r in cells(rows)[1:]] == [(ODD, "12"), ("head", "8")]
    assert aligned_right(rows, 5) and not aligned_right(rows, 0)


def test_html_escapes_names(odd):
    markup = js.boundaries(*odd)._repr_html_()
    assert "enc&lt;1&gt;&amp;co" in markup and ODD not in markup


def test_text_tables_are_unchanged(odd, mlp):
    table = js.boundaries(*odd)
    assert str(table).splitlines() == [
        "name       type     call  inputs         outputs        params",
        "---------  -------  ----  -------------  -------------  ------",
        "enc<1>&co  _encode  0/1   float32[5, 3]  float32[5, 4]  12",
        "head       _head    0/1   float32[5, 4]  float32[5, 2]  8",
    ]
    assert repr(table) == repr(list(table))  # still a list
    t = js.coverage.Tracker(*mlp, criteria=[js.coverage.NC(0.0)])
    t.update(mlp[2])
    r = t.result()
    assert repr(r) == repr(dict(r))


def test_coverage_result_html_shows_the_result_dicts_numbers(mlp):
    model, variables, x = mlp
    criteria = [js.coverage.NC(0.25), js.coverage.KMNC(3), js.coverage.TKNC(1)]
    t = js.coverage.Tracker(model, variables, x, criteria=criteria)
    t.profile([x])
    t.update(0.5 * x[:4])
    r = t.result()
    rows = read_table(r._repr_html_())
    assert cells(rows) == read_text_table(str(r))
    expected = []
    for crit, res in r.items():
        expected.append((crit, "(total)", res["total"]))
        expected += [("", layer, value) for layer, value in res["layers"].items()]
    got = cells(rows)[1:]
    assert [tuple(row[:2]) for row in got] == [e[:2] for e in expected]
    for row, (_, _, value) in zip(got, expected, strict=True):
        assert float(row[2]) == pytest.approx(value, abs=5e-5)
    assert set(r) == {"NC", "KMNC", "TKNC"} and set(r["NC"]["layers"]) == {"fc1", "fc2", "out"}
    assert aligned_right(rows, 2) and not aligned_right(rows, 1)


def _close(cell: str, value: float) -> bool:
    return float(cell) == pytest.approx(value, rel=1e-3, abs=1e-6)


def test_activation_stats_html_shows_the_result_dicts_numbers(mlp):
    stats = js.ActivationStats(*mlp, position="activation")
    stats.update(mlp[2])
    r = stats.result()
    rows = read_table(r._repr_html_())
    assert cells(rows) == read_text_table(str(r))
    header, *body = cells(rows)
    assert header == ["name", "mean", "std", "min", "max", "zero fraction", "count"]
    assert [row[0] for row in body] == list(r) == ["fc1", "fc2", "out"]
    keys = ["mean", "std", "min", "max", "zero_fraction"]
    for row in body:
        for cell, key in zip(row[1:6], keys, strict=True):
            assert _close(cell, r[row[0]][key]), (row[0], key, cell)
        assert int(row[6].replace(",", "")) == r[row[0]]["count"]
    assert r["fc1"]["zero_fraction"] > 0  # relu zeros: the column is not all 0
    assert all(aligned_right(rows, i) for i in range(1, 7))


def test_per_channel_stats_table_sums_channels_up_as_per_tensor_stats_do(mlp):
    per_tensor = js.ActivationStats(*mlp, position="activation")
    per_channel = js.ActivationStats(*mlp, position="activation", per="channel")
    for s in (per_tensor, per_channel):
        s.update(mlp[2])
        s.update(mlp[2][:5] * 2)
    whole, by_channel = per_tensor.result(), per_channel.result()
    header, *body = cells(read_table(by_channel._repr_html_()))
    assert header[-1] == "channels"
    keys = ["mean", "std", "min", "max", "zero_fraction"]
    for row in body:
        name = row[0]
        for cell, key in zip(row[1:6], keys, strict=True):
            assert _close(cell, whole[name][key]), (name, key, cell)
        assert int(row[6]) == by_channel[name]["count"] == 21
        assert int(row[7]) == np.size(by_channel[name]["mean"])
    assert [int(row[7]) for row in body] == [6, 5, 3]


def test_editor_boundaries_show_as_html(mlp):
    g = js.edit(*mlp).insert_after("fc1", jnp.tanh, name="squash<&>")
    rows = cells(read_table(g.boundaries()._repr_html_()))
    assert [r[0] for r in rows[1:]] == ["fc1", "squash<&>", "fc2", "out"]


# --------------------------------------------------------------------------- drawings


@needs_dot
def test_slice_shows_as_svg_with_its_text(odd):
    sub = js.slice(*odd, end="head")
    bundle = sub._repr_mimebundle_(include=None, exclude=None)
    assert set(bundle) == {SVG, TEXT}
    assert bundle[TEXT] == repr(sub)
    assert {ODD, "head", "<inputs>", "<output>"} <= svg_titles(bundle[SVG])


@needs_dot
def test_editor_shows_as_svg(mlp):
    g = js.edit(*mlp).insert_after("fc2", jnp.tanh, name="squash")
    bundle = g._repr_mimebundle_()
    assert {"fc1", "fc2", "squash", "out"} <= svg_titles(bundle[SVG])


@needs_dot
def test_nnx_slice_shows_as_svg():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Linear(3, 4, rngs=rngs)
            self.top = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.top(jax.nn.relu(self.stem(x)))

    sub = js.slice(Net(nnx.Rngs(0)), jnp.ones((2, 3)), start="top")
    bundle = sub._repr_mimebundle_()
    assert {"stem", "top"} <= svg_titles(bundle[SVG])
    assert bundle[TEXT] == repr(sub)


def test_include_and_exclude_are_honoured(odd):
    sub = js.slice(*odd, end="head")
    assert sub._repr_mimebundle_(include={TEXT}) == {TEXT: repr(sub)}
    assert sub._repr_mimebundle_(exclude={SVG, HTML}) == {TEXT: repr(sub)}


class Stack(nn.Module):
    """Three blocks of 40 layers: 123 module calls, too many to draw every one inline."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Block(name=f"block{i}")(x)
        return x


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(40):
            x = nn.Dense(2, name=f"d{i}")(x)
        return x


@needs_dot
def test_big_models_are_drawn_collapsed():
    model = Stack()
    x = jnp.ones((1, 2))
    sub = js.slice(model, model.init(jax.random.key(0), x), x, end="block1")
    titles = svg_titles(sub._repr_mimebundle_()[SVG])
    assert {"block0", "block1", "block2"} <= titles
    assert not any("/" in t for t in titles)  # the Dense calls fold into their blocks
    assert "block0/d0" in sub.to_dot()  # to_dot itself still draws every level


def _path_without_dot(tmp_path, monkeypatch, script: str | None = None) -> None:
    """PATH with no `dot`, or with a fake `dot` that runs `script`."""
    folder = tmp_path / "bin"
    folder.mkdir()
    if script is not None:
        fake = folder / "dot"
        fake.write_text("#!/bin/sh\n" + script + "\n")
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(folder))


def test_without_dot_the_bundle_is_text_and_a_note(odd, mlp, tmp_path, monkeypatch):
    sub = js.slice(*odd, end="head")
    g = js.edit(*mlp)
    _path_without_dot(tmp_path, monkeypatch)
    assert shutil.which("dot") is None
    for thing in (sub, g):
        bundle = thing._repr_mimebundle_()  # no exception
        assert set(bundle) == {TEXT, HTML}
        assert bundle[TEXT] == repr(thing)
        note = bundle[HTML]
        assert "apt-get install graphviz" in note and "dot" in note
        reader = _TableReader()
        reader.feed(note)
        assert not reader.open
    # The text inside the note is escaped: the Editor's repr has <...>.
    assert html.unescape(g._repr_mimebundle_()[HTML]).count(repr(g)) == 1
    assert "<jaxslice" not in g._repr_mimebundle_()[HTML]
    # Only text asked for: no note either.
    assert sub._repr_mimebundle_(include={TEXT}) == {TEXT: repr(sub)}


def test_a_failing_dot_gives_the_note_not_a_traceback(odd, tmp_path, monkeypatch):
    sub = js.slice(*odd, end="head")
    _path_without_dot(tmp_path, monkeypatch, script="echo 'syntax error in line 1' >&2; exit 3")
    assert os.path.basename(shutil.which("dot")) == "dot"
    bundle = sub._repr_mimebundle_()
    assert set(bundle) == {TEXT, HTML}
    assert "syntax error in line 1" in bundle[HTML]
