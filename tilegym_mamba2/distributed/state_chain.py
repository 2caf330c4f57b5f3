"""The state that enters each rank's slice, from one all-gather of per-rank summaries.

A slice's scan is affine in the state that enters it: its end state is E_r = S_r + a_r E_{r-1},
where S_r is the end state computed from a zero entering state and a_r = exp(sum of a * dt over
the slice) (per head), when the slice is one sequence that goes on from rank r - 1; a sequence
that starts inside the slice cuts the chain (E_r = S_r), and the entering state of rank r is
E_{r-1} only if its first sequence goes on from rank r - 1. Every rank gathers all (S_r, log a_r)
([batch, heads, head_size, state_size] and [batch, heads], fp32 or fp64: independent of the
tokens) and runs this short chain itself. Backward is the reverse chain over the gathered
gradients of the entering states and of the final state: one all-gather each way. Boundaries
are selects, not multiplications, so a NaN of one sequence never reaches another's.
"""
import torch

from .agreement import all_gather


def _row_masks(layout, device):
    """(link [ranks, batch, 1, 1, 1], carried = link and through) as bool tensors."""
    link = torch.tensor([layout.link(r) for r in range(layout.size)], dtype=torch.bool, device=device)
    through = torch.tensor([layout.through(r) for r in range(layout.size)], dtype=torch.bool, device=device)
    return link[..., None, None, None], (link & through)[..., None, None, None]


class StateChain(torch.autograd.Function):
    """(this rank's end state from zeros, its log decay) -> (its entering state, the global
    final state), differentiable; all ranks must call it (and its backward) together."""

    @staticmethod
    def forward(ctx, end_state, log_decay, layout, group):
        numel = end_state.numel()
        gathered = all_gather(torch.cat([end_state.reshape(-1), log_decay.reshape(-1)]), group)
        ends = gathered[:, :numel].reshape(layout.size, *end_state.shape)
        decays = torch.exp(gathered[:, numel:].reshape(layout.size, *log_decay.shape))[..., None, None]
        link, carried = _row_masks(layout, end_state.device)
        previous = torch.zeros_like(end_state)
        entering = previous
        for r in range(layout.size):
            if r == layout.rank:
                entering = torch.where(link[r], previous, 0.0)
            previous = torch.where(carried[r], ends[r] + decays[r] * previous, ends[r])
        ctx.save_for_backward(decays, entering)
        ctx.layout, ctx.group = layout, group
        return entering, previous

    @staticmethod
    def backward(ctx, d_entering, d_final):
        decays, entering = ctx.saved_tensors
        layout = ctx.layout
        gathered = all_gather(torch.stack([d_entering, d_final]), ctx.group)   # [ranks, 2, ...]
        link, carried = _row_masks(layout, d_final.device)
        d_end = gathered[:, 1].sum(0)  # every rank may have used the final state
        for r in range(layout.size - 1, layout.rank, -1):
            d_end = torch.where(link[r], gathered[r, 0], 0.0) + torch.where(carried[r], decays[r] * d_end, 0.0)
        r = layout.rank
        # entering is E_{r-1} wherever the chain carries it (the rows where carried[r] holds)
        d_log = torch.where(carried[r], decays[r] * d_end * entering, 0.0).sum((-1, -2))
        return d_end, d_log, None, None


def entering_output(C, entering, log_decay_cumsum, first_run, link):
    """The entering state's share of the outputs of this rank's first sequence, [batch, n, heads,
    head_size] in the states' dtype for the first n = max(first_run) tokens:
    exp(cumsum of a dt up to t) * (h_entering c_t), zero (selected) outside the first sequence
    and in rows whose first sequence starts here. The matmul runs in C's dtype for 16-bit inputs,
    as the kernels' state term does."""
    batch, tokens, groups, state_size = C.shape
    heads, head_size = entering.shape[1:3]
    n = max(first_run)
    dtype = entering.dtype
    runs = torch.tensor(first_run, device=C.device)
    linked = torch.tensor(link, dtype=torch.bool, device=C.device)
    inside = (torch.arange(n, device=C.device)[None, :] < runs[:, None]) & linked[:, None]   # [batch, n]
    mm = C.dtype if C.dtype in (torch.bfloat16, torch.float16) else dtype
    c_first = torch.where(inside[..., None, None], C[:, :n], 0).to(mm)
    h = entering.to(mm).reshape(batch, groups, heads // groups, head_size, state_size)
    ch = torch.einsum("btgn,bgrpn->btgrp", c_first, h).reshape(batch, n, heads, head_size).to(dtype)
    decay = torch.exp(torch.where(inside[..., None], log_decay_cumsum[:, :n], 0.0))
    return torch.where(inside[..., None, None], ch * decay[..., None], 0.0)
