"""The plain op's short rows in one launch: segments chained through memory.

A call on a short row (the 2048-token prefill) is host-bound: four launches and their
allocations cost more CPU time than the GPU work (docs/design.md, "Limits").
Here one kernel does all three stages. Block (segment, row and head, head tile):
  1. computes its segment's state from zero and the segment's decay, with its chunks' decay
     sums (chunk_cumsum's arithmetic), which it keeps in a workspace for step 3;
  2. waits for the block of the segment before to publish the state entering this segment (a
     flag polled with an acquiring compare-and-swap that also clears it), then publishes the
     state leaving its own, entry * exp2(decay) + own, and sets the next flag (a release); the
     last segment stores the final state instead: the state pass's arithmetic, one hop a segment;
  3. computes its chunks' outputs from the entry state, as compute_out does.
A block takes a ticket (an atomic counter) when it starts and works on the segment the ticket
names, segment-major, so it only ever waits for a block that started before it: no deadlock in
any order the hardware starts blocks. The last ticket resets the counter and each flag is
cleared by the one block that waits on it, so the workspace is clean when the kernel ends.

The workspace is kept per (device, stream): kernels on one stream run in order, so they never
share it at the same time. A call being captured into a CUDA graph gets a workspace of its own
(allocated from the graph's pool, zeroed by the graph itself): graphs captured on one stream may
be replayed on several streams at once.
"""
import math

import cuda.tile as ct
import torch

from ..core.constants import LOG2E
from ..runtime.launch import current_stream, launch, new_output, tf32_mma
from ..runtime.tuning import capturing


@ct.kernel(occupancy=2)
def chained_prefill_kernel(x, b, c, d, dt, a, init_state, out, final_state, published, sums, sync,
                           chunks_per_segment, chunk_size: ct.Constant[int], head_tile: ct.Constant[int],
                           state_size: ct.Constant[int], has_init: ct.Constant[bool], tf32: ct.Constant[bool]):
    # Few arguments: each costs ~0.5-0.7 us of host time at every launch. sums holds dt
    # and the decay sums ([2, batch, heads, padded tokens]); sync the ticket counter, a word the
    # fence touches, then one flag per block.
    mma_dtype = ct.tfloat32 if tf32 else x.dtype
    heads = x.shape[2]
    p_tiles = x.shape[3] // head_tile
    lanes = x.shape[0] * heads * p_tiles
    ticket = ct.atomic_add(sync, 0, 1)
    if ticket == ct.num_blocks(0) - 1:
        ct.atomic_xchg(sync, 0, 0)  # every ticket is taken: the counter is ready for the next launch
    segment, lane = ticket // lanes, ticket % lanes
    batch_head, p_tile = lane // p_tiles, lane % p_tiles
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    num_chunks = ct.cdiv(x.shape[1], chunk_size)
    first = segment * chunks_per_segment
    last = min(first + chunks_per_segment, num_chunks)
    a_head = ct.load(a, (head,), (1,))
    zero = ct.PaddingMode.ZERO

    # 1. The segment's own state (from zero) and its decay, before any wait.
    own = ct.zeros((head_tile, state_size), dtype=ct.float32)
    segment_decay = ct.zeros((1,), dtype=ct.float32)
    for chunk in range(first, last):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=zero).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=zero).reshape((chunk_size, state_size))
        dt_tile = ct.load(dt, (batch, chunk, head), (1, chunk_size, 1), padding_mode=zero).astype(
            ct.float32).reshape((chunk_size,))
        g = ct.cumsum(dt_tile * a_head, axis=0) * LOG2E
        # Kept for step 3 (recomputing them there measured 25 us slower). The head's other tiles
        # store the same values to the same place.
        ct.store(sums, (0, batch, head, chunk), dt_tile.reshape((1, 1, 1, chunk_size)))
        ct.store(sums, (1, batch, head, chunk), g.reshape((1, 1, 1, chunk_size)))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        weighted_b = (b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]).astype(mma_dtype)
        own = ct.mma(ct.transpose(x_tile.astype(mma_dtype)), weighted_b, own * ct.exp2(g_last))
        segment_decay = segment_decay + g_last

    # 2. The chain: the entry state from the segment before, the leaving state to the next.
    if segment == 0:
        if has_init:
            entry = ct.load(init_state, (batch, head, p_tile, 0), (1, 1, head_tile, state_size)).reshape(
                (head_tile, state_size))
        else:
            entry = ct.zeros((head_tile, state_size), dtype=ct.float32)
    else:
        flag = FIRST_FLAG + (segment - 1) * lanes + lane
        seen = ct.atomic_cas(sync, flag, 1, 0, memory_order=ct.MemoryOrder.ACQUIRE)
        while seen != 1:
            seen = ct.atomic_cas(sync, flag, 1, 0, memory_order=ct.MemoryOrder.ACQUIRE)
        entry = ct.load(published, (segment - 1, batch_head, p_tile, 0), (1, 1, head_tile, state_size),
                        allow_tma=False).reshape((head_tile, state_size))
    leaving = entry * ct.exp2(segment_decay) + own
    if last < num_chunks:
        ct.store(published, (segment, batch_head, p_tile, 0), leaving.reshape((1, 1, head_tile, state_size)),
                 allow_tma=False)
        ct.atomic_xchg(sync, FIRST_FLAG + segment * lanes + lane, 1, memory_order=ct.MemoryOrder.RELEASE)
    else:
        ct.store(final_state, (batch, head, p_tile, 0), leaving.reshape((1, 1, head_tile, state_size)))
    # Orders this block's stores of the sums before its own loads of them in step 3.
    ct.atomic_add(sync, 1, 0, memory_order=ct.MemoryOrder.ACQ_REL, memory_scope=ct.MemoryScope.BLOCK)

    # 3. The outputs, as compute_out computes them, from the entry state.
    state = entry
    skip = ct.load(d, (head,), (1,)).reshape((1, 1))
    token = ct.arange(chunk_size, dtype=ct.int32)
    causal = token[:, None] >= token[None, :]
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    for chunk in range(first, last):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=zero).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=zero).reshape((chunk_size, state_size))
        c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=zero).reshape((chunk_size, state_size))
        # Ordinary loads, not TMA: through TMA this kernel was faster, but its final state then
        # differed between repeated calls of the same inputs (cause not found: docs/design.md,
        # "Tried and rejected").
        dt_tile = ct.load(sums, (0, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape(
            (chunk_size,))
        g = ct.load(sums, (1, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape((chunk_size,))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        c_b = ct.mma(c_tile.astype(mma_dtype), ct.transpose(b_tile.astype(mma_dtype)),
                     ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        # Masking the exponent (not the product) keeps exp2 of the upper triangle from overflowing.
        decay = ct.exp2(ct.where(causal, g[:, None] - g[None, :], never))
        weights = (c_b * decay * dt_tile[None, :]).astype(mma_dtype)
        y = ct.mma(weights, x_tile.astype(mma_dtype), ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        c_decayed = (c_tile.astype(ct.float32) * ct.exp2(g)[:, None]).astype(mma_dtype)
        y = ct.mma(c_decayed, ct.transpose(state.astype(mma_dtype)), y)
        y = y + skip * x_tile.astype(ct.float32)
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))
        weighted_b = (b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]).astype(mma_dtype)
        state = ct.mma(ct.transpose(x_tile.astype(mma_dtype)), weighted_b, state * ct.exp2(g_last))


class Workspace:
    """One stream's buffers, grown as calls need and never shrunk, and what a call shape launches
    with (so a repeated call computes and makes nothing): its grid and views of the sync words
    (ticket counter and fence word, zero between launches, then the flags, also zero between
    launches), the published states and the staged sums."""

    def __init__(self, device):
        self.device = device
        self.sync = self.published = self.sums = None
        self.shapes = {}

    def for_shape(self, x_shape, state_size, chunk, per_segment, head_tile):
        key = (x_shape, state_size, chunk, per_segment, head_tile)
        found = self.shapes.get(key)
        if found is None:
            if len(self.shapes) >= MAX_SHAPES:  # a server's many prompt lengths: keep the memo small
                self.shapes.clear()
            found = self.shapes[key] = self._launch_plan(*key)
        return found

    def _launch_plan(self, x_shape, state_size, chunk, per_segment, head_tile):
        batch, tokens, heads, head_size = x_shape
        num_chunks = -(-tokens // chunk)
        segments = -(-num_chunks // per_segment)
        blocks = segments * batch * heads * (head_size // head_tile)
        # A slot for every segment (the last never publishes): a published tensor of one segment
        # would be specialized apart from the others (a dimension of 1).
        published_shape = (segments, batch * heads, head_size, state_size)
        sums_shape = (2, batch, heads, num_chunks * chunk)
        grown = False
        if self.sync is None or self.sync.numel() < FIRST_FLAG + blocks:
            self.sync = torch.zeros(FIRST_FLAG + blocks, dtype=torch.int32, device=self.device)
            grown = True
        for name, shape in (("published", published_shape), ("sums", sums_shape)):
            buffer = getattr(self, name)
            if buffer is None or buffer.numel() < math.prod(shape):
                setattr(self, name, torch.empty(math.prod(shape), dtype=torch.float32, device=self.device))
                grown = True
        if grown:
            self.shapes.clear()  # the old buffers go once no view holds them
        return ((blocks, 1, 1), self.sync, self.published[:math.prod(published_shape)].view(published_shape),
                self.sums[:math.prod(sums_shape)].view(sums_shape))


FIRST_FLAG = 2  # sync[0] is the ticket counter, sync[1] the fence's word
MAX_SHAPES = 256  # call shapes whose launch plans a workspace remembers
_workspaces: dict = {}  # (device index, raw stream) -> Workspace


def chained_prefill(x, a, b, c, d, dt, init_state, config):
    """Checked plain-op arguments (d per head) -> (out, final_state), in one launch."""
    batch, tokens, heads, head_size = shape = x.shape
    state_size = b.shape[3]
    device = x.get_device()
    stream = current_stream(device) if device >= 0 else None  # None: launches recorded on CPU (aot.py)
    if capturing():
        workspace = Workspace(x.device)
    else:
        workspace = _workspaces.get((device, stream))
        if workspace is None:
            workspace = _workspaces[(device, stream)] = Workspace(x.device)
    grid, sync, published, sums = workspace.for_shape(shape, state_size, config.chunk_size,
                                                      config.chunks_per_segment, config.out_head_tile)
    out = new_output(batch, tokens, heads, head_size, dtype=x.dtype, device=x.device)
    final_state = new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)
    # Without an initial state the kernel never reads the argument; final_state stands in.
    launch(grid, chained_prefill_kernel,
           (x, b, c, d, dt, a, final_state if init_state is None else init_state, out, final_state, published,
            sums, sync, config.chunks_per_segment, config.chunk_size, config.out_head_tile, state_size,
            init_state is not None, tf32_mma(x.dtype)))
    return out, final_state
