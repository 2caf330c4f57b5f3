"""Timing helpers shared by the scratch experiments in this folder (GPU)."""
import statistics
import sys
import time

import torch

from tilegym_mamba2.cutile import config_for
from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args


def median_ms(fn, reps=40):
    """Median CUDA-event time of fn after 3 warm-up calls (no L2 flush: for A/B in one process).
    The host's launch time is counted when the GPU waits for it."""
    _warm_up(fn)
    return statistics.median(_elapsed_ms(fn, 1) for _ in range(reps))


def queued_ms(fn, calls=20, batches=3):
    """Per-call time of ``calls`` back-to-back calls, median of ``batches``: the GPU's queue stays
    full, so the host's launch time (tens of us per call in Python) is not counted, as in a model
    where these stages run one after another."""
    _warm_up(fn)
    return statistics.median(_elapsed_ms(fn, calls) for _ in range(batches))


def host_us(fn, calls=500, warm_up=20):
    """Host microseconds to queue one call: ``calls`` calls timed with no synchronize inside (the
    GPU is not waited for), after ``warm_up`` calls and a synchronize."""
    for _ in range(warm_up):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _warm_up(fn):
    for _ in range(3):
        fn()


def _elapsed_ms(fn, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def tuned_inputs(shape):
    """Checked GPU inputs of a shape, its tuned config, and dt and the decay sums at that config."""
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    config = config_for(*args)
    dt_bht, g = chunk_cumsum(args[5], args[1], config.chunk_size)
    return args, config, dt_bht, g


def backward_inputs(shape, dtype=torch.bfloat16):
    """GPU inputs of mamba2_chunk_backward for a shape: the forward's keyword arguments, dout and
    dfinal_state."""
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda", dtype=dtype)
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    return inputs, torch.randn_like(inputs["x"]), torch.randn_like(inputs["init_state"])


def graph_us(calls, reps=30):
    """Median GPU us per call of a captured graph of ``calls`` (a list of thunks)."""
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


def variant_row(name, same, calls):
    """(name, GPU us per call) of one kernel variant, marked DIFFERS where same() is false; or
    (name and the error, nan) where it does not run."""
    try:
        return name + ("" if same() else " DIFFERS"), graph_us(calls)
    except Exception as e:  # noqa: BLE001
        return f"{name}: {type(e).__name__} {str(e)[:80]}", float("nan")


def print_rows(title, rows, mbytes):
    """The variants fastest first, with the bytes they must move per second (MB / us = TB/s)."""
    print(f"\n## {title}: {mbytes:.2f} MB moved per call at least")
    for name, us in sorted(rows, key=lambda r: (r[1] != r[1], r[1])):
        print(f"{name:48s} {us:8.2f} us  {mbytes / us:6.3f} TB/s")
    sys.stdout.flush()


def gpu_busy(fn, calls=5):
    """fn's GPU time per call summed over its kernels (ms; torch.profiler, no gaps counted), its
    kernels per call, and the profile for a table."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / calls / 1e3, len(kernels) // calls, prof
