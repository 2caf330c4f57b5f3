"""The gradient of every token's log decay, dl_u = <dh_u, exp(l_u) h_{u-1}>, one block per
(batch, head, chunk), from the chunk's entry state S and the gradient dS of the state it
leaves (scan_reference.decay_grad_reference states the four terms).

Summing per-token terms of the forward and backward outputs over the rest of the sequence
gives the same value in exact arithmetic, but there receiver and sender terms cancel over
thousands of tokens and bf16 rounding is left: 0.04-0.2 relative error in ddt measured on the
H200 (benchmarks/NOTES.md). Here every term is a sum of products within one chunk.

Entry states are stored transposed, [.., chunks * state_size, head_size], as the state pass
leaves them; the reversed scan's are in reversed chunk order, before its shifted decay (so
dS = exp2(first reversed decay) * entry).
"""
import cuda.tile as ct
import torch

from .launch import launch, new_output


@ct.kernel(occupancy=1)
def decay_grad_kernel(x, b, c, dy, dt_bht, decay_cumsum, entry_states, rev_entry_states, rev_decay_cumsum,
                      seq_idx, dl, chunk_size: ct.Constant[int], head_size: ct.Constant[int],
                      state_size: ct.Constant[int], has_seq: ct.Constant[bool]):
    batch_head, chunk = ct.bid(0), ct.bid(1)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    num_chunks = dt_bht.shape[2] // chunk_size
    tokens = x.shape[1]
    reversed_chunk = num_chunks - 1 - chunk

    x_tile = ct.load(x, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_size))
    dy_tile = ct.load(dy, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),
                      padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_size))
    b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
    c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
    dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    g_end = ct.extract(g, (chunk_size - 1,), (1,))
    rev_g = ct.load(rev_decay_cumsum, (batch, head, reversed_chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    into_next = ct.exp2(ct.extract(rev_g, (0,), (1,)))  # the decay into the next chunk's first token

    token = ct.arange(chunk_size, dtype=ct.int32)
    earlier = token[:, None] > token[None, :]          # [t, s]: s < t
    at_or_after = token[:, None] >= token[None, :]     # [t, u]: t >= u
    carried = token >= 0
    going_on = token >= 0
    same = earlier
    if has_seq:
        seq = ct.load(seq_idx, (batch, chunk), (1, chunk_size), padding_mode=ct.PaddingMode.ZERO).reshape(
            (chunk_size,))
        before = ct.load(seq_idx, (batch, max(chunk * chunk_size - 1, 0)), (1, 1)).reshape((1,))
        after = ct.load(seq_idx, (batch, min((chunk + 1) * chunk_size, tokens - 1)), (1, 1)).reshape((1,))
        carried = seq == before
        going_on = seq == after
        same = earlier & (seq[:, None] == seq[None, :])

    # Pairs s < u <= t inside the chunk: sum over t >= u of the sum over s < u.
    scores = ct.mma(c_tile, ct.transpose(b_tile), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
    products = ct.mma(dy_tile, ct.transpose(x_tile), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    pairs = ct.exp2(ct.where(same, g[:, None] - g[None, :], never)) * dt_tile[None, :] * scores * products
    before_u = ct.cumsum(pairs, axis=1) - pairs
    dl_tile = ct.sum(ct.where(at_or_after, before_u, 0.0), axis=0)

    # Received from the entry state, by t >= u; sent into dS, by s < u; and entry state to dS.
    state_t = ct.load(entry_states, (batch, head, chunk, 0), (1, 1, state_size, head_size)).reshape(
        (state_size, head_size))
    from_state = ct.mma(c_tile, state_t.astype(x.dtype), ct.zeros((chunk_size, head_size), dtype=ct.float32))
    received = ct.where(carried, ct.exp2(g) * ct.sum(dy_tile.astype(ct.float32) * from_state, axis=1), 0.0)
    dl_tile = dl_tile + ct.sum(received, axis=0, keepdims=True) - ct.cumsum(received, axis=0) + received

    grad_t = ct.load(rev_entry_states, (batch, head, reversed_chunk, 0), (1, 1, state_size, head_size)).reshape(
        (state_size, head_size)) * into_next
    to_grad = ct.mma(b_tile, grad_t.astype(x.dtype), ct.zeros((chunk_size, head_size), dtype=ct.float32))
    sent = ct.where(going_on, dt_tile * ct.exp2(g_end - g) * ct.sum(x_tile.astype(ct.float32) * to_grad, axis=1),
                    0.0)
    dl_tile = dl_tile + ct.cumsum(sent, axis=0) - sent

    through = ct.exp2(g_end) * ct.sum(ct.sum(grad_t * state_t, axis=1), axis=0, keepdims=True)
    dl_tile = dl_tile + ct.where(carried & going_on, through, 0.0)
    ct.store(dl, (batch, head, chunk), dl_tile.reshape((1, 1, chunk_size)))


def decay_grad(x, b, c, dy, dt_bht, decay_cumsum, entry_states, rev_entry_states, rev_decay_cumsum, seq_idx,
               chunk_size):
    """x, dy [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size];
    dt_bht, decay_cumsum, rev_decay_cumsum [batch, heads, chunks * chunk_size];
    entry_states, rev_entry_states [batch, heads, chunks * state_size, head_size] fp32 (one per chunk);
    seq_idx [batch, tokens] int32 or None -> dl [batch, heads, chunks * chunk_size] fp32."""
    batch, _, heads, head_size = x.shape
    state_size = b.shape[3]
    dl = new_output(batch, heads, dt_bht.shape[2], dtype=torch.float32, device=x.device)
    launch((batch * heads, dt_bht.shape[2] // chunk_size), decay_grad_kernel,
           (x, b, c, dy, dt_bht, decay_cumsum, entry_states, rev_entry_states, rev_decay_cumsum,
            dl if seq_idx is None else seq_idx, dl, chunk_size, head_size, state_size, seq_idx is not None))
    return dl
