"""Annotations on drawings name boundaries the drawing may not show as nodes.

A coverage tracker over a scanned stack reports per iteration (``layers[0]/mlp``), and a
drawing at a shallow `depth` folds nested calls into their parent: each figure must
still appear, on the node or cluster that draws its call (or the innermost one around
it), and a key that names no boundary is refused with suggestions, never dropped. The
oracle is the tracker's own result (its per-layer figures), looked up in the labels of
the DOT source.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import flax.linen as nn
import jax
import networkx as nx
import pytest

import jaxslice as js
from jaxslice.render import to_dot

C = js.coverage


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(h.shape[-1], name="mlp")(h), None


class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(6, name="dense")
        return dense(nn.relu(dense(x)))


class Net(nn.Module):
    """embed -> shared (dense called twice) -> layers (a scan of 3) -> head."""

    @nn.compact
    def __call__(self, x):
        h = Shared(name="shared")(nn.Dense(6, name="embed")(x))
        scan = nn.scan(
            ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        h, _ = scan(name="layers")(h, None)
        return nn.Dense(3, name="head")(h)


LAYERS = ["embed", "shared/dense@0", "layers[:]/mlp", "head"]


@pytest.fixture(scope="module")
def traced():
    model = Net()
    x = jax.random.normal(jax.random.key(0), (16, 3))
    variables = model.init(jax.random.key(1), x)
    tracker = C.Tracker(model, variables, x, criteria=[C.NC(0.1)], layers=LAYERS)
    tracker.update(x)
    return js.slice(model, variables, x), tracker.result()


def labels(source: str) -> dict[str, str]:
    """``{node name: label}`` and ``{cluster_<name>: label}`` read from DOT source."""
    found = dict(re.findall(r'^\s*"([^"]+)" \[label="((?:[^"\\]|\\.)*)"', source, re.M))
    for name, label in re.findall(
        r'subgraph "(cluster_[^"]+)" \{\s*label="((?:[^"\\]|\\.)*)"', source
    ):
        found[name] = label
    return found


def drawn_at(key: str, depth: int | None) -> str:
    """Where a figure of `key` must show (by the model's code above)."""
    if key.startswith("layers["):
        return "layers"  # the scan: its body is not drawn
    if key.startswith("shared/") and depth == 1:
        return "shared"
    return key


@pytest.mark.parametrize("depth", [None, 1, 2])
def test_every_figure_of_a_tracker_shows_on_the_node_that_draws_its_layer(traced, depth):
    sub, result = traced
    figures = result["NC"]["layers"]
    assert {"layers[0]/mlp", "layers[1]/mlp", "layers[2]/mlp"} <= set(figures)
    found = labels(sub.to_dot(depth=depth, annotations=result.annotations()))
    for key, value in figures.items():
        at = drawn_at(key, depth)
        label = found[at]
        if at == key:
            assert f"NC {value:.2f}" in label, (key, label)
        elif key.startswith("layers["):
            k = re.search(r"\[(\d+)\]", key).group(1)
            assert "layers[:]/mlp: " in label and f"[{k}] NC {value:.2f}" in label, (key, label)
        else:
            assert f"{key}: NC {value:.2f}" in label, (key, label)


def test_iterations_of_one_call_share_one_line(traced):
    sub, result = traced
    label = labels(sub.to_dot(annotations=result.annotations()))["layers"]
    lines = [line for line in label.split("\\n") if line.startswith("layers[:]/mlp")]
    assert len(lines) == 1 and lines[0].count(" | ") == 2, label


def test_a_stacked_name_and_a_port_show_on_the_loop_node(traced):
    sub, _ = traced
    source = sub.to_dot(annotations={"layers[:]/mlp": "all", "layers[-1]/mlp:input": "in"})
    label = labels(source)["layers"]
    assert "layers[:]/mlp: [:] all" in label and "layers[:]/mlp:input: [2] in" in label


def test_a_figure_on_a_container_keeps_the_cluster_title(traced):
    sub, _ = traced
    found = labels(sub.to_dot(annotations={"shared": "NC 0.50"}))
    assert found["cluster_shared"].startswith("shared (Shared) NC 0.50")


@pytest.mark.parametrize(
    ("key", "hint"),
    [("haed", "'head'"), ("shared/dens@0", "'shared/dense@0'"), ("layers/mlp", "'layers[0]/mlp'")],
)
def test_a_key_that_names_no_boundary_is_refused_with_suggestions(traced, key, hint):
    sub, _ = traced
    with pytest.raises(js.UnknownBoundaryError) as info:
        sub.to_dot(annotations={"head": "NC 1.00", key: "NC 0.50"})
    assert repr(key) in str(info.value) and hint in str(info.value)


def test_iteration_out_of_range_and_ambiguous_names_are_refused(traced):
    sub, _ = traced
    with pytest.raises(js.SliceError, match="from 0 to 2"):
        sub.to_dot(annotations={"layers[3]/mlp": 1})
    with pytest.raises(js.AmbiguousBoundaryError):
        sub.to_dot(annotations={"shared/dense": 1})


def test_a_hand_built_graph_refuses_unknown_keys_too():
    dag = nx.DiGraph()
    dag.add_node("fc", module_type="Dense", params=12)
    dag.add_edge("fc", "<output>", shapes=["float32[2, 3]"])
    assert '"fc\\nDense (12 params)\\n0.25"' in to_dot(dag, annotations={"fc": 0.25})
    with pytest.raises(js.UnknownBoundaryError, match="Did you mean 'fc'"):
        to_dot(dag, annotations={"fcc": 0.25})


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_labels_with_inner_calls_are_valid_dot(traced):
    sub, result = traced
    for depth in (None, 1):
        source = sub.to_dot(depth=depth, annotations=result.annotations())
        done = subprocess.run(["dot", "-Tsvg"], input=source, capture_output=True, text=True)
        assert done.returncode == 0 and not done.stderr, done.stderr
        assert "layers[:]/mlp" in done.stdout
