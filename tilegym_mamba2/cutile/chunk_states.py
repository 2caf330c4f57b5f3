"""The state entering every chunk, for the backward's chunk_grads: one block per (batch, head,
state tile) walks the row's chunks in order with its tile of the state in registers and stores
it before each chunk.

The forward's state pass (fwd_pass_state.py) at one chunk per segment gives the same states,
but in two kernels with a round trip through memory: every chunk's local state is written, read
back by the scan, and the entry state written again (three [state_size, head_size] fp32 tiles
per chunk; 1.5 of the 4.6 ms of a 2.7B-layer backward in run29). Here each chunk's state is
written once. The walk is serial, so the next chunk's inputs are loaded before the current
chunk's product, and the state is cut into tiles for more blocks in flight.

States are transposed, [state_size, head_size], and stored as the state pass stores them:
[batch, heads, chunks * state_size, head_size]. Packed sequences (``seq_idx``) follow the state
pass's rule: tokens add to the state only if they belong to the sequence the chunk ends in, and
the carried state is dropped where that sequence started inside the chunk; a row's initial
state belongs to its sequence 0.
"""
import cuda.tile as ct
import torch

from .launch import launch, new_output


@ct.kernel(occupancy=4)
def chunk_states_kernel(x, b, dt_bht, decay_cumsum, init_state, seq_idx, entry_states, final_state,
                        chunk_size: ct.Constant[int], head_tile: ct.Constant[int], state_tile: ct.Constant[int],
                        has_init: ct.Constant[bool], has_seq: ct.Constant[bool]):
    batch_head, tile = ct.bid(0), ct.bid(1)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles
    num_chunks = dt_bht.shape[2] // chunk_size
    tokens = x.shape[1]

    if has_init:
        state_t = ct.load(init_state, (batch, head, n_tile, p_tile), (1, 1, state_tile, head_tile),
                          order=(0, 1, 3, 2)).reshape((state_tile, head_tile))
        if has_seq:
            first_seq = ct.load(seq_idx, (batch, 0), (1, 1))
            state_t = ct.where(first_seq == 0, state_t, 0.0)
    else:
        state_t = ct.zeros((state_tile, head_tile), dtype=ct.float32)

    x_tile, b_t, dt_tile, g = _chunk_inputs(x, b, dt_bht, decay_cumsum, batch, head, group, 0, p_tile, n_tile,
                                            chunk_size, head_tile, state_tile)
    for chunk in range(num_chunks):
        ct.store(entry_states, (batch, head, chunk * state_tiles + n_tile, p_tile),
                 state_t.reshape((1, 1, state_tile, head_tile)))
        following = min(chunk + 1, num_chunks - 1)  # the last step reloads its own: harmless
        next_inputs = _chunk_inputs(x, b, dt_bht, decay_cumsum, batch, head, group, following, p_tile, n_tile,
                                    chunk_size, head_tile, state_tile)
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        weight = dt_tile * ct.exp2(g_last - g)
        keep = ct.exp2(g_last)
        if has_seq:
            seq = ct.load(seq_idx, (batch, chunk), (1, chunk_size), padding_mode=ct.PaddingMode.ZERO).reshape(
                (chunk_size,))
            end_seq = ct.load(seq_idx, (batch, min((chunk + 1) * chunk_size, tokens) - 1), (1, 1)).reshape((1,))
            before_seq = ct.load(seq_idx, (batch, max(chunk * chunk_size - 1, 0)), (1, 1)).reshape((1,))
            weight = ct.where(seq == end_seq, weight, 0.0)
            keep = ct.where(before_seq == end_seq, keep, 0.0)
        state_t = ct.mma((b_t.astype(ct.float32) * weight[None, :]).astype(x.dtype), x_tile, state_t * keep)
        x_tile, b_t, dt_tile, g = next_inputs
    ct.store(final_state, (batch, head, n_tile, p_tile), state_t.reshape((1, 1, state_tile, head_tile)),
             order=(0, 1, 3, 2))


@ct.function
def _chunk_inputs(x, b, dt_bht, decay_cumsum, batch, head, group, chunk, p_tile, n_tile, chunk_size, head_tile,
                  state_tile):
    x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
    b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),
                  padding_mode=ct.PaddingMode.ZERO).reshape((state_tile, chunk_size))
    dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    return x_tile, b_t, dt_tile, g


def chunk_states(x, b, dt_bht, decay_cumsum, init_state, chunk_size, seq_idx=None):
    """x [batch, tokens, heads, head_size]; b [batch, tokens, groups, state_size]; dt_bht,
    decay_cumsum [batch, heads, chunks * chunk_size] fp32; init_state [batch, heads, head_size,
    state_size] fp32 or None; seq_idx [batch, tokens] int32 or None
    -> (entry_states [batch, heads, chunks * state_size, head_size] fp32, one per chunk,
        final_state [batch, heads, head_size, state_size] fp32)."""
    batch, _, heads, head_size = x.shape
    state_size = b.shape[3]
    chunks = dt_bht.shape[2] // chunk_size
    entry_states = new_output(batch, heads, chunks * state_size, head_size, dtype=torch.float32, device=x.device)
    final_state = new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)
    head_tile, state_tile = min(head_size, 32), min(state_size, 64)
    tiles = (head_size // head_tile) * (state_size // state_tile)
    unused = final_state  # stands in for absent optional arrays; never read
    launch((batch * heads, tiles), chunk_states_kernel,
           (x, b, dt_bht, decay_cumsum, unused if init_state is None else init_state,
            unused if seq_idx is None else seq_idx, entry_states, final_state, chunk_size, head_tile, state_tile,
            init_state is not None, seq_idx is not None))
    return entry_states, final_state
