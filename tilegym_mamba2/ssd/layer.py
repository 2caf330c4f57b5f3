"""The layer op's host code, ``mamba_chunk_scan_combined``, on the same three stages as the plain op.

Every option is fused into a stage that already reads the data it needs: dt processing into
chunk_cumsum, sequence masks into the state pass and compute_out, D and z into compute_out.
With no options it runs the plain op's kernels (plus the dt clamp at (0, inf), a no-op on
valid dt): the same bits, tests/test_layer_cutile_gpu.py checks.
"""
from dataclasses import replace

import torch

from ..core.constants import VARLEN_MAX_SEGMENT_CHUNKS
from ..core.packing import per_sequence_init, seq_idx_from_cu_seqlens
from .forward import config_for, states_and_out
from .chunk_cumsum import chunk_cumsum
from .sequence_init import add_sequence_initial_states
from .varlen_states import varlen_states



def layer_config(args):
    """The layer op's config for checked arguments (core/validation.py, ScanCombinedArgs): tuned
    on the layer op itself (config_for)."""
    def run_candidate(candidate):
        run_layer(args, config=candidate)
    return config_for(args.x, args.A, args.B, args.C, None, args.dt, None, args.chunk_size,
                      run_candidate=run_candidate)


def run_layer(args, config=None, *, ungated=None):
    """Runs the stages on checked arguments (ScanCombinedArgs) -> (out, final_states, varlen_states
    or None, returned when args.return_varlen_states). ``ungated``: like x or None, with z and
    no per-sequence initial states (their terms join the gated output afterwards): gets y + D x,
    the output before its gate (autograd.keeps_ungated)."""
    x, dt, A, B, C, D, z = args.x, args.dt, args.A, args.B, args.C, args.D, args.z
    seq_idx, cu_seqlens, with_varlen_states = args.seq_idx, args.cu_seqlens, args.return_varlen_states
    batch, tokens = x.shape[:2]
    if config is None:
        config = layer_config(args)
    chunk = config.chunk_size
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32)
        if seq_idx is None:
            seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, tokens)
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    # The clamp is applied even at (0, inf), as the definition (ssd/dt.py, process_dt) says.
    dt_bht, decay_cumsum = chunk_cumsum(dt, A, chunk, dt_bias=args.dt_bias, softplus=args.dt_softplus,
                                        dt_limit=args.dt_limit)
    out, final_states, varlen, _ = scan_stages(x, B, C, D, z, dt_bht, decay_cumsum, args.initial_states, seq,
                                               cu_seqlens, config, with_varlen_states=with_varlen_states,
                                               ungated=ungated)
    if varlen is not None and with_varlen_states:
        varlen = varlen.to(C.dtype)  # mamba_ssm's dtype for them
    return out, final_states, varlen


def scan_stages(x, B, C, D, z, dt_bht, decay_cumsum, initial_states, seq, cu_seqlens, config, *,
                with_varlen_states=False, ungated=None):
    """Stages 2 and 3 with every packing option -> (out, final_states, varlen_states fp32 or None,
    entry_states as the state pass leaves them); ``ungated``: see run_layer.
    The backward's scans (ssd/scans.py) run them too, with their own weights and decays."""
    batch = x.shape[0]
    own_inits = per_sequence_init(initial_states, cu_seqlens, batch)
    assert ungated is None or not own_inits, "autograd.keeps_ungated says where ungated is kept"
    if with_varlen_states or own_inits:
        # Each varlen state walks up to a segment of chunks: shorter segments than the plain op's
        # tuned ones pay here (docs/design.md, Decisions: varlen segments).
        config = replace(config, chunks_per_segment=min(config.chunks_per_segment, VARLEN_MAX_SEGMENT_CHUNKS))
    chunk = config.chunk_size
    row_init = None if own_inits else initial_states
    entry_states, final_states, out = states_and_out(x, B, C, D, dt_bht, decay_cumsum, row_init, config, z=z,
                                                     seq_idx=seq, ungated=ungated)
    varlen = None
    if with_varlen_states or own_inits:
        varlen = varlen_states(x, B, dt_bht, decay_cumsum, seq, cu_seqlens, entry_states, chunk, config,
                               dtype=torch.float32)
    if own_inits:
        add_sequence_initial_states(out, varlen, x, C, z, decay_cumsum, cu_seqlens, initial_states, chunk, config)
        final_states = varlen[-1:].clone()
    elif varlen is not None:
        # The last sequence's state is the row's final state; both returned, they agree to the bit.
        varlen[-1] = final_states[0]
    return out, final_states, varlen, entry_states
