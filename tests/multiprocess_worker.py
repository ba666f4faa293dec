"""One process of tests/test_multiprocess.py: join the mesh, run every case, write the results as JSON.

    PYTHONPATH=scripts python tests/multiprocess_worker.py --coordinator 127.0.0.1:PORT --num-processes 2 \\
        --process-id I --local-devices 4 --result PATH

(scripts/ on the path: it joins with the lab's lab.multiprocess, as scripts/run_multiprocess.py does.)

Every process runs every case of ``CASES`` on one mesh "tp" over the devices of all processes, with
the same inputs (same seed), and compares its own copy of the replicated output with the float64
reference. It writes one JSON line to ``--result``:

    {"process_id": I, "process_count": N, "device_count": D, "local_device_count": K,
     "cases": {case id: {"shape": [T, H], "dtype": name, "replicated": bool, "error": float}
                        or {"exception": "Type: message"}}}

The test judges the results; this program only reports them. Any failure outside a case exits at
once with status 1, without waiting for the other processes.
"""

import argparse
import dataclasses
import itertools
import json
import os
import sys
import traceback
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import k3_tail
from lab.blocks import WEIGHT_LAYOUTS
from lab.multiprocess import initialize
from reference import make_inputs, reference_tail, relative_error  # tests/ is on sys.path: the script's directory

AXIS_NAME = "tp"
LATENT_SIZE = 64
SEED = 0


@dataclasses.dataclass(frozen=True)
class Case:
    """One tail call: a tier and layout, at one dtype and size, from numpy or global-array inputs.

    inputs: "host" passes numpy arrays holding the whole global value (identical in every process);
    "global" passes jax.Arrays that each process builds from its own devices' blocks only.
    """

    tier: k3_tail.Tier
    weight_layout: str
    dtype: str
    num_tokens: int
    hidden_size: int
    inputs: str

    @property
    def id(self) -> str:
        return (
            f"{self.tier.value}-{self.weight_layout}-{self.dtype}-T{self.num_tokens}-H{self.hidden_size}-{self.inputs}"
        )


TIERS_AND_LAYOUTS = tuple(
    (tier, layout) for tier, layout in itertools.product(k3_tail.Tier, WEIGHT_LAYOUTS) if tier.supports(layout)
)
# T = 5 and H = 99 divide by no TP size > 1 (the column tiers pad H); the sizes go with the dtype.
DTYPES_AND_SIZES = (("bfloat16", 5, 99), ("float32", 16, 96))
# Global arrays (the form a multi-process model has), and host numpy arrays (tail_forward places them on the
# global mesh).
INPUT_KINDS = ("global", "host")
# Every tier and layout in both dtypes and from both kinds of input, the pairs covered rather than the product (each
# case costs a compilation in both processes): the kind that goes with each dtype swaps from one (tier, layout) to
# the next, so every dtype meets every kind too. The single-process tests cover the full product of sizes.
CASES = tuple(
    Case(tier, layout, dtype, num_tokens, hidden_size, inputs)
    for index, (tier, layout) in enumerate(TIERS_AND_LAYOUTS)
    for (dtype, num_tokens, hidden_size), inputs in zip(
        DTYPES_AND_SIZES, INPUT_KINDS[index % 2:] + INPUT_KINDS[:index % 2], strict=True)
)


def main(args: argparse.Namespace) -> None:
    initialize(
        args.coordinator, args.num_processes, args.process_id,
        local_cpu_devices=args.local_devices,
        initialization_timeout=args.initialization_timeout,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
    )
    # Global devices: the mesh spans every process; rank r is the r-th device of jax.devices().
    mesh = jax.make_mesh(
        (jax.device_count(),), (AXIS_NAME,), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()
    )
    results = {case.id: run_case(case, mesh) for case in CASES}
    report = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "cases": results,
    }
    # Written whole, then renamed: the test never reads half a result.
    partial = Path(f"{args.result}.partial")
    partial.write_text(json.dumps(report) + "\n")
    partial.replace(args.result)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--local-devices", type=int, required=True, help="CPU devices in this process")
    parser.add_argument("--initialization-timeout", type=int, default=60, metavar="SECONDS")
    parser.add_argument("--heartbeat-timeout", type=int, default=30, metavar="SECONDS")
    parser.add_argument("--result", required=True, metavar="PATH", help="where to write the JSON result")
    return parser.parse_args(argv)


def run_case(case: Case, mesh) -> dict:
    """Run ``case`` on ``mesh`` and compare this process's copy of y [T, H] with the float64 reference."""
    config = k3_tail.TailConfig(hidden_size=case.hidden_size, latent_size=LATENT_SIZE, dtype=case.dtype)
    inputs = make_inputs(config, mesh.shape[AXIS_NAME], case.num_tokens, seed=SEED)
    arrays = (inputs.routed, inputs.shared, inputs.norm_weight, inputs.kernel)
    if case.inputs == "global":
        arrays = global_inputs(*arrays, config=config, mesh=mesh, weight_layout=case.weight_layout)
    try:
        y = k3_tail.tail_forward(*arrays, config=config, mesh=mesh, tier=case.tier, weight_layout=case.weight_layout)
        local_y = np.asarray(y.addressable_shards[0].data)
    except Exception as error:  # reported per case; every process raises alike, so none waits for another
        return {"exception": f"{type(error).__name__}: {error}"}
    return {
        "shape": list(local_y.shape),
        "dtype": local_y.dtype.name,
        "replicated": y.sharding.is_fully_replicated,
        "error": float(relative_error(local_y, reference_tail(config, inputs))),
    }


def global_inputs(routed, shared, norm_weight, kernel, *, config, mesh, weight_layout):
    """The tail's inputs as global jax.Arrays in the shardings tail_forward computes in.

    routed [p, T, L] and shared [p, T, H]: P("tp") on dim 0; norm_weight [L]: P(); kernel [L, H]:
    P() ("replicated"), or padded to [L, padded_hidden_size(H, p)] and P(None, "tp") ("column").
    """
    kernel_spec = P()
    if weight_layout == "column":
        width = k3_tail.padded_hidden_size(config.hidden_size, mesh.shape[AXIS_NAME])
        kernel = np.pad(kernel, [(0, 0), (0, width - config.hidden_size)])
        kernel_spec = P(None, AXIS_NAME)
    return (
        own_blocks_only(routed, NamedSharding(mesh, P(AXIS_NAME))),
        own_blocks_only(shared, NamedSharding(mesh, P(AXIS_NAME))),
        own_blocks_only(norm_weight, NamedSharding(mesh, P())),
        own_blocks_only(kernel, NamedSharding(mesh, kernel_spec)),
    )


def own_blocks_only(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``x`` as a global array, built from the blocks of this process's devices.

    The rest of this process's copy is NaN, as if this host had never seen the other processes'
    partials: a correct y then shows that they reached it through the collectives.
    """
    own = np.full_like(x, np.nan)
    for device, index in sharding.devices_indices_map(x.shape).items():
        if device.process_index == jax.process_index():
            own[index] = x[index]
    return jax.make_array_from_callback(x.shape, sharding, lambda index: own[index])


if __name__ == "__main__":
    arguments = parse_arguments()
    try:
        main(arguments)
    except Exception:
        # Exit at once: a normal exit would wait in JAX's shutdown barrier for peers that may be
        # waiting for this process in a collective; exiting stops its heartbeats, so they abort too.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
