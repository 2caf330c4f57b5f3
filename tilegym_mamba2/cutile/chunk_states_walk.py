"""The backward's chunk states in one walk over the chunks: every chunk's entry state and the
final state, the state kept in registers from one chunk to the next.

The forward's state pass (fwd_pass_state.py) at one chunk per segment, which the backward
needs, writes each chunk's local state, reads it back and writes the entry state: three fp32
state tiles per chunk. Here a block walks its (batch, head, state tile) through the chunks and
stores each entry state once: 2x faster than the state pass on the source config and the 2.7B
layer (run39, experiment 46). The update is state * exp2(chunk decay) + mma(weighted b, x, 0),
the state pass's own sum in its own order, so the entry states are the state pass's bits.

``reverse`` walks from the last chunk to the first on the arrays as they are: the backward's
scan of dh (backward.py) without flipping dy, b and c along the tokens. Backwards, token t of a
chunk enters with the decay from the chunk's first token to t, and the state leaves through the
whole chunk and the next chunk's first token (the decay between a token and the one after it).
Its entry states are stored in walk order, reversed chunk k first, as the flipped scan leaves
them. tests/cutile/test_chunk_states_walk_gpu.py checks the forward walk against the state
pass's bits and the reverse one against scan_reference's flipped scan in float64.

States are transposed, [.., state_size, head_size], as in fwd_pass_state.py, so both mma
operands are used in the layout they are loaded in.
"""
import cuda.tile as ct
import torch

from .launch import launch, new_output

# Below this many blocks, half-width head tiles: the walk is serial in the chunks, so more blocks
# is the only parallelism (run39: source config, 64 blocks at 64 x 64, 0.231 ms; 128 at 64 x 32,
# 0.187 ms; the 2.7B layer, 320 blocks at 64 x 64, 0.381 ms; 640 at 64 x 32, 0.407 ms).
FEW_BLOCKS = 264  # two per SM of an H200


@ct.kernel(occupancy=2)
def chunk_states_walk_kernel(x, b, dt_bht, decay_cumsum, init_state, entry_states, final_state,
                             chunk_size: ct.Constant[int], head_tile: ct.Constant[int],
                             state_tile: ct.Constant[int], has_init: ct.Constant[bool],
                             reverse: ct.Constant[bool]):
    batch_head, tile = ct.bid(0), ct.bid(1)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles
    num_chunks = decay_cumsum.shape[2] // chunk_size

    if has_init:
        state_t = ct.load(init_state, (batch, head, n_tile, p_tile), (1, 1, state_tile, head_tile),
                          order=(0, 1, 3, 2)).reshape((state_tile, head_tile))
    else:
        state_t = ct.zeros((state_tile, head_tile), dtype=ct.float32)
    # The loop's loads with a latency hint: nothing in them waits for the state, and at 6 the walks
    # are 4-17% faster with the same bits (run60, experiment 58; prefetching the next chunk's tiles
    # by hand was 1.4-2.4x slower, experiment 60).
    for step in range(num_chunks):
        chunk = num_chunks - 1 - step if reverse else step
        ct.store(entry_states, (batch, head, step * state_tiles + n_tile, p_tile),
                 state_t.reshape((1, 1, state_tile, head_tile)))
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
        # The same bf16 operand as segment_states_kernel's at one chunk per segment.
        weighted_b = (b_t.astype(ct.float32) * weight[None, :]).astype(x.dtype)
        state_t = state_t * keep + ct.mma(weighted_b, x_tile, ct.zeros((state_tile, head_tile), dtype=ct.float32))
    ct.store(final_state, (batch, head, n_tile, p_tile), state_t.reshape((1, 1, state_tile, head_tile)),
             order=(0, 1, 3, 2))


def chunk_states_walk(x, b, dt_bht, decay_cumsum, init_state, chunk_size, *, reverse=False):
    """x [batch, tokens, heads, head_size]; b [batch, tokens, groups, state_size] in x's dtype;
    dt_bht, decay_cumsum (base 2) [batch, heads, chunks * chunk_size] fp32 as chunk_cumsum lays
    them out (dt_bht unread with ``reverse``); init_state [batch, heads, head_size, state_size]
    fp32 or None.
    -> (entry_states [batch, heads, chunks * state_size, head_size] fp32, in walk order,
        final_state [batch, heads, head_size, state_size] fp32).
    ``reverse``: the scan of dh, with x = dy, b = c, init_state = the final state's gradient."""
    batch, _, heads, head_size = x.shape
    state_size = b.shape[3]
    chunks = decay_cumsum.shape[2] // chunk_size
    entry_states = new_output(batch, heads, chunks * state_size, head_size, dtype=torch.float32, device=x.device)
    final_state = new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)
    state_tile = min(state_size, 64)
    head_tile = min(head_size, 64)
    if batch * heads * (head_size // head_tile) * (state_size // state_tile) < FEW_BLOCKS:
        head_tile = min(head_size, 32)
    tiles = (head_size // head_tile) * (state_size // state_tile)
    has_init = init_state is not None
    launch((batch * heads, tiles), chunk_states_walk_kernel,
           (x, b, dt_bht, decay_cumsum, init_state if has_init else final_state, entry_states, final_state,
            chunk_size, head_tile, state_tile, has_init, reverse))
    return entry_states, final_state
