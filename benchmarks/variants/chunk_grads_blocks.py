"""Experiment 41 (GPU): how many of a group's heads one chunk_grads block takes (BLOCK_HEADS),
timed as the whole mamba2_chunk_backward on the issue's two shapes (inputs of hundreds of MB:
L2 holds none of them between calls). Each variant's gradients are compared with the package
default's; they differ only in the order of fp32 sums.

    python3 benchmarks/variants/chunk_grads_blocks.py [B,T,G,H,N,P ...]
"""
import sys


import tilegym_mamba2
from tilegym_mamba2.cutile import chunk_grads as cg
from timing import backward_inputs, median_ms

VARIANTS = (1, 2, 4, 8, 16)
SHAPES = ("4,16384,1,8,128,64", "2,8192,1,80,128,64")


def run(shape):
    inputs, dout, dfinal = backward_inputs(shape)

    def step():
        return tilegym_mamba2.mamba2_chunk_backward(**inputs, dout=dout, dfinal_state=dfinal)

    default = cg.BLOCK_HEADS
    want = step()
    for blocks in VARIANTS:
        cg.BLOCK_HEADS = blocks
        got = step()
        diff = max(((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item()
                   for g, w in zip(got, want) if w is not None and w.numel())
        print(f"{shape} BLOCK_HEADS={blocks:2d} (block of {cg.block_heads_for(shape[3] // shape[2])}): "
              f"{median_ms(step, reps=20):.3f} ms, max rel diff to default {diff:.1e}", flush=True)
    cg.BLOCK_HEADS = default


if __name__ == "__main__":
    for text in sys.argv[1:] or SHAPES:
        run(tuple(int(v) for v in text.split(",")))
