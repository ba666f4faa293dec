"""Run notebooks/tier_analysis.ipynb from a clean kernel and write it back with its fresh outputs.

    python scripts/execute_notebook.py

The kernel starts without XLA_FLAGS (the notebook makes its own 8 CPU devices; a forced device count from
the shell must not leak in) in a scratch directory, so a run leaves no file behind. tests/test_notebook.py runs
it the same way (with flags that compile faster and change no output) and compares every cell not tagged
"measured" with the committed outputs: after changing what the library answers, run this and commit the result.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import nbclient
import nbformat

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "tier_analysis.ipynb"
# The tag of the cells that time the tiers on this machine: their outputs change from run to run.
MEASURED = "measured"


def execute(path: Path, directory: Path) -> nbformat.NotebookNode:
    """The notebook at ``path`` run top to bottom in a fresh kernel whose working directory is ``directory``;
    the kernel inherits this process's environment."""
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(directory)}})
    client.execute()
    return notebook


def compared_outputs(cell: nbformat.NotebookNode) -> list[str]:
    """What of a cell's outputs must not change between runs: its printed text (consecutive stream outputs
    joined: where a kernel splits a stream is its timing's choice) and the markdown or plain text of what it
    displays; images apart (their bytes vary with the plotting library)."""
    texts: list[str] = []
    stream = None  # the name of the stream the last output printed to, None after any other output
    for output in cell.get("outputs", []):
        if output.output_type == "stream" and output.name == stream:
            texts[-1] += output.text
        elif output.output_type == "stream":
            texts.append(f"{output.name}: {output.text}")
        elif output.output_type == "error":
            texts.append(f"error: {output.ename}: {output.evalue}")
        elif {"text/markdown", "text/plain"} & set(output.get("data", {})):
            texts.append(output.data.get("text/markdown", output.data.get("text/plain")))
        stream = output.name if output.output_type == "stream" else None
    return texts


def main() -> None:
    # No options: --help says what it does, anything else is a usage error (exit 2) before the kernel starts.
    argparse.ArgumentParser(description="Run notebooks/tier_analysis.ipynb from a clean kernel (about 40 s) and "
                                        "write it back with its fresh outputs.").parse_args()
    os.environ.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as directory:
        notebook = execute(NOTEBOOK, Path(directory))
    nbformat.write(notebook, NOTEBOOK)
    print(f"wrote {NOTEBOOK}")


if __name__ == "__main__":
    main()
