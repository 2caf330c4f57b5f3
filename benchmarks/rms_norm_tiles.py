"""rms_norm's launch choices on the GPU: every width tile, rows per block and occupancy on the
2.7B model's norms (the mixer's gated 5120-wide one, the block's 2560-wide one) at 1, 64 and 2048
rows, beside HF's modules' torch arithmetic and mamba_ssm's Triton gated norm where it imports.
µs per call, median of 7 replays of a CUDA graph of 50 calls. The fastest eight per shape are
listed; "same" says whether the output equals the default choice's bit for bit (a different tile
adds the sum of squares in another order). docs/performance.md ("Serving") has the figures.

    python benchmarks/rms_norm_tiles.py
"""
import statistics
import traceback

import cuda.tile as ct
import torch

from tilegym_mamba2.runtime import limits

from tilegym_mamba2.serving.validation import check_rms_norm_args
from tilegym_mamba2.runtime.launch import launch
from tilegym_mamba2.serving import rms_norm as rn

SHAPES = [("decode b1 gated 5120", 1, 5120, True), ("decode b64 gated 5120", 64, 5120, True),
          ("decode b1 2560", 1, 2560, False), ("decode b64 2560", 64, 2560, False),
          ("prefill 2048 gated 5120", 2048, 5120, True), ("prefill 2048 2560", 2048, 2560, False)]


def graph_us(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def sweep_shape(kernels, name, rows, width, gated, device="cuda"):
    x = torch.randn(rows, width, device=device).bfloat16()
    wide = torch.randn(rows, 2 * width + 336, device=device).bfloat16()    # the mixer's projection
    gate = wide[:, :width] if gated else None
    w = torch.randn(width, device=device).bfloat16()
    args = check_rms_norm_args(x, w, gate, 1e-5, None, limits=limits.CUTILE)

    def hf():
        h = x.float()
        if gated:
            h = h * torch.nn.functional.silu(gate.float())
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * h.to(torch.bfloat16)
    moved = rows * width * 2 * (3 if gated else 2)
    print(f"== {name}: HF torch {graph_us(hf):.2f} us; floor {moved / 4.0e6:.2f} us at 4 TB/s", flush=True)
    default = rn.run_rms_norm(args, rn.launch_plan(args))
    results = []

    def trial(candidates):
        for width_tile, rows_tile, kernel_name in candidates:
            grid, constants = rn.launch_plan(args, width_tile=width_tile, rows_tile=rows_tile)
            out = torch.empty(rows, width, device=device, dtype=torch.bfloat16)

            def run(kernel=kernels[kernel_name], grid=grid, constants=constants, out=out):
                launch(grid, kernel, (args.x, args.x if gate is None else args.gate, args.weight, out, *constants))
            try:
                us = graph_us(run)
            except Exception as e:
                print("failed", width_tile, rows_tile, kernel_name, type(e).__name__, str(e)[:100])
                continue
            results.append((us, width_tile, rows_tile, kernel_name, torch.equal(out, default)))

    trial([(wt, rt, "occupancy 4") for wt in (512, 1024, 2048, 4096, 8192) if wt <= rn._pow2(width)
           for rt in (1, 2, 4, 8) if rt * wt <= 16384 and rt <= max(1, rn._pow2(rows))])
    results.sort()
    trial([(wt, rt, k) for _, wt, rt, _, _ in results[:2] for k in kernels if k != "occupancy 4"])
    results.sort()
    for us, wt, rt, kernel_name, same in results[:8]:
        print(f"  {us:8.2f} us  width_tile {wt:5d} rows_tile {rt:2d} {kernel_name:12s} same={same}")


def main():
    kernels = {"occupancy 4": rn.rms_norm_kernel}
    for occupancy in (1, 2, 8):
        kernels[f"occupancy {occupancy}"] = ct.kernel(occupancy=occupancy)(rn.rms_norm_kernel._pyfunc)
    for shape in SHAPES:
        sweep_shape(kernels, *shape)
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
    except Exception:
        traceback.print_exc()
        return
    for rows in (1, 64, 2048):
        x, z = (torch.randn(rows, 5120, device="cuda").bfloat16() for _ in range(2))
        w = torch.randn(5120, device="cuda").bfloat16()
        us = graph_us(lambda: rmsnorm_fn(x, w, None, z=z, eps=1e-5, norm_before_gate=False))
        print(f"mamba_ssm rmsnorm_fn gated, {rows} rows: {us:.2f} us")


if __name__ == "__main__":
    main()
