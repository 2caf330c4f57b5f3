"""Experiment 76 (GPU): the decode step with programmatic dependent launch, the flag's threshold.

After experiment 71 the step was 0.88x / 0.93x mamba_ssm's at batch 1 / 8 in CUDA-graph replay
(3.81 / 16.70 against 3.36 / 15.60 us, run78), a few microseconds in which a launch's own latency
is a large part. With programmatic dependent launch a kernel's blocks may be scheduled before the
kernel ahead of it in the stream has finished; each block waits (`ct.grid_dependency_control_wait()`,
before its first load: every input may come from that kernel) until the predecessor is done and
its writes are visible, so the results cannot change, then lets the next kernel be scheduled
(`ct.grid_dependency_control_launch_dependents()`). Run84 timed two edits of the kernel text (wait;
wait + trigger) with the flag at every batch: wait + trigger was the faster, now in the package
(selective_state_update.py), with the flag for grids of up to DEPENDENT_LAUNCH_MAX_BLOCKS blocks.
This script times the package against the flag at every size and at none, each checked to the bit.
A graph of consecutive steps (as `bench --serving` replays) is where it shows; in a model the
kernel ahead is the convolution update or a GEMM.

    python3 benchmarks/variants/state_update_pdl.py [batch ...]
"""
import sys

import torch

from tilegym_mamba2.bench import serving as bench_serving
from tilegym_mamba2.cutile.serving import selective_state_update as ssu

CALLS = 8
THRESHOLDS = {"flag at every size": 1 << 62, "no flag": 0}


def main(batches):
    from timing import graph_us, print_rows, variant_row  # benchmarks/timing.py
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as peer
    except Exception as e:  # noqa: BLE001
        peer = None
        print(f"mamba_ssm not importable: {type(e).__name__}")
    package_threshold = ssu.DEPENDENT_LAUNCH_MAX_BLOCKS
    for batch in batches:
        case = bench_serving.ServingCase("selective_state_update", batch)
        argsets = [bench_serving.state_update_inputs(case, seed=i) for i in range(CALLS)]
        ref = argsets[0]["state"].clone()
        want = ssu.selective_state_update(**dict(argsets[0], state=ref.clone()))
        rows = [("package", graph_us([lambda a=a: ssu.selective_state_update(**a) for a in argsets]))]
        if peer is not None:
            rows.append(("mamba_ssm", graph_us([lambda a=a: peer(**a) for a in argsets])))
        for name, threshold in THRESHOLDS.items():
            ssu.DEPENDENT_LAUNCH_MAX_BLOCKS = threshold
            rows.append(variant_row(
                name, lambda: torch.equal(ssu.selective_state_update(**dict(argsets[0], state=ref.clone())), want),
                [lambda a=a: ssu.selective_state_update(**a) for a in argsets]))
        ssu.DEPENDENT_LAUNCH_MAX_BLOCKS = package_threshold
        print_rows(f"batch {batch}", rows, bench_serving.floor_bytes(case) / 1e6)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1, 8, 64, 256])
