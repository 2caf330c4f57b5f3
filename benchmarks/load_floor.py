"""How close the forward's two big stages are to the cost of their own loads (GPU).

    python benchmarks/load_floor.py

For each shape (the source config and the 2.7B layer's), at several segment lengths, it times in
alternating rounds:

* the real state pass (``fwd_pass_state``: segment states and their scan) and ``compute_out``;
* "traffic" kernels with the same grid, the same tile loads (shapes, order, padding, latency
  hint) and the same stores, but no matmuls: each loaded tile is only summed, so the loads
  cannot be dropped. compute_out's runs with and without its B and C loads, which every
  (head, head tile) block repeats: the fp32 state a block carries in registers caps the head
  columns one block covers, so B and C are read again for every head tile;

then the whole op at the tuned config. First it prints the L2 read ceiling of cuTile tile loads
on this GPU: blocks summing 64 x 128 bf16 tiles of an 8 MB (L2-resident) array and of a 2 GB one
(DRAM), at 2, 4 and 8 blocks per SM.

Each line gives ms per call and GB/s. Bytes are what the blocks request (L2 -> SM), so GB/s is
comparable with the ceiling. Every time is per call of back-to-back calls (timing.queued_ms):
no host launch time, and the inputs are larger than L2, so little survives from one call to the
next.
"""
import statistics
from dataclasses import replace

import cuda.tile as ct
import torch

from tilegym_mamba2.cutile.compute_out import compute_out
from tilegym_mamba2.cutile.forward import run_stages
from tilegym_mamba2.cutile.fwd_pass_state import fwd_pass_state
from tilegym_mamba2.cutile.launch import launch
from tilegym_mamba2.cutile.tuning import segment_count
from timing import queued_ms, tuned_inputs  # benchmarks/timing.py

SHAPES = [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64)]


@ct.kernel(occupancy=2)
def out_traffic_kernel(x, b, c, dt_bht, decay_cumsum, out, sink, chunks_per_segment,
                       chunk_size: ct.Constant[int], head_tile: ct.Constant[int], state_size: ct.Constant[int],
                       with_bc: ct.Constant[bool], load_latency: ct.Constant[int]):
    batch_head, segment, p_tile = ct.bid(0), ct.bid(1), ct.bid(2)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    num_chunks = dt_bht.shape[2] // chunk_size
    hint = None if load_latency == 0 else load_latency
    acc = ct.zeros((chunk_size, state_size), dtype=ct.float32)
    first = segment * chunks_per_segment
    for chunk in range(first, min(first + chunks_per_segment, num_chunks)):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO, latency=hint).reshape((chunk_size, head_tile))
        if with_bc:
            b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                             padding_mode=ct.PaddingMode.ZERO, latency=hint).reshape((chunk_size, state_size))
            c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                             padding_mode=ct.PaddingMode.ZERO, latency=hint).reshape((chunk_size, state_size))
            acc = acc + b_tile.astype(ct.float32) + c_tile.astype(ct.float32)
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        y = x_tile.astype(ct.float32) * (dt_tile + g)[:, None]
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))
    block = (batch_head * ct.num_blocks(1) + segment) * ct.num_blocks(2) + p_tile
    ct.store(sink, (block, 0), ct.sum(acc, axis=0).reshape((1, state_size)))


@ct.kernel(occupancy=4)
def state_traffic_kernel(x, b, dt_bht, decay_cumsum, sink, chunks_per_segment, chunk_size: ct.Constant[int],
                         head_tile: ct.Constant[int], state_tile: ct.Constant[int]):
    batch_head, segment, tile = ct.bid(0), ct.bid(1), ct.bid(2)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles
    num_chunks = dt_bht.shape[2] // chunk_size
    acc_x = ct.zeros((chunk_size, head_tile), dtype=ct.float32)
    acc_b = ct.zeros((state_tile, chunk_size), dtype=ct.float32)
    first = segment * chunks_per_segment
    last = min(first + chunks_per_segment, num_chunks)
    for i in range(last - first):
        chunk = last - 1 - i
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))
        b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),
                      padding_mode=ct.PaddingMode.ZERO).reshape((state_tile, chunk_size))
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))
        acc_x = acc_x + x_tile.astype(ct.float32) * (dt_tile + g)[:, None]
        acc_b = acc_b + b_t.astype(ct.float32)
    block = (batch_head * ct.num_blocks(1) + segment) * ct.num_blocks(2) + tile
    # acc_b reduced whole: its rows (state_tile) need not match acc_x's columns (head_tile).
    ct.store(sink, (block, 0), (ct.sum(acc_x, axis=0) + ct.sum(acc_b)).reshape((1, head_tile)))


@ct.kernel(occupancy=2)
def read_ceiling_kernel(src, sink, steps, stride):
    block = ct.bid(0)
    tiles = src.shape[0] // 64
    acc = ct.zeros((64, 128), dtype=ct.float32)
    for i in range(steps):
        acc = acc + ct.load(src, ((block * stride + i) % tiles, 0), (64, 128)).astype(ct.float32)
    ct.store(sink, (block, 0), ct.sum(acc, axis=0).reshape((1, 128)))


def gbs(nbytes, ms):
    return nbytes / ms / 1e6


def rounds(runs: dict, n=5) -> dict:
    """Alternating rounds, so that clock drift lands on every run; the median over rounds."""
    times = {name: [] for name in runs}
    for _ in range(n):
        for name, fn in runs.items():
            times[name].append(queued_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def stage_table(shape):
    """Each stage and its loads at several segment lengths (the loads' own best length is their
    floor), then the whole op at the tuned config."""
    args, tuned, dt_bht, g = tuned_inputs(shape)
    x, a, b, c, d, dt, init, chunk_size = args
    batch, tokens, heads, head_size = x.shape
    state_size, chunk = b.shape[3], tuned.chunk_size
    print(f"{shape}  tuned {tuned}", flush=True)
    ht, hp, np_ = tuned.out_head_tile, tuned.state_head_tile, tuned.state_tile
    tiles = (head_size // hp) * (state_size // np_)
    xy = batch * tokens * heads * head_size * 2
    bc_once = batch * tokens * state_size * 2
    requested = {"state pass": xy * (state_size // np_) + bc_once * heads * (head_size // hp),
                 "compute_out": 2 * xy + 2 * bc_once * heads * (head_size // ht)}
    requested["state loads"], requested["out loads"] = requested["state pass"], requested["compute_out"]
    requested["out loads no B, C"] = 2 * xy
    out = torch.empty_like(x)
    lengths = sorted({4, 8, 16, 32, tuned.chunks_per_segment})
    for per_segment in lengths:
        config = replace(tuned, chunks_per_segment=per_segment)
        segments = segment_count(dt_bht, chunk, config)
        entry, final = fwd_pass_state(x, b, dt_bht, g, init, chunk, config)
        out_grid = (batch * heads, segments, head_size // ht)
        out_sink = torch.empty(out_grid[0] * out_grid[1] * out_grid[2], state_size, device=x.device)
        state_grid = (batch * heads, segments, tiles)
        state_sink = torch.empty(state_grid[0] * state_grid[1] * state_grid[2], hp, device=x.device)

        def out_loads(with_bc):
            return lambda: launch(out_grid, out_traffic_kernel,
                                  (x, b, c, dt_bht, g, out, out_sink, per_segment, chunk, ht, state_size, with_bc,
                                   config.out_load_latency))
        runs = {
            "state pass": lambda: fwd_pass_state(x, b, dt_bht, g, init, chunk, config),
            "state loads": lambda: launch(state_grid, state_traffic_kernel,
                                          (x, b, dt_bht, g, state_sink, per_segment, chunk, hp, np_)),
            "compute_out": lambda: compute_out(x, b, c, d, dt_bht, g, entry, final, chunk, config),
            "out loads": out_loads(True),
            "out loads no B, C": out_loads(False),
        }
        medians = rounds(runs)
        print(f"  {per_segment:3d} chunks/segment, {segments} segments: " + "  ".join(
            f"{name} {ms:.4f} ms ({gbs(requested[name], ms):.0f} GB/s)" for name, ms in medians.items()),
            flush=True)
    whole = rounds({"op": lambda: run_stages(*args, config=tuned)})["op"]
    print(f"  whole op at the tuned config: {whole:.4f} ms; requested MB: "
          + ", ".join(f"{name} {n / 1e6:.0f}" for name, n in requested.items() if "loads" not in name), flush=True)


def read_ceilings():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile_bytes = 64 * 128 * 2
    for label, mbytes, stride in [("L2-resident 8 MB", 8, 37), ("DRAM 2 GB", 2048, 256)]:
        src = torch.randn(mbytes * 2**20 // 256, 128, device="cuda").to(torch.bfloat16)
        for per_sm in (2, 4, 8):
            blocks, steps = sms * per_sm, 256
            sink = torch.empty(blocks, 128, device="cuda")
            if label.startswith("DRAM"):  # every block reads its own run of tiles once
                stride = steps
            fn = lambda: launch((blocks,), read_ceiling_kernel, (src, sink, steps, stride))  # noqa: E731
            ms = rounds({"r": fn}, n=3)["r"]
            print(f"  read ceiling, {label}, {per_sm} blocks/SM: {ms:.4f} ms "
                  f"{gbs(blocks * steps * tile_bytes, ms):7.0f} GB/s", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), flush=True)
    read_ceilings()
    for shape in SHAPES:
        stage_table(shape)
