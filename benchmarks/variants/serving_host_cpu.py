"""CPU proxy (no GPU): host time of one decode-step call of the serving ops, launches recorded, not run.

    PYTHONPATH=. python benchmarks/variants/serving_host_cpu.py [--profile]

selective_state_update in HF's call form (bench_serving.state_update_inputs: dt, dt_bias, A, D
expanded with stride 0, z, softplus) and causal_conv1d_update in HF's (bench_serving.
conv_update_inputs), each at batch 1 and 64 on Mamba2-2.7B's mixer (the state update also with
state_batch_indices over twice as many state rows), with the pieces of the call:
the argument checks, the launch given checked arguments, and the plan lookup where the host code
has plans (cutile/plan.py). ``ct.launch`` cannot run here: launches go to
``launch.recording_launches()`` and the CUDA device check is patched out. Tensors are on the CPU,
so torch.empty is a CPU malloc (small here: the outputs are a few hundred KiB at most).
These are CPU-proxy figures, not H200 ones: compare them only with each other.

Per row: min over 9 rounds of the mean of 2000 calls, in microseconds of this thread's CPU time
(time.thread_time_ns): on a shared machine, time spent descheduled is not counted.
"""
import argparse
import cProfile
import pstats

import torch
from host_cpu import per_call_us  # the same timing as the forward's CPU proxy, from this folder

from tilegym_mamba2 import bench_serving, serving_validation
from tilegym_mamba2.bench_serving import ServingCase
from tilegym_mamba2.cutile import causal_conv1d_update as conv_module
from tilegym_mamba2.cutile import launch
from tilegym_mamba2.cutile import selective_state_update as state_module

# The CUDA-only pieces of the host path, stood in for on a CPU.
torch.cuda.is_current_stream_capturing = lambda: False
serving_validation.check_cutile_device = lambda device: None

BATCHES = (1, 64)


def pieces(batch):
    """name -> callable, the whole call first. Names stay the same across versions of the host
    code; a piece a version does not have is left out."""
    state_kw = bench_serving.state_update_inputs(ServingCase("selective_state_update", batch), device="cpu")
    indexed_kw = bench_serving.state_update_inputs(ServingCase("selective_state_update", batch, indices=True),
                                                   device="cpu")
    conv_kw = bench_serving.conv_update_inputs(ServingCase("causal_conv1d_update", batch), device="cpu")
    state_args = serving_validation.check_state_update_args(**state_kw, backend="cutile")
    conv_args = serving_validation.check_conv_update_args(**conv_kw, backend="cutile")
    table = {
        f"selective_state_update, batch {batch}": lambda: state_module.selective_state_update(**state_kw),
        "  check_state_update_args": lambda: serving_validation.check_state_update_args(**state_kw,
                                                                                       backend="cutile"),
        "  run_state_update (checked args)": lambda: state_module.run_state_update(state_args),
        "  plan.signature + lookup": None,
        "  the same with state_batch_indices": lambda: state_module.selective_state_update(**indexed_kw),
        f"causal_conv1d_update, batch {batch}": lambda: conv_module.causal_conv1d_update(**conv_kw),
        "  check_conv_update_args": lambda: serving_validation.check_conv_update_args(**conv_kw, backend="cutile"),
        "  run_conv_update (checked args)": lambda: conv_module.run_conv_update(conv_args),
        "  plan.signature + lookup ": None,
    }
    try:  # the host code with serving plans (signatures with strides)
        from tilegym_mamba2.cutile import plan
        plan.signature(strides=True)
        state_all = dict(state_kw, state_batch_indices=None)  # every argument, in the op's order
        conv_all = dict(conv_kw, cache_seqlens=None, conv_state_indices=None)
        table["  plan.signature + lookup"] = lambda: plan.planned(plan.signature(
            "selective_state_update", *state_all.values(), strides=True))
        table["  plan.signature + lookup "] = lambda: plan.planned(plan.signature(
            "causal_conv1d_update", *conv_all.values(), strides=True))
    except (ImportError, TypeError):
        pass
    return {name: fn for name, fn in table.items() if fn is not None}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="cProfile 2000 batch-1 state update calls")
    opts = parser.parse_args()
    print("CPU proxy, Mamba2-2.7B mixer, HF call forms, tensors on cpu, launches recorded (us per call)")
    for batch in BATCHES:
        for name, fn in pieces(batch).items():
            print(f"{name:44s} {per_call_us(fn):7.2f}", flush=True)
    if opts.profile:
        call = next(iter(pieces(1).values()))
        with launch.recording_launches() as recorded:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(2000):
                call()
                recorded.clear()
            profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
