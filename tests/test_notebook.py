"""notebooks/tier_analysis.ipynb runs top to bottom on a CPU-only machine, from a clean kernel."""

import re
from pathlib import Path

import pytest

from helpers import FAST_COMPILE_XLA_FLAGS

nbformat = pytest.importorskip("nbformat", reason="needs the [notebook] extra (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="needs the [notebook] extra (nbformat, nbclient, ipykernel)")

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "tier_analysis.ipynb"
# The longest line a committed output may print: a table row, not a line of tiers changing back and forth.
MAX_OUTPUT_LINE = 160


def test_notebook_is_committed_with_outputs():
    # A reader sees every table and figure without running it: each code cell ran (top to bottom in one
    # clean kernel: counts 1..n) and printed or drew something, none failed, and the figures are embedded PNGs.
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1))
    assert all(cell.outputs for cell in code)
    outputs = [output for cell in code for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("image/png" in output.get("data", {}) for output in outputs)
    printed = [line for output in outputs if output.output_type == "stream" for line in output.text.splitlines()]
    assert max(map(len, printed)) <= MAX_OUTPUT_LINE


def test_the_crossovers_are_a_table_of_t_ranges():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [cell for cell in notebook.cells if "def fastest_ranges" in cell.source]
    (table,) = [output.data["text/markdown"] for output in cell.outputs if "text/markdown" in output.get("data", {})]
    header, rule, *rows = table.splitlines()
    assert header.startswith("| preset | kernel | T | fastest") and rows
    assert all(re.fullmatch(r"\| \w+ \| \w+ \| \d+-\d+ \| [\w ~]+ \| \d* \|", row) for row in rows)


def test_notebook_executes_without_errors(tmp_path, monkeypatch):
    # The kernel is a fresh process: it must not inherit a forced device count from XLA_FLAGS. It runs
    # every cell for errors, not timings, so it compiles fast.
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE_XLA_FLAGS)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if output.output_type == "error"]
    assert not errors
    assert not list(tmp_path.iterdir())  # its figures are shown, not written: a run leaves no file behind
