"""Stage 1: per-chunk cumulative decay sums, in the [batch, heads, tokens] layout.

Writes two fp32 tensors of shape [batch, heads, num_chunks * chunk_size]:
``dt_bht`` (dt, transposed so later stages read one head's chunk contiguously) and
``decay_cumsum`` (log2(e) * cumsum(a * dt) restarting at each chunk, so kernels use exp2).
Tokens past the end are written as dt = 0: they neither decay nor add to the state.
"""
import math

import cuda.tile as ct
import torch

from .launch import launch, new_output

LOG2E = math.log2(math.e)


@ct.kernel
def chunk_cumsum_kernel(dt, a, dt_bht, decay_cumsum,
                        chunk_size: ct.Constant[int], heads_tile: ct.Constant[int]):
    chunk, head_tile, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    dt_tile = ct.load(dt, (batch, chunk, head_tile), (1, chunk_size, heads_tile),
                      padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    a_tile = ct.load(a, (head_tile,), (heads_tile,), padding_mode=ct.PaddingMode.ZERO)
    dt_tile = dt_tile.reshape((chunk_size, heads_tile))
    cumsum = ct.cumsum(dt_tile * a_tile[None, :], axis=0) * LOG2E
    ct.store(dt_bht, (batch, head_tile, chunk),
             ct.transpose(dt_tile).reshape((1, heads_tile, chunk_size)))
    ct.store(decay_cumsum, (batch, head_tile, chunk),
             ct.transpose(cumsum).reshape((1, heads_tile, chunk_size)))


def chunk_cumsum(dt: torch.Tensor, a: torch.Tensor, chunk_size: int):
    """dt [batch, tokens, heads], a [heads] -> (dt_bht, decay_cumsum), both
    [batch, heads, num_chunks * chunk_size] fp32."""
    batch, tokens, heads = dt.shape
    num_chunks = -(-tokens // chunk_size)
    dt_bht = new_output(batch, heads, num_chunks * chunk_size, dtype=torch.float32, device=dt.device)
    decay_cumsum = new_output(batch, heads, num_chunks * chunk_size, dtype=torch.float32, device=dt.device)
    heads_tile = heads_tile_for(heads, chunk_size)
    grid = (num_chunks, -(-heads // heads_tile), batch)
    launch(grid, chunk_cumsum_kernel,
           (dt, a, dt_bht, decay_cumsum, chunk_size, heads_tile))
    return dt_bht, decay_cumsum


def heads_tile_for(heads: int, chunk_size: int) -> int:
    # Up to 4K elements per block: enough work per block, small enough to stay in registers.
    tile = 1
    while tile < heads and tile * chunk_size < 4096:
        tile *= 2
    return tile
