"""Scratch (GPU): the time of an op's first call in a fresh process (issue 3: at most 5 s,
compilation included; issue 13: a backward's at most 10 s), and optionally where it goes.

    CUDA_TILE_CACHE_DIR=$(mktemp -d) TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) \
        python3 benchmarks/variants/first_call.py plain|layer|unseen|backward|second_shape [--profile]

plain: the source config through mamba2_chunk_forward; layer: the layer bench's 2.7B case with
every option on; unseen: a shape no run has tuned (with the cuTile disk cache of an earlier
process, this is a user's new shape); backward: mamba2_chunk_forward then mamba2_chunk_backward
on the 2.7B layer's shape, as `bench --backward` times it. Empty cache directories make the call
cold: cuTile keeps compiled kernels on disk (~/.cache/cutile-python) and we keep tuned choices.
second_shape: backward's call on the 2.7B layer after the same call on the source config in
this process (run43: all 7 kernels compile again, 17.7 s).

In the backward modes the forward and the backward are timed apart. Experiment 49 (compiling the
call's kernels side by side first, in threads) made a cold first call slower; see NOTES.md.
"""
import cProfile
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


mode = sys.argv[1]
forward_seconds = []
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

        def forward_then_backward():
            begin = time.perf_counter()
            tilegym_mamba2.mamba2_chunk_forward(**inputs)
            torch.cuda.synchronize()
            forward_seconds.append(time.perf_counter() - begin)
            tilegym_mamba2.mamba2_chunk_backward(**inputs, dout=dout, dfinal_state=dfinal)
        return inputs, forward_then_backward

    if mode == "second_shape":
        shape_op((4, 16384, 1, 8, 128, 64), True)[1]()
        torch.cuda.synchronize()
        compiles.clear(), tileiras_runs.clear(), compiled.clear(), forward_seconds.clear()
    shape = {"plain": (4, 16384, 1, 8, 128, 64), "backward": (2, 8192, 1, 80, 128, 64),
             "second_shape": (2, 8192, 1, 80, 128, 64)}.get(mode, (3, 12000, 1, 24, 128, 64))
    inputs, op = shape_op(shape, mode in ("backward", "second_shape"))
torch.cuda.synchronize()


def call():
    op()
    torch.cuda.synchronize()


profile = cProfile.Profile() if "--profile" in sys.argv else None
start = time.perf_counter()
profile.runcall(call) if profile else call()
first = time.perf_counter() - start
start = time.perf_counter()
call()
split = f" (forward {forward_seconds[0]:.2f} s, backward {first - forward_seconds[0]:.2f} s)" if forward_seconds else ""
print(f"{mode}: import {imported:.2f} s, first call {first:.2f} s{split}, second call {time.perf_counter() - start:.4f} s; "
      f"{len(compiles)} kernel compiles took {sum(compiles):.2f} s, {len(tileiras_runs)} of them ran tileiras "
      f"({sum(tileiras_runs):.2f} s), the rest were disk-cache hits; compiled: {' '.join(compiled)}", flush=True)
if profile:
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(12)
