"""Seeing a model: `to_networkx`, `to_dot` and `render` on slices and edited models.

The DOT source is checked with Graphviz itself: ``dot -Tjson0`` parses it (clusters,
node attributes, edge labels) and ``dot -Tsvg`` renders it; with ``pydot`` installed,
networkx's pydot reader must parse it too. The expected graphs are written down by
hand from the models' code.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxslice as js

from helpers.models import RESNET_NAMES
from helpers.oracles import leaf_paths, make_zoo, random_input

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz `dot` is not installed"
)

BLUE, GREY = "#dbe9ff", "#f2f2f2"


# --------------------------------------------------------------------------- a model with a skip


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6, name="fc2")(nn.relu(nn.Dense(7, name="fc1")(x)))


class SkipNet(nn.Module):
    """a -> b (a container) -> c, with a's output also skipping to c and to head."""

    @nn.compact
    def __call__(self, x):
        a = nn.Dense(6, name="a")(x)
        b = Block(name="b")(nn.relu(a))
        c = nn.Dense(4, name="c")(b + a)
        return nn.Dense(3, name="head")(jnp.concatenate([jnp.tanh(c), a], axis=-1))


# Every edge of SkipNet's module DAG with the shape of the value entering its target.
SKIP_EDGES = {
    ("<inputs>", "a"): ["float32[2,5]"],
    ("a", "b/fc1"): ["float32[2,6]"],
    ("b/fc1", "b/fc2"): ["float32[2,7]"],
    ("b/fc2", "c"): ["float32[2,6]"],
    ("a", "c"): ["float32[2,6]"],  # the skip around b
    ("c", "head"): ["float32[2,10]"],  # head reads concat([tanh(c), a])
    ("a", "head"): ["float32[2,10]"],
    ("head", "<output>"): ["float32[2,3]"],
}
SKIP_EDGES_DEPTH1 = {
    ("<inputs>", "a"): ["float32[2,5]"],
    ("a", "b"): ["float32[2,6]"],
    ("b", "c"): ["float32[2,6]"],
    ("a", "c"): ["float32[2,6]"],
    ("c", "head"): ["float32[2,10]"],
    ("a", "head"): ["float32[2,10]"],
    ("head", "<output>"): ["float32[2,3]"],
}


@pytest.fixture(scope="module")
def skip():
    return make_zoo(SkipNet(), random_input(30, (2, 5)), seed=30)


def shapes_of(dag: Any) -> dict[tuple[str, str], list[str]]:
    """Edge shape labels without spaces: ``float32[2, 5]`` and ``float32[2,5]`` are equal."""
    return {e: [nospace(t) for t in dag.edges[e]["shapes"]] for e in dag.edges}


def nospace(text: str) -> str:
    return text.replace(" ", "")


def param_count(variables: Any, module: str) -> int:
    """Values of the ``params`` collection under a module path."""
    parts = tuple(module.split("/"))
    return sum(
        int(np.size(leaf))
        for path, leaf in leaf_paths(variables).items()
        if path[0] == "params" and path[1:][: len(parts)] == parts
    )


# --------------------------------------------------------------------------- DOT through Graphviz


def run_dot(source: str, fmt: str) -> str:
    done = subprocess.run(
        ["dot", f"-T{fmt}"], input=source, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"dot -T{fmt} failed: {done.stderr}\n{source}"
    assert "Warning" not in done.stderr and "Error" not in done.stderr, done.stderr
    return done.stdout


def parse_dot(source: str) -> dict[str, Any]:
    """Graphviz's own reading of the DOT source.

    Returns ``nodes`` {name: attributes}, ``clusters`` {cluster name: {"label", "nodes"
    (direct members), "subgraphs"}}, ``edges`` {(tail, head): label}.
    """
    data = json.loads(run_dot(source, "json0"))
    objects = data.get("objects", [])
    n_sub = data.get("_subgraph_cnt", 0)
    name_of = {o["_gvid"]: o["name"] for o in objects}
    nodes = {o["name"]: o for o in objects[n_sub:]}
    clusters = {}
    for o in objects[:n_sub]:
        nested = {n for s in o.get("subgraphs", []) for n in objects[s].get("nodes", [])}
        clusters[o["name"]] = {
            "label": o.get("label", ""),
            "nodes": {name_of[n] for n in o.get("nodes", []) if n not in nested},
            "subgraphs": {name_of[s] for s in o.get("subgraphs", [])},
        }
    edges = {
        (name_of[e["tail"]], name_of[e["head"]]): e.get("label", "") for e in data.get("edges", [])
    }
    return {"nodes": nodes, "clusters": clusters, "edges": edges}


def svg_titles(svg: str) -> set[str]:
    return {html.unescape(t) for t in re.findall(r"<title>(.*?)</title>", svg)}


# --------------------------------------------------------------------------- to_networkx


def test_edges_follow_the_dataflow_of_a_skip_connection(skip):
    sub = js.slice(skip.model, skip.variables, skip.x)
    dag = sub.to_networkx()
    assert set(dag.nodes) == {"<inputs>", "<output>", "a", "b/fc1", "b/fc2", "c", "head"}
    assert shapes_of(dag) == SKIP_EDGES
    assert set(dag.graph["containers"]) == {"b"}
    assert dag.nodes["b/fc1"]["parent"] == "b" and dag.nodes["c"]["parent"] is None

    shallow = sub.to_networkx(depth=1)
    assert set(shallow.nodes) == {"<inputs>", "<output>", "a", "b", "c", "head"}
    assert shapes_of(shallow) == SKIP_EDGES_DEPTH1
    assert not shallow.graph.get("containers")
    assert shallow.nodes["b"]["module_type"] == "Block"


def test_node_attributes(skip):
    dag = js.slice(skip.model, skip.variables, skip.x).to_networkx()
    expected = {
        "a": ("Dense", "float32[2,5]", "float32[2,6]"),
        "b/fc1": ("Dense", "float32[2,6]", "float32[2,7]"),
        "b/fc2": ("Dense", "float32[2,7]", "float32[2,6]"),
        "c": ("Dense", "float32[2,6]", "float32[2,4]"),
        "head": ("Dense", "float32[2,10]", "float32[2,3]"),
    }
    for name, (module_type, inputs, outputs) in expected.items():
        attrs = dag.nodes[name]
        assert attrs["label"] == name
        assert attrs["module_type"] == module_type
        assert nospace(attrs["inputs"]) == inputs and nospace(attrs["outputs"]) == outputs
        assert attrs["in_slice"] is True


def test_node_params_are_the_parameter_counts_of_the_variables(skip, resnet):
    dag = js.slice(skip.model, skip.variables, skip.x).to_networkx()
    for name in ["a", "b/fc1", "b/fc2", "c", "head"]:
        assert dag.nodes[name]["params"] == param_count(skip.variables, name), name
    assert dag.nodes["a"]["params"] == 5 * 6 + 6
    assert (
        dag.graph["containers"]["b"]["params"]
        == param_count(skip.variables, "b")
        == 6 * 7 + 7 + 7 * 6 + 6
    )
    assert (
        js.slice(skip.model, skip.variables, skip.x).to_networkx(depth=1).nodes["b"]["params"] == 97
    )

    # BatchNorm's running statistics are not parameters (as in js.boundaries).
    dag = js.slice(resnet.model, resnet.variables, resnet.x).to_networkx()
    containers = dag.graph["containers"]
    for name in RESNET_NAMES:
        attrs = containers[name] if name in containers else dag.nodes[name]
        assert attrs["params"] == param_count(resnet.variables, name), name
    assert dag.nodes["stage1/bn1"]["params"] == 2 * 4


def test_edited_graph_node_params_are_the_parameter_counts_of_the_variables(resnet):
    g = js.edit(resnet.model, resnet.variables, resnet.x).insert_after(
        "stage1", nn.Dense(4), key=jax.random.key(0), name="adapter"
    )
    dag = g.to_networkx()
    assert dag.nodes["adapter"]["params"] == 4 * 4 + 4
    for name in RESNET_NAMES:
        if name not in dag.graph["containers"]:
            assert dag.nodes[name]["params"] == param_count(resnet.variables, name), name


def test_plain_function_graph():
    layer1 = js.mark("layer1", lambda p, x: jnp.tanh(x @ p["w"]))
    layer2 = js.mark("layer2", lambda p, x: x @ p["w"])

    def model(params, x):
        h = layer1(params["l1"], x)
        return layer2(params["l2"], h) + h

    params = {"l1": {"w": jnp.ones((3, 4))}, "l2": {"w": jnp.ones((4, 4))}}
    dag = js.slice(model, params, jnp.ones((2, 3))).to_networkx()
    assert set(dag.edges) == {
        ("<inputs>", "layer1"),
        ("layer1", "layer2"),
        ("layer1", "<output>"),
        ("layer2", "<output>"),
    }
    assert dag.nodes["layer1"]["params"] == 12 and dag.nodes["layer2"]["params"] == 16


# --------------------------------------------------------------------------- DOT


def test_dot_parses_with_networkx_pydot_reader(resnet, tmp_path):
    pytest.importorskip("pydot")
    import networkx as nx

    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage2")
    path = tmp_path / "graph.dot"
    path.write_text(sub.to_dot())
    graph = nx.nx_pydot.read_dot(str(path))
    names = {str(n).strip('"') for n in graph.nodes}
    dag = sub.to_networkx()
    assert set(dag.nodes) <= names
    assert {(str(a).strip('"'), str(b).strip('"')) for a, b, *_ in graph.edges} == set(dag.edges)


@needs_dot
def test_dot_renders_to_svg_mentioning_every_node(resnet, skip):
    for sub in (
        js.slice(resnet.model, resnet.variables, resnet.x, start="stage1", end="stage2"),
        js.slice(skip.model, skip.variables, skip.x),
    ):
        source = sub.to_dot()
        svg = run_dot(source, "svg")
        assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
        dag = sub.to_networkx()
        assert set(dag.nodes) <= svg_titles(svg)
        for container in dag.graph.get("containers", {}):
            assert f"cluster_{container}" in svg_titles(svg)
        # Edges carry shape labels.
        parsed = parse_dot(source)
        assert {e: parsed["edges"][e] for e in dag.edges} == {
            e: ", ".join(dag.edges[e]["shapes"]) for e in dag.edges
        }


@needs_dot
def test_one_cluster_per_container(resnet, skip):
    source = js.slice(resnet.model, resnet.variables, resnet.x).to_dot()
    assert (
        source.count('subgraph "cluster_stage1"') == 1
        and source.count('subgraph "cluster_stage2"') == 1
    )
    parsed = parse_dot(source)
    assert set(parsed["clusters"]) == {"cluster_stage1", "cluster_stage2"}
    assert parsed["clusters"]["cluster_stage1"]["nodes"] == {
        "stage1/conv1",
        "stage1/bn1",
        "stage1/conv2",
        "stage1/bn2",
    }
    assert parsed["clusters"]["cluster_stage2"]["nodes"] == {
        "stage2/conv1",
        "stage2/bn1",
        "stage2/conv2",
        "stage2/bn2",
        "stage2/proj",
    }
    assert "stage1" in parsed["clusters"]["cluster_stage1"]["label"]
    assert "ResBlock" in parsed["clusters"]["cluster_stage1"]["label"]
    assert set(parsed["nodes"]) == {"<inputs>", "<output>", "stem", "head"} | {
        n for n in RESNET_NAMES if "/" in n
    }

    parsed = parse_dot(js.slice(skip.model, skip.variables, skip.x).to_dot())
    assert set(parsed["clusters"]) == {"cluster_b"}
    assert parsed["clusters"]["cluster_b"]["nodes"] == {"b/fc1", "b/fc2"}


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="fc")(x)


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(Inner(name="inner")(x))


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(Outer(name="outer")(x))


@needs_dot
def test_nested_containers_are_nested_clusters_and_collapse_by_depth():
    model, x = Nested(), random_input(31, (2, 3))
    variables = make_zoo(model, x, seed=31).variables
    sub = js.slice(model, variables, x)
    parsed = parse_dot(sub.to_dot())
    assert set(parsed["clusters"]) == {"cluster_outer", "cluster_outer/inner"}
    assert parsed["clusters"]["cluster_outer"]["subgraphs"] == {"cluster_outer/inner"}
    assert parsed["clusters"]["cluster_outer"]["nodes"] == {"outer/out"}
    assert parsed["clusters"]["cluster_outer/inner"]["nodes"] == {"outer/inner/fc"}

    parsed = parse_dot(sub.to_dot(depth=2))
    assert set(parsed["clusters"]) == {"cluster_outer"}
    assert parsed["clusters"]["cluster_outer"]["nodes"] == {"outer/inner", "outer/out"}

    parsed = parse_dot(sub.to_dot(depth=1))
    assert parsed["clusters"] == {}
    assert set(parsed["nodes"]) == {"<inputs>", "<output>", "outer", "head"}
    assert set(parsed["edges"]) == {("<inputs>", "outer"), ("outer", "head"), ("head", "<output>")}


def test_depth_one_shows_only_top_level_modules(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x)
    dag = sub.to_networkx(depth=1)
    assert set(dag.nodes) == {"<inputs>", "<output>", "stem", "stage1", "stage2", "head"}
    assert set(dag.edges) == {
        ("<inputs>", "stem"),
        ("stem", "stage1"),
        ("stage1", "stage2"),
        ("stage2", "head"),
        ("head", "<output>"),
    }
    assert shapes_of(dag)["stage1", "stage2"] == ["float32[2,8,8,4]"]
    source = sub.to_dot(depth=1)
    assert "subgraph" not in source and "cluster_" not in source
    assert "stage1/conv1" not in source
    assert set(sub.to_networkx(depth=2).nodes) == set(sub.to_networkx().nodes)


@needs_dot
def test_slice_region_is_highlighted(resnet):
    sub = js.slice(resnet.model, resnet.variables, resnet.x, start="stage2", end="stage2")
    dag = sub.to_networkx()
    inside = {n for n in RESNET_NAMES if n.startswith("stage2/")}
    outside = {"stem", "head"} | {n for n in RESNET_NAMES if n.startswith("stage1/")}
    for name in inside:
        assert dag.nodes[name]["in_slice"] is True, name
    for name in outside:
        assert dag.nodes[name]["in_slice"] is False, name
    assert dag.graph["containers"]["stage2"]["in_slice"] is True
    assert dag.graph["containers"]["stage1"]["in_slice"] is False

    parsed = parse_dot(sub.to_dot())
    for name in inside:
        assert parsed["nodes"][name]["fillcolor"] == BLUE, name
    for name in outside:
        assert parsed["nodes"][name]["fillcolor"] == GREY, name

    # The whole model is one slice: everything blue.
    parsed = parse_dot(js.slice(resnet.model, resnet.variables, resnet.x).to_dot())
    for name in inside | outside:
        assert parsed["nodes"][name]["fillcolor"] == BLUE, name


@needs_dot
def test_annotations_show_up(skip):
    sub = js.slice(skip.model, skip.variables, skip.x)
    source = sub.to_dot(annotations={"c": 0.8333333, "b/fc1": 12, "b": "NC 50%"})
    parsed = parse_dot(source)
    assert "0.833" in parsed["nodes"]["c"]["label"]
    assert "12" in parsed["nodes"]["b/fc1"]["label"].split("\\n")[-1]
    assert "NC 50%" in parsed["clusters"]["cluster_b"]["label"]
    assert "0.833" not in parsed["nodes"]["a"]["label"]
    svg = run_dot(source, "svg")
    assert "0.833" in svg and "NC 50%" in svg


@needs_dot
def test_annotations_with_quotes_and_backslashes_give_valid_dot(skip):
    sub = js.slice(skip.model, skip.variables, skip.x)
    note = 'max "hot" 3\\4'
    source = sub.to_dot(annotations={"c": note, "b": note})
    parsed = parse_dot(source)  # asserts dot accepts it without errors
    assert set(parsed["nodes"]) == set(sub.to_networkx().nodes)
    svg = run_dot(source, "svg")
    assert html.escape(note, quote=False) in svg or html.escape(note) in svg


# --------------------------------------------------------------------------- render


@needs_dot
def test_render_writes_svg_and_png(skip, tmp_path):
    sub = js.slice(skip.model, skip.variables, skip.x, end="c")
    path = tmp_path / "graph.svg"
    assert sub.render(path) == str(path)
    svg = path.read_text()
    assert "</svg>" in svg and {"a", "b/fc1", "b/fc2", "c", "head"} <= svg_titles(svg)
    png = tmp_path / "graph.png"
    sub.render(str(png), depth=1, annotations={"c": 0.5})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_without_dot_is_a_clear_error(skip, tmp_path, monkeypatch):
    sub = js.slice(skip.model, skip.variables, skip.x)
    g = js.edit(skip.model, skip.variables, skip.x).insert_after("c", jnp.tanh, name="squash")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("dot") is None
    for thing in (sub, g):
        path = tmp_path / "graph.svg"
        with pytest.raises(js.SliceError) as info:
            thing.render(path)
        message = str(info.value)
        assert "dot" in message and "graphviz" in message.lower()
        assert "apt-get install graphviz" in message or "brew install graphviz" in message
        assert not os.path.exists(path)
    assert "digraph" in sub.to_dot() and "squash" in g.to_dot()  # the source needs no dot


# --------------------------------------------------------------------------- edited models


@needs_dot
def test_edited_graph_highlights_the_edited_nodes(skip, tmp_path):
    g = js.edit(skip.model, skip.variables, skip.x)
    g.insert_after("a", nn.Dense(6), key=jax.random.key(0), name="adapter")
    g.replace("c", lambda h: jnp.tanh(h[:, :4]))
    dag = g.to_networkx()
    assert ("a", "adapter") in dag.edges
    assert {("adapter", "b/fc1"), ("adapter", "c"), ("adapter", "head")} <= set(dag.edges)
    assert ("a", "b/fc1") not in dag.edges
    assert dag.nodes["adapter"]["in_slice"] and dag.nodes["c"]["in_slice"]
    assert dag.nodes["adapter"]["params"] == 6 * 6 + 6
    for name in ["a", "b/fc1", "b/fc2", "head"]:
        assert not dag.nodes[name]["in_slice"], name
    parsed = parse_dot(g.to_dot(annotations={"adapter": "new"}))
    assert (
        parsed["nodes"]["adapter"]["fillcolor"] == BLUE
        and parsed["nodes"]["c"]["fillcolor"] == BLUE
    )
    assert (
        parsed["nodes"]["a"]["fillcolor"] == GREY and parsed["nodes"]["head"]["fillcolor"] == GREY
    )
    assert "new" in parsed["nodes"]["adapter"]["label"]
    path = g.render(tmp_path / "edited.svg")
    assert {"a", "adapter", "c", "head"} <= svg_titles(Path(path).read_text())
    # A slice of the edited model renders like any slice.
    sub = g.slice(start="adapter", end="head")
    assert sub.to_networkx().nodes["adapter"]["in_slice"] is True
    assert sub.to_networkx().nodes["a"]["in_slice"] is False
    run_dot(sub.to_dot(), "svg")


# --------------------------------------------------------------------------- NNX


def test_nnx_sliced_module_renders():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Linear(3, 4, rngs=rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.stem(x)))

    model = Net(nnx.Rngs(0))
    sub = js.slice(model, jnp.ones((2, 3)), start="head")
    assert isinstance(sub, js.SlicedModule)
    dag = sub.to_networkx()
    assert dag.nodes["stem"]["in_slice"] is False and dag.nodes["head"]["in_slice"] is True
    assert dag.nodes["head"]["params"] == 4 * 2 + 2
    assert ("stem", "head") in dag.edges
    source = sub.to_dot()
    assert '"head"' in source and BLUE in source
    if shutil.which("dot"):
        parsed = parse_dot(source)
        assert (
            parsed["nodes"]["stem"]["fillcolor"] == GREY
            and parsed["nodes"]["head"]["fillcolor"] == BLUE
        )
