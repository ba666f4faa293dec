"""The house's structure in figures: module sizes per folder, prose per code line, doc sizes, and the library
calls one per-rank decode call makes while it is traced and lowered.

    python scripts/lab/structure.py [--markdown]

docs/design.md's "Structure figures" are its output. The import layers (no import back up, no circle) are
tests/test_package.py's to check.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import os
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "k3_tail"
# The per-rank decode call the figures trace: Kimi-K3's tail, one token, p = 8, column layout.
DECODE_TOKENS, TP_SIZE = 1, 8


def module_lines() -> dict[str, int]:
    """Lines of each module of the package, by its path below the repository."""
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in sorted(PACKAGE.rglob("*.py"))}


def prose_and_code_lines(path: Path) -> tuple[int, int]:
    """(docstring and comment lines, other non-blank lines) of the Python file ``path``."""
    source = path.read_text()
    prose = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose.add(token.start[0])
    lines = source.splitlines()
    code = [number for number, line in enumerate(lines, 1) if line.strip() and number not in prose]
    return len(prose), len(code)


def folder_figures() -> list[tuple[str, int, int, int, float]]:
    """Per folder of the package (its top-level modules as "k3_tail"): (folder, modules, lines, largest module's
    lines, docstring and comment lines per code line)."""
    folders = collections.defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        folders["k3_tail" if len(relative.parts) == 1 else f"k3_tail/{relative.parts[0]}"].append(path)
    rows = []
    for folder, paths in sorted(folders.items()):
        lines = [len(path.read_text().splitlines()) for path in paths]
        prose, code = map(sum, zip(*(prose_and_code_lines(path) for path in paths), strict=True))
        rows.append((folder, len(paths), sum(lines), max(lines), prose / code))
    return rows


def doc_sizes() -> list[tuple[str, int, int]]:
    """(file, lines, bytes) of each Markdown file under docs/."""
    return [(str(path.relative_to(ROOT)), len(path.read_text().splitlines()), path.stat().st_size)
            for path in sorted((ROOT / "docs").rglob("*.md"))]


def traced_calls(mesh, device=None) -> collections.Counter:
    """The calls of the package's functions (comprehensions and lambdas apart) while one per-rank decode call of
    :func:`k3_tail.latent_moe_tail` (Kimi-K3, T = 1, p = 8, column layout) is traced and lowered under
    ``jax.jit(jax.shard_map(...))`` on ``mesh`` (8 devices on an axis "tp"), by (module, function). ``device``:
    the call's ``device`` (None: one branch per lowering platform)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import k3_tail

    config = k3_tail.TailConfig.kimi_k3()

    def per_rank(routed, shared, norm, kernel, rank):
        return k3_tail.latent_moe_tail(routed[0], shared[0], norm, kernel, config=config, weight_layout="column",
                                       device=device, rank=rank)

    program = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P(None, "tp"), P("tp")),
                                    out_specs=P()))
    latent, hidden = config.latent_size, config.hidden_size
    arguments = [jax.ShapeDtypeStruct((TP_SIZE, DECODE_TOKENS, latent), jnp.bfloat16),
                 jax.ShapeDtypeStruct((TP_SIZE, DECODE_TOKENS, hidden), jnp.bfloat16),
                 jax.ShapeDtypeStruct((latent,), jnp.bfloat16), jax.ShapeDtypeStruct((latent, hidden), jnp.bfloat16),
                 jax.ShapeDtypeStruct((TP_SIZE,), jnp.int32)]
    calls = collections.Counter()
    package = str(PACKAGE)

    def count(frame, event, _):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(package) and not code.co_name.startswith("<"):
            calls[os.path.relpath(code.co_filename, package), code.co_name] += 1

    sys.setprofile(count)
    try:
        program.lower(*arguments)
    finally:
        sys.setprofile(None)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    import jax
    from jax.sharding import Mesh

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", TP_SIZE)
    import k3_tail

    print("| folder | modules | lines | largest module | docstring and comment lines per code line |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for folder, modules, lines, largest, ratio in folder_figures():
        print(f"| {folder} | {modules} | {lines:,} | {largest} | {ratio:.2f} |")
    print()
    print("| per-rank decode call (Kimi-K3, T = 1, p = 8, column) | calls | modules |")
    print("| --- | ---: | ---: |")
    cpu_mesh = Mesh(jax.devices()[:TP_SIZE], ("tp",))
    cases = [("CPU device (overlap)", cpu_mesh, cpu_mesh.devices.flat[0])]
    try:
        h100_mesh = k3_tail.topology_mesh("h100x8")
        cases.append(("H100 device, deviceless (one_kernel)", h100_mesh, h100_mesh.devices.flat[0]))
    except k3_tail.TopologyUnavailable as error:  # the [aot] extra is optional: say why the row is missing
        print(f"(no H100 row: {error})", file=sys.stderr)
    cases.append(("no device: a branch per lowering platform", cpu_mesh, None))
    for label, mesh, device in cases:
        calls = traced_calls(mesh, device)
        print(f"| {label} | {sum(calls.values())} | {len({module for module, _ in calls})} |")
    print()
    print("| docs file | lines | KB |")
    print("| --- | ---: | ---: |")
    for path, lines, size in doc_sizes():
        print(f"| {path} | {lines} | {size / 1000:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
