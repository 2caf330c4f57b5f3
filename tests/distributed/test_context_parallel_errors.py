"""Bad input to the context-parallel ops: every rank raises a clear error naming the argument,
none is left waiting in a collective (a good call afterwards works), and nothing hangs."""
import functools

import pytest
import torch
import torch.distributed as dist

from cp_workers import bad_cases, run_ranks

EXPECTED = {  # call -> (exception type, words every rank's message contains)
    "heads_differ": ("ValueError", ["x's [batch, heads, head_size]", "rank 0 has", "rank 1 has"]),
    "option_differs": ("ValueError", ["dt_softplus", "every rank"]),
    "one_rank_invalid": ("ValueError", ["dt must be"]),
    "cu_seqlens_short": ("ValueError", ["cu_seqlens must end at the global number of tokens"]),
    "seq_idx_unsorted": ("ValueError", ["seq_idx must be sorted along the global sequence"]),
    "conv_width_differs": ("ValueError", ["weight's shape"]),
    "mixer_weight_wrong": ("ValueError", ["conv1d_weight"]),
    "A_values_differ": ("ValueError", ["A's values (checksum) must be the same on every rank"]),
}


@functools.cache
def outcomes(world):
    return run_ranks(world, bad_cases)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("call", sorted(EXPECTED))
def test_every_rank_raises_naming_the_argument(world, call):
    kind, words = EXPECTED[call]
    for rank, per_call in enumerate(outcomes(world)):
        assert "crash" not in per_call[call], per_call[call]["crash"]
        raised, still_works = per_call[call]
        assert raised is not None, f"rank {rank} did not raise"
        assert raised[0] == kind, (rank, raised)
        for word in words:
            assert word in raised[1], (rank, raised[1])
        assert still_works, f"rank {rank}: the group is unusable after the error"


def test_the_failing_rank_is_named_on_the_others():
    per_rank = outcomes(2)
    assert per_rank[1]["one_rank_invalid"][0][1].startswith("dt must be")
    assert "the arguments of rank 1 are invalid: dt must be" in per_rank[0]["one_rank_invalid"][0][1]


def test_without_an_initialized_group_it_says_so():
    from tilegym_mamba2.distributed import context_parallel_scan_combined
    x = torch.zeros(1, 4, 2, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_scan_combined(x, x[..., 0], torch.zeros(2), x[:, :, :1], x[:, :, :1], 16)


def test_a_group_without_a_cpu_transport_is_named(monkeypatch):
    from tilegym_mamba2.distributed.agreement import check_group_device
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="group: its backend 'nccl' cannot communicate CPU tensors"):
        check_group_device(None, torch.device("cpu"))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    check_group_device(None, torch.device("cpu"))
