"""The "cutile" backend: three stages launched in order on the current CUDA stream.

    chunk_cumsum    dt, a          -> dt_bht, decay_cumsum   [batch, heads, padded tokens]
    fwd_pass_state  x, b, ...      -> entry_states (one per segment of chunks), final_state
    compute_out     x, b, c, d, ...-> out
"""
from dataclasses import dataclass

import torch

from ..validation import check_forward_args
from .chunk_cumsum import chunk_cumsum
from .compute_out import compute_out
from .fwd_pass_state import fwd_pass_state
from .tuning import Config, choose_config


@dataclass
class Stages:
    """Every intermediate of one forward call, for stage-by-stage checks."""
    config: Config
    dt_bht: torch.Tensor
    decay_cumsum: torch.Tensor
    entry_states: torch.Tensor
    final_state: torch.Tensor
    out: torch.Tensor


def mamba2_chunk_forward(x, a, b, c, d, dt, init_state=None, chunk_size=128):
    """Mamba-2 chunked forward on our cuTile kernels; see ``tilegym_mamba2.mamba2_chunk_forward``."""
    stages = run_stages(*check_forward_args(x, a, b, c, d, dt, init_state, chunk_size, backend="cutile"))
    return stages.out, stages.final_state


def run_stages(x, a, b, c, d, dt, init_state, chunk_size, config: Config | None = None) -> Stages:
    """Runs the three stages on already-checked arguments."""
    batch, tokens, heads, head_size = x.shape
    if config is None:
        config = choose_config(batch, tokens, heads, head_size, b.shape[3], chunk_size, x.device)
    # The kernels may cut chunks shorter than asked (config.chunk_size): the recurrence, and so
    # the result, does not depend on the chunk length.
    chunk = config.chunk_size
    dt_bht, decay_cumsum = chunk_cumsum(dt, a, chunk)
    entry_states, final_state = fwd_pass_state(x, b, dt_bht, decay_cumsum, init_state, chunk, config)
    out = compute_out(x, b, c, d, dt_bht, decay_cumsum, entry_states, chunk, config)
    return Stages(config, dt_bht, decay_cumsum, entry_states, final_state, out)
