"""Joining a mesh that spans several JAX processes (one per host, or several on one machine).

Multi-process JAX runs the same program in every process: each calls :func:`initialize` before any
other JAX call, builds the mesh over ``jax.devices()`` (the devices of all processes) and calls
``tail_forward`` with the same arguments. Inputs may be

  * global ``jax.Array`` s, e.g. from ``jax.make_array_from_callback`` with the shardings the tail
    uses (routed/shared partials ``P(axis)`` on dim 0, norm weight ``P()``, kernel ``P()`` or, for
    the column layout, the padded [L, padded_hidden_size(H, p)] kernel ``P(None, axis)``): each
    process then supplies only the blocks its own devices hold;
  * host numpy arrays holding the whole global value, identical in every process (same data, same
    seed): each process copies the blocks of its own devices from its copy.

The result y [T, H] is replicated: every process reads it from ``y.addressable_shards[0].data``.
(Token-sharded with ``config.sequence_parallel``: then each process holds its own rows, and
``jax.experimental.multihost_utils.process_allgather(y, tiled=True)`` gathers all of them.)
"""

from __future__ import annotations

import jax

from k3_tail._checks import check_int


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    local_cpu_devices: int | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 300,
) -> None:
    """Join the distributed runtime as process ``process_id`` of ``num_processes``.

    Call it first, before anything else uses JAX (JAX fixes its devices when its backend starts).

    Args:
      coordinator_address: "HOST:PORT" of process 0, which serves the coordinator there; every
        process passes the same address.
      num_processes: how many processes form the mesh.
      process_id: this process, 0 <= process_id < num_processes.
      local_cpu_devices: run on the CPU platform with this many devices in this process (a CPU mesh
        for trying it out, or a host without accelerators), with cross-process collectives through
        gloo; None keeps the default backend and its settings (the GPUs of a GPU host).
      initialization_timeout: seconds to wait for every process to join; a process whose peers never
        come aborts after it, instead of waiting forever.
      heartbeat_timeout_seconds: seconds without a heartbeat after which a process counts as dead;
        the others then abort instead of hanging in a collective.
      shutdown_timeout_seconds: seconds a process that ends waits at exit for the others to end too
        (JAX's shutdown barrier), after which it exits anyway. A process that fails should exit at
        once (``os._exit``) rather than wait there while its peers wait for it in a collective.

    Raises ValueError naming the argument for a bad value; JAX's RuntimeError when its backend is
    already running.
    """
    if not isinstance(coordinator_address, str) or not _is_host_port(coordinator_address):
        raise ValueError(f"coordinator_address: expected 'HOST:PORT', got {coordinator_address!r}")
    num_processes = check_int("num_processes", num_processes, minimum=1)
    process_id = check_int("process_id", process_id, minimum=0)
    if process_id >= num_processes:
        raise ValueError(f"process_id: expected an integer < num_processes={num_processes}, got {process_id}")
    if local_cpu_devices is not None:
        local_cpu_devices = check_int("local_cpu_devices", local_cpu_devices, minimum=1)
    initialization_timeout = check_int("initialization_timeout", initialization_timeout, minimum=1)
    heartbeat_timeout_seconds = check_int("heartbeat_timeout_seconds", heartbeat_timeout_seconds, minimum=1)
    shutdown_timeout_seconds = check_int("shutdown_timeout_seconds", shutdown_timeout_seconds, minimum=1)

    if local_cpu_devices is not None:
        # Naming the platform also keeps an installed GPU plugin from trying (and failing loudly) to start.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", local_cpu_devices)
        # gloo is already the default of jax 0.10 and 0.12; named so that the CPU mesh cannot end up
        # without a cross-process implementation, under which its collectives fail.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
    )


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
