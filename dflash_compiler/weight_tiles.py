"""The tiled weight layout: a linear's `[n, k]` weight stored as 64 x 64 tiles, each tile's rows in turn.

A row-major weight puts a warpgroup GEMM's slot (64 weight rows by one 64-wide k atom) in 64 runs of 128
bytes, one weight row (k · 2 bytes, 8 KiB for k = 4096) apart; DRAM then opens a page for each run. Tiled,
the same slot is one contiguous run of 8 KiB (4 KiB of e4m3): tile (i, j) holds rows [64 i, 64 i + 64) and
columns [64 j, 64 j + 64), row-major inside the tile, the tiles of a row block along k in turn, then the next
row block. The element of row `r`, column `c` is at offset

    ((r // 64) · (k / 64) + c // 64) · 4096 + (r % 64) · 64 + c % 64

of the same n · k elements (n and k multiples of 64), so the tensor keeps its `[n, k]` shape, dtype and size,
and a 16-byte vector of a row (8 bf16, 16 e4m3, aligned) stays one 16-byte vector. `ir_passes/tile_weights.py`
decides which weights take it (transform `tiles`), and every kernel that reads such a weight addresses it
through `tile_index`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

TILE = 64  # rows and columns of one tile


def tileable(n: int, k: int) -> bool:
    """Whether an `[n, k]` weight can be tiled: whole tiles both ways."""
    return n > 0 and k > 0 and n % TILE == 0 and k % TILE == 0


def _require(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(shape) != 2 or not tileable(*shape):
        raise ValueError(
            f"{what}: expected a 2-D weight whose rows and columns are multiples of {TILE}, got shape {list(shape)}"
        )
    return shape[0], shape[1]


def to_tiles(w: np.ndarray) -> np.ndarray:
    """The tiled layout of row-major `w` (same shape and dtype; module docstring)."""
    n, k = _require(np.shape(w), "to_tiles")
    blocks = np.asarray(w).reshape(n // TILE, TILE, k // TILE, TILE).swapaxes(1, 2)
    return np.ascontiguousarray(blocks).reshape(n, k)


def from_tiles(w: np.ndarray) -> np.ndarray:
    """Row-major `w` back from its tiled layout: `from_tiles(to_tiles(w)) == w`."""
    n, k = _require(np.shape(w), "from_tiles")
    blocks = np.asarray(w).reshape(n // TILE, k // TILE, TILE, TILE).swapaxes(1, 2)
    return np.ascontiguousarray(blocks).reshape(n, k)


def tile_offset(row: Any, col: Any, k: int) -> Any:
    """The element offset of (row, col) in the tiled layout of a weight of `k` columns (ints or TIR)."""
    return ((row // TILE) * (k // TILE) + col // TILE) * (TILE * TILE) + row % TILE * TILE + col % TILE


def tile_index(tiles: int, row: Any, col: Any, k: int) -> tuple[Any, Any]:
    """The `[n, k]` buffer index that holds element (row, col) of a weight in layout `tiles` (0: row-major,
    TILE: tiled). The kernels' accesses go through it, so one kernel serves both layouts."""
    if tiles == 0:
        return row, col
    if tiles != TILE:
        raise ValueError(f"weight layout tiles={tiles}: expected 0 (row-major) or {TILE} (tiled)")
    offset = tile_offset(row, col, k)
    return offset // k, offset % k
