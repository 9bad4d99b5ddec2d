"""The tour notebook, examples/tour.ipynb: executed from a temporary copy, its outputs
must hold an HTML table and (with Graphviz's `dot`) an SVG drawing; the copy saved in the
repository must carry its outputs, so that it renders on GitHub.

Executing needs the `notebook` extra (nbclient, nbformat, ipykernel) and skips without
it. The kernel is the interpreter running the tests, through a kernel spec written to a
temporary `JUPYTER_PATH`, so a `python3` kernel installed elsewhere is never picked up.
"""

from __future__ import annotations

import json
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "tour.ipynb"
HTML, SVG = "text/html", "image/svg+xml"
KERNEL = "jaxslice-tour-python3"


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def _outputs(nb: dict, mime: str) -> list[str]:
    """Every `mime` payload among the code cells' display and result outputs."""
    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") in ("display_data", "execute_result") and mime in out.get(
                "data", {}
            ):
                found.append(_text(out["data"][mime]))
    return found


def _errors(nb: dict) -> list[str]:
    return [
        f"{out['ename']}: {out['evalue']}"
        for cell in nb["cells"]
        if cell["cell_type"] == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]


def _check_tables(nb: dict) -> None:
    tables = [h for h in _outputs(nb, HTML) if "<table" in h]
    assert tables, "no text/html output with a <table>"


def _check_svg(nb: dict) -> None:
    drawings = _outputs(nb, SVG)
    assert drawings, "no image/svg+xml output"
    for svg in drawings:
        root = ET.fromstring(svg.encode())
        assert root.tag in ("svg", "{http://www.w3.org/2000/svg}svg")


def test_saved_notebook_carries_its_outputs():
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    assert not _errors(nb)
    _check_tables(nb)
    # Every code cell was run, in order, from a fresh kernel.
    counts = [c.get("execution_count") for c in nb["cells"] if c["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1))
    if _outputs(nb, SVG):
        _check_svg(nb)


# jupyter_core warns about its coming move to platformdirs while the kernel manager looks
# up paths; that is about Jupyter's own configuration, not about this project.
@pytest.mark.filterwarnings("ignore:Jupyter is migrating its paths:DeprecationWarning")
def test_tour_notebook_executes_and_shows_tables_and_drawings(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (tests)",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    saved = NOTEBOOK.read_bytes()
    work = tmp_path / "run"
    work.mkdir()
    copy = work / "tour.ipynb"
    shutil.copyfile(NOTEBOOK, copy)

    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(work)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    nbformat.write(nb, copy)

    executed = json.loads(copy.read_text(encoding="utf-8"))
    assert not _errors(executed)
    _check_tables(executed)
    if shutil.which("dot") is not None:
        _check_svg(executed)
    assert NOTEBOOK.read_bytes() == saved  # the repository's copy is left as it was
