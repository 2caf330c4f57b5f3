"""Stage 2: the state entering each segment of chunks, and the final state.

The sequence is cut into segments of ``chunks_per_segment`` chunks. Two kernels:

* ``segment_states_kernel`` runs all segments in parallel: each block walks the chunks of
  one segment, starting from a zero state, and keeps the running state in fp32 registers
  (state = exp2(g_last) * state + X^T (w * B), w = dt * exp2(g_last - g)). It writes only the
  segment's end state and its total decay, so the sequential depth is one segment long.
* ``state_scan_kernel`` is the light pass across segments: entry[s + 1] = exp2(decay[s]) *
  entry[s] + local[s], starting from the initial state; its last value is the final state.

With one chunk per segment ``entry_states`` are exactly the chunk-entry states of the math;
with more, they are the chunk-entry states of every ``chunks_per_segment``-th chunk.
"""
import cuda.tile as ct
import torch

from .launch import launch, new_output


@ct.kernel
def segment_states_kernel(x, b, dt_bht, decay_cumsum, local_states, segment_decay,
                          chunks_per_segment, chunk_size: ct.Constant[int],
                          head_tile: ct.Constant[int], state_tile: ct.Constant[int]):
    batch_head, segment, tile = ct.bid(0), ct.bid(1), ct.bid(2)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles
    num_chunks = dt_bht.shape[2] // chunk_size

    state = ct.zeros((head_tile, state_tile), dtype=ct.float32)
    total_decay = ct.zeros((1,), dtype=ct.float32)
    first = segment * chunks_per_segment
    for chunk in range(first, min(first + chunks_per_segment, num_chunks)):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, n_tile), (1, chunk_size, 1, state_tile),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_tile))
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        weighted_b = b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]
        state = ct.mma(ct.transpose(x_tile), weighted_b.astype(x.dtype), state * ct.exp2(g_last))
        total_decay = total_decay + g_last
    ct.store(local_states, (batch, head, segment, p_tile, n_tile),
             state.reshape((1, 1, 1, head_tile, state_tile)))
    ct.store(segment_decay, (batch, head, segment), total_decay.reshape((1, 1, 1)))


@ct.kernel
def state_scan_kernel(local_states, segment_decay, init_state, entry_states, final_state,
                      has_init: ct.Constant[bool], head_tile: ct.Constant[int],
                      state_tile: ct.Constant[int]):
    batch_head, tile = ct.bid(0), ct.bid(1)
    heads = local_states.shape[1]
    batch, head = batch_head // heads, batch_head % heads
    state_tiles = ct.cdiv(local_states.shape[4], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles

    if has_init:
        state = ct.load(init_state, (batch, head, p_tile, n_tile),
                        (1, 1, head_tile, state_tile)).reshape((head_tile, state_tile))
    else:
        state = ct.zeros((head_tile, state_tile), dtype=ct.float32)
    for segment in range(local_states.shape[2]):
        ct.store(entry_states, (batch, head, segment, p_tile, n_tile),
                 state.reshape((1, 1, 1, head_tile, state_tile)))
        decay = ct.load(segment_decay, (batch, head, segment), (1, 1, 1)).reshape((1, 1))
        local = ct.load(local_states, (batch, head, segment, p_tile, n_tile),
                        (1, 1, 1, head_tile, state_tile)).reshape((head_tile, state_tile))
        state = state * ct.exp2(decay) + local
    ct.store(final_state, (batch, head, p_tile, n_tile), state.reshape((1, 1, head_tile, state_tile)))


def fwd_pass_state(x, b, dt_bht, decay_cumsum, init_state, chunk_size, config):
    """-> (entry_states [batch, heads, segments, head_size, state_size] fp32,
           final_state [batch, heads, head_size, state_size] fp32)."""
    batch, _, heads, head_size = x.shape
    state_size = b.shape[3]
    num_chunks = dt_bht.shape[2] // chunk_size
    per_segment = config.chunks_per_segment
    segments = -(-num_chunks // per_segment)
    states_shape = (batch, heads, segments, head_size, state_size)
    local_states = new_output(*states_shape, dtype=torch.float32, device=x.device)
    segment_decay = new_output(batch, heads, segments, dtype=torch.float32, device=x.device)
    entry_states = new_output(*states_shape, dtype=torch.float32, device=x.device)
    final_state = new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)

    hp, np_ = config.state_head_tile, config.state_tile
    tiles = (head_size // hp) * (state_size // np_)
    launch((batch * heads, segments, tiles), segment_states_kernel,
           (x, b, dt_bht, decay_cumsum, local_states, segment_decay,
            per_segment, chunk_size, hp, np_))
    has_init = init_state is not None
    launch((batch * heads, tiles), state_scan_kernel,
           (local_states, segment_decay, init_state if has_init else final_state,
            entry_states, final_state, has_init, hp, np_))
    return entry_states, final_state
