"""The backward's chunk states in one walk over the chunks: every chunk's entry state and the
final state, the state kept in registers from one chunk to the next.

The forward's state pass (fwd_pass_state.py) at one chunk per segment, which the backward
needs, writes each chunk's local state, reads it back and writes the entry state: three fp32
state tiles per chunk. Here a block walks its (batch, head, state tile) through the chunks and
stores each entry state once: 2.0-2.4x faster than the state pass on the source config and the
2.7B layer (docs/design.md, "Decisions"). The update is state * exp2(chunk decay) + mma(weighted
b, x, 0), the state pass's own sum in its own order, so the entry states are the state pass's
bits, stored rounded to x's dtype: chunk_grads rounds them to it for its mma anyway, and 16-bit
states halve the backward's largest tensors (docs/design.md, Decisions).

``reverse`` walks from the last chunk to the first on the arrays as they are: the backward's
scan of dh (backward.py) without flipping dy, b and c along the tokens. Backwards, token t of a
chunk enters with the decay from the chunk's first token to t, and the state leaves through the
whole chunk and the next chunk's first token (the decay between a token and the one after it).
Its entry states are stored in walk order, reversed chunk k first, as the flipped scan leaves
them. tests/ssd/test_chunk_states_walk_gpu.py checks the forward walk against the state
pass's bits and the reverse one against scan_reference's flipped scan in float64.

States are transposed, [.., state_size, head_size], as in fwd_pass_state.py, so both mma
operands are used in the layout they are loaded in.
"""
import cuda.tile as ct
import torch

from ..runtime.launch import launch, new_output, tf32_mma

# Below this many blocks, half-width head tiles: the walk is serial in the chunks, so more blocks
# is the only parallelism; above it, full-width tiles win (docs/design.md, Decisions: walk tiles).
FEW_BLOCKS = 264  # two per SM of an H200


@ct.kernel(occupancy=2)
def chunk_states_walk_kernel(x, b, dt_bht, decay_cumsum, init_state, seq_idx, entry_states, final_state,
                             chunk_size: ct.Constant[int], head_tile: ct.Constant[int],
                             state_tile: ct.Constant[int], has_init: ct.Constant[bool],
                             reverse: ct.Constant[bool], has_seq: ct.Constant[bool], tf32: ct.Constant[bool]):
    batch_head, tile = ct.bid(0), ct.bid(1)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles
    num_chunks = decay_cumsum.shape[2] // chunk_size
    tokens = x.shape[1]
    mma_dtype = ct.tfloat32 if tf32 else x.dtype

    if has_init:
        state_t = ct.load(init_state, (batch, head, n_tile, p_tile), (1, 1, state_tile, head_tile),
                          order=(0, 1, 3, 2)).reshape((state_tile, head_tile))
        if has_seq and not reverse:
            # A row's initial state belongs to its sequence 0, as in state_scan_kernel. (Backwards,
            # the final state's gradient belongs to the row's last sequence: keep's mask below.)
            first_seq = ct.load(seq_idx, (batch, 0), (1, 1))
            state_t = ct.where(first_seq == 0, state_t, 0.0)
    else:
        state_t = ct.zeros((state_tile, head_tile), dtype=ct.float32)
    # With packed sequences, the id of the token through which the state left the previous chunk
    # of the walk: the token the state arrives from in this one (carried, not loaded: see below).
    carried_seq = ct.zeros((1,), dtype=ct.int32)
    # The loop's loads with a latency hint: nothing in them waits for the state, and at 6 the walks
    # are 4-17% faster with the same bits; prefetching the next chunk's tiles by hand doubled the
    # live tiles and was slower (docs/design.md).
    for step in range(num_chunks):
        chunk = num_chunks - 1 - step if reverse else step
        ct.store(entry_states, (batch, head, step * state_tiles + n_tile, p_tile),
                 state_t.astype(entry_states.dtype).reshape((1, 1, state_tile, head_tile)))
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO, latency=6).reshape((chunk_size, head_tile))
        b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),
                      padding_mode=ct.PaddingMode.ZERO, latency=6).reshape((state_tile, chunk_size))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size), latency=6).reshape((chunk_size,))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        if reverse:
            g_first = ct.extract(g, (0,), (1,))
            following = ct.load(decay_cumsum, (batch, head, min(chunk + 1, num_chunks - 1)), (1, 1, chunk_size))
            next_first = ct.extract(following.reshape((chunk_size,)), (0,), (1,))
            next_first = ct.where(chunk + 1 < num_chunks, next_first, 0.0)
            keep = ct.exp2(g_last - g_first + next_first).reshape((1, 1))
            weight = ct.exp2(g - g_first)
        else:
            keep = ct.exp2(g_last).reshape((1, 1))
            dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size), latency=6).reshape((chunk_size,))
            weight = dt_tile * ct.exp2(g_last - g)
        if has_seq:
            # Packed sequences (seq_idx sorted along the tokens): a chunk's tokens enter the state
            # only if they belong to the sequence the state leaves the chunk in, and the state
            # crosses the chunk only if no sequence starts inside it or at its far edge. Forwards
            # these are segment_states_kernel's masks at one chunk per segment (the same bits);
            # backwards the state leaves through the chunk's first token and arrives from the
            # next chunk's first token (the row's last token after the last chunk), the masks
            # the token-flipped scan applies (backward._flipped_scan).
            # Both edge ids come from the chunk's own tile and the previous step's (two single-id
            # loads per step, each waited for, made packed walks 1.5-1.8x slower):
            # the chunk's first token's id, and its last valid token's, the largest id among its
            # tokens (sorted) where the padding, whose id is 0, is left out.
            seq = ct.load(seq_idx, (batch, chunk), (1, chunk_size), padding_mode=ct.PaddingMode.ZERO,
                          latency=6).reshape((chunk_size,))
            first_id = ct.extract(seq, (0,), (1,))
            in_row = chunk * chunk_size + ct.arange(chunk_size, dtype=ct.int32) < tokens
            last_id = ct.max(ct.where(in_row, seq, -2147483648), axis=0, keepdims=True)
            if reverse:
                # Leaving through the chunk's first token, arriving from the next chunk's first
                # (the row's last token at the walk's first step).
                leaving = first_id
                arriving = ct.where(step == 0, last_id, carried_seq)
            else:
                # Leaving through the chunk's last token, arriving from the previous chunk's last
                # (the row's first token at the first step).
                leaving = last_id
                arriving = ct.where(step == 0, first_id, carried_seq)
            carried_seq = leaving
            weight = ct.where(seq == leaving, weight, 0.0)
            keep = ct.where(arriving.reshape((1, 1)) == leaving.reshape((1, 1)), keep, 0.0)
        # The same bf16 operand as segment_states_kernel's at one chunk per segment (tf32 operands
        # for fp32 inputs where PyTorch's matmul precision allows them: launch.tf32_mma).
        weighted_b = (b_t.astype(ct.float32) * weight[None, :]).astype(mma_dtype)
        state_t = state_t * keep + ct.mma(weighted_b, x_tile.astype(mma_dtype),
                                          ct.zeros((state_tile, head_tile), dtype=ct.float32))
    ct.store(final_state, (batch, head, n_tile, p_tile), state_t.reshape((1, 1, state_tile, head_tile)),
             order=(0, 1, 3, 2))


def chunk_states_walk(x, b, dt_bht, decay_cumsum, init_state, chunk_size, *, reverse=False, seq_idx=None):
    """x [batch, tokens, heads, head_size]; b [batch, tokens, groups, state_size] in x's dtype;
    dt_bht, decay_cumsum (base 2) [batch, heads, chunks * chunk_size] fp32 as chunk_cumsum lays
    them out (dt_bht unread with ``reverse``); init_state [batch, heads, head_size, state_size]
    fp32 or None.
    -> (entry_states [batch, heads, chunks * state_size, head_size] in x's dtype, in walk order,
        final_state [batch, heads, head_size, state_size] fp32).
    ``reverse``: the scan of dh, with x = dy, b = c, init_state = the final state's gradient.
    seq_idx: [batch, tokens] int32 sequence ids (sorted along the tokens) or None."""
    batch, _, heads, head_size = x.shape
    state_size = b.shape[3]
    chunks = decay_cumsum.shape[2] // chunk_size
    entry_states = new_output(batch, heads, chunks * state_size, head_size, dtype=x.dtype, device=x.device)
    final_state = new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)
    state_tile = min(state_size, 64)
    head_tile = min(head_size, 64)
    if batch * heads * (head_size // head_tile) * (state_size // state_tile) < FEW_BLOCKS:
        head_tile = min(head_size, 32)
    tiles = (head_size // head_tile) * (state_size // state_tile)
    has_init, has_seq = init_state is not None, seq_idx is not None
    kernel = crowded_walk_kernel if batch * heads * tiles > FEW_BLOCKS else chunk_states_walk_kernel
    launch((batch * heads, tiles), kernel,
           (x, b, dt_bht, decay_cumsum, init_state if has_init else final_state,
            seq_idx if has_seq else decay_cumsum, entry_states, final_state,  # unread without has_seq
            chunk_size, head_tile, state_tile, has_init, reverse, has_seq, tf32_mma(x.dtype)))
    return entry_states, final_state


# Above FEW_BLOCKS the walk at occupancy 2 runs in two waves (the 2.7B layer: 320 blocks, 264 at a
# time); at 4 they all fit, the same bits, faster; with fewer blocks occupancy 4 gains nothing, so
# they keep 2 (docs/design.md, Decisions).
crowded_walk_kernel = chunk_states_walk_kernel.replace_hints(occupancy=4)
