"""Scratch experiment (GPU): does compute_out wait on its loads? Variants of the plain kernel's
chunk walk (no layer options, scores multiplied in the block), timed alone against the
package's kernel on the same inputs, in one process; outputs compared with the package's.

    source .device/setup.sh && python3 benchmarks/variants/compute_out_prefetch.py [shapes]

  package     tilegym_mamba2.cutile.compute_out (group scores off)
  same        this file's kernel with nothing ahead: must time like the package (control)
  ahead_xg    x, dt and the decay sums of chunk k+1 loaded before chunk k is computed
  ahead_all   x, B, C, dt and the decay sums of chunk k+1 loaded ahead
  latency L   every chunk load carries the latency hint L (cuTile: heavier DRAM traffic)

Prediction (fifth session, written before any run): each 64-token step of a block takes
~4 us on the source config where its four products need ~0.5 us at tensor-core peak and its
loads ~1.5 us at the block's share of bandwidth, so the steps mostly wait. If the compiler does
not already overlap a step's loads with the previous step, ahead_xg gives -5 to -15% and
ahead_all -10 to -30%, unless the ~80 extra registers of B and C spill (the package kernel is
at 255 registers, occupancy 2).
"""
import sys

import cuda.tile as ct
import torch

from tilegym_mamba2.cutile.compute_out import compute_out
from timing import median_ms, tuned_inputs

NOTHING, X_AND_DECAY, EVERYTHING = 0, 1, 2


def x_and_decay(x, dt_bht, decay_cumsum, batch, head, chunk, p_tile, chunk_size, head_tile, latency):
    x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                     padding_mode=ct.PaddingMode.ZERO, latency=latency).reshape((chunk_size, head_tile))
    dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
    return x_tile, dt_tile, g


def b_and_c(b, c, batch, group, chunk, chunk_size, state_size, latency):
    b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO, latency=latency).reshape((chunk_size, state_size))
    c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO, latency=latency).reshape((chunk_size, state_size))
    return b_tile, c_tile


@ct.kernel(occupancy=2)
def walk_kernel(x, b, c, d, dt_bht, decay_cumsum, entry_states, out, chunks_per_segment,
                chunk_size: ct.Constant[int], head_tile: ct.Constant[int], state_size: ct.Constant[int],
                ahead: ct.Constant[int], latency: ct.Constant[int]):
    batch_head, segment, p_tile = ct.bid(0), ct.bid(1), ct.bid(2)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    num_chunks = dt_bht.shape[2] // chunk_size
    state = ct.load(entry_states, (batch, head, segment, p_tile, 0), (1, 1, 1, head_tile, state_size),
                    order=(0, 1, 2, 4, 3)).reshape((head_tile, state_size))
    skip = ct.load(d, (head,), (1,)).reshape((1, 1))
    token = ct.arange(chunk_size, dtype=ct.int32)
    causal = token[:, None] >= token[None, :]
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    first = segment * chunks_per_segment
    last = min(first + chunks_per_segment, num_chunks) - 1
    if ahead != NOTHING:
        x_next, dt_next, g_next = x_and_decay(x, dt_bht, decay_cumsum, batch, head, first, p_tile, chunk_size,
                                              head_tile, latency)
    if ahead == EVERYTHING:
        b_next, c_next = b_and_c(b, c, batch, group, first, chunk_size, state_size, latency)
    for chunk in range(first, last + 1):
        following = min(chunk + 1, last)  # the last step reloads its own chunk: harmless
        if ahead != NOTHING:
            x_tile, dt_tile, g = x_next, dt_next, g_next
            x_next, dt_next, g_next = x_and_decay(x, dt_bht, decay_cumsum, batch, head, following, p_tile,
                                                  chunk_size, head_tile, latency)
        else:
            x_tile, dt_tile, g = x_and_decay(x, dt_bht, decay_cumsum, batch, head, chunk, p_tile, chunk_size,
                                             head_tile, latency)
        if ahead == EVERYTHING:
            b_tile, c_tile = b_next, c_next
            b_next, c_next = b_and_c(b, c, batch, group, following, chunk_size, state_size, latency)
        else:
            b_tile, c_tile = b_and_c(b, c, batch, group, chunk, chunk_size, state_size, latency)
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        c_b = ct.mma(c_tile, ct.transpose(b_tile), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        decay = ct.exp2(ct.where(causal, g[:, None] - g[None, :], never))
        weights = (c_b * decay * dt_tile[None, :]).astype(x.dtype)
        y = ct.mma(weights, x_tile, ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        c_decayed = (c_tile.astype(ct.float32) * ct.exp2(g)[:, None]).astype(x.dtype)
        y = ct.mma(c_decayed, ct.transpose(state.astype(x.dtype)), y)
        y = y + skip * x_tile.astype(ct.float32)
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))
        weighted_b = (b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]).astype(x.dtype)
        state = ct.mma(ct.transpose(x_tile), weighted_b, state * ct.exp2(g_last))


VARIANTS = [("same", NOTHING, 3), ("ahead_xg", X_AND_DECAY, 3), ("ahead_all", EVERYTHING, 3),
            ("latency 1", NOTHING, 1), ("latency 10", NOTHING, 10)]


def walk_args(args, cfg, dt_bht, g, entry, out, ahead, latency):
    x, _, b, c, d, *_ = args
    return (x, b, c, d, dt_bht, g, entry, out, cfg.chunks_per_segment, cfg.chunk_size, cfg.out_head_tile,
            b.shape[3], ahead, latency)


def run(shape):
    from dataclasses import replace
    from tilegym_mamba2.cutile.fwd_pass_state import fwd_pass_state
    args, cfg, dt_bht, g = tuned_inputs(shape)
    cfg = replace(cfg, group_scores=False)
    x, a, b, c, d, dt, init, _ = args
    entry, _ = fwd_pass_state(x, b, dt_bht, g, init, cfg.chunk_size, cfg)
    package = lambda: compute_out(x, b, c, d, dt_bht, g, entry, cfg.chunk_size, cfg)  # noqa: E731
    reference = package()
    rows = [f"{shape} config {cfg}", f"  {'package':12s} {median_ms(package):.4f} ms"]
    grid = (x.shape[0] * x.shape[2], entry.shape[2], x.shape[3] // cfg.out_head_tile)
    for name, ahead, latency in VARIANTS:
        out = torch.full_like(x, float("nan"))
        kernel_args = walk_args(args, cfg, dt_bht, g, entry, out, ahead, latency)
        launch = lambda: ct.launch(torch.cuda.current_stream(), grid, walk_kernel, kernel_args)  # noqa: E731
        try:
            launch()
            same = torch.equal(out, reference)
            diff = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            rows.append(f"  {name:12s} {median_ms(launch):.4f} ms  {'equal to the bit' if same else f'diff {diff:.1e}'}")
        except Exception as e:  # a variant that does not compile is a result too
            rows.append(f"  {name:12s} FAILED {type(e).__name__}: {str(e)[:150]}")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    shapes = [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (4, 65536, 1, 8, 128, 64),
              (8, 4096, 1, 32, 64, 128), (2, 8192, 8, 64, 256, 64)]
    for shape in shapes[:int(sys.argv[1]) if len(sys.argv) > 1 else None]:
        run(shape)
