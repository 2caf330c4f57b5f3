"""Scratch (GPU): is forward + backward host-bound? For ours (plain ops) and ours through autograd,
on the source config and the 2.7B layer: bench's median (L2 flushed), the host's time per call
(20 calls queued without waiting), the GPU's busy time (sum of kernel times, torch.profiler), and
the top kernels. run45: bench --backward's autograd row was 2.096 ms against the plain ops' 1.586.

    python3 benchmarks/variants/host_vs_gpu_backward.py
"""
import time

import torch

from tilegym_mamba2.bench import measure
from tilegym_mamba2.bench_backward import implementations
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from timing import gpu_busy  # this folder's

found, _ = implementations()
for shape in ((4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64)):
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=256, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    dout, dfinal = torch.randn_like(inputs["x"]), torch.randn_like(inputs["init_state"])
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
