"""Layer-op GPU cases shared by the tests against mamba_ssm and the cuTile backend's own tests:
packed rows, every option alone and together, boundaries on and around chunk edges."""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tilegym_mamba2.ssd.dt import process_dt
from tilegym_mamba2.ssd.reference.layer import chunked_layer_reference
from tilegym_mamba2.testing import relative_error as rel_err

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
    dtype: torch.dtype = DTYPE
    shape: tuple = (HEADS, HEAD_SIZE, STATE, GROUPS)   # heads, head_size, state_size, groups
    global_ids: bool = False        # seq_idx numbers sequences across rows, not from 0 in each


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
    heads, head_size, state, groups = case.shape

    def randn(*shape, scale=1.0, dtype=case.dtype):
        return (torch.randn(shape, generator=gen) * scale).to(dev, dtype)

    raw = "dt_softplus" in case.options
    dt = torch.randn(batch, tokens, heads, generator=gen) * 0.5
    dt = dt - 2.0 if raw else F.softplus(dt - 2.0)
    inputs = dict(
        x=randn(batch, tokens, heads, head_size),
        dt=dt.to(dev, case.dtype),
        A=-torch.exp(torch.empty(heads).uniform_(0.0, 2.77, generator=gen)).to(dev),
        B=randn(batch, tokens, groups, state),
        C=randn(batch, tokens, groups, state),
    )
    opts = {}
    if "D_head" in case.options:
        opts["D"] = randn(heads, dtype=torch.float32)
    if "D_channel" in case.options:
        opts["D"] = randn(heads, head_size, dtype=torch.float32)
    if "z" in case.options:
        opts["z"] = randn(batch, tokens, heads, head_size)
    if "dt_bias" in case.options:
        # Mamba-2's init: softplus(dt_bias) in [1e-3, 1e-1]; without softplus some dt go below 0 and clamp.
        dt0 = torch.exp(torch.empty(heads).uniform_(-6.9, -2.3, generator=gen))
        opts["dt_bias"] = (dt0 + torch.log(-torch.expm1(-dt0))).to(dev) if raw else randn(
            heads, scale=0.1, dtype=torch.float32)
    if raw:
        opts["dt_softplus"] = True
    if "dt_limit" in case.options:
        opts["dt_limit"] = (0.01, 0.1)

    num_sequences = sum(len(r) for r in rows)
    if case.init == "row":
        opts["initial_states"] = randn(batch, heads, head_size, state, dtype=torch.float32)
    elif case.init == "seq":
        opts["initial_states"] = randn(num_sequences, heads, head_size, state, dtype=torch.float32)

    # Ids restart at 0 in every row, or (global_ids) keep counting across rows as serving engines
    # number them: then later rows start at an id > 0 and get no row initial state.
    first_ids = [sum(len(r) for r in rows[:i]) if case.global_ids else 0 for i in range(len(rows))]
    seq_idx = torch.stack([torch.repeat_interleave(torch.arange(f, f + len(r), dtype=torch.int32), torch.tensor(r))
                           for f, r in zip(first_ids, rows)]).to(dev)
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


def reference(inputs, kw, chunk):
    """float64 chunked reference on the same (processed) dt -> (out, final, varlen)."""
    opts = {k: kw.get(k) for k in ("D", "z", "initial_states", "seq_idx", "cu_seqlens")}
    dt = process_dt(inputs["dt"], kw.get("dt_bias"), kw.get("dt_softplus", False),
                    kw.get("dt_limit", (0.0, float("inf"))), dtype=torch.float64)
    rest = {k: v for k, v in inputs.items() if k != "dt"}
    return chunked_layer_reference(dt=dt, **rest, **opts, chunk_size=chunk, dtype=torch.float64)


def assert_close_to_reference(where, rows, got, ref):
    """(out, final or None, varlen or None) against the reference's: overall, every sequence's
    outputs and every varlen state."""
    (out, final, varlen), (ref_out, ref_final, ref_varlen) = got, ref
    assert rel_err(out, ref_out) < TOL_OURS, f"{where}: out {rel_err(out, ref_out):.3g}"
    for b, lengths in enumerate(rows):
        start = 0
        for i, length in enumerate(lengths):
            part = slice(start, start + length)
            err = rel_err(out[b, part], ref_out[b, part])
            assert err < TOL_PER_SEQUENCE, f"{where}: row {b} sequence {i} ({length} tokens) out {err:.3g}"
            start += length
    if final is not None:
        assert rel_err(final, ref_final) < TOL_OURS, f"{where}: final_states {rel_err(final, ref_final):.3g}"
    if varlen is not None:
        assert rel_err(varlen, ref_varlen) < TOL_OURS, f"{where}: varlen_states {rel_err(varlen, ref_varlen):.3g}"
        for i in range(varlen.shape[0]):
            err = rel_err(varlen[i], ref_varlen[i])
            assert err < TOL_PER_SEQUENCE, f"{where}: varlen_states[{i}] {err:.3g}"
