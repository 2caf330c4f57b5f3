"""The backward's scans on the forward's kernels (backward.py says which scans and why).

A scan with its own per-token weight and log decay is the layer op's stages 2 and 3
(scan_combined.scan_stages) given those two in the [batch, heads, tokens] layout that
chunk_cumsum would have made: the kernels never tie the weight to the decay. Shapes follow
the heuristic config; the backward's role swaps (head_size <-> state_size) are shapes the
forward already runs.
"""
from dataclasses import replace

import torch

from ..core.constants import KERNEL_CHUNK
from ..core.packing import per_sequence_init
from ..core.tensors import group_sums
from .chunk_cumsum import given_decay_cumsum
from .chunk_grads import chunk_grads as chunk_grads_kernel
from .chunk_states_walk import chunk_states_walk
from .layer import scan_stages
from ..runtime.tuning import choose_config


def scan(x, b, c, weight, log_decay, init=None, seq_idx=None, cu_seqlens=None, *, outputs=True):
    """x [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size] in x's dtype;
    weight, log_decay [batch, tokens, heads] fp32 -> (y in x's dtype or None, final_states fp32,
    varlen_states fp32 with cu_seqlens else None, chunk states for chunk_grads: entry states, one
    per chunk, and the decay sums), see ssd/reference/scans.py. One segment per chunk;
    without ``outputs`` only the state pass runs."""
    batch, tokens, heads, head_size = x.shape
    groups, state_size = b.shape[2], b.shape[3]
    config = replace(choose_config(batch, tokens, groups, heads, head_size, state_size, KERNEL_CHUNK, x.device),
                     chunks_per_segment=1)
    chunk = config.chunk_size
    weight_bht, decay_cumsum = given_decay_cumsum(weight.float().contiguous(), log_decay.float().contiguous(), chunk)
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous()
    if init is not None:
        init = init.to(torch.float32).contiguous()
    x, b, c = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, b, c))
    if not outputs:
        # Chunk states only: per-sequence initial states stay out of them, as in scan_stages.
        row_init = None if per_sequence_init(init, cu, batch) else init
        # The walk: the state pass's bits, 2.0-2.4x faster, packed sequences included
        # (docs/design.md, Decisions).
        entry_states, final_states = chunk_states_walk(x, b, weight_bht, decay_cumsum, row_init, chunk, seq_idx=seq)
        return None, final_states, None, (entry_states, decay_cumsum, weight_bht)
    y, final_states, varlen, entry_states = scan_stages(x, b, c, None, None, weight_bht, decay_cumsum, init, seq, cu,
                                                        config, with_varlen_states=cu is not None)
    return y, final_states, varlen, (entry_states, decay_cumsum, weight_bht)


def reversed_scan(dy, c, forward_states, dfinal_states, seq_idx=None):
    """The scan of dh from the last chunk to the first on dy and c as they are (packed sequences
    in seq_idx, or one per row) -> (None, dh before the first token's decay, None, (its entry
    states in reversed chunk order,)), what the scan on token-flipped inputs gives (backward.py)."""
    decay_cumsum = forward_states[1]
    if dfinal_states is not None:
        dfinal_states = dfinal_states.to(torch.float32).contiguous()
    dy, c = (t if t.stride(-1) == 1 else t.contiguous() for t in (dy, c))
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    entry_states, dh_first = chunk_states_walk(dy, c, decay_cumsum, decay_cumsum, dfinal_states, KERNEL_CHUNK, reverse=True,
                                               seq_idx=seq)
    return None, dh_first, None, (entry_states,)


def chunk_grads(x, b, c, dy, a, seq_idx, forward_states, reverse_states, skip, dy_low=None):
    """From the forward scan's and the reversed scan's chunk states -> (dx = dt * dh b + skip * dy
    like x, ddt = x . dh b + a dl [batch, tokens, heads] fp32, da = sum of dt dl [heads] fp32, db
    and dc [batch, tokens, groups, state_size] fp32, dskip = the sum of dy * x like skip, fp32,
    or None); a [heads] fp32; skip [heads, 1] or [heads, head_size] or None; dy_low: what
    rounding dy to x's dtype left out, or None (backward.scan_backward)."""
    entry_states, decay_cumsum, weight_bht = forward_states
    rev_entry_states = reverse_states[0]
    groups = b.shape[2]
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    per_head = skip is not None and skip.shape[1] == 1
    if skip is not None:
        skip = (skip[:, 0] if per_head else skip).to(torch.float32).contiguous()
    dx, ddt, da, db, dc, dd = chunk_grads_kernel(
        x.contiguous(), b.contiguous(), c.contiguous(), dy.contiguous(),
        None if dy_low is None else dy_low.contiguous(), weight_bht, decay_cumsum, entry_states,
        rev_entry_states, seq, skip, a.contiguous(), KERNEL_CHUNK)
    ddt = ddt[:, :, :x.shape[1]].transpose(1, 2).contiguous()
    dskip = None if dd is None else dd.sum((0, 1))
    if per_head:
        dskip = dskip[:, None]
    return dx, ddt, da.sum((0, 2)), group_sums(db, groups), group_sums(dc, groups), dskip

