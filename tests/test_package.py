"""The package's shape: what `import k3_tail` loads, no import cycles, the public names, no outside citations."""

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import k3_tail

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "k3_tail"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path, modules):
    """The k3_tail modules that ``path`` imports anywhere in it (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("k3_tail"):
            for alias in node.names:  # `from k3_tail.x import y` imports module x.y when there is one
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
    return found


def test_import_graph_has_no_cycle():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imported_modules(path, paths) - {name} for name, path in paths.items()}
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import cycle: {' -> '.join(trail + [name])}"
        state[name] = "open"
        for target in sorted(graph[name]):
            visit(target, trail + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])


# The house from the bottom up (docs/design.md, "Layout"): a module imports only modules of its own layer
# or of the layers below it. A module is in the layer of the longest name here that it is or lies under.
LAYERS = (
    ("k3_tail._checks", "k3_tail.hardware", "k3_tail.hf_config", "k3_tail.json_files", "k3_tail.units",
     "k3_tail.output_files", "k3_tail.xla", "k3_tail.xla.launches", "k3_tail.deviceless"),
    ("k3_tail.ops", "k3_tail.xla.hlo_text"),
    ("k3_tail.config", "k3_tail.vllm_env", "k3_tail.policy"),
    ("k3_tail.tiers",),
    ("k3_tail.selection",),
    ("k3_tail.checkpoint", "k3_tail.per_rank", "k3_tail.shared_reduction", "k3_tail.forward", "k3_tail.module"),
    ("k3_tail.xla.compilation", "k3_tail.xla.report"),
    ("k3_tail",),
    # The measuring tools and the command-line harness, which the model's commands use too.
    ("k3_tail.tools", "k3_tail.cli.harness", "k3_tail.cli.tables"),
    ("k3_tail.models",),
    ("k3_tail.cli", "k3_tail.__main__"),
)


def layer_of(module):
    owners = [(len(name), level) for level, names in enumerate(LAYERS) for name in names
              if module == name or module.startswith(name + ".")]
    return max(owners)[1]


def test_no_import_runs_back_up_a_layer():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    upward = [f"{name} -> {target}" for name, path in sorted(paths.items())
              for target in sorted(imported_modules(path, paths) - {name}) if layer_of(target) > layer_of(name)]
    assert not upward


def test_the_package_imports_neither_the_lab_nor_the_tests_nor_the_scripts():
    """The lab (scripts/lab), the tests' modules and the scripts live beside the package: it never imports them."""
    outside = {"lab"} | {path.stem for pattern in ("tests/*.py", "scripts/*.py") for path in ROOT.glob(pattern)}
    imports = [(path, node) for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))]
    names = [(path, alias.name) for path, node in imports if isinstance(node, ast.Import) for alias in node.names]
    names += [(path, node.module) for path, node in imports
              if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module]
    assert not [f"{path.relative_to(ROOT)}: {name}" for path, name in names if name.split(".")[0] in outside]


# The measurement experiments: the scripts (the Kimi-K3 layer's two among them).
EXPERIMENTS = ("scripts/*.py",)


def test_the_experiments_stay_thin_over_the_harness():
    """Experiments are thin over the harness (k3_tail.cli.harness, k3_tail.cli.tables) and the lab
    (scripts/lab): at most 1,700 lines of Python among them, their imports apart
    (the linter's isort writes one name a line where they do not fit one)."""
    lines = sum(len(path.read_text().splitlines()) - _import_lines(path) for pattern in EXPERIMENTS
                for path in ROOT.glob(pattern))
    assert 0 < lines <= 1700


def _import_lines(path) -> int:
    """The lines of ``path``'s top-level import statements."""
    tree = ast.parse(path.read_text())
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    return sum(node.end_lineno - node.lineno + 1 for node in imports)


def test_import_loads_only_the_core():
    script = "import json, sys, k3_tail; print(json.dumps(sorted(sys.modules)))"
    environment = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment,
                            timeout=120, check=True)
    loaded = json.loads(result.stdout)
    assert not [name for name in loaded if name.split(".")[0] == "matplotlib"]
    assert not [name for name in loaded if name.startswith(("k3_tail.tools", "k3_tail.cli"))]


@pytest.mark.parametrize("name", k3_tail.__all__)
def test_every_public_name_resolves(name):
    assert getattr(k3_tail, name) is not None


def test_the_public_surface_is_a_short_list_without_module_aliases():
    assert len(k3_tail.__all__) <= 20
    assert not [name for name in k3_tail.__all__ if isinstance(getattr(k3_tail, name), types.ModuleType)]


@pytest.mark.parametrize(("module", "attribute"), [
    ("k3_tail.tools.benchmark", "measure_tiers"), ("k3_tail.selection.table", "SelectionTable"),
    ("k3_tail.selection.cost_model", "tier_cost"), ("k3_tail.deviceless.topologies", "parse_topology"),
    ("k3_tail.xla.report", "report"), ("k3_tail.xla.compilation", "compiler_options"),
    ("k3_tail.tiers.registry", "tier_table"), ("k3_tail.checkpoint", "open_checkpoint"),
])
def test_the_public_modules_go_by_their_real_names(module, attribute):
    assert callable(getattr(importlib.import_module(module), attribute))


def test_nothing_cites_a_file_outside_the_repository():
    """The project's docs and code say everything themselves: no path above the checkout, no spec sections."""
    texts = [path for pattern in ("k3_tail/**/*.py", "tests/*.py", "scripts/*", "scripts/lab/*.py", "docs/*.md",
                                  "notebooks/*.ipynb", "README.md", "pyproject.toml") for path in ROOT.glob(pattern)]
    citation = re.compile(r"\.\./shared|spec,? section")
    offenders = [str(path.relative_to(ROOT)) for path in texts
                 if path.is_file() and path != Path(__file__) and citation.search(path.read_text())]
    assert not offenders
