"""The tier registry: one record per tier, the only list of tiers, and what is made from it."""

import ast
import importlib
from pathlib import Path

import pytest

import k3_tail
from k3_tail.tiers.record import CallShape, GpuKernelCounts, TierRecord
from k3_tail.tiers.registry import TIER_RECORDS, tier_table

ROOT = Path(__file__).parent.parent
RECORD_NAMES = [record.name for record in TIER_RECORDS]


def test_the_tier_enum_is_the_registry_in_order():
    assert [tier.value for tier in k3_tail.Tier] == RECORD_NAMES
    assert len(set(RECORD_NAMES)) == len(RECORD_NAMES)
    assert all(tier.record is record for tier, record in zip(k3_tail.Tier, TIER_RECORDS, strict=True))


@pytest.mark.parametrize("record", TIER_RECORDS, ids=RECORD_NAMES)
def test_each_record_holds_the_public_tier_function_of_its_module(record):
    assert record.function is getattr(importlib.import_module(f"k3_tail.tiers.{record.name}"), f"{record.name}_tail")
    assert record.function.__module__ == f"k3_tail.tiers.{record.name}"


def test_a_record_refuses_a_function_not_named_after_its_tier():
    def overlap_step(*arguments):
        return None

    with pytest.raises(ValueError, match="^function: .*<tier name>_tail, got 'overlap_step'"):
        TierRecord(function=overlap_step, projects_all_columns=True, collectives=tuple,
                   gpu_kernels=GpuKernelCounts(replicated={}))


@pytest.mark.parametrize("record", TIER_RECORDS, ids=RECORD_NAMES)
def test_each_record_describes_itself_in_one_line(record):
    for text in (record.prose.summary, record.prose.schedule, record.prose.collectives_text,
                 record.prose.token_sharded_form):
        assert text and "\n" not in text


def test_the_readme_tier_table_is_the_registrys():
    assert tier_table() in (ROOT / "README.md").read_text()


def test_a_record_with_needs_says_why_it_cannot_run():
    record = k3_tail.Tier.ONE_SHOT.record
    assert "weight_layout='replicated'" in record.why_not("column")
    config = k3_tail.TailConfig(hidden_size=8, latent_size=4, routed_output_is_reduced=True)
    assert "routed_output_is_reduced" in record.why_not("replicated", config)
    with pytest.raises(ValueError, match="^tiers: one_shot needs the whole"):
        record.check_runs("column", argument="tiers")


@pytest.mark.parametrize(("platform", "compiled"), [("cuda", True), ("rocm", True), ("gpu", True), ("cpu", False),
                                                   ("tpu", False), (None, False)])
def test_one_kernels_pallas_kernel_compiles_on_every_gpu_platform_jaxs_gpu_included(platform, compiled):
    """As the call on a GPU device, whose platform device_platform may only know as JAX's "gpu"."""
    assert k3_tail.Tier.ONE_KERNEL.record.runs_interpreted_on(platform) is not compiled


@pytest.mark.parametrize(("platform", "family"), [("cuda", "gpu"), ("rocm", "gpu"), ("gpu", "gpu"), ("cpu", "cpu")])
def test_compiler_options_are_looked_up_by_platform_family(platform, family):
    options = k3_tail.Tier.OVERLAP.record.options_for(platform)
    assert ("xla_gpu_all_reduce_combine_threshold_bytes" in options) == (family == "gpu")


def test_cost_terms_follow_the_call_shape():
    shape = CallShape(rows=16, latent_size=64, hidden_size=96, tp_size=8, weight_layout="column", has_shared=True,
                      use_norm=True, routed_output_is_reduced=False, token_sharded=False)
    terms = k3_tail.Tier.OVERLAP.record.collectives(shape)
    assert [(t.kind, t.elements, t.beside_gemm) for t in terms] == [
        ("all-reduce", 16 * 64, False), ("all-reduce", 16 * 96, True), ("all-gather", 16 * 96, False)]


def non_docstring_strings_and_tier_attributes(path):
    """(string constants that are not docstrings, Tier.X attribute names) in a source file."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node)}
    strings = {node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id == "Tier"}
    return strings, attributes


def test_no_module_but_a_tiers_own_lists_its_facts():
    """A tier's name appears as a value only in its own module; outside the tier modules only vLLM's
    rule order (selection/rules.py) names tiers, and native, the reference semantics, may be named."""
    misplaced = []
    for path in (ROOT / "k3_tail").rglob("*.py"):
        strings, attributes = non_docstring_strings_and_tier_attributes(path)
        own = path.stem if path.parent.name == "tiers" else None
        misplaced += [f"{path.name}: {name!r}" for name in set(RECORD_NAMES) & strings if name != own]
        if path.name != "rules.py":
            named = attributes & {name.upper() for name in RECORD_NAMES} - {"NATIVE"}
            misplaced += [f"{path.name}: Tier.{name}" for name in named]
    assert not misplaced
