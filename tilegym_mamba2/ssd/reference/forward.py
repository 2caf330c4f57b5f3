"""Pure-PyTorch Mamba-2 forward pass: the ground truth and the three chunked stages.

Everything here runs on whatever device the inputs live on (CPU or CUDA) and
is the yardstick the cuTile kernels are measured against:

* ``token_recurrence`` is the plain token-by-token scan in float64. It is the
  definition of the operator and is deliberately independent of chunking.
* ``decay_cumsum_reference`` (chunk_cumsum.py), ``chunk_states_reference``
  (fwd_pass_state.py) and ``chunk_output_reference`` (compute_out.py) are the
  three stages of the chunked algorithm, each in the file of its kernel's name,
  with the same layouts as the kernels produce, so each kernel stage can be
  checked on its own (imported here too).
* ``chunked_forward_reference`` composes the stages in any dtype.
The "pytorch" backend (backends/pytorch.py) runs ``chunked_forward_reference``
in float32, or in float64 for float64 inputs (so that ``torch.autograd.gradcheck``
can run through it).

Layouts (B batch, T tokens, H heads, G groups, P head_size, N state_size,
L chunk_size, K = ceil(T / L) chunks):

    x            [B, T, H, P]
    a, d         [H]            (a < 0)
    b, c         [B, T, G, N]   (head h reads group h // (H // G))
    dt           [B, T, H]      (dt > 0)
    init_state   [B, H, P, N] or None (zeros)
    decay_cumsum [B, H, K * L]  (log2-scaled, restarts every chunk)
    chunk_states [B, H, K, P, N] (state entering each chunk)
"""

from __future__ import annotations

import torch

from ...core.constants import LOG2E
from ...core.tensors import expand_groups
from .chunk_cumsum import decay_cumsum_reference
from .compute_out import chunk_output_reference
from .fwd_pass_state import chunk_states_reference

__all__ = [
    "LOG2E",
    "token_recurrence",
    "decay_cumsum_reference",
    "chunk_states_reference",
    "chunk_output_reference",
    "chunked_forward_reference",
]


def token_recurrence(x, a, b, c, d, dt, init_state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token Mamba-2 scan in float64; the definition of the operator.

    h_t = exp(a * dt_t) * h_{t-1} + dt_t * x_t b_t^T,   y_t = h_t c_t + d * x_t

    Returns ``out`` [B, T, H, P] and ``final_state`` [B, H, P, N], both float64.
    """
    f64 = torch.float64
    heads = x.shape[2]
    x, a, d, dt = x.to(f64), a.to(f64), d.to(f64), dt.to(f64)
    b = expand_groups(b.to(f64), heads)
    c = expand_groups(c.to(f64), heads)
    batch, tokens, _, head_size = x.shape
    if init_state is None:
        h = x.new_zeros(batch, heads, head_size, b.shape[-1])
    else:
        h = init_state.to(f64)

    outs = []
    for t in range(tokens):
        dt_t = dt[:, t, :, None, None]  # [B, H, 1, 1]
        h = torch.exp(a[:, None, None] * dt_t) * h + dt_t * x[:, t, :, :, None] * b[:, t, :, None, :]
        outs.append(torch.einsum("bhpn,bhn->bhp", h, c[:, t]) + d[:, None] * x[:, t])
    return torch.stack(outs, dim=1), h


def chunked_forward_reference(x, a, b, c, d, dt, init_state=None, chunk_size: int = 128,
                              dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The three chunked stages composed, all math in ``dtype``.

    Returns ``out`` [B, T, H, P] and ``final_state`` [B, H, P, N], both in ``dtype``.
    """
    g = decay_cumsum_reference(a, dt, chunk_size, dtype=dtype)
    states, final_state = chunk_states_reference(x, b, dt, g, init_state, chunk_size, dtype=dtype)
    out = chunk_output_reference(x, b, c, d, dt, g, states, chunk_size, dtype=dtype)
    return out, final_state
