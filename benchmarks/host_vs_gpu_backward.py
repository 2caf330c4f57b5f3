"""Is a training step (forward + backward of the plain op) host-bound, and where does the
autograd step's extra host time go? (GPU)

    python benchmarks/host_vs_gpu_backward.py [--split]

For ours as plain ops (mamba2_chunk_forward then mamba2_chunk_backward) and ours through
autograd (`bench --backward`'s "ours autograd" row: leaves, the custom op, .grad), on the source
config and the 2.7B layer's shape, one line each: `bench`'s median (L2 flushed), the host's time
per call (20 calls queued without waiting), the wall time of those 20 calls to their end, and
the GPU's busy time (kernel times summed, torch.profiler) with the kernels per call; then the
profiler's table of the top kernels.

--split: instead, the host time per step (20 steps queued, then one wait; median of 5) on the
source config, printed twice (the order's own effect shows as a difference between the rounds):
  plain ops, main thread          the plain forward + backward
  plain ops, worker thread        the same steps on another Python thread (the autograd engine
                                  runs a CUDA backward on its own device thread)
  backward through the engine     the plain forward, then a torch.autograd.Function whose
                                  backward is mamba2_chunk_backward (no AccumulateGrad)
  autograd                        "ours autograd" as above
  trivial Function, CUDA tensors  the same inputs and outputs, no kernels: the engine alone
"""
import statistics
import sys
import threading
import time

import torch

import tilegym_mamba2
from tilegym_mamba2.bench.backward import implementations
from tilegym_mamba2.bench.forward import measure
from timing import backward_inputs, gpu_busy  # benchmarks/timing.py

SOURCE, LAYER_2_7B = (4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64)
NAMES = ("x", "a", "b", "c", "d", "dt", "init_state")


def host_vs_gpu(found):
    for shape in (SOURCE, LAYER_2_7B):
        inputs, dout, dfinal = backward_inputs(shape)
        for name in ("ours", "ours autograd"):
            def fn():
                return found[name](inputs, dout, dfinal)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                fn()
            host = (time.perf_counter() - start) / 20 * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 20 * 1e3
            busy, kernels, prof = gpu_busy(fn)
            print(f"{shape} {name:14s} bench {measure(fn):.3f} ms  host {host:.3f} ms/call  queued wall {wall:.3f}  "
                  f"GPU busy {busy:.3f} ms/call ({kernels} kernels)", flush=True)
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))


def host_ms(step, calls=20, rounds=5, thread=False):
    """Host time per call of ``calls`` queued calls (then one wait), median of ``rounds``."""
    def batch():
        for _ in range(calls):
            step()

    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if thread:
            worker = threading.Thread(target=batch)
            worker.start()
            worker.join()
        else:
            batch()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times[1:])


class BackwardInEngine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, marker, inputs, dout, dfinal):
        ctx.inputs, ctx.dout, ctx.dfinal = inputs, dout, dfinal
        return marker.clone()

    @staticmethod
    def backward(ctx, grad):
        tilegym_mamba2.mamba2_chunk_backward(**ctx.inputs, dout=ctx.dout, dfinal_state=ctx.dfinal)
        return grad, None, None, None


class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors):
        ctx.shapes = [t.shape for t in tensors]
        return torch.empty_like(tensors[0]), torch.empty_like(tensors[6])

    @staticmethod
    def backward(ctx, dout, dfinal):
        return tuple(torch.empty(s, device=dout.device) for s in ctx.shapes)


def split(found):
    inputs, dout, dfinal = backward_inputs(SOURCE)
    marker = torch.zeros(1, device="cuda", requires_grad=True)

    def plain():
        return found["ours"](inputs, dout, dfinal)

    def in_engine():
        tilegym_mamba2.mamba2_chunk_forward(**inputs)
        BackwardInEngine.apply(marker, inputs, dout, dfinal).sum().backward()

    def autograd():
        return found["ours autograd"](inputs, dout, dfinal)

    def trivial():
        leaves = [inputs[k].detach().requires_grad_() for k in NAMES]
        torch.autograd.backward(Trivial.apply(*leaves), [dout, dfinal])

    for fn in (plain, in_engine, autograd, trivial):
        for _ in range(3):
            fn()
    rows = (("plain ops, main thread", plain, False), ("plain ops, worker thread", plain, True),
            ("backward through the engine", in_engine, False), ("autograd", autograd, False),
            ("trivial Function, CUDA tensors", trivial, False))
    for _ in range(2):
        for name, fn, thread in rows:
            print(f"{SOURCE} {name:32s} host {host_ms(fn, thread=thread):.3f} ms/step", flush=True)


if __name__ == "__main__":
    found, _ = implementations()
    split(found) if "--split" in sys.argv[1:] else host_vs_gpu(found)
