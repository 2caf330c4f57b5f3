"""Scratch (GPU): host time of one ct.launch against the number of array arguments.

    python3 benchmarks/variants/launch_cost.py

The op spends ~0.14 ms of host time per call (h200/host_time.log) for four launches, far more
than our own Python (~25 us, profiled on CPU). Hypothesis to test: each array argument costs
microseconds at launch (reading its array interface), so the dummy arrays passed for absent
layer options and the number of launches are what to cut.
"""
import time

import cuda.tile as ct
import torch


@ct.kernel
def one(a0):
    ct.store(a0, (0,), ct.zeros((16,), dtype=ct.float32))


@ct.kernel
def five(a0, a1, a2, a3, a4):
    ct.store(a0, (0,), ct.zeros((16,), dtype=ct.float32))


@ct.kernel
def ten(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
    ct.store(a0, (0,), ct.zeros((16,), dtype=ct.float32))


@ct.kernel
def five_and_constants(a0, a1, a2, a3, a4, c0: ct.Constant[int], c1: ct.Constant[bool], c2: ct.Constant[float]):
    ct.store(a0, (0,), ct.zeros((16,), dtype=ct.float32))


def per_launch_us(kernel, args, n=2000):
    stream = torch.cuda.current_stream()
    for _ in range(50):
        ct.launch(stream, (1,), kernel, args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        ct.launch(stream, (1,), kernel, args)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


if __name__ == "__main__":
    arrays = [torch.zeros(1024, device="cuda") for _ in range(10)]
    for name, kernel, args in (("1 array", one, arrays[:1]), ("5 arrays", five, arrays[:5]),
                               ("10 arrays", ten, arrays[:10]),
                               ("5 arrays + 3 constants", five_and_constants, arrays[:5] + [64, True, 0.5])):
        print(f"{name:24s} {per_launch_us(kernel, tuple(args)):6.1f} us per launch (host, queued)")
    x = arrays[0]
    start = time.perf_counter()
    for _ in range(2000):
        x.__cuda_array_interface__
    print(f"torch __cuda_array_interface__: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us")
