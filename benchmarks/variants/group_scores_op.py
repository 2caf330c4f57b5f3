"""Scratch (GPU): the whole plain op with C·B^T once per group (group_scores) and without, at
the tuned config of each shape. The two run in alternating rounds (CUDA-event medians of 30
after warm-up each), so that clock drift lands on both; the median over rounds is reported.

    python3 benchmarks/variants/group_scores_op.py
"""
import statistics
import sys
from dataclasses import replace

from tilegym_mamba2.cutile import config_for, run_stages
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args
from timing import median_ms

SHAPES = [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (4, 65536, 1, 8, 128, 64),
          (1, 2048, 1, 32, 128, 64), (8, 4096, 1, 32, 64, 128), (2, 8192, 8, 64, 256, 64)]

for shape in SHAPES[:int(sys.argv[1]) if len(sys.argv) > 1 else None]:
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    tuned = config_for(*args)
    rounds = {False: [], True: []}
    for _ in range(5):
        for on in (False, True):
            rounds[on].append(median_ms(lambda: run_stages(*args, config=replace(tuned, group_scores=on)), reps=30))
    off, on = statistics.median(rounds[False]), statistics.median(rounds[True])
    print(f"{str(shape):28s} chosen {tuned.group_scores!s:5s}  without {off:.4f} ms  with {on:.4f} ms  "
          f"with/without {on / off:.2f}  rounds without {' '.join(f'{t:.3f}' for t in rounds[False])}  "
          f"with {' '.join(f'{t:.3f}' for t in rounds[True])}", flush=True)
