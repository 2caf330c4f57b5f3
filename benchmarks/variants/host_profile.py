"""Scratch (GPU): where the host time of one mamba2_chunk_forward call goes.

    python3 benchmarks/variants/host_profile.py

Queues 300 calls of the prefill shape under cProfile (no synchronize inside), prints the
functions by own time, then the host time of each piece of the call on its own.
"""
import cProfile
import pstats

import torch

import tilegym_mamba2
from tilegym_mamba2.cutile import config_for, run_stages
from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
from tilegym_mamba2.cutile.compute_out import compute_out
from tilegym_mamba2.cutile.fwd_pass_state import fwd_pass_state
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args
from timing import host_us  # this folder's

spec = Mamba2ProblemSpec.from_shape((1, 2048, 1, 32, 128, 64), chunk_size=128, device="cuda")
inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))


def call():
    return tilegym_mamba2.mamba2_chunk_forward(**inputs)


def print_profile(fn, n, top):
    """Queues n calls under cProfile after a warm-up; prints the top functions by own time."""
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


print_profile(call, 300, 25)

args = check_forward_args(**inputs, backend="cutile")
x, a, b, c, d, dt, init, chunk = args
config = config_for(*args)
dt_bht, g = chunk_cumsum(dt, a, config.chunk_size)
entry, final = fwd_pass_state(x, b, dt_bht, g, init, config.chunk_size, config)
pieces = {
    "whole call": call,
    "check_forward_args": lambda: check_forward_args(**inputs, backend="cutile"),
    "config_for": lambda: config_for(*args),
    "run_stages (config given)": lambda: run_stages(*args, config=config),
    "chunk_cumsum": lambda: chunk_cumsum(dt, a, config.chunk_size),
    "fwd_pass_state": lambda: fwd_pass_state(x, b, dt_bht, g, init, config.chunk_size, config),
    "compute_out": lambda: compute_out(x, b, c, d, dt_bht, g, entry, final, config.chunk_size, config),
    "torch.empty x4": lambda: [torch.empty(64, 1024, device="cuda") for _ in range(4)],
    "get_device_name": lambda: torch.cuda.get_device_name(x.device),
    "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
    "current_stream": torch.cuda.current_stream,
}
for name, fn in pieces.items():
    print(f"{name:30s} {host_us(fn):7.1f} us host per call", flush=True)

# The layer op on packed sequences (bench --layer's "packed prefill, 8 sequences").
from tilegym_mamba2.bench_layer import LAYER_CASES, layer_inputs  # noqa: E402

layer_args, _ = layer_inputs(LAYER_CASES[-1])


def layer_call():
    return tilegym_mamba2.mamba_chunk_scan_combined(chunk_size=256, **layer_args)


print(f"layer op, {LAYER_CASES[-1].name}: {host_us(layer_call, n=200):7.1f} us host per call", flush=True)
print_profile(layer_call, 100, 20)
