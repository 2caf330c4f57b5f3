"""Per-sequence initial states (``initial_states`` [num_sequences, ...] with cu_seqlens).

The recurrence is linear in the initial state, so sequence s's own initial state I_s adds
    exp(sum of a*dt over the sequence up to t) * C_t I_s^T      to each output t of s (times silu(z_t)),
    exp(sum of a*dt over the whole sequence) * I_s              to its final state,
on top of a run with zero initial states. One block per (sequence, head, head_size tile)
walks its sequence's chunks; blocks of sequences that share a chunk touch disjoint tokens,
so outputs are updated through masked gathers and scatters.

mamba_ssm has no per-sequence initial states; this path reads and rewrites the outputs once
more (one more rounding to x's dtype) instead of being fused into the stages.
"""
import cuda.tile as ct

from ..runtime.launch import launch, tf32_mma


@ct.kernel
def sequence_init_kernel(out, varlen_states, c, z, decay_cumsum, cu_seqlens, initial_states,
                         chunk_size: ct.Constant[int], head_tile: ct.Constant[int],
                         state_size: ct.Constant[int], has_z: ct.Constant[bool], tf32: ct.Constant[bool]):
    sequence, head, p_tile = ct.bid(0), ct.bid(1), ct.bid(2)
    mma_dtype = ct.tfloat32 if tf32 else c.dtype  # as compute_out_kernel's
    group = head // (out.shape[2] // c.shape[2])
    start = ct.load(cu_seqlens, (sequence,), (1,)).item()
    end = ct.load(cu_seqlens, (sequence + 1,), (1,)).item()

    init_t = ct.load(initial_states, (sequence, head, 0, p_tile), (1, 1, state_size, head_tile),
                     order=(0, 1, 3, 2)).reshape((state_size, head_tile))
    token = ct.arange(chunk_size, dtype=ct.int32)
    channel = p_tile * head_tile + ct.arange(head_tile, dtype=ct.int32)
    first = start // chunk_size
    # Decay (log2) from the sequence's start to the current chunk's start: the first chunk's
    # sums begin before the sequence does, so subtract what precedes it there.
    g_first = ct.load(decay_cumsum, (0, head, first), (1, 1, chunk_size)).reshape((chunk_size,))
    before = ct.sum(ct.where(token == start - first * chunk_size - 1, g_first, 0.0), axis=0, keepdims=True)
    offset = -before
    growth_end = ct.zeros((1,), dtype=ct.float32)
    for chunk in range(first, (end - 1) // chunk_size + 1):
        g = ct.load(decay_cumsum, (0, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        position = chunk * chunk_size + token
        inside = (position >= start) & (position < end)
        growth = ct.where(inside, ct.exp2(offset + g), 0.0)
        c_tile = ct.load(c, (0, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
        added = ct.mma((c_tile.astype(ct.float32) * growth[:, None]).astype(mma_dtype),
                       init_t.astype(mma_dtype), ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        where = (0, position[:, None], head, channel[None, :])
        if has_z:
            gate = ct.gather(z, where, mask=inside[:, None]).astype(ct.float32)
            added = added * gate / (1.0 + ct.exp(-gate))
        old = ct.gather(out, where, mask=inside[:, None]).astype(ct.float32)
        ct.scatter(out, where, (old + added).astype(out.dtype), mask=inside[:, None])
        growth_end = growth_end + ct.sum(ct.where(position == end - 1, growth, 0.0), axis=0, keepdims=True)
        offset = offset + ct.extract(g, (chunk_size - 1,), (1,))

    final_t = ct.load(varlen_states, (sequence, head, 0, p_tile), (1, 1, state_size, head_tile),
                      order=(0, 1, 3, 2)).reshape((state_size, head_tile))
    ct.store(varlen_states, (sequence, head, 0, p_tile),
             (final_t + growth_end * init_t).reshape((1, 1, state_size, head_tile)), order=(0, 1, 3, 2))


def add_sequence_initial_states(out, varlen_states, x, c, z, decay_cumsum, cu_seqlens, initial_states,
                                chunk_size, config):
    """Adds each sequence's initial-state terms to out and to varlen_states (fp32), in place."""
    _, _, heads, head_size = x.shape
    num_sequences = cu_seqlens.numel() - 1
    head_tile = config.out_head_tile
    launch((num_sequences, heads, head_size // head_tile), sequence_init_kernel,
           (out, varlen_states, c, decay_cumsum if z is None else z, decay_cumsum, cu_seqlens, initial_states,
            chunk_size, head_tile, c.shape[3], z is not None, tf32_mma(c.dtype)))
