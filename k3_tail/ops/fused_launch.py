"""The launch of one_kernel's fused kernel (:mod:`k3_tail.ops.fused_projection`): its grid of tiles and slabs of K,
the warps of each program, the platforms where it compiles.

Plain numbers, no Pallas: the cost model, selection and the reports ask for the grid a call launches
without loading it.
"""

from __future__ import annotations

import dataclasses

from k3_tail.hardware import GPU_PLATFORMS

# Tile sizes: the MMA needs at least 16 rows, columns and depth; 16 bf16 columns are a 32-byte run (an NVIDIA
# sector; an AMD cache line's other half is the next tile's, read from the cache).
COLUMN_TILE = 16
K_STEP = 64
LARGEST_ROW_TILE = 64
SMALLEST_ROW_TILE = 16
# Programs per call to aim for: AMD's MI300X tuning guide asks for at least about 1024 workgroups (304
# CUs); on an H100 (132 SMs) that is about 8 a SM.
TARGET_PROGRAMS = 1024
# Warps a program on NVIDIA, whose acquire-release atomic orders the whole CTA through bar.sync; one
# wavefront elsewhere (module docstring).
CUDA_WARPS = 4
# The device platforms where Triton compiles the kernel (elsewhere it runs interpreted).
COMPILED_ON = GPU_PLATFORMS
# int32 words from one tile's counter to the next: 128 bytes, a cache line of its own on every GPU, so
# that no two tiles' atomics contend for one line.
COUNTER_STRIDE = 32


def runs_interpreted_on(platform: str | None) -> bool:
    """Whether the kernel runs in Pallas's interpret mode on device ``platform``: everywhere but on a GPU
    (:data:`COMPILED_ON`), where Triton compiles it."""
    return platform not in COMPILED_ON


def warps_per_program(platform: str | None) -> int:
    """Warps (wavefronts on AMD) a program of the kernel runs on device ``platform``: :data:`CUDA_WARPS` on
    "cuda", else 1. One wavefront a program is what makes the split's counter correct on AMD (module
    docstring); it is also the choice for a GPU whose vendor is not known. The cost: a program's 16-column
    tile is held by 64 lanes, not 256 (T <= 16: the other 3 wavefronts held only masked-off copies), and a
    compute unit hides memory latency with at most ~5 resident wavefronts of this kernel at 1568 programs on
    304 CUs, not ~20."""
    return CUDA_WARPS if platform == "cuda" else 1


@dataclasses.dataclass(frozen=True)
class FusedGrid:
    """The kernel's grid for T tokens, L = ``latent_size`` and a column block of Hb = ``block_width``.

    row_tile: rows a program multiplies (a power of two, 16 to 64). rows, columns, splits: R, J, S, the
    grid's extent over row tiles, column tiles of :data:`COLUMN_TILE` and slabs of K of ``split_depth``
    (a multiple of :data:`K_STEP`): the largest slab for which R*J*S reaches :data:`TARGET_PROGRAMS`,
    else the smallest the scratch cap allows (S = 1 when the row and column tiles alone reach it).
    """

    row_tile: int
    rows: int
    columns: int
    splits: int
    split_depth: int

    @property
    def programs(self) -> int:
        """R * J * S."""
        return self.rows * self.columns * self.splits

    @property
    def fills(self) -> bool:
        """Whether the grid reaches :data:`TARGET_PROGRAMS` programs."""
        return self.programs >= TARGET_PROGRAMS

    def scratch_bytes(self, num_tokens: int) -> int:
        """Bytes of the kernel's scratch outputs: partials, slab exponents, counters (none when S = 1). Each
        is written once and read once per call."""
        if self.splits == 1:
            return 0
        return 4 * (self.splits * num_tokens * self.columns * COLUMN_TILE
                    + self.splits * self.columns * num_tokens + self.rows * self.columns * COUNTER_STRIDE)


def fused_grid(num_tokens: int, latent_size: int, block_width: int, *,
               target_programs: int = TARGET_PROGRAMS) -> FusedGrid:
    """The :class:`FusedGrid` for T = ``num_tokens`` >= 1, L = ``latent_size`` and Hb = ``block_width``.

    K is split into the fewest slabs of whole K steps that give ``target_programs`` programs, but into at most
    L / (4T): the partials (4*S*T*Hb bytes, written and read once) stay within half a bf16 weight block's
    bytes. Kimi-K3 (L 3584): 1344 to 1568 programs at T <= 16 and p = 4, 8 or 16.
    """
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
