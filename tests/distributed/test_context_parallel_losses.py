"""What a rank's training loss may use of a context-parallel op's outputs: 2, 3 and 4 gloo ranks
x {out only (return_final_states at its default), out + final states on the last rank, final
states only, out on some ranks only} x {unpacked, seq_idx, cu_seqlens, one-token slices, with
sequence boundaries inside slices and exactly at rank edges} x {scan, convolution, mixer}.

Every rank must finish, with every gradient equal to the single-process op's (float64, 1e-10;
replicated inputs summed over the ranks); where some rank's loss uses nothing of the op, every
rank raises one error naming that rank. Every case runs under a hard timeout (cp_workers.run_ranks)
that names the ranks still waiting, so a hang fails the test instead of stalling the suite."""
import functools
import itertools
import os

import pytest
import torch.distributed as dist

from cp_losses import LAYOUTS, LOSSES, OPS, applies, matrix, skipped_backward_without_a_next_call
from cp_workers import run_ranks

WORLDS = (2, 3, 4)
CELLS = [(op, lay, loss) for op, lay, loss in itertools.product(OPS, LAYOUTS, LOSSES) if applies(op, loss)]


@functools.cache
def results(world):
    return run_ranks(world, matrix, CELLS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op,lay,loss", [c for c in CELLS if c[2] != "out_some"])
def test_every_rank_finishes_with_the_single_process_gradients(world, op, lay, loss):
    per_rank = [r[f"{op}-{lay}-{loss}"] for r in results(world)]
    for rank, diffs in enumerate(per_rank):
        assert "crash" not in diffs, f"rank {rank}:\n{diffs['crash']}"
        assert not diffs["missing grads"], f"rank {rank}: no gradient for {diffs['missing grads']}"
        for quantity, value in diffs.items():
            if isinstance(value, tuple):
                err, scale, finite, _ = value
                assert finite, f"rank {rank}: {quantity} is not finite"
                assert err <= 1e-10 * max(1.0, scale), f"rank {rank}: {quantity} differs by {err:.3e}"
    for key in (k for k in per_rank[0] if k.endswith(" is None")):   # the README's all-reduce needs it alike
        assert len({diffs[key] for diffs in per_rank}) == 1, f"{key} differs between ranks"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op,lay", [(op, lay) for op, lay, loss in CELLS if loss == "out_some"])
def test_a_rank_whose_loss_uses_nothing_is_named_on_every_rank(world, op, lay):
    skipping = [r for r in range(world) if r % 2 == 1]
    named = f"rank {skipping[0]}" if len(skipping) == 1 else "ranks " + ", ".join(map(str, skipping))
    for rank, outcome in enumerate(r[f"{op}-{lay}-out_some"] for r in results(world)):
        assert "crash" not in outcome, f"rank {rank}:\n{outcome['crash']}"
        assert outcome["raised"] is not None, f"rank {rank} did not raise"
        kind, message = outcome["raised"]
        assert kind == "RuntimeError" and "out of step" in message, (rank, message)
        assert f"{named} did not run" in message and "uses none of the call's outputs" in message, (rank, message)
        assert outcome["usable"], f"rank {rank}: the group is unusable after the error"


def test_ranks_left_waiting_give_up_after_the_timeout_naming_the_call():
    """Rank 1 skips the backward and makes no further call: rank 0 raises after
    TILEGYM_MAMBA2_CP_TIMEOUT seconds instead of waiting forever."""
    per_rank = run_ranks(2, skipped_backward_without_a_next_call, env={"TILEGYM_MAMBA2_CP_TIMEOUT": "2"})
    assert per_rank[1]["skipped"] is None
    kind, message = per_rank[0]["skipped"]
    assert kind == "RuntimeError", message
    assert "rank 0 waited 2 s in the state chain's backward of call 1" in message
    assert "uses none of the call's outputs" in message and "a rank failed or exited" in message


def _one_rank_hangs(rank, world):
    def case():
        if rank == 1:
            dist.barrier()   # rank 0 never joins
        return rank
    return {"hangs": case}


def test_the_harness_names_the_ranks_still_waiting():
    with pytest.raises(AssertionError, match=r"ranks \[1\] still waiting \(\{1: 'hangs'\}\)"):
        run_ranks(2, _one_rank_hangs, case_timeout=3)


def _one_rank_dies(rank, world):
    def case():
        if rank == 1:
            os._exit(3)
        dist.barrier()   # would wait forever for rank 1
    return {"dies": case}


def test_the_harness_names_a_rank_that_died_at_once():
    with pytest.raises(AssertionError, match=r"rank 1 exited with code 3 while in "):
        run_ranks(2, _one_rank_dies, case_timeout=600)
