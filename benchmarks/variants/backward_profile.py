"""Where the backward's time goes: one mamba2_chunk_backward on a shape under torch.profiler,
GPU time per kernel name (ours and torch's elementwise ones), top rows.
    python3 benchmarks/variants/backward_profile.py [B,T,G,H,N,P]"""
import sys

import torch

import tilegym_mamba2
from timing import backward_inputs  # this folder's

shape = tuple(int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2,8192,1,80,128,64").split(","))
inputs, dout, dfinal = backward_inputs(shape)


def step():
    return tilegym_mamba2.mamba2_chunk_backward(**inputs, dout=dout, dfinal_state=dfinal)


for _ in range(3):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
    step()
    torch.cuda.synchronize()
print(f"shape {shape}")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
