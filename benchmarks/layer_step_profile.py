"""Where the layer op's training step spends its GPU time (GPU)

    python benchmarks/layer_step_profile.py [--gate-tiles]

For `bench --layer --backward`'s first two cases (the 2.7B layer and the source config: z, D,
dt_bias, softplus; the gradients of every input for a loss of the output alone, through
autograd), one line each: `bench`'s median (L2 flushed) and the GPU's busy time per step
(torch.profiler, kernel times summed), then the step's kernels by GPU time, with how many times
each runs per step.

--gate-tiles: also times the gate kernels (ssd/gate_grads.py) on the case's tensors for each
tile shape (elements per block, widest channel tile), checking that every shape gives the same
bits, with the bandwidth each reaches.
"""
import argparse

import torch

from tilegym_mamba2.bench.forward import measure
from tilegym_mamba2.bench.layer import LAYER_CASES, implementations, layer_inputs, training_args
from tilegym_mamba2.ssd import gate_grads
from timing import gpu_busy  # benchmarks/timing.py

GATE_TILES = [(4096, 256), (4096, 1024), (16384, 256), (16384, 1024)]
CALLS = 5


def profile_step(case, step):
    ms = measure(step)
    busy, kernels, prof = gpu_busy(step, calls=CALLS)
    print(f"== {case.name}: bench {ms:.3f} ms, GPU busy {busy:.3f} ms/step ({kernels} kernels)", flush=True)
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:12]:
        print(f"   {event.key[:60]:60s} {event.self_device_time_total / CALLS:9.1f} us/step  "
              f"x{event.count // CALLS}")


def gate_tiles(args):
    x, z, dout = args["x"].detach(), args["z"].detach(), args["dout"]
    ungated = torch.randn_like(x)
    chosen = gate_grads.ELEMENTS_PER_BLOCK, gate_grads.CHANNELS_TILE_MAX
    reference = gate_grads.gate_dz(dout, z, ungated, x, None)
    try:
        for elements, widest in GATE_TILES:
            gate_grads.ELEMENTS_PER_BLOCK, gate_grads.CHANNELS_TILE_MAX = elements, widest
            assert torch.equal(gate_grads.gate_dz(dout, z, ungated, x, None), reference), (elements, widest)
            dz = measure(lambda: gate_grads.gate_dz(dout, z, ungated, x, None))
            dy = measure(lambda: gate_grads.gate_dy(dout, z, x.dtype))
            moved = 4 * x.numel() * x.element_size()   # dz: 3 reads, 1 write; dy: 2 reads, 2 writes
            print(f"   gate tiles {elements:6d} x <= {widest:5d} channels: dz {dz:.3f} ms "
                  f"({moved / dz / 1e6:.0f} GB/s), dy {dy:.3f} ms ({moved / dy / 1e6:.0f} GB/s)", flush=True)
    finally:
        gate_grads.ELEMENTS_PER_BLOCK, gate_grads.CHANNELS_TILE_MAX = chosen


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gate-tiles", action="store_true", help="also time the gate kernels' tile shapes")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layer_step_profile.py profiles CUDA kernels: it needs an NVIDIA GPU")
    ours = implementations(training=True)[0]["ours"]
    for case in LAYER_CASES[:2]:
        args = training_args(layer_inputs(case)[0])
        step = lambda: ours(args, 256)  # noqa: E731
        step()
        torch.cuda.synchronize()
        profile_step(case, step)
        if options.gate_tiles:
            gate_tiles(args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
