"""The linear scan that the forward and the backward are both made of, in plain PyTorch.

Per batch row and head, with state h of shape [head_size, state_size]:

    h_t = exp(log_decay_t) h_{t-1} + weight_t x_t b_t^T,    y_t = h_t c_t

The forward op is this scan with weight = dt and log_decay = a * dt (plus d * x). The
backward runs it three more times with other roles (backward.py): the gradient of the state
obeys the same recurrence backwards in time, and the transposed state gives dC and dB.

Packed sequences as in the layer op: no state crosses a sequence boundary; ``init`` is
[batch, ...] (each row's sequence 0) or, with cu_seqlens, [num_sequences, ...] (one per
sequence). This is the "pytorch" backend's scan; cutile/scan.py is the kernels' one.
"""
import torch

from .layer_reference import _sequences
from .reference import chunk_output_reference, chunk_states_reference, decay_cumsum_reference


def scan_reference(x, b, c, weight, log_decay, init=None, seq_idx=None, cu_seqlens=None, *, chunk_size=64,
                   dtype=torch.float32):
    """x [batch, tokens, heads, head_size]; b, c [batch, tokens, groups, state_size];
    weight, log_decay [batch, tokens, heads] (natural log) -> (y [batch, tokens, heads, head_size],
    final_states [batch, heads, head_size, state_size], varlen_states [num_sequences, ...] with
    cu_seqlens else None), all in ``dtype``. Each sequence is scanned on its own."""
    batch, tokens, heads, head_size = x.shape
    ones = torch.ones(heads, dtype=dtype, device=x.device)
    no_skip = torch.zeros(heads, dtype=dtype, device=x.device)
    y = torch.zeros(batch, tokens, heads, head_size, dtype=dtype, device=x.device)
    final_states = torch.zeros(batch, heads, head_size, b.shape[3], dtype=dtype, device=x.device)
    ends = []
    for row, start, end, start_state in _sequences(seq_idx, cu_seqlens, init, batch, tokens):
        part = slice(row, row + 1), slice(start, end)
        decay_cumsum = decay_cumsum_reference(ones, log_decay[part], chunk_size, dtype=dtype)
        states, h = chunk_states_reference(x[part], b[part], weight[part], decay_cumsum, start_state, chunk_size,
                                           dtype=dtype)
        y[part] = chunk_output_reference(x[part], b[part], c[part], no_skip, weight[part], decay_cumsum, states,
                                         chunk_size, dtype=dtype)
        ends.append(h[0])
        final_states[row] = h[0]
    return y, final_states, (torch.stack(ends) if cu_seqlens is not None else None)
