"""The one_kernel tier's Pallas Triton kernel lowered for a deviceless GPU topology as users' programs lower it:
by ``k3_tail.compile_tail`` (the global-array entry point) and inside the user's own ``jax.shard_map``
(``k3_tail.latent_moe_tail``), each with the tier that selection picks at decode.

``python -W error tests/triton_lowering.py TOPOLOGY`` runs both in a process whose warnings are errors and
prints "lowered" (tests/test_pallas_triton.py); the tests import the functions.
"""

import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from k3_tail.xla.compilation import tail_arguments

CONFIG = k3_tail.TailConfig(hidden_size=256, latent_size=128)
# The name of the kernel's pallas_call, which its lowered custom call carries.
KERNEL_NAME = "k3_tail_norm_project_add"


def compiled_decode_call(mesh) -> jax.stages.Compiled:
    """``k3_tail.compile_tail`` of one token, with the tier selection picks on ``mesh``'s devices."""
    return k3_tail.compile_tail(CONFIG, mesh, 1, weight_layout="column")


def lowered_per_rank_call(mesh) -> jax.stages.Lowered:
    """A user's jitted shard_map over ``mesh`` that calls ``latent_moe_tail`` for one token, lowered."""
    device = mesh.devices.flat[0]

    def per_rank(routed, shared, norm_weight, kernel, rank):
        return k3_tail.latent_moe_tail(routed[0], shared[0], norm_weight, kernel, config=CONFIG, axis_name="tp",
                                       weight_layout="column", device=device, rank=rank)

    specs = (P("tp"), P("tp"), P(), P(None, "tp"), P("tp"))
    ranks = jax.ShapeDtypeStruct((mesh.shape["tp"],), jnp.int32, sharding=NamedSharding(mesh, P("tp")))
    program = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=P()))
    return program.lower(*tail_arguments(CONFIG, mesh, 1, weight_layout="column"), ranks)


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")  # a deviceless topology compiles on the CPU backend
    topology_mesh = k3_tail.topology_mesh(sys.argv[1])
    # The user's own shard_map first: k3_tail's entry points have installed nothing before its lowering.
    assert KERNEL_NAME in lowered_per_rank_call(topology_mesh).as_text()
    assert KERNEL_NAME in compiled_decode_call(topology_mesh).as_text()
    print("lowered")
