"""The full Mamba-2 layer interface, ``mamba_chunk_scan_combined``, in plain PyTorch.

Same arguments and semantics as mamba_ssm's function of that name (forward):

* dt is raw: ``dt = clamp(softplus?(dt + dt_bias), *dt_limit)`` (softplus only when
  ``dt_softplus``; it passes values above 20 through, as mamba_ssm does);
* D is per head [heads] or per channel [heads, head_size]; with z, ``out = y * silu(z)``;
* packed batches: ``seq_idx`` [batch, tokens] gives each token's sequence (sorted along
  tokens); ``cu_seqlens`` [num_sequences + 1] gives batch 1's start offsets (and, without
  seq_idx, defines it; with it, must agree). No state crosses from one sequence to the next.
  ``initial_states`` [batch, ...] starts each row's sequence with id 0, as in mamba_ssm; with
  cu_seqlens it may also be [num_sequences, ...], one initial state per sequence.
* returns out (x's dtype), final_states (fp32) and varlen_states (C's dtype), as mamba_ssm.
  The "pytorch" backend also takes float64 inputs; it then computes in float64 and returns
  float64 final_states (for torch.autograd.gradcheck on a CPU).

``layer_token_recurrence`` is the float64 ground truth; ``chunked_layer_reference`` is the
algorithm the kernels run (ssd/layer.py), with sequence boundaries as masks inside
chunks. The "pytorch" backend (backends/pytorch.py) runs the scan of ssd/reference/scans.py on each
sequence in fp32, so that sequences are independent to the bit.
"""
import math

import torch
import torch.nn.functional as F

from ...core.packing import seq_idx_from_cu_seqlens, sequences
from ...core.tensors import expand_groups
from ..dt import process_dt
from .chunk_cumsum import decay_cumsum_reference
from .chunks import chunked, chunked_decay


def layer_token_recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                           cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """Token by token in float64 -> (out, final_states [batch, ...], varlen_states [num_sequences, ...]
    or None). The definition of the layer op; validation is left to the callers."""
    f64 = torch.float64
    batch, tokens, heads, head_size = x.shape
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype=f64)
    rep = heads // B.shape[2]
    x64, A64 = x.to(f64), A.to(f64)
    B64, C64 = B.to(f64).repeat_interleave(rep, 2), C.to(f64).repeat_interleave(rep, 2)
    out = torch.empty(batch, tokens, heads, head_size, dtype=f64, device=x.device)
    final_states = x.new_zeros(batch, heads, head_size, B.shape[3], dtype=f64)
    varlen = []
    for row, start, end, init in sequences(seq_idx, cu_seqlens, initial_states, batch, tokens):
        h = torch.zeros_like(final_states[0]) if init is None else init[0].to(f64)
        for t in range(start, end):
            d_t = dt[row, t, :, None, None]
            h = torch.exp(A64[:, None, None] * d_t) * h + d_t * x64[row, t, :, :, None] * B64[row, t, :, None, :]
            out[row, t] = torch.einsum("hpn,hn->hp", h, C64[row, t])
        varlen.append(h)
        final_states[row] = h
    if D is not None:
        out = out + (D.to(f64)[:, None] if D.ndim == 1 else D.to(f64)) * x64
    if z is not None:
        out = out * F.silu(z.to(f64))
    return out, final_states, (torch.stack(varlen) if cu_seqlens is not None else None)


def chunked_layer_reference(x, dt, A, B, C, D=None, z=None, initial_states=None, seq_idx=None, cu_seqlens=None,
                            chunk_size=64, dtype=torch.float64):
    """The chunked algorithm with sequence boundaries as masks: the blueprint for the kernels.

    dt is already processed (``process_dt``). Per chunk k, with prev = the sequence of the token
    before the chunk (for chunk 0, the row's first sequence, whose entry state is the row's
    initial state when its id is 0, else zero):

        y_i = [seq_i == prev] exp2(g_i) C_i S_k^T + sum_{j <= i, seq_j == seq_i} exp2(g_i - g_j) (C_i . B_j) dt_j x_j
        S_{k+1} = [seq_last == prev] exp2(g_last) S_k + sum_{seq_j == seq_last} exp2(g_last - g_j) dt_j x_j B_j^T

    Padded tokens continue the last sequence with dt = 0, so they change nothing. Per-sequence
    initial states ([num_sequences, ...] with cu_seqlens) enter by linearity: sequence s adds
    exp(sum of a*dt from its start to t) C_t I_s^T to each of its outputs and to its end state.
    The decay sums run over whole chunks, so a sequence's result depends on its neighbours'
    dt through rounding only. Returns (out, final_states, varlen_states or None) in ``dtype``.
    """
    batch, tokens, heads, head_size = x.shape
    state_size = B.shape[3]
    L = chunk_size
    num_chunks = -(-tokens // L)
    if seq_idx is None:
        seq_idx = (seq_idx_from_cu_seqlens(cu_seqlens, tokens) if cu_seqlens is not None
                   else torch.zeros(batch, tokens, dtype=torch.int64, device=x.device))
    seq = torch.cat([seq_idx.long(), seq_idx[:, -1:].long().expand(-1, num_chunks * L - tokens)], 1)
    seq = seq.reshape(batch, num_chunks, L)
    num_seqs = None if cu_seqlens is None else cu_seqlens.numel() - 1
    per_sequence = (initial_states is not None and num_seqs is not None and num_seqs != batch
                    and initial_states.shape[0] == num_seqs)

    xc = chunked(x, L, dtype)                                   # [B, K, L, H, P]
    bc = chunked(expand_groups(B, heads), L, dtype)            # [B, K, L, H, N]
    cc = chunked(expand_groups(C, heads), L, dtype)
    dtc = chunked(dt, L, dtype)                                 # [B, K, L, H]
    g = chunked_decay(decay_cumsum_reference(A, dt, L, dtype), L, dtype)  # [B, K, L, H], log2
    g_last = g[:, :, -1]                                         # [B, K, H]

    prev = torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], 1)        # [B, K]
    carried = seq == prev[..., None]                             # [B, K, L]
    last = seq[:, :, -1]
    keeps = prev == last                                         # [B, K]
    in_last = seq == last[..., None]                             # [B, K, L]

    weight = torch.where(in_last[..., None], dtc * torch.exp2(g_last[:, :, None] - g), 0)
    local = torch.einsum("bklhp,bklhn->bkhpn", weight[..., None] * xc, bc)
    state = x.new_zeros(batch, heads, head_size, state_size, dtype=dtype)
    if initial_states is not None and not per_sequence:
        state = torch.where((seq[:, 0, 0] == 0)[:, None, None, None], initial_states.to(dtype), state)
    entry = []
    for k in range(num_chunks):
        entry.append(state)
        decayed = torch.exp2(g_last[:, k, :, None, None]) * state
        state = torch.where(keeps[:, k, None, None, None], decayed, 0) + local[:, k]
    entry = torch.stack(entry, 1)                                # [B, K, H, P, N]
    final_states = state

    inter = torch.einsum("bklhn,bkhpn->bklhp", cc, entry) * torch.exp2(g)[..., None]
    inter = torch.where(carried[..., None, None], inter, 0)
    gh = g.permute(0, 1, 3, 2)                                   # [B, K, H, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    mask = (causal & (seq[..., :, None] == seq[..., None, :]))[:, :, None]   # [B, K, 1, L, L]
    decay = torch.exp2((gh[..., :, None] - gh[..., None, :]).masked_fill(~mask, -math.inf))
    scores = torch.einsum("bkthn,bkshn->bkhts", cc, bc) * decay * dtc.permute(0, 1, 3, 2)[..., None, :]
    y = (inter + torch.einsum("bkhts,bkshp->bkthp", scores, xc)).reshape(batch, -1, heads, head_size)[:, :tokens]

    varlen = []
    if cu_seqlens is not None:  # batch 1: each sequence's state after its last token
        for end in cu_seqlens[1:].tolist():
            k, p = divmod(end - 1, L)
            same = seq[0, k, :p + 1] == seq[0, k, p]
            w = torch.where(same[:, None], dtc[0, k, :p + 1] * torch.exp2(g[0, k, p] - g[0, k, :p + 1]), 0)
            h = torch.einsum("lhp,lhn->hpn", w[..., None] * xc[0, k, :p + 1], bc[0, k, :p + 1])
            if bool(carried[0, k, p]):
                h = h + torch.exp2(g[0, k, p])[:, None, None] * entry[0, k]
            varlen.append(h)
    if per_sequence:  # linear in the initial states: add each sequence's own
        a_dt = A.to(torch.float64) * dt[0].to(torch.float64)    # [T, H]
        for s, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            growth = torch.exp(a_dt[start:end].cumsum(0)).to(dtype)                 # [len, H]
            init = initial_states[s].to(dtype)                                       # [H, P, N]
            c_seq = expand_groups(C[:, start:end], heads)[0].to(dtype)              # [len, H, N]
            y[0, start:end] += growth[..., None] * torch.einsum("lhn,hpn->lhp", c_seq, init)
            varlen[s] = varlen[s] + growth[-1][:, None, None] * init
        final_states = varlen[-1][None].clone()
    if D is not None:
        y = y + (D.to(dtype)[:, None] if D.ndim == 1 else D.to(dtype)) * x.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y, final_states, (torch.stack(varlen) if cu_seqlens is not None else None)
