"""Scratch (GPU): the whole plain op at the tuned config of each shape (the control) and at
variants of it, each variant a few Config fields changed. All run in alternating rounds
(CUDA-event medians of 30 after warm-up each) so that clock drift lands on every one; the
median over rounds is reported, with whether the output equals the control's to the bit.

    python3 benchmarks/variants/config_op.py [field=value[,field=value] ...]

Without arguments: the load-latency hints (NOTES.md, experiment 23).
"""
import statistics
import sys
from dataclasses import replace

import torch

from tilegym_mamba2.cutile import config_for, run_stages
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args
from timing import median_ms

SHAPES = [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (4, 65536, 1, 8, 128, 64),
          (1, 2048, 1, 32, 128, 64), (8, 4096, 1, 32, 64, 128), (2, 8192, 8, 64, 256, 64)]
DEFAULT_VARIANTS = ["out_load_latency=0", "out_load_latency=2", "out_load_latency=1,state_load_latency=1",
                    "out_load_latency=0,state_load_latency=1"]


def parse(variant: str) -> dict:
    return {field: int(value) for field, value in (item.split("=") for item in variant.split(","))}


variants = sys.argv[1:] or DEFAULT_VARIANTS
for shape in SHAPES:
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    tuned = config_for(*args)
    configs = {"control": tuned} | {v: replace(tuned, **parse(v)) for v in variants}
    control = run_stages(*args, config=tuned)
    same = {}
    for name, config in configs.items():
        stages = run_stages(*args, config=config)
        same[name] = torch.equal(stages.out, control.out) and torch.equal(stages.final_state, control.final_state)
    rounds = {name: [] for name in configs}
    for _ in range(5):
        for name, config in configs.items():
            rounds[name].append(median_ms(lambda: run_stages(*args, config=config), reps=30))
    base = statistics.median(rounds["control"])
    print(f"{shape}  tuned {tuned}", flush=True)
    for name, times in rounds.items():
        ms = statistics.median(times)
        print(f"  {name:42s} {ms:.4f} ms  x{ms / base:.3f}  {'same bits' if same[name] else 'OTHER BITS'}  "
              f"rounds {' '.join(f'{t:.3f}' for t in times)}", flush=True)
