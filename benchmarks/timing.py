"""Timing helpers shared by the scripts in this folder (GPU).

The scripts run as `python benchmarks/<name>.py`, which puts this folder on sys.path, so they
import these as `from timing import ...`. Nothing here runs on import.
"""
import statistics
import sys

import torch

from tilegym_mamba2.core.validation import check_forward_args
from tilegym_mamba2.ssd.chunk_cumsum import chunk_cumsum
from tilegym_mamba2.ssd.forward import _milliseconds, config_for
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs


def queued_ms(fn, calls=20, batches=3):
    """Per-call time of ``calls`` back-to-back calls, median of ``batches``: the GPU's queue stays
    full, so the host's launch time (tens of us per call in Python) is not counted, as in a model
    where these stages run one after another. No L2 flush: for side-by-side runs in one process."""
    _warm_up(fn)
    return statistics.median(_elapsed_ms(fn, calls) for _ in range(batches))


def _warm_up(fn):
    for _ in range(3):
        fn()


def _elapsed_ms(fn, calls):
    return _milliseconds(fn, reps=calls)  # one warm-up call, then CUDA events around the rest


def tuned_inputs(shape):
    """Checked GPU inputs of a shape (batch, tokens, groups, heads, state_size, head_size), its
    tuned config, and dt_bht and the decay sums at that config's chunk length."""
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    config = config_for(*args)
    dt_bht, g = chunk_cumsum(args.dt, args.a, config.chunk_size)
    return args, config, dt_bht, g


def backward_inputs(shape, dtype=torch.bfloat16):
    """GPU inputs of mamba2_chunk_backward for a shape: the forward's keyword arguments, dout and
    dfinal_state."""
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda", dtype=dtype)
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    return inputs, torch.randn_like(inputs["x"]), torch.randn_like(inputs["init_state"])


def graph_us(calls, reps=30):
    """Median GPU us per call of a CUDA graph that holds ``calls`` (a list of thunks) in order."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def checked_row(name, same, calls):
    """(name, graph_us(calls)), the name marked DIFFERS where same() is false; or (name and the
    error, nan) where it does not run."""
    try:
        return name + ("" if same() else " DIFFERS"), graph_us(calls)
    except Exception as e:  # noqa: BLE001
        return f"{name}: {type(e).__name__} {str(e)[:80]}", float("nan")


def print_rows(title, rows, mbytes):
    """(name, us) rows fastest first, with the bandwidth the op's least traffic implies
    (MB / us = TB/s); rows that did not run last."""
    print(f"\n## {title}: {mbytes:.2f} MB moved per call at least")
    for name, us in sorted(rows, key=lambda r: (r[1] != r[1], r[1])):
        print(f"{name:48s} {us:8.2f} us  {mbytes / us:6.3f} TB/s")
    sys.stdout.flush()


def gpu_busy(fn, calls=5):
    """fn's GPU time per call summed over its kernels (ms; torch.profiler, gaps not counted), its
    kernels per call, and the profile (for ``prof.key_averages().table(...)``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / calls / 1e3, len(kernels) // calls, prof
