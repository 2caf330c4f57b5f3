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
from .lockstep import CHAIN_BACKWARD, in_step


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
        ctx.set_materialize_grads(False)
        return entering, previous

    @staticmethod
    def backward(ctx, d_entering, d_final):
        decays, entering = ctx.saved_tensors
        layout = ctx.layout
        in_step(layout.op, ctx.group, CHAIN_BACKWARD, layout.call)
        d_entering = torch.zeros_like(entering) if d_entering is None else d_entering
        d_final = torch.zeros_like(entering) if d_final is None else d_final
        gathered = all_gather(torch.stack([d_entering, d_final]), ctx.group)   # [ranks, 2, ...]
        link, carried = _row_masks(layout, d_final.device)
        d_end = gathered[:, 1].sum(0)  # every rank may have used the final state
        for r in range(layout.size - 1, layout.rank, -1):
            d_end = torch.where(link[r], gathered[r, 0], 0.0) + torch.where(carried[r], decays[r] * d_end, 0.0)
        r = layout.rank
        # entering is E_{r-1} wherever the chain carries it (the rows where carried[r] holds)
        d_log = torch.where(carried[r], decays[r] * d_end * entering, 0.0).sum((-1, -2))
        return d_end, d_log, None, None


def slice_end_state(backend, x, B, dt, log_decay, run_start, start_state=None):
    """This rank's summary: the end state of its last run on ``backend`` (a Backend object)."""
    return backend.end_state(x, B, dt, log_decay, run_start, start_state)
