"""Scratch (H200): wall time per call of mamba2_chunk_forward on small, host-bound shapes.

    python3 benchmarks/variants/host_time.py LABEL

Throughput: 200 calls queued back to back, one synchronize, wall time / 200 (min and median of
5 rounds). Latency: one call plus synchronize, median of 200. Run it alternately for two
versions of the package (PYTHONPATH) to compare their host work.
"""
import statistics
import sys
import time

import torch

import tilegym_mamba2
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs

label = sys.argv[1] if len(sys.argv) > 1 else "?"
for shape in [(1, 2048, 1, 32, 128, 64), (2, 1024, 2, 8, 128, 64), (4, 16384, 1, 8, 128, 64)]:
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))

    def call():
        return tilegym_mamba2.mamba2_chunk_forward(**inputs)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            call()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / 200 * 1e3)
    latency = []
    for _ in range(200):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        latency.append((time.perf_counter() - start) * 1e3)
    print(f"{label:8s} {str(shape):28s} queued {min(rounds):.3f}/{statistics.median(rounds):.3f} ms per call "
          f"(min/median)  latency {statistics.median(latency):.3f} ms", flush=True)
