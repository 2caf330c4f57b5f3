"""The decode step (selective_state_update) in CUDA-graph replay, with and without programmatic
dependent launch (GPU).

    python benchmarks/decode_graph.py [BATCH ...]      # default: 1 8 64 256

A step takes a few microseconds, much of it launch latency. The package launches the step as a
programmatic dependent (its blocks may be scheduled while the kernel ahead of it drains; each
waits for that kernel before its first load) for grids of up to
selective_state_update.DEPENDENT_LAUNCH_MAX_BLOCKS blocks. For each batch size (the 2.7B mixer's
decode step, as `bench --serving` builds it) this replays a CUDA graph of 8 consecutive steps,
each on its own inputs, and prints the GPU us per step, fastest first, with the bandwidth that the
step's least traffic (the fp32 state read and written) implies:
  package              the package as it is
  mamba_ssm            mamba_ssm's Triton selective_state_update, when it imports
  flag at every size   dependent launch for every grid
  no flag              dependent launch never
The last two are checked to the bit against the package's result (DIFFERS where not).
"""
import sys

import torch

from tilegym_mamba2.bench.serving_ops import ServingCase, floor_bytes, state_update_inputs
from tilegym_mamba2.serving import selective_state_update as ssu
from timing import checked_row, graph_us, print_rows  # benchmarks/timing.py

CALLS = 8
THRESHOLDS = {"flag at every size": 1 << 62, "no flag": 0}


def main(batches):
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as peer
    except Exception as e:  # noqa: BLE001
        peer = None
        print(f"mamba_ssm not importable: {type(e).__name__}")
    package_threshold = ssu.DEPENDENT_LAUNCH_MAX_BLOCKS
    for batch in batches:
        case = ServingCase("selective_state_update", batch)
        argsets = [state_update_inputs(case, seed=i) for i in range(CALLS)]
        ref = argsets[0]["state"].clone()
        want = ssu.selective_state_update(**dict(argsets[0], state=ref.clone()))
        rows = [("package", graph_us([lambda a=a: ssu.selective_state_update(**a) for a in argsets]))]
        if peer is not None:
            rows.append(("mamba_ssm", graph_us([lambda a=a: peer(**a) for a in argsets])))
        try:
            for name, threshold in THRESHOLDS.items():
                ssu.DEPENDENT_LAUNCH_MAX_BLOCKS = threshold
                rows.append(checked_row(
                    name, lambda: torch.equal(ssu.selective_state_update(**dict(argsets[0], state=ref.clone())), want),
                    [lambda a=a: ssu.selective_state_update(**a) for a in argsets]))
        finally:
            ssu.DEPENDENT_LAUNCH_MAX_BLOCKS = package_threshold
        print_rows(f"batch {batch}", rows, floor_bytes(case) / 1e6)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1, 8, 64, 256])
