"""The time of an op's first call in a fresh process, compilation and tuning included, and which
kernels it compiles (GPU). The project's targets: at most 5 s for a forward's first call, 10 s
for a backward's.

    CUDA_TILE_CACHE_DIR=$(mktemp -d) TILEGYM_MAMBA2_CACHE_DIR=$(mktemp -d) \
        python benchmarks/first_call.py MODE [--profile]

cuTile keeps compiled kernels on disk (~/.cache/cutile-python) and the package keeps tuned
choices (TILEGYM_MAMBA2_CACHE_DIR); empty directories make the call cold, as a user's first.
MODE:
  plain         mamba2_chunk_forward on the source config (4, 16384, 1, 8, 128, 64)
  layer         mamba_chunk_scan_combined on the layer bench's 2.7B case, every option on
  unseen        mamba2_chunk_forward on a shape no benchmark tunes (3, 12000, 1, 24, 128, 64);
                with a warm cuTile cache, this is a user's new shape
  backward      mamba2_chunk_forward then mamba2_chunk_backward on the 2.7B layer's shape
                (2, 8192, 1, 80, 128, 64), as `bench --backward` times it
  second_shape  the backward mode's call after the same call on the source config in this
                process: what a second shape compiles again
  shape B,T,G,H,N,P[,CHUNK[,DTYPE]]
                mamba2_chunk_forward on that shape (chunk 256 and bf16 unless given); with
                --then T2, the first call of T2 tokens after it, same process: a new token count
                once the model's dimensions are known; with --backward, forward then backward;
                with --wait-background (unless TILEGYM_MAMBA2_PRECOMPILE=0), T2's call waits until
                the background compiles of the other token-count class
                (runtime/other_token_class.py) have ended, as a later step of a training run would
It prints one line: the import time, the first call's seconds (forward and backward apart in
the backward modes), the second call's, how many kernel compiles ran and how long, how many of
them ran tileiras (the rest were disk-cache hits), and the compiled kernels' names.
--profile: also cProfile's top functions of the first call (cumulative, then own time).
"""
import cProfile
import pstats
import sys
import time

_start = time.perf_counter()
import cuda.tile._compile as tile_compile  # noqa: E402
import torch  # noqa: E402

import tilegym_mamba2  # noqa: E402
from tilegym_mamba2.runtime import other_token_class  # noqa: E402
from tilegym_mamba2.bench.layer import LAYER_CASES, layer_inputs  # noqa: E402
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs  # noqa: E402

IMPORT_SECONDS = time.perf_counter() - _start
SOURCE, LAYER_2_7B, UNSEEN = (4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (3, 12000, 1, 24, 128, 64)
SHAPES = {"plain": SOURCE, "unseen": UNSEEN, "backward": LAYER_2_7B, "second_shape": LAYER_2_7B}


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


def watch_compiles():
    """-> (seconds of each compile_tile call, of each tileiras run, the compiled kernels' names).
    cuTile imports compile_tile where it is used, at call time, so wrapping the module attribute
    catches every compile: its front end, the disk-cache lookup and tileiras."""
    compiles, tileiras_runs, names = [], [], []
    timed(tile_compile, "compile_tile", compiles)
    timed(tile_compile, "compile_cubin", tileiras_runs)
    inner = tile_compile.compile_tile

    def named(function, *args, **kwargs):
        names.append(function.pyfunc.__name__)
        return inner(function, *args, **kwargs)
    tile_compile.compile_tile = named
    return compiles, tileiras_runs, names


def shape_op(shape, backward, forward_seconds, chunk_size=256, dtype=torch.bfloat16):
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=chunk_size, dtype=dtype, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    if not backward:
        return lambda: tilegym_mamba2.mamba2_chunk_forward(**inputs)
    dout, dfinal = torch.randn_like(inputs["x"]), torch.randn_like(inputs["init_state"])

    def forward_then_backward():
        begin = time.perf_counter()
        tilegym_mamba2.mamba2_chunk_forward(**inputs)
        torch.cuda.synchronize()
        forward_seconds.append(time.perf_counter() - begin)
        tilegym_mamba2.mamba2_chunk_backward(**inputs, dout=dout, dfinal_state=dfinal)
    return forward_then_backward


def parse_shape(text):
    """'B,T,G,H,N,P[,CHUNK[,DTYPE]]' -> (shape, chunk_size, dtype)."""
    parts = text.split(",")
    shape = tuple(int(v) for v in parts[:6])
    chunk = int(parts[6]) if len(parts) > 6 else 256
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(parts[7], parts[7])) \
        if len(parts) > 7 else torch.bfloat16
    return shape, chunk, dtype


def main(mode, profile=False, shape_text=None, then_tokens=None, backward=False, wait_background=False):
    if mode not in ("layer", "shape", *SHAPES):
        sys.exit(f"mode: one of layer shape {' '.join(SHAPES)}")
    compiles, tileiras_runs, compiled = watch_compiles()
    forward_seconds, background = [], ""
    if mode == "layer":
        args, _ = layer_inputs(LAYER_CASES[0])
        op = lambda: tilegym_mamba2.mamba_chunk_scan_combined(**args, chunk_size=256, backend="cutile")  # noqa: E731
    elif mode == "shape":
        shape, chunk, dtype = parse_shape(shape_text)
        if then_tokens is not None:
            begin = time.perf_counter()
            shape_op(shape, backward, forward_seconds, chunk, dtype)()
            torch.cuda.synchronize()
            if wait_background:
                first_seconds = time.perf_counter() - begin
                idle = other_token_class.wait_idle(600)
                background = (f"; the first T's call {first_seconds:.2f} s, then the background's "
                              f"{other_token_class.stats['compiled_in_background']} compiles "
                              f"{'ended' if idle else 'had not ended'} after {time.perf_counter() - begin:.2f} s, "
                              f"{other_token_class.stats['replays_failed']} replays failed")
            for log in (compiles, tileiras_runs, compiled, forward_seconds):
                log.clear()
            shape = (shape[0], then_tokens, *shape[2:])
        op = shape_op(shape, backward, forward_seconds, chunk, dtype)
    else:
        backward = mode in ("backward", "second_shape")
        if mode == "second_shape":
            shape_op(SOURCE, True, forward_seconds)()
            torch.cuda.synchronize()
            for log in (compiles, tileiras_runs, compiled, forward_seconds):
                log.clear()
        op = shape_op(SHAPES[mode], backward, forward_seconds)
    torch.cuda.synchronize()
    taken_before = other_token_class.stats["taken"]

    def call():
        op()
        torch.cuda.synchronize()

    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    profiler.runcall(call) if profiler else call()
    first = time.perf_counter() - start
    start = time.perf_counter()
    call()
    second = time.perf_counter() - start
    split = (f" (forward {forward_seconds[0]:.2f} s, backward {first - forward_seconds[0]:.2f} s)"
             if forward_seconds else "")
    label = mode if mode != "shape" else (f"shape {shape_text}" + (f" then T={then_tokens}" if then_tokens else "")
                                          + (" forward+backward" if backward else ""))
    print(f"{label}: import {IMPORT_SECONDS:.2f} s, first call {first:.2f} s{split}, second call {second:.4f} s; "
          f"{len(compiles)} kernel compiles took {sum(compiles):.2f} s, {len(tileiras_runs)} of them ran tileiras "
          f"({sum(tileiras_runs):.2f} s), the rest were disk-cache hits; "
          f"{other_token_class.stats['taken'] - taken_before} binaries taken from the background's compiles; "
          f"compiled: {' '.join(compiled)}{background}", flush=True)
    if profiler:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rest = sys.argv[2:]
    shape_text = rest.pop(0) if sys.argv[1] == "shape" and rest else None
    then = int(rest[rest.index("--then") + 1]) if "--then" in rest else None
    main(sys.argv[1], profile="--profile" in rest, shape_text=shape_text, then_tokens=then,
         backward="--backward" in rest, wait_background="--wait-background" in rest)
