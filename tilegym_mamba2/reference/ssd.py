"""Pure-PyTorch Mamba-2 forward pass: the ground truth and the three chunked stages.

Everything here runs on whatever device the inputs live on (CPU or CUDA) and
is the yardstick the cuTile kernels are measured against:

* ``token_recurrence`` is the plain token-by-token scan in float64. It is the
  definition of the operator and is deliberately independent of chunking.
* ``decay_cumsum_reference``, ``chunk_states_reference`` and
  ``chunk_output_reference`` are the three stages of the chunked algorithm,
  with the same layouts as the kernels produce, so each kernel stage can be
  checked on its own.
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

import math

import torch
import torch.nn.functional as F

from ..core.tensors import LOG2E, expand_groups, log_decay

__all__ = [
    "LOG2E",
    "token_recurrence",
    "decay_cumsum_reference",
    "chunk_states_reference",
    "chunk_output_reference",
    "chunked_forward_reference",
]



def chunked(t: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, ...] -> [B, K, L, ...], zero-padding the ragged last chunk.

    Zero padding is harmless: dt = 0 means no decay and no input, and b = c = 0
    means padded tokens neither write to nor read from the state.
    """
    num_tokens = t.shape[1]
    num_chunks = -(-num_tokens // chunk_size)
    pad = num_chunks * chunk_size - num_tokens
    t = t.to(dtype)
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], num_chunks, chunk_size, *t.shape[2:])


def chunked_decay(decay_cumsum: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, K * L] -> [B, K, L, H] so it lines up with the chunked token tensors."""
    batch, heads, padded = decay_cumsum.shape
    g = decay_cumsum.to(dtype).reshape(batch, heads, padded // chunk_size, chunk_size)
    return g.permute(0, 2, 3, 1)


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


def decay_cumsum_reference(
    a: torch.Tensor,
    dt: torch.Tensor,
    chunk_size: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Per-chunk inclusive cumsum of ``a * dt`` (core.tensors.log_decay's limits), scaled by LOG2E.

    a [H], dt [B, T, H] -> [B, H, K * L]. Padded tokens have dt = 0, so the
    cumsum stays flat after the last real token.
    """
    dtc = chunked(dt, chunk_size, dtype)  # [B, K, L, H]
    g = log_decay(a.to(dtype), dtc).cumsum(dim=2) * LOG2E
    batch, num_chunks, _, heads = g.shape
    return g.permute(0, 3, 1, 2).reshape(batch, heads, num_chunks * chunk_size)


def chunk_states_reference(
    x: torch.Tensor,
    b: torch.Tensor,
    dt: torch.Tensor,
    decay_cumsum: torch.Tensor,
    init_state: torch.Tensor | None,
    chunk_size: int,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """State entering every chunk, and the state after the last one.

    x [B, T, H, P], b [B, T, G, N], dt [B, T, H], decay_cumsum [B, H, K * L],
    init_state [B, H, P, N] or None
    -> chunk_states [B, H, K, P, N], final_state [B, H, P, N].

    S_0 = init, S_{k+1} = exp2(g_last_k) S_k + sum_t dt_t exp2(g_last_k - g_t) x_t b_t^T.
    """
    heads = x.shape[2]
    xc = chunked(x, chunk_size, dtype)  # [B, K, L, H, P]
    bc = chunked(expand_groups(b, heads), chunk_size, dtype)  # [B, K, L, H, N]
    dtc = chunked(dt, chunk_size, dtype)  # [B, K, L, H]
    g = chunked_decay(decay_cumsum, chunk_size, dtype)  # [B, K, L, H]
    g_last = g[:, :, -1]  # [B, K, H]

    # Each chunk's contribution from a zero entering state, all chunks at once.
    weight = dtc * torch.exp2(g_last[:, :, None] - g)
    local = torch.einsum("bklhp,bklhn->bkhpn", weight[..., None] * xc, bc)

    # The hand-off between chunks is sequential. A closed form via prefix sums
    # of g_last would subtract large cumulative sums and lose precision in
    # float32, and K small elementwise steps are cheap.
    batch, num_chunks, _, _, head_size = xc.shape
    if init_state is None:
        state = xc.new_zeros(batch, heads, head_size, bc.shape[-1])
    else:
        state = init_state.to(dtype)
    states = []
    for k in range(num_chunks):
        states.append(state)
        state = torch.exp2(g_last[:, k, :, None, None]) * state + local[:, k]
    return torch.stack(states, dim=2), state


def chunk_output_reference(
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt: torch.Tensor,
    decay_cumsum: torch.Tensor,
    chunk_states: torch.Tensor,
    chunk_size: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Outputs from the entering states plus the causal in-chunk mixing.

    x [B, T, H, P], b and c [B, T, G, N], d [H], dt [B, T, H],
    decay_cumsum [B, H, K * L], chunk_states [B, H, K, P, N] (None: zeros) -> out [B, T, H, P].

    y_t = exp2(g_t) S_k c_t + sum_{s <= t in chunk} exp2(g_t - g_s) (c_t . b_s) dt_s x_s + d x_t
    """
    batch, tokens, heads, head_size = x.shape
    xc = chunked(x, chunk_size, dtype)  # [B, K, L, H, P]
    bc = chunked(expand_groups(b, heads), chunk_size, dtype)  # [B, K, L, H, N]
    cc = chunked(expand_groups(c, heads), chunk_size, dtype)  # [B, K, L, H, N]
    dtc = chunked(dt, chunk_size, dtype)  # [B, K, L, H]
    g = chunked_decay(decay_cumsum, chunk_size, dtype)  # [B, K, L, H]

    inter = 0.0
    if chunk_states is not None:
        inter = torch.exp2(g)[..., None] * torch.einsum("bklhn,bhkpn->bklhp", cc, chunk_states.to(dtype))

    # Mask before exp2: for s > t the exponent is positive and could overflow
    # to inf, and inf * 0 would poison the sum with NaN.
    gh = g.permute(0, 1, 3, 2)  # [B, K, H, L]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp2((gh[..., :, None] - gh[..., None, :]).masked_fill(~causal, -math.inf))
    scores = torch.einsum("bkthn,bkshn->bkhts", cc, bc) * decay * dtc.permute(0, 1, 3, 2)[..., None, :]
    intra = torch.einsum("bkhts,bkshp->bkthp", scores, xc)

    out = (intra + inter).reshape(batch, -1, heads, head_size)[:, :tokens]
    return out + d.to(dtype)[:, None] * x.to(dtype)


def chunked_forward_reference(x, a, b, c, d, dt, init_state=None, chunk_size: int = 128,
                              dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The three chunked stages composed, all math in ``dtype``.

    Returns ``out`` [B, T, H, P] and ``final_state`` [B, H, P, N], both in ``dtype``.
    """
    g = decay_cumsum_reference(a, dt, chunk_size, dtype=dtype)
    states, final_state = chunk_states_reference(x, b, dt, g, init_state, chunk_size, dtype=dtype)
    out = chunk_output_reference(x, b, c, d, dt, g, states, chunk_size, dtype=dtype)
    return out, final_state
