"""CPU proxy (no GPU): host time of each layer of one forward call, launches recorded, not run.

    python benchmarks/variants/host_cpu.py [--device meta|cpu] [--profile]

What a call costs on the host before its kernels reach the GPU: tilegym's dispatcher, our entry
point, the argument checks, the config lookup, allocations and argument tuples. ``ct.launch`` and
the CUDA stream lookup cannot run here: launches go to ``launch.recording_launches()`` and the
device checks that need CUDA are patched out (both are measured on the H200 by host_time.py and
launch_cost.py). Tensors are on "meta" by default: torch.empty there costs the dispatcher's work
but no memory, closer to the CUDA caching allocator than a CPU malloc of megabytes.
These are CPU-proxy figures, not H200 ones: compare them only with each other.

Per layer: min over 9 rounds of the mean of 2000 calls, in microseconds of this thread's CPU time
(time.thread_time_ns): on a shared machine, time spent descheduled is not counted.
"""
import argparse
import cProfile
import os
import pstats
import tempfile
import time

os.environ["TILEGYM_MAMBA2_TUNE"] = "0"  # no timing on a CPU; the heuristic config
os.environ["TILEGYM_MAMBA2_CACHE_DIR"] = tempfile.mkdtemp()

import torch  # noqa: E402

import tilegym  # noqa: E402
import tilegym_mamba2  # noqa: E402
from tilegym_mamba2 import validation  # noqa: E402
from tilegym_mamba2.cutile import launch  # noqa: E402

# The CUDA-only pieces of the host path, stood in for on a CPU.
torch.cuda.is_current_stream_capturing = lambda: False
torch.cuda.get_device_name = lambda device=None: "NVIDIA H200"
validation._check_cutile_limits = lambda device, head_size, state_size, split_state=False: None

PREFILL = (1, 2048, 1, 32, 128, 64)  # batch, tokens, groups, heads, state_size, head_size


def inputs_on(device, shape=PREFILL, chunk_size=128):
    batch, tokens, groups, heads, state_size, head_size = shape
    bf16 = dict(dtype=torch.bfloat16, device=device)
    return dict(x=torch.empty(batch, tokens, heads, head_size, **bf16),
                a=torch.empty(heads, device=device), b=torch.empty(batch, tokens, groups, state_size, **bf16),
                c=torch.empty(batch, tokens, groups, state_size, **bf16), d=torch.empty(heads, device=device),
                dt=torch.empty(batch, tokens, heads, device=device), init_state=None, chunk_size=chunk_size)


def layer_inputs_on(device, options, shape=PREFILL):
    f = inputs_on(device, shape)
    batch, tokens, groups, heads, state_size, head_size = shape
    args = dict(x=f["x"], dt=f["dt"], A=f["a"], B=f["b"], C=f["c"], chunk_size=256)
    if options:
        args.update(D=f["d"], z=torch.empty_like(f["x"]), dt_bias=torch.empty(heads, device=device),
                    dt_softplus=True, return_final_states=True)
    return args


def per_call_us(fn, n=2000, rounds=9):
    with launch.recording_launches() as recorded:
        for _ in range(50):
            fn()
        best = float("inf")
        for _ in range(rounds):
            recorded.clear()
            start = time.thread_time_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.thread_time_ns() - start) / n / 1e3)
    return best


def pieces(device):
    """name -> callable, outermost layer first. Names stay the same across versions of the host
    code; a piece a version does not have is left out."""
    from tilegym_mamba2 import cutile
    from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
    from tilegym_mamba2.cutile.compute_out import compute_out
    from tilegym_mamba2.cutile.fwd_pass_state import fwd_pass_state
    from tilegym_mamba2.cutile.scan_combined import mamba_chunk_scan_combined
    inputs = inputs_on(device)
    args = validation.check_forward_args(**inputs, backend="cutile")
    x, a, b, c, d, dt, init, chunk = args
    config = cutile.config_for(*args)
    k = config.chunk_size
    dt_bht, g = chunk_cumsum(dt, a, k)
    entry, final = fwd_pass_state(x, b, dt_bht, g, init, k, config)
    plain_layer, options_layer = layer_inputs_on(device, False), layer_inputs_on(device, True)
    table = {
        "tilegym.ops.mamba2_chunk_forward": lambda: tilegym.ops.mamba2_chunk_forward(**inputs),
        "tilegym_mamba2.mamba2_chunk_forward": lambda: tilegym_mamba2.mamba2_chunk_forward(**inputs),
        "cutile.mamba2_chunk_forward": lambda: cutile.mamba2_chunk_forward(**inputs),
        "  check_forward_args": lambda: validation.check_forward_args(**inputs, backend="cutile"),
        "  config_for": lambda: cutile.config_for(*args),
        "  run_stages (config given)": lambda: cutile.run_stages(*args, config=config),
        "    chunk_cumsum": lambda: chunk_cumsum(dt, a, k),
        "    fwd_pass_state": lambda: fwd_pass_state(x, b, dt_bht, g, init, k, config),
        "    compute_out": lambda: compute_out(x, b, c, d, dt_bht, g, entry, final, k, config),
        "layer op, no options (tilegym.ops)": lambda: tilegym.ops.mamba2_chunk_scan_combined(**plain_layer),
        "layer op, D z bias softplus (tilegym.ops)": lambda: tilegym.ops.mamba2_chunk_scan_combined(**options_layer),
        "layer op, D z bias softplus (cutile)": lambda: mamba_chunk_scan_combined(**options_layer),
        "  plan.signature + lookup": None,
        "  forward_args (conversions only)": None,
        "torch.empty": lambda: torch.empty(2048, 32, 64, dtype=torch.bfloat16, device=device),
        "launch (recorded)": lambda: launch.launch((1,), None, (x, a, 1)),
    }
    try:  # the host code of experiment 33 on
        from tilegym_mamba2.cutile import plan
        table["  plan.signature + lookup"] = lambda: plan.planned(plan.signature("forward", *inputs.values()))
        table["  forward_args (conversions only)"] = lambda: validation.forward_args(*inputs.values())
    except ImportError:
        pass
    return {name: fn for name, fn in table.items() if fn is not None}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="meta", choices=("meta", "cpu"))
    parser.add_argument("--profile", action="store_true", help="cProfile 2000 calls through tilegym.ops")
    opts = parser.parse_args()
    tilegym.set_backend("cutile")
    with launch.recording_launches():  # the setup's own stage calls
        table = pieces(opts.device)
    print(f"CPU proxy, prefill {PREFILL}, tensors on {opts.device}, launches recorded (us per call)")
    for name, fn in table.items():
        print(f"{name:44s} {per_call_us(fn):7.2f}", flush=True)
    if opts.profile:
        call = table["tilegym.ops.mamba2_chunk_forward"]
        with launch.recording_launches():
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(2000):
                call()
            profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
