"""Stage 2: the state entering each segment of chunks, and the final state.

The sequence is cut into segments of ``chunks_per_segment`` chunks. Two kernels:

* ``segment_states_kernel`` runs all segments in parallel. A segment's state, started from
  zero, is one long matmul: sum over its tokens of w_t b_t x_t^T with w_t = dt_t * exp2(decay
  from t to the segment's end). Walking the chunks last to first keeps a running sum of the
  later chunks' decay, so each token's weight is known when its chunk is loaded and the
  accumulator never needs rescaling.
* ``state_scan_kernel`` is the light pass across segments: entry[s + 1] = exp2(decay[s]) *
  entry[s] + local[s], starting from the initial state; its last value is the final state.

States are kept transposed, [.., state_size, head_size]: with B^T as the left operand and X
as the right one, both matmuls take their operands in the layout they are loaded in, which
measured 2x faster on H200 than the X^T-on-the-left form. With one chunk per segment
``entry_states`` are exactly the chunk-entry states of the math (transposed).

Packed sequences (``seq_idx``, sorted along tokens): a segment's local state keeps only the
tokens of the sequence it ends in, and when that sequence started inside the segment its
decay is stored as -inf, so the scan drops the entry state there (exp2(-inf) = 0). An entry
state may then belong to an earlier sequence; ``compute_out`` masks it per token.

Segments are stacked along one axis with the state's rows, [batch, heads, segments *
state_size, head_size], and segment_decay is padded to a multiple of 16 segments: cuTile
compiles a kernel once per pattern of array dimensions that are 1 or divisible by 16, so with a
segment axis of its own every segment length the tuner tries would compile the three state
kernels and compute_out again (docs/design.md, Decisions: stacking nearly halved a cold first call).
"""
import cuda.tile as ct
import torch

from ..runtime.launch import launch, new_output, tf32_mma
from ..runtime.tuning import segment_count


@ct.kernel(occupancy=4)
def segment_states_kernel(x, b, dt_bht, decay_cumsum, seq_idx, local_states, segment_decay,
                          chunks_per_segment, chunk_size: ct.Constant[int],
                          head_tile: ct.Constant[int], state_tile: ct.Constant[int],
                          has_seq: ct.Constant[bool], tf32: ct.Constant[bool]):
    batch_head, segment, tile = ct.bid(0), ct.bid(1), ct.bid(2)
    mma_dtype = ct.tfloat32 if tf32 else x.dtype  # as compute_out_kernel's
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles
    num_chunks = dt_bht.shape[2] // chunk_size

    state_t = ct.zeros((state_tile, head_tile), dtype=ct.float32)
    later_decay = ct.zeros((1,), dtype=ct.float32)
    first = segment * chunks_per_segment
    last = min(first + chunks_per_segment, num_chunks)
    if has_seq:
        # The sequence of the segment's last real token, and of the token before the segment.
        end_seq = ct.load(seq_idx, (batch, min(last * chunk_size, x.shape[1]) - 1), (1, 1)).reshape((1,))
        before_seq = ct.load(seq_idx, (batch, max(first * chunk_size - 1, 0)), (1, 1)).reshape((1,))
    for i in range(last - first):
        chunk = last - 1 - i
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
        b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),
                      padding_mode=ct.PaddingMode.ZERO).reshape((state_tile, chunk_size))
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        weight = dt_tile * ct.exp2(g_last - g + later_decay)
        if has_seq:
            seq = ct.load(seq_idx, (batch, chunk), (1, chunk_size), padding_mode=ct.PaddingMode.ZERO)
            weight = ct.where(seq.reshape((chunk_size,)) == end_seq, weight, 0.0)
        state_t = ct.mma((b_t.astype(ct.float32) * weight[None, :]).astype(mma_dtype), x_tile.astype(mma_dtype),
                         state_t)
        later_decay = later_decay + g_last
    ct.store(local_states, (batch, head, segment * state_tiles + n_tile, p_tile),
             state_t.reshape((1, 1, state_tile, head_tile)))
    if has_seq:
        later_decay = ct.where(before_seq == end_seq, later_decay, -float("inf"))
    ct.store(segment_decay, (batch, head, segment), later_decay.reshape((1, 1, 1)))


# Tiles over 4096 elements hold twice the accumulator: at occupancy 4 they spill and run 1.8x
# (128 x 64) to 9x (256 x 64) slower; at 2 they beat 64 x 64 tiles at 4 where the state is 64 or
# 256 wide (tuning.py; docs/design.md, Decisions).
wide_segment_states_kernel = segment_states_kernel.replace_hints(occupancy=2)


@ct.kernel
def state_scan_kernel(local_states, segment_decay, init_state, seq_idx, entry_states, final_state, segments,
                      has_init: ct.Constant[bool], head_tile: ct.Constant[int],
                      state_tile: ct.Constant[int], has_seq: ct.Constant[bool]):
    batch_head, tile = ct.bid(0), ct.bid(1)
    heads = local_states.shape[1]
    batch, head = batch_head // heads, batch_head % heads
    state_tiles = ct.cdiv(final_state.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles

    if has_init:
        state_t = ct.load(init_state, (batch, head, n_tile, p_tile), (1, 1, state_tile, head_tile),
                          order=(0, 1, 3, 2)).reshape((state_tile, head_tile))
        if has_seq:
            # A row's initial state belongs to its sequence 0 (mamba_ssm's rule).
            first_seq = ct.load(seq_idx, (batch, 0), (1, 1))
            state_t = ct.where(first_seq == 0, state_t, 0.0)
    else:
        state_t = ct.zeros((state_tile, head_tile), dtype=ct.float32)
    # The walk is serial but its loads are not: each step loads the next segment's decay and
    # local state before it combines the current one, so a load's latency overlaps a step.
    decay = ct.load(segment_decay, (batch, head, 0), (1, 1, 1)).reshape((1, 1))
    local = ct.load(local_states, (batch, head, n_tile, p_tile), (1, 1, state_tile, head_tile)).reshape(
        (state_tile, head_tile))
    for segment in range(segments):
        ct.store(entry_states, (batch, head, segment * state_tiles + n_tile, p_tile),
                 state_t.reshape((1, 1, state_tile, head_tile)))
        following = min(segment + 1, segments - 1)  # the last step reloads its own: harmless
        next_decay = ct.load(segment_decay, (batch, head, following), (1, 1, 1)).reshape((1, 1))
        next_local = ct.load(local_states, (batch, head, following * state_tiles + n_tile, p_tile),
                             (1, 1, state_tile, head_tile)).reshape((state_tile, head_tile))
        state_t = state_t * ct.exp2(decay) + local
        decay, local = next_decay, next_local
    ct.store(final_state, (batch, head, n_tile, p_tile), state_t.reshape((1, 1, state_tile, head_tile)),
             order=(0, 1, 3, 2))


def fwd_pass_state(x, b, dt_bht, decay_cumsum, init_state, chunk_size, config, seq_idx=None):
    """seq_idx: [batch, tokens] int32 sequence ids, or None for one sequence per row.
    -> (entry_states [batch, heads, segments * state_size, head_size] fp32 (transposed states,
           segment s in rows s * state_size onwards),
        final_state [batch, heads, head_size, state_size] fp32)."""
    batch, _, heads, head_size = x.shape
    state_size = b.shape[3]
    per_segment = config.chunks_per_segment
    segments = segment_count(dt_bht, chunk_size, config)
    local_states, entry_states = new_output(2, batch, heads, segments * state_size, head_size,
                                            dtype=torch.float32, device=x.device).unbind(0)
    segment_decay = new_output(batch, heads, -(-segments // 16) * 16, dtype=torch.float32, device=x.device)
    final_state = new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)

    hp, np_ = config.state_head_tile, config.state_tile
    has_seq = seq_idx is not None
    seq = seq_idx if has_seq else segment_decay  # any array: unread without has_seq
    tiles = (head_size // hp) * (state_size // np_)
    kernel = segment_states_kernel if hp * np_ <= 4096 else wide_segment_states_kernel
    launch((batch * heads, segments, tiles), kernel,
           (x, b, dt_bht, decay_cumsum, seq, local_states, segment_decay, per_segment, chunk_size, hp, np_,
            has_seq, tf32_mma(x.dtype)))
    # The scan is a serial walk over segments that moves little data: narrow tiles give more
    # blocks for the same walk (32 x 64 measured 10-30% faster than 64 x 64 on the N=128 shapes).
    has_init = init_state is not None
    scan_hp, scan_np = min(head_size, 64), min(state_size, 32)
    launch((batch * heads, (head_size // scan_hp) * (state_size // scan_np)), state_scan_kernel,
           (local_states, segment_decay, init_state if has_init else final_state, seq,
            entry_states, final_state, segments, has_init, scan_hp, scan_np, has_seq))
    return entry_states, final_state
