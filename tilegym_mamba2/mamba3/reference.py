"""Mamba-3's scan, token by token in float64 (or the dtype asked for): the definition of the op.

Per head, with alpha_t = exp(a * dt_t) and the cumulative phase phi_t = sum_{s <= t} dt_s * angles_s:

    B~_t = R(phi_t) B_t,  C~_t = R(phi_t) C_t        (R rotates state dims 2i, 2i + 1 by phi_t[i])
    h_t = alpha_t h_{t-1} + (1 - trap_t) dt_t alpha_t x_{t-1} B~_{t-1}^T + trap_t dt_t x_t B~_t^T
    y_t = h_t C~_t + d * x_t

The first token of a sequence has no previous input (its first term is zero). ``trap`` = 1 and no
angles give Mamba-2's scan (ssd/reference/forward.py: token_recurrence). A rotation is what a
complex diagonal state would do: C~_t^T B~_s = C_t^T R(phi_s - phi_t) B_s depends on the phase
accumulated between the two tokens only.

With a rank dimension (MIMO), x is [B, T, H, R, P] and B, C are [B, T, G, R, N]: the state gains
the sum over ranks of x_r B_r^T, and each rank reads its own output y_r = h C_r + d * x_r.
"""
from __future__ import annotations

import torch

from ..core.tensors import expand_groups


def rotate_pairs(t: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """Rotates t's last dimension's pairs (2i, 2i + 1) by phase[..., i]; phase broadcasts over t."""
    even, odd = t[..., 0::2], t[..., 1::2]
    cos, sin = torch.cos(phase), torch.sin(phase)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def token_recurrence(x, dt, A, B, C, trap=None, angles=None, D=None, initial_state=None,
                     dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-3's scan in ``dtype``. Without a rank dimension: x [B, T, H, P], B, C [B, T, G, N];
    with one: x [B, T, H, R, P], B, C [B, T, G, R, N]. dt, trap [B, T, H] (trap None: 1);
    A, D [H]; angles [B, T, H, N / 2] or None; initial_state [B, H, P, N] or None.
    Returns out like x and final_state [B, H, P, N], both in ``dtype``."""
    a, b, c, d = A, B, C, D
    mimo = x.dim() == 5
    if not mimo:
        x, b, c = x.unsqueeze(3), b.unsqueeze(3), c.unsqueeze(3)
    batch, tokens, heads, _, head_size = x.shape
    x, dt, a = x.to(dtype), dt.to(dtype), a.to(dtype)
    # [B, T, G, R, N] -> [B, T, H, R, N]: expand_groups repeats dim 2 for each head of a group.
    b = expand_groups(b.to(dtype).flatten(3), heads).unflatten(3, b.shape[3:])
    c = expand_groups(c.to(dtype).flatten(3), heads).unflatten(3, c.shape[3:])
    if angles is not None:
        phase = torch.cumsum(dt[..., None] * angles.to(dtype), dim=1)[:, :, :, None, :]  # [B, T, H, 1, N/2]
        b, c = rotate_pairs(b, phase), rotate_pairs(c, phase)
    trap = torch.ones_like(dt) if trap is None else trap.to(dtype)
    state = (x.new_zeros(batch, heads, head_size, b.shape[-1]) if initial_state is None
             else initial_state.to(dtype).clone())
    outer_prev = torch.zeros_like(state)  # x_{t-1} B~_{t-1}^T summed over ranks; none before the first token
    outs = []
    for t in range(tokens):
        alpha = torch.exp(a * dt[:, t])[:, :, None, None]  # [B, H, 1, 1]
        step = dt[:, t, :, None, None]
        lam = trap[:, t, :, None, None]
        outer = torch.einsum("bhrp,bhrn->bhpn", x[:, t], b[:, t])
        state = alpha * state + (1 - lam) * step * alpha * outer_prev + lam * step * outer
        y = torch.einsum("bhpn,bhrn->bhrp", state, c[:, t])
        if d is not None:
            y = y + d.to(dtype)[:, None, None] * x[:, t]
        outs.append(y)
        outer_prev = outer
    out = torch.stack(outs, dim=1)
    return (out if mimo else out.squeeze(3)), state
