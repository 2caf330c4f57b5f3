"""Context parallelism on CPU: 2, 3 and 4 spawned ranks over gloo, float64, the pytorch backend.
Outputs, final states and every gradient of the context-parallel ops equal the single-process
ops on the whole sequence to 1e-10 (cp_workers.py builds the cases)."""
import functools

import pytest

from cp_workers import all_cases, assert_no_rank_crashed, mixer_cases, run_ranks, scan_cases

WORLDS = (2, 3, 4)
CASES = [(w, f"scan-{n}") for w in WORLDS for n in scan_cases(w)] + \
        [(w, f"mixer-{n}") for w in WORLDS for n in mixer_cases(w)]


@functools.cache
def results(world):
    """Every case on ``world`` ranks, run once per world size."""
    return run_ranks(world, all_cases)


@pytest.mark.parametrize("world,case", CASES)
def test_context_parallel_equals_the_single_process_op(world, case):
    assert_no_rank_crashed(results(world), case)
    for rank, per_case in enumerate(results(world)):
        diffs = per_case[case]
        for quantity, (err, scale, finite, _) in diffs.items():
            assert finite, f"rank {rank}: {quantity} is not finite"
            assert err <= 1e-10 * max(1.0, scale), f"rank {rank}: {quantity} differs by {err:.3e} (scale {scale:.2e})"
