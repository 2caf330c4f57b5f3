"""Scratch experiment (H200): compute_out operand layouts and tile sizes, timed alone.

    source .device/setup.sh && python3 benchmarks/variants/compute_out_variants.py

Variants of the plain kernel (no layer options), each checked against the package's kernel:
  current   the package's kernel: state carried transposed [N, P], B loaded transposed via `order`
  natural   state carried [P, N] (entry state transposed once per segment by its load), B as stored
  mixed     state carried transposed [N, P], B as stored, transposed in registers for the update
and the package kernel at other configs (32-token chunks; out_head_tile 32).
"""
import statistics
import sys
from dataclasses import replace

import cuda.tile as ct
import torch

from tilegym_mamba2.cutile import config_for
from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
from tilegym_mamba2.cutile.compute_out import compute_out
from tilegym_mamba2.cutile.fwd_pass_state import fwd_pass_state
from tilegym_mamba2.cutile.tuning import choose_config
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args


@ct.kernel(occupancy=2)
def natural_kernel(x, b, c, d, dt_bht, decay_cumsum, entry_states, out, chunks_per_segment,
                   chunk_size: ct.Constant[int], head_tile: ct.Constant[int], state_size: ct.Constant[int]):
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
    for chunk in range(first, min(first + chunks_per_segment, num_chunks)):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
        c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        scores = ct.mma(c_tile, ct.transpose(b_tile), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        decay = ct.exp2(ct.where(causal, g[:, None] - g[None, :], never))
        weights = (scores * decay * dt_tile[None, :]).astype(x.dtype)
        y = ct.mma(weights, x_tile, ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        c_decayed = (c_tile.astype(ct.float32) * ct.exp2(g)[:, None]).astype(x.dtype)
        y = ct.mma(c_decayed, ct.transpose(state.astype(x.dtype)), y)
        y = y + skip * x_tile.astype(ct.float32)
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))
        weighted_b = (b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]).astype(x.dtype)
        state = ct.mma(ct.transpose(x_tile), weighted_b, state * ct.exp2(g_last))


@ct.kernel(occupancy=2)
def mixed_kernel(x, b, c, d, dt_bht, decay_cumsum, entry_states, out, chunks_per_segment,
                 chunk_size: ct.Constant[int], head_tile: ct.Constant[int], state_size: ct.Constant[int]):
    batch_head, segment, p_tile = ct.bid(0), ct.bid(1), ct.bid(2)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    num_chunks = dt_bht.shape[2] // chunk_size
    state_t = ct.load(entry_states, (batch, head, segment, 0, p_tile),
                      (1, 1, 1, state_size, head_tile)).reshape((state_size, head_tile))
    skip = ct.load(d, (head,), (1,)).reshape((1, 1))
    token = ct.arange(chunk_size, dtype=ct.int32)
    causal = token[:, None] >= token[None, :]
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    first = segment * chunks_per_segment
    for chunk in range(first, min(first + chunks_per_segment, num_chunks)):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
        c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        scores = ct.mma(c_tile, ct.transpose(b_tile), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        decay = ct.exp2(ct.where(causal, g[:, None] - g[None, :], never))
        weights = (scores * decay * dt_tile[None, :]).astype(x.dtype)
        y = ct.mma(weights, x_tile, ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        c_decayed = (c_tile.astype(ct.float32) * ct.exp2(g)[:, None]).astype(x.dtype)
        y = ct.mma(c_decayed, state_t.astype(x.dtype), y)
        y = y + skip * x_tile.astype(ct.float32)
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))
        weighted_b = (b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]).astype(x.dtype)
        state_t = ct.mma(ct.transpose(weighted_b), x_tile, state_t * ct.exp2(g_last))


def median_ms(fn, reps=40):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tuned_inputs(shape):
    """Checked GPU inputs of a shape, its tuned config, and dt and the decay sums at that config."""
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    config = config_for(*args)
    dt_bht, g = chunk_cumsum(args[5], args[1], config.chunk_size)
    return args, config, dt_bht, g


def run(shape):
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    x, a, b, c, d, dt, init, _ = check_forward_args(**inputs, backend="cutile")
    batch, tokens, heads, head_size = x.shape
    base = choose_config(batch, tokens, b.shape[2], heads, head_size, b.shape[3], 128, x.device)
    results = {}

    def prepared(config):
        dt_bht, g = chunk_cumsum(dt, a, config.chunk_size)
        entry, _ = fwd_pass_state(x, b, dt_bht, g, init, config.chunk_size, config)
        return dt_bht, g, entry

    dt_bht, g, entry = prepared(base)
    reference = compute_out(x, b, c, d, dt_bht, g, entry, base.chunk_size, base)
    for name, kernel in (("natural", natural_kernel), ("mixed", mixed_kernel)):
        out = torch.empty_like(x)
        grid = (batch * heads, entry.shape[2], head_size // base.out_head_tile)
        args = (x, b, c, d, dt_bht, g, entry, out, base.chunks_per_segment, base.chunk_size,
                base.out_head_tile, b.shape[3])
        try:
            launch = lambda: ct.launch(torch.cuda.current_stream(), grid, kernel, args)  # noqa: E731
            ms = median_ms(launch)
            err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            results[name] = (ms, err)
        except Exception as e:  # a variant that does not compile is a result too
            results[name] = (float("nan"), f"{type(e).__name__}: {str(e)[:200]}")
    configs = {"current": base,
               "chunk32": replace(base, chunk_size=32, chunks_per_segment=base.chunks_per_segment * 2),
               "head_tile32": replace(base, out_head_tile=min(32, base.out_head_tile))}
    for name, config in configs.items():
        dt_bht, g, entry = prepared(config)
        out = compute_out(x, b, c, d, dt_bht, g, entry, config.chunk_size, config)
        ms = median_ms(lambda: compute_out(x, b, c, d, dt_bht, g, entry, config.chunk_size, config))
        err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        results[name] = (ms, err)
    print(f"{str(shape):30s} " + "  ".join(
        f"{k} {v[0]:.3f} ms (diff {v[1]:.1e})" if isinstance(v[1], float) else f"{k} FAILED {v[1]}"
        for k, v in results.items()), flush=True)


if __name__ == "__main__":
    shapes = [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (2, 8192, 8, 64, 256, 64),
              (8, 4096, 1, 32, 64, 128)]
    for shape in shapes[:int(sys.argv[1]) if len(sys.argv) > 1 else None]:
        run(shape)
