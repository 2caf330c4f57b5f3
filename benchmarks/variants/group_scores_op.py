"""Scratch (GPU): the whole plain op with C·B^T once per group (group_scores) and without, at
the tuned config of each shape. CUDA-event medians of 30 after warm-up.

    python3 benchmarks/variants/group_scores_op.py
"""
from dataclasses import replace

from tilegym_mamba2.cutile import config_for, run_stages
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args
from compute_out_variants import median_ms

for shape in [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (2, 8192, 8, 64, 256, 64),
              (8, 4096, 1, 32, 64, 128)]:
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    tuned = config_for(*args)
    times = {on: median_ms(lambda: run_stages(*args, config=replace(tuned, group_scores=on))) for on in (False, True)}
    print(f"{str(shape):28s} chosen {tuned.group_scores!s:5s}  without {times[False]:.3f} ms  "
          f"with {times[True]:.3f} ms", flush=True)
