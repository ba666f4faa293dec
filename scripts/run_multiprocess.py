"""Run every tier of the Kimi-K3 tail on a TP mesh that spans several JAX processes, and check it.

    python scripts/run_multiprocess.py --coordinator HOST0:PORT --num-processes N --process-id I   # on each host
    python scripts/run_multiprocess.py --local 2 --small                                           # on one machine

Exit status 0 when every tier is within the dtype's tolerance of the float64 reference, 1 when one is not or a
process or the coordinator's address fails, 2 for bad arguments. Method: docs/guide.md, "Multi-process meshes".

On CPU devices the processes' collectives go through gloo, whose C++ runtime prints "[Gloo] Rank R is connected
to N peer ranks. ..." on stdout for every device as it connects (no log level or variable turns it off).
--local leaves those lines out unless --verbose; with --coordinator each process prints them.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
import traceback

import jax
import numpy as np

import k3_tail
from k3_tail.cli.harness import positive_int, positive_int_list, random_seed, tp_mesh
from lab.accuracy import random_partials, random_weights, reference_tail, relative_error
from lab.blocks import WEIGHT_LAYOUTS
from lab.multiprocess import CoordinatorError, initialize, split_address

LOCAL_HOST = "127.0.0.1"
DEFAULT_LOCAL_CPU_DEVICES = 4
DEFAULT_TOKENS = (1, 16, 320)
# Long enough for process 0 to start its coordinator when all processes start together (--local on a
# loaded machine takes seconds), short enough to report a wrong address or closed port soon.
DEFAULT_CONNECT_TIMEOUT_S = 60
SMALL_SHAPES = {"hidden_size": 99, "latent_size": 64}  # 99: no TP size > 1 divides it, the column tiers pad
# Relative Frobenius error allowed against float64: bf16 keeps 8 significand bits.
TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-5}
TIERS_AND_LAYOUTS = tuple((tier, layout) for tier in k3_tail.Tier for layout in WEIGHT_LAYOUTS if tier.supports(layout))
# How gloo's connection notices begin (module docstring).
GLOO_NOTICE = "[Gloo] "


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.local is not None:
        return run_local(args)
    try:
        return run_process(args)
    except CoordinatorError as error:
        # Raised before JAX's distributed runtime starts: nothing to wait for at exit.
        print(f"{os.path.basename(__file__)}: error: {error}", file=sys.stderr)
        return 1
    except Exception:
        # Exit at once: a normal exit would wait in JAX's shutdown barrier for the other processes,
        # which may be waiting for this one in a collective; exiting stops its heartbeats, so they
        # abort after --heartbeat-timeout instead of hanging.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(prog=os.path.basename(__file__), description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", type=positive_int, metavar="N", help=f"run N processes on {LOCAL_HOST}")
    where.add_argument("--coordinator", type=coordinator_address, metavar="HOST:PORT",
                       help="address of process 0's coordinator")
    add = parser.add_argument
    add("--num-processes", type=positive_int, metavar="N", help="processes in all (with --coordinator)")
    add("--process-id", type=int, metavar="I", help="this process, 0 <= I < N (with --coordinator)")
    add("--cpu-devices", type=positive_int, metavar="K",
        help=f"K CPU devices per process (default: the platform's own; {DEFAULT_LOCAL_CPU_DEVICES} with --local)")
    add("--small", action="store_true", help="H=99, L=64 instead of Kimi-K3's H=7168, L=3584")
    add("--dtype", choices=sorted(TOLERANCE), default="bfloat16", help="activation dtype (default: bfloat16)")
    add("--tokens", type=positive_int_list, default=DEFAULT_TOKENS, metavar="T,T,...",
        help=f"token counts (default: {','.join(map(str, DEFAULT_TOKENS))})")
    add("--seed", type=random_seed, default=0,
        help="random seed of the inputs, the same in every process, 0 <= SEED < 2**32 (default: 0)")
    add("--initialization-timeout", type=positive_int, default=300, metavar="SECONDS",
        help="how long to wait for every process to join (default: 300)")
    add("--connect-timeout", type=positive_int, default=DEFAULT_CONNECT_TIMEOUT_S, metavar="SECONDS",
        help="how long a process I > 0 retries connecting to the coordinator before it gives up with exit status "
        f"1; at most --initialization-timeout (default: {DEFAULT_CONNECT_TIMEOUT_S})")
    add("--heartbeat-timeout", type=positive_int, default=100, metavar="SECONDS",
        help="silence after which a process counts as dead and the others abort (default: 100)")
    add("--timeout", type=positive_int, default=1800, metavar="SECONDS",
        help="with --local: stop every process after this long (default: 1800)")
    add("--verbose", action="store_true",
        help="with --local: show every process's stdout, gloo's connection notices included (default: process 0's "
        "results only)")
    args = parser.parse_args(argv)
    if args.coordinator is not None and (args.num_processes is None or args.process_id is None):
        parser.error("--coordinator needs --num-processes and --process-id")
    if args.local is not None and (args.num_processes is not None or args.process_id is not None):
        parser.error("--local N starts processes 0..N-1 itself: leave out --num-processes and --process-id")
    if args.process_id is not None and not 0 <= args.process_id < (args.num_processes or 0):
        parser.error(f"--process-id: expected 0 <= I < --num-processes, got {args.process_id}")
    return args


def coordinator_address(text: str) -> str:
    """``text`` if it is HOST:PORT with a port in 1..65535 (argparse type)."""
    try:
        split_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535 (an IPv6 host in brackets), "
                                         f"got {text!r}") from None
    return text


def run_local(args: argparse.Namespace) -> int:
    """Start ``args.local`` processes of this script on the loopback address; 0 when all succeed, else 1.

    When one process fails the others are stopped: they would wait for it until their heartbeat
    timeout. Only process 0 prints the results, which are passed on without gloo's connection notices
    (module docstring), unless ``--verbose`` shows every process's stdout as it is; every process's
    stderr stays visible.
    """
    port = free_loopback_port()
    shared_options = [
        "--coordinator", f"{LOCAL_HOST}:{port}", "--num-processes", str(args.local),
        "--cpu-devices", str(args.cpu_devices or DEFAULT_LOCAL_CPU_DEVICES),
        "--dtype", args.dtype, "--tokens", ",".join(map(str, args.tokens)), "--seed", str(args.seed),
        "--initialization-timeout", str(args.initialization_timeout),
        "--connect-timeout", str(args.connect_timeout), "--heartbeat-timeout", str(args.heartbeat_timeout),
        *(["--small"] if args.small else []),
    ]
    # The other processes' stdout holds only their own gloo notices.
    outputs = [None if args.verbose else subprocess.PIPE if process_id == 0 else subprocess.DEVNULL
               for process_id in range(args.local)]
    processes = [subprocess.Popen([sys.executable, __file__, *shared_options, "--process-id", str(process_id)],
                                  stdout=output, text=True)
                 for process_id, output in enumerate(outputs)]
    results = None if args.verbose else threading.Thread(target=pass_on_results, args=(processes[0].stdout,))
    if results is not None:
        results.start()
    deadline = time.monotonic() + args.timeout
    while None in (statuses := [process.poll() for process in processes]):
        failed = [i for i, status in enumerate(statuses) if status not in (None, 0)]
        if failed or time.monotonic() > deadline:
            why = f"process {failed[0]} failed" if failed else f"--timeout {args.timeout} s passed"
            print(f"stopping the other processes: {why}", file=sys.stderr)
            for process in processes:
                if process.poll() is None:
                    process.kill()
            break
        time.sleep(0.1)
    statuses = [process.wait() for process in processes]
    if results is not None:
        results.join()  # process 0 has ended: its stdout is at its end
    return 0 if all(status == 0 for status in statuses) else 1


def pass_on_results(stream) -> None:
    """Copy process 0's stdout ``stream`` to this one's, line by line, without gloo's connection notices."""
    for line in stream:
        if not line.startswith(GLOO_NOTICE):
            sys.stdout.write(line)
            sys.stdout.flush()


def free_loopback_port() -> int:
    """A TCP port on the loopback address that nothing listens on now (the coordinator binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOCAL_HOST, 0))
        return probe.getsockname()[1]


def run_process(args: argparse.Namespace) -> int:
    """This process's part: join, run every (T, tier, layout) on the global mesh, check, report on process 0."""
    initialize(args.coordinator, args.num_processes, args.process_id, local_cpu_devices=args.cpu_devices,
               initialization_timeout=args.initialization_timeout, connect_timeout=args.connect_timeout,
               heartbeat_timeout_seconds=args.heartbeat_timeout)
    shapes = SMALL_SHAPES if args.small else {}
    config = k3_tail.TailConfig.kimi_k3(**shapes, dtype=args.dtype)
    devices = jax.devices()
    mesh = tp_mesh(devices)
    tp_size = mesh.size
    tolerance = TOLERANCE[args.dtype]
    show(f"mesh: tp={tp_size} over {len(devices)} {devices[0].platform} devices in {jax.process_count()} processes "
         f"(jax {jax.__version__}); tail H={config.hidden_size}, L={config.latent_size}, {args.dtype}")

    failures = 0
    for num_tokens in args.tokens:
        # Drawn from the seed and T alone, so every process holds the same values.
        rng = np.random.default_rng([args.seed, num_tokens])
        routed, shared = random_partials(config, tp_size, num_tokens, rng)
        norm_weight, kernel = random_weights(config, rng)
        expected = reference_tail(config, routed, shared, norm_weight, kernel)
        picked = k3_tail.select_tier(config, num_tokens, tp_size)
        show(f"T={num_tokens} (select_tier picks {picked})")
        for tier, weight_layout in TIERS_AND_LAYOUTS:
            y = k3_tail.tail_forward(routed, shared, norm_weight, kernel, config=config, mesh=mesh, tier=tier,
                                     weight_layout=weight_layout)
            error = relative_error(np.asarray(y.addressable_shards[0].data), expected)
            ok = error <= tolerance  # False for NaN too
            failures += not ok
            show(f"  {tier.value:<16} {weight_layout:<11} relative error {error:.2e}  {'ok' if ok else 'FAIL'}")
    if failures:
        show(f"FAILED: {failures} run(s) exceed the {args.dtype} tolerance {tolerance:g}")
        return 1
    show(f"every tier and layout is within {tolerance:g} of the float64 reference")
    return 0


def show(line: str) -> None:
    """Print ``line`` on process 0 only: every process holds the same results."""
    if jax.process_index() == 0:
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
