"""chunk_grads' reference: every gradient of the scan that involves a state, chunk by chunk
(ssd/chunk_grads.py computes the same)."""
import math

import torch

from ...core.tensors import expand_groups
from .chunks import chunked as chunked_tokens, chunked_sequences, cumsum_within_sequences, sequence_ranks, \
    within_sequences


def chunk_grads_reference(x, b, c, dy, weight, log_decay, entry_states, end_grads, seq_idx=None, *, chunk_size):
    """Every gradient of the scan that involves a state, chunk by chunk, from the state S entering
    each chunk (of the sequence carried in) and the gradient dS of the state after it (of the
    sequence that goes on past it); the kernel ssd/chunk_grads.py computes the same. With g the
    in-chunk sums of log decay, G their total, D_ts = exp(g_t - g_s) for s <= t in one sequence
    (else 0), and dh_t = sum_{t' >= t} D_t't dy_t' c_t'^T + exp(G - g_t) dS the state's gradient:

        dxs_t = dh_t b_t = sum_{t' >= t} D_t't (c_t' . b_t) dy_t' + exp(G - g_t) dS b_t
        dc_t = h_t^T dy_t = exp(g_t) S^T dy_t + sum_{s <= t} D_ts w_s (dy_t . x_s) b_s
        db_s = w_s dh_s^T x_s = w_s (sum_{t >= s} D_ts (dy_t . x_s) c_t + exp(G - g_s) dS^T x_s)
        dl_u = <dh_u, exp(l_u) h_{u-1}>
             = sum_{s < u <= t} D_ts w_s (c_t . b_s)(dy_t . x_s) + sum_{t >= u} exp(g_t) dy_t . (S c_t)
             + sum_{s < u} w_s exp(G - g_s) x_s . (dS b_s) + exp(G) <dS, S>

    (the S terms only for tokens of the sequence carried in, the dS terms only for tokens of the
    one going on). No term is a long sum: each is a product of quantities within one chunk.

    x, dy [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size]; weight,
    log_decay [batch, tokens, heads]; entry_states, end_grads [batch, chunks, heads, head_size,
    state_size]; seq_idx [batch, tokens] or None -> (dxs like x, ddt_input = x . dxs and dl
    [batch, tokens, heads], db, dc like b summed over each group's heads), in the states' dtype."""
    batch, tokens, heads, _ = x.shape
    groups = b.shape[2]
    dtype = entry_states.dtype
    L = chunk_size
    chunks = -(-tokens // L)

    def chunked(t):
        return chunked_tokens(t, L, dtype)

    def unchunked(t):
        return t.reshape(batch, chunks * L, *t.shape[3:])[:, :tokens]

    rep = heads // groups
    xc, dyc = chunked(x), chunked(dy)
    bc, cc = chunked(expand_groups(b, heads)), chunked(expand_groups(c, heads))
    seq = chunked_sequences(seq_idx, x, L)
    rank, count = sequence_ranks(seq) if seq_idx is not None else (None, 1)
    w, g = chunked(weight), cumsum_within_sequences(chunked(log_decay), rank, count)   # [B, K, L, H]
    g_end = g[:, :, -1:]
    carried = (torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], 1)[..., None] == seq)[..., None]   # [B, K, L, 1]
    going_on = (torch.cat([seq[:, 1:, 0], seq[:, -1:, -1]], 1)[..., None] == seq)[..., None]

    same = (seq[..., :, None] == seq[..., None, :])[:, :, None]                     # [B, K, 1, L, L]
    at_or_before = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()       # [t, s]: s <= t
    pair_ok = at_or_before & same
    gh = g.permute(0, 1, 3, 2)                                                       # [B, K, H, L]
    # Every mask below is a select: a pair or token of another sequence contributes an exact 0
    # whatever its values (NaN and inf included), and contractions over tokens run one sequence
    # of the chunk at a time (within_sequences).
    decay = torch.exp(torch.where(pair_ok, gh[..., :, None] - gh[..., None, :], -math.inf))
    scores = torch.where(pair_ok, torch.einsum("bkthn,bkshn->bkhts", cc, bc), 0.0)   # c_t . b_s
    products = torch.where(pair_ok, torch.einsum("bkthp,bkshp->bkhts", dyc, xc), 0.0)  # dy_t . x_s
    from_end = torch.where(going_on, torch.exp(g_end - g), 0.0)                      # [B, K, L, H]
    into = torch.where(carried, torch.exp(g), 0.0)

    dxs = (within_sequences(rank, count, "bkhts,bkthp->bkshp", decay * scores, dyc, 2)
           + torch.where(going_on[..., None], from_end[..., None]
                         * torch.einsum("bkhpn,bklhn->bklhp", end_grads, bc), 0.0))
    weighted_b = w[..., None] * bc
    dc = (torch.where(carried[..., None], into[..., None] * torch.einsum("bkhpn,bkthp->bkthn", entry_states, dyc), 0.0)
          + within_sequences(rank, count, "bkhts,bkshn->bkthn", decay * products, weighted_b, 2))
    db = w[..., None] * (within_sequences(rank, count, "bkhts,bkthn->bkshn", decay * products, cc, 2)
                         + torch.where(going_on[..., None], from_end[..., None]
                                       * torch.einsum("bkhpn,bklhp->bklhn", end_grads, xc), 0.0))

    # dl: pairs s < u <= t, the sum over t >= u of the sum over s < u
    pairs = torch.where(pair_ok, decay * w.permute(0, 1, 3, 2)[..., None, :] * scores * products, 0.0)
    before_u = pairs.cumsum(-1) - pairs
    dl = torch.where(at_or_before, before_u, 0.0).sum(-2).permute(0, 1, 3, 2)        # [B, K, L, H]
    received = torch.where(carried, into * torch.einsum("bklhp,bkhpn,bklhn->bklh", dyc, entry_states, cc), 0.0)
    dl = dl + received.flip(2).cumsum(2).flip(2)
    sent = torch.where(going_on, w * from_end * torch.einsum("bklhp,bkhpn,bklhn->bklh", xc, end_grads, bc), 0.0)
    dl = dl + sent.cumsum(2) - sent
    through = torch.exp(g_end) * (end_grads * entry_states).sum((-1, -2))[:, :, None]
    dl = dl + torch.where(carried & going_on, through, 0.0)

    def per_group(t):  # [B, K, L, H, N] -> [B, K, L, G, N]
        return t.reshape(*t.shape[:3], groups, rep, t.shape[-1]).sum(4)

    dxs = unchunked(dxs)
    return (dxs, (x.to(dtype) * dxs).sum(-1), unchunked(dl), unchunked(per_group(db)),
            unchunked(per_group(dc)))
