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
(Token-sharded with ``config.sequence_parallel``: then each process holds its own rows of the
[T', H] padded y, and ``jax.experimental.multihost_utils.process_allgather(y, tiled=True)[:T]``
gathers the T rows.)

Before JAX's distributed runtime starts, :func:`initialize` checks the coordinator's address itself,
because JAX ends the process in a C++ abort (or a crash) when it cannot use it: process 0 must be
able to listen on the port, and every other process retries a TCP connection to the address until
it succeeds or ``connect_timeout`` passes (at most the initialization timeout, and the time waited
counts towards the one JAX then gets). Either failure is a :class:`CoordinatorError` naming the
address. A TCP connection is all it checks: where another program answers on that port, JAX's
registration fails there and ends the process itself after the initialization timeout.
"""

from __future__ import annotations

import socket
import time

import jax

from k3_tail._checks import check_int

# Seconds between two connection attempts to a coordinator that is not (yet) listening.
CONNECT_RETRY_S = 0.2


class CoordinatorError(RuntimeError):
    """The coordinator's address cannot serve: process 0 cannot listen on its port, or nothing accepts
    connections there within the connect timeout (for the other processes)."""


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    local_cpu_devices: int | None = None,
    initialization_timeout: int = 300,
    connect_timeout: int | None = None,
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
        gloo, whose C++ runtime prints a "[Gloo] Rank R is connected to ..." line on stdout for each
        device as it connects (no setting turns it off); None keeps the default backend and its
        settings (the GPUs of a GPU host).
      initialization_timeout: seconds to wait for every process to join; a process whose peers never
        come aborts after it, instead of waiting forever.
      connect_timeout: seconds a process other than 0 first retries connecting to the coordinator
        before it raises CoordinatorError (process 0 not up yet, a wrong address, a closed port);
        None or more than ``initialization_timeout``: ``initialization_timeout``. The seconds it waited
        count towards ``initialization_timeout``.
      heartbeat_timeout_seconds: seconds without a heartbeat after which a process counts as dead;
        the others then abort instead of hanging in a collective.
      shutdown_timeout_seconds: seconds a process that ends waits at exit for the others to end too
        (JAX's shutdown barrier), after which it exits anyway. A process that fails should exit at
        once (``os._exit``) rather than wait there while its peers wait for it in a collective.

    Raises ValueError naming the argument for a bad value; CoordinatorError naming the address when
    process 0 cannot listen on its port or the coordinator cannot be reached in time; JAX's
    RuntimeError when its backend is already running.
    """
    split_address(coordinator_address)
    num_processes = check_int("num_processes", num_processes, minimum=1)
    process_id = check_int("process_id", process_id, minimum=0)
    if process_id >= num_processes:
        raise ValueError(f"process_id: expected an integer < num_processes={num_processes}, got {process_id}")
    if local_cpu_devices is not None:
        local_cpu_devices = check_int("local_cpu_devices", local_cpu_devices, minimum=1)
    initialization_timeout = check_int("initialization_timeout", initialization_timeout, minimum=1)
    if connect_timeout is not None:
        connect_timeout = check_int("connect_timeout", connect_timeout, minimum=1)
    heartbeat_timeout_seconds = check_int("heartbeat_timeout_seconds", heartbeat_timeout_seconds, minimum=1)
    shutdown_timeout_seconds = check_int("shutdown_timeout_seconds", shutdown_timeout_seconds, minimum=1)

    if process_id == 0:
        check_coordinator_port(coordinator_address)
    else:
        waited = wait_for_coordinator(coordinator_address, min(connect_timeout or initialization_timeout,
                                                               initialization_timeout))
        initialization_timeout = max(1, initialization_timeout - int(waited))
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


def split_address(address: object) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" (an IPv6 host in brackets, "[::1]:PORT", comes without them), or
    ValueError naming ``coordinator_address``."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address needs its brackets: which colon starts the port is otherwise unclear
    if not host or any(character.isspace() for character in host) or not (
            port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"coordinator_address: expected HOST:PORT with a port in 1..65535 (an IPv6 host in "
                         f"brackets), got {address!r}")
    return host, int(port)


def check_coordinator_port(address: str) -> None:
    """CoordinatorError unless this process (process 0) can listen on ``address``'s port, where JAX's
    coordinator serves (on every interface)."""
    _, port = split_address(address)
    try:
        probe, any_host = socket.socket(socket.AF_INET6, socket.SOCK_STREAM), "::"
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too, as the coordinator binds
    except OSError:  # a host without IPv6
        probe, any_host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
    try:
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((any_host, port))
    except OSError as error:
        raise CoordinatorError(f"coordinator {address}: process 0 cannot listen on port {port} ({error}); "
                               "is another program or an earlier run using it?") from None


def wait_for_coordinator(address: str, timeout_s: float) -> float:
    """Retry a TCP connection to ``address`` until one succeeds, at most ``timeout_s`` seconds; the
    seconds waited, or CoordinatorError naming the address."""
    host, port = split_address(address)
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return time.monotonic() - start
        except OSError as error:  # refused, unreachable, timed out, or a host name that does not resolve
            last_error = error
        if time.monotonic() + CONNECT_RETRY_S >= deadline:
            raise CoordinatorError(
                f"coordinator {address}: nothing accepts connections there after {timeout_s:g} s ({last_error}); "
                "is process 0 running on that host, with the port open to this one?"
            )
        time.sleep(CONNECT_RETRY_S)
