"""fwd_pass_state's reference: the state entering each chunk, by the jump formula (each chunk's own
contribution, plus the carried state decayed through it; ssd/fwd_pass_state.py computes the same)."""
from __future__ import annotations

import torch

from ...core.tensors import expand_groups
from .chunks import chunked, chunked_decay


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
