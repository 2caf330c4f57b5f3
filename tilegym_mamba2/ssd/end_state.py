"""The end state of a slice's last sequence and its gradients: what each rank of a
context-parallel call sends (distributed/state_chain.py). reference/end_state.py is the same math
in PyTorch.

    S = sum over the run's tokens t of w_t e_t x_t b_t^T,   e_t = exp(sum of log decay after t)

Forward: the forward's own state pass (chunk_cumsum's layout, fwd_pass_state's segments in
parallel) on inputs whose tokens before the run are zeroed. Backward, from
G = dS: dx_t = w_t e_t G b_t, db_t = sum over the group's heads of w_t e_t G^T x_t, and per token
and head r_t = x_t . G b_t, of which the dt and log-decay gradients are made (e_t r_t, and the
prefix sums of w_t e_t r_t). No term couples two tokens, so a block takes one chunk of one
(batch, group) and walks the group's heads: one read of x, b and G per block, no serial walk.
"""
import cuda.tile as ct
import torch

from ..core.constants import KERNEL_CHUNK
from .chunk_cumsum import given_decay_cumsum
from .fwd_pass_state import fwd_pass_state
from ..runtime.launch import launch, new_output, tf32_mma
from ..runtime.tuning import choose_config
from .reference.end_state import decay_after, only_the_run, run_mask

# Tokens per block of the backward. Every block reads the whole gradient G of each head of its
# group, so longer blocks read it fewer times (G's reads dominate at 64 tokens).
GRAD_CHUNK = 128


def end_state(x, b, dt, log_decay):
    """x [batch, tokens, heads, head_size], b [batch, tokens, groups, state_size] in x's dtype;
    dt, log_decay [batch, tokens, heads] fp32 (natural log) -> the state after the last token
    from a zero state, [batch, heads, head_size, state_size] fp32 (the caller zeroes the tokens
    before a row's run: selected, so that none of their values reaches the state)."""
    batch, tokens, heads, head_size = x.shape
    config = choose_config(batch, tokens, b.shape[2], heads, head_size, b.shape[3], KERNEL_CHUNK,
                           x.device if x.is_cuda else None)
    weight_bht, decay_cumsum = given_decay_cumsum(dt.contiguous(), log_decay.contiguous(), config.chunk_size)
    return fwd_pass_state(x.contiguous(), b.contiguous(), weight_bht, decay_cumsum, None, config.chunk_size,
                          config)[1]


@ct.kernel
def end_state_grads_kernel(x, b, weighted, after, grad, run_start, dx, d_weight, q, db,
                           chunk_size: ct.Constant[int], head_tile: ct.Constant[int],
                           state_tile: ct.Constant[int], tf32: ct.Constant[bool]):
    batch_group, chunk = ct.bid(0), ct.bid(1)
    heads, groups = x.shape[2], b.shape[2]
    batch, group = batch_group // groups, batch_group % groups
    per_group = heads // groups
    head_tiles, state_tiles = x.shape[3] // head_tile, b.shape[3] // state_tile
    mma_dtype = ct.tfloat32 if tf32 else x.dtype
    token = chunk * chunk_size + ct.arange(chunk_size, dtype=ct.int32)
    first = ct.load(run_start, (batch,), (1,))
    # Tokens before the run (another sequence's) and padding are selected out, never multiplied
    # by zero: their values reach no output.
    inside = ((token >= first) & (token < x.shape[1]))[:, None]

    for r in range(per_group):
        head = group * per_group + r
        w_e = ct.load(weighted, (batch, head, chunk), (1, 1, chunk_size),
                      padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, 1))
        e = ct.load(after, (batch, head, chunk), (1, 1, chunk_size),
                    padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, 1))
        x_dot = ct.zeros((chunk_size, 1), dtype=ct.float32)
        for p_tile in range(head_tiles):
            g_b = ct.zeros((chunk_size, head_tile), dtype=ct.float32)
            for n_tile in range(state_tiles):
                b_tile = ct.load(b, (batch, chunk, group, n_tile), (1, chunk_size, 1, state_tile),
                                 padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_tile))
                g_tile = ct.load(grad, (batch, head, p_tile, n_tile),
                                 (1, 1, head_tile, state_tile)).reshape((head_tile, state_tile))
                g_b = ct.mma(b_tile.astype(mma_dtype), ct.transpose(g_tile.astype(mma_dtype)), g_b)
            x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                             padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
            dx_tile = ct.where(inside, g_b * w_e, 0.0)
            ct.store(dx, (batch, chunk, head, p_tile), dx_tile.astype(dx.dtype).reshape((1, chunk_size, 1, head_tile)))
            x_dot = x_dot + ct.sum(ct.where(inside, x_tile.astype(ct.float32) * g_b, 0.0), axis=1, keepdims=True)
        ct.store(d_weight, (batch, head, chunk), (x_dot * e).reshape((1, 1, chunk_size)))
        ct.store(q, (batch, head, chunk), (x_dot * w_e).reshape((1, 1, chunk_size)))

    for n_tile in range(state_tiles):
        db_tile = ct.zeros((chunk_size, state_tile), dtype=ct.float32)
        for r in range(per_group):
            head = group * per_group + r
            w_e = ct.load(weighted, (batch, head, chunk), (1, 1, chunk_size),
                          padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, 1))
            g_x = ct.zeros((chunk_size, state_tile), dtype=ct.float32)
            for p_tile in range(head_tiles):
                x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                                 padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
                g_tile = ct.load(grad, (batch, head, p_tile, n_tile),
                                 (1, 1, head_tile, state_tile)).reshape((head_tile, state_tile))
                g_x = ct.mma(x_tile.astype(mma_dtype), g_tile.astype(mma_dtype), g_x)
            db_tile = db_tile + g_x * w_e
        ct.store(db, (batch, chunk, group, n_tile),
                 ct.where(inside, db_tile, 0.0).reshape((1, chunk_size, 1, state_tile)))


def end_state_grads(x, b, weighted, after, grad, run_start):
    """end_state's gradients from grad = dS [batch, heads, head_size, state_size] fp32;
    weighted = w_t e_t and after = e_t [batch, heads, tokens] fp32 (zero outside the run);
    run_start [batch] int32 -> (dx like x, d_weight = e_t r_t and q = w_t e_t r_t [batch, heads,
    tokens] fp32, db [batch, tokens, groups, state_size] fp32)."""
    batch, tokens, heads, head_size = x.shape
    groups, state_size = b.shape[2:]
    chunks = -(-tokens // GRAD_CHUNK)
    dx = new_output(batch, tokens, heads, head_size, dtype=x.dtype, device=x.device)
    d_weight, q = new_output(2, batch, heads, chunks * GRAD_CHUNK, dtype=torch.float32, device=x.device).unbind(0)
    db = new_output(batch, tokens, groups, state_size, dtype=torch.float32, device=x.device)
    launch((batch * groups, chunks), end_state_grads_kernel,
           (x.contiguous(), b.contiguous(), weighted.contiguous(), after.contiguous(),
            (grad.to(x.dtype) if x.dtype in (torch.bfloat16, torch.float16) else grad).contiguous(),
            run_start, dx, d_weight, q, db, GRAD_CHUNK, min(head_size, 64), min(state_size, 64), tf32_mma(x.dtype)))
    return dx, d_weight[..., :tokens], q[..., :tokens], db


class EndStateOnKernels(torch.autograd.Function):
    """reference/end_state.py's end_state_reference on the kernels above, forward and backward."""

    @staticmethod
    def forward(ctx, x, B, dt, log_decay, run_start, start_state):
        starts = torch.tensor(run_start, dtype=torch.int32, device=x.device)
        inside = run_mask(run_start, x.shape[1], x.device)
        run = (x, B, dt.float(), log_decay.float())
        if max(run_start) > 0:  # a sequence boundary in the slice: only the last run's tokens count
            run = only_the_run(inside, *run)
        state = end_state(*run)
        run_decay = torch.where(inside[..., None], log_decay, 0.0).sum(1)[..., None, None]
        if start_state is not None:
            state = state + torch.exp(run_decay) * start_state
        ctx.save_for_backward(x, B, dt, log_decay, start_state, starts, run_decay, inside)
        return state

    @staticmethod
    def backward(ctx, grad):
        x, B, dt, log_decay, start_state, starts, run_decay, inside = ctx.saved_tensors
        after = decay_after(log_decay.float(), inside)
        weighted = torch.where(inside[:, None, :], after * dt.float().transpose(1, 2), 0.0)
        dx, d_weight, q, db = end_state_grads(x, B, weighted, after, grad.float(), starts)
        d_log = q.cumsum(-1) - q                                     # sum of q over the tokens before
        d_start = None
        if start_state is not None:  # exp(run decay) S_0: every token of the run's decay
            d_start = torch.exp(run_decay) * grad
            d_log = d_log + torch.where(inside[:, None, :], (d_start * start_state).sum((-1, -2))[..., None], 0.0)
        return (dx, db.to(B.dtype), d_weight.transpose(1, 2).to(dt.dtype), d_log.transpose(1, 2).to(log_decay.dtype),
                None, d_start)


def end_state_differentiable(x, B, dt, log_decay, run_start, start_state=None):
    """The end state of the run that starts at ``run_start`` (one offset per row), from
    ``start_state`` (or zeros), differentiable: the cutile backend's ``end_state``."""
    return EndStateOnKernels.apply(x, B, dt, log_decay, run_start, start_state)
