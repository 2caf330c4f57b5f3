"""The layer op ``mamba_chunk_scan_combined`` on CPU: its float64 definition
(``layer_token_recurrence``), dt processing, and the "pytorch" backend against the definition for
every option and packing, sequences kept apart (test_layer_interface.py: the return convention,
argument checks and tilegym dispatch)."""
import math

import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.core.packing import seq_idx_from_cu_seqlens, sequence_runs
from tilegym_mamba2.ssd.dt import process_dt
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.ssd.reference.forward import token_recurrence
from tilegym_mamba2.testing import relative_error as rel_err

from layer_op_checks import (HEADS, HEAD_SIZE, STATE, TOL_BF16, all_options, lengths_to_cu,  # tests/ssd/reference/
                             make_inputs, option, random_lengths, run_and_compare, seq_idx_rows)


# --------------------------------------------------------------------------------------------
# The float64 definition


@pytest.mark.parametrize("batch,tokens,groups,with_init", [(1, 1, 1, False), (2, 37, 2, True), (1, 130, 4, True)])
def test_layer_token_recurrence_without_options_is_token_recurrence(batch, tokens, groups, with_init):
    inputs = make_inputs(batch, tokens, groups=groups, seed=tokens)
    d = torch.randn(HEADS)
    init = torch.randn(batch, HEADS, HEAD_SIZE, STATE) if with_init else None
    out, final, varlen = layer_token_recurrence(**inputs, D=d, initial_states=init)
    ref_out, ref_final = token_recurrence(inputs["x"], inputs["A"], inputs["B"], inputs["C"], d, inputs["dt"], init)
    assert out.dtype == final.dtype == torch.float64
    assert varlen is None
    assert rel_err(out, ref_out) < 1e-12
    assert rel_err(final, ref_final) < 1e-12
    # D=None is a zero skip.
    out0, _, _ = layer_token_recurrence(**inputs, initial_states=init)
    ref0, _ = token_recurrence(inputs["x"], inputs["A"], inputs["B"], inputs["C"], torch.zeros(HEADS), inputs["dt"],
                               init)
    assert rel_err(out0, ref0) < 1e-12


def test_layer_token_recurrence_splits_sequences():
    """Each sequence of a packed row equals that sequence run on its own."""
    lengths = [5, 17, 1, 30]
    cu = lengths_to_cu(lengths)
    inputs = make_inputs(1, sum(lengths), seed=3)
    inits = torch.randn(len(lengths), HEADS, HEAD_SIZE, STATE)
    out, final, varlen = layer_token_recurrence(**inputs, cu_seqlens=cu, initial_states=inits)
    assert varlen.shape == (len(lengths), HEADS, HEAD_SIZE, STATE)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {k: v[:, s:e] if k != "A" else v for k, v in inputs.items()}
        ref_out, ref_h = token_recurrence(part["x"], part["A"], part["B"], part["C"], torch.zeros(HEADS), part["dt"],
                                          inits[i:i + 1])
        assert rel_err(out[:, s:e], ref_out) < 1e-12
        assert rel_err(varlen[i], ref_h[0]) < 1e-12
    assert torch.equal(final[0], varlen[-1])


def test_seq_idx_helpers():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    seq_idx = seq_idx_from_cu_seqlens(cu, 9)
    assert seq_idx.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2, 2]]
    assert sequence_runs(seq_idx, 1, 9) == [[(0, 3, 0), (3, 4, 1), (4, 9, 2)]]
    assert sequence_runs(None, 2, 5) == [[(0, 5, 0)], [(0, 5, 0)]]
    two_rows = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 4]])
    assert sequence_runs(two_rows, 2, 5) == [[(0, 2, 0), (2, 5, 1)], [(0, 1, 0), (1, 4, 1), (4, 5, 4)]]


# --------------------------------------------------------------------------------------------
# dt processing, against hand-written values (float64 so the expectations are exact)


def _dt(values):
    return torch.tensor(values, dtype=torch.float64).reshape(1, 1, -1)


def test_process_dt_bias_and_default_limit():
    dt = _dt([0.5, 1.0, -0.2])
    bias = torch.tensor([0.1, -0.3, 0.1], dtype=torch.float64)
    got = process_dt(dt, dt_bias=bias, dtype=torch.float64)
    # The default limit (0, inf) clamps -0.1 to 0.
    assert torch.allclose(got, _dt([0.6, 0.7, 0.0]), rtol=0, atol=1e-15)
    unclamped = process_dt(dt, dt_bias=bias, dt_limit=(-math.inf, math.inf), dtype=torch.float64)
    assert torch.allclose(unclamped, _dt([0.6, 0.7, -0.1]), rtol=0, atol=1e-15)


def test_process_dt_default_limit_clamps_negatives_to_zero():
    got = process_dt(_dt([-0.5, -1e-6, 0.0, 0.7, 1e6]), dtype=torch.float64)
    assert got.tolist() == [[[0.0, 0.0, 0.0, 0.7, 1e6]]]


def test_process_dt_softplus_threshold_20():
    values = [-30.0, -1.0, 0.0, 1.0, 19.5, 20.0, 20.5, 50.0]
    got = process_dt(_dt(values), dt_softplus=True, dtype=torch.float64)[0, 0]
    for v, g in zip(values, got.tolist()):
        if v > 20:
            assert g == v, f"softplus({v}) must pass through above the threshold, got {g!r}"
        else:
            assert g == pytest.approx(math.log1p(math.exp(v)), rel=1e-14, abs=1e-300), v
    # softplus(20) is not exactly 20: the pass-through is strictly above 20, as in mamba_ssm.
    assert got[5].item() != 20.0


def test_process_dt_clamp_low_and_high():
    got = process_dt(_dt([0.01, 0.3, 2.0, -1.0]), dt_limit=(0.1, 1.0), dtype=torch.float64)
    assert got.tolist() == [[[0.1, 0.3, 1.0, 0.1]]]


def test_process_dt_bias_softplus_limit_together():
    dt = _dt([-2.0, 0.0, 3.0])
    bias = torch.tensor([1.0, 0.5, 25.0], dtype=torch.float64)
    got = process_dt(dt, dt_bias=bias, dt_softplus=True, dt_limit=(0.4, 10.0), dtype=torch.float64)[0, 0]
    expected = [max(0.4, math.log1p(math.exp(-1.0))), math.log1p(math.exp(0.5)), 10.0]
    assert got.tolist() == pytest.approx(expected, rel=1e-14)


def test_process_dt_dtype():
    dt = torch.tensor([[[0.25, 0.5]]], dtype=torch.bfloat16)
    assert process_dt(dt).dtype == torch.float32
    assert process_dt(dt, dtype=torch.float64).dtype == torch.float64


# --------------------------------------------------------------------------------------------
# The pytorch backend against the definition


SINGLE_OPTIONS = ["D_head", "D_channel", "z", "dt_bias", "dt_softplus", "dt_limit", "initial_states"]


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("name", SINGLE_OPTIONS)
def test_pytorch_backend_single_option(name, chunk_size):
    raw = name in ("dt_softplus", "dt_bias", "dt_limit")
    inputs = make_inputs(2, 150, raw_dt=raw, seed=SINGLE_OPTIONS.index(name))
    gen = torch.Generator().manual_seed(1)
    run_and_compare(inputs, chunk_size, **option(name, inputs, gen))


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_pytorch_backend_no_options(chunk_size):
    run_and_compare(make_inputs(2, 200, seed=7), chunk_size)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_pytorch_backend_return_final_states(chunk_size):
    inputs = make_inputs(2, 100, seed=8)
    gen = torch.Generator().manual_seed(2)
    run_and_compare(inputs, chunk_size, return_final_states=True)
    run_and_compare(inputs, chunk_size, return_final_states=True, **option("initial_states", inputs, gen))


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_pytorch_backend_seq_idx_batch2_with_row_initial_states(chunk_size):
    """Different boundaries per row; each row's initial state starts only its first sequence."""
    seq_idx = seq_idx_rows([30, 50, 1, 19], [64, 36])
    inputs = make_inputs(2, 100, seed=9)
    init = torch.randn(2, HEADS, HEAD_SIZE, STATE)
    (out, final, _), (ref_out, _, _) = run_and_compare(inputs, chunk_size, seq_idx=seq_idx, initial_states=init,
                                                       return_final_states=True)
    # The initial states matter for the first sequences and only for them.
    no_init = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=chunk_size, seq_idx=seq_idx,
                                                       backend="pytorch")
    assert rel_err(out[0, :30], no_init[0, :30]) > 1e-3 and rel_err(out[1, :64], no_init[1, :64]) > 1e-3
    assert torch.allclose(out[0, 30:], no_init[0, 30:]) and torch.allclose(out[1, 64:], no_init[1, 64:])
    # final_states is the state after each row's last sequence (which has no initial state).
    _, final_no_init = tilegym_mamba2.mamba_chunk_scan_combined(
        **inputs, chunk_size=chunk_size, seq_idx=seq_idx, return_final_states=True, backend="pytorch")
    assert torch.allclose(final, final_no_init)


def test_pytorch_backend_seq_idx_with_gaps_in_ids():
    """Sequence ids need only be sorted, not consecutive."""
    inputs = make_inputs(1, 40, seed=10)
    gapped = torch.tensor([[0] * 10 + [3] * 20 + [7] * 10], dtype=torch.int64)
    dense = seq_idx_rows([10, 20, 10])
    run_and_compare(inputs, 16, seq_idx=gapped)
    a = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=16, seq_idx=gapped, backend="pytorch")
    b = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=16, seq_idx=dense, backend="pytorch")
    assert torch.equal(a, b)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("num_seqs", [1, 2, 7, 64])
@pytest.mark.parametrize("per_sequence_init", [False, True])
def test_pytorch_backend_cu_seqlens(num_seqs, chunk_size, per_sequence_init):
    high = 40 if num_seqs == 64 else 150
    lengths = random_lengths(num_seqs, 1, high, seed=num_seqs * 100 + chunk_size)
    cu = lengths_to_cu(lengths)
    inputs = make_inputs(1, sum(lengths), seed=num_seqs)
    init = torch.randn(num_seqs if per_sequence_init else 1, HEADS, HEAD_SIZE, STATE)
    run_and_compare(inputs, chunk_size, cu_seqlens=cu)
    (_, final, varlen), _ = run_and_compare(inputs, chunk_size, cu_seqlens=cu, initial_states=init,
                                            return_final_states=True, return_varlen_states=True)
    assert varlen.shape == (num_seqs, HEADS, HEAD_SIZE, STATE)
    assert torch.equal(varlen[-1], final[0])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_pytorch_backend_return_varlen_states(chunk_size):
    lengths = [20, 1, 45, 34]
    inputs = make_inputs(1, sum(lengths), seed=11)
    run_and_compare(inputs, chunk_size, cu_seqlens=lengths_to_cu(lengths), return_varlen_states=True)


@pytest.mark.parametrize("cu", [[0, 64, 128], [0, 63, 128], [0, 65, 128], [0, 1, 128], [0, 127, 128],
                                [0, 1, 2, 64, 65, 127, 128], [0, 16, 32, 48, 64, 80, 96, 112, 128]])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_pytorch_backend_boundaries_at_chunk_edges(cu, chunk_size):
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    inputs = make_inputs(1, 128, seed=len(cu) + cu[1])
    gen = torch.Generator().manual_seed(5)
    inits = torch.randn(len(cu) - 1, HEADS, HEAD_SIZE, STATE, generator=gen)
    run_and_compare(inputs, chunk_size, cu_seqlens=cu_seqlens, initial_states=inits, D=torch.randn(HEADS),
                    return_final_states=True, return_varlen_states=True)


def test_pytorch_backend_single_token_sequence():
    for tokens in (1, 2):
        inputs = make_inputs(1, tokens, seed=tokens)
        cu = torch.arange(tokens + 1, dtype=torch.int32)
        init = torch.randn(tokens, HEADS, HEAD_SIZE, STATE)
        run_and_compare(inputs, 64, cu_seqlens=cu, initial_states=init, D=torch.randn(HEADS),
                        return_final_states=True, return_varlen_states=True)
    run_and_compare(make_inputs(2, 1, seed=3), 16, return_final_states=True)



@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_pytorch_backend_all_options_cu_seqlens(num_seqs, chunk_size):
    high = 40 if num_seqs == 64 else 90
    lengths = random_lengths(num_seqs, 1, high, seed=num_seqs + chunk_size)
    cu = lengths_to_cu(lengths)
    inputs = make_inputs(1, sum(lengths), raw_dt=True, seed=num_seqs + 1)
    gen = torch.Generator().manual_seed(6)
    opts = all_options(inputs, gen)
    init = torch.randn(num_seqs, HEADS, HEAD_SIZE, STATE, generator=gen)
    run_and_compare(inputs, chunk_size, cu_seqlens=cu, initial_states=init, return_final_states=True,
                    return_varlen_states=True, **opts)
    # With an explicit seq_idx too, and D per head.
    opts["D"] = torch.randn(HEADS, generator=gen)
    run_and_compare(inputs, chunk_size, cu_seqlens=cu, seq_idx=seq_idx_from_cu_seqlens(cu, sum(lengths)),
                    initial_states=init[:1], return_final_states=True, return_varlen_states=True, **opts)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_pytorch_backend_all_options_seq_idx_batch2(chunk_size):
    seq_idx = seq_idx_rows([10, 64, 1, 45], [63, 2, 55])
    inputs = make_inputs(2, 120, raw_dt=True, seed=12)
    gen = torch.Generator().manual_seed(7)
    run_and_compare(inputs, chunk_size, seq_idx=seq_idx, return_final_states=True,
                    **option("initial_states", inputs, gen), **all_options(inputs, gen))


def test_pytorch_backend_longer_sequence():
    inputs = make_inputs(1, 600, heads=2, head_size=4, state=4, groups=1, raw_dt=True, seed=13)
    gen = torch.Generator().manual_seed(8)
    run_and_compare(inputs, 64, return_final_states=True, **option("initial_states", inputs, gen),
                    **all_options(inputs, gen))


def test_pytorch_backend_bf16():
    lengths = [70, 1, 63, 66]
    cu = lengths_to_cu(lengths)
    inputs = make_inputs(1, sum(lengths), dtype=torch.bfloat16, raw_dt=True, seed=14)
    gen = torch.Generator().manual_seed(9)
    opts = all_options(inputs, gen)
    init = torch.randn(len(lengths), HEADS, HEAD_SIZE, STATE, generator=gen)
    (out, final, varlen), _ = run_and_compare(inputs, 64, tol=TOL_BF16, cu_seqlens=cu, initial_states=init,
                                              return_final_states=True, return_varlen_states=True, **opts)
    # mamba_ssm's dtypes: final states fp32, per-sequence states in C's dtype
    assert out.dtype == varlen.dtype == torch.bfloat16 and final.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# Sequences are independent


@pytest.mark.parametrize("cu", [[0, 40, 100], [0, 64, 128], [0, 63, 128], [0, 65, 128], [0, 1, 30]])
def test_no_state_crosses_a_boundary(cu):
    tokens = cu[-1]
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    first = slice(0, cu[1])
    inputs = make_inputs(1, tokens, raw_dt=True, seed=15)
    gen = torch.Generator().manual_seed(10)
    opts = dict(D=torch.randn(HEADS, generator=gen), dt_bias=torch.randn(HEADS, generator=gen) * 0.5,
                dt_softplus=True, initial_states=torch.randn(2, HEADS, HEAD_SIZE, STATE, generator=gen))
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["x"][:, first] = torch.randn(changed["x"][:, first].shape, generator=gen)
    changed["dt"][:, first] = torch.randn(changed["dt"][:, first].shape, generator=gen) + 2.0
    changed["B"][:, first] = torch.randn(changed["B"][:, first].shape, generator=gen)

    def run(inp):
        return tilegym_mamba2.mamba_chunk_scan_combined(**inp, chunk_size=16, cu_seqlens=cu_seqlens,
                                                        return_varlen_states=True, backend="pytorch", **opts)

    (out, varlen), (out2, varlen2) = run(inputs), run(changed)
    assert rel_err(out2[:, first], out[:, first]) > 1e-2 and rel_err(varlen2[0], varlen[0]) > 1e-2
    assert torch.allclose(out2[:, cu[1]:], out[:, cu[1]:], rtol=1e-6, atol=1e-7)
    assert torch.allclose(varlen2[1], varlen[1], rtol=1e-6, atol=1e-7)
    # The definition agrees.
    ref, ref2 = (layer_token_recurrence(**inp, cu_seqlens=cu_seqlens, **opts) for inp in (inputs, changed))
    assert torch.allclose(ref2[0][:, cu[1]:], ref[0][:, cu[1]:], rtol=1e-12, atol=1e-14)
    assert torch.allclose(ref2[2][1], ref[2][1], rtol=1e-12, atol=1e-14)


def test_no_state_crosses_a_seq_idx_boundary_in_other_rows():
    seq_idx = seq_idx_rows([30, 34], [10, 54])
    inputs = make_inputs(2, 64, seed=16)
    changed = {k: v.clone() for k, v in inputs.items()}
    changed["x"][0, :30] += 1.0
    changed["x"][1, :10] -= 1.0
    out, out2 = (tilegym_mamba2.mamba_chunk_scan_combined(**inp, chunk_size=16, seq_idx=seq_idx, backend="pytorch")
                 for inp in (inputs, changed))
    assert torch.allclose(out2[0, 30:], out[0, 30:], rtol=1e-6, atol=1e-7)
    assert torch.allclose(out2[1, 10:], out[1, 10:], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(out2[0, :30], out[0, :30]) and not torch.allclose(out2[1, :10], out[1, :10])


