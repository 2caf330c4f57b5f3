"""The linear scan that the forward and the backward are both made of, in plain PyTorch.

Per batch row and head, with state h of shape [head_size, state_size]:

    h_t = exp(log_decay_t) h_{t-1} + weight_t x_t b_t^T,    y_t = h_t c_t

The forward op is this scan with weight = dt and log_decay = a * dt (plus d * x). The
backward runs it three more times with other roles (backward.py): the gradient of the state
obeys the same recurrence backwards in time, and the transposed state gives dC and dB.

Packed sequences as in the layer op: no state crosses a sequence boundary; ``init`` is
[batch, ...] (each row's sequence 0) or, with cu_seqlens, [num_sequences, ...] (one per
sequence). This is the "pytorch" backend's scan; cutile/scan.py runs the same scans on the kernels.
"""
import math

import torch

from ..core.packing import SequenceBuckets, packed_sequences, per_sequence_init, seq_idx_from_cu_seqlens, sequences
from ..core.tensors import expand_groups
from .ssd import chunk_output_reference, chunk_states_reference, chunked as chunked_tokens, decay_cumsum_reference


def scan_reference(x, b, c, weight, log_decay, init=None, seq_idx=None, cu_seqlens=None, *, chunk_size=64,
                   dtype=torch.float32, chunk_states=False, outputs=True, varlen_states=True):
    """x [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size];
    weight, log_decay [batch, tokens, heads] (natural log) -> (y [batch, tokens, heads, head_size],
    final_states [batch, heads, head_size, state_size], varlen_states [num_sequences, ...] with
    cu_seqlens else None), all in ``dtype``. Each sequence is scanned on its own.
    ``chunk_states``: a fourth value, (chunk_entry_states(...), weight, log_decay), as the cutile
    scan gives chunk_grads; without ``outputs`` y is None; without ``varlen_states`` the third
    value is None and only each row's last sequence's end state is computed."""
    if chunk_states:
        batch = x.shape[0]
        if cu_seqlens is not None and seq_idx is None:
            seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1])
        # Per-sequence initial states stay out of the chunk states, as in the kernels.
        row_init = None if per_sequence_init(init, cu_seqlens, batch) else init
        states = chunk_entry_states(x, b, weight, log_decay, row_init, seq_idx, chunk_size, dtype)
        y, final_states, varlen = scan_reference(x, b, c, weight, log_decay, init, seq_idx, cu_seqlens,
                                                 chunk_size=chunk_size, dtype=dtype)
        return (y if outputs else None), final_states, varlen, (states, weight, log_decay)
    batch, tokens, heads, head_size = x.shape
    y = torch.zeros(batch, tokens, heads, head_size, dtype=dtype, device=x.device)
    final_states = torch.zeros(batch, heads, head_size, b.shape[3], dtype=dtype, device=x.device)
    if x.device.type == "meta":  # shapes only: no values (nor offsets) to read
        varlen = None if cu_seqlens is None else final_states.new_empty(cu_seqlens.shape[0] - 1, *final_states.shape[1:])
        return y, final_states, varlen
    if seq_idx is None and cu_seqlens is None:
        for row, start, end, start_state in sequences(None, None, init, batch, tokens):
            part = slice(row, row + 1), slice(start, end)
            y[part], (_, final_states[row:row + 1]) = _scan_rows(
                x[part], b[part], c[part], weight[part], log_decay[part], start_state, chunk_size, dtype,
                torch.ones(1, dtype=torch.bool, device=x.device))
        return y, final_states, None
    rows, starts, lengths, ids = packed_sequences(seq_idx, cu_seqlens, batch, tokens)
    buckets = SequenceBuckets(rows, starts, lengths, tokens, x.device)
    starting = _starting_states(init, cu_seqlens, batch, rows, starts, ids, dtype)
    ends = torch.empty(len(rows), heads, head_size, b.shape[3], dtype=dtype, device=x.device)
    # A row's final state is its last sequence's end state.
    is_last = torch.tensor([k + 1 == len(rows) or rows[k + 1] != rows[k] for k in range(len(rows))],
                           device=x.device)
    wanted = torch.ones_like(is_last) if (cu_seqlens is not None and varlen_states) else is_last
    for bucket in buckets.buckets:
        members = bucket[0]
        start_state = None if starting is None else starting[members]
        inputs = [buckets.gather(t, bucket) for t in (x, b, c, weight, log_decay)]
        out, end = _scan_rows(*inputs, start_state, min(chunk_size, bucket[1].shape[1]), dtype, wanted[members])
        buckets.scatter(y, bucket, out)
        if end[1] is not None:
            ends[members[end[0]]] = end[1]
    final_states[torch.tensor(rows, dtype=torch.long, device=x.device)[is_last]] = ends[is_last]
    return y, final_states, (ends if cu_seqlens is not None and varlen_states else None)


def _scan_rows(x, b, c, weight, log_decay, start_state, chunk_size, dtype, wanted):
    """The chunked scan of rows that each hold one sequence -> (y, (which rows, their end states)) for
    the ``wanted`` rows' end states. Rows of one chunk need no state pass for y: the state entering
    their only chunk is the starting state (the end states, where wanted, are computed apart:
    for many short sequences they are most of the work)."""
    heads = x.shape[2]
    ones = torch.ones(heads, dtype=dtype, device=x.device)
    no_skip = torch.zeros(heads, dtype=dtype, device=x.device)
    decay_cumsum = decay_cumsum_reference(ones, log_decay, chunk_size, dtype=dtype)
    if x.shape[1] > chunk_size:
        states, h = chunk_states_reference(x, b, weight, decay_cumsum, start_state, chunk_size, dtype=dtype)
        return (chunk_output_reference(x, b, c, no_skip, weight, decay_cumsum, states, chunk_size, dtype=dtype),
                (wanted, h[wanted]))
    states = None if start_state is None else start_state.to(dtype)[:, :, None]
    y = chunk_output_reference(x, b, c, no_skip, weight, decay_cumsum, states, chunk_size, dtype=dtype)
    if not bool(wanted.any()):
        return y, (wanted, None)
    # One chunk: the end state is the starting state decayed through it plus the chunk's own sum.
    g = decay_cumsum[wanted].to(dtype).transpose(1, 2)[:, :x.shape[1]]          # [n, tokens, H]
    g_last = g[:, -1]
    scale = weight[wanted].to(dtype) * torch.exp2(g_last[:, None] - g)
    h = torch.einsum("rlhp,rlhn->rhpn", scale[..., None] * x[wanted].to(dtype),
                     expand_groups(b[wanted], heads).to(dtype))
    if start_state is not None:
        h = h + torch.exp2(g_last)[..., None, None] * start_state[wanted].to(dtype)
    return y, (wanted, h)


def _starting_states(init, cu_seqlens, batch, rows, starts, ids, dtype):
    """Each packed sequence's starting state [num_sequences, ...] (None: all zeros): its own with
    cu_seqlens and one per sequence; else its row's for the row's first sequence when its id is 0
    (mamba_ssm's rule), zeros for the others."""
    if init is None:
        return None
    if per_sequence_init(init, cu_seqlens, batch):
        return init.to(dtype)
    takes_row = torch.tensor([start == 0 and seq_id == 0 for start, seq_id in zip(starts, ids)], device=init.device)
    row_init = init.to(dtype)[torch.tensor(rows, dtype=torch.long, device=init.device)]
    return torch.where(takes_row[:, None, None, None], row_init, 0.0)


def _chunked_sequences(seq_idx, x, chunk_size):
    """Each token's sequence, [batch, chunks, chunk_size] (padding repeats the last token's)."""
    batch, tokens = x.shape[:2]
    pad = -tokens % chunk_size
    if seq_idx is None:
        seq = torch.zeros(batch, tokens + pad, dtype=torch.long, device=x.device)
    else:
        seq = torch.cat([seq_idx.long(), seq_idx[:, -1:].long().expand(-1, pad)], 1)
    return seq.reshape(batch, -1, chunk_size)


def chunk_entry_states(x, b, weight, log_decay, init, seq_idx, chunk_size, dtype):
    """The state entering each chunk of ``chunk_size`` tokens, [batch, chunks, heads, head_size,
    state_size] in ``dtype``: that of the sequence of the token before the chunk (a row's initial
    state enters its sequence 0). Chunk by chunk as the state pass at one chunk per segment:
    a chunk adds the tokens of the sequence it ends in, decayed to its end, and keeps the
    carried state, decayed through the chunk, only if that sequence began before it."""
    batch, tokens, heads, head_size = x.shape
    chunks = -(-tokens // chunk_size)

    def chunked(t):
        return chunked_tokens(t, chunk_size, dtype)

    xc, bc = chunked(x), chunked(expand_groups(b, heads))
    seq = _chunked_sequences(seq_idx, x, chunk_size)
    rank, count = _sequence_ranks(seq) if seq_idx is not None else (None, 1)
    w, g = chunked(weight), _cumsum_within_sequences(chunked(log_decay), rank, count)  # [B, K, L, H]
    g_end = g[:, :, -1]                                                          # [B, K, H]
    end_seq = seq[:, :, -1:]
    before = torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], 1)                      # [B, K]
    # Selects, not multiplications by a 0/1 mask: no value of another sequence (NaN included)
    # enters a product.
    ends_here = (seq == end_seq)[..., None, None]                                # [B, K, L, 1, 1]
    xw = torch.where(ends_here, xc * (w * torch.exp(g_end[:, :, None] - g))[..., None], 0.0)
    local = torch.einsum("bklhp,bklhn->bkhpn", xw, torch.where(ends_here, bc, 0.0))
    carries = (before == end_seq[..., 0])[..., None, None, None]                 # [B, K, 1, 1, 1]
    state = torch.zeros(batch, heads, head_size, b.shape[3], dtype=dtype, device=x.device)
    if init is not None:
        state = torch.where((seq[:, 0, 0] == 0)[:, None, None, None], init.to(dtype), 0.0)
    entries = []
    for k in range(chunks):
        entries.append(state)
        state = torch.where(carries[:, k], torch.exp(g_end[:, k])[..., None, None] * state, 0.0) + local[:, k]
    return torch.stack(entries, 1)


def _sequence_ranks(seq):
    """[B, K, L] sequence ids per chunk -> (each token's sequence's rank among its chunk's
    sequences, the largest number of sequences in a chunk)."""
    changes = torch.cat([torch.zeros_like(seq[..., :1]), (seq[..., 1:] != seq[..., :-1]).long()], -1)
    rank = changes.cumsum(-1)
    return rank, int(rank.max()) + 1


def _cumsum_within_sequences(values, rank, count):
    """The in-chunk cumulative sum along tokens (dim 2) of each sequence on its own: a sum that
    ran across a boundary would carry one sequence's values (a NaN) into the next one's."""
    if count == 1:
        return values.cumsum(2)
    out = torch.zeros_like(values)
    for j in range(count):
        mine = (rank == j)[..., None]
        out = torch.where(mine, torch.where(mine, values, 0.0).cumsum(2), out)
    return out


def _within_sequences(rank, count, equation, pairs, tokens, pair_axis):
    """einsum(equation, pairs, tokens) where ``pairs`` [.., t, s] is zero between sequences:
    ``tokens`` (over the contracted index, its token dimension at 2) is restricted to one
    sequence of the chunk at a time and each result selected to the tokens of that sequence
    (pair_axis: which of the result's dimensions is the token one), so that a non-finite value
    of one sequence never meets a zero of another's."""
    if count == 1:
        return torch.einsum(equation, pairs, tokens)
    out = 0.0
    for j in range(count):
        mine = (rank == j)                                                           # [B, K, L]
        shape = mine.shape + (1,) * (tokens.ndim - 3)
        part = torch.einsum(equation, pairs, torch.where(mine.view(shape), tokens, 0.0))
        keep = mine.view(mine.shape[:2] + (1,) * (pair_axis - 2) + mine.shape[2:] + (1,) * (part.ndim - pair_axis - 1))
        out = out + torch.where(keep, part, 0.0)
    return out


def chunk_grads_reference(x, b, c, dy, weight, log_decay, entry_states, end_grads, seq_idx=None, *, chunk_size):
    """Every gradient of the scan that involves a state, chunk by chunk, from the state S entering
    each chunk (of the sequence carried in) and the gradient dS of the state after it (of the
    sequence that goes on past it); the kernel cutile/chunk_grads.py computes the same. With g the
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
    seq = _chunked_sequences(seq_idx, x, L)
    rank, count = _sequence_ranks(seq) if seq_idx is not None else (None, 1)
    w, g = chunked(weight), _cumsum_within_sequences(chunked(log_decay), rank, count)   # [B, K, L, H]
    g_end = g[:, :, -1:]
    carried = (torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], 1)[..., None] == seq)[..., None]   # [B, K, L, 1]
    going_on = (torch.cat([seq[:, 1:, 0], seq[:, -1:, -1]], 1)[..., None] == seq)[..., None]

    same = (seq[..., :, None] == seq[..., None, :])[:, :, None]                     # [B, K, 1, L, L]
    at_or_before = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()       # [t, s]: s <= t
    pair_ok = at_or_before & same
    gh = g.permute(0, 1, 3, 2)                                                       # [B, K, H, L]
    # Every mask below is a select: a pair or token of another sequence contributes an exact 0
    # whatever its values (NaN and inf included), and contractions over tokens run one sequence
    # of the chunk at a time (_within_sequences).
    decay = torch.exp(torch.where(pair_ok, gh[..., :, None] - gh[..., None, :], -math.inf))
    scores = torch.where(pair_ok, torch.einsum("bkthn,bkshn->bkhts", cc, bc), 0.0)   # c_t . b_s
    products = torch.where(pair_ok, torch.einsum("bkthp,bkshp->bkhts", dyc, xc), 0.0)  # dy_t . x_s
    from_end = torch.where(going_on, torch.exp(g_end - g), 0.0)                      # [B, K, L, H]
    into = torch.where(carried, torch.exp(g), 0.0)

    dxs = (_within_sequences(rank, count, "bkhts,bkthp->bkshp", decay * scores, dyc, 2)
           + torch.where(going_on[..., None], from_end[..., None]
                         * torch.einsum("bkhpn,bklhn->bklhp", end_grads, bc), 0.0))
    weighted_b = w[..., None] * bc
    dc = (torch.where(carried[..., None], into[..., None] * torch.einsum("bkhpn,bkthp->bkthn", entry_states, dyc), 0.0)
          + _within_sequences(rank, count, "bkhts,bkshn->bkthn", decay * products, weighted_b, 2))
    db = w[..., None] * (_within_sequences(rank, count, "bkhts,bkthn->bkshn", decay * products, cc, 2)
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
