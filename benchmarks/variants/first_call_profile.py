"""Scratch (GPU): where the layer op's first call goes (25.5 s in run8 against the 5 s target).

    TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) python3 benchmarks/variants/first_call_profile.py

A fresh process, the bench's 2.7B layer case with every option on; the first call runs under
cProfile, then prints the functions by cumulative and by own time; a second call for contrast.
"""
import cProfile
import pstats
import time

import torch

import tilegym_mamba2
from tilegym_mamba2.bench_layer import LAYER_CASES, layer_inputs

args, _ = layer_inputs(LAYER_CASES[0])
torch.cuda.synchronize()


def call():
    out = tilegym_mamba2.mamba_chunk_scan_combined(**args, chunk_size=256, backend="cutile")
    torch.cuda.synchronize()
    return out


profile = cProfile.Profile()
start = time.perf_counter()
profile.runcall(call)
print(f"first call {time.perf_counter() - start:.2f} s")
start = time.perf_counter()
call()
print(f"second call {time.perf_counter() - start:.4f} s")
stats = pstats.Stats(profile)
stats.sort_stats("cumulative").print_stats(35)
stats.sort_stats("tottime").print_stats(15)
