"""The launch of one_kernel's fused kernel (:mod:`k3_tail.ops.fused_projection`): its grid, its warps, where it
compiles. Plain numbers, no Pallas, so that the cost model reads them without loading it."""

from __future__ import annotations

import dataclasses

from k3_tail.hardware import GPU_PLATFORMS

# Tile sizes: the MMA needs at least 16 rows, columns and depth; 16 bf16 columns are a 32-byte run (a sector).
COLUMN_TILE = 16
K_STEP = 64
LARGEST_ROW_TILE = 64
SMALLEST_ROW_TILE = 16
# Programs per call to aim for: AMD's MI300X tuning guide asks for at least about 1024 workgroups (304 CUs).
TARGET_PROGRAMS = 1024
# Warps a program on NVIDIA; one wavefront elsewhere (fused_projection's module docstring: memory ordering).
CUDA_WARPS = 4
COMPILED_ON = GPU_PLATFORMS
# int32 words from one tile's counter to the next: 128 bytes, so no two tiles' atomics share a cache line.
COUNTER_STRIDE = 32


def runs_interpreted_on(platform: str | None) -> bool:
    """Whether the kernel runs in Pallas's interpret mode on device ``platform``: off :data:`COMPILED_ON`."""
    return platform not in COMPILED_ON


def warps_per_program(platform: str | None) -> int:
    """Warps (wavefronts on AMD) a program of the kernel runs on device ``platform``: :data:`CUDA_WARPS` on
    "cuda", else 1, which makes the split's counter correct on AMD and on a GPU of unknown vendor."""
    return CUDA_WARPS if platform == "cuda" else 1


@dataclasses.dataclass(frozen=True)
class FusedGrid:
    """The kernel's grid: R, J, S = rows, columns, splits over row tiles of row_tile (16 to 64), column tiles
    of :data:`COLUMN_TILE` and slabs of K of ``split_depth`` (a multiple of :data:`K_STEP`)."""

    row_tile: int
    rows: int
    columns: int
    splits: int
    split_depth: int

    @property
    def programs(self) -> int:
        return self.rows * self.columns * self.splits

    @property
    def fills(self) -> bool:
        return self.programs >= TARGET_PROGRAMS

    def scratch_bytes(self, num_tokens: int) -> int:
        """Bytes of the kernel's scratch (partials, slab exponents, counters), each written and read once a call."""
        if self.splits == 1:
            return 0
        return 4 * (self.splits * num_tokens * self.columns * COLUMN_TILE
                    + self.splits * self.columns * num_tokens + self.rows * self.columns * COUNTER_STRIDE)


def fused_grid(num_tokens: int, latent_size: int, block_width: int, *,
               target_programs: int = TARGET_PROGRAMS) -> FusedGrid:
    """The :class:`FusedGrid` for T = ``num_tokens`` >= 1, L = ``latent_size`` and Hb = ``block_width``: K in the
    fewest slabs that give ``target_programs`` programs, at most L / (4T) (partials within half the weights)."""
    row_tile = min(max(SMALLEST_ROW_TILE, 1 << (num_tokens - 1).bit_length()), LARGEST_ROW_TILE)
    rows = -(-num_tokens // row_tile)
    columns = -(-block_width // COLUMN_TILE)
    steps = -(-latent_size // K_STEP)
    most = max(1, min(steps, latent_size // (4 * num_tokens)))
    wanted = min(-(-target_programs // (rows * columns)), most)
    depth_steps = max(1, steps // wanted)  # slabs of whole K steps: at least ``wanted`` of them
    if -(-steps // depth_steps) > most:
        depth_steps = -(-steps // most)
    return FusedGrid(row_tile, rows, columns, -(-steps // depth_steps), depth_steps * K_STEP)
