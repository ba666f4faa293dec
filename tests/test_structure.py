"""The house's structure: module and doc sizes, and a traced call that selects once, checks once and explains
nothing it was not asked for (the figures of docs/design.md's "Structure figures", lab.structure)."""

import importlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import k3_tail
from lab import structure
from reference import make_inputs

ROOT = structure.ROOT
# A per-rank decode call on a CPU device traced and lowered: the calls of its checks, its selection and the
# overlap tier's trace (59 at this writing; 110 when selection built its notes and checks ran twice).
CPU_DECODE_CALL_BUDGET = 60


@pytest.fixture(scope="module")
def cpu_mesh():
    return Mesh(np.array(jax.devices()[:structure.TP_SIZE]), ("tp",))


def test_no_module_of_the_package_is_over_500_lines():
    assert {path: lines for path, lines in structure.module_lines().items() if lines > 500} == {}


def test_no_docs_file_is_over_700_lines_and_the_design_over_450():
    sizes = {path: lines for path, lines, _ in structure.doc_sizes()}
    assert {path: lines for path, lines in sizes.items() if lines > 700} == {}
    assert sizes["docs/design.md"] <= 450


def test_a_traced_per_rank_call_checks_and_selects_once_and_builds_no_notes(cpu_mesh):
    calls = structure.traced_calls(cpu_mesh, cpu_mesh.devices.flat[0])
    once = [("config.py", "check_config"), ("per_rank.py", "_check_per_rank_inputs"),
            ("selection/rules.py", "choose_tier")]
    assert [calls[name] for name in once] == [1, 1, 1]
    assert calls["selection/rules.py", "_call_notes"] == 0 and calls["selection/buffers.py", "collective_buffers"] == 0
    assert sum(calls.values()) <= CPU_DECODE_CALL_BUDGET, calls.most_common(10)


def test_tail_forward_checks_the_global_arrays_and_runs_the_per_rank_tail_unchecked(cpu_mesh, monkeypatch):
    config = k3_tail.TailConfig(hidden_size=96, latent_size=64)
    inputs = make_inputs(config, structure.TP_SIZE, 3)
    per_rank_checks = []
    monkeypatch.setattr(k3_tail.per_rank, "_check_per_rank_inputs",
                        lambda *args, **kwargs: per_rank_checks.append(args))
    y = k3_tail.tail_forward(inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel, config=config,
                             mesh=cpu_mesh)
    assert y.shape == (3, 96) and y.sharding.is_equivalent_to(NamedSharding(cpu_mesh, P()), 2)
    assert per_rank_checks == []


def test_the_moved_topologies_module_still_imports_with_a_deprecation_warning(monkeypatch):
    monkeypatch.delitem(sys.modules, "k3_tail.xla.topologies", raising=False)
    with pytest.warns(DeprecationWarning, match="k3_tail.deviceless.topologies"):
        moved = importlib.import_module("k3_tail.xla.topologies")
    assert moved.parse_topology is k3_tail.deviceless.topologies.parse_topology
