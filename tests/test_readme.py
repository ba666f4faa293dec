"""The README's Python blocks run as written: in order, in one fresh process on 8 forced CPU devices."""

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import FAST_COMPILE_XLA_FLAGS

ROOT = Path(__file__).parent.parent
# A fenced block opened by a line of exactly ```python; ```bash and indented shell lines are not run.
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)

# Each block is compiled under its README line number, so a traceback points at the README's own line.
RUNNER = """
import sys
for line, source in eval(sys.argv[1]):
    exec(compile("\\n" * (line - 1) + source, "README.md", "exec"), globals())
"""


def readme_python_blocks():
    """(first line, source) of each ```python block of README.md, in order."""
    text = (ROOT / "README.md").read_text()
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in PYTHON_BLOCK.finditer(text)]


def test_every_readme_python_block_runs_in_order():
    blocks = readme_python_blocks()
    assert blocks, "README.md has no ```python block"
    environment = {**os.environ, "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_XLA_FLAGS}"}
    result = subprocess.run([sys.executable, "-c", RUNNER, repr(blocks)], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
