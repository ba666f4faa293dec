"""Timing the tiers: wall time of :func:`k3_tail.tail_forward` per (token count, tier) on a mesh.

What a measurement is: inputs random with a fixed seed, placed on the mesh before timing (the
weights once, each token count's partials once), so that no host transfer is timed; each
(T, tier) first runs ``warmup`` times (the first run compiles), then ``repeats`` timed runs, each
waiting for its result (``block_until_ready``). A :class:`Measurement` keeps the median, the
quartiles and the extremes of those runs in seconds. Times include the Python dispatch of
:func:`k3_tail.tail_forward`, as a caller sees it.

The "bare local GEMM" (:func:`measure_local_gemm`) is the floor a tier's compute cannot go under:
the [T, L] x [L, columns] projection alone, bf16 (the config's dtype) in, float32 accumulated,
without the norm, the collectives or the add. :func:`local_gemm_columns` says which width each
tier's rank projects.

Token ladder: :func:`token_ladder` gives 1, 2, 4, ... up to 8192. On the CPU backend
:func:`default_token_counts` stops it at ``CPU_MAX_TOKENS`` = 1024: at Kimi-K3 shapes a forced-device
CPU mesh shares the host's cores, and one column-layout call at T = 1024 already does a whole
2*T*L*H = 53 GFLOP projection (1/p of it on each of p devices), so ``k3-tail bench``'s ladder to
1024 takes about 1.5 minutes on 2 cores (docs/measurements/2026-11-30-gemm-floor.md), and each further
doubling of T would double that. Explicit token counts are never trimmed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3_tail._checks import AxisName, check_int, check_mesh
from k3_tail.config import TailConfig
from k3_tail.forward import tail_forward
from k3_tail.hardware import device_platform
from k3_tail.ops.columns import check_weight_layout, pad_columns, padded_hidden_size
from k3_tail.ops.up_projection import column_sharding, quantize_up_proj
from k3_tail.tiers.registry import Tier

DEFAULT_MAX_TOKENS = 8192
CPU_MAX_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class Timing:
    """Statistics of ``repeats`` timed runs, in seconds: median, extremes and quartiles.

    The quartiles interpolate linearly between runs (numpy's default), so
    min_s <= q25_s <= median_s <= q75_s <= max_s.
    """

    median_s: float
    min_s: float
    max_s: float
    q25_s: float
    q75_s: float
    repeats: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Timing:
        """The statistics of the run times ``seconds`` (at least one)."""
        low, q25, median, q75, high = np.percentile(np.asarray(seconds, dtype=np.float64), [0, 25, 50, 75, 100])
        return cls(median_s=float(median), min_s=float(low), max_s=float(high), q25_s=float(q25), q75_s=float(q75),
                   repeats=len(seconds))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One tier at one token count T on a TP mesh of size p, and the :class:`Timing` of its runs."""

    tier: Tier
    num_tokens: int
    tp_size: int
    weight_layout: str
    timing: Timing

    def to_dict(self) -> dict[str, Any]:
        """Plain data, one flat record (the tier as its value, e.g. "overlap", then the timing's
        fields): a JSON object or a CSV row."""
        return {"tier": self.tier.value, "num_tokens": self.num_tokens, "tp_size": self.tp_size,
                "weight_layout": self.weight_layout, **dataclasses.asdict(self.timing)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """The inverse of :meth:`to_dict` (also takes a CSV row's strings)."""
        timing = {field.name: (int if field.name == "repeats" else float)(data[field.name])
                  for field in dataclasses.fields(Timing)}
        return cls(Tier.parse(data["tier"]), int(data["num_tokens"]), int(data["tp_size"]), str(data["weight_layout"]),
                   Timing(**timing))

    @classmethod
    def field_names(cls) -> list[str]:
        """The keys of :meth:`to_dict`, in order: the CSV header."""
        return ["tier", "num_tokens", "tp_size", "weight_layout", *(field.name for field in dataclasses.fields(Timing))]


def token_ladder(max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[int, ...]:
    """1, 2, 4, ... (powers of 2 below ``max_tokens``), then ``max_tokens`` itself."""
    max_tokens = check_int("max_tokens", max_tokens, minimum=1)
    ladder = []
    tokens = 1
    while tokens < max_tokens:
        ladder.append(tokens)
        tokens *= 2
    return (*ladder, max_tokens)


def default_token_counts(platform_name: str) -> tuple[int, ...]:
    """The default ladder for a backend: up to 8192, on "cpu" up to ``CPU_MAX_TOKENS`` (module docstring)."""
    return token_ladder(CPU_MAX_TOKENS if platform_name == "cpu" else DEFAULT_MAX_TOKENS)


def tiers_for(weight_layout: str, config: TailConfig | None = None, *, platform: str | None = None) -> tuple[Tier, ...]:
    """Every tier that runs with ``weight_layout`` (and ``config``, when given), in :class:`Tier` order; with
    a device ``platform``, not those that run interpreted there (one_kernel on a CPU: nothing to time)."""
    check_weight_layout(weight_layout)
    return tuple(tier for tier in Tier if tier.supports(weight_layout, config)
                 and not (platform is not None and tier.record.runs_interpreted_on(platform)))


def check_tiers(
    tiers: Iterable[Tier | str] | None, weight_layout: str, config: TailConfig | None = None, *,
    platform: str | None = None,
) -> tuple[Tier, ...]:
    """``tiers`` parsed (None: :func:`tiers_for` the layout, config and platform); ValueError naming ``tiers``
    when one is unknown, given twice or cannot run (:meth:`Tier.why_not`), or none is given."""
    if tiers is None:
        return tiers_for(weight_layout, config, platform=platform)
    check_weight_layout(weight_layout)
    parsed = tuple(Tier.parse(tier, argument="tiers") for tier in tiers)
    if not parsed:
        raise ValueError("tiers: expected at least one tier")
    for index, tier in enumerate(parsed):
        if tier in parsed[:index]:
            raise ValueError(f"tiers: {tier.value} is given twice")
        reason = tier.why_not(weight_layout, config)
        if reason is not None:
            raise ValueError(f"tiers: {reason}")
    return parsed


def local_gemm_columns(tier: Tier | str, config: TailConfig, tp_size: int, weight_layout: str) -> int:
    """The width of one rank's projection [T, L] x [L, columns] in ``tier``: all H when it projects
    every column with the replicated kernel, else its column block ``padded_hidden_size(H, p) / p``
    (the tier record's ``gemm_columns``)."""
    return Tier.parse(tier).record.gemm_columns(config.hidden_size, tp_size, check_weight_layout(weight_layout))


def measure_tiers(
    config: TailConfig,
    mesh: Mesh,
    token_counts: Sequence[int],
    *,
    tiers: Sequence[Tier | str] | None = None,
    weight_layout: str = "column",
    repeats: int = 5,
    warmup: int = 1,
    axis_name: AxisName = "tp",
    seed: int = 0,
    on_progress: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Time :func:`tail_forward` for each token count x tier on ``mesh`` (module docstring).

    Args:
      config: the tail's shapes and numerics (any :class:`TailConfig`; its selection switches do not
        matter, every tier is forced).
      mesh: a Mesh with axis ``axis_name`` of size p (other axes replicate the computation).
      token_counts: T values, each >= 1, measured in this order.
      tiers: the tiers to time, in this order; None: every tier that runs with ``weight_layout`` and
        ``config``, compiled on the mesh's platform (:func:`tiers_for`).
      weight_layout: "column" or "replicated" kernel (see :mod:`k3_tail.ops.columns`).
      repeats: timed runs per (T, tier), >= 1. warmup: untimed runs before them, >= 1 (the first
        compiles).
      seed: of the random inputs. on_progress: called with a label ("p=8 T=64 overlap") as each
        (T, tier) measurement starts.

    Returns one :class:`Measurement` per (T, tier), T-major. Bad arguments raise ValueError naming
    the argument before anything runs: a tier that cannot run with the layout or config, a T < 1, ...
    """
    tp_size = check_mesh(mesh, axis_name)
    tiers = check_tiers(tiers, weight_layout, config, platform=device_platform(mesh.devices.flat[0]))
    token_counts = [check_int("token_counts", tokens, minimum=1) for tokens in token_counts]
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=1)
    rng = np.random.default_rng(seed)
    norm_weight, up_proj_kernel = place_weights(config, mesh, weight_layout, rng, axis_name=axis_name)
    measurements = []
    for num_tokens in token_counts:
        routed_partials, shared_partials = place_partials(config, mesh, num_tokens, rng, axis_name=axis_name)
        forward = functools.partial(
            tail_forward, routed_partials, shared_partials, norm_weight, up_proj_kernel,
            config=config, mesh=mesh, axis_name=axis_name, weight_layout=weight_layout,
        )
        for tier in tiers:
            if on_progress is not None:
                on_progress(f"p={tp_size} T={num_tokens} {tier.value}")
            _, _, timing = time_runs(functools.partial(forward, tier=tier), repeats=repeats, warmup=warmup)
            measurements.append(Measurement(tier, num_tokens, tp_size, weight_layout, timing))
    return measurements


def measure_local_gemm(
    config: TailConfig,
    mesh: Mesh,
    num_tokens: int,
    *,
    columns: int,
    repeats: int = 5,
    warmup: int = 1,
    concurrent: bool = False,
    axis_name: AxisName = "tp",
    seed: int = 0,
) -> Timing:
    """Time the bare local GEMM [T, L] x [L, columns] (``config.dtype`` in, float32 out and accumulated).

    ``concurrent=False``: on the mesh's first device alone, the floor of one rank's compute.
    ``concurrent=True``: every device along ``axis_name`` multiplies its own [T, L] x [L, columns]
    block at the same time (under ``jax.shard_map``, no collective): the floor of a whole TP step
    where the devices share hardware, as forced CPU devices share the host's cores.
    Warm-up and repeats as :func:`measure_tiers`.
    """
    tp_size = check_mesh(mesh, axis_name)
    num_tokens = check_int("num_tokens", num_tokens, minimum=1)
    columns = check_int("columns", columns, minimum=1)
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=1)
    rng = np.random.default_rng(seed)
    copies = tp_size if concurrent else 1
    latent = rng.standard_normal((copies, num_tokens, config.latent_size), dtype=np.float32)
    kernel = rng.standard_normal((copies, config.latent_size, columns), dtype=np.float32) / np.sqrt(config.latent_size)

    def gemm(x, w):
        return jnp.einsum("btl,blc->btc", x, w, preferred_element_type=jnp.float32)

    if concurrent:
        where = NamedSharding(mesh, P(axis_name))
        gemm = jax.shard_map(gemm, mesh=mesh, in_specs=(P(axis_name), P(axis_name)), out_specs=P(axis_name))
    else:
        where = mesh.devices.flat[0]
    latent, kernel = (jax.device_put(jnp.asarray(x, dtype=config.dtype), where) for x in (latent, kernel))
    run = functools.partial(jax.jit(gemm), latent, kernel)
    _, _, timing = time_runs(run, repeats=repeats, warmup=warmup)
    return timing


def time_runs(run: Callable[[], jax.Array], *, repeats: int, warmup: int = 1) -> tuple[jax.Array, float, Timing]:
    """Call ``run`` ``warmup`` times (the first compiles), then ``repeats`` timed times; every call
    waits for its result.

    Returns the last warm-up output, the warm-up calls' total wall time in seconds and the
    :class:`Timing` of the timed calls.
    """
    start = time.perf_counter()
    for _ in range(warmup):
        output = run().block_until_ready()
    warmup_seconds = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run().block_until_ready()
        seconds.append(time.perf_counter() - start)
    return output, warmup_seconds, Timing.of(seconds)


def time_round_robin(
    calls: Mapping[Hashable, Callable[[], jax.Array]], *, rounds: int, warmup: int = 1,
    on_progress: Callable[[str], None] | None = None,
) -> dict[Hashable, list[float]]:
    """Wall seconds of each call in ``calls``, measured in one interleaved run.

    Every call runs ``warmup`` times untimed (the first compiles), then ``rounds`` rounds each run every call once,
    timed with ``time.perf_counter`` around the call and ``block_until_ready``; the order rotates
    by one each round, so a load drift on a shared machine hits every call alike. Returns the
    ``rounds`` times of each call, by its key. ``on_progress`` gets "compiling KEY" and "round i/n".
    """
    report = on_progress or (lambda message: None)
    for key, call in calls.items():
        report(f"compiling {key}")
        for _ in range(check_int("warmup", warmup, minimum=1)):
            call().block_until_ready()
    keys = list(calls)
    seconds: dict[Hashable, list[float]] = {key: [] for key in keys}
    for index in range(check_int("rounds", rounds, minimum=1)):
        report(f"round {index + 1}/{rounds}")
        for key in keys[index % len(keys):] + keys[: index % len(keys)]:
            start = time.perf_counter()
            calls[key]().block_until_ready()
            seconds[key].append(time.perf_counter() - start)
    return seconds


def place_weights(
    config: TailConfig, mesh: Mesh, weight_layout: str, rng: np.random.Generator, *, axis_name: AxisName = "tp"
) -> tuple[jax.Array | None, jax.Array]:
    """Random norm weight [L] (1 + 0.1 randn, replicated; None without the norm) and up-projection
    kernel (randn / sqrt(L), in ``config.dtype``; quantised when ``config.up_proj_dtype`` is FP8).

    The kernel is [L, H] replicated, or for the "column" layout column-sharded ``P(None, axis_name)``,
    stored with zero columns up to ``padded_hidden_size(H, p)`` when p does not divide H. The norm
    weight is drawn even when unused, so that the kernel is the same with and without the norm.
    """
    latent, hidden = config.latent_size, config.hidden_size
    norm_weight = 1 + 0.1 * rng.standard_normal(latent, dtype=np.float32)
    kernel = jnp.asarray(rng.standard_normal((latent, hidden), dtype=np.float32) / np.sqrt(latent), config.dtype)
    if config.up_proj_dtype is not None:
        kernel = quantize_up_proj(kernel, config.up_proj_dtype)
    columns = axis_name if check_weight_layout(weight_layout) == "column" else None
    if columns is not None:
        kernel = pad_columns(kernel, padded_hidden_size(hidden, check_mesh(mesh, axis_name)))
    norm = place(norm_weight, config, mesh, P()) if config.use_latent_norm else None
    return norm, jax.device_put(kernel, column_sharding(kernel, mesh, columns))


def place_partials(
    config: TailConfig, mesh: Mesh, num_tokens: int, rng: np.random.Generator, *, axis_name: AxisName = "tp"
) -> tuple[jax.Array, jax.Array | None]:
    """Random routed [p, T, L] and shared [p, T, H] partials (randn / sqrt(p)), rank i holding entry i.

    With ``config.routed_output_is_reduced`` the routed output is one replicated [T, L] (the sum), with
    ``config.shared_output_is_reduced`` the shared output one replicated [T, H]; without shared
    experts the shared partial is None.
    """
    tp_size = check_mesh(mesh, axis_name)
    scale = 1 / np.sqrt(tp_size)
    routed = scale * rng.standard_normal((tp_size, num_tokens, config.latent_size), dtype=np.float32)
    if config.routed_output_is_reduced:
        routed = place(routed.sum(axis=0), config, mesh, P())
    else:
        routed = place(routed, config, mesh, P(axis_name))
    if not config.has_shared_experts:
        return routed, None
    shared = scale * rng.standard_normal((tp_size, num_tokens, config.hidden_size), dtype=np.float32)
    if config.shared_output_is_reduced:
        return routed, place(shared.sum(axis=0), config, mesh, P())
    return routed, place(shared, config, mesh, P(axis_name))


def place(host_array: np.ndarray, config: TailConfig, mesh: Mesh, spec: P) -> jax.Array:
    """``host_array`` cast to ``config.dtype`` and put on ``mesh`` with sharding ``spec``."""
    return jax.device_put(jnp.asarray(host_array, dtype=config.dtype), NamedSharding(mesh, spec))


def config_dict(config: TailConfig) -> dict[str, Any]:
    """``config`` as plain data (the dtype by name)."""
    up_proj_dtype = None if config.up_proj_dtype is None else config.up_proj_dtype.name
    return {**dataclasses.asdict(config), "dtype": config.dtype.name, "up_proj_dtype": up_proj_dtype}


def machine_info() -> dict[str, Any]:
    """Where a measurement ran: Python, jax and jaxlib versions, backend and devices, host CPU
    (logical cores, model from /proc/cpuinfo where it exists), RAM in GiB and the 1-minute load
    average (os.getloadavg) at the time of the call."""
    devices = jax.devices()
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: the platform module's answer below
    return platform.processor() or "unknown"


def _ram_gib() -> float | None:
    if sys.platform.startswith("linux"):
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return None
