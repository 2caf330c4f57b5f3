"""Experiment 73 (GPU): how far the 2048-token prefill is from issue 14's host targets, and what a
call with fewer launches would buy.

    python3 benchmarks/variants/prefill_launches.py [--layer]

(run78-run80 ran it at cd33fd1's text, with its own copies of the two timing helpers.)

The prefill (1, 2048, 1, 32, 128, 64) runs four launches (chunk_cumsum, segment_states,
state_scan, compute_out) and six allocations; `bench` sees ~0.062 ms for GPU work far shorter, so
it times the host. Per path, in alternating rounds in one process:
  host us     wall time to queue 200 calls (no synchronize inside), per call
  bench ms    `bench.measure` (L2 flushed), as `bench` reports the prefill
  gpu ms      CUDA events around 20 back-to-back calls, per call (timing.queued_ms): the
              larger of host and GPU time, so also the profiler's kernel sum (printed)
Paths: the package (a planned call, as tuned); the same config with one segment per row (two
launches: chunk_cumsum, compute_out walking the whole row, four allocations); with experiment
75's patch, the one-launch kernel (prefill.py) at 1, 2, 4, 8 chunks per segment and whole rows;
each output's largest difference to the package's printed.
Then the floor: one ct.launch of a one-array kernel and of a 12-argument one (raw stream), and
one torch.empty on the device.

With --layer: the layer op (D, z, dt_bias, softplus: mamba_ssm's Mamba2 call) on one 2048-token
row of 32 and of 80 heads, as tuned (with experiment 74's patch, whole rows offered to its
unpacked short rows) against the heuristic's segments, the outputs compared.
"""
import statistics
from dataclasses import fields, replace

import cuda.tile as ct
import torch

import tilegym_mamba2
from tilegym_mamba2.bench import measure
from tilegym_mamba2.cutile import config_for, launch, run_stages
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args
from timing import host_us, queued_ms  # this folder's

PREFILL = (1, 2048, 1, 32, 128, 64)
ROUNDS = 5


def kernel_ms(fn):
    """Sum of the GPU kernels' own times per call (profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages())
    return total / 20 / 1000


@ct.kernel
def one_array(a0):
    ct.store(a0, (0,), ct.zeros((16,), dtype=ct.float32))


@ct.kernel
def twelve(a0, a1, a2, a3, a4, a5, a6, a7, n0, n1, c0: ct.Constant[int], c1: ct.Constant[bool]):
    ct.store(a0, (0,), ct.zeros((16,), dtype=ct.float32))


def main():
    spec = Mamba2ProblemSpec.from_shape(PREFILL, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    args = check_forward_args(**inputs, backend="cutile")
    config = config_for(*args)
    num_chunks = -(-PREFILL[1] // config.chunk_size)
    whole = replace(config, chunks_per_segment=num_chunks)
    print(f"package config {config}")
    paths = {
        "package (as tuned)": lambda: tilegym_mamba2.mamba2_chunk_forward(**inputs),
        "whole row (2 launches)": lambda: run_stages(*args, config=whole),
    }
    if "one_launch" in {f.name for f in fields(config)}:  # experiment 75's patch applied
        for per_segment in (1, 2, 4, 8, num_chunks):
            one = replace(config, chunks_per_segment=per_segment, one_launch=True)
            paths[f"one launch, {per_segment} chunks"] = lambda one=one: run_stages(*args, config=one)
    ours = paths["package (as tuned)"]()[0]
    for name, fn in list(paths.items())[1:]:
        other = fn().out
        print(f"{name} vs package: max |diff| {(other.float() - ours.float()).abs().max().item():.3e}, "
              f"bitwise equal {torch.equal(other, ours)}")
    rows = {name: {"host us": [], "bench ms": [], "gpu ms": []} for name in paths}
    for fn in paths.values():
        for _ in range(20):
            fn()
    for _ in range(ROUNDS):
        for name, fn in paths.items():
            rows[name]["host us"].append(host_us(fn))
            rows[name]["bench ms"].append(measure(fn))
            rows[name]["gpu ms"].append(queued_ms(fn))
    for name, fn in paths.items():
        cells = "  ".join(f"{k} {statistics.median(v):.4g}" for k, v in rows[name].items())
        print(f"{name:28s} {cells}  kernels {kernel_ms(fn):.4f} ms")

    buf = torch.zeros(1024, device="cuda")
    stream = launch.current_stream(0)
    floor = {
        "ct.launch, 1 array": lambda: ct.launch(stream, (1,), one_array, (buf,)),
        "ct.launch, 8 arrays + 4": lambda: ct.launch(stream, (1,), twelve, (buf,) * 8 + (3, 4, 64, True)),
        "torch.empty": lambda: torch.empty(1, 32, 2048, device="cuda"),
        "raw stream handle": lambda: launch.current_stream(0),
    }
    for name, fn in floor.items():
        print(f"{name:26s} {statistics.median(host_us(fn, 2000, warm_up=50) for _ in range(5)):.2f} us host per call")


def layer_main():
    from tilegym_mamba2.bench_layer import LayerCase, layer_inputs
    from tilegym_mamba2.cutile.scan_combined import layer_config, mamba_chunk_scan_combined, run_layer
    from tilegym_mamba2.cutile.tuning import choose_config
    from tilegym_mamba2.validation import check_scan_combined_args
    for heads in (32, 80):
        case = LayerCase(f"prefill, {heads} heads", 1, 2048, 1, heads, 128, 64)
        kw, _ = layer_inputs(case)
        args = check_scan_combined_args(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], 256, kw["D"], kw["z"],
                                        kw["dt_bias"], None, None, None, True, (0.0, float("inf")), False, False,
                                        backend="cutile")
        tuned = layer_config(*args[:14])
        heuristic = choose_config(1, 2048, 1, heads, 64, 128, 256)
        print(f"{case.name}: tuned {tuned.chunks_per_segment} chunks per segment, heuristic "
              f"{heuristic.chunks_per_segment}")
        paths = {"tuned (the op)": lambda: mamba_chunk_scan_combined(chunk_size=256, **kw),
                 "heuristic segments": lambda: run_layer(*args[:14], config=heuristic)[0]}
        outs = [fn() for fn in paths.values()]
        print(f"  max |diff| {(outs[0].float() - outs[1].float()).abs().max().item():.3e}, "
              f"bitwise equal {torch.equal(outs[0], outs[1])}")
        rows = {name: {"host us": [], "bench ms": []} for name in paths}
        for _ in range(ROUNDS):
            for name, fn in paths.items():
                rows[name]["host us"].append(host_us(fn))
                rows[name]["bench ms"].append(measure(fn))
        for name, fn in paths.items():
            cells = "  ".join(f"{k} {statistics.median(v):.4g}" for k, v in rows[name].items())
            print(f"  {name:24s} {cells}  kernels {kernel_ms(fn):.4f} ms")


if __name__ == "__main__":
    import sys
    layer_main() if "--layer" in sys.argv else main()
