"""The backward's scans on the forward's kernels (backward.py says which scans and why).

A scan with its own per-token weight and log decay is the layer op's stages 2 and 3
(scan_combined.scan_stages) given those two in the [batch, heads, tokens] layout that
chunk_cumsum would have made: the kernels never tie the weight to the decay. Shapes follow
the heuristic config; the backward's role swaps (head_size <-> state_size) are shapes the
forward already runs.
"""
import torch

from ..reference import LOG2E
from .scan_combined import scan_stages
from .tuning import choose_config


def scan(x, b, c, weight, log_decay, init=None, seq_idx=None, cu_seqlens=None):
    """x [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size] in x's dtype;
    weight, log_decay [batch, tokens, heads] fp32 -> (y in x's dtype, final_states fp32,
    varlen_states fp32 with cu_seqlens else None). See scan_reference.scan_reference."""
    batch, tokens, heads, head_size = x.shape
    groups, state_size = b.shape[2], b.shape[3]
    config = choose_config(batch, tokens, groups, heads, head_size, state_size, 64, x.device)
    chunk = config.chunk_size
    padded = -(-tokens // chunk) * chunk
    # Padded tokens: weight 0 and no decay, as chunk_cumsum leaves them.
    laid_out = torch.zeros(2, batch, heads, padded, dtype=torch.float32, device=x.device)
    laid_out[0, :, :, :tokens] = weight.transpose(1, 2)
    laid_out[1, :, :, :tokens] = log_decay.transpose(1, 2)
    weight_bht = laid_out[0]
    decay_cumsum = laid_out[1].view(batch, heads, padded // chunk, chunk).cumsum(-1).view(batch, heads, padded)
    decay_cumsum *= LOG2E
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous()
    if init is not None:
        init = init.to(torch.float32).contiguous()
    return scan_stages(x.contiguous(), b.contiguous(), c.contiguous(), None, None, weight_bht, decay_cumsum, init,
                       seq, cu, config, with_varlen_states=cu is not None)
