"""The forward's host code: three stages launched in order on the current CUDA stream.

    chunk_cumsum    dt, a          -> dt_bht, decay_cumsum   [batch, heads, padded tokens]
    fwd_pass_state  x, b, ...      -> entry_states (one per segment of chunks), final_state
    compute_out     x, b, c, d, ...-> out

The layer op (layer.py) runs the same stages with its options switched on. Short rows may
run all three in one launch (chained_prefill.py), where the tuner timed that faster.
"""
from dataclasses import dataclass

import torch

from ..runtime import plan
from .chained_prefill import chained_prefill
from .chunk_cumsum import chunk_cumsum
from .compute_out import compute_out
from .fwd_pass_state import fwd_pass_state
from ..runtime.launch import new_output
from ..runtime.tuning import (Config, bucket_key, chained_fits, chained_wanted, choose_config, segment_count, tuned_config,
                     tuning_switches, whole_row_chunks)


@dataclass
class Stages:
    """Every intermediate of one forward call, for stage-by-stage checks (None where the chained
    path keeps them inside its kernel or its workspace)."""
    config: Config
    dt_bht: torch.Tensor | None
    decay_cumsum: torch.Tensor | None
    entry_states: torch.Tensor | None  # [batch, heads, segments * state_size, head_size] (fwd_pass_state.py)
    final_state: torch.Tensor
    out: torch.Tensor


def run_stages(x, a, b, c, d, dt, init_state, chunk_size, config: Config | None = None) -> Stages:
    """Runs the three stages on already-checked arguments."""
    if config is None:
        config = config_for(x, a, b, c, d, dt, init_state, chunk_size)
    if config.chained:
        out, final_state = chained_prefill(x, a, b, c, d, dt, init_state, config)
        return Stages(config, None, None, None, final_state, out)
    # The kernels use their own chunk length (config.chunk_size): the recurrence, and so the
    # result, does not depend on it.
    chunk = config.chunk_size
    dt_bht, decay_cumsum = chunk_cumsum(dt, a, chunk)
    entry_states, final_state, out = states_and_out(x, b, c, d, dt_bht, decay_cumsum, init_state, config)
    return Stages(config, dt_bht, decay_cumsum, entry_states, final_state, out)


def states_and_out(x, b, c, d, dt_bht, decay_cumsum, init_state, config, *, z=None, seq_idx=None, ungated=None):
    """Stages 2 and 3 -> (entry_states, final_state, out); ``ungated`` (with z): compute_out's. With one segment per row and no packed
    sequences, compute_out's blocks walk whole rows from the initial state and leave the final
    state, so the state pass has nothing to do."""
    chunk = config.chunk_size
    if seq_idx is not None or segment_count(dt_bht, chunk, config) > 1:
        entry_states, final_state = fwd_pass_state(x, b, dt_bht, decay_cumsum, init_state, chunk, config,
                                                   seq_idx=seq_idx)
        out = compute_out(x, b, c, d, dt_bht, decay_cumsum, entry_states, final_state, chunk, config, z=z,
                          seq_idx=seq_idx, ungated=ungated)
        return entry_states, final_state, out
    batch, _, heads, head_size = x.shape
    state_size = b.shape[3]
    if init_state is None:
        entry_states = torch.zeros(batch, heads, state_size, head_size, dtype=torch.float32, device=x.device)
    else:  # transposed, as the state pass stores entry states
        entry_states = init_state.transpose(-1, -2).contiguous()
    final_state = new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)
    out = compute_out(x, b, c, d, dt_bht, decay_cumsum, entry_states, final_state, chunk, config, z=z,
                      store_final=True, ungated=ungated)
    return entry_states, final_state, out


def config_for(x, a, b, c, d, dt, init_state, chunk_size, *, tune: bool | None = None,
               run_candidate=None) -> Config:
    """The heuristic config, or the measured one for this shape's bucket (see tuning.py).
    Measuring runs the plain op on these inputs (d may be None: a zero skip is used), or
    ``run_candidate(config)`` when given: the layer op times itself, so that it compiles only its
    own kernels and its segment length fits its options. Its choices are kept apart."""
    # Settled answers are remembered per exact shape (plan.py): the bucket lookup measured ~20 us
    # of host time per call, a tenth of a small call. The switches are part of the key.
    layer = run_candidate is not None
    memo_key = ("config", x.get_device(), x.dtype, x.shape, b.shape, chunk_size, tune, layer, *tuning_switches())
    config = plan.planned(memo_key)
    if config is not None:
        return config
    batch, tokens, heads, head_size = x.shape
    groups, state_size = b.shape[2], b.shape[3]
    base = choose_config(batch, tokens, groups, heads, head_size, state_size, chunk_size, x.device)
    key = bucket_key(torch.cuda.get_device_name(x.device), x.dtype, batch, tokens, heads, groups,
                     head_size, state_size, layer=layer)
    # Whole rows for the plain op only: the layer op timed them slowest of its candidates.
    whole_row = None if layer else whole_row_chunks(batch, tokens, heads, head_size, base, x.device)
    if run_candidate is None:
        if d is None:
            d = torch.zeros(heads, device=x.device)
        args = (x, a, b, c, d, dt, init_state, chunk_size)
        run_candidate = lambda config: run_stages(*args, config=config)  # noqa: E731
    chained = not layer and chained_wanted() and chained_fits(tokens, state_size, x.dtype)
    config = tuned_config(key, base, lambda config: _milliseconds(lambda: run_candidate(config)), tune=tune,
                          whole_row=whole_row, chained=chained)
    plan.remember(memo_key, config)  # not during capture: there the heuristic stands in
    return config


def _milliseconds(run, reps=10) -> float:
    run()  # warm-up; the candidates share compiled kernels
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
