"""The layer op ``mamba_chunk_scan_combined`` on CPU, as callers see it: mamba_ssm's return
convention, cu_seqlens and seq_idx, argument checks naming the argument at fault, and tilegym's
dispatch."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.core.packing import seq_idx_from_cu_seqlens
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.testing import relative_error as rel_err

from layer_op_checks import (HEADS, HEAD_SIZE, STATE, all_options, lengths_to_cu,  # tests/ssd/reference/
                             make_inputs, seq_idx_rows, unpack)


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
    opts = dict(all_options(inputs, gen), cu_seqlens=lengths_to_cu(lengths),
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

