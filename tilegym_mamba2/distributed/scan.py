"""context_parallel_scan_combined: mamba_chunk_scan_combined over a sequence split along tokens.

Each rank first computes the end state of its slice's last sequence from a zero entering state
(the backend's end_state: ssd/reference/end_state.py, ssd/end_state.py); one all-gather of these summaries and
the slices' decays (state_chain.StateChain) gives every rank the state entering its slice; then
the single-GPU op runs on the slice with that state as its first sequence's initial state, so
the outputs come from our fused kernels in one pass. Autograd runs through all of it: the op's
own backward (which gives the entering state's gradient), the chain's reverse all-gather and
the summary's matmul.
"""
import bisect
import dataclasses

import torch

from ..core.registry import backend_of
from ..core.validation import ScanCombinedArgs, check_scan_combined_args, scan_combined_call
from ..ssd.dt import process_dt
from .agreement import agree, check_group_device, edge_ids, fingerprints, group_or_world
from .state_chain import StateChain, slice_end_state

OP = "context_parallel_scan_combined"


def context_parallel_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                   seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                   return_final_states=False, group=None, backend=None):
    """mamba_chunk_scan_combined on one sequence whose tokens are split over the ranks of ``group``.

    Args: mamba_chunk_scan_combined's, where the tensors with a tokens dimension (x, dt, B, C, z,
    seq_idx) are this rank's slice; the ranks hold consecutive slices in rank order, of any
    lengths >= 1. seq_idx is this rank's slice of the global seq_idx; cu_seqlens (not with
    seq_idx) the global start offsets. initial_states start the global sequence (or, with
    cu_seqlens, [num_sequences, ...], each sequence). A, D, dt_bias, initial_states and every
    option must be the same on every rank. group: a torch.distributed group (default the world);
    NCCL for CUDA tensors, gloo for CPU (or CUDA, through host memory). backend: as in
    mamba_chunk_scan_combined.

    Returns this rank's out [batch, slice tokens, heads, head_size], and with
    return_final_states the global sequence's final states [batch, heads, head_size,
    state_size] on every rank. Differentiable: sliced inputs get this rank's slice of the
    gradient; replicated ones this rank's share (their sum over the group is the gradient).
    Every rank must make the call, and run backward, together.
    """
    group = group_or_world(group)
    backend = backend_of("mamba2_chunk_scan_combined", backend, x)
    call = scan_combined_call(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                              dt_softplus, dt_limit, return_final_states)
    return scan_slice(agree_scan(group, backend, call), group, backend, call)


def scan_signature(call: ScanCombinedArgs, backend):
    """What must agree across ranks, by argument."""
    def shape(t):
        return None if t is None else tuple(t.shape)
    x, B, D, z, dt_bias, cu_seqlens = call.x, call.B, call.D, call.z, call.dt_bias, call.cu_seqlens
    chunk_size, initial_states, seq_idx = call.chunk_size, call.initial_states, call.seq_idx
    dt_softplus, dt_limit, return_final_states = call.dt_softplus, call.dt_limit, call.return_final_states
    return {"x's [batch, heads, head_size]": (x.shape[0], *x.shape[2:]), "x's dtype": str(x.dtype),
            "B's [groups, state_size]": tuple(B.shape[2:]), "chunk_size": chunk_size, "D's shape": shape(D),
            "z (given or not)": z is not None, "dt_bias (given or not)": dt_bias is not None,
            "initial_states' shape": shape(initial_states), "seq_idx (given or not)": seq_idx is not None,
            "cu_seqlens": None if cu_seqlens is None else cu_seqlens.tolist(), "dt_softplus": dt_softplus,
            "dt_limit": tuple(float(v) for v in dt_limit), "return_final_states": return_final_states,
            "backend": backend.name}


def agree_scan(group, backend, call: ScanCombinedArgs):
    """Checks this rank's slice, then agree(); raises on every rank if any rank is wrong."""
    x, dt, A, B, C, D, z, dt_bias = call.x, call.dt, call.A, call.B, call.C, call.D, call.z, call.dt_bias
    initial_states, seq_idx, cu_seqlens = call.initial_states, call.seq_idx, call.cu_seqlens

    def check():
        check_group_device(group, x.device if isinstance(x, torch.Tensor) else torch.device("cpu"))
        if cu_seqlens is not None and seq_idx is not None:
            raise ValueError("give seq_idx (this rank's slice) or cu_seqlens (the global offsets), not both")
        per_sequence = cu_seqlens is not None and initial_states is not None
        check_scan_combined_args(x, dt, A, B, C, call.chunk_size, D, z, dt_bias,
                                 None if per_sequence else initial_states, seq_idx, None, call.dt_softplus,
                                 call.dt_limit, call.return_final_states, False, limits=backend.limits)
        if cu_seqlens is not None:
            _check_global_offsets(cu_seqlens, x, initial_states)

    layout = agree(OP, group, check,
                   lambda: {**scan_signature(call, backend),
                            **fingerprints(A=A, D=D, dt_bias=dt_bias, initial_states=initial_states)},
                   x.shape[1] if isinstance(x, torch.Tensor) and x.ndim == 4 else 0,
                   lambda: edge_ids(seq_idx, x.shape[0], x.shape[1], 0))
    if cu_seqlens is not None:
        offsets = cu_seqlens.tolist()
        if offsets[-1] != layout.total:
            raise ValueError(f"{OP}: cu_seqlens must end at the global number of tokens, the sum of the ranks' slices "
                             f"{list(layout.lengths)} = {layout.total}, got {offsets[-1]}")
        layout = _with_offsets(layout, offsets)
    return layout


def _check_global_offsets(cu_seqlens, x, initial_states):
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D int32 or int64 tensor [num_sequences + 1] of global start offsets")
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens packs sequences along tokens and needs batch 1, got batch {x.shape[0]}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and rise strictly, got "
                         f"{offsets if len(offsets) <= 12 else '[...]'}")
    if initial_states is not None:
        allowed = {(n, *x.shape[2:], initial_states.shape[-1]) for n in (1, len(offsets) - 1)}
        if tuple(initial_states.shape) not in allowed or initial_states.shape[-1] < 1:
            raise ValueError(f"initial_states must be [1 or num_sequences, heads, head_size, state_size], got "
                             f"{tuple(initial_states.shape)}")


def _with_offsets(layout, offsets):
    """The layout's sequence ids at the slice edges as the global cu_seqlens define them."""
    starts = [sum(layout.lengths[:r]) for r in range(layout.size)]

    def sequence_of(token):
        return bisect.bisect_right(offsets, token) - 1

    first = [[sequence_of(s)] for s in starts]
    last = [[sequence_of(s + n - 1)] for s, n in zip(starts, layout.lengths)]
    run = [[s + n - max(offsets[q[0]], s)] for q, s, n in zip(last, starts, layout.lengths)]
    return dataclasses.replace(layout, first_ids=tuple(first), last_ids=tuple(last), last_run=tuple(run))


def _local_sequences(layout, cu_seqlens, initial_states, device):
    """With global offsets: (local cu_seqlens, the local sequences' own initial states [local
    sequences, ...] or None, does the first go on from the previous rank). A sequence that does
    not start on this rank (or has no initial state of its own) gets zeros, selected from
    initial_states so that every rank's initial_states gets a gradient (zeros where it has no share)."""
    offsets = cu_seqlens.tolist()
    lo, hi = layout.offset, layout.offset + layout.lengths[layout.rank]
    seqs = [i for i in range(len(offsets) - 1) if offsets[i] < hi and offsets[i + 1] > lo]
    local = [0] + [min(offsets[i + 1], hi) - lo for i in seqs]
    own = None
    if initial_states is not None:
        per_sequence = initial_states.shape[0] == len(offsets) - 1
        source = [i if per_sequence else 0 for i in seqs]
        starts_here = [offsets[i] >= lo and (per_sequence or i == 0) for i in seqs]
        picked = initial_states[torch.tensor(source, device=initial_states.device)]
        own = torch.where(torch.tensor(starts_here, device=initial_states.device)[:, None, None, None], picked, 0.0)
    return torch.tensor(local, dtype=cu_seqlens.dtype, device=device), own, offsets[seqs[0]] < lo


def scan_slice(layout, group, backend, call: ScanCombinedArgs):
    """This rank's part of the call, after agree_scan: its last sequence's end state from zero
    (state_chain.slice_end_state), the chain's all-gather, then the single-GPU op on the slice
    with the entering state as its first sequence's initial state.

    The op's initial state is always a select between the chain's entering state and the rank's
    own initial state, on every rank (rank 0 included, whose chain link is never taken): out then
    depends on the chain on every rank, so a loss on out alone runs the chain's backward, with its
    collectives, on every rank (lockstep.py)."""
    x, dt, A, B, dt_bias, seq_idx = call.x, call.dt, call.A, call.B, call.dt_bias, call.seq_idx
    initial_states, cu_seqlens = call.initial_states, call.cu_seqlens
    rank, tokens = layout.rank, x.shape[1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    dt_used = process_dt(dt, dt_bias, call.dt_softplus, call.dt_limit, dtype=dtype)
    log_decay = A.to(dtype) * dt_used
    last_start = [tokens - n for n in layout.last_run[rank]]
    if cu_seqlens is not None:
        local_cu, own_init, goes_on = _local_sequences(layout, cu_seqlens, initial_states, x.device)
        # the last sequence's own initial state counts when it starts here
        last_init = None if own_init is None else own_init[-1:]   # zeros for a sequence that goes on
    else:
        local_cu, own_init = None, None
        # Rank 0's rows whose slice is one sequence from the global start end with initial_states
        # carried through; selected on every rank (zeros elsewhere) so that every rank's
        # initial_states gets a gradient, even from a loss on the final states alone.
        carried = torch.tensor([rank == 0 and f == 0 and t for f, t in zip(layout.first_ids[0], layout.through(0))],
                               device=x.device)
        last_init = None if initial_states is None \
            else torch.where(carried[:, None, None, None], initial_states, 0.0)
    end_state = slice_end_state(backend, x, B, dt_used, log_decay, last_start, last_init)
    entering, final_states = StateChain.apply(end_state, log_decay.sum(1), layout, group)

    link = torch.tensor(layout.link(rank), device=x.device)[:, None, None, None]
    if cu_seqlens is not None:
        local_seq_idx = None
        own = entering.new_zeros(local_cu.numel() - 1, *entering.shape[1:]) if own_init is None \
            else own_init.to(entering.dtype)
        init = torch.cat([torch.where(link, entering, own[:1]), own[1:]])
    else:
        # rank 0's rows start the global sequence with initial_states; on the other ranks, the op
        # starts each row's sequence with id 0 from its initial state: renumber so that the first
        # sequence on this rank is id 0 (rows whose first sequence starts here enter with zeros).
        own = entering.new_zeros(()) if initial_states is None \
            else torch.where(torch.tensor(rank == 0, device=x.device), initial_states.to(entering.dtype), 0.0)
        init = torch.where(link, entering, own)
        local_seq_idx = seq_idx if rank == 0 or seq_idx is None else seq_idx - seq_idx[:, :1]
    y = backend.scan_combined(dataclasses.replace(call, initial_states=init, seq_idx=local_seq_idx,
                                                  cu_seqlens=local_cu, return_final_states=False,
                                                  return_varlen_states=False))
    return (y, final_states) if call.return_final_states else y
