"""Context parallelism on one GPU: two processes sharing cuda:0 over gloo (the summaries go
through host memory), cutile backend, bf16, against the single-GPU op on the whole sequence."""
import pytest

from cp_losses import gpu_cells
from cp_workers import assert_no_rank_crashed, gpu_cases, run_ranks

TOL = 2e-2  # ||difference|| / ||single-GPU||, as ours against mamba_ssm in the layer tests


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_match_the_single_gpu_op():
    per_rank = run_ranks(2, gpu_cases, case_timeout=400)
    for case in per_rank[0]:
        assert_no_rank_crashed(per_rank, case)
    for rank, per_case in enumerate(per_rank):
        for case, diffs in per_case.items():
            for quantity, (_, _, finite, rel) in diffs.items():
                assert finite, f"rank {rank} {case}: {quantity} is not finite"
                assert rel < TOL, f"rank {rank} {case}: {quantity} differs by {rel:.3g} (relative norm)"


@pytest.mark.gpu
def test_three_ranks_packed_with_a_loss_on_out_alone_match_the_single_gpu_op():
    """3 processes on cuda:0, a one-token slice, sequences starting exactly at rank edges, the
    loss on out alone (return_final_states at its default): every rank finishes, and its out and
    every gradient match the single-GPU op on the whole sequence."""
    per_rank = run_ranks(3, gpu_cells, case_timeout=400)
    for op in per_rank[0]:
        assert_no_rank_crashed(per_rank, op)
    for rank, per_op in enumerate(per_rank):
        for op, diffs in per_op.items():
            assert not diffs["missing grads"], f"rank {rank} {op}: no gradient for {diffs['missing grads']}"
            figures = {q: v[3] for q, v in diffs.items() if isinstance(v, tuple)}
            print(f"rank {rank} {op}: " + ", ".join(f"{q} {rel:.2e}" for q, rel in figures.items()))
            for quantity, (_, _, finite, rel) in ((q, v) for q, v in diffs.items() if isinstance(v, tuple)):
                assert finite, f"rank {rank} {op}: {quantity} is not finite"
                assert rel < TOL, f"rank {rank} {op}: {quantity} differs by {rel:.3g} (relative norm)"
