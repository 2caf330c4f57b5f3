"""Host time per call of the plain op and the layer op through tilegym's dispatch, with the
package's call plans on and off (GPU).

    python benchmarks/host_time.py [LABEL]

Two modes, in alternating rounds in one process:
  planned    the package as it is: a repeated call's checks and config come from its plan
             (runtime/plan.py) and kernels are launched on the raw stream handle
  unplanned  no call plans (every call checked in full; config_for's per-shape memo still
             answers) and launches given torch Stream objects: what the plans and the raw
             handle save
For each shape and op, one line per mode:
  host us     wall time to queue 100 calls with no synchronize inside (the GPU is not waited
              for), per call; median of the rounds
  queued ms   the same 100 calls up to the synchronize that ends them, per call: the larger of
              the host's and the GPU's time
and for the prefill shape a line with CUDA events around one call after a synchronize (median
of 200), both modes, next to `bench`'s own timing (L2 flushed). LABEL (default "?") starts every
line, to tell runs apart, e.g. two checkouts run in turn through PYTHONPATH.
"""
import statistics
import sys
import time

import torch

import tilegym
import tilegym_mamba2  # noqa: F401  (registers the ops with tilegym)
from tilegym_mamba2.bench.forward import measure
from tilegym_mamba2.runtime import launch, plan
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs

PREFILL = (1, 2048, 1, 32, 128, 64)  # batch, tokens, groups, heads, state_size, head_size
SHAPES = [PREFILL, (1, 512, 1, 8, 128, 64), (2, 1024, 2, 8, 128, 64)]
CALLS, ROUNDS = 100, 7
RAW_STREAM = launch._raw_stream
PLANNED = plan.planned


def without_call_plans(key):
    """plan.planned for the unplanned mode: config_for's per-shape memo still answers; a call's
    plan never does."""
    return PLANNED(key) if key is not None and key[0] == "config" else None


def set_mode(planned: bool):
    launch._raw_stream = RAW_STREAM if planned else None
    plan.planned = PLANNED if planned else without_call_plans


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


def main(label):
    tilegym.set_backend("cutile")
    print(f"{label}: {torch.cuda.get_device_name()}, torch {torch.__version__}, raw stream query "
          f"{'present' if RAW_STREAM is not None else 'ABSENT'}", flush=True)
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
                print(f"{label:8s} {str(shape):26s} {name:36s} | event ms planned {ms[True]:.4f} unplanned "
                      f"{ms[False]:.4f} | bench (L2 flushed, planned) {measure(call):.4f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "?")
