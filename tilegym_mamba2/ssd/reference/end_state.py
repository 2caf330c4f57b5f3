"""The end state of a slice's last sequence, in plain PyTorch: what each rank of a
context-parallel call sends (distributed/state_chain.py); ssd/end_state.py computes it and its
gradients on the kernels.

    S = sum over the run's tokens t of dt_t e_t x_t b_t^T  +  exp(sum of the run's log decay) S_0,
    e_t = exp(sum of the log decay after t)

for each row's last sequence (its tokens from ``run_start`` on). Tokens before the run are
selected out, never multiplied by zero, so none of their values (NaN included) reaches S.
"""
import torch


def run_mask(run_start, tokens, device):
    """[batch, tokens] bool: the tokens of each row's last sequence (run_start: host ints)."""
    starts = torch.tensor(run_start, device=device)
    return torch.arange(tokens, device=device)[None, :] >= starts[:, None]


def only_the_run(inside, *tensors):
    """Each [batch, tokens, ...] tensor with the tokens outside the run selected to 0."""
    return [torch.where(inside.view(*inside.shape, *(1,) * (t.ndim - 2)), t, 0) for t in tensors]


def decay_after(log_decay, inside):
    """exp(sum of log decay after t within the run) [batch, heads, tokens], zero outside it.
    log_decay [batch, tokens, heads]. The sum runs along a contiguous last dimension (a strided
    cumsum over tokens is tens of times slower on a GPU)."""
    masked = torch.where(inside[:, None, :], log_decay.transpose(1, 2), 0.0)
    after = masked.flip(-1).cumsum(-1).flip(-1) - masked
    return torch.where(inside[:, None, :], torch.exp(after), 0.0)


def end_state_reference(x, B, dt, log_decay, run_start, start_state=None):
    """x [batch, tokens, heads, head_size]; B [batch, tokens, groups, state_size]; dt, log_decay
    [batch, tokens, heads] in the states' dtype (fp32, or fp64); run_start[b]: the first token of
    row b's last sequence (host ints); start_state [batch, heads, head_size, state_size] or None
    -> [batch, heads, head_size, state_size] in dt's dtype. One matmul over the tokens per group,
    in x's dtype for 16-bit inputs (as the kernels' state matmuls); differentiable."""
    batch, tokens, heads, head_size = x.shape
    groups, state_size = B.shape[2:]
    dtype = dt.dtype
    inside = run_mask(run_start, tokens, x.device)
    if max(run_start) > 0:  # selected first: no value of another sequence enters a product
        x, B, dt, log_decay = only_the_run(inside, x, B, dt, log_decay)
    weight = (decay_after(log_decay, inside) * dt.transpose(1, 2)).transpose(1, 2)            # [batch, tokens, heads]
    mm = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else dtype
    xw, bm = x.to(mm) * weight.to(mm)[..., None], B.to(mm)
    xw = xw.reshape(batch, tokens, groups, heads // groups, head_size)
    state = torch.einsum("btgrp,btgn->bgrpn", xw, bm).reshape(batch, heads, head_size, state_size).to(dtype)
    if start_state is not None:
        state = state + torch.exp(log_decay.sum(1))[..., None, None] * start_state.to(dtype)
    return state
