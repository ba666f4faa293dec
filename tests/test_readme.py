"""The Python blocks of the README, docs/guide.md and docs/kimi_k3.md run as written: each page's in order, in
one fresh process on 8 forced CPU devices, started at the repository root; the links of the README and of every
page under docs/ resolve; .ci/run runs the README's commands as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FAST_COMPILE_XLA_FLAGS

ROOT = Path(__file__).parent.parent
# A fenced block opened by a line of exactly ```python; ```bash, ```text and indented lines are not run.
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# The pages whose Python blocks run.
PAGES = ("README.md", "docs/guide.md", "docs/kimi_k3.md")

# Each block is compiled under its page's name and line number, so a traceback points at the page's own line.
RUNNER = """
import sys
page = sys.argv[1]
for line, source in eval(sys.argv[2]):
    exec(compile("\\n" * (line - 1) + source, page, "exec"), globals())
"""


def python_blocks(page):
    """(first line, source) of each ```python block of ``page`` (relative to the repository root), in order."""
    text = (ROOT / page).read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in PYTHON_BLOCK.finditer(text)]


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_runs_in_order(page):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no ```python block"
    environment = {**os.environ, "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_XLA_FLAGS}"}
    result = subprocess.run([sys.executable, "-c", RUNNER, page, repr(blocks)], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_ci_runs_the_readmes_set_up_and_test_commands_as_written():
    """The README's first two commands (its indented lines under "Set up" and "Run the tests"), as .ci/run's
    first two commands."""
    readme = (ROOT / "README.md").read_text()
    commands = [re.search(rf"^## {heading}.*?^    (\S[^\n]*)$", readme, re.MULTILINE | re.DOTALL).group(1)
                for heading in ("Set up and run the demo", "Run the tests")]
    ci = [line.removesuffix(" || exit") for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci[:2] == commands


def anchor(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """A link to a file names one that exists, and a link to a section names a heading of that file."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, section = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.MULTILINE) if linked.is_file() else []
            if not linked.is_file() or (section and section not in map(anchor, headings)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


def test_the_readme_stays_a_page_of_at_most_200_lines():
    """Set-up, demo, tests, use in a model, the tier table and pointers: the rest lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
