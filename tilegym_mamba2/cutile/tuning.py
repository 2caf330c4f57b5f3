"""Launch configuration: chunk length, tile sizes and segment length from the problem's shape."""
import functools
from dataclasses import dataclass

import torch

# Measured on H200 (benchmarks/NOTES.md): 64-token chunks run compute_out 2x faster than 128
# (the [chunk, chunk] score tile fits in registers), and the math is the same at any length.
KERNEL_CHUNK = 64
SEGMENT_CHUNKS = 16


@dataclass(frozen=True)
class Config:
    chunk_size: int           # the chunk length the kernels use
    chunks_per_segment: int   # sequential depth of one block; more segments = more parallel blocks
    state_head_tile: int      # segment_states / state_scan tile: head_size columns ...
    state_tile: int           # ... by state_size rows
    out_head_tile: int        # compute_out: head_size columns per block (the state it carries)


@functools.cache
def choose_config(batch, tokens, heads, head_size, state_size, chunk_size, device=None) -> Config:
    sms = _multiprocessor_count(device)
    kernel_chunk = min(chunk_size, KERNEL_CHUNK)
    # compute_out carries a [state_size, out_head_tile] fp32 state in registers: keep it <= 32 KiB.
    out_head_tile = min(head_size, max(16, 8192 // state_size))
    num_chunks = -(-tokens // kernel_chunk)
    blocks_per_segment = batch * heads * (head_size // out_head_tile)
    # Long segments save state traffic; shorten them only until there are two blocks per SM.
    chunks_per_segment = SEGMENT_CHUNKS
    while chunks_per_segment > 1 and blocks_per_segment * -(-num_chunks // chunks_per_segment) < 2 * sms:
        chunks_per_segment //= 2
    return Config(chunk_size=kernel_chunk, chunks_per_segment=chunks_per_segment,
                  state_head_tile=min(head_size, 64), state_tile=min(state_size, 64),
                  out_head_tile=out_head_tile)


@functools.cache
def _multiprocessor_count(device) -> int:
    if device is None or not torch.cuda.is_available():
        return 132  # an H100/H200; only used for sizing when no GPU is queried
    return torch.cuda.get_device_properties(device).multi_processor_count
