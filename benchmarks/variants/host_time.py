"""Scratch (H200): host time per call of the plain op and the layer op, plans on and off.

    python3 benchmarks/variants/host_time.py [LABEL]

For each op and shape, alternating rounds of two modes in one process:
  planned   the package as it is (a repeated call's checks and config from its plan, raw stream
            handles for ct.launch)
  unplanned no call plan (every call checked in full; config_for's per-shape memo, which the code
            before had too, still answers) and ct.launch given torch Stream objects: the host
            path of the code before experiment 33, less its no-op .to() calls
Per mode:
  host us     wall time to queue 100 calls with no synchronize inside (the GPU is not waited
              for: 400 launches stay under the launch queue's depth), per call; median of rounds
  queued ms   the same 100 calls up to the synchronize that ends them, per call: the larger of
              host and GPU time
  event ms    (prefill only) CUDA events around one call after a synchronize, median of 200:
              what `bench` sees without its L2 flush; `bench` itself for the planned mode
Run it alternately for two versions of the package (PYTHONPATH) to compare more than this.
"""
import statistics
import sys
import time

import torch

import tilegym
import tilegym_mamba2
from tilegym_mamba2.cutile import launch, plan
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs

PREFILL = (1, 2048, 1, 32, 128, 64)  # batch, tokens, groups, heads, state_size, head_size
SHAPES = [PREFILL, (1, 512, 1, 8, 128, 64), (2, 1024, 2, 8, 128, 64)]
CALLS, ROUNDS = 100, 7
label = sys.argv[1] if len(sys.argv) > 1 else "?"
raw_stream = launch._raw_stream


planned_fn = plan.planned


def without_call_plans(key):
    """plan.planned for the unplanned mode: config_for's per-shape memo (which the code before
    had too) still answers; a call's plan never does."""
    return planned_fn(key) if key is not None and key[0] == "config" else None


def set_mode(planned: bool):
    launch._raw_stream = raw_stream if planned else None
    plan.planned = planned_fn if planned else without_call_plans


def host_and_queued(call):
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (queued - start) / CALLS * 1e6, (done - start) / CALLS * 1e3


def event_ms(call, reps=200):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def calls_for(shape):
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    heads = shape[3]
    layer = dict(x=inputs["x"], dt=inputs["dt"], A=inputs["a"], B=inputs["b"], C=inputs["c"], chunk_size=256,
                 D=inputs["d"], z=torch.randn_like(inputs["x"]), dt_bias=torch.randn(heads, device="cuda"),
                 dt_softplus=True, return_final_states=True)
    return {"tilegym.ops.mamba2_chunk_forward": lambda: tilegym.ops.mamba2_chunk_forward(**inputs),
            "layer op (D, z, dt_bias, softplus)": lambda: tilegym.ops.mamba2_chunk_scan_combined(**layer)}


def main():
    tilegym.set_backend("cutile")
    print(f"{label}: {torch.cuda.get_device_name()}, torch {torch.__version__}, raw stream query "
          f"{'present' if raw_stream is not None else 'ABSENT'}", flush=True)
    for shape in SHAPES:
        for name, call in calls_for(shape).items():
            results = {True: [], False: []}
            for _ in range(ROUNDS):
                for planned in (True, False):
                    set_mode(planned)
                    results[planned].append(host_and_queued(call))
            set_mode(True)
            line = f"{label:8s} {str(shape):26s} {name:36s}"
            for planned in (True, False):
                host = statistics.median(r[0] for r in results[planned])
                queued = statistics.median(r[1] for r in results[planned])
                line += f" | {'planned' if planned else 'unplanned'} host {host:6.1f} us queued {queued:.4f} ms"
            print(line, flush=True)
            if shape == PREFILL:
                ms = {}
                for planned in (True, False):
                    set_mode(planned)
                    ms[planned] = event_ms(call)
                set_mode(True)
                from tilegym_mamba2.bench import measure
                print(f"{label:8s} {str(shape):26s} {name:36s} | event ms planned {ms[True]:.4f} unplanned "
                      f"{ms[False]:.4f} | bench (L2 flushed, planned) {measure(call):.4f} ms", flush=True)


if __name__ == "__main__":
    main()
