"""Stage 3: the output, walking each segment's chunks with the state in registers.

For chunk k with entry state S (head_size x state_size) and decay sums g:
    Y = exp2(g) * C S^T + (exp2(g_i - g_j) * [i >= j] * dt_j * (C B^T)_ij) X + d * X
then S <- exp2(g_last) S + X^T (dt * exp2(g_last - g) * B) for the next chunk. C B^T, the
decay and the causal mask stay in registers; because the block carries the state from one
chunk to the next, only one entry state per segment is read from memory.

Unlike the state pass, this kernel carries the state untransposed, [head_size, state_size], and
reads B as stored: 2.2-2.9x faster on the H200 than carrying the transposed state with B
loaded transposed (docs/design.md, Decisions). The entry state, stored
transposed by the state pass, is transposed once per segment by its load.

With ``config.group_scores`` the C·B^T tiles come from group_scores.py, computed once per
group, instead of from an mma in every (head, head tile) block.

The layer op's options are compile-time switches, so the plain op's kernel is unchanged:
packed sequences add "same sequence" to the causal mask and drop the carried state for tokens
of a sequence that started after it; D may be per channel; z gates the output, y * silu(z).
"""
import cuda.tile as ct

from .group_scores import group_scores
from ..runtime.launch import launch, new_output, tf32_mma
from ..runtime.tuning import segment_count

NO_SKIP, SKIP_PER_HEAD, SKIP_PER_CHANNEL = 0, 1, 2


@ct.kernel(occupancy=2)
def compute_out_kernel(x, b, c, d, z, seq_idx, scores, dt_bht, decay_cumsum, entry_states, out, ungated,
                       final_state, store_final, store_ungated, chunks_per_segment, chunk_size: ct.Constant[int], head_tile: ct.Constant[int],
                       state_size: ct.Constant[int], skip_mode: ct.Constant[int],
                       has_z: ct.Constant[bool], has_seq: ct.Constant[bool], has_scores: ct.Constant[bool],
                       load_latency: ct.Constant[int], tf32: ct.Constant[bool]):
    batch_head, segment, p_tile = ct.bid(0), ct.bid(1), ct.bid(2)
    # The mma operands: x's dtype, or tf32 for fp32 inputs where PyTorch's float32 matmul
    # precision allows it (launch.tf32_mma); a no-op cast otherwise.
    mma_dtype = ct.tfloat32 if tf32 else x.dtype
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    num_chunks = dt_bht.shape[2] // chunk_size

    state = ct.load(entry_states, (batch, head, p_tile, segment), (1, 1, head_tile, state_size),
                    order=(0, 1, 3, 2)).reshape((head_tile, state_size))
    if skip_mode == SKIP_PER_CHANNEL:
        skip = ct.load(d, (head, p_tile), (1, head_tile))
    elif skip_mode == SKIP_PER_HEAD:
        skip = ct.load(d, (head,), (1,)).reshape((1, 1))
    token = ct.arange(chunk_size, dtype=ct.int32)
    causal = token[:, None] >= token[None, :]
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    hint = None if load_latency == 0 else load_latency  # 0: the compiler's own estimate

    first = segment * chunks_per_segment
    if has_seq:
        # The sequence the carried state belongs to (for the row's first chunk, the row's first).
        state_seq = ct.load(seq_idx, (batch, max(first * chunk_size - 1, 0)), (1, 1)).reshape((1,))
    for chunk in range(first, min(first + chunks_per_segment, num_chunks)):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO, latency=hint).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=ct.PaddingMode.ZERO, latency=hint).reshape((chunk_size, state_size))
        c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=ct.PaddingMode.ZERO, latency=hint).reshape((chunk_size, state_size))
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        state_decay = ct.exp2(g)
        later_weight = dt_tile * ct.exp2(g_last - g)
        keep = ct.exp2(g_last)

        if has_scores:
            c_b = ct.load(scores, (batch, group, chunk, 0), (1, 1, chunk_size, chunk_size)).reshape(
                (chunk_size, chunk_size))
        else:
            c_b = ct.mma(c_tile.astype(mma_dtype), ct.transpose(b_tile.astype(mma_dtype)),
                         ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        # Masking the exponent (not the product) keeps exp2 of the upper triangle from overflowing.
        visible = causal
        if has_seq:
            seq = ct.load(seq_idx, (batch, chunk), (1, chunk_size),
                          padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size,))
            visible = causal & (seq[:, None] == seq[None, :])
            state_decay = ct.where(seq == state_seq, state_decay, 0.0)
            # Padded tokens read as sequence 0; they only occur in the last chunk, whose
            # outgoing state is never used.
            end_seq = ct.extract(seq, (chunk_size - 1,), (1,))
            later_weight = ct.where(seq == end_seq, later_weight, 0.0)
            keep = ct.where(state_seq == end_seq, keep, 0.0)
            state_seq = end_seq
        decay = ct.exp2(ct.where(visible, g[:, None] - g[None, :], never))
        weights = (c_b * decay * dt_tile[None, :]).astype(mma_dtype)
        y = ct.mma(weights, x_tile.astype(mma_dtype), ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        c_decayed = (c_tile.astype(ct.float32) * state_decay[:, None]).astype(mma_dtype)
        y = ct.mma(c_decayed, ct.transpose(state.astype(mma_dtype)), y)
        if skip_mode != NO_SKIP:
            y = y + skip * x_tile.astype(ct.float32)
        if has_z:
            if store_ungated != 0:
                ct.store(ungated, (batch, chunk, head, p_tile),
                         y.astype(ungated.dtype).reshape((1, chunk_size, 1, head_tile)))
            gate = ct.load(z, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                           padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile)).astype(ct.float32)
            y = y * gate / (1.0 + ct.exp(-gate))
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))

        weighted_b = (b_tile.astype(ct.float32) * later_weight[:, None]).astype(mma_dtype)
        state = ct.mma(ct.transpose(x_tile.astype(mma_dtype)), weighted_b, state * keep)
    # Runtime switches (store_ungated too), so both uses share one compiled kernel.
    if store_final != 0:
        ct.store(final_state, (batch, head, p_tile, 0), state.reshape((1, 1, head_tile, state_size)))


# By config.out_occupancy (tuning.py).
KERNELS = {2: compute_out_kernel, 1: compute_out_kernel.replace_hints(occupancy=1)}


def compute_out(x, b, c, d, dt_bht, decay_cumsum, entry_states, final_state, chunk_size, config, *,
                store_final=False, z=None, seq_idx=None, ungated=None):
    """entry_states: [batch, heads, segments * state_size, head_size] fp32, as the state pass
    leaves them; d: [heads], [heads, head_size] or None; z: like x or None; seq_idx: [batch, tokens]
    int32 or None; final_state: [batch, heads, head_size, state_size] fp32, written when
    ``store_final`` (one segment per row: its block walks the whole row), else unread; ungated:
    like x or None, with z: gets y + d x before the gate (what the backward's dz takes).
    -> out [batch, tokens, heads, head_size] in x's dtype."""
    batch, _, heads, head_size = x.shape
    segments = segment_count(dt_bht, chunk_size, config)
    out = new_output(*x.shape, dtype=x.dtype, device=x.device)
    skip_mode = NO_SKIP if d is None else SKIP_PER_HEAD if d.ndim == 1 else SKIP_PER_CHANNEL
    unused = dt_bht  # stands in for absent optional arrays; never read
    scores = group_scores(b, c, dt_bht.shape[2] // chunk_size, chunk_size) if config.group_scores else None
    grid = (batch * heads, segments, head_size // config.out_head_tile)
    launch(grid, KERNELS[config.out_occupancy],
           (x, b, c, unused if d is None else d, unused if z is None else z,
            unused if seq_idx is None else seq_idx, unused if scores is None else scores, dt_bht, decay_cumsum,
            entry_states, out, out if ungated is None else ungated, final_state, int(store_final),
            int(ungated is not None),
            config.chunks_per_segment, chunk_size, config.out_head_tile, b.shape[3], skip_mode,
            z is not None, seq_idx is not None, scores is not None, config.out_load_latency, tf32_mma(x.dtype)))
    return out
