"""Experiment 59 (GPU): where the autograd step's extra host time goes on the H200's host.

run54: forward + backward on the source config cost 0.61 ms of host time per step as plain ops
and 1.40 ms through autograd, where the CPU proxy (launches recorded, CPU tensors) puts the
difference at ~0.17 ms, ~0.06 of which any `torch.autograd.Function` with these inputs costs.
On CUDA tensors the autograd engine runs the backward on its own device thread; if launching
our kernels from a thread other than the main one costs more (a CUDA context made current, a
per-thread cache, the GIL handed back and forth), the plain ops run on a worker thread show it.
Host time per step, 20 steps queued without waiting (median of 5), source config:

    plain ops, main thread            the package's plain forward + backward
    plain ops, worker thread          the same 20 steps on one other Python thread
    backward through the engine       the plain forward, then a Function whose backward is
                                      mamba2_chunk_backward (the engine and its thread, no
                                      AccumulateGrad into .grad)
    autograd                          bench_backward's "ours autograd" (leaves, Function, .grad)
    trivial Function, CUDA tensors    the same inputs and outputs, no kernels: the engine alone

    python3 benchmarks/variants/autograd_host_cost.py
"""
import statistics
import threading
import time

import torch

import tilegym_mamba2
from tilegym_mamba2.bench.backward import implementations
from timing import backward_inputs  # benchmarks/timing.py

SHAPE = (4, 16384, 1, 8, 128, 64)
NAMES = ("x", "a", "b", "c", "d", "dt", "init_state")


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


def main():
    found, _ = implementations()
    inputs, dout, dfinal = backward_inputs(SHAPE)
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
    for _ in range(2):  # twice: the order's own effect shows as a difference between the rounds
        for name, fn, thread in rows:
            print(f"{SHAPE} {name:32s} host {host_ms(fn, thread=thread):.3f} ms/step", flush=True)


if __name__ == "__main__":
    main()
