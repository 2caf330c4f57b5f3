"""``tilegym_mamba2.mamba_chunk_scan_combined`` (default backend) against mamba_ssm's own
``mamba_chunk_scan_combined`` and against the float64 definition ``layer_token_recurrence``, on a GPU
in bf16. Skipped without CUDA (tests/conftest.py) or without mamba_ssm.

Two known mamba_ssm behaviours shape the comparisons:
* mamba_ssm separates sequences only through seq_idx (cu_seqlens serves just the varlen states), so it
  always gets both; ours gets only cu_seqlens in the "ours_cu_only" cases.
* mamba_ssm's varlen state of the first sequence leaves out initial_states when that sequence ends
  inside the first chunk (chunk_state_varlen adds the entering chunk state only from the second chunk
  on); that one state is compared with the definition only.
mamba_ssm has no per-sequence initial_states, so such cases are checked against the definition only.
"""
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import tilegym_mamba2
from tilegym_mamba2.layer_reference import layer_token_recurrence

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

HEADS, HEAD_SIZE, STATE, GROUPS = 8, 64, 128, 2
DTYPE = torch.bfloat16
DEVICE = "cuda"
TOL_OURS = 1e-2        # ours against float64, ‖out − ref‖ / ‖ref‖
TOL_PER_SEQUENCE = 2e-2
TOL_MAMBA = 2e-2       # mamba_ssm against float64, and ours against mamba_ssm


@dataclass
class Case:
    id: str
    rows: list                      # per batch row, its sequence lengths; a number n = n random lengths
    chunk: int
    options: tuple = ()             # D_head D_channel z dt_bias dt_softplus dt_limit
    init: str | None = None         # None, "row" ([batch, ...]) or "seq" ([num_sequences, ...], cu_seqlens)
    final: bool = False             # return_final_states
    varlen: bool = False            # return_varlen_states (cu_seqlens)
    pack: str = "none"              # "none", "seq_idx" (any batch), "cu" (batch 1: both to both),
                                    # "cu_only_ours" (batch 1: cu_seqlens alone to ours)
    seed: int = 0
    max_len: int = 5000
    lengths: list = field(default_factory=list)


ALL = ("D_channel", "z", "dt_bias", "dt_softplus", "dt_limit")

CASES = [
    Case("plain", [[3000]], 256),
    Case("D_head", [[2500]], 128, ("D_head",)),
    Case("D_channel_batch2", [[1500], [1500]], 256, ("D_channel",)),
    Case("z", [[2048]], 256, ("z",)),
    Case("dt_bias", [[2000]], 128, ("dt_bias",)),
    Case("dt_softplus", [[2000]], 256, ("dt_softplus",)),
    Case("dt_limit", [[2000]], 64, ("dt_limit",)),
    Case("initial_states_final_batch2", [[1000], [1000]], 128, init="row", final=True),
    Case("seq_idx_batch2_row_init", [[700, 1, 1299], [256, 1744]], 256, init="row", final=True, pack="seq_idx"),
    Case("cu_2_ours_cu_only_varlen", [2], 256, varlen=True, pack="cu_only_ours", seed=2),
    Case("cu_7_final_varlen", [7], 128, final=True, varlen=True, pack="cu", seed=7),
    Case("edge_on", [[256, 256, 512]], 256, init="row", final=True, varlen=True, pack="cu"),
    Case("edge_just_before", [[255, 257, 511]], 256, init="row", final=True, varlen=True, pack="cu"),
    Case("edge_just_after", [[257, 255, 513]], 256, ("D_head",), init="row", varlen=True, pack="cu"),
    Case("length_1_sequences", [[1, 1000, 1, 1, 63, 1]], 64, init="row", final=True, varlen=True, pack="cu"),
    Case("per_sequence_init_7", [7], 128, ALL, init="seq", final=True, varlen=True, pack="cu", seed=70),
    Case("all_64", [64], 256, ALL, init="row", final=True, varlen=True, pack="cu", seed=64),
    Case("all_64_ours_cu_only", [64], 128, ALL + ("D_head",), init="row", final=True, varlen=True,
         pack="cu_only_ours", seed=65, max_len=600),
    Case("all_seq_idx_batch2", [[63, 1, 1936, 1000], [2048, 952]], 128, ALL, init="row", final=True,
         pack="seq_idx"),
]


def rel_err(got, ref):
    assert not torch.isnan(got).any(), "NaN in result"
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def row_lengths(case, gen):
    rows = []
    for row in case.rows:
        if isinstance(row, int):  # row random lengths in 1..max_len
            row = torch.randint(1, case.max_len + 1, (row,), generator=gen).tolist()
        rows.append(list(row))
    assert len({sum(r) for r in rows}) == 1, "every row needs the same number of tokens"
    return rows


def build(case):
    """-> (inputs, ours kwargs, mamba_ssm kwargs or None, reference kwargs, cu_seqlens or None)."""
    gen = torch.Generator().manual_seed(case.seed)
    rows = row_lengths(case, gen)
    batch, tokens = len(rows), sum(rows[0])
    dev = DEVICE

    def randn(*shape, scale=1.0, dtype=DTYPE):
        return (torch.randn(shape, generator=gen) * scale).to(dev, dtype)

    raw = "dt_softplus" in case.options
    dt = torch.randn(batch, tokens, HEADS, generator=gen) * 0.5
    dt = dt - 2.0 if raw else F.softplus(dt - 2.0)
    inputs = dict(
        x=randn(batch, tokens, HEADS, HEAD_SIZE),
        dt=dt.to(dev, DTYPE),
        A=-torch.exp(torch.empty(HEADS).uniform_(0.0, 2.77, generator=gen)).to(dev),
        B=randn(batch, tokens, GROUPS, STATE),
        C=randn(batch, tokens, GROUPS, STATE),
    )
    opts = {}
    if "D_head" in case.options:
        opts["D"] = randn(HEADS, dtype=torch.float32)
    if "D_channel" in case.options:
        opts["D"] = randn(HEADS, HEAD_SIZE, dtype=torch.float32)
    if "z" in case.options:
        opts["z"] = randn(batch, tokens, HEADS, HEAD_SIZE)
    if "dt_bias" in case.options:
        # Mamba-2's init: softplus(dt_bias) in [1e-3, 1e-1]; without softplus some dt go below 0 and clamp.
        dt0 = torch.exp(torch.empty(HEADS).uniform_(-6.9, -2.3, generator=gen))
        opts["dt_bias"] = (dt0 + torch.log(-torch.expm1(-dt0))).to(dev) if raw else randn(
            HEADS, scale=0.1, dtype=torch.float32)
    if raw:
        opts["dt_softplus"] = True
    if "dt_limit" in case.options:
        opts["dt_limit"] = (0.01, 0.1)

    num_sequences = sum(len(r) for r in rows)
    if case.init == "row":
        opts["initial_states"] = randn(batch, HEADS, HEAD_SIZE, STATE, dtype=torch.float32)
    elif case.init == "seq":
        opts["initial_states"] = randn(num_sequences, HEADS, HEAD_SIZE, STATE, dtype=torch.float32)

    seq_idx = torch.stack([torch.repeat_interleave(torch.arange(len(r), dtype=torch.int32), torch.tensor(r))
                           for r in rows]).to(dev)
    cu = None
    if case.pack in ("cu", "cu_only_ours"):
        assert batch == 1
        cu = torch.tensor([0] + torch.tensor(rows[0]).cumsum(0).tolist(), dtype=torch.int32, device=dev)

    ours = dict(opts, return_final_states=case.final, return_varlen_states=case.varlen)
    ref = dict(opts)
    theirs = dict(opts, return_final_states=case.final, return_varlen_states=case.varlen)
    if case.pack == "seq_idx":
        ours["seq_idx"] = ref["seq_idx"] = theirs["seq_idx"] = seq_idx
    elif case.pack == "cu":
        ours.update(seq_idx=seq_idx, cu_seqlens=cu)
        ref.update(seq_idx=seq_idx, cu_seqlens=cu)
        theirs.update(seq_idx=seq_idx, cu_seqlens=cu)
    elif case.pack == "cu_only_ours":
        ours["cu_seqlens"] = ref["cu_seqlens"] = cu
        theirs.update(seq_idx=seq_idx, cu_seqlens=cu)  # mamba_ssm masks only with seq_idx
    if case.init == "seq":
        theirs = None
    return inputs, ours, theirs, ref, rows


def unpack(result, final, varlen):
    if not final and not varlen:
        assert isinstance(result, torch.Tensor)
        return result, None, None
    assert isinstance(result, tuple) and len(result) == 1 + final + varlen
    out, *rest = result
    return out, rest.pop(0) if final else None, rest.pop(0) if varlen else None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_against_mamba_ssm_and_float64(case):
    inputs, ours_kw, theirs_kw, ref_kw, rows = build(case)
    batch, tokens = inputs["x"].shape[:2]
    where = f"case {case.id} (seed {case.seed}, rows {[len(r) for r in rows]} sequences, {tokens} tokens)"

    ours = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=case.chunk, **ours_kw)
    out, final, varlen = unpack(ours, case.final, case.varlen)
    ref_out, ref_final, ref_varlen = layer_token_recurrence(**inputs, **ref_kw)

    # Structure and dtypes.
    assert out.shape == inputs["x"].shape and out.dtype == DTYPE, where
    if case.final:
        assert final.shape == (batch, HEADS, HEAD_SIZE, STATE) and final.dtype == torch.float32, where
    if case.varlen:
        assert varlen.shape == (sum(len(r) for r in rows), HEADS, HEAD_SIZE, STATE), where
        assert varlen.dtype == inputs["C"].dtype, where   # C's dtype, as mamba_ssm
    if case.final and case.varlen:
        assert torch.equal(varlen[-1], final[0].to(varlen.dtype)), where

    # Ours against the definition, overall and sequence by sequence.
    assert rel_err(out, ref_out) < TOL_OURS, f"{where}: out {rel_err(out, ref_out):.3g}"
    for b, lengths in enumerate(rows):
        start = 0
        for i, length in enumerate(lengths):
            part = slice(start, start + length)
            err = rel_err(out[b, part], ref_out[b, part])
            assert err < TOL_PER_SEQUENCE, f"{where}: row {b} sequence {i} ({length} tokens) out {err:.3g}"
            start += length
    if case.final:
        assert rel_err(final, ref_final) < TOL_OURS, f"{where}: final_states {rel_err(final, ref_final):.3g}"
    if case.varlen:
        assert rel_err(varlen, ref_varlen) < TOL_OURS, f"{where}: varlen_states {rel_err(varlen, ref_varlen):.3g}"
        for i in range(varlen.shape[0]):
            err = rel_err(varlen[i], ref_varlen[i])
            assert err < TOL_PER_SEQUENCE, f"{where}: varlen_states[{i}] {err:.3g}"

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
