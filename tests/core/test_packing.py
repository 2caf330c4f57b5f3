"""core/packing.py: packed sequences regrouped into buckets of rows, so that the pytorch scan and
the backward's per-sequence terms cost what the tokens cost, however many sequences share a row;
meta tensors with packing take shapes only."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.core.packing import SequenceBuckets, packed_sequences
from tilegym_mamba2.ssd.reference import scans as scan_module
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.testing import relative_error


def test_packed_sequences_read_from_seq_idx_and_cu_seqlens_agree():
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 3, 3, 3, 3, 3]])
    rows, starts, lengths, ids = packed_sequences(seq_idx, None, 2, 6)
    assert (rows, starts, lengths, ids) == ([0, 0, 0, 1, 1], [0, 2, 5, 0, 1], [2, 3, 1, 1, 5], [0, 1, 2, 0, 3])
    cu = torch.tensor([0, 2, 5, 6])
    assert packed_sequences(None, cu, 1, 6) == ([0, 0, 0], [0, 2, 5], [2, 3, 1], [0, 1, 2])


def test_buckets_gather_each_sequence_as_a_zero_padded_row_and_scatter_it_back():
    lengths = [1, 3, 4, 2, 7]
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    tokens = sum(lengths)
    buckets = SequenceBuckets([0] * 5, starts, lengths, tokens, "cpu")
    assert sorted(b[1].shape[1] for b in buckets.buckets) == [1, 2, 4, 8]   # powers of two, one each
    values = torch.arange(1.0, tokens + 1)[None, :, None]
    out = torch.zeros_like(values)
    for bucket in buckets.buckets:
        rows = buckets.gather(values, bucket)
        for member, row in zip(bucket[0].tolist(), rows):
            n = lengths[member]
            assert torch.equal(row[:n, 0], values[0, starts[member]:starts[member] + n, 0])
            assert (row[n:] == 0).all()
        buckets.scatter(out, bucket, rows)
    assert torch.equal(out, values)


@pytest.mark.parametrize("with_init", [False, True])
def test_many_one_token_sequences_take_one_bucket_not_a_pass_each(with_init, monkeypatch):
    """512 one-token sequences: the pytorch scan runs one bucket (it ran one pass per sequence),
    and each token's output is what its own one-token recurrence gives."""
    passes = []
    real = scan_module.decay_cumsum_reference
    monkeypatch.setattr(scan_module, "decay_cumsum_reference", lambda *a, **k: passes.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_size, state = 512, 2, 4, 8
    x = torch.randn(1, tokens, heads, head_size, generator=gen, dtype=torch.float64)
    dt = torch.rand(1, tokens, heads, generator=gen, dtype=torch.float64)
    A = -torch.rand(heads, generator=gen, dtype=torch.float64) - 0.5
    B, C = (torch.randn(1, tokens, 1, state, generator=gen, dtype=torch.float64) for _ in range(2))
    cu = torch.arange(tokens + 1, dtype=torch.int32)
    init = torch.randn(tokens, heads, head_size, state, generator=gen, dtype=torch.float64) if with_init else None
    y, varlen = tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, 64, initial_states=init, cu_seqlens=cu,
                                                        return_varlen_states=True, backend="pytorch")
    assert len(passes) == 1
    want_y, _, want_varlen = layer_token_recurrence(x, dt, A, B, C, initial_states=init, cu_seqlens=cu)
    assert relative_error(y, want_y) < 1e-12 and relative_error(varlen, want_varlen) < 1e-12


def test_the_backward_per_sequence_terms_take_a_pass_per_bucket(monkeypatch):
    """Gradients of 300 packed sequences with their own initial states: sequence_edge_terms reads
    the offsets once (it read them and looped once per sequence), and the gradients are float64's."""
    from tilegym_mamba2.ssd import backward
    reads = []
    real = backward.packed_sequences
    monkeypatch.setattr(backward, "packed_sequences", lambda *a, **k: reads.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(4)
    lengths = [1 + (7 * k) % 5 for k in range(300)]
    tokens, heads, head_size, state = sum(lengths), 2, 4, 4
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    x, dt, B, C = leaf(1, tokens, heads, head_size), leaf(1, tokens, heads), leaf(1, tokens, 1, state), leaf(
        1, tokens, 1, state)
    init = leaf(len(lengths), heads, head_size, state)
    A = -torch.rand(heads, generator=gen, dtype=torch.float64) - 0.5
    y, varlen = tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, 16, initial_states=init, cu_seqlens=cu,
                                                        dt_softplus=True, return_varlen_states=True,
                                                        backend="pytorch")
    (y.square().sum() + varlen.square().sum()).backward()
    assert len(reads) == 1
    ours = [t.grad.clone() for t in (x, dt, B, C, init)]
    for t in (x, dt, B, C, init):
        t.grad = None
    want_y, _, want_varlen = layer_token_recurrence(x, dt, A, B, C, initial_states=init, cu_seqlens=cu,
                                                 dt_softplus=True)
    (want_y.square().sum() + want_varlen.square().sum()).backward()
    for got, t in zip(ours, (x, dt, B, C, init)):
        assert relative_error(got, t.grad) < 1e-10


@pytest.mark.parametrize("packing", ["cu_seqlens", "seq_idx"])
def test_meta_tensors_with_packing_take_shapes_only(packing):
    meta = "meta"
    x, dt = torch.empty(1, 10, 4, 8, device=meta), torch.empty(1, 10, 4, device=meta)
    A, B = torch.empty(4, device=meta), torch.empty(1, 10, 1, 16, device=meta)
    kw = (dict(cu_seqlens=torch.tensor([0, 3, 10], dtype=torch.int32, device=meta), return_varlen_states=True)
          if packing == "cu_seqlens" else dict(seq_idx=torch.zeros(1, 10, dtype=torch.int32, device=meta)))
    out = tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, B, 16, return_final_states=True, **kw)
    y, final = out[0], out[1]
    assert y.device.type == "meta" and y.shape == x.shape and final.shape == (1, 4, 8, 16)
    if packing == "cu_seqlens":
        assert out[2].shape == (2, 4, 8, 16)
