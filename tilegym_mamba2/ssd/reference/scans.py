"""The linear scan that the forward and the backward are both made of, in plain PyTorch.

Per batch row and head, with state h of shape [head_size, state_size]:

    h_t = exp(log_decay_t) h_{t-1} + weight_t x_t b_t^T,    y_t = h_t c_t

The forward op is this scan with weight = dt and log_decay = a * dt (plus d * x). The
backward runs it three more times with other roles (backward.py): the gradient of the state
obeys the same recurrence backwards in time, and the transposed state gives dC and dB.

Packed sequences as in the layer op: no state crosses a sequence boundary; ``init`` is
[batch, ...] (each row's sequence 0) or, with cu_seqlens, [num_sequences, ...] (one per
sequence). This is the "pytorch" backend's scan; ssd/scans.py runs the same scans on the kernels;
chunk_states_walk.py and chunk_grads.py hold the references of its two kernels.
"""
import torch

from ...core.constants import KERNEL_CHUNK
from ...core.packing import SequenceBuckets, packed_sequences, per_sequence_init, seq_idx_from_cu_seqlens, sequences
from ...core.tensors import expand_groups
from .chunk_cumsum import decay_cumsum_reference
from .chunk_states_walk import chunk_entry_states
from .compute_out import chunk_output_reference
from .fwd_pass_state import chunk_states_reference


def scan_reference(x, b, c, weight, log_decay, init=None, seq_idx=None, cu_seqlens=None, *, chunk_size=KERNEL_CHUNK,
                   dtype=torch.float32, chunk_states=False, outputs=True, varlen_states=True):
    """x [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size];
    weight, log_decay [batch, tokens, heads] (natural log) -> (y [batch, tokens, heads, head_size],
    final_states [batch, heads, head_size, state_size], varlen_states [num_sequences, ...] with
    cu_seqlens else None), all in ``dtype``. Each sequence is scanned on its own.
    ``chunk_states``: a fourth value, (chunk_entry_states(...), weight, log_decay), as the cutile
    scan gives chunk_grads; without ``outputs`` y is None; without ``varlen_states`` the third
    value is None and only each row's last sequence's end state is computed."""
    if chunk_states:
        batch = x.shape[0]
        if cu_seqlens is not None and seq_idx is None:
            seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1])
        # Per-sequence initial states stay out of the chunk states, as in the kernels.
        row_init = None if per_sequence_init(init, cu_seqlens, batch) else init
        states = chunk_entry_states(x, b, weight, log_decay, row_init, seq_idx, chunk_size, dtype)
        y, final_states, varlen = scan_reference(x, b, c, weight, log_decay, init, seq_idx, cu_seqlens,
                                                 chunk_size=chunk_size, dtype=dtype)
        return (y if outputs else None), final_states, varlen, (states, weight, log_decay)
    batch, tokens, heads, head_size = x.shape
    y = torch.zeros(batch, tokens, heads, head_size, dtype=dtype, device=x.device)
    final_states = torch.zeros(batch, heads, head_size, b.shape[3], dtype=dtype, device=x.device)
    if x.device.type == "meta":  # shapes only: no values (nor offsets) to read
        varlen = None if cu_seqlens is None else final_states.new_empty(cu_seqlens.shape[0] - 1, *final_states.shape[1:])
        return y, final_states, varlen
    if seq_idx is None and cu_seqlens is None:
        for row, start, end, start_state in sequences(None, None, init, batch, tokens):
            part = slice(row, row + 1), slice(start, end)
            y[part], (_, final_states[row:row + 1]) = _scan_rows(
                x[part], b[part], c[part], weight[part], log_decay[part], start_state, chunk_size, dtype,
                torch.ones(1, dtype=torch.bool, device=x.device))
        return y, final_states, None
    rows, starts, lengths, ids = packed_sequences(seq_idx, cu_seqlens, batch, tokens)
    buckets = SequenceBuckets(rows, starts, lengths, tokens, x.device)
    starting = _starting_states(init, cu_seqlens, batch, rows, starts, ids, dtype)
    ends = torch.empty(len(rows), heads, head_size, b.shape[3], dtype=dtype, device=x.device)
    # A row's final state is its last sequence's end state.
    is_last = torch.tensor([k + 1 == len(rows) or rows[k + 1] != rows[k] for k in range(len(rows))],
                           device=x.device)
    wanted = torch.ones_like(is_last) if (cu_seqlens is not None and varlen_states) else is_last
    for bucket in buckets.buckets:
        members = bucket[0]
        start_state = None if starting is None else starting[members]
        inputs = [buckets.gather(t, bucket) for t in (x, b, c, weight, log_decay)]
        out, end = _scan_rows(*inputs, start_state, min(chunk_size, bucket[1].shape[1]), dtype, wanted[members])
        buckets.scatter(y, bucket, out)
        if end[1] is not None:
            ends[members[end[0]]] = end[1]
    final_states[torch.tensor(rows, dtype=torch.long, device=x.device)[is_last]] = ends[is_last]
    return y, final_states, (ends if cu_seqlens is not None and varlen_states else None)


def _scan_rows(x, b, c, weight, log_decay, start_state, chunk_size, dtype, wanted):
    """The chunked scan of rows that each hold one sequence -> (y, (which rows, their end states)) for
    the ``wanted`` rows' end states. Rows of one chunk need no state pass for y: the state entering
    their only chunk is the starting state (the end states, where wanted, are computed apart:
    for many short sequences they are most of the work)."""
    heads = x.shape[2]
    ones = torch.ones(heads, dtype=dtype, device=x.device)
    no_skip = torch.zeros(heads, dtype=dtype, device=x.device)
    decay_cumsum = decay_cumsum_reference(ones, log_decay, chunk_size, dtype=dtype)
    if x.shape[1] > chunk_size:
        states, h = chunk_states_reference(x, b, weight, decay_cumsum, start_state, chunk_size, dtype=dtype)
        return (chunk_output_reference(x, b, c, no_skip, weight, decay_cumsum, states, chunk_size, dtype=dtype),
                (wanted, h[wanted]))
    states = None if start_state is None else start_state.to(dtype)[:, :, None]
    y = chunk_output_reference(x, b, c, no_skip, weight, decay_cumsum, states, chunk_size, dtype=dtype)
    if not bool(wanted.any()):
        return y, (wanted, None)
    # One chunk: the end state is the starting state decayed through it plus the chunk's own sum.
    g = decay_cumsum[wanted].to(dtype).transpose(1, 2)[:, :x.shape[1]]          # [n, tokens, H]
    g_last = g[:, -1]
    scale = weight[wanted].to(dtype) * torch.exp2(g_last[:, None] - g)
    h = torch.einsum("rlhp,rlhn->rhpn", scale[..., None] * x[wanted].to(dtype),
                     expand_groups(b[wanted], heads).to(dtype))
    if start_state is not None:
        h = h + torch.exp2(g_last)[..., None, None] * start_state[wanted].to(dtype)
    return y, (wanted, h)


def _starting_states(init, cu_seqlens, batch, rows, starts, ids, dtype):
    """Each packed sequence's starting state [num_sequences, ...] (None: all zeros): its own with
    cu_seqlens and one per sequence; else its row's for the row's first sequence when its id is 0
    (mamba_ssm's rule), zeros for the others."""
    if init is None:
        return None
    if per_sequence_init(init, cu_seqlens, batch):
        return init.to(dtype)
    takes_row = torch.tensor([start == 0 and seq_id == 0 for start, seq_id in zip(starts, ids)], device=init.device)
    row_init = init.to(dtype)[torch.tensor(rows, dtype=torch.long, device=init.device)]
    return torch.where(takes_row[:, None, None, None], row_init, 0.0)


