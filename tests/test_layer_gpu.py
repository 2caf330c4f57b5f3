"""``tilegym_mamba2.mamba_chunk_scan_combined`` (default backend) against mamba_ssm's own
``mamba_chunk_scan_combined`` and against the float64 chunked reference (exact against the definition
``layer_token_recurrence``, tests/test_layer_chunked.py; far faster on 100k+ packed tokens), on a GPU
in bf16. Skipped without CUDA (tests/conftest.py) or without mamba_ssm.

Two known mamba_ssm behaviours shape the comparisons:
* mamba_ssm separates sequences only through seq_idx (cu_seqlens serves just the varlen states), so it
  always gets both; ours gets only cu_seqlens in the "ours_cu_only" cases.
* mamba_ssm's varlen state of the first sequence leaves out initial_states when that sequence ends
  inside the first chunk (chunk_state_varlen adds the entering chunk state only from the second chunk
  on); that one state is compared with the definition only.
mamba_ssm has no per-sequence initial_states, so such cases are checked against the definition only.
"""
import pytest
import torch

import tilegym_mamba2
from layer_cases import CASES, DTYPE, HEAD_SIZE, HEADS, STATE, TOL_MAMBA, Case, assert_close_to_reference, build, \
    reference, rel_err, unpack


try:
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as mamba_ssm_scan
    _IMPORT_ERROR = None
except Exception as error:  # ImportError, or a CUDA extension that fails to load
    mamba_ssm_scan = None
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(mamba_ssm_scan is None,
                       reason=f"mamba_ssm.ops.triton.ssd_combined cannot be imported ({_IMPORT_ERROR})"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_against_mamba_ssm_and_float64(case):
    inputs, ours_kw, theirs_kw, ref_kw, rows = build(case)
    batch, tokens = inputs["x"].shape[:2]
    where = f"case {case.id} (seed {case.seed}, rows {[len(r) for r in rows]} sequences, {tokens} tokens)"

    ours = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=case.chunk, **ours_kw)
    out, final, varlen = unpack(ours, case.final, case.varlen)
    ref_out, ref_final, ref_varlen = reference(inputs, ref_kw, case.chunk)

    # Structure and dtypes.
    assert out.shape == inputs["x"].shape and out.dtype == DTYPE, where
    if case.final:
        assert final.shape == (batch, HEADS, HEAD_SIZE, STATE) and final.dtype == torch.float32, where
    if case.varlen:
        assert varlen.shape == (sum(len(r) for r in rows), HEADS, HEAD_SIZE, STATE), where
        assert varlen.dtype == inputs["C"].dtype, where   # C's dtype, as mamba_ssm
    if case.final and case.varlen:
        assert torch.equal(varlen[-1], final[0].to(varlen.dtype)), where

    # Ours against the float64 reference, overall and sequence by sequence.
    assert_close_to_reference(where, rows, (out, final, varlen), (ref_out, ref_final, ref_varlen))

    if theirs_kw is None:
        return  # per-sequence initial states: mamba_ssm has no such option
    theirs = mamba_ssm_scan(**inputs, chunk_size=case.chunk, **theirs_kw)
    assert type(theirs) is type(ours), where
    if isinstance(theirs, tuple):
        assert len(theirs) == len(ours), where
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape, where
    t_out, t_final, t_varlen = unpack(theirs, case.final, case.varlen)
    assert t_out.dtype == out.dtype, where
    # The definition is mamba_ssm's semantics ...
    assert rel_err(t_out, ref_out) < TOL_MAMBA, f"{where}: mamba_ssm out vs float64 {rel_err(t_out, ref_out):.3g}"
    # ... and ours is mamba_ssm's answer.
    assert rel_err(out, t_out) < TOL_MAMBA, f"{where}: out vs mamba_ssm {rel_err(out, t_out):.3g}"
    if case.final:
        assert t_final.dtype == final.dtype, where
        assert rel_err(final, t_final) < TOL_MAMBA, f"{where}: final_states vs mamba_ssm {rel_err(final, t_final):.3g}"
    if case.varlen:
        # Both keep varlen states in C's dtype.
        first = 1 if "initial_states" in theirs_kw and rows[0][0] <= case.chunk else 0
        if first < varlen.shape[0]:
            err = rel_err(varlen[first:], t_varlen[first:].float())
            assert err < TOL_MAMBA, f"{where}: varlen_states vs mamba_ssm {err:.3g}"


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_return_structure_like_mamba_ssm(final, varlen):
    case = Case("structure", [[100, 200, 212]], 64, ("D_head", "z"), init="row", final=final, varlen=varlen,
                pack="cu")
    inputs, ours_kw, theirs_kw, _, _ = build(case)
    ours = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=64, **ours_kw)
    theirs = mamba_ssm_scan(**inputs, chunk_size=64, **theirs_kw)
    assert type(ours) is type(theirs)
    if isinstance(ours, tuple):
        assert len(ours) == len(theirs)
        assert [t.shape for t in ours] == [t.shape for t in theirs]
        assert ours[0].dtype == theirs[0].dtype == DTYPE
        assert [t.dtype for t in ours] == [t.dtype for t in theirs]
    else:
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == DTYPE
