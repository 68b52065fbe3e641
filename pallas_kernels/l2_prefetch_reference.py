"""What the ``l2_prefetch`` kernel returns, in plain jnp: the maximum of each program's tiles."""

from __future__ import annotations

import jax.numpy as jnp


def tile_count(w, *, block_rows: int, cols: int) -> int:
    """How many tiles of ``block_rows x cols`` elements the matrix ``w`` holds, read as rows of ``cols``."""
    return w.size // (block_rows * cols)


def check_operands(w, *, tiles: int, programs: int, block_rows: int, cols: int) -> None:
    """ValueError naming the argument unless ``w`` is a floating matrix of whole tiles and ``tiles`` and
    ``programs`` fit it."""
    if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w must be a floating matrix, got {w.dtype} {w.shape}")
    for name, value in (("block_rows", block_rows), ("cols", cols), ("programs", programs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if w.size % (block_rows * cols):
        raise ValueError(f"w's {w.size} elements are not whole tiles of block_rows x cols = {block_rows} x {cols}")
    total = tile_count(w, block_rows=block_rows, cols=cols)
    if isinstance(tiles, bool) or not isinstance(tiles, int) or not 0 <= tiles <= total:
        raise ValueError(f"tiles must be an int in [0, {total}] for w {w.shape}, got {tiles!r}")


def l2_prefetch_reference(w, *, tiles: int, programs: int, block_rows: int = 64, cols: int = 512):
    """``float32 [programs]``: entry ``p`` is the maximum of tiles ``p, p + programs, ...`` among the first
    ``tiles`` of ``w`` (its elements in row-major order, ``block_rows * cols`` a tile), ``-inf`` where a
    program has none."""
    check_operands(w, tiles=tiles, programs=programs, block_rows=block_rows, cols=cols)
    tile_max = w.reshape(-1, block_rows * cols)[:tiles].astype(jnp.float32).max(axis=1)
    rounds = -(-tiles // programs)
    padded = jnp.full((rounds * programs,), -jnp.inf, jnp.float32).at[:tiles].set(tile_max)
    return padded.reshape(rounds, programs).max(axis=0, initial=-jnp.inf)
