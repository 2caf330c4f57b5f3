"""Scratch (GPU): the time of an op's first call in a fresh process (issue 3: at most 5 s,
compilation included; issue 13: a backward's at most 10 s), and optionally where it goes.

    CUDA_TILE_CACHE_DIR=$(mktemp -d) TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) \
        python3 benchmarks/variants/first_call.py plain|layer|unseen|backward|second_shape [--profile] [--parallel]

plain: the source config through mamba2_chunk_forward; layer: the layer bench's 2.7B case with
every option on; unseen: a shape no run has tuned (with the cuTile disk cache of an earlier
process, this is a user's new shape); backward: mamba2_chunk_forward then mamba2_chunk_backward
on the 2.7B layer's shape, as `bench --backward` times it. Empty cache directories make the call
cold: cuTile keeps compiled kernels on disk (~/.cache/cutile-python) and we keep tuned choices.
second_shape: backward's call on the 2.7B layer after the same call on the source config in
this process (run40: 12.1 s; which kernels compile again, experiment 47's result).

--parallel (experiment 47): before the call, its launches are recorded (the heuristic config's:
the tuner's segment lengths share kernels) and their kernels compiled side by side into the disk
cache, with the signatures a launch would derive from these very tensors; tileiras runs as a
subprocess, so threads overlap. The call's own compiles should then all be disk-cache hits.
"""
import cProfile
import io
import os
import pstats
import sys
import time

start = time.perf_counter()
import torch  # noqa: E402

import tilegym_mamba2  # noqa: E402
from tilegym_mamba2.bench_layer import LAYER_CASES, layer_inputs  # noqa: E402
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs  # noqa: E402

imported = time.perf_counter() - start


def timed(module, name, log):
    """Wraps module.name so that each call's seconds are appended to log."""
    inner = getattr(module, name)

    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            log.append(time.perf_counter() - begin)
    setattr(module, name, wrapper)


# The kernel compiles of the call: all of cuTile's compile_tile (front end, disk-cache lookup,
# tileiras) and the tileiras runs alone. compile_tile is imported where it is used, at call time,
# so wrapping the module attribute catches every compile.
import cuda.tile._compile as tile_compile  # noqa: E402
compiles, tileiras_runs, compiled = [], [], []
timed(tile_compile, "compile_tile", compiles)
timed(tile_compile, "compile_cubin", tileiras_runs)
inner_compile = tile_compile.compile_tile
tile_compile.compile_tile = lambda function, *a, **k: compiled.append(function.pyfunc.__name__) or inner_compile(
    function, *a, **k)


def record_launches(mode, inputs):
    """The (kernel, args) the call would launch, with nothing run."""
    from tilegym_mamba2.backward import chunk_backward
    from tilegym_mamba2.cutile import run_stages
    from tilegym_mamba2.cutile.launch import recording_launches
    from tilegym_mamba2.cutile.scan import KERNELS
    from tilegym_mamba2.cutile.tuning import choose_config
    from tilegym_mamba2.validation import check_forward_args

    x, a, b, c, d, dt, init, chunk_size = check_forward_args(**inputs, backend="cutile")
    config = choose_config(*x.shape[:2], b.shape[2], x.shape[2], x.shape[3], b.shape[3], chunk_size, x.device)
    with recording_launches() as launches:
        run_stages(x, a, b, c, d, dt, init, chunk_size, config)
        if mode in ("backward", "second_shape"):
            chunk_backward(KERNELS, x, a, b, c, d, dt, init, torch.empty_like(x), torch.empty_like(init))
    return launches


def compile_side_by_side(launches):
    """Each distinct (kernel, signature) compiled once, all at the same time, into the disk cache."""
    from concurrent.futures import ThreadPoolExecutor

    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel

    jobs = {}
    for kernel, args in launches:
        signature = KernelSignature.from_kernel_args(kernel, args, CallingConvention.cutile_python_v1())
        jobs.setdefault((id(kernel), repr(signature)), (kernel, signature))
    gpu_code = "sm_{}{}".format(*torch.cuda.get_device_capability())

    def build(job):
        export_kernel(job[0], [job[1]], io.BytesIO(), gpu_code=gpu_code, output_format="cubin")

    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        list(pool.map(build, jobs.values()))
    return len(jobs)


mode = sys.argv[1]
if mode == "layer":
    args, _ = layer_inputs(LAYER_CASES[0])
    op = lambda: tilegym_mamba2.mamba_chunk_scan_combined(**args, chunk_size=256, backend="cutile")  # noqa: E731
else:
    def shape_op(shape, backward):
        spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=256, device="cuda")
        inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
        if not backward:
            return inputs, lambda: tilegym_mamba2.mamba2_chunk_forward(**inputs)
        dout, dfinal = torch.randn_like(inputs["x"]), torch.randn_like(inputs["init_state"])
        return inputs, lambda: (tilegym_mamba2.mamba2_chunk_forward(**inputs),
                                tilegym_mamba2.mamba2_chunk_backward(**inputs, dout=dout, dfinal_state=dfinal))

    if mode == "second_shape":
        shape_op((4, 16384, 1, 8, 128, 64), True)[1]()
        torch.cuda.synchronize()
        compiles.clear(), tileiras_runs.clear(), compiled.clear()
    shape = {"plain": (4, 16384, 1, 8, 128, 64), "backward": (2, 8192, 1, 80, 128, 64),
             "second_shape": (2, 8192, 1, 80, 128, 64)}.get(mode, (3, 12000, 1, 24, 128, 64))
    inputs, op = shape_op(shape, mode in ("backward", "second_shape"))
torch.cuda.synchronize()
ahead = ""
if "--parallel" in sys.argv:
    if mode == "layer":
        sys.exit("--parallel: the plain op's modes only")
    start = time.perf_counter()
    kernels = compile_side_by_side(record_launches(mode, inputs))
    ahead = f"{kernels} kernels compiled side by side in {time.perf_counter() - start:.2f} s, then "
    compiles.clear(), tileiras_runs.clear(), compiled.clear()


def call():
    op()
    torch.cuda.synchronize()


profile = cProfile.Profile() if "--profile" in sys.argv else None
start = time.perf_counter()
profile.runcall(call) if profile else call()
first = time.perf_counter() - start
start = time.perf_counter()
call()
print(f"{mode}: import {imported:.2f} s, {ahead}first call {first:.2f} s, second call {time.perf_counter() - start:.4f} s; "
      f"{len(compiles)} kernel compiles took {sum(compiles):.2f} s, {len(tileiras_runs)} of them ran tileiras "
      f"({sum(tileiras_runs):.2f} s), the rest were disk-cache hits; compiled: {' '.join(compiled)}", flush=True)
if profile:
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(12)
