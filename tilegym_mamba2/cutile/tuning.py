"""Launch configuration: tile sizes and segment length from the problem's shape."""
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Config:
    chunks_per_segment: int   # sequential depth of one block; more segments = more parallel blocks
    state_head_tile: int      # segment_states / state_scan tile: head_size rows ...
    state_tile: int           # ... by state_size columns
    out_head_tile: int        # compute_out: head_size rows per block (the state row-block it carries)


def choose_config(batch, tokens, heads, head_size, state_size, chunk_size, device=None) -> Config:
    sms = _multiprocessor_count(device)
    # compute_out carries a [out_head_tile, state_size] fp32 state in registers: keep it <= 32 KiB.
    out_head_tile = min(head_size, max(16, 8192 // state_size))
    num_chunks = -(-tokens // chunk_size)
    blocks_per_segment = batch * heads * (head_size // out_head_tile)
    # Enough segments for about four blocks per SM; beyond that more segments only add state traffic.
    segments = max(1, -(-4 * sms // blocks_per_segment))
    chunks_per_segment = max(1, -(-num_chunks // segments))
    return Config(chunks_per_segment=chunks_per_segment,
                  state_head_tile=min(head_size, 64), state_tile=min(state_size, 64),
                  out_head_tile=out_head_tile)


@functools.cache
def _multiprocessor_count(device) -> int:
    if device is None or not torch.cuda.is_available():
        return 132  # an H100/H200; only used for sizing when no GPU is queried
    return torch.cuda.get_device_properties(device).multi_processor_count
