"""MXFP4 experts at their packed cost in the compiled Kimi-K3 layer: no decoded copy of the experts.

The layer at Kimi-K3's shapes (896 experts, top 16, p = 8, the tail tier it selects) compiled for a deviceless
GPU topology with its routed experts as MXFP4 and as bf16 (``figures.compiled_figures``), each
(topology, T, format) once per session. Per rank: decode (T = 1, 16, the gather method) needs at most
max(2 MB, the bf16 layer's) temp bytes (before: the gathered codes copied, 24 MB at T = 1 on H100, 387 MB at
T = 16 on MI300X); prefill (T = 2048, the capacity method) at most twice the bf16 layer's (before: every expert's
kernels decoded to bf16, 7.80 GB against 0.67 GB); the bytes the MXFP4 layer accesses beyond the rest of the
layer (the bf16 layer's bytes less its experts' 7.40 GB) at most 1.2 times the packed experts' 1.97 GB; and no
floating-point array it writes is as large as one group of decoded expert kernels (before the capacity GEMMs
decoded in their operand load, each group's kernels were written decoded, 154 MB each). (MI355X at T = 1 needed
7.09 MB while the decoder built the values' bits with integer operations: gfx950's XLA wrote out the gathered
scales and an int32 u - 1 of the down kernel's; through the format's dtypes it needs 1.58 MB.)
"""


import pytest

from helpers import topology_params
from k3_tail.models.kimi_k3 import KIMI_K3_NUM_EXPERTS, mxfp4_experts as mxfp4, routed_experts
from k3_tail.models.kimi_k3.layer_config import KIMI_K3_EXPERT_INTERMEDIATE_SIZE
from k3_tail.models.kimi_k3.mxfp4 import MXFP4_BYTES

DECODE_TEMP_FLOOR, PREFILL_TEMP_OVER_BF16, READ_OVER_PACKED = 2e6, 2.0, 1.2
EXPERT_SHAPE = (KIMI_K3_NUM_EXPERTS, 3584, KIMI_K3_EXPERT_INTERMEDIATE_SIZE, 8)
TOPOLOGIES = topology_params("h100x8", "mi300xx8", "mi355xx8", slow=("mi355xx8",))


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_decode_with_mxfp4_experts_needs_no_more_temp_memory_than_max_2_mb_or_bf16s(kimi_layer_figures, num_tokens,
                                                                                  topology):
    bf16 = kimi_layer_figures(topology, num_tokens, None).temp_bytes
    assert kimi_layer_figures(topology, num_tokens, "mxfp4").temp_bytes <= max(DECODE_TEMP_FLOOR, bf16)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_prefill_with_mxfp4_experts_needs_at_most_twice_bf16s_temp_memory(kimi_layer_figures, topology):
    bf16 = kimi_layer_figures(topology, 2048, None).temp_bytes
    assert kimi_layer_figures(topology, 2048, "mxfp4").temp_bytes <= PREFILL_TEMP_OVER_BF16 * bf16


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("num_tokens", [1, 16, 2048])
def test_the_mxfp4_experts_are_read_at_about_their_packed_bytes(kimi_layer_figures, num_tokens, topology):
    bf16_experts = mxfp4.expert_bytes_per_rank(*EXPERT_SHAPE, 2)
    rest_of_layer = kimi_layer_figures(topology, num_tokens, None).bytes_accessed - bf16_experts
    experts_read = kimi_layer_figures(topology, num_tokens, "mxfp4").bytes_accessed - rest_of_layer
    assert experts_read <= READ_OVER_PACKED * mxfp4.expert_bytes_per_rank(*EXPERT_SHAPE, MXFP4_BYTES)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("num_tokens", [1, 16, 2048])
def test_no_array_the_mxfp4_layer_writes_is_as_large_as_one_group_of_decoded_expert_kernels(kimi_layer_figures,
                                                                                            num_tokens, topology):
    # One group of the capacity method: S = E/16 experts' [L, m/p] kernels. Before the decode moved into the GEMM's
    # operand load (models/kimi_k3/mxfp4_matmul.py), the prefill layer wrote exactly that many bf16 values per kernel.
    experts, latent, width, tp_size = EXPERT_SHAPE
    group = routed_experts.overflow_slots(experts) * latent * (width // tp_size)
    assert kimi_layer_figures(topology, num_tokens, "mxfp4").largest_float_write < group


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_at_prefill_the_experts_packed_codes_are_read_where_they_lie(kimi_layer_figures, topology):
    # One expert's packed codes of a kernel: the capacity GEMMs take the experts by index, so no array the layer writes
    # holds even one expert's (before: each group's codes were copied before each GEMM, 56 experts' worth, and each
    # overflow round's gathered ones). The bytes accessed above cannot show it: XLA counts a loop's body once.
    experts, latent, width, tp_size = EXPERT_SHAPE
    assert kimi_layer_figures(topology, 2048, "mxfp4").largest_byte_write < latent * (width // tp_size) // 2
