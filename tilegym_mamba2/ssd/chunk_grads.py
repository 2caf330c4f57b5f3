"""Every gradient of the scan that involves a state, from the chunk's entry state S and the
gradient dS of the state it leaves (reference/chunk_grads.py, chunk_grads_reference, states the formulas):
dx = dt * dh b + D * dy, x . (dh b) in fp32 (for ddt) and the log decay's gradient dl of each
head, and dc, db summed over a block's heads in fp32. Two kernels, each one block per (batch,
chunk, a few heads of one group), head by head: the columns kernel takes each token as a sender
(dx, ddt_input, db, dl's terms of tokens before u), then the rows kernel each token as a
receiver (dc, dl's terms of tokens from u on, added to dl). One kernel doing both was slower
and took all of shared memory (docs/design.md, Decisions).

Summing per-token terms of the forward and backward outputs over the rest of the sequence
gives the same dl in exact arithmetic, but there receiver and sender terms cancel over
thousands of tokens and bf16 rounding is left: 0.04-0.2 relative error in ddt measured on the
H200 (in-chunk sums: 1.7-3.3e-3). Here every term is a sum of products within one chunk.

The two chunk-by-chunk products, c_t . b_s and dy_t . x_s, each serve two gradients: with the
decay D_ts they give dxs (and dl) and dc, db (and dl). Scanning the transposed state for dc and
db instead (the first backward) ran two more passes over every token (docs/design.md, "Decisions").

Entry states are stored transposed, [.., chunks * state_size, head_size], as the state pass
leaves them; the reversed scan's are in reversed chunk order, before its shifted decay (so
dS = exp2(the next chunk's first decay) * entry).
"""
import cuda.tile as ct
import torch

from .compute_out import NO_SKIP, SKIP_PER_CHANNEL, SKIP_PER_HEAD
from ..runtime.launch import launch, new_output, tf32_mma

# Heads whose db or dc one block sums: fewer, fp32 partial sums, and c . b once for them all,
# against fewer blocks in flight: 16 was fastest (docs/design.md, Decisions). A runtime
# argument, not a constant, so that head counts with different blocks share a compile, at the
# same speed.
BLOCK_HEADS = 16


@ct.function
def _shared_by_heads(b, c, seq_idx, batch, chunk, group, tokens, chunk_size, state_size, has_seq):
    """What a block's heads share: the group's b and c tiles and the sequence masks ([t, s]: s <= t
    in one sequence; tokens of the sequence carried in from the previous chunk; tokens of the one
    going on into the next)."""
    b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
    c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
    token = ct.arange(chunk_size, dtype=ct.int32)
    same = token[:, None] >= token[None, :]    # [t, s]: s <= t
    carried = token >= 0
    going_on = token >= 0
    if has_seq:
        seq = ct.load(seq_idx, (batch, chunk), (1, chunk_size), padding_mode=ct.PaddingMode.ZERO).reshape(
            (chunk_size,))
        before = ct.load(seq_idx, (batch, max(chunk * chunk_size - 1, 0)), (1, 1)).reshape((1,))
        after = ct.load(seq_idx, (batch, min((chunk + 1) * chunk_size, tokens - 1)), (1, 1)).reshape((1,))
        carried = seq == before
        going_on = seq == after
        same = same & (seq[:, None] == seq[None, :])
    return b_tile, c_tile, same, carried, going_on


@ct.function
def split_mma(weights, operand, acc, mma_dtype):
    """acc + weights @ operand with fp32 ``weights`` split into two mma operands, the rounded
    weights and what rounding left: the product to about fp32's precision (16-bit weights alone
    lose 2^-9 of each; summed over a group's heads that broke TileGym's db check, 0.06 off where
    0.05 is allowed)."""
    high = weights.astype(mma_dtype)
    low = (weights - high.astype(ct.float32)).astype(mma_dtype)
    return ct.mma(low, operand, ct.mma(high, operand, acc))


@ct.function
def _head_tiles(x, dy, dt_bht, decay_cumsum, batch, chunk, head, chunk_size, head_size):
    """One head's x, dy, dt and decay sums in the chunk."""
    x_tile = ct.load(x, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_size))
    dy_tile = ct.load(dy, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),
                      padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_size))
    dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    return x_tile, dy_tile, dt_tile, g


@ct.kernel(occupancy=2)
def chunk_grads_columns_kernel(x, b, c, dy, dy_low, dt_bht, decay_cumsum, entry_states, rev_entry_states, seq_idx,
                               d, dx, ddt_input, dl, db, dd, chunk_size: ct.Constant[int], head_size: ct.Constant[int],
                               state_size: ct.Constant[int], has_seq: ct.Constant[bool],
                               has_dy_low: ct.Constant[bool], skip_mode: ct.Constant[int], block_heads: int,
                               tf32: ct.Constant[bool]):
    """Each token s as a sender: dx, ddt_input, db (summed over the block's heads) and dl's terms
    from s < u (written to dl; the rows kernel adds the receivers' terms); with a skip, dd's sum
    of dy * x over the chunk's tokens (dy and x are in registers here; a separate torch reduction
    that read them again was slower: docs/design.md, Decisions).

    Its chunk-by-chunk tiles are [s, t], senders along the rows, the transpose of the rows
    kernel's: sums over receivers t become row sums and the dxs and db products take the tiles
    untransposed. On [t, s] tiles the kernel spilled (docs/design.md, Decisions)."""
    batch_block, chunk = ct.bid(0), ct.bid(1)
    heads = x.shape[2]
    blocks = heads // block_heads
    batch, block = batch_block // blocks, batch_block % blocks
    group = block * block_heads // (heads // b.shape[2])
    num_chunks = dt_bht.shape[2] // chunk_size
    reversed_chunk = num_chunks - 1 - chunk
    mma_dtype = ct.tfloat32 if tf32 else x.dtype  # the mma operands' (launch.tf32_mma)
    b_tile, c_tile, same, carried, going_on = _shared_by_heads(
        b, c, seq_idx, batch, chunk, group, x.shape[1], chunk_size, state_size, has_seq)
    b_op, c_op = b_tile.astype(mma_dtype), c_tile.astype(mma_dtype)
    same = ct.transpose(same)                                                              # [s, t]
    scores = ct.mma(b_op, ct.transpose(c_op), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    token = ct.arange(chunk_size, dtype=ct.int32)
    # db summed over the block's heads in fp32: one store per block, not a rounded one per head
    # (the group's sum can cancel, and per-head stores moved heads x the bytes). Its in-chunk
    # part sum_t (sum_h dt_s D_ts dy_t . x_s) c_t takes the heads' weights summed first, in fp32,
    # and one mma at the end (split_mma), not one per head on weights rounded per head.
    db_sum = ct.zeros((chunk_size, state_size), dtype=ct.float32)
    sent_weights = ct.zeros((chunk_size, chunk_size), dtype=ct.float32)

    for i in range(block_heads):
        head = block * block_heads + i
        x_tile, dy_tile, dt_tile, g = _head_tiles(x, dy, dt_bht, decay_cumsum, batch, chunk, head, chunk_size,
                                                  head_size)
        x_op, dy_op = x_tile.astype(mma_dtype), dy_tile.astype(mma_dtype)
        g_end = ct.extract(g, (chunk_size - 1,), (1,))
        # The decay into the next chunk's first token (none after the last chunk). Where a sequence
        # ends with the chunk, from_end and going_on drop every term it scales.
        following = ct.load(decay_cumsum, (batch, head, min(chunk + 1, num_chunks - 1)), (1, 1, chunk_size))
        next_first = ct.extract(following.reshape((chunk_size,)), (0,), (1,))
        into_next = ct.exp2(ct.where(chunk + 1 < num_chunks, next_first, 0.0))

        decay = ct.exp2(ct.where(same, g[None, :] - g[:, None], never))                  # D_ts at [s, t]
        products = ct.mma(x_op, ct.transpose(dy_op), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        if has_dy_low:
            dy_low_tile = ct.load(dy_low, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),
                                  padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_size))
            dy_low_op = dy_low_tile.astype(mma_dtype)
            products = ct.mma(x_op, ct.transpose(dy_low_op), products)
        if skip_mode == SKIP_PER_HEAD:
            # dd of a head: the trace of x_s . dy_t, row sums in the warps (a sum over the chunk's
            # tokens of x * dy runs across them and was slower: docs/design.md, Decisions).
            diagonal = ct.where(token[:, None] == token[None, :], products, 0.0)
            ct.store(dd, (batch, chunk, head), ct.sum(ct.sum(diagonal, axis=1), axis=0, keepdims=True).reshape(
                (1, 1, 1)))
        decayed_products = decay * products                                               # D_ts (dy_t . x_s)
        from_end = ct.where(going_on, ct.exp2(g_end - g), 0.0)
        # dl from pairs s < u <= t: the rows kernel's sum over t >= u of what t receives, less the
        # sum over s >= u of what s sends (the pairs with s >= u cancel, within one chunk in fp32).
        # The direct sum, a cumsum along the rows, made the rows kernel three times slower for a
        # dl error already below bf16's (docs/design.md, Decisions).
        pairs = decayed_products * dt_tile[:, None] * scores
        sent_pairs = ct.sum(pairs, axis=1)

        # The gradient leaving the chunk: sent by s < u (dl), and dxs's and db's second terms.
        # The states come in x's dtype from the walks (chunk_states_walk.py): into_next scales the
        # products, not the stored state, so that the mma operand is rounded once.
        grad_t = ct.load(rev_entry_states, (batch, head, reversed_chunk, 0), (1, 1, state_size, head_size)).reshape(
            (state_size, head_size))
        to_grad = ct.mma(b_op, grad_t.astype(mma_dtype),
                         ct.zeros((chunk_size, head_size), dtype=ct.float32)) * into_next
        x_f32 = x_tile.astype(ct.float32)
        sent = dt_tile * from_end * ct.sum(x_f32 * to_grad, axis=1)
        # D_ts (c_t . b_s) split too: rounded once to x's dtype, a slow-decaying head's sum over
        # the chunk's receivers put dx 2.9x TileGym's allowed error off its reference.
        dxs_tile = split_mma(decay * scores, dy_op, to_grad * from_end[:, None], mma_dtype)
        ct.store(ddt_input, (batch, head, chunk), ct.sum(x_f32 * dxs_tile, axis=1).reshape((1, 1, chunk_size)))
        dx_tile = dxs_tile * dt_tile[:, None]
        if skip_mode != NO_SKIP:
            dy_f32 = dy_tile.astype(ct.float32)
            if has_dy_low:
                dy_f32 = dy_f32 + dy_low_tile.astype(ct.float32)
            if skip_mode == SKIP_PER_HEAD:
                dx_tile = dx_tile + ct.load(d, (head,), (1,)).reshape((1, 1)) * dy_f32
            else:
                dx_tile = dx_tile + ct.load(d, (head, 0), (1, head_size)) * dy_f32
                ct.store(dd, (batch, chunk, head, 0), ct.sum(x_f32 * dy_f32, axis=0).reshape((1, 1, 1, head_size)))
        ct.store(dx, (batch, chunk, head, 0), dx_tile.astype(dx.dtype).reshape((1, chunk_size, 1, head_size)))
        db_sum = db_sum + ct.mma(x_op, ct.transpose(grad_t.astype(mma_dtype)),
                                 ct.zeros((chunk_size, state_size), dtype=ct.float32)) * (
            from_end * into_next * dt_tile)[:, None]
        sent_weights = sent_weights + decayed_products * dt_tile[:, None]

        state_t = ct.load(entry_states, (batch, head, chunk, 0), (1, 1, state_size, head_size)).reshape(
            (state_size, head_size))
        through = ct.exp2(g_end) * into_next * ct.sum(
            ct.sum(grad_t.astype(ct.float32) * state_t.astype(ct.float32), axis=1), axis=0, keepdims=True)
        dl_tile = (ct.cumsum(sent, axis=0) - sent
                   - (ct.sum(sent_pairs, axis=0, keepdims=True) - ct.cumsum(sent_pairs, axis=0) + sent_pairs)
                   + ct.where(carried & going_on, through, 0.0))
        ct.store(dl, (batch, head, chunk), dl_tile.reshape((1, 1, chunk_size)))

    db_sum = split_mma(sent_weights, c_op, db_sum, mma_dtype)
    ct.store(db, (batch, chunk, block, 0), db_sum.reshape((1, chunk_size, 1, state_size)))


@ct.kernel(occupancy=2)
def chunk_grads_rows_kernel(x, b, c, dy, dy_low, dt_bht, decay_cumsum, entry_states, seq_idx, a, dl, ddt, da, dc,
                            chunk_size: ct.Constant[int], head_size: ct.Constant[int],
                            state_size: ct.Constant[int], has_seq: ct.Constant[bool],
                            has_dy_low: ct.Constant[bool], block_heads: int, tf32: ct.Constant[bool]):
    """Each token t as a receiver: dc (summed over the block's heads) and dl's terms from t >= u,
    added to what the columns kernel left in dl; then, dl complete, ddt = ddt_input + a dl (in
    place of the columns kernel's ddt_input) and da's sum of dt dl over the chunk (as torch ops
    after the kernel they were two transposes and four kernels more)."""
    batch_block, chunk = ct.bid(0), ct.bid(1)
    heads = x.shape[2]
    blocks = heads // block_heads
    batch, block = batch_block // blocks, batch_block % blocks
    group = block * block_heads // (heads // b.shape[2])
    mma_dtype = ct.tfloat32 if tf32 else x.dtype  # the mma operands' (launch.tf32_mma)
    b_tile, c_tile, same, carried, going_on = _shared_by_heads(
        b, c, seq_idx, batch, chunk, group, x.shape[1], chunk_size, state_size, has_seq)
    b_op, c_op = b_tile.astype(mma_dtype), c_tile.astype(mma_dtype)
    scores = ct.mma(c_op, ct.transpose(b_op), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))  # [t, s]
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    dc_sum = ct.zeros((chunk_size, state_size), dtype=ct.float32)
    received_weights = ct.zeros((chunk_size, chunk_size), dtype=ct.float32)  # as the columns kernel's

    for i in range(block_heads):
        head = block * block_heads + i
        x_tile, dy_tile, dt_tile, g = _head_tiles(x, dy, dt_bht, decay_cumsum, batch, chunk, head, chunk_size,
                                                  head_size)
        x_op, dy_op = x_tile.astype(mma_dtype), dy_tile.astype(mma_dtype)

        decay = ct.exp2(ct.where(same, g[:, None] - g[None, :], never))                  # D_ts
        products = ct.mma(dy_op, ct.transpose(x_op), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        dy_f32 = dy_tile.astype(ct.float32)
        if has_dy_low:
            dy_low_tile = ct.load(dy_low, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),
                                  padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_size))
            dy_low_op = dy_low_tile.astype(mma_dtype)
            products = ct.mma(dy_low_op, ct.transpose(x_op), products)
            dy_f32 = dy_f32 + dy_low_tile.astype(ct.float32)
        decayed_products = decay * products                                               # D_ts (dy_t . x_s)
        into = ct.where(carried, ct.exp2(g), 0.0)
        # The columns kernel's pairs, transposed: the pairs with s >= u cancel to fp32 rounding
        # (the two mma sum dy . x and c . b in their own orders).
        pairs = decayed_products * dt_tile[None, :] * scores

        # The entry state: received by t >= u (dl), and dc's first term.
        state_t = ct.load(entry_states, (batch, head, chunk, 0), (1, 1, state_size, head_size)).reshape(
            (state_size, head_size))
        from_state = ct.mma(c_op, state_t.astype(mma_dtype), ct.zeros((chunk_size, head_size), dtype=ct.float32))
        received = into * ct.sum(dy_f32 * from_state, axis=1) + ct.sum(pairs, axis=1)
        dl_tile = (ct.load(dl, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
                   + ct.sum(received, axis=0, keepdims=True) - ct.cumsum(received, axis=0) + received)
        ddt_tile = (ct.load(ddt, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
                    + ct.load(a, (head,), (1,)) * dl_tile)
        ct.store(ddt, (batch, head, chunk), ddt_tile.reshape((1, 1, chunk_size)))
        ct.store(da, (batch, head, chunk), ct.sum(dt_tile * dl_tile, axis=0, keepdims=True).reshape((1, 1, 1)))
        dc_sum = dc_sum + ct.mma(dy_op, ct.transpose(state_t.astype(mma_dtype)),
                                 ct.zeros((chunk_size, state_size), dtype=ct.float32)) * into[:, None]
        received_weights = received_weights + decayed_products * dt_tile[None, :]

    dc_sum = split_mma(received_weights, b_op, dc_sum, mma_dtype)
    ct.store(dc, (batch, chunk, block, 0), dc_sum.reshape((1, chunk_size, 1, state_size)))


def block_heads_for(heads_per_group):
    """Heads per block: the largest divisor of a group's heads up to BLOCK_HEADS."""
    return max(k for k in range(1, min(BLOCK_HEADS, heads_per_group) + 1) if heads_per_group % k == 0)


def chunk_grads(x, b, c, dy, dy_low, dt_bht, decay_cumsum, entry_states, rev_entry_states, seq_idx, d, a,
                chunk_size):
    """x, dy [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size];
    dy_low like dy or None: what rounding dy to x's dtype left out, where dy is a product (the
    gated gradient of the layer op), added to dy in the dy . x products, the dy . (c S) terms and
    D dy (the mixer's dA error from float64 1.47e-3 -> 7.6e-4; mamba_ssm 1.16e-3);
    dt_bht, decay_cumsum [batch, heads, chunks * chunk_size];
    entry_states, rev_entry_states [batch, heads, chunks * state_size, head_size] (one per chunk) in
    x's dtype from the walks, fp32 from the state pass (a scan that also makes y, the flipped
    scan of sequences with their own initial states);
    seq_idx [batch, tokens] int32 or None; d (the skip) [heads] or [heads, head_size] fp32 or None;
    a [heads] fp32
    -> (dx like x, ddt = x . dh b + a dl [batch, heads, chunks * chunk_size] fp32 (stored along
        the tokens: one [batch, tokens, heads] store per token would be strided), da's sums of
        dt dl per chunk [batch, heads, chunks] fp32,
        db and dc fp32 [batch, tokens, blocks, state_size], each summed over a block of one
        group's heads (block_heads_for), to be summed over each group's blocks,
        dd = the sum of dy * x over each chunk's tokens, fp32 [batch, chunks, heads] for d per head,
        [batch, chunks, heads, head_size] per channel, None without d)."""
    batch, tokens, heads, head_size = x.shape
    state_size = b.shape[3]
    padded = dt_bht.shape[2]
    block_heads = block_heads_for(heads // b.shape[2])
    blocks = heads // block_heads
    dx = new_output(*x.shape, dtype=x.dtype, device=x.device)
    ddt_input, dl = new_output(2, batch, heads, padded, dtype=torch.float32, device=x.device).unbind(0)
    # Two buffers, not views of one: with one block per group they are the op's returns.
    db, dc = (new_output(batch, tokens, blocks, state_size, dtype=torch.float32, device=x.device) for _ in range(2))
    skip_mode = NO_SKIP if d is None else SKIP_PER_HEAD if d.ndim == 1 else SKIP_PER_CHANNEL
    chunks = padded // chunk_size
    # The per-chunk sums' chunk axis is allocated to a multiple of 16 and returned as a view of the
    # chunks: cuTile specializes on each size's and stride's divisibility by 16, so an axis of
    # exactly `chunks` would compile both kernels again whenever the count of chunks changes class,
    # which the background compile of the other token-count classes (runtime/other_token_class.py,
    # replays at the call's own count of chunks) cannot foresee.
    stored_chunks = -(-chunks // 16) * 16
    dd = None if d is None else new_output(batch, stored_chunks, heads, *d.shape[1:], dtype=torch.float32,
                                           device=x.device)
    grid = (batch * blocks, chunks)
    tf32 = tf32_mma(x.dtype)
    dy_low = dy if dy_low is None else dy_low
    seq = dl if seq_idx is None else seq_idx
    launch(grid, chunk_grads_columns_kernel,
           (x, b, c, dy, dy_low, dt_bht, decay_cumsum, entry_states, rev_entry_states, seq,
            dl if d is None else d, dx, ddt_input, dl, db, dl if dd is None else dd, chunk_size, head_size,
            state_size, seq_idx is not None, dy_low is not dy, skip_mode, block_heads, tf32))
    da = new_output(batch, heads, stored_chunks, dtype=torch.float32, device=x.device)
    launch(grid, chunk_grads_rows_kernel,
           (x, b, c, dy, dy_low, dt_bht, decay_cumsum, entry_states, seq, a, dl, ddt_input, da, dc, chunk_size,
            head_size, state_size, seq_idx is not None, dy_low is not dy, block_heads, tf32))
    return dx, ddt_input, da[:, :, :chunks], db, dc, None if dd is None else dd[:, :chunks]
