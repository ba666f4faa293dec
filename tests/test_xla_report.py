"""k3_tail.xla.report and its HLO reader on the CPU mesh, where cost_analysis gives per-device cost."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import gpu_mesh_for, make_tp_mesh, topology_params
from k3_tail import TailConfig, Tier, compile_tail
from k3_tail.xla.hlo_text import dot_flops, parse_module, replica_group_size
from k3_tail.xla.report import report

CONFIG = TailConfig.kimi_k3()
L, H = CONFIG.latent_size, CONFIG.hidden_size


@pytest.mark.parametrize("tier", [Tier.COLUMN_PARALLEL, Tier.SCATTER_GATHER])
@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_column_tiers_do_one_pth_of_the_overlap_tiers_gemm_flops_per_device(tp_size, tier):
    mesh = make_tp_mesh(tp_size)
    full = report(compile_tail(CONFIG, mesh, 64, tier=Tier.OVERLAP, weight_layout="replicated"))
    sharded = report(compile_tail(CONFIG, mesh, 64, tier=tier, weight_layout="column"))
    assert full.gemm_flops == 2 * 64 * L * H
    assert sharded.gemm_flops * tp_size == full.gemm_flops
    # cost_analysis counts the norm and the adds too: the GEMM dominates both.
    assert (full.cost_source, sharded.cost_source) == ("cost_analysis", "cost_analysis")
    assert sharded.flops * tp_size == pytest.approx(full.flops, rel=0.05)


def test_cpu_collectives_are_synchronous_so_nothing_overlaps():
    result = report(compile_tail(CONFIG, make_tp_mesh(8), 16, tier=Tier.OVERLAP, weight_layout="replicated"))
    assert result.collectives and not any(c.is_async for c in result.collectives)
    assert result.shared_reduction is not None and result.overlapped is False


def test_collective_bytes_and_ring_wire_bytes():
    result = report(compile_tail(CONFIG, make_tp_mesh(8), 16, tier=Tier.SCATTER_GATHER, weight_layout="column"))
    for collective in result.collectives:
        assert collective.bytes == sum(array.bytes for array in collective.arrays)
        factor = {"all-reduce": 2 * 7 / 8, "reduce-scatter": 7 / 8, "all-gather": 7 / 8}[collective.kind]
        assert collective.wire_bytes == round(factor * collective.bytes)


def test_without_a_shared_argument_there_is_no_verdict():
    config = TailConfig.kimi_k3(has_shared_experts=False)
    result = report(compile_tail(config, make_tp_mesh(2), 4, tier=Tier.OVERLAP), shared_argument=None)
    assert result.shared_reduction is None and result.overlapped is None


def test_report_is_plain_data_and_readable_text():
    result = report(compile_tail(CONFIG, make_tp_mesh(2), 4, tier=Tier.COLUMN_PARALLEL))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["gemm_flops"] == result.gemm_flops and data["overlapped"] is False
    assert "overlapped: False" in result.format() and "all-reduce" in result.format()


@pytest.mark.parametrize("shared_argument", [True, "1", 1.0])
def test_bad_shared_argument_is_a_value_error(shared_argument):
    compiled = compile_tail(CONFIG, make_tp_mesh(2), 4, tier=Tier.NATIVE)
    with pytest.raises(ValueError, match="shared_argument"):
        report(compiled, shared_argument=shared_argument)


def test_a_program_that_is_not_compiled_is_a_value_error_naming_compiled():
    lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros(2))
    with pytest.raises(ValueError, match=r"^compiled: expected a jax.stages.Compiled program .*, got Lowered"):
        report(lowered)


HLO = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: bf16[16,3584], p1: bf16[3584,896]) -> (bf16[16,896], bf16[16,3584]) {
  %p0 = bf16[16,3584]{1,0} parameter(0)
  %p1 = bf16[3584,896]{1,0} parameter(1)
  %ar = ((bf16[16,3584]{1,0}), bf16[16,3584]{1,0}) all-reduce-start(bf16[16,3584]{1,0} %p0), replica_groups=mesh['dp'=2,'tp'=4] {'tp'}, to_apply=%add
  %gemm = (bf16[16,896]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %done = bf16[16,3584]{1,0} all-reduce-done(%ar)
  %out = bf16[16,896]{1,0} get-tuple-element(%gemm), index=0
  ROOT %t = (bf16[16,896]{1,0}, bf16[16,3584]{1,0}) tuple(%out, %done)
}
"""


def test_hlo_reader_takes_typed_operands_mesh_replica_groups_and_gemm_custom_calls():
    entry = parse_module(HLO).entry.by_name()
    assert entry["ar"].operands == ("p0",) and entry["done"].operands == ("ar",)
    assert replica_group_size(entry["ar"], default=8) == 4
    assert dot_flops(entry["gemm"], entry) == 2 * 16 * 896 * 3584


@pytest.mark.parametrize(("groups", "size"), [("{{0,1,2,3},{4,5,6,7}}", 4), ("[2,4]<=[8]", 4), ("{}", 8)])
def test_replica_group_spellings(groups, size):
    line = f"  %x = f32[4]{{0}} all-reduce(%p), replica_groups={groups}, to_apply=%add"
    module = parse_module(HLO.replace("  ROOT %t =", line + "\n  ROOT %t ="))
    assert replica_group_size(module.entry.by_name()["x"], default=8) == size


def test_text_without_an_entry_is_a_value_error():
    with pytest.raises(ValueError, match="ENTRY"):
        parse_module("HloModule m\n")


@pytest.mark.parametrize("topology", topology_params("h100x8", "mi300xx8"))
def test_a_combined_all_gather_counts_every_array_it_gathers(topology):
    """XLA's GPU pipeline (CUDA and AMDGPU) combines independent all-gathers (here a uint8 payload and its bf16
    scales) into one whose async result is ((inputs), (outputs)): every gathered array counts, not the last one
    alone."""
    mesh = gpu_mesh_for(topology)

    def gather_both(payload, scales):
        return tuple(jax.lax.all_gather(x, "tp", tiled=True, to="invarying") for x in (payload, scales))

    program = jax.jit(jax.shard_map(gather_both, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=(P(), P())))
    arguments = (jax.ShapeDtypeStruct((64, 32), jnp.uint8, sharding=NamedSharding(mesh, P("tp"))),
                 jax.ShapeDtypeStruct((64,), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp"))))
    (gathered,) = report(program.lower(*arguments).compile(), shared_argument=None).collectives
    assert [(array.dtype, array.dims) for array in gathered.arrays] == [("u8", (64, 32)), ("bf16", (64,))]
    assert gathered.bytes == 64 * 32 + 64 * 2 and gathered.payload_dtypes == ("u8", "bf16")
    assert gathered.wire_bytes == round(7 / 8 * gathered.bytes)


def test_the_shots_of_a_quantised_sum_carry_its_codec_and_uint8_payload():
    config = TailConfig.kimi_k3(all_reduce_quantization="int6", quantized_all_reduce_min_bytes=0)
    result = report(compile_tail(config, make_tp_mesh(4), 8, tier=Tier.NATIVE, weight_layout="replicated"))
    assert sorted((c.form, c.payload_dtypes) for c in result.collectives) == [
        ("int6-quantised all-gather", ("u8",))] * 2 + [("int6-quantised all-to-all", ("u8",))] * 2
    # The CPU backend splits an all-to-all into one operand per rank; the bytes are the same.
    assert "int6-quantised all-to-all u8[1,224,26] + u8[1,224,26]" in result.format()
