"""notebooks/tier_analysis.ipynb runs top to bottom on a CPU-only machine, from a clean kernel, and its committed
outputs are what a fresh run prints: every cell but the measured ones (tag "measured")."""

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FAST_COMPILE_XLA_FLAGS, script_module

nbformat = pytest.importorskip("nbformat", reason="needs the [notebook] extra (nbformat, nbclient, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="needs the [notebook] extra (nbformat, nbclient, ipykernel)")

SCRIPT = Path(__file__).parent.parent / "scripts" / "execute_notebook.py"
# The longest line a committed output may print: a table row, not a line of tiers changing back and forth.
MAX_OUTPUT_LINE = 160


SCRIPT_MODULE = script_module(SCRIPT)  # how the notebook is run and compared
NOTEBOOK = SCRIPT_MODULE.NOTEBOOK


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


def test_the_cells_that_time_tiers_are_tagged_measured():
    """Their outputs change from run to run: the comparison with a fresh run leaves exactly them out."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    timing = [index for index, cell in enumerate(notebook.cells) if "measure_tiers" in cell.source
              or "sweep_png" in cell.source]
    tagged = [index for index, cell in enumerate(notebook.cells)
              if SCRIPT_MODULE.MEASURED in cell.metadata.get("tags", [])]
    assert timing and tagged == timing


def test_a_fresh_run_fails_nowhere_and_prints_the_committed_outputs(tmp_path, monkeypatch):
    """One run from a clean kernel, checked for both (one test, not two sharing a fixture: pytest-xdist would run
    that fixture once per worker). The kernel is a fresh process: it must not inherit a forced device count from
    XLA_FLAGS. It runs the cells for their answers, not their timings, so it compiles fast (flags that change no
    output compared here)."""
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE_XLA_FLAGS)
    fresh = SCRIPT_MODULE.execute(NOTEBOOK, tmp_path)
    errors = [output for cell in fresh.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
    assert not list(tmp_path.iterdir())  # its figures are shown, not written: a run leaves no file behind
    stale = stale_cells(nbformat.read(NOTEBOOK, as_version=4), fresh)
    assert not stale, ("the notebook's committed outputs are stale; re-run it with `.venv/bin/python "
                       "scripts/execute_notebook.py` and commit the result:\n" + "\n\n".join(stale))


def stale_cells(committed, fresh) -> list[str]:
    """Each cell not tagged measured whose printed and displayed text and markdown (not images) differ between
    ``committed`` and ``fresh``, named by its index and first line, with the difference."""
    stale = []
    for index, (old, new) in enumerate(zip(committed.cells, fresh.cells, strict=True)):
        if old.cell_type != "code" or SCRIPT_MODULE.MEASURED in old.metadata.get("tags", []):
            continue
        was, now = (SCRIPT_MODULE.compared_outputs(cell) for cell in (old, new))
        if was != now:
            diff = difflib.unified_diff("\n".join(was).splitlines(), "\n".join(now).splitlines(), "committed",
                                        "fresh run", lineterm="", n=1)
            stale.append(f"cell {index} ({old.source.splitlines()[0]!r}):\n" + "\n".join(diff))
    return stale


@pytest.mark.parametrize(("arguments", "status"), [(["--help"], 0), (["--bogus"], 2)])
def test_the_regenerating_script_runs_nothing_for_help_or_a_bad_flag(arguments, status):
    before = NOTEBOOK.read_bytes()
    result = subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=60)
    assert result.returncode == status and "usage: execute_notebook.py" in result.stdout + result.stderr
    assert NOTEBOOK.read_bytes() == before
