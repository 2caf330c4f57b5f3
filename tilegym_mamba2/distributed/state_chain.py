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


def last_run_state(x, B, dt, log_decay, last_start, start_state=None):
    """The state at the end of each row's last sequence on this rank, from ``start_state`` where
    that sequence starts (zeros for None): sum over its tokens t of exp(sum of log decay after t)
    dt_t x_t b_t^T, one matmul over the tokens per group (in x's dtype for 16-bit inputs, as the
    kernels' state matmuls), plus the decayed start state.

    x [batch, tokens, heads, head_size]; B [batch, tokens, groups, state_size]; dt, log_decay
    [batch, tokens, heads] in the states' dtype; last_start[b]: the first token of row b's last
    sequence (host ints); start_state [batch, heads, head_size, state_size] or None.
    -> [batch, heads, head_size, state_size] in dt's dtype. Tokens of other sequences are
    selected out, never multiplied by zero."""
    batch, tokens, heads, head_size = x.shape
    groups, state_size = B.shape[2:]
    dtype = dt.dtype
    begin = min(last_start)                      # the tokens before every row's last sequence are skipped
    starts = torch.tensor(last_start, device=x.device)
    inside = torch.arange(begin, tokens, device=x.device)[None, :] >= starts[:, None]          # [batch, n]
    log_decay = torch.where(inside[..., None], log_decay[:, begin:], 0.0)
    # Sums along tokens run over a contiguous last dimension (a strided cumsum is tens of times slower).
    suffix = log_decay.transpose(1, 2).flip(-1).cumsum(-1).flip(-1).transpose(1, 2) - log_decay  # after t
    weight = torch.where(inside[..., None], dt[:, begin:] * torch.exp(suffix), 0.0)
    mm = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else dtype
    xw, bm = x[:, begin:].to(mm) * weight.to(mm)[..., None], B[:, begin:].to(mm)
    if max(last_start) > 0:  # a boundary on this rank: select the last sequence's tokens
        xw = torch.where(inside[..., None, None], xw, 0.0)
        bm = torch.where(inside[..., None, None], bm, 0.0)
    xw = xw.reshape(batch, -1, groups, heads // groups, head_size)
    state = torch.einsum("btgrp,btgn->bgrpn", xw, bm).reshape(batch, heads, head_size, state_size).to(dtype)
    if start_state is not None:
        state = state + torch.exp(log_decay.sum(1))[..., None, None] * start_state.to(dtype)
    return state
