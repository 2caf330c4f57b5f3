"""Scratch experiment (GPU): one segment per row (compute_out walks whole rows from the initial
state and leaves the final state; no state pass) against the segment lengths the tuner tried
before, on the shapes whose whole-row blocks fill the GPU. Alternating rounds, one process.

    source .device/setup.sh && python3 benchmarks/variants/whole_rows.py

Prediction (fifth session, written before any run), whole rows against the best of 8/16/32
chunks per segment: P=128 (8 x 4096 x 32 heads, 256 blocks, state pass ~40% of the op) -25% to
-35%; N=256 (256 blocks, state pass ~28%) -15% to -25%; the 2.7B layer (160 blocks on 132 SMs,
each walking 128 chunks) anywhere from -15% to +15%: its state pass goes (~0.19 ms) but a
quarter of its SMs get two blocks.
"""
import statistics
from dataclasses import replace

from tilegym_mamba2.cutile import run_stages
from tilegym_mamba2.cutile.tuning import whole_row_chunks
from timing import median_ms, tuned_inputs

SHAPES = [(8, 4096, 1, 32, 64, 128), (2, 8192, 8, 64, 256, 64), (2, 8192, 1, 80, 128, 64)]

for shape in SHAPES:
    args, tuned, _, _ = tuned_inputs(shape)
    x, _, b, *_ = args
    whole = whole_row_chunks(x.shape[0], x.shape[1], x.shape[2], x.shape[3], tuned)
    lengths = sorted({8, 16, 32, whole or 0} - {0})
    outs = {k: run_stages(*args, config=replace(tuned, chunks_per_segment=k)) for k in lengths}
    ref = outs[lengths[0]]
    rounds = {k: [] for k in lengths}
    for _ in range(5):
        for k in lengths:
            rounds[k].append(median_ms(lambda: run_stages(*args, config=replace(tuned, chunks_per_segment=k)),
                                       reps=20))
    row = [f"{str(shape):28s} tuned {tuned.chunks_per_segment}, whole rows {whole}"]
    for k in lengths:
        diff = ((outs[k].out.float() - ref.out.float()).norm() / ref.out.float().norm()).item()
        final = ((outs[k].final_state - ref.final_state).norm() / ref.final_state.norm()).item()
        row.append(f"  {k:4d} chunks/segment {statistics.median(rounds[k]):.4f} ms  "
                   f"(out diff {diff:.1e}, final diff {final:.1e} against {lengths[0]})")
    print("\n".join(row), flush=True)
