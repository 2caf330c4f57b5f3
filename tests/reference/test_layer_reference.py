"""The layer op ``mamba_chunk_scan_combined`` on CPU: its float64 definition
(``layer_token_recurrence``), dt processing, the "pytorch" backend against the definition for
every option and packing, the mamba_ssm return convention, argument checks and tilegym dispatch."""
import math

import pytest
import torch
import torch.nn.functional as F

import tilegym_mamba2
from tilegym_mamba2.core.packing import seq_idx_from_cu_seqlens, sequence_runs
from tilegym_mamba2.reference.layer import layer_token_recurrence, process_dt
from tilegym_mamba2.reference.ssd import token_recurrence
from tilegym_mamba2.testing import relative_error as rel_err

HEADS, HEAD_SIZE, STATE, GROUPS = 4, 8, 16, 2
TOL_FP32 = 1e-5
TOL_BF16 = 1e-2
RETURN_FLAGS = ("return_final_states", "return_varlen_states")


def make_inputs(batch=1, tokens=100, heads=HEADS, head_size=HEAD_SIZE, state=STATE, groups=GROUPS,
                dtype=torch.float32, raw_dt=False, seed=0):
    """mamba_ssm's layouts. dt is positive unless raw_dt (then it straddles 0, as before a softplus)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    dt = randn(batch, tokens, heads) - 1.0 if raw_dt else F.softplus(randn(batch, tokens, heads) - 2.0)
    return dict(
        x=randn(batch, tokens, heads, head_size).to(dtype),
        dt=dt.to(dtype),
        A=-(0.5 + 4 * torch.rand(heads, generator=gen)),
        B=randn(batch, tokens, groups, state).to(dtype),
        C=randn(batch, tokens, groups, state).to(dtype),
    )


def option(name, inputs, gen):
    """A value for one option, sized for ``inputs``."""
    batch, tokens, heads, head_size = inputs["x"].shape
    state = inputs["B"].shape[-1]
    if name == "D_head":
        return {"D": torch.randn(heads, generator=gen)}
    if name == "D_channel":
        return {"D": torch.randn(heads, head_size, generator=gen)}
    if name == "z":
        return {"z": torch.randn(batch, tokens, heads, head_size, generator=gen).to(inputs["x"].dtype)}
    if name == "dt_bias":
        return {"dt_bias": torch.randn(heads, generator=gen) * 0.5}
    if name == "dt_softplus":
        return {"dt_softplus": True}
    if name == "dt_limit":
        return {"dt_limit": (0.05, 0.2)}
    if name == "initial_states":
        return {"initial_states": torch.randn(batch, heads, head_size, state, generator=gen)}
    raise KeyError(name)


def lengths_to_cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def random_lengths(num, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (num,), generator=gen).tolist()


def seq_idx_rows(*row_lengths):
    """Per batch row, the lengths of its sequences -> seq_idx [batch, tokens] int32 (ids from 0)."""
    rows = [torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
            for lens in row_lengths]
    return torch.stack(rows)


def unpack(result, return_final_states, return_varlen_states):
    """mamba_ssm's convention -> (out, final_states or None, varlen_states or None), checking the structure."""
    if not return_final_states and not return_varlen_states:
        assert isinstance(result, torch.Tensor)
        return result, None, None
    assert isinstance(result, tuple)
    assert len(result) == 1 + return_final_states + return_varlen_states
    out, *rest = result
    final = rest.pop(0) if return_final_states else None
    varlen = rest.pop(0) if return_varlen_states else None
    return out, final, varlen


def run_and_compare(inputs, chunk_size, tol=TOL_FP32, **options):
    """The public function on the pytorch backend against layer_token_recurrence; returns both."""
    flags = {k: options.pop(k, False) for k in RETURN_FLAGS}
    result = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=chunk_size, **options, **flags,
                                                      backend="pytorch")
    out, final, varlen = unpack(result, **flags)
    ref_out, ref_final, ref_varlen = layer_token_recurrence(**inputs, **options)
    assert out.shape == inputs["x"].shape and out.dtype == inputs["x"].dtype
    assert rel_err(out, ref_out) < tol, f"out: {rel_err(out, ref_out):.3g}"
    if flags["return_final_states"]:
        assert final.dtype == torch.float32 and final.shape == ref_final.shape
        assert rel_err(final, ref_final) < tol, f"final_states: {rel_err(final, ref_final):.3g}"
    if flags["return_varlen_states"]:
        assert varlen.dtype == inputs["C"].dtype and varlen.shape == ref_varlen.shape  # C's dtype, as mamba_ssm
        assert rel_err(varlen, ref_varlen) < tol, f"varlen_states: {rel_err(varlen, ref_varlen):.3g}"
    return (out, final, varlen), (ref_out, ref_final, ref_varlen)


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


def _all_options(inputs, gen):
    opts = {}
    for name in ("D_channel", "z", "dt_bias", "dt_softplus"):
        opts.update(option(name, inputs, gen))
    opts["dt_limit"] = (0.01, 0.8)
    return opts


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_pytorch_backend_all_options_cu_seqlens(num_seqs, chunk_size):
    high = 40 if num_seqs == 64 else 90
    lengths = random_lengths(num_seqs, 1, high, seed=num_seqs + chunk_size)
    cu = lengths_to_cu(lengths)
    inputs = make_inputs(1, sum(lengths), raw_dt=True, seed=num_seqs + 1)
    gen = torch.Generator().manual_seed(6)
    opts = _all_options(inputs, gen)
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
                    **option("initial_states", inputs, gen), **_all_options(inputs, gen))


def test_pytorch_backend_longer_sequence():
    inputs = make_inputs(1, 600, heads=2, head_size=4, state=4, groups=1, raw_dt=True, seed=13)
    gen = torch.Generator().manual_seed(8)
    run_and_compare(inputs, 64, return_final_states=True, **option("initial_states", inputs, gen),
                    **_all_options(inputs, gen))


def test_pytorch_backend_bf16():
    lengths = [70, 1, 63, 66]
    cu = lengths_to_cu(lengths)
    inputs = make_inputs(1, sum(lengths), dtype=torch.bfloat16, raw_dt=True, seed=14)
    gen = torch.Generator().manual_seed(9)
    opts = _all_options(inputs, gen)
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


# --------------------------------------------------------------------------------------------
# Return structure, as mamba_ssm's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("return_final_states", [False, True])
@pytest.mark.parametrize("return_varlen_states", [False, True])
def test_return_structure(return_final_states, return_varlen_states, dtype):
    lengths = [10, 30, 24]
    inputs = make_inputs(1, 64, dtype=dtype, seed=17)
    result = tilegym_mamba2.mamba_chunk_scan_combined(
        **inputs, chunk_size=16, cu_seqlens=lengths_to_cu(lengths), return_final_states=return_final_states,
        return_varlen_states=return_varlen_states, backend="pytorch")
    out, final, varlen = unpack(result, return_final_states, return_varlen_states)
    assert out.shape == (1, 64, HEADS, HEAD_SIZE) and out.dtype == dtype
    assert not torch.isnan(out).any()
    if return_final_states:
        assert final.shape == (1, HEADS, HEAD_SIZE, STATE) and final.dtype == torch.float32
    if return_varlen_states:
        assert varlen.shape == (3, HEADS, HEAD_SIZE, STATE) and varlen.dtype == dtype
    if return_final_states and return_varlen_states:
        assert torch.equal(varlen[-1], final[0].to(dtype))


def test_return_structure_default_is_a_tensor():
    inputs = make_inputs(2, 20, seed=18)
    out = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=16, backend="pytorch")
    assert type(out) is torch.Tensor and out.shape == inputs["x"].shape
    # The positional order is mamba_ssm's.
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    assert torch.equal(tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, 16, backend="pytorch"), out)
    # backend=None picks the op's preferred backend, which on CPU must give the same thing.
    assert torch.allclose(tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, 16), out)


# --------------------------------------------------------------------------------------------
# cu_seqlens defines seq_idx


@pytest.mark.parametrize("lengths", [[100], [1, 99], [16, 16, 68], [33, 7, 1, 59]])
def test_seq_idx_from_cu_seqlens_matches_explicit_seq_idx(lengths):
    cu = lengths_to_cu(lengths)
    tokens = sum(lengths)
    inputs = make_inputs(1, tokens, seed=19)
    init = torch.randn(1, HEADS, HEAD_SIZE, STATE)
    explicit = seq_idx_rows(lengths)
    assert torch.equal(seq_idx_from_cu_seqlens(cu, tokens).long(), explicit.long())

    def run(**kw):
        return tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=16, initial_states=init,
                                                        return_final_states=True, backend="pytorch", **kw)

    by_cu, by_idx = run(cu_seqlens=cu), run(seq_idx=explicit)
    both = run(cu_seqlens=cu, seq_idx=explicit, return_varlen_states=True)
    for a, b, c in zip(by_cu, by_idx, both):
        assert torch.equal(a, b) and torch.equal(a, c)
    ref = layer_token_recurrence(**inputs, initial_states=init, seq_idx=explicit)
    ref_cu = layer_token_recurrence(**inputs, initial_states=init, cu_seqlens=cu)
    assert torch.equal(ref[0], ref_cu[0]) and torch.equal(ref[1], ref_cu[1])


# --------------------------------------------------------------------------------------------
# Argument checks


def _base():
    """Valid arguments: batch 1, 32 tokens, 4 heads, head_size 8, state 16, 2 groups."""
    inputs = make_inputs(1, 32, seed=20)
    return dict(inputs, chunk_size=16)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


BAD_ARGUMENTS = [
    # id, changes to _base(), exception types, name the message must contain
    ("cu_seqlens_batch2", lambda a: a.update(make_inputs(2, 32), cu_seqlens=_i32([0, 16, 32])), ValueError,
     "cu_seqlens"),
    ("cu_seqlens_not_from_0", lambda a: a.update(cu_seqlens=_i32([1, 16, 32])), ValueError, "cu_seqlens"),
    ("cu_seqlens_not_to_tokens", lambda a: a.update(cu_seqlens=_i32([0, 16, 31])), ValueError, "cu_seqlens"),
    ("cu_seqlens_past_tokens", lambda a: a.update(cu_seqlens=_i32([0, 16, 33])), ValueError, "cu_seqlens"),
    ("cu_seqlens_repeat", lambda a: a.update(cu_seqlens=_i32([0, 16, 16, 32])), ValueError, "cu_seqlens"),
    ("cu_seqlens_decrease", lambda a: a.update(cu_seqlens=_i32([0, 20, 16, 32])), ValueError, "cu_seqlens"),
    ("cu_seqlens_float", lambda a: a.update(cu_seqlens=torch.tensor([0.0, 16.0, 32.0])), (ValueError, TypeError),
     "cu_seqlens"),
    ("cu_seqlens_2d", lambda a: a.update(cu_seqlens=_i32([[0, 16, 32]])), ValueError, "cu_seqlens"),
    ("cu_seqlens_one_entry", lambda a: a.update(cu_seqlens=_i32([0])), ValueError, "cu_seqlens"),
    ("cu_seqlens_list", lambda a: a.update(cu_seqlens=[0, 16, 32]), TypeError, "cu_seqlens"),
    ("seq_idx_unsorted", lambda a: a.update(seq_idx=_i32([[0] * 16 + [1] * 8 + [0] * 8])), ValueError, "seq_idx"),
    ("seq_idx_short", lambda a: a.update(seq_idx=_i32([[0] * 31])), ValueError, "seq_idx"),
    ("seq_idx_1d", lambda a: a.update(seq_idx=_i32([0] * 32)), ValueError, "seq_idx"),
    ("seq_idx_batch", lambda a: a.update(seq_idx=_i32([[0] * 32] * 2)), ValueError, "seq_idx"),
    ("seq_idx_float", lambda a: a.update(seq_idx=torch.zeros(1, 32)), TypeError, "seq_idx"),
    ("D_heads_plus_1", lambda a: a.update(D=torch.randn(HEADS + 1)), ValueError, "D"),
    ("D_head_size", lambda a: a.update(D=torch.randn(HEAD_SIZE)), ValueError, "D"),
    ("D_head_size_plus_1", lambda a: a.update(D=torch.randn(HEADS, HEAD_SIZE + 1)), ValueError, "D"),
    ("D_3d", lambda a: a.update(D=torch.randn(1, HEADS, HEAD_SIZE)), ValueError, "D"),
    ("D_int", lambda a: a.update(D=torch.ones(HEADS, dtype=torch.int64)), TypeError, "D"),
    ("z_shape", lambda a: a.update(z=torch.randn(1, 32, HEADS, HEAD_SIZE - 1)), ValueError, "z"),
    ("z_tokens", lambda a: a.update(z=torch.randn(1, 31, HEADS, HEAD_SIZE)), ValueError, "z"),
    ("dt_bias_shape", lambda a: a.update(dt_bias=torch.randn(HEADS + 1)), ValueError, "dt_bias"),
    ("dt_bias_2d", lambda a: a.update(dt_bias=torch.randn(1, HEADS)), ValueError, "dt_bias"),
    ("dt_limit_low_gt_high", lambda a: a.update(dt_limit=(1.0, 0.5)), ValueError, "dt_limit"),
    ("dt_limit_single", lambda a: a.update(dt_limit=(0.1,)), TypeError, "dt_limit"),
    ("dt_limit_triple", lambda a: a.update(dt_limit=(0.0, 1.0, 2.0)), TypeError, "dt_limit"),
    ("dt_limit_number", lambda a: a.update(dt_limit=0.5), TypeError, "dt_limit"),
    ("dt_limit_strings", lambda a: a.update(dt_limit=("0", "1")), TypeError, "dt_limit"),
    ("varlen_without_cu_seqlens", lambda a: a.update(return_varlen_states=True), ValueError,
     "return_varlen_states"),
    ("initial_states_shape", lambda a: a.update(initial_states=torch.randn(1, HEADS, HEAD_SIZE, STATE + 1)),
     ValueError, "initial_states"),
    ("initial_states_3d", lambda a: a.update(initial_states=torch.randn(HEADS, HEAD_SIZE, STATE)),
     ValueError, "initial_states"),
    ("initial_states_per_seq_without_cu", lambda a: a.update(initial_states=torch.randn(3, HEADS, HEAD_SIZE, STATE)),
     ValueError, "initial_states"),
    ("initial_states_per_seq_wrong_count",
     lambda a: a.update(cu_seqlens=_i32([0, 10, 20, 32]), initial_states=torch.randn(4, HEADS, HEAD_SIZE, STATE)),
     ValueError, "initial_states"),
    ("initial_states_per_seq_with_seq_idx_only",
     lambda a: a.update(seq_idx=_i32([[0] * 10 + [1] * 10 + [2] * 12]),
                        initial_states=torch.randn(3, HEADS, HEAD_SIZE, STATE)),
     ValueError, "initial_states"),
    ("dt_softplus_int", lambda a: a.update(dt_softplus=1), TypeError, "dt_softplus"),
    ("dt_softplus_str", lambda a: a.update(dt_softplus="yes"), TypeError, "dt_softplus"),
    ("return_final_states_int", lambda a: a.update(return_final_states=1), TypeError, "return_final_states"),
    ("chunk_size_48", lambda a: a.update(chunk_size=48), ValueError, "chunk_size"),
    ("chunk_size_8", lambda a: a.update(chunk_size=8), ValueError, "chunk_size"),
    ("chunk_size_512", lambda a: a.update(chunk_size=512), ValueError, "chunk_size"),
    ("chunk_size_float", lambda a: a.update(chunk_size=64.0), ValueError, "chunk_size"),
    ("chunk_size_bool", lambda a: a.update(chunk_size=True), ValueError, "chunk_size"),
    ("A_shape", lambda a: a.update(A=torch.randn(HEADS + 1)), ValueError, "A"),
    ("dt_shape", lambda a: a.update(dt=torch.rand(1, 32, HEADS + 1)), ValueError, "dt"),
    ("B_dtype", lambda a: a.update(B=a["B"].double()), TypeError, "B"),
]


@pytest.mark.parametrize("change,exc,name", [c[1:] for c in BAD_ARGUMENTS], ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_raise_naming_the_argument(change, exc, name):
    args = _base()
    change(args)
    with pytest.raises(exc) as info:
        tilegym_mamba2.mamba_chunk_scan_combined(**args, backend="pytorch")
    assert name in str(info.value), str(info.value)
    # The default backend checks the same way.
    with pytest.raises(exc):
        tilegym_mamba2.mamba_chunk_scan_combined(**args)


def test_valid_base_arguments_run():
    """The baseline of BAD_ARGUMENTS is itself valid, so each failure there is the one change."""
    args = _base()
    out = tilegym_mamba2.mamba_chunk_scan_combined(**args, D=torch.randn(HEADS, HEAD_SIZE),
                                                   cu_seqlens=_i32([0, 10, 20, 32]),
                                                   initial_states=torch.randn(3, HEADS, HEAD_SIZE, STATE),
                                                   dt_limit=[0.0, 1.0], return_varlen_states=True,
                                                   backend="pytorch")
    assert len(out) == 2 and not torch.isnan(out[0]).any()


@pytest.mark.parametrize("backend", ["cutile", "triton", "nonsense"])
def test_unknown_backend_on_cpu_raises_naming_it(backend):
    args = _base()
    with pytest.raises(ValueError) as info:
        tilegym_mamba2.mamba_chunk_scan_combined(**args, backend=backend)
    assert backend in str(info.value) and "backend" in str(info.value)


# --------------------------------------------------------------------------------------------
# tilegym dispatch


def test_tilegym_dispatch():
    tilegym = pytest.importorskip("tilegym")
    import tilegym.ops

    assert hasattr(tilegym.ops, "mamba2_chunk_scan_combined")
    op = tilegym.ops.mamba2_chunk_scan_combined
    lengths = [12, 1, 51]
    inputs = make_inputs(1, sum(lengths), raw_dt=True, seed=21)
    gen = torch.Generator().manual_seed(11)
    opts = dict(_all_options(inputs, gen), cu_seqlens=lengths_to_cu(lengths),
                initial_states=torch.randn(3, HEADS, HEAD_SIZE, STATE, generator=gen),
                return_final_states=True, return_varlen_states=True)
    via_tilegym = op(**inputs, chunk_size=16, **opts, backend="pytorch")
    direct = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=16, **opts, backend="pytorch")
    assert isinstance(via_tilegym, tuple) and len(via_tilegym) == 3
    for a, b in zip(via_tilegym, direct):
        assert torch.equal(a, b)
    # Positional arguments too, plain return.
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    assert torch.equal(op(x, dt, A, B, C, 16, backend="pytorch"),
                       tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, 16, backend="pytorch"))


def test_row_initial_state_applies_to_sequence_id_zero_only():
    """mamba_ssm's rule: a row's initial state starts the tokens whose seq_idx is 0; a row
    whose ids start elsewhere starts from zeros."""
    inputs = make_inputs(2, 40, dtype=torch.float32, seed=23)
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(2, HEADS, HEAD_SIZE, STATE, generator=gen)
    seq_idx = torch.tensor([[0] * 20 + [1] * 20, [3] * 25 + [4] * 15])
    out, final = tilegym_mamba2.mamba_chunk_scan_combined(
        **inputs, chunk_size=16, seq_idx=seq_idx, initial_states=init, return_final_states=True,
        backend="pytorch")
    zero_init = init.clone()
    zero_init[1] = 0
    out2, _ = tilegym_mamba2.mamba_chunk_scan_combined(
        **inputs, chunk_size=16, seq_idx=seq_idx, initial_states=zero_init, return_final_states=True,
        backend="pytorch")
    assert torch.equal(out[1], out2[1])           # row 1's init is never used
    assert not torch.allclose(out[0, :20], out2[0, :20] * 0)   # row 0's is used
    ref_out, _, _ = layer_token_recurrence(**inputs, seq_idx=seq_idx, initial_states=init)
    assert rel_err(out, ref_out) < 1e-5


def test_seq_idx_disagreeing_with_cu_seqlens_is_an_error():
    inputs = make_inputs(1, 32, dtype=torch.float32, seed=3)
    cu = torch.tensor([0, 10, 20, 32], dtype=torch.int32)
    seq_idx = torch.tensor([[0] * 10 + [1] * 22])
    with pytest.raises(ValueError, match="seq_idx"):
        tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=16, cu_seqlens=cu, seq_idx=seq_idx,
                                                 backend="pytorch")
