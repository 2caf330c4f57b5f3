"""Experiment 79 (GPU): the chained one-launch path's host and GPU time, side by side with the
four-launch path, in one process.

In run89 the tuner timed the prefill's chained path at 0.076 ms per call against 0.073 for four
launches and kept four launches (bench 0.068 ms), where experiment 77's variant gave bench 0.053
and 0.049 ms of GPU. The tuner times ten back-to-back calls, so a host-bound call is timed by its
host; this script separates the two. Per path, medians of alternating rounds:
  host us   wall time to queue 500 calls, per call (timing.host_us)
  tuner ms  what the tuner measures (cutile._milliseconds: ten back-to-back calls)
  bench ms  `bench`'s measure (L2 flushed before each call, events around one call)
  graph ms  GPU time per call of 20 calls replayed in one CUDA graph (no host)
  kernel ms the profiler's sum of kernel durations per call
Paths: run_stages at the four-launch config the tuner kept (chunks_per_segment=4) and at the
chained configs (2 and 4 chunks per segment), and the public call (tilegym.ops) at the
four-launch and the chained-4 plan. Then the host floor of this machine: cuTile launches of
1 / 12 / 18 / 21 arguments, torch.empty, each layer of the public call.

    python3 benchmarks/variants/chained_host.py [SHAPE ...]   (default: the prefill and (2, 1024, 2, 8))
"""
import statistics
import sys

import cuda.tile as ct
import torch
from cuda.tile._cext import launch as cutile_launch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import graph_us, gpu_busy, host_us  # noqa: E402 (this folder's)

import tilegym  # noqa: E402
import tilegym_mamba2  # noqa: E402
from tilegym_mamba2.bench import measure  # noqa: E402
from tilegym_mamba2.cutile import _milliseconds, plan, run_stages  # noqa: E402
from tilegym_mamba2.cutile.chained_prefill import chained_prefill  # noqa: E402
from tilegym_mamba2.cutile.launch import current_stream, new_output  # noqa: E402
from tilegym_mamba2.cutile.tuning import chained_config, choose_config  # noqa: E402
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs  # noqa: E402
from tilegym_mamba2.validation import check_forward_args  # noqa: E402
from dataclasses import replace  # noqa: E402

SHAPES = [(1, 2048, 1, 32, 128, 64), (2, 1024, 2, 8, 128, 64)]  # batch, tokens, groups, heads, state, head


@ct.kernel
def one_array(a0):
    ct.store(a0, (0,), ct.load(a0, (0,), (1,)))


@ct.kernel
def many(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, n0, n1, c0: ct.Constant[int],
         c1: ct.Constant[int], c2: ct.Constant[int], c3: ct.Constant[bool], c4: ct.Constant[bool]):
    ct.store(a0, (0,), ct.load(a13, (0,), (1,)) + n0 + n1)


def paths_for(shape):
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    args = check_forward_args(**inputs, backend="cutile")
    batch, tokens, groups, heads, state_size, head_size = shape
    base = choose_config(batch, tokens, groups, heads, head_size, state_size, 128, args[0].device)
    four = replace(base, chunks_per_segment=4)
    configs = {"four launches, 4 chunks": four, "chained, 2 chunks": chained_config(base, 2),
               "chained, 4 chunks": chained_config(base, 4)}
    paths = {f"run_stages {name}": (lambda config=config: run_stages(*args, config=config))
             for name, config in configs.items()}
    if shape == SHAPES[0]:  # experiment 77's kernel (21 arguments), as its probe timed it
        import chained_prefill as variant  # this folder's
        x, a, b, c, d, dt, init, _ = args
        paths["variant (experiment 77), staged, 4 chunks"] = (
            lambda: variant.chained_prefill(x, a, b, c, d, dt, init, 128, 4, 64, sums="staged"))
    key = plan.signature("forward", *inputs.values())
    for name in ("four launches, 4 chunks", "chained, 4 chunks"):
        def public(config=configs[name]):
            plan.remember(key, config)  # the plan a settled call would have (a dict store)
            return tilegym.ops.mamba2_chunk_forward(**inputs)
        paths[f"tilegym.ops {name}"] = public
    return args, configs, inputs, paths


def time_paths(shape):
    args, configs, inputs, paths = paths_for(shape)
    for fn in paths.values():  # compiles, and settles the allocator
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    chained = paths["run_stages chained, 4 chunks"]()
    four = paths["run_stages four launches, 4 chunks"]()
    print(f"## {shape}: chained-4 against four launches: out max |diff| "
          f"{(chained.out.float() - four.out.float()).abs().max().item():.3e}, final state "
          f"{(chained.final_state - four.final_state).abs().max().item():.3e}", flush=True)
    rows = {name: {k: [] for k in ("host us", "tuner ms", "bench ms", "graph ms", "kernel ms")} for name in paths}
    for _ in range(5):
        for name, fn in paths.items():
            row = rows[name]
            row["host us"].append(host_us(fn))
            row["tuner ms"].append(_milliseconds(fn))
            row["bench ms"].append(measure(fn))
            if not name.startswith("tilegym.ops"):
                row["graph ms"].append(graph_us([fn] * 20) / 1e3)
                row["kernel ms"].append(gpu_busy(fn)[0])
    print(f"## {shape} bf16, medians of 5 alternating rounds")
    for name, row in rows.items():
        print(f"{name:40s} " + "  ".join(f"{k} {statistics.median(v):.4f}" for k, v in row.items() if v),
              flush=True)
    return args, configs, inputs


def host_floor(args, configs, inputs):
    """This host's costs, each a median of 5 rounds of 2000 calls."""
    x = args[0]
    buf = torch.zeros(16, device="cuda")
    stream = current_stream(0)
    chained4 = configs["chained, 4 chunks"]
    key = plan.signature("forward", *inputs.values())
    plan.remember(key, chained4)
    from tilegym_mamba2.cutile import mamba2_chunk_forward
    pieces = {
        "cuTile launch, 1 array": lambda: cutile_launch(stream, (1,), one_array, (buf,)),
        "cuTile launch, 12 arrays + 2 + 5 (21)": lambda: cutile_launch(
            stream, (1,), many, (buf,) * 14 + (3, 4, 64, 64, 128, True, False)),
        "ct.launch (tilegym's wrapper), 1 array": lambda: ct.launch(stream, (1,), one_array, (buf,)),
        "torch.empty (out)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "new_output (final state)": lambda: new_output(1, 32, 64, 128, dtype=torch.float32, device=x.device),
        "raw stream": lambda: current_stream(0),
        "chained_prefill (config given)": lambda: chained_prefill(*args[:7], chained4),
        "run_stages (config given)": lambda: run_stages(*args, config=chained4),
        "cutile.mamba2_chunk_forward (planned)": lambda: mamba2_chunk_forward(**inputs),
        "tilegym_mamba2.mamba2_chunk_forward": lambda: tilegym_mamba2.mamba2_chunk_forward(**inputs),
        "tilegym.ops.mamba2_chunk_forward": lambda: tilegym.ops.mamba2_chunk_forward(**inputs),
    }
    print("## host floor and layers, us per call (chained, 4 chunks: the prefill's plan)")
    for name, fn in pieces.items():
        print(f"{name:42s} {statistics.median(host_us(fn, 2000, warm_up=50) for _ in range(5)):7.2f}", flush=True)


def main():
    tilegym.set_backend("cutile")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    shapes = [tuple(int(v) for v in s.strip("()").split(",")) for s in sys.argv[1:]] or SHAPES
    first = None
    for shape in shapes:
        result = time_paths(shape)
        first = first or result
    host_floor(*first)


if __name__ == "__main__":
    main()
