"""Experiment 65 (GPU): forward + backward of the plain op with fp32 inputs at PyTorch's float32
matmul precisions "highest" (the default: fp32 FMA mma) and "high" (tf32 operands on tensor
cores where experiment 65's patch is applied), next to the same shapes in bf16, on the source
config and the 2.7B layer: bench's median (L2 flushed) and the kernels' GPU time per call.

    python3 benchmarks/variants/fp32_backward.py [--high-only]
"""
import sys

import torch

from tilegym_mamba2.bench import measure
from tilegym_mamba2.bench_backward import implementations
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from timing import gpu_busy  # this folder's

ours = implementations()[0]["ours"]
# fp32 at "highest" takes ~90 / ~250 ms per step and ~30 s of compiles per kernel: "--high-only" leaves it out.
RUNS = [(torch.bfloat16, "highest"), (torch.float32, "highest"), (torch.float32, "high")]
if "--high-only" in sys.argv:
    RUNS.remove((torch.float32, "highest"))
for shape in ((4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64)):
    for dtype, precision in RUNS:
        torch.set_float32_matmul_precision(precision)
        spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=256, device="cuda", dtype=dtype)
        inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
        dout, dfinal = torch.randn_like(inputs["x"]), torch.randn_like(inputs["init_state"])

        def fn():
            return ours(inputs, dout, dfinal)
        busy, kernels, prof = gpu_busy(fn)
        print(f"{shape} {str(dtype):15s} {precision:8s} fwd+bwd {measure(fn):.3f} ms  GPU busy {busy:.3f} ms/call "
              f"({kernels} kernels)", flush=True)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
torch.set_float32_matmul_precision("highest")
