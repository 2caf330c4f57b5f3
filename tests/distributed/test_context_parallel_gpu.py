"""Context parallelism on one GPU: two processes sharing cuda:0 over gloo (the summaries go
through host memory), cutile backend, bf16, against the single-GPU op on the whole sequence."""
import pytest

from cp_workers import gpu_cases, run_ranks

TOL = 2e-2  # ||difference|| / ||single-GPU||, as ours against mamba_ssm in the layer tests


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_match_the_single_gpu_op():
    for rank, per_case in enumerate(run_ranks(2, gpu_cases, timeout=400)):
        assert "crash" not in per_case, per_case["crash"]
        for case, diffs in per_case.items():
            assert "crash" not in diffs, f"rank {rank} {case}:\n{diffs['crash']}"
            for quantity, (_, _, finite, rel) in diffs.items():
                assert finite, f"rank {rank} {case}: {quantity} is not finite"
                assert rel < TOL, f"rank {rank} {case}: {quantity} differs by {rel:.3g} (relative norm)"
