"""Stage 1: per-chunk cumulative decay sums, in the [batch, heads, tokens] layout.

Writes two fp32 tensors of shape [batch, heads, num_chunks * chunk_size]:
``dt_bht`` (dt, transposed so later stages read one head's chunk contiguously) and
``decay_cumsum`` (log2(e) * cumsum(a * dt) restarting at each chunk, so kernels use exp2).
Tokens past the end are written as dt = 0: they neither decay nor add to the state.

The layer op passes raw dt: ``dt = clamp(softplus?(dt + dt_bias), low, high)`` happens here, on
the tile already in registers, so processed dt never makes a round trip through memory.
"""
import math

import cuda.tile as ct
import torch

from ..core.constants import LOG2E, LOG_DECAY_FLOOR, SOFTPLUS_THRESHOLD
from ..runtime.launch import launch, new_output
from ..runtime.tile_math import log1p



@ct.kernel
def chunk_cumsum_kernel(dt, a, dt_bias, dt_bht, decay_cumsum,
                        chunk_size: ct.Constant[int], heads_tile: ct.Constant[int],
                        has_bias: ct.Constant[bool], softplus: ct.Constant[bool], clamp: ct.Constant[bool],
                        dt_low: ct.Constant[float], dt_high: ct.Constant[float]):
    chunk, head_tile, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    dt_tile = ct.load(dt, (batch, chunk, head_tile), (1, chunk_size, heads_tile),
                      padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    a_tile = ct.load(a, (head_tile,), (heads_tile,), padding_mode=ct.PaddingMode.ZERO)
    dt_tile = dt_tile.reshape((chunk_size, heads_tile))
    if has_bias or softplus or clamp:
        # Padded tokens must stay at dt = 0 whatever bias, softplus or clamp would make of them.
        token = chunk * chunk_size + ct.arange(chunk_size, dtype=ct.int32)
        real = (token < dt.shape[1])[:, None]
        if has_bias:
            dt_tile = dt_tile + ct.load(dt_bias, (head_tile,), (heads_tile,),
                                        padding_mode=ct.PaddingMode.ZERO)[None, :]
        if softplus:
            dt_tile = ct.where(dt_tile > SOFTPLUS_THRESHOLD, dt_tile, log1p(ct.exp(dt_tile)))
        if clamp:
            # Selects, not minimum/maximum: those return the number where dt is NaN, which must
            # stay NaN (a NaN dt gives NaN outputs, as on the pytorch backend).
            dt_tile = ct.where(dt_tile < dt_low, dt_low, dt_tile)
            dt_tile = ct.where(dt_tile > dt_high, dt_high, dt_tile)
        dt_tile = ct.where(real, dt_tile, 0.0)
    # core.tensors.log_decay's limits: no decay where dt = 0 (whatever a), none past the floor.
    decay = ct.where(dt_tile == 0.0, 0.0, dt_tile * a_tile[None, :])
    decay = ct.where(decay < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, decay)
    cumsum = ct.cumsum(decay, axis=0) * LOG2E
    ct.store(dt_bht, (batch, head_tile, chunk),
             ct.transpose(dt_tile).reshape((1, heads_tile, chunk_size)))
    ct.store(decay_cumsum, (batch, head_tile, chunk),
             ct.transpose(cumsum).reshape((1, heads_tile, chunk_size)))


@ct.kernel
def given_decay_cumsum_kernel(weight, log_decay, weight_bht, decay_cumsum, chunk_size: ct.Constant[int],
                              heads_tile: ct.Constant[int]):
    chunk, head_tile, batch = ct.bid(0), ct.bid(1), ct.bid(2)
    shape = (chunk_size, heads_tile)
    weight_tile = ct.load(weight, (batch, chunk, head_tile), (1, *shape), padding_mode=ct.PaddingMode.ZERO)
    decay_tile = ct.load(log_decay, (batch, chunk, head_tile), (1, *shape), padding_mode=ct.PaddingMode.ZERO)
    cumsum = ct.cumsum(decay_tile.reshape(shape), axis=0) * LOG2E
    ct.store(weight_bht, (batch, head_tile, chunk), ct.transpose(weight_tile.reshape(shape)).reshape(
        (1, heads_tile, chunk_size)))
    ct.store(decay_cumsum, (batch, head_tile, chunk), ct.transpose(cumsum).reshape((1, heads_tile, chunk_size)))


def chunk_cumsum(dt: torch.Tensor, a: torch.Tensor, chunk_size: int, *, dt_bias=None, softplus=False,
                 dt_limit=None):
    """dt [batch, tokens, heads], a [heads] -> (dt_bht, decay_cumsum), both
    [batch, heads, num_chunks * chunk_size] fp32. With dt_bias, softplus or dt_limit (low, high),
    dt is processed first, as the layer op defines it."""
    batch, tokens, heads = dt.shape
    num_chunks = -(-tokens // chunk_size)
    # One allocation for both (each costs microseconds of host time on small calls).
    dt_bht, decay_cumsum = new_output(2, batch, heads, num_chunks * chunk_size, dtype=torch.float32,
                                      device=dt.device).unbind(0)
    heads_tile = heads_tile_for(heads, chunk_size)
    grid = (num_chunks, -(-heads // heads_tile), batch)
    low, high = dt_limit if dt_limit is not None else (0.0, math.inf)
    # dt_limit is a model constant (usually (0, inf)): compiled in, not passed per call.
    launch(grid, chunk_cumsum_kernel,
           (dt, a, a if dt_bias is None else dt_bias, dt_bht, decay_cumsum, chunk_size, heads_tile,
            dt_bias is not None, bool(softplus), dt_limit is not None, float(low), float(high)))
    return dt_bht, decay_cumsum


def given_decay_cumsum(weight: torch.Tensor, log_decay: torch.Tensor, chunk_size: int):
    """The same layout for the backward's scans, whose weight and log decay are given rather than
    dt and a * dt: weight, log_decay [batch, tokens, heads] fp32 -> (weight_bht, decay_cumsum),
    both [batch, heads, num_chunks * chunk_size] fp32, padded tokens weight 0 and no decay (one
    launch instead of five torch ops: a fill, two transposing copies, a cumsum and a scaling)."""
    batch, tokens, heads = weight.shape
    num_chunks = -(-tokens // chunk_size)
    weight_bht, decay_cumsum = new_output(2, batch, heads, num_chunks * chunk_size, dtype=torch.float32,
                                          device=weight.device).unbind(0)
    heads_tile = heads_tile_for(heads, chunk_size)
    launch((num_chunks, -(-heads // heads_tile), batch), given_decay_cumsum_kernel,
           (weight, log_decay, weight_bht, decay_cumsum, chunk_size, heads_tile))
    return weight_bht, decay_cumsum


def heads_tile_for(heads: int, chunk_size: int) -> int:
    # Up to 4K elements per block: enough work per block, small enough to stay in registers.
    tile = 1
    while tile < heads and tile * chunk_size < 4096:
        tile *= 2
    return tile
