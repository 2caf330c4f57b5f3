"""The masked chunked algorithm the kernels run (chunked_layer_reference) against the
float64 token-by-token definition: sequence boundaries anywhere relative to chunk edges,
row and per-sequence initial states, D, z, varlen and final states."""
import pytest
import torch

from tilegym_mamba2.ssd.reference.layer import chunked_layer_reference, layer_token_recurrence
from tilegym_mamba2.testing import relative_error as rel_err

HEADS, HEAD_SIZE, GROUPS, STATE = 4, 8, 2, 16


def inputs(batch, tokens, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    return dict(x=randn(batch, tokens, HEADS, HEAD_SIZE), dt=torch.rand(batch, tokens, HEADS, generator=gen,
                                                                       dtype=torch.float64),
                A=-1 - 4 * torch.rand(HEADS, generator=gen, dtype=torch.float64),
                B=randn(batch, tokens, GROUPS, STATE), C=randn(batch, tokens, GROUPS, STATE),
                D=randn(HEADS, HEAD_SIZE), z=randn(batch, tokens, HEADS, HEAD_SIZE)), gen


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())


@pytest.mark.parametrize("lengths", [[130], [64, 64], [63, 65], [65, 63], [1, 30, 97, 5], [40] * 7, [1] * 9,
                                     [200, 1, 1, 70]])
@pytest.mark.parametrize("init", [None, "row", "per_sequence"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_packed_sequences_match_the_definition(lengths, init, chunk):
    data, gen = inputs(1, sum(lengths), seed=len(lengths) * chunk)
    shape = {"row": 1, "per_sequence": len(lengths)}.get(init)
    initial = None if shape is None else torch.randn(shape, HEADS, HEAD_SIZE, STATE, generator=gen,
                                                     dtype=torch.float64)
    ref = layer_token_recurrence(**data, initial_states=initial, cu_seqlens=cu(lengths))
    got = chunked_layer_reference(**data, initial_states=initial, cu_seqlens=cu(lengths), chunk_size=chunk)
    for name, g, r in zip(("out", "final_states", "varlen_states"), got, ref):
        assert g.shape == r.shape and rel_err(g, r) < 1e-12, name


def test_seq_idx_rows_with_row_initial_states():
    data, gen = inputs(2, 100, seed=1)
    seq_idx = torch.tensor([[0] * 30 + [1] * 70, [3] * 64 + [4] * 36])   # row 1 never uses its init
    initial = torch.randn(2, HEADS, HEAD_SIZE, STATE, generator=gen, dtype=torch.float64)
    ref = layer_token_recurrence(**data, initial_states=initial, seq_idx=seq_idx)
    got = chunked_layer_reference(**data, initial_states=initial, seq_idx=seq_idx, chunk_size=32)
    assert rel_err(got[0], ref[0]) < 1e-12 and rel_err(got[1], ref[1]) < 1e-12
    assert got[2] is None and ref[2] is None


def test_without_sequences_it_is_the_plain_chunked_forward():
    from tilegym_mamba2.ssd.reference.forward import chunked_forward_reference
    data, gen = inputs(2, 150, seed=2)
    d = torch.randn(HEADS, generator=gen, dtype=torch.float64)
    out, final, _ = chunked_layer_reference(data["x"], data["dt"], data["A"], data["B"], data["C"], d, chunk_size=64)
    ref_out, ref_final = chunked_forward_reference(data["x"], data["A"], data["B"], data["C"], d, data["dt"],
                                                   chunk_size=64)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(final, ref_final) < 1e-12
