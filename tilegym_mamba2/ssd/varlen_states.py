"""Each packed sequence's state after its last token (``return_varlen_states``).

One block per (sequence, head, state tile). It starts from the entry state of the segment
holding the sequence's last token (kept only if that state already belongs to the sequence)
and walks that segment's chunks up to the last token, adding only the sequence's own tokens:
at most ``chunks_per_segment`` chunks, however long the sequence.
"""
import cuda.tile as ct

from ..runtime.launch import launch, new_output, tf32_mma


@ct.kernel
def varlen_states_kernel(x, b, dt_bht, decay_cumsum, seq_idx, cu_seqlens, entry_states, varlen_states,
                         chunks_per_segment, chunk_size: ct.Constant[int], head_tile: ct.Constant[int],
                         state_tile: ct.Constant[int], tf32: ct.Constant[bool]):
    sequence, head, tile = ct.bid(0), ct.bid(1), ct.bid(2)
    mma_dtype = ct.tfloat32 if tf32 else x.dtype  # as compute_out_kernel's
    group = head // (x.shape[2] // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles

    last_token = ct.load(cu_seqlens, (sequence + 1,), (1,)).item() - 1
    last_chunk = last_token // chunk_size
    segment = last_chunk // chunks_per_segment
    first = segment * chunks_per_segment
    before_seq = ct.load(seq_idx, (0, max(first * chunk_size - 1, 0)), (1, 1)).reshape((1, 1))
    state_t = ct.load(entry_states, (0, head, segment * state_tiles + n_tile, p_tile),
                      (1, 1, state_tile, head_tile)).reshape((state_tile, head_tile))
    state_t = ct.where(before_seq == sequence, state_t, 0.0)
    token = ct.arange(chunk_size, dtype=ct.int32)
    for chunk in range(first, last_chunk + 1):
        x_tile = ct.load(x, (0, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
        b_t = ct.load(b, (0, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),
                      padding_mode=ct.PaddingMode.ZERO).reshape((state_tile, chunk_size))
        dt_tile = ct.load(dt_bht, (0, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (0, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        seq = ct.load(seq_idx, (0, chunk), (1, chunk_size), padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size,))
        # The decay up to the sequence's last token, or to the chunk's end before that.
        end = min(last_token - chunk * chunk_size, chunk_size - 1)
        g_end = ct.sum(ct.where(token == end, g, 0.0), axis=0, keepdims=True)
        weight = ct.where((seq == sequence) & (token <= end), dt_tile * ct.exp2(g_end - g), 0.0)
        state_t = ct.mma((b_t.astype(ct.float32) * weight[None, :]).astype(mma_dtype), x_tile.astype(mma_dtype),
                         state_t * ct.exp2(g_end))
    ct.store(varlen_states, (sequence, head, n_tile, p_tile),
             state_t.astype(varlen_states.dtype).reshape((1, 1, state_tile, head_tile)), order=(0, 1, 3, 2))


def varlen_states(x, b, dt_bht, decay_cumsum, seq_idx, cu_seqlens, entry_states, chunk_size, config, dtype):
    """Batch-1 packed sequences -> [num_sequences, heads, head_size, state_size] in ``dtype``."""
    _, _, heads, head_size = x.shape
    state_size = b.shape[3]
    num_sequences = cu_seqlens.numel() - 1
    states = new_output(num_sequences, heads, head_size, state_size, dtype=dtype, device=x.device)
    # Few blocks, each a serial walk of up to a segment of chunks: 64 x 64 tiles at most give
    # more of them than the state pass's wider tiles.
    hp, np_ = min(config.state_head_tile, 64), min(config.state_tile, 64)
    launch((num_sequences, heads, (head_size // hp) * (state_size // np_)), varlen_states_kernel,
           (x, b, dt_bht, decay_cumsum, seq_idx, cu_seqlens, entry_states, states,
            config.chunks_per_segment, chunk_size, hp, np_, tf32_mma(x.dtype)))
    return states
